"""Linear layers for few rows on CUDA (triton): y = x @ W^T for x of shape [M, K], W [N, K].

At batch 1 a linear layer is a matrix-vector product: it reads every weight once and does two
flops per weight, so it runs at memory speed or not at all. cuBLAS picks split-K kernels plus a
reduction for the attention projections of an 8B model (N = 6144 / 4096, K = 4096), which
profiles showed well below copy bandwidth (docs/machines.md; docs/gpu.md). This kernel gives each
program a block of output features and walks the whole K for them, so there is no reduction
pass, and loads weight tiles wide and contiguous along K.

`linear_rows` is the same idea for a decode step of a few sequences (M up to 32): still
memory-bound, each program holds all M rows against a block of output features and walks K with
tensor-core products. Both take the residual add as an epilogue; `linear_few` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixlm.runtime.kernels import fused


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of `gemv` and `linear_rows`: output features per program, K per loop step,
    warps, pipeline depth (the defaults are `gemv`'s)."""

    block_n: int = 8
    block_k: int = 1024
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _weight_tile(w_ptr, offs_k, n_mask, k_mask, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns `offs_k`; rows past N (and, unless K is a
    multiple of the block, columns past K) read 0."""
    if EVEN_K:
        w = tl.load(w_ptr + offs_k[None, :], mask=n_mask[:, None], other=0.0)
    else:
        w = tl.load(w_ptr + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    return w


PLAIN, SILU_MUL, RMS_NORM = 0, 1, 2  # what the kernel does to its input row before the product


@triton.jit
def _gemv_kernel(X, W, B, NW, Y, N, K, stride_wn, eps, HAS_BIAS: tl.constexpr, PROLOGUE: tl.constexpr,
                 ADD_TO_Y: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = _weight_tile(w_ptr, offs_k, n_mask, k_mask, EVEN_K)
        x = tl.load(X + offs_k, mask=k_mask, other=0.0)
        xf = x.to(tl.float32)
        if PROLOGUE == 1:  # X = [gate | up]: SiLU(gate) * up, rounded where the unfused kernel rounds
            u = tl.load(X + K + offs_k, mask=k_mask, other=0.0)
            act = (xf / (1.0 + tl.exp(-xf))).to(x.dtype)
            xf = (act.to(tl.float32) * u.to(tl.float32)).to(x.dtype).to(tl.float32)
        if PROLOGUE == 2:  # RMSNorm: the norm weight now, the row's 1/rms (a scalar) after the loop
            ss += xf * xf
            xf = xf * tl.load(NW + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * xf[None, :], axis=1)
    if PROLOGUE == 2:
        acc = acc * tl.rsqrt(tl.sum(ss, 0) / K + eps)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out = acc.to(Y.dtype.element_ty)
    if ADD_TO_Y:  # the residual stream: Y += product, rounded as a separate add would round
        y = tl.load(Y + offs_n, mask=n_mask, other=0.0)
        out = (out.to(tl.float32) + y.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + offs_n, out, mask=n_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, *, silu_mul: bool = False, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, add_to: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias) -> [1, N], both contiguous along K.

    - `silu_mul`: x is [1, 2K] = [gate | up] and the product is taken with SiLU(gate) * up
      (the MLP's down projection without a separate activation kernel);
    - `norm_weight`, `eps`: the product is taken with RMSNorm(x) (a layer's input norm), in one
      pass: 1/rms(x) is a scalar, applied to the sums after the loop, so the normalised row is
      never rounded to the model dtype (slightly more precise than the unfused kernels);
    - `add_to`: a [1, N] tensor that the result is added into, in place, and returned (the
      residual stream).
    """
    k = x.shape[-1] // 2 if silu_mul else x.shape[-1]
    n = weight.shape[0]
    assert x.shape[0] == 1 and weight.shape[1] == k and weight.stride(1) == 1 and x.is_contiguous()
    assert not (silu_mul and norm_weight is not None)
    cfg = config or default_config(n, k)
    if add_to is not None:
        assert add_to.shape == (1, n) and add_to.is_contiguous() and add_to.data_ptr() != x.data_ptr()
        y = add_to
    else:
        y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    prologue = SILU_MUL if silu_mul else RMS_NORM if norm_weight is not None else PLAIN
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, norm_weight if norm_weight is not None else weight,
        y, n, k, weight.stride(0), eps,
        HAS_BIAS=bias is not None, PROLOGUE=prologue, ADD_TO_Y=add_to is not None, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


MAX_ROWS = 32  # above this cuBLAS was as fast inside the 8B model's decode step (docs/gpu.md)


@triton.jit
def _rows_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                 ADD_TO_Y: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_ptr = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_ptr = W + offs_n[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        w = _weight_tile(w_ptr, offs_k, n_mask, k_mask, EVEN_K)
        x = tl.load(x_ptr + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptr = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    out = acc.to(Y.dtype.element_ty)
    if ADD_TO_Y:  # the residual stream, rounded as a separate add would round
        y = tl.load(y_ptr, mask=mask, other=0.0)
        out = (out.to(tl.float32) + y.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(y_ptr, out, mask=mask)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemvConfig | None = None, *, add_to: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] for 1 <= M <= MAX_ROWS; with `add_to`
    ([M, N]) the result is added into it in place and it is returned (the residual stream)."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS and weight.shape[1] == k and weight.stride(1) == 1 and x.stride(-1) == 1
    cfg = config or rows_config(m, n, x.dtype)
    if add_to is not None:
        assert add_to.shape == (m, n) and add_to.stride(-1) == 1 and add_to.data_ptr() != x.data_ptr()
        y = add_to
    else:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _rows_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, ADD_TO_Y=add_to is not None, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def rows_config(m: int, n: int, dtype: torch.dtype = torch.bfloat16) -> GemvConfig:
    """The launch shape for `m` rows and `n` output features: per row-block size, the shape with
    the least time over a Llama-3-8B step (32 layers' four weights and the LM head) in the sweep
    of benchmarks/gemv.py --rows (docs/machines.md; docs/gpu.md); the LM head gets its own above
    16 rows."""
    if dtype == torch.float32:  # four-byte tiles: fewer stages fit in shared memory
        return GemvConfig(32, 64, 4, 3)
    if m <= 16:
        return GemvConfig(64, 256, 4, 5)
    return GemvConfig(128, 128, 4, 3) if n >= 65536 else GemvConfig(32, 256, 4, 5)


def linear_few(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               silu_mul: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               add_to: torch.Tensor | None = None) -> torch.Tensor:
    """`gemv` for one row, `linear_rows` for up to MAX_ROWS, with the same options. Above one row
    the RMSNorm and SiLU·up run as their own kernels first: as prologues, every program would
    recompute them for all its rows, which made the 8B model's decode steps at 8-64 rows slower
    (docs/machines.md; docs/gpu.md)."""
    if x.shape[0] == 1:
        return gemv(x, weight, bias, silu_mul=silu_mul, norm_weight=norm_weight, eps=eps, add_to=add_to)
    if norm_weight is not None:
        x = fused.rms_norm(x, norm_weight, eps)
    if silu_mul:
        x = fused.silu_mul(x)
    return linear_rows(x, weight, bias, add_to=add_to)


def default_config(n: int, k: int) -> GemvConfig:
    """The launch shape for an [N, K] weight. One shape serves all of Llama-3-8B's weights close to
    each one's best in the sweep of benchmarks/gemv.py (docs/machines.md; docs/gpu.md)."""
    return GemvConfig()
