"""Tool formats, the calls' JSON schema, the streaming call scanner and the generic rendering."""

from __future__ import annotations

import json

import jsonschema
import pytest

from radixlm.runtime.tool_calls import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    CallScanner,
    ToolCall,
    ToolChoice,
    ToolInputError,
    calls_schema,
    detect_format,
    generic_messages,
    native_messages,
    parse_history_calls,
    parse_tool_choice,
    parse_tools,
    tool_of_pointer,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"$ref": "#/$defs/Q"}}, "required": ["query"],
    "$defs": {"Q": {"type": "string", "maxLength": 5}}}}}
NOARGS = {"type": "function", "function": {"name": "now"}}


def test_parse_tools_and_choice():
    tools = parse_tools([WEATHER, SEARCH, NOARGS])
    assert [t.name for t in tools] == ["get_weather", "search", "now"]
    assert tools[2].parameters == {"type": "object", "properties": {}}
    assert parse_tool_choice(None, tools).mode == "auto"
    assert parse_tool_choice(None, []).mode == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "search"}}, tools) == ToolChoice("named",
                                                                                                       "search")


@pytest.mark.parametrize(("raw", "param"), [
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict"),
    ({"a": 1}, "tools"),
])
def test_bad_tools_name_the_field(raw, param):
    with pytest.raises(ToolInputError) as e:
        parse_tools(raw)
    assert e.value.param == param


def test_bad_tool_choice_and_history_calls():
    tools = parse_tools([WEATHER])
    with pytest.raises(ToolInputError) as e:
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    assert e.value.param == "tool_choice.function.name"
    with pytest.raises(ToolInputError):
        parse_tool_choice("required", [])
    with pytest.raises(ToolInputError) as e:
        parse_history_calls([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}], "m")
    assert e.value.param == "m[0].function.arguments"


@pytest.mark.parametrize("fmt", [GENERIC, HERMES, MISTRAL, LLAMA3_JSON])
def test_calls_schema_accepts_exactly_the_tools_calls(fmt):
    tools = parse_tools([WEATHER, SEARCH, NOARGS])
    schema = calls_schema(tools, ToolChoice("required"), fmt)
    jsonschema.Draft202012Validator.check_schema(schema)
    key = fmt.args_key
    good = [{"name": "get_weather", key: {"city": "Oslo"}}, {"name": "search", key: {"query": "abc"}},
            {"name": "now", key: {}}]
    bad = [{"name": "get_weather", key: {"unit": "C"}}, {"name": "search", key: {"query": "toolong"}},
           {"name": "other", key: {}}, {"name": "now"}, {"name": "now", key: {}, "x": 1}]
    for call in good:
        jsonschema.validate([call] if fmt.array else call, schema)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([call] if fmt.array else call, schema)
    if fmt.array:
        jsonschema.validate(good, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([], schema)
        single = calls_schema(tools, ToolChoice("required"), fmt, parallel=False)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(good[:2], single)
    named = calls_schema(tools, ToolChoice("named", "now"), fmt)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([good[0]] if fmt.array else good[0], named)


def test_compile_error_pointers_name_the_tool():
    tools = parse_tools([WEATHER, SEARCH, NOARGS])
    assert tool_of_pointer("bad (at /items/anyOf/2/properties/arguments/x)", GENERIC, tools,
                           ToolChoice("required")) == 2
    assert tool_of_pointer("bad (at /$defs/tool1/properties)", GENERIC, tools, ToolChoice("required")) == 1
    assert tool_of_pointer("bad", GENERIC, tools, ToolChoice("named", "search")) == 1
    assert tool_of_pointer("bad", GENERIC, tools, ToolChoice("required")) is None


def test_detect_format():
    assert detect_format(None) is GENERIC
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is GENERIC
    assert detect_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert detect_format("{% if tools %}[TOOL_CALLS]{% endif %}") is MISTRAL
    assert detect_format('{% if tools %}<|start_header_id|>"parameters"{% endif %}') is LLAMA3_JSON


@pytest.mark.parametrize("fmt", [GENERIC, HERMES, MISTRAL, LLAMA3_JSON])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_scanner_reads_calls_in_any_chunking(fmt, step):
    calls = [("get_weather", {"city": "Os\"lo}", "unit": "C"}), ("now", {}), ("search", {"query": ["a", {"b": 1}]})]
    if not fmt.array:
        calls = calls[:1]
    objs = [{"name": n, fmt.args_key: a} for n, a in calls]
    text = json.dumps(objs if fmt.array else objs[0], separators=(",", ":"))
    scanner = CallScanner(fmt)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    done: set[int] = set()
    for i in range(0, len(text), step):
        for k, name, piece, complete in scanner.feed(text[i:i + step]):
            if name is not None:
                assert k not in names and k not in args  # the name comes before any argument text
                names[k] = name
            args[k] = args.get(k, "") + piece
            if complete:
                done.add(k)
    assert [names[k] for k in sorted(names)] == [n for n, _ in calls]
    assert [json.loads(args[k]) for k in sorted(args)] == [a for _, a in calls]
    assert done == set(range(len(calls)))


def test_generic_rendering_of_tools_calls_and_results():
    tools = parse_tools([WEATHER])
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo"}')
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "6 C"}]
    out = generic_messages(msgs, tools)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>[{"name":"get_weather","arguments":{"city":"Oslo"}}]</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n5 C\n</tool_response>\n"
                                                 "<tool_response>\n6 C\n</tool_response>"}
    with_system = generic_messages([{"role": "system", "content": "Be brief."}, *msgs[:1]], tools)
    assert with_system[0]["content"].startswith("Be brief.\n\n")
    native = native_messages(msgs)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert native[2]["tool_call_id"] == "call_1"
