"""Attention backends, chosen by name."""

from __future__ import annotations

from radixlm.runtime.kernels.attention.base import AttentionBackend, AttentionMeta
from radixlm.runtime.kernels.attention.torch_backend import TorchAttention

ATTENTION_BACKENDS: dict[str, type] = {"torch": TorchAttention}

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMeta", "TorchAttention"]
