"""The llguidance grammar backend: JSON Schema, regexes, Lark/GBNF grammars and choices through
llguidance's Earley parser over a token trie.

- The tokenizer is the Hugging Face Rust tokenizer (``TokenizerVocab.hf_json``), checked to
  agree with our :class:`TokenizerVocab` token by token: special and added tokens and padding ids
  are special to llguidance and never allowed. The first stop id is llguidance's EOS, allowed
  exactly where the grammar may end, and the other stop ids follow its bit. A stop token is never
  passed to llguidance: it ends the matcher here (``is_terminated``) and can be rolled back.
- Every constraint becomes one Lark grammar (``%json {...}`` for a schema, ``/.../`` for a regex)
  compiled with ``no_forcing``: a mask allows every token the grammar allows, and ``accept``
  takes exactly those.
- json_schema → llguidance's own JSON Schema compiler, with our separators and no other
  whitespace unless configured; it refuses by name what it does not enforce (``not``,
  ``uniqueItems``, an overlapping ``oneOf``...). Before that, :func:`prepare_schema` drops the
  formats llguidance does not enforce and refuses what it gets wrong; in strict mode
  (``GrammarConfig.json_strict``, what generation uses) :func:`close_objects` allows no
  properties beyond those a schema names, as xgrammar's strict mode does.
- regex → llguidance's regex (Rust ``regex`` syntax, the whole output matches; ``^``/``$`` at
  the ends are allowed); ebnf → a Lark grammar as llguidance reads it (rule ``start``), or a
  GBNF grammar (rule ``root``, llama.cpp/xgrammar style) converted to Lark by llguidance's
  converter; choices → one Lark terminal, an alternation of string literals.
- Masks: llguidance writes the row itself (same layout: bit ``t % 32`` of int32 word ``t // 32``),
  one matcher at a time or a batch in its thread pool with the GIL released (``fill_batch``).
- Forced text: llguidance's forced bytes (bounded by its per-step item limit), cut to whole
  UTF-8 characters.

llguidance is imported lazily, when ``LLGuidanceBackend`` is built.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import re
import threading
from collections.abc import Sequence
from typing import Any

from radixlm.runtime.constrained import structural_tag
from radixlm.runtime.constrained.grammar import (
    CachedGrammarBackend,
    Grammar,
    GrammarConfig,
    XGrammarBackend,
    accept_in_turn,
    bitmask_width,
    mask_pointer,
)
from radixlm.runtime.constrained.productive import check_lark, productive_schema
from radixlm.runtime.constrained.schema_check import UnsupportedSchema, exclude_each_other
from radixlm.runtime.constrained.tokenizer_info import TokenizerVocab

__all__ = ["FALLBACK_MAX_EXPRESSIONS", "KNOWN_FORMATS", "LLGuidanceBackend", "LLGuidanceGrammar", "LLGuidanceMatcher",
           "choices_to_lark", "close_objects", "prepare_schema", "refers_to_special_tokens"]

log = logging.getLogger(__name__)

# llguidance's (and prepare_schema's) words for a schema construct it does not compile, where
# xgrammar may: no fallback for its resource limits (items in a row, grammar size, lexer fuel),
# which xgrammar would only take longer and more memory over.
_UNSUPPORTED = re.compile(r"Unimplemented keys|not supported|[Uu]nsatisfiable|not disjoint|circular references|"
                          r"Unable to determine|intersection stack")
# The largest xgrammar grammar (expressions) a fallback compiles: its compile time and memory grow
# steeply past a few thousand (docs/machines.md); the MCP schemas a fallback serves are below.
FALLBACK_MAX_EXPRESSIONS = 2048

_REGEX_META = set("\\.+*?()|[]{}^$")
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# The string formats llguidance (1.9) enforces; others it refuses by name. Any other format
# (JSON Schema's "uri-template", "uri-reference", "regex"..., OpenAPI's "byte", "int32",
# Pydantic's "password") is dropped: JSON Schema 2020-12 reads ``format`` as an annotation unless
# a validator is told to assert it, so such a string is any string.
KNOWN_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})
_POSITION = re.compile(r"^at \d+\(\d+\): ")
# Every grammar is Lark with this header. no_forcing: where the grammar forces bytes, the mask
# allows every token the grammar allows, as elsewhere (without it, llguidance allows only the
# tokenizer's own tokens for them); masks then agree with accept() exactly, and jump-forward
# appends forced text in the tokenizer's tokens anyway.
_HEADER = '%llguidance {"no_forcing": true}\n'
_ENDLESS_FORCING = "ff_tokens"  # in llguidance's error when forced text passes its item limit
_DEAD_ENDS = frozenset({"NoExtension", "NoExtensionBias"})  # llguidance's errors for "no token fits"
# What a Lark grammar holds besides rules: string literals, /regexes/ and comments.
_LARK_TEXT = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|#[^\n]*|/(?:\\.|[^/\\\n])+/')


def choices_to_lark(choices: tuple[str, ...]) -> str:
    """A Lark grammar that accepts exactly one of ``choices`` (JSON string literals). One terminal
    (a single lexeme: thousands of alternatives as rules would pass llguidance's row limit)."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def prepare_schema(schema: Any) -> Any:
    """The schema llguidance compiles for ``schema`` (a copy), or UnsupportedSchema for what
    llguidance accepts but cannot enforce. Every (sub)schema is looked at, referenced or not.

    - ``format`` values llguidance does not enforce (``uri-template``, ``byte``, ``int32``...)
      are dropped (llguidance refuses them): a format is an annotation unless a validator is
      told to assert it, so the string is any string. Those it knows it enforces.
    - llguidance lets a key beyond ``properties``/``required`` repeat (``{"b":1,"b":2}``, allowed
      by ``additionalProperties`` or ``patternProperties``) and counts each repeat towards
      ``minProperties``; a validator counts the key once. The required keys are unique, so one
      key more is certain: ``minProperties`` above the required count + 1 is refused where such
      keys are allowed.
    - A ``oneOf`` whose branches provably exclude each other (:func:`exclude_each_other`:
      disjoint types or values, a discriminator property) becomes ``anyOf``, the same set of
      values; llguidance refuses any other ``oneOf`` (it cannot check "exactly one")."""
    schema = copy.deepcopy(schema)
    # local $refs resolve against the root, unless a subschema sets a base of its own
    relative_refs_only = json.dumps(schema).count('"$id"') == (1 if isinstance(schema, dict) and "$id" in schema else 0)
    budget = [10_000]  # comparisons of oneOf branches for the whole schema
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{where}/{i}") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in KNOWN_FORMATS:
            del node["format"]
        least = node.get("minProperties")
        required = node.get("required")
        n_required = len({r for r in required if isinstance(r, str)}) if isinstance(required, list) else 0
        open_keys = node.get("additionalProperties", True) is not False or bool(node.get("patternProperties"))
        if isinstance(least, (int, float)) and not isinstance(least, bool) and least > n_required + 1 and open_keys:
            raise UnsupportedSchema(
                "'minProperties' more than one above the required properties is not supported: llguidance "
                f"counts a repeated key twice, a validator once (at {where or '/'})")
        _dependencies_to_any_of(node)
        _not_to_all_of(node)
        branches = node.get("oneOf")
        if isinstance(branches, list) and "anyOf" not in node and len(branches) <= _MAX_ONE_OF:
            if relative_refs_only and all(exclude_each_other(x, y, schema, budget)
                                          for i, x in enumerate(branches) for y in branches[i + 1:]):
                node["anyOf"] = node.pop("oneOf")  # exclusive branches: "exactly one" is "at least one"
            else:
                groups = _key_groups(node, branches)
                if groups is not None:
                    del node["oneOf"]
                    node["anyOf"] = _exactly_one_group(groups)
        for k, v in node.items():
            if k in _SCHEMA_MAPS and isinstance(v, dict):  # name -> schema: a property "not" is no keyword
                stack.extend((sub, f"{where}/{k}/{name}") for name, sub in v.items())
            elif k not in _DATA_KEYWORDS and isinstance(v, (dict, list)):
                stack.append((v, f"{where}/{k}"))
    return schema


# oneOf branches compared pairwise, or written out pairwise: more are left to llguidance to refuse
_MAX_ONE_OF = 32


def _dependencies_to_any_of(node: dict[str, Any]) -> None:
    """``dependencies`` / ``dependentRequired`` / ``dependentSchemas`` (llguidance has none of
    them) written as what they mean: for each key, it is absent (a property schema ``false``) or
    the keys it needs are present too / the schema it brings holds; appended to ``allOf``."""
    words = [w for w in ("dependencies", "dependentRequired", "dependentSchemas") if isinstance(node.get(w), dict)]
    extra = []
    for word in words:
        for key, dep in node[word].items():
            absent = {"properties": {key: False}}
            if isinstance(dep, list) and all(isinstance(k, str) for k in dep) and word != "dependentSchemas":
                extra.append({"anyOf": [absent, {"required": [key, *dep]}]})
            elif isinstance(dep, (dict, bool)) and word != "dependentRequired":
                extra.append({"anyOf": [absent, {"allOf": [{"required": [key]}, dep]}]})
            else:
                return  # malformed: left for llguidance to report
    for word in words:
        del node[word]
    if extra:
        node["allOf"] = [*node["allOf"], *extra] if isinstance(node.get("allOf"), list) else extra


_JSON_TYPES = ("null", "boolean", "object", "array", "number", "string")
_NOTES = frozenset({"title", "description", "$comment"})


def _not_to_all_of(node: dict[str, Any]) -> None:
    """Two forms of ``not`` (llguidance has none) written as what they mean, in ``allOf``:
    ``{"not": {"required": [keys]}}`` is an object without one of the keys at least (a property
    schema ``false``; a value that is no object passes ``required``, so fails the ``not``);
    ``{"not": {"type": T}}`` is every other type (not for ``integer`` alone: a number that is not
    whole has no type of its own)."""
    neg = node.get("not")
    if not isinstance(neg, dict) or len(set(neg) - _NOTES) != 1:
        return
    if isinstance(neg.get("required"), list) and neg["required"] and all(isinstance(k, str) for k in neg["required"]):
        part: dict[str, Any] = {"type": "object", "anyOf": [{"properties": {k: False}} for k in neg["required"]]}
    elif "type" in neg:
        types = [neg["type"]] if isinstance(neg["type"], str) else neg["type"]
        if not isinstance(types, list) or not all(t in (*_JSON_TYPES, "integer") for t in types):
            return
        if "integer" in types and "number" not in types:
            return
        part = {"type": [t for t in _JSON_TYPES if t not in types]}
        if not part["type"]:
            return  # not any type: nothing passes; llguidance reports the schema as it is
    else:
        return
    del node["not"]
    node["allOf"] = [*node["allOf"], part] if isinstance(node.get("allOf"), list) else [part]


def _key_groups(node: dict[str, Any], branches: list[Any]) -> list[list[str]] | None:
    """The key lists of an object schema's ``oneOf`` whose branches only require keys
    (``{"required": ["radius"]}, {"required": ["length", "width"]}``), or None."""
    if node.get("type") not in ("object", ["object"]) or len(branches) < 2:
        return None
    groups = []
    for b in branches:
        if not isinstance(b, dict) or set(b) - {"required", "title", "description"}:
            return None
        keys = b.get("required")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            return None
        groups.append(list(dict.fromkeys(keys)))
    return groups


def _exactly_one_group(groups: list[list[str]]) -> list[dict[str, Any]]:
    """``anyOf`` branches, one per group: its keys all present, and of every other group at least
    one key absent (a property schema ``false``), which is what ``oneOf`` of the groups' required
    lists means, written without ``not``."""
    return [{"required": keys, "allOf": [{"anyOf": [{"properties": {k: False}} for k in other]}
                                         for j, other in enumerate(groups) if j != i]}
            for i, keys in enumerate(groups)]


_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Beside these, a schema's properties are not all it allows: closing it would refuse valid keys.
_OPEN_BESIDE = frozenset({"additionalProperties", "unevaluatedProperties", "$ref", "$dynamicRef", "allOf", "anyOf",
                          "oneOf", "if", "then", "else", "dependentSchemas", "dependencies"})


def close_objects(schema: Any) -> Any:
    """``schema`` (changed in place) with ``"additionalProperties": false`` on every object
    schema that names its properties and says nothing of others: a model then writes only the
    keys it names, and those it requires (a validator would allow any others). Left open:
    objects that name no properties (a free-form map), a schema beside a ``$ref`` or a combiner
    (``allOf``, ``anyOf``, ``if``...), the parts of an ``allOf``, and the branches of an
    ``anyOf``/``oneOf`` beside properties or inside such a part: there other parts name keys too."""
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, shared = stack.pop()  # shared: another schema names keys of the same object
        if isinstance(node, list):
            stack.extend((v, shared) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        props = node.get("properties")
        if isinstance(props, dict) and props and not shared and not _OPEN_BESIDE & node.keys():
            required = node.get("required")
            for key in required if isinstance(required, list) else ():
                if isinstance(key, str) and key not in props:
                    props[key] = {}  # required but not named: any value, as a validator allows
            node["additionalProperties"] = False
        names_keys = bool(props) or bool(node.get("patternProperties"))
        for key, value in node.items():
            if key in _DATA_KEYWORDS or not isinstance(value, (dict, list)):
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema: a name is no keyword
                stack.extend((v, False) for v in value.values())
            else:
                # the parts of an allOf, and the branches of an anyOf/oneOf beside keys named here or
                # in a schema this one shares its object with, describe the same object
                stack.append((value, key == "allOf" or (key in ("anyOf", "oneOf") and (names_keys or shared))))
    return schema


def refers_to_special_tokens(lark: str) -> bool:
    """Whether a Lark grammar names a token (``<|im_end|>``, ``<[128010]>``): outside literals,
    regexes and comments ``<`` means nothing else in llguidance's Lark."""
    return "<" in _LARK_TEXT.sub("", lark)


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


def _json_options(config: GrammarConfig) -> dict[str, Any]:
    """llguidance's JSON options for our layout: separators are regexes in llguidance."""
    item, key = config.json_separators
    return {"item_separator": _regex_literal(item), "key_separator": _regex_literal(key),
            "whitespace_flexible": config.json_any_whitespace, "coerce_one_of": False, "lenient": False}


def _clean_error(message: str, limit: int = 400) -> str:
    """llguidance's message on one line, without its position in the grammar it built (``at
    1(8):``), the excerpt of that grammar (``  12 | start: ...``), a parser state dump or a backtrace."""
    lines = []
    for line in re.split("<backtrace>|<state>|<non-verbose/>", message)[0].strip().splitlines():
        head = line.strip()
        if "|" in head and head.split("|")[0].strip().isdigit():
            break
        if head and not set(head) <= {"^", " "}:
            lines.append(head)
    text = _POSITION.sub("", " ".join(lines)) or "llguidance error"
    return text if len(text) <= limit else text[:limit] + "..."


def _utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` made of whole UTF-8 characters ('' if it starts mid-character)."""
    for cut in range(len(data), max(len(data) - 4, 0) - 1, -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def _same_vocabulary(tokenizer: Any, vocab: TokenizerVocab) -> None:
    """ValueError unless llguidance's tokenizer has our bytes for every text token and keeps
    every id we never allow (special, added, padding) out of the text."""
    for i, ours in enumerate(vocab.decoded):
        special = tokenizer.is_special_token(i)
        theirs = b"" if special else tokenizer.decode_bytes([i])
        if theirs != ours:
            raise ValueError(f"the llguidance backend reads token {i} as {theirs!r}, the engine as {ours!r}; "
                             "use another grammar backend for this tokenizer")


class _VocabTokens:
    """Our token bytes in the shape llguidance's ``TokenizerWrapper`` reads; text is tokenized by
    the Hugging Face Rust tokenizer the engine uses. Ids never allowed in constrained text are
    special tokens there."""

    def __init__(self, vocab: TokenizerVocab) -> None:
        from tokenizers import Tokenizer

        self._rust = Tokenizer.from_str(vocab.hf_json)
        self.eos_token_id = vocab.stop_ids[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(i for i in range(vocab.vocab_size) if not vocab.decoded[i])
        self.tokens = [t or f"<[{i}]>".encode() for i, t in enumerate(vocab.decoded)]

    def __call__(self, text: str) -> list[int]:
        return list(self._rust.encode(text, add_special_tokens=False).ids)


class LLGuidanceMatcher:
    """One request's state: an llguidance matcher, plus whether a stop token ended it.

    ``allows`` tests a token by taking it (one call into llguidance, not two, since the token it
    allows is nearly always the one accepted next): the token stays taken, unseen, until
    ``accept`` of the same token keeps it; any other call first gives it back (``_settle``).
    (Asking llguidance, while it was warm from the test, what the next calls would ask, the forced
    text and whether the text is complete, cost the test more than it spared them: docs/machines.md;
    docs/benchmarks.md, "Fewer cold calls a step".)"""

    __slots__ = ("_m", "_executor", "vocab_size", "_text", "_stops", "_eos", "_extra_stops", "_accepted",
                 "_terminated", "_tried")

    def __init__(self, matcher: Any, executor: Any, vocab: TokenizerVocab, text_ids: bytes) -> None:
        self._m = matcher
        self._executor = executor
        self.vocab_size = vocab.vocab_size
        self._text = text_ids  # per token id, 1 where llguidance may take it (text, no stop): one lookup a test
        self._stops = frozenset(vocab.stop_ids)
        self._eos = vocab.stop_ids[0]  # the one stop id llguidance knows
        self._extra_stops = vocab.stop_ids[1:]
        self._accepted = 0
        self._terminated = False
        self._tried: int | None = None  # the token ``allows`` took ahead of its ``accept``

    def _settle(self) -> None:
        """Give back a token ``allows`` took that no ``accept`` kept."""
        if self._tried is not None:
            self._tried = None
            if not self._m.rollback(1):
                raise RuntimeError(f"llguidance: rollback failed: {_clean_error(self._m.get_error())}")

    def fill_mask(self, bitmask_row: Any) -> bool:
        """Write the allowed next tokens into ``bitmask_row`` (1-D int32, CPU). Always masks
        (special tokens are never allowed); RuntimeError when llguidance fails."""
        width = bitmask_width(self.vocab_size)
        ptr = mask_pointer(bitmask_row, width)
        self._settle()
        if self._terminated:
            self._only_stops(_words(bitmask_row))
        else:
            self._m.unsafe_compute_mask_ptr(ptr, 4 * width)
            self._finish_row(_words(bitmask_row))
        return True

    def _only_stops(self, row: Any) -> None:
        row[:] = 0
        for s in self._stops:
            row[s // 32] |= _bit(s)

    def _finish_row(self, row: Any) -> None:
        """After llguidance wrote ``row``: raise its error, give the other stop ids EOS's bit."""
        if self._m.is_error():
            if not self._dead_end():
                raise self._failure()
            row[:] = 0  # no token continues the text (llguidance wrote its EOS-only fallback)
            return
        if self._extra_stops and int(row[self._eos // 32]) & _bit(self._eos):
            for s in self._extra_stops:
                row[s // 32] |= _bit(s)

    @staticmethod
    def fill_batch(matchers: Sequence[LLGuidanceMatcher], bitmask: Any,
                   rows: Sequence[int]) -> list[bool | Exception] | None:
        """fill_mask for many matchers in llguidance's thread pool (the GIL released); None when
        the batch call itself fails, so the caller fills row by row."""
        width = bitmask_width(matchers[0].vocab_size)
        try:
            ptr = mask_pointer(bitmask, width, ndim=2)
            for m in matchers:
                m._settle()
            live = [(m._m, r) for m, r in zip(matchers, rows) if not m._terminated]
            if live:
                matchers[0]._executor.unsafe_compute_mask_ptr(live, ptr, 4 * width, int(bitmask.shape[0]))
        except Exception:  # noqa: BLE001 - retried row by row, where the error lands on its own row
            return None
        out: list[bool | Exception] = []
        words = _words(bitmask)
        for m, r in zip(matchers, rows):
            try:
                if m._terminated:
                    m._only_stops(words[r])
                else:
                    m._finish_row(words[r])
                out.append(True)
            except Exception as e:  # noqa: BLE001 - a grammar-engine failure is its own row's
                out.append(e)
        return out

    def allows(self, token: int) -> bool:
        """Whether the mask would allow ``token`` next, the state unchanged as far as any other
        call sees. Stop tokens answer False (the caller masks the row: exact, and rare);
        RuntimeError when llguidance fails."""
        token = int(token)
        tried = self._tried
        if token == tried:
            return True
        if tried is not None:
            self._settle()
        if self._terminated or not (0 <= token < self.vocab_size and self._text[token]):
            return False
        m = self._m
        if m.try_consume_tokens([token]) == 1:
            self._tried = token
            return True
        if m.is_error() and not self._dead_end():
            raise self._failure()
        return False

    def accept(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        token = int(token)
        if token == self._tried:
            self._tried = None
            self._accepted += 1
            return True
        self._settle()
        if self._terminated or not 0 <= token < self.vocab_size:
            return False
        if token in self._stops:
            if not self._m.is_accepting():
                return False
            self._terminated = True
        elif not self._text[token] or self._m.try_consume_tokens([token]) != 1:
            if self._m.is_error() and not self._dead_end():
                raise self._failure()
            return False
        self._accepted += 1
        return True

    def accept_many(self, tokens: Sequence[int]) -> int:
        """Advance over ``tokens`` in order, in one call into llguidance, until the grammar
        refuses one; how many it took."""
        self._settle()
        ids = [int(t) for t in tokens]
        if self._terminated or any(not (0 <= t < self.vocab_size and self._text[t]) for t in ids):
            return accept_in_turn(self.accept, ids)  # stop or special tokens: one at a time
        took = self._m.try_consume_tokens(ids) if ids else 0
        if took < len(ids) and self._m.is_error() and not self._dead_end():
            raise self._failure()
        self._accepted += took
        return took

    def _failure(self) -> RuntimeError:
        """llguidance's error, which ends this request: its matcher is broken from here."""
        error = _clean_error(self._m.get_error())
        if _ENDLESS_FORCING in error:
            return RuntimeError(f"llguidance: the grammar forces text without end from here ({error})")
        return RuntimeError(f"llguidance: {error}")

    def _dead_end(self) -> bool:
        """llguidance stopped where no token continues the text (say the grammar needs a byte no
        token holds): no engine failure, the mask just allows nothing, as xgrammar's would."""
        return _clean_error(self._m.get_error()) in _DEAD_ENDS

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (a stop token included)."""
        if n < 0:
            raise ValueError(f"rollback count must be >= 0, got {n}")
        if n > self._accepted:
            raise ValueError(f"cannot roll back {n} tokens: only {self._accepted} accepted")
        if n == 0:
            return
        self._settle()
        self._accepted -= n
        if self._terminated:
            self._terminated = False
            n -= 1
        if n and not self._m.rollback(n):
            raise RuntimeError(f"llguidance: rollback failed: {_clean_error(self._m.get_error())}")

    def forced_text(self, max_chars: int | None = None) -> str:
        """The text the grammar forces next ('' when the next character is a choice or the output
        ends inside a character), at most ``max_chars`` characters."""
        if self._terminated or max_chars == 0:
            return ""
        if self._tried is not None:  # (asked after every token: no call where nothing is to settle)
            self._settle()
        forced = self._m.compute_ff_bytes()
        if self._m.is_error():
            if self._dead_end():
                return ""
            raise self._failure()
        if not forced:
            return ""
        text = _utf8_prefix(forced)
        return text if max_chars is None else text[:max_chars]

    def is_completed(self) -> bool:
        """True once the text so far is a complete match (a stop token may follow)."""
        if self._terminated:
            return True
        if self._tried is not None:
            self._settle()
        return bool(self._m.is_accepting())

    def only_stop_next(self) -> bool:
        """True when the text is complete and llguidance allows no more of it (it has stopped):
        the mask would allow the stop tokens alone."""
        if self._terminated:
            return False
        self._settle()
        m = self._m
        return bool(m.is_accepting() and m.is_stopped() and not m.is_error())

    def is_terminated(self) -> bool:
        """True once a stop token was accepted at a point where the grammar may end."""
        return self._terminated


def _words(mask: Any) -> Any:
    """The numpy view of a bitmask (torch or numpy, CPU): its per-word reads and writes cost far
    less there than on a torch tensor, for every row of every step (docs/machines.md)."""
    return mask.numpy() if hasattr(mask, "numpy") else mask


def _bit(token: int) -> int:
    """Token ``token``'s bit in its int32 word (bit 31 is the sign)."""
    bit = token % 32
    return -(1 << 31) if bit == 31 else 1 << bit


class LLGuidanceGrammar:
    """A compiled constraint: a fresh llguidance matcher that each request's matcher copies."""

    __slots__ = ("kind", "vocab_size", "_template", "_executor", "_vocab", "_text_ids")
    backend = "llguidance"

    def __init__(self, kind: str, template: Any, executor: Any, vocab: TokenizerVocab, text_ids: bytes) -> None:
        self.kind = kind
        self.vocab_size = vocab.vocab_size
        self._template = template
        self._executor = executor
        self._vocab = vocab
        self._text_ids = text_ids

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._executor, self._vocab, self._text_ids)


class LLGuidanceBackend(CachedGrammarBackend):
    """Compiles constraints with llguidance against a :class:`TokenizerVocab`. Thread-safe: the
    tokenizer and compiled templates are read-only; each matcher owns its llguidance matcher.
    One thread pool (llguidance's ``LLExecutor``, ``config.fill_threads`` threads) fills batches
    of masks."""

    name = "llguidance"

    def __init__(self, vocab: TokenizerVocab, config: GrammarConfig | None = None) -> None:
        import llguidance  # lazy: only when this backend is picked

        super().__init__(vocab, config)
        if not vocab.hf_json:
            raise ValueError("the llguidance backend needs a fast (Rust) Hugging Face tokenizer")
        self._llg = llguidance
        # The Rust tokenizer: llguidance tokenizes forced bytes with it (masks there allow the
        # canonical tokens), without calling back into Python.
        self._tokenizer = llguidance.LLTokenizer(vocab.hf_json, n_vocab=vocab.vocab_size, eos_token=vocab.stop_ids[0])
        try:
            _same_vocabulary(self._tokenizer, vocab)
        except ValueError:
            # llguidance read the JSON's tokens otherwise (seen with a GGUF-converted tokenizer under
            # transformers 5.17): give it our token bytes, tokenizing through the same Rust tokenizer
            self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_VocabTokens(vocab)),
                                                     n_vocab=vocab.vocab_size, eos_token=vocab.stop_ids[0])
            _same_vocabulary(self._tokenizer, vocab)
        self._executor = llguidance.LLExecutor(self.config.fill_threads)
        self._limits = llguidance.LLParserLimits(verbose_errors=False)  # errors name no parser state
        self._json_options = _json_options(self.config)
        stops = set(vocab.stop_ids)
        self._text_ids = bytes(bool(b) and t not in stops for t, b in enumerate(vocab.decoded))
        self._other: XGrammarBackend | None = None  # the fallback, made on first use
        self._other_lock = threading.Lock()

    def _fallback(self, kind: str, norm: Any, error: str) -> Grammar | None:
        """A json_schema llguidance refused for a construct it does not compile (not for one of
        its resource limits), compiled by xgrammar where it is installed and ``config.fallback``
        is on: xgrammar's backend refuses what it would only approximate (schema_check.py), so
        what it compiles it enforces exactly. Only grammars of at most
        ``FALLBACK_MAX_EXPRESSIONS``: xgrammar's compile cannot be stopped, and its time and
        memory grow fast with that size. Logged once per schema (a compiled grammar is cached,
        the fallback's with it)."""
        if (kind != "json_schema" or not self.config.fallback or not _UNSUPPORTED.search(error)
                or importlib.util.find_spec("xgrammar") is None):
            return None
        with self._other_lock:
            if self._other is None:
                self._other = XGrammarBackend(self.vocab, self.config)
        try:
            size = self._other.json_grammar_size(norm)
            if size > FALLBACK_MAX_EXPRESSIONS:
                log.debug("json_schema %s: no fallback, xgrammar's grammar would hold %d expressions", _digest(norm), size)
                return None
            grammar = self._other.compile(kind, norm)
        except ValueError as e:
            log.debug("json_schema %s: xgrammar refused it too (%s)", _digest(norm), e)
            return None
        log.warning("json_schema %s (%d bytes): compiled by xgrammar, since the llguidance backend refused it: %s",
                    _digest(norm), len(norm), error)
        return grammar

    def check_schema(self, schema: Any) -> Any:
        """Drop formats llguidance does not know; refuse what it gets wrong (:func:`prepare_schema`);
        make every subschema no finite value satisfies ``false`` (llguidance would let a model enter
        it and never leave; :func:`productive_schema`); in strict mode, close the objects
        (:func:`close_objects`)."""
        prepared = productive_schema(prepare_schema(schema))
        return close_objects(prepared) if self.config.json_strict else prepared

    def grammar_text(self, kind: str, norm: Any) -> str:
        """The Lark grammar llguidance compiles for a normalized spec (ValueError when there is none)."""
        if kind == "json_schema":
            schema = json.loads(norm)
            if schema is False:
                raise ValueError("cannot compile json_schema: the schema false accepts no value")
            # our layout replaces any x-guidance options the schema brings (lenient mode, say)
            schema = {**(schema if isinstance(schema, dict) else {}), "x-guidance": self._json_options}
            return f"{_HEADER}start: %json {json.dumps(schema, separators=(',', ':'))}"
        if kind == "regex":
            return f"{_HEADER}start: /{self._llg.regex_to_lark(norm, '')}/"
        if kind == "choices":
            return _HEADER + choices_to_lark(norm)
        if kind == "structural_tag":
            return self._structural_tag_lark(norm)
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(norm)
        except RecursionError:
            raise ValueError("cannot compile ebnf: the grammar nests too deeply to convert") from None
        except Exception as e:  # the GBNF converter raises its own error types
            raise ValueError(f"cannot compile ebnf: {_clean_error(str(e))}") from None
        if refers_to_special_tokens(lark):
            raise ValueError("cannot compile ebnf: special tokens (<...> in Lark) are never allowed in "
                             "constrained text")
        if "allow_invalid_utf8" in lark:
            raise ValueError("cannot compile ebnf: allow_invalid_utf8 would let invalid UTF-8 into the text")
        check_lark(lark)  # llguidance would let a model enter a rule with no finite text and never leave
        return _HEADER + lark

    def _structural_tag_lark(self, norm: str) -> str:
        """Free text in which each trigger is a lazy lexeme (it ends the text the moment it appears)
        followed by one of its structures: the rest of the begin, the JSON, the end."""
        structures, triggers = structural_tag.load(norm)
        rules, segments = [], []
        for i, (trigger, group) in enumerate(structural_tag.by_trigger(structures, triggers)):
            bodies = []
            for s in group:
                schema = {**(s.schema if isinstance(s.schema, dict) else {}), "x-guidance": self._json_options}
                if s.schema is False:
                    raise ValueError(f"cannot compile structural_tag: the schema of {s.begin!r} is false")
                parts = [_lark_string(s.begin[len(trigger):]), "%json " + json.dumps(schema, separators=(",", ":")),
                         _lark_string(s.end)]
                bodies.append(" ".join(p for p in parts if p))
            rules.append(f"trigger_{i}[lazy]: TEXT {_lark_string(trigger)}")
            rules.append(f"segment_{i}: trigger_{i} ({' | '.join(bodies)})")
            segments.append(f"segment_{i}")
        lines = [f"start: ({' | '.join(segments)})* TEXT", *rules, r"TEXT: /(.|\n)*/"]
        return _HEADER + "\n".join(lines)

    def _compile_uncached(self, kind: str, norm: Any) -> LLGuidanceGrammar:
        text = self.grammar_text(kind, norm)
        # builds the grammar, the GIL released
        template = self._llg.LLMatcher(self._tokenizer, text, log_level=0, limits=self._limits)
        if template.is_error():
            raise ValueError(f"cannot compile {kind}: {_clean_error(template.get_error())}")
        # The first mask and forced text find what the build does not: a grammar that accepts
        # no text at all (a $ref loop), one that forces text without end (an object that
        # requires itself), a lexer that gives up at once.
        probe = template.deep_copy()
        probe.compute_bitmask()
        forced = b"" if probe.is_error() else probe.compute_ff_bytes()
        if forced and not probe.is_error():  # taking a token computes what is forced after it
            probe.try_consume_tokens(self._tokenizer.tokenize_bytes(forced[:16])[:1])
        if probe.is_error():
            error = _clean_error(probe.get_error())
            if " " not in error:  # an error name: no token can start the text
                reason = f"it accepts no finite text (llguidance stopped: {error})"
            elif _ENDLESS_FORCING in error:
                reason = f"it accepts no finite text: the text it forces from the start has no end ({error})"
            else:
                reason = error
            raise ValueError(f"cannot compile {kind}: {reason}")
        return LLGuidanceGrammar(kind, template, self._executor, self.vocab, self._text_ids)


def _digest(text: str) -> str:
    """A short name for a spec in the log: the start of its SHA-256."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def _lark_string(text: str) -> str:
    """A Lark string literal for ``text`` ("" for none)."""
    return json.dumps(text, ensure_ascii=False) if text else ""
