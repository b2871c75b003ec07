"""A real router process on 127.0.0.1 (`radixlm route` or `radixlm serve --dp-size N`) and calls to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from radixlm.testing import free_port, http_call, poll

WORKER = "X-Radixlm-Worker"
DEADLINE_S = 300.0  # polls give up after this (the machine may be shared and slow); never a sleep


class Router:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: str,
                 headers: dict[str, str] | None = None) -> None:
        self.proc, self.port, self.log_path = proc, port, log_path
        self.headers = headers or {}  # sent with every call (the API key)
        self.url = f"http://127.0.0.1:{port}"
        self.replicas: list[Any] = []  # `serve --dp-size N`: the test's handles on its replicas

    def call(self, method: str, path: str, body: Any = None, timeout: float = 300.0) -> tuple[int, Any]:
        return http_call(self.url + path, method, body, headers=self.headers, timeout=timeout)

    def request(self, method: str, path: str, raw: bytes | None = None, headers: dict[str, str] | None = None) \
            -> tuple[int, dict[str, str], bytes]:
        """(status, response headers, body) of one call with exactly these headers (no API key unless given)."""
        return raw_call(self.url + path, method, raw, headers)

    def generate(self, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """(the /generate answer, the worker that answered), read with urllib for the header."""
        status, headers, data = self.request("POST", "/generate", json.dumps(body).encode(), self.headers)
        assert status == 200, data
        return json.loads(data), headers[WORKER]

    def workers(self) -> list[dict[str, Any]]:
        status, info = self.call("GET", "/get_server_info")
        assert status == 200, info
        return list(info["workers"])

    def metric(self, name: str) -> float:
        _, text = self.call("GET", "/metrics")
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM (a launcher stops its replicas too), then the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(120)
        if code != 0:  # shown with the failing test
            print(f"the router exited with {code}; the end of its log:\n{self.log()[-4000:]}")
        os.unlink(self.log_path)
        return code


def raw_call(url: str, method: str, raw: bytes | None = None, headers: dict[str, str] | None = None) \
        -> tuple[int, dict[str, str], bytes]:
    """(status, response headers, body bytes) of one call; HTTP errors are returned, not raised."""
    req = urllib.request.Request(url, data=raw, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def start_router(args: Sequence[str], healthy_workers: int, api_key: str | None = None) -> Router:
    """`python -m radixlm.cli ARGS --port P` (`route ...` or `serve --dp-size N ...`), returned once its
    /health counts `healthy_workers` (0: once it answers at all)."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="radixlm-route-", suffix=".log")
    key_args = ["--api-key", api_key] if api_key else []
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.cli", *args, "--port", str(port), *key_args],
                            stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    os.close(fd)
    r = Router(proc, port, log_path, {"Authorization": f"Bearer {api_key}"} if api_key else None)

    def ready() -> bool:
        assert proc.poll() is None, r.log()
        try:
            status, health = r.call("GET", "/health", timeout=5)
        except OSError:
            return False  # not listening yet
        return health.get("healthy_workers", 0) == healthy_workers if healthy_workers else status == 503

    try:
        poll(f"{healthy_workers} healthy workers", ready)
    except BaseException:
        r.stop()
        raise
    return r
