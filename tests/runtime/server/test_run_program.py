"""POST /run_program on a real server: programs give the same variables run on the server as run
step by step by the client (greedy), streams carry every state's text events, bad graphs are 400s
listing their problems, a failing gen names its variable without touching other programs, and a
client that leaves aborts every request of its program."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from dsl_programs import forked
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import read_sse, start_server

import radixlm as rl
from radixlm.lang.backends.runtime_endpoint import BackendError, RuntimeEndpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
OPTIONS = ["--dtype=float32", "--max-total-tokens=8000", "--context-length=2048", "--max-program-gens=40",
           "--max-program-fork-depth=3", "--max-program-fork-width=4", "--max-program-text-bytes=20000",
           "--max-program-nodes=400", "--program-scheduling=on"]


def load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(default_source):
    with start_server(*OPTIONS) as s:
        yield s


@pytest.fixture(scope="module")
def both(server):
    """The same server, programs run step by step by the client, and as one /run_program each."""
    return RuntimeEndpoint(server.url, programs="client"), RuntimeEndpoint(server.url, programs="server")


def graph_of(func: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return json.loads(func.trace(*args, **kwargs).to_json())


# -- the same results both ways ----------------------------------------------------------------
def test_lang_test_programs_give_the_same_variables_both_ways(both):
    progs = load(ROOT / "tests" / "lang" / "test_programs.py", "lang_test_programs")
    calls = [(progs.few_shot_qa, ("What is the capital of Italy?",)),
             (progs.multi_turn, ("Hi!", "Name a colour.")),
             (progs.select_and_regex, ()),
             (progs.fork_join, ()),
             (progs.nested_forks, ()),
             (progs.with_logprobs, ())]
    client, remote = both
    for func, args in calls:
        a = func.run(*args, backend=client, temperature=0)
        b = func.run(*args, backend=remote, temperature=0)
        assert b.variables() == a.variables(), func.name
        assert b.text() == a.text() and b.messages() == a.messages(), func.name
    meta = b.get_meta_info("days")  # with_logprobs: the gen's logprobs come back, as over /generate
    assert [e[1] for e in meta["output_token_logprobs"]] == [e[1] for e in a.get_meta_info("days")["output_token_logprobs"]]
    assert len(meta["output_top_logprobs"][0]) == 2


def test_streamed_gen_keeps_every_logprob_both_ways(both):
    """A native stream sends each chunk's new logprobs only: the client puts them back together."""
    progs = load(ROOT / "tests" / "lang" / "test_programs.py", "lang_test_programs")
    whole = progs.with_logprobs.run(backend=both[0], temperature=0).get_meta_info("days")
    for backend in both:
        state = progs.with_logprobs.run(backend=backend, temperature=0, stream=True)
        assert len(list(state.text_iter("days"))) > 1
        meta = state.get_meta_info("days")
        assert [e[1] for e in meta["output_token_logprobs"]] == [e[1] for e in whole["output_token_logprobs"]]
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == whole["completion_tokens"]


def test_examples_give_the_same_variables_both_ways(both):
    client, remote = both
    tot = load(ROOT / "examples" / "agents" / "tree_of_thought.py", "agents_tot")
    args = (tot.PROBLEM, 2, 2, 4)
    a = tot.tree_of_thought.run(*args, backend=client, temperature=0)
    b = tot.tree_of_thought.run(*args, backend=remote, temperature=0)
    assert b.variables() == a.variables() and len(b["step2"]) == 2
    ex = load(ROOT / "examples" / "agents" / "json_extraction.py", "agents_json")
    a_batch = ex.extract.run_batch([{"text": t} for t in ex.TEXTS[:2]], backend=client, temperature=0)
    b_batch = ex.extract.run_batch([{"text": t} for t in ex.TEXTS[:2]], backend=remote, temperature=0)
    assert [s.variables() for s in b_batch] == [s.variables() for s in a_batch]


