"""ServerContext: everything one running server owns (engine client, tokenizer, metrics, state)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
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

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine process (model load + warm-up), then the tokenizer; then ready."""
        self._client = EngineClient(self.engine_config)
        self.info = await self._client.start()
        self._tokenizer = await asyncio.to_thread(ServerTokenizer.load, self.info)
        self._dispatcher = Dispatcher(self._client, self.metrics, self.settings.max_queued_requests)
        if self.phase is Phase.STARTING:
            self.phase = Phase.READY

    async def drain(self, grace: float) -> bool:
        """Refuse new work; wait up to `grace` s for in-flight requests. True if they all finished."""
        self.phase = Phase.DRAINING
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        """Abort what is left and stop the engine process."""
        self.phase = Phase.STOPPED
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
        if self._client is not None and self._client.dead:
            return f"the engine is unavailable: {self._client.dead}"
        return None

    def require_ready(self) -> tuple[ServerTokenizer, Dispatcher]:
        why = self.unavailable()
        if why is not None:
            raise ApiError(503, why, code="unavailable")
        assert self._tokenizer is not None and self._dispatcher is not None
        return self._tokenizer, self._dispatcher

    def require_engine(self) -> EngineClient:
        """The engine for queries; unlike require_ready this also serves while draining."""
        if self._client is None or not self.info:
            raise ApiError(503, "the server is starting: the model is still loading", code="unavailable")
        if self._client.dead:
            raise ApiError(503, f"the engine is unavailable: {self._client.dead}", code="unavailable")
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
