"""Server-sent events: `data: {json}` frames and the closing `data: [DONE]`."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from radixlm.runtime.server.errors import error_body
from radixlm.runtime.server.payload import dumps

log = logging.getLogger(__name__)


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


@contextlib.asynccontextmanager
async def event_stream(request: web.Request) -> AsyncIterator[web.StreamResponse]:
    """An SSE response that ends with [DONE]; if the handler fails after the headers went out,
    the error goes into the stream as an event; a client that went away ends it quietly (leaving
    the dispatcher's context then aborts what is still running)."""
    resp = await open_stream(request)
    try:
        yield resp
        await send_done(resp)
    except ClientGone:
        pass
    except Exception as e:  # noqa: BLE001 - headers are sent: the error can only go in the stream
        log.exception("stream failed")
        with contextlib.suppress(ClientGone):
            await send_event(resp, error_body(500, f"internal server error: {type(e).__name__}: {e}"))


async def send_event(resp: web.StreamResponse, obj: Any) -> None:
    await _write(resp, f"data: {dumps(obj)}\n\n")


async def send_done(resp: web.StreamResponse) -> None:
    await _write(resp, "data: [DONE]\n\n")


async def _write(resp: web.StreamResponse, text: str) -> None:
    try:
        await resp.write(text.encode("utf-8"))
    except ConnectionError as e:  # reset by peer, or "Cannot write to closing transport"
        raise ClientGone(str(e)) from None
