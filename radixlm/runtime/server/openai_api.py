"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (with SSE streaming)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from radixlm.runtime.intake import PromptRequest
from radixlm.runtime.sampling_params import PARAMS, Param, SamplingParams
from radixlm.runtime.server.context import CONTEXT, ServerContext
from radixlm.runtime.server.dispatcher import Event, Job, check_job_count, expand_jobs, next_event
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.fields import (
    check_keys,
    get_bool,
    get_float,
    get_int,
    get_object,
    get_stop,
    get_str,
    is_int,
    is_token_list,
)
from radixlm.runtime.server.openai_tools import (
    Piece,
    ToolPlan,
    check_schema,
    collect_choice,
    first_phase_params,
    merged,
    opener_ids,
    parse_tool_fields,
    render_chat,
    run_choice,
    tool_format,
    usage,
)
from radixlm.runtime.server.payload import (
    check_response_cost,
    check_stop_bytes,
    finite_logprob,
    json_response,
    read_json_object,
)
from radixlm.runtime.server.sse import event_stream, send_event
from radixlm.runtime.server.tokenizer import ServerTokenizer
from radixlm.runtime.sessions import SessionParams
from radixlm.runtime.tool_calls import ToolInputError, parse_history_calls

log = logging.getLogger("radixlm.server")

MAX_N = 128
# The sampling fields, by their OpenAI names (OpenAI's own, and the SGLang / vLLM extensions the openai
# client sends through extra_body): from the SamplingParams declaration, OpenAI name -> native name.
SAMPLING_FIELDS: dict[str, str] = {p.openai or name: name for name, p in PARAMS.items() if p.openai is not None}
COMMON_FIELDS = ("model", "stream", "stream_options", *SAMPLING_FIELDS)
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "echo", "logprobs", "best_of")
CHAT_FIELDS = (*COMMON_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs",
               "response_format", "tools", "tool_choice", "parallel_tool_calls", "session_id")
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                  "prompt_cache_retention", "reasoning_effort", "verbosity")
UNSUPPORTED_FIELDS = ("suffix", "functions", "function_call", "audio", "prediction",
                      "web_search_options", "modalities")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The engine's names -> ours, for error messages that name what the client sent.
_RENAMES = {name: theirs for theirs, name in SAMPLING_FIELDS.items() if theirs != name}


def routes() -> list[web.RouteDef]:
    return [
        web.get("/v1/models", list_models),
        web.get("/v1/models/{model:.+}", get_model),
        web.post("/v1/completions", _endpoint(plan_completion)),
        web.post("/v1/chat/completions", _endpoint(plan_chat)),
    ]


def _endpoint(planner: Callable[[dict[str, Any], ServerTokenizer, int, int], Plan]) -> Handler:
    """The handler of a generation route: read the body, plan the requests, run them."""

    async def handle(request: web.Request) -> web.StreamResponse:
        ctx = request.app[CONTEXT]
        arrival = time.perf_counter()
        body = await read_json_object(request, ctx.settings.max_request_bytes)
        tok, _ = ctx.require_ready()
        # off the event loop: tokenizing long prompts must not stall other requests
        plan = await asyncio.to_thread(planner, body, tok, ctx.settings.max_top_logprobs,
                                       ctx.settings.max_queued_requests)
        check_response_cost(plan.jobs, ctx.settings.max_response_bytes)
        check_stop_bytes(plan.jobs, ctx.settings.max_stop_bytes, "stop")
        return await _run(request, ctx, plan, arrival, tok)

    return handle


# -- models ------------------------------------------------------------------------------
def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.model_name, "object": "model", "created": int(ctx.started_at), "owned_by": "radixlm",
            "root": ctx.info.get("model_path"), "max_model_len": ctx.info.get("context_length")}


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    ctx.require_engine()
    return json_response({"object": "list", "data": [_model_card(ctx)]})


