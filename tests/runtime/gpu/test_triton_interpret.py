"""The triton kernels on CPU under TRITON_INTERPRET=1 (in a subprocess: the variable must be set
before triton is imported): attention against the torch backend on tiny fp32 ragged batches,
and the fused RMSNorm / RoPE / SiLU*up, batch-1 GEMV and few-row linear kernels against plain
PyTorch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _interpreter_ok() -> bool:
    """Triton 3.6's interpreter fails on loop bounds loaded from memory; 3.9's runs them."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 9)


@pytest.mark.skipif(not _interpreter_ok(), reason="needs triton >= 3.9 (its interpreter)")
def test_triton_kernels_match_torch_under_interpreter():
    script = Path(__file__).with_name("triton_cases.py")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("rel err") == 24
    assert "store_kv equal to index copies: True" in proc.stdout
