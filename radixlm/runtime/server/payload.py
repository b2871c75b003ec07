"""JSON in and out: request bodies read within the size limit, responses that are valid JSON."""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from radixlm.runtime.server.context import CONTEXT
from radixlm.runtime.server.errors import ApiError

if TYPE_CHECKING:
    from radixlm.runtime.server.dispatcher import Job

_PARSE_INLINE_BYTES = 256 * 1024
JSON_TYPE = "application/json"
_INT_LIMIT = 2**63
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB]|\\u[dD][c-fC-F]")


def dumps(obj: Any) -> str:
    """Compact JSON; NaN/inf never appear (callers map them), so the output is standard JSON."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=dumps(obj), status=status, content_type="application/json", headers=headers)


def finite_logprob(x: float | None) -> float | None:
    """-inf becomes -9999.0 (OpenAI's convention), NaN becomes null: JSON has neither."""
    if x is None or math.isnan(x):
        return None
    return x if math.isfinite(x) else (-9999.0 if x < 0 else 9999.0)


async def read_json_object(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; 415 unless it is sent as JSON in UTF-8 (check_json_type), 413 past
    max_bytes, 408 when it does not arrive within the server's body_timeout, 400 for anything that is
    not an object of valid values (see parse_body)."""
    check_json_type(request)
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(max_bytes)
    timeout = request.app[CONTEXT].settings.body_timeout
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(max_bytes) from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                       code="body_timeout") from None
    if len(raw) > _PARSE_INLINE_BYTES:  # big bodies parse off the event loop
        return await asyncio.to_thread(parse_body, raw)
    return parse_body(raw)


def check_json_type(request: web.Request) -> None:
    """415 unless the request says its body is JSON (``Content-Type: application/json``, with no
    charset or ``charset=utf-8``). A web page may send a cross-site POST without asking first
    (no CORS preflight) only as text/plain, form data or with no Content-Type at all: a JSON route
    that read those would let any page the user opens spend, flush or abort on a server without
    an API key. So they are refused; docs/server.md, "Request bodies and methods"."""
    sent = request.headers.get("Content-Type")
    if sent is None:
        raise ApiError(415, f"the request has no Content-Type header; send the JSON body with "
                            f"'Content-Type: {JSON_TYPE}'", code="unsupported_media_type")
    if request.content_type != JSON_TYPE:
        shown = sent if len(sent) <= 80 else sent[:77] + "..."
        raise ApiError(415, f"the request body is sent as {shown!r}; this route reads JSON: send it with "
                            f"'Content-Type: {JSON_TYPE}'", code="unsupported_media_type")
    charset = request.charset
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise ApiError(415, f"the request body is sent in charset {charset[:40]!r}; JSON bodies are read as UTF-8: "
                            f"send UTF-8 text with 'Content-Type: {JSON_TYPE}' (or '; charset=utf-8')",
                       code="unsupported_media_type")


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object whose every value the runtime can hold: strings are valid
    Unicode (no lone surrogates), integers fit 64 bits, numbers are finite. The bytes are UTF-8
    (a leading byte order mark is ignored, as RFC 8259 allows). 400s name the field."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start} is not); send JSON in "
                            "UTF-8") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:  # the router's json_object says the same (radixlm.router.keys)
        raise ApiError(400, "the request body is nested too deeply; send fewer levels of nested arrays and "
                            "objects") from None
    except _NotANumber as e:
        raise ApiError(400, f"the request body holds {e.args[0]}, which is not a JSON number; send a finite "
                            "number") from None
    except ValueError:  # json's only other refusal: an integer literal past Python's digit limit
        raise ApiError(400, f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                            "digits; integers must fit in 64 bits") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_kind(body)}")
    check_values(body, maybe_surrogates=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


def check_values(body: dict[str, Any], maybe_surrogates: bool = True) -> None:
    """Walk a parsed body (iteratively) and refuse the first value the runtime cannot hold."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if maybe_surrogates and _SURROGATE.search(v):
                raise _bad_value(path, "holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without "
                                       "its pair); send valid Unicode text")
        elif isinstance(v, bool):
            continue
        elif isinstance(v, int):
            if not -_INT_LIMIT <= v < _INT_LIMIT:
                raise _bad_value(path, "is an integer outside the 64-bit range")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise _bad_value(path, "is a number outside the range of a double")
        elif isinstance(v, dict):
            for key, item in v.items():
                if maybe_surrogates and _SURROGATE.search(key):
                    raise _bad_value(path, "has a key that holds a lone UTF-16 surrogate; send valid Unicode text")
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))


