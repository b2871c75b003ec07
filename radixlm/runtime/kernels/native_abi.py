"""The native kernels' binary interface, declared once: each struct as one field list (name, C
type) and each exported function as one parameter list (name, kind), from which come both sides
of the boundary: the LLVM struct types, field accesses and `define` lines in the IR
(native_ir.py and its ir_*.py parts), and the ctypes `Structure`s, `CFUNCTYPE`s and keyword-checked callers in Python
(native.py). A field or parameter added, removed or reordered here moves on both sides at once.

The structs of int64 words (a matrix's descriptor, a posted job, a decode step, a layer) hold
addresses and float bits as integers, as the kernels read them; the control block has real
structure (the sequence number, the flags, the job area, a cache line per worker).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# the C types a field may have, and the LLVM type each is
_SCALARS: dict[Any, str] = {ctypes.c_int64: "i64", ctypes.c_int32: "i32", ctypes.c_float: "float",
                            ctypes.c_double: "double", ctypes.c_void_p: "ptr"}


class Struct:
    """One struct: `fields` (name, ctypes type: a scalar of _SCALARS, an array of one, or another
    Struct's `ctype`), laid out as C lays it out (what ctypes and LLVM's x86-64 data layout agree on)."""

    def __init__(self, name: str, fields: tuple[tuple[str, Any], ...]) -> None:
        names = [f for f, _ in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"struct {name} declares a field twice: {names}")
        self.name, self.fields, self.names = name, fields, tuple(names)
        self.ctype: type[ctypes.Structure] = type(name, (ctypes.Structure,), {"_fields_": list(fields),
                                                                          "_abi_": self})

    @classmethod
    def words(cls, name: str, names: tuple[str, ...]) -> Struct:
        """A struct of int64 words named `names`."""
        return cls(name, tuple((n, ctypes.c_int64) for n in names))

    @property
    def ir_name(self) -> str:
        return f"%{self.name}"

    def ir_type(self) -> str:
        """The IR's type definition, `%Name = type { ... }`."""
        return f"{self.ir_name} = type {{ {', '.join(_ir_type(t) for _, t in self.fields)} }}"

    def index(self, field: str) -> int:
        if field not in self.names:
            raise KeyError(f"struct {self.name} has no field {field!r}; it has {', '.join(self.names)}")
        return self.names.index(field)

    def offset(self, field: str) -> int:
        """The field's byte offset, as ctypes lays it out."""
        return int(getattr(self.ctype, field).offset)

    def field_type(self, field: str) -> str:
        return _ir_type(self.fields[self.index(field)][1])

    def gep(self, dst: str, base: str, field: str, *rest: str) -> str:
        """`%dst`: a pointer to `field` (then `rest`: further indices, typed) of the struct at `base`."""
        tail = "".join(f", {r}" for r in rest)
        return f"  %{dst} = getelementptr {self.ir_name}, ptr {base}, i32 0, i32 {self.index(field)}{tail}"

    def load(self, base: str, names: tuple[str, ...] | None = None) -> str:
        """`%name`: each of `names` (default: all fields) loaded from the struct at `base`."""
        return "\n".join(f"{self.gep(name + '.p', base, name)}\n"
                         f"  %{name} = load {self.field_type(name)}, ptr %{name}.p, align 8"
                         for name in (self.names if names is None else names))

    def store(self, base: str, values: Mapping[str, str], prefix: str) -> str:
        """Store each field's value (an IR operand) into the struct at `base`; every field must be
        given (`prefix` names the pointers)."""
        missing = set(self.names) - set(values)
        if missing or set(values) - set(self.names):
            raise ValueError(f"storing struct {self.name}: missing {sorted(missing)}, "
                             f"unknown {sorted(set(values) - set(self.names))}")
        return "\n".join(f"{self.gep(f'{prefix}{i}.p', base, name)}\n"
                         f"  store {self.field_type(name)} {values[name]}, ptr %{prefix}{i}.p, align 8"
                         for i, name in enumerate(self.names))


