"""Property tests: RadixCache against a naive per-prefix oracle.

The oracle keeps, for every cached page-aligned token prefix (a tuple), the slots of its last
page and the time it was last touched (with pages, siblings may share leading tokens, so the
oracle works at page granularity). Because a match or insert touches exactly one root path, unlocked
leaves never share a touch time, so LRU eviction has one correct order at token granularity;
the tree evicts whole nodes, so it must evict exactly the first ``freed / page_size`` prefixes of
that order.
"""

import heapq
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlm.runtime.radix_cache import RadixCache, SlotAllocator

NUM_SLOTS = 40
TOKENS = st.lists(st.integers(0, 3), max_size=12)


def tree_contents(cache):
    """Every cached page-aligned prefix -> slots of its last page, read from the tree's nodes."""
    page = cache.page_size
    out = {}
    stack = [((), cache._root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            p = prefix
            for j in range(0, len(child.key), page):
                p = p + tuple(child.key[j : j + page])
                assert p not in out
                out[p] = tuple(child.slots[j : j + page])
            stack.append((p, child))
    return out


class Model:
    """Drives a RadixCache the way a scheduler does and checks it against the oracle."""

    def __init__(self, page_size):
        self.alloc = SlotAllocator(NUM_SLOTS)
        self.cache = RadixCache(self.alloc, page_size)
        self.page = page_size
        self.cached = {}  # page-aligned prefix tuple -> slots of its last page
        self.atime = {}  # prefix tuple -> last touch
        self.clock = 0
        self.locks = []  # (node, locked prefix tuple)

    # -- oracle helpers
    def aligned(self, n):
        return n - n % self.page

    def longest(self, t):
        k = 0
        while k + self.page <= len(t) and tuple(t[: k + self.page]) in self.cached:
            k += self.page
        return k

    def touch(self, t, k):
        if k == 0:
            return
        self.clock += 1
        for j in range(self.page, k + 1, self.page):
            self.atime[tuple(t[:j])] = self.clock

    def protected(self):
        prot = set()
        for _, p in self.locks:
            for j in range(self.page, len(p) + 1, self.page):
                prot.add(p[:j])
        return prot

    def lru_order(self):
        """Page prefixes in the order LRU eviction must free them (all evictable ones)."""
        page = self.page
        prot = self.protected()
        nchild = dict.fromkeys(self.cached, 0)
        for p in self.cached:
            if len(p) > page:
                nchild[p[:-page]] += 1
        heap = [(self.atime[p], p) for p in self.cached if nchild[p] == 0 and p not in prot]
        heapq.heapify(heap)
        order = []
        while heap:
            t, p = heapq.heappop(heap)
            assert not heap or heap[0][0] != t, "two LRU candidates share a touch time"
            order.append(p)
            if len(p) > page:
                q = p[:-page]
                nchild[q] -= 1
                if nchild[q] == 0 and q not in prot:
                    heapq.heappush(heap, (self.atime[q], q))
        return order

    # -- operations
    def evict(self, num):
        order = self.lru_order()
        free_before = self.alloc.num_free
        freed = self.cache.evict(num)
        assert self.alloc.num_free - free_before == freed
        assert freed % self.page == 0
        if num > 0:
            assert freed >= min(num, len(order) * self.page)
        else:
            assert freed == 0
        for p in order[: freed // self.page]:
            del self.cached[p]
            del self.atime[p]
        return freed

    def alloc_or_evict(self, n):
        slots = self.alloc.alloc(n)
        if slots is None:
            self.evict(n - self.alloc.num_free)
            slots = self.alloc.alloc(n)
        return slots

    def match(self, t, do_lock):
        r = self.cache.match_prefix(t)
        k = self.longest(t)
        expect = []
        for j in range(self.page, k + 1, self.page):
            expect.extend(self.cached[tuple(t[:j])])
        assert r.slots == expect
        self.touch(t, k)
        if do_lock:
            self.cache.lock(r.node)
            self.locks.append((r.node, tuple(t[:k])))
        return r

    def oracle_insert(self, t, slots, n):
        ins = self.aligned(len(t))
        assert n == self.longest(t[:ins])
        for j in range(n + self.page, ins + 1, self.page):
            self.cached[tuple(t[:j])] = tuple(slots[j - self.page : j])
        self.touch(t, ins)
        return ins

    def insert_fresh(self, t):
        slots = self.alloc_or_evict(len(t))
        if slots is None:
            return
        n = self.cache.insert(t, slots)
        ins = self.oracle_insert(t, slots, n)
        self.alloc.free(slots[:n])
        self.alloc.free(slots[ins:])

    def extend(self, t):
        """match + lock, allocate the rest, insert, then move the lock to the longer node."""
        r = self.match(t, do_lock=True)
        k = len(r.slots)
        new = self.alloc_or_evict(len(t) - k)
        if new is None:
            self.unlock(len(self.locks) - 1)
            return
        full = r.slots + new
        n = self.cache.insert(t, full)
        assert n >= k
        ins = self.oracle_insert(t, full, n)
        self.alloc.free(full[k:n])
        self.alloc.free(full[ins:])
        self.match(t, do_lock=True)
        self.unlock(len(self.locks) - 2)

    def unlock(self, i):
        node, _ = self.locks.pop(i)
        self.cache.unlock(node)

    def check(self):
        self.cache.check_integrity()
        assert tree_contents(self.cache) == self.cached
        prot = self.protected()
        assert prot <= self.cached.keys()
        page = self.page
        assert self.cache.total_size() == len(self.cached) * page
        assert self.cache.protected_size() == len(prot) * page
        assert self.cache.evictable_size() == (len(self.cached) - len(prot)) * page
        assert self.alloc.num_free == NUM_SLOTS - len(self.cached) * page

    def finish(self, use_reset):
        while self.locks:
            self.unlock(len(self.locks) - 1)
        self.check()
        total = self.cache.total_size()
        if use_reset:
            self.cache.reset()
        else:
            assert self.evict(10**9) == total
            assert not self.cached
        self.cache.check_integrity()
        assert self.cache.total_size() == 0
        assert self.alloc.num_free == NUM_SLOTS  # no leak, and no double free got this far


class RadixCacheMachine(RuleBasedStateMachine):
    model: Model

    @initialize(page=st.sampled_from([1, 2]), use_reset=st.booleans())
    def setup(self, page, use_reset):
        self.model = Model(page)
        self.use_reset = use_reset

    @rule(t=TOKENS)
    def insert_fresh(self, t):
        self.model.insert_fresh(t)

    @rule(t=TOKENS)
    def extend(self, t):
        self.model.extend(t)

    @rule(t=TOKENS, do_lock=st.booleans())
    def match(self, t, do_lock):
        self.model.match(t, do_lock)

    @precondition(lambda self: self.model.locks)
    @rule(data=st.data())
    def unlock(self, data):
        self.model.unlock(data.draw(st.integers(0, len(self.model.locks) - 1)))

    @rule(num=st.integers(0, 12))
    def evict(self, num):
        self.model.evict(num)

    @invariant()
    def consistent(self):
        self.model.check()

    def teardown(self):
        if hasattr(self, "model"):
            self.model.finish(self.use_reset)


RadixCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixCacheMachine = RadixCacheMachine.TestCase


def test_long_seeded_random_runs():
    """Long random op sequences (seeded) reach states the short hypothesis runs do not."""
    for seed in range(6):
        rng = random.Random(seed)
        m = Model(page_size=1 + seed % 2)
        for _ in range(600):
            t = [rng.randrange(4) for _ in range(rng.randrange(13))]
            op = rng.random()
            if op < 0.3:
                m.insert_fresh(t)
            elif op < 0.5:
                m.extend(t)
            elif op < 0.7:
                m.match(t, do_lock=rng.random() < 0.3)
            elif op < 0.85 and m.locks:
                m.unlock(rng.randrange(len(m.locks)))
            else:
                m.evict(rng.randrange(13))
            m.check()
        m.finish(use_reset=seed % 3 == 0)
