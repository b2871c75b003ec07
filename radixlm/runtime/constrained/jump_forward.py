"""Jump-forward: append the text a grammar forces as tokens, without a decode step per token.

After each sampled token the matcher may report a forced string (``{"name":"`` once ``{`` is
out, ``","age":`` after a string value). Appending its tokens one decode step at a time wastes
forward passes; instead they join the request in one extend step. The tokens must be the ones
the tokenizer would produce for the whole text, or the model sees token sequences it never saw
in training (``"`` + ``,`` instead of ``",``), so a window of the output tail is re-tokenized
together with the forced string:

- the window never reaches into the prompt nor into tokens whose KV the prefix cache holds
  (``floor``), starts on a UTF-8 character boundary and after any special token;
- where the tokenizer has a split rule (:mod:`pre_tokens`), the window starts instead after the
  last token boundary where the text always splits: the tokens before it stay as the model wrote
  them (re-tokenizing them could only change tokens the model chose itself), and what is
  re-tokenized is short and recurs (``","age":``), so its tokens are kept for the next time;
- tokens the re-tokenization changes are rolled back in the matcher (and, by the caller, in
  the KV); the new ones are accepted, and if the grammar refuses any, nothing changes;
- the last new token is held back when a longer vocabulary token starts with its bytes and the
  grammar may allow it: the model may want that longer token (``":"`` + ``Bob``), and the next
  decode step, masked by the grammar, picks it. Where the matcher can test a token (``allows``)
  and the longer tokens are few, they are tested: when the grammar allows none of them (``":``
  before an integer, whose only longer token ``":"`` opens a string), the token is no choice
  and joins the jump, which spares the request a forward pass.

Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from radixlm.runtime.constrained.grammar import GrammarMatcher, accept_run
from radixlm.runtime.constrained.pre_tokens import SplitRule
from radixlm.runtime.constrained.tokenizer_info import TokenizerVocab

__all__ = ["MAX_JUMP_CHARS", "Jump", "JumpForward", "JumpPolicy"]

DEFAULT_WINDOW = 8  # output tokens before the forced text that may be re-tokenized
# Forced characters one jump takes at most: bounds the re-tokenizing work of one step; a longer
# forced run continues at the next step.
MAX_JUMP_CHARS = 4096
# A held-back last token whose longer tokens number at most this many has them tested against the
# grammar (a few µs each); past it the token stays held back.
MAX_EXTENSION_TESTS = 16
# re-tokenized texts whose tokens are kept (the forced texts of the grammars in use, with the
# piece of output before them); past it the store starts afresh
MAX_KEPT_TEXTS = 4096


class Jump(NamedTuple):
    """Output tokens ``[0, keep)`` stay; ``new_ids`` replace the rest; ``text`` is what they add.
    (A named tuple: made on the step's path, where a frozen dataclass costs several µs cold.)"""

    keep: int
    new_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class JumpPolicy:
    """When a jump pays for itself. A jump turns its step into an extend step for the whole batch,
    ``penalty_s`` longer than a decode step of ``decode_s`` (on CUDA measured at start-up: a few
    tokens extend in the decode graphs, a row per token; on the CPU about nothing). It spares the
    jumping row the forward passes of its ``gain`` forced tokens and of the step after them, each
    worth a ``1/running`` share of a decode step. So a jump needs
    ``(gain + 1) * decode_s / running > penalty_s``; and never while more than ``max_running``
    requests run (an explicit cap; None: the cost alone decides)."""

    decode_s: float = 1.0
    penalty_s: float = 0.0
    max_running: int | None = None

    def min_gain(self, running: int) -> int | None:
        """The fewest tokens a jump must write while ``running`` requests run; None: no jump."""
        if self.max_running is not None and running > self.max_running:
            return None
        if self.penalty_s <= 0:
            return 1
        return max(1, math.floor(running * self.penalty_s / self.decode_s))


def _is_continuation(b: bytes) -> bool:
    return bool(b) and b[0] & 0xC0 == 0x80


class JumpForward:
    """Plans and applies jumps for one tokenizer; ``encode`` is text -> token ids (no specials)."""

    def __init__(self, vocab: TokenizerVocab, encode: Callable[[str], list[int]],
                 window: int = DEFAULT_WINDOW, split: SplitRule | None = None) -> None:
        self.vocab = vocab
        self.encode = encode
        self.window = window
        self.split = split
        # text -> its tokens and their bytes (None: they would not spell it)
        self._kept: dict[str, tuple[tuple[int, ...], tuple[bytes, ...]] | None] = {}
        # the text tokens sorted by their bytes: those starting with some bytes are one run of it
        order = sorted((b, t) for t, b in enumerate(vocab.decoded) if b)
        self._sorted_bytes = [b for b, _ in order]
        self._sorted_ids = [t for _, t in order]
        self._max_token_bytes = max((len(b) for b in vocab.decoded), default=1) or 1
        # per token id, whether a longer token starts with its bytes (a jump's last token is then
        # held back): one lookup on the step's path, where a search of the sorted bytes takes ~16
        # cold reads
        self._extendable = bytearray(vocab.vocab_size)
        after = b""  # the nearest sorted bytes after the current run of equal ones
        for j in range(len(order) - 1, -1, -1):
            piece = order[j][0]
            if j + 1 < len(order) and order[j + 1][0] != piece:
                after = order[j + 1][0]
            self._extendable[order[j][1]] = after.startswith(piece) and after != piece

    def longer_tokens(self, piece: bytes, limit: int) -> list[int] | None:
        """The tokens whose bytes start with ``piece`` and go on; None when more than ``limit``."""
        i = bisect.bisect_right(self._sorted_bytes, piece)
        out: list[int] = []
        while i < len(self._sorted_bytes) and self._sorted_bytes[i].startswith(piece):
            if len(out) == limit:
                return None
            out.append(self._sorted_ids[i])
            i += 1
        return out

    def _no_choice(self, matcher: GrammarMatcher, token: int) -> bool:
        """Whether the grammar allows none of the tokens longer than ``token`` that start with its
        bytes (so the model cannot prefer one), tested where the matcher can and they are few."""
        allows = getattr(matcher, "allows", None)
        if allows is None:
            return False
        longer = self.longer_tokens(self.vocab.decoded[token], MAX_EXTENSION_TESTS)
        return longer is not None and not any(allows(t) for t in longer)

    def _window_start(self, output_ids: Sequence[int], floor: int) -> int:
        dec = self.vocab.decoded
        start = max(floor, len(output_ids) - self.window)
        for i in range(len(output_ids) - 1, start - 1, -1):
            if not dec[output_ids[i]]:  # a special token: its text cannot be re-tokenized
                start = i + 1
                break
        while start < len(output_ids) and _is_continuation(dec[output_ids[start]]):
            start += 1
        return start

    def _last_split(self, output_ids: Sequence[int], floor: int, forced: str) -> int | None:
        """The last output position, at most a window back and not before ``floor``, where the
        text always splits (the forced text after the output): re-tokenizing starts there. None
        when there is none, or no split rule, or a token there is special or part of a character."""
        if self.split is None:
            return None
        dec = self.vocab.decoded
        right = forced[0]
        for k in range(len(output_ids), max(floor, len(output_ids) - self.window), -1):
            try:
                text = dec[output_ids[k - 1]].decode("utf-8")
            except UnicodeDecodeError:  # a token holding part of a character
                return None
            if not text:  # a special token
                return None
            if self.split(text[-1], right):
                return k
            right = text[0]
        return None

    def _tokens(self, text: str) -> tuple[tuple[int, ...], tuple[bytes, ...]] | None:
        """``text``'s tokens and their bytes, kept for the next time; None when they would not
        spell it (the tokenizer normalized the text)."""
        if text in self._kept:
            return self._kept[text]
        ids = tuple(self.encode(text))
        pieces = tuple(self.vocab.decoded[t] for t in ids)
        got = (ids, pieces) if b"".join(pieces) == text.encode("utf-8") else None
        if len(self._kept) >= MAX_KEPT_TEXTS:
            self._kept.clear()
        self._kept[text] = got
        return got

    def jump(self, matcher: GrammarMatcher, output_ids: Sequence[int], floor: int, limit: int,
             min_gain: int = 1, forced: str | None = None) -> Jump | None:
        """Advance ``matcher`` over the forced text and return the token change, or None (no change).

        ``output_ids`` are all output tokens, every one accepted by ``matcher``; tokens before
        ``floor`` must not change; the output may grow to at most ``limit`` tokens; a jump that
        would write fewer than ``min_gain`` tokens is not taken (the mask forces them one a step).

        The forced text asked of the matcher is bounded by what ``limit`` can still hold (tokens
        times the longest token's bytes) and by ``MAX_JUMP_CHARS``; grammars whose forced text is
        endless are refused when they compile (``limits.grammar_bounds``). ``forced``: the forced
        text, where the caller has asked the matcher for it already (the bound then cuts it)."""
        room = limit - len(output_ids)
        if room < max(min_gain, 1):
            return None
        bound = min(room * self._max_token_bytes, MAX_JUMP_CHARS)
        forced = matcher.forced_text(bound) if forced is None else forced[:bound]
        if not forced or len(forced.encode("utf-8")) < min_gain:
            return None  # (each token spells a byte at least: too few bytes for min_gain, no need to re-tokenize)
        dec = self.vocab.decoded
        start = self._last_split(output_ids, floor, forced)
        if start is None:
            start = self._window_start(output_ids, floor)
        old = list(output_ids[start:])
        old_bytes = b"".join(dec[t] for t in old) if old else b""
        try:
            old_text = old_bytes.decode("utf-8")
        except UnicodeDecodeError:  # the output ends inside a character
            return None
        tokens = self._tokens(old_text + forced)
        if tokens is None:
            return None  # the tokenizer normalized the text: its tokens would not spell it
        new, pieces = tokens
        n = min(len(new), limit - start)
        held = n == len(new) > 0 and bool(self._extendable[new[-1]])  # a longer token starts with it
        if held:
            n -= 1
        common = 0
        while common < min(len(old), n) and old[common] == new[common]:
            common += 1
        # the jump's tokens: those it writes (as many decode steps as the forced text would take,
        # give or take a token the re-tokenizing merges)
        if len(b"".join(pieces[:n])) <= len(old_bytes) or n - common < min_gain:
            return None
        if len(old) > common:
            matcher.rollback(len(old) - common)
        took = accept_run(matcher, new[common:n])
        if took == n - common and held and self._no_choice(matcher, new[n]) and accept_run(matcher, new[n:n + 1]):
            n, took = n + 1, took + 1
        try:
            text = b"".join(pieces[:n]).decode("utf-8")[len(old_text):]
        except UnicodeDecodeError:  # the held-back token split a character
            text = None
        if took < n - common or text is None:
            matcher.rollback(took)
            ok = accept_run(matcher, old[common:]) == len(old) - common
            assert ok, "re-accepting the tokens the matcher accepted before failed"
            return None
        return Jump(start + common, new[common:n], text)
