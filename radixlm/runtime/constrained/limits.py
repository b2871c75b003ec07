"""Size limits on constraints, checked before anything compiles.

Grammar engines compile some inputs in time that grows much faster than their size (xgrammar:
~0.2 s for a schema with 300 properties, ~330 s for 3,000; enums and ``choices`` lists of
100k strings take minutes), and deep nesting overflows Python's recursion limit. These checks
are linear in the spec's size, iterative (no recursion), and say what is too big and the limit.
Measurements and the reasons for each default: docs/reliability.md, "Grammar, sampling-parameter
and IR fuzzing". The defaults admit every schema of JSONSchemaBench (largest 59,862 bytes,
deepest 63 levels, longest enum 463 values, largest count 131,072).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["SpecLimits", "check_spec"]

# JSON Schema keywords holding a count that a grammar unrolls or counts up to.
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")
# Keywords whose values are data, not subschemas: their contents are not counted as nesting.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# {m}, {m,}, {m,n} (regex and EBNF)
_SURROGATE = re.compile("[\ud800-\udfff]")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class SpecLimits:
    """The largest constraint a request may carry. ``max_bytes``: the spec's text (a schema's
    compact JSON, the regex or grammar, the choices' UTF-8 bytes together); ``max_nesting``:
    JSON containers inside one another in a schema, open groups in a regex or EBNF rule;
    ``max_enum``: values of one ``enum`` and strings of one ``choices``; ``max_repeat``: a
    ``{m,n}`` count and the value of ``minLength``/``maxItems``/... ."""

    max_bytes: int = 131_072
    max_nesting: int = 128
    max_enum: int = 4096
    max_repeat: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_nesting", "max_enum", "max_repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _too_big(kind: str, what: str, value: int, limit: int, flag: str) -> ValueError:
    return ValueError(f"{kind} is too large: {what} is {value:,}, the limit is {limit:,} "
                      f"(server option --grammar-max-{flag})")


def check_spec(kind: str, norm: Any, limits: SpecLimits) -> None:
    """Raise ValueError if the normalized spec (see ``normalize_spec``) passes a limit."""
    texts = norm if kind == "choices" else (norm,)
    if kind == "choices" and len(norm) > limits.max_enum:
        raise _too_big(kind, "the number of choices", len(norm), limits.max_enum, "enum")
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if size > limits.max_bytes:
        raise _too_big(kind, "its size in bytes", size, limits.max_bytes, "bytes")
    for text in texts:
        bad = _SURROGATE.search(text)
        if bad:
            raise ValueError(f"{kind} is not valid Unicode text: it holds the lone surrogate "
                             f"U+{ord(bad.group()):04X} (a \\u escape of half a UTF-16 pair?)")
    if kind == "json_schema":
        _check_schema(json.loads(norm), limits)
    elif kind in ("regex", "ebnf"):
        depth = _group_depth(norm, quotes=kind == "ebnf")
        if depth > limits.max_nesting:
            raise _too_big(kind, "the nesting of parenthesized groups", depth, limits.max_nesting, "nesting")
        _check_repeats(kind, norm, limits)


def _check_repeats(kind: str, text: str, limits: SpecLimits) -> None:
    for m in _REPEAT.finditer(text):
        if m.start() and text[m.start() - 1] == "\\":
            continue  # an escaped brace: literal text
        count = max(int(g) for g in m.groups() if g)
        if count > limits.max_repeat:
            raise _too_big(kind, f"the repetition count in {m.group(0)!r}", count, limits.max_repeat, "repeat")


def _check_schema(schema: Any, limits: SpecLimits) -> None:
    """Nesting, enum sizes, counts and patterns of a parsed schema, walked without recursion."""
    kind = "json_schema"
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_nesting:
            raise _too_big(kind, "its nesting depth (objects and arrays inside one another)", depth,
                           limits.max_nesting, "nesting")
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
            continue
        if not isinstance(node, dict):
            continue
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > limits.max_enum:
            raise _too_big(kind, "the number of enum values", len(enum), limits.max_enum, "enum")
        for key in COUNT_KEYWORDS:
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limits.max_repeat:
                raise _too_big(kind, f"{key!r}", int(min(value, 10**18)), limits.max_repeat, "repeat")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            depth_in = _group_depth(pattern, quotes=False)
            if depth_in > limits.max_nesting:
                raise _too_big(kind, "the nesting of groups in a 'pattern'", depth_in, limits.max_nesting, "nesting")
            _check_repeats(kind, pattern, limits)
        for key, value in node.items():
            if key not in _DATA_KEYWORDS and isinstance(value, (dict, list)):
                stack.append((value, depth + 1))


def _group_depth(text: str, quotes: bool) -> int:
    """The deepest nesting of ``( )`` in a regex (``quotes=False``) or an EBNF grammar, skipping
    escaped characters, character classes ``[...]`` and, in EBNF, quoted literals."""
    depth = best = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a class: ']' right after '[' or '[^' is a literal
            i += 1
            if i < n and text[i] == "^":
                i += 1
            if i < n and text[i] == "]":
                i += 1
            while i < n and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
        elif quotes and c in "\"'":
            i += 1
            while i < n and text[i] != c:
                i += 2 if text[i] == "\\" else 1
        elif quotes and c == "#":  # EBNF comment to the end of the line
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            best = max(best, depth)
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1
    return best
