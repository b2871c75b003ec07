"""Token bitmasks as torch tensors: the only torch code of the constrained package.

A bitmask row has ``bitmask_width(vocab_size)`` int32 words; bit ``t % 32`` of word ``t // 32``
is set when token ``t`` is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixlm.runtime.constrained.grammar import bitmask_width

__all__ = ["allocate_bitmask", "apply_bitmask_", "allowed_tokens"]


def allocate_bitmask(n_rows: int, vocab_size: int, pinned: bool = False) -> torch.Tensor:
    """An (n_rows, words) int32 CPU tensor with every token allowed; ``pinned``: in page-locked
    memory, for copies to a CUDA device that do not wait."""
    mask = torch.empty((n_rows, bitmask_width(vocab_size)), dtype=torch.int32, pin_memory=pinned)
    return mask.fill_(-1)


_BIT_TABLES: dict[torch.device, torch.Tensor] = {}


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, vocab_size) bool (little-endian words: byte k of word w holds tokens 32w + 8k ..
    32w + 8k + 7). On the CPU numpy's unpackbits; on a device one table look-up per byte."""
    if bitmask.device.type == "cpu":
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))
    table = _BIT_TABLES.get(bitmask.device)
    if table is None:
        table = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = _BIT_TABLES[bitmask.device] = table.bool().to(bitmask.device)
    octets = bitmask.contiguous().view(torch.uint8).long()
    return table[octets].reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None
) -> None:
    """Set disallowed logits to -inf in place.

    ``bitmask[i]`` applies to logits row ``rows[i]`` (default: row i); other rows are untouched.
    """
    vocab_size = logits.shape[-1]
    assert bitmask.shape[-1] == bitmask_width(vocab_size), (bitmask.shape, vocab_size)
    if rows is None:
        rows = list(range(bitmask.shape[0]))
    assert len(rows) == bitmask.shape[0]
    if not rows:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        _apply_on_host(logits, bitmask, rows)
        return
    allowed = _unpack(_to_device(bitmask, logits.device), vocab_size)
    if list(rows) == list(range(logits.shape[0])):  # every row masked: in place, no gather
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = _to_device(torch.tensor(list(rows), dtype=torch.long), logits.device)
    sub = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
    logits.index_copy_(0, idx, sub)


_NEG_INF_BITS = np.uint32(0xFF800000)  # float32 -inf; 0 is +0.0


def _apply_on_host(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """The CPU path, without a branch per token: each disallowed token's logit gets -inf added
    (built as float32 bit patterns from the unpacked bits), the others +0.0, in numpy's
    single-threaded loops; masked writes (a mispredicted branch per token) and torch's intra-op
    thread pool on a busy machine cost many times that (docs/machines.md)."""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")
    values = logits.detach().numpy()  # shares memory with logits
    vocab_size = values.shape[-1]
    for i, r in enumerate(rows):
        add = np.subtract(1, bits[i, :vocab_size], dtype=np.uint32)
        add *= _NEG_INF_BITS
        np.add(values[r], add.view(np.float32), out=values[r])


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; on CUDA through pinned memory, without waiting for the work
    already queued there (the forward pass whose logits the masks are for)."""
    if device.type != "cuda":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row allows (for tests and debugging)."""
    allowed = _unpack(bitmask_row.reshape(1, -1), vocab_size)[0]
    return allowed.nonzero().flatten().tolist()
