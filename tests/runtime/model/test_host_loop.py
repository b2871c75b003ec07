"""The CPU layer loop over bound modules (LlamaModel._forward_host) runs the same ops as the
decoder layers as modules (`_forward_modules`, the CUDA path above the few-row kernels): the
same results to the bit, dense and with weight-only quantized linears swapped in after the
loop had bound the dense ones; and fp32 decode steps as one native call give the loop's."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from radixlm.runtime.kernels import native, native_ir
from radixlm.runtime.kernels.attention.base import AttentionMeta
from radixlm.runtime.kernels.attention.torch_backend import TorchAttention
from radixlm.runtime.kv_pool import KVPool
from radixlm.runtime.model import loader
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.formats import QuantChoice
from radixlm.runtime.model.fused_decode import FusedDecode
from radixlm.runtime.model.llama import LlamaModel
from radixlm.runtime.model.loader import build_model, quantize_linears

ARCH = ModelArch(family="llama", vocab_size=96, hidden_size=128, intermediate_size=192, num_layers=3, num_heads=4,
                 num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                 tie_word_embeddings=True, attention_bias=True)


def _both_paths(model: LlamaModel, dtype: torch.dtype) -> None:
    """Prefill 12 tokens, then 3 decode steps; each step through both loops from the same state."""
    pool = KVPool(model.shard, 64, dtype, "cpu")
    table = torch.zeros((1, 64), dtype=torch.int64)
    table[0, :16] = torch.arange(1, 17)
    att = TorchAttention(pool, ARCH.num_heads, ARCH.head_dim)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ARCH.vocab_size, (15,), generator=gen)
    assert model.rope is not None
    for start, end in [(0, 12), (12, 13), (13, 14), (14, 15)]:
        att.prepare(AttentionMeta(torch.arange(start + 1, end + 1), table, [0], [0], [end - start], [end]))
        with torch.inference_mode():
            h = model.embed_tokens(ids[start:end])
            rotary = model.rope.batch(torch.arange(start, end), h.dtype)
            mod_h, mod_res = model._forward_modules(h.clone(), rotary, att)
            host_h, host_res = model._forward_host(h.clone(), rotary, att, None)
            # only the last row asked for: the last layer drops the others after its attention
            # (its matmuls then run on one row, which the BLAS may round differently)
            last = torch.tensor([end - start - 1])
            kept_h, kept_res = model._forward_host(h.clone(), rotary, att, last)
        assert torch.equal(mod_h, host_h) and torch.equal(mod_res, host_res)
        assert mod_h.abs().sum() > 0
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(kept_h, host_h[last], rtol=tol, atol=tol)
        torch.testing.assert_close(kept_res, host_res[last], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_loop_equals_module_path(dtype):
    model = build_model(ARCH, None, dtype, "cpu", max_positions=256, seed=1)
    _both_paths(model, dtype)


@pytest.mark.parametrize("attention_bias", [True, False])
@pytest.mark.parametrize("dense_above", [None, 4])
def test_host_loop_rebinds_after_quantization(monkeypatch, attention_bias, dense_above):
    """Quantized layers swapped in after the loop bound the dense ones; steps of at most
    `dense_above` rows call the int4 kernel directly (`few`), longer ones the layer's forward
    (here its dense copy), and a layer with a bias always its forward."""
    monkeypatch.setattr(loader, "packs", lambda weight: False)  # plain nn.Linear layers to quantize
    arch = dataclasses.replace(ARCH, attention_bias=attention_bias)
    model = build_model(arch, None, torch.bfloat16, "cpu", max_positions=256, seed=1)
    dense = model.host_layers()[0].linears[0]
    quantize_linears(model, QuantChoice("q4", dense_above, "test"), torch.bfloat16, None)
    layer = model.host_layers()[0]
    assert layer.linears[0] != dense  # bound to the quantized layer now
    assert layer.few_rows == (sys.maxsize if dense_above is None else dense_above)
    assert layer.few[1] != layer.linears[1]  # o: the kernel alone
    assert (layer.few[0] == layer.linears[0]) == attention_bias  # q/k/v with a bias: its forward
    _both_paths(model, torch.bfloat16)


@pytest.mark.skipif(not native.available(), reason="needs the native kernels")
@pytest.mark.parametrize("isa", native.supported_isas())
@pytest.mark.parametrize("rows", [1, 3, 7, 16])
def test_fused_decode_equals_the_layer_loop(monkeypatch, rows, isa):
    """fp32 decode steps on the native kernels as one call (`FusedDecode`; the row kernels up to
    4 rows, the tiles above where the instruction set has them): the layer loop's results to the
    bit, K/V rows written alike; a prompt keeps the loop."""
    monkeypatch.setattr(native, "isa", lambda: isa)  # (every kernel made below: this instruction set's)
    monkeypatch.setattr(loader, "packs", lambda weight: False)
    arch = dataclasses.replace(ARCH, head_dim=64, attention_bias=False, num_heads=2, num_kv_heads=1)
    model = build_model(arch, None, torch.float32, "cpu", max_positions=256, seed=1)
    quantize_linears(model, QuantChoice("q4", None, "test"), torch.float32, None)
    fused_rows = FusedDecode.supported(model.shard, model._layer_parts(), False)
    assert fused_rows == (32 if isa in native_ir.TILE_ISAS else 4)
    if rows > fused_rows:
        pytest.skip("decode steps of more than 4 rows run as one call with the tiled products")
    pool = KVPool(model.shard, 1024, torch.float32, "cpu")
    att = TorchAttention(pool, arch.num_heads, arch.head_dim)
    table = torch.arange(1, 1 + rows * 32).view(rows, 32)
    gen = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, arch.vocab_size, (rows, 14), generator=gen)
    assert model.rope is not None
    with torch.inference_mode():
        for i in range(rows):  # each sequence's 10-token prompt, through the loop
            att.prepare(AttentionMeta(table[i, :10], table, [i], [0], [10], [10]))
            h = model.embed_tokens(ids[i, :10])
            assert model._fused_decode(h, att, None) is None
            model._forward_host(h, model.rope.batch(torch.arange(10), h.dtype), att, None)
        for pos in range(10, 14):  # then decode steps of all the rows
            att.prepare(AttentionMeta(table[:, pos], table, list(range(rows)), list(range(rows)), [1] * rows,
                                      [pos + 1] * rows))
            h = model.embed_tokens(ids[:, pos])
            rotary = model.rope.batch(torch.full((rows,), pos), h.dtype)
            before = pool.kv.clone()
            loop_h, loop_res = model._forward_host(h.clone(), rotary, att, None)
            written, pool.kv[:] = pool.kv.clone(), before
            fused = model._fused_decode(h, att, None)
            assert fused is not None
            fused_h, fused_res = fused.run(h.clone(), rotary, att)
            assert torch.equal(fused_h, loop_h) and torch.equal(fused_res, loop_res)
            assert torch.equal(pool.kv, written) and loop_h.abs().sum() > 0
