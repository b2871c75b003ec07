"""ServerContext: everything one running server owns (engine client, tokenizer, metrics, state)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import math
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.server.dispatcher import Dispatcher
from radixlm.runtime.server.engine_client import EngineClient, EngineDeadError
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.metrics import Metrics
from radixlm.runtime.server.settings import ServerSettings
from radixlm.runtime.server.tokenizer import ServerTokenizer

log = logging.getLogger("radixlm.server")


class Phase(enum.Enum):
    STARTING = "starting"  # listening; the model is loading
    READY = "ready"
    DRAINING = "draining"  # SIGTERM/SIGINT: in-flight requests finish, new ones are refused
    STOPPED = "stopped"


class ServerContext:
    def __init__(self, settings: ServerSettings, engine_config: EngineConfig) -> None:
        self.settings = settings
        self.engine_config = engine_config
        self.metrics = Metrics()
        self.phase = Phase.STARTING
        self.started_at = time.time()
        self.info: dict[str, Any] = {}
        self._client: EngineClient | None = None
        self._tokenizer: ServerTokenizer | None = None
        self._dispatcher: Dispatcher | None = None
        self._busy = 0  # generation handlers in flight
        self._idle = asyncio.Event()
        self._idle.set()
        self._supervisor: asyncio.Task[None] | None = None
        self._engine_down: str | None = None  # why the engine cannot serve (it died; restarting or not)
        self._restarts: deque[float] = deque()  # monotonic times of restarts within the window
        self.num_restarts = 0
        self.start_seconds = 30.0  # how long the engine's last start took (a guess until the first)
        self._restarting = False  # a fresh engine process is being started
        self.session_lock = asyncio.Lock()  # /open_session checks the cap and opens as one step

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process (model load + warm-up), then the tokenizer; then ready."""
        self._client = EngineClient(self.engine_config)
        t0 = time.monotonic()
        # the tokenizer's code imports (~1 s) while the engine process loads the model: only the
        # engine knows the tokenizer's directory, but the import need not wait for it
        importing = asyncio.create_task(asyncio.to_thread(ServerTokenizer.import_code))
        try:
            self.info = await self._client.start()
        finally:  # (an import that failed fails the load below, after the engine's own errors)
            await asyncio.gather(importing, return_exceptions=True)
        self.start_seconds = time.monotonic() - t0
        self._tokenizer = await asyncio.to_thread(ServerTokenizer.load, self.info)
        self._tokenizer.special_in_content = self.settings.special_tokens_in_content
        # (the first program's PrefixTokenizer would work out its parts on the event loop: ~0.1 s)
        await asyncio.to_thread(self._tokenizer.prefix_tokenizer)
        self._dispatcher = Dispatcher(self._client, self.metrics, self.settings.max_queued_requests,
                                      self.settings.max_pending_outputs, self.retry_headers)
        # What the server holds from now on (modules, the tokenizer, the app: ~231,000 objects) stays
        # out of the cyclic collector, as in the engine process: a full pass over that many stops
        # the event loop and every request in flight for a long while (docs/machines.md).
        gc.collect()
        gc.freeze()
        if self.phase is Phase.STARTING:
            self.phase = Phase.READY
        self._supervisor = asyncio.create_task(self._supervise())

    async def _supervise(self) -> None:
        """Wait for the engine process to exit; restart it if --restart-on-failure allows, else
        leave the server answering 503. Requests in flight at the crash have failed already."""
        while True:
            assert self._client is not None
            why = await self._client.wait_exit()
            if self.phase is not Phase.READY:
                return  # shutting down: the exit was ours
            log.error("%s", why)
            self.metrics.engine_crashes.inc()
            while True:
                refusal = self._restart_refusal()
                if refusal is not None:
                    self._engine_down = f"{why}; not restarted: {refusal}"
                    log.error("%s; the server answers 503 until it is restarted", self._engine_down)
                    return
                self._restarts.append(time.monotonic())
                self._restarting = True
                self._engine_down = f"{why}; restarting it"
                log.warning("restarting the engine process (restart %d within %.0f s, at most %d)",
                            len(self._restarts), self.settings.restart_window, self.settings.max_restarts)
                client = EngineClient(self.engine_config)
                t0 = time.monotonic()
                try:
                    self.info = await client.start()
                    self.start_seconds = time.monotonic() - t0
                    break
                except Exception as e:  # noqa: BLE001 - a failed restart counts against the cap too
                    self._restarting = False
                    why = f"the restarted engine failed to start: {e}"
                    log.error("%s", why)
                    await client.close()
                except asyncio.CancelledError:
                    await client.close()
                    raise
            old, self._client = self._client, client
            assert self._dispatcher is not None
            self._dispatcher.client = client
            self._engine_down = None
            self._restarting = False
            self.num_restarts += 1
            self.metrics.engine_restarts.inc()
            log.info("the engine process is back (pid %s)", client.pid)
            await old.close()

    def _restart_refusal(self) -> str | None:
        """Why the engine must not be restarted now, or None: restarts are capped at max_restarts
        within restart_window seconds, so a crash loop ends in 503s instead of spinning."""
        s = self.settings
        if not s.restart_on_failure:
            return "--restart-on-failure is off"
        while self._restarts and time.monotonic() - self._restarts[0] > s.restart_window:
            self._restarts.popleft()
        if len(self._restarts) >= s.max_restarts:
            return f"--max-restarts {s.max_restarts} reached ({len(self._restarts)} in the last {s.restart_window:.0f} s)"
        return None

    async def drain(self, grace: float) -> bool:
        """Refuse new work; wait up to `grace` s for in-flight requests. True if they all finished."""
        self.phase = Phase.DRAINING
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        """Abort what is left and stop the engine process."""
        self.phase = Phase.STOPPED
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    # -- access for handlers ------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or str(self.info.get("model_name", "default"))

    @property
    def client(self) -> EngineClient | None:
        return self._client

    def unavailable(self) -> str | None:
        """Why the server cannot take generation work now, or None when it can."""
        if self.phase is Phase.STARTING:
            return "the server is starting: the model is still loading"
        if self.phase in (Phase.DRAINING, Phase.STOPPED):
            return "the server is shutting down"
        return self.engine_down()

    def engine_down(self) -> str | None:
        """Why the engine cannot serve although the server is up (it died), or None."""
        if self._engine_down is not None:
            return self._engine_down
        if self._client is not None and self._client.dead:
            return self._client.dead
        return None

    def retry_headers(self) -> dict[str, str] | None:
        """``Retry-After`` for a 503 while the engine starts or restarts: the seconds its last start
        took. None when it will not come back (restarts off or used up) or the server drains."""
        if self.phase is Phase.DRAINING or self.phase is Phase.STOPPED:
            return None
        if not self._restarting and self.engine_down() is not None and self._restart_refusal() is not None:
            return None
        return {"Retry-After": str(max(1, math.ceil(self.start_seconds)))}

    def require_ready(self) -> tuple[ServerTokenizer, Dispatcher]:
        why = self.unavailable()
        if why is not None:
            down = self.engine_down() is not None
            raise ApiError(503, why, code="engine_dead" if down else "unavailable",
                           headers=self.retry_headers() if down or self.phase is Phase.STARTING else None)
        assert self._tokenizer is not None and self._dispatcher is not None
        return self._tokenizer, self._dispatcher

    def require_engine(self) -> EngineClient:
        """The engine for queries; unlike require_ready this also serves while draining."""
        if self._client is None or not self.info:
            raise ApiError(503, "the server is starting: the model is still loading", code="unavailable",
                           headers=self.retry_headers())
        why = self.engine_down()
        if why is not None:
            raise ApiError(503, why, code="engine_dead", headers=self.retry_headers())
        return self._client

    @property
    def tokenizer(self) -> ServerTokenizer | None:
        return self._tokenizer

    @property
    def dispatcher(self) -> Dispatcher | None:
        return self._dispatcher

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Count a generation handler as in flight (what draining waits for)."""
        self._busy += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._busy -= 1
            if self._busy == 0:
                self._idle.set()

    @property
    def num_busy(self) -> int:
        return self._busy

    async def stats(self) -> dict[str, Any] | None:
        """The engine's stats, or None when it cannot answer; refreshes the metric gauges."""
        client = self._client
        stats = None
        if client is not None and self.info and not client.dead and self.phase is not Phase.STOPPED:
            with contextlib.suppress(EngineDeadError, asyncio.TimeoutError):
                stats = await client.query("stats", timeout=10.0)
        self.metrics.refresh(stats)
        return stats


CONTEXT = web.AppKey("context", ServerContext)