def _ir_type(t: Any) -> str:
    if t in _SCALARS:
        return _SCALARS[t]
    if isinstance(t, type) and issubclass(t, ctypes.Array):
        return f"[{t._length_} x {_ir_type(t._type_)}]"
    abi = getattr(t, "_abi_", None)
    if isinstance(abi, Struct):
        return abi.ir_name
    raise TypeError(f"no LLVM type for {t!r}")


@dataclass(frozen=True)
class Param:
    """A parameter of an exported function. `kind`: "ptr" (a tensor's data, one of `dtypes` by
    torch's name, at least `numel(args)` elements where given, contiguous where `contiguous`),
    "struct" (a ctypes Structure of `struct`, passed by address), "i64" (an int), "float"."""

    name: str
    kind: str
    dtypes: tuple[str, ...] = ()
    numel: Callable[[Mapping[str, Any]], int] | None = None
    contiguous: bool = False
    struct: Struct | None = None

    @property
    def ir_type(self) -> str:
        return {"ptr": "ptr", "struct": "ptr", "i64": "i64", "float": "float"}[self.kind]

    @property
    def ctype(self) -> Any:
        return {"ptr": ctypes.c_void_p, "struct": ctypes.c_void_p, "i64": ctypes.c_int64,
                "float": ctypes.c_float}[self.kind]


@dataclass(frozen=True)
class Function:
    """An exported function (it returns nothing): its name and parameters."""

    name: str
    params: tuple[Param, ...]

    def define(self, attributes: str = "") -> str:
        """The IR's `define` line, through the opening brace."""
        params = ", ".join(f"{p.ir_type} %{p.name}" for p in self.params)
        return f"define void @{self.name}({params}){attributes} {{"

    def call(self, args: Mapping[str, str]) -> str:
        """An IR call of this function with `args` (IR operands by parameter name, all of them)."""
        if set(args) != {p.name for p in self.params}:
            raise ValueError(f"calling @{self.name}: missing {sorted({p.name for p in self.params} - set(args))}, "
                             f"unknown {sorted(set(args) - {p.name for p in self.params})}")
        return f"  call void @{self.name}({', '.join(f'{p.ir_type} {args[p.name]}' for p in self.params)})"

    def cfunctype(self) -> Any:
        return ctypes.CFUNCTYPE(None, *(p.ctype for p in self.params))


class Kernel:
    """An exported function bound to its compiled address, called with keyword arguments only:
    tensors for "ptr" parameters (their dtype, size and layout checked), ctypes structs for
    "struct" ones, ints and floats for the rest. A wrong name raises TypeError, a wrong dtype or a
    short or strided buffer ValueError, each naming the argument; the call never reaches the
    kernel then."""

    def __init__(self, function: Function, address: int) -> None:
        self.function = function
        self.raw = function.cfunctype()(address)  # positional, unchecked: for callers that hold raw addresses
        self._names = frozenset(p.name for p in function.params)
        self._convert = tuple((p.name, _converter(function.name, p)) for p in function.params)

    def __call__(self, **kwargs: Any) -> None:
        if kwargs.keys() != self._names:
            unknown, missing = sorted(kwargs.keys() - self._names), sorted(self._names - kwargs.keys())
            raise TypeError(f"{self.function.name}(): " + "; ".join(
                ([f"unexpected argument {', '.join(unknown)}"] if unknown else [])
                + ([f"missing argument {', '.join(missing)}"] if missing else [])))
        self.raw(*[convert(kwargs[name], kwargs) for name, convert in self._convert])

    def addresses(self, **kwargs: Any) -> None:
        """The call by keyword with raw values (addresses as ints, the control block's too), names
        checked but not values: for a hot caller (a product, ~1 us against ~8 here) whose values
        were checked once where they were made."""
        try:
            values = [kwargs[p.name] for p in self.function.params]
        except KeyError as e:
            raise TypeError(f"{self.function.name}(): missing argument {e.args[0]}") from None
        if len(kwargs) != len(values):
            raise TypeError(f"{self.function.name}(): unexpected argument "
                            f"{', '.join(sorted(kwargs.keys() - self._names))}")
        self.raw(*values)


