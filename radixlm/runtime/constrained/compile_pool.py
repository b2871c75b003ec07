"""CompilePool: runs grammar compiles on threads, each bounded by a time limit.

A compile past its limit fails its future with ``ValueError("... exceeded N s")`` at once, so
its request can be answered; the compile's thread cannot be stopped (Python threads cannot be
killed and the grammar engine's C++ compile has no cancel), so it runs on, abandoned, until the
engine returns, and its result is thrown away. Its slot is handed to the next compile, so a
stuck compile does not hold up others, as long as fewer than ``2 * workers`` compiles run in all
(past that, new compiles wait for an abandoned one to end). Compile threads are not daemons, so
a process exits only once its abandoned compiles end (the server kills its engine process 10 s
after asking it to stop).
Trade-off (docs/reliability.md): a separate process could be killed and memory-capped, but then
every compiled grammar would have to be serialized across (~1 s for a 12 MB xgrammar grammar),
so the hard bound is left to the size limits (``limits.py``) that run before compiling.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

__all__ = ["CompilePool"]


class _Job:
    __slots__ = ("future", "fn", "args", "deadline", "state")

    def __init__(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.future = future
        self.fn = fn
        self.args = args
        self.deadline = 0.0
        self.state = "queued"  # then "running", and "overdue" or "done"


class CompilePool:
    """``submit(fn, *args) -> Future``. When a job passes ``timeout_s`` seconds of running,
    ``on_timeout(*args)`` is called on the watchdog thread and its return value becomes the
    message of the ValueError that fails the job's future."""

    def __init__(self, workers: int, timeout_s: float, on_timeout: Callable[..., str] | None = None,
                 name: str = "grammar-compile") -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.workers = workers
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._deadlines: list[tuple[float, int, _Job]] = []  # heap of running jobs' deadlines
        self._seq = itertools.count()
        self._running = 0  # jobs within their time limit
        self.overdue = 0  # abandoned jobs still running
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._watchdog.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the compile pool is shut down")
            self._queue.append(_Job(future, fn, args))
            self._start_ready()
        return future

    def shutdown(self) -> None:
        """Stop starting jobs; queued ones are cancelled, running ones finish on their own."""
        with self._cond:
            self._closed = True
            while self._queue:
                self._queue.popleft().future.cancel()
            self._cond.notify_all()

    # -- internals (the _cond lock held) ------------------------------------------------------
    def _start_ready(self) -> None:
        while self._queue and self._running < self.workers and self._running + self.overdue < 2 * self.workers:
            job = self._queue.popleft()
            if job.future.cancelled():  # its request was aborted while it waited
                continue
            job.deadline = time.monotonic() + self.timeout_s
            heapq.heappush(self._deadlines, (job.deadline, next(self._seq), job))
            self._running += 1
            job.state = "running"
            # not daemon: exiting while a daemon thread is inside the C++ compile aborts the process
            # ("terminate called without an active exception", exit 134); exit waits for it instead
            threading.Thread(target=self._run, args=(job,), name=self._name, daemon=False).start()
        self._cond.notify_all()  # the watchdog re-reads the earliest deadline

    def _run(self, job: _Job) -> None:
        try:
            result, error = job.fn(*job.args), None
        except BaseException as e:  # noqa: BLE001 - handed to the future's owner
            result, error = None, e
        with self._cond:
            overdue = job.state == "overdue"
            if overdue:
                self.overdue -= 1
            else:
                self._running -= 1
            job.state = "done"
            if not overdue and not job.future.done():  # an overdue job's future is the watchdog's
                if error is None:
                    job.future.set_result(result)
                else:
                    job.future.set_exception(error)
            if not self._closed:
                self._start_ready()

    def _fail(self, job: _Job) -> None:
        message = f"compile exceeded {self.timeout_s:g} s"
        if self._on_timeout is not None:
            try:
                message = self._on_timeout(*job.args)
            except Exception as e:  # noqa: BLE001 - the watchdog must survive a failing callback
                message = f"{message} ({type(e).__name__} while recording it: {e})"
        try:
            job.future.set_exception(ValueError(message))
        except InvalidStateError:  # cancelled meanwhile (its request was aborted)
            pass

    def _watch(self) -> None:
        expired: list[_Job] = []
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                while self._deadlines and (self._deadlines[0][2].state == "done" or self._deadlines[0][0] <= now):
                    _, _, job = heapq.heappop(self._deadlines)
                    if job.state == "running":
                        job.state = "overdue"
                        self._running -= 1
                        self.overdue += 1
                        expired.append(job)
                if expired:
                    self._start_ready()
                    self._cond.release()
                    try:  # outside the lock: the callback may take the backend's lock
                        for job in expired:
                            self._fail(job)
                    finally:
                        self._cond.acquire()
                    expired.clear()
                    continue
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._cond.wait(wait)
