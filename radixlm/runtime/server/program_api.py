"""POST /run_program: a DSL request graph (radixlm.runtime.programs.ir) run next to the engine.

The graph is validated by the IR's own validator and the server's ProgramLimits, then run by the
same executor the DSL runs client-side (radixlm.runtime.programs.executor), over an in-process
connection whose every request is a native /generate body parsed exactly as that route parses
it. So a program gives the same variables either way; it just skips one HTTP round trip per gen,
select and fork. A graph is data: nothing in it is executed as code.

Every engine request of a run carries the run's program id (and, for forks, the fork's group and
hold: radixlm.runtime.scheduler.ProgramTag), so the scheduler admits it as part of a program; the
engine is told when the program ends. /metrics counts programs, their latency and the HTTP round
trips their in-process requests saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from radixlm.runtime.chat_template import ChatTemplate
from radixlm.runtime.programs.connection import (
    Connection,
    GenOutput,
    GenRequest,
    ScorePrompt,
    StreamChunk,
    TokenLogprob,
    prefill_body,
    score_body,
    score_rows,
)
from radixlm.runtime.programs.executor import RunContext, SessionTurns, failed_at, run_sequence
from radixlm.runtime.programs.ir import Graph, GraphError
from radixlm.runtime.programs.limits import ProgramLimits, check_limits
from radixlm.runtime.programs.sampling import SamplingArgs
from radixlm.runtime.programs.state import StateCore, TextEvent
from radixlm.runtime.scheduler.request import ProgramTag
from radixlm.runtime.server.context import CONTEXT, ServerContext
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.fields import check_keys, get_bool, get_str
from radixlm.runtime.server.native_api import GenerateSpec, native_meta, parse_generate_soon
from radixlm.runtime.server.payload import check_stop_bytes, json_response, read_json_object
from radixlm.runtime.server.prefix_tokenizer import PrefixTokenizer
from radixlm.runtime.server.sse import event_stream, send_event

RUN_PROGRAM_FIELDS = ("graph", "stream", "session_id", "sampling_defaults")


def routes() -> list[web.RouteDef]:
    return [web.post("/run_program", run_program)]


class ProgramError(ApiError):
    """An ApiError that also lists every problem of a graph, or names the variable whose gen or
    select failed (and the state it ran on)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 errors: list[str] | None = None, variable: str | None = None, state: str | None = None) -> None:
        super().__init__(status, message, param, code)
        self.errors, self.variable, self.state = errors, variable, state

    def body(self) -> dict[str, Any]:
        out = super().body()
        if self.errors is not None:
            out["error"]["errors"] = self.errors
        if self.state is not None:
            out["error"]["variable"] = self.variable
            out["error"]["state"] = self.state
        return out


@dataclass(frozen=True)
class ProgramSpec:
    graph: Graph
    stream: bool
    session_id: str | None
    defaults: SamplingArgs


def parse_program(body: dict[str, Any], limits: ProgramLimits) -> ProgramSpec:
    """Validate a /run_program body: the IR's validator (every problem listed), then the limits."""
    check_keys(body, RUN_PROGRAM_FIELDS)
    stream, session_id = get_bool(body, "stream"), get_str(body, "session_id")
    raw_defaults = body.get("sampling_defaults") or {}
    if not isinstance(raw_defaults, dict):
        raise ApiError(400, "sampling_defaults must be an object of sampling parameters", param="sampling_defaults")
    try:
        defaults = SamplingArgs.from_kwargs(raw_defaults)
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"invalid sampling_defaults: {e}", param="sampling_defaults") from None
    raw = body.get("graph")
    if not isinstance(raw, dict):
        raise ApiError(400, "graph is required: a request graph object (radixlm.Graph.to_json())", param="graph")
    try:
        graph = Graph.from_json(raw)
    except GraphError as e:
        raise ProgramError(400, str(e), "graph", "invalid_graph", errors=e.problems) from None
    except RecursionError:
        raise ProgramError(400, "invalid request graph: nested too deeply", "graph", "invalid_graph",
                           errors=["graph: nested too deeply"]) from None
    problems = check_limits(graph, limits, defaults.n)
    if problems:
        raise ProgramError(400, "; ".join(p.message for p in problems), problems[0].flag, "program_too_large",
                           errors=[p.message for p in problems])
    return ProgramSpec(graph, stream, session_id, defaults)