def _converter(fn: str, p: Param) -> Callable[[Any, Mapping[str, Any]], Any]:
    """A function of (value, all arguments) -> `value` as ctypes passes it to parameter `p`, or a
    TypeError / ValueError naming it."""
    def wrong(expected: str, value: Any) -> TypeError:
        return TypeError(f"{fn}(): argument {p.name} must be {expected}, not {type(value).__name__}")

    if p.kind == "i64":
        def integer(value: Any, args: Mapping[str, Any]) -> Any:
            if type(value) is not int and (not isinstance(value, int) or isinstance(value, bool)):
                raise wrong("an int", value)
            return value
        return integer
    if p.kind == "float":
        def real(value: Any, args: Mapping[str, Any]) -> Any:
            if type(value) is not float and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise wrong("a float", value)
            return float(value)
        return real
    if p.kind == "struct":
        assert p.struct is not None
        ctype, name = p.struct.ctype, p.struct.name

        def struct(value: Any, args: Mapping[str, Any]) -> Any:
            if type(value) is not ctype:
                raise wrong(f"a {name} struct", value)
            return ctypes.addressof(value)
        return struct
    dtypes = frozenset(f"torch.{d}" for d in p.dtypes)
    numel, contiguous = p.numel, p.contiguous

    def tensor(value: Any, args: Mapping[str, Any]) -> Any:
        try:
            dtype, device = value.dtype, value.device
        except AttributeError:
            raise wrong("a tensor", value) from None
        if dtypes and str(dtype) not in dtypes:
            raise ValueError(f"{fn}(): argument {p.name} must be {' or '.join(p.dtypes)}, "
                             f"not {str(dtype).removeprefix('torch.')}")
        if device.type != "cpu":
            raise ValueError(f"{fn}(): argument {p.name} must be on the CPU, not {device}")
        if contiguous and not value.is_contiguous():
            raise ValueError(f"{fn}(): argument {p.name} must be contiguous")
        if numel is not None and value.numel() < (need := numel(args)):
            raise ValueError(f"{fn}(): argument {p.name} holds {value.numel()} elements; the call reads or writes {need}")
        return value.data_ptr()
    return tensor


# -- the structs -------------------------------------------------------------------------------

# a matrix's descriptor (the products read it; int64 words)
DESCRIPTOR = Struct.words("Descriptor", ("bits", "wi", "aqi", "asci", "n", "nch", "f32"))
JOB_WORDS = 32  # the control block's job area
WORKER = Struct("WorkerSlot", (("done", ctypes.c_int64), ("asleep", ctypes.c_int64), ("pad", ctypes.c_int64 * 6)))
MAX_WORKERS = 64
# the control block: the posted job's sequence number alone on its cache line, then the flags,
# the job (its op, then its op's fields: the job structs below), a cache line per worker
CONTROL = Struct("Control", (("seq", ctypes.c_int64), ("pad0", ctypes.c_int64 * 7),
                             ("stop", ctypes.c_int64), ("busy", ctypes.c_int64), ("omp_parts", ctypes.c_int64),
                             ("pad1", ctypes.c_int64 * 5), ("job", ctypes.c_int64 * JOB_WORDS),
                             ("workers", WORKER.ctype * MAX_WORKERS)))

# the posted jobs, one struct an op (its `op` word first), each read from the control block's job area
PRODUCT_JOB = Struct.words("ProductJob", ("op", "desci", "m", "yi", "parts"))
TILE_JOB = Struct.words("TileJob", ("op", "desci", "mpad", "yi", "parts", "taqi", "tasci"))
QUANTIZE_JOB = Struct.words("QuantizeJob", ("op", "xi", "qaqi", "qasci", "parts", "chunks", "f32"))
ATTENTION_JOB = Struct.words("AttentionJob", (
    "op", "qi", "qstride", "kvi", "kvstride", "idxi", "maxkv", "lensi", "outi", "items", "heads", "kvheads",
    "scalebits", "scratchi", "sstride", "parts", "dim", "f32"))
PREFILL_JOB = Struct.words("PrefillJob", (
    "op", "pqi", "qstride", "kti", "parts", "pvi", "pouti", "pheads", "pkvheads", "tq", "prefix", "tpad",
    "scalebits", "pscri"))
