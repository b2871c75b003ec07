"""Grammars that can never end are refused when they compile (xgrammar: limits.grammar_bounds;
llguidance: the productivity fixpoint of productive.py, then a probe of its forced text); forced
text is bounded (issue 21, bug 1)."""

from __future__ import annotations

import copy
import json

import pytest
from matcher_helpers import _feed, _ids

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained import GRAMMAR_BACKENDS, XGrammarBackend
from radixlm.runtime.constrained.jump_forward import MAX_JUMP_CHARS, JumpForward
from radixlm.runtime.constrained.limits import MAX_SHORTEST_TEXT, NoFiniteText, grammar_bounds
from radixlm.runtime.constrained.llguidance_backend import LLGuidanceGrammar
from radixlm.runtime.constrained.productive import check_lark, productive_schema
from radixlm.runtime.constrained.service import GrammarService

SELF_REQUIRED = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
                 "$ref": "#/$defs/n"}
ARRAY_OF_ITSELF = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
ONLY_ITSELF = {"$ref": "#"}
ENDLESS = [("json_schema", json.dumps(SELF_REQUIRED)), ("json_schema", json.dumps(ARRAY_OF_ITSELF)),
           ("json_schema", json.dumps(ONLY_ITSELF)), ("ebnf", 'root ::= "a" root')]


@pytest.fixture(scope="module")
def xgr_backend(vocab):
    return XGrammarBackend(vocab)


@pytest.fixture(scope="module")
def llg_backend(vocab):
    return GRAMMAR_BACKENDS["llguidance"](vocab)


@pytest.fixture(params=["xgrammar", "llguidance"])
def backend(request, xgr_backend, llg_backend):
    return {"xgrammar": xgr_backend, "llguidance": llg_backend}[request.param]


@pytest.mark.parametrize(("kind", "spec"), ENDLESS)
def test_grammar_with_no_finite_text_is_refused(backend, kind, spec):
    """xgrammar: by the analysis of limits.grammar_bounds (or, from xgrammar 0.2.9, its own
    compiler refuses a $ref chain with nothing in it); llguidance: its first mask finds no
    token, or the text it forces from the start passes its item limit."""
    with pytest.raises(ValueError, match=r"accepts no finite text|Circular \$ref chain with no schema content"):
        backend.compile(kind, spec)


