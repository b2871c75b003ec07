"""Which number format the model runs in: the activation dtype per processor and whether the
weights stay quantized. Each choice comes with the reason, logged at start and served by
/get_server_info.

- dtype `auto`: bf16 on CUDA. On a CPU, a 4-bit GGUF model that `--quantization auto` keeps
  quantized runs fp32 activations where the native tiled kernels run: its steps then run on them
  (the fused decode step, the tiled products, the prompt attention), faster than the bf16 path
  even where the processor multiplies bf16 natively (docs/machines.md; docs/benchmarks.md, "One
  number format for every processor"). Otherwise bf16 where the processor multiplies bf16 natively
  (the avx512_bf16 or amx_bf16 flags, `bf16` on Arm), else fp32 (other processors emulate bf16
  matmuls, slower than fp32: docs/machines.md). Without readable CPU flags a tiny matmul is timed
  in both dtypes.
- quantization `auto`: on a CPU in bf16, a GGUF model whose linear weights are 4-bit runs from
  them (int4 at steps of few rows, a dense copy above). In fp32 chosen by `--dtype auto` it runs
  from them where the native kernels run (AVX-512 VNNI or AVX2: 4-bit blocks times int8
  activation blocks): at every step where the tiles run, but for steps of more than
  AMX_DENSE_ABOVE rows (prompts) on a dense bf16 copy where oneDNN multiplies bf16 in AMX tiles
  (faster than the tiles at long prompts: docs/machines.md); without the tiles up to a few rows, an fp16 copy in
  FBGEMM's GEMM above. Any other model in fp32 runs fp16 weights in FBGEMM's fp16 GEMM (half the
  bytes of fp32, fp32 accumulation; torch's int4/int8 kernels have no fast fp32 path) where this
  torch has it. Everything else keeps dense weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from radixlm.runtime.kernels.cpuinfo import CPUINFO, cpuinfo_field

BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
# Where oneDNN multiplies bf16 in AMX tiles, a 4-bit GGUF model in fp32 keeps a dense bf16 copy
# for steps of more rows than this, which prompts run faster on than on the tiles (docs/machines.md);
# the fused decode step takes up to native_ir.BUSY_ROWS rows, so decode batches up to that stay on
# the 4-bit weights.
AMX_DENSE_ABOVE = 32
# Steps of more rows than this use the dense copy under --quantization auto: in decode steps with
# the weights cold in memory, torch's int4 kernel (fewer bytes to read) beats the packed bf16 copy
# up to 4 rows and loses by 16 (docs/machines.md; benchmarks/quant_kernels.py and docs/benchmarks.md).
# With the native VNNI kernels (which take 4 rows a pass) the quantized steps beat the dense copy up
# to 16 rows (docs/machines.md; docs/benchmarks.md, "Native VNNI kernels").
AUTO_DENSE_ABOVE = 4
NATIVE_DENSE_ABOVE = 16
# With fp32 activations (no native bf16) the dense copy is FBGEMM's fp16 GEMM, which the native
# row kernels beat up to 4 rows and lose to from ~8 with the weights cold (docs/machines.md;
# docs/benchmarks.md, "Native kernels without native bf16"). Where the tiled products run (AVX-512
# VNNI, AVX2) there is no dense copy: VNNI's beat FBGEMM's fp16 GEMM at every row count from 5
# ("Tiled products"); AVX2's, set against FBGEMM's fp16 GEMM at a long prompt and at decode batches
# (docs/machines.md; "Tiled products on AVX2"), keep one copy of the weights.
NATIVE_FP32_DENSE_ABOVE = 4


def auto_dense_above(dtype: str = "bfloat16") -> int:
    """Up to how many rows `auto`'s quantized layers multiply their own weights: more with the
    native kernels than with torch's int4 kernel, fewer against FBGEMM's fp16 copy in fp32."""
    from radixlm.runtime.kernels import native

    if not native.available():
        return AUTO_DENSE_ABOVE
    return NATIVE_FP32_DENSE_ABOVE if dtype == "float32" else NATIVE_DENSE_ABOVE


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # a torch dtype name
    reason: str


@dataclass(frozen=True)
class QuantChoice:
    method: str  # "none" or a name in radixlm.runtime.model.quant_linear.QUANT_METHODS
    dense_above: int | None  # steps of more rows multiply a dense copy; None: no copy
    reason: str


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The processor's feature flags (x86 `flags`, Arm `Features`), or None if unreadable."""
    value = cpuinfo_field(("flags", "Features"), cpuinfo)
    return None if value is None else frozenset(value.split())


