"""Reference attention in plain PyTorch (scaled_dot_product_attention); runs on any device.

Decode tokens (one new token per sequence) are batched into one padded call; each extend
(prefill) segment gets its own call with a causal mask offset by its cached prefix.

In the decode call, the query heads that share a KV head take the place of the query length
([B, kv_heads, heads / kv_heads, d] against [B, kv_heads, L, d]): every query of a sequence sees
the same keys, so this is the same attention, and PyTorch's CPU kernel runs it several times
faster than one query per head with `enable_gqa` (docs/machines.md).

Extends in bf16 on a CPU with avx512_bf16 but no AMX run as blocks of queries instead
(`blocked_extend`): there PyTorch's CPU flash kernel multiplies bf16 at about fp32's speed, while
its plain bf16 matmuls run much faster; 128 queries at a time, with the heads that share a KV head
stacked as rows, run the same causal attention faster from 512 to 4k tokens, with or without a
cached prefix (docs/machines.md; docs/benchmarks.md). With AMX the flash kernel multiplies on the
tiles and beats the blocks (docs/machines.md), so it stays, as it does without native bf16 (not
measured), in fp32 (where the blocks are slower) and for short extends (`BLOCKED_MIN_QUERIES`,
`BLOCKED_MIN_PAIRS`), a jump-forward's few tokens say, where the blocks' fixed cost a layer is more
than the flash kernel's call.

fp32 extends of 256 queries and more, where the native kernels run and are the faster (AVX-512 VNNI;
AVX2 on AMD processors: `native.prefill_preferred`), run
on their causal prompt attention (`native.prefill_attention`: scores, weights and values in three
passes of independent FMA chains, the pool's K and V rows laid out once per call by the kernels),
its products in bf16 pairs with fp32 sums where `formats.choose_attention` says so (`prompt_bf16`:
avx512_bf16, --dtype auto), and then for extends from 16 queries (`NATIVE_BF16_MIN_QUERIES`); on
the AVX2 kernels from 64 (`NATIVE_AVX2_MIN_QUERIES`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixlm.runtime.kernels import native, native_ir
from radixlm.runtime.kernels.attention.base import AttentionMeta

if TYPE_CHECKING:
    from radixlm.runtime.kv_pool import KVPool

# fp32 extends of at least this many queries run on the native prompt attention (`native.prefill_attention`):
# below, the flash kernel, which needs no copy of the keys, is the faster (docs/machines.md)
NATIVE_MIN_QUERIES = 256
# ... from this many on the AVX2 kernels (AMD processors only: `native.prefill_preferred`), the kernels laying
# out K and V themselves, faster than the flash kernel from there over any cached prefix (docs/machines.md)
NATIVE_AVX2_MIN_QUERIES = 64
# ... and in its bf16 form from this many queries, whatever the cached prefix (docs/machines.md; docs/benchmarks.md,
# "bf16 products in the prompt attention")
NATIVE_BF16_MIN_QUERIES = 16
EXTEND_BLOCK = 128  # queries per block of `blocked_extend`: the fastest of the sizes measured (docs/machines.md)
# below these an extend keeps the flash kernel, where the blocks' fixed cost outweighs what they
# spare (docs/machines.md)
BLOCKED_MIN_QUERIES = 32
BLOCKED_MIN_PAIRS = 32768  # queries x keys
# a block's scores (heads x rows x keys) stay under this many elements: fewer rows a block at long
# contexts (the default model keeps 128 rows up to ~7k keys), never fewer than 16
SCORES_BUDGET = 8 * 2**20


def blocked_prompts(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the torch backend runs long extends as `blocked_extend`: bf16 on a CPU that
    multiplies bf16 natively (avx512_bf16, where it was measured) but has no AMX tiles."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return bool(native()) and not amx()


@functools.lru_cache(maxsize=8)
def _diagonal_bias(rows: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The causal mask of a block's diagonal square as an additive bias [rows, group, rows]: -inf
    where a query would see a later key. Made once per shape, not in every layer (read only)."""
    above = torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)
    return torch.zeros(rows, group, rows, dtype=dtype, device=device).masked_fill_(above[:, None, :], float("-inf"))


