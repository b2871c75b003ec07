"""EngineCore.integrity_report (served as GET /debug/check): it passes after real requests and
names each kind of broken invariant it is meant to catch."""

from __future__ import annotations

import pytest

from radixlm.runtime.engine import Engine
from radixlm.runtime.intake import Submission
from radixlm.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


def test_integrity_report_passes_and_catches_leaks_and_stray_locks():
    engine = Engine(dtype="float32", max_total_tokens=512, context_length=256)
    try:
        core = engine.core
        prompt = core.tokenizer.encode("The capital of France is")
        core.add_request(Submission("running", prompt, SamplingParams(max_new_tokens=6, temperature=0)))
        core.step()
        core.step()  # the request now holds the slots of its decoded tokens, beyond its cached prefix
        report = core.integrity_report()
        assert report["ok"] and not report["idle"], report["errors"]
        assert report["running_requests"] == 1 and report["kv_slots_held_by_requests"] > 0, report
        held = report["kv_slots_free"] + report["cache_tokens"] + report["kv_slots_held_by_requests"]
        assert held == report["kv_slots_total"], report
        while core.has_work:
            core.step()

        engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 4})
        report = core.integrity_report()
        assert report["ok"] and report["idle"], report["errors"]
        assert report["kv_slots_free"] + report["cache_tokens"] == report["kv_slots_total"]
        assert report["cache_tokens"] > 0 and report["kv_slots_held_by_requests"] == 0

        stray = core.allocator.alloc(3)  # slots nobody accounts for: a leak
        report = core.integrity_report()
        assert not report["ok"] and any("leaked" in e for e in report["errors"]), report
        core.allocator.free(stray)

        node = core.cache.match_prefix(core.tokenizer.encode("The capital")).node
        core.cache.lock(node)  # a lock left behind with nothing running
        report = core.integrity_report()
        assert not report["ok"] and any("locked while idle" in e for e in report["errors"]), report
        core.cache.unlock(node)
        assert core.integrity_report()["ok"]
    finally:
        engine.shutdown()