LAYOUT_JOB = Struct.words("LayoutJob", ("op", "ksi", "vsi", "kstride", "vstride", "idxi", "n", "padded", "kvh",
                                        "kti", "vvi", "isbf16", "parts"))

# a CPU decode step of the whole model's layers in one call (`decode_layers`): the step's buffers and
# shapes, then per layer its four products' descriptors, its norms' weights and eps, its pool layer
# (a product's tiled descriptor is 0 where it has none: the fused step then has at most MAX_ROWS rows)
STEP = Struct.words("Step", ("m", "residual", "x", "qkv", "rot", "att", "o", "gu", "act", "h", "cos", "sin", "slots",
                             "idx", "maxkv", "lens", "heads", "kvheads", "d", "hidden", "inter", "scalebits",
                             "scratch", "sstride", "workers", "layers", "count", "mpad", "tvals", "tscales"))
LAYER = Struct.words("Layer", ("qkvdesc", "odesc", "gudesc", "downdesc", "norm1", "norm2", "eps1bits", "eps2bits",
                               "kvlayer", "qkvtiles", "otiles", "gutiles", "downtiles"))



# -- the exported functions ---------------------------------------------------------------------

_ACT = ("bfloat16", "float32")
_F32 = ("float32",)
_CTL = Param("ctl", "struct", struct=CONTROL)


def _p(name: str, dtypes: tuple[str, ...] = (), numel: Callable[[Mapping[str, Any]], int] | None = None,
       contiguous: bool = False) -> Param:
    return Param(name, "ptr", dtypes, numel, contiguous)


def _i(*names: str) -> tuple[Param, ...]:
    return tuple(Param(n, "i64") for n in names)


PRODUCT = Function("product", (_CTL, _p("desc", ("int64",), lambda a: len(DESCRIPTOR.names), True),
                               _p("x", _ACT, contiguous=True), _p("y", _ACT, contiguous=True), *_i("m", "workers")))
