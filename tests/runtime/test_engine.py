"""The Engine end to end on the default model (fp32, so greedy outputs are comparable exactly)."""

from __future__ import annotations

import asyncio
import re

import pytest

from radixlm.runtime.engine import Engine

pytestmark = pytest.mark.slow

FEW_SHOT = (
    "Translate English to French.\n"
    "sea otter => loutre de mer\npeppermint => menthe poivrée\nplush giraffe => girafe en peluche\n"
    "cheese => fromage\nbread => pain\nwater => eau\n"
)
WORDS = ["apple", "house", "car", "book", "dog", "cat", "sun", "moon"]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def _engine(**kw) -> Engine:
    opts = dict(dtype="float32", max_total_tokens=6000, context_length=2048)
    opts.update(kw)
    return Engine(**opts)


@pytest.fixture(scope="module")
def engine():
    e = _engine()
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference(engine):
    """Each few-shot prompt run alone on a cold cache."""
    outs = {}
    for w in WORDS:
        engine.flush_cache()
        outs[w] = engine.generate(FEW_SHOT + f"{w} =>", GREEDY)["output_ids"]
    return outs


def _batch(engine: Engine) -> list[list[int]]:
    res = engine.generate([FEW_SHOT + f"{w} =>" for w in WORDS], GREEDY)
    return [r["output_ids"] for r in res]


def test_batch_with_radix_cache_equals_alone(engine, reference):
    engine.flush_cache()
    assert _batch(engine) == [reference[w] for w in WORDS]
    # the shared few-shot prefix was computed once: later requests read it from the cache
    res = engine.generate([FEW_SHOT + f"{w} =>" for w in WORDS], GREEDY)
    assert all(r["meta_info"]["cached_tokens"] >= len(engine.encode(FEW_SHOT)) - 1 for r in res)
    engine.core.check_idle_integrity()


@pytest.mark.parametrize(
    "options",
    [dict(cache="none"), dict(chunked_prefill_size=16), dict(chunked_prefill_size=0), dict(policy="dfs-weight")],
    ids=["no-cache", "chunk16", "no-chunking", "dfs-weight"],
)
def test_greedy_identical_across_cache_and_chunking(options, reference):
    e = _engine(**options)
    try:
        assert _batch(e) == [reference[w] for w in WORDS]
        e.core.check_idle_integrity()
    finally:
        e.shutdown()


def test_alone_equals_inside_batch_of_16_mixed(engine, reference):
    engine.flush_cache()
    prompts, params = [], []
    for i, w in enumerate(WORDS):
        prompts.append(FEW_SHOT + f"{w} =>")
        params.append(GREEDY)
        # companions: sampled, seeded, other lengths, other prompts
        prompts.append(f"Write a short poem number {i} about {w}.")
        params.append({"temperature": 0.9, "top_p": 0.9, "seed": i, "max_new_tokens": 5 + 3 * i})
    res = engine.generate(prompts, params)
    assert [r["output_ids"] for r in res[::2]] == [reference[w] for w in WORDS]


def test_retraction_with_a_third_of_the_kv_still_gives_identical_outputs(engine):
    prompts = [f"Write a story about a {w}." for w in WORDS]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    alone = [engine.generate(p, params)["output_ids"] for p in prompts]
    demand = sum(len(engine.encode(p)) + 24 for p in prompts)
    e = _engine(max_total_tokens=demand // 3, max_running_requests=8)
    try:
        res = e.generate(prompts, params)
        assert [r["output_ids"] for r in res] == alone
        assert e.core.scheduler.num_retractions > 0
        e.core.check_idle_integrity()
    finally:
        e.shutdown()


def test_seed_reproducible_and_n_samples(engine):
    p = {"temperature": 1.0, "max_new_tokens": 24, "seed": 1234, "ignore_eos": True}
    a = engine.generate("Once upon a time", p)["output_ids"]
    b = engine.generate("Once upon a time", p)["output_ids"]
    c = engine.generate("Once upon a time", dict(p, seed=99))["output_ids"]
    assert a == b and a != c
    many = engine.generate("Once upon a time", dict(p, n=3))
    assert len(many) == 3
    assert many[0]["output_ids"] == a  # copy i uses seed + i
    assert len({tuple(m["output_ids"]) for m in many}) == 3


def test_max_new_tokens_zero_warms_the_cache(engine):
    engine.flush_cache()
    prompt = "A long prompt to warm the cache: " + " ".join(WORDS * 4)
    r = engine.generate(prompt, {"max_new_tokens": 0})
    assert r["text"] == "" and r["output_ids"] == []
    assert r["meta_info"]["finish_reason"] == {"type": "length"}
    r2 = engine.generate(prompt, {"max_new_tokens": 1})
    assert r2["meta_info"]["cached_tokens"] == r2["meta_info"]["prompt_tokens"] - 1


def test_stop_strings_trimmed_or_kept_and_stop_token_ids(engine):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    full = engine.generate(chat, {"temperature": 0, "max_new_tokens": 32})
    assert "Paris" in full["text"]
    cut = engine.generate(chat, {"temperature": 0, "max_new_tokens": 32, "stop": ["Paris"]})
    assert cut["text"] == full["text"][: full["text"].index("Paris")]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris"}
    kept = engine.generate(chat, {"temperature": 0, "max_new_tokens": 32, "stop": "Paris", "no_stop_trim": True})
    assert kept["text"].endswith("Paris")
    tok = full["output_ids"][2]
    by_id = engine.generate(chat, {"temperature": 0, "max_new_tokens": 32, "stop_token_ids": [tok]})
    assert by_id["output_ids"] == full["output_ids"][:3]
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}


