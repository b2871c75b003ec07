"""Paced prompt work on the real model (fp32, the default model): a long prompt in flight while a
request decodes and short requests arrive behind it, its pieces held back nearly every step
(decode_slowdown just above 1) and cut to the smallest timed piece. Greedy outputs equal each
request run alone on an engine that neither paces nor chunks."""

from __future__ import annotations

from collections import defaultdict

import pytest

from radixlm.runtime.engine import Engine
from radixlm.runtime.engine_core import EngineCore
from radixlm.runtime.intake import Submission
from radixlm.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

FEW_SHOT = "Translate to French.\nsea otter => loutre de mer\ncheese => fromage\nbread => pain\n"


def _run(core: EngineCore, arrivals: dict[int, list[Submission]], long_rid: str) -> tuple[dict[str, list[int]], bool]:
    """Step until done, adding each submission at its step; the outputs, and whether the long
    prompt's pieces were ever held back while it was in flight."""
    outs: dict[str, list[int]] = defaultdict(list)
    held = False
    step = 0
    while arrivals or core.has_work:
        for sub in arrivals.pop(step, []):
            core.add_request(sub)
        in_flight = long_rid in core.requests and not core.requests[long_rid].output_ids
        held |= in_flight and not core.scheduler.costs.pieces_may_run
        for o in core.step():
            if o.replace_from is not None:
                del outs[o.rid][o.replace_from:]
            outs[o.rid] += o.token_ids_delta
        step += 1
    return outs, held


def test_paced_steps_give_the_outputs_of_each_request_alone():
    opts = dict(dtype="float32", max_total_tokens=4096, context_length=2048)
    paced = Engine(**opts, chunked_prefill_size=64, max_prefill_tokens=64, decode_slowdown=1.01,
                   prefill_step_seconds=1e-6)
    plain = Engine(**opts, chunked_prefill_size=0, decode_slowdown=0, prefill_step_seconds=0)
    try:
        long_ids = paced.encode(FEW_SHOT * 12 + "house =>")
        assert len(long_ids) > 300
        subs = {
            0: [Submission("dec", paced.encode("Count: one, two, three,"), SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))],
            2: [Submission("long", long_ids, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))],
        }
        for i, text in enumerate(["The capital of France is", "def fib(n):", "Water =>"]):
            subs[4 + 2 * i] = [Submission(f"short{i}", paced.encode(text),
                                          SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))]
        expected = {}
        for batch in subs.values():
            for sub in batch:
                plain.flush_cache()
                expected[sub.rid] = plain.generate(input_ids=sub.prompt_ids, sampling_params={
                    "max_new_tokens": sub.params.max_new_tokens, "temperature": 0, "ignore_eos": True})["output_ids"]
        got, held = _run(paced.core, subs, "long")
        assert held, "the long prompt's pieces never waited for the decodes"
        assert dict(got) == expected
        paced.core.check_idle_integrity()
    finally:
        paced.shutdown()
        plain.shutdown()
