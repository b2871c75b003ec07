"""Dense bf16 linears packed once for oneDNN (radixlm.runtime.model.dense_linear): the same products
as F.linear to the bit, and a packed model the same logits as the one with plain weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.runtime.kernels.attention.base import AttentionMeta
from radixlm.runtime.kernels.attention.torch_backend import TorchAttention
from radixlm.runtime.kv_pool import KVPool
from radixlm.runtime.model import loader
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.dense_linear import DenseLinear, packing_available
from radixlm.runtime.model.llama import LlamaModel

needs_packing = pytest.mark.skipif(not packing_available(), reason="oneDNN does not multiply bf16 on this CPU")

ARCH = ModelArch(family="llama", vocab_size=96, hidden_size=128, intermediate_size=192, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                 tie_word_embeddings=False, attention_bias=True)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_product_equals_f_linear_to_the_bit(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=gen).bfloat16()
    b = torch.randn(960, generator=gen).bfloat16() if with_bias else None
    layer = DenseLinear(w, b)
    assert layer.packed is not None and layer.weight is None  # the packed copy is the only one
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    assert torch.equal(layer(x), F.linear(x, w, b))
    x3 = x.view(1, rows, 576)
    assert torch.equal(layer(x3), F.linear(x3, w, b))
    wide = torch.randn(rows, 1152, generator=gen).bfloat16()[:, ::2]  # a strided input
    assert torch.equal(layer(wide), F.linear(wide, w, b))


def test_fp32_weights_stay_plain():
    w = torch.randn(64, 32)
    layer = DenseLinear(w)
    assert layer.packed is None and layer.weight is not None
    x = torch.randn(5, 32)
    assert torch.equal(layer(x), F.linear(x, w))


def _logits(model: LlamaModel) -> list[torch.Tensor]:
    """Prefill 12 tokens, then 3 decode steps: every step's logits."""
    pool = KVPool(model.shard, 64, torch.bfloat16, "cpu")
    table = torch.zeros((1, 64), dtype=torch.int64)
    table[0, :16] = torch.arange(1, 17)
    att = TorchAttention(pool, ARCH.num_heads, ARCH.head_dim)
    ids = torch.randint(0, ARCH.vocab_size, (15,), generator=torch.Generator().manual_seed(3))
    out = []
    for start, end in [(0, 12), (12, 13), (13, 14), (14, 15)]:
        att.prepare(AttentionMeta(torch.arange(start + 1, end + 1), table, [0], [0], [end - start], [end]))
        out.append(model(ids[start:end], torch.arange(start, end), att))
    return out


@needs_packing
def test_packed_model_gives_the_plain_model_logits_to_the_bit(monkeypatch):
    packed = loader.build_model(ARCH, None, torch.bfloat16, "cpu", max_positions=256, seed=1)
    assert isinstance(packed.layers[0].mlp.down_proj, DenseLinear) and isinstance(packed.host_head, DenseLinear)
    monkeypatch.setattr(loader, "packs", lambda weight: False)
    plain = loader.build_model(ARCH, None, torch.bfloat16, "cpu", max_positions=256, seed=1)
    assert isinstance(plain.layers[0].mlp.down_proj, torch.nn.Linear) and plain.host_head is None
    for a, b in zip(_logits(packed), _logits(plain), strict=True):
        assert torch.equal(a, b) and a.abs().sum() > 0
