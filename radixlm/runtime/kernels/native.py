"""The CPU's block-quantized products, compiled at start by LLVM (the llvmlite wheel brings it, so a
user's machine needs no compiler; the object is kept in the cache dir for the next process:
object_cache.py): 4-bit (GGUF Q4_1/Q4_0/Q4_K) and 8-bit (Q8_0) weight blocks
times int8 activation blocks in integers, as llama.cpp multiplies at batch 1: through AVX-512
VNNI where the processor has it, else through AVX2. torch's own int4 kernel converts
each weight to a float and stays compute-bound, well below the memory's speed (docs/machines.md),
and has no fast path for fp32 activations at all; these read the weights at the memory's speed. The IR and its
layout: native_ir.py and its ir_*.py parts; the structs and signatures both sides share, and the keyword callers that
check their arguments: native_abi.py; the worker threads' protocol: thread_pool.py.

`BlockProduct` holds one matrix in the kernels' layout and multiplies [rows, K] bf16 or fp32
activations (rows <= native_ir.MAX_ROWS per call; more in turn). The threads: the product's output rows are
split between the caller and `threads - 1` workers started on first use; `busy()` marks a forward
pass, during which the workers spin for the next product instead of sleeping (and torch's own
ops run on one thread, so that nothing waits on a spinning core).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.config import default_cache_dir
from radixlm.runtime.kernels import native_abi, native_ir, object_cache
from radixlm.runtime.kernels.cpuinfo import cpuinfo_field

logger = logging.getLogger(__name__)

GROUP = 32
# the processor features each instruction set of native_ir needs (LLVM's names)
NEEDS = {"avx512": ("+avx512f", "+avx512bw", "+avx512vl", "+avx512vnni", "+f16c", "+fma"),
         "avx2": ("+avx2", "+fma", "+f16c")}
BF16_NEEDS = "+avx512bf16"  # ... and the AVX-512 module's bf16 prompt attention (`vdpbf16ps`)
OBJECT_FORMAT = "mcjit-o3-1"  # how `_compiled` makes the object: change it when that changes


def _host_features() -> set[str]:
    import llvmlite.binding as llvm  # type: ignore[import-untyped]

    return set(llvm.get_host_cpu_features().flatten().split(","))


def supported_isas() -> tuple[str, ...]:
    """The instruction sets of native_ir this processor runs, best first (none without llvmlite)."""
    try:
        features = _host_features()
    except ImportError:
        return ()
    return tuple(isa for isa in native_ir.ISAS if all(f in features for f in NEEDS[isa]))


@functools.cache
def isa() -> str | None:
    """The instruction set this process's kernels use: the best the processor runs, or
    RADIXLM_NATIVE_ISA=avx2 to take the AVX2 kernels on an AVX-512 processor (to measure them);
    None where none runs or the kernels are turned off (RADIXLM_NATIVE=0)."""
    if os.environ.get("RADIXLM_NATIVE", "1") == "0":
        return None
    isas = supported_isas()
    wanted = os.environ.get("RADIXLM_NATIVE_ISA", "")
    if wanted:
        if wanted not in native_ir.ISAS:
            raise ValueError(f"RADIXLM_NATIVE_ISA={wanted!r}: choose one of {', '.join(native_ir.ISAS)}")
        return wanted if wanted in isas else None
    return isas[0] if isas else None


def available() -> bool:
    """Whether this process can use the kernels: llvmlite importable, a processor with AVX-512
    VNNI or with AVX2, and not turned off (RADIXLM_NATIVE=0)."""
    return isa() is not None


class _Library:
    """The compiled module for one instruction set, its entry points, and its worker threads."""

    def __init__(self, isa: str) -> None:
        import llvmlite.binding as llvm

        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        target = llvm.Target.from_default_triple()
        features = llvm.get_host_cpu_features().flatten()
        if isa != "avx512":  # the AVX2 code even where the processor has more (GFNI too: AVX2-only kinds lack it)
            features = ",".join("-" + f[1:] if f[1:].startswith(("avx512", "amx", "gfni")) else f
                                for f in features.split(","))
        self.isa = isa
        cpu = llvm.get_host_cpu_name()
        self.machine = target.create_target_machine(cpu=cpu, features=features, opt=3)
        self.omp = isa in native_ir.TILE_ISAS and _bind_openmp(llvm)
        self.bf16 = isa == "avx512" and BF16_NEEDS in features.split(",")
        # (from_cache: whether the object came from the cache dir rather than from a compile)
        obj, self.from_cache = _compiled(llvm, self.machine, isa, cpu, features,
                                         native_ir.module_ir(isa, omp=self.omp, bf16=self.bf16))
        self.engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), self.machine)
        self.engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        self.engine.finalize_object()

        def kernel(function: native_abi.Function) -> native_abi.Kernel:
            return native_abi.Kernel(function, self.engine.get_function_address(function.name))

        # the entry points, called with keyword arguments (native_abi declares them); None: not in this module
        self.product = kernel(native_abi.PRODUCT)
        self.attention = kernel(native_abi.ATTENTION)
        self.norm = kernel(native_abi.RMS_NORM)
        self.rotate = kernel(native_abi.ROTATE)
        self.swiglu = kernel(native_abi.SWIGLU)
        self.write_rows = kernel(native_abi.WRITE_ROWS)
        self.decode_layers = kernel(native_abi.DECODE_LAYERS)
        prefill = isa in native_ir.PREFILL_ISAS
        self.prefill = kernel(native_abi.PREFILL) if prefill else None
        self.prefill_bf16 = kernel(native_abi.PREFILL_BF16) if self.bf16 else None
        self.layout = kernel(native_abi.LAYOUT) if prefill else None
        self.tiles = kernel(native_abi.TILES) if isa in native_ir.TILE_ISAS else None
        self.worker = kernel(native_abi.WORKER_LOOP)
        self.wake = kernel(native_abi.WAKE)
        self.scratch = torch.empty(0, dtype=torch.float32)  # the attention's scores, a row per part
        # the tiled products' quantized activations and their scales (grown to the most rows seen)
        self.tile_values = torch.empty(0, dtype=torch.int8)
        self.tile_scales = torch.empty(0, dtype=torch.float32)
        # the control block (native_abi.CONTROL), in a tensor's memory (torch aligns it to a cache line)
        self.control_memory = torch.zeros(ctypes.sizeof(native_abi.CONTROL.ctype), dtype=torch.uint8)
        self.control = native_abi.CONTROL.ctype.from_address(self.control_memory.data_ptr())
        self.control_address = ctypes.addressof(self.control)
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.threads_started = False
        self.busy_depth = 0
        atexit.register(self.stop)
        os.register_at_fork(after_in_child=self._forked)

    @property
    def workers(self) -> int:
        return len(self.threads)

    def start(self) -> None:
        """Start the workers of this process: torch's thread count - 1 (none on one thread)."""
        if self.threads_started:
            return
        self.threads_started, self.threads = True, []
        ctypes.memset(self.control_address, 0, ctypes.sizeof(self.control))
        for index in range(max(0, min(torch.get_num_threads(), native_abi.MAX_WORKERS) - 1)):
            thread = threading.Thread(target=functools.partial(self.worker, ctl=self.control, i=index), daemon=True,
                                      name=f"radixlm-native-{index}")
            thread.start()
            self.threads.append(thread)

    def _forked(self) -> None:
        """In a forked child the workers are not there: start them again on first use."""
        self.threads, self.threads_started, self.busy_depth = [], False, 0
        self.lock = threading.Lock()

    def attention_scratch(self, longest: int) -> int:
        """The decode attention's score rows, one a part, for sequences of up to `longest` keys
        (grown as needed; under the lock): the stride between the rows."""
        parts = self.workers + 1
        if self.scratch.numel() < parts * longest:
            self.scratch = torch.empty(parts * max(longest, 1024), dtype=torch.float32)
        return self.scratch.numel() // parts

    def tile_scratch(self, values: int) -> None:
        """Room for `values` quantized activations of the tiled products, and their scales (one
        fp32 per 16 values; grown as needed, under the lock)."""
        if self.tile_values.numel() < values:
            self.tile_values = torch.empty(values, dtype=torch.int8)
            self.tile_scales = torch.empty(values // 16, dtype=torch.float32)

    def stop(self) -> None:
        if not self.threads:
            return
        self.control.stop = 1
        self.control.seq += 1
        self.wake(ctl=self.control, workers=self.workers)
        for thread in self.threads:
            thread.join(timeout=1.0)
        self.threads, self.threads_started = [], False


def _compiled(llvm: Any, machine: Any, isa: str, cpu: str, features: str, ir: str) -> tuple[bytes, bool]:
    """The object code of `ir` for `machine`, and whether it came from the cache dir
    (`object_cache`): there under a key of the IR, the processor and features it is compiled for,
    the instruction set and the llvmlite and LLVM versions; else compiled (O3) and kept there."""
    import llvmlite

    digest = object_cache.key(ir, cpu, features, isa, machine.triple, llvmlite.__version__,
                              ".".join(map(str, llvm.llvm_version_info)), OBJECT_FORMAT)
    path = object_cache.entry(default_cache_dir(), isa, digest)
    obj = object_cache.read(path)
    if obj is not None:
        logger.debug("native kernels (%s) loaded from %s", isa, path)
        return obj, True
    start = time.perf_counter()
    module = llvm.parse_assembly(ir)
    module.verify()
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    builder.getModulePassManager().run(module, builder)
    obj = machine.emit_object(module)
    logger.info("native kernels (%s) compiled in %.1f s", isa, time.perf_counter() - start)
    object_cache.write(path, obj)
    return obj, False


OPENMP_SYMBOLS = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")


def _bind_openmp(llvm: Any) -> bool:
    """Give the JIT the OpenMP runtime torch runs its ops on (the libgomp this process loaded),
    so that the tiled products can run on torch's own threads; False where none is loaded."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "libgomp" in line.split()[-1]})
    if not paths:
        return False
    try:
        runtime = ctypes.CDLL(paths[0])
        for name in OPENMP_SYMBOLS:
            llvm.add_symbol(name, ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value)
    except (OSError, AttributeError):
        return False
    return True


@functools.cache
def _library_for(isa: str) -> _Library:
    if isa not in supported_isas():
        raise RuntimeError(f"the native block products for {isa} need llvmlite and a processor with "
                           + ", ".join(f[1:] for f in NEEDS[isa]))
    return _Library(isa)


def library(isa_name: str | None = None) -> _Library:
    """The compiled kernels for `isa_name`, by default this process's (`isa()`)."""
    chosen = isa_name or isa()
    if chosen is None:
        raise RuntimeError("the native block products need llvmlite and a processor with AVX-512 VNNI or with "
                           "AVX2 (and RADIXLM_NATIVE not 0)")
    return _library_for(chosen)


@contextlib.contextmanager
def running(lib: _Library) -> Iterator[int]:
    """`lib` locked with its workers started, for one job; yields the OpenMP threads to run it on
    (torch's pool outside a busy stretch, whose threads spin between torch's ops), or 0: our
    workers (in a busy stretch they spin for it, and torch runs on one thread)."""
    with lib.lock:
        if not lib.threads_started:
            lib.start()
        yield torch.get_num_threads() if lib.omp and lib.busy_depth == 0 else 0


@contextlib.contextmanager
def busy(isa_name: str | None = None) -> Iterator[None]:
    """A forward pass of few rows: the workers spin between its products, and torch's own ops
    run on this thread alone (a spinning worker holds the other cores)."""
    lib = library(isa_name)
    with lib.lock:
        lib.start()
    threads = torch.get_num_threads()
    lib.busy_depth += 1
    if lib.busy_depth == 1 and lib.workers:
        lib.control.busy = 1
        torch.set_num_threads(1)
    try:
        yield
    finally:
        lib.busy_depth -= 1
        if lib.busy_depth == 0 and lib.workers:
            lib.control.busy = 0
            torch.set_num_threads(threads)


def pack_blocks(u: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernels' layout of w = scale * u + minimum per block of 32: u [N, K] unsigned integers
    (0..15 for 4 bits, 0..255 for 8), scale and minimum [N, K / 32]. Returns [N, K / 64 * bytes]
    uint8: per chunk of 64 weights the integers (4-bit: block 0 low nibbles, block 1 high), then
    fp16 [d0, d1, m0, m1]."""
    n, k = u.shape
    if k % native_ir.CHUNK or scale.shape != (n, k // GROUP) or minimum.shape != scale.shape:
        raise ValueError(f"block weights need K divisible by {native_ir.CHUNK} and one scale/minimum per "
                         f"{GROUP}; got {tuple(u.shape)} with scales {tuple(scale.shape)}")
    chunks = k // native_ir.CHUNK
    q = u.to(torch.uint8).view(n, chunks, 2, GROUP)
    ints = q[:, :, 0] | (q[:, :, 1] << 4) if bits == 4 else q.reshape(n, chunks, native_ir.CHUNK)
    scales = torch.cat([scale.view(n, chunks, 2), minimum.view(n, chunks, 2)], -1).half().contiguous()
    return torch.cat([ints, scales.view(torch.uint8)], -1).contiguous().view(n, chunks * native_ir.CHUNK_BYTES[bits])


def pack_tiles(u: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int) -> torch.Tensor:
    """The tiled products' layout of the same blocks (w = scale * u + minimum per 32 along K):
    per TILE_N output rows, per block of 32, the rows' integers as `vpdpbusd` takes them with one
    activation broadcast (4 consecutive weights of each row in turn; 4-bit: a 64-byte load holds
    weights 8p..8p+3 in its low nibbles and 8p+4..8p+7 in its high ones), then the 16 rows' fp16
    scales and 16 minimums. Returns [N / TILE_N, K / 32 * TILE_BYTES] uint8."""
    n, k = u.shape
    if n % native_ir.TILE_N or k % native_ir.CHUNK or scale.shape != (n, k // GROUP) or minimum.shape != scale.shape:
        raise ValueError(f"tiled block weights need N divisible by {native_ir.TILE_N}, K by {native_ir.CHUNK} and "
                         f"one scale/minimum per {GROUP}; got {tuple(u.shape)} with scales {tuple(scale.shape)}")
    tiles, blocks = n // native_ir.TILE_N, k // GROUP
    q = u.to(torch.uint8).view(tiles, native_ir.TILE_N, blocks, GROUP)
    if bits == 4:  # [tile, block, load, row, nibble, weight]
        q = q.view(tiles, native_ir.TILE_N, blocks, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
        ints = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(tiles, blocks, -1)
    else:  # [tile, block, quad, row, weight]
        ints = q.view(tiles, native_ir.TILE_N, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, blocks, -1)
    scales = torch.stack([scale.view(tiles, native_ir.TILE_N, blocks), minimum.view(tiles, native_ir.TILE_N, blocks)])
    scales = scales.permute(1, 3, 0, 2).half().contiguous().view(torch.uint8).view(tiles, blocks, -1)
    return torch.cat([ints, scales], -1).contiguous().view(tiles, blocks * native_ir.TILE_BYTES[bits])


def tiles_available(isa_name: str | None = None) -> bool:
    """Whether the tiled products of many rows run here (AVX-512 VNNI, or AVX2)."""
    return (isa_name or isa()) in native_ir.TILE_ISAS


ACT_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


class BlockProduct:
    """y = x @ W^T for W held in the kernels' layout; x [rows, K] -> y [rows, N], both `dtype`
    (bf16 or fp32). With `tiles` (the same weights in `pack_tiles`'s layout) a call of more than
    MAX_ROWS rows runs the tiled product; without, MAX_ROWS rows at a time."""

    def __init__(self, packed: torch.Tensor, n: int, k: int, bits: int, dtype: torch.dtype = torch.bfloat16,
                 isa_name: str | None = None, tiles: torch.Tensor | None = None) -> None:
        if dtype not in ACT_DTYPES.values():
            raise ValueError(f"the native product takes bf16 or fp32 activations, not {dtype}")
        self.lib = library(isa_name)
        self.packed, self.n, self.k, self.bits, self.dtype = packed, n, k, bits, dtype
        chunks = k // native_ir.CHUNK
        # scratch for the quantized activations, and the descriptor the kernels read
        self.quantized = torch.empty(native_ir.MAX_ROWS * k, dtype=torch.int8)
        self.act_scales = torch.empty(native_ir.MAX_ROWS * chunks * 4, dtype=torch.float32)
        fields = {"bits": bits, "wi": packed.data_ptr(), "aqi": self.quantized.data_ptr(),
                  "asci": self.act_scales.data_ptr(), "n": n, "nch": chunks, "f32": int(dtype == torch.float32)}
        self.descriptor = torch.tensor([fields[f] for f in native_ir.DESC_FIELDS], dtype=torch.int64)
        self.descriptor_address = self.descriptor.data_ptr()
        self.tiles = tiles
        if tiles is not None:
            if self.lib.tiles is None:
                raise ValueError(f"the tiled products need AVX-512 VNNI or AVX2; these kernels are {self.lib.isa}")
            fields["wi"] = tiles.data_ptr()
            self.tile_descriptor = torch.tensor([fields[f] for f in native_ir.DESC_FIELDS], dtype=torch.int64)

    @classmethod
    def affine(cls, u: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.bfloat16, isa_name: str | None = None, tiled: bool = False) -> BlockProduct:
        """`tiled`: also hold the tiled layout, where the kernels and the shape allow it."""
        n, k = u.shape
        tiles = (pack_tiles(u, scale, minimum, bits)
                 if tiled and tiles_available(isa_name) and n % native_ir.TILE_N == 0 else None)
        return cls(pack_blocks(u, scale, minimum, bits), n, k, bits, dtype, isa_name, tiles)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"the native product takes [rows, {self.k}] {_name(self.dtype)}; got "
                             f"{tuple(x.shape)} {x.dtype}")
        rows = x.shape[0]
        if rows > native_ir.MAX_ROWS and self.tiles is not None:
            return self._tiled(x)
        if rows > native_ir.MAX_ROWS or rows == 0:
            return self._in_turn(x)
        x = x.contiguous()
        y = torch.empty((rows, self.n), dtype=self.dtype)
        lib = self.lib
        with lib.lock:
            if not lib.threads_started:
                lib.start()
            # (by address: x checked above, the descriptor made by __init__; ~121 products a decode step)
            lib.product.addresses(ctl=lib.control_address, desc=self.descriptor_address, x=x.data_ptr(),
                                  y=y.data_ptr(), m=rows, workers=lib.workers)
        return y

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """The tiled product: the rows padded to a multiple of TILE_M (zero activations), the
        output's padding rows cut off."""
        x = x.contiguous()
        rows = x.shape[0]
        padded = -(-rows // native_ir.TILE_M) * native_ir.TILE_M
        y = torch.empty((padded, self.n), dtype=self.dtype)
        lib = self.lib
        with running(lib) as omp:
            lib.tile_scratch(padded * self.k)
            assert lib.tiles is not None
            lib.tiles(ctl=lib.control, desc=self.tile_descriptor, x=x, y=y, m=rows, mpad=padded, workers=lib.workers,
                      aq=lib.tile_values, asc=lib.tile_scales, omp=omp)
        return y[:rows]

    def _in_turn(self, x: torch.Tensor) -> torch.Tensor:
        """More rows than one call takes: MAX_ROWS at a time (each reads the weights again); none:
        an empty product, without a call (the kernels read at least one block)."""
        if x.shape[0] == 0:
            return x.new_empty((0, self.n))
        with busy(self.lib.isa):
            return torch.cat([self(x[r : r + native_ir.MAX_ROWS]) for r in range(0, x.shape[0], native_ir.MAX_ROWS)])


def _name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def decode_attention(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                     kv_heads: int, scale: float) -> torch.Tensor:
    """Attention of decode queries q [B, heads, d] (bf16 or fp32, heads and d contiguous; rows may
    be strided) over each sequence's keys, read in place from a host pool layer kv [slots, 2 *
    kv_heads, d] of q's dtype (a slot's K heads, then its V heads): sequence b's keys are at
    slots[b * L : b * L + lengths[b]] (slots [B * L] int64, lengths [B] int64). -> [B, heads * d]
    in q's dtype. The (sequence, head) pairs are split between the caller and the workers."""
    b, heads, d = q.shape
    if (q.dtype not in ACT_DTYPES.values() or kv.dtype != q.dtype or d not in native_ir.HEAD_DIMS
            or q.stride(2) != 1 or q.stride(1) != d or not kv.is_contiguous()):
        raise ValueError(f"native decode attention takes bf16 or fp32 (q and kv alike) with head size in "
                         f"{native_ir.HEAD_DIMS} and contiguous heads; got q {tuple(q.shape)} {q.dtype}, "
                         f"kv {tuple(kv.shape)} {kv.dtype}")
    if (slots.dtype != torch.int64 or lengths.dtype != torch.int64 or not slots.is_contiguous()
            or not lengths.is_contiguous() or lengths.numel() != b):
        raise ValueError(f"native decode attention takes contiguous int64 slots and {b} int64 lengths; got "
                         f"{slots.dtype} {tuple(slots.shape)} and {lengths.dtype} {tuple(lengths.shape)}")
    longest = slots.numel() // max(1, b)
    out = torch.empty((b, heads * d), dtype=q.dtype)
    lib = library()
    with running(lib):
        stride = lib.attention_scratch(longest)
        lib.attention(ctl=lib.control, q=q, qstride=q.stride(0), kv=kv, kvstride=kv.stride(0), idx=slots,
                      maxkv=longest, lens=lengths, out=out, items=b * heads, heads=heads, kvheads=kv_heads,
                      scale=scale, scratch=lib.scratch, sstride=stride, workers=lib.workers, dim=d,
                      f32=int(q.dtype == torch.float32))
    return out



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 rows x [rows, K] (contiguous, K a multiple of 16) by an fp32 weight [K]:
    x / sqrt(mean(x^2) + eps) * weight in one pass a row, the rows split between the threads
    (torch's OpenMP pool outside a busy stretch), a few rows on this thread alone."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 16
            or not x.is_contiguous() or weight.shape != (x.shape[1],) or not weight.is_contiguous()):
        raise ValueError(f"the native RMSNorm takes contiguous fp32 [rows, K] with K a multiple of 16 and an fp32 "
                         f"[K] weight; got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    y = torch.empty_like(x)
    lib = library()
    with running(lib) as omp:
        lib.norm(ctl=lib.control, x=x, w=weight, y=y, k=x.shape[1], eps=eps, rows=x.shape[0], workers=lib.workers,
                 threads=omp)
    return y


def prefill_available() -> bool:
    """Whether `prefill_attention` runs here (the AVX-512 VNNI or AVX2 kernels' module)."""
    return isa() in native_ir.PREFILL_ISAS


@functools.cache
def _vendor() -> str:
    """The processor's vendor_id (AuthenticAMD, GenuineIntel), or "" if unreadable."""
    return cpuinfo_field(("vendor_id",)) or ""


def prefill_bf16_available() -> bool:
    """Whether `prefill_attention(bf16=True)` runs here (the AVX-512 module on a processor with
    AVX-512 BF16)."""
    return isa() == "avx512" and BF16_NEEDS in _host_features()


def prefill_preferred() -> bool:
    """Whether prompts take `prefill_attention` rather than torch's flash kernel here: with the
    AVX-512 module wherever it runs; with the AVX2 one on AMD processors only, where it beats the
    flash kernel (on Intel processors it lost: docs/machines.md; docs/benchmarks.md, "One number
    format for every processor")."""
    return prefill_available() and (isa() == "avx512" or _vendor() == "AuthenticAMD")


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      isa_name: str | None = None, bf16: bool = False,
                      slots: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prompt's queries q [n, heads, 64] (fp32; heads and d contiguous,
    tokens may be strided) at the last n of a sequence's N positions, whose keys and values are
    rows `slots` (int64 [N]; None: all rows in order) of k, v [R, kv_heads, 64] (fp32; heads and d
    contiguous, rows may be strided: a host pool's layer, K and V sharing a row), N - n of them a
    cached prefix -> [n, heads * 64]. K and V are laid out once per call as the kernel reads them
    (`ir_prompt_attention._layout`: [kv_heads, N / 16, 64, 16] and [kv_heads, N, 64], N padded to 16); the
    items (PREFILL_ROWS positions of one head) are split between the threads (torch's OpenMP pool
    outside a busy stretch). `isa_name`: the kernels of that instruction set (default: this
    process's). `bf16` (AVX-512 BF16 processors: `prefill_bf16_available`): q, K, V and the weights
    rounded to bf16 and multiplied in pairs into fp32 sums, as GPU attention kernels multiply."""
    n, heads, d = q.shape
    rows, kv_heads = k.shape[0], k.shape[1]
    total = rows if slots is None else slots.shape[0]
    if (q.dtype != torch.float32 or k.dtype != torch.float32 or v.dtype != torch.float32 or d != 64
            or q.stride(2) != 1 or q.stride(1) != d or k.shape != v.shape or k.shape[2] != d
            or any(t.stride(2) != 1 or t.stride(1) != d for t in (k, v)) or total < n or heads % kv_heads):
        raise ValueError(f"native prompt attention takes fp32 q [n, heads, 64] and k, v [R, kv_heads, 64] (heads and "
                         f"d contiguous) with kv_heads dividing heads and at least n positions; got q "
                         f"{tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, v {tuple(v.shape)}, "
                         f"{total} positions")
    if slots is not None and (slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous()
                              or total and not 0 <= int(slots.min()) <= int(slots.max()) < rows):
        raise ValueError(f"native prompt attention takes slots as contiguous int64 [N] rows of k and v (0..{rows - 1})")
    if total >= 2**31:  # (the kernel compares positions as 32-bit lanes)
        raise ValueError(f"native prompt attention takes fewer than 2^31 positions; got {total}")
    lib = library(isa_name)
    kernel = lib.prefill_bf16 if bf16 else lib.prefill
    if kernel is None or lib.layout is None:
        raise ValueError("the bf16 prompt attention needs a processor with AVX-512 BF16" if bf16 else
                         "prompt attention runs with the AVX-512 VNNI or AVX2 kernels")
    out = torch.empty((n, heads * d), dtype=torch.float32)
    if n == 0:
        return out
    padded = -(-total // 16) * 16
    # the keys in blocks of 16, each block [d, 16]: read in order (rows of a [d, N] layout N * 4
    # bytes apart fall into the same cache sets: docs/machines.md)
    # (bf16: each key's dims in pairs [kv_heads, N / 16, 32, 16, 2], and the values' keys in pairs
    # [kv_heads, N / 2, 64, 2], as `vdpbf16ps` multiplies them)
    dtype = torch.bfloat16 if bf16 else torch.float32
    keys_t = torch.empty(kv_heads * padded * d, dtype=dtype)
    values = torch.empty(kv_heads * padded * d, dtype=dtype)
    index = torch.arange(total) if slots is None else slots
    with running(lib) as omp:
        lib.layout(ctl=lib.control, ks=k, vs=v, kstride=k.stride(0), vstride=v.stride(0), idx=index, n=total,
                   padded=padded, kvh=kv_heads, kt=keys_t, vv=values, isbf16=int(bf16), workers=lib.workers,
                   threads=omp)
        # each part's scores: PREFILL_ROWS rows of the keys, then (bf16) its item's queries
        part = native_ir.PREFILL_ROWS * (padded + native_ir.PREFILL_ROW_PAD) + native_ir.PREFILL_Q_SCRATCH
        scratch = torch.empty(max(omp, lib.workers + 1) * part, dtype=torch.float32)
        kernel(ctl=lib.control, q=q, qstride=q.stride(0), kt=keys_t, v=values, out=out, pheads=heads,
               pkvheads=kv_heads, tq=n, prefix=total - n, tpad=padded, scale2=scale / math.log(2), workers=lib.workers,
               threads=omp, scratch=scratch)
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """For contiguous fp32 x [T, heads, d] (d 64 or 128) and a token's cos and sin [T, 1, d]: x * cos
    + roll(x, d / 2, -1) * sin for each token's first `rot` heads (the rotary embedding of its q and
    k, each product rounded as torch rounds it), the rest (its v) as they are; in one pass."""
    d = x.shape[-1]
    if (x.dtype != torch.float32 or cos.dtype != x.dtype or sin.dtype != x.dtype or d not in native_ir.HEAD_DIMS
            or x.dim() != 3 or cos.shape != (x.shape[0], 1, d) or sin.shape != cos.shape or not 0 <= rot <= x.shape[1]
            or not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())):
        raise ValueError(f"the native rotation takes contiguous fp32 x [T, heads, 64 or 128], cos and sin [T, 1, d] and "
                         f"at most `heads` heads to rotate; got {tuple(x.shape)} {x.dtype}, {tuple(cos.shape)} "
                         f"{cos.dtype}, {tuple(sin.shape)} {sin.dtype}, {rot}")
    y = torch.empty_like(x)
    lib = library()
    with running(lib) as omp:
        lib.rotate(ctl=lib.control, x=x, c=cos, s=sin, y=y, dim=d, heads=x.shape[1], rot=rot, rows=x.numel() // d,
                   workers=lib.workers, threads=omp)
    return y


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for contiguous fp32 rows [gate | up] of 2 * I values (I a multiple of 16)
    -> [rows, I], in one pass (silu's exponential to ~1e-8 relative)."""
    if (gate_up.dtype != torch.float32 or gate_up.dim() != 2 or gate_up.shape[1] % 32
            or not gate_up.is_contiguous()):
        raise ValueError(f"the native SwiGLU takes contiguous fp32 [rows, 2 * I] with I a multiple of 16; got "
                         f"{tuple(gate_up.shape)} {gate_up.dtype}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    y = gate_up.new_empty((rows, inter))
    lib = library()
    with running(lib) as omp:
        lib.swiglu(ctl=lib.control, gu=gate_up, y=y, inter=inter, rows=rows, workers=lib.workers, threads=omp)
    return y


def write_rows(dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """dst[slots[t]] = src[t] for a contiguous dst [S, ...] and src [T, ...] of dst's row shape
    and dtype whose rows are each contiguous (rows themselves may be strided; int64 slots [T] in
    range): `index_copy_` in one loop of row copies, cheaper a call than torch's (docs/machines.md)."""
    if (src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or not dst.is_contiguous()
            or not src[:1].is_contiguous() or slots.dtype != torch.int64 or not slots.is_contiguous()
            or slots.shape != (src.shape[0],)):
        raise ValueError(f"native row writes take a contiguous dst, src rows of its shape and dtype, each "
                         f"contiguous, and int64 slots, one a row; got dst {tuple(dst.shape)} {dst.dtype}, src "
                         f"{tuple(src.shape)} {src.dtype}, slots {tuple(slots.shape)} {slots.dtype}")
    width = dst[0].numel() * dst.element_size()
    library().write_rows(dst=dst, drow=width, src=src, srow=src.stride(0) * src.element_size(), slots=slots,
                         rows=src.shape[0], width=width)
