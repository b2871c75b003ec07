"""NoCache: the naive twin keeps nothing and leaks nothing."""

import pytest

from radixlm.runtime.radix_cache import CACHES, NoCache, PrefixCache, RadixCache, SlotAllocator


def test_registry():
    assert CACHES == {"radix": RadixCache, "none": NoCache}
    a = SlotAllocator(8)
    for factory in CACHES.values():
        assert isinstance(factory(a, 1), PrefixCache)


def test_no_cache_matches_nothing_and_frees_inserts():
    a = SlotAllocator(8)
    c = NoCache(a)
    r = c.match_prefix([1, 2, 3])
    assert r.slots == []
    s = a.alloc(3)
    assert c.insert([1, 2, 3], s) == 0
    assert a.num_free == 8
    assert c.match_prefix([1, 2, 3]).slots == []
    c.lock(r.node)
    c.unlock(r.node)
    c.unlock(r.node)
    assert c.evict(100) == 0
    assert c.total_size() == c.evictable_size() == c.protected_size() == 0
    c.check_integrity()
    c.reset()


def test_no_cache_leaves_page_remainder_to_caller():
    a = SlotAllocator(8)
    c = NoCache(a, page_size=4)
    s = a.alloc(6)
    assert c.insert(list(range(6)), s) == 0
    assert a.num_free == 6  # slots[:4] freed by the cache
    a.free(s[4:])  # the caller frees the remainder, exactly as with RadixCache
    assert a.num_free == 8


def test_no_cache_length_mismatch():
    c = NoCache(SlotAllocator(4))
    with pytest.raises(ValueError):
        c.insert([1, 2], [1])
