"""LLVM IR text of the CPU's block-quantized products (compiled by radixlm.runtime.kernels.native).

The weights are blocks of 32 along K, w = d * u + m with u an unsigned 4- or 8-bit integer (GGUF
Q4_1 as it is; Q4_0 and Q8_0 with m = -8 d and -128 d). The activations are quantized the same
way llama.cpp does at batch 1, to int8 per block of 32 (a = da * qa), so a block's product is
one integer dot product of unsigned bytes times signed bytes: AVX-512 VNNI's `vpdpbusd`, or on a
processor with AVX2 alone `vpmaddubsw` + `vpmaddwd` for 4-bit weights (a pair's sum stays within
16 bits) and bytes widened to 16 bits + `vpmaddwd` for 8-bit ones (the same integer sums):

    sum_i w_i a_i = d da sum_i u_i qa_i + m (da sum_i qa_i)

A weight row is stored as chunks of 64 weights (two blocks) followed by the chunk's scales as
four fp16 [d0, d1, m0, m1]: 4-bit chunks hold block 0 in the low nibbles and block 1 in the high
ones (40 bytes), 8-bit chunks the 64 bytes as they are (72 bytes). The activations' scales come
per chunk as four fp32 [da0, da1, sa0, sa1] with sa = da * sum qa, so the chunk's scale products
are one 4-wide multiply. The activations are bf16 or fp32 (the model's dtype), and the products
write the same dtype.

A product splits its output rows between the calling thread and `workers` threads that wait in
`worker` (spinning while a forward pass is marked busy, else asleep on a futex: thread_pool.py):
one call per product, no Python between the parts. The structs the kernels read and the exported
functions' signatures are declared once, in native_abi.py; each exported function is made by
ir_builder.py, which checks its SSA names as it is generated.
"""

from __future__ import annotations

import math
import struct

from radixlm.runtime.kernels import native_abi as abi
from radixlm.runtime.kernels import thread_pool
from radixlm.runtime.kernels.ir_builder import FunctionBuilder

CHUNK = 64  # weights per chunk (two blocks of 32)
MAX_ROWS = 4  # activation rows one call multiplies (each weight chunk read once for all)
BUSY_ROWS = 32  # steps of up to this many rows on the kernels run as one busy stretch (native.busy)
CHUNK_BYTES = {4: 40, 8: 72}
# a chunk's loads prefetch the weights this many bytes (times the rows an iteration) ahead: on a
# 2-core Ice Lake the default model's 121 products of a bs1 step took 12.0 instead of 16.5 ms
# with 2048 (1024-8192 alike), the hardware prefetcher alone not keeping up with short rows
PREFETCH = 2048

