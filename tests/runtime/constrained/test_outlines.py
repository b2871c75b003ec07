"""The outlines-core grammar backend, side by side with xgrammar and llguidance on the same constraints."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from matcher_helpers import _added_ids, _feed, _ids, _mask

from radixlm.runtime.constrained import GRAMMAR_BACKENDS, GrammarConfig, bitmask_width, build_tokenizer_vocab
from radixlm.runtime.constrained.bitmask import allocate_bitmask
from radixlm.runtime.constrained.outlines_backend import (
    OutlinesBackend,
    choices_to_regex,
    regex_unsupported_feature,
)

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
IPV4 = rf"({OCTET}\.){{3}}{OCTET}"

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
            "required": ["name"],
        },
        "status": {"enum": ["open", "paid", "shipped"]},
        "items": {"type": "array", "items": {"type": "string"}},
        "note": {"type": "string"},
    },
    "required": ["id", "customer", "status", "items"],
}


@pytest.fixture(scope="module")
def outlines(vocab) -> OutlinesBackend:
    return GRAMMAR_BACKENDS["outlines"](vocab)


@pytest.fixture(scope="module")
def backends(vocab, outlines) -> dict:
    return {"outlines": outlines, "xgrammar": GRAMMAR_BACKENDS["xgrammar"](vocab),
            "llguidance": GRAMMAR_BACKENDS["llguidance"](vocab)}


@pytest.fixture(params=["outlines", "xgrammar", "llguidance"])
def backend(request, backends):
    return backends[request.param]


def test_registered_under_outlines(outlines, vocab):
    assert isinstance(outlines, OutlinesBackend) and outlines.name == "outlines"
    assert outlines.vocab_size == vocab.vocab_size


# --- regex, choices -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "regex, good, bad",
    [
        (PHONE, ["(555) 123-4567", "(000) 000-0000"], ["555-123-4567", "(555) 123-456", "(555)123-4567"]),
        (DATE, ["2024-02-29", "1999-12-31"], ["2024-13-01", "2024-1-01", "2024-02-32"]),
        (IPV4, ["192.168.0.1", "255.255.255.255", "0.0.0.0"], ["256.1.1.1", "1.2.3", "01.2.3.4", "1.2.3.4."]),
    ],
)
def test_regex_accepts_and_rejects(smol_tokenizer, backend, regex, good, bad):
    eos = smol_tokenizer.eos_token_id
    g = backend.compile("regex", regex)
    for text in good:
        m = g.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, text)) is None, text
        assert m.is_completed() and not m.is_terminated()
        assert m.accept(eos) and m.is_terminated(), text
    for text in bad:
        m = g.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, text) + [eos]) is not None, text
        assert not m.is_terminated()


@pytest.mark.parametrize(
    "regex, text",
    [(r"\d+|\d+\.\d+", "1.5"), ("(a|ab)*", "abab"), ("x(blue|bluebird)", "xbluebird"), ("(|a)", "a"), ("a*?", "aa")],
)
def test_later_alternatives_not_cut_at_the_end(smol_tokenizer, backend, regex, text):
    """outlines-core's index alone refuses these (leftmost-first); the end character fixes it."""
    m = backend.compile("regex", regex).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, text) + [smol_tokenizer.eos_token_id]) is None
    assert m.is_terminated()


def test_stop_masked_mid_text_even_if_dot_allows_the_end_character(smol_tokenizer, outlines, vocab, width):
    eos = smol_tokenizer.eos_token_id
    lead = vocab.decoded.index(b"\xf4")  # the first byte of U+10FFFF, a token of its own
    m = outlines.compile("regex", "ab?").new_matcher()
    assert m.accept(_ids(smol_tokenizer, "a")[0]) and m.is_completed()
    assert lead not in _mask(m, width) and not m.accept(lead)
    m = outlines.compile("regex", "a.*b").new_matcher()
    assert m.accept(_ids(smol_tokenizer, "a")[0])
    assert eos not in _mask(m, width) and not m.is_completed() and not m.accept(eos)
    assert m.accept(_ids(smol_tokenizer, "b")[0])
    assert eos in _mask(m, width) and m.accept(eos)


def test_regex_anchors_at_the_ends_are_dropped(smol_tokenizer, outlines):
    assert outlines.compile("regex", r"^\d+$").regex == r"\d+"
    assert outlines.compile("regex", r"a\$").regex == r"a\$"
    m = outlines.compile("regex", r"^\d+$").new_matcher()
    assert _feed(m, _ids(smol_tokenizer, "42") + [smol_tokenizer.eos_token_id]) is None


