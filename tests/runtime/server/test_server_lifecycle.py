"""Auth, backpressure and shutdown of a real `radixlm serve` process (bf16, --api-key, one request at a time)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
from dsl_programs import forked
from server_harness import Server, next_event, process_running, read_sse, start_server

from radixlm.lang.backends.openai import OpenAI
from radixlm.lang.backends.runtime_endpoint import BackendError, RuntimeEndpoint
from radixlm.testing import free_port, http_call, poll

pytestmark = pytest.mark.slow

KEY = "test-secret"
LONG = {"text": "Write a long story.", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}


@pytest.fixture(scope="module")
def server():
    with start_server("--max-total-tokens", "4096", "--max-queued-requests", "1", "--shutdown-grace", "120",
                      api_key=KEY) as s:
        yield s  # (stopped already by test_sigterm_drains_in_flight_request when the module runs whole)


def test_api_key(server: Server):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    status, got = server.post("/generate", body, headers={"Authorization": ""})
    assert status == 401 and got["error"]["type"] == "authentication_error" and "missing" in got["error"]["message"]
    status, got = server.post("/generate", body, headers={"Authorization": "Bearer wrong"})
    assert status == 401 and "not valid" in got["error"]["message"]
    for path in ("/v1/models", "/metrics", "/get_server_info", "/get_model_info"):
        assert server.get(path, headers={"Authorization": "Bearer nope"})[0] == 401, path
    assert server.get("/health", headers={"Authorization": ""})[0] == 200  # open to load balancers
    status, got = server.post("/generate", body)  # with the key
    assert status == 200 and got["meta_info"]["completion_tokens"] == 1


def test_backpressure_429(server: Server):
    headers = server.headers

    async def run() -> tuple[int, dict]:
        async with aiohttp.ClientSession(headers=headers) as s:
            async with s.post(server.url + "/generate", json=LONG) as first:
                assert first.status == 200
                await next_event(first)  # the one allowed request is in flight
                async with s.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}) as r:
                    return r.status, await r.json()

    status, got = asyncio.run(run())
    assert status == 429 and got["error"]["type"] == "rate_limit_error" and "capacity" in got["error"]["message"]
    # the first request was dropped with its connection; the slot comes back
    server.wait_until("the dropped request to end", lambda i: i["requests_in_flight"] == 0
                      and i["stats"]["running_requests"] == 0)
    assert server.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}})[0] == 200


def test_a_program_is_admitted_whole(server: Server):
    """One request in flight at most, yet a program whose fork runs two at once runs to its end:
    it is admitted as a whole, and its own requests are never refused. While the server is at
    capacity a new program gets the 429 at once, before any of its work. (No select: its one
    request of several prompts is more than this server ever runs at once, a 400 either way.)"""
    remote = RuntimeEndpoint(server.url, api_key=KEY, programs="server")
    state = forked.run(False, backend=remote, temperature=0)
    assert state.error() is None and len(state["fruit"]) == 2

    async def run() -> tuple[int, dict]:
        async with aiohttp.ClientSession(headers=server.headers) as s:
            async with s.post(server.url + "/generate", json=LONG) as first:
                await next_event(first)  # the one allowed request is in flight
                body = {"graph": json.loads(forked.trace(False).to_json())}
                async with s.post(server.url + "/run_program", json=body) as r:
                    return r.status, await r.json()

    status, got = asyncio.run(run())
    assert status == 429 and "capacity" in got["error"]["message"]
    server.wait_until("the dropped request to end", lambda i: i["requests_in_flight"] == 0)


@pytest.mark.parametrize("backend", ["native", "openai"])
def test_the_dsl_client_waits_out_a_429(server: Server, backend: str):
    """A program run step by step (over /generate, or the OpenAI API) meets a full server: its first
    request is refused with 429 and sent again until the long request in flight is done
    (max_retries 0: it fails with the 429)."""
    body = {**LONG, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    for retries in (0, None):  # (None, the default: as long as the timeout allows)
        client = (RuntimeEndpoint(server.url, api_key=KEY, programs="client", max_retries=retries)
                  if backend == "native" else
                  OpenAI("smollm2", base_url=server.url + "/v1", api_key=KEY, chat=False, max_retries=retries))

        async def run(client: Any = client) -> Any:
            async with aiohttp.ClientSession(headers=server.headers) as s:
                async with s.post(server.url + "/generate", json=body) as first:
                    await next_event(first)  # the one allowed request is in flight
                    try:
                        return await asyncio.to_thread(forked.run, False, backend=client, temperature=0)
                    except BackendError as e:
                        return e
                    finally:
                        await read_sse(first)

        got = asyncio.run(run())
        if retries is None:
            assert not isinstance(got, BaseException) and got.error() is None and len(got["fruit"]) == 2
        else:
            assert isinstance(got, BackendError) and got.status == 429
        server.wait_until("the requests to end", lambda i: i["requests_in_flight"] == 0)


def test_sigterm_drains_in_flight_request(server: Server):
    engine_pid = server.server_info()["engine_pid"]
    body = {**LONG, "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}

    async def run() -> list:
        async with aiohttp.ClientSession(headers=server.headers) as s:
            async with s.post(server.url + "/generate", json=body) as resp:
                first = await next_event(resp)
                server.proc.send_signal(signal.SIGTERM)  # mid-stream
                return [first, *await read_sse(resp)]

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    final = events[-2]["meta_info"]
    assert final["finish_reason"]["type"] == "length" and final["completion_tokens"] == 24  # finished, not aborted
    assert server.proc.wait(60) == 0
    assert "stopped" in server.log()
    with pytest.raises(ProcessLookupError):  # the engine process went with it
        os.kill(engine_pid, 0)


# A stand-in for `radixlm serve --dp-size N`'s launcher: it starts one replica as the launcher does
# (its own pid in RADIXLM_LAUNCHER_PID), writes the replica's pid, and waits to be killed.
_LAUNCHER = """
import os, subprocess, sys, time
port, pid_file, log_file = sys.argv[1:]
with open(log_file, "w") as log:
    p = subprocess.Popen([sys.executable, "-m", "radixlm.cli", "serve", "--port", port, "--max-total-tokens", "2048"],
                         env={**os.environ, "RADIXLM_LAUNCHER_PID": str(os.getpid())}, stdout=log,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
with open(pid_file, "w") as f:
    f.write(str(p.pid))
time.sleep(600)
"""


def test_a_replica_stops_when_its_launcher_is_gone(tmp_path):
    """A replica of `serve --dp-size N` whose launcher was killed (nothing routes to it any more)
    stops, engine process included, instead of serving on for good."""
    port, pid_file, log_file = free_port(), tmp_path / "pid", tmp_path / "replica.log"
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(port), str(pid_file), str(log_file)])
    replica = None

    def replica_log() -> str:
        return log_file.read_text(errors="replace") if log_file.exists() else ""

    def engine_pid() -> int | None:
        assert launcher.poll() is None, replica_log()
        try:
            status, info = http_call(f"http://127.0.0.1:{port}/get_server_info", "GET", timeout=5)
        except OSError:
            return None  # not listening yet
        return int(info["engine_pid"]) if status == 200 else None  # (a 503 while the model loads)

    try:
        engine = poll("the replica to serve", engine_pid, 180, detail=replica_log)
        replica = int(pid_file.read_text())
        launcher.kill()
        launcher.wait()
        poll("the replica and its engine to stop once their launcher is gone",
             lambda: not process_running(replica) and not process_running(engine), 60, detail=replica_log)
        assert f"the launcher (pid {launcher.pid}) is gone; stopping" in log_file.read_text(errors="replace")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if replica is not None and process_running(replica):
            os.kill(replica, signal.SIGKILL)
