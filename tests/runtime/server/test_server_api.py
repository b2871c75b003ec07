"""The HTTP runtime end to end: a real `radixlm serve` process on the default model (fp32, greedy),
driven by the official openai client, raw aiohttp and urllib."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from server_harness import Server, next_event, read_sse, start_server

pytestmark = pytest.mark.slow

MAX_REQUEST_BYTES = 256 * 1024
GREEDY = {"temperature": 0, "max_new_tokens": 8}
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server():
    # fp32: greedy outputs are then identical batched or alone, so they can be compared exactly
    s = start_server("--dtype", "float32", "--max-total-tokens", "16384", "--context-length", "2048",
                     "--max-request-bytes", str(MAX_REQUEST_BYTES), "--served-model-name", "smol")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


# -- info routes --------------------------------------------------------------------------
def test_info_routes(server: Server):
    assert server.get("/health") == (200, {"status": "ok"})
    status, info = server.get("/get_model_info")
    assert status == 200
    assert info["context_length"] == 2048 and info["is_generation"] is True
    assert info["chat_template"] == "chatml" and info["tokenizer_path"]
    status, models = server.get("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["smol"]
    assert server.get("/v1/models/smol")[0] == 200
    assert server.get("/v1/models/other")[0] == 404
    assert server.get("/health_generate") == (200, {"status": "ok"})
    stats = server.server_info()["stats"]
    assert stats["kv_slots_total"] == 16384 and stats["running_requests"] == 0
    engine = server.server_info()["engine"]  # an explicit --dtype is reported as such
    assert (engine["dtype"], engine["dtype_reason"]) == ("float32", "set by --dtype")
    assert engine["quantization"] == "none" and "float32" in engine["quantization_reason"]


def test_model_info_tokenizer_facts(server: Server, smol_tokenizer):
    from radixlm.runtime.chat_template import from_tokenizer

    info = server.get("/get_model_info")[1]
    assert info["chat_template_jinja"] == smol_tokenizer.chat_template
    special = info["special_tokens"]
    assert (special["bos_token"], special["eos_token"]) == (smol_tokenizer.bos_token, smol_tokenizer.eos_token)
    assert special["eos_token_id"] in info["eos_token_ids"] and special["add_bos_token"] is False
    # the role markers the in-process Engine backend derives from the same tokenizer
    assert info["role_markers"] == from_tokenizer(smol_tokenizer).to_dict()
    assert info["role_markers"]["default_system"].startswith("<|im_start|>system\n")


def test_tokenize_and_detokenize(server: Server, smol_tokenizer):
    text = "<|im_start|>user\nHello, radix trees!<|im_end|>"
    ids = smol_tokenizer.encode(text)
    status, got = server.post("/tokenize", {"prompt": text})
    assert status == 200 and got == {"tokens": ids, "count": len(ids), "max_model_len": 2048}
    status, got = server.post("/tokenize", {"prompt": [text, "a b"], "add_special_tokens": False, "model": "smol"})
    assert status == 200 and got["tokens"] == [ids, smol_tokenizer.encode("a b", add_special_tokens=False)]
    assert got["count"] == [len(ids), len(got["tokens"][1])]
    assert server.post("/tokenize", {"prompt": ""})[1]["count"] == 0
    # special tokens are dropped by default (SGLang's skip_special_tokens=true), kept on request
    assert server.post("/detokenize", {"tokens": ids}) == (200, {"text": "user\nHello, radix trees!"})
    status, got = server.post("/detokenize", {"tokens": [ids, []], "skip_special_tokens": False})
    assert status == 200 and got == {"text": [text, ""]}


# -- OpenAI client ------------------------------------------------------------------------
def test_openai_chat_matches_native_generate(server: Server, oai: openai.OpenAI, smol_tokenizer):
    r = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == "smol" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    ids = smol_tokenizer.encode(
        smol_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    native = server.generate({"input_ids": ids, "sampling_params": GREEDY})
    assert native["text"] == choice.message.content
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == native["meta_info"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the same prompt again reads its prefix from the radix cache
    again = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == choice.message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= len(ids) - 1


def test_openai_completion_n_and_stop(server: Server, oai: openai.OpenAI):
    prompt = "The days of the week are Monday, Tuesday,"
    r = oai.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert r.object == "text_completion" and text == server.generate(
        {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12}})["text"]
    # stop string: trimmed, finish_reason stop
    stop = text.strip()[:4]
    r = oai.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert text.startswith(r.choices[0].text)
    # n samples of one prompt, and a batch of prompts: choices are prompt-major
    r = oai.completions.create(model="smol", prompt=[prompt, "One, two,"], n=2, max_tokens=4, temperature=0,
                               extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == text[: len(r.choices[0].text)]
    assert r.usage.completion_tokens == 16


def test_openai_streaming(oai: openai.OpenAI):
    full = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    prompt = "Once upon a time"
    whole = oai.completions.create(model="smol", prompt=prompt, max_tokens=10, temperature=0).choices[0].text
    parts = oai.completions.create(model="smol", prompt=prompt, max_tokens=10, temperature=0, stream=True, n=2)
    texts = ["", ""]
    for c in parts:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [whole, whole]


def test_openai_logprobs(server: Server, oai: openai.OpenAI):
    r = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
        assert entry.bytes == list(entry.token.encode())
    streamed = list(oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=3, stream=True))
    stream_lps = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in stream_lps] == [e.token for e in content]
    assert [e.logprob for e in stream_lps] == pytest.approx([e.logprob for e in content], abs=1e-5)

    c = oai.completions.create(model="smol", prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2, echo=True)
    lp = c.choices[0].logprobs
    prompt_len = c.usage.prompt_tokens
    assert len(lp.tokens) == prompt_len + 4 and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == c.choices[0].text and c.choices[0].text.startswith("1, 2, 3,")
    assert all(len(d) >= 2 for d in lp.top_logprobs[prompt_len:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_openai_errors(oai: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="smol", messages=CHAT, temperature=5)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="smol", messages=CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "2"}}})
    assert "cannot compile json_schema" in str(e.value) and e.value.body["param"] == "response_format"
    r = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=24, temperature=0,
                                    response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    # text is the default format and fine
    r = oai.chat.completions.create(model="smol", messages=CHAT, max_tokens=2, response_format={"type": "text"})
    assert r.usage.completion_tokens <= 2


# -- SSE framing --------------------------------------------------------------------------
def test_raw_sse_framing(server: Server):
    async def run() -> tuple[str, bytes]:
        async with aiohttp.ClientSession() as s:
            body = {"model": "smol", "messages": CHAT, "max_tokens": 5, "temperature": 0, "stream": True}
            async with s.post(server.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                return resp.headers["Content-Type"], await resp.read()

    ctype, raw = asyncio.run(run())
    assert ctype.startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and frames[-2] == b"data: [DONE]"
    for frame in frames[:-2]:
        assert frame.startswith(b"data: {") and b"\n" not in frame
        assert json.loads(frame[6:])["object"] == "chat.completion.chunk"


# -- native /generate ---------------------------------------------------------------------
def test_generate_single_and_batch(server: Server):
    prompts = ["The capital of France is", "1 + 1 ="]
    singles = [server.generate({"text": p, "sampling_params": GREEDY}) for p in prompts]
    for s in singles:
        assert set(s) == {"text", "output_ids", "meta_info"}
        m = s["meta_info"]
        assert m["completion_tokens"] == len(s["output_ids"]) and m["prompt_tokens"] > 0
        assert m["finish_reason"]["type"] in ("stop", "length")
    batch = server.generate({"text": prompts, "sampling_params": GREEDY})
    assert isinstance(batch, list) and [b["text"] for b in batch] == [s["text"] for s in singles]
    ids = server.generate({"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": [GREEDY, {**GREEDY, "n": 2}],
                           "rid": ["a", "b"]})
    assert [o["meta_info"]["id"] for o in ids] == ["a", "b-0", "b-1"]
    assert ids[1]["text"] == ids[2]["text"]


def test_generate_stream(server: Server):
    body = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    whole = server.generate(body)

    async def run() -> list:
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/generate", json={**body, "stream": True}) as resp:
                assert resp.status == 200
                return await read_sse(resp)

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, as SGLang streams
    assert texts[-1] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_generate_constrained_native_and_openai(server: Server, oai: openai.OpenAI):
    phone = server.generate({"text": "Call me at ", "sampling_params": {
        "temperature": 0, "max_new_tokens": 20, "regex": r"\d{3}-\d{4}"}})
    assert len(phone["text"]) == 8 and phone["text"][3] == "-" and phone["text"].replace("-", "").isdigit()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"]}
    body = {"text": "A city as JSON:", "sampling_params": {"temperature": 0, "max_new_tokens": 48,
                                                            "json_schema": json.dumps(schema)}}
    whole = server.generate(body)
    obj = json.loads(whole["text"])
    assert set(obj) == {"city", "population"} and whole["meta_info"]["forced_tokens"] > 0

    async def stream() -> list:
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/generate", json={**body, "stream": True}) as resp:
                assert resp.status == 200
                return await read_sse(resp)

    chunks = asyncio.run(stream())[:-1]
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    chat = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Name a city as JSON."}], temperature=0,
        max_tokens=48, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert set(json.loads(chat.choices[0].message.content)) == {"city", "population"}
    assert chat.choices[0].finish_reason == "stop"


def test_generate_logprobs(server: Server, smol_tokenizer):
    text = "The capital of France is"
    n_prompt = len(smol_tokenizer.encode(text))
    out = server.generate({"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                           "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                           "return_text_in_logprobs": True})
    m = out["meta_info"]
    assert len(m["input_token_logprobs"]) == n_prompt and m["input_token_logprobs"][0][0] is None
    assert all(lp <= 0 for lp, _, _ in m["input_token_logprobs"][1:])
    assert [t for _, t, _ in m["output_token_logprobs"]] == out["output_ids"]
    assert "".join(s for _, _, s in m["output_token_logprobs"]) == out["text"]
    assert len(m["output_top_logprobs"]) == 4 and all(len(step) == 2 for step in m["output_top_logprobs"])
    assert [step[0][1] for step in m["output_top_logprobs"]] == out["output_ids"]  # greedy picks the top token
    plain = server.generate({"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                             "return_logprob": True})
    assert plain["meta_info"]["output_token_logprobs"][0][2] is None  # no text unless asked


def test_generate_prefill_only(server: Server):
    out = server.generate({"text": "Score this prompt.", "sampling_params": {"max_new_tokens": 0},
                           "return_logprob": True, "logprob_start_len": 0})
    m = out["meta_info"]
    assert out["text"] == "" and out["output_ids"] == [] and m["completion_tokens"] == 0
    assert len(m["input_token_logprobs"]) == m["prompt_tokens"]
    assert m["finish_reason"]["type"] == "length"


def test_abort_request_by_rid(server: Server):
    async def run() -> dict:
        async with aiohttp.ClientSession() as s:
            body = {"text": "Tell me a long story.", "rid": "to-abort", "stream": True,
                    "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}
            async with s.post(server.url + "/generate", json=body) as resp:
                await next_event(resp)
                async with s.post(server.url + "/abort_request", json={"rid": "to-abort"}) as r:
                    assert r.status == 200 and (await r.json())["aborted"] == 1
                events = await read_sse(resp)
        return events[-2]

    last = asyncio.run(run())
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 1000


# -- concurrency --------------------------------------------------------------------------
WORDS = "apple river stone cloud music paper garden window silver orange".split()


def _concurrent_bodies() -> list[dict]:
    return [
        {"text": f"Item {i}: " + " ".join(WORDS[: 1 + i % len(WORDS)]),
         "sampling_params": {"temperature": 0, "max_new_tokens": 1 + i % 7}}
        for i in range(64)
    ]


def test_64_concurrent_streams_equal_one_at_a_time(server: Server):
    bodies = _concurrent_bodies()
    alone = [server.generate(b) for b in bodies]
    bad = [{"text": "x", "sampling_params": {"top_p": 0}}, {"input_ids": [10**9]}, {"text": ""}, {"txt": "x"}]

    async def stream_one(s: aiohttp.ClientSession, body: dict) -> tuple[int, list]:
        async with s.post(server.url + "/generate", json={**body, "stream": True}) as resp:
            if resp.status != 200:
                return resp.status, [await resp.json()]
            return resp.status, await read_sse(resp)

    async def run() -> list:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            return await asyncio.gather(*[stream_one(s, b) for b in bodies + bad])

    results = asyncio.run(run())
    for (status, events), ref in zip(results[:64], alone):
        assert status == 200 and events[-1] == "[DONE]"
        assert events[-2]["text"] == ref["text"] and events[-2]["output_ids"] == ref["output_ids"]
    assert [status for status, _ in results[64:]] == [400] * len(bad)  # bad neighbours affect no one


def test_disconnects_free_requests_and_kv(server: Server):
    aborts_before = server.metric("radixlm_requests_total", 'finish_reason="abort"')
    long = {"sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}

    async def run() -> None:
        sessions = [aiohttp.ClientSession() for _ in range(22)]
        try:
            streams = []
            for i, s in enumerate(sessions[:20]):
                resp = await s.post(server.url + "/generate", json={"text": f"Story {i}:", "stream": True, **long})
                streams.append(resp)
            for resp in streams:
                assert resp.status == 200
                await next_event(resp)  # each one is generating now
            # two plain (non-streaming) requests, dropped while they run
            plain = [asyncio.create_task(s.post(server.url + "/generate", json={"text": f"Essay {i}:", **long}))
                     for i, s in enumerate(sessions[20:])]
            await asyncio.to_thread(server.wait_until, "the plain requests to run",
                                    lambda info: info["stats"]["running_requests"] >= 22)
            for t in plain:
                t.cancel()
            await asyncio.gather(*plain, return_exceptions=True)
            for resp in streams:
                resp.close()
        finally:
            for s in sessions:
                await s.close()

    asyncio.run(run())
    info = server.wait_until("the aborted requests to release their KV",
                             lambda info: info["stats"]["running_requests"] == 0
                             and info["stats"]["waiting_requests"] == 0
                             and info["stats"]["kv_slots_used_by_requests"] == 0
                             and info["requests_in_flight"] == 0)
    assert info["stats"]["cache_protected_tokens"] == 0
    assert server.metric("radixlm_requests_total", 'finish_reason="abort"') == aborts_before + 22
    assert server.metric("radixlm_num_running_requests") == 0
    assert server.metric("radixlm_kv_slots_used") == 0


# -- validation ---------------------------------------------------------------------------
BAD_INPUTS = [
    # (route, body (dict, or raw bytes), status, message fragment, param)
    ("/generate", b"{bad", 400, "not valid JSON", None),
    ("/generate", b"[1, 2]", 400, "must be a JSON object", None),
    ("/generate", b"", 400, "body is empty", None),
    ("/generate", {}, 400, "exactly one of text or input_ids", None),
    ("/generate", {"text": "a", "input_ids": [1]}, 400, "exactly one of text or input_ids", "text"),
    ("/generate", {"text": 5}, 400, "text must be a string", "text"),
    ("/generate", {"text": ""}, 400, "text is empty", "text"),
    ("/generate", {"input_ids": []}, 400, "input_ids is empty", "input_ids"),
    ("/generate", {"input_ids": ["a"]}, 400, "input_ids must be a list of integer", "input_ids"),
    ("/generate", {"input_ids": [-1]}, 400, "outside the vocabulary", "input_ids"),
    ("/generate", {"input_ids": [1] * 2048}, 400, "context length of 2048", "input_ids"),
    ("/generate", {"text": "a", "foo": 1}, 400, "unknown field 'foo'", "foo"),
    ("/generate", {"text": "a", "image_data": "x.png"}, 400, "image_data is not supported", "image_data"),
    ("/generate", {"text": "a", "sampling_params": {"foo": 1}}, 400, "unknown sampling parameter 'foo'",
     "sampling_params"),
    ("/generate", {"text": "a", "sampling_params": "hot"}, 400, "sampling_params must be an object",
     "sampling_params"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400, "max_new_tokens must be >= 0",
     "sampling_params"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "9"}}, 400, "max_new_tokens must be an int",
     "sampling_params"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -0.5}}, 400, "temperature must be in [0, 100]",
     "sampling_params"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p must be in (0, 1]", "sampling_params"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "a("}}, 400, "cannot compile regex", "sampling_params"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": "{x"}}, 400, "json_schema is not valid JSON",
     "sampling_params"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "1 entries for 2 prompts", "sampling_params"),
    ("/generate", {"text": "a", "return_logprob": "yes"}, 400, "return_logprob must be true or false",
     "return_logprob"),
    ("/generate", {"text": "a", "top_logprobs_num": -1}, 400, "top_logprobs_num must be >= 0", "top_logprobs_num"),
    ("/generate", {"text": "a", "top_logprobs_num": 10**6}, 400, "top_logprobs_num must be <= 20",
     "top_logprobs_num"),
    ("/generate", {"text": "a", "rid": 7}, 400, "rid must be a non-empty string", "rid"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages must be a non-empty list", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role must be one of",
     "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "text part", "messages[0].content[0]"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3}, 400, "max_tokens must be >= 0", "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 3}, 400, "temperature must be <= 2", "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n must be >= 1", "n"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": 5}, 400, "stop must be a string or a list", "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 1.5}, 400, "seed must be an integer", "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, 400, "needs logprobs", "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400,
     "only allowed with stream", "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"1": 500}}, 400, "a number in [-100, 100]",
     "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"x": 5}}, 400, "keys must be token ids",
     "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"999999999": 5}}, 400, "outside the vocabulary",
     "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "suffix": "x"}, 400, "suffix is not supported", "suffix"),
    ("/v1/chat/completions", {"messages": CHAT, "foo": 1}, 400, "unknown field 'foo'", "foo"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, 400,
     "cannot compile json_schema", "response_format"),
    ("/v1/completions", {"prompt": "a", "regex": "[z-a]"}, 400, "cannot compile regex", "regex"),
    ("/v1/completions", {"model": "smol"}, 400, "prompt is required", "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt is empty", "prompt"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, 400, "best_of must equal n", "best_of"),
    ("/v1/completions", {"prompt": "a", "logprobs": 99}, 400, "logprobs must be <= 20", "logprobs"),
    ("/abort_request", {}, 400, "give rid", "rid"),
    ("/tokenize", {}, 400, "prompt is required", "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt must be a string or a non-empty list", "prompt"),
    ("/tokenize", {"prompt": []}, 400, "prompt must be a string or a non-empty list", "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens must be true or false",
     "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "text": "b"}, 400, "unknown field 'text'", "text"),
    ("/tokenize", b"{bad", 400, "not valid JSON", None),
    ("/detokenize", {}, 400, "tokens is required", "tokens"),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens must be a list of integer token ids", "tokens"),
    ("/detokenize", {"tokens": [1, [2]]}, 400, "tokens must be a list of integer token ids", "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "outside the vocabulary", "tokens"),
    ("/detokenize", {"tokens": [[1], [10**9]]}, 400, "outside the vocabulary", "tokens[1]"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": 1}, 400, "skip_special_tokens must be true or false",
     "skip_special_tokens"),
]


@pytest.mark.parametrize("route,body,status,fragment,param", BAD_INPUTS,
                         ids=[f"{r}-{i}" for i, (r, *_rest) in enumerate(BAD_INPUTS)])
def test_bad_input(server: Server, route, body, status, fragment, param):
    raw = body if isinstance(body, bytes) else None
    got_status, got = server.request("POST", route, None if raw is not None else body, raw=raw)
    assert got_status == status, got
    err = got["error"]
    assert fragment in err["message"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_body_too_large_and_unknown_routes(server: Server):
    big = json.dumps({"text": "a" * (MAX_REQUEST_BYTES + 10)}).encode()
    status, got = server.request("POST", "/generate", raw=big)
    assert status == 413 and "larger than the limit" in got["error"]["message"]
    status, got = server.get("/no/such/route")
    assert status == 404 and "no route" in got["error"]["message"]
    status, got = server.request("PUT", "/generate", {})
    assert status == 405 and "not allowed" in got["error"]["message"]
    assert server.get("/health")[0] == 200  # none of it hurt the server


def test_metrics(server: Server):
    status, text = server.get("/metrics")
    assert status == 200
    for name in ("radixlm_time_to_first_token_seconds_bucket", "radixlm_inter_token_latency_seconds_bucket",
                 "radixlm_e2e_request_latency_seconds_bucket", "radixlm_prompt_tokens_total",
                 "radixlm_generation_tokens_total", "radixlm_num_running_requests", "radixlm_num_waiting_requests",
                 "radixlm_kv_slots_used", "radixlm_radix_cache_hit_rate", "radixlm_engine_up"):
        assert name in text, name
    assert server.metric("radixlm_requests_total", 'finish_reason="length"') > 0
    assert server.metric("radixlm_generation_tokens_total") > 0
    assert 0 < server.metric("radixlm_radix_cache_hit_rate") < 1
    assert server.metric("radixlm_http_responses_total", 'status="400"') >= len(BAD_INPUTS) - 1
    assert server.metric("radixlm_http_responses_total", 'status="500"') == 0


def test_a_request_that_is_not_streamed_is_timed_like_one_that_is(server: Server):
    """A non-streamed request's output reaches the server whole (one engine message); its first
    token and the gaps between its tokens are still counted in the histograms."""
    body = {"text": "Count to twenty:", "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    ttft, itl = (server.metric(f"radixlm_{m}_seconds_count") for m in ("time_to_first_token", "inter_token_latency"))
    e2e = server.metric("radixlm_e2e_request_latency_seconds_sum")
    out = server.generate(body)
    assert len(out["output_ids"]) == 8
    assert server.metric("radixlm_time_to_first_token_seconds_count") == ttft + 1
    assert server.metric("radixlm_inter_token_latency_seconds_count") == itl + 7
    took = server.metric("radixlm_e2e_request_latency_seconds_sum") - e2e
    assert 0 < out["meta_info"]["ttft"] <= took
