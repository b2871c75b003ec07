"""The OpenAPI 3.1 description of every HTTP route, served at GET /openapi.json.

Written by hand as plain data so it reads as the API's reference (the sampling parameters are generated
from their declaration in SamplingParams); tests/runtime/server/test_openapi.py
keeps it true (every registered route is described and every described path is registered, request
fields match what the handlers accept, real responses validate against the response schemas).
Limits that are server settings (top logprobs, body size, API key) are filled in per server.
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.sampling_params import (
    ALIASES,
    DEFAULTS,
    EMPTY_ONLY,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_STOP_STRINGS,
    PARAMS,
    Param,
)
from radixlm.runtime.scheduler.request import MAX_PROGRAM_GROUP, MAX_PROGRAM_HOLD, MAX_PROGRAM_ID
from radixlm.runtime.server.native_api import GENERATE_IGNORED, GENERATE_UNSUPPORTED
from radixlm.runtime.server.openai_api import IGNORED_FIELDS, MAX_N, SAMPLING_FIELDS, UNSUPPORTED_FIELDS
from radixlm.runtime.server.settings import ServerSettings
from radixlm.runtime.stop import MAX_STOP_REGEXES
from radixlm.runtime.tool_calls import MAX_TOOLS

Schema = dict[str, Any]


# -- schema helpers ---------------------------------------------------------------------------
def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(props: dict[str, Schema], required: tuple[str, ...] = (), closed: bool = False,
         description: str | None = None) -> Schema:
    """An object schema; ``closed``: unknown fields are refused (the handlers answer 400 naming them)."""
    s: Schema = {"type": "object", "properties": props}
    if required:
        s["required"] = list(required)
    if closed:
        s["additionalProperties"] = False
    if description:
        s["description"] = description
    return s


def _opt(s: Schema) -> Schema:
    """A request field that may also be null (null means: not given, the default applies)."""
    return {"anyOf": [s, {"type": "null"}]}


def _one_or_list(s: Schema, what: str) -> Schema:
    return {"anyOf": [s, {"type": "array", "items": s}],
            "description": f"{what}: one value for every prompt, or a list with one per prompt"}


def _empty_only(what: str) -> Schema:
    return {"enum": [None, False, "", [], {}],
            "description": f"{what}: accepted only when empty (SGLang/OpenAI clients send it); else 400"}


INT = {"type": "integer"}
NUM = {"type": "number"}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
NULL_STR = {"type": ["string", "null"]}
TOKEN_ID = {"type": "integer", "minimum": 0, "description": "a token id in [0, vocab_size)"}
TOKEN_IDS = {"type": "array", "items": TOKEN_ID, "minItems": 1}
ANY_JSON: Schema = {}


# -- request bodies ---------------------------------------------------------------------------
def _sampling_params() -> Schema:
    """radixlm.runtime.sampling_params.SamplingParams, SGLang's native sampling_params: from its declaration."""
    props = {name: _opt(sampling_schema(p, DEFAULTS[name])) for name, p in PARAMS.items()}
    for alias, name in ALIASES.items():  # SGLang's spellings
        props[alias] = _opt({**sampling_schema(PARAMS[name]), "description": f"SGLang's name for {name}"})
    for name, (empty, why) in EMPTY_ONLY.items():
        props[name] = {"enum": list(empty), "description": f"SGLang's; accepted only as {empty[-1]!r} or null: {why}"}
    return _obj(props, closed=True, description=(
        "Unknown keys are a 400. At most one of regex, json_schema, ebnf, choices, structural_tag "
        "(SGLang's, as JSON text; not with the outlines backend). A constraint the grammar engine cannot "
        "compile is a 400 naming it."))


