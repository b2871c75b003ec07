"""The router answers like the server: bodies it cannot read and requests without the API key are
refused by the router itself (the server's JSON errors, one warning line each in its log, never a
500), before anything reaches the routing state, and clients without the key never see worker urls.

`lone`: a real `radixlm route --api-key` over a port nobody listens on (whatever it forwarded would be
a 503), so every 400/401 below is the router's own. `guarded`: the same over a real `radixlm serve
--api-key` on a tiny random model, where requests that got past the router would reach the trees.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from server_harness import WORKER, Router, Server, raw_call, start_router, start_server

from radixlm.router.keys import BODY_ROUTES
from radixlm.testing import free_port, poll

KEY = "router-guard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 1_000_000
DEEP = 100_000
BAD_BODIES = {  # name: (body, words of the router's message)
    "deep_object": (b'{"a":' * DEEP + b"1" + b"}" * DEEP, "nested too deeply"),
    "deep_array": (b"[" * DEEP + b"]" * DEEP, "nested too deeply"),
    "huge_integer": (b'{"text": "a", "sampling_params": {"max_new_tokens": ' + b"9" * 5000 + b"}}",
                     "more than 4300 digits"),
    "not_utf8": (b'{"text": "caf\xe9"}', "not valid UTF-8 (byte 13 is not)"),
    "not_json": (b"text=hello", "not valid JSON"),
    "empty": (b"", "is empty"),
    "not_an_object": (b'["hello"]', "must be a JSON object, got an array"),
}


@pytest.fixture(scope="module")
def lone() -> Iterator[Router]:
    r = start_router(["route", "--worker-urls", f"http://127.0.0.1:{free_port()}", "--max-request-bytes",
                      str(MAX_BYTES)], healthy_workers=0, api_key=KEY)
    yield r
    assert r.stop() == 0


@pytest.fixture(scope="module")
def worker() -> Iterator[Server]:
    s = start_server("--model", "dummy:llama-tiny", "--dtype", "float32", "--max-total-tokens", "4096",
                     api_key=KEY)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def guarded(worker: Server) -> Iterator[Router]:
    r = start_router(["route", "--worker-urls", worker.url, "--health-interval", "0.2", "--health-timeout", "1",
                      "--health-failures", "1"], healthy_workers=1, api_key=KEY)
    yield r
    assert r.stop() == 0


class OneLogLine:
    """Counts the router's log lines while a request runs: one warning naming it, no traceback."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def __enter__(self) -> OneLogLine:
        self.before = self.router.log().splitlines()
        return self

    def __exit__(self, *exc: object) -> None:
        new = self.router.log().splitlines()[len(self.before):]  # written before the answer was sent
        assert len(new) == 1 and " WARNING refused " in new[0], new
        assert "Traceback" not in self.router.log()


def error_of(status: int, data: bytes, expected: int) -> dict[str, Any]:
    """The server's error body: exactly {"error": {message, type, param, code}}."""
    assert status == expected, data
    body = json.loads(data)
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


# -- the router's own answers (no worker behind it) ---------------------------------------------------
@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_a_body_the_router_cannot_read_is_its_own_400(lone: Router, name: str) -> None:
    raw, words = BAD_BODIES[name]
    with OneLogLine(lone):
        status, headers, data = lone.request("POST", "/generate", raw, AUTH)
    err = error_of(status, data, 400)  # not the 503 a forwarded request gets
    assert words in err["message"] and err["type"] == "invalid_request_error", err
    assert WORKER not in headers


@pytest.mark.parametrize("path", sorted(BODY_ROUTES))
def test_every_route_the_router_reads_refuses_a_deep_body(lone: Router, path: str) -> None:
    with OneLogLine(lone):
        status, _, data = lone.request("POST", path, BAD_BODIES["deep_array"][0], AUTH)
    assert "nested too deeply" in error_of(status, data, 400)["message"]


