"""Server settings (HTTP side); the engine's own settings are radixlm.runtime.config.EngineConfig."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from radixlm.runtime.programs.limits import ProgramLimits


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
    restart_on_failure: bool = True  # start a fresh engine process after it dies (docs/reliability.md)
    max_restarts: int = 3  # restarts allowed within restart_window; past it the server stays 503
    restart_window: float = 600.0  # seconds over which max_restarts is counted
    stream_write_timeout: float = 30.0  # seconds a stream may wait for its client to read; then aborted
    max_pending_outputs: int = 4096  # engine outputs one request may have waiting for its handler; then aborted
    debug_routes: bool = False  # serve GET /debug/check (walks the radix cache in the engine loop)
    header_timeout: float = 10.0  # seconds a connection may take to send a request's headers; then closed
    body_timeout: float = 60.0  # seconds a handler waits for a request's body; then 408
    max_response_bytes: int = 256 * 1024 * 1024  # what one response may cost at most (estimated up front): 400
    max_stop_bytes: int = 64 * 1024  # UTF-8 bytes of one request's stop strings and stop_regex patterns in all: 400
    max_sessions: int = 1024  # open sessions at most; /open_session past it: 429
    max_session_ttl: float = 86400.0  # the largest ttl /open_session accepts, in seconds
    special_tokens_in_content: bool = False  # true: special-token text in chat content becomes control tokens
    programs: ProgramLimits = field(default_factory=ProgramLimits)  # POST /run_program's limits, a flag each

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
        for name in ("header_timeout", "body_timeout", "max_session_ttl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_response_bytes < 1024:
            raise ValueError(f"max_response_bytes must be >= 1024, got {self.max_response_bytes}")
        if self.max_stop_bytes < 1:
            raise ValueError(f"max_stop_bytes must be >= 1, got {self.max_stop_bytes}")
        if self.max_sessions < 0:
            raise ValueError(f"max_sessions must be >= 0, got {self.max_sessions}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.api_key is not None and (self.api_key != self.api_key.strip() or not self.api_key.isprintable()
                                         or not self.api_key.isascii()):
            raise ValueError("api_key must be printable ASCII with no leading or trailing whitespace")


API_KEY_ENV = "RADIXLM_API_KEY"


def resolve_api_key(flag: str | None, path: str | None, environ: Mapping[str, str]) -> str | None:
    """The API key from --api-key, else from --api-key-file (its first line; a flag's value is
    visible in `ps`, a file's is not), else from $RADIXLM_API_KEY; None when none is given. An
    empty key is refused wherever it comes from: a server started without the auth it was asked
    for would say nothing."""
    if flag is not None and path is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the API key file {path}: {e}") from None
        if not key:
            raise ValueError(f"the API key file {path} is empty")
        return key
    if flag is not None:
        return flag
    env = environ.get(API_KEY_ENV)
    if env is not None and not env.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty: set it to the key, or unset it to serve without one")
    return env
