"""A DSL backend's request that a server refuses with 429 is sent again (radixlm.lang.backends.retry):
against a small HTTP server on 127.0.0.1 that refuses the first tries."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from radixlm.lang.backends import retry


async def _serve(refusals: int, headers: dict[str, str]) -> tuple[web.AppRunner, str, list[float]]:
    """A server whose /x answers 429 (with ``headers``) ``refusals`` times, then 200; the times of the tries."""
    tries: list[float] = []

    async def handle(request: web.Request) -> web.Response:
        tries.append(time.monotonic())
        assert await request.json() == {"a": 1}  # the same body every time
        if len(tries) <= refusals:
            return web.json_response({"error": {"message": "busy"}}, status=429, headers=headers)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/x", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/x", tries


def _run(refusals: int, max_retries: int | None, timeout: float = 60.0,
         headers: dict[str, str] | None = None) -> tuple[int, list[float]]:
    async def go() -> tuple[int, list[float]]:
        runner, url, tries = await _serve(refusals, headers or {})
        try:
            async with aiohttp.ClientSession() as session:
                async with await retry.post(session, url, {"a": 1}, max_retries, timeout) as resp:
                    return resp.status, tries
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_a_429_is_sent_again_with_a_growing_wait():
    status, tries = _run(refusals=3, max_retries=None)
    assert status == 200 and len(tries) == 4
    waits = [b - a for a, b in zip(tries, tries[1:])]
    for got, want in zip(waits, (0.25, 0.5, 1.0)):
        assert want <= got < want + 0.5


def test_max_retries_bounds_the_tries_and_the_last_429_is_returned():
    assert _run(refusals=5, max_retries=2)[0] == 429
    status, tries = _run(refusals=5, max_retries=0)
    assert status == 429 and len(tries) == 1


def test_the_timeout_bounds_the_tries_without_max_retries():
    status, tries = _run(refusals=100, max_retries=None, timeout=1.0)
    assert status == 429 and len(tries) == 3  # waits of 0.25 and 0.5 s fit in 1 s, the next 1 s does not


def test_the_servers_retry_after_is_honoured():
    status, tries = _run(refusals=1, max_retries=None, headers={"Retry-After": "0.05"})
    assert status == 200 and tries[1] - tries[0] < 0.2
    status, tries = _run(refusals=1, max_retries=None, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert status == 200 and tries[1] - tries[0] >= 0.25  # not seconds: the backoff


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_max_retries_is_a_value_error(bad):
    with pytest.raises(ValueError, match="max_retries"):
        retry.check_max_retries(bad)
