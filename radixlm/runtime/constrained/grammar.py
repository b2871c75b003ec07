"""Grammar backends: compile a constraint once, then drive one matcher per request.

The seam the scheduler sees (see docs/DESIGN.md, "Key seams"):
``backend.compile(kind, spec) -> Grammar`` (cached by (kind, spec)); ``Grammar.new_matcher()``
gives a matcher with ``fill_mask(bitmask_row)``, ``accept(token)``, ``rollback(n)``,
``forced_text()``, ``is_completed()`` and ``is_terminated()``. The backends by name are in
``registry``. Matchers hold plain ints; the bitmask row they fill is
any int32 CPU array (torch or numpy) of ``bitmask_width(vocab_size)`` words, bit ``t % 32`` of
word ``t // 32`` set when token ``t`` is allowed. The grammar engine is imported lazily, so
importing this module pulls in no torch (xgrammar itself imports torch when first used).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from radixlm.runtime.constrained import structural_tag
from radixlm.runtime.constrained.finite_schema import finite_schema
from radixlm.runtime.constrained.limits import NoFiniteText, SpecLimits, check_spec, grammar_bounds
from radixlm.runtime.constrained.schema_check import UnsupportedSchema, prepare_json_schema
from radixlm.runtime.constrained.tokenizer_info import TokenizerVocab

__all__ = [
    "GRAMMAR_KINDS",
    "CachedGrammarBackend",
    "Grammar",
    "GrammarBackend",
    "GrammarConfig",
    "GrammarMatcher",
    "XGrammarBackend",
    "accept_in_turn",
    "accept_run",
    "accept_tokens",
    "bitmask_width",
    "choices_to_ebnf",
    "fill_masks",
    "mask_pointer",
    "normalize_spec",
]

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "choices", "structural_tag")


def bitmask_width(vocab_size: int) -> int:
    """Number of int32 words in one token-bitmask row."""
    return (vocab_size + 31) // 32


def mask_pointer(mask: Any, width: int, ndim: int = 1) -> int:
    """Address of a C-contiguous int32 CPU array (torch or numpy) of ``ndim`` dimensions (1: one
    row, 2: rows) whose rows are ``width`` words; ValueError naming what is wrong."""
    if str(mask.dtype) not in ("int32", "torch.int32"):
        raise ValueError(f"bitmask must be int32, got {mask.dtype}")
    if hasattr(mask, "data_ptr"):
        ok, ptr = mask.is_contiguous() and mask.device.type == "cpu", mask.data_ptr()
    else:
        ok, ptr = mask.flags.c_contiguous, mask.ctypes.data
    if not ok or mask.ndim != ndim or mask.shape[-1] != width:
        raise ValueError(f"bitmask must be a contiguous {ndim}-D CPU array of rows of {width} int32 words")
    return int(ptr)


@dataclass(frozen=True)
class GrammarConfig:
    """How constraints compile. Compact JSON separators by default so that forced runs
    (``{"name":"``, ``","age":``) are as long as possible for jump-forward."""

    json_separators: tuple[str, str] = (",", ":")
    json_any_whitespace: bool = False
    # Strict: no properties/items beyond those the schema names (what generation wants).
    json_strict: bool = True
    json_any_order: bool = False
    cache_size: int = 1024
    compile_threads: int = 1
    fill_threads: int = 1  # llguidance's pool that fills a step's masks together
    limits: SpecLimits = SpecLimits()  # checked before compiling (radixlm.runtime.constrained.limits)
    # A json_schema the llguidance backend refuses is compiled by xgrammar when it is installed
    # (it enforces exactly what it compiles); off for a backend on its own (tests, benchmarks).
    fallback: bool = False

    def __post_init__(self) -> None:
        if len(self.json_separators) != 2:
            raise ValueError("json_separators must be (item_separator, key_separator)")
        if self.cache_size < 1:
            raise ValueError("cache_size must be >= 1")
        if self.compile_threads < 1:
            raise ValueError("compile_threads must be >= 1")
        if self.fill_threads < 1:
            raise ValueError("fill_threads must be >= 1")


class GrammarMatcher(Protocol):
    """Per-request grammar state: every call the engine makes on a matcher. A backend may add
    ``allows(token) -> bool`` (whether the mask would allow ``token``, the state unchanged; False
    is always safe): greedy rows on the CPU then test the drawn token instead of masking first;
    and ``accept_many(tokens) -> int`` (accept in order until one is refused; how many were taken)
    for jump-forward's runs of tokens (:func:`accept_run`); and ``only_stop_next() -> bool``
    (True when the text is complete and the grammar allows no more of it, so only a stop token
    may follow; False is always safe): the engine then ends the output without filling a mask
    to find out."""

    def fill_mask(self, bitmask_row: Any) -> bool:
        """Fill ``bitmask_row`` with the tokens allowed next; False when every token is allowed."""
        ...

    def accept(self, token: int) -> bool:
        """Advance over ``token``; False (state unchanged) when the grammar refuses it."""
        ...

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        ...

    def forced_text(self, max_chars: int | None = None) -> str:
        """The text the grammar forces next, at most ``max_chars`` characters ('' when none)."""
        ...

    def is_completed(self) -> bool:
        """True once the text so far is a complete match (a stop token may follow)."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar accepts nothing more (a stop token was accepted)."""
        ...


def fill_masks(matchers: Sequence[GrammarMatcher], bitmask: Any, rows: Sequence[int]) -> list[bool | Exception]:
    """Fill row ``rows[i]`` of ``bitmask`` for ``matchers[i]``: all of one backend's rows at once
    where it has a batch fill (parallel threads, the GIL released), else row by row. Entry i:
    whether the row masks anything, or the exception its matcher raised (only its row fails)."""
    out: list[bool | Exception] = [False] * len(matchers)
    for cls, idx in _by_type(matchers).items():
        batch = getattr(cls, "fill_batch", None)
        got = batch([matchers[i] for i in idx], bitmask, [rows[i] for i in idx]) if batch and len(idx) > 1 else None
        for j, i in enumerate(idx):
            out[i] = got[j] if got is not None else _call(matchers[i].fill_mask, bitmask[rows[i]])
    return out


def accept_tokens(matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool | Exception]:
    """Advance ``matchers[i]`` over ``tokens[i]``, a backend's matchers at once where it can.
    Entry i: whether the grammar took the token, or the exception its matcher raised."""
    if len(matchers) == 1:  # (a batch of one, as at bs1: no grouping, no call between)
        try:
            return [bool(matchers[0].accept(tokens[0]))]
        except Exception as e:  # noqa: BLE001 - a grammar-engine failure is its own row's
            return [e]
    out: list[bool | Exception] = [False] * len(matchers)
    for cls, idx in _by_type(matchers).items():
        batch = getattr(cls, "accept_batch", None)
        got = batch([matchers[i] for i in idx], [tokens[i] for i in idx]) if batch and len(idx) > 1 else None
        for j, i in enumerate(idx):
            out[i] = got[j] if got is not None else _call(matchers[i].accept, tokens[i])
    return out


def accept_run(matcher: GrammarMatcher, tokens: Sequence[int]) -> int:
    """Advance ``matcher`` over ``tokens`` in order until the grammar refuses one; how many it
    took (in one call where the backend has ``accept_many``)."""
    many = getattr(matcher, "accept_many", None)
    return int(many(tokens)) if many is not None else accept_in_turn(matcher.accept, tokens)


def accept_in_turn(accept: Callable[[int], bool], tokens: Sequence[int]) -> int:
    """Call ``accept`` on each token in order until it refuses one; how many it took."""
    for i, t in enumerate(tokens):
        if not accept(t):
            return i
    return len(tokens)


def _by_type(matchers: Sequence[GrammarMatcher]) -> dict[type, list[int]]:
    groups: dict[type, list[int]] = {}
    for i, m in enumerate(matchers):
        groups.setdefault(type(m), []).append(i)
    return groups


def _call(fn: Any, arg: Any) -> bool | Exception:
    try:
        return bool(fn(arg))
    except Exception as e:  # noqa: BLE001 - a grammar-engine failure is its own row's
        return e


class Grammar(Protocol):
    """A compiled constraint, shared by all requests that use the same (kind, spec). ``backend``:
    the grammar engine that compiled it (another than the configured one after a fallback)."""

    kind: str
    vocab_size: int
    backend: str

    def new_matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    """Compiles constraints for one tokenizer vocabulary; the registry names the implementations."""

    name: str
    config: GrammarConfig

    def compile(self, kind: str, spec: Any) -> Grammar:
        """The (cached) grammar for ``(kind, spec)``; ValueError naming what is wrong."""
        ...

    def remember_failure(self, kind: str, spec: Any, message: str) -> None:
        """Cache ``message`` as the outcome of compiling ``(kind, spec)``."""
        ...

    def cached(self, kind: str, spec: Any) -> Grammar | None:
        """The grammar for ``(kind, spec)`` if it is cached; ValueError if its compile failed;
        None when it must be compiled."""
        ...


def _json_dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choices_to_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF grammar that accepts exactly one of ``choices``."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


_TOO_DEEP = "json_schema is too large: it nests too deeply to read (objects and arrays inside one another)"


def normalize_spec(kind: str, spec: Any) -> tuple[Hashable, Any]:
    """Validate a user constraint; return (cache key, normalized spec).

    json_schema → its compact JSON text (property order kept: it is the generation order);
    regex / ebnf → the string; choices → a tuple of distinct strings in the given order.
    """
    if kind not in GRAMMAR_KINDS:
        raise ValueError(f"unknown constraint kind {kind!r}; expected one of {GRAMMAR_KINDS}")
    if kind == "json_schema":
        if isinstance(spec, type) and hasattr(spec, "model_json_schema"):
            schema = spec.model_json_schema()
        elif isinstance(spec, str):
            try:
                schema = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError(_TOO_DEEP) from None
        elif isinstance(spec, dict):
            schema = spec
        else:
            raise ValueError(
                "json_schema must be a dict, a JSON string or a Pydantic model class, "
                f"got {type(spec).__name__}"
            )
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        try:
            text = _json_dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"json_schema is not JSON-serializable: {e}") from None
        except RecursionError:
            raise ValueError(_TOO_DEEP) from None
        return (kind, text), text
    if kind == "structural_tag":
        text = structural_tag.normalize(spec)
        return (kind, text), text
    if kind in ("regex", "ebnf"):
        if not isinstance(spec, str):
            raise ValueError(f"{kind} must be a string, got {type(spec).__name__}")
        if not spec:
            raise ValueError(f"{kind} must not be empty")
        return (kind, spec), spec
    # choices
    if isinstance(spec, (str, bytes)) or not hasattr(spec, "__iter__"):
        raise ValueError(f"choices must be a list of strings, got {type(spec).__name__}")
    items = list(spec)
    if not items:
        raise ValueError("choices must not be empty")
    for c in items:
        if not isinstance(c, str):
            raise ValueError(f"choices must be strings, got {type(c).__name__}: {c!r}")
    norm = tuple(dict.fromkeys(items))
    return (kind, norm), norm


