"""Table tests for RadixCache."""

import random
import sys
import time

import pytest

from radixlm.runtime.radix_cache import IntegrityError, MatchResult, RadixCache, SlotAllocator


def make(num_slots=64, page_size=1):
    a = SlotAllocator(num_slots)
    return a, RadixCache(a, page_size)


def put(a, c, tokens):
    """Insert ``tokens`` with fresh slots, freeing what the caller keeps; return (n, slots)."""
    slots = a.alloc(len(tokens))
    n = c.insert(tokens, slots)
    ins = len(tokens) - len(tokens) % c.page_size
    a.free(slots[:n])
    a.free(slots[ins:])
    c.check_integrity()
    return n, slots


def test_match_on_empty_tree():
    a, c = make()
    r = c.match_prefix([1, 2, 3])
    assert isinstance(r, MatchResult)
    assert r.slots == []
    assert c.match_prefix([]).slots == []
    assert c.total_size() == 0
    c.lock(r.node)  # locking the root is a no-op
    assert c.protected_size() == 0
    c.unlock(r.node)
    c.check_integrity()


def test_insert_then_match_and_split():
    a, c = make()
    n, s = put(a, c, [1, 2, 3, 4, 5])
    assert n == 0
    assert c.total_size() == 5 and c.evictable_size() == 5
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).slots == s
    r = c.match_prefix([1, 2, 3, 9])  # ends inside the segment: split
    assert r.slots == s[:3]
    c.check_integrity()
    assert c.total_size() == 5
    assert c.match_prefix([1, 2, 3, 4, 5]).slots == s
    assert c.match_prefix([7, 1, 2]).slots == []
    assert c.match_prefix([1, 2]).slots == s[:2]
    c.check_integrity()


def test_match_returns_a_fresh_list():
    a, c = make()
    _, s = put(a, c, [1, 2, 3])
    r = c.match_prefix([1, 2, 3])
    r.slots.append(99)
    assert c.match_prefix([1, 2, 3]).slots == s


def test_insert_returns_already_cached_count_and_branches():
    a, c = make()
    assert put(a, c, [1, 2, 3, 4])[0] == 0
    n, s2 = put(a, c, [1, 2, 7, 8, 9])
    assert n == 2
    n, _ = put(a, c, [1, 2, 3])  # fully contained
    assert n == 3
    n, _ = put(a, c, [1, 2, 3, 4])
    assert n == 4
    assert c.total_size() == 7
    assert c.match_prefix([1, 2, 7, 8, 9]).slots[2:] == s2[2:]
    n, _ = put(a, c, [5])
    assert n == 0 and c.total_size() == 8
    assert a.num_free == 64 - 8


def test_insert_with_matched_prefix_slots():
    """The scheduler's flow: match, allocate the rest, insert the whole."""
    a, c = make()
    put(a, c, [1, 2, 3])
    r = c.match_prefix([1, 2, 3, 4, 5])
    new = a.alloc(2)
    n = c.insert([1, 2, 3, 4, 5], r.slots + new)
    assert n == 3  # the matched slots are the tree's own: nothing to free
    assert c.match_prefix([1, 2, 3, 4, 5]).slots == r.slots + new
    assert a.num_free == 64 - 5
    c.check_integrity()


def test_insert_length_mismatch():
    a, c = make()
    with pytest.raises(ValueError):
        c.insert([1, 2, 3], [1, 2])


def test_lock_protects_from_eviction():
    a, c = make()
    put(a, c, [1, 2, 3])
    put(a, c, [1, 2, 4, 5])
    r = c.match_prefix([1, 2, 3])
    c.lock(r.node)
    assert c.protected_size() == 3  # [1,2] and [3]
    assert c.evictable_size() == 2
    c.check_integrity()
    assert c.evict(100) == 2
    assert c.total_size() == 3
    assert c.match_prefix([1, 2, 4, 5]).slots == r.slots[:2]
    c.check_integrity()
    c.unlock(r.node)
    assert c.protected_size() == 0 and c.evictable_size() == 3
    assert c.evict(100) == 3
    assert c.total_size() == 0 and a.num_free == 64
    c.check_integrity()


