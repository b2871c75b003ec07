"""ModelRunner: the only owner of tensors. Runs a model forward over one step's ragged batch."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from radixlm.runtime.batch import UNSEEN, SeqStep
from radixlm.runtime.cuda_graph import DecodeGraphs, GraphableAttention, decode_rows
from radixlm.runtime.distributed.group import RankFailure
from radixlm.runtime.distributed.launch import Leader
from radixlm.runtime.kernels.attention import ATTENTION_BACKENDS, AttentionMeta
from radixlm.runtime.kv_pool import KVPool
from radixlm.runtime.model.llama import LlamaModel


class ModelRunner:
    """Holds the model, the KV pool and the request->slot table on the device."""

    def __init__(
        self,
        model: LlamaModel,
        num_slots: int,
        max_requests: int,
        max_context: int,
        attention_backend: str = "torch",
        graph_buckets: Sequence[int] = (),
        prompt_bf16: bool = False,
    ) -> None:
        """`graph_buckets`: decode batch sizes to capture as CUDA graphs (CUDA and a backend with
        `bind_decode` only; empty: always eager); `prompt_bf16`: the CPU's native prompt attention
        multiplies in bf16 (`formats.choose_attention`)."""
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}; choose one of {sorted(ATTENTION_BACKENDS)}")
        self.model = model
        self.arch = model.shard  # this rank's heads and KV heads under tensor parallelism
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        if attention_backend == "triton" and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention backend needs a CUDA device; use --attention-backend torch")
        self.pool = KVPool(self.arch, num_slots, self.dtype, self.device)
        self.max_context = max_context
        # one row per running request, plus a scratch row for the padding rows of graph batches
        self.req_to_token = torch.zeros((max_requests + 1, max_context), dtype=torch.int64, device=self.device)
        # the token each request row's last step drew (keep_tokens): a step's UNSEEN token ids read it
        self.last_tokens = torch.zeros(max_requests + 1, dtype=torch.int64, device=self.device)
        self.attention = ATTENTION_BACKENDS[attention_backend](self.pool, self.arch.num_heads, self.arch.head_dim,
                                                               prompt_bf16)
        self.leader: Leader | None = None  # set on rank 0 of a tensor-parallel engine
        self.graphs: DecodeGraphs | None = None
        self.graph_steps = 0  # steps run as a CUDA graph (the others run eager)
        if graph_buckets and self.device.type == "cuda" and isinstance(self.attention, GraphableAttention):
            self.graphs = DecodeGraphs(model, self.attention, self.req_to_token, max_requests, graph_buckets)

    def forward(self, seqs: list[SeqStep], ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; return fp32 logits [sum(seq.num_logits), vocab] in sequence order.
        An UNSEEN token id is read from the token table by its sequence's row. `ids` (a worker rank
        under tensor parallelism: what rank 0 sent) is the step's tokens on the device, in order,
        in place of the seqs' token ids. Under tensor parallelism rank 0 sends the step to the
        other ranks first; every rank runs it."""
        for s in seqs:
            if s.cached_len + len(s.token_ids) > self.max_context:
                raise ValueError(f"sequence of {s.cached_len + len(s.token_ids)} tokens exceeds the context length "
                                 f"{self.max_context}")
        if ids is None:
            ids = self._device_ids(seqs)
        if self.leader is None:
            return self._forward(seqs, ids)
        self.leader.send(seqs, ids)
        try:
            return self._forward(seqs, ids)
        except Exception as e:  # the ranks may be out of step now: only a restart recovers
            self.leader.workers.check()  # a dead rank is the likelier cause: name it
            raise RankFailure(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e

    def _forward(self, seqs: list[SeqStep], ids: torch.Tensor | None) -> torch.Tensor:
        self._write_prefixes(seqs)
        graphs = self.graphs
        step = None if graphs is None else decode_rows(seqs, graphs.max_bs)
        if graphs is not None and step is not None:
            self.graph_steps += 1
            rows_out = graphs.run(step, ids)
            return rows_out if step.logit_rows is None else rows_out[self.to_device(step.logit_rows)]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        q_starts, q_lens, kv_lens, rows, token_rows = [], [], [], [], []
        for s in seqs:
            n = len(s.token_ids)
            end = s.cached_len + n
            q_starts.append(len(tokens))
            logit_rows.extend(range(len(tokens) + s.logit_start, len(tokens) + n))
            tokens.extend(s.token_ids)
            positions.extend(range(s.cached_len, end))
            token_rows.extend([s.row] * n)
            slots.extend(s.slots)
            q_lens.append(n)
            kv_lens.append(end)
            rows.append(s.row)
        # host lists reach the device through pinned, non-blocking copies: the host never waits here
        # for the step still running
        slot_t = self.to_device(slots)
        pos_t = self.to_device(positions)
        self.req_to_token[self.to_device(token_rows), pos_t] = slot_t
        meta = AttentionMeta(slot_t, self.req_to_token, rows, q_starts, q_lens, kv_lens)
        self.attention.prepare(meta)
        logits: torch.Tensor = self.model(
            ids if ids is not None else self.to_device(tokens),
            pos_t,
            self.attention,
            None if len(logit_rows) == len(tokens) else self.to_device(logit_rows),  # (a decode step: every row)
        )
        return logits

    def keep_tokens(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Remember the tokens a step drew (on the device) for these request rows: the next step
        can feed them before the host has read them."""
        self.last_tokens[self.to_device(rows)] = tokens

    def _device_ids(self, seqs: list[SeqStep]) -> torch.Tensor | None:
        """The step's token ids on the device when some are UNSEEN (read from the token table);
        None when the host has them all."""
        at: list[int] = []
        rows: list[int] = []
        tokens: list[int] = []
        for s in seqs:
            for t in s.token_ids:
                if t == UNSEEN:
                    at.append(len(tokens))
                    rows.append(s.row)
                tokens.append(t)
        if not at:
            return None
        unseen = self.last_tokens[self.to_device(rows)]
        if len(at) == len(tokens):  # (a step of decodes only)
            return unseen
        ids = self.to_device([max(t, 0) for t in tokens])
        ids[self.to_device(at)] = unseen
        return ids

    def _write_prefixes(self, seqs: list[SeqStep]) -> None:
        """The request->slot rows of sequences that start here (SeqStep.prefix_slots)."""
        for s in seqs:
            if s.prefix_slots is not None:
                assert len(s.prefix_slots) == s.cached_len
                if s.prefix_slots:
                    self.req_to_token[s.row, : s.cached_len] = self.to_device(s.prefix_slots)

    def to_device(self, values: list[int]) -> torch.Tensor:
        """An int64 tensor of host values on the device, copied without waiting for queued work."""
        t = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def fetch_ids(self, ids: torch.Tensor) -> Callable[[], list[int]]:
        """Start copying int64 ids to the host; the returned call waits for them. On CUDA the
        copy is queued now, so work queued after it does not delay it."""
        if ids.device.type != "cuda":
            host = ids.tolist()
            return lambda: host
        buf = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        buf.copy_(ids, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()

        def wait() -> list[int]:
            done.synchronize()
            return buf.tolist()

        return wait
