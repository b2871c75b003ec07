"""The overlap schedule (greedy decode steps queued one step ahead of the host's work) gives
exactly the outputs of the plain loop. It is on by default only with CUDA; here it is forced on
over the CPU, where each queued step runs at once but every bookkeeping path is the same."""

from __future__ import annotations

import pytest

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
    on = Engine(overlap_schedule=True, max_total_tokens=4096)
    off = Engine(overlap_schedule=False, max_total_tokens=4096)
    yield on, off
    on.shutdown()
    off.shutdown()


def _strip(out: dict) -> tuple:
    m = out["meta_info"]
    return out["text"], out["output_ids"], m["completion_tokens"], m["finish_reason"]


def test_batch_outputs_equal(engines):
    on, off = engines
    assert on.core.overlap and not off.core.overlap
    steps_before = on.core.steps
    got = on.generate(PROMPTS, _params())
    ref = off.generate(PROMPTS, _params())
    assert [_strip(o) for o in got] == [_strip(o) for o in ref]
    assert {o["meta_info"]["finish_reason"]["type"] for o in ref} == {"stop", "length"}
    assert on.core.steps > steps_before
    on.core.check_idle_integrity()
    off.core.check_idle_integrity()


def test_alone_and_mixed_with_sampling(engines):
    """A sampled request in the batch turns look-ahead off for those steps; outputs of the
    greedy ones still match, and a lone greedy request (bs 1, the case it is built for) too."""
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
