"""Smoke tests of examples/agents on the default model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"agents_{name}", AGENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_react_agent_runs_tools_and_feeds_observations_back(engine_backend):
    import json

    from radixlm.lang.frontend.tools import declare

    agent = load("react_agent")
    assert agent.calculator("17 * 23") == "391" and agent.calculator("__import__('os')").startswith("error")
    assert agent.lookup("Capital of France?") == "Paris"
    state = agent.main("What is 17 * 23?", backend=engine_backend)
    messages = state.messages()
    turns = [m["content"] for m in messages if m["role"] == "assistant"]
    assert 1 <= len(turns) <= 3
    _, bind = declare(agent.TOOLS)
    calls = []
    for turn in turns:  # each turn is exactly one call, in the generic format, valid for its tool
        assert turn.startswith("<tool_call>[") and turn.endswith("]</tool_call>")
        (call,) = json.loads(turn[len("<tool_call>"):-len("</tool_call>")])
        calls.append(bind(call))
    assert calls[0].name != "finish"  # the first step always consults a tool
    tool_calls = [c for c in calls if c.name != "finish"]
    results = [m["content"] for m in messages if m["content"].startswith("<tool_response>")]
    # every tool step but a final finish got exactly the tool's own output back
    assert results == [f"<tool_response>\n{c()}\n</tool_response>" for c in tool_calls]
    assert all(c.name != "finish" for c in calls[:-1])


def test_tree_of_thought_forks_three_levels(engine_backend):
    tot = load("tree_of_thought")
    assert tot.tree_of_thought.trace(tot.PROBLEM).nodes[-1].op == "join"  # one static graph
    state, score, path = tot.main(backend=engine_backend, step_tokens=4)
    assert len(state["step3"]) == 2 and len(state["step1"][1][0]) == 2
    assert len(path) == 3 and all(isinstance(step, str) for step in path)
    assert score <= 0.0 and state["verdict"][1][1][1] in (" yes", " no")


def test_json_extraction_batch_parses(engine_backend):
    ex = load("json_extraction")
    contacts = ex.main(backend=engine_backend, texts=ex.TEXTS[:3])
    assert len(contacts) == 3 and all(isinstance(c.age, int) for c in contacts)


def test_multi_turn_chat(engine_backend):
    chat = load("multi_turn_chat")
    turns = chat.TURNS[:2]
    states = chat.main(backend=engine_backend, turns=turns, max_tokens=8)
    roles = [m["role"] for m in states[-1].messages()]
    assert roles == ["system"] + ["user", "assistant"] * len(turns)
    assert [m["content"] for m in states[-1].messages()[2::2]] == [st["reply"] for st in states]
    # the second run read the first one's conversation from the session's pinned KV
    first = len(engine_backend.engine.encode(states[0].text()))
    assert states[1].get_meta_info("reply")["cached_tokens"] >= first - 1
