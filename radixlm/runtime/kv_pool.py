"""The KV pool: one K and one V buffer per layer, indexed by token slot."""

from __future__ import annotations

import torch

from radixlm.runtime.model.arch import ModelArch


class KVPool:
    """K/V storage for `num_slots` token slots plus slot 0, a padding slot never handed out."""

    def __init__(self, arch: ModelArch, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError(f"the KV pool needs at least 1 token slot, got {num_slots}")
        shape = (arch.num_layers, num_slots + 1, arch.num_kv_heads, arch.head_dim)
        # Left uninitialised (zeroing gigabytes costs seconds): attention reads only slots that
        # were written, plus the zeroed padding slot 0 where a padded index points.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, 0].zero_()
        self.v[:, 0].zero_()
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_token(arch: ModelArch, dtype: torch.dtype) -> int:
        return 2 * arch.num_layers * arch.kv_size * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, kv_heads, head_dim]) at `slots` ([T]) of `layer`."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)
