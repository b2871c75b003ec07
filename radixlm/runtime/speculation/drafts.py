"""Draft proposals for speculative decoding, torch-free like the radix cache.

A draft is a guess of a request's next tokens. ``PromptLookup`` finds the newest earlier place
in the request's own tokens (prompt and output) where its last few tokens occurred and proposes
what followed there: agents copy from their prompts (a document's JSON, code to edit, a tool
call's arguments) and repeat themselves. With ``radix`` the radix cache is asked first: what
follows the request's whole sequence in the tree (the same request sent before, an earlier turn
of a session that goes on the same way, a fork sibling). ``DraftLength`` sizes each draft by
the request's recent acceptance: long while guesses hold, none for a while after they fail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.runtime.config import SpeculativeConfig
from radixlm.runtime.radix_cache import PrefixCache

NGRAMS = (3, 2)  # suffix lengths tried, longest first (a single token matches too often to pay)
MAX_PAUSE = 32  # steps without a draft, at most, after drafts keep failing


class PromptLookup:
    """The request's tokens with, for each n in NGRAMS, where the n-gram that ends them last
    ended before (kept up to date as tokens are appended: O(1) a token)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end of its newest occurrence
        self._before: dict[int, int | None] = {}  # n -> end of the current suffix's previous occurrence

    def sync(self, tokens: list[int]) -> None:
        """Bring the index to ``tokens``, which extend the ones it holds (else it is rebuilt: a
        draft is only a guess, so the cheap check of the last token held is enough)."""
        n = len(self.tokens)
        if len(tokens) < n or (n and tokens[n - 1] != self.tokens[-1]):
            self.tokens, self._last, self._before = [], {}, {}
            n = 0
        for t in tokens[n:]:
            self.tokens.append(t)
            end = len(self.tokens)
            for k in NGRAMS:
                if end >= k:
                    key = tuple(self.tokens[end - k :])
                    self._before[k] = self._last.get(key)
                    self._last[key] = end

    def draft(self, limit: int) -> list[int]:
        """What followed the newest earlier occurrence of the longest suffix found, up to
        ``limit`` tokens."""
        for k in NGRAMS:
            end = self._before.get(k)
            if end is not None:
                return self.tokens[end : end + limit]
        return []


@dataclass
class DraftLength:
    """How long a request's next draft may be: grows by two after a draft accepted whole, falls
    to one more than was accepted otherwise; after two drafts in a row accepted not at all, no
    draft for a pause that doubles each time (up to MAX_PAUSE steps)."""

    most: int
    length: int = 0
    misses: int = 0
    pause: int = 0
    resume_in: int = 0
    verified: int = 0  # drafts checked
    accepted: int = 0  # their tokens accepted in all
    history: list[int] = field(default_factory=list)  # tokens accepted per check

    def __post_init__(self) -> None:
        self.length = self.length or self.most

    def allowed(self) -> int:
        if self.resume_in > 0:
            self.resume_in -= 1
            return 0
        return self.length

    def record(self, drafted: int, accepted: int) -> None:
        self.verified += 1
        self.accepted += accepted
        self.history.append(accepted)
        if accepted == drafted:
            self.length, self.misses, self.pause = min(self.most, drafted + 2), 0, 0
            return
        self.length = max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= 2:
            self.pause = min(MAX_PAUSE, max(1, self.pause * 2))
            self.resume_in, self.misses = self.pause, 0


class DraftProposer:
    """Drafts for one engine: ``algorithm`` "ngram" or "radix" (see the module docstring), at
    most ``most`` tokens, never past ``context_length``."""

    def __init__(self, algorithm: str, cache: PrefixCache, most: int, context_length: int) -> None:
        self.algorithm = algorithm
        self.cache = cache
        self.most = most
        self.context_length = context_length

    @classmethod
    def build(cls, config: SpeculativeConfig, cache: PrefixCache, context_length: int) -> DraftProposer | None:
        """The engine's proposer, or None with speculation off."""
        if config.speculative_algorithm == "none":
            return None
        return cls(config.speculative_algorithm, cache, config.speculative_num_draft_tokens, context_length)

    def propose(self, tokens: list[int], lookup: PromptLookup, limit: int) -> list[int]:
        if limit <= 0:
            return []
        if self.algorithm == "radix":
            found = self.cache.continuation(tokens, limit)
            if found:
                return found
        lookup.sync(tokens)
        return lookup.draft(limit)
