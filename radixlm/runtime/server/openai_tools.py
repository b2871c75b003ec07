"""Tool calling on /v1/chat/completions: request fields, and the phases one choice runs.

- ``required`` / a named tool: the prompt ends with the format's opener (``<tool_call>``) and the
  output is generated under one JSON-schema constraint whose language is exactly the calls
  (radixlm.runtime.tool_calls.calls_schema).
- ``auto``: first free text with the trigger (``<tool_call>``) as a stop string; if the model
  writes it, a second request continues from the same context (the radix cache holds it) with
  the text before the trigger, the opener and the calls constraint.
- ``none``: plain text (the tools are still shown to the model).
See docs/tools.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.intake import Submission
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server.context import ServerContext
from radixlm.runtime.server.dispatcher import Job
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.fields import get_bool
from radixlm.runtime.server.tokenizer import ServerTokenizer
from radixlm.runtime.tool_calls import (
    CallScanner,
    Tool,
    ToolCall,
    ToolChoice,
    ToolFormat,
    ToolInputError,
    calls_schema,
    detect_format,
    generic_messages,
    native_messages,
    parse_tool_choice,
    parse_tools,
    tool_of_pointer,
)


@dataclass
class ToolPlan:
    """The validated tool fields of a chat request and what its choices generate."""

    tools: list[Tool]
    choice: ToolChoice
    fmt: ToolFormat
    parallel: bool
    schema: str = ""  # the calls' JSON schema (text), for auto / required / named
    chat_ids: list[int] = field(default_factory=list)  # the rendered conversation, assistant turn opened

    @property
    def generates_calls(self) -> bool:
        return self.choice.mode != "none" and bool(self.tools)


def parse_tool_fields(body: Mapping[str, Any], fmt: ToolFormat) -> ToolPlan:
    """tools, tool_choice and parallel_tool_calls, checked (400s name the field)."""
    try:
        tools = parse_tools(body["tools"]) if body.get("tools") is not None else []
        choice = parse_tool_choice(body.get("tool_choice"), tools)
    except ToolInputError as e:
        raise ApiError(400, str(e), param=e.param) from None
    parallel = get_bool(body, "parallel_tool_calls", True)
    plan = ToolPlan(tools, choice, fmt, parallel)
    if plan.generates_calls:
        plan.schema = json.dumps(calls_schema(tools, choice, fmt, parallel), separators=(",", ":"))
    return plan


def render_chat(tok: ServerTokenizer, messages: list[dict[str, Any]], plan: ToolPlan) -> list[int]:
    """Token ids of the conversation: the template renders tools and calls itself when it can
    (native formats), else the generic rendering (tool list in the system message)."""
    has_tool_parts = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if plan.fmt.native:
        tools = [t.to_openai() for t in plan.tools] or None
        return tok.encode_chat(native_messages(messages), tools=tools)
    if plan.tools or has_tool_parts:
        return tok.encode_chat(generic_messages(messages, plan.tools, plan.fmt))
    return tok.encode_chat(messages)


def tool_format(tok: ServerTokenizer) -> ToolFormat:
    return detect_format(tok.chat_template_text)


def first_phase_params(params: dict[str, Any], plan: ToolPlan) -> None:
    """Native sampling fields of a choice's first request: ``auto`` stops at the trigger;
    ``required`` / named generates the calls under their schema."""
    if not plan.generates_calls:
        return
    if plan.choice.mode == "auto":
        stop = params.get("stop") or []
        params["stop"] = [*stop, plan.fmt.trigger]
        params["no_stop_trim"] = False
    else:
        _calls_params(params, plan)


def _calls_params(params: dict[str, Any], plan: ToolPlan) -> None:
    params["json_schema"] = plan.schema
    params["stop"] = []  # stop strings shape text content, never a call
    params["ignore_eos"] = False
    params["min_new_tokens"] = 0


def opener_ids(tok: ServerTokenizer, fmt: ToolFormat) -> list[int]:
    """The opener as the tokenizer spells it (its own added token where it has one)."""
    return tok.encode_plain(fmt.opener, add_special_tokens=False, param="tools") if fmt.opener else []


# -- running a choice ------------------------------------------------------------------------------
@dataclass
class Piece:
    """One thing a choice produced: content text, a call's start (name, id), arguments text, or the end."""

    kind: str  # "content" | "call" | "args" | "end"
    text: str = ""
    call: int = 0
    call_id: str = ""
    reason: str | None = None
    matched: str | int | None = None
    metas: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ChoiceResult:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reason: str | None = None
    matched: str | int | None = None
    metas: list[dict[str, Any]] = field(default_factory=list)


