"""LLVM IR text of the CPU's block-quantized products (compiled by radixlm.runtime.kernels.native).

The weights are blocks of 32 along K, w = d * u + m with u an unsigned 4- or 8-bit integer (GGUF
Q4_1 as it is; Q4_0 and Q8_0 with m = -8 d and -128 d). The activations are quantized the same
way llama.cpp does at batch 1, to int8 per block of 32 (a = da * qa), so a block's product is
one integer dot product, AVX-512 VNNI's `vpdpbusd` (unsigned bytes times signed bytes):

    sum_i w_i a_i = d da sum_i u_i qa_i + m (da sum_i qa_i)

A weight row is stored as chunks of 64 weights (two blocks) followed by the chunk's scales as
four fp16 [d0, d1, m0, m1]: 4-bit chunks hold block 0 in the low nibbles and block 1 in the high
ones (40 bytes), 8-bit chunks the 64 bytes as they are (72 bytes). The activations' scales come
per chunk as four fp32 [da0, da1, sa0, sa1] with sa = da * sum qa, so the chunk's scale products
are one 4-wide multiply. The products write bf16.

A product splits its output rows between the calling thread and `workers` threads that wait in
`worker` (spinning while a forward pass is marked busy, else asleep on a futex): one call per
product, no Python between the parts.
"""

from __future__ import annotations

CHUNK = 64  # weights per chunk (two blocks of 32)
MAX_ROWS = 4  # activation rows one call multiplies (each weight chunk read once for all)
CHUNK_BYTES = {4: 40, 8: 72}
SPIN_BUSY = 200_000  # pause loops a worker spins for the next product while a forward pass is busy
SPIN_IDLE = 64  # ... and otherwise, before it sleeps

# the control block (int64 slots; each group on its own cache line)
SEQ, STOP, BUSY = 0, 8, 9
JOB = 16  # the posted job: JOB_FIELDS
JOB_FIELDS = ("desci", "m", "yi", "parts")
DESC_FIELDS = ("bits", "wi", "aqi", "asci", "n", "nch")  # a matrix's descriptor (int64s)
DONE = 32  # + 8 * worker: the last job done; + 1: asleep
CONTROL_SLOTS = DONE + 8 * 64


def _splat(t: str, n: int, v: int | str) -> str:
    return "<" + ", ".join([f"{t} {v}"] * n) + ">"


def _mask(values: list[int]) -> str:
    return f"<{len(values)} x i32> <" + ", ".join(f"i32 {v}" for v in values) + ">"


_HEADER = """
declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <16 x i32>, <16 x i32>)
declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)
declare float @llvm.vector.reduce.fadd.v16f32(float, <16 x float>)
declare <32 x float> @llvm.fabs.v32f32(<32 x float>)
declare float @llvm.vector.reduce.fmax.v32f32(<32 x float>)
declare <32 x float> @llvm.rint.v32f32(<32 x float>)
declare i32 @llvm.vector.reduce.add.v32i32(<32 x i32>)
declare void @llvm.x86.sse2.pause()
declare i64 @syscall(i64, ...)
"""


