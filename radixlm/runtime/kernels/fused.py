"""Fused element-wise kernels for the model on CUDA (triton): RMSNorm with the residual add,
rotary embedding of q and k in place, SiLU(gate) * up, and the KV pool write of k and v.

A bs1 decode step of an 8B model launches ~40 small kernels per layer without them; each
costs a few microseconds however little it does, which profiles showed as ~20% of the step.
RMSNorm and SiLU round where PyTorch rounds (the residual sum, the normalised value and the
activation to the model dtype), so their results match the unfused modules; RoPE computes in
fp32 from the fp32 tables, a little more precise than the bf16 products of `apply_rotary`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(R.dtype.element_ty)
        tl.store(R + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)).to(Y.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * normalise(x) over the last dim, [T, N]. With `residual`, x is first added into
    `residual` in place and the sum is normalised."""
    y = torch.empty_like(x)
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    has_res = residual is not None
    r = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x, r, weight, y, x.stride(0), r.stride(0), y.stride(0), n, eps,
        HAS_RESIDUAL=has_res, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return y


@triton.jit
def _rope_rows(base, cos, sin, count, stride_h, HALF: tl.constexpr, ROWS: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, ROWS)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h < count)[:, None] & (offs_d < HALF)[None, :]
    ptr = base + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * cos[None, :] - x2 * sin[None, :]).to(base.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, COS, SIN, POS, stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
                 HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                 KV_HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(COS + pos * stride_cos + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(SIN + pos * stride_cos + offs_d, mask=d_mask, other=0.0)
    _rope_rows(Q + t * stride_qt, cos, sin, HEADS, stride_qh, HALF, HEADS_PAD, HALF_PAD)
    _rope_rows(K + t * stride_kt, cos, sin, KV_HEADS, stride_kh, HALF, KV_HEADS_PAD, HALF_PAD)


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, heads, d] and k [T, kv_heads, d] in place (rotate-half layout); cos/sin are
    the fp32 tables [max_positions, d] whose two halves are equal."""
    half = q.shape[-1] // 2
    _rope_kernel[(q.shape[0],)](
        q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HEADS=q.shape[1], KV_HEADS=k.shape[1], HEADS_PAD=triton.next_power_of_2(q.shape[1]),
        KV_HEADS_PAD=triton.next_power_of_2(k.shape[1]), HALF=half, HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_out, N, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(GU + t * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + t * stride_gu + N + offs, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty)
    tl.store(OUT + t * stride_out + offs, (act.to(tl.float32) * u.to(tl.float32)).to(OUT.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up] of shape [T, 2N]; returns [T, N]."""
    n = gate_up.shape[-1] // 2
    out = torch.empty((gate_up.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4,
    )
    return out


@triton.jit
def _store_kv_kernel(K, V, KC, VC, SLOTS, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
                     HEADS: tl.constexpr, D: tl.constexpr, HEADS_PAD: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h < HEADS)[:, None] & (offs_d < D)[None, :]
    dst = slot * stride_c + offs_h[:, None] * D + offs_d[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(KC + dst, k, mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(VC + dst, v, mask=mask)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache[slots] = k and v_cache[slots] = v in one launch; caches [slots, kv_heads, d]
    contiguous, k/v [T, kv_heads, d] with unit stride along d (views of the qkv output)."""
    heads, d = k.shape[1], k.shape[2]
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
        HEADS=heads, D=d, HEADS_PAD=triton.next_power_of_2(heads), D_PAD=triton.next_power_of_2(d), num_warps=4,
    )
