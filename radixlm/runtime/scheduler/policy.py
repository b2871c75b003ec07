"""Orders of the waiting queue: which requests to admit first.

Each policy takes the waiting requests (their `prefix_hint` and `node` refreshed from the
prefix cache by the scheduler) and returns them in admission order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixlm.runtime.scheduler.request import Request


def fcfs(waiting: list[Request]) -> list[Request]:
    """First come, first served."""
    return sorted(waiting, key=lambda r: r.arrival)


def lpm(waiting: list[Request]) -> list[Request]:
    """Longest cached prefix first, so hot prefixes are reused before they are evicted."""
    return sorted(waiting, key=lambda r: (-r.prefix_hint, r.arrival))


def dfs_weight(waiting: list[Request]) -> list[Request]:
    """Depth-first over the cache tree, heavier subtrees (more waiting requests) first, so
    requests that share a prefix run back to back while it is hot."""
    weight: dict[int, int] = {}
    children: dict[int, list[Any]] = {}
    at_node: dict[int, list[Request]] = {}
    root: Any = None
    for r in waiting:
        node = r.node
        at_node.setdefault(id(node), []).append(r)
        child = None
        while node is not None:
            seen = id(node) in weight
            weight[id(node)] = weight.get(id(node), 0) + 1
            if child is not None:  # child was new, so this link is too
                children.setdefault(id(node), []).append(child)
            if seen:
                # ancestors were already linked: just add the weight up the chain
                parent = getattr(node, "parent", None)
                while parent is not None:
                    weight[id(parent)] += 1
                    parent = getattr(parent, "parent", None)
                break
            child, node = node, getattr(node, "parent", None)
        else:
            root = child
    order: list[Request] = []
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        order.extend(sorted(at_node.get(id(node), []), key=lambda r: r.arrival))
        kids = sorted(children.get(id(node), []), key=lambda n: weight[id(n)])
        stack.extend(kids)  # heaviest popped first
    assert len(order) == len(waiting)
    return order


POLICIES: dict[str, Callable[[list[Request]], list[Request]]] = {
    "lpm": lpm,
    "dfs-weight": dfs_weight,
    "fcfs": fcfs,
}
