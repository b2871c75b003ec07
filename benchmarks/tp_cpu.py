"""Tensor parallelism on the CPU (gloo): decode tok/s at batch 1 and 8 and prefill tok/s for each
--tp-size next to TP=1 in the same run, and rank 0's host time per step sending the batch
description to the other ranks. On a CPU the ranks share one memory bus and a few cores, so this
measures the overhead of the machinery (step broadcast, gloo all-reduces, logit gather), not a
speed-up; the speed-up is a GPU question (docs/distributed.md).

    python benchmarks/tp_cpu.py --model dummy:llama-tiny --tp 1 2 4 [--out benchmarks/results/tp_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from radixlm.runtime.engine import Engine

PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 32, 48, 512


def _prompts(bs: int, length: int) -> list[list[int]]:
    return [[(1000 + 37 * i + 11 * j) % 40000 + 100 for j in range(length)] for i in range(bs)]


def decode(engine: Engine, bs: int) -> float:
    """Decode tok/s: output tokens after the first, over the time after the slowest first token."""
    p = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    engine.flush_cache()
    t0 = time.perf_counter()
    res = engine.generate(input_ids=_prompts(bs, PROMPT_LEN), sampling_params=p)
    total = time.perf_counter() - t0
    ttft = max(r["meta_info"]["ttft"] for r in res)
    return bs * (NEW_TOKENS - 1) / (total - ttft)


def prefill(engine: Engine) -> float:
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(input_ids=_prompts(1, PREFILL_LEN)[0], sampling_params={"max_new_tokens": 1})
    return PREFILL_LEN / (time.perf_counter() - t0)


def measure(model: str, tp: int, dtype: str, repeats: int) -> dict[str, float]:
    with Engine(model, dtype=dtype, tp_size=tp, max_total_tokens=4096, context_length=1024,
                chunked_prefill_size=PREFILL_LEN) as engine:
        decode(engine, 1)  # warm-up
        leader = engine.core.leader
        sent0, secs0 = (leader.steps_sent, leader.send_seconds) if leader else (0, 0.0)
        out = {
            "decode_bs1_tok_s": max(decode(engine, 1) for _ in range(repeats)),
            "decode_bs8_tok_s": max(decode(engine, 8) for _ in range(repeats)),
            "prefill_tok_s": max(prefill(engine) for _ in range(repeats)),
        }
        if leader is not None:
            out["step_send_us"] = 1e6 * (leader.send_seconds - secs0) / max(leader.steps_sent - sent0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:llama-tiny")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/tp_cpu.json")
    ns = ap.parse_args()
    rows = {}
    for tp in ns.tp:
        rows[tp] = measure(ns.model, tp, ns.dtype, ns.repeats)
        print(f"TP={tp}: " + ", ".join(f"{k} {v:,.1f}" for k, v in rows[tp].items()), flush=True)
    base = rows.get(1)
    if base:
        for tp, row in rows.items():
            ratios = {k: row[k] / base[k] for k in base}
            print(f"TP={tp} / TP=1: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    result = {
        "date": time.strftime("%Y-%m-%d"), "model": ns.model, "dtype": ns.dtype, "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "load_avg_at_end": os.getloadavg(), "by_tp_size": rows,
    }
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
