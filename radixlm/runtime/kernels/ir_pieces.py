"""The pieces the native kernels' IR text shares: the posted jobs' op codes, the instruction
sets and activation dtypes, and the helpers each kernel's IR is written with (an exported
function's definition, splats and broadcasts, bf16 rounding, a vector 2^x, and a posted job's
fields, post and share of the parts). The underscored helpers are for the ir_* modules of this
package alone.
"""

from __future__ import annotations

import math
import struct

from radixlm.runtime.kernels import native_abi as abi
from radixlm.runtime.kernels.ir_builder import FunctionBuilder

# the ops of the posted jobs (the control block's job area: native_abi.CONTROL; each op's job struct there)
PRODUCT, ATTENTION, TILES, QUANTIZE, NORM, PREFILL, ROTATE, SWIGLU, PREFILL_BF16, LAYOUT = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9
ISAS = ("avx512", "avx2")  # the instruction sets the products are written for
ACTS = ("bf16", "f32")  # the activation dtypes they take and write
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


def _splat_i32(name: str, value: str) -> list[str]:
    """%name: the i32 `value` in all 16 lanes."""
    return [f"  %{name}.i = insertelement <16 x i32> poison, i32 {value}, i64 0",
            f"  %{name} = shufflevector <16 x i32> %{name}.i, <16 x i32> poison, <16 x i32> zeroinitializer"]


def _f32(value: float) -> str:
    """An LLVM float constant (hex of the double holding the float32-rounded value)."""
    return "0x" + struct.pack(">d", struct.unpack("<f", struct.pack("<f", value))[0]).hex().upper()


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
