"""The torch attention backend against attention written out per sequence and per head (fp32):
decode rows batched with padding, with and without prefill segments in the same step, and
grouped-query heads (the decode call puts a KV head's query heads in the query-length place); in
bf16 the extends run as blocks of queries (`blocked_extend`), checked across block edges too; fp32
prompts of head size 64 on the native prompt attention where it runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixlm.runtime.kernels import native
from radixlm.runtime.kernels.attention.base import AttentionMeta
from radixlm.runtime.kernels.attention.torch_backend import (
    NATIVE_AVX2_MIN_QUERIES,
    NATIVE_BF16_MIN_QUERIES,
    NATIVE_MIN_QUERIES,
    TorchAttention,
    blocked_extend,
    blocked_prompts,
)
from radixlm.runtime.kv_pool import KVPool
from radixlm.runtime.model.arch import ModelArch

HEADS, KV_HEADS, D = 6, 2, 16
ARCH = ModelArch(family="llama", vocab_size=64, hidden_size=HEADS * D, intermediate_size=64, num_layers=1,
                 num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False)
ARCH_64 = dataclasses.replace(ARCH, hidden_size=HEADS * 64, head_dim=64, max_position_embeddings=512)


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q [n, heads, d] at positions first_pos.. over keys/values [L, kv_heads, d], causal, in fp32."""
    q, keys, values = q.float(), keys.float(), values.float()
    group = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        visible = first_pos + t + 1
        for h in range(q.shape[1]):
            k, v = keys[:visible, h // group], values[:visible, h // group]
            p = torch.softmax(k @ q[t, h] / q.shape[2] ** 0.5, 0)
            out[t, h] = p @ v
    return out


def _cached(pool: KVPool, plan: list[tuple[int, int]], d: int, dtype: torch.dtype, gen: torch.Generator,
            free: torch.Tensor, context: int = 512
            ) -> tuple[torch.Tensor, list[torch.Tensor], list[int], list[int], list[int], list]:
    """Each plan row's cached K/V written to the pool at the next `free` slots: (the request->slot
    table of `context` positions a row, each row's new slots, q starts, q lengths, kv lengths, each
    row's cached (K, V))."""
    table = torch.zeros((len(plan), context), dtype=torch.int64)
    history, new_slots, q_starts, q_lens, kv_lens = [], [], [], [], []
    for row, (cached, new) in enumerate(plan):
        slots, free = free[: cached + new], free[cached + new :]
        table[row, : cached + new] = slots
        k_old, v_old = (torch.randn(cached, KV_HEADS, d, generator=gen).to(dtype) for _ in range(2))
        pool.k[0, slots[:cached]], pool.v[0, slots[:cached]] = k_old, v_old
        history.append((k_old, v_old))
        new_slots.append(slots[cached:])
        q_starts.append(sum(q_lens))
        q_lens.append(new)
        kv_lens.append(cached + new)
    return table, new_slots, q_starts, q_lens, kv_lens, history


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plan", [
    [(40, 1)],  # batch 1 decode: no padding
    [(7, 1), (30, 1), (18, 1)],  # decodes of different lengths: padded
    [(12, 1), (25, 1), (0, 5), (9, 4)],  # decodes, then prefill segments (one with a cached prefix)
    [(0, 3), (20, 1)],  # a decode after a prefill segment: not a leading slice
    [(9, 1), (0, 200), (100, 150)],  # long segments: in bf16 blocks of queries (one over a prefix)
])
def test_torch_attention_matches_per_head_reference(plan, dtype):
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(ARCH, 1024, dtype, "cpu")
    att = TorchAttention(pool, HEADS, D)
    table, new_slots, q_starts, q_lens, kv_lens, history = _cached(pool, plan, D, dtype, gen,
                                                                   torch.arange(1, 1025))
    total = sum(q_lens)
    q = torch.randn(total, HEADS, D, generator=gen).to(dtype)
    k, v = (torch.randn(total, KV_HEADS, D, generator=gen).to(dtype) for _ in range(2))
    att.prepare(AttentionMeta(torch.cat(new_slots), table, list(range(len(plan))), q_starts, q_lens, kv_lens))
    before = pool.kv.clone()
    out = att.forward(0, q, k, v).view(total, HEADS, D)
    # the CPU layer loop's call: K and V as one tensor, stored in one copy, the same attention
    after, pool.kv[:] = pool.kv.clone(), before
    joined = att.forward_joined(0, q, torch.cat([k, v], 1)).view(total, HEADS, D)
    assert torch.equal(joined, out) and torch.equal(pool.kv, after)
    assert torch.equal(pool.k[0, torch.cat(new_slots)], k) and torch.equal(pool.v[0, torch.cat(new_slots)], v)
    for (cached, new), start, (k_old, v_old) in zip(plan, q_starts, history):
        part = slice(start, start + new)
        ref = _reference(q[part], torch.cat([k_old, k[part]]), torch.cat([v_old, v[part]]), cached)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[part].float(), ref, rtol=tol, atol=tol)
    # bf16 segments of 32+ queries and 32k+ query-key pairs run as blocks (avx512_bf16 without AMX),
    # the rest the flash kernel
    blocks = blocked_prompts(dtype, torch.device("cpu"))
    assert blocks == (dtype == torch.bfloat16 and torch.cpu._is_avx512_bf16_supported()
                      and not torch.cpu._is_amx_tile_supported())
    assert [way for *_, way in att.extends] == [
        "blocked" if blocks and new >= 32 and new * (cached + new) >= 32768 else "flash"
        for cached, new in plan if new > 1]  # (head size 16: never the native prompt attention)


