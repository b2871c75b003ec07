"""LLVM IR text of the CPU's decode attention: each item's (a sequence's query head) attention
over the sequence's keys in the host pool, read in place at its slots (`attend_{act}_{dim}`), the
items shared between the parts (`attention_part`) of the job that `attention` posts.
"""

from __future__ import annotations

import math

from radixlm.runtime.kernels import native_abi as abi
from radixlm.runtime.kernels.ir_pieces import (
    ACTS,
    ATTENTION,
    _addresses,
    _broadcast,
    _exported,
    _f32,
    _job_loads,
    _pointers,
    _post,
    _share,
    _splat,
    _to_bf16,
)

HEAD_DIMS = (64, 128)  # the head sizes the decode attention is compiled for
_ELEMENT = {"bf16": "i16", "f32": "float"}  # the IR element type an activation dtype is addressed as


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


def entry() -> str:
    """attention(ctl, q, ...): the decode attention posted (`attention_part`)."""
    attention = f"""entry:
  %parts = add i64 %workers, 1
{_addresses("q", "kv", "idx", "lens", "out", "scratch")}
  %scale32 = bitcast float %scale to i32
  %scalebits = zext i32 %scale32 to i64
{_post(ATTENTION, abi.ATTENTION_JOB)}
  call void @run_job(ptr %ctl, i64 %workers)
  ret void"""
    return _exported(abi.ATTENTION, attention)


def functions() -> str:
    """`exp2_neg`, the decode attention for each activation dtype and head size, and `attention_part`."""
    return _exp2() + "".join(_attend(d, act) for act in ACTS for d in HEAD_DIMS) + _attention_part()
