"""Radix tree over token ids mapping cached prefixes to KV slots.

Each node holds a segment of token ids and the KV slots of those tokens; a path from the
root spells a cached prefix. Running requests lock the node ending their prefix (and thereby
every ancestor); unlocked leaves are evicted least recently used first. All walks are loops,
so keys of any length and trees of any depth are fine.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from radixlm.runtime.radix_cache.allocator import SlotAllocator
from radixlm.runtime.radix_cache.base import IntegrityError, MatchResult, PrefixCache


class _Node:
    __slots__ = ("key", "slots", "children", "parent", "lock_ref", "last_access", "uid")

    def __init__(self, key: list[int], slots: list[int], parent: _Node | None, uid: int) -> None:
        self.key = key
        self.slots = slots
        self.children: dict[object, _Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.uid = uid

    def __repr__(self) -> str:
        head = self.key[:8]
        more = "..." if len(self.key) > 8 else ""
        return (
            f"_Node(uid={self.uid}, len={len(self.key)}, key={head}{more}, "
            f"lock_ref={self.lock_ref})"
        )


class RadixCache(PrefixCache):
    """Prefix cache as a radix tree with lock counts and LRU eviction of unlocked leaves."""

    def __init__(self, allocator: SlotAllocator, page_size: int = 1) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self._allocator = allocator
        self._page = page_size
        self._clock = 0
        self._next_uid = 0
        self._init_tree()

    def _init_tree(self) -> None:
        self._root = self._new_node([], [], None)
        self._total = 0
        self._evictable = 0
        self._protected = 0
        # Unlocked, childless, non-root nodes: the eviction candidates.
        self._leaves: set[_Node] = set()

    # ------------------------------------------------------------------ helpers

    def _new_node(self, key: list[int], slots: list[int], parent: _Node | None) -> _Node:
        node = _Node(key, slots, parent, self._next_uid)
        self._next_uid += 1
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, tokens: Sequence[int], i: int) -> object:
        if self._page == 1:
            return tokens[i]
        return tuple(tokens[i : i + self._page])

    def _common_len(self, key: list[int], tokens: list[int], i: int) -> int:
        """Page-aligned length of the common prefix of ``key`` and ``tokens[i:]``."""
        klen = len(key)
        if tokens[i : i + klen] == key:  # the common case: the whole segment matches
            return klen
        limit = min(klen, len(tokens) - i)
        m = 0
        while m < limit and key[m] == tokens[i + m]:
            m += 1
        return m - m % self._page

    def _split(self, child: _Node, m: int) -> _Node:
        """Split ``child`` after ``m`` tokens; return the new upper node.

        ``child`` keeps the lower part, so handles to it still denote the same full prefix.
        """
        parent = child.parent
        assert parent is not None and 0 < m < len(child.key)
        ck = self._child_key(child.key, 0)
        mid = self._new_node(child.key[:m], child.slots[:m], parent)
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        del child.key[:m]
        del child.slots[:m]
        child.parent = mid
        mid.children[self._child_key(child.key, 0)] = child
        parent.children[ck] = mid
        return mid

    @staticmethod
    def _as_list(tokens: Sequence[int]) -> list[int]:
        return tokens if type(tokens) is list else list(tokens)

    def _check_alive(self, node: object) -> _Node:
        if not isinstance(node, _Node):
            raise TypeError(f"not a node of this cache: {node!r}")
        if node is not self._root and node.parent is None:
            raise IntegrityError(f"node was evicted or reset: {node!r}")
        return node

    # ------------------------------------------------------------------ public API

    @property
    def page_size(self) -> int:
        """Tokens per page; keys, matches and inserts are multiples of it."""
        return self._page

    @property
    def allocator(self) -> SlotAllocator:
        """The allocator the cache frees evicted slots into."""
        return self._allocator

    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``tokens``, rounded down to a multiple of ``page_size``.

        Returns a fresh list of its slots and the node ending exactly at the match (a node is
        split if the match ends inside it; the root if nothing matches). Marks the path as
        recently used.
        """
        tokens = self._as_list(tokens)
        n = len(tokens) - len(tokens) % self._page
        node = self._root
        if n == 0:
            return MatchResult([], node)
        out: list[int] = []
        node, _ = self._descend(tokens, n, self._tick(), out)
        return MatchResult(out, node)

    def continuation(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` cached tokens that follow ``tokens``, down the most recently used
        child at each fork; none unless all of ``tokens`` is cached. Nothing is split, locked or
        marked used (a draft is only a proposal)."""
        tokens = self._as_list(tokens)
        node, at, i, n = self._root, 0, 0, len(tokens)
        while i < n:
            if at == len(node.key):
                if n - i < self._page:  # part of a page: the newest child that starts with it
                    kids = [c for c in node.children.values() if c.key[: n - i] == tokens[i:]]
                    child = max(kids, key=lambda c: c.last_access) if kids else None
                else:
                    child = node.children.get(self._child_key(tokens, i))
                if child is None:
                    return []
                node, at = child, 0
            m = min(len(node.key) - at, n - i)
            if node.key[at : at + m] != tokens[i : i + m]:
                return []
            i, at = i + m, at + m
        out = node.key[at : at + limit]
        while len(out) < limit and node.children:
            node = max(node.children.values(), key=lambda c: c.last_access)
            out += node.key[: limit - len(out)]
        return out

    def _descend(self, tokens: list[int], n: int, now: int, slots_out: list[int] | None) -> tuple[_Node, int]:
        """Walk down the longest cached prefix of tokens[:n], splitting the last node so it
        ends exactly there and marking the path used; return that node and the prefix length
        (and collect the path's slots into ``slots_out`` when given)."""
        node = self._root
        i = 0
        while i < n:
            child = node.children.get(self._child_key(tokens, i))
            if child is None:
                break
            m = min(self._common_len(child.key, tokens, i), n - i)
            if m < len(child.key):
                child = self._split(child, m)
            child.last_access = now
            if slots_out is not None:
                slots_out.extend(child.slots)
            node = child
            i += m
        return node, i

    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache ``tokens`` with their KV ``slots``; return ``n``, the tokens already cached.

        Only the first ``inserted = len(tokens) // page_size * page_size`` tokens are inserted.
        Ownership afterwards:
          * the tree keeps its own slots for ``tokens[:n]`` and takes ``slots[n:inserted]``;
          * the caller still owns ``slots[:n]`` -- duplicates it must free, except the slots
            it got from ``match_prefix`` for this prefix (those are the tree's own; a caller
            that matched ``k`` tokens frees ``slots[k:n]``);
          * the caller owns ``slots[inserted:]`` (the page remainder) and must free them.
        Marks the path as recently used. Raises ValueError if the lengths differ.
        """
        if len(slots) != len(tokens):
            raise ValueError(
                f"insert needs one slot per token: got {len(tokens)} tokens and {len(slots)} slots"
            )
        tokens = self._as_list(tokens)
        n = len(tokens) - len(tokens) % self._page
        if n == 0:
            return 0
        now = self._tick()
        node, i = self._descend(tokens, n, now, None)
        if i < n:
            leaf = self._new_node(tokens[i:n], list(slots[i:n]), node)
            leaf.last_access = now
            node.children[self._child_key(leaf.key, 0)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            added = n - i
            self._total += added
            self._evictable += added
        return i

    def lock(self, node: object) -> None:
        """Increment the lock count of ``node`` and every ancestor below the root."""
        cur = self._check_alive(node)
        root = self._root
        while cur is not root:
            if cur.lock_ref == 0:
                size = len(cur.key)
                self._evictable -= size
                self._protected += size
                self._leaves.discard(cur)
            cur.lock_ref += 1
            cur = cur.parent  # type: ignore[assignment]

    def unlock(self, node: object) -> None:
        """Decrement the lock count of ``node`` and every ancestor below the root."""
        cur = self._check_alive(node)
        root = self._root
        if cur is not root and cur.lock_ref <= 0:
            raise IntegrityError(f"unlock of an unlocked node: {cur!r}")
        while cur is not root:
            if cur.lock_ref <= 0:
                raise IntegrityError(f"lock_ref would go negative: {cur!r}")
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                size = len(cur.key)
                self._evictable += size
                self._protected -= size
                if not cur.children:
                    self._leaves.add(cur)
            cur = cur.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Evict LRU unlocked leaves until ``num_tokens`` slots are freed or none is left.

        Whole nodes are evicted, so more than ``num_tokens`` may be freed. Returns the count.
        """
        if num_tokens <= 0 or not self._leaves:
            return 0
        heap = [(leaf.last_access, leaf.uid, leaf) for leaf in self._leaves]
        heapq.heapify(heap)
        root = self._root
        free = self._allocator.free
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None and leaf.lock_ref == 0 and not leaf.children
            free(leaf.slots)
            size = len(leaf.key)
            freed += size
            self._total -= size
            self._evictable -= size
            self._leaves.discard(leaf)
            del parent.children[self._child_key(leaf.key, 0)]
            leaf.parent = None
            if parent is not root and not parent.children and parent.lock_ref == 0:
                self._leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def total_size(self) -> int:
        """Tokens held by the tree."""
        return self._total

    def evictable_size(self) -> int:
        """Tokens held in unlocked nodes (evictable once their subtrees are gone)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens held in locked nodes."""
        return self._protected

    def check_integrity(self) -> None:
        """Walk the tree and check every invariant (sizes, locks, keys, slots, leaves); IntegrityError
        names the first one broken."""
        root = self._root
        if root.key or root.slots or root.parent is not None:
            raise IntegrityError("root must be empty")
        if root.lock_ref != 0:
            raise IntegrityError("root is never locked")
        total = evictable = protected = 0
        seen: set[int] = set()
        leaves: set[_Node] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                self._check_node(node, ck, child, seen)
                size = len(child.key)
                total += size
                if child.lock_ref:
                    protected += size
                else:
                    evictable += size
                    if not child.children:
                        leaves.add(child)
                stack.append(child)
        if total != self._total:
            raise IntegrityError(f"total_size {self._total} != walked {total}")
        if evictable != self._evictable:
            raise IntegrityError(f"evictable {self._evictable} != walked {evictable}")
        if protected != self._protected:
            raise IntegrityError(f"protected {self._protected} != walked {protected}")
        if leaves != self._leaves:
            raise IntegrityError("eviction-candidate set out of sync")

    def _check_node(self, node: _Node, ck: object, child: _Node, seen: set[int]) -> None:
        """One parent -> child link of the walk in ``check_integrity``; adds child's slots to ``seen``."""
        key = child.key
        problem = ""
        if child.parent is not node:
            problem = "bad parent link"
        elif not key:
            problem = "empty segment in non-root node"
        elif len(key) != len(child.slots):
            problem = "key/slots length mismatch"
        elif len(key) % self._page:
            problem = "segment not page aligned"
        elif ck != self._child_key(key, 0):
            problem = f"child keyed {ck!r} but starts {key[:self._page]}"
        elif child.lock_ref < 0:
            problem = "negative lock_ref"
        elif node is not self._root and node.lock_ref < child.lock_ref:
            problem = "lock_ref above parent's"
        elif node is not self._root and node.last_access < child.last_access:
            problem = "LRU order broken"
        if problem:
            raise IntegrityError(f"{problem} at {child!r}")
        alloc = self._allocator
        for s in child.slots:
            if s in seen:
                raise IntegrityError(f"slot {s} appears twice in the tree")
            if not alloc.is_allocated(s):
                raise IntegrityError(f"slot {s} is in the tree but not allocated")
            seen.add(s)

    def reset(self) -> None:
        """Drop the whole tree, freeing every slot back to the allocator."""
        if self._protected:
            raise IntegrityError("reset while nodes are locked")
        slots: list[int] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            slots.extend(node.slots)
            stack.extend(node.children.values())
            node.children = {}
            node.parent = None
        self._allocator.free(slots)
        self._init_tree()

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self._page}, total={self._total}, "
            f"evictable={self._evictable}, protected={self._protected})"
        )
