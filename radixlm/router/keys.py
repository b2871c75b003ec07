"""What the router reads from a request body: its routing key (the prompt, as text) and its session.

The router validates nothing: a body it cannot read gets the empty key and goes to a worker, whose
answer (a 400 naming the field) is passed back.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

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
        return json.dumps(body["graph"])  # a graph's text nodes come in program order
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


def parse_body(raw: bytes) -> Any:
    """The JSON body, or None when it is not JSON."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
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