def bf16_matmul_speedup() -> float:
    """fp32 time / bf16 time of a [64, 576] x [576, 1536] matmul, best of a few runs."""
    import torch

    def best(dtype: torch.dtype) -> float:
        a, b = torch.randn(64, 576).to(dtype), torch.randn(576, 1536).to(dtype)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.float32) / best(torch.bfloat16)


def choose_dtype(requested: str, device: str, flags: frozenset[str] | None,
                 measure: Callable[[], float] = bf16_matmul_speedup, native_four_bit: bool = False) -> DtypeChoice:
    """The activation/weight dtype for `requested` (`auto` or a dtype name) on `device`.
    `native_four_bit`: the model is a 4-bit GGUF that `--quantization auto` keeps quantized, and
    the native tiled kernels run here."""
    if requested != "auto":
        return DtypeChoice(requested, "set by --dtype")
    if device.startswith("cuda"):
        return DtypeChoice("bfloat16", "CUDA: bf16 tensor cores")
    if native_four_bit:
        return DtypeChoice("float32", "the model's 4-bit GGUF weights run on the native kernels (fp32 "
                                      "activations: the fused decode step, the tiled products), faster than "
                                      "the bf16 path, native bf16 or not")
    if flags is not None:
        native = [f for f in BF16_FLAGS if f in flags]
        if native:
            return DtypeChoice("bfloat16", f"the CPU multiplies bf16 natively ({', '.join(native)})")
        return DtypeChoice("float32", "the CPU has no native bf16 (no avx512_bf16/amx_bf16): "
                                      "bf16 matmuls would be emulated, slower than fp32")
    speedup = measure()
    if speedup >= 1.0:
        return DtypeChoice("bfloat16", f"CPU flags unreadable; a bf16 matmul timed {speedup:.2f}x fp32's speed")
    return DtypeChoice("float32", f"CPU flags unreadable; a bf16 matmul timed {speedup:.2f}x fp32's speed")


def choose_attention(requested_dtype: str, dtype: str, device: str, head_dim: int, backend: str) -> DtypeChoice:
    """The numbers the CPU's native prompt attention multiplies q, K, V and its weights in (its
    sums are fp32 either way), where prompts run on it (fp32 activations, head size 64, the torch
    backend, a processor that prefers it: `native.prefill_preferred`): bf16 pairs where `--dtype
    auto` chose fp32 activations and the processor multiplies bf16 natively
    (`native.prefill_bf16_available`): faster than the fp32 form (docs/machines.md), with the
    rounding of GPU attention kernels (docs/engine.md, "Number formats")."""
    from radixlm.runtime.kernels import native

    if device != "cpu" or dtype != "float32" or head_dim != 64 or backend != "torch" or not native.prefill_preferred():
        return DtypeChoice(dtype, "the model's dtype (prompts do not run on the native attention here)")
    if requested_dtype != "auto":
        return DtypeChoice("float32", "set by --dtype")
    if not native.prefill_bf16_available():
        return DtypeChoice("float32", "the processor has no native bf16 products (avx512_bf16)")
    return DtypeChoice("bfloat16", "fp32 activations; the prompt attention multiplies bf16 pairs into fp32 "
                                   "sums on the processor's avx512_bf16 (vdpbf16ps), as GPU attention kernels do")


def native_tiles_run(gguf_four_bit: Callable[[], bool], dense_above: int | None) -> bool:
    """Whether a 4-bit GGUF model's weights, kept quantized, run on the native kernels at every
    step shape (tiled above a few rows): the tiles run here, no --quant-dense-above asks for a
    dense copy, and the GGUF's linear weights are mostly 4-bit (asked last: it may read the file)."""
    from radixlm.runtime.kernels import native

    return dense_above is None and native.tiles_available() and gguf_four_bit()