_XGR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")
_XGR_CHECK = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def _clean_engine_error(err: BaseException) -> str:
    msg = str(err).strip()
    msg = _XGR_PREFIX.sub("", msg)
    msg = _XGR_CHECK.sub("", msg)
    return msg.strip() or type(err).__name__


class TokenBan:
    """Tokens a grammar must never allow, whatever its engine says, applied to mask rows.

    xgrammar lets a raw control character (a tab, say) into a JSON string that has a length
    limit or a pattern; JSON forbids those, so json_schema grammars ban every token holding a
    byte below 0x20 other than newline and carriage return (which xgrammar never puts inside a
    string, and which "any" whitespace needs between values)."""

    __slots__ = ("ids", "_words", "_keep", "_torch")

    def __init__(self, ids: frozenset[int]) -> None:
        self.ids = ids
        words: dict[int, int] = {}
        for t in ids:
            words[t // 32] = words.get(t // 32, 0) | (1 << (t % 32))
        self._words = np.array(sorted(words), dtype=np.int64)
        # int32 words whose bits are 1 except the banned ones
        self._keep = np.array([~words[w] & 0xFFFFFFFF for w in sorted(words)], dtype=np.uint32).view(np.int32)
        self._torch: tuple[Any, Any] | None = None

    def apply(self, row: Any) -> None:
        """Clear the banned tokens' bits in ``row`` (numpy or torch int32, 1-D)."""
        if not len(self._words):
            return
        if not isinstance(row, np.ndarray) and getattr(row, "device", None) is not None and row.device.type == "cpu":
            row = row.numpy()  # the same memory; numpy's fancy indexing is ~10x cheaper than torch's
        if isinstance(row, np.ndarray):
            row[self._words] &= self._keep
            return
        if self._torch is None:
            import torch

            self._torch = (torch.from_numpy(self._words), torch.from_numpy(self._keep))
        words, keep = self._torch
        row[words] &= keep

    @classmethod
    def json_control_bytes(cls, decoded: Sequence[bytes]) -> TokenBan:
        bad = set(range(0x20)) - {0x0A, 0x0D}
        return cls(frozenset(t for t, b in enumerate(decoded) if bad.intersection(b)) | _surrogate_ids(decoded))

    @classmethod
    def surrogates(cls, decoded: Sequence[bytes]) -> TokenBan:
        return cls(_surrogate_ids(decoded))


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def _surrogate_ids(decoded: Sequence[bytes]) -> frozenset[int]:
    return frozenset(t for t, b in enumerate(decoded) if _SURROGATE.search(b))


@dataclass(frozen=True)
class ByteRules:
    """What a grammar engine gets wrong at the byte level, fixed around its matcher.

    xgrammar accepts the UTF-8 encoding of surrogates (ED A0..BF ..), which is not UTF-8: the
    detokenized text would hold U+FFFD there (one per byte), breaking lengths and patterns.
    Tokens holding such a sequence are banned (``ban``); after a token that ends in a lone
    0xED, tokens starting with a byte A0..BF are (``after_ed``)."""

    ban: TokenBan
    after_ed: TokenBan
    ends_ed: frozenset[int]

    @classmethod
    def build(cls, decoded: Sequence[bytes], ban: TokenBan) -> ByteRules:
        return cls(ban, TokenBan(frozenset(t for t, b in enumerate(decoded) if b and 0xA0 <= b[0] <= 0xBF)),
                   frozenset(t for t, b in enumerate(decoded) if b.endswith(b"\xed")))

_XGR_BATCH: Any = None


def _xgrammar_batch() -> Any:
    """xgrammar's BatchGrammarMatcher (its own thread pool), made on first use."""
    global _XGR_BATCH
    if _XGR_BATCH is None:
        import xgrammar

        _XGR_BATCH = xgrammar.BatchGrammarMatcher()
    return _XGR_BATCH


class XGrammarMatcher:
    """One request's xgrammar matcher state."""

    __slots__ = ("_m", "vocab_size", "_rules", "_ends_ed", "_jump_safe")

    def __init__(self, matcher: Any, vocab_size: int, rules: ByteRules | None = None, jump_safe: bool = True) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self._rules = rules
        self._jump_safe = jump_safe  # limits.grammar_bounds proved the engine's forced-text walk ends
        self._ends_ed: list[bool] = [False]  # per accepted token: the output ends in a lone 0xED

    def fill_mask(self, bitmask_row: Any) -> bool:
        """Write the allowed next tokens into ``bitmask_row`` (1-D int32, CPU).

        Returns False when every token is allowed (the row need not be applied)."""
        need = bool(self._m.fill_next_token_bitmask(bitmask_row.reshape(1, -1)))
        if self._rules is None:
            return need
        if not need:
            bitmask_row[...] = -1
        self._apply_rules(bitmask_row)
        return True

    def _apply_rules(self, bitmask_row: Any) -> None:
        if self._rules is not None:
            self._rules.ban.apply(bitmask_row)
            if self._ends_ed[-1]:
                self._rules.after_ed.apply(bitmask_row)

    @staticmethod
    def fill_batch(matchers: Sequence[XGrammarMatcher], bitmask: Any, rows: Sequence[int]) -> list[bool] | None:
        """fill_mask for many matchers in xgrammar's thread pool (every row counts as masking);
        None when the batch call fails, so the caller finds the failing row one by one."""
        try:
            _xgrammar_batch().batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, list(rows))
        except Exception:  # noqa: BLE001 - retried row by row, where the error lands on its own row
            return None
        for m, r in zip(matchers, rows):
            m._apply_rules(bitmask[r])
        return [True] * len(matchers)

    @staticmethod
    def accept_batch(matchers: Sequence[XGrammarMatcher], tokens: Sequence[int]) -> list[bool] | None:
        """accept for many matchers in xgrammar's thread pool; None when the batch call fails."""
        out = [m._allowed_by_rules(t) for m, t in zip(matchers, tokens)]
        idx = [i for i, ok in enumerate(out) if ok]
        try:
            took = _xgrammar_batch().batch_accept_token([matchers[i]._m for i in idx], [int(tokens[i]) for i in idx])
        except Exception:  # noqa: BLE001 - retried row by row
            return None
        for i, ok in zip(idx, took):
            out[i] = bool(ok)
            if ok:
                matchers[i]._took(tokens[i])
        return out

    def _allowed_by_rules(self, token: int) -> bool:
        rules = self._rules
        return rules is None or not (token in rules.ban.ids or (self._ends_ed[-1] and token in rules.after_ed.ids))

    def _took(self, token: int) -> None:
        self._ends_ed.append(self._rules is not None and token in self._rules.ends_ed)

    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        if not self._allowed_by_rules(token) or not self._m.accept_token(int(token)):
            return False
        self._took(token)
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if n < 0:
            raise ValueError(f"rollback count must be >= 0, got {n}")
        if n:
            self._m.rollback(n)
            del self._ends_ed[-n:]

    def forced_text(self, max_chars: int | None = None) -> str:
        """The text the grammar forces next ('' when the next character is a choice), at most
        ``max_chars`` characters; '' for a grammar whose forced text is not known to be finite."""
        if not self._jump_safe or max_chars == 0:
            return ""
        text: str = self._m.find_jump_forward_string()
        return text if max_chars is None else text[:max_chars]

    def is_completed(self) -> bool:
        """True once the text so far is a complete match (a stop token may follow)."""
        return bool(self._m.is_completed())

    def is_terminated(self) -> bool:
        """True once a stop token was accepted at a point where the grammar may end."""
        return bool(self._m.is_terminated())


