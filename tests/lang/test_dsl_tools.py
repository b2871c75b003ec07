"""gen(tools=[...]): typed Python functions as tools, one grammar-made call per gen, on the
Engine, on a real server through RuntimeEndpoint (step by step over /generate and whole over
/run_program) and through the OpenAI backend against the same server's /v1."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

import radixlm as rl
from radixlm.lang.backends.openai import OpenAI
from radixlm.lang.backends.runtime_endpoint import RuntimeEndpoint
from radixlm.lang.frontend.tools import declare

API_KEY = "dsl-test-key"
GREEDY = {"temperature": 0}


class Place(BaseModel):
    city: Annotated[str, Field(max_length=30)]
    country: Annotated[str, Field(max_length=30)]


def get_weather(city: Annotated[str, Field(max_length=30)], unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
    """The current weather in a city."""
    return f"{city}: 21 degrees {unit}"


def search(query: Annotated[str, Field(max_length=40)], limit: Annotated[int, Field(ge=1, le=5)] = 3) -> list[str]:
    """Search the web; the titles of the first results."""
    return [f"{query} #{i}" for i in range(limit)]


def book_trip(to: Place, nights: Annotated[int, Field(ge=1, le=30)]) -> str:
    """Book a hotel for some nights."""
    return f"booked {nights} nights in {to.city}, {to.country}"


TOOLS = [get_weather, search, book_trip]
SYSTEM = "You are a helpful assistant.\n\n" + rl.describe_tools(TOOLS)


@rl.function
def ask(s, question: str):
    s += rl.system(SYSTEM)
    s += rl.user(question)
    s += rl.assistant(rl.gen("call", tools=TOOLS, max_tokens=80))


@rl.function
def agent(s, question: str):
    """Reads the call (no static graph), runs it, asks for the answer."""
    s += rl.system(SYSTEM)
    s += rl.user(question)
    s += rl.assistant(rl.gen("call", tools=TOOLS, max_tokens=80))
    s += rl.user(f"<tool_response>\n{s['call']()}\n</tool_response>")
    s += rl.assistant(rl.gen("answer", max_tokens=12))


@rl.function
def forked(s):
    s += rl.system(SYSTEM)
    forks = s.fork(2)
    for f, q in zip(forks, ("Weather in Paris?", "Search for cheap flights")):
        f += rl.user(q)
        f += rl.assistant(rl.gen("call", tools=TOOLS, max_tokens=80))
    forks.join()


def check_call(call: rl.FunctionCall, text: str | None) -> None:
    """A valid call of one of TOOLS, written in the state's text in the generic format."""
    assert isinstance(call, rl.FunctionCall)
    assert call.name in {t.__name__ for t in TOOLS} and call.function.__name__ == call.name
    _, bind = declare(TOOLS)
    again = bind({"name": call.name, "arguments": call.json_arguments})  # validates against the signature
    assert again.arguments == call.arguments
    call()  # the function accepts them
    if text is None:
        return
    written = "<tool_call>" + json.dumps([call.to_dict()], separators=(",", ":"), ensure_ascii=False) + "</tool_call>"
    assert written in text


# -- no model needed -------------------------------------------------------------------------------
def test_bad_tools_are_value_errors_saying_what_to_fix():
    def untyped(city, days: int) -> str:
        return city

    def star(*args: int) -> None:
        pass

    cases = [
        ([], "at least one function"),
        ([get_weather, get_weather], "unique"),
        ([get_weather, 3], r"tools\[1\] is int, not a function"),
        ([untyped], "parameter 'city' has no type hint"),
        ([star], r"\*args"),
        ([lambda x: x], "lambda"),
        (get_weather, "list of functions"),
    ]
    for tools, message in cases:
        with pytest.raises(ValueError, match=message):
            rl.gen("call", tools=tools)
    with pytest.raises(ValueError, match="no regex, json_schema"):
        rl.gen("call", tools=[search], regex="a+")
    with pytest.raises(ValueError, match="n must be 1"):
        rl.gen("call", tools=[search], n=2)


