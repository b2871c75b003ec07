"""RoPE off CUDA: q and k rotated as the textbook `apply_rotary` rounds them, and the CPU layer
loop's form over all q/k/v heads at once, which leaves the V heads exactly as they were."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.rope import RotaryEmbedding, apply_rotary

ARCH = ModelArch(family="llama", vocab_size=64, hidden_size=6 * 32, intermediate_size=64, num_layers=1, num_heads=6,
                 num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
                 tie_word_embeddings=False, attention_bias=False)


@pytest.mark.parametrize("head_dim", [32, 64])  # (fp32 head size 64: on the native kernels where they run)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_with_values_equals_q_k_rotation_and_keeps_v(dtype, head_dim):
    gen = torch.Generator().manual_seed(0)
    arch = dataclasses.replace(ARCH, head_dim=head_dim, hidden_size=6 * head_dim)
    rope = RotaryEmbedding(arch, 512, "cpu")
    positions = torch.tensor([0, 3, 4, 200, 511] * 20)  # (100 tokens: the native rotation's threads too)
    batch = rope.batch(positions, dtype)
    heads = (torch.randn(len(positions), 6 + 2 + 2, head_dim, generator=gen) * 3).to(dtype)
    heads[0, 9, :4] = torch.tensor([-0.0, 0.0, 1e-30, -2.5])  # signed zeros, a tiny value
    q, k = batch.apply(heads[:, :8], 6)
    rotated = batch.rotate(heads, 8)
    assert torch.equal(rotated[:, :6], q) and torch.equal(rotated[:, 6:8], k)
    assert torch.equal(rotated[:, 8:], heads[:, 8:])  # the V heads as they were
    cos_t, sin_t = rope.tables(positions, dtype)
    assert torch.equal(q, apply_rotary(heads[:, :6], cos_t, sin_t))
