"""The router process: listen, check the workers, route, and stop cleanly on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from radixlm.router.app import create_app
from radixlm.router.config import RouterConfig

log = logging.getLogger("radixlm.router")


async def route(config: RouterConfig, stop: asyncio.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or `stop` is set); returns the exit code (1 if it cannot listen)."""
    runner = web.AppRunner(create_app(config), handler_cancellation=True, access_log=None,
                           shutdown_timeout=config.shutdown_grace)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        log.error("cannot listen on %s:%s: %s", config.host, config.port, e)
        await runner.cleanup()
        return 1
    port = runner.addresses[0][1] if runner.addresses else config.port  # the bound one, for --port 0
    log.info("routing on http://%s:%d to %d workers (policy %s)", config.host, port, len(config.urls), config.policy)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("shutting down: requests in flight get %.0f s to finish", config.shutdown_grace)
    await runner.cleanup()
    log.info("stopped")
    return 0
