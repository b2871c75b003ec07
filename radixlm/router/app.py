"""The router's aiohttp app: every route of `radixlm serve` passed through to a worker chosen by the
policy, plus /health, /metrics and the routes that fan out to all workers."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from radixlm.router.config import RouterConfig
from radixlm.router.keys import BODY_ROUTES, SessionTable, json_object, parse_body, routing_key, session_of
from radixlm.router.policies import Choice, Policy, make_policy

log = logging.getLogger("radixlm.router")
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Headers that belong to one connection, not to the request or response passed through.
_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length"))
# The server's error types by status (radixlm/runtime/server/errors.py), and the router's own 504.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}
# Routes whose request goes to every healthy worker; the rest go to one.
_FAN_OUT = ("/flush_cache", "/abort_request")
_JSON_TYPE = "application/json"
OPEN_ROUTES = frozenset({"/health", "/openapi.json"})  # answered without --api-key's key, as by the server
_PARSE_INLINE_BYTES = 256 * 1024  # bodies above this are parsed off the event loop, as by the server
WORKER_HEADER = "X-Radixlm-Worker"  # on every passed-through response: the worker that answered
# Whether answers to a request may name workers: with no --api-key, or with the key sent.
_SHOW_WORKERS = web.RequestKey("show_workers", bool)
_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError)


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> web.Response:
    """The server's error body, byte for byte: `{"error": {message, type, param, code}}`."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.Response(text=json.dumps(body, ensure_ascii=False, separators=(",", ":")), status=status,
                        content_type="application/json",
                        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


class Refused(Exception):
    """A request the router answers itself with a 4xx: a body it cannot read, no key, too large."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class WorkerDown(Exception):
    """The worker was taken out (or its connection failed) while a request was on it."""


@dataclass(eq=False)
class Worker:
    index: int
    url: str
    healthy: bool = False
    in_flight: int = 0
    failures: int = 0  # failed health checks in a row
    down: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class RouterMetrics:
    """The router's own Prometheus metrics, in a registry owned by one app."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.routed = Counter("radixlm_router_requests", "Requests sent to a worker, by worker and policy reason.",
                              ["worker", "reason"], registry=r)
        self.responses = Counter("radixlm_router_http_responses", "Responses of the router by status code.",
                                 ["status"], registry=r)
        self.retries = Counter("radixlm_router_retries", "Requests moved to another worker before any byte "
                               "was sent back, by the worker that failed.", ["worker"], registry=r)
        self.removals = Counter("radixlm_router_worker_removals", "Times a worker was taken out.", ["worker"],
                                registry=r)
        self.healthy = Gauge("radixlm_router_worker_healthy", "1 while the worker takes requests.", ["worker"],
                             registry=r)
        self.in_flight = Gauge("radixlm_router_in_flight_requests", "Requests in flight on the worker.",
                               ["worker"], registry=r)
        self.sessions = Gauge("radixlm_router_sessions", "Sessions bound to a worker.", registry=r)


