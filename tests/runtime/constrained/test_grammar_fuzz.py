"""Fuzzing the grammar backends with arbitrary and pathological constraints (xgrammar and
llguidance, the default model's vocabulary): every spec either compiles (and a matcher then runs
a few tokens) or fails with a ValueError that says what is wrong; nothing else escapes, nothing
hangs (each compile runs on a CompilePool whose time limit turns a stuck compile into that
ValueError).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
from big_schemas import ref_chain
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.compile_pool import CompilePool
from radixlm.runtime.constrained.grammar import CompileFailure, GrammarConfig, bitmask_width
from radixlm.runtime.constrained.limits import SpecLimits, check_spec
from radixlm.runtime.constrained.registry import GRAMMAR_BACKENDS
from radixlm.runtime.constrained.service import GrammarService

# RADIXLM_FUZZ_EXAMPLES=2000 RADIXLM_FUZZ_RANDOM=1 for a longer, freshly random run
FUZZ = settings(max_examples=int(os.environ.get("RADIXLM_FUZZ_EXAMPLES", "60")),
                derandomize=not os.environ.get("RADIXLM_FUZZ_RANDOM"), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
COMPILE_LIMIT_S = 20.0  # far above any compile the strategies below produce


@pytest.fixture(scope="module")
def backends(vocab) -> dict:
    return {name: GRAMMAR_BACKENDS[name](vocab, GrammarConfig(cache_size=64)) for name in ("xgrammar", "llguidance")}


@pytest.fixture(params=["xgrammar", "llguidance"])
def backend(request, backends):
    return backends[request.param]


@pytest.fixture
def xgr(backends):
    return backends["xgrammar"]


@pytest.fixture(scope="module")
def pool():
    p = CompilePool(1, COMPILE_LIMIT_S)
    yield p
    p.shutdown()


def _outcome(backend, pool, kind: str, spec: Any, steps: int = 4) -> str:
    """Compile on the pool, run a matcher ``steps`` tokens; 'ok' or the ValueError's message.
    Any other exception fails the test."""
    try:
        grammar = pool.submit(backend.compile, kind, spec).result()
    except ValueError as e:
        message = str(e)
        assert message and "Traceback" not in message
        return message
    matcher = grammar.new_matcher()
    row = np.zeros(bitmask_width(backend.vocab_size), dtype=np.int32)
    stops = set(backend.vocab.stop_ids)
    for _ in range(steps):
        if matcher.is_terminated():
            break
        row[:] = 0
        if matcher.fill_mask(row):
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: backend.vocab_size]
            allowed = [int(t) for t in np.flatnonzero(bits) if t not in stops]
        else:
            allowed = [t for t in range(backend.vocab_size) if backend.vocab.decoded[t]][:1]
        if not allowed:
            break
        assert matcher.accept(allowed[len(allowed) // 2]), "a token the mask allows was refused"
    return "ok"


def _fuzz(backend, pool, kind: str, spec: Any) -> None:
    outcome = _outcome(backend, pool, kind, spec)
    event(" ".join(outcome.split()[:4]))  # pytest --hypothesis-show-statistics: what the errors were


# --- regexes ----------------------------------------------------------------------------------

_ATOMS = ["a", "b", "x", ".", r"\d", r"\w", r"\s", r"\S", "[a-z]", "[^0-9]", r"[\s\S]", r"\.", r"\\", "é",
          "中", r"\n", r"\u0041", r"\x41", r"\p{L}", "(?:ab)", "^", "$", r"\b", "(?=a)", r"\1", "[", ")", "{",
          "(?P<n>a)", "[a-]", "[]a]", "[z-a]", r"\Q", "*", "a{,3}"]
_QUANTIFIERS = ["*", "+", "?", "*?", "+?", "{2}", "{1,3}", "{0,}", "{3,1}", "{1000}", "{0,20}", "{99999999999}"]


def _regexes() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map("|".join),
            inner.map(lambda r: f"({r})"),
            st.tuples(inner, st.sampled_from(_QUANTIFIERS)).map("".join),
        )

    grammar_made = st.recursive(st.sampled_from(_ATOMS), extend, max_leaves=10)
    soup = st.text(alphabet="ab.*+?()[]{}|^$\\-,0123456789dws", min_size=1, max_size=24)
    return st.one_of(grammar_made, soup, st.text(min_size=1, max_size=16))


@FUZZ
@given(pattern=_regexes())
def test_fuzz_regex_compiles_or_names_the_problem(backend, pool, pattern):
    _fuzz(backend, pool, "regex", pattern)


@FUZZ
@given(grammar=st.one_of(
    st.text(alphabet='root:=|"ab()*+?[]{}#\n ,0123456789-', min_size=1, max_size=40),
    _regexes().map(lambda r: f"root ::= {r}"),
    _regexes().map(lambda r: f'root ::= "a" x\nx ::= [{r}]*'),
))
def test_fuzz_ebnf_compiles_or_names_the_problem(backend, pool, grammar):
    _fuzz(backend, pool, "ebnf", grammar)


# --- JSON schemas -----------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=6,
)
_TYPES = st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array", "nonsense"])
_NAMES = st.sampled_from(["a", "b", "name", "", "x y", "é"])
_COUNTS = st.integers(-2, 12) | st.sampled_from([2**31, 10**30, 1.5, "3"])
_NUMBERS = st.integers(-1000, 1000) | st.floats(-1e6, 1e6) | st.sampled_from([10**300, -(2**63)])


def _keywords(schema: st.SearchStrategy[Any]) -> list[st.SearchStrategy[tuple[str, Any]]]:
    pairs: dict[str, st.SearchStrategy[Any]] = {
        "type": _TYPES | st.lists(_TYPES, max_size=3),
        "properties": st.dictionaries(_NAMES, schema, max_size=3),
        "required": st.lists(_NAMES, max_size=3),
        "additionalProperties": st.booleans() | schema,
        "patternProperties": st.dictionaries(st.sampled_from(["^a", "b$", "(a|aa)+$", "["]), schema, max_size=2),
        "items": st.booleans() | schema,
        "prefixItems": st.lists(schema, max_size=2),
        "enum": st.lists(_JSON, max_size=4),
        "const": _JSON,
        "anyOf": st.lists(schema, max_size=3),
        "oneOf": st.lists(schema, max_size=3),
        "allOf": st.lists(schema, max_size=3),
        "not": schema,
        "if": schema, "then": schema, "else": schema,
        "$ref": st.sampled_from(["#", "#/$defs/a", "#/$defs/missing", "#/properties/a", "http://example.com/s"]),
        "$defs": st.fixed_dictionaries({"a": schema}),
        "pattern": _regexes(),
        "format": st.sampled_from(["date-time", "email", "uuid", "ipv4", "hostname", "no-such-format"]),
        "minLength": _COUNTS, "maxLength": _COUNTS, "minItems": _COUNTS, "maxItems": _COUNTS,
        "minProperties": _COUNTS, "maxProperties": _COUNTS, "uniqueItems": st.booleans(),
        "minimum": _NUMBERS, "maximum": _NUMBERS, "exclusiveMinimum": _NUMBERS, "multipleOf": _NUMBERS,
        "default": _JSON, "description": st.text(max_size=8),
    }
    return [st.tuples(st.just(k), v) for k, v in pairs.items()]


_SCHEMAS = st.recursive(
    st.booleans() | st.just({}) | st.builds(lambda t: {"type": t}, _TYPES),
    lambda inner: st.lists(st.one_of(*_keywords(inner)), max_size=4).map(dict),
    max_leaves=8,
)


@FUZZ
@given(schema=_SCHEMAS)
def test_fuzz_json_schema_compiles_or_names_the_problem(backend, pool, schema):
    _fuzz(backend, pool, "json_schema", schema)


@FUZZ
@given(schema=_JSON | _JSON.map(json.dumps) | st.text(max_size=20))
def test_fuzz_random_json_as_schema(backend, pool, schema):
    _fuzz(backend, pool, "json_schema", schema)


@FUZZ
@given(choices=st.lists(st.text(max_size=8), max_size=6))
def test_fuzz_choices(backend, pool, choices):
    _fuzz(backend, pool, "choices", choices)


# --- pathological constraints -----------------------------------------------------------------


def _nested_object(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# (kind, spec, the words the error must contain); checked before anything compiles
OVER_LIMIT = {
    "json nested 200": ("json_schema", _nested_object(200), ["nesting depth", "128", "--grammar-max-nesting"]),
    "json nested 1000": ("json_schema", _nested_object(1000), ["nests too deeply"]),
    "json nested 1000 as text": ("json_schema", '{"items":' * 5000 + "{}" + "}" * 5000, ["nests too deeply"]),
    "json enum 10k": ("json_schema", {"enum": list(range(10_000))}, ["enum values is 10,000", "4,096",
                                                                      "--grammar-max-enum"]),
    "json enum 200k": ("json_schema", {"enum": [f"value{i}" for i in range(200_000)]},
                       ["size in bytes", "1,048,576", "--grammar-max-schema-bytes"]),
    "json maxLength 1e18": ("json_schema", {"type": "string", "maxLength": 10**18}, ["'maxLength'",
                                                                                      "--grammar-max-repeat"]),
    "json minItems 1e30": ("json_schema", {"type": "array", "minItems": 1e30}, ["'minItems'", "1,000,000"]),
    "json pattern a{2000000}": ("json_schema", {"type": "string", "pattern": "a{2000000}"}, ["repetition count"]),
    "json huge pattern": ("json_schema", {"type": "string", "pattern": "ab" * 600_000}, ["size in bytes"]),
    "json $ref chain": ("json_schema", ref_chain(1000), ["nesting through $ref", "is 3,002", "1,024",
                                                          "--grammar-max-ref-nesting"]),
    "regex a{10000000}": ("regex", "a{10000000}", ["repetition count in '{10000000}'", "--grammar-max-repeat"]),
    "regex a{1,99999999}": ("regex", "a{1,99999999}", ["repetition count"]),
    "regex nested groups 1000": ("regex", "(" * 1000 + "a" + ")" * 1000, ["nesting of parenthesized groups",
                                                                          "--grammar-max-nesting"]),
    "regex 1 MB": ("regex", "a" * 1_000_000, ["size in bytes is 1,000,000", "131,072"]),
    "regex 100k alternatives": ("regex", "|".join(f"w{i}" for i in range(100_000)), ["size in bytes"]),
    "ebnf nested parens 1000": ("ebnf", "root ::= " + "(" * 1000 + '"a"' + ")" * 1000, ["nesting"]),
    "ebnf a{5000000}": ("ebnf", 'root ::= "a"{5000000}', ["repetition count"]),
    "choices 100k": ("choices", [f"c{i}" for i in range(100_000)], ["number of choices is 100,000"]),
    "choices 1 MB": ("choices", ["x" * 1_000_000], ["size in bytes"]),
}


@pytest.mark.parametrize("name", list(OVER_LIMIT))
def test_over_limit_specs_are_refused_before_compiling(backend, name):
    kind, spec, words = OVER_LIMIT[name]
    with pytest.raises(ValueError) as err:
        backend.compile(kind, spec)
    message = str(err.value)
    assert f"{kind} is too large" in message
    for w in words:
        assert w in message


# Classic catastrophic-backtracking regexes and huge counts: both backends build automata (or
# derivatives), not a backtracking matcher, so these compile at once; a few tokens then run
# through the matcher.
BOUNDED = {
    "(a*)*b": ("regex", r"(a*)*b"),
    "(a|aa)+$": ("regex", r"(a|aa)+$"),
    "(x+x+)+y": ("regex", r"(x+x+)+y"),
    "a{1000000}": ("regex", r"a{1000000}"),
    "(a{1000}){1000}": ("regex", r"(a{1000}){1000}"),
    "(a|b){1000}c{1000}": ("regex", r"(a|b){1000}c{1000}"),
    "nested groups 128": ("regex", "(" * 128 + "a" + ")" * 128),
    "json pattern (a|aa)+$": ("json_schema", {"type": "string", "pattern": "^(a|aa)+$"}),
    "json minItems 1M": ("json_schema", {"type": "array", "items": {"type": "integer"}, "minItems": 1_000_000}),
    "json $ref loop": ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                       "$ref": "#/$defs/a"}),
    "ebnf left recursion": ("ebnf", 'root ::= root "a" | "a"'),
    "ebnf a{1000000}": ("ebnf", 'root ::= "a"{1000000}'),
    "choices 4096": ("choices", [f"choice {i}" for i in range(4096)]),
}


@pytest.mark.parametrize("name", list(BOUNDED))
def test_catastrophic_looking_specs_compile_or_fail_cleanly(backend, pool, name):
    kind, spec = BOUNDED[name]
    outcome = _outcome(backend, pool, kind, spec, steps=8)
    # a spec with no finite text (the $ref loop) is refused before compiling (limits.check_spec)
    assert outcome == "ok" or outcome.startswith((f"cannot compile {kind}:", f"{kind} accepts no finite text"))


def test_limits_admit_what_they_promise():
    limits = SpecLimits()
    check_spec("json_schema", json.dumps(_nested_object(63)), limits)  # 127 levels
    check_spec("json_schema", json.dumps({"enum": list(range(4096))}), limits)
    check_spec("regex", r"\{99999999\}" + "[(]" * 200, limits)  # an escaped brace, parentheses in a class
    check_spec("ebnf", 'root ::= "((((" [(] # ((((\n', SpecLimits(max_nesting=1))
    with pytest.raises(ValueError, match="--grammar-max-nesting"):
        check_spec("json_schema", json.dumps(_nested_object(64)), limits)  # 129 levels


def test_a_failed_compile_is_cached(xgr):
    spec = {"type": "integer", "minimum": 10**300}  # xgrammar refuses it while compiling
    with pytest.raises(ValueError) as first:
        xgr.compile("json_schema", spec)
    key = ("json_schema", json.dumps(spec, separators=(",", ":")))
    assert xgr._cache[key] == CompileFailure(str(first.value))
    with pytest.raises(ValueError) as second:
        xgr.compile("json_schema", spec)
    assert str(second.value) == str(first.value)


def _service(tokenizer, width: int, **options: Any) -> GrammarService:
    return GrammarService(tokenizer, width, [tokenizer.eos_token_id], ConstraintConfig(**options))


def test_a_compile_past_the_time_limit_fails_its_request_and_is_remembered(smol_tokenizer, width):
    # 1,000 optional properties take seconds to compile (docs/reliability.md); the limit is 0.05 s
    slow = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    service = _service(smol_tokenizer, width, grammar_compile_timeout=0.05, grammar_compile_workers=1,
                       grammar_backend="xgrammar")  # llguidance compiles this one in milliseconds
    try:
        with pytest.raises(ValueError) as err:
            service.submit("json_schema", slow).result()
        assert str(err.value) == ("constrained decoding: cannot compile json_schema: grammar compile exceeded "
                                  "0.05 s (server option --grammar-compile-timeout)")
        # the one compile slot went to the next compile, while the slow one may still run on
        assert service.submit("regex", "[ab]{3}").result().kind == "regex"
        # the same spec again: the remembered failure, no second compile
        key = ("json_schema", json.dumps(slow, separators=(",", ":")))
        assert isinstance(service.backend._cache[key], CompileFailure)
        with pytest.raises(ValueError) as again:
            service.submit("json_schema", slow).result()
        assert str(again.value) == str(err.value)
    finally:
        service.shutdown()


def test_an_over_limit_spec_is_refused_at_submit(smol_tokenizer, width):
    service = _service(smol_tokenizer, width, grammar_max_enum=3)
    try:
        with pytest.raises(ValueError, match=r"^constrained decoding: choices is too large: the number of choices "
                                             r"is 4, the limit is 3 \(server option --grammar-max-enum\)$"):
            service.submit("choices", ["a", "b", "c", "d"])
        assert service.submit("choices", ["a", "b", "c"]).result().kind == "choices"
    finally:
        service.shutdown()


@pytest.mark.parametrize("kind,spec", [("regex", "a\ud800"), ("ebnf", 'root ::= "\udfff"'), ("choices", ["ok", "\ud83d"]),
                                       ("json_schema", '{"const": "\\ud800"}')])
def test_lone_surrogates_are_named(backend, kind, spec):
    # JSON text may carry "\ud800" escapes that decode to half a UTF-16 pair: no UTF-8 exists for it
    with pytest.raises(ValueError, match=rf"^{kind} is not valid Unicode text: it holds the lone surrogate U\+D"):
        backend.compile(kind, spec)


def test_a_backtracking_pattern_property_check_is_bounded(xgr):
    # schema_check tests property names against patternProperties. With Python's `re`, this one
    # backtracked for hours (~2^60 steps) holding the GIL, so no other thread of the engine
    # process (step loop, compile watchdog) ran meanwhile; now the search stops after 0.1 s.
    name = "a" * 60 + "b"
    schema = {"type": "object", "properties": {name: {"type": "integer"}},
              "patternProperties": {"^(a|aa)+$": {"type": "string"}}}
    with pytest.raises(ValueError, match=f"property '{name}' also matches patternProperties"):
        xgr.compile("json_schema", schema)  # an unanswered search counts as a match
