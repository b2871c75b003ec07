"""Reference attention in plain PyTorch (scaled_dot_product_attention); runs on any device.

Decode tokens (one new token per sequence) are batched into one padded call; each extend
(prefill) segment gets its own call with a causal mask offset by its cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixlm.runtime.kernels.attention.base import AttentionMeta
from radixlm.runtime.kernels.kv_pool import KVPool


class TorchAttention:
    def __init__(self, pool: KVPool, num_heads: int, head_dim: int) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def prepare(self, meta: AttentionMeta) -> None:
        self.meta = meta
        device = meta.out_slots.device
        decode = [i for i in range(meta.num_seqs) if meta.q_lens[i] == 1]
        self.decode_tokens: torch.Tensor | slice | None = None
        if decode:
            kv_lens = torch.tensor([meta.kv_lens[i] for i in decode], device=device)
            max_kv = max(meta.kv_lens[i] for i in decode)
            rows = torch.tensor([meta.rows[i] for i in decode], device=device)
            starts = [meta.q_starts[i] for i in decode]
            # the scheduler puts decodes first, so their tokens are usually one leading slice
            contiguous = starts == list(range(starts[0], starts[0] + len(starts)))
            self.decode_tokens = (
                slice(starts[0], starts[0] + len(starts)) if contiguous else torch.tensor(starts, device=device)
            )
            valid = torch.arange(max_kv, device=device)[None, :] < kv_lens[:, None]
            # padded positions read slot 0 (zeros), never a stale or unwritten slot
            self.decode_kv_idx = torch.where(valid, meta.req_to_token[rows, :max_kv], 0).flatten()
            self.decode_shape = (len(decode), max_kv, self.pool.k.shape[2], self.head_dim)
            self.decode_mask = valid[:, None, None, :]
        self.extends: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        for i in range(meta.num_seqs):
            q_len, kv_len = meta.q_lens[i], meta.kv_lens[i]
            if q_len == 1:
                continue
            kv_idx = meta.req_to_token[meta.rows[i], :kv_len]
            mask = None
            if kv_len != q_len:  # a cached prefix: query j sees positions <= prefix + j
                prefix = kv_len - q_len
                mask = torch.arange(kv_len, device=device)[None, :] <= (
                    torch.arange(q_len, device=device)[:, None] + prefix
                )
            self.extends.append((meta.q_starts[i], q_len, kv_idx, mask))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        self.pool.write(layer, meta.out_slots, k, v)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if self.decode_tokens is not None:
            qd = q[self.decode_tokens].unsqueeze(2)  # [B, H, 1, d]
            # index_select is several times faster than advanced indexing on CPU
            kd = k_cache.index_select(0, self.decode_kv_idx).view(self.decode_shape).transpose(1, 2)
            vd = v_cache.index_select(0, self.decode_kv_idx).view(self.decode_shape).transpose(1, 2)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=self.decode_mask, scale=self.scale, enable_gqa=True
            )
            out[self.decode_tokens] = od.squeeze(2)
        for start, q_len, kv_idx, mask in self.extends:
            qe = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q, d]
            ke = k_cache.index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)
            ve = v_cache.index_select(0, kv_idx).transpose(0, 1).unsqueeze(0)
            oe = F.scaled_dot_product_attention(
                qe, ke, ve, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
            out[start : start + q_len] = oe.squeeze(0).transpose(0, 1)
        return out.view(q.shape[0], -1)
