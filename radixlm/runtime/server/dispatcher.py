"""Dispatcher: admits engine requests (backpressure), runs them concurrently, merges their outputs.

Every generation route turns one HTTP request into one or more engine requests (a batch, n
copies); the dispatcher streams their outputs as one sequence of events and guarantees that
whatever is still running when the consumer leaves (client gone, error, shutdown) is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from radixlm.runtime.engine_core import RequestOutput
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server.engine_client import EngineClient, EngineDeadError, RequestFailedError
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.messages import AddRequest
from radixlm.runtime.server.metrics import Metrics
from radixlm.runtime.sessions import SessionParams


@dataclass(frozen=True)
class Job:
    """One engine request and where its result goes in the response."""

    index: int
    request: AddRequest
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
    def __init__(self, client: EngineClient, metrics: Metrics, max_queued: int, max_pending: int) -> None:
        self.client = client  # replaced when the engine process is restarted
        self.metrics = metrics
        self.max_queued = max_queued
        self.max_pending = max_pending  # outputs one engine request may have waiting for the handler
        self._active: dict[str, str] = {}  # engine rid -> user rid

    @property
    def num_active(self) -> int:
        return len(self._active)

    @contextlib.asynccontextmanager
    async def run(self, jobs: list[Job], arrival: float, admit: bool = True) -> AsyncIterator[AsyncIterator[Event]]:
        """Submit `jobs` and yield their merged events; on exit, abort whatever has not finished."""
        rids = [j.request.rid for j in jobs]
        if len(set(rids)) != len(rids) or any(r in self._active for r in rids):
            taken = next(r for r in rids if r in self._active or rids.count(r) > 1)
            raise ApiError(400, f"request id {taken!r} is already in use; give each request its own rid", "rid")
        if admit and len(self._active) + len(jobs) > self.max_queued:
            raise ApiError(
                429,
                f"the server is at capacity ({len(self._active)} requests in flight, limit "
                f"{self.max_queued}); retry later",
                code="too_many_requests",
            )
        for j in jobs:
            self._active[j.request.rid] = j.user_rid
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
                    self._active.pop(j.request.rid, None)

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
                    if n:
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
            queue.put_nowait(Event(job.index, error=ApiError(status, str(e), param=None)))
        except EngineDeadError as e:
            outcome = "error"
            queue.put_nowait(Event(job.index, error=ApiError(503, f"the engine is unavailable: {e}",
                                                             code="engine_dead")))
        finally:
            if outcome:
                self.metrics.observe_unfinished(outcome)


async def _merged(queue: asyncio.Queue[Event], n: int, pending: list[int]) -> AsyncIterator[Event]:
    remaining = n
    while remaining:
        ev = await queue.get()
        if ev.output is not None:
            pending[ev.index] -= 1
        if ev.last:
            remaining -= 1
        yield ev


@dataclass(frozen=True)
class PromptSpec:
    """One prompt of an HTTP request with its options, before n is expanded."""

    prompt_ids: list[int]
    params: SamplingParams
    user_rid: str
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    session: SessionParams | None = None


def check_job_count(count: int, max_jobs: int, what: str = "completions (prompts x n)") -> None:
    """A request that alone asks for more engine requests than the server admits at once can never
    run: a 400 before anything is tokenized or expanded (retrying, as after a 429, cannot help)."""
    if count > max_jobs:
        raise ApiError(400, f"this request asks for {count} {what}, more than the {max_jobs} the server "
                            "runs at once (--max-queued-requests); split it into smaller requests")


def expand_jobs(prompts: list[PromptSpec], max_jobs: int) -> list[Job]:
    """One job per completion: n copies of each prompt, in prompt-major order (at most max_jobs).

    Copies of a seeded request get seeds seed+i, so each is its own sample yet reproducible
    (what the in-process Engine does)."""
    check_job_count(sum(p.params.n for p in prompts), max_jobs)
    jobs: list[Job] = []
    for p in prompts:
        n = p.params.n
        for i in range(n):
            params = p.params
            if n > 1:
                seed = None if params.seed is None else params.seed + i
                params = SamplingParams.from_dict({**params.to_dict(), "n": 1, "seed": seed})
            rid = p.user_rid if n == 1 else f"{p.user_rid}-{i}"
            req = AddRequest(rid, p.prompt_ids, params.to_dict(), p.return_logprob, p.logprob_start_len,
                             p.top_logprobs_num, p.session)
            jobs.append(Job(len(jobs), req, p.user_rid))
    return jobs


async def next_event(it: AsyncIterator[Event]) -> Event | None:
    """The next event of a dispatcher stream, or None when it has ended."""
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None
