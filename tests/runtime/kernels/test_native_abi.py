"""The native kernels' typed interface: the structs' ctypes and LLVM layouts agree, the IR's
functions have the declared signatures, the keyword callers reject bad arguments by name, and
the IR builder catches SSA slips when the IR is generated."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from radixlm.runtime.kernels import native, native_abi, native_ir
from radixlm.runtime.kernels.ir_builder import FunctionBuilder, IRError, check_function, check_module

llvm = pytest.importorskip("llvmlite.binding")

MODULES = [("avx512", omp, bf16) for omp in (False, True) for bf16 in (False, True)] + [
    ("avx2", omp, False) for omp in (False, True)]


@pytest.fixture(scope="module")
def target_data():  # type: ignore[no-untyped-def]
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.Target.from_triple("x86_64-unknown-linux-gnu").create_target_machine().target_data


@pytest.mark.parametrize("struct", native_abi.STRUCTS, ids=lambda s: s.name)
def test_ctypes_offsets_equal_llvm_offsets(struct: native_abi.Struct, target_data) -> None:  # type: ignore[no-untyped-def]
    module = llvm.parse_assembly(native_abi.type_definitions() + f"@probe = external global {struct.ir_name}\n")
    ty = module.get_struct_type(struct.name)
    assert target_data.get_abi_size(ty) == ctypes.sizeof(struct.ctype)
    for i, name in enumerate(struct.names):
        assert target_data.get_element_offset(ty, i) == struct.offset(name), name


def test_control_block_layout() -> None:
    # the sequence number alone on its cache line; each worker's slot on its own
    control = native_abi.CONTROL
    assert control.offset("stop") == 64 and control.offset("job") % 64 == 0 and control.offset("workers") % 64 == 0
    assert ctypes.sizeof(native_abi.WORKER.ctype) == 64
    with pytest.raises(KeyError, match="no field 'nope'"):
        control.index("nope")


def test_struct_rejects_a_field_declared_twice() -> None:
    with pytest.raises(ValueError, match="declares a field twice"):
        native_abi.Struct.words("Twice", ("a", "b", "a"))


@pytest.mark.parametrize(("isa", "omp", "bf16"), MODULES)
def test_module_signatures_match_declarations(isa: str, omp: bool, bf16: bool) -> None:
    ir = native_ir.module_ir(isa, omp=omp, bf16=bf16)
    check_module(ir)  # every function's SSA names, builder-made or not
    module = llvm.parse_assembly(ir)
    module.verify()
    declared = [f for f in native_abi.FUNCTIONS if f is not native_abi.PREFILL_BF16 or bf16]
    for function in declared:
        defined = module.get_function(function.name)
        assert [a.name for a in defined.arguments] == [p.name for p in function.params], function.name
        assert [str(a.type) for a in defined.arguments] == [p.ir_type for p in function.params], function.name


def test_builder_hands_out_fresh_names() -> None:
    b = FunctionBuilder(native_abi.WAKE)
    first, second = b.fresh("x"), b.fresh("x")
    assert first != second and re.fullmatch(r"%x\.\d+", first)
    b.emit("entry:", f"  {first} = add i64 %workers, 1", f"  {second} = add i64 {first}, 1", "  ret void")
    text = b.text()
    assert text.startswith("define void @wake(ptr %ctl, i64 %workers) {") and text.rstrip().endswith("}")


def test_builder_catches_a_duplicate_name() -> None:
    b = FunctionBuilder(native_abi.WAKE)
    b.emit("entry:", "  %a = add i64 %workers, 1", "  %a = add i64 %workers, 2", "  ret void")
    with pytest.raises(IRError, match="%a defined twice"):
        b.text()


def test_builder_catches_a_parameter_redefined() -> None:
    b = FunctionBuilder(native_abi.WAKE)
    b.emit("entry:", "  %workers = add i64 1, 1", "  ret void")
    with pytest.raises(IRError, match="%workers defined twice"):
        b.text()


def test_check_catches_use_before_definition_and_undefined_names() -> None:
    head = native_abi.WAKE.define()
    with pytest.raises(IRError, match="%b used on line 3 before its definition"):
        check_function(f"{head}\nentry:\n  %a = add i64 %b, 1\n  %b = add i64 %workers, 1\n  ret void\n}}\n")
    with pytest.raises(IRError, match="%c used but never defined"):
        check_function(f"{head}\nentry:\n  %a = add i64 %c, 1\n  ret void\n}}\n")
    with pytest.raises(IRError, match="undefined label %nowhere"):
        check_function(f"{head}\nentry:\n  br label %nowhere\n}}\n")
    # a phi may name a value defined further down (its loop's back edge)
    check_function(f"{head}\nentry:\n  br label %loop\nloop:\n  %i = phi i64 [0, %entry], [%n, %loop]\n"
                   f"  %n = add i64 %i, 1\n  %go = icmp ult i64 %n, %workers\n  br i1 %go, label %loop, label %exit\n"
                   f"exit:\n  ret void\n}}\n")


def test_call_checks_argument_names() -> None:
    with pytest.raises(ValueError, match="missing.*'workers'"):
        native_abi.WAKE.call({"ctl": "%ctl"})


needs_native = pytest.mark.skipif(not native.available(), reason="needs llvmlite and AVX-512 VNNI or AVX2")


@needs_native
def test_kernel_rejects_a_wrong_or_missing_keyword() -> None:
    lib = native.library()
    x, w = torch.ones(2, 16), torch.ones(16)
    args = dict(ctl=lib.control, x=x, w=w, y=torch.empty(2, 16), k=16, eps=1e-6, rows=2, workers=0, threads=0)
    with pytest.raises(TypeError, match="unexpected argument weight"):
        lib.norm(**{**args, "weight": w})
    without = {k: v for k, v in args.items() if k != "eps"}
    with pytest.raises(TypeError, match="missing argument eps"):
        lib.norm(**without)
    lib.norm(**args)  # (the same call, right, runs)
    assert torch.allclose(args["y"], torch.ones(2, 16), atol=1e-5)


@needs_native
def test_kernel_rejects_a_wrong_dtype_shape_or_type_by_name() -> None:
    lib = native.library()
    args = dict(ctl=lib.control, x=torch.ones(2, 16), w=torch.ones(16), y=torch.empty(2, 16), k=16, eps=1e-6, rows=2,
                workers=0, threads=0)
    with pytest.raises(ValueError, match="argument w must be float32, not bfloat16"):
        lib.norm(**{**args, "w": torch.ones(16, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="argument y holds 16 elements; the call reads or writes 32"):
        lib.norm(**{**args, "y": torch.empty(1, 16)})
    with pytest.raises(ValueError, match="argument x must be contiguous"):
        lib.norm(**{**args, "x": torch.ones(16, 2).t()})
    with pytest.raises(TypeError, match="argument rows must be an int, not float"):
        lib.norm(**{**args, "rows": 2.0})
    with pytest.raises(TypeError, match="argument x must be a tensor, not int"):
        lib.norm(**{**args, "x": args["x"].data_ptr()})  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="argument ctl must be a Control struct"):
        lib.norm(**{**args, "ctl": lib.control_address})
    with pytest.raises(ValueError, match="argument slots holds 1 elements; the call reads or writes 2"):
        lib.write_rows(dst=torch.zeros(4, 16), drow=64, src=torch.ones(2, 16), srow=64,
                       slots=torch.zeros(1, dtype=torch.int64), rows=2, width=64)
