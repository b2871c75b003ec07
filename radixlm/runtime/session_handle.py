"""Session: the user's handle on one open multi-turn session of an engine.

The sessions themselves (turns, pins, TTL) are the engine core's: radixlm.runtime.sessions.
"""

from __future__ import annotations

from typing import Any, Protocol

from radixlm.runtime.sessions import SessionParams


class TurnRunner(Protocol):
    """What a session handle needs of its engine (radixlm.runtime.engine.Engine)."""

    def generate(self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any: ...

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None, **kwargs: Any) -> Any: ...

    def close_session(self, session_id: str) -> None: ...


class Session:
    """A handle on one open session of an Engine: each generate() is a new turn.

    By default a turn continues the newest finished turn; ``rid`` continues (``replace``:
    replaces what followed) an earlier one. ``last_rid`` is the request id of the newest turn
    this handle sent, for branching back to it later.
    """

    def __init__(self, engine: TurnRunner, session_id: str) -> None:
        self.engine = engine
        self.id = session_id
        self.last_rid: str | None = None

    def params(self, rid: str | None = None, replace: bool = False, offset: int | None = None) -> SessionParams:
        return SessionParams(self.id, rid, offset, replace)

    def generate(self, prompt: Any = None, sampling_params: Any = None, *, rid: str | None = None,
                 replace: bool = False, offset: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """One turn: ``prompt`` (text or token ids) is appended to the history it continues."""
        out = self.engine.generate(prompt, sampling_params, session_params=self.params(rid, replace, offset),
                                   **kwargs)
        self.last_rid = out["meta_info"]["id"]
        return dict(out)

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None, *, rid: str | None = None,
                             replace: bool = False, offset: int | None = None, **kwargs: Any) -> dict[str, Any]:
        """generate() for asyncio."""
        out = await self.engine.async_generate(prompt, sampling_params,
                                               session_params=self.params(rid, replace, offset), **kwargs)
        self.last_rid = out["meta_info"]["id"]
        return dict(out)

    def close(self) -> None:
        self.engine.close_session(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