class Router:
    """Per-app state: the workers, the policy, session bindings, the upstream HTTP client."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.policy: Policy = make_policy(config.policy, len(config.urls), config)
        self.workers = [Worker(i, url) for i, url in enumerate(config.urls)]
        self.sessions = SessionTable(config.max_sessions)
        self.metrics = RouterMetrics()
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=config.request_timeout, connect=config.health_timeout))
        self._health_task: asyncio.Task[None] | None = None

    # -- workers ------------------------------------------------------------------------
    async def start(self) -> None:
        await self.check_all()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        await self.client.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.workers))

    async def _check(self, w: Worker) -> None:
        try:
            async with self.client.get(w.url + "/health",
                                       timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)) as resp:
                ok, why = resp.status == 200, f"/health answered {resp.status}"
        except aiohttp.ClientConnectorError as e:
            self.take_out(w, f"connection failed: {e}")
            return
        except (TimeoutError, *_CONNECTION_ERRORS) as e:
            ok, why = False, f"/health failed: {type(e).__name__} {e}"
        if ok:
            w.failures = 0
            if not w.healthy:
                w.healthy = True
                w.down = asyncio.get_running_loop().create_future()
                self.metrics.healthy.labels(w.url).set(1)
                log.info("worker %s is healthy: it takes requests", w.url)
            return
        w.failures += 1
        if w.failures >= self.config.health_failures:
            self.take_out(w, why)

    def take_out(self, w: Worker, why: str) -> None:
        """Stop sending to `w`; requests in flight on it fail now (and move on if nothing was sent back)."""
        if not w.healthy:
            return
        w.healthy = False
        if not w.down.done():
            w.down.set_result(None)
        self.policy.forget(w.index)
        self.metrics.healthy.labels(w.url).set(0)
        self.metrics.removals.labels(w.url).inc()
        log.warning("worker %s taken out: %s", w.url, why)

    def loads(self) -> list[int]:
        return [w.in_flight for w in self.workers]

    async def until_down(self, w: Worker, aw: Awaitable[T]) -> T:
        """Await `aw`, unless `w` is taken out first (WorkerDown); `aw` is cancelled either way."""
        task = asyncio.ensure_future(aw)
        try:
            await asyncio.wait((task, w.down), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
        if not task.done() or task.cancelled():
            raise WorkerDown(f"worker {w.url} was taken out")
        return task.result()

    # -- proxying -------------------------------------------------------------------------
    async def proxy(self, request: web.Request, body: bytes, key: str = "", pinned: int | None = None) -> \
            web.StreamResponse:
        """Send the request to a worker (the policy's choice, or `pinned`) and pass its answer back;
        a worker that fails before anything was sent back is taken out and the next one tried."""
        tried: set[int] = set()
        last = "no worker is healthy"
        while True:
            if pinned is not None:
                w = self.workers[pinned]
                if not w.healthy:
                    return error_response(503, f"the worker holding this session ({w.url}) is down: {last}"
                                          if tried else f"the worker holding this session ({w.url}) is down",
                                          "session_worker_down")
                choice = Choice(pinned, "session")
            else:
                candidates = [w.index for w in self.workers if w.healthy and w.index not in tried]
                if not candidates:
                    return error_response(503, last if tried else "no worker is healthy", "no_healthy_worker")
                choice = self.policy.choose(key, self.loads(), candidates)
                w = self.workers[choice.worker]
            self.metrics.routed.labels(w.url, choice.reason).inc()
            got = await self._attempt(request, w, body)
            if isinstance(got, web.StreamResponse):
                got["worker"] = w.index  # which worker answered (/open_session binds the session to it)
                return got
            self.metrics.retries.labels(w.url).inc()
            tried.add(w.index)
            last = f"worker {w.url} failed: {got}" if _shows_workers(request) else "every worker tried failed"
            if pinned is not None:
                continue  # answered above: the session's worker is down

    async def _attempt(self, request: web.Request, w: Worker, body: bytes) -> web.StreamResponse | str:
        """The worker's answer passed back, or why it failed before anything was sent back."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        w.in_flight += 1
        self.metrics.in_flight.labels(w.url).set(w.in_flight)
        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                upstream = await self.until_down(w, self.client.request(
                    request.method, w.url + request.path_qs, data=body or None, headers=headers))
                if upstream.status == 503:  # starting, draining or its engine is gone: not this request's fault
                    text = (await self.until_down(w, upstream.read())).decode(errors="replace")
                    self.take_out(w, f"it answered 503: {text[:200]}")
                    return f"503 {text[:200]}"
                if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    data = await self.until_down(w, upstream.read())
                    return web.Response(body=data, status=upstream.status, headers=_passed(request, upstream))
                first = await self.until_down(w, upstream.content.readany())  # nothing sent back before it
            except TimeoutError as e:
                if isinstance(e, aiohttp.ServerTimeoutError):  # no connection within --health-timeout
                    self.take_out(w, f"{type(e).__name__}: {e}")
                    return f"{type(e).__name__}: {e}"
                return error_response(504, f"{_name(request, w)} did not answer within --request-timeout "
                                      f"{self.config.request_timeout:g} s", "worker_timeout")
            except (WorkerDown, *_CONNECTION_ERRORS) as e:
                self.take_out(w, f"{type(e).__name__}: {e}")
                return f"{type(e).__name__}: {e}"
            return await self._stream(request, w, upstream, first)
        finally:
            if upstream is not None:
                upstream.close()  # a no-op once read; else the connection closes and the worker aborts
            w.in_flight -= 1
            self.metrics.in_flight.labels(w.url).set(w.in_flight)

    async def _stream(self, request: web.Request, w: Worker, upstream: aiohttp.ClientResponse,
                      first: bytes) -> web.StreamResponse:
        """Pass an SSE stream through chunk by chunk; a worker lost mid-stream ends it with an error event."""
        resp = web.StreamResponse(status=upstream.status, headers=_passed(request, upstream))
        await resp.prepare(request)
        tail, chunk = b"\n\n", first
        try:
            while chunk:
                await resp.write(chunk)
                tail = (tail + chunk)[-2:]
                chunk = await self.until_down(w, upstream.content.readany())
        except (TimeoutError, WorkerDown, *_CONNECTION_ERRORS) as e:
            if isinstance(e, WorkerDown | aiohttp.ClientConnectionError | aiohttp.ClientPayloadError):
                self.take_out(w, f"lost mid-stream: {type(e).__name__}: {e}")
            err = {"error": {"message": f"{_name(request, w)} failed mid-stream: {type(e).__name__}", "type":
                             "service_unavailable_error", "param": None, "code": "worker_lost"}}
            sep = b"" if tail == b"\n\n" else b"\n\n"
            await resp.write(sep + b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def fan_out(self, request: web.Request, body: bytes) -> web.Response:
        """Send the request to every healthy worker: /flush_cache (all must succeed), /abort_request
        (the counts are summed)."""
        healthy = [w for w in self.workers if w.healthy]
        if not healthy:
            return error_response(503, "no worker is healthy", "no_healthy_worker")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}

        async def one(w: Worker) -> tuple[int, bytes]:
            try:
                async with self.client.request(request.method, w.url + request.path_qs, data=body or None,
                                               headers=headers) as r:
                    return r.status, await r.read()
            except (TimeoutError, *_CONNECTION_ERRORS) as e:
                return 503, json.dumps({"error": {"message": f"worker {w.url} failed: {e}",
                                                  "type": "service_unavailable_error", "param": None,
                                                  "code": "worker_lost"}}).encode()

        answers = await asyncio.gather(*(one(w) for w in healthy))
        for status, data in answers:
            if status != 200:
                return web.Response(body=data, status=status, content_type="application/json")
        if request.path == "/abort_request":
            total = sum(int(parse_body(d).get("aborted", 0)) for _, d in answers if isinstance(parse_body(d), dict))
            return web.json_response({"aborted": total})
        if request.path == "/flush_cache":
            for w in healthy:
                self.policy.forget(w.index)
        return web.Response(body=answers[0][1], status=200, content_type="application/json")

    async def info(self, request: web.Request) -> dict[str, Any]:
        """The router's state and each worker's own /get_server_info."""
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}

        async def one(w: Worker) -> Any:
            if not w.healthy:
                return None
            try:
                async with self.client.get(w.url + "/get_server_info", headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=self.config.health_timeout)) as r:
                    return await r.json() if r.status == 200 else None
            except (TimeoutError, ValueError, *_CONNECTION_ERRORS):
                return None

        infos = await asyncio.gather(*(one(w) for w in self.workers))
        return {"router": {"policy": self.config.policy, "sessions": len(self.sessions)},
                "workers": [{"url": w.url, "healthy": w.healthy, "in_flight": w.in_flight,
                             "tree_chars": self.policy.remembered(w.index), "server_info": i}
                            for w, i in zip(self.workers, infos, strict=True)]}


