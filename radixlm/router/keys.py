"""What the router reads from a request body: its routing key (the prompt, as text) and its session.

On the routes it reads, a body the server would not read as a JSON object (not UTF-8, not JSON,
nested too deeply, an integer past Python's digit limit, not an object) is refused with the
server's 400; the fields of a readable one are the workers' to check (their 400 naming the field
is passed back), as are the bodies of every other route, which pass through unread.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from typing import Any

# The routes whose body the router reads: for the routing key and the session (see below).
BODY_ROUTES = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/run_program", "/close_session"})
_SURROGATES = 0x800  # token ids at or above U+D800 are shifted past the surrogate block


def ids_key(ids: list[Any]) -> str:
    """Token ids as one character each, so id prefixes are character prefixes."""
    out = []
    for t in ids:
        if not isinstance(t, int) or t < 0 or t >= 0x110000 - _SURROGATES:
            break
        out.append(chr(t if t < 0xD800 else t + _SURROGATES))
    return "".join(out)


def _prompt_key(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return first  # a batch goes to one worker, routed by its first prompt
        if isinstance(first, int):
            return ids_key(value)
        if isinstance(first, list):
            return ids_key(first)
    return ""


def _messages_key(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            break
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        parts.append(f"<|{m.get('role')}|>{content if isinstance(content, str) else ''}")
    return "".join(parts)


def routing_key(path: str, body: Any) -> str:
    """The text whose prefix decides cache affinity ('' when the body has none)."""
    if not isinstance(body, dict):
        return ""
    if path == "/generate":
        return _prompt_key(body.get("text")) or _prompt_key(body.get("input_ids"))
    if path == "/v1/completions":
        return _prompt_key(body.get("prompt"))
    if path == "/v1/chat/completions":
        return _messages_key(body.get("messages"))
    if path == "/run_program" and "graph" in body:
        try:
            return json.dumps(body["graph"])  # a graph's text nodes come in program order
        except RecursionError:  # read, but too deep to write back: routed by load alone
            return ""
    return ""


def session_of(path: str, body: Any) -> str | None:
    """The session a request belongs to (its turns must reach the worker holding its KV)."""
    if not isinstance(body, dict):
        return None
    if path == "/generate":
        params = body.get("session_params")
        sid = params.get("id") if isinstance(params, dict) else None
    elif path in ("/v1/chat/completions", "/run_program", "/close_session"):
        sid = body.get("session_id")
    else:
        return None
    return sid if isinstance(sid, str) and sid else None


def json_object(raw: bytes) -> dict[str, Any]:
    """A client's body as the server reads it: a JSON object, else ValueError with the server's
    400 message (what to fix), word for word (the server's is radixlm.runtime.server.payload.parse_body's)."""
    if not raw.strip():
        raise ValueError("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte order mark is allowed (RFC 8259)
    except UnicodeDecodeError as e:
        raise ValueError(f"the request body is not valid UTF-8 (byte {e.start} is not); send JSON in UTF-8") \
            from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") \
            from None
    except RecursionError:
        raise ValueError("the request body is nested too deeply; send fewer levels of nested arrays and "
                         "objects") from None
    except ValueError:  # json's only other refusal: an integer literal past Python's digit limit
        raise ValueError(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                         "digits; integers must fit in 64 bits") from None
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {_json_kind(body)}")
    return body


def _json_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null"


def parse_body(raw: bytes) -> Any:
    """A worker's JSON answer, or None when it is not JSON."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


class SessionTable:
    """session id -> worker index, the oldest binding forgotten past `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def bind(self, session_id: str, worker: int) -> None:
        self._map[session_id] = worker
        self._map.move_to_end(session_id)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def get(self, session_id: str) -> int | None:
        worker = self._map.get(session_id)
        if worker is not None:
            self._map.move_to_end(session_id)
        return worker

    def drop(self, session_id: str) -> None:
        self._map.pop(session_id, None)