# the tiled products of many rows (AVX-512 VNNI only): TILE_N output rows by TILE_M activation rows
# at a time, the weights stored tile by tile (per block of 32 along K: TILE_N rows' integers laid
# out for `vpdpbusd` with one activation broadcast, then their fp16 scales and minimums)
TILE_N, TILE_M = 16, 8
TILE_BYTES = {4: TILE_N * 32 // 2 + 4 * TILE_N, 8: TILE_N * 32 + 4 * TILE_N}
TILE_ISAS = ("avx512", "avx2")
# the native prompt attention: on AVX2 (16 vector registers) it measured slower than torch's flash
# kernel (1,000 queries: 23.7 against 15.1 ms, on an Ice Lake running the AVX2 code)
PREFILL_ISAS = ("avx512", "avx2")
# bytes of int8 activations a stretch of rows takes: a thread's L2 keeps them; on AVX2, whose
# tiles read them twice (a pass per half tile), its L1
TILE_CACHE = {"avx512": 196_608, "avx2": 24_576}
# passes of a tile's block loop, each over TILE_N / passes output rows: AVX2's 16 vector registers
# hold the sums of half a tile
TILE_HALVES = {"avx512": 1, "avx2": 2}
# groups of a tile's TILE_M activation rows, a pass each (times the halves): on AVX2 a pass over
# all eight rows keeps their eight sums and the block's eight weight quads in registers and spills
# the rest (48 stack moves a block, both halves, against 28 in groups of four rows; 6-10% faster
# from 512 rows)
TILE_GROUPS = {"avx512": 1, "avx2": 2}

# the ops of the posted jobs (the control block's job area: native_abi.CONTROL; each op's job struct there)
PRODUCT, ATTENTION, TILES, QUANTIZE, NORM, PREFILL, ROTATE, SWIGLU, PREFILL_BF16, LAYOUT = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9
NORM_ALONE = 16  # an RMSNorm of fewer rows runs on the calling thread alone
ROTATE_ALONE = 64  # a rotation of fewer (token, head) rows runs on the calling thread alone
SWIGLU_ALONE = 8  # a SwiGLU of fewer rows runs on the calling thread alone
DESC_FIELDS = abi.DESCRIPTOR.names  # a matrix's descriptor (int64s)
ISAS = ("avx512", "avx2")  # the instruction sets the products are written for
ACTS = ("bf16", "f32")  # the activation dtypes they take and write
HEAD_DIMS = (64, 128)  # the head sizes the decode attention is compiled for
_TYPES = frozenset(s.ir_name for s in abi.STRUCTS)  # the struct types' names, for the builder's checks


def _exported(function: abi.Function, body: str) -> str:
    """An exported function: its `define` line from its declaration (native_abi), then `body`
    (from its first label to its last instruction), its SSA names checked (ir_builder)."""
    b = FunctionBuilder(function, _TYPES)
    b.emit(body)
    return "\n" + b.text()


def _splat(t: str, n: int, v: int | str) -> str:
    return "<" + ", ".join([f"{t} {v}"] * n) + ">"


def _mask(values: list[int]) -> str:
    return f"<{len(values)} x i32> <" + ", ".join(f"i32 {v}" for v in values) + ">"


def _broadcast(name: str, value: str, lanes: int) -> list[str]:
    """%name: the float `value` in all `lanes` lanes of a vector."""
    return [f"  %{name}.i = insertelement <{lanes} x float> poison, float {value}, i64 0",
            f"  %{name} = shufflevector <{lanes} x float> %{name}.i, <{lanes} x float> poison, "
            f"<{lanes} x i32> zeroinitializer"]


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


def _to_bf16(src: str, dst: str, lanes: int = 0) -> list[str]:
    """%dst: the float (or <lanes x float>) %src rounded to bf16 bits (i16), to nearest even and
    NaN kept a NaN, as the processor's own conversion rounds; in integers, since LLVM lowers
    `fptrunc ... to bfloat` on a processor without AVX-512 bf16 to a library call that a JIT-ed
    module may not find."""
    def ty(t: str) -> str:
        return f"<{lanes} x {t}>" if lanes else t

    def const(v: int) -> str:
        return _splat("i32", lanes, v) if lanes else str(v)
    return [f"  %{dst}.b = bitcast {ty('float')} {src} to {ty('i32')}",
            f"  %{dst}.l = lshr {ty('i32')} %{dst}.b, {const(16)}",
            f"  %{dst}.o = and {ty('i32')} %{dst}.l, {const(1)}",
            f"  %{dst}.a = add {ty('i32')} %{dst}.b, {const(0x7FFF)}",
            f"  %{dst}.r = add {ty('i32')} %{dst}.a, %{dst}.o",
            f"  %{dst}.n = fcmp uno {ty('float')} {src}, {src}",
            f"  %{dst}.q = or {ty('i32')} %{dst}.b, {const(0x400000)}",
            f"  %{dst}.v = select {ty('i1')} %{dst}.n, {ty('i32')} %{dst}.q, {ty('i32')} %{dst}.r",
            f"  %{dst}.h = lshr {ty('i32')} %{dst}.v, {const(16)}",
            f"  %{dst} = trunc {ty('i32')} %{dst}.h to {ty('i16')}"]


def _quantize(act: str) -> str:
    """quantize_{act}(x, aq i8, asc f32, blocks): a = da * qa per block of 32 of x (bf16 or fp32),
    qa in -127..127 rounded to nearest even; asc per pair of blocks [da0, da1, sa0, sa1]."""
    if act == "bf16":
        load = f"""  %xp = getelementptr i16, ptr %x, i64 %o
  %xv = load <32 x i16>, ptr %xp, align 2
  %xw = zext <32 x i16> %xv to <32 x i32>
  %xs = shl <32 x i32> %xw, {_splat("i32", 32, 16)}
  %xf = bitcast <32 x i32> %xs to <32 x float>"""
    else:
        load = """  %xp = getelementptr float, ptr %x, i64 %o
  %xf = load <32 x float>, ptr %xp, align 4"""
    return f"""
define void @quantize_{act}(ptr %x, ptr %aq, ptr %asc, i64 %blocks) {{
entry:
  %none = icmp eq i64 %blocks, 0
  br i1 %none, label %done, label %loop
loop:
  %b = phi i64 [0, %entry], [%b.next, %loop]
  %o = mul i64 %b, 32
{load}
  %ab = call <32 x float> @llvm.fabs.v32f32(<32 x float> %xf)
  %mx = call nnan float @llvm.vector.reduce.fmax.v32f32(<32 x float> %ab)
  %d = fdiv float %mx, 127.0
  %nz = fcmp ogt float %mx, 0.0
  %inv = fdiv float 127.0, %mx
  %id = select i1 %nz, float %inv, float 0.0
{chr(10).join(_broadcast("idv", "%id", 32))}
  %sc = fmul <32 x float> %xf, %idv
  %r = call <32 x float> @llvm.rint.v32f32(<32 x float> %sc)
  %qi = fptosi <32 x float> %r to <32 x i32>
  %q8 = trunc <32 x i32> %qi to <32 x i8>
  %qp = getelementptr i8, ptr %aq, i64 %o
  store <32 x i8> %q8, ptr %qp, align 1
  %sum = call i32 @llvm.vector.reduce.add.v32i32(<32 x i32> %qi)
  %sumf = sitofp i32 %sum to float
  %sd = fmul float %sumf, %d
  %pair = lshr i64 %b, 1
  %odd = and i64 %b, 1
  %base = shl i64 %pair, 2
  %di = add i64 %base, %odd
  %si = add i64 %di, 2
  %dp = getelementptr float, ptr %asc, i64 %di
  store float %d, ptr %dp, align 4
  %sp = getelementptr float, ptr %asc, i64 %si
  store float %sd, ptr %sp, align 4
  %b.next = add i64 %b, 1
  %more = icmp ult i64 %b.next, %blocks
  br i1 %more, label %loop, label %done
done:
  ret void
}}
"""


def _dot_weights(bits: int, isa: str, x: str) -> list[str]:
    """Load the chunk's 64 weights at %wp{x} in the form `_dot` multiplies (names end in `x`)."""
    if bits == 4:
        out = [f"  %wv{x} = load <32 x i8>, ptr %wp{x}, align 1",
               f"  %lo{x} = and <32 x i8> %wv{x}, {_splat('i8', 32, 15)}",
               f"  %hi{x} = lshr <32 x i8> %wv{x}, {_splat('i8', 32, 4)}"]
        if isa == "avx512":
            out += [f"  %w64{x} = shufflevector <32 x i8> %lo{x}, <32 x i8> %hi{x}, {_mask(list(range(64)))}",
                    f"  %wi{x} = bitcast <64 x i8> %w64{x} to <16 x i32>"]
        return out
    if isa == "avx512":
        return [f"  %wi{x} = load <16 x i32>, ptr %wp{x}, align 1"]
    out = [f"  %w64{x} = load <64 x i8>, ptr %wp{x}, align 1"]
    for q in range(4):  # four quarters of 16 bytes, widened to 16 bits
        out += [f"  %wq{q}{x} = shufflevector <64 x i8> %w64{x}, <64 x i8> poison, "
                f"{_mask(list(range(16 * q, 16 * q + 16)))}",
                f"  %ww{q}{x} = zext <16 x i8> %wq{q}{x} to <16 x i16>"]
    return out


def _activations(bits: int, isa: str, j: int, t: str) -> list[str]:
    """Load activation row j's 64 int8 values of the chunk (at %apr{j}{t}) in the form `_dot` takes."""
    if isa == "avx512":
        return [f"  %av{j}{t} = load <16 x i32>, ptr %apr{j}{t}, align 1"]
    out = [f"  %av{j}{t} = load <64 x i8>, ptr %apr{j}{t}, align 1"]
    if bits == 4:
        return out + [f"  %ah{j}_{h}{t} = shufflevector <64 x i8> %av{j}{t}, <64 x i8> poison, "
                      f"{_mask(list(range(32 * h, 32 * h + 32)))}" for h in range(2)]
    for q in range(4):
        out += [f"  %aq{j}_{q}{t} = shufflevector <64 x i8> %av{j}{t}, <64 x i8> poison, "
                f"{_mask(list(range(16 * q, 16 * q + 16)))}",
                f"  %aw{j}_{q}{t} = sext <16 x i8> %aq{j}_{q}{t} to <16 x i16>"]
    return out


def _dot(bits: int, isa: str, j: int, t: str, x: str) -> list[str]:
    """%s{j}{x}: <16 x i32> with block 0's integer sum over lanes 0-7 and block 1's over lanes 8-15,
    of the weights loaded by `_dot_weights` (names ending in `x`) and activation row j's values."""
    if isa == "avx512":
        return [f"  %s{j}{x} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> zeroinitializer, "
                f"<16 x i32> %wi{x}, <16 x i32> %av{j}{t})"]
    ones = _splat("i16", 16, 1)
    out = []
    if bits == 4:  # u <= 15: a pair's sum |15 * 127 * 2| fits vpmaddubsw's 16 bits
        for h, w in ((0, f"%lo{x}"), (1, f"%hi{x}")):
            out += [f"  %ph{j}_{h}{x} = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {w}, "
                    f"<32 x i8> %ah{j}_{h}{t})",
                    f"  %pd{j}_{h}{x} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %ph{j}_{h}{x}, "
                    f"<16 x i16> {ones})"]
        return out + [f"  %s{j}{x} = shufflevector <8 x i32> %pd{j}_0{x}, <8 x i32> %pd{j}_1{x}, "
                      f"{_mask(list(range(16)))}"]
    for q in range(4):  # u <= 255 would overflow vpmaddubsw: both widened to 16 bits
        out += [f"  %pd{j}_{q}{x} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %ww{q}{x}, "
                f"<16 x i16> %aw{j}_{q}{t})"]
    return out + [f"  %b0_{j}{x} = add <8 x i32> %pd{j}_0{x}, %pd{j}_1{x}",
                  f"  %b1_{j}{x} = add <8 x i32> %pd{j}_2{x}, %pd{j}_3{x}",
                  f"  %s{j}{x} = shufflevector <8 x i32> %b0_{j}{x}, <8 x i32> %b1_{j}{x}, {_mask(list(range(16)))}"]


def _row_loop(bits: int, m: int, act: str, isa: str, t: str, together: int, first: str, last: str,
              after: str) -> list[str]:
    """A loop over output rows %{first}..%{last} (a multiple of `together` apart), `together` rows
    an iteration (independent sums for the processor to overlap), each against the m activation
    rows; then to label %{after}. Names end in `t` (and the output row's index within the
    iteration)."""
    cb, scales = CHUNK_BYTES[bits], CHUNK_BYTES[bits] - 8
    rows = [f"{t}r{i}" for i in range(together)]
    out = [f"  %none{t} = icmp uge i64 %{first}, %{last}",
           f"  br i1 %none{t}, label %{after}, label %row{t}",
           f"row{t}:",
           f"  %r{t} = phi i64 [%{first}, %start{t}], [%r.next{t}, %rowend{t}]"]
    for i, x in enumerate(rows):
        out += [f"  %ri{x} = add i64 %r{t}, {i}",
                f"  %ro{x} = mul i64 %ri{x}, %rowbytes",
                f"  %wrow{x} = getelementptr i8, ptr %w, i64 %ro{x}"]
    out += [f"  br label %chunk{t}", f"chunk{t}:", f"  %c{t} = phi i64 [0, %row{t}], [%c.next{t}, %chunk{t}]"]
    for x in rows:
        for j in range(m):
            out += [f"  %acc{j}{x} = phi <16 x float> [zeroinitializer, %row{t}], [%accn{j}{x}, %chunk{t}]",
                    f"  %mac{j}{x} = phi <4 x float> [zeroinitializer, %row{t}], [%macn{j}{x}, %chunk{t}]"]
    out += [f"  %co{t} = mul i64 %c{t}, {cb}",
            f"  %ao{t} = shl i64 %c{t}, 6",
            f"  %so{t} = shl i64 %c{t}, 2",
            f"  %ap{t} = getelementptr i8, ptr %aq, i64 %ao{t}",
            f"  %sp{t} = getelementptr float, ptr %asc, i64 %so{t}"]
    for j in range(m):
        out += [f"  %apr{j}{t} = getelementptr i8, ptr %ap{t}, i64 %ka{j}",
                f"  %spr{j}{t} = getelementptr float, ptr %sp{t}, i64 %ks{j}",
                f"  %as{j}{t} = load <4 x float>, ptr %spr{j}{t}, align 4"]
        out += _activations(bits, isa, j, t)
    for x in rows:
        out += [f"  %wp{x} = getelementptr i8, ptr %wrow{x}, i64 %co{t}",
                f"  %pf{x} = getelementptr i8, ptr %wp{x}, i64 {PREFETCH * together}",
                f"  call void @llvm.prefetch.p0(ptr %pf{x}, i32 0, i32 3, i32 1)"]
        out += _dot_weights(bits, isa, x)
        out += [f"  %shp{x} = getelementptr i8, ptr %wp{x}, i64 {scales}",
                f"  %sh{x} = load <4 x half>, ptr %shp{x}, align 2",
                f"  %sf{x} = fpext <4 x half> %sh{x} to <4 x float>"]
        for j in range(m):
            out += _dot(bits, isa, j, t, x)
            out += [f"  %f{j}{x} = sitofp <16 x i32> %s{j}{x} to <16 x float>",
                    f"  %kk{j}{x} = fmul <4 x float> %sf{x}, %as{j}{t}",
                    f"  %kv{j}{x} = shufflevector <4 x float> %kk{j}{x}, <4 x float> poison, "
                    f"{_mask([0] * 8 + [1] * 8)}",
                    f"  %accn{j}{x} = call <16 x float> @llvm.fma.v16f32(<16 x float> %f{j}{x}, "
                    f"<16 x float> %kv{j}{x}, <16 x float> %acc{j}{x})",
                    f"  %macn{j}{x} = fadd <4 x float> %mac{j}{x}, %kk{j}{x}"]
    out += [f"  %c.next{t} = add i64 %c{t}, 1",
            f"  %more{t} = icmp ult i64 %c.next{t}, %nch",
            f"  br i1 %more{t}, label %chunk{t}, label %rowend{t}",
            f"rowend{t}:"]
    for x in rows:
        for j in range(m):
            out += [f"  %h{j}{x} = call reassoc float @llvm.vector.reduce.fadd.v16f32(float -0.0, "
                    f"<16 x float> %accn{j}{x})",
                    f"  %m2_{j}{x} = extractelement <4 x float> %macn{j}{x}, i64 2",
                    f"  %m3_{j}{x} = extractelement <4 x float> %macn{j}{x}, i64 3",
                    f"  %mm{j}{x} = fadd float %m2_{j}{x}, %m3_{j}{x}",
                    f"  %res{j}{x} = fadd float %h{j}{x}, %mm{j}{x}",
                    f"  %yo{j}{x} = add i64 %ri{x}, %ky{j}"]
            if act == "bf16":
                out += _to_bf16(f"%res{j}{x}", f"bf{j}{x}")
                out += [f"  %yp{j}{x} = getelementptr i16, ptr %y, i64 %yo{j}{x}",
                        f"  store i16 %bf{j}{x}, ptr %yp{j}{x}, align 2"]
            else:
                out += [f"  %yp{j}{x} = getelementptr float, ptr %y, i64 %yo{j}{x}",
                        f"  store float %res{j}{x}, ptr %yp{j}{x}, align 4"]
    return out + [f"  %r.next{t} = add i64 %r{t}, {together}",
                  f"  %rows{t} = icmp ult i64 %r.next{t}, %{last}",
                  f"  br i1 %rows{t}, label %row{t}, label %{after}"]


def _rows_together(m: int, isa: str) -> int:
    """Output rows an iteration of the products of m activation rows: two where the registers
    hold both rows' sums (AVX-512's 32 vector registers; AVX2's 16 for up to 2 activation rows)."""
    return 2 if isa == "avx512" or m <= 2 else 1


def _rows(bits: int, m: int, act: str, isa: str) -> str:
    """rows_{act}_{bits}_{m}(w, aq, asc, y, n0, n1, nch, n): output rows n0..n1 of m activation
    rows, written as `act`: `_rows_together` rows an iteration, then the odd row alone."""
    together = _rows_together(m, isa)
    out = [f"define void @rows_{act}_{bits}_{m}(ptr %w, ptr %aq, ptr %asc, ptr %y, i64 %n0, i64 %n1, "
           "i64 %nch, i64 %n) {",
           "entry:",
           f"  %rowbytes = mul i64 %nch, {CHUNK_BYTES[bits]}",
           "  %k = shl i64 %nch, 6",
           "  %sstride = shl i64 %nch, 2"]
    # the row offsets of activation row j: its int8 values (j K), scales (j nch 4) and outputs (j n)
    for j in range(m):
        out += [f"  %ka{j} = mul i64 %k, {j}", f"  %ks{j} = mul i64 %sstride, {j}", f"  %ky{j} = mul i64 %n, {j}"]
    out += ["  %span = sub i64 %n1, %n0",
            f"  %pairs = udiv i64 %span, {together}",
            f"  %paired = mul i64 %pairs, {together}",
            "  %split = add i64 %n0, %paired",
            "  br label %startA",
            "startA:"]
    out += _row_loop(bits, m, act, isa, "A", together, "n0", "split", "startB")
    out += ["startB:"]
    out += _row_loop(bits, m, act, isa, "B", 1, "split", "n1", "exit")
    return "\n".join(out + ["exit:", "  ret void", "}"]) + "\n"


def _splat_i32(name: str, value: str) -> list[str]:
    """%name: the i32 `value` in all 16 lanes."""
    return [f"  %{name}.i = insertelement <16 x i32> poison, i32 {value}, i64 0",
            f"  %{name} = shufflevector <16 x i32> %{name}.i, <16 x i32> poison, <16 x i32> zeroinitializer"]


def _tile_dots(bits: int, isa: str, p: int, h: int, rows: range) -> list[str]:
    """The integer sums %s{p}_{j} of pass `p` for a block of 32 along K: TILE_N weight rows (at
    %wb{p}) against each activation row j of `rows` (at %aqb{p}_{j}), one `vpdpbusd` per 4 weights of
    the 16 rows, the activations' 4 bytes broadcast (AVX2: `_tile_dots_avx2`, half `h` of the rows)."""
    if isa == "avx2":
        return _tile_dots_avx2(bits, p, h, rows)
    out: list[str] = []
    last = dict.fromkeys(rows, "zeroinitializer")
    quads: list[tuple[str, int]] = []  # (the weights' <16 x i32>, the quad's first k)
    for w in range(4 if bits == 4 else 8):
        out += [f"  %wl{p}_{w}.p = getelementptr i8, ptr %wb{p}, i64 {64 * w}"]
        if bits == 4:  # a load holds k 8w..8w+3 in the low nibbles, 8w+4..8w+7 in the high ones
            out += [f"  %wl{p}_{w} = load <64 x i8>, ptr %wl{p}_{w}.p, align 1",
                    f"  %wlo{p}_{w} = and <64 x i8> %wl{p}_{w}, {_splat('i8', 64, 15)}",
                    f"  %whi{p}_{w} = lshr <64 x i8> %wl{p}_{w}, {_splat('i8', 64, 4)}",
                    f"  %wq{p}_{2 * w} = bitcast <64 x i8> %wlo{p}_{w} to <16 x i32>",
                    f"  %wq{p}_{2 * w + 1} = bitcast <64 x i8> %whi{p}_{w} to <16 x i32>"]
            quads += [(f"%wq{p}_{2 * w}", 8 * w), (f"%wq{p}_{2 * w + 1}", 8 * w + 4)]
        else:
            out += [f"  %wq{p}_{w} = load <16 x i32>, ptr %wl{p}_{w}.p, align 1"]
            quads += [(f"%wq{p}_{w}", 4 * w)]
    for q, (weights, k) in enumerate(quads):
        for j in rows:
            out += [f"  %a{p}_{j}_{q}.p = getelementptr i8, ptr %aqb{p}_{j}, i64 {k}",
                    f"  %a{p}_{j}_{q} = load i32, ptr %a{p}_{j}_{q}.p, align 1",
                    *_splat_i32(f"av{p}_{j}_{q}", f"%a{p}_{j}_{q}"),
                    f"  %d{p}_{j}_{q} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {last[j]}, "
                    f"<16 x i32> {weights}, <16 x i32> %av{p}_{j}_{q})"]
            last[j] = f"%d{p}_{j}_{q}"
    return out + [f"  %s{p}_{j} = add <16 x i32> {last[j]}, zeroinitializer" for j in rows]


def _tile_dots_avx2(bits: int, p: int, h: int, rows: range) -> list[str]:
    """`_tile_dots` without VNNI, for half `h` of the tile's rows (8 weight rows: 32 bytes of each
    load) and the activation rows `rows`, into <8 x i32> sums: `vpmaddubsw` of the rows' 4 unsigned
    weights and the activations' 4 broadcast bytes gives 16-bit sums of pairs, added over the
    block's 8 quads in 16 bits (|8 * 2 * 15 * 127| < 2^15), then `vpmaddwd` sums each row's pairs
    into 32 bits. 8-bit weights go as two nibble halves (u = 16 * hi + lo), each of them in range;
    the high half's pairs are weighed 16."""
    out: list[str] = []
    nib, four = _splat("i8", 32, 15), _splat("i8", 32, 4)
    weigh = {0: _splat("i16", 16, 1), 1: _splat("i16", 16, 16)}
    quads: list[tuple[str, int, int]] = []  # (weights <32 x i8>, the quad's first k, 0: x1 / 1: x16)
    for c in range(4 if bits == 4 else 8):
        w = f"%xw{p}_{c}"
        out += [f"  {w}.p = getelementptr i8, ptr %wb{p}, i64 {64 * c + 32 * h}",
                f"  {w} = load <32 x i8>, ptr {w}.p, align 1",
                f"  {w}lo = and <32 x i8> {w}, {nib}",
                f"  {w}hi = lshr <32 x i8> {w}, {four}"]
        quads += ([(f"{w}lo", 8 * c, 0), (f"{w}hi", 8 * c + 4, 0)] if bits == 4
                  else [(f"{w}lo", 4 * c, 0), (f"{w}hi", 4 * c, 1)])
    for j in rows:
        acc: dict[int, str] = {}
        for q, (w, k, g) in enumerate(quads):
            a = f"%xa{p}_{j}_{q}"
            out += [f"  {a}.p = getelementptr i8, ptr %aqb{p}_{j}, i64 {k}",
                    f"  {a}.i = load i32, ptr {a}.p, align 1",
                    f"  {a}.v = insertelement <8 x i32> poison, i32 {a}.i, i64 0",
                    f"  {a}.s = shufflevector <8 x i32> {a}.v, <8 x i32> poison, <8 x i32> zeroinitializer",
                    f"  {a} = bitcast <8 x i32> {a}.s to <32 x i8>",
                    f"  {a}.m = call <16 x i16> @llvm.x86.avx2.pmadd.ub.sw(<32 x i8> {w}, <32 x i8> {a})"]
            if g in acc:
                out.append(f"  {a}.t = add <16 x i16> {acc[g]}, {a}.m")
                acc[g] = f"{a}.t"
            else:
                acc[g] = f"{a}.m"
        parts = []
        for g, total in acc.items():
            out.append(f"  %xd{p}_{j}_{g} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> {total}, "
                       f"<16 x i16> {weigh[g]})")
            parts.append(f"%xd{p}_{j}_{g}")
        out.append(f"  %s{p}_{j} = add <8 x i32> {parts[0]}, {parts[1]}" if len(parts) == 2
                   else f"  %s{p}_{j} = add <8 x i32> {parts[0]}, zeroinitializer")
    return out


def _tile(bits: int, act: str, isa: str) -> str:
    """tile_{act}_{bits}(w, aq, asc, y, t0, t1, m, nch, n): output tiles t0..t1 (TILE_N output rows
    each) of m activation rows (a multiple of TILE_M), in stretches of rows whose int8 values fit
    TILE_CACHE; each tile of each stretch reads its weights once for TILE_M rows at a time. On
    AVX2 (16 vector registers) a tile's block loop runs four times, for each half of its output
    rows and each half of the TILE_M activation rows, so that its sums and the block's weights
    stay in registers."""
    tb = TILE_BYTES[bits]
    halves = TILE_HALVES[isa]
    out = [f"define void @tile_{act}_{bits}(ptr %w, ptr %aq, ptr %asc, ptr %y, i64 %t0, i64 %t1, i64 %m, "
           "i64 %nch, i64 %n) {",
           "entry:",
           "  %nb = shl i64 %nch, 1",
           "  %k = shl i64 %nch, 6",
           "  %sstride = shl i64 %nch, 2",
           f"  %tilebytes = mul i64 %nb, {tb}",
           f"  %fit = udiv i64 {TILE_CACHE[isa]}, %k",
           f"  %fitm = and i64 %fit, {-TILE_M}",
           f"  %stretch = call i64 @llvm.umax.i64(i64 %fitm, i64 {TILE_M})",
           "  %notiles = icmp uge i64 %t0, %t1",
           "  %norows = icmp eq i64 %m, 0",
           "  %skip = or i1 %notiles, %norows",
           "  br i1 %skip, label %exit, label %mc",
           "mc:",
           "  %mc0 = phi i64 [0, %entry], [%mc1, %mcnext]",
           "  %mcend = add i64 %mc0, %stretch",
           "  %mc1 = call i64 @llvm.umin.i64(i64 %mcend, i64 %m)",
           "  br label %nt",
           "nt:",
           "  %t = phi i64 [%t0, %mc], [%t.next, %ntnext]",
           "  %to = mul i64 %t, %tilebytes",
           "  %wt = getelementptr i8, ptr %w, i64 %to",
           f"  %tcol = mul i64 %t, {TILE_N}",
           "  br label %mt",
           "mt:",
           "  %r = phi i64 [%mc0, %nt], [%r.next, %mtnext]"]
    for j in range(TILE_M):
        out += [f"  %row{j} = add i64 %r, {j}",
                f"  %ao{j} = mul i64 %row{j}, %k",
                f"  %aqr{j} = getelementptr i8, ptr %aq, i64 %ao{j}",
                f"  %so{j} = mul i64 %row{j}, %sstride",
                f"  %ascr{j} = getelementptr float, ptr %asc, i64 %so{j}",
                f"  %yr{j} = mul i64 %row{j}, %n",
                f"  %yo{j} = add i64 %yr{j}, %tcol"]
    out.append("  br label %blk0")
    groups = TILE_GROUPS[isa]
    size = TILE_M // groups
    passes = [(h, range(g * size, g * size + size)) for h in range(halves) for g in range(groups)]
    for p, (h, rows) in enumerate(passes):
        out += _tile_pass(bits, act, isa, p, h, rows, "mt" if p == 0 else f"stored{p - 1}")
        out.append(f"  br label %{'mtnext' if p == len(passes) - 1 else f'blk{p + 1}'}")
    out += ["mtnext:",
            f"  %r.next = add i64 %r, {TILE_M}",
            "  %rmore = icmp ult i64 %r.next, %mc1",
            "  br i1 %rmore, label %mt, label %ntnext",
            "ntnext:",
            "  %t.next = add i64 %t, 1",
            "  %tmore = icmp ult i64 %t.next, %t1",
            "  br i1 %tmore, label %nt, label %mcnext",
            "mcnext:",
            "  %mmore = icmp ult i64 %mc1, %m",
            "  br i1 %mmore, label %mc, label %exit",
            "exit:",
            "  ret void",
            "}"]
    return "\n".join(out) + "\n"


def _tile_pass(bits: int, act: str, isa: str, p: int, h: int, rows: range, before: str) -> list[str]:
    """Pass `p` of a tile's block loop (label blk{p}, entered from `before`) over output rows
    h * L .. h * L + L - 1 (L = TILE_N / TILE_HALVES[isa] lanes) and the activation rows `rows`, then
    their stores (ending in block stored{p}): the rows' sums of the blocks' integer dots times the
    blocks' scales."""
    lanes = TILE_N // TILE_HALVES[isa]
    v = f"<{lanes} x float>"
    scales = TILE_BYTES[bits] - 4 * TILE_N
    out = [f"blk{p}:",
           f"  %b{p} = phi i64 [0, %{before}], [%b{p}.next, %blk{p}]"]
    out += [f"  %acc{p}_{j} = phi {v} [zeroinitializer, %{before}], [%accn{p}_{j}, %blk{p}]" for j in rows]
    out += [f"  %bo{p} = mul i64 %b{p}, {TILE_BYTES[bits]}",
            f"  %wb{p} = getelementptr i8, ptr %wt, i64 %bo{p}",
            f"  %pf{p} = getelementptr i8, ptr %wb{p}, i64 {PREFETCH}",
            f"  call void @llvm.prefetch.p0(ptr %pf{p}, i32 0, i32 3, i32 1)",
            f"  %dsp{p} = getelementptr i8, ptr %wb{p}, i64 {scales + 2 * lanes * h}",
            f"  %dsh{p} = load <{lanes} x half>, ptr %dsp{p}, align 2",
            f"  %ds{p} = fpext <{lanes} x half> %dsh{p} to {v}",
            f"  %msp{p} = getelementptr i8, ptr %wb{p}, i64 {scales + 2 * TILE_N + 2 * lanes * h}",
            f"  %msh{p} = load <{lanes} x half>, ptr %msp{p}, align 2",
            f"  %ms{p} = fpext <{lanes} x half> %msh{p} to {v}",
            f"  %ab{p} = shl i64 %b{p}, 5",
            f"  %bpair{p} = lshr i64 %b{p}, 1",
            f"  %bodd{p} = and i64 %b{p}, 1",
            f"  %bs4{p} = shl i64 %bpair{p}, 2",
            f"  %bsi{p} = add i64 %bs4{p}, %bodd{p}"]
    for j in rows:
        out += [f"  %aqb{p}_{j} = getelementptr i8, ptr %aqr{j}, i64 %ab{p}",
                f"  %dap{p}_{j} = getelementptr float, ptr %ascr{j}, i64 %bsi{p}",
                f"  %da{p}_{j} = load float, ptr %dap{p}_{j}, align 4",
                f"  %sap{p}_{j} = getelementptr float, ptr %dap{p}_{j}, i64 2",
                f"  %sa{p}_{j} = load float, ptr %sap{p}_{j}, align 4"]
    out += _tile_dots(bits, isa, p, h, rows)
    for j in rows:
        out += [f"  %f{p}_{j} = sitofp <{lanes} x i32> %s{p}_{j} to {v}",
                *_broadcast(f"dav{p}_{j}", f"%da{p}_{j}", lanes),
                f"  %dd{p}_{j} = fmul {v} %ds{p}, %dav{p}_{j}",
                f"  %acd{p}_{j} = call {v} @llvm.fma.v{lanes}f32({v} %f{p}_{j}, {v} %dd{p}_{j}, {v} %acc{p}_{j})",
                *_broadcast(f"sav{p}_{j}", f"%sa{p}_{j}", lanes),
                f"  %accn{p}_{j} = call {v} @llvm.fma.v{lanes}f32({v} %ms{p}, {v} %sav{p}_{j}, {v} %acd{p}_{j})"]
    out += [f"  %b{p}.next = add i64 %b{p}, 1",
            f"  %bmore{p} = icmp ult i64 %b{p}.next, %nb",
            f"  br i1 %bmore{p}, label %blk{p}, label %stored{p}",
            f"stored{p}:"]
    for j in rows:
        out.append(f"  %yh{p}_{j} = add i64 %yo{j}, {lanes * h}")
        if act == "bf16":
            out += [*_to_bf16(f"%accn{p}_{j}", f"yb{p}_{j}", lanes),
                    f"  %yp{p}_{j} = getelementptr i16, ptr %y, i64 %yh{p}_{j}",
                    f"  store <{lanes} x i16> %yb{p}_{j}, ptr %yp{p}_{j}, align 2"]
        else:
            out += [f"  %yp{p}_{j} = getelementptr float, ptr %y, i64 %yh{p}_{j}",
                    f"  store {v} %accn{p}_{j}, ptr %yp{p}_{j}, align 4"]
    return out


def _tiles_part() -> str:
    """tiles_part(ctl, index): the posted tiled product's output tiles of part `index`, and
    `tiles`, which quantizes the activations, zeroes the rows that pad them to TILE_M and posts
    the job."""
    kinds = [(f32, act, bits) for f32, act in enumerate(ACTS) for bits in TILE_BYTES]
    cases = " ".join(f"i64 {f32 * 1000 + bits}, label %{act}b{bits}" for f32, act, bits in kinds)
    blocks = "\n".join(f"{act}b{bits}:\n  call void @tile_{act}_{bits}(ptr %w, ptr %aq, ptr %asc, ptr %y, i64 %t0, "
                       "i64 %t1, i64 %mpad, i64 %nch, i64 %n)\n  br label %exit" for f32, act, bits in kinds)
    return _exported(abi.part("tiles"), f"""entry:
{_job_loads(abi.TILE_JOB)}
  %desc = inttoptr i64 %desci to ptr
  %y = inttoptr i64 %yi to ptr
{abi.DESCRIPTOR.load("%desc")}
  %aq = inttoptr i64 %taqi to ptr
  %asc = inttoptr i64 %tasci to ptr
  %w = inttoptr i64 %wi to ptr
  %tiles = lshr i64 %n, {TILE_N.bit_length() - 1}
{_share("tiles", "t0", "t1")}
  %f32k = mul i64 %f32, 1000
  %kind = add i64 %f32k, %bits
  switch i64 %kind, label %exit [ {cases} ]
{blocks}
exit:
  ret void""") + _exported(abi.part("quantize"), f"""entry:
{_job_loads(abi.QUANTIZE_JOB)}
{_share("chunks", "c0", "c1")}
  %b0 = shl i64 %c0, 1
  %count = sub i64 %c1, %c0
  %blocks = shl i64 %count, 1
  %vo = shl i64 %b0, 5
  %so = shl i64 %c0, 2
  %aqb = add i64 %qaqi, %vo
  %aq = inttoptr i64 %aqb to ptr
  %ascb = shl i64 %so, 2
  %asca = add i64 %qasci, %ascb
  %asc = inttoptr i64 %asca to ptr
  %isf32 = icmp ne i64 %f32, 0
  br i1 %isf32, label %qf32, label %qbf16
qf32:
  %x4 = shl i64 %vo, 2
  %xa4 = add i64 %xi, %x4
  %xp4 = inttoptr i64 %xa4 to ptr
  call void @quantize_f32(ptr %xp4, ptr %aq, ptr %asc, i64 %blocks)
  ret void
qbf16:
  %x2 = shl i64 %vo, 1
  %xa2 = add i64 %xi, %x2
  %xp2 = inttoptr i64 %xa2 to ptr
  call void @quantize_bf16(ptr %xp2, ptr %aq, ptr %asc, i64 %blocks)
  ret void""") + _exported(abi.TILES, f"""entry:
{abi.DESCRIPTOR.load("%desc", ("nch", "f32"))}
  %chunks = mul i64 %m, %nch
{_parts("%omp")}
  %xi = ptrtoint ptr %x to i64
  %qaqi = ptrtoint ptr %aq to i64
  %qasci = ptrtoint ptr %asc to i64
{_post(QUANTIZE, abi.QUANTIZE_JOB)}
  call void @run_on(ptr %ctl, i64 %workers, i64 %omp)
  %k = shl i64 %nch, 6
  %extra = sub i64 %mpad, %m
  %aqo = mul i64 %m, %k
  %aqp = getelementptr i8, ptr %aq, i64 %aqo
  %aqn = mul i64 %extra, %k
  call void @llvm.memset.p0.i64(ptr %aqp, i8 0, i64 %aqn, i1 false)
  %sstride = shl i64 %nch, 2
  %sco = mul i64 %m, %sstride
  %scp = getelementptr float, ptr %asc, i64 %sco
  %scf = mul i64 %extra, %sstride
  %scn = shl i64 %scf, 2
  call void @llvm.memset.p0.i64(ptr %scp, i8 0, i64 %scn, i1 false)
  %desci = ptrtoint ptr %desc to i64
  %yi = ptrtoint ptr %y to i64
  %taqi = ptrtoint ptr %aq to i64
  %tasci = ptrtoint ptr %asc to i64
{_post(TILES, abi.TILE_JOB)}
  call void @run_on(ptr %ctl, i64 %workers, i64 %omp)
  ret void""")


def _norm() -> str:
    """rms_norm(ctl, x, w, y, k, eps, rows, workers, threads): y = x / sqrt(mean(x^2) + eps) * w
    for fp32 rows of k (a multiple of 16) values, as HF's RMSNorm orders it; rows split between
    threads (`run_on`), or on the caller alone below NORM_ALONE rows."""
    vector = "<16 x float>"
    row = f"""  %ro = mul i64 %r, %k
  %xr = getelementptr float, ptr %x, i64 %ro
  %yr = getelementptr float, ptr %y, i64 %ro
  br label %square
square:
  %j = phi i64 [0, %row], [%j.next, %square]
  %acc = phi {vector} [zeroinitializer, %row], [%acc.next, %square]
  %xp = getelementptr float, ptr %xr, i64 %j
  %xv = load {vector}, ptr %xp, align 4
  %acc.next = call {vector} @llvm.fma.v16f32({vector} %xv, {vector} %xv, {vector} %acc)
  %j.next = add i64 %j, 16
  %more = icmp ult i64 %j.next, %k
  br i1 %more, label %square, label %mean
mean:
  %ss = call reassoc float @llvm.vector.reduce.fadd.v16f32(float -0.0, {vector} %acc.next)
  %ms = fdiv float %ss, %kf
  %me = fadd float %ms, %eps
  %sd = call float @llvm.sqrt.f32(float %me)
  %inv = fdiv float 1.0, %sd
{chr(10).join(_broadcast("invv", "%inv", 16))}
  br label %scale
scale:
  %i = phi i64 [0, %mean], [%i.next, %scale]
  %xq = getelementptr float, ptr %xr, i64 %i
  %xw = load {vector}, ptr %xq, align 4
  %wq = getelementptr float, ptr %w, i64 %i
  %wv = load {vector}, ptr %wq, align 4
  %nv = fmul {vector} %xw, %invv
  %yv = fmul {vector} %nv, %wv
  %yq = getelementptr float, ptr %yr, i64 %i
  store {vector} %yv, ptr %yq, align 4
  %i.next = add i64 %i, 16
  %imore = icmp ult i64 %i.next, %k
  br i1 %imore, label %scale, label %rowdone"""
    return _row_job(abi.RMS_NORM, NORM, NORM_ALONE, "  %kf = uitofp i64 %k to float", row)


PREFILL_ROWS = 8  # query rows (positions of one head) a native prompt-attention item takes
# floats between the end of an item's score row and the next one's start: rows tpad floats apart
# would be 4 KiB apart at 1,024 keys, and a pass's loads and stores at one offset of each row
# would fall into one cache set (and alias the stores on Intel cores)
PREFILL_ROW_PAD = 16
# floats of a part's scratch after its score rows: the bf16 form's item's queries, rounded once an item
PREFILL_Q_SCRATCH = PREFILL_ROWS * 64 // 2


def _exp2v(src: str, dst: str, lanes: int = 16) -> list[str]:
    """%dst: 2^%src for <lanes x float> %src <= 0, lane by lane: 2^n 2^f with n = rint, |f| <= 1/2,
    2^f a degree-7 polynomial (relative error ~1e-8); below -126 the result flushes toward 0."""
    v, n = f"<{lanes} x float>", lanes
    coefficients = [math.log(2) ** k / math.factorial(k) for k in range(8)]
    out = [f"  %{dst}.x = call {v} @llvm.maxnum.v{n}f32({v} {src}, {v} {_splat('float', n, _f32(-126.0))})",
           f"  %{dst}.n = call {v} @llvm.rint.v{n}f32({v} %{dst}.x)",
           f"  %{dst}.f = fsub {v} %{dst}.x, %{dst}.n",
           f"  %{dst}.p7 = fadd {v} zeroinitializer, {_splat('float', n, _f32(coefficients[7]))}"]
    for k in range(6, -1, -1):
        out.append(f"  %{dst}.p{k} = call {v} @llvm.fma.v{n}f32({v} %{dst}.p{k + 1}, {v} %{dst}.f, "
                   f"{v} {_splat('float', n, _f32(coefficients[k]))})")
    return out + [f"  %{dst}.i = fptosi {v} %{dst}.n to <{n} x i32>",
                  f"  %{dst}.e = add <{n} x i32> %{dst}.i, {_splat('i32', n, 127)}",
                  f"  %{dst}.b = shl <{n} x i32> %{dst}.e, {_splat('i32', n, 23)}",
                  f"  %{dst}.t = bitcast <{n} x i32> %{dst}.b to {v}",
                  f"  %{dst} = fmul {v} %{dst}.p0, %{dst}.t"]


# How a prompt-attention item's work is laid out per instruction set: the vector's lanes, the
# query rows whose scores one pass over a key block sums together (each row's sums for the
# block's 16 keys stay in registers: with AVX-512 two chains a row of one 16-lane vector, with
# AVX2's 16 registers two 8-lane vectors a row, four rows a pass), and the (rows, value vectors)
# that one pass over the keys weights into their sums (AVX2: four rows by two vectors a pass, the
# values read half as often, was 1-4% faster on a Zen 4 but slower on a Zen 5 over long prefixes).
PREFILL_PLANS: dict[str, tuple[int, list[list[int]], list[tuple[list[int], list[int]]]]] = {
    "avx512": (16, [list(range(8))], [([0, 1, 2, 3], [0, 1, 2, 3]), ([4, 5, 6, 7], [0, 1, 2, 3])]),
    "avx2": (8, [[0, 1, 2, 3], [4, 5, 6, 7]],
             [(rows, chunks) for rows in ([0, 1], [2, 3], [4, 5], [6, 7]) for chunks in ([0, 1, 2, 3], [4, 5, 6, 7])]),
}


def _pair(name: str, pointer: str, offset: str) -> list[str]:
    """%name: the two bf16 at `pointer` + `offset` bf16s (32 bits) in all 16 pairs of a <32 x bfloat>."""
    return [f"  %{name}.p = getelementptr i16, ptr {pointer}, i64 {offset}",
            f"  %{name}.w = load i32, ptr %{name}.p, align 4",
            *_splat_i32(f"{name}.s", f"%{name}.w"),
            f"  %{name} = bitcast <16 x i32> %{name}.s to <32 x bfloat>"]


DPBF16 = "@llvm.x86.avx512bf16.dpbf16ps.512"


def _prefill(isa: str, bf16: bool = False) -> str:
    """prefill_part(ctl, index): causal attention of a prompt's fp32 queries over the sequence's
    keys (a cached prefix, then the prompt's own), head size 64: items of PREFILL_ROWS positions of
    one query head, round-robin between the parts. Three passes over the keys an item sees, each
    with independent chains of FMAs laid out by PREFILL_PLANS[isa]: the scores (from K laid out
    [kv_head, tpad / 16, 64, 16]: a block of 16 keys is 4 KiB read in order) into the part's
    scratch rows, with their running max; the weights 2^(s - max) in place, with their sums; then
    the values [kv_head, tpad, 64] weighted into the rows' sums. `bf16` (AVX-512 BF16): q, K, V
    and the weights in bf16, multiplied in pairs by `vdpbf16ps` into fp32 sums: K laid out
    [kv_head, tpad / 16, 32, 16, 2] (each key's dims 2i and 2i + 1 side by side), V [kv_head,
    tpad / 2, 64, 2] (keys 2j and 2j + 1 side by side), the weights written over their scores'
    rows as bf16, an item's fp32 queries rounded into the part's scratch after its score rows
    (PREFILL_Q_SCRATCH); prefill_bf16 and prefill_bf16_part."""
    lanes, score_groups, value_groups = PREFILL_PLANS[isa]
    n, R, D = lanes, PREFILL_ROWS, 64
    if bf16 and n != 16:
        raise ValueError("the bf16 prompt attention is written for AVX-512 (16 lanes)")
    sfx, el = ("_bf16", "i16") if bf16 else ("", "float")  # names; the element q, K and V are addressed as
    steps = D // 2 if bf16 else D  # the scores' steps along d: pairs of dims in bf16
    # key and query positions are compared as 32-bit lanes (AVX2 has no unsigned 64-bit compare:
    # its form took several ops a vector; the attention 3% faster on AVX2, 1.5% on AVX-512)
    v, vi, vb, halves = f"<{n} x float>", f"<{n} x i32>", f"<{n} x i1>", 16 // n
    chains = 2 if halves == 1 else 1  # independent sums a (row, vector) in a pass over a block
    neg = _splat("float", n, _f32(-3.0e38))
    fma, last_scored = f"@llvm.fma.v{n}f32", f"scored{len(score_groups) - 1}"
    out = ["entry:",
           _job_loads(abi.PREFILL_JOB),
           "  %q = inttoptr i64 %pqi to ptr",
           "  %kt = inttoptr i64 %kti to ptr",
           "  %vv = inttoptr i64 %pvi to ptr",
           "  %o = inttoptr i64 %pouti to ptr",
           f"  %rstride = add i64 %tpad, {PREFILL_ROW_PAD}",
           f"  %rowsc = mul i64 %rstride, {R}",
           f"  %partsc = add i64 %rowsc, {PREFILL_Q_SCRATCH}",
           "  %scro = mul i64 %partsc, %index",
           "  %scr0 = inttoptr i64 %pscri to ptr",
           "  %scr = getelementptr float, ptr %scr0, i64 %scro",
           "  %qscr = getelementptr float, ptr %scr, i64 %rowsc",
           "  %s32 = trunc i64 %scalebits to i32",
           "  %scale2 = bitcast i32 %s32 to float",
           *_broadcast("s2v", "%scale2", n),
           "  %group = udiv i64 %pheads, %pkvheads",
           f"  %tq1 = add i64 %tq, {R - 1}",
           f"  %nqb = udiv i64 %tq1, {R}",
           "  %items = mul i64 %nqb, %pheads",
           "  %last = sub i64 %tq, 1",
           "  %kvlen = add i64 %prefix, %tq",
           f"  %ostride = mul i64 %pheads, {D}",
           f"  %iota = add {vi} zeroinitializer, <" + ", ".join(f"i32 {i}" for i in range(n)) + ">",
           "  %none = icmp uge i64 %index, %items",
           "  br i1 %none, label %exit, label %item",
           "item:",
           "  %it = phi i64 [%index, %entry], [%it.next, %stored]",
           "  %h = udiv i64 %it, %nqb",
           "  %qb = urem i64 %it, %nqb",
           "  %g = udiv i64 %h, %group",
           f"  %t0 = mul i64 %qb, {R}",
           f"  %hoff = mul i64 %h, {D}",
           f"  %kbase = mul i64 %g, {D}",
           "  %kbt = mul i64 %kbase, %tpad",  # (a head's keys: tpad / 16 blocks of [64, 16])
           f"  %ktg = getelementptr {el}, ptr %kt, i64 %kbt",
           "  %vgo = mul i64 %g, %tpad",
           f"  %vgo2 = mul i64 %vgo, {D}",
           f"  %vg = getelementptr {el}, ptr %vv, i64 %vgo2"]
    for r in range(R):
        out += [f"  %t{r}r = add i64 %t0, {r}",
                f"  %tl{r} = call i64 @llvm.umin.i64(i64 %t{r}r, i64 %last)",
                f"  %pos{r} = add i64 %prefix, %t{r}r",
                f"  %pos{r}.w = trunc i64 %pos{r} to i32",
                f"  %posv{r}.i = insertelement {vi} poison, i32 %pos{r}.w, i64 0",
                f"  %posv{r} = shufflevector {vi} %posv{r}.i, {vi} poison, <{n} x i32> zeroinitializer",
                f"  %qo{r}a = mul i64 %tl{r}, %qstride",
                f"  %qo{r} = add i64 %qo{r}a, %hoff",
                *([f"  %qf{r} = getelementptr float, ptr %q, i64 %qo{r}",  # (bf16: the row rounded into the scratch)
                   f"  %qfv{r} = load <64 x float>, ptr %qf{r}, align 4",
                   f"  %qbv{r} = fptrunc <64 x float> %qfv{r} to <64 x bfloat>",
                   f"  %qr{r} = getelementptr i16, ptr %qscr, i64 {64 * r}",
                   f"  store <64 x bfloat> %qbv{r}, ptr %qr{r}, align 2"] if bf16 else
                  [f"  %qr{r} = getelementptr float, ptr %q, i64 %qo{r}"]),
                f"  %srow{r}o = mul i64 %rstride, {r}",
                f"  %srow{r} = getelementptr float, ptr %scr, i64 %srow{r}o"]

    def keys_at(name: str, base: str, half: int) -> list[str]:
        """%name: the key positions base + half * n + 0 .. n - 1, and %name.o the first of them."""
        return [f"  %{name}.o = add i64 {base}, {half * n}",
                f"  %{name}.w = trunc i64 %{name}.o to i32",
                f"  %{name}.i = insertelement {vi} poison, i32 %{name}.w, i64 0",
                f"  %{name}.s = shufflevector {vi} %{name}.i, {vi} poison, <{n} x i32> zeroinitializer",
                f"  %{name} = add {vi} %{name}.s, %iota"]

    out += [f"  %endq = add i64 %pos{R - 1}, 1",
            "  %kvend = call i64 @llvm.umin.i64(i64 %endq, i64 %kvlen)",
            "  %kvend1 = add i64 %kvend, 1",
            "  %kvpairs = lshr i64 %kvend1, 1",
            "  %kvend15 = add i64 %kvend, 15",
            "  %nkb = lshr i64 %kvend15, 4",
            "  br label %kblock",
            # pass 1: the scores, masked, and their running max
            "kblock:",
            f"  %kb = phi i64 [0, %item], [%kb.next, %{last_scored}]"]
    out += [f"  %mxv{r}_{h} = phi {v} [{neg}, %item], [%mxn{r}_{h}, %{last_scored}]"
            for r in range(R) for h in range(halves)]
    out += ["  %j0 = shl i64 %kb, 4",
            "  %kjo = shl i64 %j0, 6",
            f"  %ktj = getelementptr {el}, ptr %ktg, i64 %kjo"]
    for h in range(halves):
        out += keys_at(f"keys{h}", "%j0", h)
    out.append("  br label %score0")
    for g, rows in enumerate(score_groups):
        before = "kblock" if g == 0 else f"scored{g - 1}"
        sums = {(r, h, c): f"%sc{r}_{h}_{c}" for r in rows for h in range(halves) for c in range(chains)}
        body = []
        for dd in range(4):
            body += [f"  %dd{g}_{dd} = add i64 %d{g}, {dd}",
                     f"  %krb{g}_{dd} = shl i64 %dd{g}_{dd}, {5 if bf16 else 4}"]
            kvec = f"<{2 * n} x bfloat>" if bf16 else v
            for h in range(halves):
                body += [f"  %kro{g}_{dd}_{h} = add i64 %krb{g}_{dd}, {h * n}",
                         f"  %krp{g}_{dd}_{h} = getelementptr {el}, ptr %ktj, i64 %kro{g}_{dd}_{h}",
                         f"  %kr{g}_{dd}_{h} = load {kvec}, ptr %krp{g}_{dd}_{h}, align 4"]
            if bf16:
                body.append(f"  %dd2{g}_{dd} = shl i64 %dd{g}_{dd}, 1")
            for r in rows:
                body += (_pair(f"qv{r}_{dd}", f"%qr{r}", f"%dd2{g}_{dd}") if bf16 else
                         [f"  %qp{r}_{dd} = getelementptr float, ptr %qr{r}, i64 %dd{g}_{dd}",
                          f"  %qs{r}_{dd} = load float, ptr %qp{r}_{dd}, align 4",
                          *_broadcast(f"qv{r}_{dd}", f"%qs{r}_{dd}", n)])
                for h in range(halves):
                    key = (r, h, dd % chains)
                    new = f"%sc{r}_{h}_{dd % chains}.{dd}"
                    dot = (f"{DPBF16}({v} {sums[key]}, {kvec} %kr{g}_{dd}_{h}, {kvec} %qv{r}_{dd})" if bf16 else
                           f"{fma}({v} %qv{r}_{dd}, {v} %kr{g}_{dd}_{h}, {v} {sums[key]})")
                    body.append(f"  {new} = call {v} {dot}")
                    sums[key] = new
        out += [f"score{g}:", f"  %d{g} = phi i64 [0, %{before}], [%d{g}.next, %score{g}]"]
        out += [f"  %sc{r}_{h}_{c} = phi {v} [zeroinitializer, %{before}], [{sums[(r, h, c)]}, %score{g}]"
                for r in rows for h in range(halves) for c in range(chains)]
        out += body
        out += [f"  %d{g}.next = add i64 %d{g}, 4",
                f"  %dmore{g} = icmp ult i64 %d{g}.next, {steps}",
                f"  br i1 %dmore{g}, label %score{g}, label %scored{g}",
                f"scored{g}:"]
        for r in rows:
            for h in range(halves):
                total = sums[(r, h, 0)]
                if chains == 2:
                    out.append(f"  %sum{r}_{h} = fadd {v} {sums[(r, h, 0)]}, {sums[(r, h, 1)]}")
                    total = f"%sum{r}_{h}"
                out += [f"  %ss{r}_{h} = fmul {v} {total}, %s2v",
                        f"  %late{r}_{h} = icmp ugt {vi} %keys{h}, %posv{r}",
                        f"  %sm{r}_{h} = select {vb} %late{r}_{h}, {v} {neg}, {v} %ss{r}_{h}",
                        f"  %mxn{r}_{h} = call {v} @llvm.maxnum.v{n}f32({v} %mxv{r}_{h}, {v} %sm{r}_{h})",
                        f"  %sp{r}_{h} = getelementptr float, ptr %srow{r}, i64 %keys{h}.o",
                        f"  store {v} %sm{r}_{h}, ptr %sp{r}_{h}, align 4"]
        if g < len(score_groups) - 1:
            out.append(f"  br label %score{g + 1}")
    out += ["  %kb.next = add i64 %kb, 1",
            "  %kmore = icmp ult i64 %kb.next, %nkb",
            "  br i1 %kmore, label %kblock, label %maxed",
            # pass 2: the weights in place, and their sums
            "maxed:"]
    for r in range(R):
        top = f"%mxn{r}_0"
        if halves == 2:
            out.append(f"  %mxr{r} = call {v} @llvm.maxnum.v{n}f32({v} %mxn{r}_0, {v} %mxn{r}_1)")
            top = f"%mxr{r}"
        out += [f"  %m{r} = call nnan float @llvm.vector.reduce.fmax.v{n}f32({v} {top})",
                *_broadcast(f"mv{r}", f"%m{r}", n)]
    out += ["  br label %weigh",
            "weigh:",
            "  %wb = phi i64 [0, %maxed], [%wb.next, %weigh]"]
    out += [f"  %ls{r}_{h} = phi {v} [zeroinitializer, %maxed], [%lsn{r}_{h}, %weigh]"
            for r in range(R) for h in range(halves)]
    out.append("  %w0 = shl i64 %wb, 4")
    for h in range(halves):
        out += keys_at(f"wkeys{h}", "%w0", h)
    for r in range(R):
        for h in range(halves):
            out += [f"  %wp{r}_{h} = getelementptr float, ptr %srow{r}, i64 %wkeys{h}.o",
                    f"  %ws{r}_{h} = load {v}, ptr %wp{r}_{h}, align 4",
                    f"  %wd{r}_{h} = fsub {v} %ws{r}_{h}, %mv{r}",
                    *_exp2v(f"%wd{r}_{h}", f"we{r}_{h}", n),
                    f"  %wlate{r}_{h} = icmp ugt {vi} %wkeys{h}, %posv{r}",
                    f"  %wz{r}_{h} = select {vb} %wlate{r}_{h}, {v} zeroinitializer, {v} %we{r}_{h}",
                    *([f"  %wzb{r}_{h} = fptrunc {v} %wz{r}_{h} to <{n} x bfloat>",
                       f"  %wpb{r}_{h} = getelementptr i16, ptr %srow{r}, i64 %wkeys{h}.o",
                       f"  store <{n} x bfloat> %wzb{r}_{h}, ptr %wpb{r}_{h}, align 2"] if bf16 else
                      [f"  store {v} %wz{r}_{h}, ptr %wp{r}_{h}, align 4"]),
                    f"  %lsn{r}_{h} = fadd {v} %ls{r}_{h}, %wz{r}_{h}"]
    out += ["  %wb.next = add i64 %wb, 1",
            "  %wmore = icmp ult i64 %wb.next, %nkb",
            "  br i1 %wmore, label %weigh, label %weighed",
            "weighed:"]
    for r in range(R):
        total = f"%lsn{r}_0"
        if halves == 2:
            out.append(f"  %lst{r} = fadd {v} %lsn{r}_0, %lsn{r}_1")
            total = f"%lst{r}"
        out += [f"  %l{r} = call reassoc float @llvm.vector.reduce.fadd.v{n}f32(float -0.0, {v} {total})",
                f"  %inv{r} = fdiv float 1.0, %l{r}",
                *_broadcast(f"invv{r}", f"%inv{r}", n)]
    # pass 3: the values weighted into the rows' sums, a key at a time, a plan's group at a time
    for k, (rows, chunks) in enumerate(value_groups):
        start = "weighed" if k == 0 else f"done{k - 1}"
        out += [f"  br label %values{k}",
                f"values{k}:",
                f"  %vj{k} = phi i64 [0, %{start}], [%vj{k}.next, %values{k}]"]
        out += [f"  %acc{k}_{r}_{c} = phi {v} [zeroinitializer, %{start}], [%accn{k}_{r}_{c}, %values{k}]"
                for r in rows for c in chunks]
        # (bf16: %vj counts pairs of keys; a pair past the end weighs its second key 0)
        vvec = f"<{2 * n} x bfloat>" if bf16 else v
        out += [f"  %vo{k} = mul i64 %vj{k}, {2 * D if bf16 else D}",
                f"  %vp{k} = getelementptr {el}, ptr %vg, i64 %vo{k}"]
        for c in chunks:
            out += [f"  %vc{k}_{c}.p = getelementptr {el}, ptr %vp{k}, i64 {2 * n * c if bf16 else n * c}",
                    f"  %vc{k}_{c} = load {vvec}, ptr %vc{k}_{c}.p, align 4"]
        if bf16:
            out.append(f"  %vj2{k} = shl i64 %vj{k}, 1")
        for r in rows:
            if bf16:
                out += _pair(f"pjv{k}_{r}", f"%srow{r}", f"%vj2{k}")
                out += [f"  %accn{k}_{r}_{c} = call {v} {DPBF16}({v} %acc{k}_{r}_{c}, {vvec} %vc{k}_{c}, "
                        f"{vvec} %pjv{k}_{r})" for c in chunks]
                continue
            out += [f"  %pj{k}_{r}.p = getelementptr float, ptr %srow{r}, i64 %vj{k}",
                    f"  %pj{k}_{r} = load float, ptr %pj{k}_{r}.p, align 4",
                    *_broadcast(f"pjv{k}_{r}", f"%pj{k}_{r}", n)]
            out += [f"  %accn{k}_{r}_{c} = call {v} {fma}({v} %pjv{k}_{r}, {v} %vc{k}_{c}, {v} %acc{k}_{r}_{c})"
                    for c in chunks]
        out += [f"  %vj{k}.next = add i64 %vj{k}, 1",
                f"  %jmore{k} = icmp ult i64 %vj{k}.next, {'%kvpairs' if bf16 else '%kvend'}",
                f"  br i1 %jmore{k}, label %values{k}, label %finish{k}",
                f"finish{k}:"]
        for r in rows:
            out += [f"  %keep{k}_{r} = icmp ult i64 %t{r}r, %tq",
                    f"  br i1 %keep{k}_{r}, label %store{k}_{r}, label %next{k}_{r}",
                    f"store{k}_{r}:",
                    f"  %oo{k}_{r}a = mul i64 %t{r}r, %ostride",
                    f"  %oo{k}_{r} = add i64 %oo{k}_{r}a, %hoff",
                    f"  %or{k}_{r} = getelementptr float, ptr %o, i64 %oo{k}_{r}"]
            for c in chunks:
                out += [f"  %ov{k}_{r}_{c} = fmul {v} %accn{k}_{r}_{c}, %invv{r}",
                        f"  %op{k}_{r}_{c} = getelementptr float, ptr %or{k}_{r}, i64 {n * c}",
                        f"  store {v} %ov{k}_{r}_{c}, ptr %op{k}_{r}_{c}, align 4"]
            out += [f"  br label %next{k}_{r}", f"next{k}_{r}:"]
        out += [f"  br label %done{k}", f"done{k}:"]
    out += ["  br label %stored",
            "stored:",
            "  %it.next = add i64 %it, %parts",
            "  %imore = icmp ult i64 %it.next, %items",
            "  br i1 %imore, label %item, label %exit",
            "exit:",
            "  ret void"]
    post = ["entry:",
            _parts(),
            "  %pqi = ptrtoint ptr %q to i64",
            "  %kti = ptrtoint ptr %kt to i64",
            "  %pvi = ptrtoint ptr %v to i64",
            "  %pouti = ptrtoint ptr %out to i64",
            "  %pscri = ptrtoint ptr %scratch to i64",
            "  %sb32 = bitcast float %scale2 to i32",
            "  %scalebits = zext i32 %sb32 to i64",
            _post(PREFILL_BF16 if bf16 else PREFILL, abi.PREFILL_JOB),
            "  call void @run_on(ptr %ctl, i64 %workers, i64 %threads)",
            "  ret void"]
    return (_exported(abi.part(f"prefill{sfx}"), "\n".join(out))
            + _exported(abi.PREFILL_BF16 if bf16 else abi.PREFILL, "\n".join(post)))



def _layout(bf16: bool) -> str:
    """layout(ctl, ks, vs, kstride, vstride, idx, n, padded, kvh, kt, vv, bf16, workers, threads): the
    prompt attention's K and V (`_prefill`'s layouts) from rows idx[0..n) of ks and vs (row r of
    head h at r * stride + h * 64 floats: a host pool's layer, K and V sharing a row), the keys
    padded to `padded` with zeros; items of 16 keys of one head split between the parts, each key
    block's columns gathered (`bf16`: the module has the bf16 form; `isbf16` asks for it)."""
    lanes = list(range(16))
    rows = []
    for i in lanes:
        rows += [f"  %key{i} = add i64 %j0, {i}",
                 f"  %ok{i} = icmp ult i64 %key{i}, %n",
                 f"  %jc{i} = select i1 %ok{i}, i64 %key{i}, i64 0",  # (a key past the end reads row idx[0], masked)
                 f"  %sp{i} = getelementptr i64, ptr %idx, i64 %jc{i}",
                 f"  %slot{i} = load i64, ptr %sp{i}, align 8",
                 f"  %ko{i}a = mul i64 %slot{i}, %kstride",
                 f"  %ko{i} = add i64 %ko{i}a, %goff",
                 f"  %kr{i} = getelementptr float, ptr %ks, i64 %ko{i}",
                 f"  %vo{i}a = mul i64 %slot{i}, %vstride",
                 f"  %vo{i} = add i64 %vo{i}a, %goff",
                 f"  %vr{i} = getelementptr float, ptr %vs, i64 %vo{i}",
                 f"  %krows{i} = insertelement <16 x ptr> {'poison' if i == 0 else f'%krows{i - 1}'}, ptr %kr{i}, "
                 f"i64 {i}",
                 f"  %valid{i} = insertelement <16 x i1> {'poison' if i == 0 else f'%valid{i - 1}'}, i1 %ok{i}, i64 {i}"]

    def value_row(name: str, i: int) -> list[str]:
        return [f"  %{name}l = load <64 x float>, ptr %vr{i}, align 4",
                f"  %{name} = select i1 %ok{i}, <64 x float> %{name}l, <64 x float> zeroinitializer"]

    f32 = ["kf32:",
           "  %d = phi i64 [0, %rows], [%d.next, %kf32]",
           "  %kpf = getelementptr float, <16 x ptr> %krows15, i64 %d",
           "  %kvf = call <16 x float> @llvm.masked.gather.v16f32.v16p0(<16 x ptr> %kpf, i32 4, <16 x i1> %valid15, "
           "<16 x float> zeroinitializer)",
           "  %kof = shl i64 %blk, 6",
           "  %kof2 = add i64 %kof, %d",
           "  %kof3 = shl i64 %kof2, 4",
           "  %ktf = getelementptr float, ptr %kt, i64 %kof3",
           "  store <16 x float> %kvf, ptr %ktf, align 4",
           "  %d.next = add i64 %d, 1",
           "  %dmore = icmp ult i64 %d.next, 64",
           "  br i1 %dmore, label %kf32, label %vf32",
           "vf32:",
           "  %vrow0 = mul i64 %g, %padded",
           "  %vrow = add i64 %vrow0, %j0"]
    for i in lanes:
        f32 += [*value_row(f"vf{i}", i),
                f"  %vfo{i}a = add i64 %vrow, {i}",
                f"  %vfo{i} = shl i64 %vfo{i}a, 6",
                f"  %vfp{i} = getelementptr float, ptr %vv, i64 %vfo{i}",
                f"  store <64 x float> %vf{i}, ptr %vfp{i}, align 4"]
    f32.append("  br label %itemdone")
    b16: list[str] = []
    if bf16:
        interleave = ", ".join(f"i32 {c // 2 + 64 * (c % 2)}" for c in range(128))
        b16 = ["kbf:",
               "  %p = phi i64 [0, %rows], [%p.next, %kbf]",
               "  %p2 = shl i64 %p, 1",
               "  %kpb = getelementptr float, <16 x ptr> %krows15, i64 %p2",
               "  %kvb = call <16 x i64> @llvm.masked.gather.v16i64.v16p0(<16 x ptr> %kpb, i32 4, <16 x i1> %valid15, "
               "<16 x i64> zeroinitializer)",
               "  %kvbf = bitcast <16 x i64> %kvb to <32 x float>",
               "  %kvbb = fptrunc <32 x float> %kvbf to <32 x bfloat>",
               "  %kob = shl i64 %blk, 5",
               "  %kob2 = add i64 %kob, %p",
               "  %kob3 = shl i64 %kob2, 5",
               "  %ktb = getelementptr i16, ptr %kt, i64 %kob3",
               "  store <32 x bfloat> %kvbb, ptr %ktb, align 2",
               "  %p.next = add i64 %p, 1",
               "  %pmore = icmp ult i64 %p.next, 32",
               "  br i1 %pmore, label %kbf, label %vbf",
               "vbf:",
               "  %halfpad = lshr i64 %padded, 1",
               "  %vpair0 = mul i64 %g, %halfpad",
               "  %kb8 = shl i64 %kb, 3",
               "  %vpair = add i64 %vpair0, %kb8"]
        for jp in range(8):
            b16 += [*value_row(f"va{jp}", 2 * jp), *value_row(f"vb{jp}", 2 * jp + 1),
                    f"  %vi{jp} = shufflevector <64 x float> %va{jp}, <64 x float> %vb{jp}, <128 x i32> <{interleave}>",
                    f"  %vib{jp} = fptrunc <128 x float> %vi{jp} to <128 x bfloat>",
                    f"  %vbo{jp}a = add i64 %vpair, {jp}",
                    f"  %vbo{jp} = shl i64 %vbo{jp}a, 7",
                    f"  %vbp{jp} = getelementptr i16, ptr %vv, i64 %vbo{jp}",
                    f"  store <128 x bfloat> %vib{jp}, ptr %vbp{jp}, align 2"]
        b16.append("  br label %itemdone")
    pick = ("  %wantbf = icmp ne i64 %isbf16, 0\n  br i1 %wantbf, label %kbf, label %kf32" if bf16
            else "  br label %kf32")
    return """
declare <16 x float> @llvm.masked.gather.v16f32.v16p0(<16 x ptr>, i32, <16 x i1>, <16 x float>)
declare <16 x i64> @llvm.masked.gather.v16i64.v16p0(<16 x ptr>, i32, <16 x i1>, <16 x i64>)

""" + _exported(abi.part("layout"), f"""entry:
{_job_loads(abi.LAYOUT_JOB)}
{_pointers("ks", "vs", "idx", "kt", "vv")}
  %nb = lshr i64 %padded, 4
  %items = mul i64 %kvh, %nb
{_share("items", "i0", "i1")}
  %none = icmp uge i64 %i0, %i1
  br i1 %none, label %exit, label %item
item:
  %it = phi i64 [%i0, %entry], [%it.next, %itemdone]
  %g = udiv i64 %it, %nb
  %kb = urem i64 %it, %nb
  %blk0 = mul i64 %g, %nb
  %blk = add i64 %blk0, %kb
  %j0 = shl i64 %kb, 4
  %goff = shl i64 %g, 6
  br label %rows
rows:
{chr(10).join(rows)}
{pick}
{chr(10).join(f32)}
{chr(10).join(b16)}
itemdone:
  %it.next = add i64 %it, 1
  %imore = icmp ult i64 %it.next, %i1
  br i1 %imore, label %item, label %exit
exit:
  ret void""") + _exported(abi.LAYOUT, f"""entry:
{_parts()}
{_addresses("ks", "vs", "idx", "kt", "vv")}
{_post(LAYOUT, abi.LAYOUT_JOB)}
  call void @run_on(ptr %ctl, i64 %workers, i64 %threads)
  ret void""")


def _write_rows() -> str:
    """write_rows(dst, drow, src, srow, slots, rows, width): copy row t of src (rows `srow` bytes
    apart) to row slots[t] of dst (rows `drow` bytes apart), `width` bytes each, on this thread."""
    return "\ndeclare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)\n" + _exported(abi.WRITE_ROWS, """entry:
  %none = icmp eq i64 %rows, 0
  br i1 %none, label %exit, label %row
row:
  %t = phi i64 [0, %entry], [%t.next, %row]
  %sp = getelementptr i64, ptr %slots, i64 %t
  %slot = load i64, ptr %sp, align 8
  %do = mul i64 %slot, %drow
  %d = getelementptr i8, ptr %dst, i64 %do
  %so = mul i64 %t, %srow
  %s = getelementptr i8, ptr %src, i64 %so
  call void @llvm.memcpy.p0.p0.i64(ptr %d, ptr %s, i64 %width, i1 false)
  %t.next = add i64 %t, 1
  %more = icmp ult i64 %t.next, %rows
  br i1 %more, label %row, label %exit
exit:
  ret void""")


def _swiglu() -> str:
    """swiglu(ctl, gu, y, inter, rows, workers, threads): y = silu(g) * u for fp32 rows [g | u] of
    2 * inter values (inter a multiple of 16), silu(g) = g / (1 + e^-g) with e^-|g| from `_exp2v`."""
    v = "<16 x float>"
    one = _splat("float", 16, "1.0")
    row = f"""  %go = mul i64 %r, %width
  %gr = getelementptr float, ptr %gu, i64 %go
  %ur = getelementptr float, ptr %gr, i64 %inter
  %yo = mul i64 %r, %inter
  %yr = getelementptr float, ptr %y, i64 %yo
  br label %col
col:
  %i = phi i64 [0, %row], [%i.next, %col]
  %gp = getelementptr float, ptr %gr, i64 %i
  %g = load {v}, ptr %gp, align 4
  %up = getelementptr float, ptr %ur, i64 %i
  %u = load {v}, ptr %up, align 4
  %a = call {v} @llvm.fabs.v16f32({v} %g)
  %xl = fmul {v} %a, {_splat('float', 16, _f32(-1 / math.log(2)))}
{chr(10).join(_exp2v("%xl", "t"))}
  %den = fadd {v} %t, {one}
  %neg = fcmp olt {v} %g, zeroinitializer
  %num = select <16 x i1> %neg, {v} %t, {v} {one}
  %sig = fdiv {v} %num, %den
  %silu = fmul {v} %g, %sig
  %out = fmul {v} %silu, %u
  %yp = getelementptr float, ptr %yr, i64 %i
  store {v} %out, ptr %yp, align 4
  %i.next = add i64 %i, 16
  %more = icmp ult i64 %i.next, %inter
  br i1 %more, label %col, label %rowdone"""
    return _row_job(abi.SWIGLU, SWIGLU, SWIGLU_ALONE, "  %width = shl i64 %inter, 1", row)


def _rotate() -> str:
    """rotate(ctl, x, cos, sin, y, dim, heads, rot, rows, workers, threads): for fp32 rows of dim 64 or
    128, `heads` a token (rows = tokens * heads), y = x * cos + roll(x, dim / 2) * sin for a token's
    first `rot` heads (its q and k: the rotary embedding, `RotaryBatch.rotate`) with the token's row
    of cos and sin, each product rounded, then the sum (the same values as those three torch ops);
    y = x for the rest (its v)."""
    v = "<16 x float>"
    out = ["  %ro = mul i64 %r, %dim",
           "  %xr = getelementptr float, ptr %x, i64 %ro",
           "  %yr = getelementptr float, ptr %y, i64 %ro",
           "  %tok = udiv i64 %r, %heads",
           "  %head = urem i64 %r, %heads",
           "  %to = mul i64 %tok, %dim",
           "  %cr = getelementptr float, ptr %c, i64 %to",
           "  %sr = getelementptr float, ptr %s, i64 %to",
           "  %turn = icmp ult i64 %head, %rot",
           "  br i1 %turn, label %turned, label %kept",
           "kept:",
           "  %width = shl i64 %dim, 2",
           "  call void @llvm.memcpy.p0.p0.i64(ptr %yr, ptr %xr, i64 %width, i1 false)",
           "  br label %rowdone",
           "turned:",
           "  br i1 %wide, label %d128, label %d64"]
    for dim in (64, 128):
        nv = dim // 16
        out.append(f"d{dim}:")
        for i in range(nv):
            out += [f"  %x{dim}_{i}.p = getelementptr float, ptr %xr, i64 {16 * i}",
                    f"  %x{dim}_{i} = load {v}, ptr %x{dim}_{i}.p, align 4"]
        for i in range(nv):
            out += [f"  %c{dim}_{i}.p = getelementptr float, ptr %cr, i64 {16 * i}",
                    f"  %c{dim}_{i} = load {v}, ptr %c{dim}_{i}.p, align 4",
                    f"  %s{dim}_{i}.p = getelementptr float, ptr %sr, i64 {16 * i}",
                    f"  %s{dim}_{i} = load {v}, ptr %s{dim}_{i}.p, align 4",
                    f"  %a{dim}_{i} = fmul {v} %x{dim}_{i}, %c{dim}_{i}",
                    f"  %b{dim}_{i} = fmul {v} %x{dim}_{(i + nv // 2) % nv}, %s{dim}_{i}",
                    f"  %o{dim}_{i} = fadd {v} %a{dim}_{i}, %b{dim}_{i}",
                    f"  %y{dim}_{i}.p = getelementptr float, ptr %yr, i64 {16 * i}",
                    f"  store {v} %o{dim}_{i}, ptr %y{dim}_{i}.p, align 4"]
        out.append("  br label %rowdone")
    return _row_job(abi.ROTATE, ROTATE, ROTATE_ALONE, "  %wide = icmp eq i64 %dim, 128", "\n".join(out))


STEP_FIELDS, LAYER_FIELDS = abi.STEP.names, abi.LAYER.names  # a decode step's struct, and a layer's
_STEP_POINTERS = ("residual", "x", "qkv", "rot", "att", "o", "gu", "act", "h", "cos", "sin", "slots", "idx", "lens",
                  "scratch", "layers", "tvals", "tscales")


def _decode_layers(tiled: bool) -> str:
    """decode_layers(ctl, step): the decoder layers of a CPU decode step of few rows (the row
    kernels' products), each op the native function the layer loop would call, in its order and on
    its buffers, so the results are the same to the bit: residual += h (after the first layer);
    x = rms_norm(residual); qkv; rotary over q, k and v heads (v as they are); the step's K/V rows
    into the pool layer; decode attention; residual += o_proj; x = rms_norm(residual); gate/up;
    SwiGLU; h = down_proj. fp32 only. A product runs on the row kernels up to MAX_ROWS rows, on the
    tiles above (`tiled`: the module has them; the products' outputs then have `mpad` rows).
    `add_rows(x, y, n)`: x += y over n floats."""
    v = "<16 x float>"
    step = "\n".join(f"  %{name}.s = inttoptr i64 %{name} to ptr" for name in _STEP_POINTERS)

    def norm(weight: str, eps: str) -> str:
        return abi.RMS_NORM.call(dict(ctl="%ctl", x="%residual.s", w=weight, y="%x.s", k="%hidden", eps=eps, rows="%m",
                                      workers="%workers", threads="0"))
    return f"""
define internal void @add_rows(ptr %x, ptr %y, i64 %n) {{
entry:
  %none = icmp eq i64 %n, 0
  br i1 %none, label %exit, label %loop
loop:
  %i = phi i64 [0, %entry], [%i.next, %loop]
  %xp = getelementptr float, ptr %x, i64 %i
  %xv = load {v}, ptr %xp, align 4
  %yp = getelementptr float, ptr %y, i64 %i
  %yv = load {v}, ptr %yp, align 4
  %sv = fadd {v} %xv, %yv
  store {v} %sv, ptr %xp, align 4
  %i.next = add i64 %i, 16
  %more = icmp ult i64 %i.next, %n
  br i1 %more, label %loop, label %exit
exit:
  ret void
}}

define internal void @matmul(ptr %ctl, i64 %rowdesc, i64 %tiledesc, ptr %x, ptr %y, i64 %m, i64 %mpad,
                             i64 %workers, ptr %tvals, ptr %tscales) {{
entry:
  %few = icmp ule i64 %m, {MAX_ROWS}
  %notiles = icmp eq i64 %tiledesc, 0
  %rows = or i1 %few, %notiles
  br i1 %rows, label %rowk, label %tiled
rowk:
  %rd = inttoptr i64 %rowdesc to ptr
{abi.PRODUCT.call(dict(ctl="%ctl", desc="%rd", x="%x", y="%y", m="%m", workers="%workers"))}
  ret void
tiled:
{"  %td = inttoptr i64 %tiledesc to ptr" if tiled else ""}
{abi.TILES.call(dict(ctl="%ctl", desc="%td", x="%x", y="%y", m="%m", mpad="%mpad", workers="%workers", aq="%tvals",
                     asc="%tscales", omp="0")) if tiled else ""}
  ret void
}}

""" + _exported(abi.DECODE_LAYERS, f"""entry:
{abi.STEP.load("%step")}
{step}
  %s32 = trunc i64 %scalebits to i32
  %scale = bitcast i32 %s32 to float
  %mh = mul i64 %m, %hidden
  %allheads = add i64 %heads, %kvheads
  %allheads2 = add i64 %allheads, %kvheads
  %rotrows = mul i64 %m, %allheads2
  %qstride = mul i64 %allheads2, %d
  %kvwidth0 = mul i64 %kvheads, %d
  %kvstride = shl i64 %kvwidth0, 1
  %kvbytes = shl i64 %kvstride, 2
  %rowbytes = shl i64 %qstride, 2
  %koff = mul i64 %heads, %d
  %krot = getelementptr float, ptr %rot.s, i64 %koff
  %items = mul i64 %m, %heads
  %none = icmp eq i64 %count, 0
  br i1 %none, label %exit, label %layer
layer:
  %l = phi i64 [0, %entry], [%l.next, %layer]
  %ld = getelementptr {abi.LAYER.ir_name}, ptr %layers.s, i64 %l
{abi.LAYER.load("%ld")}
  %norm1.p2 = inttoptr i64 %norm1 to ptr
  %norm2.p2 = inttoptr i64 %norm2 to ptr
  %kv = inttoptr i64 %kvlayer to ptr
  %e1 = trunc i64 %eps1bits to i32
  %eps1 = bitcast i32 %e1 to float
  %e2 = trunc i64 %eps2bits to i32
  %eps2 = bitcast i32 %e2 to float
  %first = icmp eq i64 %l, 0
  %addn = select i1 %first, i64 0, i64 %mh
  call void @add_rows(ptr %residual.s, ptr %h.s, i64 %addn)
{norm("%norm1.p2", "%eps1")}
  call void @matmul(ptr %ctl, i64 %qkvdesc, i64 %qkvtiles, ptr %x.s, ptr %qkv.s, i64 %m, i64 %mpad, i64 %workers,
                    ptr %tvals.s, ptr %tscales.s)
{abi.ROTATE.call(dict(ctl="%ctl", x="%qkv.s", c="%cos.s", s="%sin.s", y="%rot.s", dim="%d", heads="%allheads2",
                       rot="%allheads", rows="%rotrows", workers="%workers", threads="0"))}
{abi.WRITE_ROWS.call(dict(dst="%kv", drow="%kvbytes", src="%krot", srow="%rowbytes", slots="%slots.s", rows="%m",
                          width="%kvbytes"))}
{abi.ATTENTION.call(dict(ctl="%ctl", q="%rot.s", qstride="%qstride", kv="%kv", kvstride="%kvstride", idx="%idx.s",
                         maxkv="%maxkv", lens="%lens.s", out="%att.s", items="%items", heads="%heads",
                         kvheads="%kvheads", scale="%scale", scratch="%scratch.s", sstride="%sstride",
                         workers="%workers", dim="%d", f32="1"))}
  call void @matmul(ptr %ctl, i64 %odesc, i64 %otiles, ptr %att.s, ptr %o.s, i64 %m, i64 %mpad, i64 %workers,
                    ptr %tvals.s, ptr %tscales.s)
  call void @add_rows(ptr %residual.s, ptr %o.s, i64 %mh)
{norm("%norm2.p2", "%eps2")}
  call void @matmul(ptr %ctl, i64 %gudesc, i64 %gutiles, ptr %x.s, ptr %gu.s, i64 %m, i64 %mpad, i64 %workers,
                    ptr %tvals.s, ptr %tscales.s)
{abi.SWIGLU.call(dict(ctl="%ctl", gu="%gu.s", y="%act.s", inter="%inter", rows="%m", workers="%workers", threads="0"))}
  call void @matmul(ptr %ctl, i64 %downdesc, i64 %downtiles, ptr %act.s, ptr %h.s, i64 %m, i64 %mpad, i64 %workers,
                    ptr %tvals.s, ptr %tscales.s)
  %l.next = add i64 %l, 1
  %more = icmp ult i64 %l.next, %count
  br i1 %more, label %layer, label %exit
exit:
  ret void""")


def _row_job(function: abi.Function, op: int, alone: int, setup: str, row: str) -> str:
    """@{name}_rows(<params>, r0, r1): `row`'s IR for each row %r of r0..r1 (from label `row`, it
    ends by branching to %rowdone; `setup` runs once before); {name}(ctl, <params>, rows, workers,
    threads) and {name}_part(ctl, index): those rows split between the parts (`run_on`), or on the
    caller alone below `alone` rows. The params are `function`'s (native_abi.row_params: ptr, i64
    or float); its job (native_abi.row_job) holds each as an i64."""
    name, job = function.name, abi.row_job(function)
    params = tuple((p.name, p.ir_type) for p in abi.row_params(function))
    unpack = {"ptr": "  %{p} = inttoptr i64 %f_{p} to ptr",
              "i64": "  %{p} = add i64 %f_{p}, 0",
              "float": "  %{p}.t = trunc i64 %f_{p} to i32\n  %{p} = bitcast i32 %{p}.t to float"}
    pack = {"ptr": "  %f_{p} = ptrtoint ptr %{p} to i64",
            "i64": "  %f_{p} = add i64 %{p}, 0",
            "float": "  %{p}.t = bitcast float %{p} to i32\n  %f_{p} = zext i32 %{p}.t to i64"}
    signature = ", ".join(f"{kind} %{p}" for p, kind in params)
    return f"""
define internal void @{name}_rows({signature}, i64 %r0, i64 %r1) {{
entry:
  %none = icmp uge i64 %r0, %r1
{setup}
  br i1 %none, label %exit, label %row
row:
  %r = phi i64 [%r0, %entry], [%r.next, %rowdone]
{row}
rowdone:
  %r.next = add i64 %r, 1
  %rmore = icmp ult i64 %r.next, %r1
  br i1 %rmore, label %row, label %exit
exit:
  ret void
}}

""" + _exported(abi.part(name), f"""entry:
{_job_loads(job)}
{chr(10).join(unpack[kind].format(p=p) for p, kind in params)}
{_share("rows", "r0", "r1")}
  call void @{name}_rows({signature}, i64 %r0, i64 %r1)
  ret void""") + _exported(function, f"""entry:
  %alone = icmp ult i64 %rows, {alone}
  br i1 %alone, label %here, label %shared
here:
  call void @{name}_rows({signature}, i64 0, i64 %rows)
  ret void
shared:
{_parts()}
{chr(10).join(pack[kind].format(p=p) for p, kind in params)}
{_post(op, job)}
  call void @run_on(ptr %ctl, i64 %workers, i64 %threads)
  ret void""")


def _job_loads(job: abi.Struct) -> str:
    """%name: each field of the posted `job`, loaded from the control block's job area."""
    return abi.CONTROL.gep("jobarea", "%ctl", "job", "i64 0") + "\n" + job.load("%jobarea")


def _pointers(*names: str) -> str:
    """%name: the pointer a job's field %{name}i holds, for each name."""
    return "\n".join(f"  %{name} = inttoptr i64 %{name}i to ptr" for name in names)


def _addresses(*names: str) -> str:
    """%{name}i: pointer %name as a job's field holds it, for each name."""
    return "\n".join(f"  %{name}i = ptrtoint ptr %{name} to i64" for name in names)


def _parts(threads: str = "%threads") -> str:
    """%parts: the job's parts, one a thread: the OpenMP pool's `threads`, or (0) our workers and the caller."""
    return (f"  %ours = add i64 %workers, 1\n  %inomp = icmp ne i64 {threads}, 0\n"
            f"  %parts = select i1 %inomp, i64 {threads}, i64 %ours")


def _post(op: int, job: abi.Struct) -> str:
    """Store a `job` into the control block's job area: `op`, then the caller's values %name of
    its other fields."""
    values = {"op": str(op), **{name: f"%{name}" for name in job.names[1:]}}
    return abi.CONTROL.gep(f"jobarea{op}", "%ctl", "job", "i64 0") + "\n" + job.store(f"%jobarea{op}", values, f"job{op}_")


def _share(total: str, first: str, last: str) -> str:
    """The range [first, last) of `total` items that part %index of %parts takes."""
    return (f"  %{first}.lo = mul i64 %{total}, %index\n  %{first} = udiv i64 %{first}.lo, %parts\n"
            f"  %{last}.index = add i64 %index, 1\n  %{last}.hi = mul i64 %{total}, %{last}.index\n"
            f"  %{last} = udiv i64 %{last}.hi, %parts")


def _product_part() -> str:
    """product_part(ctl, index): the posted product's output rows of part `index` of `parts`."""
    cases, blocks = [], []
    for f32, act in enumerate(ACTS):
        for bits in CHUNK_BYTES:
            for m in range(1, MAX_ROWS + 1):
                label = f"{act}b{bits}m{m}"
                cases.append(f"i64 {f32 * 1000 + bits * 8 + m}, label %{label}")
                blocks.append(f"{label}:\n  call void @rows_{act}_{bits}_{m}(ptr %w, ptr %aq, ptr %asc, ptr %y, "
                              "i64 %n0, i64 %n1, i64 %nch, i64 %n)\n  br label %exit")
    return _exported(abi.part("product"), f"""entry:
{_job_loads(abi.PRODUCT_JOB)}
  %desc = inttoptr i64 %desci to ptr
  %y = inttoptr i64 %yi to ptr
{abi.DESCRIPTOR.load("%desc")}
  %w = inttoptr i64 %wi to ptr
  %aq = inttoptr i64 %aqi to ptr
  %asc = inttoptr i64 %asci to ptr
{_share("n", "n0", "n1")}
  %b8 = shl i64 %bits, 3
  %bm = add i64 %b8, %m
  %f32k = mul i64 %f32, 1000
  %kind = add i64 %f32k, %bm
  switch i64 %kind, label %exit [ {" ".join(cases)} ]
{chr(10).join(blocks)}
exit:
  ret void""")


def _product_attention() -> str:
    """product(ctl, desc, x, y, m, workers): the activations quantized on this thread, the product
    posted (`product_part`); attention(ctl, q, ...): the decode attention posted (`attention_part`)."""
    product = f"""entry:
{abi.DESCRIPTOR.load("%desc", ("aqi", "asci", "nch", "f32"))}
  %aq = inttoptr i64 %aqi to ptr
  %asc = inttoptr i64 %asci to ptr
  %blocks0 = mul i64 %m, %nch
  %blocks = shl i64 %blocks0, 1
  %isf32 = icmp ne i64 %f32, 0
  br i1 %isf32, label %qf32, label %qbf16
qf32:
  call void @quantize_f32(ptr %x, ptr %aq, ptr %asc, i64 %blocks)
  br label %post
qbf16:
  call void @quantize_bf16(ptr %x, ptr %aq, ptr %asc, i64 %blocks)
  br label %post
post:
  %parts = add i64 %workers, 1
  %desci = ptrtoint ptr %desc to i64
  %yi = ptrtoint ptr %y to i64
{_post(PRODUCT, abi.PRODUCT_JOB)}
  call void @run_job(ptr %ctl, i64 %workers)
  ret void"""
    attention = f"""entry:
  %parts = add i64 %workers, 1
{_addresses("q", "kv", "idx", "lens", "out", "scratch")}
  %scale32 = bitcast float %scale to i32
  %scalebits = zext i32 %scale32 to i64
{_post(ATTENTION, abi.ATTENTION_JOB)}
  call void @run_job(ptr %ctl, i64 %workers)
  ret void"""
    return _exported(abi.PRODUCT, product) + _exported(abi.ATTENTION, attention)


def _f32(value: float) -> str:
    """An LLVM float constant (hex of the double holding the float32-rounded value)."""
    return "0x" + struct.pack(">d", struct.unpack("<f", struct.pack("<f", value))[0]).hex().upper()


def _exp2() -> str:
    """exp2(x) for x <= 0: 2^floor(x) times a degree-7 polynomial of the fraction (relative error
    ~2e-6, far below bf16's 4e-3); below -126 the result flushes toward 0."""
    coefficients = [math.log(2) ** k / math.factorial(k) for k in range(8)]
    poly = ["  %p7 = fadd float 0.0, " + _f32(coefficients[7])]
    for k in range(6, -1, -1):
        poly.append(f"  %m{k} = fmul float %p{k + 1}, %f\n  %p{k} = fadd float %m{k}, {_f32(coefficients[k])}")
    return f"""
define internal float @exp2_neg(float %x0) alwaysinline {{
entry:
  %x = call float @llvm.maxnum.f32(float %x0, float -126.0)
  %n = call float @llvm.floor.f32(float %x)
  %f = fsub float %x, %n
{chr(10).join(poly)}
  %ni = fptosi float %n to i32
  %e = add i32 %ni, 127
  %eb = shl i32 %e, 23
  %two = bitcast i32 %eb to float
  %r = fmul float %p0, %two
  ret float %r
}}
"""


_ELEMENT = {"bf16": "i16", "f32": "float"}  # the IR element type an activation dtype is addressed as


def _vectors(act: str, pointer: str, name: str, count: int) -> list[str]:
    """Load count * 16 values of `act` at `pointer` as <16 x float> vectors %{name}0..."""
    if act == "f32":
        return [f"  %{name}{v}.p = getelementptr float, ptr {pointer}, i64 {16 * v}\n"
                f"  %{name}{v} = load <16 x float>, ptr %{name}{v}.p, align 4" for v in range(count)]
    out = []
    for v in range(count):
        out += [f"  %{name}{v}.p = getelementptr i16, ptr {pointer}, i64 {16 * v}",
                f"  %{name}{v}.h = load <16 x i16>, ptr %{name}{v}.p, align 2",
                f"  %{name}{v}.w = zext <16 x i16> %{name}{v}.h to <16 x i32>",
                f"  %{name}{v}.s = shl <16 x i32> %{name}{v}.w, {_splat('i32', 16, 16)}",
                f"  %{name}{v} = bitcast <16 x i32> %{name}{v}.s to <16 x float>"]
    return out


def _attend(dim: int, act: str) -> str:
    """attend_{act}_{dim}(...): decode attention of items i0..i1 (item = sequence b, query head h)
    over the sequence's keys in the host pool (a slot's row: K heads, then V heads, `act`), without
    a gather: scores into `scratch`, their max, then exp2 weights and the V sum in one pass."""
    nv, el = dim // 16, _ELEMENT[act]
    out = [f"define void @attend_{act}_{dim}(ptr %q, i64 %qstride, ptr %kv, i64 %kvstride, ptr %idx, i64 %maxkv, "
           "ptr %lens, ptr %out, i64 %heads, i64 %kvheads, float %scale, ptr %scratch, i64 %i0, i64 %i1) {",
           "entry:",
           "  %group = udiv i64 %heads, %kvheads",
           "  %scale2 = fmul float %scale, " + _f32(1 / math.log(2)),
           *_broadcast("s2v", "%scale2", 16),
           "  %none = icmp uge i64 %i0, %i1",
           "  br i1 %none, label %exit, label %item",
           "item:",
           "  %i = phi i64 [%i0, %entry], [%i.next, %stored]",
           "  %b = udiv i64 %i, %heads",
           "  %h = urem i64 %i, %heads",
           "  %g = udiv i64 %h, %group",
           "  %lenp = getelementptr i64, ptr %lens, i64 %b",
           "  %len = load i64, ptr %lenp, align 8",
           "  %qrow = mul i64 %b, %qstride",
           f"  %qh = mul i64 %h, {dim}",
           "  %qo = add i64 %qrow, %qh",
           f"  %qp = getelementptr {el}, ptr %q, i64 %qo",
           f"  %ko = mul i64 %g, {dim}",
           "  %vg = add i64 %g, %kvheads",
           f"  %vo = mul i64 %vg, {dim}",
           "  %ib = mul i64 %b, %maxkv",
           "  %idxb = getelementptr i64, ptr %idx, i64 %ib"]
    out += _vectors(act, "%qp", "qr", nv)
    out += [f"  %qv{v} = fmul <16 x float> %qr{v}, %s2v" for v in range(nv)]
    out += ["  %empty = icmp eq i64 %len, 0",
            "  br i1 %empty, label %stored, label %score",
            "score:",
            "  %j = phi i64 [0, %item], [%j.next, %score]",
            "  %mx = phi float [" + _f32(-3.0e38) + ", %item], [%mx.next, %score]",
            "  %slotp = getelementptr i64, ptr %idxb, i64 %j",
            "  %slot = load i64, ptr %slotp, align 8",
            "  %row = mul i64 %slot, %kvstride",
            "  %kro = add i64 %row, %ko",
            f"  %kp = getelementptr {el}, ptr %kv, i64 %kro"]
    out += _vectors(act, "%kp", "k", nv)
    out.append("  %t0 = fmul <16 x float> %qv0, %k0")
    out += [f"  %t{v} = call <16 x float> @llvm.fma.v16f32(<16 x float> %qv{v}, <16 x float> %k{v}, "
            f"<16 x float> %t{v - 1})" for v in range(1, nv)]
    out += [f"  %sc = call reassoc float @llvm.vector.reduce.fadd.v16f32(float -0.0, <16 x float> %t{nv - 1})",
            "  %scp = getelementptr float, ptr %scratch, i64 %j",
            "  store float %sc, ptr %scp, align 4",
            "  %mx.next = call float @llvm.maxnum.f32(float %mx, float %sc)",
            "  %j.next = add i64 %j, 1",
            "  %more = icmp ult i64 %j.next, %len",
            "  br i1 %more, label %score, label %weigh",
            "weigh:",
            "  %jj = phi i64 [0, %score], [%jj.next, %weigh]",
            "  %sum = phi float [0.0, %score], [%sum.next, %weigh]"]
    out += [f"  %acc{v} = phi <16 x float> [zeroinitializer, %score], [%acc{v}.next, %weigh]" for v in range(nv)]
    out += ["  %wsp = getelementptr float, ptr %scratch, i64 %jj",
            "  %ws = load float, ptr %wsp, align 4",
            "  %wd = fsub float %ws, %mx.next",
            "  %pw = call float @exp2_neg(float %wd)",
            "  %sum.next = fadd float %sum, %pw",
            *_broadcast("pwv", "%pw", 16),
            "  %vslotp = getelementptr i64, ptr %idxb, i64 %jj",
            "  %vslot = load i64, ptr %vslotp, align 8",
            "  %vrow = mul i64 %vslot, %kvstride",
            "  %vro = add i64 %vrow, %vo",
            f"  %vp = getelementptr {el}, ptr %kv, i64 %vro"]
    out += _vectors(act, "%vp", "v", nv)
    out += [f"  %acc{v}.next = call <16 x float> @llvm.fma.v16f32(<16 x float> %pwv, <16 x float> %v{v}, "
            f"<16 x float> %acc{v})" for v in range(nv)]
    out += ["  %jj.next = add i64 %jj, 1",
            "  %wmore = icmp ult i64 %jj.next, %len",
            "  br i1 %wmore, label %weigh, label %normalize",
            "normalize:",
            "  %inv = fdiv float 1.0, %sum.next",
            *_broadcast("invv", "%inv", 16),
            "  %ob = mul i64 %i, " + str(dim),
            f"  %op = getelementptr {el}, ptr %out, i64 %ob"]
    for v in range(nv):
        out += [f"  %o{v} = fmul <16 x float> %acc{v}.next, %invv"]
        if act == "f32":
            out += [f"  %op{v} = getelementptr float, ptr %op, i64 {16 * v}",
                    f"  store <16 x float> %o{v}, ptr %op{v}, align 4"]
        else:
            out += [*_to_bf16(f"%o{v}", f"ob{v}", 16),
                    f"  %op{v} = getelementptr i16, ptr %op, i64 {16 * v}",
                    f"  store <16 x i16> %ob{v}, ptr %op{v}, align 2"]
    out += ["  br label %stored",
            "stored:",
            "  %i.next = add i64 %i, 1",
            "  %items = icmp ult i64 %i.next, %i1",
            "  br i1 %items, label %item, label %exit",
            "exit:",
            "  ret void",
            "}"]
    return "\n".join(out) + "\n"


def _attention_part() -> str:
    """attention_part(ctl, index): the posted attention's items of part `index`, with the part's
    own scratch row."""
    kinds = [(f32, act, d) for f32, act in enumerate(ACTS) for d in HEAD_DIMS]
    cases = " ".join(f"i64 {f32 * 1000 + d}, label %{act}d{d}" for f32, act, d in kinds)
    blocks = "\n".join(f"{act}d{d}:\n  call void @attend_{act}_{d}(ptr %q, i64 %qstride, ptr %kv, i64 %kvstride, "
                       "ptr %idx, i64 %maxkv, ptr %lens, ptr %out, i64 %heads, i64 %kvheads, float %scale, ptr %scr, "
                       "i64 %i0, i64 %i1)\n  br label %exit" for f32, act, d in kinds)
    return _exported(abi.part("attention"), f"""entry:
{_job_loads(abi.ATTENTION_JOB)}
{_pointers("q", "kv", "idx", "lens", "out", "scratch")}
  %scale32 = trunc i64 %scalebits to i32
  %scale = bitcast i32 %scale32 to float
  %so = mul i64 %sstride, %index
  %scr = getelementptr float, ptr %scratch, i64 %so
{_share("items", "i0", "i1")}
  %f32k = mul i64 %f32, 1000
  %kind = add i64 %f32k, %dim
  switch i64 %kind, label %exit [ {cases} ]
{blocks}
exit:
  ret void""")


def module_ir(isa: str = "avx512", omp: bool = False, bf16: bool = False) -> str:
    """The module for processors with `isa` (one of ISAS); `omp`: the tiled products may run on
    the OpenMP pool (GOMP_parallel, omp_get_thread_num and omp_get_num_threads resolve); `bf16`:
    also the bf16 prompt attention (AVX-512 BF16 processors)."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}; choose one of {', '.join(ISAS)}")
    if bf16 and isa != "avx512":
        raise ValueError("the bf16 prompt attention needs the AVX-512 module")
    rows = "".join(_rows(bits, m, act, isa) for act in ACTS for bits in CHUNK_BYTES for m in range(1, MAX_ROWS + 1))
    attention = _exp2() + "".join(_attend(d, act) for act in ACTS for d in HEAD_DIMS) + _attention_part()
    quantize = "".join(_quantize(act) for act in ACTS)
    tiles = ("".join(_tile(bits, act, isa) for act in ACTS for bits in TILE_BYTES) + _tiles_part()
             if isa in TILE_ISAS else "")
    prefill = _prefill(isa) + _layout(bf16) if isa in PREFILL_ISAS else ""
    if bf16:
        prefill += (f"declare <16 x float> {DPBF16}(<16 x float>, <32 x bfloat>, <32 x bfloat>)\n"
                    + _prefill(isa, bf16=True))
    parts = {PRODUCT: "product", NORM: "rms_norm", ROTATE: "rotate", SWIGLU: "swiglu"}
    if tiles:
        parts |= {TILES: "tiles", QUANTIZE: "quantize"}
    if prefill:
        parts |= {PREFILL: "prefill", LAYOUT: "layout"}
    if bf16:
        parts |= {PREFILL_BF16: "prefill_bf16"}
    return (abi.type_definitions() + _DOTS[isa] + _HEADER + thread_pool.DECLARATIONS + quantize + rows
            + _product_part() + attention + tiles + _norm() + _rotate() + _swiglu() + _write_rows()
            + _decode_layers(bool(tiles)) + prefill + _product_attention()
            + thread_pool.module_ir(parts, "attention", omp and bool(tiles), _TYPES))
