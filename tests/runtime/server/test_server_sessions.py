"""Sessions over HTTP: /open_session, /close_session, /generate with session_params, OpenAI chat
with session_id, their 404 / 400 cases and metrics, on a real server (fp32, greedy)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from server_harness import Server, read_sse, start_server

pytestmark = pytest.mark.slow

CHAT = {"temperature": 0, "max_new_tokens": 10}


@pytest.fixture(scope="module")
def server():
    s = start_server("--dtype", "float32", "--max-total-tokens", "4096", "--context-length", "1024",
                     "--served-model-name", "smol")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat_turns(tok, questions: list[str]) -> list[list[int]]:
    first = tok.encode(tok.apply_chat_template([{"role": "user", "content": questions[0]}],
                                               add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    return [first] + [tok.encode(f"\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                                 add_special_tokens=False) for q in questions[1:]]


def _open(server: Server, **body) -> str:
    status, sid = server.post("/open_session", body)
    assert status == 200 and isinstance(sid, str), sid
    return sid


def test_native_turns_equal_full_history_and_branch(server: Server, smol_tokenizer):
    turns = _chat_turns(smol_tokenizer, ["My name is Ada.", "What is the capital of France?", "Name a colour."])
    sid = _open(server, capacity=1000)
    history: list[int] = []
    outs = []
    for i, new in enumerate(turns):
        body = {"input_ids": new, "sampling_params": CHAT, "session_params": {"id": sid, "rid": None}}
        if outs:
            body["session_params"]["rid"] = outs[-1]["meta_info"]["id"]
        out = server.generate(body)
        meta = out["meta_info"]
        assert meta["session_id"] == sid and meta["prompt_tokens"] == len(history) + len(new)
        if i:
            assert meta["cached_tokens"] >= len(history) - 1
        ref = server.generate({"input_ids": history + new, "sampling_params": CHAT})
        assert ref["output_ids"] == out["output_ids"]
        history += new + out["output_ids"]
        outs.append(out)
    # replace turn 2: continue turn 1 and drop what followed
    new2 = _chat_turns(smol_tokenizer, ["", "What is the capital of Italy?"])[1]
    branch = server.generate({"input_ids": new2, "sampling_params": CHAT, "rid": "branch-2",
                              "session_params": {"id": sid, "rid": outs[0]["meta_info"]["id"], "replace": True}})
    assert branch["meta_info"]["id"] == "branch-2"
    fresh = turns[0] + outs[0]["output_ids"] + new2
    assert branch["output_ids"] == server.generate({"input_ids": fresh, "sampling_params": CHAT})["output_ids"]
    status, err = server.post("/generate", {"input_ids": new2, "sampling_params": CHAT,
                                            "session_params": {"id": sid, "rid": outs[2]["meta_info"]["id"]}})
    assert status == 400 and "no turn" in err["error"]["message"]
    # a streamed turn continues the branch
    async def stream() -> list:
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": turns[2], "sampling_params": CHAT, "stream": True, "session_params": {"id": sid}}
            async with s.post(server.url + "/generate", json=body) as resp:
                assert resp.status == 200
                return await read_sse(resp)

    events = asyncio.run(stream())
    last = events[-2]["meta_info"]
    assert events[-1] == "[DONE]" and last["session_id"] == sid
    assert last["cached_tokens"] >= len(fresh) + len(branch["output_ids"]) - 1
    assert server.post("/close_session", {"session_id": sid}) == (200, {"session_id": sid, "closed": True})


def test_openai_chat_with_session_id(server: Server, oai: openai.OpenAI):
    sid = _open(server)
    messages: list[dict] = [{"role": "user", "content": "My name is Ada."}]
    history = 0
    for i, q in enumerate(["What is my name?", "Name a colour."]):
        r = oai.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0,
                                        extra_body={"session_id": sid})
        plain = oai.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == plain.choices[0].message.content
        if i:
            assert r.usage.prompt_tokens_details.cached_tokens >= history - 1
        history = r.usage.prompt_tokens + r.usage.completion_tokens
        messages += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": q}]
    with pytest.raises(openai.BadRequestError, match="one choice"):
        oai.chat.completions.create(model="smol", messages=messages, n=2, extra_body={"session_id": sid})
    server.post("/close_session", {"session_id": sid})
    with pytest.raises(openai.NotFoundError, match="not open"):
        oai.chat.completions.create(model="smol", messages=messages, max_tokens=2, extra_body={"session_id": sid})


@pytest.mark.parametrize("path, body, status, needle", [
    ("/open_session", {"capacity": 0}, 400, "capacity"),
    ("/open_session", {"capacity": 5, "capacity_of_str_len": 5}, 400, "not both"),
    ("/open_session", {"ttl": -1}, 400, "ttl"),
    ("/open_session", {"bogus": 1}, 400, "bogus"),
    ("/close_session", {}, 400, "session_id"),
    ("/close_session", {"session_id": "never-opened"}, 404, "not open"),
    ("/generate", {"input_ids": [1, 2], "session_params": {"id": "never-opened"}}, 404, "not open"),
    ("/generate", {"input_ids": [1, 2], "session_params": {"id": "x", "bogus": 1}}, 400, "bogus"),
    ("/generate", {"input_ids": [[1, 2], [3]], "session_params": {"id": "x"}}, 400, "one prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "session_id": "never-opened"}, 404,
     "not open"),
])
def test_session_errors(server: Server, path, body, status, needle):
    got, err = server.post(path, body)
    assert got == status and needle in err["error"]["message"], err
    assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_duplicate_id_capacity_and_closed(server: Server):
    assert _open(server, session_id="fixed", capacity_of_str_len=12) == "fixed"
    status, err = server.post("/open_session", {"session_id": "fixed"})
    assert status == 400 and "already open" in err["error"]["message"]
    server.generate({"input_ids": list(range(100, 108)), "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                     "session_params": {"id": "fixed"}})
    status, err = server.post("/generate", {"input_ids": list(range(200, 205)), "session_params": {"id": "fixed"}})
    assert status == 400 and "at most 12 tokens" in err["error"]["message"]
    assert "15 (10 of history + 5 new)" in err["error"]["message"]
    assert server.post("/close_session", {"session_id": "fixed"})[0] == 200
    status, err = server.post("/generate", {"input_ids": [1], "session_params": {"id": "fixed"}})
    assert status == 404 and err["error"]["type"] == "not_found_error"


def test_session_stats_and_metrics(server: Server):
    sid = _open(server)
    names = ("turns", "cached_tokens", "history_tokens", "turn_hit_ratio_count")
    before = {n: server.metric(f"radixlm_session_{n}" + ("" if n.endswith("count") else "_total")) for n in names}
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    metas = [server.generate({"input_ids": ids, "sampling_params": params, "session_params": {"id": sid}})["meta_info"]
             for ids in (list(range(300, 340)), [5, 6])]
    assert metas[1]["session_history_tokens"] == 43 and metas[1]["cached_tokens"] >= 42
    stats = server.server_info()["stats"]
    assert stats["sessions_open"] >= 1 and stats["session_pinned_tokens"] >= 47
    assert server.metric("radixlm_sessions_open") == stats["sessions_open"]
    assert server.metric("radixlm_session_pinned_tokens") >= 47
    # per-turn counters: cached and history tokens of exactly these two turns; one hit ratio (turn 2 has history)
    assert server.metric("radixlm_session_turns_total") == before["turns"] + 2
    assert server.metric("radixlm_session_cached_tokens_total") == \
        before["cached_tokens"] + sum(m["cached_tokens"] for m in metas)
    assert server.metric("radixlm_session_history_tokens_total") == before["history_tokens"] + 43
    assert server.metric("radixlm_session_turn_hit_ratio_count") == before["turn_hit_ratio_count"] + 1
    assert server.metric("radixlm_session_turn_hit_ratio_bucket", 'le="0.95"') < \
        server.metric("radixlm_session_turn_hit_ratio_bucket", 'le="1.0"')
    pinned = stats["session_pinned_tokens"]
    server.post("/close_session", {"session_id": sid})
    assert server.server_info()["stats"]["session_pinned_tokens"] == pinned - 47
