"""Triton attention over the KV slot pool (CUDA, or CPU under TRITON_INTERPRET=1).

Two kernels, both reading K/V through the request->slot table, so a cached prefix is never
copied:
- extend: one program per (sequence, query head, block of queries); causal over the sequence's
  cached prefix plus its new tokens, online softmax in fp32.
- decode: split-KV in two stages. Stage 1 runs one program per (sequence, KV head, split) and
  handles all query heads of the KV head together (GQA: K/V read once per group); it writes a
  partial output and its log-sum-exp. Stage 2 merges the splits of each (sequence, head).
  The number of splits depends only on the batch size rounded up to a power of two, so a
  CUDA-graph bucket and an eager batch of the same size run the same arithmetic.

Decode can also run from static buffers (`bind_decode`), the path CUDA graphs capture.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from radixlm.runtime.kernels.attention.base import AttentionMeta

if TYPE_CHECKING:
    from radixlm.runtime.kv_pool import KVPool

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
DECODE_BLOCK_N = 32  # with 2 programs per SM and 3 stages: a sweep's best overall (docs/machines.md)


@triton.jit
def _attend_block(q, K, V, slot_row, offs_n, n_mask, visible, head_off, offs_d, d_mask, stride_ks, scale,
                  m_i, l_i, acc, PRECISION: tl.constexpr):
    """One block of context positions into an online softmax: gather the positions' K/V rows
    through their slots (`slot_row`: the request's row of the slot table), score the queries
    (scale folded with log2 e; `visible` masks scores), and return the updated running max,
    sum and output accumulator (fp32)."""
    slots = tl.load(slot_row + offs_n, mask=n_mask, other=0).to(tl.int64)
    kv_off = slots[:, None] * stride_ks + head_off + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    Q, K, V, Out, req_to_token, rows, q_starts, q_lens, kv_lens,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_rt,
    scale,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    mblk = tl.program_id(2)
    q_len = tl.load(q_lens + seq)
    if mblk * BLOCK_M < q_len:
        q_start = tl.load(q_starts + seq).to(tl.int64)
        kv_len = tl.load(kv_lens + seq)
        row = tl.load(rows + seq).to(tl.int64)
        prefix = kv_len - q_len
        kv_head = head // GROUP
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        m_mask = offs_m < q_len
        d_mask = offs_d < D
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        # every query row sees position 0 in the first block, so no row is ever all -inf
        end = tl.minimum(kv_len, prefix + (mblk + 1) * BLOCK_M)
        for start in range(0, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            visible = (offs_n[None, :] <= (prefix + offs_m)[:, None]) & n_mask[None, :]
            m_i, l_i, acc = _attend_block(q, K, V, req_to_token + row * stride_rt, offs_n, n_mask, visible,
                                          kv_head * stride_kh, offs_d, d_mask, stride_ks, scale, m_i, l_i, acc,
                                          PRECISION)
        out = acc / l_i[:, None]
        tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_partial_kernel(
    Q, K, V, MidO, MidLse, req_to_token, rows, kv_lens, tokens,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_rt,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    scale,
    SPLITS, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens + b)
    split_len = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    if start < end:
        row = tl.load(rows + b).to(tl.int64)
        tok = tl.load(tokens + b).to(tl.int64)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        g_mask = offs_g < GROUP
        d_mask = offs_d < D
        heads = kv_head * GROUP + offs_g
        q = tl.load(Q + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            m_i, l_i, acc = _attend_block(q, K, V, req_to_token + row * stride_rt, offs_n, n_mask, n_mask[None, :],
                                          kv_head * stride_kh, offs_d, d_mask, stride_ks, scale, m_i, l_i, acc,
                                          PRECISION)
        mid = b * stride_mb + heads * stride_mh + split * stride_ms
        tl.store(MidO + mid[:, None] + offs_d[None, :], acc / l_i[:, None], mask=g_mask[:, None] & d_mask[None, :])
        tl.store(MidLse + b * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    Out, MidO, MidLse, kv_lens, tokens,
    stride_ot, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    SPLITS, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    kv_len = tl.load(kv_lens + b)
    tok = tl.load(tokens + b).to(tl.int64)
    split_len = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for split in range(SPLITS):
        if split * split_len < kv_len:
            lse = tl.load(MidLse + b * stride_lb + head * stride_lh + split)
            o = tl.load(MidO + b * stride_mb + head * stride_mh + split * stride_ms + offs_d, mask=d_mask, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + w * o
            total = total * alpha + w
            m = m_new
    tl.store(Out + tok * stride_ot + head * stride_oh + offs_d, (acc / total).to(Out.dtype.element_ty), mask=d_mask)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def decode_splits(batch_size: int, kv_heads: int, num_sms: int) -> int:
    """KV splits per sequence: enough programs to fill the GPU about twice over, from the batch
    size rounded up to a power of two (so graph buckets and eager batches agree). Chosen with
    the split count, block and pipeline depth from the sweep of benchmarks/decode_kernels.py."""
    programs = _pow2(batch_size) * kv_heads
    return min(MAX_SPLITS, _pow2(math.ceil(2 * num_sms / programs)))


class TritonAttention:
    """Attention backend `triton`: extend and split-KV decode kernels over the KV pool."""

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.kv_heads = pool.k.shape[2]
        self.group = num_heads // self.kv_heads
        self.d_pad = max(16, _pow2(head_dim))
        self.g_pad = max(16, _pow2(self.group))
        self.scale = head_dim**-0.5 * LOG2E
        self.precision = "ieee" if pool.k.dtype == torch.float32 else "tf32"
        device = pool.k.device
        on_gpu = device.type == "cuda"
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 132
        # interpreter (CPU): small tiles keep it quick; GPU: tiles for Hopper-class parts
        self.extend_blocks = (128, 64, 8) if on_gpu and head_dim <= 128 else (64, 64, 4) if on_gpu else (32, 32, 4)
        self.out_slots: torch.Tensor | None = None
        self.req_to_token: torch.Tensor | None = None
        self._decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        self._extend: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    def prepare(self, meta: AttentionMeta) -> None:
        """Split the ragged batch into decode sequences and extend segments; one H2D copy."""
        n = meta.num_seqs
        dec = [i for i in range(n) if meta.q_lens[i] == 1]
        ext = [i for i in range(n) if meta.q_lens[i] != 1]
        cols = [[meta.rows[i] for i in dec], [meta.kv_lens[i] for i in dec], [meta.q_starts[i] for i in dec],
                [meta.rows[i] for i in ext], [meta.q_starts[i] for i in ext], [meta.q_lens[i] for i in ext],
                [meta.kv_lens[i] for i in ext]]
        flat = torch.tensor([x for c in cols for x in c], dtype=torch.int32)
        if meta.out_slots.is_cuda:  # pinned, non-blocking: no wait for the step still running
            flat = flat.pin_memory().to(meta.out_slots.device, non_blocking=True)
        else:  # the triton interpreter (tests)
            flat = flat.to(meta.out_slots.device)
        parts = torch.split(flat, [len(c) for c in cols])
        self.out_slots, self.req_to_token = meta.out_slots, meta.req_to_token
        self._decode = None
        if dec:
            self._bind_decode_tensors(parts[0], parts[1], parts[2])
        self._extend = None
        if ext:
            self._extend = (parts[3], parts[4], parts[5], parts[6], max(meta.q_lens[i] for i in ext))

    def bind_decode(self, out_slots: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
                    kv_lens: torch.Tensor, tokens: torch.Tensor) -> None:
        """A decode-only batch read from (static) device buffers: no host work, graph-safe."""
        self.out_slots, self.req_to_token = out_slots, req_to_token
        self._bind_decode_tensors(rows, kv_lens, tokens)
        self._extend = None

    def _bind_decode_tensors(self, rows: torch.Tensor, kv_lens: torch.Tensor, tokens: torch.Tensor) -> None:
        bs = rows.shape[0]
        splits = decode_splits(bs, self.kv_heads, self.num_sms)
        device = rows.device
        mid_o = torch.empty((bs, self.num_heads, splits, self.d_pad), dtype=torch.float32, device=device)
        mid_lse = torch.empty((bs, self.num_heads, splits), dtype=torch.float32, device=device)
        self._decode = (rows, kv_lens, tokens, mid_o, mid_lse, splits)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        assert self.out_slots is not None and self.req_to_token is not None, "prepare() first"
        self.pool.write(layer, self.out_slots, k, v)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty_like(q)
        r2t = self.req_to_token
        if self._decode is not None:
            rows, kv_lens, tokens, mid_o, mid_lse, splits = self._decode
            bs = rows.shape[0]
            _decode_partial_kernel[(bs, self.kv_heads, splits)](
                q, k_cache, v_cache, mid_o, mid_lse, r2t, rows, kv_lens, tokens,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), r2t.stride(0),
                mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
                self.scale, splits,
                GROUP=self.group, G_PAD=self.g_pad, D=self.head_dim, D_PAD=self.d_pad,
                BLOCK_N=DECODE_BLOCK_N, PRECISION=self.precision, num_warps=4, num_stages=3,
            )
            _decode_merge_kernel[(bs, self.num_heads)](
                out, mid_o, mid_lse, kv_lens, tokens,
                out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
                mid_lse.stride(0), mid_lse.stride(1), splits,
                D=self.head_dim, D_PAD=self.d_pad, BLOCK_N=DECODE_BLOCK_N, num_warps=1,
            )
        if self._extend is not None:
            rows, q_starts, q_lens, kv_lens, max_q = self._extend
            block_m, block_n, warps = self.extend_blocks
            grid = (rows.shape[0], self.num_heads, triton.cdiv(max_q, block_m))
            _extend_kernel[grid](
                q, k_cache, v_cache, out, r2t, rows, q_starts, q_lens, kv_lens,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
                r2t.stride(0), self.scale,
                GROUP=self.group, D=self.head_dim, D_PAD=self.d_pad, BLOCK_M=block_m, BLOCK_N=block_n,
                PRECISION=self.precision, num_warps=warps, num_stages=2,
            )
        return out.view(q.shape[0], -1)