async def get_model(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    ctx.require_engine()
    name = request.match_info["model"]
    if name != ctx.model_name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")
    return json_response(_model_card(ctx))


# -- shared request handling -------------------------------------------------------------
@dataclass
class Plan:
    """A validated OpenAI request: engine jobs plus how to render their outputs."""

    kind: str  # "chat" | "completion"
    rid: str
    jobs: list[Job]
    n: int
    stream: bool
    include_usage: bool
    prompt_lens: list[int]  # per prompt
    logprobs: bool = False
    top_logprobs: int = 0
    echo_texts: list[str] = field(default_factory=list)  # per prompt, completions with echo
    constraint_param: str | None = None  # the field that asked for constrained decoding
    tools: ToolPlan | None = None  # chat with tools that may be called (tool_choice auto / required / named)


def _sampling(body: Mapping[str, Any], n: int, max_tokens: int | None, default_max: int) -> dict[str, Any]:
    """OpenAI fields (plus SGLang extensions) as native sampling_params; 400s name the OpenAI field.
    Fields not given are left out (SamplingParams' defaults apply); the route reads n and max_tokens."""
    d: dict[str, Any] = {"n": n, "max_new_tokens": default_max if max_tokens is None else max_tokens}
    for theirs, name in SAMPLING_FIELDS.items():
        if name not in d and body.get(theirs) is not None:
            d[name] = _read(body, theirs, PARAMS[name])
    return d


def _read(body: Mapping[str, Any], key: str, p: Param) -> Any:
    """One sampling field, type-checked (and within the bounds of its OpenAI range) as the OpenAI API does;
    SamplingParams checks the rest."""
    if p.kind in ("int", "float"):
        lo = p.lo if p.off is None and not p.lo_open else None
        hi = p.openai_hi if p.openai_hi is not None else p.hi if p.off is None else None
        if p.kind == "int":
            return get_int(body, key, lo=None if lo is None else int(lo), hi=None if hi is None else int(hi))
        return get_float(body, key, lo=lo, hi=hi)
    if p.kind == "seed":
        return get_int(body, key)
    if p.kind == "bool":
        return get_bool(body, key)
    if p.kind == "stop":
        return get_stop(body, key)
    if p.kind == "token_ids":
        if not is_token_list(body[key]):
            raise ApiError(400, f"{key} must be a list of integer token ids", param=key)
        return body[key]
    if p.kind == "logit_bias":  # OpenAI's range; SamplingParams reads the ids and the vocabulary bounds them
        bias = body[key]
        hi = p.openai_hi if p.openai_hi is not None else math.inf
        if not isinstance(bias, dict) or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and -hi <= b <= hi for b in bias.values()):
            raise ApiError(400, f"{key} must be an object {{token id: bias}} with each bias a number in "
                                f"[-{hi:g}, {hi:g}]", param=key)
        return bias
    if p.kind == "schema":
        if not isinstance(body[key], (str, dict)):
            raise ApiError(400, f"{key} must be a JSON schema (object or string)", param=key)
        return body[key]
    return get_str(body, key)


def _params(d: dict[str, Any], tok: ServerTokenizer) -> SamplingParams:
    try:
        params = SamplingParams(**d)
    except ValueError as e:
        message = str(e)
        for ours, theirs in _RENAMES.items():
            message = message.replace(ours, theirs)
        param = next((k for k in SAMPLING_FIELDS if message.startswith(f"{k} ")), None)
        raise ApiError(400, message, param=param) from None
    tok.check_token_params(params)
    return params


