"""The OpenAPI description stays true to the app: the same routes and methods, the same request
fields as the handlers accept, valid JSON Schemas with resolvable references (no model needed).
Real responses are validated against it in test_http_fuzz.py, which runs a server."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from json_tree import json_objects

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.sampling_params import ALIASES, EMPTY_ONLY, SamplingParams
from radixlm.runtime.server import native_api, openai_api, program_api
from radixlm.runtime.server.app import create_app
from radixlm.runtime.server.context import ServerContext
from radixlm.runtime.server.openapi import openapi_spec
from radixlm.runtime.server.settings import ServerSettings

METHODS = ("get", "post", "put", "patch", "delete", "head", "options")


def registered_routes(settings: ServerSettings) -> set[tuple[str, str]]:
    """(method, path) of every route of the real app. aiohttp adds HEAD to each GET route by
    itself (allow_head): a HEAD whose GET is registered counts as that GET's."""
    app = create_app(ServerContext(settings, EngineConfig()))
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()}
    return {(m, p) for m, p in routes if not (m == "head" and ("get", p) in routes)}


def described_routes(spec: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m, path) for path, item in spec["paths"].items() for m in item if m in METHODS}


def schema_of(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return spec["components"]["schemas"][name]


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return openapi_spec(ServerSettings())


def test_every_registered_route_is_described_and_every_described_route_is_registered(spec):
    registered, described = registered_routes(ServerSettings()), described_routes(spec)
    assert registered - described == set(), "routes missing from radixlm/runtime/server/openapi.py"
    assert described - registered == set(), "described routes the app does not register"


def test_the_spec_is_openapi_31_with_valid_json_schemas_and_resolvable_refs(spec):
    assert spec["openapi"].startswith("3.1") and json.loads(json.dumps(spec)) == spec
    for name, schema in spec["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
    refs = [x["$ref"] for x in json_objects(spec) if isinstance(x.get("$ref"), str)]
    assert refs
    for ref in refs:
        node: Any = spec
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]  # KeyError: a dangling reference
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if method in METHODS:
                assert "200" in op["responses"] and op["summary"], (method, path)


def test_request_fields_are_exactly_what_the_handlers_accept(spec):
    def fields(name: str) -> set[str]:
        return set(schema_of(spec, name)["properties"])

    assert fields("SamplingParams") == set(SamplingParams.field_names()) | set(ALIASES) | set(EMPTY_ONLY)
    assert fields("SessionParams") == {"id", "rid", "offset", "replace", "drop_previous_output"}
    native = set(native_api.GENERATE_FIELDS) | set(native_api.GENERATE_IGNORED) | set(native_api.GENERATE_UNSUPPORTED)
    assert fields("GenerateRequest") == native
    extra = set(openai_api.IGNORED_FIELDS) | set(openai_api.UNSUPPORTED_FIELDS)
    assert fields("CompletionRequest") == set(openai_api.COMPLETION_FIELDS) | extra
    assert fields("ChatCompletionRequest") == set(openai_api.CHAT_FIELDS) | extra
    assert fields("RunProgramRequest") == set(program_api.RUN_PROGRAM_FIELDS)
    for name in ("SamplingParams", "SessionParams", "GenerateRequest", "CompletionRequest", "ChatCompletionRequest",
                 "RunProgramRequest"):
        assert schema_of(spec, name)["additionalProperties"] is False, name  # unknown fields are a 400


def test_server_limits_and_auth_follow_the_settings():
    plain = openapi_spec(ServerSettings(max_top_logprobs=5))
    assert {} in plain["security"]  # no --api-key: the bearer header is optional
    top = schema_of(plain, "CompletionRequest")["properties"]["logprobs"]["anyOf"][0]
    assert top["maximum"] == 5
    keyed = openapi_spec(ServerSettings(api_key="k"))
    assert keyed["security"] == [{"bearerAuth": []}]
    open_paths = {p for p, item in keyed["paths"].items() for op in item.values() if op.get("security") == []}
    assert open_paths == {"/health", "/openapi.json"}


def test_error_responses_are_described_on_every_operation(spec):
    error = schema_of(spec, "Error")
    jsonschema.validate({"error": {"message": "x must be an integer", "type": "invalid_request_error",
                                   "param": "x", "code": None}}, error)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"error": {"message": "", "type": "invalid_request_error", "param": None,
                                       "code": None}}, error)
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if method in METHODS and path not in ("/health", "/openapi.json"):
                assert "401" in op["responses"], (method, path)
            if method in METHODS and "requestBody" in op:
                assert {"400", "413", "415"} <= set(op["responses"]), (method, path)


def test_head_is_answered_on_every_get_path_but_those_that_act(spec):
    """aiohttp answers HEAD on a GET route by itself; a GET that acts (flushes, generates) refuses it
    (405), and the description says which do."""
    app = create_app(ServerContext(ServerSettings(), EngineConfig()))
    heads = {r.resource.canonical for r in app.router.routes() if r.method == "HEAD"}
    gets = {path: item["get"] for path, item in spec["paths"].items() if "get" in item}
    assert heads == {path for path, op in gets.items() if "405" not in op["responses"]}
    assert {path for path, op in gets.items() if "405" in op["responses"]} == {"/flush_cache", "/health_generate"}


def test_run_program_graph_schema_is_the_irs_own_and_accepts_a_traced_graph(spec):
    import radixlm as rl

    @rl.function
    def prog(s):
        s += "Q:" + rl.gen("a", max_tokens=2)
        f = s.fork(2)
        f += rl.select("c", choices=["x", "y"])
        f.join()

    graph = json.loads(prog.trace().to_json())
    resolver_spec = {**spec, **spec["components"]["schemas"]["RunProgramRequest"]}
    jsonschema.validate({"graph": graph, "stream": True}, resolver_spec)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"graph": {"nodes": [{"op": "bogus"}]}}, resolver_spec)
    assert "1024 gens (--max-program-*)" in spec["paths"]["/run_program"]["post"]["summary"]
