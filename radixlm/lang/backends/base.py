"""The backend seam of the DSL: what the interpreter needs from a runtime.

A backend opens one connection per run (or run_batch); the connection generates (whole or
streamed), prefills a prefix (a cache hint that also returns its token count) and returns the
input-token logprobs that select() scores choices with. A backend on a radixlm runtime also
opens and closes sessions (whose KV stays pinned between runs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.chat_template import ChatTemplate

# (logprob, token): the token is an id, or its text where an API gives no ids (OpenAI).
TokenLogprob = tuple[float | None, int | str]
# A text, or its tokens as ids (or as token texts, where an API gives no ids).
ScorePrompt = str | Sequence[int | str]


@dataclass(frozen=True)
class GenRequest:
    """One generation: the state's text; for chat-only APIs also its finished messages and the
    open role with its content so far."""

    text: str
    sampling: dict[str, Any]
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: tuple[str, str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    session: dict[str, Any] | None = None  # the runtime's session_params: this request is a session turn
    # sorted [start, end) character ranges of ``text`` that are message content: plain text, never
    # control tokens (radixlm.runtime.chat_template.encode_with_plain_spans)
    plain_spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class GenOutput:
    text: str
    meta: dict[str, Any]


@dataclass(frozen=True)
class StreamChunk:
    """A text delta; the last chunk of a stream carries the request's meta info."""

    text: str
    meta: dict[str, Any] | None = None


class Connection(ABC):
    """A backend opened for one run; every method may be awaited concurrently."""

    @abstractmethod
    async def generate(self, req: GenRequest) -> list[GenOutput]:
        """The completions of ``req`` (``n`` of them)."""

    @abstractmethod
    def stream(self, req: GenRequest) -> AsyncIterator[StreamChunk]:
        """The completion of ``req`` (n = 1) as it is decoded."""

    @abstractmethod
    async def prefill(self, text: str) -> int:
        """Compute (and cache) the KV of ``text``; returns its token count."""

    @abstractmethod
    async def input_logprobs(self, prompts: Sequence[ScorePrompt], start: int) -> list[list[TokenLogprob]]:
        """For each prompt (text, or tokens as returned here), (logprob, token) of its tokens from position
        ``start`` on; the logprob of position 0 is None. One batched call sharing cached prefixes."""


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
