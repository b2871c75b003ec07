"""The llguidance grammar backend: masks against accept, stop tokens, forced text, rollback,
errors, and the schema rules it needs (radixlm/runtime/constrained/llguidance_backend.py)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from matcher_helpers import _added_ids, _feed, _ids, _mask

from radixlm.runtime.constrained import GRAMMAR_BACKENDS, GrammarConfig, bitmask_width, build_tokenizer_vocab
from radixlm.runtime.constrained.bitmask import allocate_bitmask
from radixlm.runtime.constrained.jump_forward import JumpForward
from radixlm.runtime.constrained.llguidance_backend import (
    FALLBACK_MAX_EXPRESSIONS,
    LLGuidanceBackend,
    choices_to_lark,
    close_objects,
    prepare_schema,
    refers_to_special_tokens,
)
from radixlm.runtime.constrained.pre_tokens import split_rule
from radixlm.runtime.constrained.schema_check import UnsupportedSchema

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                     "required": ["name"], "additionalProperties": False},
        "status": {"enum": ["open", "paid"]},
        "items": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["id", "customer", "status", "items"],
    "additionalProperties": False,
}
EXPR = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+'
# What an llguidance lexer step gives up on (JSONSchemaBench Github_easy o21053): masking fails.
TOO_COMPLEX = {"type": "string", "minLength": 1, "maxLength": 5000, "pattern": "^$|(^(?:\\S+\\s+){0,99}\\S+$)"}


@pytest.fixture(scope="module")
def llg(vocab) -> LLGuidanceBackend:
    return GRAMMAR_BACKENDS["llguidance"](vocab)


def test_registered_under_llguidance(llg, vocab):
    assert isinstance(llg, LLGuidanceBackend) and llg.name == "llguidance"
    assert llg.vocab_size == vocab.vocab_size


# --- masks allow exactly what the grammar allows --------------------------------------------


LANGUAGES = [
    ("json_schema", ORDER,
     ['{"id":3,"customer":{"name":"Al"},"status":"paid","items":[]}',
      '{"id":12,"customer":{"name":"B \\"Q\\""},"status":"open","items":["x","y"]}'],
     ['{"id":0,"customer":{"name":"Al"},"status":"paid","items":[]}',  # minimum
      '{"id":3,"customer":{"name":"Alexander"},"status":"paid","items":[]}',  # maxLength
      '{"id":3,"customer":{"name":"Al"},"status":"lost","items":[]}',  # enum
      '{"id":3,"customer":{"name":"Al"},"status":"paid","items":["a","b","c"]}',  # maxItems
      '{"id":3,"customer":{"name":"Al"},"status":"paid"}',  # required
      '{"id":3,"customer":{"name":"Al"},"status":"paid","items":[],"x":1}',  # additionalProperties
      '{"id": 3,"customer":{"name":"Al"},"status":"paid","items":[]}',  # compact separators
      '{"customer":{"name":"Al"},"id":3,"status":"paid","items":[]}']),  # schema order
    ("regex", r"\(\d{3}\) [a-z]+(-[a-z]+)?", ["(555) abc", "(012) ab-cd"], ["(55) abc", "(555) ab-", "(555) Abc"]),
    ("regex", r"^(yes|no)$", ["yes", "no"], ["ye", "yesno", "^yes$"]),
    ("ebnf", EXPR, ["12+3", "7", "1-2+30"], ["1++2", "+1", "1+"]),
    ("ebnf", 'start: "x" /[0-9]+/ ("!" | "?")', ["x1!", "x42?"], ["x!", "x1", "y1!"]),
    ("choices", ["red wine", "white", "rosé"], ["red wine", "white", "rosé"], ["red", "whites", "rose"]),
]


def _walk(m, ids, width: int, eos: int, stops: frozenset[int] = frozenset()) -> int | None:
    """Feed ``ids`` then ``eos``, checking before each token that the mask allows exactly what
    accept takes, and what allows() says but for stop tokens (always False there: the engine then
    masks), on the token and a probe of others; the index of the first refused token."""
    probe = sorted(set(range(0, width, 211)) | set(ids) | stops)
    for i, t in enumerate([*ids, eos]):
        allowed = _mask(m, width)
        for p in probe:
            assert m.allows(p) == (p in allowed and p not in stops and p != eos), (i, p)
            ok = m.accept(p)
            assert ok == (p in allowed), (i, p)
            if ok:
                m.rollback(1)
        if not m.accept(t):
            return i
    return None


@pytest.mark.parametrize(("kind", "spec", "good", "bad"), LANGUAGES, ids=[f"{k}-{i}" for i, (k, *_) in
                                                                           enumerate(LANGUAGES)])
def test_masks_allow_exactly_what_the_grammar_allows(smol_tokenizer, llg, width, kind, spec, good, bad):
    eos = smol_tokenizer.eos_token_id
    g = llg.compile(kind, spec)
    stops = frozenset(llg.vocab.stop_ids)
    for text in good:
        m = g.new_matcher()
        assert _walk(m, _ids(smol_tokenizer, text), width, eos, stops) is None, text
        assert m.is_terminated() and m.is_completed()
        assert not m.allows(_ids(smol_tokenizer, text)[0])  # nothing after the end
    for text in bad:
        m = g.new_matcher()
        assert _walk(m, _ids(smol_tokenizer, text), width, eos, stops) is not None, text
        assert not m.is_terminated()


def test_special_and_padding_ids_never_allowed(smol_tokenizer, width):
    padded = width + 64
    vocab = build_tokenizer_vocab(smol_tokenizer, padded)
    be = LLGuidanceBackend(vocab)
    never = (_added_ids(smol_tokenizer) | set(range(width, padded))) - {smol_tokenizer.eos_token_id}
    m = be.compile("regex", "(.|\n)*").new_matcher()
    allowed = _mask(m, padded)
    assert not allowed & never and smol_tokenizer.eos_token_id in allowed  # may end anywhere
    assert not any(m.accept(t) for t in sorted(never))
    m = be.compile("json_schema", {"type": "string"}).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, '"Al')) is None
    allowed = _mask(m, padded)
    assert len(allowed) > 40_000 and not allowed & (never | {smol_tokenizer.eos_token_id})
    assert m.accept(_ids(smol_tokenizer, "ice")[0])


def test_every_stop_id_only_where_complete(smol_tokenizer, width):
    im_end, endoftext = smol_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    vocab = build_tokenizer_vocab(smol_tokenizer, width, stop_token_ids=[im_end, endoftext])
    m = LLGuidanceBackend(vocab).compile("regex", r"\d+").new_matcher()
    assert not _mask(m, width) & {im_end, endoftext}
    assert not m.accept(endoftext) and not m.is_completed()
    assert m.accept(_ids(smol_tokenizer, "7")[0]) and m.is_completed()
    assert {im_end, endoftext} <= _mask(m, width)
    assert m.accept(endoftext) and m.is_terminated()
    assert _mask(m, width) == {im_end, endoftext}
    assert not m.accept(_ids(smol_tokenizer, "7")[0]) and not m.accept(im_end)


def test_stop_is_the_only_choice_once_the_grammar_is_done(smol_tokenizer, llg, width):
    eos = smol_tokenizer.eos_token_id
    m = llg.compile("choices", ["yes", "no"]).new_matcher()
    assert m.accept(_ids(smol_tokenizer, "yes")[0])
    assert _mask(m, width) == {eos} and m.is_completed() and not m.is_terminated()


# --- rollback, forced text ------------------------------------------------------------------


def test_rollback_restores_mask_forced_text_and_termination(smol_tokenizer, llg, width):
    eos = smol_tokenizer.eos_token_id
    m = llg.compile("json_schema", ORDER).new_matcher()
    ids = _ids(smol_tokenizer, '{"id":3,"customer":{"name":"Bo"}')
    assert _feed(m, ids) is None
    after_mask, after_forced = _mask(m, width), m.forced_text()
    assert after_forced == ',"status":"'
    m.rollback(4)
    assert _feed(m, ids[-4:]) is None
    assert _mask(m, width) == after_mask and m.forced_text() == after_forced
    m.rollback(len(ids))
    assert m.forced_text() == '{"id":'
    m.rollback(0)
    with pytest.raises(ValueError):
        m.rollback(-1)
    with pytest.raises(ValueError, match="only 0"):
        m.rollback(1)
    m = llg.compile("regex", "ab?").new_matcher()
    assert m.accept(_ids(smol_tokenizer, "a")[0]) and m.accept(eos) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated() and m.is_completed()
    assert m.accept(_ids(smol_tokenizer, "b")[0]) and m.accept(eos)
    m.rollback(3)
    assert m.forced_text() == "a" and not m.is_completed()


def test_a_token_allows_took_is_invisible_until_accepted(smol_tokenizer, llg, width):
    """allows() takes the token ahead of accept() (one call into llguidance, not two); every
    other call first gives it back, so the state any caller sees is unchanged."""
    prefix = _ids(smol_tokenizer, '{"id":3,"customer":{"name":"Bo')
    plain = llg.compile("json_schema", ORDER).new_matcher()
    assert _feed(plain, prefix) is None
    want_mask, want_forced = _mask(plain, width), plain.forced_text()
    quote, brace, newline = _ids(smol_tokenizer, '"')[0], _ids(smol_tokenizer, "}")[0], _ids(smol_tokenizer, "\n")[0]
    m = llg.compile("json_schema", ORDER).new_matcher()
    assert _feed(m, prefix) is None
    assert m.allows(quote) and m.allows(quote)  # asked twice: still one token taken
    assert _mask(m, width) == want_mask and m.forced_text() == want_forced and not m.is_completed()
    assert m.allows(quote) and not m.allows(newline) and m.allows(quote)  # no raw newline in a JSON string
    assert m.accept(quote) and m.forced_text() == '},"status":"' and plain.accept(quote)  # kept once accepted
    assert _mask(m, width) == _mask(plain, width)
    assert m.allows(brace)
    m.rollback(1)  # undoes the accepted quote, not the token only tested
    assert m.forced_text() == want_forced and _mask(m, width) == want_mask
    assert m.allows(quote) and m.accept(newline) is False and m.accept(quote)  # another token: given back first
    bitmask = allocate_bitmask(2, width)
    assert m.allows(brace) and type(m).fill_batch([m, plain], bitmask, [0, 1]) == [True, True]
    assert torch.equal(bitmask[0], bitmask[1])  # a batch fill gives the tested token back too


def test_accept_many_takes_tokens_until_one_is_refused(smol_tokenizer, llg, width):
    ids = _ids(smol_tokenizer, '{"id":3,"customer":{"name":"Bo"}')
    one_by_one = llg.compile("json_schema", ORDER).new_matcher()
    assert _feed(one_by_one, ids) is None
    m = llg.compile("json_schema", ORDER).new_matcher()
    assert m.accept_many(ids) == len(ids) and m.accept_many([]) == 0
    assert _mask(m, width) == _mask(one_by_one, width) and m.forced_text() == one_by_one.forced_text()
    bad = _ids(smol_tokenizer, ',"status":"open"}')  # "}" before "items": refused there
    took = m.accept_many(bad)
    assert 0 < took < len(bad)
    m.rollback(len(ids) + took)  # counts what it took: all of it rolls back
    assert m.forced_text() == '{"id":'
    eos = smol_tokenizer.eos_token_id
    r = llg.compile("regex", "ab").new_matcher()
    assert r.accept_many([*_ids(smol_tokenizer, "ab"), eos]) == len(_ids(smol_tokenizer, "ab")) + 1
    assert r.is_terminated()  # a stop token among them: taken one at a time


@pytest.mark.parametrize(
    ("kind", "spec", "prefix", "forced"),
    [
        ("json_schema", ORDER, "", '{"id":'),
        ("json_schema", ORDER, '{"id":5', ""),
        ("json_schema", ORDER, '{"id":5,', '"customer":{"name":"'),
        ("json_schema", ORDER, '{"id":5,"customer":{"name":"x"}', ',"status":"'),
        ("json_schema", ORDER, '{"id":5,"customer":{"name":"x"},"status":"o', 'pen","items":['),
        ("regex", r"id-\d+", "", "id-"),
        ("ebnf", 'root ::= "ab" [0-9]+ "cd"', "ab1", ""),
        ("choices", ["bluebird", "blueberry"], "", "blueb"),
        ("choices", ["bluebird", "blueberry"], "bluebi", "rd"),
    ],
)
def test_forced_text(smol_tokenizer, llg, kind, spec, prefix, forced):
    m = llg.compile(kind, spec).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, prefix)) is None
    assert m.forced_text() == forced
    assert m.forced_text(2) == forced[:2] and m.forced_text(0) == ""


def test_forced_text_waits_for_a_split_character(smol_tokenizer, llg):
    ids = _ids(smol_tokenizer, "\U0001d11e")  # three tokens, each a part of one UTF-8 character
    assert len(ids) == 3
    m = llg.compile("choices", ["\U0001d11e and more"]).new_matcher()
    assert m.forced_text() == "\U0001d11e and more"
    assert m.accept(ids[0]) and m.forced_text() == ""
    assert m.accept(ids[1]) and m.forced_text() == ""
    assert m.accept(ids[2]) and m.forced_text() == " and more"


def test_jump_forward_appends_the_forced_tokens(smol_tokenizer, llg, vocab):
    jf = JumpForward(vocab, lambda text: smol_tokenizer.encode(text, add_special_tokens=False))
    m = llg.compile("json_schema", ORDER).new_matcher()
    out = _ids(smol_tokenizer, '{"id":5,"customer":{"name":"x"}')
    assert _feed(m, out) is None
    jump = jf.jump(m, out, 0, 100)
    assert jump is not None and jump.new_ids
    ids = out[:jump.keep] + list(jump.new_ids)
    assert b"".join(vocab.decoded[t] for t in ids).decode() == '{"id":5,"customer":{"name":"x"}' + jump.text
    assert jump.text + m.forced_text() == ',"status":"'  # the matcher took the new tokens


class _Untestable:
    """A matcher without ``allows``: the jump cannot test tokens through it."""

    def __init__(self, matcher):
        self._m = matcher

    def __getattr__(self, name):
        if name == "allows":
            raise AttributeError(name)
        return getattr(self._m, name)


def test_a_held_back_token_the_grammar_leaves_no_choice_to_joins_the_jump(smol_tokenizer, llg, vocab):
    """The forced text ends in ``":`` before an integer: its one longer token ``":"`` opens a
    string, which the grammar forbids, so ``":`` joins the jump (a forward pass spared). Before a
    string-or-integer value ``":"`` is allowed and ``":`` stays held back for the model, as it
    does behind a matcher that cannot test a token."""
    encode = lambda text: smol_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    jf = JumpForward(vocab, encode)
    assert [vocab.decoded[t] for t in jf.longer_tokens(b'":', 16)] == [b'":"']
    assert jf.longer_tokens(b'"', 16) is None  # more than 16: never tested
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = _ids(smol_tokenizer, '{"name":"x"')
    m = llg.compile("json_schema", person).new_matcher()
    assert _feed(m, out) is None
    jump = jf.jump(m, out, 0, 100)
    assert jump.text == ',"age":' and vocab.decoded[jump.new_ids[-1]] == b'":'
    assert m.forced_text() == "" and m.accept(encode("7")[0])
    untestable = llg.compile("json_schema", person).new_matcher()
    _feed(untestable, out)
    jump = jf.jump(_Untestable(untestable), out, 0, 100)
    assert jump.text == ',"age' and untestable.forced_text() == '":'
    either = {"type": "object", "properties": {"v": {"type": ["string", "integer"]}}, "required": ["v"],
              "additionalProperties": False}
    m = llg.compile("json_schema", either).new_matcher()
    start = _ids(smol_tokenizer, "{")
    assert _feed(m, start) is None
    jump = jf.jump(m, start, 0, 100)
    assert jump.text == '"v' and m.forced_text() == '":'
    assert m.accept(vocab.decoded.index(b'":"'))  # the model may still take the longer token


def test_a_split_rule_re_tokenizes_only_after_the_last_split(smol_tokenizer, llg, vocab):
    """With the tokenizer's split rule, the tokens before the last split stay as the model wrote
    them ("Al" + "ice", where the tokenizer writes "Alice"), only the text after it is
    re-tokenized, and its tokens are kept for the next jump over the same text."""
    rust = smol_tokenizer.backend_tokenizer
    asked: list[str] = []

    def encode(text: str) -> list[int]:
        asked.append(text)
        return list(rust.encode(text, add_special_tokens=False).ids)

    split = split_rule(vocab.hf_json, encode)
    assert split is not None
    head = _ids(smol_tokenizer, '{"id":5,"customer":{"name":"')
    out = head + _ids(smol_tokenizer, "Al") + _ids(smol_tokenizer, "ice") + _ids(smol_tokenizer, '"}')
    split_jf = JumpForward(vocab, encode, split=split)
    jumps = []
    for jf in (JumpForward(vocab, encode), split_jf, split_jf):
        m = llg.compile("json_schema", ORDER).new_matcher()
        assert _feed(m, out) is None
        asked.clear()
        jump = jf.jump(m, out, 0, 100)
        jumps.append((jump, list(asked)))
        ids = out[:jump.keep] + list(jump.new_ids)
        assert b"".join(vocab.decoded[t] for t in ids).decode() + m.forced_text() == \
            '{"id":5,"customer":{"name":"Alice"},"status":"'
    (whole, _), (after_split, asked_split), (again, asked_again) = jumps
    assert whole.keep <= len(head)  # the window's re-tokenizing rewrote "Al" + "ice"
    assert after_split.keep >= len(head) + 2  # the split ('e' | '"') keeps them
    assert asked_split == ['"},"status":"'] and asked_again == []  # kept: no encode the second time
    assert again == after_split


def test_a_split_rule_changes_nothing_where_the_model_wrote_canonical_tokens(smol_tokenizer, llg, vocab):
    encode = lambda text: smol_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    split = split_rule(vocab.hf_json, encode)
    for prefix in ('{"id":5,"customer":{"name":"x"}', '{"id":5,"customer":{"name":"Alice Bo"},"status":"paid"',
                   '{"id":17'):
        out = _ids(smol_tokenizer, prefix)
        results = []
        for jf in (JumpForward(vocab, encode), JumpForward(vocab, encode, split=split)):
            m = llg.compile("json_schema", ORDER).new_matcher()
            assert _feed(m, out) is None
            jump = jf.jump(m, out, 0, 100)
            results.append(None if jump is None else (out[:jump.keep] + list(jump.new_ids), jump.text,
                                                      m.forced_text()))
        assert results[0] == results[1], prefix


def test_only_stop_next(smol_tokenizer, llg):
    """True where the text is complete and nothing more of it may follow; False where more may
    (a regex's "a+"), before the end, and after a rollback."""
    done = '{"id":3,"customer":{"name":"Al"},"status":"paid","items":[]}'
    m = llg.compile("json_schema", ORDER).new_matcher()
    ids = _ids(smol_tokenizer, done)
    assert _feed(m, ids[:-1]) is None and not m.only_stop_next()
    assert m.allows(ids[-1]) and m.accept(ids[-1]) and m.only_stop_next()
    m.rollback(1)
    assert not m.only_stop_next()
    assert m.accept(ids[-1]) and m.only_stop_next() and m.accept(smol_tokenizer.eos_token_id)
    assert m.is_terminated() and not m.only_stop_next()
    more = llg.compile("regex", "a+").new_matcher()
    assert _feed(more, _ids(smol_tokenizer, "aaa")) is None
    assert more.is_completed() and not more.only_stop_next()
    choice = llg.compile("choices", ["yes", "yesterday"]).new_matcher()
    assert _feed(choice, _ids(smol_tokenizer, "yes")) is None and not choice.only_stop_next()


def test_answers_after_a_test_are_those_of_a_fresh_matcher(smol_tokenizer, llg):
    """``allows`` takes the token it tests; through any order of tests, accepts, rollbacks and
    runs, the answers (forced text, complete, only a stop next) stay those of a matcher fed the
    accepted tokens afresh."""
    text = '{"id":12,"customer":{"name":"Bo"},"status":"paid","items":["x","y"]}'
    ids = _ids(smol_tokenizer, text)
    other = _ids(smol_tokenizer, 'zz"}]')
    rng = random.Random(0)
    grammar = llg.compile("json_schema", ORDER)
    m, taken = grammar.new_matcher(), 0
    for _ in range(300):
        op = rng.choice(["test and accept", "accept", "test another", "rollback", "run"])
        if op == "test and accept" and taken < len(ids):
            assert m.allows(ids[taken]) and m.accept(ids[taken])
            taken += 1
        elif op == "accept" and taken < len(ids):
            assert m.accept(ids[taken])
            taken += 1
        elif op == "test another":
            m.allows(rng.choice(other + ids))
        elif op == "rollback" and taken:
            n = rng.randint(1, min(taken, 4))
            m.rollback(n)
            taken -= n
        elif op == "run":
            n = min(rng.randint(1, 4), len(ids) - taken)
            assert m.accept_many(ids[taken:taken + n]) == n
            taken += n
        fresh = grammar.new_matcher()
        assert _feed(fresh, ids[:taken]) is None
        assert (m.forced_text(), m.is_completed(), m.only_stop_next()) == \
            (fresh.forced_text(), fresh.is_completed(), fresh.only_stop_next()), (op, taken)
    assert taken > 0


def test_a_jump_short_of_min_gain_is_not_taken(smol_tokenizer, llg, vocab):
    """JumpPolicy's floor: a jump adding fewer tokens than asked leaves the matcher as it was."""
    jf = JumpForward(vocab, lambda text: smol_tokenizer.encode(text, add_special_tokens=False))
    out = _ids(smol_tokenizer, '{"id":5,"customer":{"name":"x"}')
    probe = llg.compile("json_schema", ORDER).new_matcher()
    assert _feed(probe, out) is None
    gain = len(jf.jump(probe, out, 0, 100).new_ids)  # the tokens the jump writes
    m = llg.compile("json_schema", ORDER).new_matcher()
    _feed(m, out)
    assert jf.jump(m, out, 0, 100, min_gain=gain + 1) is None
    assert jf.jump(m, out, 0, 100, min_gain=len(',"status":"') + 1) is None  # fewer forced bytes than that
    assert m.forced_text() == ',"status":"'  # untouched
    jump = jf.jump(m, out, 0, 100, min_gain=gain)
    assert jump is not None and len(jump.new_ids) == gain


# --- compiling: grammar forms, JSON layout, errors ------------------------------------------


def test_json_layout_follows_the_config(smol_tokenizer, vocab):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    eos = smol_tokenizer.eos_token_id
    layouts = {GrammarConfig(json_separators=(", ", ": ")): ['{"a": 1, "b": 2}'],
               GrammarConfig(json_any_whitespace=True): ['{"a":1,"b":2}', '{ "a" : 1,\n "b": 2 }']}
    refused = {GrammarConfig(json_separators=(", ", ": ")): ['{"a":1,"b":2}'], GrammarConfig(json_any_whitespace=True): []}
    for config, texts in layouts.items():
        g = LLGuidanceBackend(vocab, config).compile("json_schema", schema)
        for text in texts:
            assert _feed(g.new_matcher(), _ids(smol_tokenizer, text) + [eos]) is None, text
        for text in refused[config]:
            assert _feed(g.new_matcher(), _ids(smol_tokenizer, text) + [eos]) is not None, text


def test_choices_escape_anything(smol_tokenizer, llg):
    eos = smol_tokenizer.eos_token_id
    tricky = ['say "hi"\\n', "tab\there\nnew", "a.b*c+(d)|[e]{2}^$?/", "caf\u00e9 \u4e2d", "\x01", ""]
    g = llg.compile("choices", tricky)
    for c in tricky:
        m = g.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, c) + [eos]) is None and m.is_terminated(), c
    assert _feed(g.new_matcher(), _ids(smol_tokenizer, "a.b*c+(d)|[e]{2}^$") + [eos]) is not None
    assert choices_to_lark(("a", '"')) == 'start: CHOICE\nCHOICE: "a" | "\\""'


