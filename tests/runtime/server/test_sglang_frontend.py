"""SGLang's own frontend (PyPI ``sglang``, the ``sglang.lang`` package) against a real `radixlm serve`,
and the SGLang /generate fields it and other SGLang clients send (stop_regex, logit_bias, sampling_seed,
stream_interval, custom_params, structural_tag) and the routes they call.

The ``sglang`` tests skip when the package is not importable: nothing is installed at run time, and CI
does not install it (docs/server.md, "SGLang frontend", says how to install it for development). The
raw-protocol tests below them always run.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from server_harness import Server, read_sse, start_server

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server():
    s = start_server("--dtype", "float32", "--max-total-tokens", "8192", "--context-length", "1024")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def sgl(server: Server) -> Any:
    """The sglang package, with a RuntimeEndpoint on the server as its default backend."""
    sgl = pytest.importorskip("sglang")
    # SmolLM2 speaks ChatML; SGLang cannot tell that from the model path
    sgl.set_default_backend(sgl.RuntimeEndpoint(server.url, chat_template_name="chatml"))
    yield sgl
    sgl.set_default_backend(None)


# -- sglang.lang programs ------------------------------------------------------------------------
def test_gen_with_stop_regex_is_the_plain_output_cut_at_the_first_match(sgl):
    pattern = r"[Ff]rance\b"

    @sgl.function
    def qa(s, q, pat):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0, stop_regex=pat))

    plain = qa.run(q=QUESTION, pat=None)["answer"]
    m = re.search(pattern, plain)
    assert m is not None, plain  # the model's greedy answer names France
    state = qa.run(q=QUESTION, pat=pattern)
    assert state["answer"] == plain[: m.start()]
    assert state.get_meta_info("answer")["finish_reason"] == {"type": "stop", "matched": pattern}


def test_select_regex_and_json_schema(sgl):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    @sgl.function
    def program(s):
        s += "The capital of France is" + sgl.select("city", choices=[" Paris", " London", " Berlin"])
        s += "\nA number: " + sgl.gen("num", regex=r"[0-9]{1,3}", temperature=0, max_tokens=8)
        s += "\nJSON: " + sgl.gen("obj", json_schema=json.dumps(schema), temperature=0, max_tokens=32)
        s += "\nAn integer: " + sgl.gen_int("i", max_tokens=8, temperature=0)

    state = program.run()
    assert state["city"] == " Paris"
    meta = state.get_meta_info("city")
    assert len(meta["normalized_prompt_logprobs"]) == 3 and meta["normalized_prompt_logprobs"][0] == max(
        meta["normalized_prompt_logprobs"])
    assert re.fullmatch(r"[0-9]{1,3}", state["num"]), state["num"]
    assert isinstance(json.loads(state["obj"])["a"], int)
    int(state["i"])  # gen_int: SGLang's integer regex plus its stop strings


def test_fork_branches_equal_the_same_programs_unforked(sgl):
    @sgl.function
    def forked(s):
        s += "Two fruits:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"{i + 1}. " + sgl.gen("fruit", max_tokens=8, temperature=0, stop="\n")
        forks.join()

    @sgl.function
    def straight(s, i):
        s += "Two fruits:\n" + f"{i + 1}. " + sgl.gen("fruit", max_tokens=8, temperature=0, stop="\n")

    fruits = forked.run()["fruit"]
    assert fruits == [straight.run(i=i)["fruit"] for i in range(2)]
    assert all(f and "\n" not in f for f in fruits)


def test_stream_chunks_add_up_to_the_whole_answer(sgl):
    @sgl.function
    def qa(s):
        s += sgl.user("Name three colours.")
        s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0, stop_regex=r"\n\n"))

    whole = qa.run()["answer"]
    chunks = list(qa.run(stream=True).text_iter("answer"))
    assert len(chunks) > 2 and "".join(chunks) == whole


def test_return_logprob_and_top_logprobs(sgl):
    @sgl.function
    def qa(s):
        s += sgl.user(QUESTION) + sgl.assistant(sgl.gen("answer", max_tokens=6, temperature=0))

    state = qa.run(return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = state.get_meta_info("answer")
    out = meta["output_token_logprobs"]
    assert len(out) == meta["completion_tokens"] == 6
    assert "".join(text for _, _, text in out) == state["answer"]
    for (lp, tid, _), top in zip(out, meta["output_top_logprobs"]):
        assert lp <= 0 and len(top) == 2 and top[0][1] == tid  # greedy: the sampled token is the top one


def test_min_new_tokens(sgl):
    @sgl.function
    def short(s, min_tokens):
        s += sgl.user("Say yes.") + sgl.assistant(sgl.gen("a", max_tokens=48, min_tokens=min_tokens,
                                                          temperature=0))

    free = short.run(min_tokens=0).get_meta_info("a")
    assert free["finish_reason"]["type"] == "stop"  # ends on EOS by itself
    longer = short.run(min_tokens=free["completion_tokens"] + 5).get_meta_info("a")
    assert longer["completion_tokens"] >= free["completion_tokens"] + 5


def test_run_batch_flush_cache_and_server_info(sgl):
    @sgl.function
    def capital(s, country):
        s += f"The capital of {country} is" + sgl.gen("c", max_tokens=3, temperature=0)

    states = capital.run_batch([{"country": "France"}, {"country": "Italy"}])
    assert [s["c"] for s in states] == [capital.run(country=c)["c"] for c in ("France", "Italy")]
    info = sgl.get_server_info()  # GET /server_info
    assert info["version"] and info["stats"]["kv_slots_total"] == 8192
    sgl.flush_cache()  # POST /flush_cache


def test_stream_logprobs_are_those_of_the_new_tokens(sgl, server: Server):
    """SGLang's own test_stream_logprobs checks, on every chunk its RuntimeEndpoint reads."""
    from sglang.lang.ir import SglSamplingParams

    backend = sgl.RuntimeEndpoint(server.url, chat_template_name="chatml")
    state = SimpleNamespace(text_="The capital of France is", images_=[])  # what generate_stream reads
    params = SglSamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True, return_logprob=True,
                               top_logprobs_num=2)
    chunks = list(backend.generate_stream(state, params))
    assert len(chunks) > 2
    prev, ids = 0, []
    for _, meta in chunks:
        new = meta["output_token_logprobs"]
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(new) == meta["completion_tokens"] - prev == len(meta["output_top_logprobs"])
        prev = meta["completion_tokens"]
        ids += [tid for _, tid, _ in new]
    assert ids == _gen(server, {})["output_ids"]  # the same 16 greedy tokens, unstreamed


