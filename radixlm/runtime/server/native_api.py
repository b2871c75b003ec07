"""SGLang's native runtime protocol: /generate and the server-management routes."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from radixlm.runtime.intake import PromptRequest, Submission
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.request import ProgramTag
from radixlm.runtime.server.context import CONTEXT, ServerContext
from radixlm.runtime.server.dispatcher import Event, Job, check_job_count, expand_jobs, next_event
from radixlm.runtime.server.errors import ApiError
from radixlm.runtime.server.fields import (
    check_keys,
    get_bool,
    get_float,
    get_int,
    get_str,
    is_token_list,
    show_number,
)
from radixlm.runtime.server.payload import (
    check_response_cost,
    check_stop_bytes,
    finite_logprob,
    json_response,
    read_json_object,
)
from radixlm.runtime.server.prefix_tokenizer import PrefixTokenizer
from radixlm.runtime.server.sse import event_stream, send_event
from radixlm.runtime.server.tokenizer import ServerTokenizer
from radixlm.runtime.sessions import SessionError, SessionParams

log = logging.getLogger("radixlm.server")

GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "stream", "session_params", "plain_text_spans",
                   "program")
# SGLang's GenerateReqInput fields for features this server lacks: accepted only when empty (null,
# false, 0, [], {}, ""), so its clients work unchanged; set, they are a 400 naming the field.
GENERATE_UNSUPPORTED = (
    "image_data", "audio_data", "video_data", "input_embeds", "lora_path", "lora_id", "custom_logit_processor",
    "return_hidden_states", "token_ids_logprob", "modalities", "mm_hashes", "mm_content_hashes",
    "use_audio_in_video", "video_config", "watermark", "return_sampling_mask", "sampling_logprobs_mode",
    "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
    "return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "positional_embed_overrides",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "background", "require_reasoning", "max_thinking_tokens",
    "extra_key", "cache_salt", "return_bytes", "return_entropy", "return_prompt_token_ids", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "kv_hints",
)
# SGLang fields that only label a request (metrics, logs, tracing, routing between replicas): accepted and
# without effect here.
GENERATE_IGNORED = ("log_metrics", "session_id", "conversation_id", "routing_key", "priority", "no_logs",
                    "custom_labels", "external_trace_header", "received_time")
TOKENIZE_FIELDS = ("prompt", "add_special_tokens", "model")  # SGLang's /tokenize request
DETOKENIZE_FIELDS = ("tokens", "skip_special_tokens", "model")  # SGLang's /detokenize request
HEALTH_GENERATE_TIMEOUT = 30.0
# a /generate body whose prompts are at most this many characters (or token ids) in all is parsed
# on the event loop (tokenizing that much is brief: docs/machines.md); a longer one in a thread, so
# that it does not stall other requests. A thread costs the body two turns of the loop,
# and its tokenizing took turns with the loop for the GIL (docs/server.md, "Processes").
INLINE_PARSE_SIZE = 1024


@dataclass
class GenerateSpec:
    jobs: list[Job]
    single: bool  # one prompt, n == 1: the response is an object, not a list
    stream: bool
    text_in_logprobs: bool
    stream_intervals: list[int]  # per job: send a stream chunk every this many output tokens


def routes() -> list[web.RouteDef]:
    return [
        web.post("/generate", generate),
        web.get("/get_model_info", get_model_info),
        web.get("/model_info", get_model_info),  # SGLang's current name
        web.get("/get_server_info", get_server_info),
        web.get("/server_info", get_server_info),  # SGLang's current name; its frontend calls this one
        web.get("/health", health),
        web.get("/health_generate", health_generate, allow_head=False),  # HEAD must not act: 405
        web.post("/flush_cache", flush_cache),
        web.get("/flush_cache", flush_cache, allow_head=False),
        web.post("/abort_request", abort_request),
        web.post("/concate_and_append_request", concate_and_append_request),
        web.post("/open_session", open_session),
        web.post("/close_session", close_session),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
        web.get("/debug/check", debug_check),
    ]


# -- /generate ---------------------------------------------------------------------------
async def generate(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    arrival = time.perf_counter()
    body = await read_json_object(request, ctx.settings.max_request_bytes)
    tok, dispatcher = ctx.require_ready()
    spec = await parse_generate_soon(body, tok, ctx.settings.max_top_logprobs, ctx.settings.max_queued_requests)
    check_response_cost(spec.jobs, ctx.settings.max_response_bytes)
    check_stop_bytes(spec.jobs, ctx.settings.max_stop_bytes, "sampling_params")
    with ctx.busy():
        try:
            async with dispatcher.run(spec.jobs, arrival, stream=spec.stream) as events:
                if spec.stream:
                    return await _stream(request, spec, events, tok)
                return await _collect(spec, events, tok)
        except ApiError as e:
            if e.status == 400 and e.param is None and "constrained" in e.message:
                e.param = "sampling_params"  # the engine refused a regex / json_schema / ebnf
            raise


async def parse_generate_soon(body: dict[str, Any], tok: ServerTokenizer, max_top: int, max_jobs: int,
                              program: ProgramTag | None = None, prefix: PrefixTokenizer | None = None) -> GenerateSpec:
    """`parse_generate`, on the event loop for a short body, in a thread for a long one
    (INLINE_PARSE_SIZE; what ``prefix`` tokenized before does not count)."""
    if _prompt_size(body, prefix) <= INLINE_PARSE_SIZE:
        return parse_generate(body, tok, max_top, max_jobs, program, prefix)
    return await asyncio.to_thread(parse_generate, body, tok, max_top, max_jobs, program, prefix)


def _prompt_size(body: dict[str, Any], prefix: PrefixTokenizer | None = None) -> int:
    """The characters of a body's text prompts (past what ``prefix`` tokenized before), or the
    ids of its token prompts (a malformed body is sized too: parse_generate says what is wrong
    with it)."""
    prompts = body.get("text") if body.get("text") is not None else body.get("input_ids")
    fresh = prefix.fresh_chars if prefix is not None else len
    if isinstance(prompts, str):
        return fresh(prompts)
    if isinstance(prompts, list):
        return sum(fresh(p) if isinstance(p, str) else len(p) if isinstance(p, list) else 1 for p in prompts)
    return 0


def parse_generate(body: dict[str, Any], tok: ServerTokenizer, max_top: int, max_jobs: int,
                   program: ProgramTag | None = None, prefix: PrefixTokenizer | None = None) -> GenerateSpec:
    """Validate a /generate body into engine jobs; every problem is a 400 naming its field.
    ``program``: the tag of a program the server runs (then the body has no ``program`` field),
    ``prefix``: its PrefixTokenizer."""
    check_keys(body, GENERATE_FIELDS, GENERATE_IGNORED, GENERATE_UNSUPPORTED)
    for key in ("text", "input_ids"):
        if isinstance(body.get(key), list) and body[key] and isinstance(body[key][0], (str, list)):
            check_job_count(len(body[key]), max_jobs, "prompts")
    prompts, single = _prompts(body, tok, prefix)
    b = len(prompts)
    params = _per_prompt(body, "sampling_params", b)
    logprob = _per_prompt(body, "return_logprob", b)
    start = _per_prompt(body, "logprob_start_len", b)
    top = _per_prompt(body, "top_logprobs_num", b)
    rids = _rids(body, b)
    if program is None:
        program = parse_program_tag(body.get("program"))
    specs: list[PromptRequest] = []
    for i, ids in enumerate(prompts):
        try:
            sp = SamplingParams.from_dict(params[i])
        except ValueError as e:
            raise ApiError(400, f"invalid sampling_params: {e}", param="sampling_params") from None
        tok.check_token_params(sp, f"sampling_params[{i}]." if isinstance(body.get("sampling_params"), list)
                               else "sampling_params.")
        specs.append(PromptRequest(
            rid=rids[i],
            prompt_ids=ids,
            params=sp,
            return_logprob=get_bool({"return_logprob": logprob[i]}, "return_logprob"),
            logprob_start_len=get_int({"logprob_start_len": start[i]}, "logprob_start_len", -1, lo=-1),
            top_logprobs_num=get_int({"top_logprobs_num": top[i]}, "top_logprobs_num", 0, lo=0, hi=max_top),
            program=program,
        ))
    session = _session_params(body)
    if session is None:  # a session turn's prompt grows by its history: the engine checks it
        check_logprob_start(specs)
    try:
        jobs = expand_jobs(specs, max_jobs, session)
    except ValueError as e:  # a session turn of several prompts or n > 1
        raise ApiError(400, str(e), param="session_params") from None
    return GenerateSpec(
        jobs=jobs,
        single=single and len(jobs) == 1,
        stream=get_bool(body, "stream"),
        text_in_logprobs=get_bool(body, "return_text_in_logprobs"),
        stream_intervals=[job.request.params.stream_interval for job in jobs],
    )


def check_logprob_start(specs: list[PromptRequest]) -> None:
    """logprob_start_len is -1 (output logprobs only) or a position inside its prompt."""
    for p in specs:
        if p.logprob_start_len >= len(p.prompt_ids):
            raise ApiError(400, f"logprob_start_len {p.logprob_start_len} is past the prompt's {len(p.prompt_ids)} "
                                "tokens; give -1 or a position inside the prompt", param="logprob_start_len")


def _prompts(body: dict[str, Any], tok: ServerTokenizer,
             prefix: PrefixTokenizer | None = None) -> tuple[list[list[int]], bool]:
    text, ids, spans = body.get("text"), body.get("input_ids"), body.get("plain_text_spans")
    if (text is None) == (ids is None):
        raise ApiError(400, "give exactly one of text or input_ids", param="text" if text is not None else None)
    if spans is not None and not isinstance(text, str):
        raise ApiError(400, "plain_text_spans goes with a single string text", param="plain_text_spans")
    if text is not None:
        if isinstance(text, str):
            return [tok.encode_text(text, "text", spans, prefix)], True
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [tok.encode_text(t, f"text[{i}]", prefix=prefix) for i, t in enumerate(text)], False
        raise ApiError(400, "text must be a string or a non-empty list of strings", param="text")
    if ids == []:
        raise ApiError(400, "input_ids is empty; give at least one token", param="input_ids")
    if is_token_list(ids):
        tok.check_prompt(ids, "input_ids")
        return [list(ids)], True
    if isinstance(ids, list) and all(is_token_list(x) for x in ids):
        for i, x in enumerate(ids):
            tok.check_prompt(x, f"input_ids[{i}]")
        return [list(x) for x in ids], False
    raise ApiError(400, "input_ids must be a list of integer token ids, or a list of such lists", param="input_ids")


PROGRAM_TAG_FIELDS = ("id", "group", "hold")


def parse_program_tag(v: Any) -> ProgramTag | None:
    """radixlm's ``program`` field {id, group, hold}: which program the request belongs to; null: none."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) - set(PROGRAM_TAG_FIELDS):
        raise ApiError(400, f"program must be an object with the fields {', '.join(PROGRAM_TAG_FIELDS)} "
                            "(id required)", param="program")
    try:
        return ProgramTag(v.get("id", ""), v.get("group"), v.get("hold", 0))
    except ValueError as e:
        raise ApiError(400, f"invalid program: {e}", param="program") from None


