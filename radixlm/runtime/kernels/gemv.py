"""Linear layers for one row on CUDA (triton): y = x @ W^T for x of shape [1, K], W [N, K].

At batch 1 a linear layer is a matrix-vector product: it reads every weight once and does two
flops per weight, so it runs at memory speed or not at all. cuBLAS picks split-K kernels plus a
reduction for the attention projections of an 8B model (N = 6144 / 4096, K = 4096), which
profiles on an H100 showed at ~52% of copy bandwidth (docs/gpu.md). This kernel gives each
program a block of output features and walks the whole K for them, so there is no reduction
pass, and loads weight tiles wide and contiguous along K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape: output features per program, K per loop step, warps, pipeline depth."""

    block_n: int = 8
    block_k: int = 1024
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_ptr + offs_k[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(X + offs_k)
        else:
            k_mask = offs_k < K
            w = tl.load(w_ptr + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(X + offs_k, mask=k_mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=n_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias) -> [1, N], both contiguous along K."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert x.numel() == k and weight.shape[1] == k and weight.stride(1) == 1 and x.is_contiguous()
    cfg = config or default_config(n, k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def default_config(n: int, k: int) -> GemvConfig:
    """The launch shape for an [N, K] weight. One shape serves all of Llama-3-8B's weights within
    0.5 µs of each one's best in the H100 sweep of benchmarks/gemv.py (docs/gpu.md)."""
    return GemvConfig()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the GEMV kernel when x is one contiguous row."""
    if x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1:
        return gemv(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