async def run_program(request: web.Request) -> web.StreamResponse:
    """Run one request graph; its variables and meta info, or (stream) its text events then them."""
    ctx = request.app[CONTEXT]
    body = await read_json_object(request, ctx.settings.max_request_bytes)
    tok, dispatcher = ctx.require_ready()
    spec = await asyncio.to_thread(parse_program, body, ctx.settings.programs)
    dispatcher.check_capacity(1)  # a program is admitted as a whole: its requests are never refused later
    core = StateCore()
    link = SessionTurns(spec.session_id, core) if spec.session_id is not None else None
    program_id = f"program-{uuid.uuid4().hex}"
    run_ctx = RunContext(ServerConnection(ctx, program_id, prefix=tok.prefix_tokenizer()), ChatTemplate.from_dict(tok.role_markers()),
                         spec.defaults, spec.stream, spec.graph.program, session=link)
    metrics = ctx.metrics
    metrics.programs_running.inc()
    start, outcome = time.perf_counter(), "abort"
    try:
        with ctx.busy():
            if spec.stream:
                resp, outcome = await _stream(request, spec.graph, core, run_ctx, link)
                return resp
            try:
                await _run(spec.graph, core, run_ctx, link)
            except Exception as e:  # noqa: BLE001 - every failure leaves as an error naming its variable
                outcome = "error"
                raise program_error(e, core) from None
            outcome = "ok"
            return json_response(program_result(spec.graph, core))
    finally:
        metrics.programs_running.dec()
        metrics.programs_finished.labels(outcome).inc()
        if outcome != "abort":
            metrics.program_latency.observe(time.perf_counter() - start)
        live = ctx.dispatcher  # (a new one if the engine was restarted meanwhile)
        if live is not None:  # the scheduler keeps nothing more for it
            await live.client.end_program(program_id)


async def _run(graph: Graph, core: StateCore, ctx: RunContext, link: SessionTurns | None) -> None:
    await run_sequence(core, graph.nodes, ctx)
    if link is not None:
        await link.pin(ctx.conn)