def sampling_schema(p: Param, default: Any = None, openai: bool = False) -> Schema:
    """The JSON schema of one sampling parameter from its declaration; ``openai``: as the OpenAI
    routes take it (its OpenAI bounds, lists only, no defaults: the routes have their own)."""
    s: Schema
    if p.kind in ("int", "float"):
        bounds: Schema = {}
        if p.lo is not None:
            bounds["exclusiveMinimum" if p.lo_open else "minimum"] = p.lo
        hi = p.openai_hi if openai and p.openai_hi is not None else p.hi
        if hi is not None:
            bounds["maximum"] = hi
        s = {"type": "integer" if p.kind == "int" else "number"}
        s.update({"anyOf": [{"const": p.off}, bounds]} if p.off is not None else bounds)
    elif p.kind == "stop":
        one = {"type": "string", "minLength": 1}
        many = {"type": "array", "items": one, "maxItems": MAX_STOP_STRINGS}
        s = {"anyOf": [one, many]}
    elif p.kind == "stop_regex":
        one = {"type": "string", "minLength": 1}
        s = {"anyOf": [one, {"type": "array", "items": one, "maxItems": MAX_STOP_REGEXES}]}
    elif p.kind == "logit_bias":
        most = p.openai_hi if openai and p.openai_hi is not None else MAX_LOGIT_BIAS_VALUE
        bias = {"type": "number", "minimum": -most, "maximum": most}
        s = {"type": "object", "patternProperties": {"^[0-9]+$": bias}, "additionalProperties": False,
             "maxProperties": MAX_LOGIT_BIAS}
    elif p.kind == "token_ids":
        many = {"type": "array", "items": TOKEN_ID}
        s = many if openai else {"anyOf": [TOKEN_ID, many]}
    elif p.kind == "schema":
        s = {"type": ["string", "object"] if openai else ["string", "object", "boolean"]}
    elif p.kind == "choices":
        s = {"type": "array", "items": STR, "minItems": 1}
    else:
        s = dict({"bool": BOOL, "seed": INT, "text": STR}[p.kind])
    if default is not None and not openai and not isinstance(default, tuple):
        s["default"] = default
    s["description"] = p.help
    return s


def _session_params() -> Schema:
    return _obj({
        "id": {"type": "string", "minLength": 1, "description": "the id /open_session returned"},
        "rid": _opt({"type": "string", "minLength": 1, "description": "the turn to continue (default: newest)"}),
        "offset": _opt({"type": "integer", "minimum": 0, "description": "keep only this many history tokens"}),
        "replace": _opt(BOOL),
        "drop_previous_output": _opt(BOOL),
    }, required=("id",), closed=True, description="a turn of a session (docs/sessions.md)")


def _generate_request(max_top: int, max_jobs: int) -> Schema:
    text = {"anyOf": [STR, {"type": "array", "items": STR, "minItems": 1}],
            "description": "the prompt, or a batch of prompts"}
    ids = {"anyOf": [TOKEN_IDS, {"type": "array", "items": TOKEN_IDS, "minItems": 1}],
           "description": "the prompt as token ids, or a batch of them"}
    s = _obj({
        "text": text,
        "input_ids": ids,
        "sampling_params": _opt(_one_or_list(_opt(_ref("SamplingParams")), "sampling parameters")),
        "rid": _opt({"anyOf": [{"type": "string", "minLength": 1},
                               {"type": "array", "items": {"type": "string", "minLength": 1}}],
                     "description": "request id (one per prompt for a batch); 400 if one is in flight"}),
        "return_logprob": _opt(_one_or_list(_opt(BOOL), "return logprobs")),
        "logprob_start_len": _opt(_one_or_list(_opt({"type": "integer", "minimum": -1}),
                                               "first prompt position with input logprobs (-1: none)")),
        "top_logprobs_num": _opt(_one_or_list(_opt({"type": "integer", "minimum": 0, "maximum": max_top}),
                                              "top alternatives per output token (--max-top-logprobs)")),
        "return_text_in_logprobs": _opt(BOOL),
        "stream": _opt({**BOOL, "description": "server-sent events: each chunk holds the text and output_ids so "
                                               "far, and the output logprobs of the tokens new since the last one"}),
        "session_params": {"anyOf": [_ref("SessionParams"), {"type": "null"}, {"type": "object", "maxProperties": 0}]},
        "plain_text_spans": _opt({
            "type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                       "minItems": 2, "maxItems": 2},
            "description": "radixlm: sorted [start, end) character ranges of a single text (message contents) "
                           "tokenized as plain text, never as control tokens (unless --special-tokens-in-content)"}),
        "program": {"anyOf": [{"type": "null"}, {
            "type": "object", "additionalProperties": False, "required": ["id"],
            "properties": {
                "id": {"type": "string", "minLength": 1, "maxLength": MAX_PROGRAM_ID},
                "group": {"anyOf": [{"type": "string", "maxLength": MAX_PROGRAM_GROUP}, {"type": "null"}]},
                "hold": {"type": "integer", "minimum": 0, "maximum": MAX_PROGRAM_HOLD}},
            "description": "radixlm: the program this request belongs to, for program-aware scheduling: "
                           "requests of started programs are admitted first (within --program-fairness); "
                           "group names a fork (its branches' first requests carry it); hold on a "
                           "max_new_tokens=0 prefill keeps its KV cached until that many requests of its "
                           "group were admitted"}]},
        **{k: {**ANY_JSON, "description": "accepted and ignored"} for k in GENERATE_IGNORED},
        **{k: _empty_only(k) for k in GENERATE_UNSUPPORTED},
    }, closed=True, description="Exactly one of text or input_ids. Prompts must be shorter than the context length.")
    s["description"] += f" Prompts x n at most {max_jobs} (--max-queued-requests), else 400."
    s["oneOf"] = [{"required": ["text"]}, {"required": ["input_ids"]}]
    return s