def _bad_value(path: str, what: str) -> ApiError:
    name = path or "the request body"
    shown = name if len(name) <= 80 else name[:77] + "..."
    return ApiError(400, f"{shown} {what}", param=shown if path else None)


class _NotANumber(ValueError):
    """NaN, Infinity or -Infinity in a body: Python's json reads them, JSON has no such numbers."""


def _no_constant(name: str) -> Any:
    raise _NotANumber(name)


def too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body is larger than the limit of {max_bytes} bytes (--max-request-bytes)")


def _json_kind(x: Any) -> str:
    if isinstance(x, list):
        return "an array"
    if isinstance(x, str):
        return "a string"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, (int, float)):
        return "a number"
    return "null"


# What one output token costs in a response, roughly (JSON text): its text and id; each logprob
# entry (the token's own, and each top alternative) as an OpenAI chat entry is about 80 bytes.
BYTES_PER_TOKEN = 16
BYTES_PER_LOGPROB = 80


def response_cost(jobs: Sequence[Job]) -> int:
    """An upper estimate of the bytes a response to ``jobs`` can take: every job's max_new_tokens
    (and its prompt's logprobs when asked) times what a token costs with its logprobs. (A native
    stream resends all text so far in each chunk; what it sends is metered as it goes: sse.py.)"""
    total = 0
    for job in jobs:
        req = job.request
        per_token = BYTES_PER_TOKEN
        if req.return_logprob:
            per_token += BYTES_PER_LOGPROB * (1 + req.top_logprobs_num)
        prompt = 0
        if req.return_logprob and req.logprob_start_len >= 0:
            prompt = len(req.prompt_ids) - req.logprob_start_len
        total += req.params.max_new_tokens * per_token + prompt * (BYTES_PER_TOKEN + BYTES_PER_LOGPROB)
    return total


def check_stop_bytes(jobs: Sequence[Job], limit: int, param: str) -> None:
    """400 before anything runs when one request's stop strings and stop_regex patterns hold more
    than ``limit`` UTF-8 bytes in all (--max-stop-bytes): the engine matches them against every
    step's text, so megabytes of them stalled every other request's steps for seconds."""
    seen: set[int] = set()
    for job in jobs:
        params = job.request.params
        if id(params) in seen:  # the prompts of a batch may share theirs: measured once
            continue
        seen.add(id(params))
        size = sum(len(s.encode("utf-8", "surrogatepass")) for s in (*params.stop, *params.stop_regex))
        if size > limit:
            what = "stop strings and stop_regex patterns" if params.stop_regex else "stop strings"
            raise ApiError(400, f"{param}: the {what} hold {size:,} UTF-8 bytes in all, more than the server's "
                                f"limit of {limit:,} (--max-stop-bytes); send fewer or shorter ones", param=param)


def check_response_cost(jobs: Sequence[Job], limit: int) -> None:
    """400 before anything runs when a response could cost more than ``limit`` bytes."""
    cost = response_cost(jobs)
    if cost > limit:
        raise ApiError(400, f"this request's response could take about {cost:,} bytes, more than the server's "
                            f"limit of {limit:,} (--max-response-bytes); lower max_new_tokens / max_tokens, n, "
                            "or top_logprobs")
