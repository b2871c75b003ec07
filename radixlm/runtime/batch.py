"""The scheduler -> model runner seam: one step's work as plain ints and lists."""

from __future__ import annotations

from dataclasses import dataclass

# A token id that stands for the token a request's previous step drew on the device, which the
# host has not read yet (the overlap schedule): the model runner reads it from its token table
# by the sequence's row.
UNSEEN = -1


@dataclass(frozen=True)
class SeqStep:
    """One sequence's share of a forward step.

    The new tokens sit at positions cached_len .. cached_len + len(token_ids) - 1 and their K/V
    go to `slots`. `prefix_slots`, when given (a request's first step, or its first after being
    retracted), are the slots of positions 0 .. cached_len - 1, which the runner writes into the
    sequence's row of its request->slot table; later steps only append. Logits are returned for
    new tokens logit_start .. end (len(token_ids) asks for none, e.g. a middle prefill chunk).
    A token id may be UNSEEN (a decode past a token still on the device).
    """

    row: int
    cached_len: int
    token_ids: list[int]
    slots: list[int]
    logit_start: int
    prefix_slots: list[int] | None = None

    @property
    def num_logits(self) -> int:
        return len(self.token_ids) - self.logit_start