@pytest.mark.parametrize("choice", ["red", "green", "blue", "bluebird", ""])
def test_choices_accept_each(smol_tokenizer, outlines, choice):
    g = outlines.compile("choices", ["red", "green", "blue", "bluebird", ""])
    m = g.new_matcher()
    assert _feed(m, _ids(smol_tokenizer, choice) + [smol_tokenizer.eos_token_id]) is None
    assert m.is_terminated()


def test_choices_reject_others_and_escape(smol_tokenizer, outlines):
    eos = smol_tokenizer.eos_token_id
    g = outlines.compile("choices", ["red", "green"])
    for other in ["yellow", "re", "redd", "Red"]:
        assert _feed(g.new_matcher(), _ids(smol_tokenizer, other) + [eos]) is not None, other
    tricky = ['say "hi"\\n', "tab\there\nnew", "a.b*c+(d)|[e]{2}^$?", "caf\u00e9 \u4e2d"]
    g = outlines.compile("choices", tricky)
    for c in tricky:
        m = g.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, c) + [eos]) is None and m.is_terminated(), c
    assert _feed(g.new_matcher(), _ids(smol_tokenizer, "a.b*c+(d)|[e]{2}^$") + [eos]) is not None
    assert choices_to_regex(("a.b", "\x01")) == r"(a\.b|\x01)"


# --- JSON schema ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        {"id": 1, "customer": {"name": "Ann"}, "status": "open", "items": []},
        {"id": -7, "customer": {"name": "B \"Q\"", "vip": True}, "status": "paid", "items": ["x", "y"],
         "note": "n\u00e9"},
    ],
)
def test_json_valid_accepted(smol_tokenizer, backend, obj):
    m = backend.compile("json_schema", ORDER).new_matcher()
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    assert _feed(m, _ids(smol_tokenizer, text) + [smol_tokenizer.eos_token_id]) is None, text
    assert m.is_terminated()


@pytest.mark.parametrize(
    "text",
    [
        '{"id":1,"customer":{"name":"A"},"status":"lost","items":[]}',  # not in the enum
        '{"id":1,"customer":{"vip":true},"status":"open","items":[]}',  # nested required missing
        '{"id":1,"customer":{"name":"A"},"status":"open","items":[1]}',  # item type
        '{"id":1.5,"customer":{"name":"A"},"status":"open","items":[]}',  # not an integer
        '{"id":1,"customer":{"name":"A"},"status":"open"}',  # items missing
        '{"id": 1,"customer":{"name":"A"},"status":"open","items":[]}',  # compact separators
    ],
)
def test_json_invalid_rejected(smol_tokenizer, backend, text):
    m = backend.compile("json_schema", ORDER).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, text) + [smol_tokenizer.eos_token_id]) is not None
    assert not m.is_terminated()


def test_unnamed_property_refused_in_strict_mode(smol_tokenizer, backend):
    """ORDER does not say ``additionalProperties``: strict mode (generation's; xgrammar's and
    llguidance's) and outlines refuse a property it never names."""
    text = '{"id":1,"customer":{"name":"A"},"status":"open","items":[],"x":1}'
    m = backend.compile("json_schema", ORDER).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, text) + [smol_tokenizer.eos_token_id]) is not None
    assert not m.is_terminated()


def test_json_spaced_separators_are_allowed_not_required(smol_tokenizer, vocab):
    be = OutlinesBackend(vocab, GrammarConfig(json_separators=(", ", ": ")))
    g = be.compile("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                   "required": ["a", "b"]})
    for text in ['{"a": 1, "b": 2}', '{"a":1,"b":2}']:
        m = g.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, text) + [smol_tokenizer.eos_token_id]) is None, text
    with pytest.raises(ValueError, match="separators"):
        OutlinesBackend(vocab, GrammarConfig(json_separators=(";", "=")))


def test_pydantic_model(smol_tokenizer, outlines):
    pydantic = pytest.importorskip("pydantic", reason="pydantic is not installed")

    class Point(pydantic.BaseModel):
        x: int
        y: int
        label: str | None = None

    g = outlines.compile("json_schema", Point)
    assert outlines.compile("json_schema", Point.model_json_schema()) is g
    m = g.new_matcher()
    text = Point(x=1, y=-2, label="p").model_dump_json()
    assert _feed(m, _ids(smol_tokenizer, text) + [smol_tokenizer.eos_token_id]) is None and m.is_terminated()


# --- masks ----------------------------------------------------------------------------------


