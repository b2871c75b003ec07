"""Each step's batch description, from rank 0 to the other ranks, as plain int64 tensors.

A message is one fixed-size broadcast over the gloo control group: [kind, payload length, ids
length, payload...], the payload (the steps' ints) inline when it fits (a decode step of up to
~300 sequences), else in a second broadcast; then, when the step's tokens are still on rank 0's
device (the overlap schedule), those ids over the device group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.distributed.group import TPGroup

STEP, STOP = 1, 2
_HEADER = 3
_INLINE = 2048  # payload ints carried in the first broadcast (16 KiB in all)
_FIXED = 6  # per sequence: row, cached_len, tokens, logit_start, slots, prefix slots (-1: None)


def encode_steps(seqs: list[SeqStep]) -> list[int]:
    """The ints of a step: the fixed fields of every sequence, then their lists in order."""
    out: list[int] = [len(seqs)]
    for s in seqs:
        out += [s.row, s.cached_len, len(s.token_ids), s.logit_start, len(s.slots),
                -1 if s.prefix_slots is None else len(s.prefix_slots)]
    for s in seqs:
        out += s.token_ids
        out += s.slots
        if s.prefix_slots is not None:
            out += s.prefix_slots
    return out


def decode_steps(data: list[int]) -> list[SeqStep]:
    """The inverse of `encode_steps`."""
    n = data[0]
    heads = [data[1 + i * _FIXED : 1 + (i + 1) * _FIXED] for i in range(n)]
    pos = 1 + n * _FIXED
    seqs = []
    for row, cached, n_tokens, logit_start, n_slots, n_prefix in heads:
        tokens = data[pos : pos + n_tokens]
        pos += n_tokens
        slots = data[pos : pos + n_slots]
        pos += n_slots
        prefix = None
        if n_prefix >= 0:
            prefix = data[pos : pos + n_prefix]
            pos += n_prefix
        seqs.append(SeqStep(row, cached, tokens, slots, logit_start, prefix))
    if pos != len(data):
        raise ValueError(f"step message of {len(data)} ints holds {pos}")
    return seqs


@dataclass(frozen=True)
class Step:
    """A step as a worker rank receives it; `ids` replaces the token ids when rank 0 had them on the device."""

    seqs: list[SeqStep]
    ids: torch.Tensor | None


class StepChannel:
    """Rank 0 sends each step with `send` (and `stop` at the end); the other ranks `receive`."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group

    def send(self, seqs: list[SeqStep], ids: torch.Tensor | None) -> None:
        payload = encode_steps(seqs)
        n_ids = -1 if ids is None else int(ids.numel())
        first = torch.zeros(_HEADER + _INLINE, dtype=torch.int64)
        first[:_HEADER] = torch.tensor([STEP, len(payload), n_ids])
        if len(payload) <= _INLINE:
            first[_HEADER : _HEADER + len(payload)] = torch.tensor(payload, dtype=torch.int64)
        self.group.broadcast_host(first)
        if len(payload) > _INLINE:
            self.group.broadcast_host(torch.tensor(payload, dtype=torch.int64))
        if ids is not None:
            self.group.broadcast_device(ids.contiguous())

    def stop(self) -> None:
        first = torch.zeros(_HEADER + _INLINE, dtype=torch.int64)
        first[0] = STOP
        self.group.broadcast_host(first)

    def receive(self) -> Step | None:
        """The next step, or None when rank 0 stops."""
        first = torch.empty(_HEADER + _INLINE, dtype=torch.int64)
        self.group.broadcast_host(first)
        kind, size, n_ids = first[:_HEADER].tolist()
        if kind == STOP:
            return None
        if size <= _INLINE:
            payload = first[_HEADER : _HEADER + size]
        else:
            payload = torch.empty(size, dtype=torch.int64)
            self.group.broadcast_host(payload)
        ids = None
        if n_ids >= 0:
            ids = torch.empty(n_ids, dtype=torch.int64, device=self.group.device)
            self.group.broadcast_device(ids)
        return Step(decode_steps(payload.tolist()), ids)