# Every branch recurses: no single path is forced, yet no text ends (xgrammar: limits.grammar_bounds;
# llguidance: the productivity fixpoint of productive.py).
ALL_BRANCHES_RECURSE = [
    ("ebnf", 'root ::= "[" root "]" | "{" root "}"'),
    ("ebnf", 'start: "[" start "]"\n     | "{" start "}"'),  # Lark, llguidance's own syntax
    ("json_schema", {"$defs": {"n": {"anyOf": [
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]},
        {"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}]}}, "$ref": "#/$defs/n"}),
    ("json_schema", {"oneOf": [{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                               {"type": "object", "properties": {"b": {"$ref": "#"}}, "required": ["b"]}]}),
]


@pytest.mark.parametrize(("kind", "spec"), ALL_BRANCHES_RECURSE)
def test_grammar_whose_every_branch_recurses_is_refused(backend, kind, spec):
    if kind == "ebnf" and spec.startswith("start:") and backend.name == "xgrammar":
        pytest.skip("Lark is llguidance's syntax")
    with pytest.raises(ValueError, match=f"^{kind} accepts no finite text: every way through it requires itself"):
        backend.compile(kind, spec)


def test_service_answers_the_400_message(smol_tokenizer, width):
    service = GrammarService(smol_tokenizer, width, [smol_tokenizer.eos_token_id], ConstraintConfig())
    try:
        for kind, spec in ALL_BRANCHES_RECURSE:
            with pytest.raises(ValueError, match=f"^constrained decoding: {kind} accepts no finite text"):
                service.submit(kind, spec).result()
    finally:
        service.shutdown()


def test_dead_branch_is_refused(backend):
    """A grammar that accepts something, but with a branch that never ends once entered."""
    for grammar in ('root ::= "b" | "a" x\nx ::= "a" x', 'root ::= "b" | x\nx ::= "(" x ")" | "[" x "]"'):
        with pytest.raises(ValueError, match="rule 'x' requires itself again on every path"):
            backend.compile("ebnf", grammar)


def test_dead_schema_branch(xgr_backend, llg_backend, smol_tokenizer):
    """xgrammar refuses a schema with a branch no finite value satisfies; llguidance compiles it
    with that branch as ``false`` (the same schema: the branch accepts nothing), so a model
    never enters it."""
    schema = {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/bad"}],
              "$defs": {"bad": {"type": "object", "properties": {"x": {"$ref": "#/$defs/bad"}}, "required": ["x"]}}}
    with pytest.raises(ValueError, match="can never end once entered"):
        xgr_backend.compile("json_schema", schema)
    grammar = llg_backend.compile("json_schema", schema)
    m = grammar.new_matcher()
    assert _feed(m, _ids(smol_tokenizer, '"ok"')) is None and m.is_completed()
    assert _feed(grammar.new_matcher(), _ids(smol_tokenizer, '{"x":')) == 0


def test_exponentially_long_shortest_text_is_refused(xgr_backend):
    rules = ["root ::= r0", *(f"r{i} ::= r{i + 1} r{i + 1}" for i in range(40)), 'r40 ::= "ab"']
    with pytest.raises(ValueError, match=f"longer than {MAX_SHORTEST_TEXT:,} bytes"):
        xgr_backend.compile("ebnf", "\n".join(rules))


def test_llguidance_ends_a_request_whose_grammar_forces_text_without_end_later(llg_backend, smol_tokenizer):
    """Past a choice, a branch that forces text forever, in a grammar no analysis of ours read
    (built here without it: both backends refuse this one): llguidance stops at its item limit,
    and the matcher's error ends that request alone."""
    text = '%llguidance {"no_forcing": true}\nstart: "b" | "a" x\nx: "a" x'
    template = llg_backend._llg.LLMatcher(llg_backend._tokenizer, text, log_level=0)
    m = LLGuidanceGrammar("ebnf", template, llg_backend._executor, llg_backend.vocab,
                          llg_backend._text_ids).new_matcher()
    assert m.forced_text() == ""  # a choice first
    a = smol_tokenizer.encode("a", add_special_tokens=False)[0]
    assert m.accept(a)
    assert len(m.forced_text(MAX_JUMP_CHARS)) == MAX_JUMP_CHARS  # what jump-forward asks after a token
    with pytest.raises(RuntimeError, match="forces text without end"):
        m.accept(a)


def test_llguidance_refuses_an_exponentially_large_grammar(llg_backend):
    rules = ["root ::= r0", *(f"r{i} ::= r{i + 1} r{i + 1}" for i in range(40)), 'r40 ::= "ab"']
    with pytest.raises(ValueError, match="^cannot compile ebnf: .*too big"):
        llg_backend.compile("ebnf", "\n".join(rules))


def test_optional_recursion_compiles_and_jumps(xgr_backend):
    g = xgr_backend.compile("json_schema", {"type": "object", "properties": {"c": {"$ref": "#"}}})
    assert g.jump_safe
    assert g.new_matcher().forced_text() == "{"


def test_user_lookahead_turns_jump_forward_off(xgr_backend):
    g = xgr_backend.compile("ebnf", 'root ::= "ab" x "d"\nx ::= "c" (= "d")')
    assert not g.jump_safe
    assert g.new_matcher().forced_text() == ""


def test_unreadable_grammar_turns_jump_forward_off():
    assert not grammar_bounds("ebnf", '{"rules": [["root", 0, -1]], "grammar_expr_data": [99, 0], '
                                      '"grammar_expr_indptr": [0], "root_rule_id": 0}').jump_safe


def test_service_refusal_names_constrained_decoding(smol_tokenizer, width):
    config = ConstraintConfig(grammar_backend="xgrammar")  # the refusal is xgrammar's (grammar_bounds)
    service = GrammarService(smol_tokenizer, width, [smol_tokenizer.eos_token_id], config)
    try:
        future = service.submit("json_schema", SELF_REQUIRED)
        with pytest.raises(ValueError, match="constrained decoding: json_schema accepts no finite text"):
            future.result(timeout=60)
    finally:
        service.shutdown()


class _Recorder:
    """A matcher that records the bound it was asked for and forces a long run of 'a'."""

    def __init__(self, inner):
        self.inner = inner
        self.asked: list[int | None] = []

    def forced_text(self, max_chars=None):
        self.asked.append(max_chars)
        return self.inner.forced_text(max_chars)

    def accept(self, t):
        return self.inner.accept(t)

    def rollback(self, n):
        self.inner.rollback(n)


@pytest.mark.parametrize("limit", [1, 5, 40])
def test_jump_is_bounded_by_the_limit_in_tokens_and_chars(backend, vocab, smol_tokenizer, limit):
    jf = JumpForward(vocab, lambda text: smol_tokenizer.encode(text, add_special_tokens=False))
    m = _Recorder(backend.compile("regex", "x{20000}").new_matcher())
    jump = jf.jump(m, [], 0, limit)
    assert jump is not None
    assert len(jump.new_ids) <= limit
    longest = max(len(b) for b in vocab.decoded)
    assert m.asked == [min(limit * longest, MAX_JUMP_CHARS)]
    assert len(jump.text) <= limit * longest


def test_jump_with_no_room_asks_for_nothing(backend, vocab, smol_tokenizer):
    jf = JumpForward(vocab, lambda text: smol_tokenizer.encode(text, add_special_tokens=False))
    m = _Recorder(backend.compile("regex", "x{20000}").new_matcher())
    assert jf.jump(m, [], 0, 0) is None
    assert m.asked == []


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance", "outlines"])
def test_forced_text_takes_a_bound(vocab, backend_name):
    m = GRAMMAR_BACKENDS[backend_name](vocab).compile("regex", "abcdefgh[0-9]").new_matcher()
    assert m.forced_text() == "abcdefgh"
    assert m.forced_text(3) == "abc"
    assert m.forced_text(0) == ""


# schema -> whether some finite JSON value satisfies it (the fixpoint of productive.py)
PRODUCTIVE = [
    ({"type": "object", "properties": {"c": {"$ref": "#"}}}, True),  # optional recursion
    ({"type": "array", "items": {"$ref": "#"}}, True),  # [] ends it
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),  # null
    ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),  # no type: a string passes
    ({"anyOf": [{"$ref": "#"}, {"type": "string"}]}, True),
    ({"allOf": [{"type": "string"}, {"$ref": "#/$defs/x"}], "$defs": {"x": {"$ref": "#/$defs/x"}}}, False),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 1}, True),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}], "minItems": 2}, False),
    ({"type": "array", "items": [{"$ref": "#"}], "minItems": 1}, False),  # draft 7 tuple
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, False),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}, True),  # cannot tell
]


