"""An approximate prefix tree over text characters: what one worker has recently served.

The router cannot see a worker's radix cache (it holds token ids and evicts on its own), so it
keeps its own picture of it: the prompts it sent there, as characters, with the least recently
used leaves dropped once the tree holds more than `max_chars` characters.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    label: str  # the characters on the edge into this node
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # by the first character of their label
    last_use: int = 0


class CharTree:
    """A radix tree over characters with LRU eviction of leaves past `max_chars`."""

    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self._root = _Node("", None)
        self._chars = 0
        self._clock = 0

    @property
    def low_water(self) -> int:
        """What eviction leaves: a little under `max_chars`, so a full tree is not walked on every insert."""
        return self.max_chars - self.max_chars // 16

    @property
    def size(self) -> int:
        """Characters held (the sum of edge labels)."""
        return self._chars

    def match(self, text: str) -> int:
        """How many leading characters of `text` the tree holds (use is marked by `insert` alone:
        the router asks every worker's tree, but sends the prompt to one)."""
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            n = _common(child.label, text, i)
            i += n
            if n < len(child.label):
                break
            node = child
        return i

    def insert(self, text: str) -> None:
        """Add `text` (as a path from the root); past `max_chars`, evict down to `low_water`."""
        self._clock += 1
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node, last_use=self._clock)
                node.children[text[i]] = leaf
                self._chars += len(leaf.label)
                break
            n = _common(child.label, text, i)
            if n < len(child.label):
                child = self._split(child, n)
            child.last_use = self._clock
            node, i = child, i + n
        if self._chars > self.max_chars:
            self.evict(self.low_water)

    def evict(self, keep_chars: int) -> None:
        """Drop least recently used leaves until at most `keep_chars` characters remain."""
        if self._chars <= keep_chars:
            return
        heap = [(n.last_use, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self._chars > keep_chars and heap:
            leaf = heapq.heappop(heap)[2]
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.label[0]]
            self._chars -= len(leaf.label)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))  # it became a leaf

    def clear(self) -> None:
        """Forget everything (the worker's cache was flushed, or it restarted)."""
        self._root = _Node("", None)
        self._chars = 0

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n characters; returns the new middle node."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.label)
        mid = _Node(child.label[:n], parent, last_use=child.last_use)
        parent.children[mid.label[0]] = mid
        child.label = child.label[n:]
        child.parent = mid
        mid.children[child.label[0]] = child
        return mid

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out


def _common(label: str, text: str, start: int) -> int:
    """Length of the common prefix of `label` and `text[start:]`."""
    if text.startswith(label, start):
        return len(label)
    n = min(len(label), len(text) - start)
    k = 0
    while k < n and label[k] == text[start + k]:
        k += 1
    return k
