"""Start a real `radixlm serve` process on 127.0.0.1 and talk to it (urllib for plain calls, aiohttp for SSE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from radixlm.testing import free_port, graceful_stop, http_call

START_DEADLINE_S = 180.0


def process_running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its new parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except OSError:
        return False


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: str
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    # -- plain calls --------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
        """(status, parsed JSON body or text) for one call; HTTP errors are returned, not raised."""
        return http_call(self.url + path, method, body, raw, {**self.headers, **(headers or {})}, timeout)

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return self.request("POST", path, body, **kw)

    def generate(self, body: dict[str, Any]) -> Any:
        status, out = self.post("/generate", body)
        assert status == 200, out
        return out

    def server_info(self) -> dict[str, Any]:
        status, out = self.get("/get_server_info")
        assert status == 200, out
        return out

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics (0.0 when absent)."""
        status, text = self.get("/metrics")
        assert status == 200
        key = name + (f"{{{labels}}}" if labels else "")
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_until(self, what: str, cond, deadline_s: float = 60.0) -> dict[str, Any]:
        """Poll /get_server_info until cond(info) holds; fails after deadline_s."""
        end = time.monotonic() + deadline_s
        info = self.server_info()
        while not cond(info):
            assert time.monotonic() < end, f"timed out waiting for {what}: {info['stats']}"
            time.sleep(0.05)
            info = self.server_info()
        return info

    # -- process ------------------------------------------------------------------------
    def stop(self) -> int:
        if graceful_stop(self.proc) != 0:  # shown with the failing test: why the server did not stop cleanly
            print(f"the server exited with {self.proc.returncode}; the end of its log:\n{self.log()[-4000:]}")
        os.unlink(self.log_path)
        return self.proc.returncode


def start_server(*args: str, api_key: str | None = None) -> Server:
    """Start `python -m radixlm.cli serve` and wait (bounded) until /health answers 200."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix="radixlm-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "radixlm.cli", "serve", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    os.close(fd)
    server = Server(proc, port, log_path, api_key, {"Authorization": f"Bearer {api_key}"} if api_key else {})
    end = time.monotonic() + START_DEADLINE_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while the model loads
        if time.monotonic() > end:
            server.stop()
            raise RuntimeError(f"the server was not healthy within {START_DEADLINE_S:.0f} s")
        time.sleep(0.2)


# -- SSE ----------------------------------------------------------------------------------
async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Every event of a stream: parsed JSON objects, then the string '[DONE]'."""
    events = []
    async for line in resp.content:
        line = line.strip()
        if not line:
            continue
        assert line.startswith(b"data: "), line
        payload = line[len(b"data: "):]
        events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


async def next_event(resp: aiohttp.ClientResponse) -> Any:
    while True:
        line = (await resp.content.readline()).strip()
        if line:
            assert line.startswith(b"data: "), line
            payload = line[len(b"data: "):]
            return "[DONE]" if payload == b"[DONE]" else json.loads(payload)