@pytest.mark.skipif(not native.prefill_preferred(),
                    reason="prompts take the native attention with AVX-512 VNNI, or AVX2 on AMD processors")
@pytest.mark.parametrize("plan", [
    [(0, 260)],  # a prompt alone
    [(3, 1), (0, 300), (40, 256), (0, 40)],  # decodes, prompts (one over a cached prefix), a short extend
    [(0, 100), (200, 70), (0, 63)],  # native on the AVX2 kernels from 64 queries, on AVX-512 from 256
])
def test_fp32_prompts_on_the_native_attention_match_the_reference(plan):
    d = 64
    gen = torch.Generator().manual_seed(1)
    pool = KVPool(ARCH_64, 1024, torch.float32, "cpu")
    att = TorchAttention(pool, HEADS, d)
    table, new_slots, q_starts, q_lens, kv_lens, history = _cached(pool, plan, d, torch.float32, gen,
                                                                   torch.arange(1, 1025))
    total = sum(q_lens)
    q = torch.randn(total, HEADS + 2 * KV_HEADS, d, generator=gen)[:, :HEADS]  # tokens strided, as from qkv
    k, v = (torch.randn(total, KV_HEADS, d, generator=gen) for _ in range(2))
    att.prepare(AttentionMeta(torch.cat(new_slots), table, list(range(len(plan))), q_starts, q_lens, kv_lens))
    least = NATIVE_AVX2_MIN_QUERIES if native.isa() == "avx2" else NATIVE_MIN_QUERIES
    assert att.native_min == least
    assert [way for *_, way in att.extends] == ["native" if new >= least else "flash" for _, new in plan if new > 1]
    out = att.forward(0, q, k, v).view(total, HEADS, d)
    for (cached, new), start, (k_old, v_old) in zip(plan, q_starts, history):
        part = slice(start, start + new)
        ref = _reference(q[part], torch.cat([k_old, k[part]]), torch.cat([v_old, v[part]]), cached)
        torch.testing.assert_close(out[part], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not native.prefill_bf16_available(), reason="the bf16 prompt attention needs avx512_bf16")
def test_fp32_prompts_on_the_bf16_native_attention_match_the_reference():
    """`prompt_bf16`: extends of 16+ queries on the native attention's bf16 form, the pool's rows
    read in place, within bf16's rounding of the fp32 reference; shorter ones flash."""
    d = 64
    plan = [(3, 1), (0, 300), (40, 256), (0, 12), (100, 16), (2600, 64), (2000, 15)]
    gen = torch.Generator().manual_seed(2)
    pool = KVPool(ARCH_64, 8192, torch.float32, "cpu")
    att = TorchAttention(pool, HEADS, d, prompt_bf16=True)
    table, new_slots, q_starts, q_lens, kv_lens, history = _cached(pool, plan, d, torch.float32, gen,
                                                                   torch.arange(1, 8193), context=4096)
    total = sum(q_lens)
    q = torch.randn(total, HEADS + 2 * KV_HEADS, d, generator=gen)[:, :HEADS]
    k, v = (torch.randn(total, KV_HEADS, d, generator=gen) for _ in range(2))
    att.prepare(AttentionMeta(torch.cat(new_slots), table, list(range(len(plan))), q_starts, q_lens, kv_lens))
    assert NATIVE_BF16_MIN_QUERIES == 16
    assert [way for *_, way in att.extends] == ["native", "native", "flash", "native", "native", "flash"]
    out = att.forward(0, q, k, v).view(total, HEADS, d)
    for (cached, new), start, (k_old, v_old) in zip(plan, q_starts, history):
        part = slice(start, start + new)
        ref = _reference(q[part], torch.cat([k_old, k[part]]), torch.cat([v_old, v[part]]), cached)
        torch.testing.assert_close(out[part], ref, rtol=0, atol=3e-2)
        assert (out[part] - ref).abs().mean() < 3e-3


