"""A radixlm server (``radixlm serve``) as a DSL backend, over its native /generate API."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import aiohttp

from radixlm.lang.backends import retry
from radixlm.lang.backends.base import (
    Backend,
    Connection,
    GenOutput,
    GenRequest,
    GraphConnection,
    ScorePrompt,
    StreamChunk,
    TokenLogprob,
)
from radixlm.runtime.chat_template import FALLBACK, ChatTemplate, from_tokenizer
from radixlm.runtime.programs.connection import prefill_body, score_body, score_rows
from radixlm.runtime.programs.executor import RunContext
from radixlm.runtime.programs.ir import ForkNode, GenNode, Graph
from radixlm.runtime.programs.state import StateCore
from radixlm.runtime.tokenizer_loader import load_tokenizer

ProgramMode = Literal["auto", "server", "client"]
PROGRAM_MODES: tuple[ProgramMode, ...] = ("auto", "server", "client")


def _gather_logprobs(held: dict[str, list[Any]], meta: dict[str, Any]) -> None:
    """Keep a native stream's output logprobs whole in ``held``: a chunk holds the entries from
    position output_token_logprobs_length - len(entries) on, the tokens new since the previous
    chunk (a server without that field, as older SGLang, sends them all each time)."""
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if key in meta:
            entries = meta[key]
            start = meta.get("output_token_logprobs_length", len(entries)) - len(entries)
            kept = held.setdefault(key, [])
            del kept[start:]
            kept.extend(entries)


class BackendError(RuntimeError):
    """The server refused or failed a request; the message holds its error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class RuntimeEndpoint(Backend):
    """Run programs on a radixlm (or SGLang-compatible) server at ``base_url``.

    Programs: with ``programs="auto"`` a program that traces to a static graph runs on the
    server in one POST /run_program (no round trip per gen, select or fork); one that reads
    generated values, one run in a session, or one whose role markers are not the server's runs
    step by step over /generate. ``"server"`` forces the first (a program without a graph is a
    TraceError), ``"client"`` the second.

    A request the server refuses with 429 (at capacity) is sent again (:mod:`retry`:
    ``max_retries`` times, None: for as long as ``timeout`` allows), so a program waits for room
    rather than failing halfway.

    Role markers: ``chat_template`` when given; else the server's own (``role_markers`` in
    ``/get_model_info``, probed from its tokenizer exactly as the in-process Engine backend
    does); else, for a server that does not report them (SGLang), its tokenizer when
    ``tokenizer_path`` is readable on this machine; else the documented fallback.
    """

    def __init__(self, base_url: str, api_key: str | None = None, chat_template: ChatTemplate | None = None,
                 timeout: float = 600.0, programs: ProgramMode = "auto", max_retries: int | None = None) -> None:
        if programs not in PROGRAM_MODES:
            raise ValueError(f"programs must be one of {', '.join(PROGRAM_MODES)}, got {programs!r}")
        retry.check_max_retries(max_retries)
        self.programs = programs
        self.max_retries = max_retries
        self.no_run_program = False  # set when the server answered 404 to /run_program
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.model_info = self._call("/get_model_info")
        # a radixlm server (which reports its role markers) takes the ``program`` field that tags
        # a step-by-step program's requests; SGLang's /generate would refuse it
        self.tags_programs = "role_markers" in self.model_info
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
        self.template_source = "local tokenizer"
        return from_tokenizer(load_tokenizer(path))

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
            yield _EndpointConnection(session, self)


