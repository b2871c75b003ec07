"""Where a tokenizer always splits text into pieces it tokenizes apart.

A byte-level BPE tokenizer first cuts text into pre-tokens with a regex, then merges bytes only
inside each piece. So where two characters always fall into different pieces, the text on each
side tokenizes alone to what it gives inside the whole: ``encode(a + b) == encode(a) + encode(b)``.
Jump-forward uses it to re-tokenize only the text after the last such split instead of a window
of the output, and to keep the tokens of texts it has seen (a JSON schema forces the same
``","age":`` in every record).

Known here: the GPT-2 pre-tokenizer (``ByteLevel`` with its own regex, no normalizer, no prefix
space), which SmolLM2, GPT-2 and StarCoder use. Its pieces are contractions (``'s``, ``'ll``...),
a run of letters, of digits or of other symbols, each after at most one space, and runs of
whitespace. Two characters split when they are of different kinds among letter, digit and symbol,
or when a space or tab follows one of those, except an apostrophe before a letter (a contraction
may start there). Any other tokenizer gets no rule (None), and jump-forward re-tokenizes its
window as before. A rule is checked against the tokenizer itself before it is used.

Pure Python: no torch.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from typing import Any

__all__ = ["SplitRule", "split_rule"]

SplitRule = Callable[[str, str], bool]  # (last character before, first character after) -> always split there

# texts whose every split the rule claims must tokenize as their two sides do apart
_PROBES = ('{"name":"Alice Martin","age":34,"tags":["a b",true,null]}', "It's 12:30 -- they'll see\tyou.",
           "naïve café, 東京 x2 😀!", "x = 1.5e-3; y=[0,10,200]", "don't 'quote' O'Neil's", "a\n\nb {c}")


def _kind(ch: str) -> str:
    """'L' letter, 'N' digit (any Unicode number), 'S' space or tab, 'P' other symbol, '' for
    other whitespace and control characters (never split around: the regex's whitespace runs
    treat them in ways this rule does not follow)."""
    if ch < "\x80":
        return _ASCII_KINDS[ord(ch)]
    return _unicode_kind(ch)


def _unicode_kind(ch: str) -> str:
    if ch in " \t":
        return "S"
    cat = unicodedata.category(ch)
    if cat[0] in "LN":
        return cat[0]
    if ch.isspace() or cat[0] in "CZ":
        return ""
    return "P"


_ASCII_KINDS = tuple(_unicode_kind(chr(i)) for i in range(128))  # (looked up on the step's path)


def _gpt2_split(left: str, right: str) -> bool:
    a, b = _kind(left), _kind(right)
    if a not in ("L", "N", "P") or not b or a == b:
        return False
    return not (left == "'" and b == "L")


def _is_gpt2_byte_level(spec: dict[str, Any]) -> bool:
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False))


def split_rule(hf_json: str, encode: Callable[[str], list[int]]) -> SplitRule | None:
    """The split rule of the tokenizer serialized in ``hf_json`` whose text encoder is ``encode``,
    or None when its pre-tokenizer is not one known here or the rule fails a probe."""
    if not hf_json:
        return None
    try:
        spec = json.loads(hf_json)
    except ValueError:
        return None
    if not isinstance(spec, dict) or not _is_gpt2_byte_level(spec):
        return None
    for text in _PROBES:
        whole = encode(text)
        for i in range(1, len(text)):
            if _gpt2_split(text[i - 1], text[i]) and encode(text[:i]) + encode(text[i:]) != whole:
                return None
    return _gpt2_split
