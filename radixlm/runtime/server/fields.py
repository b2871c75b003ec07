"""Typed reads of request fields: every failure is a 400 that names the field."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

from radixlm.runtime.sampling_params import show_float
from radixlm.runtime.server.errors import ApiError

_UNSET: Any = object()


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_token_list(x: Any) -> TypeGuard[list[int]]:
    return isinstance(x, list) and all(is_int(t) for t in x)


def check_keys(body: Mapping[str, Any], known: Iterable[str], ignored: Iterable[str] = (),
               unsupported: Iterable[str] = ()) -> None:
    """Unknown keys are errors (a typo must not be silently ignored); `ignored` keys are accepted
    and have no effect; `unsupported` keys are accepted only when empty (null, false, [], {})."""
    known, ignored, unsupported = set(known), set(ignored), set(unsupported)
    for key, value in body.items():
        if key in known or key in ignored:
            continue
        if key in unsupported:
            if value in (None, False, [], {}, ""):
                continue
            raise ApiError(400, f"{key} is not supported by this server", param=key)
        valid = ", ".join(sorted(known | ignored))
        raise ApiError(400, f"unknown field {key!r}; valid fields: {valid}", param=key)


def get_int(body: Mapping[str, Any], key: str, default: Any = None, lo: int | None = None,
            hi: int | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not is_int(v):
        raise ApiError(400, f"{key} must be an integer, got {_show(v)}", param=key)
    _check_range(key, v, lo, hi)
    return v


def get_float(body: Mapping[str, Any], key: str, default: Any = None, lo: float | None = None,
              hi: float | None = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not is_number(v) or not _finite(v):
        raise ApiError(400, f"{key} must be a finite number, got {_show(v)}", param=key)
    _check_range(key, v, lo, hi)
    return float(v)


def get_bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be true or false, got {_show(v)}", param=key)
    return v


def get_str(body: Mapping[str, Any], key: str, default: Any = None) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise ApiError(400, f"{key} must be a string, got {_show(v)}", param=key)
    return v


def get_object(body: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ApiError(400, f"{key} must be an object, got {_show(v)}", param=key)
    return v


def get_stop(body: Mapping[str, Any], key: str = "stop") -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ApiError(400, f"{key} must be a string or a list of strings, got {_show(v)}", param=key)
    if any(not s for s in v):
        raise ApiError(400, f"{key} strings must be non-empty", param=key)
    return v


def _check_range(key: str, v: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and v < lo:
        raise ApiError(400, f"{key} must be >= {show_number(lo)}, got {show_number(v)}", param=key)
    if hi is not None and v > hi:
        raise ApiError(400, f"{key} must be <= {show_number(hi)}, got {show_number(v)}", param=key)


def show_number(v: float) -> str:
    """A number for an error message, as sent: any int (however large, never an OverflowError), a
    float as its repr (2.0000001, never rounded to 2), without '.0' when it is whole."""
    if isinstance(v, int):
        text = str(v)
        return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
    return show_float(v)


def _finite(v: float) -> bool:
    if isinstance(v, int):
        return abs(v) <= _FLOAT_MAX_INT
    return math.isfinite(v)


_FLOAT_MAX_INT = int(sys.float_info.max)


def _show(v: Any) -> str:
    text = show_number(v) if is_int(v) else repr(v)
    kind = type(v).__name__ if v is not None else "null"
    kind = {"str": "string", "dict": "object", "list": "array", "bool": "boolean", "float": "number",
            "int": "integer"}.get(kind, kind)
    return f"{kind} {text[:60]}{'...' if len(text) > 60 else ''}"