def _session_params(body: dict[str, Any]) -> SessionParams | None:
    """SGLang's session_params {id, rid, offset, replace, drop_previous_output}; null or {}: none."""
    v = body.get("session_params")
    if v is None or v == {}:
        return None
    try:
        return SessionParams.from_dict(v)
    except SessionError as e:
        raise ApiError(400, str(e), param="session_params") from None


def _per_prompt(body: dict[str, Any], key: str, b: int) -> list[Any]:
    """A field given once for all prompts, or as a list with one entry per prompt."""
    v = body.get(key)
    values = v if isinstance(v, list) else [v] * b
    if len(values) != b:
        raise ApiError(400, f"{key} has {len(values)} entries for {b} prompts; give one, or one per prompt", key)
    return values


def _rids(body: dict[str, Any], b: int) -> list[str]:
    rid = body.get("rid")
    if rid is None:
        return [uuid.uuid4().hex for _ in range(b)]
    rids = [rid] if isinstance(rid, str) else rid
    if not isinstance(rids, list) or not all(isinstance(r, str) and r for r in rids):
        raise ApiError(400, "rid must be a non-empty string, or a list of them for a batch", param="rid")
    if len(rids) != b:
        raise ApiError(400, f"rid has {len(rids)} ids for {b} prompts; give one per prompt", param="rid")
    return rids


