"""`radixlm serve --dp-size 2`: the router over two real replicas on 127.0.0.1 (the default model).

The tests run in file order on one router: the fault tests come last (the last one kills a worker).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from server_harness import WORKER, Router, read_sse, start_router

from radixlm.testing import http_call, poll

pytestmark = pytest.mark.slow
SYS_A = "You are Captain Hook, a pirate who answers every question with a sea shanty about treasure. "
SYS_B = "You are a meticulous tax lawyer who cites the relevant statute before answering any question. "
GREEDY = {"temperature": 0, "max_new_tokens": 6}


class Replica:
    """One replica behind the router, found through the router's /get_server_info."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid

    def get(self, path: str) -> tuple[int, Any]:
        return http_call(self.url + path, "GET", timeout=60)

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        status, out = http_call(self.url + "/generate", "POST", body, timeout=300)
        assert status == 200, out
        return out

    def running(self) -> int:
        status, info = self.get("/get_server_info")
        assert status == 200, info
        return int(info["stats"]["running_requests"])

    def metric(self, name: str, labels: str) -> float:
        _, text = self.get("/metrics")
        key = f"{name}{{{labels}}} "
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


@pytest.fixture(scope="module")
def router() -> Iterator[Router]:
    """`radixlm serve --dp-size 2`: two replicas and the router, one command (fp32: greedy outputs then
    do not depend on batching or on what is cached)."""
    r = start_router(["serve", "--dp-size", "2", "--dtype", "float32", "--max-total-tokens", "8192",
                      "--router-health-interval", "0.2", "--router-health-timeout", "1",
                      "--router-health-failures", "1"], healthy_workers=2)
    try:
        r.replicas = [Replica(w["url"], w["server_info"]["server_pid"]) for w in r.workers()]
    except BaseException:
        r.stop()  # the launcher stops its replicas
        raise
    yield r
    for w in r.replicas:
        if Path(f"/proc/{w.pid}").exists():
            os.kill(w.pid, signal.SIGCONT)  # in case a test left it stopped
    assert r.stop() == 0  # stops the router and every replica
    assert not any(Path(f"/proc/{w.pid}").exists() for w in r.replicas)


def by_url(router: Router, url: str) -> Replica:
    return next(w for w in router.replicas if w.url == url)


