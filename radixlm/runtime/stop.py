r"""Stop-string and stop-regex matching over a stream of final text chunks (pure Python, no torch).

Which match wins: the occurrence that starts first in the text; among stop strings that start at
the same position, the shortest (it is complete first, so the stream can stop without waiting).
This is "the first occurrence of any stop string in the text". (vLLM and SGLang check the strings
in list order and cut at the first one found, so when two stop strings both occur their result can
depend on the list order and the chunking; here it depends on neither.) While a longer stop string that
starts earlier may still complete, a shorter one that already matched later is not reported yet
(``flush()`` reports it when the stream ends first).

Stop regexes (SGLang's ``stop_regex``) follow the same rule, as candidates beside the strings: a
complete match counts from the moment it exists (a greedy ``\d+`` does not wait for more digits),
and text where a match may still begin (the regex module's partial matching) is held back. A
regex also sees up to ``REGEX_CONTEXT`` characters of text already emitted (lookbehind, ``\b``),
but a match never starts inside it. Patterns are run by the ``regex`` module, with a size limit at
compile time (``compile_stop_regex``) and a time budget per feed, so a hostile pattern cannot
hang the engine: past the budget ``feed`` raises ``StopRegexTimeout``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import regex

MAX_STOP_REGEXES = 32  # SGLang's limits: patterns per request, and UTF-8 bytes per pattern
MAX_STOP_REGEX_BYTES = 256
# Counted repeats are expanded when a pattern compiles, at a cost per unit, so nested counts take
# long (docs/machines.md). A pattern whose repeats could expand past this is refused before it compiles.
MAX_STOP_REGEX_SIZE = 100_000
REGEX_CONTEXT = 256  # characters of emitted text a regex sees before where a match may start
REGEX_BUDGET_S = 0.05  # all stop-regex searches of one feed


class StopRegexTimeout(Exception):
    """The stop regexes took longer than their time budget on one piece of output."""


def _repeat_bound(pattern: str, i: int) -> tuple[int, int] | None:
    """At ``pattern[i] == '{'``: (largest count, index after '}') of a counted repeat, else None."""
    j = pattern.find("}", i)
    if j == -1:
        return None
    parts = [p.strip() for p in pattern[i + 1 : j].split(",")]
    if len(parts) > 2 or not all(p.isascii() and (p.isdigit() or (not p and len(parts) == 2)) for p in parts):
        return None  # not a counted repeat: the regex module reads the braces as literal text
    counts = [int(p) for p in parts if p.strip()]
    return (max(counts) if counts else 1), j + 1


def regex_size(pattern: str) -> int:
    """An upper bound on how many units a pattern's counted repeats expand to when it compiles:
    each atom counts 1, a group its contents (all alternatives added), ``x{m,n}`` n times x."""
    frames: list[int] = [0]
    last = 0  # the size of the atom just read (what a quantifier repeats)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            if pattern[i - 1 : i] in ("p", "P", "N", "x") and pattern[i : i + 1] == "{":  # \p{L}: one atom
                i = (pattern.find("}", i) + 1) or n
            frames[-1] += 1
            last = 1
            continue
        if c == "[":
            j = i + 1 + (pattern[i + 1 : i + 2] == "^")
            j += pattern[j : j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            frames[-1] += 1
            last = 1
            continue
        if c == "(":
            frames.append(0)
            i += 1
            continue
        if c == ")" and len(frames) > 1:
            last = frames.pop()
            frames[-1] += last
            i += 1
            continue
        if c == "{":
            bound = _repeat_bound(pattern, i)
            if bound is not None:
                frames[-1] += last * (bound[0] - 1)
                last *= bound[0]
                i = bound[1]
                continue
        if c in "*+?|":
            i += 1
            continue
        frames[-1] += 1
        last = 1
        i += 1
    return sum(frames)


def compile_stop_regex(pattern: str, name: str = "stop_regex") -> Any:
    """The compiled pattern; ValueError naming ``name`` when it is too long, too large once its
    repeats expand, or not a valid regular expression."""
    size = len(pattern.encode("utf-8"))
    if size > MAX_STOP_REGEX_BYTES:
        raise ValueError(f"{name} is {size} bytes long; at most {MAX_STOP_REGEX_BYTES} are allowed")
    if regex_size(pattern) > MAX_STOP_REGEX_SIZE:
        raise ValueError(f"{name} has counted repeats ({{m,n}}) that expand past {MAX_STOP_REGEX_SIZE:,} "
                         "units; use smaller counts or * / +")
    try:
        return regex.compile(pattern)
    except Exception as e:  # noqa: BLE001 - regex.error, OverflowError, RecursionError: all bad patterns
        raise ValueError(f"{name} is not a valid regular expression: {e}") from None


def _failure(pattern: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of pattern[:i]."""
    fail = [0] * (len(pattern) + 1)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i + 1] = k
    return fail