def _openai_common() -> dict[str, Schema]:
    sampling = {theirs: _opt(sampling_schema(PARAMS[name], openai=True)) for theirs, name in SAMPLING_FIELDS.items()}
    sampling["n"]["anyOf"][0]["maximum"] = MAX_N
    return {
        "model": _opt({**STR, "description": "accepted; this server serves one model"}),
        "stream": _opt(BOOL),
        "stream_options": _opt(_obj({"include_usage": _opt(BOOL), "continuous_usage_stats": _opt(BOOL)},
                                    closed=True, description="only with stream: true")),
        # the sampling parameters by their OpenAI names (SGLang / vLLM extensions too: extra_body)
        **sampling,
    }


def _openai_extras() -> dict[str, Schema]:
    return {**{k: {**ANY_JSON, "description": "accepted and ignored"} for k in IGNORED_FIELDS},
            **{k: _empty_only(k) for k in UNSUPPORTED_FIELDS}}


def _completion_request(max_top: int) -> Schema:
    prompt = {"anyOf": [STR, {"type": "array", "items": STR, "minItems": 1}, TOKEN_IDS,
                        {"type": "array", "items": TOKEN_IDS, "minItems": 1}],
              "description": "a string, a list of strings, token ids, or a list of token-id lists"}
    return _obj({
        **_openai_common(),
        "prompt": prompt,
        "echo": _opt(BOOL),
        "logprobs": _opt({"type": "integer", "minimum": 0, "maximum": max_top}),
        "best_of": _opt({"type": "integer", "minimum": 1, "description": "must equal n"}),
        **_openai_extras(),
    }, required=("prompt",), closed=True, description="max_tokens defaults to 16.")


