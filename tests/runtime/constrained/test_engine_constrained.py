"""Constrained decoding through the Engine on the default model: every kind, jump-forward, errors."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
from enum import Enum

import jsonschema
import pytest
from pydantic import BaseModel

from radixlm.runtime.engine import Engine
from radixlm.runtime.intake import Submission

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 96}


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    street: str
    city: str
    zip_code: str | None = None


class Person(BaseModel):
    name: str
    age: int
    favorite_color: Color
    hobbies: list[str]
    address: Address
    nickname: str | None = None


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def engine():
    e = Engine(dtype="float32", max_total_tokens=8000, context_length=2048)
    yield e
    e.core.check_idle_integrity()
    e.shutdown()


def _valid(schema: dict, text: str) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


def test_pydantic_model_nested_enum_list_optional(engine):
    prompt = _chat("Describe a person as JSON: Ann, 34, likes green, hikes and reads, lives at 1 Main St, Springfield.")
    schema = Person.model_json_schema()
    for params in ({**GREEDY, "max_new_tokens": 160}, {"temperature": 0.8, "seed": 7, "max_new_tokens": 160}):
        out = engine.generate(prompt, {**params, "json_schema": Person})
        meta = out["meta_info"]
        if meta["finish_reason"]["type"] == "length":
            assert meta["completion_tokens"] == params["max_new_tokens"]
            continue
        assert meta["finish_reason"]["type"] == "stop"
        obj = _valid(schema, out["text"])
        Person.model_validate(obj)
        assert out["text"] == engine.tokenizer.decode(out["output_ids"])


@pytest.mark.parametrize("name,regex,check", [
    ("phone", r"\(\d{3}\) \d{3}-\d{4}", lambda s: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", s)),
    ("date", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", lambda s: re.fullmatch(r"\d{4}-\d\d-\d\d", s)),
    ("ipv4", r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)", lambda s: ipaddress.IPv4Address(s)),
])
def test_regex(engine, name, regex, check):
    prompt = f"Here is an example of a {name}: "
    for params in (GREEDY, {"temperature": 1.0, "seed": 3, "max_new_tokens": 96}):
        out = engine.generate(prompt, {**params, "regex": regex})
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert check(out["text"]), out["text"]


def test_ebnf_arithmetic(engine):
    grammar = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [0-9]+
'''
    out = engine.generate("Write an arithmetic expression: ", {**GREEDY, "max_new_tokens": 24, "ebnf": grammar})
    text = out["text"]
    if out["meta_info"]["finish_reason"]["type"] == "stop":
        assert re.fullmatch(r"[0-9+\-*/()]+", text) and text.count("(") == text.count(")"), text
        eval(text.replace("/", "*"), {"__builtins__": {}})  # noqa: S307 - digits and operators only
    else:
        assert re.fullmatch(r"[0-9+\-*/()]*", text), text


def test_choices(engine):
    choices = ["positive", "negative", "neutral"]
    for text in ("I love this film!", "This was a terrible waste of time."):
        out = engine.generate(_chat(f"Sentiment of: {text}"), {**GREEDY, "choices": choices})
        assert out["text"] in choices
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_jump_forward_saves_forward_passes_and_stays_valid(engine):
    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"},
        "capital": {"type": "boolean"}}, "required": ["name", "country", "population", "capital"]}
    prompt = _chat("Give a JSON record about the city of Lyon.")
    metas = {}
    for jf in (True, False):
        out = engine.generate(prompt, {**GREEDY, "json_schema": schema, "jump_forward": jf})
        _valid(schema, out["text"])
        assert out["text"] == engine.tokenizer.decode(out["output_ids"])
        metas[jf] = out["meta_info"]
    assert metas[True]["forced_tokens"] > 0 and metas[False]["forced_tokens"] == 0
    # every sampled token costs one forward pass; forced ones share one pass per jump
    assert metas[False]["forward_passes"] == metas[False]["completion_tokens"]
    assert metas[True]["forward_passes"] < metas[False]["forward_passes"]


def test_jump_forward_only_while_few_requests_run(engine):
    """jump_forward_max_running: above it forced text is decoded through the mask, one token a
    step (uniform decode batches); the text is valid either way. (Which steps of a pair of
    requests run both at once depends on how the scheduler admits them, so the cap is checked at
    1 with one request and at 0 with two.)"""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}},
              "required": ["city", "rank"]}
    prompts = [_chat("A city and its rank as JSON."), _chat("Another city as JSON.")]
    params = {**GREEDY, "json_schema": schema}
    for cap, batch in ((1, prompts[:1]), (0, prompts)):
        capped = Engine(dtype="float32", max_total_tokens=4000, context_length=2048, jump_forward_max_running=cap)
        try:
            outs = capped.generate(batch, params)
        finally:
            capped.shutdown()
        for out in outs:
            _valid(schema, out["text"])
            meta = out["meta_info"]
            if cap >= len(batch):  # at most `cap` running: jumps, fewer passes than tokens
                assert meta["forced_tokens"] > 0 and meta["forward_passes"] < meta["completion_tokens"]
            else:  # more running: no jumps, one pass per token
                assert meta["forced_tokens"] == 0 and meta["forward_passes"] == meta["completion_tokens"]
    uncapped = engine.generate(prompts, params)  # the CPU default: no limit
    assert all(o["meta_info"]["forced_tokens"] > 0 for o in uncapped)


def test_the_forced_opening_joins_the_prefill(engine):
    """The text a grammar forces before any choice (``{"name":"``) is output before the first
    forward pass: the prompt's prefill computes it and samples the first free token, so it costs
    no pass; it streams first; a stop string inside it ends the request with no pass at all."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    prompt = _chat("A person as JSON.")
    opening = engine.tokenizer.encode('{"name":"', add_special_tokens=False)
    params = {**GREEDY, "json_schema": schema, "max_new_tokens": len(opening) + 1}
    out = engine.generate(prompt, params)
    m = out["meta_info"]
    assert out["output_ids"][:len(opening)] == opening and out["text"].startswith('{"name":"')
    assert (m["forward_passes"], m["forced_tokens"], m["finish_reason"]["type"]) == (1, len(opening), "length")
    chunks = list(engine.stream(prompt, params))
    assert chunks[0]["text"] == '{"name":"' and chunks[0]["output_ids"] == opening
    again = engine.generate(prompt, params)["meta_info"]  # the opening's KV is cached now; usage counts the prompt's
    assert again["cached_tokens"] == again["prompt_tokens"]  # (the opening was cached too)
    stopped = engine.generate(prompt, {**params, "stop": ["name"]})
    assert stopped["text"] == '{"' and stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": "name"}
    assert stopped["meta_info"]["forward_passes"] == 0
    # without jump-forward the opening is sampled, a pass a token
    plain = engine.generate(prompt, {**params, "jump_forward": False})
    assert plain["meta_info"]["forward_passes"] == plain["meta_info"]["completion_tokens"] == len(opening) + 1


def test_stream_ids_match_final_ids_with_jumps(engine):
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["title", "year"]}
    params = {**GREEDY, "json_schema": schema}
    prompt = _chat("A famous film as JSON.")
    final = engine.generate(prompt, params)
    ids: list[int] = []
    text = ""
    for chunk in engine.stream(prompt, params):
        if chunk["replace_from"] is not None:
            del ids[chunk["replace_from"]:]
        ids += chunk["output_ids"]
        text += chunk["text"]
    assert ids == final["output_ids"] and text == final["text"]
    assert final["meta_info"]["forced_tokens"] > 0


def test_abort_while_compiling(engine):
    from radixlm.runtime.sampling_params import SamplingParams

    core = engine.core
    schema = {"type": "object", "properties": {"never_compiled_before": {"type": "string"}}}
    core.add_request(Submission("compiling", [1, 2, 3], SamplingParams(json_schema=schema)))
    out = core.abort("compiling")
    assert out is not None and out.finished and out.meta["finish_reason"] == {"type": "abort"}
    while core.has_work:
        assert all(o.rid != "compiling" for o in core.step())


def test_a_compiling_request_keeps_its_place_in_line(engine):
    """A constrained request joins the queue once its grammar compiled, after requests that came
    later; first come, first served still counts it first (its place was taken when it came)."""
    from radixlm.runtime.sampling_params import SamplingParams

    core = engine.core
    core.add_request(Submission("came-first", [1, 2, 3], SamplingParams(regex=r"[0-9]{2}-in-line", max_new_tokens=8)))
    core.add_request(Submission("came-second", [4, 5, 6], SamplingParams(max_new_tokens=2)))
    first, second = core.requests["came-first"], core.requests["came-second"]
    assert first.arrival < second.arrival
    while core.has_work:
        core.step()
    assert first.arrival < second.arrival  # (joining the queue did not renumber it)
    assert first.output_ids and second.output_ids


def test_unconstrained_rows_untouched_in_a_mixed_batch(engine):
    free = ("Once upon a time", {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True})
    alone = engine.generate(*free)

    async def both():
        return await asyncio.gather(
            engine.async_generate(free[0], free[1]),
            engine.async_generate("Answer: ", {**GREEDY, "regex": "(yes|no)"}),
        )

    mixed, constrained = asyncio.run(both())
    assert mixed["output_ids"] == alone["output_ids"]
    assert constrained["text"] in ("yes", "no")


def test_bad_constraint_fails_only_its_request(engine):
    with pytest.raises(ValueError, match="constrained decoding: .*regex"):
        engine.generate("x", {"regex": "(unclosed"})
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        engine.generate("x", {"json_schema": "{not json"})

    async def mixed():
        return await asyncio.gather(
            engine.async_generate("Count: 1, 2,", {"temperature": 0, "max_new_tokens": 8}),
            engine.async_generate("x", {"regex": "[z-a]"}),
            return_exceptions=True,
        )

    good, bad = asyncio.run(mixed())
    assert isinstance(bad, ValueError) and "regex" in str(bad)
    assert good["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_length_cut_reports_length(engine):
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 60}}, "required": ["story"]}
    for jf in (True, False):
        out = engine.generate(_chat("Tell a long story as JSON."),
                              {"temperature": 0, "max_new_tokens": 6, "json_schema": schema, "jump_forward": jf})
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["completion_tokens"] == 6 == len(out["output_ids"])


