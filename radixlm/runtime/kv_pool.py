"""The KV pool: one K and one V buffer per layer, indexed by token slot, and its sizing.

It knows a model only by the sizes below (``ModelArch`` has them), so kernels never import the model."""

from __future__ import annotations

from typing import Protocol

import torch

from radixlm.runtime.kernels import native


class KVShape(Protocol):
    """The sizes of a model's K/V cache."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def kv_size(self) -> int: ...


class ActivationShape(KVShape, Protocol):
    """The sizes that bound a forward pass's activations."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def q_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


class KVPool:
    """K/V storage for `num_slots` token slots plus slot 0, a padding slot never handed out.

    On the host a slot holds its K heads and then its V heads in one row (`kv`, [layers, slots,
    2 * kv_heads, d]; `k` and `v` are views of its halves), so a decode step writes a token's K and
    V in one copy (`write_joined`) and gathers a sequence's in one `index_select`: a batch-1 decode
    step of the default model issues 60 ops fewer (docs/machines.md; docs/benchmarks.md). On CUDA,
    where the kernels take K and V by their own strides, they are two tensors (`kv` None)."""

    def __init__(self, arch: KVShape, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError(f"the KV pool needs at least 1 token slot, got {num_slots}")
        heads = arch.num_kv_heads
        self.kv: torch.Tensor | None = None
        if torch.device(device).type == "cpu":
            self.kv = torch.empty((arch.num_layers, num_slots + 1, 2 * heads, arch.head_dim), dtype=dtype)
            # Host memory is only committed when first written: without this the pool would grow
            # the process's RSS by up to its whole size under load, long after the pool was sized
            # from the memory free at start (which others may have taken by then: an OOM kill
            # mid-load instead of a failure at start). The page faults, slow on a loaded machine, are
            # paid once here instead of inside decode steps (docs/machines.md).
            self.kv.zero_()
            self.k, self.v = self.kv[:, :, :heads], self.kv[:, :, heads:]
        else:  # device memory is committed at allocation; attention reads only written slots
            shape = (arch.num_layers, num_slots + 1, heads, arch.head_dim)
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
            self.k[:, 0].zero_()  # and the padding slot 0, where a padded index points
            self.v[:, 0].zero_()
        self.num_slots = num_slots
        # each layer's K and V as views, indexed once here rather than twice a layer every step
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)
        self.kv_layers = None if self.kv is None else self.kv.unbind(0)
        self.native_writes = self.kv is not None and native.available()  # (write_joined's rows)

    @staticmethod
    def bytes_per_token(arch: KVShape, dtype: torch.dtype) -> int:
        return 2 * arch.num_layers * arch.kv_size * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, kv_heads, head_dim]) at `slots` ([T]) of `layer`."""
        if k.is_cuda:  # one kernel for both instead of two index copies
            from radixlm.runtime.kernels import fused

            fused.store_kv(self.k_layers[layer], self.v_layers[layer], slots, k, v)
            return
        self.k_layers[layer].index_copy_(0, slots, k)
        self.v_layers[layer].index_copy_(0, slots, v)

    def write_joined(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store kv ([T, 2 * kv_heads, head_dim]: each token's K heads, then its V heads) at
        `slots` of `layer` in one copy; the host pool only."""
        assert self.kv_layers is not None, "K and V are joined in the host pool only"
        if self.native_writes and kv.stride(2) == 1 and kv.stride(1) == kv.shape[2] and slots.is_contiguous():
            native.write_rows(self.kv_layers[layer], slots, kv)  # (slots come from the allocator: in range)
            return
        self.kv_layers[layer].index_copy_(0, slots, kv)


def activation_reserve(arch: ActivationShape, dtype: torch.dtype, max_tokens: int, max_logit_rows: int) -> int:
    """Bytes a GPU keeps free beside the KV pool: a forward of `max_tokens` tokens (hidden
    states, q/k/v, the MLP's intermediates), fp32 logits and their sampling copies for
    `max_logit_rows` rows, and CUDA graphs; with 50% slack plus 512 MiB for library workspaces."""
    elt = torch.empty((), dtype=dtype).element_size()
    per_token = (4 * arch.hidden_size + 2 * (arch.q_size + 2 * arch.kv_size) + 4 * arch.intermediate_size) * elt
    logits = 3 * max_logit_rows * arch.vocab_size * 4
    return int(1.5 * (max_tokens * per_token + logits)) + (512 << 20)


def pool_slots(arch: KVShape, dtype: torch.dtype, free_bytes: int, fraction: float, reserve_bytes: int) -> int:
    """KV pool size in tokens: `fraction` of the free memory left after the reserve (>= 256)."""
    usable = max(free_bytes - reserve_bytes, 0)
    return max(int(usable * fraction) // KVPool.bytes_per_token(arch, dtype), 256)