def test_a_program_that_reads_values_falls_back_or_is_refused_when_forced(server, both):
    progs = load(ROOT / "tests" / "lang" / "test_programs.py", "lang_test_programs2")
    auto = RuntimeEndpoint(server.url)
    state = progs.reads_values.run(backend=auto, temperature=0)
    assert state["yn"] in (" yes", " no") and "why" in state.variables() and state.text().count("|") == 1
    with pytest.raises(rl.TraceError):
        progs.reads_values.run(backend=both[1], temperature=0)


# -- streaming ---------------------------------------------------------------------------------

def test_stream_sends_each_states_text_in_order_then_the_result(server):
    async def go() -> list[Any]:
        async with aiohttp.ClientSession() as http:
            body = {"graph": graph_of(forked), "stream": True, "sampling_defaults": {"temperature": 0}}
            async with http.post(server.url + "/run_program", json=body) as resp:
                assert resp.status == 200
                return await read_sse(resp)

    events = asyncio.run(go())
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["done"] is True and len(final["variables"]["fruit"]) == 2
    texts = [e for e in events[:-2]]
    root = "".join(e["text"] for e in texts if e["state"] == "root")
    assert root == final["text"]
    first = "".join(e["text"] for e in texts if e["state"] == "root" and e["var"] == "first")
    assert first == final["variables"]["first"]
    for i in range(2):  # each branch streamed its own gen, in order
        branch = "".join(e["text"] for e in texts if e["state"] == f"root/f0.{i}" and e["var"] == "fruit")
        assert branch == final["variables"]["fruit"][i]
    status, plain = server.post("/run_program", {"graph": graph_of(forked), "sampling_defaults": {"temperature": 0}})
    assert status == 200 and plain["variables"] == final["variables"]


def test_streamed_run_from_the_client_matches(both):
    client, remote = both
    a = forked.run(backend=client, temperature=0)
    state = forked.run(backend=remote, temperature=0, stream=True)
    streamed = "".join(state.text_iter())
    assert streamed == state.text() == a.text() and state.variables() == a.variables()


# -- bad input ---------------------------------------------------------------------------------
def fork_chain(depth: int) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = [{"op": "gen", "name": "x", "sampling": {"max_new_tokens": 1}}]
    for i in range(depth):
        nodes = [{"op": "fork", "id": i, "branches": [nodes]}, {"op": "join", "fork": i}]
    return nodes


@pytest.mark.parametrize("graph, param, needle", [
    ({"nodes": [{"op": "role_end", "role": "user"}, {"op": "join", "fork": 7}]}, "graph", "join of fork 7"),
    ({"nodes": [{"op": "exec", "code": "import os"}]}, "graph", "does not match any of the expected tags"),
    ({"nodes": [{"op": "fork", "id": 1, "branches": [[{"op": "fork", "id": 1, "branches": [[]]}]]},
                {"op": "join", "fork": 1}]}, "graph", "fork id 1 is used twice"),
    ({"nodes": [{"op": "text", "text": "Ideas:"}, {"op": "fork", "id": 0, "branches": [fork_chain(0)] * 2}]}, "graph",
     "nodes[1]: fork 0 is never joined, so the variables its branches set (x) would be dropped: add "
     '{"op": "join", "fork": 0} after it'),
    ({"nodes": "text"}, "graph", "nodes"),
    ({"nodes": fork_chain(4)}, "max_program_fork_depth", "--max-program-fork-depth"),
    ({"nodes": [{"op": "fork", "id": 0, "branches": [[]] * 5}, {"op": "join", "fork": 0}]},
     "max_program_fork_width", "--max-program-fork-width"),
    ({"nodes": [{"op": "text", "text": "x" * 20001}]}, "max_program_text_bytes", "--max-program-text-bytes"),
    ({"nodes": [{"op": "gen", "sampling": {"max_new_tokens": 1}}] * 41}, "max_program_gens", "--max-program-gens"),
    ({"nodes": [{"op": "text", "text": "a"}] * 401}, "max_program_nodes", "--max-program-nodes"),
])
def test_bad_graphs_are_400s_listing_every_problem(server, graph, param, needle):
    status, out = server.post("/run_program", {"graph": graph})
    assert status == 400, out
    err = out["error"]
    assert err["param"] == param and needle in err["message"]
    assert err["errors"] and any(needle in p for p in err["errors"])