@pytest.mark.parametrize(("schema", "productive"), PRODUCTIVE)
def test_productivity_of_schemas(schema, productive):
    if productive:
        assert productive_schema(copy.deepcopy(schema)) == schema  # nothing to rewrite at the top
    else:
        with pytest.raises(NoFiniteText, match="^json_schema accepts no finite text"):
            productive_schema(copy.deepcopy(schema))


def test_a_subschema_with_no_value_becomes_false():
    schema = {"type": "object", "properties": {"ok": {"type": "integer"}, "loop": {"$ref": "#/$defs/loop"}},
              "$defs": {"loop": {"type": "array", "items": {"$ref": "#/$defs/loop"}, "minItems": 1}}}
    got = productive_schema(copy.deepcopy(schema))
    assert got["properties"] == {"ok": {"type": "integer"}, "loop": False} and got["$defs"]["loop"] is False


@pytest.mark.parametrize(("grammar", "refused"), [
    ('start: x\nx: "a" x | "b"', None),
    ('start: x+\nx: "(" x ")"', "start"),
    ('start: "a" | x?\nx: "(" x ")"', "x"),  # the start ends, but x never does once entered
    ('start: x{0,3} "!"\nx: "(" x ")" -> paren', "x"),
    ('start: [x] "!"\nx: "(" x ")"\nWORD: /[a-z]+/ & ~"if"', "x"),
    ('start: (x\n  | "b")\nx: ("(" x\n   ")")', "x"),  # lines go on inside brackets
    ('%llguidance {}\nstart: %json {"type": "object"} | x\nx[lazy]: "a" x', "x"),
    ('start: x\nx: "a" y\ny: x', "start"),
    ('start: "a"\n| "b" start', None),
    ("start: x\nx: 'single quotes are not read here' x", None),  # not followed: left to the engine
])
def test_productivity_of_lark_grammars(grammar, refused):
    if refused is None:
        check_lark(grammar)
    else:
        words = "accepts no finite text" if refused == "start" else f"rule '{refused}' requires itself again"
        with pytest.raises(NoFiniteText, match=words):
            check_lark(grammar)
