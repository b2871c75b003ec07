"""Table tests for SlotAllocator."""

import pytest

from radixlm.runtime.radix_cache import IntegrityError, SlotAllocator


def test_fresh_allocator_hands_out_1_to_n_never_0():
    a = SlotAllocator(5)
    assert a.num_slots == 5 and a.num_free == 5
    got = a.alloc(5)
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert a.num_free == 0
    assert a.alloc(1) is None


def test_alloc_zero_and_too_many():
    a = SlotAllocator(3)
    assert a.alloc(0) == []
    assert a.alloc(4) is None
    assert a.num_free == 3  # a failed alloc takes nothing
    with pytest.raises(ValueError):
        a.alloc(-1)


def test_free_then_realloc_reuses_slots():
    a = SlotAllocator(4)
    x = a.alloc(3)
    a.free(x[:2])
    assert a.num_free == 3
    y = a.alloc(3)
    assert set(y) == set(x[:2]) | {4}
    assert a.is_allocated(x[2]) and all(a.is_allocated(s) for s in y)
    assert a.num_used == 4


def test_double_free_and_out_of_range_are_integrity_errors():
    a = SlotAllocator(4)
    x = a.alloc(2)
    a.free(x)
    with pytest.raises(IntegrityError):
        a.free([x[0]])
    with pytest.raises(IntegrityError):
        a.free([0])  # the padding slot is never handed out
    with pytest.raises(IntegrityError):
        a.free([5])
    b = SlotAllocator(4)
    y = b.alloc(1)
    with pytest.raises(IntegrityError):
        b.free([y[0], y[0]])  # double free inside one call


def test_free_never_allocated_slot():
    a = SlotAllocator(4)
    with pytest.raises(IntegrityError):
        a.free([2])
    assert not a.is_allocated(0) and not a.is_allocated(2) and not a.is_allocated(99)


def test_bad_size():
    with pytest.raises(ValueError):
        SlotAllocator(-1)
    assert SlotAllocator(0).alloc(1) is None


def test_check_integrity_catches_a_corrupt_free_stack():
    a = SlotAllocator(4)
    x = a.alloc(2)
    a.check_integrity()
    a._free.append(x[0])  # handed out and free at once
    with pytest.raises(IntegrityError):
        a.check_integrity()
    a._free.pop()
    a._free.pop()  # a slot lost: neither free nor in use
    with pytest.raises(IntegrityError):
        a.check_integrity()
