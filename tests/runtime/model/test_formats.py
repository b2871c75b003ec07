"""The number-format decisions: dtype per processor, and when weights stay quantized."""

from __future__ import annotations

from pathlib import Path

import pytest

from radixlm.runtime.kernels import native
from radixlm.runtime.model.formats import (
    AMX_DENSE_ABOVE,
    auto_dense_above,
    choose_attention,
    choose_dtype,
    choose_quantization,
    cpu_flags,
    native_tiles_run,
)
from radixlm.runtime.model.quant_linear import fp16_available

AVX2 = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def _no_measure() -> float:
    raise AssertionError("flags were readable: nothing to measure")


@pytest.mark.parametrize(("requested", "device", "flags", "dtype", "why"), [
    ("auto", "cpu", AVX512 | {"avx512_bf16"}, "bfloat16", "avx512_bf16"),  # AMD Zen 4, Intel Cooper Lake
    ("auto", "cpu", AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16", "amx_bf16"),  # Sapphire Rapids
    ("auto", "cpu", AVX512, "float32", "no native bf16"),  # Skylake-X / Ice Lake servers
    ("auto", "cpu", AVX2, "float32", "no native bf16"),  # AVX2-only (older EPYC VMs)
    ("auto", "cpu", frozenset({"fp", "asimd", "bf16", "i8mm"}), "bfloat16", "bf16"),  # Arm Neoverse V1+
    ("auto", "cpu", frozenset({"fp", "asimd"}), "float32", "no native bf16"),  # older Arm
    ("auto", "cuda", None, "bfloat16", "CUDA"),
    ("float32", "cpu", AVX512 | {"avx512_bf16"}, "float32", "--dtype"),  # explicit dtypes win
    ("bfloat16", "cpu", AVX2, "bfloat16", "--dtype"),
    ("float16", "cuda", None, "float16", "--dtype"),
])
def test_dtype_table(requested, device, flags, dtype, why):
    choice = choose_dtype(requested, device, flags, measure=_no_measure)
    assert choice.dtype == dtype and why in choice.reason


@pytest.mark.parametrize(("flags", "dtype", "why"), [
    (AVX512 | {"avx512_bf16"}, "float32", "native kernels"),  # Zen 4/5: the native kernels win over bf16
    (AVX512, "float32", "native kernels"),
    (AVX2, "float32", "native kernels"),
    (None, "float32", "native kernels"),  # nothing to measure either
    (AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"}, "float32", "native kernels"),  # AMX (its copy: below)
])
def test_dtype_of_a_four_bit_gguf_on_the_native_kernels(flags, dtype, why):
    choice = choose_dtype("auto", "cpu", flags, measure=_no_measure, native_four_bit=True)
    assert choice.dtype == dtype and why in choice.reason
    assert choose_dtype("bfloat16", "cpu", flags, native_four_bit=True).dtype == "bfloat16"  # asked for: kept
    assert choose_dtype("auto", "cuda", None, native_four_bit=True).dtype == "bfloat16"


@pytest.mark.parametrize(("speedup", "dtype"), [(2.5, "bfloat16"), (1.0, "bfloat16"), (0.35, "float32")])
def test_dtype_measured_when_flags_unreadable(speedup, dtype):
    choice = choose_dtype("auto", "cpu", None, measure=lambda: speedup)
    assert choice.dtype == dtype and f"{speedup:.2f}x" in choice.reason


def test_cpu_flags_from_cpuinfo(tmp_path: Path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\n"
                   "processor\t: 1\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_flags(x86) == frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\nCPU implementer\t: 0x41\n")
    assert cpu_flags(arm) == frozenset({"fp", "asimd", "bf16"})
    assert cpu_flags(tmp_path / "missing") is None
    assert choose_dtype("auto", "cpu", cpu_flags(arm), measure=_no_measure).dtype == "bfloat16"


@pytest.mark.parametrize(("requested", "device", "dtype", "four_bit", "method", "dense_above"), [
    ("auto", "cpu", "bfloat16", True, "q4", auto_dense_above()),  # the default model on a bf16 CPU
    ("auto", "cpu", "float32", True, "none", None),  # an fp32 asked for: dense (auto: below)
    ("auto", "cpu", "float16", True, "none", None),  # int4/int8 kernels are slow with fp16 activations
    ("auto", "cpu", "bfloat16", False, "none", None),  # safetensors / 8-bit GGUF: dense
    ("auto", "cuda", "bfloat16", True, "none", None),  # CUDA keeps its triton path
    ("none", "cpu", "bfloat16", True, "none", None),
    ("q4", "cpu", "float32", False, "q4", None),  # explicit: as asked, no dense copy
    ("int8", "cpu", "bfloat16", True, "int8", None),
])
def test_quantization_table(requested, device, dtype, four_bit, method, dense_above):
    choice = choose_quantization(requested, device, dtype, four_bit)
    assert (choice.method, choice.dense_above) == (method, dense_above) and choice.reason


@pytest.mark.skipif(not fp16_available(), reason="this torch has no FBGEMM fp16 linear for this processor")
def test_fp32_chosen_for_want_of_native_bf16_runs_fp16_weights():
    """A model that is not 4-bit GGUF blocks: fp16 weights in FBGEMM's fp16 GEMM, no dense copy;
    a 4-bit GGUF also, where the native kernels do not run."""
    choice = choose_quantization("auto", "cpu", "float32", False, auto_dtype=True)
    assert (choice.method, choice.dense_above) == ("fp16", None) and "FBGEMM" in choice.reason
    choice = choose_quantization("auto", "cpu", "float32", True, auto_dtype=True)
    if native.tiles_available():
        assert (choice.method, choice.dense_above) == ("q4", None)
        assert f"native {native.isa()} kernels" in choice.reason and "no dense copy" in choice.reason
    elif native.available():
        assert (choice.method, choice.dense_above) == ("q4", auto_dense_above("float32"))
        assert f"native {native.isa()} kernels" in choice.reason and "fp16 copy" in choice.reason
    else:
        assert (choice.method, choice.dense_above) == ("fp16", None)
    assert choose_quantization("auto", "cpu", "float32", True, dense_above=4, auto_dtype=True).dense_above == 4
    # where oneDNN multiplies bf16 in AMX tiles, prompts go to a bf16 copy (decode steps stay on the blocks)
    amx = choose_quantization("auto", "cpu", "float32", True, auto_dtype=True, amx=True)
    if native.tiles_available():
        assert (amx.method, amx.dense_above) == ("q4", AMX_DENSE_ABOVE) and "bf16 copy in AMX tiles" in amx.reason
    assert choose_quantization("auto", "cpu", "float32", False, auto_dtype=True, amx=True).method == "fp16"
    assert choose_quantization("fp16", "cpu", "float32", False).method == "fp16"
    with pytest.raises(ValueError, match="--dtype float32"):
        choose_quantization("fp16", "cpu", "bfloat16", False)


def test_quantization_errors():
    with pytest.raises(ValueError, match="CPU only"):
        choose_quantization("q4", "cuda", "bfloat16", True)
    with pytest.raises(ValueError, match="--quantization"):
        choose_quantization("int3", "cpu", "bfloat16", True)
    assert choose_quantization("q4", "cpu", "bfloat16", True, dense_above=8).dense_above == 8


def test_native_tiles_run_reads_the_file_last():
    """One predicate for the dtype and the quantization: a 4-bit GGUF runs on the native tiles
    unless a dense copy is asked for or the tiles do not run here; the GGUF's 4-bit share (a file
    read) is asked only when the rest holds."""
    asked: list[bool] = []

    def four_bit(answer: bool):
        def ask() -> bool:
            asked.append(answer)
            return answer
        return ask

    assert not native_tiles_run(four_bit(True), dense_above=8) and not asked
    assert native_tiles_run(four_bit(True), None) == native.tiles_available()
    assert not native_tiles_run(four_bit(False), None)
    assert asked == ([True, False] if native.tiles_available() else [])


@pytest.mark.parametrize(("requested", "dtype", "device", "head_dim", "backend", "preferred", "bf16", "chosen", "why"), [
    ("auto", "float32", "cpu", 64, "torch", True, True, "bfloat16", "avx512_bf16"),  # a Zen 4 serving the default model
    ("auto", "float32", "cpu", 64, "torch", True, False, "float32", "no native bf16"),  # an Ice Lake, an AVX2 EPYC
    ("float32", "float32", "cpu", 64, "torch", True, True, "float32", "--dtype"),  # fp32 asked for: fp32 products
    ("auto", "bfloat16", "cpu", 64, "torch", True, True, "bfloat16", "model's dtype"),  # bf16 activations throughout
    ("auto", "float32", "cpu", 128, "torch", True, True, "float32", "model's dtype"),  # no native kernel for 128
    ("auto", "float32", "cpu", 64, "triton", True, True, "float32", "model's dtype"),
    ("auto", "float32", "cpu", 64, "torch", False, True, "float32", "model's dtype"),  # AVX2 on an Intel: flash
    ("auto", "bfloat16", "cuda", 64, "triton", False, False, "bfloat16", "model's dtype"),
])
def test_prompt_attention_format(monkeypatch, requested, dtype, device, head_dim, backend, preferred, bf16, chosen,
                                 why):
    """bf16 products in the native prompt attention only where prompts run on it, --dtype auto
    chose fp32 activations, and the processor multiplies bf16 natively."""
    monkeypatch.setattr(native, "prefill_preferred", lambda: preferred)
    monkeypatch.setattr(native, "prefill_bf16_available", lambda: bf16)
    choice = choose_attention(requested, dtype, device, head_dim, backend)
    assert choice.dtype == chosen and why in choice.reason