def _chat_request(max_top: int) -> Schema:
    part = _obj({"type": {"const": "text"}, "text": STR}, required=("type", "text"))
    message = _obj({
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [STR, {"type": "array", "items": part}, {"type": "null"}],
                    "description": "text, or text parts; null only for assistant"},
        "name": STR,
        "tool_calls": {"type": "array", "items": _tool_call(), "description": "assistant only: calls it made"},
        "tool_call_id": {**STR, "minLength": 1, "description": "required on a tool message: the call it answers"},
    }, required=("role",))
    function = _obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$", "description": "unique"},
                     "description": STR,
                     "parameters": {"type": "object", "description": "a JSON schema of an object (default: no "
                                    "arguments); one that does not compile is a 400 naming it"},
                     "strict": BOOL}, required=("name",), closed=True)
    tool = _obj({"type": {"const": "function"}, "function": function}, required=("type", "function"), closed=True)
    named = _obj({"type": {"const": "function"}, "function": _obj({"name": STR}, required=("name",))},
                 required=("type", "function"), closed=True)
    schema_spec = _obj({"name": STR, "schema": {"type": "object"}, "strict": BOOL}, required=("schema",))
    response_format = _obj({"type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": schema_spec},
                           required=("type",), description="not together with regex / json_schema / ebnf")
    return _obj({
        **_openai_common(),
        "messages": {"type": "array", "items": message, "minItems": 1},
        "max_completion_tokens": _opt({"type": "integer", "minimum": 0}),
        "logprobs": _opt(BOOL),
        "top_logprobs": _opt({"type": "integer", "minimum": 0, "maximum": max_top,
                              "description": "needs logprobs: true"}),
        "response_format": _opt(response_format),
        "tools": _opt({"type": "array", "items": tool, "maxItems": MAX_TOOLS}),
        "tool_choice": {"anyOf": [{"enum": [None, "none", "auto", "required"]}, named],
                        "description": "default auto with tools, none without; auto, required and a named "
                                       "function need tools (docs/tools.md)"},
        "parallel_tool_calls": _opt({**BOOL, "description": "default true: a turn may hold several calls"}),
        "session_id": _opt({"type": "string", "minLength": 1,
                            "description": "extension: the turn replaces that session's history (n = 1)"}),
        **_openai_extras(),
    }, required=("messages",), closed=True,
        description="max_tokens defaults to what is left of the context after the prompt.")


# -- response bodies --------------------------------------------------------------------------
LOGPROB = {"type": ["number", "null"], "description": "-inf is -9999.0; the first prompt token's is null"}
NATIVE_LOGPROB = {"type": "array", "prefixItems": [LOGPROB, INT, NULL_STR], "minItems": 3, "maxItems": 3,
                  "description": "[logprob, token_id, text or null]"}


def _native_meta() -> Schema:
    reason = {"anyOf": [{"type": "null"}, _obj({"type": {"enum": ["stop", "length", "abort"]},
                                                "matched": {"type": ["string", "integer", "null"]},
                                                "length": INT}, required=("type",))]}
    triples = {"type": "array", "items": NATIVE_LOGPROB}
    return _obj({
        "id": STR, "finish_reason": reason, "prompt_tokens": INT, "completion_tokens": INT, "cached_tokens": INT,
        "e2e_latency": NUM, "ttft": {"type": ["number", "null"]}, "retractions": INT,
        "input_token_logprobs": triples,
        "output_token_logprobs": {**triples, "description": "in a stream chunk: the entries from position "
                                  "output_token_logprobs_length - len(output_token_logprobs) on"},
        "output_top_logprobs": {"type": "array", "items": triples},
        "output_token_logprobs_length": {**INT, "minimum": 0,
                                         "description": "output logprob entries in all (= completion_tokens)"},
    }, required=("id", "finish_reason", "prompt_tokens", "completion_tokens"))


def _generate_response() -> Schema:
    one = _obj({"text": STR, "output_ids": {"type": "array", "items": INT}, "meta_info": _ref("NativeMeta")},
               required=("text", "output_ids", "meta_info"))
    return {"anyOf": [one, {"type": "array", "items": one}],
            "description": "a list when the input is a list or n > 1 (all copies of prompt 0 first)"}


def _usage() -> Schema:
    return _obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT,
                 "prompt_tokens_details": _obj({"cached_tokens": INT})},
                required=("prompt_tokens", "completion_tokens", "total_tokens"))


def _completion() -> Schema:
    lp = _obj({"tokens": {"type": "array", "items": STR},
               "token_logprobs": {"type": "array", "items": LOGPROB},
               "top_logprobs": {"type": "array", "items": {"type": ["object", "null"],
                                                           "additionalProperties": LOGPROB}},
               "text_offset": {"type": "array", "items": INT}},
              required=("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    choice = _obj({"index": INT, "text": STR, "logprobs": {"anyOf": [lp, {"type": "null"}]},
                   "finish_reason": {"enum": ["stop", "length", "abort", None]},
                   "matched_stop": {"type": ["string", "integer", "null"]}},
                  required=("index", "text", "logprobs", "finish_reason"))
    return _obj({"id": STR, "object": {"const": "text_completion"}, "created": INT, "model": STR,
                 "choices": {"type": "array", "items": choice}, "usage": _ref("Usage")},
                required=("id", "object", "created", "model", "choices", "usage"))


