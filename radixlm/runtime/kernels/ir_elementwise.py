"""LLVM IR text of the CPU's row-wise ops and the fused decode step: RMSNorm, the rotary
embedding and SwiGLU, each with its rows shared between the parts (`_row_job`); `write_rows`,
which copies K/V rows into a pool's slots; and `decode_layers`, a decode step's decoder layers in
one call.
"""

from __future__ import annotations

import math

from radixlm.runtime.kernels import native_abi as abi
from radixlm.runtime.kernels.ir_pieces import (
    NORM,
    ROTATE,
    SWIGLU,
    _broadcast,
    _exp2v,
    _exported,
    _f32,
    _job_loads,
    _parts,
    _post,
    _share,
    _splat,
)
from radixlm.runtime.kernels.ir_products import MAX_ROWS

NORM_ALONE = 16  # an RMSNorm of fewer rows runs on the calling thread alone
ROTATE_ALONE = 64  # a rotation of fewer (token, head) rows runs on the calling thread alone
SWIGLU_ALONE = 8  # a SwiGLU of fewer rows runs on the calling thread alone
STEP_FIELDS, LAYER_FIELDS = abi.STEP.names, abi.LAYER.names  # a decode step's struct, and a layer's
_STEP_POINTERS = ("residual", "x", "qkv", "rot", "att", "o", "gu", "act", "h", "cos", "sin", "slots", "idx", "lens",
                  "scratch", "layers", "tvals", "tscales")


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


def functions(tiled: bool) -> str:
    """RMSNorm, the rotation, SwiGLU, `write_rows` and `decode_layers` (`tiled`: the module has the
    tiled products)."""
    return _norm() + _rotate() + _swiglu() + _write_rows() + _decode_layers(tiled)
