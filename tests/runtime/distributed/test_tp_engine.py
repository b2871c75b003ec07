"""Tensor parallelism over gloo on the CPU: TP=2 and TP=4 (dummy:llama-tiny, 8 heads over 2 KV
heads, so TP=4 replicates KV heads) and TP=3 on the default model (9 heads over 3 KV heads) give
TP=1's greedy tokens and its logits within fp32 / bf16 tolerance."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.engine import Engine

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fib(n):",
           "The capital of France is a city of"]  # shares a cached prefix with the first
GREEDY = {"max_new_tokens": 12, "temperature": 0}
# Small chunks: prompts run as several extend steps over their cached prefix, batched with decodes.
OPTS = {"max_total_tokens": 2048, "context_length": 1536, "chunked_prefill_size": 8, "max_running_requests": 8}
LAST = 16


def step_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The last LAST positions' logits of `ids` as one prefill in a fresh row, through every
    rank (over 1,000 tokens: the step's description takes a second broadcast)."""
    runner = engine.core.runner
    seq = SeqStep(0, 0, ids, list(range(1, len(ids) + 1)), len(ids) - LAST, prefix_slots=[])
    return runner.forward([seq]).clone()


def run(model: str, dtype: str, tp: int, ids: list[int], **opts: object) -> tuple[list[list[int]], torch.Tensor]:
    with Engine(model, dtype=dtype, tp_size=tp, **OPTS, **opts) as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        assert (engine.core.ahead_steps > 0) == bool(opts.get("overlap_schedule"))
        logits = step_logits(engine, ids)
        procs = engine.core.workers.procs if engine.core.workers else []
    assert all(p.returncode == 0 for p in procs)  # shutdown stops every worker cleanly
    return [o["output_ids"] for o in outs], logits


@pytest.fixture(scope="module")
def ids(smol_tokenizer) -> list[int]:
    ids = smol_tokenizer.encode("Tensor parallelism splits every layer over the ranks, one shard each. ")
    return (ids * 100)[:1100]


@pytest.fixture(scope="module")
def tiny_tp1(ids):
    return run("dummy:llama-tiny", "float32", 1, ids)


@pytest.mark.parametrize(("tp", "overlap"), [(2, True), (4, False)])
def test_dummy_model_tp_matches_tp1(tp, overlap, ids, tiny_tp1):
    """With the overlap schedule, decode steps reach the workers with their tokens still on
    rank 0's device (sent over the device group)."""
    tokens, logits = run("dummy:llama-tiny", "float32", tp, ids, overlap_schedule=overlap)
    ref_tokens, ref_logits = tiny_tp1
    assert tokens == ref_tokens
    assert logits.shape == ref_logits.shape == (LAST, 49152)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_dummy_model_tp2_bf16_logits_within_tolerance(ids, tiny_tp1):
    _, logits = run("dummy:llama-tiny", "bfloat16", 2, ids)
    _, ref = run("dummy:llama-tiny", "bfloat16", 1, ids)
    # bf16 rounds each partial sum of the row-parallel layers before the all-reduce
    torch.testing.assert_close(logits, ref, rtol=0.05, atol=0.05)
    torch.testing.assert_close(logits, tiny_tp1[1], rtol=0.1, atol=0.1)  # and near fp32


@pytest.mark.slow
def test_default_model_tp3_matches_tp1(ids):
    tokens, logits = run("smollm2-135m-instruct", "float32", 3, ids)
    ref_tokens, ref_logits = run("smollm2-135m-instruct", "float32", 1, ids)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=2e-4)
