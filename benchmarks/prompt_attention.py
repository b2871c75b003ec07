"""The native prompt attention against torch's flash kernel, per extend shape: time of
`native.prefill_attention` / `F.scaled_dot_product_attention` (with the cached prefix's mask) for
queries over a cached prefix, the default model's heads (9 over 3, head size 64), best of `--reps`
calls each way, interleaved. Below 1 the native kernel is faster; it decides the extends' thresholds
in `torch_backend` (docs/benchmarks.md, "bf16 products in the prompt attention").

    python benchmarks/prompt_attention.py [--bf16] [--queries 16,32,64,128,256] [--prefixes 0,500,1000,2000,4000]

The AVX2 kernels on an AVX-512 processor: RADIXLM_NATIVE_ISA=avx2 ATEN_CPU_CAPABILITY=avx2.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixlm.runtime.kernels import native


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    n, total = q.shape[0], k.shape[0]
    mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          attn_mask=mask, scale=0.125, enable_gqa=True)


def _best_pair(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bf16: bool, reps: int) -> tuple[float, float]:
    """Best ms of the native kernel and of the flash kernel on the same inputs, called in turn."""
    calls: list[Callable[[], object]] = [lambda: native.prefill_attention(q, k, v, 0.125, bf16=bf16),
                                         lambda: _flash(q, k, v)]
    times: list[list[float]] = [[], []]
    for call in calls:
        call()
    for _ in range(reps):
        for call, spent in zip(calls, times):
            t0 = time.perf_counter()
            call()
            spent.append(time.perf_counter() - t0)
    return min(times[0]) * 1e3, min(times[1]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16", action="store_true", help="the bf16 form (avx512_bf16)")
    ap.add_argument("--queries", default="16,32,64,128,256")
    ap.add_argument("--prefixes", default="0,500,1000,2000,4000")
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    prefixes = [int(p) for p in args.prefixes.split(",")]
    print(f"native {'bf16' if args.bf16 else 'fp32'} ({native.isa()}) / flash, ms (best of {args.reps}, interleaved)")
    print("queries \\ cached " + " ".join(f"{p:>18d}" for p in prefixes))
    for n in (int(x) for x in args.queries.split(",")):
        cells = []
        for prefix in prefixes:
            q = torch.randn(n, 15, 64, generator=gen)[:, :9]  # strided, as from the q/k/v projection
            k, v = (torch.randn(prefix + n, 3, 64, generator=gen) for _ in range(2))
            a, b = _best_pair(q, k, v, args.bf16, args.reps)
            cells.append(f"{a:6.2f}/{b:6.2f}={a / b:4.2f}")
        print(f"{n:17d} " + " ".join(f"{c:>18s}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
