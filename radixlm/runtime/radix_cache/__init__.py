"""KV slot allocator and prefix caches (radix tree and its naive twin)."""

from collections.abc import Callable

from radixlm.runtime.radix_cache.allocator import SlotAllocator
from radixlm.runtime.radix_cache.base import IntegrityError, MatchResult, PrefixCache
from radixlm.runtime.radix_cache.no_cache import NoCache
from radixlm.runtime.radix_cache.radix_cache import RadixCache

# name -> factory(allocator, page_size); the CLI's --cache choices come from here.
CACHES: dict[str, Callable[[SlotAllocator, int], PrefixCache]] = {
    "radix": RadixCache,
    "none": NoCache,
}

__all__ = ["CACHES", "IntegrityError", "MatchResult", "NoCache", "PrefixCache", "RadixCache", "SlotAllocator"]