def test_lock_counts_nest_and_unlock_below_zero_raises():
    a, c = make()
    put(a, c, [1, 2, 3])
    r = c.match_prefix([1, 2, 3])
    c.lock(r.node)
    c.lock(r.node)
    c.unlock(r.node)
    assert c.evict(100) == 0
    c.unlock(r.node)
    with pytest.raises(IntegrityError):
        c.unlock(r.node)
    c.check_integrity()
    assert c.evict(100) == 3


def test_split_of_locked_node_keeps_locks():
    a, c = make()
    put(a, c, [1, 2, 3, 4])
    r = c.match_prefix([1, 2, 3, 4])
    c.lock(r.node)
    short = c.match_prefix([1, 2, 9])  # splits the locked node
    assert short.slots == r.slots[:2]
    c.check_integrity()
    assert c.protected_size() == 4
    put(a, c, [1, 2, 5])
    assert c.evict(100) == 1  # only the new unlocked branch
    c.unlock(r.node)  # the old handle still denotes [1,2,3,4]
    c.check_integrity()
    assert c.protected_size() == 0
    assert c.evict(100) == 4
    assert a.num_free == 64


def test_lock_upper_node_after_split_then_unlock():
    a, c = make()
    put(a, c, [1, 2, 3, 4])
    upper = c.match_prefix([1, 2])
    c.lock(upper.node)
    assert c.protected_size() == 2 and c.evictable_size() == 2
    assert c.evict(1) == 2  # the unlocked tail [3, 4]
    assert c.evict(1) == 0
    c.unlock(upper.node)
    c.check_integrity()
    assert c.evict(1) == 2


def test_lru_order_of_eviction():
    a, c = make()
    put(a, c, [1, 1])
    put(a, c, [2, 2])
    put(a, c, [3, 3])
    c.match_prefix([1, 1])  # 1 is now the most recent; 2 is the oldest
    assert c.evict(1) == 2
    assert c.match_prefix([2, 2]).slots == []
    assert len(c.match_prefix([3, 3]).slots) == 2  # touching 3 makes 1 the oldest
    assert c.evict(2) == 2
    assert c.match_prefix([1, 1]).slots == []
    assert len(c.match_prefix([3, 3]).slots) == 2
    c.check_integrity()


def test_eviction_climbs_to_parent_that_becomes_a_leaf():
    a, c = make()
    put(a, c, [1, 2, 3])
    put(a, c, [1, 2, 4])
    put(a, c, [9])
    c.match_prefix([9])
    # leaves [3] and [4] are older than [9]; after both go, [1,2] is older than [9] too
    assert c.evict(4) == 4
    assert c.total_size() == 1
    assert len(c.match_prefix([9]).slots) == 1
    c.check_integrity()


def test_evict_frees_into_allocator():
    a, c = make(num_slots=10)
    put(a, c, list(range(6)))
    assert a.num_free == 4
    assert a.alloc(5) is None
    assert c.evict(5) == 6  # whole nodes are evicted
    assert a.num_free == 10
    assert c.evict(5) == 0
    assert c.evict(0) == 0
    c.check_integrity()


def test_evicted_node_handle_is_rejected():
    a, c = make()
    put(a, c, [1, 2])
    r = c.match_prefix([1, 2])
    c.evict(2)
    with pytest.raises(IntegrityError):
        c.lock(r.node)


def test_page_size_alignment():
    a, c = make(page_size=4)
    tokens = list(range(10))
    slots = a.alloc(10)
    n = c.insert(tokens, slots)
    assert n == 0 and c.total_size() == 8
    a.free(slots[8:])  # the remainder stays the caller's
    assert c.match_prefix(tokens).slots == slots[:8]
    assert c.match_prefix(tokens[:7]).slots == slots[:4]
    assert c.match_prefix(tokens[:3]).slots == []
    r = c.match_prefix([0, 1, 2, 3, 4, 5, 99, 99])  # diverges inside page 2: split at 4
    assert r.slots == slots[:4]
    c.check_integrity()
    n, _ = put(a, c, [0, 1, 2, 3, 4, 5, 99, 99, 1])
    assert n == 4
    assert c.total_size() == 12
    s3 = a.alloc(3)
    assert c.insert([0, 1, 2], s3) == 0  # shorter than a page: nothing inserted
    a.free(s3)
    assert c.total_size() == 12
    c.check_integrity()
    assert c.evict(10**9) == 12
    assert a.num_free == 64