def _tool_call() -> Schema:
    fn = _obj({"name": STR, "arguments": {**STR, "description": "the arguments as JSON text"}},
              required=("name", "arguments"))
    return _obj({"id": STR, "type": {"const": "function"}, "function": fn}, required=("id", "function"))


def _chat_completion() -> Schema:
    top = _obj({"token": STR, "logprob": LOGPROB, "bytes": {"type": "array", "items": INT}},
               required=("token", "logprob", "bytes"))
    entry = _obj({**top["properties"], "top_logprobs": {"type": "array", "items": top}},
                 required=("token", "logprob", "bytes", "top_logprobs"))
    lp = _obj({"content": {"type": "array", "items": entry}, "refusal": {"type": "null"}}, required=("content",))
    message = _obj({"role": {"const": "assistant"}, "content": NULL_STR,
                    "tool_calls": {"type": "array", "items": _tool_call(), "description": "the calls (content is "
                                   "then the text before them, or null)"}},
                   required=("role", "content"))
    choice = _obj({"index": INT, "message": message,
                   "logprobs": {"anyOf": [lp, {"type": "null"}]},
                   "finish_reason": {"enum": ["stop", "length", "abort", "tool_calls", None]},
                   "matched_stop": {"type": ["string", "integer", "null"]}},
                  required=("index", "message", "logprobs", "finish_reason"))
    return _obj({"id": STR, "object": {"const": "chat.completion"}, "created": INT, "model": STR,
                 "choices": {"type": "array", "items": choice}, "usage": _ref("Usage"),
                 "system_fingerprint": {"type": "null"}},
                required=("id", "object", "created", "model", "choices", "usage"))


def _model_card() -> Schema:
    return _obj({"id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR,
                 "root": NULL_STR, "max_model_len": {"type": ["integer", "null"]}},
                required=("id", "object", "created", "owned_by"))


def _model_info() -> Schema:
    return _obj({
        "model_path": STR, "tokenizer_path": STR, "model_name": STR, "served_model_name": STR,
        "is_generation": BOOL, "context_length": INT, "vocab_size": INT,
        "eos_token_ids": {"type": "array", "items": INT},
        "chat_template": {**NULL_STR, "description": "a family name: chatml, llama-3, llama-2, gemma, custom"},
        "chat_template_jinja": {**NULL_STR, "description": "the template's Jinja text"},
        "special_tokens": {"type": ["object", "null"]},
        "role_markers": {"type": ["object", "null"]},
        "dtype": NULL_STR,
        "server_pid": INT,
    }, required=("model_path", "tokenizer_path", "model_name", "served_model_name", "is_generation",
                 "context_length", "vocab_size", "eos_token_ids", "chat_template"))


def _server_info() -> Schema:
    return _obj({
        "version": STR, "phase": {"enum": ["starting", "ready", "draining", "stopped"]}, "uptime_s": NUM,
        "server_settings": {"type": "object", "description": "ServerSettings; the API key shows as <set>"},
        "engine_config": {"type": "object"}, "engine": {"type": "object"}, "engine_pid": {"type": ["integer", "null"]},
        "stats": {"type": ["object", "null"], "description": "the engine's counters (null if it cannot answer)"},
        "requests_in_flight": INT, "http_handlers_in_flight": INT,
    }, required=("version", "phase", "uptime_s", "server_settings", "engine_config", "engine", "stats",
                 "requests_in_flight", "http_handlers_in_flight"))


def _error() -> Schema:
    inner = _obj({
        "message": {"type": "string", "minLength": 1, "description": "what is wrong and what to do"},
        "type": {**STR, "description": "invalid_request_error, authentication_error, not_found_error, "
                                      "rate_limit_error, service_unavailable_error, ... (by status)"},
        "param": {**NULL_STR, "description": "the request field at fault, when one is"},
        "code": NULL_STR,
    }, required=("message", "type", "param", "code"))
    return _obj({"error": inner}, required=("error",), description="every error, on every route (OpenAI's shape)")


