"""A oneOf whose branches exclude each other is an anyOf: the llguidance backend compiles such a
schema (llguidance itself refuses every oneOf, since it cannot check "exactly one"), and leaves
any other oneOf to be refused. Exclusion is proved only from disjoint types, disjoint listed
values, or a discriminator property; anything else counts as overlapping."""

from __future__ import annotations

import json

import pytest
from matcher_helpers import _feed, _ids

from radixlm.runtime.constrained.grammar import GrammarConfig
from radixlm.runtime.constrained.llguidance_backend import prepare_schema
from radixlm.runtime.constrained.registry import GRAMMAR_BACKENDS
from radixlm.runtime.constrained.schema_check import exclude_each_other

CAT = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
       "required": ["kind", "lives"]}
DOG = {"type": "object", "properties": {"kind": {"enum": ["dog", "wolf"]}, "bark": {"type": "string"}},
       "required": ["kind"]}
PETS = {"$defs": {"cat": CAT, "dog": DOG}, "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]}


@pytest.mark.parametrize(("a", "b", "exclusive"), [
    ({"type": "string"}, {"type": ["integer", "null"]}, True),
    ({"type": "number"}, {"type": "integer"}, False),  # 3 is both
    ({"const": 1}, {"enum": [2, "1"]}, True),
    ({"const": 1}, {"enum": [1.0]}, False),  # equal to a validator
    ({"enum": ["a", 2]}, {"type": "boolean"}, True),
    (CAT, DOG, True),  # the required "kind" is "cat" in one, "dog"/"wolf" in the other
    ({"type": "object", "properties": {"kind": {"const": "a"}}},
     {"type": "object", "properties": {"kind": {"const": "b"}}}, False),  # {} fits both
    ({"minimum": 5}, {"maximum": 3}, False),  # disjoint, but not proved: counted as overlapping
    (False, {}, True),
])
def test_exclusion_is_proved_or_refused(a, b, exclusive):
    assert exclude_each_other(a, b, {}) is exclusive
    assert exclude_each_other(b, a, {}) is exclusive


def test_exclusive_one_of_becomes_any_of_and_others_stay():
    assert prepare_schema(PETS)["anyOf"] == PETS["oneOf"]
    overlapping = {"oneOf": [{"type": "number"}, {"type": "integer"}]}
    assert prepare_schema(overlapping) == overlapping
    nested = {"type": "object", "properties": {"pet": {"oneOf": PETS["oneOf"]}}, "$defs": PETS["$defs"]}
    assert "anyOf" in prepare_schema(nested)["properties"]["pet"]
    # a subschema with a base URI of its own: its $refs might not be the root's; left alone
    based = {"oneOf": [{"$id": "https://x/a", "type": "string"}, {"type": "integer"}]}
    assert "oneOf" in prepare_schema(based)


def test_llguidance_enforces_an_exclusive_one_of(vocab, smol_tokenizer):
    backend = GRAMMAR_BACKENDS["llguidance"](vocab, GrammarConfig(cache_size=8, json_strict=False))
    grammar = backend.compile("json_schema", json.dumps(PETS))
    stop = vocab.stop_ids[0]
    for text, ok in [('{"kind":"cat","lives":9}', True), ('{"kind":"wolf"}', True), ('{"kind":"cat"}', False),
                     ('{"kind":"cow"}', False), ('{"lives":9}', False)]:
        refused = _feed(grammar.new_matcher(), _ids(smol_tokenizer, text) + [stop])
        assert (refused is None) == ok, text
    with pytest.raises(ValueError, match="oneOf"):
        backend.compile("json_schema", json.dumps({"oneOf": [{"type": "number"}, {"type": "integer"}]}))