def test_page_children_keyed_by_first_page():
    a, c = make(page_size=2)
    put(a, c, [1, 2, 3, 4])
    put(a, c, [1, 3, 3, 4])  # same first token, different first page: a sibling
    assert c.total_size() == 8
    assert len(c.match_prefix([1, 3, 3, 4]).slots) == 4
    assert len(c.match_prefix([1, 2, 3, 5]).slots) == 2
    c.check_integrity()


def test_reset_frees_everything():
    a, c = make()
    put(a, c, [1, 2, 3])
    put(a, c, [1, 5])
    r = c.match_prefix([1, 2, 3])
    c.lock(r.node)
    with pytest.raises(IntegrityError):
        c.reset()
    c.unlock(r.node)
    c.reset()
    assert c.total_size() == c.evictable_size() == c.protected_size() == 0
    assert a.num_free == 64
    assert c.match_prefix([1, 2, 3]).slots == []
    with pytest.raises(IntegrityError):
        c.lock(r.node)  # handles from before the reset are dead
    c.check_integrity()
    put(a, c, [1, 2])
    assert c.total_size() == 2


def test_check_integrity_catches_corruption():
    a, c = make()
    put(a, c, [1, 2, 3])
    put(a, c, [1, 2, 4])
    c.check_integrity()
    c._evictable += 1
    with pytest.raises(IntegrityError):
        c.check_integrity()
    c._evictable -= 1
    leaf = c.match_prefix([1, 2, 3]).node
    a.free(leaf.slots)  # freed behind the tree's back
    with pytest.raises(IntegrityError):
        c.check_integrity()
    a2, c2 = make()
    put(a2, c2, [1, 2, 3])
    put(a2, c2, [1, 2, 4])
    n3 = c2.match_prefix([1, 2, 3]).node
    n4 = c2.match_prefix([1, 2, 4]).node
    n4.slots[0] = n3.slots[0]  # one slot in two nodes
    with pytest.raises(IntegrityError):
        c2.check_integrity()
    a3, c3 = make()
    put(a3, c3, [1, 2, 3])
    c3.match_prefix([1]).node.lock_ref = 5  # parent fine; now make a child exceed it
    c3._root.children[1].children[2].lock_ref = 7
    with pytest.raises(IntegrityError):
        c3.check_integrity()


def test_deep_tree_and_long_keys_use_no_recursion():
    depth = 3 * sys.getrecursionlimit()
    a, c = make(num_slots=depth + 200_000)
    tokens = list(range(depth))
    put(a, c, tokens)
    for k in range(depth - 1, 0, -1):  # one split per match: a chain `depth` nodes deep
        assert len(c.match_prefix(tokens[:k]).slots) == k
    r = c.match_prefix(tokens)
    assert len(r.slots) == depth
    c.lock(r.node)
    c.check_integrity()
    c.unlock(r.node)
    assert c.evict(depth) == depth
    assert a.num_free == a.num_slots
    long = [random.Random(0).randrange(5) for _ in range(100_000)]
    put(a, c, long)
    assert c.match_prefix(long + [7]).slots == c.match_prefix(long).slots
    assert len(c.match_prefix(long[:60_000] + [9]).slots) == 60_000
    c.check_integrity()
    c.reset()
    assert a.num_free == a.num_slots


def test_scale_2000_random_sequences():
    rng = random.Random(1234)
    bases = [[rng.randrange(1000) for _ in range(rng.randrange(1, 200))] for _ in range(50)]
    seqs = []
    for _ in range(2000):
        base = rng.choice(bases)
        cut = rng.randrange(len(base) + 1)
        seq = base[:cut] + [rng.randrange(1000) for _ in range(rng.randrange(0, 300 - cut + 1))]
        seqs.append(seq[:300])
    a, c = make(num_slots=2000 * 300)
    t0 = time.perf_counter()
    for seq in seqs:
        slots = a.alloc(len(seq))
        n = c.insert(seq, slots)
        a.free(slots[:n])
    for seq in seqs:
        assert len(c.match_prefix(seq).slots) == len(seq)
    elapsed = time.perf_counter() - t0
    c.check_integrity()
    assert a.num_free + c.total_size() == a.num_slots
    total = c.total_size()
    assert c.evict(10**9) == total
    assert a.num_free == a.num_slots
    print(f"2000 inserts + 2000 matches: {elapsed:.3f}s")