# -- operations -------------------------------------------------------------------------------
_ERRORS = {
    "400": ("BadRequest", "invalid input; the message and param name the field"),
    "401": ("Unauthorized", "missing or wrong API key (only when the server runs with --api-key)"),
    "404": ("NotFound", "no such thing (route, model, session, request)"),
    "408": ("ClientTooSlow", "the client left too many stream outputs unread; the request was aborted"),
    "405": ("MethodNotAllowed", "the method is not served on this path (the Allow header lists those that "
                                "are); a GET route that acts (generates, flushes) refuses HEAD"),
    "413": ("TooLarge", "the body is larger than --max-request-bytes"),
    "415": ("UnsupportedMediaType", "the body is not sent as 'Content-Type: application/json' in UTF-8"),
    "429": ("Overloaded", "more than --max-queued-requests engine requests in flight; retry later"),
    "503": ("Unavailable", "starting, draining, or the engine is gone"),
}
SSE = {"text/event-stream": {"schema": {"type": "string", "description": (
    "'data: {json}\\n\\n' per chunk, then 'data: [DONE]\\n\\n'; an error after the first chunk is "
    "sent as an Error object in a data line")}}}


def _json(schema: Schema) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _op(summary: str, ok: Schema | None, errors: tuple[str, ...], body: Schema | None = None,
        ok_content: dict[str, Any] | None = None, tag: str = "native", open_route: bool = False,
        body_required: bool = True, acts: bool = False) -> dict[str, Any]:
    """One operation; ``acts``: a GET that changes or runs something, so HEAD on its path is a 405
    (every other GET path also answers HEAD, as aiohttp does by itself)."""
    op: dict[str, Any] = {"summary": summary, "tags": [tag]}
    if body is not None:
        op["requestBody"] = {"required": body_required, "content": _json(body)}
    content = ok_content if ok_content is not None else _json(ok if ok is not None else ANY_JSON)
    op["responses"] = {"200": {"description": "success", "content": content}}
    codes = set(errors) | ({"413", "415"} if body is not None else set()) | (set() if open_route else {"401"})
    codes |= {"405"} if acts else set()
    for code in sorted(codes):
        op["responses"][code] = {"$ref": f"#/components/responses/{_ERRORS[code][0]}"}
    if open_route:
        op["security"] = []
    return op