def test_logprobs_line_up_with_output_ids(engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"]}
    out = engine.generate(_chat("Two numbers as JSON."), {**GREEDY, "json_schema": schema}, return_logprob=True)
    lps = out["meta_info"]["output_token_logprobs"]
    assert [t for _, t in lps] == out["output_ids"]


# --- the outlines backend through the Engine ------------------------------------------------


@pytest.fixture(scope="module")
def outlines_engine():
    e = Engine(dtype="float32", max_total_tokens=8000, context_length=2048, grammar_backend="outlines")
    yield e
    e.core.check_idle_integrity()
    e.shutdown()


@pytest.mark.parametrize("kind", ["json_schema", "regex"])
def test_outlines_jump_forward_through_engine(outlines_engine, kind):
    """outlines-core knows nothing of forced text: the character FSM (interegular) supplies it.
    With jump-forward on, forced runs join the output in shared passes, and the output still
    matches; with it off, every token costs a pass."""
    if kind == "json_schema":
        spec = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                                 "capital": {"type": "boolean"}},
                "required": ["city", "population", "capital"]}
        prompt = _chat("Give a JSON record about the city of Lyon.")
    else:
        spec = r"The answer is (yes|no), with confidence [1-9][0-9]%\."
        prompt = "Is Lyon in France? "
    metas = {}
    for jf in (True, False):
        out = outlines_engine.generate(prompt, {**GREEDY, kind: spec, "jump_forward": jf})
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        if kind == "json_schema":
            _valid(spec, out["text"])
        else:
            assert re.fullmatch(spec, out["text"]), out["text"]
        assert out["text"] == outlines_engine.tokenizer.decode(out["output_ids"])
        metas[jf] = out["meta_info"]
    assert metas[True]["forced_tokens"] > 0 and metas[False]["forced_tokens"] == 0
    assert metas[False]["forward_passes"] == metas[False]["completion_tokens"]
    assert metas[True]["forward_passes"] < metas[True]["completion_tokens"]
