"""CPU weight-only linear kernels at the default model's shapes: which one is fastest per shape.

For each weight [N, K] of SmolLM2-135M (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
LM head 49152x576) and M = 1, 16, 64 rows, times y = x @ W^T with:
- bf16 / fp32 dense `F.linear`,
- bf16 dense with the weight packed once for oneDNN (`DenseLinear`, radixlm.runtime.model.dense_linear:
  what a dense bf16 layer and the dense copy of a quantized one run where oneDNN multiplies bf16),
- int8 weight-only, per-channel scales (`torch.ops.aten._weight_int8pack_mm`),
- int4 weight-only, group 32 scales and zero points (`_weight_int4pack_mm_for_cpu` on weights
  packed by `_convert_weight_to_int4pack_for_cpu`; the GGUF Q4_0/Q4_1 layout),
- int8 dequantized to the activation dtype, then `F.linear` (dequant + matmul),
- with fp32 activations, FBGEMM's packed GEMMs: fp16 weights (`quantized::linear_dynamic_fp16`,
  what `--quantization fp16` runs) and int8 weights with the activations quantized to 8 bits per
  call (`quantized::linear_dynamic`; measured, not used: the activations lose precision),
- with `--compile`: the dequant + matmul through `torch.compile` (inductor needs a C++ compiler,
  which pip wheels do not bring, so the runtime never relies on it).

    python benchmarks/quant_kernels.py [--threads 2] [--compile] [--out benchmarks/results/quant_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from radixlm.runtime.model.dense_linear import DenseLinear, packs
from radixlm.runtime.model.quant_linear import fp16_available

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = (1, 16, 64)
GROUP = 32


def _time(fn: Callable[[], torch.Tensor], budget: float = 0.3) -> float:
    """Microseconds per call: the best of many short batches of calls (on a shared, loaded
    machine the median measures the other processes; the minimum measures the kernel)."""
    for _ in range(3):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.05:
        fn()
        n += 1
    reps = max(1, n // 10)
    samples = []
    end = time.perf_counter() + budget
    while time.perf_counter() < end or len(samples) < 10:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps * 1e6)
    return min(samples)


def kernels(n: int, k: int, act: torch.dtype, compile_: bool) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The candidate implementations of x @ W^T for a random [n, k] weight."""
    w = torch.randn(n, k) * 0.02
    dense = w.to(act)
    scale8 = w.abs().amax(1) / 127
    q8 = torch.round(w / scale8[:, None]).clamp(-127, 127).to(torch.int8)
    s8 = scale8.to(act)
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    s4 = ((hi - lo) / 15).clamp_min(1e-8)
    q4 = torch.round((g - lo[..., None]) / s4[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    sz = torch.stack([s4.T, (lo + 8 * s4).T], -1).to(act).contiguous()

    def dequant_mm(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, q8.to(x.dtype) * s8[:, None])

    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "dense": lambda x: F.linear(x, dense),
        "int8pack": lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8),
        "int4pack_g32": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz),
        "int8_dequant_mm": dequant_mm,
    }
    if packs(dense):
        out["dense_packed"] = DenseLinear(dense)
    if act == torch.float32 and fp16_available():  # (FBGEMM: x86 with AVX2)
        fp16 = torch.ops.quantized.linear_prepack_fp16(w, None)
        out["fbgemm_fp16"] = lambda x: torch.ops.quantized.linear_dynamic_fp16(x, fp16)
        qw = torch.quantize_per_channel(w, scale8.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
        w8a8 = torch.ops.quantized.linear_prepack(qw, None)
        out["fbgemm_dynamic_int8"] = lambda x: torch.ops.quantized.linear_dynamic(x, w8a8, True)
    if compile_:
        out["int8_compiled_dequant_mm"] = torch.compile(dequant_mm, dynamic=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--out", default="benchmarks/results/quant_kernels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results: list[dict[str, object]] = []
    with torch.inference_mode():
        for act_name in args.dtypes.split(","):
            act = getattr(torch, act_name)
            for shape, (n, k) in SHAPES.items():
                cands = kernels(n, k, act, args.compile)
                for m in ROWS:
                    x = torch.randn(m, k).to(act)
                    row: dict[str, object] = {"act": act_name, "shape": shape, "n": n, "k": k, "m": m}
                    for name, fn in cands.items():
                        try:
                            row[name] = round(_time(lambda fn=fn, x=x: fn(x)), 1)
                        except Exception as e:  # noqa: BLE001 - a kernel missing on this CPU/dtype is a result
                            row[name] = f"error: {type(e).__name__}"
                    timed = {kk: v for kk, v in row.items() if kk not in ("act", "shape", "n", "k", "m")
                             and isinstance(v, float)}
                    row["fastest"] = min(timed, key=lambda kk: timed[kk])
                    results.append(row)
                    print(json.dumps(row), flush=True)
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), []) if Path("/proc/cpuinfo").exists() else []
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "threads": args.threads, "torch": torch.__version__,
            "cpu_flags": [f for f in flags if f.startswith(("avx", "amx", "fma"))], "unit": "microseconds per call"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
