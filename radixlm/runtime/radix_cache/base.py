"""The prefix-cache interface shared by RadixCache and its naive twin NoCache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class IntegrityError(RuntimeError):
    """KV bookkeeping broke an invariant (a leaked slot, a stray lock): a bug, reported, never asserted."""


@dataclass(frozen=True)
class MatchResult:
    """A cached prefix: its KV slots (a fresh list the caller may keep) and an opaque node.

    ``node`` is only meaningful to the cache that produced it: pass it back to ``lock`` /
    ``unlock``. ``len(slots)`` is the number of prefix tokens already cached.
    """

    slots: list[int]
    node: object


class PrefixCache(ABC):
    """Maps token-id prefixes to KV slots, with lock counts and LRU eviction.

    Slot ownership: slots held by the cache are freed back to its allocator by the cache
    (``evict`` / ``reset``); see ``insert`` for what the caller must free itself.
    """

    shares_prefixes: bool = True  # False for the no-sharing twin

    @property
    @abstractmethod
    def page_size(self) -> int:
        """Tokens per page; matches and inserts are rounded down to a multiple of it."""

    @abstractmethod
    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached, page-aligned prefix of ``tokens``."""

    def continuation(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` cached tokens that follow ``tokens`` (the most recently used branch
        at each fork), or none when ``tokens`` is not cached whole: a draft for speculative
        decoding. Reads only. A cache that shares nothing has none."""
        return []

    @abstractmethod
    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache ``tokens`` -> ``slots``; return how many leading tokens were already cached.

        With ``inserted = len(tokens) // page_size * page_size`` and ``n`` the return value:
        the cache takes ownership of ``slots[n:inserted]``; the caller keeps ownership of
        ``slots[:n]`` (duplicates of what is cached, to be freed unless they are the very
        slots ``match_prefix`` returned) and of ``slots[inserted:]`` (the page remainder).
        """

    @abstractmethod
    def lock(self, node: object) -> None:
        """Protect ``node`` and its ancestors from eviction (counted)."""

    @abstractmethod
    def unlock(self, node: object) -> None:
        """Undo one ``lock(node)``."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots if possible; return how many were freed."""

    @abstractmethod
    def total_size(self) -> int:
        """Tokens (= slots) held by the cache."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held in unlocked nodes."""

    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held in locked nodes."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Walk the structure; raise IntegrityError naming the first broken invariant."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything, freeing all held slots (nothing may be locked)."""