@pytest.mark.parametrize(
    ("kind", "spec", "match"),
    [
        ("regex", "a(b", "unclosed group"),
        ("regex", "[z-a]", "invalid character class range"),
        ("regex", r"\bword", "lookarounds not supported"),
        ("json_schema", {"not": {"enum": ["a"]}}, r'Unimplemented keys: \["not"\]'),
        ("json_schema", {"type": "array", "uniqueItems": True}, "uniqueItems"),
        ("json_schema", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ("json_schema", {"type": "object", "properties": {"a": {}}, "required": ["a", "b"],
                         "additionalProperties": False}, "Unsatisfiable schema"),
        ("json_schema", {"$ref": "http://example.com/schema"}, "not present in a registry"),
        ("json_schema", "false", "accepts no value"),
        ("ebnf", 'root ::= "a" (= "b")', "Expected"),
        ("ebnf", "root ::= missing", "missing"),
        ("ebnf", "start: <|im_start|>", "special tokens"),
        ("ebnf", 'start: "a" <[1]>', "special tokens"),
    ],
)
def test_bad_specs_raise_clean_value_errors(llg, kind, spec, match):
    with pytest.raises(ValueError, match=match) as info:
        llg.compile(kind, spec)
    message = str(info.value)
    assert message.startswith(f"cannot compile {kind}: ") and "\n" not in message and len(message) < 500
    assert not any(noise in message for noise in ("<state>", "backtrace", "start: /", "at 1("))
    with pytest.raises(ValueError) as again:  # cached
        llg.compile(kind, spec)
    assert str(again.value) == message


def test_special_tokens_are_found_outside_literals_only():
    assert refers_to_special_tokens("start: <|im_end|>") and refers_to_special_tokens("start: x <[0-9]>")
    assert not refers_to_special_tokens('start: "<|im_end|>" /<a\\/>/ // <b>\n# <c>\nx: %json {"pattern": "<"}')


def test_prepare_schema_drops_formats_llguidance_does_not_enforce(llg, smol_tokenizer):
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "format": "password"}, "b": {"type": "string", "format": "date"},
        "format": {"type": "string", "enum": [{"format": "x"}]}}, "default": {"format": "kept"}}
    got = prepare_schema(schema)
    assert "format" not in got["properties"]["a"] and got["properties"]["b"]["format"] == "date"
    assert got["properties"]["format"]["enum"] == [{"format": "x"}] and got["default"] == {"format": "kept"}
    assert schema["properties"]["a"]["format"] == "password"  # the input is not changed
    m = llg.compile("json_schema", {"type": "string", "format": "date"}).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, '"2024-13-01"')) is not None  # known formats are enforced
    assert llg.compile("json_schema", {"type": "string", "format": "int32"}).kind == "json_schema"


