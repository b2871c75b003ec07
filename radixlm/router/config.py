"""The router's settings: one frozen dataclass; `radixlm route`'s flags derive from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(frozen=True)
class RouterConfig:
    worker_urls: tuple[str, ...] = ()  # the replicas, e.g. http://127.0.0.1:30001
    policy: str = "cache_aware"  # a name in radixlm.router.policies.POLICIES
    host: str = "127.0.0.1"
    port: int = 30000
    cache_threshold: float = 0.5  # cache_aware: the share of the prompt a worker must already hold to win it
    balance_abs_threshold: int = 32  # cache_aware: ignore affinity when max - min in-flight exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max in-flight exceeds this times min
    max_tree_chars: int = 1 << 22  # cache_aware: characters remembered per worker (LRU past it)
    health_interval: float = 2.0  # seconds between health checks of each worker
    health_timeout: float = 5.0  # seconds a health check may take
    health_failures: int = 2  # failed checks in a row that take a worker out (a refused connection: at once)
    request_timeout: float = 3600.0  # seconds a proxied request may take in all (streams included)
    max_request_bytes: int = 32 * 1024 * 1024  # request bodies above this: 413
    max_sessions: int = 100_000  # session -> worker bindings kept (oldest forgotten past it)
    shutdown_grace: float = 30.0  # seconds in-flight requests get to finish after SIGTERM/SIGINT
    api_key: str | None = field(default=None, repr=False)  # every route but /health, /openapi.json: Bearer <key>

    def __post_init__(self) -> None:
        if not self.worker_urls:
            raise ValueError("give at least one worker: --worker-urls http://HOST:PORT [...]")
        for url in self.worker_urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"worker url {url!r} is not http(s)://HOST:PORT; fix --worker-urls")
        if len(set(self.worker_urls)) != len(self.worker_urls):
            raise ValueError("--worker-urls names a worker twice")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"--balance-rel-threshold must be >= 1, got {self.balance_rel_threshold}")
        for name in ("max_tree_chars", "health_failures", "max_request_bytes", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("health_interval", "health_timeout", "request_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.shutdown_grace < 0:
            raise ValueError(f"--shutdown-grace must be >= 0 seconds, got {self.shutdown_grace}")
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()
                                         or not self.api_key.isprintable() or not self.api_key.isascii()):
            raise ValueError("--api-key must be non-empty printable ASCII with no leading or trailing whitespace")

    @property
    def urls(self) -> tuple[str, ...]:
        """The worker urls without a trailing slash."""
        return tuple(u.rstrip("/") for u in self.worker_urls)
