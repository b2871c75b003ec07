"""Pathological constraints through the Engine and a real server: a clear 400 (ValueError) for
the request that carries one, and other requests go on (default model)."""

from __future__ import annotations

import asyncio
import re

import pytest
from server_harness import start_server

from radixlm.runtime.engine import Engine

pytestmark = pytest.mark.slow

# 3,000 optional properties (89 KB, under the size limit): ~0.67 s of llguidance compile on a
# 2-core CPU (which then fails on its own), past the time limit set below. With 1,000 properties
# (0.15 s) and a 0.05 s limit, the regex compile queued behind it, run while the overdue one was
# still running beside a decoding request, once overran the limit too on a loaded CI machine.
SLOW_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}
LIMIT_S = 0.25


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_engine_finishes_other_requests_while_a_compile_is_overdue():
    engine = Engine(dtype="float32", max_total_tokens=4000, context_length=1024,
                    grammar_compile_workers=1, grammar_compile_timeout=LIMIT_S)
    try:
        async def together():
            return await asyncio.gather(
                engine.async_generate("Hi", {"json_schema": SLOW_SCHEMA, "max_new_tokens": 8}),
                engine.async_generate("Hi", {"temperature": 0, "max_new_tokens": 8}),
                # waits for the single compile slot, which the overdue compile hands on
                engine.async_generate("Hi", {"regex": "[ab]{3}", "max_new_tokens": 8}),
                return_exceptions=True,
            )

        slow, plain, constrained = asyncio.run(together())
        assert isinstance(slow, ValueError)
        assert str(slow) == ("constrained decoding: cannot compile json_schema: grammar compile exceeded 0.25 s "
                             "(server option --grammar-compile-timeout)")
        assert isinstance(plain, dict) and len(plain["output_ids"]) == 8, plain
        assert isinstance(constrained, dict), constrained
        assert re.fullmatch("[ab]{3}", constrained["text"])
        # sent again: the remembered failure, at once
        with pytest.raises(ValueError, match="grammar compile exceeded 0.25 s"):
            engine.generate("Hi", {"json_schema": SLOW_SCHEMA, "max_new_tokens": 8})
        # too deep to read in Python (a RecursionError before the limits existed): a ValueError too
        with pytest.raises(ValueError, match="json_schema is too large: it nests too deeply to read"):
            engine.generate("Hi", {"json_schema": _nested(1000)})
        assert len(engine.generate("Hi", {"temperature": 0, "max_new_tokens": 4})["output_ids"]) == 4
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server():
    with start_server("--dtype", "float32", "--max-total-tokens", "4000", "--context-length", "1024",
                      "--grammar-compile-timeout", str(LIMIT_S), "--grammar-max-enum", "100") as s:
        yield s


@pytest.mark.parametrize("path,body,param,words", [
    ("/generate", {"text": "a", "sampling_params": {"json_schema": _nested(300)}}, "sampling_params",
     ["nesting depth", "the limit is 128", "--grammar-max-nesting"]),
    ("/generate", {"text": "a", "sampling_params": {"regex": "(x+x+)+y{5000000}"}}, "sampling_params",
     ["repetition count", "--grammar-max-repeat"]),
    ("/v1/completions", {"prompt": "a", "regex": "a" * 200_000}, "regex",
     ["size in bytes is 200,000", "the limit is 131,072", "--grammar-max-bytes"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": list(range(101))}}}},
     "response_format", ["number of enum values is 101", "the limit is 100", "--grammar-max-enum"]),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": SLOW_SCHEMA}}, "sampling_params",
     ["grammar compile exceeded 0.25 s", "--grammar-compile-timeout"]),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": SLOW_SCHEMA}}, "sampling_params",
     ["grammar compile exceeded 0.25 s"]),  # the same again: the remembered failure
])
def test_server_answers_400_and_serves_the_next_request(server, path, body, param, words):
    status, out = server.post(path, body)
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error"
    assert out["error"]["param"] == param
    for w in words:
        assert w in out["error"]["message"]
    status, ok = server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert status == 200, ok
    assert len(ok["output_ids"]) == 3
