"""The server process: listen, start the engine, serve, and shut down cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.server.app import create_app
from radixlm.runtime.server.context import Phase, ServerContext
from radixlm.runtime.server.settings import ServerSettings

log = logging.getLogger("radixlm.server")
HANDLER_SHUTDOWN_TIMEOUT = 5.0  # after the engine is closed, for handlers to write their last bytes


async def serve(settings: ServerSettings, engine_config: EngineConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code (0 after a clean shutdown).

    The port opens first, so /health answers 503 while the model loads; it answers 200 once
    the engine process has loaded the model and run its warm-up.
    """
    ctx = ServerContext(settings, engine_config)
    runner = web.AppRunner(create_app(ctx), handler_cancellation=True, access_log=None,
                           shutdown_timeout=HANDLER_SHUTDOWN_TIMEOUT)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as e:
        log.error("cannot listen on %s:%s: %s", settings.host, settings.port, e)
        await runner.cleanup()
        return 1
    log.info("listening on http://%s:%d; loading the model", settings.host, site.port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
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
                     info["context_length"], info["max_total_tokens"], settings.host, site.port)
            await stopping
    else:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
    stopping.cancel()

    # Shut down: stop listening, let in-flight requests finish, then abort the rest.
    await site.stop()
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
    ctx.phase = Phase.DRAINING
    await ctx.close()
    await runner.cleanup()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    log.info("stopped")
    return code