def test_special_tokens_never_allowed_in_a_string(smol_tokenizer, outlines, width):
    m = outlines.compile("json_schema", ORDER).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, '{"id":1,"customer":{"name":"Al')) is None
    allowed = _mask(m, width)
    im_start = smol_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in allowed
    assert not allowed & _added_ids(smol_tokenizer)
    assert set(_ids(smol_tokenizer, "ice")) <= allowed
    assert len(allowed) > 1000


def test_mask_agrees_with_accept_and_xgrammar(smol_tokenizer, backends, vocab, width):
    """At each step of a valid text, both backends allow the same tokens, and a token is in
    the outlines mask exactly when the outlines matcher accepts it."""
    text = '{"id":12,"customer":{"name":"Zo","vip":false},"status":"shipped","items":["a"]}'
    ids = _ids(smol_tokenizer, text) + [smol_tokenizer.eos_token_id]
    om = backends["outlines"].compile("json_schema", ORDER).new_matcher()
    xm = backends["xgrammar"].compile("json_schema", ORDER).new_matcher()
    probe = sorted(set(ids) | set(range(0, width, 97)))
    # outlines-core's JSON strings leave out U+007F..U+009F, and U+100000.. (byte 0xF4) is
    # reserved for the end character (see outlines_backend.py); xgrammar allows both.
    differ = set(_ids(smol_tokenizer, "\x7f")) | {i for i, b in enumerate(vocab.decoded) if b"\xf4" in b}
    assert differ
    for t in ids:
        allowed = _mask(om, width)
        assert allowed - differ == _mask(xm, width) - differ
        for p in probe:
            ok = om.accept(p)
            assert ok == (p in allowed), p
            if ok:
                om.rollback(1)
        assert om.accept(t) and xm.accept(t)
    assert om.is_terminated() and xm.is_terminated()


def test_eos_only_where_complete_and_every_stop_id(smol_tokenizer, width):
    im_end, endoftext = smol_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    vocab = build_tokenizer_vocab(smol_tokenizer, width, stop_token_ids=[im_end, endoftext])
    g = OutlinesBackend(vocab).compile("regex", r"\d+")
    m = g.new_matcher()
    assert not _mask(m, width) & {im_end, endoftext}
    assert not m.accept(endoftext)
    assert m.accept(_ids(smol_tokenizer, "7")[0])
    assert {im_end, endoftext} <= _mask(m, width)
    assert m.accept(endoftext) and m.is_terminated()
    assert _mask(m, width) == {im_end, endoftext}
    assert not m.accept(_ids(smol_tokenizer, "7")[0])


def test_ids_past_tokenizer_vocab_never_allowed(smol_tokenizer, width):
    padded = width + 64
    vocab = build_tokenizer_vocab(smol_tokenizer, padded)
    m = OutlinesBackend(vocab).compile("regex", ".*").new_matcher()
    allowed = _mask(m, padded)
    assert not allowed & set(range(width, padded))
    assert smol_tokenizer.eos_token_id in allowed
    assert not m.accept(width + 1)


def test_fill_mask_rows_numpy_torch_and_bad(outlines, width):
    m = outlines.compile("choices", ["yes", "no"]).new_matcher()
    row = np.zeros(bitmask_width(width), dtype=np.int32)
    assert m.fill_mask(row)
    t = allocate_bitmask(1, width)[0]
    assert m.fill_mask(t)
    assert np.array_equal(row, t.numpy())
    with pytest.raises(ValueError, match="int32"):
        m.fill_mask(np.zeros(bitmask_width(width), dtype=np.int64))
    with pytest.raises(ValueError, match="contiguous"):
        m.fill_mask(torch.zeros(2 * bitmask_width(width), dtype=torch.int32)[::2])


# --- rollback, forced text ------------------------------------------------------------------


def test_rollback_restores_state(smol_tokenizer, outlines, width):
    m = outlines.compile("json_schema", ORDER).new_matcher()
    ids = _ids(smol_tokenizer, '{"id":3,"customer":{"name":"Bo"}')
    assert _feed(m, ids) is None
    after_mask, after_forced = _mask(m, width), m.forced_text()
    m.rollback(4)
    assert _feed(m, ids[-4:]) is None
    assert _mask(m, width) == after_mask and m.forced_text() == after_forced == ',"status":"'
    m.rollback(len(ids))
    assert m.forced_text() == '{"id":'
    m.rollback(0)
    with pytest.raises(ValueError):
        m.rollback(-1)
    with pytest.raises(ValueError, match="only 0"):
        m.rollback(1)


