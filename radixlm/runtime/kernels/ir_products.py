"""LLVM IR text of the CPU's block-quantized products of few activation rows (up to MAX_ROWS a call).

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

The activations are quantized on the calling thread (`quantize_{act}`), then the product is
posted (`product`) and its output rows shared between the parts (`product_part`); ir_tiles.py
holds the tiled products of many rows, which read the same quantized activations.
"""

from __future__ import annotations

from radixlm.runtime.kernels import native_abi as abi
from radixlm.runtime.kernels.ir_pieces import (
    ACTS,
    PRODUCT,
    _broadcast,
    _exported,
    _job_loads,
    _mask,
    _post,
    _share,
    _splat,
    _to_bf16,
)

CHUNK = 64  # weights per chunk (two blocks of 32)
MAX_ROWS = 4  # activation rows one call multiplies (each weight chunk read once for all)
BUSY_ROWS = 32  # steps of up to this many rows on the kernels run as one busy stretch (native.busy)
CHUNK_BYTES = {4: 40, 8: 72}
# a chunk's loads prefetch the weights this many bytes (times the rows an iteration) ahead: the
# hardware prefetcher alone does not keep up with short rows (docs/machines.md)
PREFETCH = 2048
DESC_FIELDS = abi.DESCRIPTOR.names  # a matrix's descriptor (int64s)


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


def entry() -> str:
    """product(ctl, desc, x, y, m, workers): the activations quantized on this thread, the product
    posted (`product_part`)."""
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
    return _exported(abi.PRODUCT, product)


def functions(isa: str) -> str:
    """The activations' quantization (`quantize_{act}`), the row products of 1..MAX_ROWS activation
    rows for each activation dtype and weight width (`rows_{act}_{bits}_{m}`), and `product_part`."""
    rows = "".join(_rows(bits, m, act, isa) for act in ACTS for bits in CHUNK_BYTES for m in range(1, MAX_ROWS + 1))
    return "".join(_quantize(act) for act in ACTS) + rows + _product_part()