async def _collect(spec: GenerateSpec, events: Any, tok: ServerTokenizer) -> web.Response:
    n = len(spec.jobs)
    texts, ids = [""] * n, [list[int]() for _ in range(n)]
    metas: list[dict[str, Any]] = [{} for _ in range(n)]
    async for ev in events:
        if ev.error is not None:
            raise ev.error
        out = ev.output
        assert out is not None  # an event holds an output or an error
        texts[ev.index] += out.text_delta
        out.apply_ids(ids[ev.index])
        if out.finished:
            metas[ev.index] = out.meta
    results = [
        {"text": texts[i], "output_ids": ids[i], "meta_info": native_meta(metas[i], tok, spec.text_in_logprobs)}
        for i in range(n)
    ]
    return json_response(results[0] if spec.single else results)


async def _stream(request: web.Request, spec: GenerateSpec, events: Any, tok: ServerTokenizer) -> web.StreamResponse:
    """SGLang's stream: each chunk holds the text and output ids so far (cumulative) and, with
    return_logprob, the logprobs of the tokens new since the previous chunk (docs/server.md, "Streaming")."""
    n = len(spec.jobs)
    texts, ids = [""] * n, [list[int]() for _ in range(n)]
    lps: list[list[Any]] = [[] for _ in range(n)]
    tops: list[list[Any]] = [[] for _ in range(n)]
    sent = [0] * n  # output tokens each job had at its last chunk (stream_interval)
    lp_sent = [0] * n  # output logprobs each job's client holds (a re-tokenized tail is sent again)
    it = events.__aiter__()
    first: Event = await it.__anext__()
    if first.error is not None:
        raise first.error  # nothing sent yet: a plain HTTP error
    async with event_stream(request) as resp:
        ev: Event | None = first
        while ev is not None:
            if ev.error is not None:
                await send_event(resp, ev.error.body())
                break
            i, out = ev.index, ev.output
            assert out is not None  # an event holds an output or an error
            texts[i] += out.text_delta
            out.apply_ids(ids[i])
            if out.replace_from is not None:  # jump-forward re-tokenized a tail: its logprobs go too
                del lps[i][out.replace_from :], tops[i][out.replace_from :]
                lp_sent[i] = min(lp_sent[i], out.replace_from)
            if out.finished and "output_token_logprobs" in out.meta:  # the totals hold every logprob
                lps[i] = list(out.meta["output_token_logprobs"])
                tops[i] = list(out.meta.get("output_top_logprobs", ()))
            elif not out.finished:
                lps[i].extend(out.meta.get("output_token_logprobs", ()))
                tops[i].extend(out.meta.get("output_top_logprobs", ()))
            # as SGLang: the first tokens at once (time to first token), then every stream_interval tokens
            due = sent[i] == 0 or len(ids[i]) - sent[i] >= spec.stream_intervals[i]
            if out.finished or (due and (out.text_delta or out.token_ids_delta)):
                req = spec.jobs[i].request
                if out.finished:
                    totals = {k: v for k, v in out.meta.items() if k not in STREAMED_LOGPROBS}
                    meta = native_meta(totals, tok, spec.text_in_logprobs)
                else:
                    meta = {"id": req.rid, "finish_reason": None, "prompt_tokens": len(req.prompt_ids),
                            "completion_tokens": len(ids[i])}
                if req.return_logprob:
                    meta.update(_new_logprobs(lps[i], tops[i] if req.top_logprobs_num else None, lp_sent[i],
                                              tok, spec.text_in_logprobs))
                    lp_sent[i] = len(lps[i])
                sent[i] = len(ids[i])
                chunk: dict[str, Any] = {"text": texts[i], "output_ids": ids[i], "meta_info": meta}
                if not spec.single:
                    chunk["index"] = i
                await send_event(resp, chunk)
            ev = await next_event(it)
    return resp