def _paths() -> dict[str, Any]:
    gen_errors = ("400", "404", "408", "429", "503")
    info_errors = ("503",)
    ok = _obj({"status": {"const": "ok"}}, required=("status",))
    flush_ok = _obj({"flushed": {"const": True}, "message": STR}, required=("flushed",))
    flush = _op("Drop every cached prefix; 400 while requests are in flight", flush_ok, ("400", "503"))
    flush_get = _op("Drop every cached prefix; 400 while requests are in flight (HEAD: 405)", flush_ok,
                    ("400", "503"), acts=True)
    sse_or = {**_json(_ref("GenerateResponse")), **SSE}
    tokenize_ok = _obj({"tokens": {"anyOf": [{"type": "array", "items": INT},
                                             {"type": "array", "items": {"type": "array", "items": INT}}]},
                        "count": {"anyOf": [INT, {"type": "array", "items": INT}]}, "max_model_len": INT},
                       required=("tokens", "count", "max_model_len"))
    return {
        "/generate": {"post": _op(
            "Generate (SGLang's native protocol)", None, gen_errors, _ref("GenerateRequest"), ok_content=sse_or)},
        "/health": {"get": _op("200 when ready to generate; 503 while starting, draining, or without an engine",
                               ok, info_errors, open_route=True)},
        "/health_generate": {"get": _op("200 only if a one-token generation completes within 30 s (HEAD: 405)",
                                        ok, info_errors, acts=True)},
        "/get_model_info": {"get": _op("The model and its tokenizer", _ref("ModelInfo"), info_errors)},
        "/model_info": {"get": _op("The same as /get_model_info (SGLang's current name)", _ref("ModelInfo"),
                                   info_errors)},
        "/get_server_info": {"get": _op("Settings, engine config, engine stats", _ref("ServerInfo"), info_errors)},
        "/server_info": {"get": _op("The same as /get_server_info (SGLang's current name)", _ref("ServerInfo"),
                                    info_errors)},
        "/flush_cache": {"post": flush, "get": flush_get},
        "/abort_request": {"post": _op(
            "Abort a request (all its n copies) by rid, or every request", _obj(
                {"aborted": {"type": "integer", "minimum": 0}}, required=("aborted",)), ("400", "503"),
            _obj({"rid": _opt(STR), "abort_all": _opt(BOOL)}, closed=True,
                 description="give rid, or abort_all: true"))},
        "/concate_and_append_request": {"post": _op(
            "SGLang's parallel-encoding join: acknowledged; the next /generate sends the joined text",
            _obj({"success": {"const": True}, "message": STR}, required=("success",)), ("400", "503"),
            _obj({"src_rids": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                  "dst_rid": {"type": "string", "minLength": 1, "description": "not one of src_rids"}},
                 required=("src_rids", "dst_rid"), closed=True))},
        "/open_session": {"post": _op(
            "Open a session; answers its id as a JSON string", {"type": "string", "minLength": 1},
            ("400", "503"), _obj({
                "session_id": _opt({**STR, "description": "default: a fresh id; 400 if taken"}),
                "capacity": _opt({"type": "integer", "minimum": 1, "description": "tokens; default: no cap"}),
                "capacity_of_str_len": _opt({"type": "integer", "minimum": 1,
                                             "description": "SGLang's name, read as capacity"}),
                "ttl": _opt({"type": "number", "exclusiveMinimum": 0, "description": "seconds idle before closing"}),
            }, closed=True, description="not both capacity and capacity_of_str_len"))},
        "/close_session": {"post": _op(
            "Close a session and unpin its KV", _obj({"session_id": STR, "closed": {"const": True}},
                                                     required=("session_id", "closed")), ("400", "404", "503"),
            _obj({"session_id": STR}, required=("session_id",), closed=True))},
        "/tokenize": {"post": _op(
            "Token ids of a text (or of each text of a list)", tokenize_ok, ("400", "503"),
            _obj({"prompt": {"anyOf": [STR, {"type": "array", "items": STR, "minItems": 1}]},
                  "add_special_tokens": _opt(BOOL), "model": _opt(STR)}, required=("prompt",), closed=True))},
        "/detokenize": {"post": _op(
            "The text of token ids (or of each list of a list)", _obj(
                {"text": {"anyOf": [STR, {"type": "array", "items": STR}]}}, required=("text",)), ("400", "503"),
            _obj({"tokens": {"anyOf": [{"type": "array", "items": TOKEN_ID},
                                       {"type": "array", "items": {"type": "array", "items": TOKEN_ID}}]},
                  "skip_special_tokens": _opt(BOOL), "model": _opt(STR)}, required=("tokens",), closed=True))},
        "/debug/check": {"get": _op(
            "KV accounting and the radix cache's integrity (only with --debug-routes true, else 404)",
            _obj({"ok": BOOL, "errors": {"type": "array", "items": STR}}, required=("ok", "errors")),
            ("404", "503"))},
        "/metrics": {"get": _op("Prometheus text format", None, (), ok_content={
            "text/plain": {"schema": {"type": "string"}}})},
        "/openapi.json": {"get": _op("This description", {"type": "object"}, (), open_route=True)},
        "/v1/models": {"get": _op("The served model", _obj(
            {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
            required=("object", "data")), info_errors, tag="openai")},
        "/v1/models/{model}": {"get": {
            **_op("One model; 404 unless it is the served one", _ref("Model"), ("404", "503"), tag="openai"),
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": STR}]}},
        "/v1/completions": {"post": _op(
            "OpenAI completions", None, gen_errors, _ref("CompletionRequest"), tag="openai",
            ok_content={**_json(_ref("Completion")), **SSE})},
        "/v1/chat/completions": {"post": _op(
            "OpenAI chat completions (the model's chat template)", None, gen_errors, _ref("ChatCompletionRequest"),
            tag="openai", ok_content={**_json(_ref("ChatCompletion")), **SSE})},
    }


def openapi_spec(settings: ServerSettings) -> dict[str, Any]:
    """The description of a server run with ``settings`` (its limits filled in)."""
    max_top = settings.max_top_logprobs
    auth: list[dict[str, list[str]]] = [{"bearerAuth": []}] if settings.api_key else [{"bearerAuth": []}, {}]
    error = {"description": "error", "content": _json(_ref("Error"))}
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixlm", "version": "1", "description": (
            "SGLang's native routes and the OpenAI-compatible /v1 routes of `radixlm serve` (docs/server.md). "
            f"Request bodies are JSON objects of at most {settings.max_request_bytes} bytes, sent with "
            "'Content-Type: application/json' in UTF-8 (else 415); unknown fields are "
            "a 400 naming them; a field given as null takes its default. One request asks for at most "
            f"{settings.max_queued_requests} prompts x n (--max-queued-requests), else 400; its stop strings "
            f"and stop_regex patterns hold at most {settings.max_stop_bytes} UTF-8 bytes (--max-stop-bytes), "
            "else 400.")},
        "servers": [{"url": "/"}],
        "security": auth,
        "paths": {**_paths(), **_program_paths(settings)},
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer", "description": (
                "with --api-key, every route but /health and /openapi.json needs 'Authorization: Bearer <key>'")}},
            "responses": {name: {**error, "description": text} for name, text in _ERRORS.values()},
            "schemas": {
                "Error": _error(),
                "SamplingParams": _sampling_params(),
                "SessionParams": _session_params(),
                "GenerateRequest": _generate_request(max_top, settings.max_queued_requests),
                "GenerateResponse": _generate_response(),
                "NativeMeta": _native_meta(),
                "CompletionRequest": _completion_request(max_top),
                "ChatCompletionRequest": _chat_request(max_top),
                "Completion": _completion(),
                "ChatCompletion": _chat_completion(),
                "Usage": _usage(),
                "Model": _model_card(),
                "ModelInfo": _model_info(),
                "ServerInfo": _server_info(),
                **_program_schemas(),
            },
        },
    }


