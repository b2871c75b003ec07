"""RadixCache.continuation: the cached tokens that follow a cached sequence (a draft for
speculative decoding), down the most recently used branch, without touching the tree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.radix_cache import CACHES, NoCache, PrefixCache, RadixCache, SlotAllocator


def make(page_size: int = 1, num_slots: int = 256) -> tuple[SlotAllocator, RadixCache]:
    a = SlotAllocator(num_slots)
    return a, RadixCache(a, page_size)


def put(a: SlotAllocator, c: PrefixCache, tokens: list[int]) -> None:
    """Insert ``tokens`` with fresh slots, freeing the ones the caller keeps (as the scheduler does)."""
    slots = a.alloc(len(tokens))
    assert slots is not None
    n = c.insert(tokens, slots)
    inserted = len(tokens) - len(tokens) % c.page_size
    a.free(slots[:n])
    a.free(slots[inserted:])
    c.check_integrity()


def snapshot(c: RadixCache) -> tuple:
    """Everything continuation must leave alone: each node's key, slots, lock count, last use and
    identity, nested as the tree is, and the cache's sizes and clock."""
    def node(n) -> tuple:
        kids = tuple(sorted((repr(k), node(ch)) for k, ch in n.children.items()))
        return (tuple(n.key), tuple(n.slots), n.lock_ref, n.last_access, n.uid, id(n), kids)
    return (node(c._root), c.total_size(), c.evictable_size(), c.protected_size(), c._clock, len(c._leaves))


def test_tokens_after_a_cached_prefix_up_to_the_limit():
    a, c = make()
    put(a, c, [1, 2, 3, 4, 5, 6, 7, 8])
    assert c.continuation([1, 2, 3], 10) == [4, 5, 6, 7, 8]
    assert c.continuation([1, 2, 3], 2) == [4, 5]
    assert c.continuation([1, 2, 3], 0) == []
    assert c.continuation([], 3) == [1, 2, 3]
    assert c.continuation([1, 2, 3, 4, 5, 6, 7, 8], 4) == []  # the whole sequence: nothing follows
    assert c.continuation((1, 2), 3) == [3, 4, 5]  # any sequence of ints


def test_prefix_ending_inside_a_node_or_at_its_end_and_across_levels():
    a, c = make()
    put(a, c, [1, 2, 3, 4, 5, 6])
    put(a, c, [1, 2, 3, 9, 9])  # nodes: [1 2 3] -> {[4 5 6], [9 9]}
    put(a, c, [1, 2, 3, 9, 9, 7, 7, 7])  # [9 9] -> [7 7 7]
    assert c.continuation([1, 2], 10) == [3, 9, 9, 7, 7, 7]  # ends inside [1 2 3], newest branch after
    assert c.continuation([1, 2, 3], 10) == [9, 9, 7, 7, 7]  # ends at a node's end
    assert c.continuation([1, 2, 3, 4], 10) == [5, 6]  # inside the older branch: that branch's tokens
    assert c.continuation([1, 2, 3, 9], 2) == [9, 7]  # the limit falls inside the next node
    assert c.continuation([1, 2, 3, 9, 9, 7], 10) == [7, 7]


def test_follows_the_most_recently_used_child_at_a_fork():
    a, c = make()
    put(a, c, [5, 1, 1, 1])
    put(a, c, [5, 2, 2, 2])
    put(a, c, [5, 3, 3, 3])
    assert c.continuation([5], 10) == [3, 3, 3]  # the newest insert
    c.match_prefix([5, 1, 1, 1])
    assert c.continuation([5], 10) == [1, 1, 1]
    c.match_prefix([5, 2])  # a match of a branch's first token alone makes it the newest too
    assert c.continuation([5], 10) == [2, 2, 2]
    assert c.continuation([], 2) == [5, 2]
    # deeper forks are decided each by their own children's last use
    put(a, c, [5, 1, 1, 1, 8, 8])
    put(a, c, [5, 1, 1, 1, 9, 9])
    c.match_prefix([5, 1, 1, 1, 8])
    assert c.continuation([5], 10) == [1, 1, 1, 8, 8]
    c.check_integrity()


@pytest.mark.parametrize("query", [[1, 2, 4], [1, 2, 3, 4], [7], [1, 5], [2, 3], [1, 2, 3, 9, 9, 1]])
def test_nothing_unless_the_tokens_are_all_cached(query):
    a, c = make()
    put(a, c, [1, 2, 3])
    put(a, c, [1, 2, 3, 9, 9])
    assert c.continuation(query, 10) == []


