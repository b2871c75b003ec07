"""Attention backends, chosen by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from radixlm.runtime.kernels.attention.base import AttentionBackend, AttentionMeta
from radixlm.runtime.kernels.attention.torch_backend import TorchAttention

if TYPE_CHECKING:
    from radixlm.runtime.kv_pool import KVPool


def _triton(pool: KVPool, num_heads: int, head_dim: int, prompt_bf16: bool = False) -> AttentionBackend:
    # imported on use: triton is optional, and runs only on CUDA or under TRITON_INTERPRET=1
    from radixlm.runtime.kernels.attention.triton_backend import TritonAttention

    return TritonAttention(pool, num_heads, head_dim)


def _flashinfer(pool: KVPool, num_heads: int, head_dim: int, prompt_bf16: bool = False) -> AttentionBackend:
    # imported on use: flashinfer is optional (CUDA, fp16/bf16); a ValueError says what to install
    from radixlm.runtime.kernels.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(pool, num_heads, head_dim)


# name -> factory(pool, num_heads, head_dim, prompt_bf16): `prompt_bf16` asks the CPU's native prompt
# attention for bf16 products (the GPU backends multiply in the pool's dtype)
ATTENTION_BACKENDS: dict[str, Callable[[KVPool, int, int, bool], AttentionBackend]] = {
    "torch": TorchAttention,
    "triton": _triton,
    "flashinfer": _flashinfer,
}

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMeta", "TorchAttention"]