def test_the_graph_carries_tools_as_data_only():
    graph = ask.trace("Weather in Oslo?")
    node = graph.nodes[-2]
    assert node.op == "gen" and [t.name for t in node.tools] == ["get_weather", "search", "book_trip"]
    loaded = rl.Graph.from_json(graph.to_json())
    assert loaded.nodes[-2].tools == node.tools
    props = json.loads(graph.to_json())["nodes"][-2]["tools"][2]["parameters"]
    assert "to" in props["properties"] and "$defs" in props  # the nested model kept as $ref + $defs
    bad = json.loads(graph.to_json())
    bad["nodes"][-2]["tools"].append(dict(bad["nodes"][-2]["tools"][0]))
    bad["nodes"][-2]["constraint"] = {"kind": "regex", "spec": "a"}
    with pytest.raises(rl.GraphError, match="used twice|takes no regex"):
        rl.Graph.from_json(bad)


def test_bound_calls_validate_and_invoke():
    _, bind = declare(TOOLS)
    call = bind({"name": "book_trip", "arguments": {"to": {"city": "Rome", "country": "Italy"}, "nights": 2}})
    assert isinstance(call.arguments["to"], Place) and call() == "booked 2 nights in Rome, Italy"
    assert bind([{"name": "search", "arguments": {"query": "x"}}])[0].invoke() == ["x #0", "x #1", "x #2"]
    with pytest.raises(ValueError, match="signature refuses"):
        bind({"name": "search", "arguments": {"query": "x", "limit": 9}})


# -- the default model ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_engine_and_endpoint_make_the_same_valid_calls(engine_backend, server):
    client = RuntimeEndpoint(server.url, api_key=API_KEY, programs="client")
    graphs = RuntimeEndpoint(server.url, api_key=API_KEY, programs="server")
    questions = ["What is the weather in Paris?", "Book me 3 nights in Rome, Italy.", "Search for cheap flights."]
    for q in questions:
        results = []
        for be in (engine_backend, client, graphs):
            st = ask.run(q, backend=be, stop="\n", **GREEDY)  # a run's stop strings never cut a call
            check_call(st["call"], st.text())
            results.append((st["call"].to_dict(), st.text()))
        assert results[0] == results[1] == results[2]


@pytest.mark.slow
def test_step_by_step_agent_and_streaming(engine_backend, endpoint):
    st = agent.run("What is the weather in Paris?", backend=engine_backend, **GREEDY)
    check_call(st["call"], st.text())
    assert st.messages()[3]["content"] == f"<tool_response>\n{st['call']()}\n</tool_response>"
    remote = agent.run("What is the weather in Paris?", backend=endpoint, **GREEDY)
    assert remote.text() == st.text()

    streamed = ask.run("What is the weather in Paris?", backend=endpoint, stream=True, **GREEDY)
    chunks = list(streamed.text_iter("call"))
    assert len(chunks) > 1
    check_call(streamed["call"], "".join(chunks))


@pytest.mark.slow
def test_fork_branches_gather_calls(engine_backend, endpoint):
    local = forked.run(backend=engine_backend, **GREEDY)
    remote = forked.run(backend=endpoint, **GREEDY)  # one /run_program request
    assert len(local["call"]) == 2
    for call in local["call"]:
        check_call(call, None)  # a branch's text stays in the branch
    assert [c.to_dict() for c in remote["call"]] == [c.to_dict() for c in local["call"]]
    assert all(isinstance(c, rl.FunctionCall) for c in remote["call"])


@pytest.mark.slow
def test_openai_backend_calls_through_tools(server, engine_backend):
    be = OpenAI("smollm2", base_url=server.url + "/v1", api_key=API_KEY)
    for q in ("What is the weather in Paris?", "Book me 3 nights in Rome, Italy."):
        st = ask.run(q, backend=be, **GREEDY)
        check_call(st["call"], st.text())
        assert st.messages()[-1]["content"].startswith("<tool_call>[{\"name\":")
    # completion mode: the call is generated under the schema (the json_schema extension field)
    text_mode = OpenAI("smollm2", base_url=server.url + "/v1", api_key=API_KEY, chat=False)
    st = ask.run("What is the weather in Paris?", backend=text_mode, **GREEDY)
    check_call(st["call"], st.text())


@pytest.mark.slow
def test_json_graph_runs_without_functions(engine_backend):
    st = rl.run_graph(ask.trace("What is the weather in Paris?").to_json(), backend=engine_backend, **GREEDY)
    value = st["call"]  # no functions travel with a graph's JSON: the call stays data
    assert set(value) == {"name", "arguments"} and value["name"] in {t.__name__ for t in TOOLS}
