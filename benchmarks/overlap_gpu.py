"""The overlap schedule on one GPU, for comparing two checkouts' step loops side by side.

An 8B-shaped model (dummy weights, bf16, triton attention, CUDA graphs) as `gpu.py` builds it:
greedy decode output tok/s at batch 1, 8 and 64 (input 128, output 256) with the overlap
schedule on and off, sampled at batch 64 (temperature 0.8, top-p 0.95, top-k 50) on and off, and
a 5-field json_schema at batch 1, 16 and 64 (overlap on). Each figure is the best of ``--reps``.

    python benchmarks/overlap_gpu.py --tokenizer $TOK --label after --out after.json

It uses the helpers of the `gpu.py` beside it, so a copy of this file in another checkout's
benchmarks/ measures that checkout (run it with that checkout first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu import SAMPLED, decode_tok_s, engine_for, structured_tok_s  # noqa: E402


def best(reps: int, fn: Any, *args: Any) -> float:
    return max(fn(*args) for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (for detokenizing only)")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = engine_for(args.tokenizer, "radix")
    res: dict[str, Any] = {"label": args.label, "gpu": torch.cuda.get_device_name(), "reps": args.reps}
    for overlap in (True, False):
        engine.core.overlap = overlap
        key = "overlap" if overlap else "plain"
        res[f"decode_{key}"] = {bs: best(args.reps, decode_tok_s, engine, bs) for bs in (1, 8, 64)}
        res[f"decode_sampled_bs64_{key}"] = best(args.reps, decode_tok_s, engine, 64, SAMPLED)
        print(json.dumps({k: v for k, v in res.items() if key in k}), flush=True)
    engine.core.overlap = True
    structured_tok_s(engine, 2, True)  # the grammar compiler's first use
    res["json_schema_overlap"] = {bs: best(args.reps, structured_tok_s, engine, bs, True) for bs in (1, 16, 64)}
    res["free_overlap"] = {bs: best(args.reps, structured_tok_s, engine, bs, False) for bs in (1, 16, 64)}
    res["wall_s"] = time.perf_counter() - t0
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
