"""Few-row linear layers on the GPU: cuBLAS (`F.linear`, and at one row the weight-times-column
form) vs the triton kernels of radixlm/runtime/kernels/gemv.py (`gemv` at one row, `linear_rows`
at 8-64 rows) over a sweep of launch shapes, for the weight shapes of Llama-3-8B. Prints one
table per row count (µs per call, GB/s of weight read) and writes the full sweep as JSON.

    python benchmarks/gemv.py [--out benchmarks/results/gemv.json] [--quick] [--rows 8,32,64]

Each variant is timed as a CUDA graph replaying the call over enough distinct weight copies
(>= 512 MiB) that nothing is served from L2, as in a decode step where every layer's weights
differ; the figure is the per-call median over replays.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu import hbm_copy_gbps  # benchmarks/gpu.py, beside this script

from radixlm.runtime.kernels.gemv import GemvConfig, gemv, linear_rows

SHAPES = {  # name: (N, K) of Llama-3-8B's weights
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
}
SWEEP = {"block_n": (4, 8, 16, 32), "block_k": (256, 512, 1024), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
QUICK = {"block_n": (8, 16), "block_k": (512,), "num_warps": (4,), "num_stages": (2, 3)}
ROWS_SWEEP = {"block_n": (16, 32, 64, 128), "block_k": (64, 128, 256), "num_warps": (4, 8), "num_stages": (3, 5)}


def graph_us(calls: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Median per-call µs of `calls`, captured once, in order, as one CUDA graph (no launch gaps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile, create library handles
        for call in calls[:2]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def graph_time_us(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
                  weights: list[torch.Tensor]) -> float:
    """Median per-call µs of `fn(x, w)` over all `weights`, captured once as a graph."""
    return graph_us([lambda w=w: fn(x, w) for w in weights])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def sweep_shapes(m: int, configs: list[GemvConfig] | list[GemvConfig]) -> tuple[dict[str, object], list[tuple]]:
    """Every weight shape at `m` rows: cuBLAS, and the triton kernel under each launch shape."""
    kernel = gemv if m == 1 else linear_rows
    entries: dict[str, object] = {}
    rows = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-(512 << 20) // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ weights[0].float().T
        gbps = lambda us: nbytes / us / 1e3  # noqa: E731
        entry: dict[str, object] = {"n": n, "k": k, "bytes": nbytes}
        entry["linear_us"] = graph_time_us(lambda a, w: F.linear(a, w), x, weights)
        entry["matvec_us"] = graph_time_us(lambda a, w: (w @ a.view(-1, 1)).view(1, -1), x, weights) if m == 1 else None
        sweep_rows = []
        for cfg in configs:
            try:
                err = rel_err(kernel(x, weights[0], config=cfg), ref)
                us = graph_time_us(lambda a, w, c=cfg: kernel(a, w, config=c), x, weights)
            except Exception as e:  # a launch shape the compiler refuses (too many registers, ...)
                sweep_rows.append({"config": cfg.__dict__, "error": repr(e)[:200]})
                continue
            sweep_rows.append({"config": cfg.__dict__, "us": us, "rel_err": err})
        ok = sorted((r for r in sweep_rows if "us" in r and r["rel_err"] < 1e-2), key=lambda r: r["us"])
        entry["sweep"] = sweep_rows
        entry["best"] = ok[:5]
        entries[name] = entry
        best = ok[0] if ok else {"us": float("nan"), "config": {}, "rel_err": float("nan")}
        mv = entry["matvec_us"] or float("nan")
        rows.append((name, nbytes / 2**20, entry["linear_us"], gbps(entry["linear_us"]), mv, gbps(mv),
                     best["us"], gbps(best["us"]), best["rel_err"], best["config"]))
        del weights
        torch.cuda.empty_cache()
    return entries, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gemv.json")
    ap.add_argument("--quick", action="store_true", help="a few launch shapes only")
    ap.add_argument("--rows", default="", help="also sweep linear_rows at these row counts, e.g. 8,32,64")
    args = ap.parse_args()
    torch.manual_seed(0)
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "copy_gbps": hbm_copy_gbps()}
    tables = {}
    for m in [1] + [int(v) for v in args.rows.split(",") if v]:
        sweep = (QUICK if args.quick else SWEEP) if m == 1 else ROWS_SWEEP
        cls = GemvConfig if m == 1 else GemvConfig
        entries, tables[m] = sweep_shapes(m, [cls(*v) for v in itertools.product(*sweep.values())])
        results["shapes" if m == 1 else f"shapes_rows{m}"] = entries
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{results['gpu']}: copy {results['copy_gbps']:.0f} GB/s (read+write)")
    for m, rows in tables.items():
        kernel = "gemv" if m == 1 else "rows"
        print(f"{m} row(s):\n{'weight':<13}{'MiB':>7}{'linear µs':>11}{'GB/s':>7}{'matvec µs':>11}{'GB/s':>7}"
              f"{kernel + ' µs':>9}{'GB/s':>7}{'err':>9}  config")
        for r in rows:
            print(f"{r[0]:<13}{r[1]:>7.0f}{r[2]:>11.1f}{r[3]:>7.0f}{r[4]:>11.1f}{r[5]:>7.0f}{r[6]:>9.1f}{r[7]:>7.0f}"
                  f"{r[8]:>9.1e}  {r[9]}")


if __name__ == "__main__":
    main()