class _EndpointConnection(GraphConnection):
    """``program_id``: the program whose requests this connection sends (a step-by-step run on a
    radixlm server), named in each /generate body's ``program`` field."""

    def __init__(self, session: aiohttp.ClientSession, endpoint: RuntimeEndpoint,
                 program_id: str | None = None) -> None:
        self.session = session
        self.endpoint = endpoint
        self.requires_graphs = endpoint.programs == "server"
        self.program_id = program_id

    def for_program(self, program_id: str) -> Connection:
        return _EndpointConnection(self.session, self.endpoint, program_id) if self.endpoint.tags_programs else self

    def _body(self, body: dict[str, Any]) -> dict[str, Any]:
        return body if self.program_id is None else {**body, "program": {"id": self.program_id}}

    async def _send(self, path: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """POST ``body`` to ``path``, sent again after a 429 (:mod:`retry`); the caller closes the response."""
        return await retry.post(self.session, path, body, self.endpoint.max_retries, self.endpoint.timeout)

    async def run_graph(self, graph: Graph, core: StateCore, ctx: RunContext) -> bool:
        """POST /run_program: the graph runs next to the engine; its result fills ``core``."""
        mode = self.endpoint.programs
        if mode == "client" or self.endpoint.no_run_program:
            return False
        why_not = ("it runs in a session (its turns are sent one by one)" if ctx.session is not None else
                   "its role markers are not the server's" if self.endpoint.template_source != "server" else None)
        if why_not is not None:
            if mode == "server":
                raise ValueError(f"program {graph.program!r} cannot run on the server (programs='server'): {why_not}")
            return False
        body = {"graph": graph.model_dump(mode="json"), "stream": ctx.stream,
                "sampling_defaults": ctx.defaults.to_native()}
        async with await self._send("/run_program", body) as resp:
            if resp.status == 404 and mode == "auto" and "program_failed" not in await resp.text():
                self.endpoint.no_run_program = True  # a server without /run_program (SGLang): step by step
                return False
            if resp.status != 200:
                raise _program_failure(resp.status, await resp.text())
            if not ctx.stream:
                _fill(core, await resp.json(), graph)
                return True
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    raise _program_failure(500, json.dumps(event))
                if event.get("done"):
                    _fill(core, event, graph)
                elif event["state"] == "root":  # the root state's text events, as the executor appends them
                    core.append(event["text"], event["var"])
        return True

    async def _post(self, body: dict[str, Any]) -> Any:
        async with await self._send("/generate", self._body(body)) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise BackendError(resp.status, _error_message(text))
            return json.loads(text)

    async def generate(self, req: GenRequest) -> list[GenOutput]:
        out = await self._post(req.native_body())
        outs = out if isinstance(out, list) else [out]
        return [GenOutput(o["text"], o["meta_info"]) for o in outs]

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamChunk]:
        async with await self._send("/generate", self._body({**req.native_body(), "stream": True})) as resp:
            if resp.status != 200:
                raise BackendError(resp.status, _error_message(await resp.text()))
            sent = 0
            logprobs: dict[str, list[Any]] = {}
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    raise BackendError(500, _error_message(json.dumps(event)))
                text, meta = event["text"], event["meta_info"]  # text: cumulative, as in SGLang
                _gather_logprobs(logprobs, meta)
                final = meta.get("finish_reason") is not None
                yield StreamChunk(text[sent:], {**meta, **logprobs} if final else None)
                sent = len(text)

    async def prefill(self, text: str) -> int:
        out = await self._post(prefill_body(text))
        n: int = out["meta_info"]["prompt_tokens"]
        return n

    async def input_logprobs(self, prompts: Sequence[ScorePrompt], start: int) -> list[list[TokenLogprob]]:
        outs = await self._post(score_body(prompts, start))
        return score_rows([o["meta_info"] for o in outs])


def _fill(core: StateCore, result: dict[str, Any], graph: Graph) -> None:
    """A state as /run_program's result left it (its text as one event when none was streamed);
    tool calls, which come back as data, bound to the program's functions again."""
    if not core.events:
        core.append(result["text"])
    core.text = result["text"]
    variables = dict(result["variables"])
    for node in _tool_gens(graph.nodes):
        if node.name in variables:
            variables[node.name] = node.bind(variables[node.name])
    core.variables.update(variables)
    core.meta.update(result["meta"])
    core.messages[:] = result["messages"]


def _tool_gens(nodes: Sequence[Any]) -> Iterator[GenNode]:
    """The graph's gens with tools, fork branches' included."""
    for node in nodes:
        if isinstance(node, GenNode) and node.tools is not None and node.name is not None:
            yield node
        elif isinstance(node, ForkNode):
            for branch in node.branches:
                yield from _tool_gens(branch)


def _program_failure(status: int, body: str) -> BackendError:
    """/run_program's error; its note names the variable whose gen or select failed."""
    err = BackendError(status, _error_message(body))
    with contextlib.suppress(ValueError, KeyError, TypeError):
        detail = json.loads(body)["error"]
        if detail.get("state") is not None:
            err.add_note(f"variable {detail.get('variable')!r} failed on state {detail.get('state')!r}")
    return err


def _error_message(body: str) -> str:
    try:
        message: str = json.loads(body)["error"]["message"]
        return message
    except (ValueError, KeyError, TypeError):
        return body[:500]
