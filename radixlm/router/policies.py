"""Routing policies (a registry): which worker gets a request, from its routing key and the loads.

Pure logic over worker indices: no HTTP, so they are table- and property-tested on their own.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from radixlm.router.config import RouterConfig
from radixlm.router.tree import CharTree


@dataclass(frozen=True)
class Choice:
    """A routing decision: the worker and why (a label of the router's metrics)."""

    worker: int
    reason: str  # affinity | balance | least_loaded | round_robin | shortest_queue


class Policy(Protocol):
    def choose(self, key: str, loads: Sequence[int], candidates: Collection[int]) -> Choice:
        """Pick one of `candidates` (non-empty) for a request with routing key `key`; `loads[i]` is
        the number of requests in flight on worker i."""
        ...

    def forget(self, worker: int) -> None:
        """The worker lost its cache (flushed, restarted, taken out)."""
        ...

    def remembered(self, worker: int) -> int:
        """Characters of prompts the policy holds for the worker (0 for one that keeps none)."""
        ...


class RoundRobin:
    """Each request to the next candidate in turn."""

    def __init__(self, num_workers: int, config: RouterConfig) -> None:
        self._n = num_workers
        self._next = 0

    def choose(self, key: str, loads: Sequence[int], candidates: Collection[int]) -> Choice:
        for step in range(self._n):
            w = (self._next + step) % self._n
            if w in candidates:
                self._next = w + 1
                return Choice(w, "round_robin")
        raise ValueError("no candidate worker")

    def forget(self, worker: int) -> None:
        pass

    def remembered(self, worker: int) -> int:
        return 0


class ShortestQueue:
    """The candidate with the fewest requests in flight; ties taken in turn."""

    def __init__(self, num_workers: int, config: RouterConfig) -> None:
        self._turn = RoundRobin(num_workers, config)

    def choose(self, key: str, loads: Sequence[int], candidates: Collection[int]) -> Choice:
        low = min(loads[c] for c in candidates)
        w = self._turn.choose(key, loads, [c for c in candidates if loads[c] == low]).worker
        return Choice(w, "shortest_queue")

    def forget(self, worker: int) -> None:
        pass

    def remembered(self, worker: int) -> int:
        return 0


class CacheAware:
    """Prefix affinity over approximate per-worker prefix trees, unless the load is imbalanced.

    - Imbalanced (max - min in-flight > balance_abs_threshold and max > balance_rel_threshold * min):
      the least loaded candidate, whatever it holds.
    - Else the candidate whose tree holds the longest prefix of the key, if that prefix is at least
      cache_threshold of the key (ties: the less loaded one).
    - Else the least loaded candidate (ties: the one remembering less text, so new prefixes spread).
    The key is then remembered in the chosen worker's tree.
    """

    def __init__(self, num_workers: int, config: RouterConfig) -> None:
        self.trees = [CharTree(config.max_tree_chars) for _ in range(num_workers)]
        self._turn = 0  # ties between equally idle workers for keyless requests (sessions) go in turn
        self._threshold = config.cache_threshold
        self._abs = config.balance_abs_threshold
        self._rel = config.balance_rel_threshold

    def choose(self, key: str, loads: Sequence[int], candidates: Collection[int]) -> Choice:
        if not candidates:
            raise ValueError("no candidate worker")
        low = min(loads[c] for c in candidates)
        high = max(loads[c] for c in candidates)
        if high - low > self._abs and high > self._rel * low:
            choice = Choice(self._least_loaded(loads, candidates), "balance")
        else:
            choice = self._by_prefix(key, loads, candidates)
        if key:
            self.trees[choice.worker].insert(key)
        return choice

    def _by_prefix(self, key: str, loads: Sequence[int], candidates: Collection[int]) -> Choice:
        if key:
            matched = {c: self.trees[c].match(key) for c in candidates}
            best = min(candidates, key=lambda c: (-matched[c], loads[c], c))
            if matched[best] > 0 and matched[best] >= self._threshold * len(key):
                return Choice(best, "affinity")
        if not key:
            self._turn += 1
            n = len(self.trees)
            return Choice(min(candidates, key=lambda c: (loads[c], (c - self._turn) % n)), "least_loaded")
        return Choice(self._least_loaded(loads, candidates), "least_loaded")

    def _least_loaded(self, loads: Sequence[int], candidates: Collection[int]) -> int:
        return min(candidates, key=lambda c: (loads[c], self.trees[c].size, c))

    def forget(self, worker: int) -> None:
        self.trees[worker].clear()

    def remembered(self, worker: int) -> int:
        return self.trees[worker].size


POLICIES: dict[str, Callable[[int, RouterConfig], Policy]] = {
    "cache_aware": CacheAware,
    "round_robin": RoundRobin,
    "shortest_queue": ShortestQueue,
}


def make_policy(name: str, num_workers: int, config: RouterConfig) -> Policy:
    """The policy registered as `name`, for `num_workers` workers."""
    if name not in POLICIES:
        raise ValueError(f"unknown --policy {name!r}; choose one of {', '.join(sorted(POLICIES))}")
    return POLICIES[name](num_workers, config)