def _quantize() -> str:
    """quantize(x bf16, aq i8, asc f32, blocks): a = da * qa per block of 32, qa in -127..127
    rounded to nearest even; asc per pair of blocks [da0, da1, sa0, sa1]."""
    return f"""
define void @quantize(ptr %x, ptr %aq, ptr %asc, i64 %blocks) {{
entry:
  br label %loop
loop:
  %b = phi i64 [0, %entry], [%b.next, %loop]
  %o = mul i64 %b, 32
  %xp = getelementptr i16, ptr %x, i64 %o
  %xv = load <32 x i16>, ptr %xp, align 2
  %xw = zext <32 x i16> %xv to <32 x i32>
  %xs = shl <32 x i32> %xw, {_splat("i32", 32, 16)}
  %xf = bitcast <32 x i32> %xs to <32 x float>
  %ab = call <32 x float> @llvm.fabs.v32f32(<32 x float> %xf)
  %mx = call float @llvm.vector.reduce.fmax.v32f32(<32 x float> %ab)
  %d = fdiv float %mx, 127.0
  %nz = fcmp ogt float %mx, 0.0
  %inv = fdiv float 127.0, %mx
  %id = select i1 %nz, float %inv, float 0.0
  %idi = insertelement <32 x float> poison, float %id, i64 0
  %idv = shufflevector <32 x float> %idi, <32 x float> poison, <32 x i32> zeroinitializer
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


def _rows(bits: int, m: int) -> str:
    """rows_{bits}_{m}(w, aq, asc, y, n0, n1, nch, n): output rows n0..n1 of m activation rows."""
    cb, scales = CHUNK_BYTES[bits], CHUNK_BYTES[bits] - 8
    out = [f"define void @rows_{bits}_{m}(ptr %w, ptr %aq, ptr %asc, ptr %y, i64 %n0, i64 %n1, "
           "i64 %nch, i64 %n) {",
           "entry:",
           f"  %rowbytes = mul i64 %nch, {cb}",
           "  %k = shl i64 %nch, 6",
           "  %sstride = shl i64 %nch, 2",
           "  %empty = icmp uge i64 %n0, %n1",
           "  br i1 %empty, label %exit, label %row",
           "row:",
           "  %r = phi i64 [%n0, %entry], [%r.next, %rowend]",
           "  %ro = mul i64 %r, %rowbytes",
           "  %wrow = getelementptr i8, ptr %w, i64 %ro",
           "  br label %chunk",
           "chunk:",
           "  %c = phi i64 [0, %row], [%c.next, %chunk]"]
    for j in range(m):
        out += [f"  %acc{j} = phi <16 x float> [zeroinitializer, %row], [%accn{j}, %chunk]",
                f"  %mac{j} = phi <4 x float> [zeroinitializer, %row], [%macn{j}, %chunk]"]
    out += [f"  %co = mul i64 %c, {cb}",
            "  %wp = getelementptr i8, ptr %wrow, i64 %co"]
    if bits == 4:
        out += ["  %wv = load <32 x i8>, ptr %wp, align 1",
                f"  %lo = and <32 x i8> %wv, {_splat('i8', 32, 15)}",
                f"  %hi = lshr <32 x i8> %wv, {_splat('i8', 32, 4)}",
                f"  %w64 = shufflevector <32 x i8> %lo, <32 x i8> %hi, {_mask(list(range(64)))}"]
    else:
        out += ["  %w64 = load <64 x i8>, ptr %wp, align 1"]
    out += ["  %wi = bitcast <64 x i8> %w64 to <16 x i32>",
            f"  %shp = getelementptr i8, ptr %wp, i64 {scales}",
            "  %sh = load <4 x half>, ptr %shp, align 2",
            "  %sf = fpext <4 x half> %sh to <4 x float>",
            "  %ao = shl i64 %c, 6",
            "  %so = shl i64 %c, 2",
            "  %ap = getelementptr i8, ptr %aq, i64 %ao",
            "  %sp = getelementptr float, ptr %asc, i64 %so"]
    for j in range(m):
        out += [f"  %apr{j} = getelementptr i8, ptr %ap, i64 %ka{j}",
                f"  %av{j} = load <16 x i32>, ptr %apr{j}, align 1",
                f"  %spr{j} = getelementptr float, ptr %sp, i64 %ks{j}",
                f"  %as{j} = load <4 x float>, ptr %spr{j}, align 4",
                f"  %s{j} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> zeroinitializer, "
                f"<16 x i32> %wi, <16 x i32> %av{j})",
                f"  %f{j} = sitofp <16 x i32> %s{j} to <16 x float>",
                f"  %kk{j} = fmul <4 x float> %sf, %as{j}",
                f"  %kv{j} = shufflevector <4 x float> %kk{j}, <4 x float> poison, {_mask([0] * 8 + [1] * 8)}",
                f"  %accn{j} = call <16 x float> @llvm.fma.v16f32(<16 x float> %f{j}, <16 x float> %kv{j}, "
                f"<16 x float> %acc{j})",
                f"  %macn{j} = fadd <4 x float> %mac{j}, %kk{j}"]
    out += ["  %c.next = add i64 %c, 1",
            "  %more = icmp ult i64 %c.next, %nch",
            "  br i1 %more, label %chunk, label %rowend",
            "rowend:"]
    for j in range(m):
        out += [f"  %h{j} = call reassoc float @llvm.vector.reduce.fadd.v16f32(float -0.0, <16 x float> %accn{j})",
                f"  %m2_{j} = extractelement <4 x float> %macn{j}, i64 2",
                f"  %m3_{j} = extractelement <4 x float> %macn{j}, i64 3",
                f"  %mm{j} = fadd float %m2_{j}, %m3_{j}",
                f"  %res{j} = fadd float %h{j}, %mm{j}",
                f"  %bf{j} = fptrunc float %res{j} to bfloat",
                f"  %yo{j} = add i64 %r, %ky{j}",
                f"  %yp{j} = getelementptr bfloat, ptr %y, i64 %yo{j}",
                f"  store bfloat %bf{j}, ptr %yp{j}, align 2"]
    out += ["  %r.next = add i64 %r, 1",
            "  %rows = icmp ult i64 %r.next, %n1",
            "  br i1 %rows, label %row, label %exit",
            "exit:",
            "  ret void",
            "}"]
    # the row offsets of activation row j: its int8 values (j K), scales (j nch 4) and outputs (j n)
    offsets = []
    for j in range(m):
        offsets += [f"  %ka{j} = mul i64 %k, {j}", f"  %ks{j} = mul i64 %sstride, {j}", f"  %ky{j} = mul i64 %n, {j}"]
    at = out.index("  %empty = icmp uge i64 %n0, %n1")
    return "\n".join(out[:at] + offsets + out[at:]) + "\n"


def _dispatch() -> str:
    """part(ctl, index): the posted job's output rows of part `index` of `parts`."""
    cases, blocks = [], []
    for bits in CHUNK_BYTES:
        for m in range(1, MAX_ROWS + 1):
            label = f"b{bits}m{m}"
            cases.append(f"i64 {bits * 8 + m}, label %{label}")
            blocks.append(f"{label}:\n  call void @rows_{bits}_{m}(ptr %w, ptr %aq, ptr %asc, ptr %y, i64 %n0, "
                          "i64 %n1, i64 %nch, i64 %n)\n  br label %exit")
    job = "\n".join(f"  %{name}p = getelementptr i64, ptr %ctl, i64 {JOB + i}\n  %{name} = load i64, ptr %{name}p, align 8"
                     for i, name in enumerate(JOB_FIELDS))
    desc = "\n".join(f"  %{name}p = getelementptr i64, ptr %desc, i64 {i}\n  %{name} = load i64, ptr %{name}p, align 8"
                      for i, name in enumerate(DESC_FIELDS))
    return f"""
define void @part(ptr %ctl, i64 %index) {{
entry:
{job}
  %desc = inttoptr i64 %desci to ptr
  %y = inttoptr i64 %yi to ptr
{desc}
  %w = inttoptr i64 %wi to ptr
  %aq = inttoptr i64 %aqi to ptr
  %asc = inttoptr i64 %asci to ptr
  %lo = mul i64 %n, %index
  %n0 = udiv i64 %lo, %parts
  %index1 = add i64 %index, 1
  %hi = mul i64 %n, %index1
  %n1 = udiv i64 %hi, %parts
  %b8 = shl i64 %bits, 3
  %kind = add i64 %b8, %m
  switch i64 %kind, label %exit [ {" ".join(cases)} ]
{chr(10).join(blocks)}
exit:
  ret void
}}
"""