def _prefix_suffix(text: str, pattern: str, fail: list[int]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``pattern``."""
    n = len(pattern)
    if n == 1:
        return 0
    # Only the last n - 1 characters can hold a proper prefix of the pattern, and it starts with
    # the pattern's first character (usually absent: then no per-character loop at all).
    start = text.find(pattern[0], max(0, len(text) - (n - 1)))
    if start == -1:
        return 0
    k = 0
    for ch in text[start:]:
        while k and pattern[k] != ch:
            k = fail[k]
        if pattern[k] == ch:
            k += 1
            if k == n:
                k = fail[k]
    return k


class StopMatcher:
    """Finds the first stop string or stop-regex match in a stream of text chunks, holding back
    what may start one.

    ``feed(delta)`` takes newly final text and returns ``(safe, matched)``: ``safe`` is text that
    can be emitted now; ``matched`` is the stop string found (for a regex: its pattern, as SGLang
    reports it), or None. The longest tail of the text that is a prefix of some stop string, or
    where a regex may still match, is held back, so a stop split across chunks is still found.
    On a match, ``safe`` is the text before it (plus the matched text itself when ``keep_stop``),
    the text after it is dropped, and further feeds are an error. ``flush()`` releases the
    held-back text at the end of a stream that did not match. With no stops, ``feed`` passes text
    straight through and nothing is ever held back.

    Cost per feed: O(len(delta) + max stop length) per stop string; per regex, two searches over
    the held-back text and the delta (within ``REGEX_BUDGET_S`` in all).
    """

    def __init__(self, stop: Sequence[str], keep_stop: bool = False, regexes: Sequence[str] = ()) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        if isinstance(regexes, str):
            regexes = (regexes,)
        stops = tuple(dict.fromkeys(stop))
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop: tuple[str, ...] = stops
        self.regexes: tuple[str, ...] = tuple(dict.fromkeys(regexes))
        self.keep_stop = keep_stop
        self._fail = [_failure(s) for s in stops]
        self._compiled = [compile_stop_regex(r) for r in self.regexes]
        self._held = ""
        self._context = ""  # the tail of the emitted text, for regex lookbehind
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string (or stop regex pattern) that matched, or None."""
        return self._matched

    @property
    def held(self) -> str:
        """Text received but not yet emitted (a possible start of a stop)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Take newly final text; return (text safe to emit now, matched stop or None).

        Raises StopRegexTimeout when the stop regexes overrun their time budget."""
        assert self._matched is None, "StopMatcher.feed after a stop matched"
        if not self.stop and not self._compiled:
            return delta, None
        if not delta:
            return "", None
        text = self._held + delta

        # Searching held + delta finds every occurrence that crosses or follows the boundary,
        # and again a complete one that was held back while a longer candidate starting
        # earlier was pending.
        best_at, best, label = self._first_match(text)

        # Earliest start of a tail that may still grow into a stop.
        pending = len(text)
        for s, fail in zip(self.stop, self._fail):
            pending = min(pending, len(text) - _prefix_suffix(text, s, fail))
        if self._compiled:
            pending = min(pending, self._regex_pending(text))

        if best_at != -1 and best_at <= pending:
            self._matched = label
            self._held = ""
            return text[:best_at] + (best if self.keep_stop else ""), label
        # Either no match, or a longer stop starting before the match may still complete.
        self._held = text[pending:]
        if self._compiled:
            self._context = (self._context + text[:pending])[-REGEX_CONTEXT:]
        return text[:pending], None

    def flush(self) -> str:
        """End of stream: return the held-back text ("" after a match).

        The held text may contain a complete stop that waited on a longer one starting earlier;
        with the stream over that one can no longer complete, so the shorter one matches now:
        check ``matched`` after flushing."""
        text, self._held = self._held, ""
        if self._matched is not None or not text:
            return ""
        at, best, label = self._first_match(text)
        if at == -1:
            return text
        self._matched = label
        return text[:at] + (best if self.keep_stop else "")

    def _first_match(self, text: str) -> tuple[int, str, str]:
        """(start, matched text, stop string or pattern) of the first complete match in
        ``text``, or (-1, "", ""): the earliest start wins, then the shorter match, then strings."""
        best_at, best, label = -1, "", ""
        for s in self.stop:
            at = text.find(s)
            if at != -1 and (best_at == -1 or at < best_at or (at == best_at and len(s) < len(best))):
                best_at, best, label = at, s, s
        if self._compiled:
            ctx = self._context
            deadline = time.perf_counter() + REGEX_BUDGET_S
            for pattern, r in zip(self.regexes, self._compiled):
                m = _search(r, ctx + text, len(ctx), False, deadline)
                if m is None:
                    continue
                at, found = m.start() - len(ctx), m.group()
                if best_at == -1 or at < best_at or (at == best_at and len(found) < len(best)):
                    best_at, best, label = at, found, pattern
        return best_at, best, label

    def _regex_pending(self, text: str) -> int:
        """Earliest index of ``text`` where a regex match may begin that more text could complete."""
        ctx = self._context
        deadline = time.perf_counter() + REGEX_BUDGET_S
        pending = len(text)
        for r in self._compiled:
            m = _search(r, ctx + text, len(ctx), True, deadline)
            if m is not None and m.partial:
                pending = min(pending, m.start() - len(ctx))
        return pending


def _search(r: Any, text: str, pos: int, partial: bool, deadline: float) -> Any:
    left = deadline - time.perf_counter()
    try:
        if left <= 0:
            raise TimeoutError
        return r.search(text, pos, partial=partial, timeout=left)
    except TimeoutError:
        raise StopRegexTimeout(f"stop_regex took longer than {REGEX_BUDGET_S * 1000:g} ms to search the output; "
                               "use a simpler pattern") from None
