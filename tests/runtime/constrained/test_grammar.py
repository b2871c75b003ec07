"""Grammar backend groundwork: tokenizer description, compile seam, matchers, bitmasks."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from matcher_helpers import _added_ids, _feed, _ids, _mask

from radixlm.runtime.constrained import (
    GRAMMAR_BACKENDS,
    GrammarConfig,
    XGrammarBackend,
    bitmask_width,
    build_tokenizer_vocab,
)
from radixlm.runtime.constrained.bitmask import allocate_bitmask, allowed_tokens, apply_bitmask_

BENCH_DIR = Path(__file__).resolve().parents[4] / "shared" / "data" / "jsonschemabench"  # beside the checkout

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "age", "tags"],
}


@pytest.fixture(scope="module")
def backends(vocab) -> dict:
    return {name: GRAMMAR_BACKENDS[name](vocab) for name in ("xgrammar", "llguidance")}


@pytest.fixture(params=["xgrammar", "llguidance"])
def backend(request, backends):
    return backends[request.param]


# --- tokenizer description ------------------------------------------------------------------


def test_vocab_marks_special_and_added_tokens(smol_tokenizer, vocab, width):
    tok = smol_tokenizer
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert vocab.vocab_size == width == len(vocab.decoded)
    assert vocab.kind == "byte_level"
    assert {im_start, im_end} <= vocab.special_ids
    assert _added_ids(tok) <= vocab.special_ids
    assert all(vocab.decoded[i] == b"" for i in vocab.special_ids)
    assert vocab.stop_ids == (tok.eos_token_id,)
    (hello,) = _ids(tok, " hello")
    assert vocab.decoded[hello] == b" hello"
    # Every other token decodes to exactly the bytes the tokenizer produces for it.
    nl = _ids(tok, "\n")
    assert b"".join(vocab.decoded[i] for i in nl) == b"\n"
    text = 'Grüße, {"a": [1, 2]}\t\u00e9\u4e2d'
    assert b"".join(vocab.decoded[i] for i in _ids(tok, text)) == text.encode()


def test_from_huggingface_leaves_special_tokens_allowed(smol_tokenizer, width):
    """Why tokenizer_info.py exists: xgrammar's own HF import (0.2.x) treats <|im_start|> as
    text, so it may appear inside a JSON string. If this ever fails, xgrammar fixed it."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(smol_tokenizer, vocab_size=width)
    assert info.special_token_ids == []
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema({"type": "string"})
    m = xgr.GrammarMatcher(compiled)
    assert m.accept_string('"ab')
    mask = xgr.allocate_token_bitmask(1, width)
    m.fill_next_token_bitmask(mask)
    im_start = smol_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start in allowed_tokens(mask[0], width)


def test_ids_past_tokenizer_vocab_are_never_allowed(smol_tokenizer, width):
    padded = width + 64
    vocab = build_tokenizer_vocab(smol_tokenizer, padded)
    assert set(range(width, padded)) <= vocab.special_ids
    g = XGrammarBackend(vocab).compile("regex", ".*")
    m = g.new_matcher()
    allowed = _mask(m, padded)
    assert not allowed & set(range(width, padded))
    assert not allowed & _added_ids(smol_tokenizer) - set(vocab.stop_ids)
    assert smol_tokenizer.eos_token_id in allowed  # ".*" may end anywhere


def test_build_vocab_rejects_bad_arguments(smol_tokenizer, width):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer_vocab(smol_tokenizer, 0)
    with pytest.raises(ValueError, match="outside the logits width"):
        build_tokenizer_vocab(smol_tokenizer, width, stop_token_ids=[width])
    with pytest.raises(ValueError, match="empty"):
        build_tokenizer_vocab(smol_tokenizer, width, stop_token_ids=[])


# --- JSON schema ----------------------------------------------------------------------------


def test_special_tokens_masked_inside_json_string(smol_tokenizer, backend, width):
    m = backend.compile("json_schema", PERSON).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, '{"name":"Al')) is None
    allowed = _mask(m, width)
    assert not allowed & _added_ids(smol_tokenizer)
    assert smol_tokenizer.eos_token_id not in allowed
    assert set(_ids(smol_tokenizer, "ice")) <= allowed
    assert len(allowed) > 1000  # almost any text may go in a string


def test_valid_instance_accepted_then_terminated(smol_tokenizer, backend, width):
    eos = smol_tokenizer.eos_token_id
    m = backend.compile("json_schema", PERSON).new_matcher()
    text = json.dumps({"name": "Ann \"A\" Lee", "age": 42, "tags": ["b", "a"]}, separators=(",", ":"))
    ids = _ids(smol_tokenizer, text)
    assert _feed(m, ids[:-1]) is None
    assert eos not in _mask(m, width)
    assert m.accept(ids[-1])
    assert not m.is_terminated()
    assert _mask(m, width) == {eos}
    assert m.accept(eos)
    assert m.is_terminated()
    assert not m.accept(ids[0])