# the meta_info lists a stream chunk holds from the client's position on, not from the start
STREAMED_LOGPROBS = ("output_token_logprobs", "output_top_logprobs")


def _new_logprobs(lps: list[Any], tops: list[Any] | None, start: int, tok: ServerTokenizer,
                  text: bool) -> dict[str, Any]:
    """A stream chunk's output logprobs: the entries from ``start`` on (the tokens new since the
    previous chunk), and how many the output has in all (SGLang's output_token_logprobs_length)."""
    meta: dict[str, Any] = {"output_token_logprobs": native_logprobs(lps[start:], tok, text),
                            "output_token_logprobs_length": len(lps)}
    if tops is not None:
        meta["output_top_logprobs"] = [native_logprobs(step, tok, text) for step in tops[start:]]
    return meta


def native_meta(meta: dict[str, Any], tok: ServerTokenizer, text: bool) -> dict[str, Any]:
    """The engine's final meta in SGLang's shape: logprobs as [logprob, token_id, text|null]."""
    out = dict(meta)
    reason = dict(out.get("finish_reason") or {})
    if reason.get("type") == "length":
        reason["length"] = out.get("completion_tokens", 0)
    out["finish_reason"] = reason or None
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if key in out:
            out[key] = native_logprobs(out[key], tok, text)
    if "output_token_logprobs" in out:
        out["output_token_logprobs_length"] = len(out["output_token_logprobs"])
    if "output_top_logprobs" in out:
        out["output_top_logprobs"] = [native_logprobs(step, tok, text) for step in out["output_top_logprobs"]]
    return out