def test_two_problems_are_both_listed(server):
    status, out = server.post("/run_program", {"graph": {"nodes": [
        {"op": "role_end", "role": "user"}, {"op": "var_end", "name": "v"}]}})
    assert status == 400 and len(out["error"]["errors"]) == 2


@pytest.mark.parametrize("body, param", [
    ({}, "graph"), ({"graph": []}, "graph"), ({"graph": {"nodes": []}, "program": "x"}, "program"),
    ({"graph": {"nodes": []}, "sampling_defaults": {"temperature": -1}}, "sampling_defaults"),
    ({"graph": {"nodes": []}, "stream": "yes"}, "stream"),
])
def test_bad_bodies_are_400s_naming_the_field(server, body, param):
    status, out = server.post("/run_program", body)
    assert status == 400 and out["error"]["param"] == param, out


# -- failures and aborts -----------------------------------------------------------------------
@rl.function
def bad_regex(s):
    s += "Number:" + rl.gen("ok", max_tokens=2)
    s += " Code:" + rl.gen("code", regex="([a-z", max_tokens=4)


def test_a_failing_gen_names_its_variable_and_other_programs_finish(server, both):
    async def go() -> tuple[list[Any], dict[str, Any]]:
        async with aiohttp.ClientSession() as http:
            async def failing() -> list[Any]:
                async with http.post(server.url + "/run_program",
                                     json={"graph": graph_of(bad_regex), "stream": True}) as resp:
                    return await read_sse(resp)

            async def good() -> dict[str, Any]:
                async with http.post(server.url + "/run_program", json={
                        "graph": graph_of(forked), "sampling_defaults": {"temperature": 0}}) as resp:
                    assert resp.status == 200
                    return await resp.json()

            return await asyncio.gather(failing(), good())

    events, other = asyncio.run(go())
    error = events[-2]["error"]
    assert error["variable"] == "code" and error["state"] == "root" and "gen('code')" in error["message"]
    assert not any(e.get("done") for e in events[:-1] if isinstance(e, dict))
    assert len(other["variables"]["fruit"]) == 2
    status, out = server.post("/run_program", {"graph": graph_of(bad_regex)})  # not streamed: the HTTP error
    assert status == 400 and out["error"]["variable"] == "code"
    with pytest.raises(BackendError) as err:
        bad_regex.run(backend=both[1])
    assert "'code'" in "".join(err.value.__notes__)


@rl.function
def long_fork(s):
    s += "Count to a thousand:"
    f = s.fork(2)
    f += rl.gen("count", max_tokens=1900, ignore_eos=True)
    f.join()


def test_client_disconnect_aborts_every_request_of_the_program(server):
    async def go() -> None:
        async with aiohttp.ClientSession() as http:
            resp = await http.post(server.url + "/run_program", json={"graph": graph_of(long_fork), "stream": True})
            assert resp.status == 200
            seen: set[str] = set()
            while len(seen) < 2:  # both branches are decoding
                line = (await resp.content.readline()).strip()
                if line.startswith(b"data: "):
                    seen.add(json.loads(line[6:])["state"])
                    seen.discard("root")
            resp.close()

    asyncio.run(go())
    info = server.wait_until("the program's requests to be aborted",
                             lambda i: i["requests_in_flight"] == 0 and i["stats"]["running_requests"] == 0)
    assert info["http_handlers_in_flight"] == 0
    assert server.metric("radixlm_requests_total", 'finish_reason="abort"') >= 2  # not left to finish


