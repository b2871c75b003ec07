"""CompilePool: jobs past the time limit fail at once and hand their slot on, up to a bound."""

from __future__ import annotations

import threading

import pytest

from radixlm.runtime.constrained.compile_pool import CompilePool


def test_an_overdue_job_fails_and_hands_its_slot_on_up_to_twice_the_workers():
    release = threading.Event()
    started: list[str] = []

    def job(tag: str) -> str:
        started.append(tag)
        release.wait()  # stuck until the test lets it go
        return tag

    pool = CompilePool(1, 0.5, on_timeout=lambda tag: f"{tag} overdue")  # c runs within 0.5 s even on a loaded machine
    try:
        a = pool.submit(job, "a")
        with pytest.raises(ValueError, match="^a overdue$"):
            a.result(timeout=60)
        b = pool.submit(job, "b")  # a runs on, abandoned; its slot went to b
        with pytest.raises(ValueError, match="^b overdue$"):
            b.result(timeout=60)  # a hang here: the stuck job kept its slot
        c = pool.submit(job, "c")  # two abandoned jobs: c waits for one of them to end
        assert started == ["a", "b"] and not c.done()
        release.set()
        assert c.result() == "c"  # started once a or b returned, within its own time limit
        assert started == ["a", "b", "c"]
    finally:
        release.set()
        pool.shutdown()


def test_results_errors_and_cancelled_jobs():
    pool = CompilePool(2, 60.0)
    gate = threading.Event()
    try:
        assert pool.submit(lambda x: x * 2, 21).result() == 42
        with pytest.raises(KeyError):
            pool.submit(lambda: {}["missing"]).result()
        blockers = [pool.submit(gate.wait) for _ in range(2)]
        ran: list[int] = []
        queued = pool.submit(ran.append, 1)
        assert queued.cancel()  # its request was aborted while it waited for a slot
        gate.set()
        assert all(f.result() for f in blockers)
        assert pool.submit(lambda: "after").result() == "after"
        assert ran == []
    finally:
        gate.set()
        pool.shutdown()
