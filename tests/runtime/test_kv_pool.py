"""The KV pool on the host: its memory is resident from construction, so a server's RSS does not
grow by up to the pool's size under load (docs/reliability.md, "Failures found and fixed")."""

from __future__ import annotations

import ctypes
import os

import torch

from radixlm.runtime.kv_pool import KVPool
from radixlm.runtime.model.arch import ModelArch

ARCH = ModelArch(family="llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                 tie_word_embeddings=False, attention_bias=False)


def _resident_fraction(t: torch.Tensor) -> float:
    """Share of the tensor's memory pages that are in RAM (mincore(2))."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.nbytes - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in bytes(vec)) / pages


def test_cpu_pool_is_resident_from_construction():
    pool = KVPool(ARCH, 64 * 1024, torch.float32, "cpu")  # 2 x 134 MB: fresh pages
    assert pool.k.nbytes + pool.v.nbytes == KVPool.bytes_per_token(ARCH, torch.float32) * (64 * 1024 + 1)
    assert pool.kv is not None and pool.kv.nbytes == pool.k.nbytes + pool.v.nbytes  # K and V share rows
    assert _resident_fraction(pool.kv) == 1.0
    assert not pool.k.any() and not pool.v.any()  # zeroed, padding slot 0 included
