"""The KV pool on the host: its memory is resident from construction, so a server's RSS does not
grow by up to the pool's size under load (docs/reliability.md, "Failures found and fixed")."""

from __future__ import annotations

import torch

from radixlm.runtime.kv_pool import KVPool
from radixlm.runtime.model.arch import ModelArch

ARCH = ModelArch(family="llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                 tie_word_embeddings=False, attention_bias=False)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_cpu_pool_is_resident_from_construction():
    before = _rss_bytes()
    pool = KVPool(ARCH, 64 * 1024, torch.float32, "cpu")  # 2 x 134 MB: fresh pages, not reused heap
    grown = _rss_bytes() - before
    size = pool.k.nbytes + pool.v.nbytes
    assert size == KVPool.bytes_per_token(ARCH, torch.float32) * (64 * 1024 + 1)
    assert grown >= 0.9 * size, f"only {grown >> 20} of {size >> 20} MiB resident"
    assert not pool.k.any() and not pool.v.any()  # zeroed, padding slot 0 included