# -- program-aware scheduling ------------------------------------------------------------------
@rl.function
def tree(s, i: int):
    s += f"Problem {i}: name a number." + rl.gen("start", max_tokens=3, ignore_eos=True)
    f = s.fork(3)
    for k, b in enumerate(f):
        b += f"\nIdea {k}:" + rl.gen("idea", max_tokens=3, ignore_eos=True)
        g = b.fork(2)
        for j, c in enumerate(g):
            c += f"\nCheck {j}:" + rl.gen("check", max_tokens=2, ignore_eos=True)
        g.join()
    f.join()
    s += "\nBest:" + rl.select("best", choices=[" first", " second"])


def test_greedy_results_are_the_same_with_program_scheduling_on_and_off(server):
    """8 concurrent programs of forks within forks, run on this server (program scheduling on) and
    on one started with it off: the same variables."""
    with start_server(*OPTIONS, "--program-scheduling=off") as off:
        args = [{"i": i} for i in range(8)]
        runs = [tree.run_batch(args, backend=RuntimeEndpoint(s.url, programs="server"), temperature=0,
                               concurrency=8) for s in (server, off)]
    on_vars, off_vars = ([s.variables() for s in r] for r in runs)
    assert all(s.error() is None for r in runs for s in r)
    assert on_vars == off_vars and len(on_vars[0]["check"]) == 3


def test_program_metrics_move_and_nothing_stays_held(server):
    names = ("radixlm_programs_finished_total", "radixlm_program_latency_seconds_count",
             "radixlm_program_round_trips_saved_total")
    before = [server.metric(names[0], 'outcome="ok"'), server.metric(names[1]), server.metric(names[2])]
    errors = server.metric(names[0], 'outcome="error"')
    was = server.server_info()["stats"]
    known = was["programs_scheduled"]  # (client-driven runs of earlier tests)
    state = tree.run(0, backend=RuntimeEndpoint(server.url, programs="server"), temperature=0)
    assert state.error() is None
    after = [server.metric(names[0], 'outcome="ok"'), server.metric(names[1]), server.metric(names[2])]
    assert after[0] == before[0] + 1 and after[1] == before[1] + 1
    # 1 + 3 + 6 gens, fork prefills (root and each of the 3 branches) and the select's scoring
    assert after[2] - before[2] >= 10 + 4 + 1
    assert server.metric("radixlm_programs_running") == 0
    status, _ = server.post("/run_program", {"graph": graph_of(bad_regex)})
    assert status == 400 and server.metric(names[0], 'outcome="error"') == errors + 1
    # the engine forgot the programs: no fork prefix stays locked for them
    stats = server.server_info()["stats"]
    assert stats["programs_scheduled"] == known and stats["program_held_tokens"] == 0
    # the tree's levels came one after another: a round trip each at least (counted in steps,
    # which do not pass while the engine waits for the next request alone)
    assert stats["program_returns"] - was["program_returns"] >= 2
    assert stats["program_returns"] >= stats["program_returns_late"] >= 0 and stats["program_return_steps"] >= 0


@pytest.mark.parametrize("program", [
    "p", {"group": "g"}, {"id": ""}, {"id": "p", "hold": -1}, {"id": "p", "hold": 2}, {"id": "p", "x": 1},
    {"id": "p", "group": "g", "hold": "3"}, {"id": "p", "managed": True},  # (only the server's own programs are)
])
def test_bad_program_fields_on_generate_are_400s(server, program):
    status, out = server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 1},
                                            "program": program})
    assert status == 400 and out["error"]["param"] == "program", out


def test_a_client_may_name_its_program_on_generate(server):
    tag = {"id": "my-program", "group": "f0", "hold": 2}
    out = server.generate({"text": "Count: one, two,", "sampling_params": {"max_new_tokens": 0}, "program": tag})
    assert out["meta_info"]["prompt_tokens"] > 0
    held = server.server_info()["stats"]["program_held_tokens"]
    assert held >= out["meta_info"]["prompt_tokens"] - 1  # its prefix is kept for the fork's 2 branches
    for i in range(2):
        server.generate({"text": f"Count: one, two, {i}", "sampling_params": {"max_new_tokens": 1},
                         "program": {"id": "my-program", "group": "f0"}})
    assert server.server_info()["stats"]["program_held_tokens"] == 0  # both branches came