@pytest.mark.parametrize(
    "text",
    [
        '{"name":"x","age":"3","tags":[]}',  # age is a string
        '{"name":"x","age":3,"tags":["c"]}',  # not in enum
        '{"name":"x","age":3}',  # missing required
        '{"name": "x","age":3,"tags":[]}',  # compact separators by default
        '{"age":3,"name":"x","tags":[]}',  # properties in schema order
    ],
)
def test_invalid_instance_rejected(smol_tokenizer, backend, text):
    m = backend.compile("json_schema", PERSON).new_matcher()
    ids = _ids(smol_tokenizer, text) + [smol_tokenizer.eos_token_id]
    bad = _feed(m, ids)
    assert bad is not None
    assert not m.is_terminated()


def test_rollback_restores_state(smol_tokenizer, backend, width):
    m = backend.compile("json_schema", PERSON).new_matcher()
    ids = _ids(smol_tokenizer, '{"name":"Bob","age":7')
    assert _feed(m, ids) is None
    after = _mask(m, width)
    m.rollback(3)
    assert _feed(m, ids[-3:]) is None
    assert _mask(m, width) == after
    m.rollback(0)
    with pytest.raises(ValueError):
        m.rollback(-1)


def test_forced_text(smol_tokenizer, backend):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    m = backend.compile("json_schema", schema).new_matcher()
    assert m.forced_text() == '{"name":"'
    assert m.accept(_ids(smol_tokenizer, "{")[0])
    assert m.forced_text() == '"name":"'
    m2 = backend.compile("json_schema", PERSON).new_matcher()
    assert _feed(m2, _ids(smol_tokenizer, '{"name":"x"')) is None
    assert m2.forced_text() == ',"age":'


def test_json_schema_spec_forms_and_cache(backend):
    g = backend.compile("json_schema", PERSON)
    assert backend.compile("json_schema", json.loads(json.dumps(PERSON))) is g
    assert backend.compile("json_schema", json.dumps(PERSON, indent=2)) is g
    assert backend.compile("regex", "a+") is backend.compile("regex", "a+")
    assert backend.compile("regex", "a+") is not backend.compile("regex", "a*")
    assert backend.compile("choices", ["x", "y"]) is backend.compile("choices", ("x", "y"))
    assert g.kind == "json_schema" and g.vocab_size == backend.vocab_size


def test_cache_is_bounded(vocab):
    be = XGrammarBackend(vocab, GrammarConfig(cache_size=2))
    a = be.compile("regex", "a")
    be.compile("regex", "b")
    assert be.compile("regex", "a") is a  # refreshes "a"
    be.compile("regex", "c")  # evicts "b"
    assert len(be._cache) == 2 and be.compile("regex", "a") is a


def test_pydantic_model(smol_tokenizer, backend):
    pydantic = pytest.importorskip("pydantic", reason="pydantic is not installed")
    from enum import Enum

    class Color(str, Enum):
        red = "red"
        blue = "blue"

    class Pet(pydantic.BaseModel):
        kind: str
        color: Color

    class Owner(pydantic.BaseModel):
        name: str
        pets: list[Pet]
        nickname: str | None = None

    g = backend.compile("json_schema", Owner)
    assert backend.compile("json_schema", Owner) is g
    assert backend.compile("json_schema", Owner.model_json_schema()) is g
    obj = Owner(name="Zoe", pets=[Pet(kind="cat", color=Color.red)], nickname=None)
    m = g.new_matcher()
    ids = _ids(smol_tokenizer, obj.model_dump_json()) + [smol_tokenizer.eos_token_id]
    assert _feed(m, ids) is None and m.is_terminated()
    m = g.new_matcher()
    bad = '{"name":"Zoe","pets":[{"kind":"cat","color":"green"}]}'
    assert _feed(m, _ids(smol_tokenizer, bad)) is not None


# --- regex, ebnf, choices -------------------------------------------------------------------


def test_regex(smol_tokenizer, backend):
    eos = smol_tokenizer.eos_token_id
    g = backend.compile("regex", r"\d{3}-\d{4}")
    m = g.new_matcher()
    assert _feed(m, _ids(smol_tokenizer, "555-1234") + [eos]) is None and m.is_terminated()
    assert _feed(g.new_matcher(), _ids(smol_tokenizer, "55a")) is not None
    assert _feed(g.new_matcher(), _ids(smol_tokenizer, "555-12345")) is not None
    assert backend.compile("regex", r"id-\d+").new_matcher().forced_text() == "id-"


def test_ebnf(smol_tokenizer, backend):
    ebnf = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ (("*" | "/") [0-9]+)*'
    g = backend.compile("ebnf", ebnf)
    m = g.new_matcher()
    ids = _ids(smol_tokenizer, "12+3*4-5") + [smol_tokenizer.eos_token_id]
    assert _feed(m, ids) is None and m.is_terminated()
    assert _feed(g.new_matcher(), _ids(smol_tokenizer, "1++2")) is not None