ATTENTION = Function("attention", (
    _CTL, _p("q", _ACT), *_i("qstride"), _p("kv", _ACT, contiguous=True), *_i("kvstride"),
    _p("idx", ("int64",), lambda a: a["items"] // max(a["heads"], 1) * a["maxkv"], True), *_i("maxkv"),
    _p("lens", ("int64",), lambda a: a["items"] // max(a["heads"], 1), True),
    _p("out", _ACT, lambda a: a["items"] * a["dim"], True), *_i("items", "heads", "kvheads"), Param("scale", "float"),
    _p("scratch", _F32, lambda a: (a["workers"] + 1) * a["sstride"], True), *_i("sstride", "workers", "dim", "f32")))
TILES = Function("tiles", (_CTL, _p("desc", ("int64",), lambda a: len(DESCRIPTOR.names), True),
                           _p("x", _ACT, contiguous=True), _p("y", _ACT, contiguous=True), *_i("m", "mpad", "workers"),
                           _p("aq", ("int8",), contiguous=True), _p("asc", _F32, contiguous=True), *_i("omp")))
RMS_NORM = Function("rms_norm", (
    _CTL, _p("x", _F32, lambda a: a["rows"] * a["k"], True), _p("w", _F32, lambda a: a["k"], True),
    _p("y", _F32, lambda a: a["rows"] * a["k"], True), *_i("k"), Param("eps", "float"),
    *_i("rows", "workers", "threads")))
ROTATE = Function("rotate", (
    _CTL, _p("x", _F32, lambda a: a["rows"] * a["dim"], True),
    _p("c", _F32, lambda a: a["rows"] // max(a["heads"], 1) * a["dim"], True),
    _p("s", _F32, lambda a: a["rows"] // max(a["heads"], 1) * a["dim"], True),
    _p("y", _F32, lambda a: a["rows"] * a["dim"], True), *_i("dim", "heads", "rot", "rows", "workers", "threads")))
SWIGLU = Function("swiglu", (_CTL, _p("gu", _F32, lambda a: 2 * a["rows"] * a["inter"], True),
                             _p("y", _F32, lambda a: a["rows"] * a["inter"], True),
                             *_i("inter", "rows", "workers", "threads")))
WRITE_ROWS = Function("write_rows", (_p("dst"), *_i("drow"), _p("src"), *_i("srow"),
                                     _p("slots", ("int64",), lambda a: a["rows"], True), *_i("rows", "width")))
DECODE_LAYERS = Function("decode_layers", (_CTL, _p("step", ("int64",), lambda a: len(STEP.names), True)))
_PREFILL_PARAMS = (_CTL, _p("q", _F32), *_i("qstride"), _p("kt", contiguous=True), _p("v", contiguous=True),
                   _p("out", _F32, lambda a: a["tq"] * a["pheads"] * 64, True),
                   *_i("pheads", "pkvheads", "tq", "prefix", "tpad"), Param("scale2", "float"),
                   *_i("workers", "threads"), _p("scratch", _F32, contiguous=True))
PREFILL = Function("prefill", _PREFILL_PARAMS)
PREFILL_BF16 = Function("prefill_bf16", _PREFILL_PARAMS)
LAYOUT = Function("layout", (
    _CTL, _p("ks", _F32), _p("vs", _F32), *_i("kstride", "vstride"), _p("idx", ("int64",), lambda a: a["n"], True),
    *_i("n", "padded", "kvh"), _p("kt", ("float32", "bfloat16"), lambda a: a["kvh"] * a["padded"] * 64, True),
    _p("vv", ("float32", "bfloat16"), lambda a: a["kvh"] * a["padded"] * 64, True),
    *_i("isbf16", "workers", "threads")))
def part(name: str) -> Function:
    """`<name>_part(ctl, index)`: part `index` of the posted job of op `name` (thread_pool's `part` calls it)."""
    return Function(f"{name}_part", (_CTL, *_i("index")))


# the thread pool's entry points (thread_pool.py)
WORKER_LOOP = Function("worker", (_CTL, *_i("i")))
WAKE = Function("wake", (_CTL, *_i("workers")))
RUN_JOB = Function("run_job", (_CTL, *_i("workers")))  # (called within the module only, as are these two)
RUN_ON = Function("run_on", (_CTL, *_i("workers", "threads")))
PART = Function("part", (_CTL, *_i("index")))

ROW_JOB_PARAMS = ("ctl", "rows", "workers", "threads")  # a row job's parameters that its job does not carry


def row_params(function: Function) -> tuple[Param, ...]:
    """The parameters of a row job (`ir_elementwise._row_job`) that its job carries."""
    return tuple(p for p in function.params if p.name not in ROW_JOB_PARAMS)


def row_job(function: Function) -> Struct:
    """The job struct of a row job: its op, its parameters (`row_params`), parts, rows."""
    return Struct.words(f"{function.name.title().replace('_', '')}Job",
                        ("op", *(f"f_{p.name}" for p in row_params(function)), "parts", "rows"))


NORM_JOB, ROTATE_JOB, SWIGLU_JOB = row_job(RMS_NORM), row_job(ROTATE), row_job(SWIGLU)
STRUCTS = (DESCRIPTOR, WORKER, CONTROL, PRODUCT_JOB, TILE_JOB, QUANTIZE_JOB, ATTENTION_JOB, PREFILL_JOB, LAYOUT_JOB,
           NORM_JOB, ROTATE_JOB, SWIGLU_JOB, STEP, LAYER)
FUNCTIONS = (PRODUCT, ATTENTION, TILES, RMS_NORM, ROTATE, SWIGLU, WRITE_ROWS, DECODE_LAYERS, PREFILL, PREFILL_BF16,
             LAYOUT, WORKER_LOOP, WAKE)


def check_jobs() -> None:
    """Each job struct fits the control block's job area."""
    for job in (PRODUCT_JOB, TILE_JOB, QUANTIZE_JOB, ATTENTION_JOB, PREFILL_JOB, LAYOUT_JOB, NORM_JOB, ROTATE_JOB,
                SWIGLU_JOB):
        if ctypes.sizeof(job.ctype) > ctypes.sizeof(ctypes.c_int64 * JOB_WORDS):
            raise ValueError(f"job {job.name} has {len(job.names)} words; the job area holds {JOB_WORDS}")


check_jobs()


def type_definitions() -> str:
    """The IR's definitions of every struct type."""
    return "".join(s.ir_type() + "\n" for s in STRUCTS)
