"""The CPU RMSNorm (`host_rms_norm`) against HF's formula: bf16 through LayerNorm's kernel over
[x, -x], fp32 on the native kernels where they run (else as bf16), within fp32 rounding of
`F.rms_norm`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixlm.runtime.model.llama import host_rms_norm


def _hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    h = x.float()
    variance = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(variance + eps)).to(x.dtype)


@pytest.mark.parametrize("size", [64, 576, 4096])
@pytest.mark.parametrize("rows", [1, 16])
def test_bf16_norm_matches_hf(size, rows):
    gen = torch.Generator().manual_seed(size + rows)
    differ = total = 0
    for i in range(40):
        scale = 10 ** (torch.rand((), generator=gen).item() * 5 - 3)  # 1e-3 .. 1e2
        x = torch.randn(rows, size, generator=gen) * scale
        x[:, torch.randint(0, size, (2,), generator=gen)] *= 50  # outlier channels, as real hidden states have
        x = x.bfloat16()
        weight = (1 + 0.3 * torch.randn(size, generator=gen)).bfloat16()
        eps = 1e-5 if i % 2 else 1e-6
        ours, ref = host_rms_norm(x, weight, eps), _hf(x, weight, eps)
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
        # where they differ, by one bf16 step of the normalised value (times the weight)
        step = (ref.float().abs() * 2**-7).clamp_min(1e-30)
        assert ((ours.float() - ref.float()).abs() <= step * 1.01 + 1e-30).all()
        differ += int((ours != ref).sum())
        total += ours.numel()
    assert differ <= max(2, total // 1000), f"{differ} of {total} elements differ from HF's RMSNorm"


def test_bf16_norm_of_a_view_and_zero_rows():
    x = torch.randn(3, 128).bfloat16()
    weight = torch.ones(64).bfloat16()
    half = x[:, 32:96]  # a strided view, as the residual stream's slices are
    assert torch.allclose(host_rms_norm(half, weight, 1e-5).float(), _hf(half, weight, 1e-5).float(), rtol=1e-2)
    zeros = torch.zeros(2, 64).bfloat16()
    assert torch.equal(host_rms_norm(zeros, weight, 1e-5), zeros)  # eps keeps 0 / sqrt(0 + eps) finite


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_fp32_norm_is_f_rms_norm_within_fp32_rounding(rows):
    gen = torch.Generator().manual_seed(rows)
    for scale in (1e-3, 1.0, 1e2):
        x, weight = torch.randn(rows, 576, generator=gen) * scale, torch.randn(576, generator=gen)
        ours, ref = host_rms_norm(x, weight, 1e-6), F.rms_norm(x, (576,), weight, 1e-6)
        assert torch.allclose(ours, ref, rtol=2e-6, atol=2e-6 * ref.abs().max().item())
        assert torch.equal(host_rms_norm(x[:1], weight, 1e-6), ours[:1])  # a row alone as in a batch


def test_fp32_norm_of_zero_rows_and_of_a_view():
    weight = torch.randn(576)
    zeros = torch.zeros(20, 576)
    assert torch.equal(host_rms_norm(zeros, weight, 1e-6), zeros)
    assert host_rms_norm(torch.empty(0, 576), weight, 1e-6).shape == (0, 576)
    x = torch.randn(4, 1200)
    view = x[:, 16:592]  # strided: F.rms_norm's path
    assert torch.allclose(host_rms_norm(view, weight, 1e-6), F.rms_norm(view, (576,), weight, 1e-6), rtol=2e-6,
                          atol=1e-5)
