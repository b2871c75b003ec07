"""The server's side of the engine process, in-process with a real engine: the dispatcher's bound
on outputs a request leaves unread, and an exception that escapes the engine loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.intake import Submission
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server.dispatcher import Dispatcher, Job
from radixlm.runtime.server.engine_client import EngineClient, EngineDeadError, RequestFailedError
from radixlm.runtime.server.metrics import Metrics

pytestmark = pytest.mark.slow

DEADLINE_S = 300.0
PROMPT = [1, 504, 3458, 282, 4649, 314]


def _config() -> EngineConfig:
    return EngineConfig.from_kwargs(max_total_tokens=2048, dtype="float32")


async def _until(what: str, cond: Callable[[], Awaitable[bool]]) -> None:
    end = time.monotonic() + DEADLINE_S
    while not await cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _job(index: int, rid: str, max_new_tokens: int) -> Job:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    return Job(index, Submission(rid, PROMPT, params), rid)


def test_unread_outputs_abort_only_their_request():
    async def run() -> None:
        client = EngineClient(_config())
        await client.start()
        metrics = Metrics()
        dispatcher = Dispatcher(client, metrics, max_queued=8, max_pending=4)
        try:
            async with dispatcher.run([_job(0, "unread", 2000)], time.perf_counter()) as unread:
                async with dispatcher.run([_job(0, "read", 12)], time.perf_counter()) as read:
                    done = [ev async for ev in read]  # consumed as it comes, alongside the unread one
                assert done[-1].output.finished and done[-1].output.meta["completion_tokens"] == 12

                async def engine_idle() -> bool:
                    return (await client.query("stats"))["running_requests"] == 0

                await _until("the unread request to be aborted", engine_idle)  # not 2000 tokens later
                events = [ev async for ev in unread]
            assert [ev.output is not None for ev in events] == [True] * 4 + [False]
            assert events[-1].error.code == "client_too_slow" and "4 outputs unread" in events[-1].error.message
            aborts = metrics.registry.get_sample_value("radixlm_slow_client_aborts_total", {"reason": "pending_outputs"})
            assert aborts == 1
            stats = await client.query("stats")
            assert stats["kv_slots_used_by_requests"] == 0 and dispatcher.num_active == 0
        finally:
            await client.close()

    asyncio.run(run())


def test_a_malformed_request_fails_alone_and_an_exception_escaping_the_loop_ends_the_engine():
    async def run() -> None:
        client = EngineClient(_config())
        await client.start()
        try:
            pid = client.pid
            stream = client.generate(Submission("long", PROMPT, _job(0, "long", 2000).request.params))
            first = await stream.__anext__()
            assert not first.finished
            # A malformed submission (prompt_ids None) raises TypeError admitting it: that request fails (500),
            # the stream beside it goes on, the engine keeps running.
            bad = client.generate(Submission("bad", None, _job(0, "bad", 1).request.params))  # type: ignore[arg-type]
            with pytest.raises(RequestFailedError) as bad_err:
                await bad.__anext__()
            assert not bad_err.value.bad_input
            assert "request bad" in str(bad_err.value) and "TypeError" in str(bad_err.value)
            for _ in range(3):
                assert not (await stream.__anext__()).finished
            assert client.pid == pid and not client.dead
            # A malformed query (close_session without its id) raises outside any request: the engine process
            # ends with that exception's message, which every request in flight gets.
            with pytest.raises(EngineDeadError) as query_err:
                await client.query("close_session")
            with pytest.raises(EngineDeadError) as long_err:
                while True:
                    await stream.__anext__()
            why = await client.wait_exit()
            assert why == str(query_err.value) == str(long_err.value) == client.dead
            assert why.startswith("the engine process died (exit code 1): KeyError:"), why
            assert client.pid == pid
            with pytest.raises(EngineDeadError):
                await client.query("stats")
        finally:
            await client.close()

    asyncio.run(run())
