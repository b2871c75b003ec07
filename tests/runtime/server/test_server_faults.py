"""Faults of a real `radixlm serve` process: a client that stops reading its stream, the engine
process killed with SIGKILL (restarted once, as the server does by default, then not again past
--max-restarts), and the server killed with SIGKILL (its engine process exits too).

The tests run in file order on one server (the last starts its own): the crash-loop test leaves its
engine dead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from typing import Any

import aiohttp
import pytest
from server_harness import Server, next_event, process_running, read_sse, start_server

from radixlm.testing import poll

pytestmark = pytest.mark.slow

WRITE_TIMEOUT_S = 2
GREEDY = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
# Every chunk of a native stream repeats the output so far and carries its new token's 200 top
# logprobs with their text (~5 KB), so a client that reads nothing fills the socket buffers (a few
# MB on loopback) within a few hundred tokens.
STUCK = {"text": "Write a long story.", "stream": True, "return_logprob": True, "top_logprobs_num": 200,
         "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
LONG = {"text": "Count to a thousand.", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
DEADLINE_S = 300.0  # polls give up after this (the machine may be shared and slow); never a sleep


@pytest.fixture(scope="module")
def server():
    # fp32: greedy outputs are then identical batched or alone (the reference runs alone)
    s = start_server("--dtype", "float32", "--max-total-tokens", "8192", "--max-restarts", "1",
                     "--stream-write-timeout", str(WRITE_TIMEOUT_S), "--max-top-logprobs", "200")
    yield s
    assert s.stop() == 0  # also with its engine dead


@pytest.fixture(scope="module")
def reference(server: Server) -> str:
    """A greedy completion from a fresh engine (nothing cached), before any fault."""
    return server.generate(GREEDY)["text"]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def stuck_stream(server: Server) -> socket.socket:
    """Send a streaming /generate over a raw socket with a tiny receive buffer, and never read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps(STUCK).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def drain(sock: socket.socket, timeout_s: float) -> int:
    """Read a socket to its end (EOF or a reset); the bytes it still held."""
    sock.settimeout(timeout_s)
    received = 0
    try:
        while chunk := sock.recv(1 << 16):
            received += len(chunk)
    except ConnectionResetError:
        pass
    return received


def test_stuck_stream_is_aborted_and_others_proceed(server: Server, reference: str):
    rss_before = rss_mib(server.proc.pid)
    aborts_before = sum(server.metric("radixlm_slow_client_aborts_total", f'reason="{r}"')
                        for r in ("write_timeout", "pending_outputs"))
    sock = stuck_stream(server)
    try:
        server.wait_until("the stuck stream to run", lambda i: i["requests_in_flight"] == 1, DEADLINE_S)

        async def others() -> tuple[list[str], list[Any]]:
            async with aiohttp.ClientSession() as s:
                async def plain() -> str:
                    async with s.post(server.url + "/generate", json=GREEDY) as r:
                        assert r.status == 200
                        return (await r.json())["text"]

                async def streamed() -> list[Any]:
                    async with s.post(server.url + "/generate", json={**GREEDY, "stream": True}) as r:
                        assert r.status == 200
                        return await read_sse(r)

                return await asyncio.gather(plain(), plain()), await streamed()

        texts, events = asyncio.run(others())
        assert texts == [reference, reference]
        assert events[-1] == "[DONE]" and events[-2]["text"] == reference

        # The stuck request is aborted (not run to 4000 tokens) while its socket is still open.
        info = server.wait_until("the stuck stream to be aborted", lambda i: i["requests_in_flight"] == 0
                                 and i["stats"]["running_requests"] == 0, DEADLINE_S)
        assert info["stats"]["kv_slots_used_by_requests"] == 0
        aborts = sum(server.metric("radixlm_slow_client_aborts_total", f'reason="{r}"')
                     for r in ("write_timeout", "pending_outputs"))
        assert aborts == aborts_before + 1
        # ... and its connection is closed: what was buffered, then EOF or a reset.
        received = drain(sock, DEADLINE_S)
        assert received > 0
    finally:
        sock.close()
    rss_after = rss_mib(server.proc.pid)
    print(f"server RSS {rss_before:.1f} -> {rss_after:.1f} MiB; the stuck client got {received} bytes")
    assert rss_after - rss_before < 64


async def _in_flight_then_kill(server: Server) -> tuple[list[Any], int, dict[str, Any], str | None]:
    """A stream and a plain request in flight; SIGKILL the engine; what each client gets."""
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/generate", json={**LONG, "stream": True}) as stream:
            assert stream.status == 200
            first = await next_event(stream)
            plain = asyncio.ensure_future(s.post(server.url + "/generate", json=LONG))
            await asyncio.to_thread(server.wait_until, "both requests to run",
                                    lambda i: i["stats"]["running_requests"] == 2, DEADLINE_S)
            os.kill(server.server_info()["engine_pid"], signal.SIGKILL)
            events = [first, *await read_sse(stream)]
        async with await plain as resp:
            return events, resp.status, await resp.json(), resp.headers.get("Retry-After")


