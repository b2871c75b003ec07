"""A radixlm server (``radixlm serve``) as a DSL backend, over its native /generate API."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from radixlm.lang.backends.base import (
    Backend,
    Connection,
    GenOutput,
    GenRequest,
    ScorePrompt,
    StreamChunk,
    TokenLogprob,
)
from radixlm.runtime.chat_template import FALLBACK, ChatTemplate, from_tokenizer


class BackendError(RuntimeError):
    """The server refused or failed a request; the message holds its error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class RuntimeEndpoint(Backend):
    """Run programs on a radixlm (or SGLang-compatible) server at ``base_url``.

    Role markers: ``chat_template`` when given; else the server's own (``role_markers`` in
    ``/get_model_info``, probed from its tokenizer exactly as the in-process Engine backend
    does); else, for a server that does not report them (SGLang), its tokenizer when
    ``tokenizer_path`` is readable on this machine; else the documented fallback.
    """

    def __init__(self, base_url: str, api_key: str | None = None, chat_template: ChatTemplate | None = None,
                 timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.model_info = self._call("/get_model_info")
        self.template_source = "argument"  # where the role markers came from (docs/dsl.md)
        self._template = chat_template or self._server_template()

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """GET ``path``, or POST ``body`` as JSON to it; the decoded JSON reply."""
        data = None if body is None else json.dumps(body).encode()
        headers = self.headers if body is None else {**self.headers, "Content-Type": "application/json"}
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise BackendError(e.code, _error_message(e.read().decode(errors="replace"))) from None

    def _server_template(self) -> ChatTemplate:
        markers = self.model_info.get("role_markers")
        if markers is not None:
            try:
                template = ChatTemplate.from_dict(markers)
            except ValueError as e:
                raise ValueError(f"{self.base_url}/get_model_info sent unusable role_markers: {e}") from None
            self.template_source = "server"
            return template
        path = self.model_info.get("tokenizer_path")
        if not path or not os.path.isdir(path):
            self.template_source = "fallback"
            return FALLBACK
        from transformers import AutoTokenizer

        self.template_source = "local tokenizer"
        return from_tokenizer(AutoTokenizer.from_pretrained(path))

    def open_session(self, capacity: int | None = None, ttl: float | None = None,
                     session_id: str | None = None) -> str:
        body = {k: v for k, v in (("capacity", capacity), ("ttl", ttl), ("session_id", session_id)) if v is not None}
        session_id_out: str = self._call("/open_session", body)
        return session_id_out

    def close_session(self, session_id: str) -> None:
        try:
            self._call("/close_session", {"session_id": session_id})
        except BackendError as e:
            if e.status != 404:  # 404: no longer open (closed or expired)
                raise

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Connection]:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(self.base_url, headers=self.headers, timeout=timeout,
                                         connector=connector) as session:
            yield _EndpointConnection(session)


class _EndpointConnection(Connection):
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def _post(self, body: dict[str, Any]) -> Any:
        async with self.session.post("/generate", json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise BackendError(resp.status, _error_message(text))
            return json.loads(text)

    @staticmethod
    def _body(req: GenRequest) -> dict[str, Any]:
        body = {"text": req.text, "sampling_params": req.sampling, "return_logprob": req.return_logprob,
                "top_logprobs_num": req.top_logprobs_num, "session_params": req.session}
        if req.plain_spans:  # radixlm's extension: only sent when some content holds special-token text
            body["plain_text_spans"] = [list(s) for s in req.plain_spans]
        return body

    async def generate(self, req: GenRequest) -> list[GenOutput]:
        out = await self._post(self._body(req))
        outs = out if isinstance(out, list) else [out]
        return [GenOutput(o["text"], o["meta_info"]) for o in outs]

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamChunk]:
        async with self.session.post("/generate", json={**self._body(req), "stream": True}) as resp:
            if resp.status != 200:
                raise BackendError(resp.status, _error_message(await resp.text()))
            sent = 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    raise BackendError(500, _error_message(json.dumps(event)))
                text = event["text"]  # cumulative, as in SGLang
                final = event["meta_info"].get("finish_reason") is not None
                yield StreamChunk(text[sent:], event["meta_info"] if final else None)
                sent = len(text)

    async def prefill(self, text: str) -> int:
        out = await self._post({"text": text, "sampling_params": {"max_new_tokens": 0}})
        n: int = out["meta_info"]["prompt_tokens"]
        return n

    async def input_logprobs(self, prompts: Sequence[ScorePrompt], start: int) -> list[list[TokenLogprob]]:
        body: dict[str, Any] = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                                "logprob_start_len": start}
        if all(isinstance(p, str) for p in prompts):
            body["text"] = list(prompts)
        else:
            body["input_ids"] = [list(p) for p in prompts]
        outs = await self._post(body)
        return [[(e[0], e[1]) for e in o["meta_info"]["input_token_logprobs"]] for o in outs]


def _error_message(body: str) -> str:
    try:
        message: str = json.loads(body)["error"]["message"]
        return message
    except (ValueError, KeyError, TypeError):
        return body[:500]
