"""Weight-only quantized linear layers for the CPU: the weights stay 4 or 8 bits in memory.

At batch 1 a linear layer reads every weight once per token, so its time is the weight bytes
over memory bandwidth: 4-bit weights with a bf16 scale and zero point per 32 (0.625 bytes per
weight, the GGUF Q4_1 size) are read ~3x faster than bf16. The products run in torch's CPU
kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`); benchmarks/quant_kernels.py
measured them against dense bf16 at the default model's shapes (docs/machines.md;
docs/benchmarks.md): faster at one row, but slower from 16 rows up, where the dense matmul is
compute-bound and these kernels are not tuned. So a layer may keep a dense copy of its weights for steps of
more rows than `dense_above` (memory for speed; `None`: no copy, the quantized kernel always).

`fp16` is for processors without native bf16, where the model runs in fp32 and torch's
int4/int8 kernels have no fast path (far slower than a fp32 matmul: docs/machines.md): the
weights are held in fp16 and multiplied by FBGEMM's fp16 GEMM (`quantized::linear_dynamic_fp16`),
which reads half the bytes of fp32 and accumulates in fp32. It beats the fp32 matmul at every step
shape of the default model (docs/machines.md; docs/benchmarks.md), and a row's output moves with
the batch size by ~1e-6, as a fp32 matmul's does.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from radixlm.runtime.kernels import native, native_ir
from radixlm.runtime.kernels.native import BlockProduct
from radixlm.runtime.model.dense_linear import DenseLinear, amx_packing

GROUP = 32  # weights per scale/zero pair in int4 (the GGUF Q4_0/Q4_1 block)


def _groups(weight: torch.Tensor, method: str) -> torch.Tensor:
    """A float [N, K] weight as fp32 groups of 32 along K, [N, K / 32, 32]."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"{method} needs input sizes divisible by {GROUP}; this layer has {k}")
    return weight.float().view(n, k // GROUP, GROUP)


def q4_1_of(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float [N, K] weight as 4-bit groups of 32 between their min and max (as GGUF Q4_1):
    (q [N, K] int32 in 0..15, scale, minimum [N, K / 32]) with w ~ scale * q + minimum."""
    g = _groups(weight, "q4")
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(weight.shape)
    return q, scale, lo


def q8_0_of(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float [N, K] weight as 8-bit groups of 32 (as GGUF Q8_0): (q [N, K] int32 in -127..127,
    scale [N, K / 32]) with w ~ scale * q, scale = max|w| / 127."""
    g = _groups(weight, "8-bit blocks")
    scales = (g.abs().amax(-1) / 127).clamp_min(1e-12)
    q = torch.round(g / scales[..., None]).clamp(-127, 127).to(torch.int32).view(weight.shape)
    return q, scales


def _dequantized(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:
    """The float [N, K] weight of blocks w = scale * q (+ minimum) per group of 32, in `dtype`."""
    w = q.float().view(*scale.shape, GROUP) * scale.float()[..., None]
    if minimum is not None:
        w = w + minimum.float()[..., None]
    return w.view(q.shape).to(dtype)


def _with_dense_copy(layer: WeightOnlyLinear, weight: torch.Tensor, dtype: torch.dtype,
                     keep_dense: bool) -> WeightOnlyLinear:
    """A layer quantized from the float `weight`, given that weight as its dense copy if asked."""
    if keep_dense:
        layer.dense = layer.dense_copy(weight.to(dtype), layer.bias)
    return layer


class WeightOnlyLinear(nn.Module):
    """y = x @ W^T (+ bias) with W held quantized; subclasses define the quantized product."""

    method = ""

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None,
                 dense: torch.Tensor | None, dense_above: int | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # (packed for oneDNN where the processor multiplies bf16: radixlm.runtime.model.dense_linear)
        self.dense: DenseLinear | WeightOnlyLinear | None = None if dense is None else self.dense_copy(dense, bias)
        self.dense_above = dense_above

    def dense_copy(self, weight: torch.Tensor, bias: torch.Tensor | None) -> DenseLinear | WeightOnlyLinear:
        """The layer's dense copy of `weight` (the activations' dtype), which multiplies steps of
        more than `dense_above` rows."""
        return DenseLinear(weight, bias)

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def kernel_rows(self) -> int:
        """Up to how many rows `forward` multiplies with the quantized kernel: `dense_above`, or
        any number without a dense copy."""
        return sys.maxsize if self.dense_above is None else self.dense_above

    def row_product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The quantized product alone, for a [rows, K] input (no bias): what `forward` runs for
        a step of at most `kernel_rows` rows, without its checks, for the CPU loop's decode
        steps (a call saved on each of 120 products a step in the default model). Quantized
        layers never shard over --tp-size, so no all-reduce is skipped."""
        mm = self.quantized_mm
        return lambda x: mm(x.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and x.dim() == 2 and x.shape[0] <= self.kernel_rows:
            return self.quantized_mm(x.contiguous())  # the decode step's case, in fewest ops
        rows = x.reshape(-1, self.in_features)
        if self.dense is not None and rows.shape[0] > self.kernel_rows:
            out: torch.Tensor = self.dense.forward(x)  # (a hot path: without nn.Module's call machinery)
            return out
        y = self.quantized_mm(rows.contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.method}, in={self.in_features}, out={self.out_features}, dense_above={self.dense_above}"


class Int8Linear(WeightOnlyLinear):
    """int8 weights with one scale per output row (symmetric), `_weight_int8pack_mm`."""

    method = "int8"
    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, dense_above: int | None = None) -> None:
        super().__init__(qweight.shape[0], qweight.shape[1], bias, dense, dense_above)
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)

    def row_product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        qweight, scales, mm = self.qweight, self.scales, torch._weight_int8pack_mm
        return lambda x: mm(x.contiguous(), qweight, scales)

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                   keep_dense: bool = False, dense_above: int | None = None) -> Int8Linear:
        """Quantize a float [N, K] weight: per row, scale = max|w| / 127."""
        w = weight.float()
        scales = (w.abs().amax(1) / 127).clamp_min(1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales.to(dtype), _opt(bias, dtype), weight.to(dtype) if keep_dense else None, dense_above)


class Int4Linear(WeightOnlyLinear):
    """4-bit weights in groups of 32 along K, w = (q - 8) * scale + zero, `_weight_int4pack_mm_for_cpu`."""

    method = "q4"
    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype,
                 bias: torch.Tensor | None = None, dense: torch.Tensor | None = None,
                 dense_above: int | None = None) -> None:
        """`q`: [N, K] integers in 0..15; `scales`, `zeros`: [N, K / 32] (the real-valued w for q)."""
        n, k = q.shape
        if k % GROUP or scales.shape != (n, k // GROUP) or zeros.shape != scales.shape:
            raise ValueError(f"int4 weights need K divisible by {GROUP} and one scale/zero per group; "
                             f"got q {tuple(q.shape)}, scales {tuple(scales.shape)}")
        super().__init__(n, k, bias, dense, dense_above)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        # the kernel wants [K / group, N, 2] in the activation dtype
        self.register_buffer("scales_zeros", torch.stack([scales.T, zeros.T], -1).to(dtype).contiguous())

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def row_product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        packed, scales_zeros, mm = self.packed, self.scales_zeros, torch._weight_int4pack_mm_for_cpu
        return lambda x: mm(x.contiguous(), packed, GROUP, scales_zeros)

    @classmethod
    def from_affine(cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None = None, keep_dense: bool = False,
                    dense_above: int | None = None) -> Int4Linear:
        """From w = scale * q + minimum per group (GGUF Q4_1; Q4_0 and Q4_K map onto it)."""
        s, m = scale.float(), minimum.float()
        dense = _dequantized(q, s, m, dtype) if keep_dense else None
        return cls(q, s, m + 8 * s, dtype, _opt(bias, dtype), dense, dense_above)


class Int8BlockLinear(Int4Linear):
    """8-bit weights with one scale per 32 along K, w = scale * q with q in -128..127 (GGUF
    Q8_0), multiplied by the int4 kernel as two 4-bit halves in one call: q = 16 * hi + lo with
    hi = q >> 4 in -8..7 and lo = q & 15, so W x = [W_hi | W_lo] [x, x] where W_hi has scale
    16 * scale and W_lo scale `scale`. The same weights (their scales rounded to bf16) in 1.25
    bytes a weight. Why: torch's int8 kernel is compute-bound on the CPU, and the per-row scale
    it takes loses the blocks' own; for the default model's LM head (49152 x 576, Q8_0) a row runs
    faster this way, with a 5x smaller error against the file's weights (docs/machines.md;
    docs/benchmarks.md)."""

    method = "q8_0"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, dense_above: int | None = None) -> None:
        """`q`: [N, K] integers in -128..127; `scales`: [N, K / 32] (w = scale * q per group)."""
        n, k = q.shape
        if k % GROUP or scales.shape != (n, k // GROUP):
            raise ValueError(f"8-bit block weights need K divisible by {GROUP} and one scale per group; "
                             f"got q {tuple(q.shape)}, scales {tuple(scales.shape)}")
        q, s = q.to(torch.int32), scales.float()
        halves = torch.cat([(q >> 4) + 8, q & 15], 1)  # hi + 8 in 0..15 (as int4 wants), lo in 0..15
        # the int4 form's w = (h - 8) * scale + zero: hi's zero is 0 (16 s (hi + 8 - 8)), lo's 8 s
        super().__init__(halves, torch.cat([16 * s, s], 1), torch.cat([torch.zeros_like(s), 8 * s], 1), dtype,
                         bias, dense, dense_above)
        self.in_features = k

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(torch.cat([x, x], -1), self.packed, GROUP, self.scales_zeros)

    def row_product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        packed, scales_zeros, mm, cat = self.packed, self.scales_zeros, torch._weight_int4pack_mm_for_cpu, torch.cat
        return lambda x: mm(cat([x, x], -1), packed, GROUP, scales_zeros)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                    keep_dense: bool = False, dense_above: int | None = None) -> Int8BlockLinear:
        """From a file's own blocks (GGUF Q8_0): w = scale * q per group of 32, taken as they are."""
        dense = _dequantized(q, scales, None, dtype) if keep_dense else None
        return cls(q, scales, dtype, _opt(bias, dtype), dense, dense_above)


class NativeBlockLinear(WeightOnlyLinear):
    """4- or 8-bit weight blocks (w = scale * u + minimum per 32 along K) multiplied by the
    native kernels (radixlm.runtime.kernels.native) with int8 activation blocks, as llama.cpp
    multiplies at batch 1: the weights read at the memory's speed, where torch's int4 kernel
    converts each to a float. Used in place of `Int4Linear` / `Int8BlockLinear` where the
    processor runs them (`native.available()`: AVX-512 VNNI or AVX2), for bf16 or fp32
    activations. A layer without a dense copy also holds its weights tiled for steps of more than
    4 rows (`native.pack_tiles`; set against FBGEMM's fp16 GEMM in docs/machines.md and
    docs/benchmarks.md), and with fp32 activations also where a dense copy serves only steps of
    more than that. With fp32 activations a dense copy is held as bf16 packed for oneDNN where it
    multiplies bf16 in AMX tiles (`dense_linear.amx_packing`), else as fp16 in FBGEMM's GEMM where
    this torch has it (`Fp16Linear`)."""

    def __init__(self, product: BlockProduct, method: str, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, dense_above: int | None = None) -> None:
        super().__init__(product.n, product.k, bias, dense, dense_above)
        self.product = product
        self.method = method

    def dense_copy(self, weight: torch.Tensor, bias: torch.Tensor | None) -> DenseLinear | WeightOnlyLinear:
        if weight.dtype == torch.float32 and amx_packing():
            return DenseLinear(weight.bfloat16(), bias)
        if weight.dtype == torch.float32 and fp16_available():
            return Fp16Linear(weight, bias)
        return super().dense_copy(weight, bias)

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def row_product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.product

    @classmethod
    def from_affine(cls, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None = None, keep_dense: bool = False,
                    dense_above: int | None = None, tiled: bool | None = None) -> NativeBlockLinear:
        """From w = scale * q + minimum per group, q in 0..15 (GGUF Q4_1; Q4_0 and Q4_K map onto it).
        `tiled`: hold the tiled layout too (None: where no dense copy is kept)."""
        dense = _dequantized(q, scale, minimum, dtype) if keep_dense else None
        product = BlockProduct.affine(q, scale.float(), minimum.float(), bits=4, dtype=dtype,
                                      tiled=_tiled(dtype, keep_dense, dense_above) if tiled is None else tiled)
        return cls(product, "q4", _opt(bias, dtype), dense, dense_above)

    @classmethod
    def from_blocks(cls, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                    keep_dense: bool = False, dense_above: int | None = None,
                    tiled: bool | None = None) -> NativeBlockLinear:
        """From w = scale * q per group, q in -128..127 (GGUF Q8_0): u = q + 128, minimum -128 scale;
        `tiled` as in `from_affine`."""
        s = scale.float()
        dense = _dequantized(q, s, None, dtype) if keep_dense else None
        product = BlockProduct.affine(q.to(torch.int32) + 128, s, -128 * s, bits=8, dtype=dtype,
                                      tiled=_tiled(dtype, keep_dense, dense_above) if tiled is None else tiled)
        return cls(product, "q8_0", _opt(bias, dtype), dense, dense_above)


def _tiled(dtype: torch.dtype, keep_dense: bool, dense_above: int | None) -> bool:
    """Whether a native layer holds its weights tiled too: where no dense copy serves the steps of
    more than MAX_ROWS rows, or (fp32) where the copy serves only steps of more rows than that."""
    more = dense_above is not None and dense_above > native_ir.MAX_ROWS and dtype == torch.float32
    return not keep_dense or more


def uses_native(dtype: torch.dtype, in_features: int) -> bool:
    """Whether block weights for `dtype` activations go to the native kernels (bf16 or fp32, K a
    multiple of their 64-weight chunk, a processor they run on)."""
    return (dtype in (torch.bfloat16, torch.float32) and in_features % native_ir.CHUNK == 0
            and native.available())


def four_bit_linear(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype,
                    bias: torch.Tensor | None = None, keep_dense: bool = False,
                    dense_above: int | None = None, tiled: bool | None = None) -> WeightOnlyLinear:
    """A layer of 4-bit blocks (w = scale * q + minimum, q in 0..15): native kernels where they
    run (tiled for many rows unless a dense copy serves those: `tiled` None), else torch's int4
    kernel."""
    if uses_native(dtype, q.shape[1]):
        return NativeBlockLinear.from_affine(q, scale, minimum, dtype, bias, keep_dense=keep_dense,
                                             dense_above=dense_above, tiled=tiled)
    return Int4Linear.from_affine(q, scale, minimum, dtype, bias, keep_dense=keep_dense, dense_above=dense_above)


def eight_bit_linear(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                     keep_dense: bool = False, dense_above: int | None = None,
                     tiled: bool | None = None) -> WeightOnlyLinear:
    """A layer of 8-bit blocks (w = scale * q, q in -128..127): native kernels where they run
    (tiled as in `four_bit_linear`), else torch's int4 kernel as two halves."""
    if uses_native(dtype, q.shape[1]):
        return NativeBlockLinear.from_blocks(q, scale, dtype, bias, keep_dense=keep_dense, dense_above=dense_above,
                                             tiled=tiled)
    return Int8BlockLinear.from_blocks(q, scale, dtype, bias, keep_dense=keep_dense, dense_above=dense_above)


def q8_from_float(weight: torch.Tensor, dtype: torch.dtype, keep_dense: bool = False,
                  dense_above: int | None = None) -> WeightOnlyLinear:
    """A float [N, K] weight as 8-bit blocks of 32 (as Q8_0), the weight itself as the dense copy."""
    q, scales = q8_0_of(weight)
    layer = eight_bit_linear(q, scales, dtype, dense_above=dense_above, tiled=_tiled(dtype, keep_dense, dense_above))
    return _with_dense_copy(layer, weight, dtype, keep_dense)


def q4_from_float(weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                  keep_dense: bool = False, dense_above: int | None = None) -> WeightOnlyLinear:
    """--quantization q4 of a float [N, K] weight: per group of 32 between its min and max (as
    Q4_1), the weight itself as the dense copy."""
    q, scale, lo = q4_1_of(weight)
    layer = four_bit_linear(q, scale, lo, dtype, bias, dense_above=dense_above, tiled=_tiled(dtype, keep_dense, dense_above))
    return _with_dense_copy(layer, weight, dtype, keep_dense)


@functools.cache
def fp16_available() -> bool:
    """Whether this torch build has FBGEMM's fp16 linear for this processor (x86 with AVX2)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 8), None)
        return bool(torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 8), packed).sum().item() == 64)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


class Fp16Linear(WeightOnlyLinear):
    """fp16 weights, fp32 activations and accumulation: FBGEMM's `linear_dynamic_fp16` on its
    packed copy of the weights (the packed object is the only copy held)."""

    method = "fp16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None, dense_above: int | None = None) -> None:
        super().__init__(weight.shape[0], weight.shape[1], bias, dense, dense_above)
        # (packed from the fp16-rounded weight, so its values are exactly the fp16 ones)
        self.packed: Any = torch.ops.quantized.linear_prepack_fp16(weight.half().float().contiguous(), None)

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        return out

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                   keep_dense: bool = False, dense_above: int | None = None) -> Fp16Linear:
        """From a float [N, K] weight; `dtype` (the activations') must be fp32."""
        if dtype != torch.float32:
            raise ValueError(f"--quantization fp16 runs with fp32 activations (--dtype float32), not {dtype}")
        if not fp16_available():
            raise ValueError("--quantization fp16 needs FBGEMM's fp16 linear (torch on x86 with AVX2), "
                             "which this torch/processor lacks; use --quantization none")
        return cls(weight, _opt(bias, dtype), weight.to(dtype) if keep_dense else None, dense_above)


def _opt(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


# --quantization method -> how a float [N, K] weight becomes a quantized layer
QuantizeFn = Callable[..., WeightOnlyLinear]
QUANT_METHODS: dict[str, QuantizeFn] = {"int8": Int8Linear.from_float, "q4": q4_from_float,
                                         "fp16": Fp16Linear.from_float}
# the methods a GGUF file's own blocks load into (radixlm/runtime/model/gguf_quant.py); others
# are made from the loaded float weights
GGUF_BLOCK_METHODS = ("int8", "q4")