def _get_with_headers(server: Server, path: str) -> tuple[int, Any, dict[str, str]]:
    async def get() -> tuple[int, Any, dict[str, str]]:
        async with aiohttp.ClientSession() as s, s.get(server.url + path) as resp:
            return resp.status, await resp.json(), dict(resp.headers)
    return asyncio.run(get())


def _assert_engine_dead(body: dict[str, Any]) -> None:
    err = body["error"]
    assert err["code"] == "engine_dead" and err["type"] == "service_unavailable_error"
    assert "the engine process died (killed by SIGKILL)" in err["message"]


SLOW_STOP = [  # a grammar's forced opening fed to a stop regex too slow to search
    {"text": "x", "sampling_params": {"regex": "a{300}", "stop_regex": "(.*a){25}x", "max_new_tokens": 310,
                                      "temperature": 0}},
    {"text": "x", "sampling_params": {"json_schema": json.dumps({"const": "a" * 300}), "stop_regex": "(.*a){25}x",
                                      "max_new_tokens": 310, "temperature": 0}},
]


async def _beside(server: Server, bad: dict[str, Any]) -> tuple[str, int, dict[str, Any]]:
    """A greedy stream running while `bad` is sent: the stream's text, bad's status and body."""
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/generate", json={**GREEDY, "stream": True}) as stream:
            assert stream.status == 200
            first = await next_event(stream)
            async with s.post(server.url + "/generate", json=bad) as resp:
                status, body = resp.status, await resp.json()
            events = [first, *await read_sse(stream)]
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events
    return events[-2]["text"], status, body


@pytest.mark.parametrize("bad", SLOW_STOP, ids=["regex", "json_schema"])
def test_one_request_cannot_take_the_engine_down(server: Server, reference: str, bad: dict[str, Any]):
    """Its fault ends it alone (a 400 naming what to fix); the stream beside it and the engine go on."""
    pid = server.server_info()["engine_pid"]
    text, status, body = asyncio.run(_beside(server, bad))
    assert status == 400, body
    assert "stop_regex took longer" in body["error"]["message"]
    assert text == reference
    assert server.get("/health")[0] == 200
    assert server.server_info()["engine_pid"] == pid
    assert server.generate(GREEDY)["text"] == reference


def test_engine_killed_in_flight_fails_cleanly_then_restarts(server: Server, reference: str):
    pid = server.server_info()["engine_pid"]
    events, status, body, retry_after = asyncio.run(_in_flight_then_kill(server))
    # the stream: its chunks, one error event, then the end of the stream
    assert events[-1] == "[DONE]"
    assert "error" not in events[0] and all("error" not in e for e in events[:-2])
    _assert_engine_dead(events[-2])
    # the plain request: a 503 with a JSON error, and when to retry (the engine restarts by default)
    assert status == 503
    _assert_engine_dead(body)
    assert retry_after is not None and int(retry_after) >= 1
    # restarting: /health says why and when to come back; then a fresh engine serves the same greedy text
    status, health, headers = _get_with_headers(server, "/health")
    assert status == 503
    _assert_engine_dead(health)
    assert "restarting" in health["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    poll("the restarted engine", lambda: server.get("/health")[0] == 200)
    assert server.generate(GREEDY)["text"] == reference
    info = server.server_info()
    assert info["engine_pid"] != pid and info["engine_restarts"] == 1
    assert server.metric("radixlm_engine_crashes_total") == 1
    assert server.metric("radixlm_engine_restarts_total") == 1


def test_crash_loop_ends_in_503(server: Server):
    os.kill(server.server_info()["engine_pid"], signal.SIGKILL)
    # --max-restarts 1 within the window: no second restart
    status, health = poll("the second crash to be noticed",
                          lambda: (r := server.get("/health"))[0] == 503 and "not restarted" in r[1]["error"]["message"]
                          and r)
    _assert_engine_dead(health)
    assert "--max-restarts 1" in health["error"]["message"]
    for path, body in (("/generate", GREEDY), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
        status, got = server.post(path, body, timeout=30)
        assert status == 503, got
        _assert_engine_dead(got)
    assert "Retry-After" not in _get_with_headers(server, "/health")[2]  # it will not come back by itself
    assert server.get("/get_server_info")[0] == 503
    assert server.metric("radixlm_engine_up") == 0 and server.metric("radixlm_engine_restarts_total") == 1


def test_a_killed_server_takes_its_engine_with_it():
    """SIGKILL of the server mid-stream: its engine process, whose outputs nobody reads any more,
    exits (it once stayed, generating and then waiting to send, holding ~1.3 GB for good)."""
    with start_server("--dtype", "float32", "--max-total-tokens", "4096") as s:
        engine = s.server_info()["engine_pid"]

        async def stream_then_kill() -> None:
            async with aiohttp.ClientSession() as session, session.post(
                    s.url + "/generate", json={**LONG, "stream": True}) as r:
                await r.content.readline()  # the engine is generating
                s.proc.kill()
                s.proc.wait()

        try:
            asyncio.run(stream_then_kill())
            poll("the orphaned engine to exit", lambda: not process_running(engine), deadline_s=60)
        finally:
            if process_running(engine):
                os.kill(engine, signal.SIGKILL)
