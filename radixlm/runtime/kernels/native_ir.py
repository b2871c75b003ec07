"""LLVM IR text of the CPU's native kernels (compiled by radixlm.runtime.kernels.native): one
module an instruction set, assembled here from its parts:

- ir_products.py: the block-quantized products of few activation rows, and the activations'
  quantization (the weights' and activations' layouts are described there);
- ir_tiles.py: the tiled products of many rows;
- ir_decode_attention.py: the decode attention over the host pool;
- ir_prompt_attention.py: the prompt attention, and the K/V layout it reads;
- ir_elementwise.py: RMSNorm, the rotary embedding, SwiGLU, K/V row writes and the fused decode step;
- ir_pieces.py: the op codes, instruction sets and helpers those share.

Each part's `functions` gives the text of its functions (ir_products' and ir_decode_attention's
`entry` the exported function that posts their job); `module_ir` joins them in one fixed order,
so that a module's text, and the compiled-object cache keyed by its hash, stays the same.

A product splits its output rows between the calling thread and `workers` threads that wait in
`worker` (spinning while a forward pass is marked busy, else asleep on a futex: thread_pool.py):
one call per product, no Python between the parts. The structs the kernels read and the exported
functions' signatures are declared once, in native_abi.py; each exported function is made by
ir_builder.py, which checks its SSA names as it is generated.

The constants the kernels' callers size and check their buffers by are reachable here.
"""

from __future__ import annotations

from radixlm.runtime.kernels import (
    ir_decode_attention,
    ir_elementwise,
    ir_products,
    ir_prompt_attention,
    ir_tiles,
    thread_pool,
)
from radixlm.runtime.kernels import native_abi as abi
from radixlm.runtime.kernels.ir_decode_attention import HEAD_DIMS
from radixlm.runtime.kernels.ir_elementwise import LAYER_FIELDS, STEP_FIELDS
from radixlm.runtime.kernels.ir_pieces import (
    _TYPES,
    ACTS,
    ISAS,
    LAYOUT,
    NORM,
    PREFILL,
    PREFILL_BF16,
    PRODUCT,
    QUANTIZE,
    ROTATE,
    SWIGLU,
    TILES,
)
from radixlm.runtime.kernels.ir_products import BUSY_ROWS, CHUNK, CHUNK_BYTES, DESC_FIELDS, MAX_ROWS
from radixlm.runtime.kernels.ir_prompt_attention import PREFILL_ISAS, PREFILL_Q_SCRATCH, PREFILL_ROW_PAD, PREFILL_ROWS
from radixlm.runtime.kernels.ir_tiles import TILE_BYTES, TILE_ISAS, TILE_M, TILE_N

__all__ = ["ACTS", "BUSY_ROWS", "CHUNK", "CHUNK_BYTES", "DESC_FIELDS", "HEAD_DIMS", "ISAS", "LAYER_FIELDS", "MAX_ROWS",
           "PREFILL_ISAS", "PREFILL_Q_SCRATCH", "PREFILL_ROWS", "PREFILL_ROW_PAD", "STEP_FIELDS", "TILE_BYTES",
           "TILE_ISAS", "TILE_M", "TILE_N", "module_ir"]

_DOTS = {"avx512": "declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <16 x i32>, <16 x i32>)\n",
         "avx2": "declare <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8>, <32 x i8>)\n"
                 "declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)\n"}
_HEADER = """
declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)
declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)
declare float @llvm.vector.reduce.fadd.v16f32(float, <16 x float>)
declare <32 x float> @llvm.fabs.v32f32(<32 x float>)
declare float @llvm.vector.reduce.fmax.v32f32(<32 x float>)
declare <32 x float> @llvm.rint.v32f32(<32 x float>)
declare i32 @llvm.vector.reduce.add.v32i32(<32 x i32>)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare float @llvm.maxnum.f32(float, float)
declare float @llvm.floor.f32(float)
declare float @llvm.sqrt.f32(float)
declare <16 x float> @llvm.maxnum.v16f32(<16 x float>, <16 x float>)
declare <16 x float> @llvm.rint.v16f32(<16 x float>)
declare <16 x float> @llvm.fabs.v16f32(<16 x float>)
declare i64 @llvm.umin.i64(i64, i64)
declare i64 @llvm.umax.i64(i64, i64)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)
"""


def module_ir(isa: str = "avx512", omp: bool = False, bf16: bool = False) -> str:
    """The module for processors with `isa` (one of ISAS); `omp`: the tiled products may run on
    the OpenMP pool (GOMP_parallel, omp_get_thread_num and omp_get_num_threads resolve); `bf16`:
    also the bf16 prompt attention (AVX-512 BF16 processors)."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}; choose one of {', '.join(ISAS)}")
    if bf16 and isa != "avx512":
        raise ValueError("the bf16 prompt attention needs the AVX-512 module")
    tiled = isa in TILE_ISAS
    prefill = ir_prompt_attention.functions(isa, bf16) if isa in PREFILL_ISAS else ""
    parts = {PRODUCT: "product", NORM: "rms_norm", ROTATE: "rotate", SWIGLU: "swiglu"}
    if tiled:
        parts |= {TILES: "tiles", QUANTIZE: "quantize"}
    if prefill:
        parts |= {PREFILL: "prefill", LAYOUT: "layout"}
    if bf16:
        parts |= {PREFILL_BF16: "prefill_bf16"}
    return (abi.type_definitions() + _DOTS[isa] + _HEADER + thread_pool.DECLARATIONS + ir_products.functions(isa)
            + ir_decode_attention.functions() + (ir_tiles.functions(isa) if tiled else "")
            + ir_elementwise.functions(tiled) + prefill + ir_products.entry() + ir_decode_attention.entry()
            + thread_pool.module_ir(parts, "attention", omp and tiled, _TYPES))