def test_generate_chat_and_streams_pass_through(router: Router) -> None:
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    out, url = router.generate(body)
    assert out["text"] == by_url(router, url).generate(body)["text"]  # what the worker itself says
    assert out["meta_info"]["completion_tokens"] == 6

    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage and chat.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True)
        if c.choices)
    assert streamed == chat.choices[0].message.content
    assert [m.id for m in client.models.list()] == [m["id"] for m in by_url(router, url).get("/v1/models")[1]["data"]]

    async def native_stream() -> list[Any]:
        async with aiohttp.ClientSession() as s, s.post(router.url + "/generate", json={**body, "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            return await read_sse(r)

    events = asyncio.run(native_stream())
    assert events[-1] == "[DONE]" and len(events) >= 7  # a chunk per token, passed through one by one
    assert events[-2]["text"] == out["text"]


def test_client_disconnect_aborts_on_the_worker(router: Router) -> None:
    before = sum(w.metric("radixlm_requests_total", 'finish_reason="abort"') for w in router.replicas)

    async def read_one_then_leave() -> str:
        async with aiohttp.ClientSession() as s:
            r = await s.post(router.url + "/generate", json={
                "text": "Count to a thousand.", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
            await r.content.readline()
            url = r.headers[WORKER]
            r.close()  # the client goes away mid-stream
            return url

    url = asyncio.run(read_one_then_leave())
    worker = by_url(router, url)
    poll("the request aborted", lambda: worker.running() == 0)
    poll("the abort counted", lambda: sum(w.metric("radixlm_requests_total", 'finish_reason="abort"')
                                          for w in router.replicas) == before + 1)


def test_same_prefix_same_worker(router: Router) -> None:
    seen: dict[str, set[str]] = {SYS_A: set(), SYS_B: set()}
    cached = []
    for i, q in enumerate(["What is 2+2?", "Name a color.", "Where is Paris?", "Who wrote Hamlet?"]):
        for prefix in (SYS_A, SYS_B):
            out, url = router.generate({"text": prefix + q, "sampling_params": GREEDY})
            seen[prefix].add(url)
            if i > 0:
                cached.append(out["meta_info"]["cached_tokens"])
    assert len(seen[SYS_A]) == 1 and len(seen[SYS_B]) == 1  # each prefix on one worker
    assert seen[SYS_A] != seen[SYS_B]  # and the two spread over both
    assert min(cached) >= 15  # later requests read their system prompt from the worker's cache
    assert router.metric('radixlm_router_requests_total{reason="affinity"') >= 6


def test_sessions_stick_to_their_worker(router: Router) -> None:
    homes = []
    for k in range(4):
        status, sid = router.call("POST", "/open_session", {})
        assert status == 200 and isinstance(sid, str)
        first, home = router.generate({"text": f"My name is Ann{k}.", "session_params": {"id": sid},
                                       "sampling_params": GREEDY})
        second, again = router.generate({"text": " What is my name?", "session_params": {"id": sid},
                                         "sampling_params": GREEDY})
        assert again == home
        assert second["meta_info"]["cached_tokens"] >= first["meta_info"]["prompt_tokens"]  # history from cache
        assert router.call("POST", "/close_session", {"session_id": sid}) == (200, {"session_id": sid, "closed": True})
        homes.append(home)
    assert len(set(homes)) == 2  # idle workers take new sessions in turn


def test_fan_out_routes(router: Router) -> None:
    assert router.call("POST", "/abort_request", {"abort_all": True}) == (200, {"aborted": 0})
    status, _ = router.call("POST", "/flush_cache")
    assert status == 200
    assert all(w["server_info"]["stats"]["cache_tokens"] == 0 for w in router.workers())
    status, err = router.call("POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": -1}})
    assert status == 400 and "max_new_tokens" in err["error"]["message"]  # the worker's own 400


def test_hung_worker_fails_fast_then_rejoins(router: Router) -> None:
    _, home = router.generate({"text": SYS_A + "Hello", "sampling_params": GREEDY})
    hung = by_url(router, home)
    for _ in range(4):  # idle workers take new sessions in turn: one of the next few lands on `home`
        status, sid = router.call("POST", "/open_session", {})
        if router.generate({"text": "Hi", "session_params": {"id": sid}, "sampling_params": GREEDY})[1] == home:
            break
    else:
        pytest.fail("no session landed on the worker under test")
    retries = router.metric("radixlm_router_retries_total")

    async def long_request() -> tuple[int, dict[str, Any], str]:
        async with aiohttp.ClientSession() as s, s.post(router.url + "/generate", json={
                "text": SYS_A + "Tell me a story.", "sampling_params": {"max_new_tokens": 64, "ignore_eos": True,
                                                                       "temperature": 0}}) as r:
            return r.status, await r.json(), r.headers.get(WORKER, "")

    async def run() -> tuple[int, dict[str, Any], str]:
        task = asyncio.create_task(long_request())
        while not await asyncio.to_thread(lambda: hung.running() > 0):
            assert not task.done(), "the request ended before the worker was stopped"
            await asyncio.sleep(0.05)
        os.kill(hung.pid, signal.SIGSTOP)  # the worker hangs: no answer, no closed connection
        return await task

    status, out, answered = asyncio.run(run())
    try:
        assert status == 200 and answered != home  # moved to the other worker: nothing had been sent back
        assert out["meta_info"]["completion_tokens"] == 64
        assert router.metric("radixlm_router_retries_total") == retries + 1
        assert router.call("GET", "/health")[1]["healthy_workers"] == 1
        status, err = router.call("POST", "/generate", {"text": "Again", "session_params": {"id": sid}})
        assert status == 503 and err["error"]["code"] == "session_worker_down"
    finally:
        os.kill(hung.pid, signal.SIGCONT)
    poll("the worker rejoins", lambda: router.call("GET", "/health")[1].get("healthy_workers") == 2)


def test_killed_worker_stream_error_then_failover(router: Router) -> None:
    async def stream_then_kill() -> tuple[list[Any], str]:
        async with aiohttp.ClientSession() as s, s.post(router.url + "/generate", json={
                "text": SYS_B + "Tell me a story.", "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
            url = r.headers[WORKER]
            first = json.loads((await r.content.readline()).removeprefix(b"data: "))
            os.kill(by_url(router, url).pid, signal.SIGKILL)
            return [first, *await read_sse(r)], url

    events, killed = asyncio.run(stream_then_kill())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "worker_lost"
    assert events[-2]["error"]["type"] == "service_unavailable_error"
    out, url = router.generate({"text": SYS_B + "Tell me a story.", "sampling_params": GREEDY})
    assert url != killed and out["meta_info"]["completion_tokens"] >= 1  # the same prefix, now elsewhere
    survivor = by_url(router, url)
    os.kill(survivor.pid, signal.SIGSTOP)  # hung: no worker is left
    try:
        poll("no healthy worker", lambda: router.call("GET", "/health")[0] == 503)
        status, err = router.call("POST", "/generate", {"text": "x"})
        assert status == 503 and err["error"]["code"] == "no_healthy_worker"
    finally:
        os.kill(survivor.pid, signal.SIGCONT)