def _common(body: Mapping[str, Any]) -> tuple[int, bool, bool]:
    get_str(body, "model")
    n = get_int(body, "n", 1, lo=1, hi=MAX_N)
    stream = get_bool(body, "stream")
    opts = get_object(body, "stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        check_keys(opts, ("include_usage", "continuous_usage_stats"))
        include_usage = get_bool(opts, "include_usage")
    return n, stream, include_usage


def _finish_reason(meta: Mapping[str, Any]) -> str | None:
    reason = meta.get("finish_reason") or {}
    return reason.get("type")


def _matched_stop(meta: Mapping[str, Any]) -> str | int | None:
    return (meta.get("finish_reason") or {}).get("matched")


def _usage(plan: Plan, metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (as OpenAI does for n > 1); completions add up."""
    prompt = sum(plan.prompt_lens)
    completion = sum(int(m.get("completion_tokens", 0)) for m in metas)
    cached = sum(int(metas[i].get("cached_tokens", 0)) for i in range(0, len(metas), plan.n))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _constraint_error(plan_param: str | None, e: ApiError) -> ApiError:
    if e.status == 400 and e.param is None and plan_param is not None and "constrained" in e.message:
        e.param = plan_param
    return e


async def _run(request: web.Request, ctx: ServerContext, plan: Plan, arrival: float,
               tok: ServerTokenizer) -> web.StreamResponse:
    assert ctx.dispatcher is not None
    with ctx.busy():
        try:
            if plan.tools is not None:
                if plan.tools.choice.mode == "auto":
                    await check_schema(ctx, plan.tools, plan.rid, arrival)
                if plan.stream:
                    return await _stream_tools(request, ctx, plan, arrival, tok)
                return await _collect_tools(ctx, plan, arrival, tok)
            async with ctx.dispatcher.run(plan.jobs, arrival, stream=plan.stream) as events:
                if plan.stream:
                    return await _stream(request, ctx, plan, events, tok)
                return await _collect(ctx, plan, events, tok)
        except ApiError as e:
            raise _constraint_error(plan.constraint_param, e) from None


async def _collect(ctx: ServerContext, plan: Plan, events: Any, tok: ServerTokenizer) -> web.Response:
    count = len(plan.jobs)
    texts = [""] * count
    metas: list[dict[str, Any]] = [{} for _ in range(count)]
    async for ev in events:
        if ev.error is not None:
            raise ev.error
        texts[ev.index] += ev.output.text_delta
        if ev.output.finished:
            metas[ev.index] = ev.output.meta
    choices = []
    for i in range(count):
        meta = metas[i]
        if plan.kind == "chat":
            lp = None
            if plan.logprobs:
                lp = {"content": _chat_logprobs(meta.get("output_token_logprobs", []),
                                                meta.get("output_top_logprobs"), plan.top_logprobs, tok),
                      "refusal": None}
            choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": lp,
                            "finish_reason": _finish_reason(meta), "matched_stop": _matched_stop(meta)})
        else:
            text, lp = texts[i], None
            if plan.echo_texts:
                text = plan.echo_texts[i // plan.n] + text
            if plan.logprobs:
                entries = list(meta.get("output_token_logprobs", []))
                tops = list(meta.get("output_top_logprobs") or [])
                if plan.echo_texts:
                    prompt_entries = list(meta.get("input_token_logprobs", []))
                    entries = prompt_entries + entries
                    tops = [None] * len(prompt_entries) + tops
                lp = _completion_logprobs(entries, tops, plan.top_logprobs, tok, 0)
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": _finish_reason(meta),
                            "matched_stop": _matched_stop(meta)})
    body: dict[str, Any] = {"id": plan.rid, "object": "chat.completion" if plan.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": ctx.model_name, "choices": choices,
            "usage": _usage(plan, metas)}
    if plan.kind == "chat":
        body["system_fingerprint"] = None
    return json_response(body)


async def _stream(request: web.Request, ctx: ServerContext, plan: Plan, events: Any,
                  tok: ServerTokenizer) -> web.StreamResponse:
    it = events.__aiter__()
    first: Event = await it.__anext__()
    if first.error is not None:
        raise first.error  # nothing sent yet: a plain HTTP error
    count = len(plan.jobs)
    created = int(time.time())
    chat = plan.kind == "chat"
    metas: list[dict[str, Any]] = [{} for _ in range(count)]
    sent_lp = [0] * count  # logprob entries already sent, per choice
    text_offset = [0] * count

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        c: dict[str, Any] = {"id": plan.rid, "object": "chat.completion.chunk" if chat else "text_completion",
             "created": created,
             "model": ctx.model_name, "choices": choices}
        if chat:
            c["system_fingerprint"] = None
        if plan.include_usage:
            c["usage"] = None
        return c

    async with event_stream(request) as resp:
        if chat:
            for i in range(count):
                await send_event(resp, chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]))
        elif plan.echo_texts:
            for i in range(count):
                echo = plan.echo_texts[i // plan.n]
                await send_event(resp, chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]))
        ev: Event | None = first
        while ev is not None:
            if ev.error is not None:
                await send_event(resp, _constraint_error(plan.constraint_param, ev.error).body())
                break
            i, out = ev.index, ev.output
            assert out is not None  # an event holds an output or an error
            lp: Any = None
            if plan.logprobs:
                if out.finished:
                    metas[i] = out.meta
                    entries = out.meta.get("output_token_logprobs", [])[sent_lp[i]:]
                    tops = (out.meta.get("output_top_logprobs") or [])[sent_lp[i]:]
                else:
                    entries = out.meta.get("output_token_logprobs", [])
                    tops = out.meta.get("output_top_logprobs") or []
                sent_lp[i] += len(entries)
                if entries:
                    if chat:
                        lp = {"content": _chat_logprobs(entries, tops, plan.top_logprobs, tok), "refusal": None}
                    else:
                        lp = _completion_logprobs(entries, tops, plan.top_logprobs, tok, text_offset[i])
                        text_offset[i] += sum(len(t) for t in lp["tokens"])
            elif out.finished:
                metas[i] = out.meta
            reason = _finish_reason(out.meta) if out.finished else None
            if out.text_delta or lp is not None or out.finished:
                if chat:
                    delta = {"content": out.text_delta} if out.text_delta else {}
                    choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
                else:
                    choice = {"index": i, "text": out.text_delta, "logprobs": lp, "finish_reason": reason}
                if out.finished:
                    choice["matched_stop"] = _matched_stop(out.meta)
                await send_event(resp, chunk([choice]))
            ev = await next_event(it)
        else:
            if plan.include_usage:
                final = chunk([])
                final["usage"] = _usage(plan, metas)
                await send_event(resp, final)
    return resp


def _chat_logprobs(entries: Any, tops: Any, k: int, tok: ServerTokenizer) -> list[dict[str, Any]]:
    out = []
    for j, (lp, tid) in enumerate(entries):
        text = tok.token_text(tid)
        top_list = []
        if k and tops and j < len(tops) and tops[j]:
            for tlp, ttid in tops[j][:k]:
                ttext = tok.token_text(ttid)
                top_list.append({"token": ttext, "logprob": finite_logprob(tlp), "bytes": list(ttext.encode())})
        out.append({"token": text, "logprob": finite_logprob(lp), "bytes": list(text.encode()),
                    "top_logprobs": top_list})
    return out


def _completion_logprobs(entries: Any, tops: Any, k: int, tok: ServerTokenizer, offset: int) -> dict[str, Any]:
    tokens: list[str] = []
    token_lps: list[float | None] = []
    top_dicts: list[dict[str, float | None] | None] = []
    offsets: list[int] = []
    for j, (lp, tid) in enumerate(entries):
        text = tok.token_text(tid)
        tokens.append(text)
        token_lps.append(finite_logprob(lp))
        offsets.append(offset)
        offset += len(text)
        step = tops[j] if tops and j < len(tops) else None
        if step is None and lp is None:
            top_dicts.append(None)
            continue
        d: dict[str, float | None] = {}
        for tlp, ttid in (step or [])[:k]:
            d.setdefault(tok.token_text(ttid), finite_logprob(tlp))
        if lp is not None:
            d.setdefault(text, finite_logprob(lp))  # OpenAI always includes the sampled token
        top_dicts.append(d)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top_dicts, "text_offset": offsets}


# -- /v1/completions ---------------------------------------------------------------------
def plan_completion(body: dict[str, Any], tok: ServerTokenizer, max_top: int, max_jobs: int) -> Plan:
    check_keys(body, COMPLETION_FIELDS, IGNORED_FIELDS, UNSUPPORTED_FIELDS)
    n, stream, include_usage = _common(body)
    best_of = get_int(body, "best_of", n, lo=1)
    if best_of != n:
        raise ApiError(400, f"best_of must equal n ({n}): this server returns every sample it draws",
                       param="best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        check_job_count(len(prompt), max_jobs, "prompts")
    prompts = _completion_prompts(body, tok)
    logprobs = get_int(body, "logprobs", None, lo=0, hi=max_top)
    echo = get_bool(body, "echo")
    if echo and logprobs is not None and stream:
        raise ApiError(400, "echo with logprobs is not available when streaming; drop stream or logprobs",
                       param="echo")
    max_tokens = get_int(body, "max_tokens", None, lo=0)
    params = _params(_sampling(body, n, max_tokens, 16), tok)
    rid = f"cmpl-{uuid.uuid4().hex}"
    specs = [
        PromptRequest(rid if len(prompts) == 1 else f"{rid}-{p}", ids, params, return_logprob=logprobs is not None,
                      logprob_start_len=0 if echo and logprobs is not None else -1, top_logprobs_num=logprobs or 0)
        for p, ids in enumerate(prompts)
    ]
    return Plan(
        kind="completion", rid=rid, jobs=expand_jobs(specs, max_jobs), n=n, stream=stream,
        include_usage=include_usage,
        prompt_lens=[len(p) for p in prompts], logprobs=logprobs is not None, top_logprobs=logprobs or 0,
        echo_texts=[_prompt_text(body, p, ids, tok) for p, ids in enumerate(prompts)] if echo else [],
        constraint_param=_constraint_field(body),
    )


def _completion_prompts(body: Mapping[str, Any], tok: ServerTokenizer) -> list[list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "prompt is required", param="prompt")
    if isinstance(prompt, str):
        return [tok.encode_text(prompt, "prompt")]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tok.encode_text(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if all(is_int(t) for t in prompt):
            tok.check_prompt(prompt, "prompt")
            return [list(prompt)]
        if all(is_token_list(p) for p in prompt):
            for i, p in enumerate(prompt):
                tok.check_prompt(p, f"prompt[{i}]")
            return [list(p) for p in prompt]
    if prompt == []:
        raise ApiError(400, "prompt is empty", param="prompt")
    raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids, or a list of such lists",
                   param="prompt")


def _prompt_text(body: Mapping[str, Any], p: int, ids: list[int], tok: ServerTokenizer) -> str:
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt[p], str):
        return str(prompt[p])
    return str(tok.decode(ids))


def _constraint_field(body: Mapping[str, Any]) -> str | None:
    for key in ("response_format", "json_schema", "regex", "ebnf"):
        if body.get(key) is not None:
            return key
    return None


# -- /v1/chat/completions ----------------------------------------------------------------
def plan_chat(body: dict[str, Any], tok: ServerTokenizer, max_top: int, max_jobs: int) -> Plan:
    check_keys(body, CHAT_FIELDS, IGNORED_FIELDS, UNSUPPORTED_FIELDS)
    n, stream, include_usage = _common(body)
    tools = parse_tool_fields(body, tool_format(tok))
    ids = render_chat(tok, _messages(body), tools)
    logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0, lo=0, hi=max_top)
    if top and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = get_int(body, "max_completion_tokens", None, lo=0)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None, lo=0)
    if tools.generates_calls:
        _check_with_tools(body, logprobs)
        tools.chat_ids = ids
        if tools.choice.mode != "auto":
            ids = ids + opener_ids(tok, tools.fmt)
            tok.check_prompt(ids, "messages")
    d = _sampling(body, n, max_tokens, tok.context_length - len(ids))
    _response_format(body, d)
    first_phase_params(d, tools)
    params = _params(d, tok)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    spec = PromptRequest(rid, ids, params, return_logprob=logprobs, top_logprobs_num=top if logprobs else 0)
    jobs = expand_jobs([spec], max_jobs, _chat_session(body, n))
    return Plan(kind="chat", rid=rid, jobs=jobs, n=n, stream=stream,
                include_usage=include_usage,
                prompt_lens=[len(ids)], logprobs=logprobs, top_logprobs=top, constraint_param=_constraint_field(body),
                tools=tools if tools.generates_calls else None)


def _check_with_tools(body: Mapping[str, Any], logprobs: bool) -> None:
    """What a request whose model may call tools cannot also ask for."""
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        raise ApiError(400, "response_format cannot be combined with tools (unless tool_choice is none)",
                       param="response_format")
    for key in ("regex", "json_schema", "ebnf"):
        if body.get(key) is not None:
            raise ApiError(400, f"{key} cannot be combined with tools (unless tool_choice is none)", param=key)
    if logprobs:
        raise ApiError(400, "logprobs are not available with tools (unless tool_choice is none)", param="logprobs")
    if body.get("session_id") is not None:
        raise ApiError(400, "session_id is not available with tools (unless tool_choice is none)",
                       param="session_id")


def _chat_session(body: Mapping[str, Any], n: int) -> SessionParams | None:
    """``session_id`` (extension): the messages are the whole conversation, as always; the turn
    replaces the session's history with it, so the KV of what it shares stays pinned."""
    sid = get_str(body, "session_id")
    if sid is None:
        return None
    if not sid:
        raise ApiError(400, "session_id must be the non-empty id /open_session returned", param="session_id")
    if n != 1:
        raise ApiError(400, "a session turn has one choice; drop n or session_id", param="n")
    return SessionParams(sid, replace=True)


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: role + string content; an assistant's
    ``tool_calls`` (parsed ToolCalls) and a tool message's ``tool_call_id`` (and ``name``) kept.
    A tool message answers a call an earlier assistant message made (its ``tool_call_id``)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    called: list[str] = []  # the ids of the calls earlier assistant messages made
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with role and content", param=where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                           param=f"{where}.role")
        content = _content(m.get("content"), f"{where}.content", role, bool(m.get("tool_calls")))
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if m.get("tool_calls"):
            if role != "assistant":
                raise ApiError(400, f"{where}.tool_calls is only for assistant messages", param=f"{where}.tool_calls")
            try:
                msg["tool_calls"] = parse_history_calls(m["tool_calls"], f"{where}.tool_calls")
            except ToolInputError as e:
                raise ApiError(400, str(e), param=e.param) from None
            called.extend(c.id for c in msg["tool_calls"])
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ApiError(400, f"{where}.tool_call_id is required for a tool message: the id of the call it "
                                    "answers", param=f"{where}.tool_call_id")
            if call_id not in called:  # rendered as given, the model would read a result of no call
                known = ", ".join(repr(c[:80]) for c in called[-8:]) or "none: no earlier message has tool_calls"
                raise ApiError(400, f"{where}.tool_call_id {call_id[:80]!r} answers no tool call of an earlier "
                                    f"assistant message; give the id of the call it answers (ids so far: {known})",
                               param=f"{where}.tool_call_id")
            msg["tool_call_id"] = call_id
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def _content(content: Any, where: str, role: str, has_calls: bool = False) -> str:
    if isinstance(content, str):
        return content
    if content is None and (role == "assistant" or has_calls):
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}[{j}] must be a text part {{type: text, text}}; this model reads "
                                    f"text only, got {kind!r}", param=f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", param=where)


def _response_format(body: Mapping[str, Any], d: dict[str, Any]) -> None:
    """json_object / json_schema become a JSON-schema constraint (the engine says if it can)."""
    rf = get_object(body, "response_format")
    if rf is None:
        return
    kind = rf.get("type")
    if kind == "text":
        return
    if d.get("regex") or d.get("ebnf") or d.get("json_schema"):
        raise ApiError(400, "give response_format or one of regex / json_schema / ebnf, not both",
                       param="response_format")
    if kind == "json_object":
        d["json_schema"] = {"type": "object"}
    elif kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        d["json_schema"] = json.dumps(schema)
    elif kind == "structural_tag":  # SGLang's: the whole object is the tag (the grammar engine checks it)
        d["structural_tag"] = json.dumps(rf)
    else:
        raise ApiError(400, f"response_format.type must be text, json_object, json_schema or structural_tag, "
                            f"got {kind!r}", param="response_format")



# -- chat with tools -----------------------------------------------------------------------
def _choice_gens(ctx: ServerContext, plan: Plan, arrival: float, tok: ServerTokenizer) -> list[AsyncIterator[Piece]]:
    assert plan.tools is not None
    return [run_choice(ctx, plan.tools, job, arrival, tok) for job in plan.jobs]


async def _collect_tools(ctx: ServerContext, plan: Plan, arrival: float, tok: ServerTokenizer) -> web.Response:
    results = await asyncio.gather(*(collect_choice(g) for g in _choice_gens(ctx, plan, arrival, tok)))
    choices = []
    for i, r in enumerate(results):
        message: dict[str, Any] = {"role": "assistant", "content": r.content or (None if r.calls else "")}
        if r.calls:
            message["tool_calls"] = [c.to_openai() for c in r.calls]
        choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": r.reason,
                        "matched_stop": r.matched})
    return json_response({"id": plan.rid, "object": "chat.completion", "created": int(time.time()),
                          "model": ctx.model_name, "choices": choices, "system_fingerprint": None,
                          "usage": usage(plan.prompt_lens[0], [r.metas for r in results])})