# -- POST /run_program (radixlm.runtime.server.program_api) ---------------------------------------
def _program_paths(settings: ServerSettings) -> dict[str, Any]:
    limits = settings.programs
    summary = ("Run a DSL request graph next to the engine (docs/server.md, \"/run_program\"); limits: "
               f"{limits.max_program_nodes} nodes, {limits.max_program_fork_width} branches per fork, forks "
               f"{limits.max_program_fork_depth} deep, {limits.max_program_text_bytes} text bytes, "
               f"{limits.max_program_gens} gens (--max-program-*), each past it a 400 naming its flag")
    return {"/run_program": {"post": _op(
        summary, None, ("400", "404", "408", "429", "503"), _ref("RunProgramRequest"),
        ok_content={**_json(_ref("RunProgramResponse")), **SSE})}}


def _program_schemas() -> dict[str, Schema]:
    """The request graph's schema comes from its pydantic models (declared once, in the IR)."""
    from radixlm.runtime.programs.ir import Graph

    graph = Graph.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = graph.pop("$defs", {})
    any_json = {"description": "any JSON value"}
    request = _obj({
        "graph": _ref("Graph"),
        "stream": _opt({**BOOL, "description": "SSE: {state, var, text} per text event of each state "
                                               "(state 'root', or 'root/f<fork>.<branch>'), then {done: true, ...}"}),
        "session_id": _opt({**STR, "description": "the root state's gens are turns of this open session"}),
        "sampling_defaults": _opt({"type": "object", "description": (
            "sampling parameters (the DSL's, as in SamplingParams) under every gen's own")}),
    }, required=("graph",), closed=True)
    response = _obj({
        "program": STR,
        "variables": {"type": "object", "additionalProperties": any_json,
                      "description": "final variables: select choices, gen texts (typed by dtype); lists for "
                                     "names set in fork branches"},
        "meta": {"type": "object", "additionalProperties": any_json,
                 "description": "per variable: the native meta_info of its gen, or its select's scores"},
        "text": STR,
        "messages": {"type": "array", "items": _obj({"role": STR, "content": STR})},
    }, required=("program", "variables", "meta", "text", "messages"))
    return {**defs, "Graph": graph, "RunProgramRequest": request, "RunProgramResponse": response}
