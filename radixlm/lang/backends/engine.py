"""The in-process Engine as a DSL backend: no HTTP, requests go straight into the scheduler."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from radixlm.lang.backends.base import (
    Backend,
    Connection,
    GenOutput,
    GenRequest,
    ScorePrompt,
    StreamChunk,
    TokenLogprob,
)
from radixlm.runtime.chat_template import ChatTemplate, encode_with_plain_spans, from_tokenizer

if TYPE_CHECKING:
    from radixlm.runtime.engine import Engine


class EngineBackend(Backend):
    """Run programs on an in-process ``radixlm.Engine``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._template = from_tokenizer(engine.tokenizer)

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Connection]:
        yield _EngineConnection(self.engine)

    def open_session(self, capacity: int | None = None, ttl: float | None = None,
                     session_id: str | None = None) -> str:
        return self.engine.open_session(capacity, ttl, session_id)

    def close_session(self, session_id: str) -> None:
        from radixlm.runtime.sessions import SessionNotFoundError

        with contextlib.suppress(SessionNotFoundError):
            self.engine.close_session(session_id)


class _EngineConnection(Connection):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _prompt(self, req: GenRequest) -> dict[str, Any]:
        """The prompt argument: the text, or its token ids when parts of it are plain-text content."""
        if not req.plain_spans:
            return {"prompt": req.text}
        return {"input_ids": encode_with_plain_spans(self.engine.tokenizer, req.text, req.plain_spans)}

    async def generate(self, req: GenRequest) -> list[GenOutput]:
        out = await self.engine.async_generate(
            sampling_params=req.sampling, return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
            session_params=req.session, **self._prompt(req))
        outs = out if isinstance(out, list) else [out]
        return [GenOutput(o["text"], server_shaped(o["meta_info"])) for o in outs]

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamChunk]:
        async for chunk in self.engine.async_stream(
                sampling_params=req.sampling, return_logprob=req.return_logprob,
                top_logprobs_num=req.top_logprobs_num, session_params=req.session, **self._prompt(req)):
            yield StreamChunk(chunk["text"], server_shaped(chunk["meta_info"]) if chunk["finished"] else None)

    async def prefill(self, text: str) -> int:
        out = _one(await self.engine.async_generate(text, {"max_new_tokens": 0}))
        n: int = out["meta_info"]["prompt_tokens"]
        return n

    async def input_logprobs(self, prompts: Sequence[ScorePrompt], start: int) -> list[list[TokenLogprob]]:
        params = {"max_new_tokens": 0}
        texts = [p for p in prompts if isinstance(p, str)]
        if len(texts) == len(prompts):
            out = await self.engine.async_generate(texts, params, return_logprob=True, logprob_start_len=start)
        else:
            out = await self.engine.async_generate(None, params, input_ids=[_token_ids(p) for p in prompts],
                                                   return_logprob=True, logprob_start_len=start)
        outs = out if isinstance(out, list) else [out]
        return [[(lp, tok) for lp, tok in o["meta_info"]["input_token_logprobs"]] for o in outs]


def _one(out: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    """The single output of a one-prompt Engine call."""
    if isinstance(out, list):
        raise TypeError(f"expected one output, got {len(out)}")
    return out


def _token_ids(prompt: ScorePrompt) -> list[int]:
    """A prompt given as token ids (the Engine scores texts or ids, never a mix)."""
    ids = [t for t in prompt if isinstance(t, int)]
    if isinstance(prompt, str) or len(ids) != len(prompt):
        raise TypeError("score prompts are all texts or all token-id lists")
    return ids


def server_shaped(meta: dict[str, Any]) -> dict[str, Any]:
    """The Engine's meta info in the shape a server's /generate answers (SGLang's), so a program
    reads the same meta on every backend: logprobs as ``[logprob, token_id, None]`` (-inf as
    -9999.0) and a length finish with its length."""
    def triples(entries: Any) -> list[list[Any]]:
        return [[_finite(lp), tid, None] for lp, tid in entries]

    out = dict(meta)
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in out:
            out[key] = triples(out[key])
    if "output_top_logprobs" in out:
        out["output_top_logprobs"] = [triples(step) for step in out["output_top_logprobs"]]
    reason = out.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "length":
        out["finish_reason"] = {**reason, "length": out.get("completion_tokens", 0)}
    return out


def _finite(lp: float | None) -> float | None:
    if lp is None or math.isnan(lp):
        return None
    return lp if math.isfinite(lp) else (-9999.0 if lp < 0 else 9999.0)
