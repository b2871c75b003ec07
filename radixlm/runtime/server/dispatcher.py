"""Dispatcher: admits engine requests (backpressure), runs them concurrently, merges their outputs.

Every generation route turns one HTTP request into one or more engine requests (a batch, n
copies); the dispatcher streams their outputs as one sequence of events and guarantees that
whatever is still running when the consumer leaves (client gone, error, shutdown) is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.engine_core import RequestOutput
from radixlm.runtime.intake import PromptRequest, Submission, submissions
from radixlm.runtime.server.engine_client import EngineClient, EngineDeadError, RequestFailedError
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.metrics import Metrics
from radixlm.runtime.sessions import SessionParams


@dataclass(frozen=True)
class Job:
    """One engine request and where its result goes in the response."""

    index: int
    request: Submission
    user_rid: str  # what /abort_request names; n copies of one prompt share it


@dataclass(frozen=True)
class Event:
    """One output of job `index`, or the error that ended it."""

    index: int
    output: RequestOutput | None = None
    error: ApiError | None = None

    @property
    def last(self) -> bool:
        return self.error is not None or (self.output is not None and self.output.finished)


class SlowConsumer(Exception):
    """A request's handler left too many outputs unread (its client does not read its stream)."""


class Dispatcher:
    def __init__(self, client: EngineClient, metrics: Metrics, max_queued: int, max_pending: int,
                 retry_headers: Callable[[], dict[str, str] | None] = lambda: None) -> None:
        self.client = client  # replaced when the engine process is restarted
        self.retry_headers = retry_headers  # the Retry-After of a 503 for a request the engine's death failed
        self.metrics = metrics
        self.max_queued = max_queued
        self.max_pending = max_pending  # outputs one engine request may have waiting for the handler
        self._active: dict[str, str] = {}  # engine rid -> user rid
        self._users: Counter[str] = Counter()  # user rid -> its engine requests in flight

    @property
    def num_active(self) -> int:
        return len(self._active)

    @contextlib.asynccontextmanager
    async def run(self, jobs: list[Job], arrival: float, admit: bool = True,
                  stream: bool = True) -> AsyncIterator[AsyncIterator[Event]]:
        """Submit `jobs` and yield their merged events; on exit, abort whatever has not finished.
        ``stream`` False: the consumer reads only each job's finished output (its text and ids
        whole), which is then the job's one event."""
        taken = self._taken([j.request.rid for j in jobs], {j.user_rid for j in jobs})
        if taken is not None:
            raise ApiError(400, f"request id {taken!r} is already in use; give each request its own rid", "rid")
        if admit:
            self.check_capacity(len(jobs))
        if not stream:
            jobs = [dataclasses.replace(j, request=dataclasses.replace(j.request, stream=False)) for j in jobs]
        for j in jobs:
            self._active[j.request.rid] = j.user_rid
            self._users[j.user_rid] += 1
        # The hand-off never blocks the engine's output fan-out: outputs queue here, and a job
        # whose handler leaves max_pending of them unread is aborted (the others go on).
        queue: asyncio.Queue[Event] = asyncio.Queue()
        pending = [0] * len(jobs)
        tasks = [asyncio.create_task(self._pump(j, arrival, queue, pending)) for j in jobs]
        try:
            yield _merged(queue, len(jobs), pending)
        finally:
            for t in tasks:
                t.cancel()
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:  # also when the handler is cancelled meanwhile (its connection closed)
                for j in jobs:
                    if self._active.pop(j.request.rid, None) is not None:
                        self._users[j.user_rid] -= 1
                        if not self._users[j.user_rid]:
                            del self._users[j.user_rid]

    def check_capacity(self, n: int) -> None:
        """A 429 when ``n`` more requests would pass the limit of requests in flight."""
        if len(self._active) + n > self.max_queued:
            raise ApiError(
                429,
                f"the server is at capacity ({len(self._active)} requests in flight, limit "
                f"{self.max_queued}); retry later",
                code="too_many_requests",
            )

    def _taken(self, rids: list[str], user_rids: set[str]) -> str | None:
        """A name the new jobs would share with one in flight (an engine rid or the rid its client
        gave: an n > 1 request's copies rid-0, rid-1 hold rid too), or that they repeat; else None."""
        if len(set(rids)) != len(rids):
            return next(r for r in rids if rids.count(r) > 1)
        return next((r for r in [*rids, *sorted(user_rids)] if r in self._active or r in self._users), None)

    async def abort(self, user_rid: str | None) -> int:
        """Abort the engine requests of one user rid (None: all); returns how many."""
        rids = [r for r, u in self._active.items() if user_rid is None or u == user_rid or r == user_rid]
        for rid in rids:
            await self.client.abort(rid)
        return len(rids)

    async def _pump(self, job: Job, arrival: float, queue: asyncio.Queue[Event], pending: list[int]) -> None:
        outcome = "abort"
        last = arrival
        first = True
        try:
            async with contextlib.aclosing(self.client.generate(job.request)) as stream:
                async for out in stream:
                    if pending[job.index] >= self.max_pending:
                        raise SlowConsumer()
                    now = time.perf_counter()
                    n = len(out.token_ids_delta)
                    if not job.request.stream:
                        if out.finished:
                            self._observe_whole(out.meta, n, now - arrival)
                    elif n:
                        if first:
                            self.metrics.ttft.observe(now - arrival)
                            first = False
                        else:
                            for _ in range(n):
                                self.metrics.itl.observe((now - last) / n)
                        last = now
                    if out.finished:
                        outcome = ""
                        self.metrics.observe_finished(out.meta, now - arrival)
                    pending[job.index] += 1
                    queue.put_nowait(Event(job.index, output=out))
        except SlowConsumer:
            outcome = "error"
            self.metrics.slow_client_aborts.labels("pending_outputs").inc()
            queue.put_nowait(Event(job.index, error=ApiError(
                408, f"request aborted: its client left {self.max_pending} outputs unread "
                     "(--max-pending-outputs); read the stream as it arrives", code="client_too_slow")))
        except RequestFailedError as e:
            outcome = "error"
            status = 404 if e.not_found else 400 if e.bad_input else 500
            code = "internal_error" if status == 500 else None
            queue.put_nowait(Event(job.index, error=ApiError(status, str(e), param=None, code=code)))
        except EngineDeadError as e:
            outcome = "error"
            queue.put_nowait(Event(job.index, error=ApiError(503, f"the engine is unavailable: {e}",
                                                             code="engine_dead", headers=self.retry_headers())))
        finally:
            if outcome:
                self.metrics.observe_unfinished(outcome)

    def _observe_whole(self, meta: Mapping[str, Any], tokens: int, e2e: float) -> None:
        """The token timings of a job whose output came whole: its first token came the engine's
        decode time (e2e less its ttft) before the end, and its tokens after that evenly apart."""
        ttft, engine_e2e = meta.get("ttft"), meta.get("e2e_latency")
        if not tokens or ttft is None or engine_e2e is None:
            return
        decoding = max(engine_e2e - ttft, 0.0)
        self.metrics.ttft.observe(max(e2e - decoding, 0.0))
        for _ in range(tokens - 1):
            self.metrics.itl.observe(decoding / (tokens - 1))


