"""LLVM IR text of the CPU's tiled block-quantized products of many activation rows (AVX-512
VNNI, or AVX2): TILE_N output rows by TILE_M activation rows at a time, the weights stored tile by
tile. `tiles` quantizes the activations in parts (`quantize_part`), zeroes the rows that pad them
to TILE_M and shares the output tiles between the parts (`tiles_part`).
"""

from __future__ import annotations

from radixlm.runtime.kernels import native_abi as abi
from radixlm.runtime.kernels.ir_pieces import (
    ACTS,
    QUANTIZE,
    TILES,
    _broadcast,
    _exported,
    _job_loads,
    _parts,
    _post,
    _share,
    _splat,
    _splat_i32,
    _to_bf16,
)
from radixlm.runtime.kernels.ir_products import PREFETCH

# TILE_N output rows by TILE_M activation rows at a time, the weights stored tile by tile (per block
# of 32 along K: TILE_N rows' integers laid out for `vpdpbusd` with one activation broadcast, then
# their fp16 scales and minimums)
TILE_N, TILE_M = 16, 8
TILE_BYTES = {4: TILE_N * 32 // 2 + 4 * TILE_N, 8: TILE_N * 32 + 4 * TILE_N}
TILE_ISAS = ("avx512", "avx2")
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


def functions(isa: str) -> str:
    """The tiled products for each activation dtype and weight width (`tile_{act}_{bits}`), and
    `tiles`, `tiles_part` and `quantize_part`."""
    return "".join(_tile(bits, act, isa) for act in ACTS for bits in TILE_BYTES) + _tiles_part()