def test_min_new_tokens_blocks_eos(engine):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    short = engine.generate(chat, {"temperature": 0, "max_new_tokens": 64})
    n = len(short["output_ids"])
    assert short["meta_info"]["finish_reason"]["type"] == "stop"
    longer = engine.generate(chat, {"temperature": 0, "max_new_tokens": 64, "min_new_tokens": n + 5})
    assert len(longer["output_ids"]) >= n + 5


def test_logprobs_input_and_output(engine):
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = engine.encode(prompt)
    r = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
                        return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    meta = r["meta_info"]
    inp = meta["input_token_logprobs"]
    assert [t for _, t in inp] == ids and inp[0][0] is None
    assert all(lp <= 0 for lp, _ in inp[1:])
    out = meta["output_token_logprobs"]
    assert [t for _, t in out] == r["output_ids"]
    for (lp, tok), top in zip(out, meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy = top-1
    # the same input logprobs when the prompt is already cached (the cache is bypassed for them)
    again = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 1},
                            return_logprob=True, logprob_start_len=3)["meta_info"]["input_token_logprobs"]
    assert [t for _, t in again] == ids[3:]
    for (a, _), (b, _) in zip(again, inp[3:]):
        assert abs(a - b) < 1e-4


def test_stream_concatenation_equals_text_and_abort_frees(engine):
    p = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    prompt = "Emoji and accents: héllo wörld 👩‍👩‍👧 🇫🇷 你好"
    chunks = list(engine.stream(prompt, p))
    assert chunks[-1]["finished"] and all(not c["finished"] for c in chunks[:-1])
    assert "".join(c["text"] for c in chunks) == engine.generate(prompt, p)["text"]
    it = engine.stream(prompt, p)
    next(it)
    next(it)
    it.close()  # the consumer walks away: the request is aborted
    engine.core.check_idle_integrity()


def test_async_generate_batches_concurrent_calls(engine, reference):
    async def run():
        return await asyncio.gather(*[engine.async_generate(FEW_SHOT + f"{w} =>", GREEDY) for w in WORDS])

    res = asyncio.run(run())
    assert [r["output_ids"] for r in res] == [reference[w] for w in WORDS]


def test_bad_input_raises_clear_errors(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("hi", {"temperature": -1})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate("hi", {"max_tokens": 3})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate(input_ids=[1, 2, 10**7])
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[5] * 5000)
    with pytest.raises(ValueError, match="exactly one of"):
        engine.generate()
    engine.core.check_idle_integrity()


def test_stop_regex_cuts_at_the_first_match_and_streams_hold_it_back(engine):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    full = engine.generate(chat, {"temperature": 0, "max_new_tokens": 32})["text"]
    pattern = r"Par\w+"
    m = re.search(pattern, full)
    assert m is not None, full
    p = {"temperature": 0, "max_new_tokens": 32, "stop_regex": pattern}
    cut = engine.generate(chat, p)
    assert cut["text"] == full[: m.start()]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    kept = engine.generate(chat, {**p, "no_stop_trim": True})["text"]
    assert kept.startswith(cut["text"]) and re.fullmatch(pattern, kept[len(cut["text"]):])
    chunks = list(engine.stream(chat, p))
    assert "".join(c["text"] for c in chunks) == cut["text"]
    engine.core.check_idle_integrity()


def test_logit_bias_forces_and_bans_tokens(engine):
    target = engine.encode(" banana")[-1]
    prompt = "The capital of France is"
    forced = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 3, "logit_bias": {str(target): 100}})
    assert forced["output_ids"] == [target] * 3
    sampled = engine.generate(prompt, {"temperature": 1, "seed": 5, "max_new_tokens": 3, "logit_bias": {target: 100}})
    assert sampled["output_ids"] == [target] * 3
    first = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 1})["output_ids"][0]
    assert engine.generate(prompt, {"temperature": 0, "max_new_tokens": 1,
                                    "logit_bias": {first: -1e9}})["output_ids"][0] != first
    with pytest.raises(ValueError, match="logit_bias holds token id"):
        engine.generate(prompt, {"logit_bias": {10**7: 1.0}})
    # SGLang's sampling_seed is the seed
    seeded = {"temperature": 1, "max_new_tokens": 8}
    assert (engine.generate(prompt, {**seeded, "sampling_seed": 3})["output_ids"]
            == engine.generate(prompt, {**seeded, "seed": 3})["output_ids"])