def _shows_workers(request: web.Request) -> bool:
    """Whether answers to this request may name workers: not to a client without --api-key's key."""
    return bool(request.get(_SHOW_WORKERS, False))


def _name(request: web.Request, w: Worker) -> str:
    return f"worker {w.url}" if _shows_workers(request) else "the worker"


def _passed(request: web.Request, upstream: aiohttp.ClientResponse) -> dict[str, str]:
    """The worker's response headers, plus which worker answered (to a client that may know)."""
    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP}
    if _shows_workers(request):
        headers[WORKER_HEADER] = str(upstream.url.origin())
    return headers


ROUTER_KEY = web.AppKey("router", Router)


def create_app(config: RouterConfig) -> web.Application:
    """The router app; the workers' health is checked from its startup on."""
    app = web.Application(client_max_size=config.max_request_bytes, middlewares=[_errors, _guard])

    async def on_startup(app: web.Application) -> None:
        router = app[ROUTER_KEY] = Router(config)
        await router.start()

    async def on_cleanup(app: web.Application) -> None:
        await app[ROUTER_KEY].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, _server_info)
    app.router.add_post("/open_session", _open_session)
    app.router.add_post("/close_session", _close_session)
    app.router.add_route("*", "/{tail:.*}", _pass_through)
    return app


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as JSON in the server's shape; a request the router refuses is logged in one
    line (no traceback: a client cannot fill the log), and bad input is never a 500."""
    try:
        resp = await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _refused(request, Refused(e.status, _too_large(request) if e.status == 413 else e.reason))
    except Refused as e:
        resp = _refused(request, e)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.rel_url.raw_path[:200])
        detail = f": {e}" if _shows_workers(request) else ""
        resp = error_response(500, f"internal router error: {type(e).__name__}{detail}; the router log has the "
                              "traceback", "internal_error")
    request.app[ROUTER_KEY].metrics.responses.labels(str(resp.status)).inc()
    return resp


def _refused(request: web.Request, e: Refused) -> web.Response:
    log.warning("refused %s %s from %s: %d %s", request.method, request.rel_url.raw_path[:200], request.remote,
                e.status, e.message)
    return error_response(e.status, e.message, e.code)


def _too_large(request: web.Request) -> str:
    return (f"the request body is larger than the limit of {request.app[ROUTER_KEY].config.max_request_bytes} "
            "bytes (--max-request-bytes)")


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The API key, then the body size limit, before any handler reads the body (the server's order):
    a request without the key never reaches the routing state."""
    config = request.app[ROUTER_KEY].config
    header = request.headers.get("Authorization", "")
    shown = config.api_key is None or _key_matches(header, config.api_key)
    if not shown and request.path not in OPEN_ROUTES:
        what = "is missing" if not header else "is not valid"
        raise Refused(401, f"the API key {what}: send the header 'Authorization: Bearer <key>'", "invalid_api_key")
    if request.content_length is not None and request.content_length > config.max_request_bytes:
        raise Refused(413, _too_large(request))
    request[_SHOW_WORKERS] = shown
    return await handler(request)