def test_a_program_run_step_by_step_names_itself_on_each_request(server):
    """The client's requests of one program carry one program id of its own (the scheduler then
    prefers them over new programs' requests); a server that does not take the field gets none."""
    progs = load(ROOT / "tests" / "lang" / "test_programs.py", "lang_test_programs3")

    def known() -> int:
        return server.server_info()["stats"]["programs_scheduled"]

    start = known()
    progs.reads_values.run(backend=RuntimeEndpoint(server.url), temperature=0)  # no graph: run live
    assert known() == start + 1
    progs.fork_join.run(backend=RuntimeEndpoint(server.url, programs="client"), temperature=0)  # its graph, here
    progs.fork_join.run(backend=RuntimeEndpoint(server.url, programs="client"), temperature=0)
    assert known() == start + 3  # one id per run
    untagged = RuntimeEndpoint(server.url, programs="client")
    untagged.tags_programs = False  # as for an SGLang server
    progs.few_shot_qa.run("What is 2 + 2?", backend=untagged, temperature=0)
    assert known() == start + 3
    assert server.server_info()["stats"]["program_held_tokens"] == 0  # a client's run holds no fork prefix


# -- hostile graphs ----------------------------------------------------------------------------
@pytest.mark.parametrize("nodes, needle", [
    ([{"op": "join", "fork": 0}, {"op": "fork", "id": 0, "branches": [[]]}], "not forked earlier"),
    ([{"op": "fork", "id": 0, "branches": [[{"op": "join", "fork": 0}]]}, {"op": "join", "fork": 0}],
     "not forked earlier"),  # a branch joining the fork it belongs to: a cycle
    ([{"op": "gen", "name": "x", "sampling": {"max_new_tokens": -3}}], "max_new_tokens"),
    ([{"op": "select", "name": "x", "choices": []}], "choices"),
    ([{"op": "text"}], "text"),
])
def test_cycles_and_malformed_nodes_are_400s(server, nodes, needle):
    status, out = server.post("/run_program", {"graph": {"nodes": nodes}})
    assert status == 400, out
    assert any(needle in p for p in out["error"]["errors"]), out


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
NODE_OPS = ["text", "gen", "select", "fork", "join", "role_begin", "role_end", "var_begin", "var_end", "exec"]
NODES = st.fixed_dictionaries({"op": st.sampled_from(NODE_OPS)}, optional={
    "text": JSON_VALUES, "name": JSON_VALUES, "sampling": JSON_VALUES, "choices": JSON_VALUES,
    "id": st.integers(-1, 3) | JSON_VALUES, "fork": st.integers(-1, 3), "role": st.sampled_from(["user", "x"]),
    "branches": st.lists(st.lists(st.fixed_dictionaries({"op": st.sampled_from(NODE_OPS)}), max_size=2),
                         max_size=2)})
BODIES = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries({"graph": st.one_of(JSON_VALUES, st.fixed_dictionaries(
        {"nodes": st.lists(NODES, max_size=6)}, optional={"version": JSON_VALUES, "program": JSON_VALUES}))},
        optional={"stream": JSON_VALUES, "sampling_defaults": JSON_VALUES, "session_id": JSON_VALUES}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(body=BODIES)
def test_random_bodies_never_give_a_server_error(server, body):
    """Random JSON bodies and near-graphs: a 400 (or, for a graph that happens to be valid, a 200 or
    a program error), never a 5xx."""
    if isinstance(body, dict) and isinstance(body.get("graph"), dict):
        for node in body["graph"].get("nodes", []):
            if node.get("op") == "gen" and isinstance(node.get("sampling"), dict):
                node["sampling"]["max_new_tokens"] = 2  # valid gens stay short
    status, out = server.post("/run_program", body)
    assert status < 500, (body, out)
    if status != 200:
        assert "error" in out or isinstance(out, str), out