def test_reads_only_nothing_split_locked_or_marked_used():
    a, c = make()
    for seq in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [1, 2, 3, 9, 9, 7, 7], [4, 4, 4, 4]):
        put(a, c, seq)
    locked = c.match_prefix([4, 4]).node  # a lock and a split of its own, before the snapshot
    c.lock(locked)
    before = snapshot(c)
    free_before = a.num_free
    queries = [[], [1], [1, 2], [1, 2, 3], [1, 2, 3, 9], [1, 2, 3, 9, 9, 7], [1, 2, 3, 4, 5, 6], [4, 4, 4],
               [1, 2, 8], [3], [4, 4, 4, 4, 4]]
    for q in queries:
        for limit in (0, 1, 3, 100):
            c.continuation(q, limit)
    assert snapshot(c) == before
    assert a.num_free == free_before
    c.check_integrity()
    c.unlock(locked)
    c.check_integrity()


def test_pages_of_two_tokens():
    a, c = make(page_size=2)
    put(a, c, [1, 2, 3, 4, 5, 6, 7])  # the last token is a part page: not cached
    assert c.total_size() == 6
    assert c.continuation([1, 2], 10) == [3, 4, 5, 6]
    assert c.continuation([1, 2, 3], 10) == [4, 5, 6]  # ends inside a page of a node
    assert c.continuation([1, 2, 3, 4, 5, 6], 10) == []
    assert c.continuation([1, 2, 3, 4, 5, 6, 7], 10) == []  # 7 is not cached
    put(a, c, [1, 2, 3, 4, 8, 9])  # [1 2 3 4] -> {[5 6], [8 9]}
    assert c.continuation([1, 2, 3, 4], 10) == [8, 9]
    assert c.continuation([1, 2, 3, 4, 8, 9], 10) == []
    c.match_prefix([1, 2, 3, 4, 5, 6])
    assert c.continuation([1, 2], 3) == [3, 4, 5]
    assert c.continuation([1, 2, 3, 4], 10) == [5, 6]
    assert c.continuation([1, 2, 3, 4, 9], 10) == []  # no page starts 9 there
    assert c.continuation([1, 2, 3, 4, 8, 7], 10) == []
    c.check_integrity()


@pytest.mark.parametrize("query, want", [([1], [2, 3, 4, 5, 6]), ([1, 2, 3], [4, 5, 6]), ([1, 2, 3, 4, 5], [6]),
                                         ([1, 2, 3, 4, 8], [9]), ([1, 2, 3, 4, 5, 7], [])])
def test_pages_query_ends_inside_the_first_page_past_a_node_boundary(query, want):
    """A query whose tokens past the last node boundary it reaches are fewer than a page: the
    child is found by those tokens, the newest of those that start with them (the engine's
    sequences have any length, the tree's nodes page-aligned ones)."""
    a, c = make(page_size=2)
    put(a, c, [1, 2])
    put(a, c, [1, 2, 3, 4])
    put(a, c, [1, 2, 3, 4, 8, 9])
    put(a, c, [1, 2, 3, 4, 5, 6])  # nodes [1 2] -> [3 4] -> {[8 9], [5 6]}, [5 6] the newest
    before = snapshot(c)
    assert c.continuation(query, 10) == want
    assert snapshot(c) == before


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_cache_that_shares_nothing_has_no_continuation(page_size):
    a = SlotAllocator(64)
    c = CACHES["none"](a, page_size)
    assert isinstance(c, NoCache)
    put(a, c, [1, 2, 3, 4])
    assert c.continuation([1, 2], 5) == []
    assert c.continuation([], 5) == []
    assert a.num_free == 64


SEQS = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(seqs=SEQS, page_size=st.sampled_from([1, 2]), data=st.data())
def test_continuation_follows_some_inserted_sequence(seqs, page_size, data):
    """For a query that is a cached prefix of one inserted sequence: the continuation is at most
    ``limit`` tokens that follow the query in some inserted sequence; it is not empty when one of
    them goes on past the query; with a limit past every sequence it reaches one's cached end."""
    a, c = make(page_size=page_size)
    for s in seqs:
        put(a, c, s)
    cached = [s[: len(s) - len(s) % page_size] for s in seqs]
    pick = data.draw(st.sampled_from(cached))
    query = pick[: data.draw(st.integers(0, len(pick)))]
    limit = data.draw(st.integers(0, 14))
    before = snapshot(c)
    got = c.continuation(query, limit)
    assert snapshot(c) == before
    assert len(got) <= limit
    n = len(query)
    assert any(s[:n] == query and s[n : n + len(got)] == got for s in cached), (query, got, cached)
    if limit > 0 and any(s[:n] == query and len(s) > n for s in cached):
        assert got, (query, cached)
    if limit >= 12:
        assert query + got in [s for s in cached if s[:n] == query], (query, got, cached)
