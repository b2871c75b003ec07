"""CUDA graphs of decode steps: one graph per batch-size bucket, replayed over padded inputs.

A step of few new tokens per sequence (a jump-forward's forced tokens, a short prompt after a
cache hit) runs in the same graphs: each new token becomes a decode row of its own, on its
sequence's row of the request->slot table, attending to the positions up to and including its
own. Every row's K/V is written before any row attends, so the rows of one sequence see each
other exactly as in an extend step (`decode_rows`).

Each graph reads its inputs from static device buffers (token ids, positions, KV slots,
request rows, context lengths) and writes fp32 logits for every row of its bucket. A batch of
`bs` decode tokens runs the smallest bucket >= bs; the padding rows point at a scratch row of
the request->slot table and write their K/V into the pool's padding slot 0, which the triton
backend never reads unmasked. Graphs share one memory pool and are captured largest first.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.kernels.attention import AttentionBackend
from radixlm.runtime.model.llama import LlamaModel

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
_FIELDS = 5  # rows of the static input buffer: ids, positions, slots, request rows, kv lengths
# A sequence extends in the decode graphs up to this many new tokens (one decode row each): each
# row reads its sequence's whole KV, so the rows of a long extend would read it over and over.
GRAPH_EXTEND_TOKENS = 32
# Rows the graphs hold beyond a full batch of decodes (CudaGraphConfig.cuda_graph_max_bs's
# default): room for the tokens of short extends beside them (a jump's forced text, a program's
# next prompt piece), which would otherwise send the whole step eager.
GRAPH_EXTEND_ROWS = 32


@dataclass(frozen=True)
class DecodeRows:
    """A step as decode rows, one per new token (the inputs of `DecodeGraphs.run`), and which
    rows' logits the step returns (None: every row's)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    rows: list[int]
    kv_lens: list[int]
    logit_rows: list[int] | None


def decode_rows(seqs: Sequence[SeqStep], max_rows: int) -> DecodeRows | None:
    """The step as one decode row per new token, or None where the graphs cannot run it: more
    rows than `max_rows`, or a sequence with more than GRAPH_EXTEND_TOKENS new tokens. (A
    sequence's prefix slots, if any, are the caller's to write first.)"""
    if sum(len(s.token_ids) for s in seqs) > max_rows or any(len(s.token_ids) > GRAPH_EXTEND_TOKENS for s in seqs):
        return None
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    logit_rows: list[int] = []
    for s in seqs:
        n = len(s.token_ids)
        logit_rows.extend(range(len(ids) + s.logit_start, len(ids) + n))
        ids.extend(s.token_ids)
        positions.extend(range(s.cached_len, s.cached_len + n))
        slots.extend(s.slots)
        rows.extend([s.row] * n)
    kv_lens = [p + 1 for p in positions]
    return DecodeRows(ids, positions, slots, rows, kv_lens, None if len(logit_rows) == len(ids) else logit_rows)


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

    def run(self, step: DecodeRows, ids_device: torch.Tensor | None = None) -> torch.Tensor:
        """Run the step's decode rows (at most max_bs); fp32 logits [rows, vocab], valid until
        the next replay (all rows' logits, whatever `step.logit_rows` asks for). `ids_device`
        (int64 [rows] on the GPU) replaces `step.ids`: tokens sampled by a step still in flight."""
        bs = len(step.ids)
        bucket = self.buckets[bisect_left(self.buckets, bs)]
        pad = self._padding(bucket - bs)
        fields = (step.ids, step.positions, step.slots, step.rows, step.kv_lens)
        host = torch.tensor([c + p for c, p in zip(fields, pad)], dtype=torch.int64)
        # pinned and non-blocking: queued behind the step still running, the host does not wait for it
        self.inputs[:, :bucket].copy_(host.pin_memory(), non_blocking=True)
        if ids_device is not None:
            self.inputs[0, :bs].copy_(ids_device)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:bs]
