"""Typed messages between the server process and the engine-core process.

A request to run is the `Submission` the HTTP edge built (radixlm.runtime.intake), sent as it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.engine_core import RequestOutput


# server -> engine: a radixlm.runtime.intake.Submission (one completion, its params parsed once at the
# edge and sent typed), or one of these.
@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class EndProgram:
    """A program's last request is done: release what the scheduler keeps for it."""

    program_id: str


@dataclass(frozen=True)
class Query:
    """A question with one answer (`Reply` with the same token): 'stats', 'flush_cache',
    'check' (EngineCore.integrity_report), 'open_session' or 'close_session' (those two with
    their fields in `args`)."""

    kind: str
    token: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Shutdown:
    pass


# engine -> server
@dataclass(frozen=True)
class Ready:
    info: dict[str, Any]


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[RequestOutput]


@dataclass(frozen=True)
class RequestFailed:
    rid: str
    message: str
    bad_input: bool  # True: the request was invalid (HTTP 400); False: the engine failed (500)
    not_found: bool = False  # its session is not open (HTTP 404)


@dataclass(frozen=True)
class Crashed:
    """An exception escaped the engine loop; the process exits (code 1) right after sending it."""

    error: str


@dataclass(frozen=True)
class Reply:
    token: int
    payload: dict[str, Any] = field(default_factory=dict)
