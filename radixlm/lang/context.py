"""The default backend, kept in one explicit context object (no hidden module globals)."""

from __future__ import annotations

import threading
from typing import Any

from radixlm.lang.backends.base import Backend


def as_backend(backend: Any) -> Backend:
    """A DSL backend for ``backend``: a Backend as it is, an in-process Engine wrapped."""
    if isinstance(backend, Backend):
        return backend
    from radixlm.runtime.engine import Engine  # torch only once an Engine exists anyway

    if isinstance(backend, Engine):
        from radixlm.lang.backends.engine import EngineBackend

        return EngineBackend(backend)
    raise TypeError(f"a backend must be an Engine, RuntimeEndpoint or OpenAI, got {type(backend).__name__}")


class DslContext:
    """Holds the backend that programs use when ``run(backend=...)`` names none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backend: Backend | None = None

    def set_backend(self, backend: Any) -> None:
        with self._lock:
            self._backend = None if backend is None else as_backend(backend)

    def backend(self, override: Any = None) -> Backend:
        """``override`` when given, else the default; a clear error when there is neither."""
        if override is not None:
            return as_backend(override)
        with self._lock:
            if self._backend is None:
                raise RuntimeError("no backend: call radixlm.set_default_backend(radixlm.Engine()) "
                                   "(or a RuntimeEndpoint / OpenAI), or pass backend= to run()")
            return self._backend


DEFAULT_CONTEXT = DslContext()


def set_default_backend(backend: Any) -> None:
    """Use ``backend`` (an Engine, RuntimeEndpoint or OpenAI) for programs run without one."""
    DEFAULT_CONTEXT.set_backend(backend)