def blocked_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor,
                   block: int = EXTEND_BLOCK, budget: int = SCORES_BUDGET) -> None:
    """Causal attention of one extend into `out` [n, heads, d]: queries q [n, heads, d] at the
    last n positions of keys/values k, v [N, kv_heads, d] (N - n of them a cached prefix).

    Each block of queries sees the keys up to its last position; only the block's own diagonal
    square needs the causal mask, added as a bias. A block's scores are [kv_heads, rows * group,
    keys] in q's dtype (softmax accumulates in fp32), at most `budget` elements where the block
    can have 16 rows and more."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    prefix = k.shape[0] - n
    qs = torch.empty(kv_heads, n, group, d, dtype=q.dtype, device=q.device)
    torch.mul(q.view(n, kv_heads, group, d).permute(1, 0, 2, 3), scale, out=qs)  # q itself stays as it was
    keys_t = k.permute(1, 2, 0)  # [kv, d, N]
    values = v.permute(1, 0, 2)  # [kv, N, d]
    out_groups = out.view(n, kv_heads, group, d)
    block = min(block, max(16, budget // (heads * k.shape[0])))  # the budget never below 16 rows
    bias = _diagonal_bias(min(block, n), group, q.dtype, q.device)
    for s in range(0, n, block):
        e = min(n, s + block)
        rows = e - s
        seen = prefix + e
        scores = torch.bmm(qs[:, s:e].reshape(kv_heads, rows * group, d), keys_t[:, :, :seen])
        scores[:, :, prefix + s : seen].view(kv_heads, rows, group, rows).add_(bias[:rows, :, :rows])
        o = torch.bmm(torch.softmax(scores, -1), values[:, :seen])  # [kv, rows * group, d]
        out_groups[s:e] = o.view(kv_heads, rows, group, d).permute(1, 0, 2, 3)


class TorchAttention:
    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, prompt_bf16: bool = False) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # decode attention reads a bf16 or fp32 host pool in place on the native kernels, where they run
        self.native = (pool.kv_layers is not None and pool.kv_layers[0].dtype in (torch.bfloat16, torch.float32)
                       and head_dim in native_ir.HEAD_DIMS and native.available())
        self.blocks = blocked_prompts(pool.k.dtype, pool.k.device)
        # extends of fp32 prompts (head size 64) on the native kernels' causal attention, where they run
        self.native_prompts = (pool.k.dtype == torch.float32 and pool.k.device.type == "cpu" and head_dim == 64
                               and native.prefill_preferred())
        # ... multiplying bf16 pairs into fp32 sums (`prompt_bf16`, where the processor has avx512_bf16)
        if prompt_bf16 and not (self.native_prompts and native.prefill_bf16_available()):
            raise ValueError("bf16 prompt attention runs on the native kernels of an avx512_bf16 processor, for fp32 "
                             "activations of head size 64")
        self.prompt_bf16 = prompt_bf16
        # the fewest queries an extend takes the native prompt attention with
        self.native_min = (NATIVE_BF16_MIN_QUERIES if prompt_bf16 else
                           NATIVE_AVX2_MIN_QUERIES if native.isa() == "avx2" else NATIVE_MIN_QUERIES)

    def prepare(self, meta: AttentionMeta) -> None:
        self.meta = meta
        device = meta.out_slots.device
        decode = [i for i in range(meta.num_seqs) if meta.q_lens[i] == 1]
        self.decode_tokens: torch.Tensor | slice | None = None
        if decode:
            kv_lens = torch.tensor([meta.kv_lens[i] for i in decode], device=device)
            self.decode_lens = kv_lens
            max_kv = max(meta.kv_lens[i] for i in decode)
            rows = torch.tensor([meta.rows[i] for i in decode], device=device)
            starts = [meta.q_starts[i] for i in decode]
            # the scheduler puts decodes first, so their tokens are usually one leading slice
            contiguous = starts == list(range(starts[0], starts[0] + len(starts)))
            self.decode_tokens = (
                slice(starts[0], starts[0] + len(starts)) if contiguous else torch.tensor(starts, device=device)
            )
            self.decode_shape = (len(decode), max_kv, self.pool.k.shape[2], self.head_dim)
            self.decode_mask: torch.Tensor | None = None
            if all(meta.kv_lens[i] == max_kv for i in decode):  # no padding (always so at batch 1)
                self.decode_kv_idx = meta.req_to_token[rows, :max_kv].flatten()
            else:
                valid = torch.arange(max_kv, device=device)[None, :] < kv_lens[:, None]
                # padded positions read slot 0 (zeros), never a stale or unwritten slot
                self.decode_kv_idx = torch.where(valid, meta.req_to_token[rows, :max_kv], 0).flatten()
                self.decode_mask = valid[:, None, None, :]
        # a step of decodes only: the decode call's output is the whole output
        self.decode_only = bool(decode) and len(decode) == meta.num_seqs
        self.extends: list[tuple[int, int, torch.Tensor, torch.Tensor | None, str]] = []
        for i in range(meta.num_seqs):
            q_len, kv_len = meta.q_lens[i], meta.kv_lens[i]
            if q_len == 1:
                continue
            kv_idx = meta.req_to_token[meta.rows[i], :kv_len]
            way = "flash"
            if self.blocks and q_len >= BLOCKED_MIN_QUERIES and q_len * kv_len >= BLOCKED_MIN_PAIRS:
                way = "blocked"
            elif self.native_prompts and q_len >= self.native_min:
                way = "native"
            mask = None
            if kv_len != q_len and way == "flash":  # a cached prefix: query j sees positions <= prefix + j
                prefix = kv_len - q_len
                mask = torch.arange(kv_len, device=device)[None, :] <= (
                    torch.arange(q_len, device=device)[:, None] + prefix
                )
            self.extends.append((meta.q_starts[i], q_len, kv_idx, mask, way))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.meta.out_slots, k, v)
        return self._attend(layer, q)

    def forward_joined(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """`forward` with the new K and V as one [T, 2 * kv_heads, d] tensor (each token's K heads,
        then its V heads), written in one copy to a host pool (`KVPool.write_joined`)."""
        self.pool.write_joined(layer, self.meta.out_slots, kv)
        return self._attend(layer, q)

    def _attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of q [T, heads, d] over each sequence's context, the new K/V already stored."""
        if self.decode_only:  # (then the decodes' tokens are all of q, in order)
            return self._decode(layer, q)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if self.decode_tokens is not None:
            out.view(q.shape[0], -1)[self.decode_tokens] = self._decode(layer, q[self.decode_tokens])
        for start, q_len, kv_idx, mask, way in self.extends:
            if way == "native":  # (it reads the pool's rows itself)
                pk, pv = self._layer(layer)
                out[start : start + q_len] = native.prefill_attention(
                    q[start : start + q_len], pk, pv, self.scale, bf16=self.prompt_bf16, slots=kv_idx
                ).view(q_len, self.num_heads, -1)
                continue
            ke, ve = self._gather(layer, kv_idx)
            if way == "blocked":
                blocked_extend(q[start : start + q_len], ke, ve, self.scale, out[start : start + q_len])
                continue
            qe = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, d]
            ke, ve = ke.transpose(0, 1).unsqueeze(0), ve.transpose(0, 1).unsqueeze(0)
            oe = F.scaled_dot_product_attention(
                qe, ke, ve, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
            out[start : start + q_len] = oe.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], -1)

    def _gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V [len(slots), kv_heads, d] at `slots` of `layer`: from a host pool, where
        K and V share a row, one `index_select` (several times faster than advanced indexing on
        the CPU) and its two halves."""
        pool = self.pool
        if pool.kv_layers is not None:
            both = pool.kv_layers[layer].index_select(0, slots)
            heads = both.shape[1] // 2
            return both[:, :heads], both[:, heads:]
        return pool.k_layers[layer].index_select(0, slots), pool.v_layers[layer].index_select(0, slots)

    def _layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's K and V of `layer`, [slots, kv_heads, d] each (views: a host pool's halves)."""
        pool = self.pool
        if pool.kv_layers is not None:
            heads = pool.kv_layers[layer].shape[1] // 2
            return pool.kv_layers[layer][:, :heads], pool.kv_layers[layer][:, heads:]
        return pool.k_layers[layer], pool.v_layers[layer]

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of the decode queries q [B, heads, d] -> [B, heads * d]."""
        b, _, kv_heads, d = self.decode_shape
        if self.native and q.stride(2) == 1 and q.stride(1) == d:
            assert self.pool.kv_layers is not None
            return native.decode_attention(q, self.pool.kv_layers[layer], self.decode_kv_idx, self.decode_lens,
                                           kv_heads, self.scale)
        qd = q.reshape(b, kv_heads, self.num_heads // kv_heads, d)  # heads sharing a KV head as queries
        k, v = self._gather(layer, self.decode_kv_idx)
        kd = k.view(self.decode_shape).transpose(1, 2)  # [B, kv_heads, L, d]
        vd = v.view(self.decode_shape).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, scale=self.scale)
        return od.reshape(b, self.num_heads * d)