def test_streamed_program_chunks_carry_their_logprobs(sgl):
    @sgl.function
    def qa(s):
        s += sgl.user(QUESTION) + sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0, return_logprob=True))

    async def collect() -> list[Any]:
        return [c async for c in qa.run(stream=True).text_async_iter("answer", return_meta_data=True)]

    chunks = asyncio.run(collect())
    # (the iterator reads the newest chunk's meta when it wakes: per-chunk counts are checked above)
    assert chunks and all(text and meta["completion_tokens"] == meta["output_token_logprobs_length"]
                          for text, meta in chunks)
    assert "".join(text for text, _ in chunks) == qa.run()["answer"]


CONTEXTS = ["Ethan is the father of Liam.", "Noah is the father of Julian.", "Oliver is the father of Mason."]
JOIN_QUESTION = "Question: Who is the father of Julian?\nAnswer:"


def test_concate_and_append_join_equals_the_text_sent_unforked(sgl):
    @sgl.function
    def joined(s):
        s += "Please memorize these statements.\n"
        forks = s.fork(len(CONTEXTS))
        forks += lambda i: f"Statement {i}: {CONTEXTS[i]}\n"
        forks.join(mode="concate_and_append")
        s += JOIN_QUESTION + sgl.gen("answer", max_tokens=8, temperature=0)

    @sgl.function
    def straight(s):
        s += "Please memorize these statements.\n"
        for i, c in enumerate(CONTEXTS):
            s += f"Statement {i}: {c}\n"
        s += JOIN_QUESTION + sgl.gen("answer", max_tokens=8, temperature=0)

    # the frontend joins through POST /concate_and_append_request (not by appending text itself)
    assert sgl.global_config.enable_parallel_encoding and sgl.global_config.default_backend.support_concate_and_append
    state = joined.run()
    assert state.error() is None
    plain = straight.run()
    assert state.text() == plain.text() and state["answer"] == plain["answer"] and state["answer"]


