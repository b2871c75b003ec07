"""Launch-shape sweep of the small kernels of a decode step on the GPU (Llama-3-8B layout, bf16):
split-KV decode attention (stage 1 + merge), SiLU(gate)·up and RMSNorm with the residual add,
at the batch sizes the decode benchmark runs. Prints, per kernel and case, the current launch
shape's time and the best few of the sweep; writes everything as JSON.

    python benchmarks/decode_kernels.py [--out benchmarks/results/decode_kernels.json]

Times are per call inside a CUDA graph (no launch gaps), medians over replays. Attention reads
K/V of contiguous slot runs, one per sequence, at shuffled places of a large pool, with L2
overwritten before each call; the element-wise kernels read warm inputs, as after the GEMM that
wrote them.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from gemv import graph_us  # benchmarks/gemv.py, beside this script

from radixlm.runtime.kernels import fused
from radixlm.runtime.kernels.attention import triton_backend as tb

HEADS, KV_HEADS, D, HIDDEN, INTER = 32, 8, 128, 4096, 14336
BATCHES = (1, 8, 64, 128)
CONTEXTS = (256, 1024, 4096)
POOL_SLOTS = 1 << 20
CALLS = 20  # calls per captured graph


_FLUSH: torch.Tensor | None = None


def median_us(fn: Callable[[], Any], cold: bool = False) -> float:
    """GPU µs of one call of `fn`; with `cold`, L2 is overwritten before each call (its cost,
    timed alone, is subtracted), as for K/V that earlier layers evicted."""
    global _FLUSH
    if not cold:
        return graph_us([fn] * CALLS)
    if _FLUSH is None:
        _FLUSH = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    flush = _FLUSH
    return graph_us([lambda: (flush.fill_(1), fn())] * CALLS) - graph_us([lambda: flush.fill_(1)] * CALLS)


def attention_case(bs: int, ctx: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(bs * 7 + ctx)
    starts = torch.randperm(POOL_SLOTS // ctx - 1, generator=gen)[:bs] * ctx + 1
    r2t = (starts[:, None] + torch.arange(ctx)[None, :]).cuda()
    return {"q": torch.randn(bs, HEADS, D, device="cuda", dtype=torch.bfloat16), "r2t": r2t,
            "rows": torch.arange(bs, dtype=torch.int32, device="cuda"),
            "kv_lens": torch.full((bs,), ctx, dtype=torch.int32, device="cuda"),
            "tokens": torch.arange(bs, dtype=torch.int32, device="cuda"), "k": k_cache, "v": v_cache}


def run_attention(c: dict[str, torch.Tensor], splits: int, block_n: int, warps: int, stages: int) -> torch.Tensor:
    q, k, v, r2t = c["q"], c["k"], c["v"], c["r2t"]
    bs = q.shape[0]
    mid_o = torch.empty((bs, HEADS, splits, D), dtype=torch.float32, device="cuda")
    mid_lse = torch.empty((bs, HEADS, splits), dtype=torch.float32, device="cuda")
    out = torch.empty_like(q)
    tb._decode_partial_kernel[(bs, KV_HEADS, splits)](
        q, k, v, mid_o, mid_lse, r2t, c["rows"], c["kv_lens"], c["tokens"],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), r2t.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), D**-0.5 * tb.LOG2E,
        splits, GROUP=HEADS // KV_HEADS, G_PAD=16, D=D, D_PAD=D, BLOCK_N=block_n, PRECISION="tf32",
        num_warps=warps, num_stages=stages,
    )
    tb._decode_merge_kernel[(bs, HEADS)](
        out, mid_o, mid_lse, c["kv_lens"], c["tokens"], out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        splits, D=D, D_PAD=D, BLOCK_N=block_n, num_warps=1,
    )
    return out


def sweep_attention(num_sms: int) -> dict[str, Any]:
    k_cache = torch.randn(POOL_SLOTS, KV_HEADS, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    results: dict[str, Any] = {}
    for bs, ctx in itertools.product(BATCHES, CONTEXTS):
        c = attention_case(bs, ctx, k_cache, v_cache)
        current = tb.decode_splits(bs, KV_HEADS, num_sms)
        ref = run_attention(c, current, tb.DECODE_BLOCK_N, 4, 2).float()
        rows = []
        for splits, block_n, warps, stages in itertools.product((1, 2, 4, 8, 16, 32), (32, 64, 128), (4, 8), (1, 2, 3)):
            if splits * block_n > ctx:
                continue
            try:
                err = (run_attention(c, splits, block_n, warps, stages).float() - ref).abs().max().item()
                us = median_us(lambda: run_attention(c, splits, block_n, warps, stages), cold=True)
            except Exception as e:  # a shape the compiler refuses (shared memory, registers)
                rows.append({"splits": splits, "block_n": block_n, "warps": warps, "stages": stages, "error": repr(e)[:120]})
                continue
            rows.append({"splits": splits, "block_n": block_n, "warps": warps, "stages": stages, "us": us, "err": err})
        kv_bytes = 2 * bs * ctx * KV_HEADS * D * 2
        results[f"bs{bs}_ctx{ctx}"] = _summary(rows, lambda r: (r["splits"], r["block_n"], r["warps"], r["stages"])
                                               == (current, tb.DECODE_BLOCK_N, 4, 2), kv_bytes)
    return results


def sweep_silu_mul() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for t in BATCHES:
        gu = torch.randn(t, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        rows = []
        for block, warps in itertools.product((256, 512, 1024, 2048, 4096), (1, 2, 4, 8)):
            out = torch.empty(t, INTER, device="cuda", dtype=torch.bfloat16)

            def go(block: int = block, warps: int = warps, out: torch.Tensor = out) -> None:
                fused._silu_mul_kernel[(t, triton.cdiv(INTER, block))](gu, out, gu.stride(0), out.stride(0), INTER,
                                                                      BLOCK=block, num_warps=warps)
            rows.append({"block": block, "warps": warps, "us": median_us(go)})
        results[f"rows{t}"] = _summary(rows, lambda r: (r["block"], r["warps"]) == (1024, 4), t * INTER * 6)
    return results


def sweep_rms_norm() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for t in BATCHES:
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        rows = []
        for warps in (1, 2, 4, 8, 16, 32):
            def go(warps: int = warps) -> None:
                fused._rms_norm_kernel[(t,)](x, r, w, y, x.stride(0), r.stride(0), y.stride(0), HIDDEN, 1e-5,
                                             HAS_RESIDUAL=True, BLOCK=HIDDEN, num_warps=warps)
            rows.append({"warps": warps, "us": median_us(go)})
        results[f"rows{t}"] = _summary(rows, lambda r: r["warps"] == 16, t * HIDDEN * 8)
    return results


def _summary(rows: list[dict[str, Any]], is_current: Callable[[dict[str, Any]], bool], nbytes: int) -> dict[str, Any]:
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    current = next((r for r in timed if is_current(r)), None)
    return {"bytes": nbytes, "current": current, "best": timed[:5], "all": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/decode_kernels.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"gpu": torch.cuda.get_device_name(), "silu_mul": sweep_silu_mul(), "rms_norm": sweep_rms_norm(),
           "attention": sweep_attention(num_sms)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(res["gpu"])
    for kernel in ("silu_mul", "rms_norm", "attention"):
        for case, s in res[kernel].items():
            cur = s["current"]
            best = [{k: v for k, v in b.items() if k != "err"} for b in s["best"][:3]]
            gbps = lambda us: s["bytes"] / us / 1e3  # noqa: E731
            print(f"{kernel:<10}{case:<16} now {cur['us'] if cur else float('nan'):8.1f} µs"
                  f" ({gbps(cur['us']) if cur else 0:5.0f} GB/s)  best {best[0]['us']:8.1f} µs ({gbps(best[0]['us']):5.0f} GB/s)"
                  f"  {best}", flush=True)


if __name__ == "__main__":
    main()
