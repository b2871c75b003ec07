"""CUDA graphs of decode steps: one graph per batch-size bucket, replayed over padded inputs.

Each graph reads its inputs from static device buffers (token ids, positions, KV slots,
request rows, context lengths) and writes fp32 logits for every row of its bucket. A batch of
`bs` decode tokens runs the smallest bucket >= bs; the padding rows point at a scratch row of
the request->slot table and write their K/V into the pool's padding slot 0, which the triton
backend never reads unmasked. Graphs share one memory pool and are captured largest first.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from radixlm.runtime.kernels.attention import AttentionBackend
from radixlm.runtime.model.llama import LlamaModel

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_FIELDS = 5  # rows of the static input buffer: ids, positions, slots, request rows, kv lengths


def graph_buckets(max_bs: int) -> tuple[int, ...]:
    """Batch sizes to capture: the standard buckets up to max_bs, and max_bs itself."""
    return tuple(sorted({b for b in _BUCKETS if b < max_bs} | {max_bs}))


@runtime_checkable
class GraphableAttention(AttentionBackend, Protocol):
    """An attention backend CUDA graphs can replay: ``isinstance(backend, GraphableAttention)``."""

    def bind_decode(self, out_slots: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
                    kv_lens: torch.Tensor, tokens: torch.Tensor) -> None:
        """Read a decode-only batch's layout from device buffers, with no host work."""


class DecodeGraphs:
    """Captured decode graphs over static inputs; `run` pads a batch to its bucket and replays."""

    def __init__(self, model: LlamaModel, attention: GraphableAttention, req_to_token: torch.Tensor,
                 scratch_row: int, buckets: Sequence[int]) -> None:
        self.model = model
        self.attention = attention
        self.req_to_token = req_to_token
        self.scratch_row = scratch_row
        self.buckets = tuple(sorted(buckets))
        device = req_to_token.device
        self.inputs = torch.zeros((_FIELDS, self.buckets[-1]), dtype=torch.int64, device=device)
        self.tokens = torch.arange(self.buckets[-1], dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()  # one memory pool for all the graphs
        for bs in reversed(self.buckets):
            self._capture(bs)

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def _padding(self, pad: int) -> list[list[int]]:
        return [[0] * pad, [0] * pad, [0] * pad, [self.scratch_row] * pad, [1] * pad]

    def _forward(self, bs: int) -> torch.Tensor:
        ids, positions, slots, rows, kv_lens = self.inputs[:, :bs]
        self.req_to_token[rows, positions] = slots
        self.attention.bind_decode(slots, self.req_to_token, rows, kv_lens, self.tokens[:bs])
        logits: torch.Tensor = self.model(ids, positions, self.attention, None)
        return logits

    def _capture(self, bs: int) -> None:
        self.inputs[:, :bs].copy_(torch.tensor(self._padding(bs), dtype=torch.int64))
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ untyped
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compile kernels, create library handles
            self._forward(bs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bs)
        self.graphs[bs] = (graph, logits)

    def run(self, ids: list[int], positions: list[int], slots: list[int], rows: list[int],
            kv_lens: list[int], ids_device: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per sequence (len(ids) <= max_bs); fp32 logits [len(ids), vocab],
        valid until the next replay. `ids_device` (int64 [len(ids)] on the GPU) replaces `ids`:
        tokens sampled by a step still in flight."""
        bs = len(ids)
        bucket = self.buckets[bisect_left(self.buckets, bs)]
        pad = self._padding(bucket - bs)
        host = torch.tensor([c + p for c, p in zip((ids, positions, slots, rows, kv_lens), pad)], dtype=torch.int64)
        # pinned and non-blocking: queued behind the step still running, the host does not wait for it
        self.inputs[:, :bucket].copy_(host.pin_memory(), non_blocking=True)
        if ids_device is not None:
            self.inputs[0, :bs].copy_(ids_device)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:bs]
