"""Server settings (HTTP side); the engine's own settings are radixlm.runtime.config.EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # every route but /health then needs `Authorization: Bearer <key>`
    max_queued_requests: int = 1024  # engine requests in flight (running + waiting); past it: 429
    max_request_bytes: int = 32 * 1024 * 1024  # request bodies above this: 413
    shutdown_grace: float = 30.0  # seconds in-flight requests get to finish after SIGTERM/SIGINT
    served_model_name: str | None = None  # the model id of the OpenAI API (default: the model's name)
    max_top_logprobs: int = 20  # cap on top_logprobs_num / top_logprobs / logprobs
    restart_on_failure: bool = False  # start a fresh engine process after it dies (docs/reliability.md)
    max_restarts: int = 3  # restarts allowed within restart_window; past it the server stays 503
    restart_window: float = 600.0  # seconds over which max_restarts is counted
    stream_write_timeout: float = 30.0  # seconds a stream may wait for its client to read; then aborted
    max_pending_outputs: int = 4096  # engine outputs one request may have waiting for its handler; then aborted
    debug_routes: bool = False  # serve GET /debug/check (walks the radix cache in the engine loop)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.shutdown_grace < 0:
            raise ValueError(f"shutdown_grace must be >= 0 seconds, got {self.shutdown_grace}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.restart_window > 0:
            raise ValueError(f"restart_window must be > 0 seconds, got {self.restart_window}")
        if not self.stream_write_timeout > 0:
            raise ValueError(f"stream_write_timeout must be > 0 seconds, got {self.stream_write_timeout}")
        if self.max_pending_outputs < 1:
            raise ValueError(f"max_pending_outputs must be >= 1, got {self.max_pending_outputs}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
