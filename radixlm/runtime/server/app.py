"""The aiohttp application: routes, and the middleware every route shares (errors, auth, limits)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from radixlm.runtime.server import native_api, openai_api, program_api
from radixlm.runtime.server.context import CONTEXT, ServerContext
from radixlm.runtime.server.errors import ApiError, error_body
from radixlm.runtime.server.metrics import CONTENT_TYPE
from radixlm.runtime.server.openapi import openapi_spec
from radixlm.runtime.server.payload import json_response, too_large

log = logging.getLogger("radixlm.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# answered without the API key (load balancers, orchestrators, API tooling)
OPEN_ROUTES = frozenset({"/health", "/openapi.json"})


def create_app(ctx: ServerContext) -> web.Application:
    app = web.Application(middlewares=[_errors, _guard], client_max_size=ctx.settings.max_request_bytes)
    app[CONTEXT] = ctx
    app.add_routes(native_api.routes())
    app.add_routes(openai_api.routes())
    app.add_routes(program_api.routes())
    app.add_routes([web.get("/metrics", metrics), web.get("/openapi.json", openapi)])
    return app


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI 3.1 description of every route, with this server's limits."""
    return json_response(openapi_spec(request.app[CONTEXT].settings))


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format; engine gauges are refreshed from the engine's stats on each scrape."""
    ctx = request.app[CONTEXT]
    await ctx.stats()
    return web.Response(body=ctx.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as JSON in OpenAI's shape; bad input is never a 500."""
    ctx = request.app[CONTEXT]
    try:
        resp = await handler(request)
    except ApiError as e:
        headers = dict(e.headers or {})
        if e.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        resp = json_response(e.body(), e.status, headers or None)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = json_response(error_body(e.status, _http_message(request, e)), e.status, _allow(e))
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        resp = json_response(error_body(500, f"internal server error: {type(e).__name__}: {e}; the server log has "
                                             "the traceback", code="internal_error"), 500)
    ctx.metrics.http_responses.labels(str(resp.status)).inc()
    return resp


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """API key, then the body size limit, before any handler reads anything."""
    settings = request.app[CONTEXT].settings
    if settings.api_key is not None and request.path not in OPEN_ROUTES:
        header = request.headers.get("Authorization", "")
        if not _key_matches(header, settings.api_key):
            what = "is missing" if not header else "is not valid"
            raise ApiError(401, f"the API key {what}: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
    if request.content_length is not None and request.content_length > settings.max_request_bytes:
        raise too_large(settings.max_request_bytes)
    return await handler(request)


def _key_matches(header: str, key: str) -> bool:
    """`Bearer <key>`, compared in constant time. The header's bytes are compared as sent (aiohttp
    keeps a non-UTF-8 byte as a surrogate escape); only HTTP whitespace around the key is dropped."""
    scheme, _, token = header.partition(" ")
    sent = token.strip(" \t").encode("utf-8", "surrogateescape")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent, key.encode())


def _http_message(request: web.Request, e: web.HTTPException) -> str:
    if e.status == 404:
        return f"no route {request.method} {request.path}; see docs/server.md for the routes"
    if e.status == 405:
        return f"{request.method} is not allowed on {request.path}"
    if e.status == 413:
        return f"the request body is larger than the limit of {request.app[CONTEXT].settings.max_request_bytes} bytes"
    return e.reason


def _allow(e: web.HTTPException) -> dict[str, str] | None:
    allow = e.headers.get("Allow")
    return {"Allow": allow} if allow else None