# -- SGLang's protocol without the package ---------------------------------------------------------
def _gen(server: Server, params: dict[str, Any], text: str = "The capital of France is", **body: Any) -> Any:
    return server.generate({"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                              "ignore_eos": True, **params}, **body})


async def _stream(server: Server, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession() as http, http.post(server.url + "/generate",
                                                          json={**body, "stream": True}) as resp:
        assert resp.status == 200
        return await read_sse(resp)


def test_every_field_the_sglang_frontend_sends_is_accepted(server: Server):
    # what sglang.lang's RuntimeEndpoint.generate sends for a plain gen(), field for field
    body = {"text": "Hello", "sampling_params": {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 4, "min_new_tokens": 0,
        "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [], "temperature": 0, "top_p": 1.0, "top_k": -1,
        "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "regex": None,
        "json_schema": None}, "return_logprob": False, "return_text_in_logprobs": False}
    assert server.generate(body)["meta_info"]["completion_tokens"] >= 1
    # and the rest of SGLang's SamplingParams / GenerateReqInput, empty or off
    extra = {"structural_tag": None, "logit_bias": None, "sampling_seed": None, "stream_interval": None,
             "custom_params": None, "watermark": None, "beam_width": None}
    out = server.generate({**body, "sampling_params": {**body["sampling_params"], **extra}, "session_id": None,
                           "lora_path": None, "image_data": None, "routing_key": "r1", "priority": 0})
    assert out["meta_info"]["completion_tokens"] >= 1
    assert server.get("/server_info")[1]["version"] == server.get("/get_server_info")[1]["version"]
    assert server.get("/model_info") == server.get("/get_model_info")


@pytest.mark.parametrize(("params", "field", "what"), [
    ({"custom_params": {"x": 1}}, "custom_params", "custom logit processors"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "structures": [], "triggers": []})},
     "structural_tag", "structures must be a non-empty list"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}, "end": ""}],
                                    "triggers": ["<b"]})}, "structural_tag", "every begin must start with a trigger"),
    ({"structural_tag": "{not json"}, "structural_tag", "not valid JSON"),
    ({"stop_regex": "(unclosed"}, "stop_regex", "not a valid regular expression"),
    ({"stop_regex": "(a{1000}){1000}"}, "stop_regex", "expand past"),
    ({"stop_regex": "x*"}, "stop_regex", "matches the empty text"),
    ({"logit_bias": {"1": "big"}}, "logit_bias", "must be a number"),
    ({"logit_bias": {"999999999": 1.0}}, "logit_bias", "outside the vocabulary"),
    ({"sampling_seed": 1, "seed": 2}, "sampling_seed", "same parameter"),
    ({"stream_interval": 0}, "stream_interval", ">= 1"),
    ({"stop_regexes": ["x"]}, "stop_regexes", "unknown sampling parameter"),
])
def test_bad_sglang_sampling_fields_are_400s_naming_them(server: Server, params, field, what):
    status, out = server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, **params}})
    assert status == 400, out
    assert field in out["error"]["message"] and what in out["error"]["message"], out


def test_unknown_generate_fields_outside_sglang_are_still_400(server: Server):
    status, out = server.post("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2},
                                            "not_an_sglang_field": 1})
    assert status == 400 and out["error"]["param"] == "not_an_sglang_field"
    status, out = server.post("/generate", {"text": "Hi", "image_data": "http://x/y.png"})
    assert status == 400 and out["error"]["param"] == "image_data"


def test_stop_regex_over_http_trims_keeps_and_holds_back_in_streams(server: Server):
    plain = _gen(server, {})["text"]
    m = re.search(r"\s[a-z]+\s", plain)
    assert m is not None, plain
    pattern = r"\s" + re.escape(m.group().strip()) + r"\s"
    cut = _gen(server, {"stop_regex": pattern})
    assert cut["text"] == plain[: m.start()]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    kept = _gen(server, {"stop_regex": [pattern], "no_stop_trim": True})
    assert kept["text"] == plain[: m.end()]
    events = asyncio.run(_stream(server, {"text": "The capital of France is", "sampling_params": {
        "temperature": 0, "max_new_tokens": 16, "ignore_eos": True, "stop_regex": pattern}}))
    texts = [e["text"] for e in events[:-1]]
    assert events[-1] == "[DONE]" and texts[-1] == cut["text"]
    assert all(plain.startswith(t) and len(t) <= m.start() for t in texts)  # the match never shows


def test_logit_bias_forces_or_bans_a_token(server: Server, smol_tokenizer):
    target = smol_tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = _gen(server, {"max_new_tokens": 4, "logit_bias": {str(target): 100.0}})
    assert forced["output_ids"] == [target] * 4
    sampled = _gen(server, {"max_new_tokens": 4, "temperature": 1.0, "seed": 3, "logit_bias": {target: 100}})
    assert sampled["output_ids"] == [target] * 4
    first = _gen(server, {"max_new_tokens": 1})["output_ids"][0]
    banned = _gen(server, {"max_new_tokens": 1, "logit_bias": {str(first): -1e9}})
    assert banned["output_ids"][0] != first