async def _stream_tools(request: web.Request, ctx: ServerContext, plan: Plan, arrival: float,
                        tok: ServerTokenizer) -> web.StreamResponse:
    """OpenAI's deltas: content text; per call a first delta with index, id, type, name and empty
    arguments, then argument fragments; finish_reason tool_calls."""
    created = int(time.time())
    metas: list[list[dict[str, Any]]] = [[] for _ in plan.jobs]

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        c: dict[str, Any] = {"id": plan.rid, "object": "chat.completion.chunk", "created": created,
                             "model": ctx.model_name, "system_fingerprint": None, "choices": choices}
        if plan.include_usage:
            c["usage"] = None
        return c

    stream = merged(_choice_gens(ctx, plan, arrival, tok))
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        first = await next_piece(stream)  # errors before any output are plain HTTP errors
        async with event_stream(request) as resp:
            for i in range(len(plan.jobs)):
                await send_event(resp, chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]))
            item = first
            try:
                while item is not None:
                    i, p = item
                    delta: dict[str, Any] = {}
                    reason = None
                    if p.kind == "content":
                        delta = {"content": p.text}
                    elif p.kind == "call":
                        delta = {"tool_calls": [{"index": p.call, "id": p.call_id, "type": "function",
                                                 "function": {"name": p.text, "arguments": ""}}]}
                    elif p.kind == "args":
                        delta = {"tool_calls": [{"index": p.call, "function": {"arguments": p.text}}]}
                    else:
                        reason, metas[i] = p.reason, p.metas
                    choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
                    if p.kind == "end":
                        choice["matched_stop"] = p.matched
                    await send_event(resp, chunk([choice]))
                    item = await next_piece(stream)
            except ApiError as e:
                await send_event(resp, _constraint_error(plan.constraint_param, e).body())
            else:
                if plan.include_usage:
                    final = chunk([])
                    final["usage"] = usage(plan.prompt_lens[0], metas)
                    await send_event(resp, final)
    return resp


async def next_piece(it: AsyncIterator[tuple[int, Piece]]) -> tuple[int, Piece] | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None