def choose_quantization(requested: str, device: str, dtype: str, gguf_four_bit: bool,
                        dense_above: int | None = None, auto_dtype: bool = False, amx: bool = False) -> QuantChoice:
    """Whether linear weights stay quantized. `gguf_four_bit`: the model comes from a GGUF whose
    linear weights are mostly Q4_0/Q4_1/Q4_K; `dense_above`: --quant-dense-above, if given;
    `auto_dtype`: --dtype auto chose `dtype` (an fp32 asked for runs dense fp32 weights); `amx`:
    oneDNN multiplies bf16 in AMX tiles here (`dense_linear.amx_packing`)."""
    from radixlm.runtime.kernels import native, native_ir
    from radixlm.runtime.model.quant_linear import QUANT_METHODS, fp16_available

    on_cuda = device.startswith("cuda")
    if requested not in ("auto", "none", *QUANT_METHODS):
        raise ValueError(f"unknown --quantization {requested!r}; choose one of auto, none, "
                         + ", ".join(sorted(QUANT_METHODS)))
    if requested == "none":
        return QuantChoice("none", None, "set by --quantization")
    if requested != "auto":
        if on_cuda:
            raise ValueError(f"--quantization {requested} runs on the CPU only; on CUDA use --quantization none")
        if requested == "fp16" and dtype != "float32":
            raise ValueError(f"--quantization fp16 multiplies fp32 activations; the model runs in {dtype}: "
                             "add --dtype float32")
        return QuantChoice(requested, dense_above, "set by --quantization")
    if on_cuda:
        return QuantChoice("none", None, "CUDA runs dense bf16 weights (its triton kernels)")
    not_four_bit = QuantChoice("none", None, "the model's weights are not 4-bit GGUF blocks")
    kernels = f"the native {native.isa()} kernels" if native.available() else "torch's int4 kernel"
    if dtype == "float32" and auto_dtype and native_tiles_run(lambda: gguf_four_bit, dense_above):
        if amx:
            return QuantChoice("q4", AMX_DENSE_ABOVE, f"the GGUF's 4-bit weights, used as they are for steps of up "
                                                      f"to {AMX_DENSE_ABOVE} rows ({kernels}, fp32 activations, "
                                                      "tiled), a dense bf16 copy in AMX tiles above")
        return QuantChoice("q4", None, f"the GGUF's 4-bit weights, used as they are at every step "
                                       f"({kernels}, fp32 activations; tiled above {native_ir.MAX_ROWS} rows, "
                                       "no dense copy)")
    if dtype == "float32" and auto_dtype and gguf_four_bit and native.available():
        rows = auto_dense_above(dtype) if dense_above is None else dense_above
        copy = "an fp16 copy in FBGEMM's GEMM" if fp16_available() else "a dense fp32 copy"
        return QuantChoice("q4", rows, f"no native bf16: the GGUF's 4-bit weights, used as they are for steps of "
                                       f"up to {rows} rows ({kernels}, fp32 activations), {copy} above")
    if dtype == "float32" and auto_dtype:
        if not fp16_available():
            return QuantChoice("none", None, "fp32 without FBGEMM's fp16 linear (torch's int4/int8 CPU kernels "
                                             "are slow with fp32 activations)")
        return QuantChoice("fp16", dense_above, "no native bf16: fp16 weights in FBGEMM's fp16 GEMM (half the "
                                                "bytes of fp32, fp32 accumulation), faster than a fp32 matmul "
                                                "at every step shape")
    if dtype != "bfloat16":
        return QuantChoice("none", None, f"torch's int4/int8 CPU kernels are slow with {dtype} activations")
    if not gguf_four_bit:
        return not_four_bit
    rows = auto_dense_above() if dense_above is None else dense_above
    return QuantChoice("q4", rows, f"the GGUF's 4-bit weights, used as they are for steps of up to {rows} "
                                   f"rows ({kernels}: 3x fewer bytes read), a dense bf16 copy above")