@pytest.mark.parametrize(("content_type", "says"), [
    ("text/plain", "is sent as 'text/plain'; this route reads JSON"),
    ("application/x-www-form-urlencoded", "is sent as 'application/x-www-form-urlencoded'"),
    ("application/json; charset=latin-1", "charset 'latin-1'"),
])
def test_a_body_not_sent_as_json_is_a_415_before_it_is_read(lone: Router, content_type: str, says: str) -> None:
    with OneLogLine(lone):
        status, _, data = lone.request("POST", "/generate", BAD_BODIES["deep_array"][0],
                                       {**AUTH, "Content-Type": content_type})
    err = error_of(status, data, 415)
    assert says in err["message"] and err["code"] == "unsupported_media_type", err


def test_a_body_past_the_limit_is_a_413_and_the_key_comes_first(lone: Router) -> None:
    big = b'{"text": "' + b"a" * MAX_BYTES + b'"}'
    with OneLogLine(lone):
        status, _, data = lone.request("POST", "/generate", big, AUTH)
    assert f"limit of {MAX_BYTES} bytes" in error_of(status, data, 413)["message"]
    with OneLogLine(lone):
        status, _, data = lone.request("POST", "/generate", big)
    assert error_of(status, data, 401)["code"] == "invalid_api_key"


@pytest.mark.parametrize(("method", "path", "raw", "header", "says"), [
    ("POST", "/generate", BAD_BODIES["deep_object"][0], None, "is missing"),  # the key before the body
    ("POST", "/generate", BAD_BODIES["huge_integer"][0], f"Bearer {KEY}x", "is not valid"),
    ("POST", "/v1/chat/completions", b"{}", f"Basic {KEY}", "is not valid"),
    ("GET", "/metrics", None, None, "is missing"),
    ("GET", "/get_server_info", None, "Bearer", "is not valid"),
    ("POST", "/flush_cache", None, None, "is missing"),
    ("GET", "/v1/models", None, None, "is missing"),
])
def test_without_the_key_the_router_answers_401(lone: Router, method: str, path: str, raw: bytes | None,
                                                header: str | None, says: str) -> None:
    with OneLogLine(lone):
        status, headers, data = lone.request(method, path, raw, {"Authorization": header} if header else None)
    err = error_of(status, data, 401)
    assert err == {"message": f"the API key {says}: send the header 'Authorization: Bearer <key>'",
                   "type": "authentication_error", "param": None, "code": "invalid_api_key"}
    assert headers["WWW-Authenticate"] == "Bearer" and str(lone.port) not in data.decode()


def test_open_routes_and_the_key_with_http_whitespace(lone: Router) -> None:
    assert lone.request("GET", "/health")[0] == 503  # open: the router's own (no worker is healthy)
    status, _, data = lone.request("GET", "/get_server_info", None, {"Authorization": f"bearer \t{KEY} "})
    assert status == 200 and json.loads(data)["workers"][0]["healthy"] is False


# -- over a real worker: nothing of a keyless request gets past the router -------------------------------
def test_keyless_requests_never_reach_the_routing_state(guarded: Router, worker: Server) -> None:
    prompt = "The router remembers this prompt for its worker. "
    out, url = guarded.generate({"text": prompt, "sampling_params": {"max_new_tokens": 1}})
    assert url == worker.url and out["meta_info"]["completion_tokens"] == 1
    before = guarded.workers()[0]
    assert before["tree_chars"] == len(prompt)  # keyed requests are remembered
    routed = guarded.metric("radixlm_router_requests_total")
    seen_by_worker = worker.metric("radixlm_http_responses_total", 'status="401"')

    keyless = [("/generate", {"text": "A keyless client's prompt, long enough to be remembered."}),
               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "keyless"}]}),
               ("/v1/completions", {"prompt": "keyless completion"}),
               ("/run_program", {"graph": {"text": "keyless program"}}),
               ("/open_session", {}),
               ("/generate", {"text": "keyless turn", "session_params": {"id": "keyless-session"}})]
    for path, body in keyless:
        for header in (None, {"Authorization": "Bearer wrong"}):
            status, headers, data = guarded.request("POST", path, json.dumps(body).encode(), header)
            assert status == 401 and WORKER not in headers, data

    after = guarded.workers()[0]
    assert after["tree_chars"] == before["tree_chars"] and after["in_flight"] == 0
    assert guarded.call("GET", "/get_server_info")[1]["router"]["sessions"] == 0
    assert guarded.metric("radixlm_router_requests_total") == routed
    assert worker.metric("radixlm_http_responses_total", 'status="401"') == seen_by_worker  # none forwarded