async def run_choice(ctx: ServerContext, plan: ToolPlan, job: Job, arrival: float,
                     tok: ServerTokenizer) -> AsyncIterator[Piece]:
    """The pieces of one choice, phase after phase (each an engine request)."""
    assert ctx.dispatcher is not None
    metas: list[dict[str, Any]] = []
    sub = job.request
    job = Job(0, sub, sub.rid)  # the copies of n > 1 run on their own: each is its own user rid
    if plan.choice.mode == "auto":
        content, meta = "", {}
        async for out, text in _phase(ctx, job, arrival, 0):
            if text:
                content += text
                yield Piece("content", text)
            if out is not None:
                meta = out
        metas.append(meta)
        reason = meta.get("finish_reason") or {}
        if not (reason.get("type") == "stop" and reason.get("matched") == plan.fmt.trigger):
            yield Piece("end", reason=reason.get("type"), matched=reason.get("matched"), metas=metas)
            return
        prompt = (plan.chat_ids + tok.encode_content(content)
                  + opener_ids(tok, plan.fmt))
        left = sub.params.max_new_tokens - int(meta.get("completion_tokens", 0))
        if left <= 0:
            yield Piece("end", reason="length", metas=metas)
            return
        d = sub.params.to_dict()
        d["max_new_tokens"] = left
        d["stop"] = []
        _calls_params(d, plan)
        sub = Submission(f"{sub.rid}-calls", prompt, SamplingParams.from_dict(d))
        job = Job(0, sub, sub.rid)
    scanner = CallScanner(plan.fmt)
    ids: dict[int, str] = {}
    pending: dict[int, str] = {}  # arguments text of calls whose name has not come yet (never, in order)
    meta = {}
    try:
        async for out, text in _phase(ctx, job, arrival, 0 if plan.choice.mode != "auto" else 1):
            for k, name, args, _done in scanner.feed(text):
                if name is not None:
                    ids[k] = plan.fmt.new_id()
                    yield Piece("call", text=name, call=k, call_id=ids[k])
                    if pending.get(k):
                        yield Piece("args", text=pending.pop(k), call=k)
                if args:
                    if k in ids:
                        yield Piece("args", text=args, call=k)
                    else:
                        pending[k] = pending.get(k, "") + args
            if out is not None:
                meta = out
    except ApiError as e:
        raise await _schema_error(ctx, plan, e, arrival) from None
    metas.append(meta)
    reason = (meta.get("finish_reason") or {}).get("type")
    complete = bool(scanner.calls) and all(c.done for c in scanner.calls)
    yield Piece("end", reason="tool_calls" if reason == "stop" and complete else reason, metas=metas)


async def _phase(ctx: ServerContext, job: Job, arrival: float,
                 phase: int) -> AsyncIterator[tuple[dict[str, Any] | None, str]]:
    """(final meta or None, new text) for each output of one engine request."""
    assert ctx.dispatcher is not None
    async with ctx.dispatcher.run([job], arrival, admit=phase == 0) as events:
        async for ev in events:
            if ev.error is not None:
                raise ev.error
            assert ev.output is not None
            yield (ev.output.meta if ev.output.finished else None), ev.output.text_delta


async def _schema_error(ctx: ServerContext, plan: ToolPlan, e: ApiError, arrival: float) -> ApiError:
    """A calls schema that did not compile is the fault of one tool's parameters: named by the
    error's JSON pointer, or found by compiling each tool's schema alone."""
    if e.status != 400 or "constrained decoding" not in e.message:
        return e
    e.param = "tools"
    index = tool_of_pointer(e.message, plan.fmt, plan.tools, plan.choice)
    if index is None:
        index = await _failing_tool(ctx, plan, arrival)
    if index is not None:
        e.param = f"tools[{index}].function.parameters"
        e.message = f"{e.param}: {e.message}"
    return e


async def check_schema(ctx: ServerContext, plan: ToolPlan, rid: str, arrival: float) -> None:
    """With tool_choice auto the calls' grammar is compiled up front (a prefill-only request of one
    token; the engine caches the grammar for the second phase), so a schema that does not compile
    is a 400 whether or not the model calls a tool."""
    params = SamplingParams(max_new_tokens=0, json_schema=plan.schema)
    job = Job(0, Submission(f"{rid}-toolcheck", plan.chat_ids[:1], params), f"{rid}-toolcheck")
    try:
        async for _ in _phase(ctx, job, arrival, 1):
            pass
    except ApiError as e:
        raise await _schema_error(ctx, plan, e, arrival) from None


async def _failing_tool(ctx: ServerContext, plan: ToolPlan, arrival: float) -> int | None:
    assert ctx.dispatcher is not None
    for i, t in enumerate(plan.tools):
        if plan.choice.mode == "named" and t.name != plan.choice.name:
            continue
        schema = calls_schema([t], ToolChoice("named", t.name), plan.fmt)
        params = SamplingParams(max_new_tokens=0, json_schema=json.dumps(schema))
        job = Job(0, Submission(f"toolprobe-{id(plan)}-{i}", plan.chat_ids[:1], params), f"toolprobe-{id(plan)}")
        try:
            async for _ in _phase(ctx, job, arrival, 1):
                pass
        except ApiError as err:
            if err.status == 400:
                return i
    return None


async def collect_choice(gen: AsyncIterator[Piece]) -> ChoiceResult:
    res = ChoiceResult()
    names: dict[int, tuple[str, str]] = {}
    args: dict[int, str] = {}
    async with contextlib.aclosing(gen):  # type: ignore[type-var]
        async for p in gen:
            if p.kind == "content":
                res.content += p.text
            elif p.kind == "call":
                names[p.call] = (p.call_id, p.text)
            elif p.kind == "args":
                args[p.call] = args.get(p.call, "") + p.text
            else:
                res.reason, res.matched, res.metas = p.reason, p.matched, p.metas
    for k in sorted(names):
        call_id, name = names[k]
        text = args.get(k, "")
        try:
            json.loads(text)
        except ValueError:
            continue  # cut by max_tokens: only complete calls are returned
        res.calls.append(ToolCall(call_id, name, text))
    return res


async def merged(gens: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """The pieces of several choices as they come; on exit, whatever still runs is cancelled."""
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, gen: AsyncIterator[Piece]) -> None:
        try:
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for p in gen:
                    queue.put_nowait((k, p))
            queue.put_nowait((k, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((k, e))

    tasks = [asyncio.create_task(pump(k, g)) for k, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(prompt_len: int, results: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Prompt tokens once; completion tokens of every phase of every choice; cached by the first."""
    completion = sum(int(m.get("completion_tokens", 0)) for metas in results for m in metas)
    cached = int(results[0][0].get("cached_tokens", 0)) if results and results[0] else 0
    return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