@pytest.mark.parametrize("fmt", ["uri-template", "uri-reference", "regex", "iri", "json-pointer", "byte"])
def test_formats_it_cannot_enforce_are_plain_strings(llg, smol_tokenizer, fmt):
    """JSON Schema's formats llguidance does not enforce, and others: ``format`` is an annotation
    unless a validator is told to assert it, so the string is any string (not a refusal)."""
    m = llg.compile("json_schema", {"type": "object", "properties": {"x": {"type": "string", "format": fmt}},
                                    "required": ["x"]}).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, '{"x":"file:///{path}?q=1 (any text)"}')) is None and m.is_completed()


def test_repeated_keys_cannot_satisfy_min_properties(llg, smol_tokenizer):
    """llguidance would take {"b":1,"b":2} for minProperties 2 (one key to a validator)."""
    with pytest.raises(ValueError, match="'minProperties' more than one above the required properties"):
        llg.compile("json_schema", {"type": "object", "minProperties": 2})
    with pytest.raises(UnsupportedSchema, match=r"at /\$defs/x"):
        prepare_schema({"$defs": {"x": {"type": "object", "patternProperties": {"^b": {}},
                                        "additionalProperties": False, "minProperties": 3, "required": ["b1"]}}})
    for fine in ({"type": "object", "minProperties": 1}, {"type": "object", "minProperties": 3, "required": ["a", "b"]},
                 {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "minProperties": 2,
                  "additionalProperties": False}):
        llg.compile("json_schema", fine)
    m = llg.compile("json_schema", {"type": "object", "minProperties": 1}).new_matcher()
    assert _feed(m, _ids(smol_tokenizer, "{}") + [smol_tokenizer.eos_token_id]) is not None