def test_worker_urls_only_to_clients_with_the_key(guarded: Router, worker: Server) -> None:
    port = str(worker.port)
    status, headers, data = guarded.request("GET", "/openapi.json")  # open on the server: passed through
    assert status == 200 and json.loads(data)["openapi"].startswith("3.1")
    assert WORKER not in headers and port not in data.decode()
    for path in ("/get_server_info", "/metrics"):
        status, headers, data = guarded.request("GET", path)
        assert status == 401 and port not in data.decode() and WORKER not in headers
    status, headers, _ = guarded.request("GET", "/openapi.json", None, AUTH)
    assert status == 200 and headers[WORKER] == worker.url
    assert port in guarded.call("GET", "/metrics")[1]


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_the_router_refuses_a_body_as_the_worker_does(guarded: Router, worker: Server, name: str) -> None:
    raw = BAD_BODIES[name][0]
    w_status, w_out = worker.post("/generate", raw=raw)
    with OneLogLine(guarded):
        status, headers, data = guarded.request("POST", "/generate", raw, AUTH)
    err = error_of(status, data, w_status)
    assert WORKER not in headers  # answered by the router itself
    assert err == w_out["error"]  # the same type, param, code and message


def test_bodies_of_other_routes_pass_through_unread(guarded: Router, worker: Server) -> None:
    raw = BAD_BODIES["deep_object"][0]
    direct = worker.post("/tokenize", raw=raw)
    status, headers, data = guarded.request("POST", "/tokenize", raw, AUTH)
    assert (status, json.loads(data)) == direct and status == 400 and headers[WORKER] == worker.url


def test_the_router_401_is_the_workers(guarded: Router, worker: Server) -> None:
    for header in (None, {"Authorization": "Bearer nope"}):
        w_status, w_headers, w_data = raw_call(worker.url + "/generate", "POST", b"{}", header)
        status, headers, data = guarded.request("POST", "/generate", b"{}", header)
        assert (status, data) == (w_status, w_data) == (401, data)  # byte for byte
        assert headers["WWW-Authenticate"] == w_headers["WWW-Authenticate"] == "Bearer"
        assert headers["Content-Type"] == w_headers["Content-Type"]


def test_a_worker_that_fails_is_not_named_to_a_keyless_client(guarded: Router, worker: Server) -> None:
    """Last: the worker hangs (SIGSTOP) under an open route's request, is taken out, and comes back."""
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        status, headers, data = guarded.request("GET", "/openapi.json")  # answered once the worker is out
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)
    err = error_of(status, data, 503)
    assert err["message"] == "every worker tried failed" and err["code"] == "no_healthy_worker", err
    assert WORKER not in headers and str(worker.port) not in data.decode()
    poll("the worker rejoins", lambda: guarded.call("GET", "/health")[1].get("healthy_workers") == 1)


# -- `radixlm serve --dp-size N --api-key`: the router it starts checks the key too -----------------------
def test_the_router_of_serve_dp_checks_the_replicas_key() -> None:
    r = start_router(["serve", "--dp-size", "2", "--model", "dummy:llama-tiny", "--dtype", "float32",
                      "--max-total-tokens", "4096"], healthy_workers=2, api_key=KEY)
    try:
        for method, path, raw in (("POST", "/generate", b'{"text": "hi"}'), ("GET", "/metrics", None)):
            with OneLogLine(r):  # refused by the router itself, not passed back from a replica
                status, headers, data = r.request(method, path, raw)
            assert error_of(status, data, 401)["code"] == "invalid_api_key" and WORKER not in headers
        status, headers, data = r.request("POST", "/generate", b'{"text": "hi", "sampling_params": '
                                          b'{"max_new_tokens": 1}}', AUTH)
        assert status == 200 and headers[WORKER] in {w["url"] for w in r.workers()}, data
    finally:
        assert r.stop() == 0
