"""Figures for docs/reliability.md ("Engine-process crash and restart", "Slow clients").

Starts a real `radixlm serve` (fp32, `--restart-on-failure --max-restarts 1
--stream-write-timeout 2`) and measures, printing one JSON line per step:

1. a streaming client that never reads: seconds until its request is aborted, bytes the socket
   held (kernel buffers), server RSS before and after;
2. SIGKILL of the engine with a stream and a plain request in flight: seconds until each client
   has its error, then seconds until /health is 200 again and whether a greedy request gives the
   text it gave before;
3. a second SIGKILL: seconds until /health reports the crash loop, and how fast a new request
   gets its 503.

    python benchmarks/faults.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "runtime" / "server")]
from server_harness import Server, next_event, read_sse, start_server  # noqa: E402
from test_server_faults import GREEDY, LONG, drain, rss_mib, stuck_stream  # noqa: E402

POLL_S = 0.05


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def stuck(server: Server) -> None:
    rss0 = rss_mib(server.proc.pid)
    t0 = time.monotonic()
    sock = stuck_stream(server)
    while server.server_info()["requests_in_flight"] != 1:
        time.sleep(POLL_S)
    while True:
        info = server.server_info()
        if info["requests_in_flight"] == 0 and info["stats"]["running_requests"] == 0:
            break
        time.sleep(POLL_S)
    aborted_s = time.monotonic() - t0
    held = drain(sock, 60)
    sock.close()
    report(step="stuck stream", aborted_after_s=round(aborted_s, 2), bytes_held_by_socket=held,
           rss_before_mib=round(rss0, 1), rss_after_mib=round(rss_mib(server.proc.pid), 1),
           aborts={r: server.metric("radixlm_slow_client_aborts_total", f'reason="{r}"')
                   for r in ("write_timeout", "pending_outputs")})


async def kill_in_flight(server: Server) -> float:
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/generate", json={**LONG, "stream": True}) as stream:
            await next_event(stream)
            plain = asyncio.ensure_future(s.post(server.url + "/generate", json=LONG))
            while (await asyncio.to_thread(server.server_info))["stats"]["running_requests"] != 2:
                await asyncio.sleep(POLL_S)
            pid = (await asyncio.to_thread(server.server_info))["engine_pid"]
            t = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            events = await read_sse(stream)
            stream_s = time.monotonic() - t
        async with await plain as resp:
            body = await resp.json()
            plain_s = time.monotonic() - t
    report(step="SIGKILL in flight", stream_error_after_s=round(stream_s, 3), plain_error_after_s=round(plain_s, 3),
           stream_error=events[-2], plain_status=resp.status, plain_body=body)
    return t


def main() -> None:
    server = start_server("--dtype", "float32", "--max-total-tokens", "8192", "--restart-on-failure",
                          "--max-restarts", "1", "--stream-write-timeout", "2", "--max-top-logprobs", "200")
    try:
        reference = server.generate(GREEDY)["text"]
        stuck(server)
        killed_at = asyncio.run(kill_in_flight(server))
        while server.get("/health")[0] != 200:
            time.sleep(POLL_S)
        back_s = time.monotonic() - killed_at
        report(step="restart", health_200_after_kill_s=round(back_s, 1),
               same_greedy_text=server.generate(GREEDY)["text"] == reference)
        os.kill(server.server_info()["engine_pid"], signal.SIGKILL)
        t = time.monotonic()
        while True:
            status, health = server.get("/health")
            if status == 503 and "not restarted" in health["error"]["message"]:
                break
            time.sleep(POLL_S / 2)
        loop_s = time.monotonic() - t
        t = time.monotonic()
        status, _ = server.post("/generate", GREEDY)
        report(step="second SIGKILL", health_503_after_s=round(loop_s, 3), health=health, new_request_status=status,
               new_request_s=round(time.monotonic() - t, 4))
    finally:
        report(step="stop", exit_code=server.stop())


if __name__ == "__main__":
    main()