# --- rows, engine failures, the tokenizer ---------------------------------------------------


def test_fill_mask_rows_numpy_torch_and_bad(llg, width):
    m = llg.compile("choices", ["yes", "no"]).new_matcher()
    row = np.zeros(bitmask_width(width), dtype=np.int32)
    assert m.fill_mask(row)
    t = allocate_bitmask(1, width)[0]
    assert m.fill_mask(t)
    assert np.array_equal(row, t.numpy())
    with pytest.raises(ValueError, match="int32"):
        m.fill_mask(np.zeros(bitmask_width(width), dtype=np.int64))
    with pytest.raises(ValueError, match="contiguous"):
        m.fill_mask(torch.zeros(2 * bitmask_width(width), dtype=torch.int32)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        m.fill_mask(np.zeros(bitmask_width(width) - 1, dtype=np.int32))


def test_an_engine_failure_is_a_runtime_error(smol_tokenizer, llg, width):
    m = llg.compile("json_schema", TOO_COMPLEX).new_matcher()
    assert m.accept(_ids(smol_tokenizer, '"')[0])
    with pytest.raises(RuntimeError, match="^llguidance: lexer error: too many expressions constructed$"):
        _mask(m, width)


def test_a_dead_end_masks_everything_out(smol_tokenizer, llg, width, vocab):
    """U+98730 needs the byte 0xF2, which no SmolLM2 token holds: after "a" no token fits."""
    assert not any(b"\xf2" in b for b in vocab.decoded)
    m = llg.compile("choices", ["a\U00098730"]).new_matcher()
    assert m.accept(_ids(smol_tokenizer, "a")[0])
    assert _mask(m, width) == set()
    assert not m.accept(_ids(smol_tokenizer, "b")[0]) and not m.accept(smol_tokenizer.eos_token_id)
    assert not m.is_completed() and m.forced_text() == ""


def test_the_engines_token_bytes_win_over_the_tokenizer_json(vocab, width):
    """A vocabulary whose bytes differ from what llguidance reads in the JSON (here: one token the
    engine never allows) builds llguidance's tokenizer from the engine's bytes."""
    hello = vocab.decoded.index(b"hello")
    backend = LLGuidanceBackend(dataclasses.replace(vocab, decoded=vocab.decoded[:hello] + (b"",) + vocab.decoded[hello + 1:]))
    assert hello not in _mask(backend.compile("regex", "[a-z]+").new_matcher(), width)
    assert hello in _mask(LLGuidanceBackend(vocab).compile("regex", "[a-z]+").new_matcher(), width)
    with pytest.raises(ValueError, match="needs a fast"):
        LLGuidanceBackend(dataclasses.replace(vocab, hf_json=""))


def test_strict_mode_closes_objects_that_name_their_properties(vocab, smol_tokenizer):
    """Generation (json_strict, the default) writes only the keys a schema names, as xgrammar's
    strict mode; without it llguidance reads the schema as a validator does."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "m": {"type": "object", "additionalProperties": {"type": "integer"}},
                                               "free": {"type": "object"}},
              "required": ["a"]}
    extra, in_map, in_free = '{"a":1,"z":2}', '{"a":1,"m":{"k":1}}', '{"a":1,"free":{"k":[]}}'
    strict = GRAMMAR_BACKENDS["llguidance"](vocab).compile("json_schema", schema)
    loose = GRAMMAR_BACKENDS["llguidance"](vocab, GrammarConfig(json_strict=False)).compile("json_schema", schema)
    assert _feed(strict.new_matcher(), _ids(smol_tokenizer, extra)) is not None
    for text in (in_map, in_free):  # declared maps and free-form objects stay open
        assert _feed(strict.new_matcher(), _ids(smol_tokenizer, text)) is None
    assert _feed(loose.new_matcher(), _ids(smol_tokenizer, extra)) is None


def test_close_objects_leaves_shared_objects_open():
    parts = [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "object", "properties": {}}}}]
    branch = {"properties": {"c": {}}}
    schema = close_objects({"allOf": parts, "$defs": {"properties": {"properties": {"x": {}}}},
                            "properties": {"additionalProperties": {"properties": {"y": {}}},
                                           "z": {"properties": {"q": {}}, "anyOf": [branch]},
                                           "r": {"$ref": "#/$defs/properties", "properties": {"w": {}}},
                                           "s": {"properties": {"t": {}}, "required": ["t", "u"]}}})
    assert "additionalProperties" not in parts[0] and "additionalProperties" not in parts[1]
    assert "additionalProperties" not in schema  # an allOf beside it
    assert schema["$defs"]["properties"]["additionalProperties"] is False  # a definition named "properties"
    props = schema["properties"]
    assert props["additionalProperties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["z"] and "additionalProperties" not in branch
    assert "additionalProperties" not in props["r"]
    assert props["s"]["additionalProperties"] is False and props["s"]["properties"]["u"] == {}


def test_our_token_bytes_stand_in_for_the_tokenizer_json(vocab, smol_tokenizer, width):
    """Where llguidance reads the tokenizer JSON's tokens otherwise than the engine, the backend
    hands it our token bytes instead: they agree with the engine, tokenize like the JSON
    tokenizer, and give the same masks."""
    import llguidance

    from radixlm.runtime.constrained.llguidance_backend import _same_vocabulary, _VocabTokens

    ours = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_VocabTokens(vocab)), n_vocab=vocab.vocab_size,
                                  eos_token=vocab.stop_ids[0])
    _same_vocabulary(ours, vocab)
    theirs = llguidance.LLTokenizer(vocab.hf_json, n_vocab=vocab.vocab_size, eos_token=vocab.stop_ids[0])
    for text in ['{"name":"Zoë ¡hola!"}', "  spaced\\nlines\t", "日本語 123"]:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text) == _ids(smol_tokenizer, text)
    schema = llguidance.LLMatcher.grammar_from_json_schema('{"type":"object","properties":{"a":{"type":"string"}}}')
    a, b = llguidance.LLMatcher(ours, schema), llguidance.LLMatcher(theirs, schema)
    for t in _ids(smol_tokenizer, '{"a":"x¡y"}'):
        assert np.array_equal(a.compute_bitmask(), b.compute_bitmask())
        assert a.consume_token(t) and b.consume_token(t)


# --- fallback to xgrammar -----------------------------------------------------------------------

# A payment card is exactly one of two closed objects, told apart by "provider". llguidance
# refuses the oneOf (it cannot tell the branches exclude each other: a value that is no object
# would pass both); xgrammar's backend gives each branch the type its keywords imply (object),
# proves them exclusive by the discriminator, and enforces the schema exactly.
CARD = {"type": "object", "required": ["card"], "properties": {"card": {"oneOf": [
    {"additionalProperties": False, "required": ["provider"],
     "properties": {"provider": {"enum": ["mastercard"], "type": "string"}}},
    {"additionalProperties": False, "required": ["provider", "code"],
     "properties": {"provider": {"enum": ["visa"], "type": "string"}, "code": {"type": "integer"}}}]}}}


def test_a_schema_llguidance_refuses_is_compiled_by_xgrammar(vocab, smol_tokenizer, caplog):
    pytest.importorskip("xgrammar")
    with pytest.raises(ValueError, match="oneOf constraints are not supported"):
        LLGuidanceBackend(vocab).compile("json_schema", CARD)  # no fallback: llguidance alone
    backend = LLGuidanceBackend(vocab, GrammarConfig(fallback=True))
    with caplog.at_level("WARNING", logger="radixlm.runtime.constrained.llguidance_backend"):
        grammar = backend.compile("json_schema", CARD)
        assert backend.compile("json_schema", CARD) is grammar  # cached: compiled and logged once
    assert grammar.backend == "xgrammar"
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "compiled by xgrammar" in logged[0] and "oneOf constraints" in logged[0]
    for text in ('{"card":{"provider":"visa","code":4242}}', '{"card":{"provider":"mastercard"}}'):
        m = grammar.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, text)) is None and m.is_completed(), text
    for text in ('{"card":{"provider":"visa"}}', '{"card":{"provider":"mastercard","code":1}}', '{"card":"x"}'):
        m = grammar.new_matcher()
        assert _feed(m, _ids(smol_tokenizer, text)) is not None or not m.is_completed(), text


def test_no_fallback_where_xgrammar_would_only_approximate(vocab):
    """``not`` is refused by both: xgrammar's backend refuses what it cannot enforce exactly, so
    the error stays llguidance's."""
    pytest.importorskip("xgrammar")
    backend = LLGuidanceBackend(vocab, GrammarConfig(fallback=True))
    with pytest.raises(ValueError, match=r"^cannot compile json_schema: .*not"):
        backend.compile("json_schema", {"type": "object", "properties": {"a": {"not": {"minimum": 3}}}})


def test_no_fallback_past_llguidance_limits_or_for_a_large_grammar(vocab, caplog):
    """xgrammar's compile cannot be stopped and grows fast (1,000 optional properties: 29 s,
    +6 GiB): no fallback where llguidance refused for one of its resource limits, nor where
    xgrammar's grammar would pass FALLBACK_MAX_EXPRESSIONS."""
    pytest.importorskip("xgrammar")
    backend = LLGuidanceBackend(vocab, GrammarConfig(fallback=True))
    many = {f"p{i}": {"type": "integer"} for i in range(3000)}
    with caplog.at_level("DEBUG", logger="radixlm.runtime.constrained.llguidance_backend"):
        with pytest.raises(ValueError, match="Current row has .* items; max is 2000"):
            backend.compile("json_schema", {"type": "object", "properties": many})  # a resource limit
        assert not caplog.records
        wide = {"type": "object", "properties": {**dict(list(many.items())[:300]), "card": CARD["properties"]["card"]}}
        with pytest.raises(ValueError, match="oneOf constraints are not supported"):
            backend.compile("json_schema", wide)  # a construct xgrammar compiles, but too large a grammar
    (record,) = caplog.records
    size = int(record.getMessage().split("would hold ")[1].split()[0])
    assert size > FALLBACK_MAX_EXPRESSIONS
