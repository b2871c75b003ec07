"""SGLang's structural_tag: its two shapes normalized and checked (radixlm/runtime/constrained/
structural_tag.py), enforced by llguidance (lazy triggers) and xgrammar (native), refused by outlines."""

from __future__ import annotations

import json

import pytest
from matcher_helpers import _feed, _ids

from radixlm.runtime.constrained import GRAMMAR_BACKENDS
from radixlm.runtime.constrained.structural_tag import normalize, parse

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"], "additionalProperties": False}
TAG = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
    {"begin": "<function=search>", "schema": SEARCH, "end": "</function>"}]}
FORMAT = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
    {"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
     "end": s["end"]} for s in TAG["structures"]]}}
TEXTS = [
    ("Hello there, no tools needed.", True),
    ('Sure. <function=get_weather>{"city":"Paris"}</function> Anything else?', True),
    ('<function=search>{"q":"x"}</function><function=get_weather>{"city":"Oslo"}</function>', True),
    ('Sure. <function=get_weather>{"q":"x"}</function>', False),  # the other structure's schema
    ('Sure. <function=get_weather>{"city":"Llanfairpwllgwyngyll"}</function>', False),  # maxLength
    ("Sure. <function=nope>{}", False),  # a trigger must go on into a begin
    ('a <function=get_weather>{"city":"P"} and more', False),  # the end must follow
]


def test_both_shapes_normalize_alike():
    assert normalize(TAG) == normalize(json.dumps(FORMAT)) == normalize(json.dumps(TAG))
    structures, triggers = parse(TAG)
    assert [s.begin for s in structures] == ["<function=get_weather>", "<function=search>"] and triggers == ["<function="]
    assert parse({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]})[0][0].schema == {}


@pytest.mark.parametrize(("spec", "what"), [
    ("[", "not valid JSON"),
    ({"type": "json_schema"}, "type must be 'structural_tag'"),
    ({"structures": [], "triggers": ["<"]}, "structures must be a non-empty list"),
    ({"structures": [{"begin": "", "schema": {}, "end": ""}], "triggers": ["<"]}, "begin must be a non-empty"),
    ({"structures": [{"begin": "<a>", "schema": 3, "end": ""}], "triggers": ["<a"]}, "schema must be a JSON schema"),
    ({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": []}, "non-empty list of non-empty"),
    ({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": ["<b"]}, "must start with a trigger"),
    ({"structures": [{"begin": "<a>", "schema": {}, "end": ""}], "triggers": ["<", "<a"]}, "prefix of"),
    ({"structures": [{"begin": "<a>", "schema": {}, "end": "", "x": 1}], "triggers": ["<a"]}, "begin, schema and end"),
    ({"format": {"type": "sequence", "elements": []}}, "'sequence' is not supported"),
    ({"format": {**FORMAT["format"], "at_least_one": True}}, "at_least_one is not supported"),
])
def test_bad_tags_say_what_is_wrong(spec, what):
    with pytest.raises(ValueError, match=what):
        normalize(spec)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_free_text_outside_and_the_schema_inside(backend, vocab, smol_tokenizer):
    if backend not in GRAMMAR_BACKENDS:
        pytest.skip(f"{backend} is not installed")
    grammar = GRAMMAR_BACKENDS[backend](vocab).compile("structural_tag", json.dumps(TAG))
    for text, ok in TEXTS:
        m = grammar.new_matcher()
        rejected = _feed(m, _ids(smol_tokenizer, text))
        assert (rejected is None) == ok, (backend, text)
        if ok:
            assert m.is_completed(), text  # free text may end anywhere outside a tag


def test_llguidance_forces_the_rest_of_a_unique_begin(vocab, smol_tokenizer):
    grammar = GRAMMAR_BACKENDS["llguidance"](vocab).compile("structural_tag", json.dumps(TAG))
    m = grammar.new_matcher()
    assert _feed(m, _ids(smol_tokenizer, "Sure. <function=get_w")) is None
    assert m.forced_text().startswith('eather>{"city":"')


def test_outlines_refuses_naming_itself(vocab):
    if "outlines" not in GRAMMAR_BACKENDS:
        pytest.skip("outlines is not installed")
    with pytest.raises(ValueError, match="outlines grammar backend cannot enforce it"):
        GRAMMAR_BACKENDS["outlines"](vocab).compile("structural_tag", json.dumps(TAG))