def test_logit_bias_on_the_openai_routes(server: Server, smol_tokenizer):
    target = smol_tokenizer.encode(" banana", add_special_tokens=False)[0]
    status, out = server.post("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 3,
                                                   "logit_bias": {str(target): 100}})
    assert status == 200 and out["choices"][0]["text"] == " banana" * 3, out
    status, out = server.post("/v1/chat/completions", {"model": "m", "max_tokens": 3, "logit_bias": {str(target): 100},
                                                        "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and out["choices"][0]["message"]["content"] == " banana" * 3, out


def test_sampling_seed_is_seed(server: Server):
    params = {"temperature": 1.0, "max_new_tokens": 12}
    assert _gen(server, {**params, "sampling_seed": 11})["output_ids"] == _gen(server, {**params, "seed": 11})[
        "output_ids"]


def test_stream_interval_sends_a_chunk_every_k_tokens(server: Server):
    body = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
    every = asyncio.run(_stream(server, body))[:-1]
    body["sampling_params"]["stream_interval"] = 4
    sparse = asyncio.run(_stream(server, body))[:-1]
    assert sparse[-1]["text"] == every[-1]["text"] and sparse[-1]["output_ids"] == every[-1]["output_ids"]
    counts = [len(e["output_ids"]) for e in sparse]
    assert counts == [1, 5, 9, 12], counts  # the first token at once, then every 4, then the end


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                              "country": {"type": "string", "maxLength": 12}},
               "required": ["city", "country"], "additionalProperties": False}


@pytest.mark.parametrize(("text", "params"), [
    ("The capital of France is", {"max_new_tokens": 12, "ignore_eos": True}),
    ("The capital of France is", {"max_new_tokens": 12, "ignore_eos": True, "stream_interval": 5}),
    ("Paris as JSON with its city and country: ", {"max_new_tokens": 40, "json_schema": json.dumps(CITY_SCHEMA)}),
], ids=["every-token", "stream-interval", "json-schema"])
def test_stream_logprobs_are_the_new_tokens_and_add_up_to_the_whole(server: Server, text, params):
    body = {"text": text, "sampling_params": {"temperature": 0, **params}, "return_logprob": True,
            "top_logprobs_num": 2, "return_text_in_logprobs": True}
    whole = server.generate(body)["meta_info"]
    assert whole["output_token_logprobs_length"] == whole["completion_tokens"] == len(whole["output_token_logprobs"])
    events = asyncio.run(_stream(server, body))
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"] == whole["finish_reason"]
    held: list[Any] = []
    tops: list[Any] = []
    for e in events[:-1]:
        m = e["meta_info"]
        new = m["output_token_logprobs"]
        assert m["output_token_logprobs_length"] == m["completion_tokens"] == len(e["output_ids"])
        start = m["output_token_logprobs_length"] - len(new)
        # the tokens new since the last chunk; after a jump over forced text re-tokenized a tail
        # already sent (json-schema), from where it changed
        assert start == len(held) or ("json_schema" in params and start < len(held)), (start, len(held))
        del held[start:], tops[start:]
        held += new
        tops += m["output_top_logprobs"]
        assert [tid for _, tid, _ in held] == e["output_ids"]
    if "stream_interval" in params:
        assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == [1, 6, 11, 12]
    assert [entry[1:] for entry in held] == [entry[1:] for entry in whole["output_token_logprobs"]]
    assert [entry[0] for entry in held] == pytest.approx([entry[0] for entry in whole["output_token_logprobs"]],
                                                         abs=1e-4)
    assert [[t[1] for t in step] for step in tops] == [[t[1] for t in step] for step in whole["output_top_logprobs"]]


