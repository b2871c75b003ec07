"""NoCache: the naive twin of RadixCache for ``--cache none`` and as a test oracle."""

from __future__ import annotations

from collections.abc import Sequence

from radixlm.runtime.radix_cache.allocator import SlotAllocator
from radixlm.runtime.radix_cache.base import MatchResult, PrefixCache


class _Root:
    """The dummy node every match returns."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NoCache.root"


class NoCache(PrefixCache):
    """Caches nothing: every match is empty and every insert frees what it is handed."""

    shares_prefixes = False

    def __init__(self, allocator: SlotAllocator, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self._allocator = allocator
        self._page = page_size
        self._root = _Root()

    @property
    def page_size(self) -> int:
        """Tokens per page (only decides which slots ``insert`` takes over)."""
        return self._page

    @property
    def allocator(self) -> SlotAllocator:
        """The allocator inserted slots are freed into."""
        return self._allocator

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Always the empty prefix at the dummy root."""
        return MatchResult([], self._root)

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Take ownership of ``slots[:inserted]`` and free them at once; return 0.

        Same contract as ``RadixCache.insert`` with nothing cached: ``inserted`` is
        ``len(tokens) // page_size * page_size`` and the caller still frees ``slots[inserted:]``.
        """
        if len(slots) != len(tokens):
            raise ValueError(
                f"insert needs one slot per token: got {len(tokens)} tokens and {len(slots)} slots"
            )
        n = len(tokens) - len(tokens) % self._page
        self._allocator.free(slots[:n])
        return 0

    def lock(self, node: object) -> None:
        """No-op."""

    def unlock(self, node: object) -> None:
        """No-op."""

    def evict(self, num_tokens: int) -> int:
        """Nothing to evict: 0."""
        return 0

    def total_size(self) -> int:
        """Always 0."""
        return 0

    def evictable_size(self) -> int:
        """Always 0."""
        return 0

    def protected_size(self) -> int:
        """Always 0."""
        return 0

    def check_integrity(self) -> None:
        """Nothing to check."""

    def reset(self) -> None:
        """Nothing to drop."""
