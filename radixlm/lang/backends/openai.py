"""Any OpenAI-compatible server as a DSL backend (aiohttp; the ``openai`` package is not needed).

Chat mode (default) sends the state's finished messages to /v1/chat/completions, so a gen must
open an assistant message (``s += assistant(gen(...))``). Completion mode (``chat=False``) sends
the state's text to /v1/completions. select() scores choices with prompt logprobs
(/v1/completions with ``echo`` and ``logprobs``, ``max_tokens: 0``); a server without them gets
a clear error. json_schema goes through ``response_format`` (chat) or the ``json_schema``
extension field (completions); regex and ebnf, and sampling values OpenAI lacks (top_k, min_p,
...), are sent as the extension fields SGLang and vLLM read. A gen with tools goes as ``tools``
with ``tool_choice: "required"`` (chat).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from radixlm.lang.backends import retry
from radixlm.lang.backends.base import (
    Backend,
    Connection,
    GenOutput,
    GenRequest,
    ScorePrompt,
    StreamChunk,
    TokenLogprob,
)
from radixlm.lang.backends.runtime_endpoint import BackendError, _error_message
from radixlm.runtime.chat_template import FALLBACK, ChatTemplate

_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class OpenAI(Backend):
    """Run programs on an OpenAI-compatible server (``base_url`` ends in /v1). A request refused
    with 429 (rate limited, at capacity) is sent again (:mod:`retry`: its ``Retry-After``, else a
    backoff; ``max_retries`` times, None: for as long as ``timeout`` allows)."""

    def __init__(self, model: str, base_url: str = "https://api.openai.com/v1", api_key: str | None = None,
                 chat: bool = True, chat_template: ChatTemplate = FALLBACK, timeout: float = 600.0,
                 max_retries: int | None = None) -> None:
        retry.check_max_retries(max_retries)
        self.model, self.chat, self.timeout, self.max_retries = model, chat, timeout, max_retries
        self.base_url = base_url.rstrip("/") + "/"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._template = chat_template

    @property
    def chat_template(self) -> ChatTemplate:
        """How the state's text spells roles (the chat API itself receives messages)."""
        return self._template

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Connection]:
        async with aiohttp.ClientSession(headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
            yield _OpenAIConnection(self, session)


class _OpenAIConnection(Connection):
    def __init__(self, backend: OpenAI, session: aiohttp.ClientSession) -> None:
        self.be, self.session = backend, session
        self.native_tools = backend.chat  # chat mode: a gen's tools go as `tools`, tool_choice required

    async def _send(self, route: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """POST ``body`` to ``route``, sent again after a 429 (:mod:`retry`); the caller closes the response."""
        return await retry.post(self.session, self.be.base_url + route, body, self.be.max_retries, self.be.timeout)

    async def _post(self, route: str, body: dict[str, Any]) -> Any:
        async with await self._send(route, body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise BackendError(resp.status, _error_message(text))
            return json.loads(text)

    def _body(self, req: GenRequest) -> tuple[str, dict[str, Any]]:
        sampling = dict(req.sampling)
        body: dict[str, Any] = {"model": self.be.model}
        schema = sampling.pop("json_schema", None)
        if schema is not None and self.be.chat:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": json.loads(schema)}}
        elif schema is not None:  # completions have no response_format: the extension field SGLang and vLLM read
            body["json_schema"] = schema
        for key, value in sampling.items():
            body[_OPENAI_NAMES.get(key, key)] = value
        if req.return_logprob:
            body["logprobs"] = True if self.be.chat else max(req.top_logprobs_num, 1)
            if self.be.chat and req.top_logprobs_num:
                body["top_logprobs"] = req.top_logprobs_num
        if req.tools is not None:
            body.update(tools=req.tools, tool_choice="required", parallel_tool_calls=False)
        if not self.be.chat:
            return "completions", {**body, "prompt": req.text}
        if req.open_role is None or req.open_role[0] != "assistant" or req.open_role[1]:
            raise ValueError("with the OpenAI chat API a gen must open an assistant message: "
                             "write `s += assistant(gen(...))`, or use OpenAI(..., chat=False)")
        return "chat/completions", {**body, "messages": req.messages}

    async def generate(self, req: GenRequest) -> list[GenOutput]:
        route, body = self._body(req)
        out = await self._post(route, body)
        if req.tools is not None:
            texts = [_call_value(c) for c in out["choices"]]
        else:
            texts = [c["message"]["content"] if self.be.chat else c["text"] for c in out["choices"]]
        return [GenOutput(t or "", {"finish_reason": c.get("finish_reason"), "usage": out.get("usage"),
                                    "logprobs": c.get("logprobs")})
                for t, c in zip(texts, out["choices"])]

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamChunk]:
        route, body = self._body(req)
        async with await self._send(route, {**body, "stream": True}) as resp:
            if resp.status != 200:
                raise BackendError(resp.status, _error_message(await resp.text()))
            finish = None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: "):])
                for choice in event.get("choices", []):
                    delta = choice["delta"].get("content") if self.be.chat else choice.get("text")
                    if delta:
                        yield StreamChunk(delta)
                    finish = choice.get("finish_reason") or finish
            yield StreamChunk("", {"finish_reason": finish})

    async def prefill(self, text: str) -> int:
        rows = await self.input_logprobs([text], 0)
        return len(rows[0])

    async def input_logprobs(self, prompts: Sequence[ScorePrompt], start: int) -> list[list[TokenLogprob]]:
        texts = [p if isinstance(p, str) else "".join(str(t) for t in p) for p in prompts]
        body = {"model": self.be.model, "prompt": texts, "max_tokens": 0, "echo": True, "logprobs": 0}
        try:
            out = await self._post("completions", body)
        except BackendError as e:
            raise ValueError(f"select needs prompt logprobs (/v1/completions with echo and logprobs), "
                             f"which this server does not offer ({e})") from None
        rows: list[list[TokenLogprob]] = [[] for _ in texts]
        for choice in out["choices"]:
            lp = choice.get("logprobs") or {}
            if not lp.get("tokens"):
                raise ValueError("select needs prompt logprobs, and this server returned none for echo")
            rows[choice["index"]] = list(zip(lp["token_logprobs"], lp["tokens"]))[start:]
        return rows


def _call_value(choice: dict[str, Any]) -> str:
    """The one call of a choice as the one-call VALUE the executor reads (radixlm.runtime.tool_calls)."""
    calls = (choice.get("message") or {}).get("tool_calls") or []
    if len(calls) != 1:
        raise ValueError(f"the server answered tool_choice 'required' with {len(calls)} tool calls "
                         f"(finish_reason {choice.get('finish_reason')!r}); expected exactly one")
    fn = calls[0]["function"]
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        raise ValueError(f"the server's tool call has arguments that are not JSON: {fn['arguments'][:200]!r}") from None
    return json.dumps([{"name": fn["name"], "arguments": arguments}], ensure_ascii=False, separators=(",", ":"))
