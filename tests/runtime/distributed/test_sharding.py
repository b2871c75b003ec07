"""Shard plans, the tp_size checks and the step message, in one process (no process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.config import EngineConfig, ParallelConfig
from radixlm.runtime.distributed import ShardPlan, check_tp_size, valid_tp_sizes
from radixlm.runtime.distributed.step import decode_steps, encode_steps
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.llama import LlamaModel
from radixlm.runtime.model.source import DUMMY_CONFIGS


def arch_of(name: str, **changes: object) -> ModelArch:
    return ModelArch.from_hf_config({**DUMMY_CONFIGS[name], **changes})


def test_valid_sizes_follow_heads_kv_heads_and_mlp():
    assert valid_tp_sizes(arch_of("llama-tiny")) == [1, 2, 4, 8]
    assert valid_tp_sizes(arch_of("smollm2-135m")) == [1, 3]  # 9 heads / 3 KV heads; 9 does not divide 1536
    assert valid_tp_sizes(arch_of("llama-3-8b")) == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize(("name", "size", "says"), [
    ("smollm2-135m", 2, "it must divide the model's 9 attention heads; use one of 1, 3"),
    ("llama-tiny", 3, "it must divide the model's 8 attention heads; use one of 1, 2, 4, 8"),
    ("llama-tiny", 16, "attention heads"),
])
def test_bad_tp_size_is_one_line_naming_the_fix(name, size, says):
    with pytest.raises(ValueError) as err:
        check_tp_size(arch_of(name), size)
    assert says in str(err.value) and f"--tp-size {size}" in str(err.value) and "\n" not in str(err.value)


def test_kv_heads_fewer_than_ranks_are_replicated_to_the_ranks_that_read_them():
    arch = arch_of("llama-tiny")  # 8 heads, 2 KV heads: heads 0-3 read KV head 0, 4-7 KV head 1
    group = arch.num_heads // arch.num_kv_heads
    for size in (1, 2, 4, 8):
        for rank in range(size):
            plan = ShardPlan.of(arch, rank, size)
            assert plan.local_kv_heads == max(2 // size, 1)
            q_heads = range(rank * plan.local_heads, (rank + 1) * plan.local_heads)
            kv_heads = range(plan.kv_head_start, plan.kv_head_start + plan.local_kv_heads)
            assert {h // group for h in q_heads} <= set(kv_heads)  # every query head finds its KV head locally


@pytest.mark.parametrize(("name", "size", "vocab"), [("llama-tiny", 2, None), ("llama-tiny", 4, 1001),
                                                     ("smollm2-135m", 3, 1000), ("qwen2.5-0.5b", 2, 1000)])
def test_shards_put_back_together_are_the_whole_model(name, size, vocab):
    """Column pieces stack, row pieces sit side by side, vocabulary rows stack (the padding cut
    off), norms are whole; the local shapes are the shapes of the sharded model's parameters."""
    arch = arch_of(name, num_hidden_layers=1, **({"vocab_size": vocab} if vocab else {}))
    torch.manual_seed(0)
    with torch.device("meta"):
        local_shapes = dict(LlamaModel(arch).named_parameters())
    whole = {n: torch.randn(p.shape) for n, p in local_shapes.items()}
    plans = [ShardPlan.of(arch, r, size) for r in range(size)]
    hd, kv = arch.head_dim, arch.kv_size
    for name_, full in whole.items():
        pieces = [plan.shard(name_, full) for plan in plans]
        local = plans[0].local_shape(arch)
        if name_.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            q, k, v = torch.split(full, [arch.q_size, kv, kv])
            parts = [torch.split(p, [local.q_size, local.kv_size, local.kv_size]) for p in pieces]
            assert torch.equal(torch.cat([p[0] for p in parts]), q)
            starts = [plan.kv_head_start * hd for plan in plans]
            for i, (plan, p) in enumerate(zip(plans, parts)):
                assert torch.equal(p[1], k[starts[i] : starts[i] + plan.local_kv_heads * hd])
                assert torch.equal(p[2], v[starts[i] : starts[i] + plan.local_kv_heads * hd])
        elif name_.endswith("gate_up_proj.weight"):
            gate, up = full.chunk(2)
            assert torch.equal(torch.cat([p.chunk(2)[0] for p in pieces]), gate)
            assert torch.equal(torch.cat([p.chunk(2)[1] for p in pieces]), up)
        elif name_.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(pieces, dim=1), full)
        elif name_ in ("embed_tokens.weight", "lm_head.weight"):
            assert all(p.shape[0] == local.vocab_size for p in pieces)
            joined = torch.cat(pieces)
            assert torch.equal(joined[: arch.vocab_size], full) and not joined[arch.vocab_size :].any()
        else:
            assert all(torch.equal(p, full) for p in pieces)


@given(st.lists(st.tuples(st.integers(0, 64), st.integers(0, 500), st.lists(st.integers(0, 50_000), min_size=1,
                                                                             max_size=20),
                          st.booleans(), st.integers(0, 1)), max_size=6))
def test_step_message_round_trips(raw):
    seqs = []
    for row, cached, tokens, has_prefix, logit_start in raw:
        prefix = list(range(1, cached + 1)) if has_prefix else None
        seqs.append(SeqStep(row, cached, tokens, [t + 7 for t in tokens], min(logit_start, len(tokens)), prefix))
    assert decode_steps(encode_steps(seqs)) == seqs


def test_parallel_config_is_a_component_with_flags():
    assert EngineConfig.from_kwargs(tp_size=2).parallel == ParallelConfig(tp_size=2)
    cfg = EngineConfig.from_kwargs(tp_size=4, dist_timeout=5.0, max_total_tokens=64)
    assert EngineConfig.from_kwargs(**cfg.flat()) == cfg
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        ParallelConfig(tp_size=0)
    from radixlm.cli import build_parser

    ns = build_parser().parse_args(["serve", "--tp-size", "2"])
    assert ns.tp_size == 2 and dataclasses.fields(ParallelConfig)[0].name == "tp_size"
