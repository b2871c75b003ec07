"""What llguidance refuses, written as what it means before it compiles (prepare_schema):

- a oneOf whose branches exclude each other is an anyOf (llguidance refuses every oneOf, since it
  cannot check "exactly one"); exclusion is proved only from disjoint types, disjoint listed
  values, or a discriminator property; anything else counts as overlapping;
- an object's oneOf of required-key groups is "one group's keys all present, and of every other
  group one key absent";
- dependencies / dependentRequired / dependentSchemas are "the key absent, or what it needs".

Each compiles and enforces exactly the validator's set, in strict (generation) mode too."""

from __future__ import annotations

import json

import jsonschema
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


SHAPE = {"type": "object", "properties": {"radius": {"type": "number"}, "length": {"type": "number"},
                                          "width": {"type": "number"}},
         "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}]}
_PAY = {"card": {"type": "string"}, "billing": {"type": "string"}, "gift": {"type": "boolean"}}
ORDER_7 = {"type": "object", "properties": _PAY, "dependencies": {"card": ["billing"], "gift": {"required": ["card"]}}}
ORDER_2020 = {"type": "object", "properties": _PAY, "dependentRequired": {"card": ["billing"]},
              "dependentSchemas": {"gift": {"required": ["card"]}}}
_ORDERS = [("{}", True), ('{"card":"x","billing":"y"}', True), ('{"card":"x"}', False), ('{"gift":true}', False),
           ('{"card":"x","billing":"y","gift":true}', True), ('{"billing":"y"}', True)]
D7, D2020 = jsonschema.Draft7Validator, jsonschema.Draft202012Validator
CASES = {  # schema, the draft that reads it, texts and whether they are valid
    "shape": (SHAPE, D2020, [('{"radius":1}', True), ('{"length":1,"width":2}', True), ('{"length":1}', False),
                             ('{"radius":1,"length":1,"width":2}', False), ('{"radius":1,"length":1}', True),
                             ("{}", False)]),
    "dependencies": (ORDER_7, D7, _ORDERS),
    "dependentRequired": (ORDER_2020, D2020, _ORDERS),
}


@pytest.mark.parametrize("strict", [False, True], ids=["validator", "strict"])
@pytest.mark.parametrize("case", list(CASES))
def test_key_groups_and_dependencies_compile_exactly(case, strict, vocab, smol_tokenizer):
    schema, draft, texts = CASES[case]
    for text, ok in texts:  # the expectations are the validator's
        assert draft(schema).is_valid(json.loads(text)) is ok, text
    prepared = prepare_schema(schema)
    assert not {"oneOf", "dependencies", "dependentRequired", "dependentSchemas"} & prepared.keys()
    backend = GRAMMAR_BACKENDS["llguidance"](vocab, GrammarConfig(cache_size=8, json_strict=strict))
    grammar = backend.compile("json_schema", json.dumps(schema))
    stop = vocab.stop_ids[0]
    for text, ok in texts:
        if strict and not ok:
            continue  # strict mode refuses more (keys in its own order): what it refuses is no check
        refused = _feed(grammar.new_matcher(), _ids(smol_tokenizer, text) + [stop])
        assert (refused is None) == ok, (text, strict)


def test_a_oneof_of_key_groups_needs_an_object_schema():
    """Without "type": "object", a string would match every group (required ignores it) and so
    fail the oneOf; the rewrite would let it through, so it is not made."""
    loose = {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}
    assert prepare_schema(loose) == loose


def test_a_oneof_of_many_branches_is_left_as_it_is():
    """Branches are compared pairwise (and key groups written out pairwise): past 32 a hostile
    schema would cost quadratic time and size, so llguidance refuses it as before."""
    many = {"oneOf": [{"const": i} for i in range(33)]}
    assert prepare_schema(many) == many
    few = {"oneOf": [{"const": i} for i in range(32)]}
    assert "anyOf" in prepare_schema(few)


def test_a_hostile_discriminator_chain_is_cut_short():
    """Branches whose required properties all point back at the root: proving exclusion would
    recurse through every property at every level; a budget shared by the schema's comparisons
    ends it (counted as overlapping), so the compile stays quick."""
    props = {f"p{i}": {"$ref": "#"} for i in range(40)}
    node = {"type": "object", "properties": props, "required": list(props)}
    hostile = {"oneOf": [node, dict(node)]}  # without the budget, 40 ** depth comparisons: it would not return
    assert exclude_each_other(node, dict(node), hostile) is False
    assert prepare_schema(hostile)["oneOf"]


@pytest.mark.parametrize(("schema", "texts"), [
    ({"type": "object", "properties": {"ios": {"type": "string"}, "web": {"type": "string"}},
      "not": {"required": ["ios", "web"]}},
     [('{"ios":"a"}', True), ("{}", True), ('{"ios":"a","web":"b"}', False)]),
    ({"not": {"required": ["a"]}}, [('"text"', False), ("{}", True), ('{"a":1}', False), ("3", False)]),
    ({"not": {"type": "number"}}, [('"x"', True), ("3", False), ("2.5", False), ("null", True)]),
    ({"not": {"type": ["object", "string"]}}, [("[]", True), ('"x"', False), ("{}", False), ("true", True)]),
])
def test_not_required_and_not_type_compile_exactly(schema, texts, vocab, smol_tokenizer):
    for text, ok in texts:  # the expectations are the validator's
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) is ok, text
    assert "not" not in prepare_schema(schema)
    backend = GRAMMAR_BACKENDS["llguidance"](vocab, GrammarConfig(cache_size=8, json_strict=False))
    grammar = backend.compile("json_schema", json.dumps(schema))
    for text, ok in texts:
        refused = _feed(grammar.new_matcher(), _ids(smol_tokenizer, text) + [vocab.stop_ids[0]])
        assert (refused is None) == ok, text


def test_other_nots_are_left_to_llguidance():
    for neg in ({"type": "integer"}, {"enum": ["a"]}, {"required": ["a"], "type": "object"}):
        assert prepare_schema({"not": neg})["not"] == neg
