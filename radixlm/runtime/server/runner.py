"""The server process: listen, start the engine, serve, and shut down cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.server.app import create_app
from radixlm.runtime.server.context import Phase, ServerContext
from radixlm.runtime.server.errors import error_body
from radixlm.runtime.server.payload import json_response
from radixlm.runtime.server.settings import ServerSettings

log = logging.getLogger("radixlm.server")
HANDLER_SHUTDOWN_TIMEOUT = 5.0  # after the engine is closed, for handlers to write their last bytes
KEEPALIVE_TIMEOUT = 75.0  # seconds an idle kept-alive connection stays open (aiohttp's default is an hour)
# Set by `radixlm serve --dp-size N` for its replicas: the launcher's pid. A replica whose launcher
# is gone (killed without stopping them) stops itself instead of serving on with nobody routing to it.
LAUNCHER_PID_ENV = "RADIXLM_LAUNCHER_PID"
LAUNCHER_CHECK_S = 1.0


async def serve(settings: ServerSettings, engine_config: EngineConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code (0 after a clean shutdown).

    The port opens first, so /health answers 503 while the model loads; it answers 200 once
    the engine process has loaded the model and run its warm-up.
    """
    ctx = ServerContext(settings, engine_config)
    runner = web.AppRunner(create_app(ctx), handler_cancellation=True, access_log=None,
                           shutdown_timeout=HANDLER_SHUTDOWN_TIMEOUT)
    await runner.setup()
    try:
        listener = await _listen(runner, settings)
    except OSError as e:
        log.error("cannot listen on %s:%s: %s", settings.host, settings.port, e)
        await runner.cleanup()
        return 1
    port = listener.sockets[0].getsockname()[1] if listener.sockets else settings.port
    log.info("listening on http://%s:%d; loading the model", settings.host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    watching = asyncio.create_task(_stop_without_launcher(int(launcher), stop)) if launcher else None
    starting = asyncio.create_task(ctx.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if starting.done():
        if starting.exception() is not None:
            log.error("the engine failed to start: %s", starting.exception())
            code = 1
        else:
            info = ctx.info
            log.info("ready: %s (context %s, %s KV slots) on http://%s:%d", info["model_name"],
                     info["context_length"], info["max_total_tokens"], settings.host, port)
            log.info("dtype %s: %s", info.get("dtype"), info.get("dtype_reason"))
            log.info("quantization %s: %s", info.get("quantization"), info.get("quantization_reason"))
            log.info("prompt attention in %s: %s", info.get("attention_dtype"), info.get("attention_dtype_reason"))
            if info.get("packed_weights"):
                log.info("%d dense bf16 weight matrices packed once for oneDNN (the same products, faster)",
                         info["packed_weights"])
            if info.get("native_products"):
                log.info("%d 4/8-bit weight matrices multiply on the native VNNI kernels (int8 activation blocks)",
                         info["native_products"])
            await stopping
    else:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
    stopping.cancel()

    # Shut down: stop listening, let in-flight requests finish, then abort the rest.
    listener.close()
    if ctx.phase is Phase.READY:
        log.info("shutting down: %d requests in flight get %.0f s to finish (signal again to abort them now)",
                 ctx.num_busy, settings.shutdown_grace)
        stop.clear()
        draining = asyncio.create_task(ctx.drain(settings.shutdown_grace))
        again = asyncio.create_task(stop.wait())
        await asyncio.wait({draining, again}, return_when=asyncio.FIRST_COMPLETED)
        again.cancel()
        if not draining.done() or not draining.result():
            draining.cancel()
            log.warning("aborting %d requests in flight", ctx.num_busy)
    if watching is not None:
        watching.cancel()
    ctx.phase = Phase.DRAINING
    await ctx.close()
    await runner.cleanup()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    log.info("stopped")
    return code


async def _stop_without_launcher(pid: int, stop: asyncio.Event) -> None:
    """A replica's watch on its launcher: once this process's parent is no longer ``pid``, stop
    as on SIGTERM (requests in flight get the shutdown grace)."""
    while os.getppid() == pid:
        await asyncio.sleep(LAUNCHER_CHECK_S)
    log.error("the launcher (pid %d) is gone; stopping", pid)
    stop.set()


async def _listen(runner: web.AppRunner, settings: ServerSettings) -> asyncio.Server:
    """Listen with connections served by `_Protocol` (the app runner's server still tracks them,
    so runner.cleanup() closes them as it would a TCPSite's)."""
    loop = asyncio.get_running_loop()
    server = runner.server
    assert server is not None

    def protocol() -> _Protocol:
        return _Protocol(server, loop=loop, access_log=None, keepalive_timeout=KEEPALIVE_TIMEOUT,
                         header_timeout=settings.header_timeout)

    return await loop.create_server(protocol, settings.host, settings.port, reuse_address=True)


class _Protocol(RequestHandler):
    """aiohttp's connection handler with a deadline for request headers (slowloris: a client that
    sends its headers a byte at a time is closed after header_timeout seconds) and errors of the
    HTTP parser itself (malformed or oversized request lines and headers) answered as JSON."""

    def __init__(self, manager: web.Server, *, loop: asyncio.AbstractEventLoop, header_timeout: float,
                 **kwargs: Any) -> None:
        super().__init__(manager, loop=loop, **kwargs)
        self._header_timeout = header_timeout
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:
            self._disarm()  # a whole request head arrived
        elif data and self._header_deadline is None and self._current_request is None:
            self._arm()  # the first bytes of the next request on a kept-alive connection

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._header_deadline = self._loop.call_later(self._header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _expire(self) -> None:
        self._header_deadline = None
        if self._current_request is None:
            log.info("closing a connection that sent no complete request head within %g s (--header-timeout)",
                     self._header_timeout)
            self.force_close()

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started: no error response can follow")
        log.debug("HTTP error %d from %s: %s", status, request.remote, message or exc)
        if status < 500:
            text = f"malformed HTTP request: {message or HTTPStatus(status).phrase}"
        else:
            text = "internal server error"
        resp = json_response(error_body(status, text), status)
        resp.force_close()
        return resp
