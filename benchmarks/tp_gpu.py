"""Tensor parallelism on two GPUs: one JSON from one run on `nvidia-h200-x2`.

- correctness: dummy:llama-3.2-1b in fp32, TP=2 greedy tokens == TP=1 (8 prompts x 32 tokens),
  and dummy:llama-3-8b in bf16, the share of TP=2's greedy tokens equal to TP=1's;
- dummy:llama-3-8b, TP=1 (one GPU) vs TP=2: decode tok/s at batch 1 and 64, prefill tok/s at 4k;
- a Llama-3-70B-shaped dummy model (dummy:llama-3-70b, 141 GB in bf16: only TP=2 loads) at
  batch 1, 16 and 64 and prefill 4k, with the bs1 roofline of two GPUs (half the weight bytes per
  GPU over each GPU's measured copy bandwidth);
- the NCCL all-reduce of one layer's [bs, hidden] bf16 activations, eager, timed in two ranks,
  and its share of the step (two per layer).

    python benchmarks/tp_gpu.py --tokenizer DIR [--out benchmarks/results/tp_gpu.json] [--skip-70b | --only-70b]

First run 2026-11-26 on two H200s (docs/benchmarks.md, "Tensor parallelism", "Two GPUs").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixlm.runtime.engine import Engine
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.source import DUMMY_CONFIGS

IN_LEN, OUT_LEN, PREFILL = 128, 128, 4096


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return torch.randint(1000, 120000, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_tok_s(engine: Engine, bs: int) -> float:
    engine.flush_cache()
    t0 = time.perf_counter()
    res = engine.generate(input_ids=prompts(bs, IN_LEN, bs),
                          sampling_params={"temperature": 0, "max_new_tokens": OUT_LEN, "ignore_eos": True})
    total = time.perf_counter() - t0
    return bs * (OUT_LEN - 1) / (total - max(r["meta_info"]["ttft"] for r in res))


def prefill_tok_s(engine: Engine, repeats: int = 3) -> float:
    best = 0.0
    for r in range(repeats):
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(input_ids=prompts(1, PREFILL, PREFILL + r)[0], sampling_params={"max_new_tokens": 1})
        best = max(best, PREFILL / (time.perf_counter() - t0))
    return best


def greedy(engine: Engine) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts(8, 64, 7), sampling_params={"temperature": 0, "max_new_tokens": 32,
                                                                          "ignore_eos": True})
    return [o["output_ids"] for o in outs]


def engine(model: str, tp: int, tokenizer: str, dtype: str = "bfloat16") -> Engine:
    return Engine(model, device="cuda", dtype=dtype, tp_size=tp, tokenizer_path=tokenizer,
                  chunked_prefill_size=PREFILL, max_prefill_tokens=PREFILL, max_running_requests=64)


def done(e: Engine) -> None:
    e.shutdown()
    del e
    gc.collect()
    torch.cuda.empty_cache()


def hbm_gbps() -> float:
    """One GPU's device-to-device copy bandwidth (read + write), median of 20."""
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() * 2 / statistics.median(times) / 1e9


def weight_bytes(arch: ModelArch) -> int:
    """Bytes a decode step reads: every weight but the embedding table (one row), bf16."""
    h, layers = arch.hidden_size, arch.num_layers
    per_layer = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + 3 * h * arch.intermediate_size + 2 * h
    return 2 * (layers * per_layer + h + arch.vocab_size * h)


def _allreduce_rank(rank: int, init: str, hidden: int, sizes: list[int], out: Any) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
    res = {}
    for bs in sizes:
        x = torch.randn(bs, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        res[bs] = (time.perf_counter() - t0) / 200 * 1e6
    if rank == 0:
        out.update(res)
    dist.destroy_process_group()


def allreduce_us(hidden: int, sizes: list[int]) -> dict[int, float]:
    path = f"/tmp/radixlm-ar-{os.getpid()}"
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_allreduce_rank, args=(f"file://{path}", hidden, sizes, out), nprocs=2)
        return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default="benchmarks/results/tp_gpu.json")
    ap.add_argument("--skip-70b", action="store_true")
    ap.add_argument("--only-70b", action="store_true", help="skip the 1B/8B rows (a second call on the same machine)")
    ns = ap.parse_args()
    r: dict[str, Any] = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                         "torch": torch.__version__, "hbm_copy_gbps": hbm_gbps()}
    print(r, flush=True)

    runs: dict[str, list[list[int]]] = {}
    for tp in () if ns.only_70b else (1, 2):  # exact: fp32
        e = engine("dummy:llama-3.2-1b", tp, ns.tokenizer, "float32")
        runs[f"fp32_tp{tp}"] = greedy(e)
        done(e)
    for tp in () if ns.only_70b else (1, 2):
        e = engine("dummy:llama-3-8b", tp, ns.tokenizer)
        runs[f"tp{tp}"] = greedy(e)
        r[f"8b_tp{tp}"] = {"decode_bs1": decode_tok_s(e, 1), "decode_bs64": decode_tok_s(e, 64),
                           "prefill_4k": prefill_tok_s(e)}
        print(f"8B TP={tp}", r[f"8b_tp{tp}"], flush=True)
        done(e)
    if not ns.only_70b:
        r["fp32_1b_tp2_greedy_equal"] = runs["fp32_tp1"] == runs["fp32_tp2"]
        pairs = [(a, b) for x, y in zip(runs["tp1"], runs["tp2"]) for a, b in zip(x, y)]
        r["bf16_8b_tp2_tokens_equal_share"] = sum(a == b for a, b in pairs) / len(pairs)
        r["8b_tp2_over_tp1"] = {k: r["8b_tp2"][k] / r["8b_tp1"][k] for k in r["8b_tp1"]}
        print("8B TP=2 / TP=1", r["8b_tp2_over_tp1"], "fp32 equal", r["fp32_1b_tp2_greedy_equal"], flush=True)

    arch70 = ModelArch.from_hf_config(DUMMY_CONFIGS["llama-3-70b"])
    r["allreduce_us_by_bs"] = allreduce_us(arch70.hidden_size, [1, 16, 64, PREFILL])
    if not ns.skip_70b:
        e = engine("dummy:llama-3-70b", 2, ns.tokenizer)
        row = {f"decode_bs{bs}": decode_tok_s(e, bs) for bs in (1, 16, 64)}
        row["prefill_4k"] = prefill_tok_s(e)
        done(e)
        roof = 2 * r["hbm_copy_gbps"] * 1e9 / weight_bytes(arch70)  # two GPUs, each reading half
        row["roofline_bs1"], row["bs1_of_roofline"] = roof, row["decode_bs1"] / roof
        for bs in (1, 16, 64):  # two all-reduces per layer in a step of bs tokens
            step_us = 1e6 * bs / row[f"decode_bs{bs}"]
            row[f"allreduce_share_bs{bs}"] = 2 * arch70.num_layers * r["allreduce_us_by_bs"][bs] / step_us
        r["70b_tp2"] = row
        print("70B TP=2", row, flush=True)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