def test_rollback_undoes_termination(smol_tokenizer, outlines):
    eos = smol_tokenizer.eos_token_id
    m = outlines.compile("regex", r"ab?").new_matcher()
    assert m.accept(_ids(smol_tokenizer, "a")[0]) and m.accept(eos) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and m.is_completed()
    assert m.accept(_ids(smol_tokenizer, "b")[0]) and m.accept(eos)


@pytest.mark.parametrize(
    "kind, spec, prefix, forced",
    [
        ("json_schema", {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
         '{"', 'name":"'),
        ("json_schema", ORDER, "", '{"id":'),
        ("json_schema", ORDER, '{"id":5', ""),  # another digit, or ","
        ("json_schema", ORDER, '{"id":5,', '"customer":{"name":"'),
        ("json_schema", ORDER, '{"id":5,"customer":{"name":"x"}', ',"status":"'),
        ("json_schema", ORDER, '{"id":5,"customer":{"name":"x"},"status":"s', 'hipped","items":['),
        ("regex", r"id-\d+", "", "id-"),
        ("regex", DATE, "2024-1", ""),
        ("regex", DATE, "2024", "-"),
        ("choices", ["bluebird", "blueberry"], "", "blueb"),
        ("choices", ["bluebird", "blueberry"], "bluebi", "rd"),
    ],
)
def test_forced_text_same_on_both_backends(smol_tokenizer, backend, kind, spec, prefix, forced):
    m = backend.compile(kind, spec).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, prefix)) is None
    assert m.forced_text() == forced


def test_forced_text_waits_for_a_split_character(smol_tokenizer, outlines):
    ids = _ids(smol_tokenizer, "\U0001d11e")  # three tokens, each a part of one UTF-8 character
    assert len(ids) == 3
    m = outlines.compile("choices", ["\U0001d11e and more"]).new_matcher()
    assert m.forced_text() == "\U0001d11e and more"
    assert m.accept(ids[0]) and m.forced_text() == ""
    assert m.accept(ids[1]) and m.forced_text() == ""
    assert m.accept(ids[2]) and m.forced_text() == " and more"
    m.rollback(2)
    assert m.forced_text() == ""
    m.rollback(1)
    assert m.forced_text() == "\U0001d11e and more"


def test_no_character_fsm_means_no_forced_text(smol_tokenizer, outlines):
    # interegular cannot read \p{..} classes: the grammar still masks, it just never jumps.
    g = outlines.compile("regex", r"ab\p{L}")
    assert g.char_fsm is None and "interegular" in g.char_fsm_error
    m = g.new_matcher()
    assert m.forced_text() == ""
    assert _feed(m, _ids(smol_tokenizer, "abé") + [smol_tokenizer.eos_token_id]) is None


# --- errors, cache --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, spec, match",
    [
        ("ebnf", "root ::= \"a\"", "ebnf needs the xgrammar backend"),
        ("regex", "a(?=b)", "lookahead"),
        ("regex", r"(a)\1", "backreferences"),
        ("regex", r"\bword", "word boundaries"),
        ("regex", "a^b", "anchors"),
        ("regex", "a(b", "cannot compile regex"),
        ("json_schema", {"type": "string", "format": "hostname"}, "hostname"),
        ("json_schema", {"type": "foo"}, "foo"),
        ("json_schema", {"type": "string", "pattern": "(?<=a)b"}, "lookbehind"),
        ("choices", [], "empty"),
    ],
)
def test_bad_specs_raise_value_error(outlines, kind, spec, match):
    with pytest.raises(ValueError, match=match):
        outlines.compile(kind, spec)


@pytest.mark.parametrize(
    "regex, feature",
    [
        (r"^\d+$", None),
        (r"[$^]\$\^", None),
        (r"[\]^](?:x)\++", None),
        (r"a*+", "possessive"),
        (r"(?!x)", "lookahead"),
        (r"(?<!x)y", "lookbehind"),
        (r"(?P<n>a)(?P=n)", "backreferences"),
        (r"\Aab", "anchors"),
        (r"a|^b", "anchors"),
        (r"(?>ab)", "atomic"),
        (r"[\b]", None),
    ],
)
def test_regex_unsupported_feature(regex, feature):
    found = regex_unsupported_feature(regex)
    assert (found is None) if feature is None else (feature in found)


def test_cache_shared_and_thread_safe(vocab):
    be = OutlinesBackend(vocab, GrammarConfig(cache_size=2))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: be.compile("json_schema", ORDER), range(8)))
    assert all(g is got[0] for g in got)
    assert be.compile("json_schema", json.dumps(ORDER, indent=2)) is got[0]
    a = be.compile("regex", "a")
    be.compile("regex", "b")  # evicts the schema
    assert be.compile("regex", "a") is a and len(be._cache) == 2