async def _merged(queue: asyncio.Queue[Event], n: int, pending: list[int]) -> AsyncIterator[Event]:
    remaining = n
    while remaining:
        ev = await queue.get()
        if ev.output is not None:
            pending[ev.index] -= 1
        if ev.last:
            remaining -= 1
        yield ev


def check_job_count(count: int, max_jobs: int, what: str = "completions (prompts x n)") -> None:
    """A request that alone asks for more engine requests than the server admits at once can never
    run: a 400 before anything is tokenized or expanded (retrying, as after a 429, cannot help)."""
    if count > max_jobs:
        raise ApiError(400, f"this request asks for {count} {what}, more than the {max_jobs} the server "
                            "runs at once (--max-queued-requests); split it into smaller requests")


def expand_jobs(prompts: list[PromptRequest], max_jobs: int, session: SessionParams | None = None) -> list[Job]:
    """One job per completion: n copies of each prompt, in prompt-major order (at most max_jobs),
    built by the intake every caller shares (radixlm.runtime.intake.submissions)."""
    check_job_count(sum(p.params.n for p in prompts), max_jobs)
    jobs: list[Job] = []
    for p, copies in zip(prompts, submissions(prompts, session)):
        for sub in copies:
            jobs.append(Job(len(jobs), sub, p.rid))
    return jobs


async def next_event(it: AsyncIterator[Event]) -> Event | None:
    """The next event of a dispatcher stream, or None when it has ended."""
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None