async def _stream(request: web.Request, graph: Graph, core: StateCore, ctx: RunContext,
                  link: SessionTurns | None) -> tuple[web.StreamResponse, str]:
    """One event per text event of every state, in each state's order, then the result (or the
    error); and how the program ended ("ok" or "error"; an exception when the client left)."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def heard(state: StateCore, event: TextEvent) -> None:
        queue.put_nowait({"state": state.path, "var": event.var, "text": event.text})

    core.listener = heard

    async def program() -> None:
        try:
            await _run(graph, core, ctx, link)
        finally:
            queue.put_nowait(None)

    task = asyncio.create_task(program())
    try:
        async with event_stream(request) as resp:
            while (item := await queue.get()) is not None:
                await send_event(resp, item)
            try:
                await task
            except Exception as e:  # noqa: BLE001 - the program's error ends its stream
                outcome = "error"
                await send_event(resp, program_error(e, core).body())
            else:
                outcome = "ok"
                await send_event(resp, {"done": True, **program_result(graph, core)})
        return resp, outcome
    finally:  # the client left, or the stream failed: every request of the program is aborted
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def program_result(graph: Graph, core: StateCore) -> dict[str, Any]:
    return {"program": graph.program, "variables": json_safe(core.variables), "meta": json_safe(core.meta),
            "text": core.text, "messages": core.messages}


def program_error(e: BaseException, root: StateCore) -> ProgramError:
    """The error of a failed program, naming the gen or select (its variable) that failed."""
    node, state = failed_at(e) or (None, root.path)
    variable = getattr(node, "name", None)
    what = f"{node.op}({variable!r})" if node is not None and variable else (node.op if node is not None else None)
    notes = "; ".join(getattr(e, "__notes__", ()))
    if isinstance(e, ApiError):
        status, message, code = e.status, e.message, e.code
    elif isinstance(e, (ValueError, TypeError)):
        status, message, code = 400, str(e), None
    else:
        status, message, code = 500, f"{type(e).__name__}: {e}", None
    head = f"{what} failed: " if what else ""
    return ProgramError(status, head + message + (f" ({notes})" if notes else ""), code=code or "program_failed",
                        variable=variable, state=state)


def json_safe(value: Any) -> Any:
    """Variables and meta as standard JSON: tuples become lists, non-finite floats null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class ServerConnection(Connection):
    """The executor's connection inside the server: each request is a native /generate body,
    parsed by that route's own parser and run through the dispatcher (admission, abort on exit).

    Each body names the program (``program_id``); the first request through a fork's connection
    also names the fork (``group``) and, for its prefix prefill, how many branches wait for it."""

    def __init__(self, ctx: ServerContext, program_id: str, group: str | None = None, hold: int = 0,
                 prefix: PrefixTokenizer | None = None) -> None:
        """``prefix``: the program's PrefixTokenizer (its texts tokenized from where they last
        changed), shared by every connection of the program."""
        self.ctx = ctx
        self.program_id = program_id
        self._group, self._hold = group, hold
        self.prefix = prefix

    def fork(self, group: str, branches: int) -> tuple[Connection, list[Connection]]:
        return (ServerConnection(self.ctx, self.program_id, group, branches, self.prefix),
                [ServerConnection(self.ctx, self.program_id, group, prefix=self.prefix) for _ in range(branches)])

    def _tag(self) -> ProgramTag:
        """This request's program tag (the server runs the program, so it is managed); a fork's
        group goes on its connection's first request only."""
        tag = ProgramTag(self.program_id, self._group, self._hold, managed=True)
        self._group, self._hold = None, 0
        return tag

    async def _spec(self, body: dict[str, Any]) -> GenerateSpec:
        tok = self.ctx.tokenizer
        assert tok is not None  # the handler checked the server is ready
        s = self.ctx.settings
        self.ctx.metrics.program_round_trips_saved.inc()  # a client-driven program would have sent this over HTTP
        body = {k: v for k, v in body.items() if k != "program"}
        spec = await parse_generate_soon(body, tok, s.max_top_logprobs, s.max_queued_requests, self._tag(),
                                         self.prefix)
        check_stop_bytes(spec.jobs, s.max_stop_bytes, "sampling_params")
        return spec

    @contextlib.asynccontextmanager
    async def _events(self, spec: GenerateSpec, stream: bool) -> AsyncIterator[Any]:
        dispatcher = self.ctx.dispatcher
        assert dispatcher is not None
        # (admitted with the program: a 429 halfway would throw its work away, and its requests
        # are bounded by the program's limits)
        async with dispatcher.run(spec.jobs, time.perf_counter(), admit=False, stream=stream) as events:
            yield events

    async def _outputs(self, body: dict[str, Any]) -> list[GenOutput]:
        spec = await self._spec(body)
        tok = self.ctx.tokenizer
        assert tok is not None
        n = len(spec.jobs)
        texts, metas = [""] * n, [dict[str, Any]() for _ in range(n)]
        async with self._events(spec, stream=False) as events:
            async for ev in events:
                if ev.error is not None:
                    raise ev.error
                texts[ev.index] += ev.output.text_delta
                if ev.output.finished:
                    metas[ev.index] = native_meta(ev.output.meta, tok, False)
        return [GenOutput(t, m) for t, m in zip(texts, metas)]

    async def generate(self, req: GenRequest) -> list[GenOutput]:
        return await self._outputs(req.native_body())

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamChunk]:
        spec = await self._spec(req.native_body())
        tok = self.ctx.tokenizer
        assert tok is not None
        async with self._events(spec, stream=True) as events:
            async for ev in events:
                if ev.error is not None:
                    raise ev.error
                out = ev.output
                yield StreamChunk(out.text_delta, native_meta(out.meta, tok, False) if out.finished else None)

    async def prefill(self, text: str) -> int:
        n: int = (await self._outputs(prefill_body(text)))[0].meta["prompt_tokens"]
        return n

    async def input_logprobs(self, prompts: Sequence[ScorePrompt], start: int) -> list[list[TokenLogprob]]:
        return score_rows([o.meta for o in await self._outputs(score_body(prompts, start))])
