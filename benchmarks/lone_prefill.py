"""A prompt alone on the server: prefill tok/s in one step (up to max_prefill_tokens, the
scheduler's rule) against cut into chunks of chunked_prefill_size (forced here by
max_prefill_tokens = chunked_prefill_size). Two engines of the same model,
measured in alternation so load on a shared machine falls on both alike; the best and the median
of the repetitions are reported.

    python benchmarks/lone_prefill.py [--model M] [--device cpu|cuda] [--lengths 1024,4096] [--reps 3]
        [--tokenizer DIR] [--out benchmarks/results/lone_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from radixlm.runtime.config import SchedulerConfig
from radixlm.runtime.engine import Engine
from radixlm.runtime.model.source import DEFAULT_MODEL


def prefill_tok_s(engine: Engine, prompt: list[int]) -> float:
    engine.flush_cache()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
    return len(prompt) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (dummy models)")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/lone_prefill.json")
    args = ap.parse_args()
    chunk = SchedulerConfig().chunked_prefill_size
    kw = {"model": args.model, "device": args.device, "tokenizer_path": args.tokenizer}
    engines = {"one step": Engine(**kw), f"chunks of {chunk}": Engine(**kw, max_prefill_tokens=chunk)}
    lengths = [int(x) for x in args.lengths.split(",")]
    vocab = next(iter(engines.values())).core.source.arch.vocab_size

    def prompt_of(n: int) -> list[int]:
        return [(i * 7919) % (vocab - 100) + 50 for i in range(n)]

    runs: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in engines}
    for e in engines.values():  # warm-up at every length
        for n in lengths:
            prefill_tok_s(e, prompt_of(n))
    for _ in range(args.reps):
        for n in lengths:
            for name, e in engines.items():
                runs[name][n].append(prefill_tok_s(e, prompt_of(n)))
    rows = []
    for n in lengths:
        one, cut = runs["one step"][n], runs[f"chunks of {chunk}"][n]
        rows.append({"length": n, "one_step_best": max(one), "chunked_best": max(cut),
                     "one_step_median": statistics.median(one), "chunked_median": statistics.median(cut),
                     "ratio_best": max(one) / max(cut)})
        print(f"prompt {n:5d}: one step {max(one):9.1f} tok/s (median {statistics.median(one):.1f}), "
              f"chunks of {chunk} {max(cut):9.1f} (median {statistics.median(cut):.1f}), "
              f"{max(one) / max(cut):.2f}x", flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"date": str(date.today()), "model": args.model, "device": device,
                                          "torch": torch.__version__, "chunk": chunk, "rows": rows,
                                          "runs": {k: {str(n): v for n, v in r.items()} for k, r in runs.items()}},
                                         indent=2))
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    main()