def test_concate_and_append_request_as_the_sglang_frontend_sends_it(server: Server):
    prefix, pieces = "Please memorize these statements.\n", [f"Statement {i}: {c}\n" for i, c in enumerate(CONTEXTS)]
    full = prefix + "".join(pieces) + JOIN_QUESTION
    assert server.post("/flush_cache")[0] == 200
    reference = _gen(server, {"max_new_tokens": 8}, text=full)
    assert server.post("/flush_cache")[0] == 200
    for piece in pieces:  # each fork commits its text (SglCommitLazy), then the join
        assert server.generate({"text": prefix + piece, "sampling_params": {"max_new_tokens": 0}})
    status, out = server.post("/concate_and_append_request", {"src_rids": ["a1", "b2", "c3"], "dst_rid": "d4"})
    assert status == 200 and out["success"] is True, out
    joined = _gen(server, {"max_new_tokens": 8}, text=full)  # the destination's next gen sends the joined text
    assert joined["text"] == reference["text"] and joined["output_ids"] == reference["output_ids"]
    first = server.post("/tokenize", {"prompt": prefix + pieces[0]})[1]["tokens"]
    whole = server.post("/tokenize", {"prompt": full})[1]["tokens"]
    shared = len(os.path.commonprefix([first, whole]))  # the prompt up to the end of the first fork's piece
    assert joined["meta_info"]["cached_tokens"] == shared, (joined["meta_info"], shared, len(whole))


@pytest.mark.parametrize(("body", "param", "what"), [
    ({"dst_rid": "d"}, "src_rids", "src_rids is required"),
    ({"src_rids": [], "dst_rid": "d"}, "src_rids", "non-empty list of non-empty strings"),
    ({"src_rids": ["a", 1], "dst_rid": "d"}, "src_rids", "non-empty list of non-empty strings"),
    ({"src_rids": "a", "dst_rid": "d"}, "src_rids", "non-empty list of non-empty strings"),
    ({"src_rids": ["a"]}, "dst_rid", "dst_rid is required"),
    ({"src_rids": ["a"], "dst_rid": ""}, "dst_rid", "must be a non-empty string"),
    ({"src_rids": ["a", "b"], "dst_rid": "b"}, "dst_rid", "joined into itself"),
    ({"src_rids": ["a"], "dst_rid": "d", "mode": "x"}, "mode", "mode"),
])
def test_bad_concate_and_append_bodies_are_400s_naming_the_field(server: Server, body, param, what):
    status, out = server.post("/concate_and_append_request", body)
    assert status == 400 and out["error"]["param"] == param and what in out["error"]["message"], out


# -- structural_tag: free text, enforced JSON inside each tag ---------------------------------------
TAG_PROMPT = ('To get the weather, write <function=get_weather>{"city": "NAME"}</function>.\n'
              'Q: What is the weather in Paris?\nA: Let me check. <function=get_weather>{"city": "Paris"}</function>\n'
              "Q: What is the weather in Rome?\nA:")
CITY = {"type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
TAG = {"type": "structural_tag", "triggers": ["<function="],
       "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}]}
SEGMENT = re.compile(r"<function=get_weather>(.*?)</function>", re.S)


def check_tagged(text: str) -> None:
    """The text holds at least one tag, and every tag's JSON follows the schema."""
    segments = SEGMENT.findall(text)
    assert segments and text.count("<function=") == len(segments), text
    for seg in segments:
        assert json.loads(seg)["city"] in ("Rome", "Oslo") and set(json.loads(seg)) == {"city"}, text


def test_structural_tag_on_native_generate(server: Server):
    free = server.generate({"text": TAG_PROMPT, "sampling_params": {"max_new_tokens": 40, "temperature": 0}})
    assert "<function=get_weather>" in free["text"]  # the model writes the tag by itself here
    for tag in (TAG, {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
            {"type": "tag", "begin": "<function=get_weather>", "content": {"type": "json_schema", "json_schema": CITY},
             "end": "</function>"}]}}):
        out = server.generate({"text": TAG_PROMPT, "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, "structural_tag": json.dumps(tag)}})
        check_tagged(out["text"])
        assert out["text"].startswith(" Let me check.")  # free text outside the tag


def test_structural_tag_as_openai_response_format(server: Server):
    messages = [{"role": "system", "content": TAG_PROMPT.rsplit("\nQ:", 1)[0]},
                {"role": "user", "content": "Q: What is the weather in Rome?"},
                {"role": "assistant", "content": "Let me check. <function=get_weather>{\"city\": \"Rome\"}</function>"},
                {"role": "user", "content": "Q: And in Oslo?"}]
    body = {"model": "m", "max_tokens": 40, "temperature": 0, "messages": messages}
    status, out = server.post("/v1/chat/completions", {**body, "response_format": TAG})
    assert status == 200, out
    check_tagged(out["choices"][0]["message"]["content"])
    status, out = server.post("/v1/chat/completions", {**body, "response_format": {**TAG, "triggers": ["<x"]}})
    assert status == 400 and "every begin must start with a trigger" in out["error"]["message"], out
