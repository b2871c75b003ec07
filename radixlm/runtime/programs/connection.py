"""The connection seam of the executor: what running a request graph needs from a runtime.

A connection generates (whole or streamed), prefills a prefix (a cache hint that also returns
its token count) and returns the input-token logprobs that select() scores choices with. The
DSL's backends (radixlm.lang.backends) open one per run; the server runs graphs over its own
in-process one (radixlm.runtime.server.program_api).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    # OpenAI-shaped tools: the output is exactly one call of one of them, as the one-call VALUE
    # JSON (radixlm.runtime.tool_calls); only sent to connections that take tools natively
    tools: list[dict[str, Any]] | None = None

    def native_body(self) -> dict[str, Any]:
        """This generation as a native /generate body (the HTTP backend sends it; the server's
        in-process connection parses it exactly as /generate does)."""
        body: dict[str, Any] = {"text": self.text, "sampling_params": self.sampling,
                                "return_logprob": self.return_logprob, "top_logprobs_num": self.top_logprobs_num,
                                "session_params": self.session}
        if self.plain_spans:  # radixlm's extension: only sent when some content holds special-token text
            body["plain_text_spans"] = [list(s) for s in self.plain_spans]
        return body


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

    # True: a gen with tools is sent as a GenRequest with ``tools`` (an API with tool calling of its
    # own); False: the executor generates the call under the calls' JSON schema itself
    native_tools: bool = False

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

    def for_program(self, program_id: str) -> Connection:
        """This connection for one program that the client runs step by step (``program_id``,
        unique to the run). A runtime that schedules programs tags the program's requests with
        it, so its later requests are preferred over new programs' (radixlm's ``program`` field);
        by default it is this connection."""
        return self

    def fork(self, group: str, branches: int) -> tuple[Connection, list[Connection]]:
        """The connections of a fork named ``group`` (unique in the run): one for the prefill of its
        prefix, one per branch. A runtime that schedules programs tags their requests (the
        prefix's KV is kept for the branches, whose first requests are admitted together); by
        default they are all this connection."""
        return self, [self] * branches


# -- the native protocol's shapes, shared by the HTTP backend and the server's own connection --
def prefill_body(text: str) -> dict[str, Any]:
    """A /generate body that computes and caches ``text``'s KV (its meta holds prompt_tokens)."""
    return {"text": text, "sampling_params": {"max_new_tokens": 0}}


def score_body(prompts: Sequence[ScorePrompt], start: int) -> dict[str, Any]:
    """A /generate body returning each prompt's input-token logprobs from position ``start``."""
    body: dict[str, Any] = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                            "logprob_start_len": start}
    if all(isinstance(p, str) for p in prompts):
        body["text"] = list(prompts)
    else:
        body["input_ids"] = [list(p) for p in prompts]
    return body


def score_rows(metas: Sequence[dict[str, Any]]) -> list[list[TokenLogprob]]:
    """(logprob, token id) rows from the native meta_info of a score_body request."""
    return [[(e[0], e[1]) for e in meta["input_token_logprobs"]] for meta in metas]
