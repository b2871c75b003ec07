"""LLVM IR text of the CPU's prompt attention: causal attention of a prompt's queries over the
sequence's keys (`prefill`, in fp32; `prefill_bf16` on AVX-512 BF16), items of PREFILL_ROWS
positions of one head shared between the parts, and `layout`, which lays a host pool's K and V
out as it reads them.
"""

from __future__ import annotations

from radixlm.runtime.kernels import native_abi as abi
from radixlm.runtime.kernels.ir_pieces import (
    LAYOUT,
    PREFILL,
    PREFILL_BF16,
    _addresses,
    _broadcast,
    _exp2v,
    _exported,
    _f32,
    _job_loads,
    _parts,
    _pointers,
    _post,
    _share,
    _splat,
    _splat_i32,
)

# the instruction sets the native prompt attention is compiled for (docs/machines.md)
PREFILL_ISAS = ("avx512", "avx2")
PREFILL_ROWS = 8  # query rows (positions of one head) a native prompt-attention item takes
# floats between the end of an item's score row and the next one's start: rows tpad floats apart
# would be 4 KiB apart at 1,024 keys, and a pass's loads and stores at one offset of each row
# would fall into one cache set (and alias the stores on Intel cores)
PREFILL_ROW_PAD = 16
# floats of a part's scratch after its score rows: the bf16 form's item's queries, rounded once an item
PREFILL_Q_SCRATCH = PREFILL_ROWS * 64 // 2


# How a prompt-attention item's work is laid out per instruction set: the vector's lanes, the
# query rows whose scores one pass over a key block sums together (each row's sums for the
# block's 16 keys stay in registers: with AVX-512 two chains a row of one 16-lane vector, with
# AVX2's 16 registers two 8-lane vectors a row, four rows a pass), and the (rows, value vectors)
# that one pass over the keys weights into their sums (AVX2: the layout that measured best over
# long prefixes; docs/machines.md).
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


def functions(isa: str, bf16: bool) -> str:
    """The fp32 prompt attention and `layout`; `bf16`: the bf16 form too."""
    text = _prefill(isa) + _layout(bf16)
    if bf16:
        text += (f"declare <16 x float> {DPBF16}(<16 x float>, <32 x bfloat>, <32 x bfloat>)\n"
                 + _prefill(isa, bf16=True))
    return text
