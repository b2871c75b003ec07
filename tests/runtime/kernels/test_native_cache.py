"""The compiled native kernels kept in the cache dir (radixlm.runtime.kernels.object_cache): a second
process loads them instead of compiling, each instruction set has its own entry, and a damaged
entry or a cache dir that cannot be written falls back to compiling, with the products still the
int8 block arithmetic. Each process is a real one, started with its own $RADIXLM_CACHE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixlm.runtime.kernels import native, object_cache
from tests.runtime.kernels.test_native import _blocks, _reference

pytestmark = pytest.mark.skipif(not native.available(), reason="needs llvmlite and AVX-512 VNNI or AVX2")

# one product in a fresh process: its output saved, and whether the kernels came from the cache
_CHILD = """
import json, sys, torch
from radixlm.runtime.kernels import native
u, scale, minimum, x = torch.load(sys.argv[1])
product = native.BlockProduct.affine(u, scale, minimum, 4, torch.float32)
torch.save(product(x), sys.argv[2])
print(json.dumps({"isa": product.lib.isa, "from_cache": product.lib.from_cache}))
"""


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, tuple[torch.Tensor, ...]]:
    u, scale, minimum = _blocks(4, 96, 256, seed=7)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    path = tmp_path / "inputs.pt"
    torch.save((u, scale, minimum, x), path)
    return path, (u, scale, minimum, x)


def _run(cache: Path, inputs: tuple[Path, tuple[torch.Tensor, ...]], isa: str | None = None) -> dict[str, object]:
    """A fresh process's product with `cache` as $RADIXLM_CACHE (and `isa`'s kernels), checked
    against the int8 block arithmetic; what it reported."""
    env = {**os.environ, "RADIXLM_CACHE": str(cache)}
    if isa is not None:
        env["RADIXLM_NATIVE_ISA"] = isa
    out = cache.parent / "out.pt"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(inputs[0]), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = torch.load(out).double()
    ref = _reference(inputs[1][3], *inputs[1][:3])
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 / 8 * ref.abs().max().item())
    report: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return report


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / object_cache.SUBDIR).glob("*.o"))


def test_a_second_process_loads_the_kernels_instead_of_compiling(tmp_path, inputs):
    cache = tmp_path / "cache"
    first = _run(cache, inputs)
    assert first["from_cache"] is False
    [entry] = _entries(cache)
    assert entry.name.startswith(f"{first['isa']}-")
    second = _run(cache, inputs)
    assert second == {**first, "from_cache": True}
    assert _entries(cache) == [entry]


@pytest.mark.skipif(len(native.supported_isas()) < 2, reason="needs a processor that runs AVX-512 VNNI and AVX2")
def test_each_instruction_set_has_its_own_entry(tmp_path, inputs):
    cache = tmp_path / "cache"
    assert _run(cache, inputs, "avx512") == {"isa": "avx512", "from_cache": False}
    assert _run(cache, inputs, "avx2") == {"isa": "avx2", "from_cache": False}
    assert [p.name.split("-")[0] for p in _entries(cache)] == ["avx2", "avx512"]


def test_a_damaged_entry_is_compiled_again_and_replaced(tmp_path, inputs):
    cache = tmp_path / "cache"
    _run(cache, inputs)
    [entry] = _entries(cache)
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the code, the length unchanged
    entry.write_bytes(data)
    assert _run(cache, inputs)["from_cache"] is False
    assert _entries(cache) == [entry]
    assert entry.read_bytes() != data and object_cache.read(entry) is not None


def test_a_cache_dir_that_cannot_be_written_falls_back_to_compiling(tmp_path, inputs):
    cache = tmp_path / "not-a-dir"  # (a file: refused even to root, where a read-only mode is not)
    cache.write_text("")
    assert _run(cache, inputs)["from_cache"] is False
    assert cache.read_text() == ""


def test_entries_hold_the_object_whole_or_read_as_absent(tmp_path):
    path = object_cache.entry(tmp_path, "avx2", object_cache.key("ir", "cpu"))
    assert object_cache.read(path) is None
    obj = bytes(range(256)) * 4
    assert object_cache.write(path, obj)
    assert object_cache.read(path) == obj
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    whole = path.read_bytes()
    for damaged in (whole[:-1], whole[:10], b"", b"x" + whole[1:], whole + b"\0"):
        path.write_bytes(damaged)
        assert object_cache.read(path) is None
    (tmp_path / "blocked").write_text("")
    assert not object_cache.write(tmp_path / "blocked" / "kernels" / "entry.o", obj)


def test_the_key_changes_with_every_part():
    parts = ["ir", "znver4", "+avx2,+fma", "avx2", "x86_64-unknown-linux-gnu", "0.44.0", "15.0.7", "1"]
    keys = {object_cache.key(*parts)}
    for i in range(len(parts)):
        keys.add(object_cache.key(*parts[:i], parts[i] + "x", *parts[i + 1 :]))
    keys.add(object_cache.key("ab", "c"))
    keys.add(object_cache.key("a", "bc"))
    assert len(keys) == len(parts) + 3
