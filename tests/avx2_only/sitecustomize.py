"""Run radixlm as on a processor with AVX2 alone, on one that has more (AVX-512, AMX): put this folder
first on PYTHONPATH, with torch's and oneDNN's own kernels held to AVX2 too:

    PYTHONPATH=tests/avx2_only ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m pytest -q

Every Python process started so (pytest's workers, the servers the tests start) sees the processor
without AVX-512, AMX, GFNI and AVX-VNNI where radixlm asks: the flags of /proc/cpuinfo
(`--dtype auto`, the number formats), LLVM's host features (the native kernels' instruction set)
and torch's bf16 query (the prompt attention's path). Each module is changed as it is first
imported, so a process that never imports torch or the runtime still does not (the router's test).
FBGEMM still picks its kernels from the processor itself. docs/engine.md, "Number formats"."""

from __future__ import annotations

import importlib.abc
import re
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

GONE = re.compile(r"^(avx512|amx|gfni|avx_?vnni|avx10)")


def _llvmlite(module: Any) -> None:
    host = module.get_host_cpu_features

    def features() -> Any:
        found = host()
        for name in list(found):
            if GONE.match(name.replace("-", "_")):
                found[name] = False
        return found

    module.get_host_cpu_features = features


def _cpuinfo(module: Any) -> None:
    field = module.cpuinfo_field

    def without(names: tuple[str, ...], cpuinfo: Any = module.CPUINFO) -> str | None:
        value: str | None = field(names, cpuinfo)
        if value is not None and cpuinfo == module.CPUINFO and ("flags" in names or "Features" in names):
            value = " ".join(flag for flag in value.split() if not GONE.match(flag))
        return value

    module.cpuinfo_field = without


def _torch_cpu(module: ModuleType) -> None:
    for name in ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
                 "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(module, name):
            setattr(module, name, lambda: False)


CHANGES: dict[str, Callable[[ModuleType], None]] = {
    "llvmlite.binding": _llvmlite,
    "radixlm.runtime.kernels.cpuinfo": _cpuinfo,
    "torch.cpu": _torch_cpu,
}


class _Changed(importlib.abc.MetaPathFinder):
    """Finds CHANGES' modules through the other finders and changes each once it has run."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name not in CHANGES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module = _then(spec.loader.exec_module, CHANGES[name])  # type: ignore[method-assign,assignment]
                return spec
        return None


def _then(run: Callable[[ModuleType], None], change: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def exec_module(module: ModuleType) -> None:
        run(module)
        change(module)

    return exec_module


sys.meta_path.insert(0, _Changed())
