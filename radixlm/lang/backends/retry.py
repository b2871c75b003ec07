"""A request the server refused with 429 (at capacity, or rate limited) sent again, as OpenAI's client
does: after 0.25 s, then twice as long each time up to 8 s, or after the server's ``Retry-After``
(seconds, at most 60); ``max_retries`` times, or (None) for as long as the backend's timeout allows."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import aiohttp

RETRY_FIRST_S = 0.25
RETRY_MAX_S = 8.0
RETRY_AFTER_MAX_S = 60.0


def check_max_retries(max_retries: int | None) -> None:
    if max_retries is not None and (isinstance(max_retries, bool) or not isinstance(max_retries, int)
                                    or max_retries < 0):
        raise ValueError(f"max_retries must be None or an integer >= 0, got {max_retries!r}")


def _wait(resp: aiohttp.ClientResponse, k: int) -> float:
    """Seconds before the next try: the server's Retry-After where it gives one, else the backoff."""
    given: str = resp.headers.get("Retry-After", "")
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):  # none given, or not a number of seconds (an HTTP date, "nan")
        return min(RETRY_FIRST_S * 2.0 ** min(k, 16), RETRY_MAX_S)
    return min(max(seconds, 0.0), RETRY_AFTER_MAX_S)


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], max_retries: int | None,
               timeout: float) -> aiohttp.ClientResponse:
    """POST ``body`` as JSON to ``url``, sent again after a 429; the response (the caller closes
    it): any other status, or the last 429."""
    give_up = time.monotonic() + timeout
    k = 0
    while True:
        resp = await session.post(url, json=body)
        if resp.status != 429 or k == max_retries:
            return resp
        wait = _wait(resp, k)
        if max_retries is None and time.monotonic() + wait > give_up:
            return resp
        resp.release()
        await asyncio.sleep(wait)
        k += 1
