"""Sharded layers a Llama-family model builds when tp_size > 1.

Column-parallel layers (fused QKV, gate/up) need no communication: they are plain nn.Linear of
the rank's output columns. The row-parallel layers (O, down) sum their partial outputs with one
all-reduce; the vocabulary-parallel embedding sums the one rank's rows that hold each token;
the LM head's logits are gathered for sampling."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.runtime.distributed.group import TPGroup
from radixlm.runtime.distributed.sharding import ShardPlan


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T): the input's columns are split over the ranks."""

    def __init__(self, local_in: int, out_features: int, group: TPGroup) -> None:
        super().__init__(local_in, out_features, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds rows [start, start + rows) of the (padded) vocabulary; a token's vector
    comes from the one rank that holds it, the others add zeros."""

    def __init__(self, plan: ShardPlan, hidden: int, group: TPGroup) -> None:
        super().__init__(plan.vocab_per_rank, hidden, _weight=torch.empty(plan.vocab_per_rank, hidden))
        self.start = plan.vocab_start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))


def gather_logits(group: TPGroup, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's logits for its vocabulary rows -> [T, vocab_size] (the padding cut off)."""
    return group.gather_last_dim(local)[..., :vocab_size]
