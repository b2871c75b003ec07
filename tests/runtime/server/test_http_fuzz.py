"""Property-based HTTP fuzzing of every route in /openapi.json (schemathesis), against one real
`radixlm serve` on 127.0.0.1 started once for this module.

Each operation gets schema-valid (positive) and schema-violating (negative) requests, a bounded
number of each, with a per-request timeout. Every response must be: not a 5xx, documented for
that route, of the documented content type and schema, and every error a JSON Error body whose
message names the problem. Afterwards the server is healthy and a greedy /generate returns the
same text as before the fuzzing. Generated values that would only make a run long are bounded
(docs/reliability.md): at most 4 new tokens, n <= 2, batches of at most 4 prompts.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from json_tree import json_objects
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from server_harness import Server, start_server

pytestmark = pytest.mark.slow

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
REQUEST_TIMEOUT_S = 60.0  # a request that takes longer counts as a hang
MAX_NEW_TOKENS = 4
MAX_COPIES = 2  # n, best_of
MAX_PROMPTS = 4
# Examples per operation and generation mode; routes that run the model or take input get more.
EXAMPLES = {"POST /generate": 20, "POST /v1/completions": 15, "POST /v1/chat/completions": 15}
BODY_EXAMPLES = 8
OTHER_EXAMPLES = 2
TOKEN_FIELDS = ("max_new_tokens", "min_new_tokens", "max_tokens", "max_completion_tokens", "min_tokens")
COPY_FIELDS = ("n", "best_of")
PROMPT_FIELDS = ("text", "input_ids", "prompt", "messages")
GREEDY = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
RAN: Counter[str] = Counter()  # cases run per operation (reported at the end)


@pytest.fixture(scope="module")
def server():
    s = start_server("--dtype", "float32", "--context-length", "128", "--max-total-tokens", "8192",
                     "--max-queued-requests", "64", "--api-key", API_KEY, "--debug-routes", "true")
    s.headers = AUTH
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def spec(server: Server) -> dict[str, Any]:
    status, spec = server.get("/openapi.json", headers={"Authorization": ""})  # open route
    assert status == 200 and spec["openapi"].startswith("3.1")
    return spec


@pytest.fixture(scope="module")
def greedy_before(server: Server, spec) -> str:
    """The greedy text before any fuzzing (the `spec` fixture runs first)."""
    return server.generate(GREEDY)["text"]


@pytest.fixture(scope="module")
def schema(spec: dict[str, Any]):
    return schemathesis.openapi.from_dict(bounded(spec))


def bounded(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with generated values kept small where they only make runs long."""
    spec = copy.deepcopy(spec)

    for x in json_objects(spec):
        props = x.get("properties", {})
        for key, limit in [*((k, MAX_NEW_TOKENS) for k in TOKEN_FIELDS), *((k, MAX_COPIES) for k in COPY_FIELDS)]:
            if key in props:
                for s in _alternatives(props[key]):
                    if s.get("type") == "integer":
                        s["maximum"] = min(s.get("maximum", limit), limit)
        for key in PROMPT_FIELDS:
            if key in props:
                for s in _alternatives(props[key]):
                    if s.get("type") == "array":
                        s["maxItems"] = MAX_PROMPTS
    return spec


def _alternatives(s: dict[str, Any]) -> list[dict[str, Any]]:
    return [s, *s.get("anyOf", [])]


def bound_work(path: str, body: Any) -> Any:
    """Negative cases may break the bounds above with values the server accepts (max_new_tokens:
    10**6 is valid), and a request without a token limit takes the server's default: clamp the
    first and give the second the bound, so no request runs long. Invalid values (-1, 2.5, "x") stay."""
    body = _clamped(body)
    if not isinstance(body, dict):
        return body
    limit = {"max_new_tokens": MAX_NEW_TOKENS}
    if path == "/generate":
        sp = body.get("sampling_params")
        if sp is None:
            body["sampling_params"] = limit
        elif isinstance(sp, dict) and sp.get("max_new_tokens") is None:
            sp.update(limit)
        elif isinstance(sp, list):
            body["sampling_params"] = [_with_limit(p, limit) for p in sp]
    elif path in ("/v1/completions", "/v1/chat/completions"):
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_NEW_TOKENS
    elif path == "/run_program":
        _bound_gens(body.get("graph"), limit)
    return body


