"""Each step's batch description, from rank 0 to the other ranks, as plain int64 tensors.

A message is a fixed header [kind, payload length, ids length] broadcast over the gloo control
group, then the payload (the steps' ints), then, when the step's tokens are still on rank 0's
device (the overlap schedule), those ids over the device group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.distributed.group import TPGroup

STEP, STOP = 1, 2
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
        payload = torch.tensor(encode_steps(seqs), dtype=torch.int64)
        n_ids = -1 if ids is None else int(ids.numel())
        self.group.broadcast_host(torch.tensor([STEP, payload.numel(), n_ids], dtype=torch.int64))
        self.group.broadcast_host(payload)
        if ids is not None:
            self.group.broadcast_device(ids.contiguous())

    def stop(self) -> None:
        self.group.broadcast_host(torch.tensor([STOP, 0, -1], dtype=torch.int64))

    def receive(self) -> Step | None:
        """The next step, or None when rank 0 stops."""
        header = torch.empty(3, dtype=torch.int64)
        self.group.broadcast_host(header)
        kind, size, n_ids = header.tolist()
        if kind == STOP:
            return None
        payload = torch.empty(size, dtype=torch.int64)
        self.group.broadcast_host(payload)
        ids = None
        if n_ids >= 0:
            ids = torch.empty(n_ids, dtype=torch.int64, device=self.group.device)
            self.group.broadcast_device(ids)
        return Step(decode_steps(payload.tolist()), ids)
