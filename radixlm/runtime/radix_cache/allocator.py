"""Token-slot allocator for the KV pool.

Plain Python ints only: the device pool has ``num_slots + 1`` rows, row 0 is the padding
slot that is never handed out, and rows ``1..num_slots`` are managed here.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixlm.runtime.radix_cache.base import IntegrityError


class SlotAllocator:
    """Hands out KV token slots from a free stack; O(n) per call in the slots handled."""

    __slots__ = ("_num_slots", "_free", "_in_use")

    def __init__(self, num_slots: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative int, got {num_slots!r}")
        self._num_slots = num_slots
        # Reversed so that a fresh allocator hands out 1, 2, 3, ... (pop from the end).
        self._free: list[int] = list(range(num_slots, 0, -1))
        # In-use flags make double frees and frees of never-allocated slots cheap to catch.
        self._in_use = bytearray(num_slots + 1)

    @property
    def num_slots(self) -> int:
        """Usable slots (the padding slot 0 excluded)."""
        return self._num_slots

    @property
    def num_free(self) -> int:
        """Slots currently available to ``alloc``."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots currently handed out."""
        return self._num_slots - len(self._free)

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is currently handed out (False for 0 and out-of-range slots)."""
        return 0 < slot <= self._num_slots and self._in_use[slot] == 1

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free slots, or return None (taking nothing) if fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n == 0:
            return []
        free = self._free
        if n > len(free):
            return None
        out = free[-n:]
        del free[-n:]
        out.reverse()
        in_use = self._in_use
        for s in out:
            in_use[s] = 1
        return out

    def free(self, slots: Iterable[int]) -> None:
        """Return slots to the pool; a double free or an out-of-range slot is an IntegrityError."""
        in_use = self._in_use
        n = self._num_slots
        free = self._free
        for s in slots:
            if not 0 < s <= n:
                raise IntegrityError(f"slot {s} out of range 1..{n}")
            if not in_use[s]:
                raise IntegrityError(f"double free of slot {s}")
            in_use[s] = 0
            free.append(s)

    def check_integrity(self) -> None:
        """The free stack and the in-use flags agree; IntegrityError names the first slot that does not."""
        in_use = self._in_use
        seen: set[int] = set()
        for s in self._free:
            if not 0 < s <= self._num_slots:
                raise IntegrityError(f"free slot {s} out of range 1..{self._num_slots}")
            if in_use[s] or s in seen:
                raise IntegrityError(f"slot {s} is free twice or free and in use")
            seen.add(s)
        if len(seen) + sum(in_use) != self._num_slots:
            raise IntegrityError(f"{self._num_slots - len(seen) - sum(in_use)} slots are neither free nor in use")

    def __repr__(self) -> str:
        return f"SlotAllocator(num_slots={self._num_slots}, num_free={len(self._free)})"
