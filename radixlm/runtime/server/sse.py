"""Server-sent events: `data: {json}` frames and the closing `data: [DONE]`.

A stream whose client stops reading is cut off: each write may wait at most
`stream_write_timeout` seconds for the client to take bytes (aiohttp waits for the socket to
drain once its buffer passes 64 KiB, so a connection holds at most about that much); past it
the handler ends (its engine requests are aborted) and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from radixlm.runtime.server.context import CONTEXT
from radixlm.runtime.server.errors import error_body
from radixlm.runtime.server.payload import dumps

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed the connection while we were writing to it."""


class ClientTooSlow(ClientGone):
    """The client did not read for stream_write_timeout seconds; the connection will be closed."""


class StreamTooLarge(Exception):
    """The stream sent more than max_response_bytes (a native cumulative stream resends all text
    so far in each chunk); it ends with an error event."""


class EventStreamResponse(web.StreamResponse):
    """A streaming response whose writes give up after `write_timeout` s without progress, and
    that stops after `max_bytes` bytes."""

    def __init__(self, request: web.Request, write_timeout: float, max_bytes: int | None = None) -> None:
        super().__init__(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                                              "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._request = request
        self._write_timeout = write_timeout
        self.stalled = False
        self.max_bytes = max_bytes
        self.sent = 0

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.stalled:
            raise ClientTooSlow("the client stopped reading")
        self.sent += len(data)
        try:
            async with asyncio.timeout(self._write_timeout):
                await super().write(data)
        except TimeoutError:
            self.stalled = True
            self.force_close()
            raise ClientTooSlow(f"the client read nothing for {self._write_timeout:g} s") from None

    async def write_eof(self, data: bytes = b"") -> None:
        """Called by aiohttp after the handler (its engine requests are aborted by then): a stalled
        stream's connection is dropped with its unsent bytes, instead of waiting for it to drain."""
        if not self.stalled:
            try:
                async with asyncio.timeout(self._write_timeout):
                    await super().write_eof(data)
                return
            except TimeoutError:
                self.stalled = True
        transport = self._request.transport
        if transport is not None:
            transport.abort()


async def open_stream(request: web.Request) -> web.StreamResponse:
    settings = request.app[CONTEXT].settings
    resp = EventStreamResponse(request, settings.stream_write_timeout, settings.max_response_bytes)
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
    except ClientTooSlow as e:
        log.warning("aborting a stream to %s: %s", request.remote, e)
        request.app[CONTEXT].metrics.slow_client_aborts.labels("write_timeout").inc()
    except ClientGone:
        pass
    except StreamTooLarge as e:  # the handler ends (its engine requests are aborted); the client is told why
        with contextlib.suppress(ClientGone):
            await send_event(resp, error_body(400, str(e)), metered=False)
            await send_done(resp)
    except Exception as e:
        log.exception("stream failed")
        with contextlib.suppress(ClientGone):
            await send_event(resp, error_body(500, f"internal server error: {type(e).__name__}: {e}"))


async def send_event(resp: web.StreamResponse, obj: Any, metered: bool = True) -> None:
    await _write(resp, f"data: {dumps(obj)}\n\n", metered)


async def send_done(resp: web.StreamResponse) -> None:
    await _write(resp, "data: [DONE]\n\n", metered=False)


async def _write(resp: web.StreamResponse, text: str, metered: bool = True) -> None:
    data = text.encode("utf-8")
    if metered and isinstance(resp, EventStreamResponse) and resp.max_bytes is not None \
            and resp.sent + len(data) > resp.max_bytes:
        raise StreamTooLarge(f"the stream reached the server's limit of {resp.max_bytes:,} bytes per response "
                             "(--max-response-bytes) and was ended; a native /generate stream resends all text "
                             "so far in each chunk: for long outputs stream from /v1/completions, which sends "
                             "only what is new")
    try:
        await resp.write(data)
    except ConnectionError as e:  # reset by peer, or "Cannot write to closing transport"
        raise ClientGone(str(e)) from None
