"""What every attention backend sees: the ragged batch's layout and the KV pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from radixlm.runtime.kv_pool import KVPool


@dataclass(frozen=True)
class AttentionMeta:
    """Layout of one forward pass. Sequence i owns tokens q_starts[i] : q_starts[i] + q_lens[i]
    of the flat token batch, and attends to positions 0 : kv_lens[i] of its row in req_to_token
    (its cached prefix followed by its new tokens)."""

    out_slots: torch.Tensor  # [T] KV slot of each new token
    req_to_token: torch.Tensor  # [rows, max_context] slot of each position of each request
    rows: list[int]
    q_starts: list[int]
    q_lens: list[int]
    kv_lens: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.rows)


class AttentionBackend(Protocol):
    """Writes the new K/V of a layer into the pool, then attends over each sequence's context."""

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int, prompt_bf16: bool = False) -> None: ...

    def prepare(self, meta: AttentionMeta) -> None:
        """Build per-forward index tensors once; every layer reuses them."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, d]; k, v: [T, kv_heads, d]. Returns [T, heads * d]."""
