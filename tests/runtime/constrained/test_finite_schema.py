"""Finite schemas: a schema whose values are all listed (its enum/const, an allOf branch's, every
anyOf/oneOf branch's) compiles to the enum of the listed values the whole schema accepts, decided
by a JSON Schema validator; so keywords no grammar engine enforces (not, if/then, uniqueItems)
are exact there. Then the real backends: the listed values that pass are accepted, the others
refused, and a schema that accepts none is a ValueError naming why."""

from __future__ import annotations

import json

import pytest
from matcher_helpers import _feed, _ids

from radixlm.runtime.constrained.finite_schema import finite_schema, listed_values
from radixlm.runtime.constrained.grammar import GrammarConfig
from radixlm.runtime.constrained.registry import GRAMMAR_BACKENDS

# JSONSchemaBench's Synthesized form: an enum, and a `not` no grammar engine enforces
NOT_SCHEMA = {"allOf": [{"enum": [[1, 2], [1, 1], "x", 3]}, {"not": {"uniqueItems": True, "type": "array"}}]}


def test_listed_values_bound_a_schema_or_not():
    assert listed_values({"type": "string"}) is None
    assert listed_values({"enum": [1, True, 1, {"a": 1, "b": 2}, {"b": 2, "a": 1}]}) == [1, True, {"a": 1, "b": 2}]
    assert listed_values({"const": "a", "enum": ["a", "b"]}) == ["a"]
    assert listed_values({"allOf": [{"type": "integer"}, {"enum": [1, 2]}, {"enum": [2, 3]}]}) == [2]
    assert listed_values({"anyOf": [{"const": 1}, {"enum": [2, 3]}]}) == [1, 2, 3]
    assert listed_values({"oneOf": [{"const": 1}, {"type": "string"}]}) is None  # one branch unbounded
    assert listed_values({"allOf": [False]}) == []
    assert listed_values({"allOf": [{"const": 1}, {"enum": [1.0, 2]}]}) == [1]  # 1 and 1.0 are one value


def test_the_values_the_whole_schema_accepts_become_the_enum():
    assert finite_schema(NOT_SCHEMA, 4096) == {"enum": [[1, 1], "x", 3]}
    # oneOf: a value in both branches passes neither as "exactly one"
    assert finite_schema({"oneOf": [{"enum": [1, 2]}, {"enum": [2, 3]}]}, 4096) == {"enum": [1, 3]}
    assert finite_schema({"if": {"const": 1}, "then": {"type": "string"}, "enum": [1, 2]}, 4096) == {"enum": [2]}
    assert finite_schema({"enum": ["a", "b"]}, 4096) is None  # already a plain enum
    assert finite_schema({"allOf": [{"const": 1}, {"enum": [1.0, 2]}], "type": "integer"}, 4096) == {"enum": [1]}
    assert finite_schema({"type": "object"}, 4096) is None
    assert finite_schema({"enum": list(range(10)), "minimum": 5}, 4) is None  # more listed than the limit


def test_a_schema_that_accepts_no_listed_value_is_refused():
    with pytest.raises(ValueError, match="accepts nothing"):
        finite_schema({"const": 5, "type": "string"}, 4096)


def test_a_schema_the_validator_cannot_decide_is_left_as_it_is():
    assert finite_schema({"enum": [1, 2], "$ref": "#/$defs/missing"}, 4096) is None


@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_backends_enforce_a_finite_schema_exactly(name, vocab, smol_tokenizer):
    backend = GRAMMAR_BACKENDS[name](vocab, GrammarConfig(cache_size=8))
    grammar = backend.compile("json_schema", json.dumps(NOT_SCHEMA))
    stop = vocab.stop_ids[0]
    for text, ok in [("[1,1]", True), ('"x"', True), ("3", True), ("[1,2]", False), ("4", False)]:
        m = grammar.new_matcher()
        refused = _feed(m, _ids(smol_tokenizer, text) + [stop])
        assert (refused is None) == ok, (name, text)
    with pytest.raises(ValueError, match="cannot compile json_schema: .*accepts nothing"):
        backend.compile("json_schema", json.dumps({"allOf": [{"const": "a"}, {"not": {"const": "a"}}]}))


def test_a_schema_without_a_draft_keeps_what_draft_7_and_the_newest_both_accept():
    """"dependencies" is draft 7's (2020-12 ignores it): with no $schema, both readings must hold."""
    schema = {"enum": [{"a": 1}, {"a": 1, "b": 2}], "dependencies": {"a": ["b"]}}
    assert finite_schema(schema, 4096) == {"enum": [{"a": 1, "b": 2}]}
    newest = {**schema, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert finite_schema(newest, 4096) == {"enum": [{"a": 1}, {"a": 1, "b": 2}]}


def test_a_schema_with_a_pattern_is_left_to_the_grammar_engine():
    """The validator would run ^(a+)+$ in Python's backtracking regex engine on "aaaa...!":
    exponential time in a compile thread. Such schemas are compiled as they are (the grammar
    engines' regexes run in linear time)."""
    hostile = {"enum": ["a" * 40 + "!", "b"], "pattern": "^(a+)+$"}
    assert finite_schema(hostile, 4096) is None
    keys = {"allOf": [{"enum": [{"ab": 1}, {"b": 1}]}, {"patternProperties": {"^a{1,}b+": {"type": "string"}}}]}
    assert finite_schema(keys, 4096) is None
    long_text = {"enum": ["a" * 2000 + "!"], "pattern": "a*b"}  # one quantifier, a long text: quadratic
    assert finite_schema(long_text, 4096) is None
    # no quantifier, or one against short texts: bounded time, decided
    plain = {"allOf": [{"enum": [{"ab": 1}, {"b": 1}]}, {"patternProperties": {"^ab|^c": {"type": "string"}}}]}
    assert finite_schema(plain, 4096) == {"enum": [{"b": 1}]}
    assert finite_schema({"enum": ["aab", "ba"], "pattern": "^a+b"}, 4096) == {"enum": ["aab"]}
