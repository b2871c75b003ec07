"""Server-sent events: `data: {json}` frames and the closing `data: [DONE]`."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from radixlm.runtime.server.payload import dumps


class ClientGone(Exception):
    """The client closed the connection while we were writing to it."""


async def open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                 "X-Accel-Buffering": "no"},
    )
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, obj: Any) -> None:
    await _write(resp, f"data: {dumps(obj)}\n\n")


async def send_done(resp: web.StreamResponse) -> None:
    await _write(resp, "data: [DONE]\n\n")


async def _write(resp: web.StreamResponse, text: str) -> None:
    try:
        await resp.write(text.encode("utf-8"))
    except ConnectionError as e:  # reset by peer, or "Cannot write to closing transport"
        raise ClientGone(str(e)) from None
