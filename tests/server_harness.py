"""Real radixlm processes on 127.0.0.1 for the tests (and the benchmarks that drive one): `radixlm serve`
(`start_server`) and the router (`start_router`: `radixlm route`, or `serve --dp-size N` with its replicas).

Each starts on a free port with its output in a temporary log, is returned once its /health says so
(polled, with a deadline), and is stopped as an operator would stop it (SIGTERM, wait, SIGKILL). One that
exits while starting, or is not ready in time, fails with the end of its log. Use one as a context manager
(`with start_server(...) as s:`) or stop it in a fixture's teardown, asserting the exit code where the test
cares. Plain calls go through urllib (`radixlm.testing.http_call`), streams through aiohttp (`read_sse`).

pyproject's pytest settings put tests/ on sys.path, so every test module imports this as `server_harness`.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, TypeVar

import aiohttp

from radixlm.testing import STOP_WAIT_S, free_port, graceful_stop, http_call, poll

LOG_TAIL_CHARS = 4000  # of a process's log, shown when it fails to start or to stop cleanly
WORKER = "X-Radixlm-Worker"  # the router's header naming the replica that answered

P = TypeVar("P", bound="Process")


def process_running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its new parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except OSError:
        return False


@dataclass
class Process:
    """A radixlm process listening on 127.0.0.1:`port`, its output in `log_path`."""

    name: ClassVar[str] = "the process"
    stop_wait_s: ClassVar[float] = STOP_WAIT_S  # for it to exit after SIGTERM before it is killed

    proc: subprocess.Popen[bytes]
    port: int
    log_path: str
    api_key: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # sent with every plain call (the API key)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self) -> str:
        return f"the end of {self.name}'s log:\n{self.log()[-LOG_TAIL_CHARS:]}"

    def stop(self) -> int:
        """SIGTERM it (if it still runs), wait, kill it if it does not exit; its exit code. Once stopped
        its log is gone, so a code other than 0 prints the log's end (shown with the failing test)."""
        code = graceful_stop(self.proc, self.stop_wait_s)
        if os.path.exists(self.log_path):
            if code != 0:
                print(f"{self.name} exited with {code}; {self.log_tail()}")
            os.unlink(self.log_path)
        return code

    def __enter__(self: P) -> P:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def launch(make: Callable[..., P], cli_args: Sequence[str], what: str, ready: Callable[[P], bool],
           api_key: str | None = None, env: dict[str, str] | None = None) -> P:
    """`python -m radixlm.cli CLI_ARGS --port P [--api-key K]` (with `env` over this process's environment),
    returned once `ready(it)` holds; a RuntimeError with its log's end if it exits first or is not ready by
    `radixlm.testing.poll`'s deadline. `ready` may raise OSError while nothing listens yet."""
    port = free_port()
    fd, log_path = tempfile.mkstemp(prefix=f"radixlm-{cli_args[0]}-", suffix=".log")
    cmd = [sys.executable, "-m", "radixlm.cli", *cli_args, "--port", str(port)]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=None if env is None else {**os.environ, **env})
    os.close(fd)
    p = make(proc, port, log_path, api_key, {"Authorization": f"Bearer {api_key}"} if api_key else {})

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{p.name} exited with {proc.returncode} while starting; {p.log_tail()}")
        try:
            return ready(p)
        except (OSError, http.client.HTTPException):
            return False  # not listening yet

    try:
        poll(what, up, detail=p.log_tail)
    except BaseException as e:
        graceful_stop(proc, p.stop_wait_s)  # (the error shows its log's end already)
        os.unlink(log_path)
        if isinstance(e, AssertionError):  # not ready in time
            raise RuntimeError(str(e)) from None
        raise
    return p


class Server(Process):
    """`radixlm serve`."""

    name = "the server"

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
        return dict(out)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics (0.0 when absent)."""
        status, text = self.get("/metrics")
        assert status == 200
        key = name + (f"{{{labels}}}" if labels else "")
        for line in text.splitlines():
            if line.startswith(key + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_until(self, what: str, cond: Callable[[dict[str, Any]], bool], deadline_s: float = 60.0) \
            -> dict[str, Any]:
        """Poll /get_server_info until cond(info) holds and return that info; fails after deadline_s,
        showing the stats last seen."""
        seen: dict[str, Any] = {}

        def met() -> dict[str, Any]:
            seen.clear()
            seen.update(self.server_info())
            return dict(seen) if cond(seen) else {}

        return poll(what, met, deadline_s, detail=lambda: f"stats: {seen.get('stats')}")


def start_server(*args: str, api_key: str | None = None, env: dict[str, str] | None = None) -> Server:
    """`radixlm serve ARGS` (the default model unless ARGS name one), returned once /health answers 200."""
    return launch(Server, ["serve", *args], "the server to be healthy",
                  lambda s: s.get("/health", timeout=5)[0] == 200, api_key, env)


@dataclass
class Router(Process):
    """`radixlm route`, or `radixlm serve --dp-size N` (the router in front, its replicas behind)."""

    name = "the router"
    stop_wait_s = 120.0  # a launcher stops its replicas too

    replicas: list[Any] = field(default_factory=list)  # `serve --dp-size N`: the test's handles on its replicas

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
        """The sum of the /metrics samples whose line starts with `name`."""
        _, text = self.call("GET", "/metrics")
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def start_router(args: Sequence[str], healthy_workers: int, api_key: str | None = None,
                 env: dict[str, str] | None = None) -> Router:
    """`radixlm ARGS` (`route ...` or `serve --dp-size N ...`), returned once its /health counts
    `healthy_workers` (0: once it answers at all, a 503 with no worker healthy)."""

    def ready(r: Router) -> bool:
        status, health = r.call("GET", "/health", timeout=5)
        return health.get("healthy_workers", 0) == healthy_workers if healthy_workers else status == 503

    return launch(Router, args, f"{healthy_workers} healthy workers", ready, api_key, env)


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


# -- SSE ----------------------------------------------------------------------------------
async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """Every event of a stream: parsed JSON objects, then the string '[DONE]'."""
    events: list[Any] = []
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