def _bound_gens(node: Any, limit: dict[str, int]) -> None:
    """Give every gen node of a request graph without a token limit the bound (a valid graph of
    many gens at the server's default length could outrun the request timeout on a loaded machine)."""
    if isinstance(node, list):
        for item in node:
            _bound_gens(item, limit)
    elif isinstance(node, dict):
        if node.get("op") == "gen":
            sampling = node.get("sampling")
            if sampling is None:
                node["sampling"] = dict(limit)
            elif isinstance(sampling, dict) and sampling.get("max_new_tokens") is None:
                sampling.update(limit)
        for value in node.values():
            _bound_gens(value, limit)


def _with_limit(p: Any, limit: dict[str, int]) -> Any:
    if p is None:
        return limit
    return {**limit, **{k: v for k, v in p.items() if v is not None}} if isinstance(p, dict) else p


def _clamped(body: Any) -> Any:
    if isinstance(body, dict):
        out = {}
        for k, v in body.items():
            if k in TOKEN_FIELDS and _is_int(v) and v > MAX_NEW_TOKENS:
                v = MAX_NEW_TOKENS
            elif k in COPY_FIELDS and _is_int(v) and v > MAX_COPIES:
                v = MAX_COPIES
            elif k in PROMPT_FIELDS and isinstance(v, list):
                v = v[:MAX_PROMPTS]
            out[k] = _clamped(v)
        return out
    if isinstance(body, list):
        return [_clamped(v) for v in body]
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_error_body(response: schemathesis.Response) -> None:
    """Every error is JSON {"error": {message, ...}} whose message says what is wrong."""
    if response.status_code < 400:
        return
    content_type = response.headers.get("content-type", [""])[0]
    assert content_type.startswith("application/json"), (content_type, response.text[:200])
    err = response.json()["error"]
    assert isinstance(err["message"], str) and len(err["message"]) >= 10, err
    if response.status_code == 400 and err["param"]:  # the field at fault is named in the message
        leaf = err["param"].split("[")[0].split(".")[0]
        # (as typed, or as its repr where it holds characters that would not show, e.g. '\x1f')
        assert leaf in err["message"] or repr(leaf) in err["message"], err


def response_schema(spec: dict[str, Any], method: str, path: str, status: int = 200) -> dict[str, Any]:
    """The JSON response schema of one route, standalone (its $refs resolve in the spec's components)."""
    resp = spec["paths"][path][method]["responses"][str(status)]
    if "$ref" in resp:
        resp = spec["components"]["responses"][resp["$ref"].rsplit("/", 1)[-1]]
    return {**resp["content"]["application/json"]["schema"], "components": spec["components"]}


def assert_valid(spec: dict[str, Any], method: str, path: str, status: int, body: Any) -> None:
    jsonschema.Draft202012Validator(response_schema(spec, method, path, status)).validate(body)


