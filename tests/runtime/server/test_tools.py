"""OpenAI tool calling on a real server with the official client: tool_choice none / auto /
required / named, streaming, parallel calls, agent loops, bad input; native template rendering."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import jsonschema
import openai
import pytest
from server_harness import Server, start_server
from transformers import AutoTokenizer

from radixlm.runtime.server.openai_api import _messages
from radixlm.runtime.server.openai_tools import opener_ids, parse_tool_fields, render_chat
from radixlm.runtime.server.tokenizer import ServerTokenizer
from radixlm.runtime.tool_calls import HERMES

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
SEARCH_PARAMS = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                                  "limit": {"type": "integer", "minimum": 1, "maximum": 5}},
                 "required": ["query"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH_PARAMS,
                                      "strict": True}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "search": SEARCH_PARAMS}


def get_weather(city: str, unit: str) -> str:
    return f"{city}: 21 degrees {unit}, sunny"


def search(query: str, limit: int = 3) -> str:
    return f"{limit} results for {query}"


FUNCTIONS = {"get_weather": get_weather, "search": search}


@pytest.fixture(scope="module")
def server():
    s = start_server("--dtype", "float32", "--max-total-tokens", "8192", "--context-length", "2048")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _valid(call: Any, names: tuple[str, ...] = ("get_weather", "search")) -> dict[str, Any]:
    """The arguments of a returned call, checked against its tool's schema."""
    assert call.type == "function" and call.id
    assert call.function.name in names
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def _history_call(cid: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _few_shot(*cities: str) -> list[dict[str, Any]]:
    """Earlier turns where the assistant called get_weather (the small model follows the pattern)."""
    out: list[dict[str, Any]] = []
    for i, city in enumerate(cities):
        out += [{"role": "user", "content": f"Weather in {city}?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [_history_call(f"call_{i}", "get_weather", {"city": city, "unit": "celsius"})]}]
    return out


def _run_calls(calls: Any) -> list[dict[str, Any]]:
    """Run each call's Python function; the tool messages that answer them."""
    return [{"role": "tool", "tool_call_id": c.id, "content": FUNCTIONS[c.function.name](**_valid(c))}
            for c in calls]


def test_required_gives_valid_calls(oai):
    r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                    tools=TOOLS, tool_choice="required", temperature=0, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _valid(call)
    assert r.usage.completion_tokens > 0


def test_named_tool_choice_calls_that_tool_sampled(oai):
    r = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Find news about the Moon."}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "search"}}, temperature=1.0, seed=3, n=3,
        max_tokens=80)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert [c.function.name for c in choice.message.tool_calls] == ["search"] * len(choice.message.tool_calls)
        for call in choice.message.tool_calls:
            _valid(call, ("search",))
    assert len({c.message.tool_calls[0].id for c in r.choices}) == 3


def test_tool_choice_none_and_auto_without_a_call_answer_in_text(oai):
    msgs = [{"role": "user", "content": "Say hello."}]
    for choice in ("none", "auto"):
        r = oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS, tool_choice=choice, temperature=0,
                                        max_tokens=20)
        c = r.choices[0]
        assert c.message.tool_calls is None
        assert c.finish_reason in ("stop", "length") and c.message.content
        assert "<tool_call>" not in c.message.content


def test_auto_calls_once_the_model_writes_the_marker(oai):
    msgs = [*_few_shot("Rome", "Oslo"), {"role": "user", "content": "Weather in Paris?"}]
    r = oai.chat.completions.create(model="m", messages=msgs, tools=TOOLS, temperature=0, max_tokens=100)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [call.function.name for call in c.message.tool_calls] == ["get_weather"]
    assert _valid(c.message.tool_calls[0])["city"] == "Paris"


def test_streamed_calls_equal_the_plain_response(oai):
    msgs = [*_few_shot("Rome"), {"role": "user", "content": "Weather in Lima?"}]
    for tool_choice in ("auto", "required"):
        kw = {"model": "m", "messages": msgs, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0,
              "max_tokens": 100}
        plain = oai.chat.completions.create(**kw).choices[0]
        with oai.chat.completions.stream(**kw) as stream:
            argument_deltas = sum(1 for ev in stream if ev.type == "tool_calls.function.arguments.delta")
            final = stream.get_final_completion().choices[0]
        assert argument_deltas >= 2  # arguments arrive in pieces
        assert final.finish_reason == plain.finish_reason == "tool_calls"
        got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
        assert got == [(c.function.name, c.function.arguments) for c in plain.message.tool_calls]
        # raw chunks: the first delta of a call carries id, type, name and empty arguments
        chunks = list(oai.chat.completions.create(**kw, stream=True))
        firsts = [d.tool_calls[0] for ch in chunks for d in [ch.choices[0].delta] if ch.choices and d.tool_calls
                  and d.tool_calls[0].id]
        assert [(f.index, f.type, f.function.name, f.function.arguments) for f in firsts] == [
            (i, "function", name, "") for i, (name, _) in enumerate(got)]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _agent(oai: openai.OpenAI, question: str, stream: bool, history: list[dict[str, Any]] | None = None,
           parallel: bool = True) -> tuple[list[Any], str]:
    """ask -> the model calls tools -> run them -> send the results -> the final answer."""
    messages = [*(history or []), {"role": "user", "content": question}]
    made: list[Any] = []
    for step in range(3):
        kw = {"model": "m", "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 48,
              "tool_choice": "required" if step == 0 else "none" if step == 2 else "auto",
              "parallel_tool_calls": parallel}
        if stream:
            with oai.chat.completions.stream(**kw) as s:
                for _ in s:
                    pass
                choice = s.get_final_completion().choices[0]
        else:
            choice = oai.chat.completions.create(**kw).choices[0]
        if not choice.message.tool_calls:
            assert choice.finish_reason in ("stop", "length")
            return made, choice.message.content or ""
        assert choice.finish_reason == "tool_calls"
        made += choice.message.tool_calls
        messages.append({"role": "assistant", "content": choice.message.content,
                         "tool_calls": [_history_call(c.id, c.function.name, json.loads(c.function.arguments))
                                        for c in choice.message.tool_calls]})
        messages += _run_calls(choice.message.tool_calls)
    raise AssertionError("no final answer")


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop(oai, stream):
    calls, answer = _agent(oai, "What is the weather in Paris?", stream)
    assert calls and answer.strip()
    assert calls[0].function.name == "get_weather"


@pytest.fixture(scope="module")
def oai_no_jumps():
    """Jump-forward re-tokenizes the model's `"}` + forced `}` into `"` + `}}`, after which the small
    model always closes the list: parallel calls are shown without jumps (docs/tools.md)."""
    s = start_server("--dtype", "float32", "--max-total-tokens", "4096", "--context-length", "2048",
                     "--jump-forward", "false")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    assert s.stop() == 0


def test_parallel_calls_and_one_call_when_parallel_is_off(oai_no_jumps):
    oai = oai_no_jumps
    two = {"role": "assistant", "content": None, "tool_calls": [
        _history_call("a", "get_weather", {"city": "Rome", "unit": "celsius"}),
        _history_call("b", "get_weather", {"city": "Oslo", "unit": "celsius"})]}
    history = [{"role": "user", "content": "Weather in Rome and Oslo?"}, two,
               {"role": "tool", "tool_call_id": "a", "content": "Rome: 20 C"},
               {"role": "tool", "tool_call_id": "b", "content": "Oslo: 5 C"},
               {"role": "assistant", "content": "Rome: 20 C, Oslo: 5 C."}]
    calls, answer = _agent(oai, "Weather in Rome and Oslo?", False, history)
    assert [c.function.name for c in calls[:2]] == ["get_weather", "get_weather"]
    assert {json.loads(c.function.arguments)["city"] for c in calls[:2]} == {"Rome", "Oslo"}
    assert answer.strip()
    one, _ = _agent(oai, "Weather in Rome and Oslo?", False, history, parallel=False)
    assert len(one) >= 1
    r = oai.chat.completions.create(model="m", messages=[*history, {"role": "user", "content": "Weather in Rome and Oslo?"}],
                                    tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_tokens=100)
    assert len(r.choices[0].message.tool_calls) == 1


BAD = [
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"enum": ["a"]}}}, "required": ["a"]}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)a"}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]},
     "messages[1].tool_call_id"),
    ({"tools": TOOLS, "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    # a result of no call the model made (rendered as given before)
    ({"tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Oslo?"},
                                   {"role": "assistant", "content": None, "tool_calls": [
                                       _history_call("c1", "get_weather", {"city": "Oslo", "unit": "celsius"})]},
                                   {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
                                   {"role": "tool", "tool_call_id": "c2", "content": "7 C"}]},
     "messages[3].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "r"}]},
     "messages[1].tool_call_id"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "logprobs": True}, "logprobs"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_bad_tool_input_is_a_400_naming_the_field(server, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **fields}
    status, out = server.post("/v1/chat/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == param, out
    if param == "messages[3].tool_call_id":
        assert "'c2' answers no tool call of an earlier assistant message" in out["error"]["message"]
        assert "ids so far: 'c1'" in out["error"]["message"]


# -- a template that renders tools itself (Hermes / Qwen style) --------------------------------------
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>
{"name": <name>, "arguments": <arguments>}
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' and tools %}
{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{%- for c in m.tool_calls %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_with_tools_renders_them_and_its_own_call_format():
    folder = sorted(glob.glob(os.path.expanduser("~/.cache/radixlm/SmolLM2-135M-Instruct*")))[-1]
    hf = AutoTokenizer.from_pretrained(folder)
    hf.chat_template = HERMES_TEMPLATE
    tok = ServerTokenizer(hf, 2048, len(hf))
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                         {"role": "assistant", "content": None,
                          "tool_calls": [_history_call("c1", "get_weather", {"city": "Oslo", "unit": "celsius"})]},
                         {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
                         {"role": "user", "content": "And Rome?"}],
            "tools": TOOLS, "tool_choice": "required"}
    plan = parse_tool_fields(body, HERMES)
    text = hf.decode(render_chat(tok, _messages(body), plan))
    assert '{"type": "function", "function": {"name": "get_weather"' in text  # the template's own tool list
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n5 C\n</tool_response>" in text
    assert hf.decode(opener_ids(tok, HERMES)) == "<tool_call>\n"
    # the calls' value is one call object (Hermes writes one call per block)
    schema = json.loads(plan.schema)
    jsonschema.validate({"name": "search", "arguments": {"query": "q"}}, schema)
