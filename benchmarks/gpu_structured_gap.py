"""Where a bs64 json_schema generate loses to free text on the GPU: three runs of each after
two warm-up rounds, then one of each under the torch profiler (wall time vs GPU kernel time;
the difference is the GPU waiting on the host).

    python3 benchmarks/gpu_structured_gap.py --tokenizer .gpu_assets/tokenizer [--grammar-backend llguidance]
"""

from __future__ import annotations

import argparse
import time

import torch
from gpu import engine_for, structured_tok_s
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--grammar-backend", default="llguidance")
    args = ap.parse_args()
    engine = engine_for(args.tokenizer, "radix", args.grammar_backend)
    structured_tok_s(engine, 2, True)
    for _ in range(2):
        print(f"warm json {structured_tok_s(engine, 64, True):.0f} free {structured_tok_s(engine, 64, False):.0f}")
    for constrained in (True, False):
        name = "json" if constrained else "free"
        print(name, " ".join(f"{structured_tok_s(engine, 64, constrained):.0f}" for _ in range(3)), flush=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            rate = structured_tok_s(engine, 64, constrained)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        ka = prof.key_averages()
        gpu = sum(k.self_device_time_total for k in ka) / 1e6
        print(f"{name}: {rate:.0f} tok/s under the profiler, wall {wall:.3f} s, GPU kernels {gpu:.3f} s")
        print(ka.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=50))
    engine.shutdown()


if __name__ == "__main__":
    main()