def test_real_responses_validate_against_the_spec(server: Server, spec):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    calls = [
        ("get", "/health", None), ("get", "/get_model_info", None), ("get", "/get_server_info", None),
        ("get", "/v1/models", None), ("get", "/v1/models/smollm2-135m-instruct", None),
        ("post", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0},
                               "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
                               "return_text_in_logprobs": True}),
        ("post", "/generate", {"text": ["Hi", "Yo"], "sampling_params": {"max_new_tokens": 2, "n": 2}}),
        ("post", "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "echo": True}),
        ("post", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
        ("post", "/tokenize", {"prompt": ["Hi", "there"]}), ("post", "/detokenize", {"tokens": [[19556], [2]]}),
        ("post", "/abort_request", {"abort_all": True}), ("post", "/flush_cache", None),
        ("post", "/concate_and_append_request", {"src_rids": ["a", "b"], "dst_rid": "c"}),
    ]
    for method, path, body in calls:
        status, out = server.request(method.upper(), path, body)
        assert status == 200, (path, out)
        assert_valid(spec, method, "/v1/models/{model}" if path.startswith("/v1/models/") else path, 200, out)
    status, sid = server.post("/open_session", {"ttl": 60})
    assert status == 200
    assert_valid(spec, "post", "/open_session", 200, sid)
    status, out = server.post("/close_session", {"session_id": sid})
    assert_valid(spec, "post", "/close_session", 200, out)
    # errors: the Error shape, and the schema refuses what is not one
    for method, path, body, code in [("post", "/generate", {"text": "Hi", "bogus": 1}, 400),
                                     ("post", "/close_session", {"session_id": sid}, 404),
                                     ("get", "/v1/models/nope", None, 404)]:
        status, out = server.request(method.upper(), path, body)
        assert status == code, out
        assert_valid(spec, method, "/v1/models/{model}" if path.startswith("/v1/models/") else path, code, out)
    status, out = server.get("/get_model_info", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    assert_valid(spec, "get", "/get_model_info", 401, out)
    with pytest.raises(jsonschema.ValidationError):
        assert_valid(spec, "get", "/health", 200, {"status": "fine"})


def fuzz_runs() -> list[tuple[str, GenerationMode]]:
    """(operation, mode) pairs: negative cases only where there is input to get wrong."""
    from radixlm.runtime.server.openapi import openapi_spec
    from radixlm.runtime.server.settings import ServerSettings

    runs = []
    for path, item in openapi_spec(ServerSettings())["paths"].items():
        for method, op in item.items():
            runs.append((f"{method.upper()} {path}", GenerationMode.POSITIVE))
            if "requestBody" in op or op.get("parameters") or "{" in path:
                runs.append((f"{method.upper()} {path}", GenerationMode.NEGATIVE))
    return runs


def examples_for(label: str, op: Any) -> int:
    if label in EXAMPLES:
        return EXAMPLES[label]
    return BODY_EXAMPLES if op.body else OTHER_EXAMPLES


@pytest.mark.parametrize(("label", "mode"), fuzz_runs(), ids=lambda x: x if isinstance(x, str) else x.value)
def test_fuzz_operation(server: Server, schema, greedy_before: str, label: str, mode: GenerationMode):
    method, path = label.split(" ", 1)
    op = schema[path][method]
    session = requests.Session()

    @settings(max_examples=examples_for(label, op), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(mode))
    def run(case) -> None:
        if isinstance(case.body, (dict, list)):
            case.body = bound_work(path, case.body)
        try:
            response = case.call(base_url=server.url, session=session, headers=AUTH, timeout=REQUEST_TIMEOUT_S)
        except requests.Timeout:
            pytest.fail(f"no answer within {REQUEST_TIMEOUT_S:.0f} s: {case.as_curl_command()}")
        RAN[label] += 1
        case.validate_response(response, checks=CHECKS)
        check_error_body(response)

    run()


@pytest.mark.parametrize(("path", "body", "named"), [
    # SamplingParams raised TypeError / OverflowError (500), or took a string as a list of choices
    ("/generate", {"text": "Hi", "sampling_params": {"choices": 5}}, "choices"),
    ("/generate", {"text": "Hi", "sampling_params": {"choices": "abc"}}, "choices"),
    ("/generate", {"text": "Hi", "sampling_params": {"temperature": 10**400}}, "temperature"),
    # an out-of-vocabulary stop token id blocked before min_new_tokens failed the whole engine step (500
    # for every request in the batch)
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 1,
                                                     "stop_token_ids": [60000]}}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [10**30]},
     "stop_token_ids"),
    # n or a batch larger than the server admits was expanded first (n = 10**9: memory and time)
    ("/generate", {"text": "Hi", "sampling_params": {"n": 10**9}}, "--max-queued-requests"),
    ("/generate", {"text": ["Hi"] * 65}, "65 prompts"),
    ("/generate", {"input_ids": [[1]] * 65}, "65 prompts"),
    ("/v1/completions", {"prompt": ["Hi"] * 65, "max_tokens": 1}, "65 prompts"),
    ("/v1/completions", {"prompt": ["Hi"] * 2, "n": 40, "max_tokens": 1}, "80 completions"),
])
def test_fuzzing_findings_are_clear_400s(server: Server, path: str, body: dict[str, Any], named: str):
    status, out = server.post(path, body)
    assert status == 400, out
    assert named in out["error"]["message"], out


def test_server_is_healthy_after_fuzzing(server: Server, greedy_before: str):
    assert server.proc.poll() is None, server.log()
    assert server.get("/health") == (200, {"status": "ok"})
    assert server.get("/health_generate") == (200, {"status": "ok"})
    assert server.generate(GREEDY)["text"] == greedy_before
    status, report = server.get("/debug/check")  # KV accounting and radix cache integrity
    assert status == 200 and report["ok"], report
    server.wait_until("no request in flight", lambda i: i["requests_in_flight"] == 0
                      and i["stats"]["running_requests"] == 0 and i["stats"]["waiting_requests"] == 0)
    print(f"\nfuzz cases run: {sum(RAN.values())} over {len(RAN)} operations: {dict(RAN)}")