def native_logprobs(entries: Any, tok: ServerTokenizer, text: bool) -> list[list[Any]]:
    return [[finite_logprob(lp), tid, tok.token_text(tid) if text else None] for lp, tid in entries]


# -- management routes -------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    """200 once the model is loaded and warmed up; 503 while starting, draining, or if the engine died."""
    ctx = request.app[CONTEXT]
    if ctx.unavailable() is not None:
        ctx.require_ready()  # raises the 503, with Retry-After while the engine starts or restarts
    return json_response({"status": "ok"})


async def health_generate(request: web.Request) -> web.Response:
    """Healthy only if the engine completes a one-token generation."""
    ctx = request.app[CONTEXT]
    arrival = time.perf_counter()
    tok, dispatcher = ctx.require_ready()
    ids = tok.encode_text("ping", "text")
    params = SamplingParams(max_new_tokens=1, temperature=0)
    rid = f"health-{uuid.uuid4().hex}"
    job = Job(0, Submission(rid, ids, params), rid)

    async def one_token() -> None:
        async with dispatcher.run([job], arrival, admit=False, stream=False) as events:
            async for ev in events:
                if ev.error is not None:
                    raise ApiError(503, f"the engine failed a test generation: {ev.error.message}")

    with ctx.busy():
        try:
            await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT)
        except TimeoutError:
            raise ApiError(503, f"the engine did not finish a one-token generation within "
                                f"{HEALTH_GENERATE_TIMEOUT:.0f} s") from None
    return json_response({"status": "ok"})


