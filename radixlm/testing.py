"""Helpers for scripts that drive a real radixlm server from outside: the test suite and the
benchmarks. Nothing in the runtime imports this module.

- `http_call`: one blocking HTTP call that returns (status, body) and never raises on an error
  status (a 4xx/5xx is an answer to look at);
- `graceful_stop`: stop a server process as an operator would (SIGTERM, wait, SIGKILL);
- `poll`: wait for a condition with a deadline, never a fixed sleep;
- `free_port`: a port nobody listens on, for a server to start on.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

STOP_WAIT_S = 60.0  # for a SIGTERMed server to drain and exit before it is killed
POLL_DEADLINE_S = 300.0  # polls give up after this (the machine may be shared and slow)
POLL_INTERVAL_S = 0.05


def http_call(url: str, method: str, body: Any = None, raw: bytes | None = None,
              headers: dict[str, str] | None = None, timeout: float = 60.0) -> tuple[int, Any]:
    """(status, the JSON body parsed, or its text when it is not JSON) of `method url`; `body`
    is sent as JSON, `raw` as given bytes."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def graceful_stop(proc: subprocess.Popen[bytes], wait_s: float = STOP_WAIT_S) -> int:
    """SIGTERM `proc` (if it still runs), wait up to `wait_s` for it to exit, kill it after
    that; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


def poll(what: str, fn: Callable[[], T], deadline_s: float = POLL_DEADLINE_S,
         detail: Callable[[], str] | None = None) -> T:
    """Call `fn` until it returns something truthy and return that; an AssertionError naming
    `what` after `deadline_s`, followed by what `detail()` says then (a log's tail, the state last seen)."""
    end = time.monotonic() + deadline_s
    while not (got := fn()):
        if time.monotonic() >= end:
            raise AssertionError(f"timed out waiting for {what}" + (f"\n{detail()}" if detail else ""))
        time.sleep(POLL_INTERVAL_S)
    return got


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