def test_bf16_prompts_need_the_native_attention():
    """bf16 products are asked only where prompts run on the native kernels with avx512_bf16."""
    pool = KVPool(ARCH_64, 64, torch.bfloat16, "cpu")  # bf16 activations: no native prompt attention
    with pytest.raises(ValueError, match="avx512_bf16"):
        TorchAttention(pool, HEADS, 64, prompt_bf16=True)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("prefix,new", [(0, 13), (0, 4), (9, 10), (30, 1), (5, 3)])
def test_blocked_extend_matches_reference_across_block_edges(monkeypatch, heads, kv_heads, prefix, new):
    """Blocks of 4 queries: several blocks, a short last one, a cached prefix, one query."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(new, heads, D, generator=gen).bfloat16()
    k, v = (torch.randn(prefix + new, kv_heads, D, generator=gen).bfloat16() for _ in range(2))
    out = torch.full_like(q, float("nan"))
    calls = []
    real_bmm = torch.bmm

    def counting_bmm(a, b):
        calls.append(a.shape)
        return real_bmm(a, b)

    monkeypatch.setattr(torch, "bmm", counting_bmm)
    blocked_extend(q, k, v, D**-0.5, out, block=4)
    monkeypatch.undo()
    assert len(calls) == 2 * -(-new // 4)  # two products a block of 4
    torch.testing.assert_close(out.float(), _reference(q, k, v, prefix), rtol=2e-2, atol=2e-2)


def test_blocked_extend_takes_fewer_rows_a_block_under_the_scores_budget(monkeypatch):
    """A budget of 16 rows' scores: 40 queries over 140 keys run as blocks of 16 (not 128)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(40, HEADS, D, generator=gen).bfloat16()
    k, v = (torch.randn(140, KV_HEADS, D, generator=gen).bfloat16() for _ in range(2))
    calls = []
    real_bmm = torch.bmm

    def counting_bmm(a, b):
        calls.append(a.shape)
        return real_bmm(a, b)

    out = torch.full_like(q, float("nan"))
    monkeypatch.setattr(torch, "bmm", counting_bmm)
    blocked_extend(q, k, v, D**-0.5, out, budget=16 * HEADS * 140)
    monkeypatch.undo()
    assert len(calls) == 2 * 3  # blocks of 16, 16 and 8 queries, two products each
    torch.testing.assert_close(out.float(), _reference(q, k, v, 100), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("plan", [[(40, 1)], [(7, 1), (300, 1), (18, 1)], [(12, 1), (0, 5)]])
def test_decodes_on_the_native_kernels_match_the_reference(plan):
    """With head size 64 and a bf16 host pool the decode rows read the pool in place on the native
    kernels (where they run; else the torch path): the same reference, decodes alone or beside a
    prefill segment."""
    from radixlm.runtime.kernels import native

    d = 64
    gen = torch.Generator().manual_seed(1)
    pool = KVPool(ARCH_64, 2048, torch.bfloat16, "cpu")
    att = TorchAttention(pool, HEADS, d)
    assert att.native == native.available()
    scattered = torch.randperm(2000, generator=gen) + 1  # as a busy cache leaves the free slots
    table, slots_of, q_starts, q_lens, kv_lens, history = _cached(pool, plan, d, torch.bfloat16, gen, scattered)
    total = sum(q_lens)
    q = torch.randn(total, HEADS, d, generator=gen).bfloat16()
    kv = torch.randn(total, 2 * KV_HEADS, d, generator=gen).bfloat16()
    att.prepare(AttentionMeta(torch.cat(slots_of), table, list(range(len(plan))), q_starts, q_lens, kv_lens))
    out = att.forward_joined(0, q, kv).view(total, HEADS, d)
    k, v = kv[:, :KV_HEADS], kv[:, KV_HEADS:]
    for (cached, new), start, (k_old, v_old) in zip(plan, q_starts, history):
        part = slice(start, start + new)
        ref = _reference(q[part], torch.cat([k_old, k[part]]), torch.cat([v_old, v[part]]), cached)
        torch.testing.assert_close(out[part].float(), ref, rtol=2e-2, atol=2e-2)
