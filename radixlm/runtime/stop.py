"""Stop-string matching over a stream of final text chunks (pure Python, no torch).

Which match wins: the occurrence that starts first in the text; among stop strings that start at
the same position, the shortest (it is complete first, so the stream can stop without waiting).
This is "the first occurrence of any stop string in the text". (vLLM and SGLang check the strings
in list order and cut at the first one found, so when two stop strings both occur their result can
depend on the list order and the chunking; here it depends on neither.) While a longer stop string that
starts earlier may still complete, a shorter one that already matched later is not reported yet
(``flush()`` reports it when the stream ends first).
"""

from __future__ import annotations

from collections.abc import Sequence


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
    """Finds the first stop string in a stream of text chunks, holding back what may start one.

    ``feed(delta)`` takes newly final text and returns ``(safe, matched)``: ``safe`` is text that
    can be emitted now; ``matched`` is the stop string found, or None. The longest tail of the
    text that is a prefix of some stop string is held back, so a stop string split across chunks
    is still found. On a match, ``safe`` is the text before the stop string (plus the stop string
    itself when ``keep_stop``), the text after it is dropped, and further feeds are an error.
    ``flush()`` releases the held-back text at the end of a stream that did not match. With no
    stop strings, ``feed`` passes text straight through and nothing is ever held back.

    Cost per feed: O(len(delta) + max stop length) per stop string.
    """

    def __init__(self, stop: Sequence[str], keep_stop: bool = False) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        stops = tuple(dict.fromkeys(stop))
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop: tuple[str, ...] = stops
        self.keep_stop = keep_stop
        self._fail = [_failure(s) for s in stops]
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that matched, or None."""
        return self._matched

    @property
    def held(self) -> str:
        """Text received but not yet emitted (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Take newly final text; return (text safe to emit now, matched stop string or None)."""
        assert self._matched is None, "StopMatcher.feed after a stop string matched"
        if not self.stop:
            return delta, None
        if not delta:
            return "", None
        text = self._held + delta

        # Searching held + delta finds every occurrence that crosses or follows the boundary,
        # and again a complete one that was held back while a longer candidate starting
        # earlier was pending.
        best_at, best = self._first_match(text)

        # Earliest start of a tail that may still grow into a stop string.
        pending = len(text)
        for s, fail in zip(self.stop, self._fail):
            pending = min(pending, len(text) - _prefix_suffix(text, s, fail))

        if best_at != -1 and best_at <= pending:
            self._matched = best
            self._held = ""
            return text[:best_at] + (best if self.keep_stop else ""), best
        # Either no match, or a longer stop string starting before the match may still complete.
        self._held = text[pending:]
        return text[:pending], None

    def flush(self) -> str:
        """End of stream: return the held-back text ("" after a match).

        The held text may contain a complete stop string that waited on a longer one starting
        earlier; with the stream over that one can no longer complete, so the shorter one
        matches now: check ``matched`` after flushing.
        """
        text, self._held = self._held, ""
        if self._matched is not None or not text:
            return ""
        at, best = self._first_match(text)
        if at == -1:
            return text
        self._matched = best
        return text[:at] + (best if self.keep_stop else "")

    def _first_match(self, text: str) -> tuple[int, str]:
        """(start, stop string) of the first occurrence in ``text``, or (-1, "")."""
        best_at = -1
        best = ""
        for s in self.stop:
            at = text.find(s)
            if at == -1:
                continue
            if best_at == -1 or at < best_at or (at == best_at and len(s) < len(best)):
                best_at, best = at, s
        return best_at, best