@pytest.mark.parametrize("choice", ["red", "green", "blue", "bluebird"])
def test_choices_accept_each(smol_tokenizer, backend, choice):
    g = backend.compile("choices", ["red", "green", "blue", "bluebird"])
    m = g.new_matcher()
    ids = _ids(smol_tokenizer, choice) + [smol_tokenizer.eos_token_id]
    assert _feed(m, ids) is None and m.is_terminated()


def test_choices_reject_others_and_escape(smol_tokenizer, backend):
    eos = smol_tokenizer.eos_token_id
    g = backend.compile("choices", ["red", "green"])
    for other in ["yellow", "re", "redd", "Red"]:
        assert _feed(g.new_matcher(), _ids(smol_tokenizer, other) + [eos]) is not None, other
    tricky = ['say "hi"\\n', "tab\there\nnew", "caf\u00e9", ""]
    g = backend.compile("choices", tricky)
    for c in tricky:
        m = g.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, c) + [eos]) is None and m.is_terminated(), c


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, spec, match",
    [
        ("json_schema", {"type": "foo"}, "foo"),
        ("json_schema", '{"type": ', "not valid JSON"),
        ("json_schema", 42, "dict, a JSON string or a Pydantic"),
        ("json_schema", "[1, 2]", "JSON object"),
        ("regex", "a(b", "parenthesis|unclosed group"),
        ("regex", "", "empty"),
        ("ebnf", "root ::= missing", "missing"),
        ("choices", [], "empty"),
        ("choices", "abc", "list of strings"),
        ("choices", ["a", 1], "strings"),
        ("cfg", "x", "unknown constraint kind"),
    ],
)
def test_bad_specs_raise_value_error(backend, kind, spec, match):
    with pytest.raises(ValueError, match=match) as info:
        backend.compile(kind, spec)
    assert "/project/cpp" not in str(info.value)  # engine's file:line prefix is stripped


# --- masks ----------------------------------------------------------------------------------


def test_fill_mask_numpy_row_and_apply(smol_tokenizer, backend, width):
    m = backend.compile("choices", ["yes", "no"]).new_matcher()
    row = np.zeros(bitmask_width(width), dtype=np.int32)
    assert m.fill_mask(row)
    allowed = set(allowed_tokens(torch.from_numpy(row), width))
    assert allowed and allowed <= {_ids(smol_tokenizer, w)[0] for w in ["yes", "no", "y", "n", "ye"]}

    logits = torch.randn(3, width)
    before = logits.clone()
    mask = allocate_bitmask(1, width)
    m.fill_mask(mask[0])
    apply_bitmask_(logits, mask, rows=[1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert set(finite) == allowed
    assert torch.equal(logits[1][finite], before[1][finite])


def test_unconstrained_mask_reports_no_apply(backend, width, smol_tokenizer):
    # Before anything is generated, ".*" allows every text token and EOS: fill_mask says so
    # only when truly all tokens are allowed, which the special ids prevent here.
    m = backend.compile("regex", ".*").new_matcher()
    row = allocate_bitmask(1, width)[0]
    assert m.fill_mask(row)
    assert not set(allowed_tokens(row, width)) & (_added_ids(smol_tokenizer) - {smol_tokenizer.eos_token_id})


# --- JSONSchemaBench sample -----------------------------------------------------------------


def _bench(file: str, n: int) -> list[dict]:
    path = BENCH_DIR / f"{file}.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is missing")
    with path.open() as f:
        return [json.loads(line) for line in itertools.islice(f, n)]


def test_bench_glaive_first_20_compile_and_accept(smol_tokenizer, backend):
    """The first 20 Glaive schemas compile, and their first valid instance (compact, in the
    file's key order) is accepted token by token and ends terminated."""
    eos = smol_tokenizer.eos_token_id
    checked = 0
    for row in _bench("Glaiveai2K", 20):
        g = backend.compile("json_schema", row["schema"])
        valid = [t["data"] for t in row["tests"] if t["valid"]]
        if not valid:
            continue
        text = json.dumps(valid[0], separators=(",", ":"), ensure_ascii=False)
        m = g.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, text) + [eos]) is None, (row["name"], text)
        assert m.is_terminated()
        checked += 1
    assert checked >= 15


def test_bench_handwritten_compile_or_value_error(backend):
    """Hand-written edge-case schemas: each compiles or fails with ValueError, nothing else."""
    outcomes = {"ok": 0, "error": 0}
    for row in _bench("Handwritten", 20):
        try:
            backend.compile("json_schema", row["schema"])
            outcomes["ok"] += 1
        except ValueError as e:
            assert str(e).startswith("cannot compile json_schema: "), str(e)
            outcomes["error"] += 1
    assert outcomes["ok"] + outcomes["error"] == 20
    # most hand-written schemas use "not", which a grammar cannot enforce: refused by name
    assert outcomes["error"] >= 10
