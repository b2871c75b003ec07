"""Fault boundaries: an exception raised on behalf of one request ends that request alone.

The step's batched phases (the forward pass, masks and sampling, logprobs) run every request
together; when one raises, `isolate` runs the batch's items one at a time to find the items at
fault, so the others go on with the same results. Per-request phases (admission, the jump over a
grammar's forced opening, output processing: grammar, detokenizing, stops) catch around each
request. What is left after a fault is checked (`EngineCore` runs the KV integrity check);
only exceptions that mean shared state is broken (`is_fatal`) end the engine, whose server then
starts a fresh one. docs/reliability.md, "Fault boundaries".

`FaultHook` is the test-only way in: off unless a test sets one on the engine, it raises
`InjectedFault` in a chosen phase for a chosen request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger("radixlm.engine")

T = TypeVar("T")
R = TypeVar("R")

# Where a fault may be raised on behalf of one request (the hook's phases, in step order).
PHASES = ("admit", "jump", "forward", "logprobs", "mask", "sample", "accept", "detokenize", "stop", "finish")
# Exception type names that say the device, not one request, is broken (torch's CUDA errors).
_FATAL_NAMES = frozenset({"AcceleratorError", "CudaError", "RankFailure", "IntegrityError", "MemoryError"})
_FATAL_TEXT = ("CUDA error", "device-side assert", "NCCL error", "CUBLAS_STATUS", "cuDNN error")


class InjectedFault(RuntimeError):
    """Raised by a `FaultHook` (tests only)."""


@dataclass
class FaultHook:
    """Test-only: raise `InjectedFault` each time request ``rid`` passes ``phase`` after it
    passed it ``after`` times unharmed (a persistent fault, so running a batch's items one at a
    time finds it again). In a batched phase the request's presence in the batch counts."""

    phase: str
    rid: str
    after: int = 0
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"unknown fault phase {self.phase!r}; choose one of {PHASES}")

    def check(self, phase: str, rids: Sequence[str]) -> None:
        if phase != self.phase or self.rid not in rids:
            return
        if self.seen < self.after:
            self.seen += 1
            return
        self.fired += 1
        raise InjectedFault(f"fault injected in {phase} for request {self.rid}")


class FaultBoundary:
    """The engine's fault policy: the test hook, which exceptions are fatal, and the one-line
    report of a contained fault (its traceback goes to the log)."""

    def __init__(self) -> None:
        self.hook: FaultHook | None = None
        self.contained = 0  # faults contained since start
        self.unchecked = False  # a fault was contained since the last integrity check

    def check(self, phase: str, rids: Sequence[str]) -> None:
        """Where a test's hook may raise (nothing without a hook)."""
        if self.hook is not None:
            self.hook.check(phase, rids)

    def contain(self, rid: str, phase: str, e: BaseException) -> str:
        """A fault raised on behalf of request ``rid``: re-raise it when fatal, else log it with
        its traceback and return the error its caller is given (500 ``internal_error``)."""
        if is_fatal(e):
            raise e
        self.contained += 1
        self.unchecked = True
        log.error("request %s failed in %s: %s: %s", rid, phase, type(e).__name__, e, exc_info=e)
        return f"internal error in {phase} for request {rid}: {type(e).__name__}: {e} (the server log has the traceback)"

    def isolate(self, items: Sequence[T], run: Callable[[Sequence[T]], R],
                fault: Callable[[T, BaseException], None]) -> tuple[list[int], list[R]]:
        """Run ``run`` over all ``items``; if it raises, over each item alone, calling ``fault``
        for each item that raises alone. Returns the indices of the items that ran and the
        results (one for the whole batch, or one per item that ran). Fatal errors propagate."""
        try:
            return list(range(len(items))), [run(items)]
        except Exception as e:  # noqa: BLE001 - found out below, item by item
            if is_fatal(e):
                raise
            if len(items) == 1:
                fault(items[0], e)
                return [], []
        kept: list[int] = []
        results: list[R] = []
        for i, item in enumerate(items):
            try:
                results.append(run([item]))
            except Exception as e:  # noqa: BLE001 - this item's fault
                if is_fatal(e):
                    raise
                fault(item, e)
                continue
            kept.append(i)
        return kept, results


def is_fatal(e: BaseException) -> bool:
    """Whether ``e`` means state shared by every request may be broken (a device error, a dead
    tensor-parallel rank, a failed integrity check, memory exhausted): the engine must end."""
    names = {c.__name__ for c in type(e).__mro__}
    if names & _FATAL_NAMES:
        return True
    text = str(e)
    return any(t in text for t in _FATAL_TEXT)
