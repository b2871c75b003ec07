"""The overlap schedule (decode steps queued one step ahead of the host's work) gives exactly
the outputs of the plain loop, greedy and sampled (seeded, or unseeded from the same global
RNG state). It is on by default only with CUDA; here it is forced on
over the CPU, where each queued step runs at once but every bookkeeping path is the same."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.engine import Engine

pytestmark = pytest.mark.slow

FEW_SHOT = "Translate to French.\nsea otter => loutre de mer\ncheese => fromage\n"
PROMPTS = [FEW_SHOT + f"{w} =>" for w in ("bread", "water", "house", "cat")] + [
    "Count: one, two, three,",
    "The capital of France is",
    "def fib(n):",
]


def _params() -> list[dict]:
    """Greedy requests that end by length, by a stop string, by EOS (ignore_eos off, chat-like
    prompts) and with min_new_tokens, so steps drop requests at different times."""
    return [
        {"temperature": 0, "max_new_tokens": 12, "stop": "\n"},
        {"temperature": 0, "max_new_tokens": 3},
        {"temperature": 0, "max_new_tokens": 20},
        {"temperature": 0, "max_new_tokens": 9, "min_new_tokens": 5},
        {"temperature": 0, "max_new_tokens": 25, "stop": [" five"]},
        {"temperature": 0, "max_new_tokens": 2},
        {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
    ]


@pytest.fixture(scope="module")
def engines():
    # fp32: a step queued ahead still holds the rows of requests that finished meanwhile, so its
    # batch is larger than the plain loop's; CPU bf16 matmuls round differently per batch size
    # (logits moved by up to 0.25, enough to flip a sampled token), fp32 ones by ~1e-5.
    on = Engine(overlap_schedule=True, max_total_tokens=4096, dtype="float32")
    off = Engine(overlap_schedule=False, max_total_tokens=4096, dtype="float32")
    yield on, off
    on.shutdown()
    off.shutdown()


def _strip(out: dict) -> tuple:
    m = out["meta_info"]
    return out["text"], out["output_ids"], m["completion_tokens"], m["finish_reason"]


def test_batch_outputs_equal(engines):
    on, off = engines
    assert on.core.overlap and not off.core.overlap
    counters = [(e.core.steps, e.core.prompt_steps, e.core.rows_fed, e.core.tokens_fed) for e in (on, off)]
    clocks = [dict(e.core.step_seconds) for e in (on, off)]
    got = on.generate(PROMPTS, _params())
    ref = off.generate(PROMPTS, _params())
    assert [_strip(o) for o in got] == [_strip(o) for o in ref]
    assert {o["meta_info"]["finish_reason"]["type"] for o in ref} == {"stop", "length"}
    for e, outs, (steps, prompt_steps, rows, tokens), clock in zip((on, off), (got, ref), counters, clocks):
        passes = sum(o["meta_info"]["forward_passes"] for o in outs)
        steps, prompt_steps, rows = e.core.steps - steps, e.core.prompt_steps - prompt_steps, e.core.rows_fed - rows
        assert 1 <= prompt_steps < steps <= rows
        # each step a request ran in is one row (a step queued ahead may also carry the row of a
        # request that ended meanwhile)
        assert rows == passes if e is off else rows >= passes
        # the tokens fed: each prompt's uncached part once, then each output token but the last
        m = [o["meta_info"] for o in outs]
        fed = sum(i["prompt_tokens"] - i["cached_tokens"] + i["completion_tokens"] - 1 for i in m)
        assert e.core.tokens_fed - tokens == fed if e is off else e.core.tokens_fed - tokens >= fed
        # the step loop's clock: each phase of a CPU step ran
        spent = {k: v - clock[k] for k, v in e.core.step_seconds.items()}
        assert all(spent[k] > 0 for k in ("schedule", "forward", "sample", "wait", "process"))
    on.core.check_idle_integrity()
    off.core.check_idle_integrity()


def test_alone_and_mixed_with_sampling(engines):
    """A penalised request in the batch turns look-ahead off for those steps; outputs still
    match, and a lone greedy request (bs 1, the case it is built for) too."""
    on, off = engines
    alone = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    assert _strip(on.generate(PROMPTS[2], alone)) == _strip(off.generate(PROMPTS[2], alone))
    params = [{"temperature": 0, "max_new_tokens": 16},
              {"temperature": 0.8, "max_new_tokens": 8, "seed": 7},
              {"temperature": 0, "max_new_tokens": 16, "frequency_penalty": 0.5}]
    got, ref = on.generate(PROMPTS[:3], params), off.generate(PROMPTS[:3], params)
    assert [_strip(o) for o in got] == [_strip(o) for o in ref]
    on.core.check_idle_integrity()


def test_stream_abort_mid_way(engines):
    """A stream closed after a few chunks aborts its request while a step is queued ahead; the
    pool ends with nothing leaked and the next request matches the plain loop."""
    on, off = engines
    params = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
    stream = on.stream(PROMPTS[0], params)
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    while on.core.has_work:
        on.core.step()
    on.core.check_idle_integrity()
    assert _strip(on.generate(PROMPTS[1], params)) == _strip(off.generate(PROMPTS[1], params))


def _sampled_params() -> list[dict]:
    """Greedy, unseeded and seeded sampled requests with top-k / top-p / min-p, ending by
    length, stop strings, EOS and with min_new_tokens, so rows leave a step queued ahead."""
    return [
        {"temperature": 0, "max_new_tokens": 12, "stop": "\n"},
        {"temperature": 0.9, "max_new_tokens": 14, "top_k": 20, "stop": "\n"},
        {"temperature": 1.0, "max_new_tokens": 20, "top_p": 0.9, "seed": 11},
        {"temperature": 0.7, "max_new_tokens": 9, "min_p": 0.05, "stop": "\n"},
        {"temperature": 1.2, "max_new_tokens": 25, "top_k": 50, "top_p": 0.95, "seed": 3, "stop": [" five", "\n"]},
        {"temperature": 0.8, "max_new_tokens": 8, "min_new_tokens": 5, "top_k": 5},
        {"temperature": 1.0, "max_new_tokens": 30, "top_p": 0.8, "min_p": 0.02, "ignore_eos": True},
    ]


def _run(engine: Engine, prompts, params, seed: int) -> list[tuple]:
    torch.manual_seed(seed)  # the unseeded rows draw from the global generator
    return [_strip(o) for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampled_batch_outputs_equal(engines, seed):
    on, off = engines
    before = on.core.ahead_steps
    got = _run(on, PROMPTS, _sampled_params(), seed)
    ref = _run(off, PROMPTS, _sampled_params(), seed)
    assert got == ref
    assert on.core.ahead_steps > before
    assert {r[3]["type"] for r in ref} == {"stop", "length"}
    on.core.check_idle_integrity()
    off.core.check_idle_integrity()


def test_sampled_only_batch_looks_ahead(engines):
    """Sampled requests alone (no greedy one) are queued ahead, unseeded and seeded; a seeded
    request gives the same tokens whatever the global RNG state."""
    on, off = engines
    params = [{"temperature": 0.8, "max_new_tokens": 16, "top_k": 40, "ignore_eos": True},
              {"temperature": 1.0, "max_new_tokens": 16, "top_p": 0.9, "seed": 5, "ignore_eos": True},
              {"temperature": 0.6, "max_new_tokens": 16, "min_p": 0.1, "ignore_eos": True}]
    before = on.core.ahead_steps
    got = _run(on, PROMPTS[:3], params, 7)
    assert on.core.ahead_steps - before >= 10  # 16 tokens: prefill, then decode steps queued ahead
    assert got == _run(off, PROMPTS[:3], params, 7)
    assert _run(on, [PROMPTS[1]], [params[1]], 8) == [got[1]]
    on.core.check_idle_integrity()
    off.core.check_idle_integrity()


def test_min_new_tokens_block_on_the_step_that_looks_ahead(engines):
    """The step that first queues the next one ahead draws the min_new_tokens-th token, EOS still
    blocked (the default model answers this in 7 tokens + EOS; the greedy-only schedule once took
    the unblocked argmax there and stopped at 8)."""
    on, off = engines
    prompt = "<|im_start|>user\nWhat is the capital of France? One word.<|im_end|>\n<|im_start|>assistant\n"
    params = {"temperature": 0, "max_new_tokens": 16, "min_new_tokens": 8}
    got, ref = _strip(on.generate(prompt, params)), _strip(off.generate(prompt, params))
    assert got == ref
    assert ref[2] == 16
    on.core.check_idle_integrity()


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                                           "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"]}
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _constrained_batch(jump_forward: bool, sampled: bool) -> tuple[list[str], list[dict]]:
    """Constrained rows (two schemas, a regex, choices) next to free-text ones; greedy, or
    sampled with seeds."""
    t = {"temperature": 0.9, "top_p": 0.95} if sampled else {"temperature": 0}
    jf = {"jump_forward": jump_forward}
    prompts = [CHAT.format("A person as JSON."), CHAT.format("A person from Paris as JSON."),
               CHAT.format("A date?"), CHAT.format("Yes or no?"), PROMPTS[0], PROMPTS[4]]
    params = [
        {**t, **jf, "seed": 1, "max_new_tokens": 40, "json_schema": PERSON},
        {**t, **jf, "seed": 2, "max_new_tokens": 40, "json_schema": {"type": "array", "items": {"type": "integer"},
                                                                     "maxItems": 4}},
        {**t, **jf, "seed": 3, "max_new_tokens": 16, "regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"},
        {**t, **jf, "seed": 4, "max_new_tokens": 8, "choices": ["yes, surely", "no, never"]},
        {**t, "seed": 5, "max_new_tokens": 12},
        {**t, "seed": 6, "max_new_tokens": 30, "ignore_eos": True},
    ]
    return prompts, params


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump", "no-jump"])
def test_constrained_rows_join_the_overlap_schedule(engines, jump_forward, sampled):
    """Mixed batches of constrained and free rows: the overlap loop (masks filled after the
    previous tokens reach the grammars, while the queued forward runs; a row that jumped forward
    dropped, its extend queued ahead with the next step) gives the plain loop's outputs token for
    token, and does look ahead."""
    on, off = engines
    prompts, params = _constrained_batch(jump_forward, sampled)
    before, extends = on.core.ahead_steps, on.core.ahead_extends
    got = [_strip(o) for o in on.generate(prompts, params)]
    ref = [_strip(o) for o in off.generate(prompts, params)]
    assert got == ref
    assert on.core.ahead_steps - before >= 5
    if jump_forward:  # a jump's extend is queued ahead too, next to the other rows' decodes
        assert on.core.ahead_extends > extends
    alone = [_strip(o) for o in on.generate(prompts[:1], params[:1])]  # a constrained row alone (bs 1)
    assert alone == ref[:1]
    on.core.check_idle_integrity()
    off.core.check_idle_integrity()


def test_steps_are_timed_under_the_overlap_schedule(engines):
    """Each step is timed from when it was scheduled to when it was processed, also while the
    step after it was scheduled in between: the prompt pacing learns what steps cost."""
    on, _ = engines
    costs = on.core.scheduler.costs
    on.flush_cache()
    on.generate(PROMPTS[6], {"temperature": 0, "max_new_tokens": 24})  # steps of decodes alone
    assert costs.decode_s is not None
    on.generate(PROMPTS[0] + " " + PROMPTS[5] * 20, {"temperature": 0, "max_new_tokens": 4})  # a prompt's step
    assert costs.token_s is not None
