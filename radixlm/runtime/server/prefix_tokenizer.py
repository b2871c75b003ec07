"""PrefixTokenizer: a server-run program's texts, each tokenized from where it last changed.

A program the server runs (/run_program) sends texts that grow: a gen's prompt is the last
one's plus its output and the program's next words, a select sends its prefix and then the
prefix with each choice. Tokenizing each text whole costs the server's event loop time in
proportion to the text, on top of the transformers wrapper's cost a call (docs/machines.md). Under a byte-level BPE
tokenizer with a split rule (:mod:`radixlm.runtime.constrained.pre_tokens`), text before a place
where it always splits tokenizes inside the whole as it does alone. So a text that extends one
tokenized before keeps that text's tokens up to its last such place and tokenizes the rest:
the ids are the whole text's (tested against tokenizing it whole).

A place with special-token text near it is never used (the tokenizer cuts added tokens out
before its pre-tokenizer runs, and the characters on both sides of a place may spell one).
Made by :meth:`ServerTokenizer.prefix_tokenizer`, which checks the rule against the tokenizer
first; one per program, shared by its forks' branches, from the event loop and worker threads.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

from radixlm.runtime.constrained.pre_tokens import SplitRule

__all__ = ["PrefixTokenizer"]

KEPT_TEXTS = 32  # texts a program keeps (its states' latest texts, a select's prefix and choices)
MAX_TOKENS_BACK = 64  # tokens searched back from a kept text's end for a place to split


class PrefixTokenizer:
    """``encode``: text -> ids, the whole tokenizer (adding no ids of its own);
    ``token_bytes[id]``: how many UTF-8 bytes the token spells; ``specials``: the texts of the
    tokenizer's added tokens, as UTF-8."""

    def __init__(self, encode: Callable[[str], list[int]], token_bytes: Sequence[int], split: SplitRule,
                 specials: Sequence[bytes]) -> None:
        self._encode = encode
        self._token_bytes = token_bytes
        self._split = split
        self._specials = tuple(specials)
        self._reach = max((len(s) for s in self._specials), default=1)
        # text -> its ids and the byte offset where each token ends (oldest first)
        self._kept: dict[str, tuple[list[int], list[int]]] = {}
        self._lock = threading.Lock()

    def fresh_chars(self, text: str) -> int:
        """About how many characters of ``text`` ``encode`` would tokenize (for the caller's choice
        of thread): those past the longest kept text it extends."""
        with self._lock:
            base = self._base(text)
        return len(text) - len(base)

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, as tokenizing it whole gives them."""
        with self._lock:
            base = self._base(text)
            kept = self._kept.pop(base, None) if base else None
            if kept is not None:
                self._kept[base] = kept  # (most recently used last)
        data = text.encode("utf-8")
        cut = self._cut(data, *kept) if kept is not None else None
        if kept is None or cut is None:
            ids, ends = self._whole(data, 0)
        elif kept[1][cut - 1] == len(data):  # (the text itself)
            return list(kept[0])
        else:
            tail_ids, tail_ends = self._whole(data, kept[1][cut - 1])
            ids, ends = kept[0][:cut] + tail_ids, kept[1][:cut] + tail_ends
        with self._lock:
            self._kept[text] = (ids, ends)
            while len(self._kept) > KEPT_TEXTS:
                del self._kept[next(iter(self._kept))]
        return list(ids)

    def _base(self, text: str) -> str:
        """The longest kept text that ``text`` starts with ('' when none)."""
        best = ""
        for t in self._kept:
            if len(best) < len(t) <= len(text) and text.startswith(t):
                best = t
        return best

    def _whole(self, data: bytes, start: int) -> tuple[list[int], list[int]]:
        """The ids of ``data[start:]`` tokenized whole, and each token's end offset in ``data``."""
        ids = self._encode(data[start:].decode("utf-8"))
        ends = list(itertools.accumulate((self._token_bytes[t] for t in ids), initial=start))[1:]
        return ids, ends

    def _cut(self, data: bytes, ids: list[int], ends: list[int]) -> int | None:
        """How many of a kept text's tokens ``data`` (which extends the text) keeps: the tokens
        before the last place, at most MAX_TOKENS_BACK tokens back, where ``data`` always splits;
        None when there is none."""
        for k in range(len(ids), max(len(ids) - MAX_TOKENS_BACK, 0), -1):
            at = ends[k - 1]
            if at == len(data):
                return k
            if data[at] & 0xC0 == 0x80:  # inside a character
                continue
            near = data[max(at - self._reach, 0):at + self._reach]
            if any(s in near for s in self._specials):
                continue
            left = data[max(at - 4, 0):at].decode("utf-8", "ignore")
            right = data[at:at + 4].decode("utf-8", "ignore")
            if left and right and self._split(left[-1], right[0]):
                return k
        return None
