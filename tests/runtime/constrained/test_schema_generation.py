"""The short version of benchmarks/schema_generation.py: generate under real JSONSchemaBench
schemas (two per file), greedy and sampled; every finished output validates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from radixlm.runtime.engine import Engine

pytestmark = pytest.mark.slow

BENCH_DIR = Path(__file__).resolve().parents[4] / "shared" / "data" / "jsonschemabench"  # beside the checkout
SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "schema_generation.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("schema_generation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_outputs_validate():
    if not BENCH_DIR.exists():
        pytest.skip(f"{BENCH_DIR} is missing")
    bench = _bench_module()
    schemas = bench.sample_schemas(10, seed=1, data=BENCH_DIR)
    assert len(schemas) == 10
    engine = Engine(max_total_tokens=20000, context_length=4096)  # the number format that suits this processor
    try:
        res = bench.run(engine, schemas, max_new=96)
        engine.core.check_idle_integrity()
    finally:
        engine.shutdown()
    # Synthesized/Handwritten schemas use "not"/approximated keywords: refused (5 of the 10 compile)
    assert res["compiled"] >= 5, res["failures"]
    for mode, counts in res["counts"].items():
        assert counts.get("invalid", 0) == 0, (mode, res["failures"])
        assert counts.get("valid", 0) + counts.get("length", 0) == res["compiled"]
    assert res["counts"]["greedy"].get("valid", 0) >= 3
