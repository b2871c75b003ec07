"""The backend seam of the DSL: what the interpreter needs from a runtime.

A backend opens one connection per run (or run_batch); the connection (defined with the executor
in radixlm.runtime.programs.connection, re-exported here) generates, prefills and scores. A
backend on a radixlm runtime also opens and closes sessions (whose KV stays pinned between runs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager

from radixlm.runtime.chat_template import ChatTemplate
from radixlm.runtime.programs.connection import (
    Connection,
    GenOutput,
    GenRequest,
    ScorePrompt,
    StreamChunk,
    TokenLogprob,
)
from radixlm.runtime.programs.executor import RunContext
from radixlm.runtime.programs.ir import Graph
from radixlm.runtime.programs.state import StateCore

__all__ = ["Backend", "Connection", "GenOutput", "GenRequest", "GraphConnection", "ScorePrompt", "StreamChunk",
           "TokenLogprob"]


class GraphConnection(Connection):
    """A connection to a runtime that also runs whole request graphs itself (POST /run_program)."""

    # True: every program must run as one graph in the runtime; one that reads generated values,
    # and so has no graph, is an error instead of running node by node
    requires_graphs: bool = False

    @abstractmethod
    async def run_graph(self, graph: Graph, core: StateCore, ctx: RunContext) -> bool:
        """Run ``graph`` in the runtime, in one request, filling ``core`` as the executor would;
        False when it does not (the caller then runs the graph node by node)."""


class Backend(ABC):
    """A runtime the DSL runs programs on."""

    @property
    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        """How system/user/assistant messages are spelled for this backend's model."""

    @abstractmethod
    def connect(self) -> AbstractAsyncContextManager[Connection]:
        """Open a connection for one run; it is closed when the run ends."""

    def open_session(self, capacity: int | None = None, ttl: float | None = None,
                     session_id: str | None = None) -> str:
        """Open a runtime session (docs/sessions.md); returns its id."""
        raise NotImplementedError(
            f"the {type(self).__name__} backend has no sessions: sessions keep KV pinned in a radixlm "
            "runtime, so open them on an Engine or a RuntimeEndpoint")

    def close_session(self, session_id: str) -> None:
        """Close a runtime session; one that is no longer open (closed, expired) is left as it is."""
        raise NotImplementedError(f"the {type(self).__name__} backend has no sessions")
