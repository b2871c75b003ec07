"""Schema constructs xgrammar only approximates: refused by name, or rewritten into an equal or
narrower schema it enforces; outputs generated under what compiles validate with jsonschema."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from matcher_helpers import _feed, _ids, _mask

from radixlm.runtime.constrained import GRAMMAR_BACKENDS, bitmask_width
from radixlm.runtime.constrained.schema_check import UnsupportedSchema, prepare_json_schema

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "jsonschemabench.py"

OBJ = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}


@pytest.fixture(scope="module")
def backend(vocab):
    return GRAMMAR_BACKENDS["xgrammar"](vocab)


@pytest.mark.parametrize("schema, named", [
    ({"not": {"type": "null"}}, "the keyword 'not'"),
    ({"type": "array", "uniqueItems": True}, "the keyword 'uniqueItems'"),
    ({"type": "array", "if": {"minItems": 1}, "then": {"minItems": 2}}, "the keyword 'if'"),
    ({**OBJ, "dependentRequired": {"a": ["b"]}}, "the keyword 'dependentRequired'"),
    ({**OBJ, "dependencies": {"a": ["b"]}}, "the keyword 'dependencies'"),
    ({"type": "array", "contains": {"const": 5}}, "the keyword 'contains'"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' whose branches 0 and 1 may both match"),
    ({**OBJ, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, "'oneOf' whose branches 0 and 1"),
    ({"type": "string", "pattern": "^a[b-z]+$", "maxLength": 3}, "maxLength together with 'pattern'"),
    ({"type": "string", "format": "date", "minLength": 3}, "minLength together with 'format'"),
    ({"type": "string", "pattern": "^(?!a)[a-z]+$"}, "lookaround assertions"),
    ({"type": "string", "pattern": "a^b"}, "'^' or '$' inside the pattern"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' on a number"),
    ({"type": "integer", "multipleOf": 3, "minimum": 1}, "'multipleOf' together with minimum"),
    # (at the root such a schema lists all its values: finite_schema compiles it as {"enum": ["ab"]})
    ({"type": "object", "properties": {"s": {"type": "string", "enum": ["ab", "c"], "minLength": 2}}},
     "'enum'/'const' next to minLength"),
    ({"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": {"type": "integer"}},
     "'patternProperties' together with 'additionalProperties'"),
    ({"type": "object", "properties": {"xa": {"type": "string"}}, "patternProperties": {"^x": {"minLength": 3}}},
     "property 'xa' also matches patternProperties"),
    ({"type": "object", "additionalProperties": True, "minProperties": 2}, "'minProperties' beyond"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "allOf": [{"properties": {"a": {"pattern": "x"}}},
                                                                           {"properties": {"a": {"pattern": "y"}}}]},
     "could not be merged into one schema (both give 'pattern')"),
    ({"type": "string", "const": 1}, "no 'enum'/'const' value matches 'type': no value is valid"),
    ({"type": "string", "pattern": "^1\\.2(-[a-z]+)?$"}, "a repeated or optional group holding a repeat"),
    ({"type": "object", "patternProperties": {"^.{1,9}$": {}}}, "'.' in a key pattern"),
    ({"definitions": {"n": {"id": "#n", "type": "integer"}}, "type": "array", "items": {"$ref": "#n"}},
     "'$ref' '#n' is not supported"),
])
def test_refused_by_name(backend, schema, named):
    with pytest.raises(UnsupportedSchema, match=None) as info:
        prepare_json_schema(schema)
    assert named in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="cannot compile json_schema: "):
        backend.compile("json_schema", schema)


def test_refusal_names_where():
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}},
              "$defs": {"n": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(UnsupportedSchema, match=r"'uniqueItems'.*\(at /\$defs/n\)"):
        prepare_json_schema(schema)
    # only what a validator reaches counts: an unreferenced definition is not looked at
    assert prepare_json_schema({"type": "integer", "$defs": {"n": {"not": {}}}}) == {
        "type": "integer", "$defs": {"n": {"not": {}}}}


def test_rewrites_only_narrow():
    # keywords of one type without "type": xgrammar would accept any value there
    assert prepare_json_schema({"minLength": 2})["type"] == "string"
    assert prepare_json_schema({"minimum": 1, "maxLength": 3})["type"] == ["number", "string"]
    # enum values that cannot match "type" are dropped (xgrammar emits them regardless)
    assert prepare_json_schema({"type": "string", "enum": ["a", 1, None]})["enum"] == ["a"]
    # a oneOf whose branches exclude each other is an anyOf
    union = {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                       {"type": "object", "properties": {"k": {"const": "b"}, "x": {}}, "required": ["k"]}]}
    assert list(prepare_json_schema(union)) == ["anyOf"]
    # keywords beside anyOf are merged into each branch
    got = prepare_json_schema({**OBJ, "required": ["a"], "anyOf": [{"properties": {"b": {"minimum": 3}}}, {}]})
    assert got["anyOf"][0]["properties"]["b"] == {"type": "integer", "minimum": 3}
    assert all(br["required"] == ["a"] for br in got["anyOf"])
    # ... and beside a $ref, which is inlined
    got = prepare_json_schema({"$ref": "#/$defs/o", "required": ["a"], "$defs": {"o": OBJ}})
    assert got["required"] == ["a"] and got["properties"] == OBJ["properties"]
    # a required property the schema does not list gets the additionalProperties schema
    got = prepare_json_schema({"type": "object", "required": ["z"], "additionalProperties": {"type": "null"}})
    assert got["properties"] == {"z": {"type": "null"}}
    # a length beside a pattern of one repeated character class goes into the repeat count
    got = prepare_json_schema({"type": "string", "pattern": "[0-9a-f]+", "minLength": 2, "maxLength": 4})
    assert got == {"type": "string", "pattern": "^[0-9a-f]{2,4}$"}
    # a format beside a pattern is dropped: xgrammar would enforce the format instead
    assert prepare_json_schema({"type": "string", "format": "uri", "pattern": "^https?://"}) == {
        "type": "string", "pattern": "^https?://"}
    # an optional property no value fits is left out
    got = prepare_json_schema({"type": "object", "properties": {"a": {"type": "object", "enum": ["x"]}, "b": {}}})
    assert list(got["properties"]) == ["b"]


def test_input_is_not_modified():
    schema = {"oneOf": [{"type": "string"}, {"type": "null"}], "$defs": {}}
    before = json.dumps(schema)
    prepare_json_schema(schema)
    assert json.dumps(schema) == before


def test_recursive_ref_with_siblings_is_refused_not_looping():
    schema = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n", "required": ["c"]}}}},
              "$ref": "#/$defs/n"}
    try:
        prepare_json_schema(schema)
    except UnsupportedSchema as e:
        assert "does not end" in str(e) or "nests too deeply" in str(e)


# The outputs that broke their schemas in the 2026-11-22 generation run (before these rules),
# with the cause: each is now refused, or its grammar refuses that output.
BROKEN_BEFORE = [
    # anyOf next to properties/required: branches compiled alone, "ast" was never required
    ({"type": "object", "properties": {"ast": {"type": "string"}, "type": {"enum": ["RULE", "STRING"]}},
      "required": ["ast", "type"], "anyOf": [{"properties": {"type": {"enum": ["STRING"]}}}]},
     '{"type":"STRING"}'),
    # $ref next to required: "power" was never required
    ({"$ref": "#/definitions/l", "definitions": {"l": {"type": "object", "properties": {
        "power": {"enum": ["on", "off"]}, "r": {"type": "string"}}}}, "required": ["power"]},
     '{"r":"x"}'),
]


@pytest.mark.parametrize("schema, output", BROKEN_BEFORE)
def test_outputs_that_broke_before_are_refused_now(backend, smol_tokenizer, schema, output):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(output), schema)
    m = backend.compile("json_schema", schema).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, output) + [smol_tokenizer.eos_token_id]) is not None


def test_surrogates_never_generated(backend, vocab, width):
    # xgrammar takes ED A0..BF (a UTF-8-encoded surrogate, not UTF-8); the text would decode to
    # U+FFFD per byte and break a maxLength. Banned inside a token and across two tokens.
    lone_ed = next(t for t, b in enumerate(vocab.decoded) if b == b"\xed")
    cont = next(t for t, b in enumerate(vocab.decoded) if b == b"\xb4")
    ok_cont = next(t for t, b in enumerate(vocab.decoded) if b == b"\x9f")
    for kind, spec, opening in (("json_schema", {"type": "string", "maxLength": 3}, b'"'), ("regex", ".*", None)):
        m = backend.compile(kind, spec).new_matcher()
        if opening is not None:
            assert m.accept(vocab.decoded.index(opening))
        assert m.accept(lone_ed)
        assert cont not in _mask(m, width) and not m.accept(cont)
        assert ok_cont in _mask(m, width) and m.accept(ok_cont)  # ED 9F .. is U+D7C0..: fine
        m.rollback(2)
        assert m.accept(lone_ed) and not m.accept(cont)


def test_raw_control_characters_never_allowed_in_json(backend, smol_tokenizer, width):
    # xgrammar's length-limited string lets a raw tab through; JSON forbids it.
    m = backend.compile("json_schema", {"type": "string", "maxLength": 5}).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, '"')) is None
    (tab,) = _ids(smol_tokenizer, "\t")
    assert tab not in _mask(m, width)
    assert not m.accept(tab)
    assert _feed(m, _ids(smol_tokenizer, 'ab"')) is None  # other text still goes through
    # regexes keep their tabs
    r = backend.compile("regex", "a\tb").new_matcher()
    assert _feed(r, _ids(smol_tokenizer, "a\tb")) is None


@pytest.fixture(scope="module")
def jsb():
    spec = importlib.util.spec_from_file_location("jsonschemabench_walks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


WALKED = [
    {**OBJ, "required": ["a"], "anyOf": [{"properties": {"b": {"minimum": 3, "maximum": 40}}, "required": ["b"]},
                                         {"properties": {"a": {"enum": ["x", "y"]}}}]},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["k", "n"]},
               {"type": "object", "properties": {"k": {"const": "b"}, "s": {"type": "string", "maxLength": 3}},
                "required": ["k"]}]},
    {"type": "object", "properties": {"p": {"type": "string", "pattern": "^[a-c]+x$"},
                                      "q": {"type": "string", "pattern": "^[^a]*$", "minLength": 2, "maxLength": 3}},
     "required": ["p", "q"],
     "additionalProperties": {"type": "boolean"}, "maxProperties": 3},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number", "minimum": 1.5},
                                                       "minItems": 1, "maxItems": 3}}},
               {"required": ["a"]}]},
]


@pytest.mark.parametrize("schema", WALKED)
def test_random_walk_outputs_validate(jsb, backend, schema):
    """Random tokens from the grammar's mask (no model), stopped where allowed: every finished
    output validates against the schema as written."""
    res = jsb.SchemaResult(file="t", name=json.dumps(schema), backend="xgrammar")
    row = np.zeros(bitmask_width(backend.vocab_size), dtype=np.int32)
    decoded = list(backend.vocab.decoded)
    grammar = backend.compile("json_schema", schema)
    jsb.validate_walks(res, grammar, schema, decoded, backend.vocab.stop_ids[0], 12,
                       jsb.structural_tokens(decoded), row)
    assert res.walks_finished >= 6, res
    assert res.walks_valid == res.walks_finished, res.failures
