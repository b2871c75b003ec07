"""Megatron-style shards of a Llama-family model: which heads, MLP columns and vocabulary rows a rank holds.

Pure arithmetic over the model's sizes (any object with the fields of `ShardableShape`); no
process group is needed, so every rule here is unit-tested in one process."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch


class ShardableShape(Protocol):
    """The sizes a tensor-parallel split depends on (ModelArch has them)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


ShapeT = TypeVar("ShapeT", bound=ShardableShape)


def valid_tp_sizes(arch: ShardableShape, limit: int = 64) -> list[int]:
    """Every tp_size up to `limit` that `check_tp_size` accepts for this model."""
    return [n for n in range(1, limit + 1) if _tp_problem(arch, n) is None]


def _tp_problem(arch: ShardableShape, size: int) -> str | None:
    if arch.num_heads % size:
        return f"it must divide the model's {arch.num_heads} attention heads"
    kv = arch.num_kv_heads
    if kv % size and size % kv:
        return f"it must divide the model's {kv} KV heads or be a multiple of them"
    if arch.intermediate_size % size:
        return f"it must divide the model's MLP size {arch.intermediate_size}"
    return None


def check_tp_size(arch: ShardableShape, size: int) -> None:
    """Raise a one-line ValueError saying which --tp-size values work when `size` does not."""
    problem = _tp_problem(arch, size)
    if problem is not None:
        choices = ", ".join(map(str, valid_tp_sizes(arch)))
        raise ValueError(f"--tp-size {size} does not fit this model: {problem}; use one of {choices}")


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `size` holds. KV heads are split when there are at least as many as
    ranks; otherwise each rank keeps the one KV head its query heads read (replicated)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, arch: ShardableShape, rank: int, size: int) -> ShardPlan:
        check_tp_size(arch, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside [0, {size})")
        return cls(rank, size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size,
                   arch.vocab_size)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(self.num_kv_heads // self.size, 1)

    @property
    def kv_head_start(self) -> int:
        return self.rank * self.num_kv_heads // self.size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        """Vocabulary rows per rank; the last rank's tail past the vocabulary is zero padding."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_shape(self, arch: ShapeT) -> ShapeT:
        """`arch` (a dataclass) with this rank's head, KV head, MLP and vocabulary counts."""
        replaced: ShapeT = dataclasses.replace(
            _as_dataclass(arch), num_heads=self.local_heads, num_kv_heads=self.local_kv_heads,
            head_dim=self.head_dim, intermediate_size=self.local_intermediate, vocab_size=self.vocab_per_rank,
        )
        return replaced

    # -- weights ------------------------------------------------------------------------
    def shard(self, name: str, full: torch.Tensor, part: int | None = None) -> torch.Tensor:
        """This rank's piece of the full tensor `name` (our parameter name). `part` names the
        piece of a fused parameter the tensor is: q/k/v (0/1/2) of qkv_proj, gate/up (0/1) of
        gate_up_proj. Norm weights are whole on every rank."""
        hd = self.head_dim
        if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            if part is None:
                return torch.cat([self.shard(name, p, i) for i, p in enumerate(self._split_qkv(full))])
            if part == 0:
                return full[self.rank * self.local_heads * hd : (self.rank + 1) * self.local_heads * hd]
            start = self.kv_head_start * hd
            return full[start : start + self.local_kv_heads * hd]
        if name.endswith("mlp.gate_up_proj.weight"):
            if part is None:
                return torch.cat([self.shard(name, p, i) for i, p in enumerate(full.chunk(2))])
            return full[self.rank * self.local_intermediate : (self.rank + 1) * self.local_intermediate]
        if name.endswith("self_attn.o_proj.weight"):
            width = self.local_heads * hd
            return full[:, self.rank * width : (self.rank + 1) * width]
        if name.endswith("mlp.down_proj.weight"):
            width = self.local_intermediate
            return full[:, self.rank * width : (self.rank + 1) * width]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            rows = full[self.vocab_start : self.vocab_start + self.vocab_per_rank]
            if rows.shape[0] < self.vocab_per_rank:
                pad = full.new_zeros((self.vocab_per_rank - rows.shape[0], *full.shape[1:]))
                rows = torch.cat([rows, pad])
            return rows
        return full

    def _split_qkv(self, full: torch.Tensor) -> list[torch.Tensor]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return list(torch.split(full, [q, kv, kv]))


def _as_dataclass(obj: Any) -> Any:
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"expected a dataclass instance, got {type(obj).__name__}")
    return obj