def _threads() -> str:
    """worker(ctl, i): run part i + 1 of each job until `stop`; product(...): post a job, run part
    0, wait for the workers."""
    return f"""
define void @worker(ptr %ctl, i64 %i) {{
entry:
  %seqp = getelementptr i64, ptr %ctl, i64 {SEQ}
  %stopp = getelementptr i64, ptr %ctl, i64 {STOP}
  %busyp = getelementptr i64, ptr %ctl, i64 {BUSY}
  %slot = mul i64 %i, 8
  %donei = add i64 %slot, {DONE}
  %donep = getelementptr i64, ptr %ctl, i64 %donei
  %sleepp = getelementptr i64, ptr %donep, i64 1
  %part = add i64 %i, 1
  %first = load atomic i64, ptr %seqp acquire, align 8
  br label %wait
wait:
  %seen = phi i64 [%first, %entry], [%seen, %spin], [%seen, %woke], [%s, %ran]
  %spins = phi i64 [0, %entry], [%spins.next, %spin], [0, %woke], [0, %ran]
  %s = load atomic i64, ptr %seqp acquire, align 8
  %stop = load atomic i64, ptr %stopp monotonic, align 8
  %stopping = icmp ne i64 %stop, 0
  br i1 %stopping, label %exit, label %check
check:
  %new = icmp ne i64 %s, %seen
  br i1 %new, label %run, label %idle
idle:
  %busy = load atomic i64, ptr %busyp monotonic, align 8
  %isbusy = icmp ne i64 %busy, 0
  %limit = select i1 %isbusy, i64 {SPIN_BUSY}, i64 {SPIN_IDLE}
  %keep = icmp ult i64 %spins, %limit
  br i1 %keep, label %spin, label %sleep
spin:
  call void @llvm.x86.sse2.pause()
  %spins.next = add i64 %spins, 1
  br label %wait
sleep:
  store atomic i64 1, ptr %sleepp seq_cst, align 8
  %s2 = load atomic i64, ptr %seqp seq_cst, align 8
  %changed = icmp ne i64 %s2, %seen
  br i1 %changed, label %woke, label %block
block:
  %expect = and i64 %seen, 4294967295
  %ignored = call i64 (i64, ...) @syscall(i64 202, ptr %seqp, i64 128, i64 %expect, ptr null)
  br label %woke
woke:
  store atomic i64 0, ptr %sleepp seq_cst, align 8
  br label %wait
run:
  call void @part(ptr %ctl, i64 %part)
  store atomic i64 %s, ptr %donep release, align 8
  br label %ran
ran:
  br label %wait
exit:
  ret void
}}

define void @wake(ptr %ctl, i64 %workers) {{
entry:
  %seqp = getelementptr i64, ptr %ctl, i64 {SEQ}
  fence seq_cst
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i.next, %next]
  %go = icmp ult i64 %i, %workers
  br i1 %go, label %body, label %exit
body:
  %slot = mul i64 %i, 8
  %sl = add i64 %slot, {DONE + 1}
  %sleepp = getelementptr i64, ptr %ctl, i64 %sl
  %asleep = load atomic i64, ptr %sleepp seq_cst, align 8
  %isasleep = icmp ne i64 %asleep, 0
  br i1 %isasleep, label %futex, label %next
futex:
  %ignored = call i64 (i64, ...) @syscall(i64 202, ptr %seqp, i64 129, i64 2147483647)
  br label %exit
next:
  %i.next = add i64 %i, 1
  br label %loop
exit:
  ret void
}}

define void @product(ptr %ctl, ptr %desc, ptr %x, ptr %y, i64 %m, i64 %workers) {{
entry:
  %aqp = getelementptr i64, ptr %desc, i64 2
  %aqi = load i64, ptr %aqp, align 8
  %aq = inttoptr i64 %aqi to ptr
  %ascp = getelementptr i64, ptr %desc, i64 3
  %asci = load i64, ptr %ascp, align 8
  %asc = inttoptr i64 %asci to ptr
  %nchp = getelementptr i64, ptr %desc, i64 5
  %nch = load i64, ptr %nchp, align 8
  %blocks0 = mul i64 %m, %nch
  %blocks = shl i64 %blocks0, 1
  call void @quantize(ptr %x, ptr %aq, ptr %asc, i64 %blocks)
  %parts = add i64 %workers, 1
  %desci = ptrtoint ptr %desc to i64
  %yi = ptrtoint ptr %y to i64
{chr(10).join(f"  %jp{i} = getelementptr i64, ptr %ctl, i64 {JOB + i}{chr(10)}  store i64 {v}, ptr %jp{i}, align 8"
              for i, v in enumerate(("%desci", "%m", "%yi", "%parts")))}
  %seqp = getelementptr i64, ptr %ctl, i64 {SEQ}
  %old = load atomic i64, ptr %seqp monotonic, align 8
  %seq = add i64 %old, 1
  %solo = icmp eq i64 %workers, 0
  br i1 %solo, label %mine, label %post
post:
  store atomic i64 %seq, ptr %seqp seq_cst, align 8
  call void @wake(ptr %ctl, i64 %workers)
  br label %mine
mine:
  call void @part(ptr %ctl, i64 0)
  br label %join
join:
  %i = phi i64 [0, %mine], [%i.next, %joined]
  %all = icmp uge i64 %i, %workers
  br i1 %all, label %exit, label %waitone
waitone:
  %slot = mul i64 %i, 8
  %dl = add i64 %slot, {DONE}
  %donep = getelementptr i64, ptr %ctl, i64 %dl
  br label %poll
poll:
  %d = load atomic i64, ptr %donep acquire, align 8
  %ok = icmp eq i64 %d, %seq
  br i1 %ok, label %joined, label %pause
pause:
  call void @llvm.x86.sse2.pause()
  br label %poll
joined:
  %i.next = add i64 %i, 1
  br label %join
exit:
  ret void
}}
"""


def module_ir() -> str:
    rows = "".join(_rows(bits, m) for bits in CHUNK_BYTES for m in range(1, MAX_ROWS + 1))
    return _HEADER + _quantize() + rows + _dispatch() + _threads()
