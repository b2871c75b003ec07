"""JSON in and out: request bodies read within the size limit, responses that are valid JSON."""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

from radixlm.runtime.server.errors import ApiError


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
    """The body as a JSON object; 413 past max_bytes, 400 for anything that is not an object."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise too_large(max_bytes)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(max_bytes) from None
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_kind(body)}")
    return body


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