def _key_matches(header: str, key: str) -> bool:
    """The server's rule: `Bearer <key>`, compared in constant time, the header's bytes as sent (aiohttp
    keeps a non-UTF-8 byte as a surrogate escape); only HTTP whitespace around the key is dropped."""
    scheme, _, token = header.partition(" ")
    sent = token.strip(" \t").encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, key.encode())


async def _read(request: web.Request) -> tuple[bytes, dict[str, Any] | None]:
    """The body, and on a route the router reads (keys.BODY_ROUTES) the JSON object in it; there a
    body the server would not read is refused as the server does (415, then 413, then 400)."""
    if request.method != "POST" or request.path not in BODY_ROUTES:
        return await request.read(), None
    _check_json_type(request)
    body = await request.read()
    try:
        if len(body) > _PARSE_INLINE_BYTES:
            return body, await asyncio.to_thread(json_object, body)
        return body, json_object(body)
    except ValueError as e:
        raise Refused(400, str(e)) from None


def _check_json_type(request: web.Request) -> None:
    """The server's 415 (its check_json_type, same messages): a body not sent as JSON in UTF-8 is
    what a web page can POST cross-site without asking first, so it is refused before it is read."""
    sent = request.headers.get("Content-Type")
    if sent is None:
        raise Refused(415, f"the request has no Content-Type header; send the JSON body with "
                           f"'Content-Type: {_JSON_TYPE}'", "unsupported_media_type")
    if request.content_type != _JSON_TYPE:
        shown = sent if len(sent) <= 80 else sent[:77] + "..."
        raise Refused(415, f"the request body is sent as {shown!r}; this route reads JSON: send it with "
                           f"'Content-Type: {_JSON_TYPE}'", "unsupported_media_type")
    charset = request.charset
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise Refused(415, f"the request body is sent in charset {charset[:40]!r}; JSON bodies are read as UTF-8: "
                           f"send UTF-8 text with 'Content-Type: {_JSON_TYPE}' (or '; charset=utf-8')",
                      "unsupported_media_type")


async def _health(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    healthy = sum(w.healthy for w in router.workers)
    if not healthy:
        return error_response(503, "no worker is healthy", "no_healthy_worker")
    return web.json_response({"status": "ok", "healthy_workers": healthy, "workers": len(router.workers)})


async def _metrics(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    router.metrics.sessions.set(len(router.sessions))
    for w in router.workers:
        router.metrics.healthy.labels(w.url).set(int(w.healthy))
        router.metrics.in_flight.labels(w.url).set(w.in_flight)
    return web.Response(body=generate_latest(router.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _server_info(request: web.Request) -> web.Response:
    return web.json_response(await request.app[ROUTER_KEY].info(request))


async def _open_session(request: web.Request) -> web.StreamResponse:
    """Opened on the policy's choice (no prompt yet: the least loaded), then bound to it."""
    router = request.app[ROUTER_KEY]
    body = await request.read()
    resp = await router.proxy(request, body)
    if resp.status == 200 and isinstance(resp, web.Response) and resp.body is not None:
        sid = parse_body(bytes(resp.body))  # type: ignore[arg-type]
        worker = _answered_by(router, resp)
        if isinstance(sid, str) and worker is not None:
            router.sessions.bind(sid, worker)
    return resp


async def _close_session(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    body, parsed = await _read(request)
    sid = session_of(request.path, parsed)
    pinned = router.sessions.get(sid) if sid else None
    resp = await router.proxy(request, body, pinned=pinned)
    if sid and resp.status == 200:
        router.sessions.drop(sid)
    return resp


async def _pass_through(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    body, parsed = await _read(request)
    if request.path in _FAN_OUT:
        return await router.fan_out(request, body)
    sid = session_of(request.path, parsed)
    pinned = router.sessions.get(sid) if sid else None
    return await router.proxy(request, body, routing_key(request.path, parsed), pinned)


def _answered_by(router: Router, resp: web.StreamResponse) -> int | None:
    index = resp.get("worker")
    return index if isinstance(index, int) else None