async def get_model_info(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    ctx.require_engine()
    info, tok = ctx.info, ctx.tokenizer
    return json_response({
        "model_path": info["model_path"],
        "tokenizer_path": info["tokenizer_path"],
        "model_name": info["model_name"],
        "served_model_name": ctx.model_name,
        "is_generation": True,
        "context_length": info["context_length"],
        "vocab_size": info["vocab_size"],
        "eos_token_ids": info["eos_token_ids"],
        "chat_template": tok.chat_template_name if tok is not None else None,
        "dtype": info.get("dtype"),
        # the tokenizer's facts, so a remote client formats prompts as the server would
        "chat_template_jinja": tok.chat_template_text if tok is not None else None,
        "special_tokens": tok.special_tokens() if tok is not None else None,
        "role_markers": tok.role_markers() if tok is not None else None,
    })


async def get_server_info(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    client = ctx.require_engine()
    stats = await ctx.stats()
    settings = dataclasses.asdict(ctx.settings)
    settings["api_key"] = "<set>" if settings["api_key"] else None
    return json_response({
        "version": _version(),
        "phase": ctx.phase.value,
        "uptime_s": time.time() - ctx.started_at,
        "server_settings": settings,
        "engine_config": dataclasses.asdict(ctx.engine_config),
        "engine": ctx.info,
        "server_pid": os.getpid(),
        "engine_pid": client.pid,
        "engine_restarts": ctx.num_restarts,
        "stats": stats,
        "requests_in_flight": ctx.dispatcher.num_active if ctx.dispatcher else 0,
        "http_handlers_in_flight": ctx.num_busy,
    })


async def flush_cache(request: web.Request) -> web.Response:
    """Drop every cached prefix; refused (400, as SGLang) while requests are in flight."""
    ctx = request.app[CONTEXT]
    client = ctx.require_engine()
    reply = await client.query("flush_cache")
    if not reply.get("flushed"):
        raise ApiError(400, "cache not flushed: requests are in flight; retry when the server is idle")
    return json_response({"flushed": True, "message": "Cache flushed."})


async def debug_check(request: web.Request) -> web.Response:
    """KV accounting and the radix cache's integrity check, run in the engine between steps
    (EngineCore.integrity_report); served only with --debug-routes true, as it walks the whole
    cache. A broken invariant answers 200 with ok: false and the errors, not a 500."""
    ctx = request.app[CONTEXT]
    if not ctx.settings.debug_routes:
        raise ApiError(404, "/debug/check is off: start the server with --debug-routes true", code="not_found")
    client = ctx.require_engine()
    report = await client.query("check")
    report["requests_in_flight"] = ctx.dispatcher.num_active if ctx.dispatcher else 0
    return json_response(report)


async def abort_request(request: web.Request) -> web.Response:
    """Abort one request by its rid (all its n copies), or every request with abort_all."""
    ctx = request.app[CONTEXT]
    body = await read_json_object(request, ctx.settings.max_request_bytes)
    check_keys(body, ("rid", "abort_all"))
    ctx.require_engine()
    abort_all = get_bool(body, "abort_all")
    rid = get_str(body, "rid")
    if rid is None and not abort_all:
        raise ApiError(400, "give rid (the request to abort) or abort_all: true", param="rid")
    dispatcher = ctx.dispatcher
    count = await dispatcher.abort(None if abort_all else rid) if dispatcher is not None else 0
    return json_response({"aborted": count})


async def concate_and_append_request(request: web.Request) -> web.Response:
    """SGLang's parallel-encoding join (``fork(...).join("concate_and_append")`` in its frontend):
    {src_rids: [str], dst_rid: str} -> {success: true}. The frontend has already appended the forks'
    texts to the destination state, and its next /generate sends that whole text: the radix cache
    serves the prefix it shares with the first fork (each fork committed its text just before), the
    rest is prefilled, so the output is that of the same text sent unforked. The rids are the
    frontend's own state ids, never sent to /generate, so there is nothing to look up here."""
    ctx = request.app[CONTEXT]
    body = await read_json_object(request, ctx.settings.max_request_bytes)
    check_keys(body, ("src_rids", "dst_rid"))
    src, dst = body.get("src_rids"), body.get("dst_rid")
    if not (isinstance(src, list) and src and all(isinstance(r, str) and r for r in src)):
        what = "is required" if src is None else "must be a non-empty list of non-empty strings"
        raise ApiError(400, f"src_rids {what}: the ids of the forked states to join", param="src_rids")
    if not (isinstance(dst, str) and dst):
        what = "is required" if dst is None else "must be a non-empty string"
        raise ApiError(400, f"dst_rid {what}: the id of the state the forks are joined into", param="dst_rid")
    if dst in src:
        raise ApiError(400, f"dst_rid {dst!r} is also in src_rids; a state cannot be joined into itself",
                       param="dst_rid")
    ctx.require_engine()
    return json_response({"success": True, "message": f"joined {len(src)} forks into {dst!r}: its next /generate "
                                                      "(their texts appended) reuses the cached prefix"})


# -- tokenizer routes (SGLang's /tokenize and /detokenize) ------------------------------------
async def tokenize(request: web.Request) -> web.Response:
    """{prompt: str | [str], add_special_tokens?: bool = true, model?} -> {tokens, count, max_model_len}
    (a list of each for a list of prompts). Prompts are not checked against the context length."""
    ctx = request.app[CONTEXT]
    body = await read_json_object(request, ctx.settings.max_request_bytes)
    check_keys(body, TOKENIZE_FIELDS)
    get_str(body, "model")
    special = get_bool(body, "add_special_tokens", True)
    prompt = body.get("prompt")
    tok = _require_tokenizer(ctx)
    if isinstance(prompt, str):
        ids = await asyncio.to_thread(tok.encode_plain, prompt, special)  # off the event loop
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": tok.context_length})
    if not (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        what = "is required" if prompt is None else "must be a string or a non-empty list of strings"
        raise ApiError(400, f"prompt {what}", param="prompt")
    ids_list = await asyncio.to_thread(lambda: [tok.encode_plain(p, special, f"prompt[{i}]")
                                                for i, p in enumerate(prompt)])
    return json_response({"tokens": ids_list, "count": [len(x) for x in ids_list],
                          "max_model_len": tok.context_length})


async def detokenize(request: web.Request) -> web.Response:
    """{tokens: [int] | [[int]], skip_special_tokens?: bool = true, model?} -> {text} (a list for lists)."""
    ctx = request.app[CONTEXT]
    body = await read_json_object(request, ctx.settings.max_request_bytes)
    check_keys(body, DETOKENIZE_FIELDS)
    get_str(body, "model")
    skip = get_bool(body, "skip_special_tokens", True)
    tokens = body.get("tokens")
    tok = _require_tokenizer(ctx)
    if is_token_list(tokens):
        return json_response({"text": tok.decode_plain(tokens, skip, "tokens")})
    if isinstance(tokens, list) and all(is_token_list(x) for x in tokens):
        return json_response({"text": [tok.decode_plain(x, skip, f"tokens[{i}]") for i, x in enumerate(tokens)]})
    what = "is required" if tokens is None else "must be a list of integer token ids, or a list of such lists"
    raise ApiError(400, f"tokens {what}", param="tokens")


def _require_tokenizer(ctx: ServerContext) -> ServerTokenizer:
    ctx.require_engine()
    if ctx.tokenizer is None:
        raise ApiError(503, "the server is starting: the tokenizer is still loading", code="unavailable")
    return ctx.tokenizer


# -- sessions (docs/sessions.md) ----------------------------------------------------------
async def open_session(request: web.Request) -> web.Response:
    """Open a session; answers its id as a JSON string (as SGLang). ``capacity`` is in tokens
    (SGLang's ``capacity_of_str_len`` is read as the same cap); ``ttl`` in seconds."""
    ctx = request.app[CONTEXT]
    body = await read_json_object(request, ctx.settings.max_request_bytes)
    check_keys(body, ("session_id", "capacity", "capacity_of_str_len", "ttl"))
    if body.get("capacity") is not None and body.get("capacity_of_str_len") is not None:
        raise ApiError(400, "give capacity or capacity_of_str_len, not both", param="capacity")
    key = "capacity" if body.get("capacity") is not None else "capacity_of_str_len"
    args = {"session_id": get_str(body, "session_id"), "capacity": get_int(body, key, None, lo=1),
            "ttl": get_float(body, "ttl")}
    if args["ttl"] is not None and not 0 < args["ttl"] <= ctx.settings.max_session_ttl:
        raise ApiError(400, f"ttl must be > 0 and <= {ctx.settings.max_session_ttl:g} seconds (--max-session-ttl), "
                            f"got {show_number(args['ttl'])}", param="ttl")
    async with ctx.session_lock:  # the count and the open are one step
        await check_session_room(ctx)
        reply = await _session_query(ctx, "open_session", args, "session_id")
    return json_response(reply["session_id"])


async def check_session_room(ctx: ServerContext) -> None:
    """429 when --max-sessions sessions are open already."""
    stats = await ctx.require_engine().query("stats")
    open_now = int(stats.get("sessions_open", 0))
    if open_now >= ctx.settings.max_sessions:
        raise ApiError(429, f"{open_now} sessions are open, the server's limit (--max-sessions); close one "
                            "(/close_session) or wait for one to expire", code="too_many_sessions")


async def close_session(request: web.Request) -> web.Response:
    """Close a session and unpin its KV; 404 if it is not open."""
    ctx = request.app[CONTEXT]
    body = await read_json_object(request, ctx.settings.max_request_bytes)
    check_keys(body, ("session_id",))
    sid = get_str(body, "session_id")
    if sid is None:
        raise ApiError(400, "session_id is required", param="session_id")
    await _session_query(ctx, "close_session", {"session_id": sid}, "session_id")
    return json_response({"session_id": sid, "closed": True})


async def _session_query(ctx: ServerContext, kind: str, args: dict[str, Any], param: str) -> dict[str, Any]:
    client = ctx.require_engine()
    reply = await client.query(kind, args=args)
    if "error" in reply:
        raise ApiError(reply["status"], reply["error"], param=param)
    return reply


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("radixlm")
    except PackageNotFoundError:
        return "unknown"