class XGrammarGrammar:
    __slots__ = ("kind", "vocab_size", "_compiled", "_xgr", "_rules", "jump_safe")
    backend = "xgrammar"

    def __init__(self, kind: str, compiled: Any, vocab_size: int, xgr: Any, rules: ByteRules | None = None,
                 jump_safe: bool = True) -> None:
        self.kind = kind
        self.vocab_size = vocab_size
        self._compiled = compiled
        self._xgr = xgr
        self._rules = rules
        self.jump_safe = jump_safe

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(self._compiled), self.vocab_size, self._rules,
                               self.jump_safe)


@dataclass(frozen=True)
class CompileFailure:
    """A cached compile error."""

    message: str


def _grammar_or_raise(result: Grammar | CompileFailure) -> Grammar:
    if isinstance(result, CompileFailure):
        raise ValueError(result.message)
    return result


class CachedGrammarBackend:
    """Base of the grammar backends: validates specs and keeps an LRU cache of compiled
    grammars keyed by (kind, spec). Thread-safe; subclasses implement ``_compile_uncached``."""

    name = ""

    def __init__(self, vocab: TokenizerVocab, config: GrammarConfig | None = None) -> None:
        self.vocab = vocab
        self.config = config or GrammarConfig()
        self._cache: OrderedDict[Hashable, Grammar | CompileFailure] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    def compile(self, kind: str, spec: Any) -> Grammar:
        """Compile (or fetch from the cache) the grammar for ``(kind, spec)``.

        Raises ValueError naming what is wrong or unsupported. A failed compile is cached too:
        the same spec fails again at once, with the same message."""
        key, norm = normalize_spec(kind, spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return _grammar_or_raise(hit)
        check_spec(kind, norm, self.config.limits)
        # Compiled outside the lock: two threads may compile one key; the first one kept wins.
        result: Grammar | CompileFailure
        try:
            if kind == "json_schema":
                result = self._compile_uncached(kind, self._enforceable_schema(norm))
            elif kind == "structural_tag":
                result = self._compile_uncached(kind, self._enforceable_tag(norm))
            else:
                result = self._compile_uncached(kind, norm)
        except NoFiniteText as e:  # no engine compiles it
            result = CompileFailure(str(e))
        except ValueError as e:
            result = self._fallback(kind, norm, str(e)) or CompileFailure(str(e))
        return _grammar_or_raise(self._keep(key, result))

    def _fallback(self, kind: str, norm: Any, error: str) -> Grammar | None:
        """A grammar from another engine for a spec this one refused with ``error``; None: none."""
        return None

    def cached(self, kind: str, spec: Any) -> Grammar | None:
        """The grammar for ``(kind, spec)`` if it is cached (ValueError if its compile failed),
        else None: a request whose grammar is known starts without a trip to the compile pool."""
        key, _ = normalize_spec(kind, spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                return None
            self._cache.move_to_end(key)
        return _grammar_or_raise(hit)

    def check_schema(self, schema: Any) -> Any:
        """The schema to compile for ``schema`` (parsed JSON): as is, or narrowed, or
        UnsupportedSchema naming what this backend's engine cannot enforce exactly. Each backend
        refuses only what its own engine gets wrong; this default refuses nothing."""
        return schema

    def _enforceable_schema(self, text: str) -> str:
        schema = json.loads(text)
        try:
            checked = self._checked(schema)
        except NoFiniteText:
            raise  # it names the kind
        except (UnsupportedSchema, ValueError) as e:
            raise ValueError(f"cannot compile json_schema: {e}") from None
        return text if checked is schema else _json_dumps(checked)

    def _enforceable_tag(self, text: str) -> str:
        """A structural tag whose structures' schemas went through ``check_schema``."""
        data = json.loads(text)
        for i, s in enumerate(data["structures"]):
            try:
                s["schema"] = self._checked(s["schema"])
            except (UnsupportedSchema, ValueError) as e:
                raise ValueError(f"cannot compile structural_tag: structures[{i}].schema: {e}") from None
        return _json_dumps(data)

    def _checked(self, schema: Any) -> Any:
        """The schema to compile: the enum of the values it accepts when it lists them all
        (:func:`finite_schema`, exact whatever else it says), then ``check_schema``."""
        return self.check_schema(finite_schema(schema, self.config.limits.max_enum) or schema)

    def remember_failure(self, kind: str, spec: Any, message: str) -> None:
        """Cache ``message`` as the outcome of compiling ``(kind, spec)`` (a compile that ran
        past its time limit), unless a result is cached already."""
        self._keep(normalize_spec(kind, spec)[0], CompileFailure(message))

    def _keep(self, key: Hashable, result: Grammar | CompileFailure) -> Grammar | CompileFailure:
        with self._lock:
            result = self._cache.setdefault(key, result)
            self._cache.move_to_end(key)
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
        return result

    def _compile_uncached(self, kind: str, norm: Any) -> Grammar:
        raise NotImplementedError


class XGrammarBackend(CachedGrammarBackend):
    """Compiles constraints with xgrammar against a :class:`TokenizerVocab`. Thread-safe."""

    name = "xgrammar"

    def __init__(self, vocab: TokenizerVocab, config: GrammarConfig | None = None) -> None:
        import xgrammar as xgr  # lazy: pulls in torch

        super().__init__(vocab, config)
        self._xgr = xgr
        info = xgr.TokenizerInfo(
            list(vocab.decoded),
            xgr.VocabType.RAW,
            vocab_size=vocab.vocab_size,
            stop_token_ids=list(vocab.stop_ids),
            add_prefix_space=False,
        )
        self.tokenizer_info = info
        self._json_rules = ByteRules.build(vocab.decoded, TokenBan.json_control_bytes(vocab.decoded))
        self._text_rules = ByteRules.build(vocab.decoded, TokenBan.surrogates(vocab.decoded))
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=self.config.compile_threads, cache_enabled=False
        )

    def _compile_uncached(self, kind: str, norm: Any) -> XGrammarGrammar:
        rules = self._json_rules if kind == "json_schema" else self._text_rules
        compiled = self._compile_engine(kind, norm)
        # A grammar that can never end is refused; one whose forced text may be endless gets no jump-forward.
        bounds = grammar_bounds(kind, compiled.grammar.serialize_json())
        return XGrammarGrammar(kind, compiled, self.vocab_size, self._xgr, rules, bounds.jump_safe)

    def check_schema(self, schema: Any) -> Any:
        """Refuse what xgrammar only approximates, or narrow it to what xgrammar enforces (schema_check.py)."""
        return prepare_json_schema(schema)

    def json_grammar_size(self, norm: str) -> int:
        """How many expressions xgrammar's grammar for a normalized json_schema holds, found in
        milliseconds before compiling it (the compile's time and memory grow with it, and with
        the vocabulary); ValueError when the schema is refused."""
        cfg = self.config
        try:
            grammar = self._xgr.Grammar.from_json_schema(
                self._enforceable_schema(norm), any_whitespace=cfg.json_any_whitespace, separators=cfg.json_separators,
                strict_mode=cfg.json_strict, any_order=cfg.json_any_order)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"cannot compile json_schema: {_clean_engine_error(e)}") from None
        return len(json.loads(grammar.serialize_json())["grammar_expr_indptr"])

    def _compile_engine(self, kind: str, norm: Any) -> Any:
        c = self._compiler
        cfg = self.config
        try:
            if kind == "json_schema":
                return c.compile_json_schema(
                    norm,
                    any_whitespace=cfg.json_any_whitespace,
                    separators=cfg.json_separators,
                    strict_mode=cfg.json_strict,
                    any_order=cfg.json_any_order,
                )
            if kind == "regex":
                return c.compile_regex(norm)
            if kind == "ebnf":
                return c.compile_grammar(norm)
            if kind == "structural_tag":
                return c.compile_structural_tag(_xgrammar_tag(norm))
            return c.compile_grammar(choices_to_ebnf(norm))
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"cannot compile {kind}: {_clean_engine_error(e)}") from None


def _xgrammar_tag(norm: str) -> dict[str, Any]:
    """A normalized structural tag in xgrammar's own (triggered_tags) form."""
    structures, triggers = structural_tag.load(norm)
    tags = [{"type": "tag", "begin": s.begin, "content": {"type": "json_schema", "json_schema": s.schema},
             "end": s.end} for s in structures]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
