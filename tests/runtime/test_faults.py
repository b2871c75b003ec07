"""Fault boundaries: an exception raised on behalf of one request, in any phase of the step, ends
that request alone. Hypothesis picks the phase, the request and how many times the request passes
the phase unharmed first; the test hook (`FaultHook`, off unless set) raises there. Every other
request must finish with the greedy text it has without the fault, and the KV bookkeeping must be
intact and idle afterwards. Run with the plain step and with the overlap schedule forced on."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlm.runtime.engine import Engine
from radixlm.runtime.faults import PHASES, FaultBoundary, FaultHook, InjectedFault, is_fatal
from radixlm.runtime.intake import Submission
from radixlm.runtime.radix_cache import IntegrityError
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.request import Request, Status

pytestmark = pytest.mark.slow

FEW_SHOT = "Translate to French.\nsea otter => loutre de mer\ncheese => fromage\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# (rid, prompt, sampling params, return_logprob): greedy requests that end by a stop, by length and
# by their grammar; one with logprobs, one constrained (masks, accepts and jumps over forced text).
REQUESTS = [
    ("few-shot", FEW_SHOT + "bread =>", {"temperature": 0, "max_new_tokens": 10, "stop": "\n"}, False),
    ("logprobs", "The capital of France is", {"temperature": 0, "max_new_tokens": 8}, True),
    ("json", "A person as JSON:", {"temperature": 0, "max_new_tokens": 20, "json_schema": SCHEMA}, False),
    ("count", "Count: one, two, three,", {"temperature": 0, "max_new_tokens": 8}, False),
]
RIDS = [r[0] for r in REQUESTS]


def run_all(engine: Engine, tag: str) -> dict[str, tuple[str, str | None, bool]]:
    """Submit every request at once and step until done: rid -> (text, error, internal)."""
    core = engine.core
    for rid, prompt, params, logprob in REQUESTS:
        core.add_request(Submission(f"{tag}{rid}", engine.encode(prompt), SamplingParams.from_dict(params),
                                    return_logprob=logprob, top_logprobs_num=2 if logprob else 0))
    texts: dict[str, str] = {}
    done: dict[str, tuple[str, str | None, bool]] = {}
    while core.has_work:
        for out in core.step():
            rid = out.rid.removeprefix(tag)  # (a request of another tag keeps its whole id)
            texts[rid] = texts.get(rid, "") + out.text_delta
            if out.finished:
                assert rid not in done, f"{rid} finished twice"
                done[rid] = (texts[rid], out.error, out.internal)
    assert set(RIDS) <= set(done)
    return done


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "overlap"])
def engine(request):
    # fp32: greedy outputs are then the same whichever requests share a batch
    e = Engine(dtype="float32", max_total_tokens=4096, overlap_schedule=request.param)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def reference(engine):
    got = run_all(engine, "ref-")
    assert all(error is None for _, error, _ in got.values()), got
    engine.flush_cache()
    return {rid: text for rid, (text, _, _) in got.items()}


@given(phase=st.sampled_from(PHASES), victim=st.sampled_from(RIDS), after=st.integers(0, 3))
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_fault_ends_its_request_alone(engine, reference, phase, victim, after):
    core = engine.core
    tag = f"{phase}-{victim}-{after}-"
    hook = FaultHook(phase, tag + victim, after)
    core.faults.hook = hook
    try:
        got = run_all(engine, tag) if phase != "admit" or after > 0 else None
        if got is None:  # a fault while admitting: add_request raises and leaves nothing behind
            with pytest.raises(InjectedFault):
                run_all(engine, tag)
            core.faults.hook = None
            while core.has_work:  # the requests admitted before it run to their end
                core.step()
            assert not core.requests
            core.check_idle_integrity()
            return
    finally:
        core.faults.hook = None
    assert set(got) == set(RIDS)
    for rid, (text, error, internal) in got.items():
        if rid == victim and hook.fired:
            assert error is not None, f"{victim} survived a fault in {phase}"
            if internal:
                assert f"request {tag + victim}" in error and "InjectedFault" in error
            continue
        assert error is None, (rid, error)
        assert text == reference[rid], (rid, phase, victim, after)
    core.check_idle_integrity()
    engine.flush_cache()


def test_finishing_and_aborting_twice_is_a_no_op(engine):
    """A request in no queue (its constraint compiling), aborted twice; a finished one aborted."""
    core = engine.core
    sub = Submission("abort-twice", engine.encode("Hello"), SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": 4, "json_schema": SCHEMA}))
    core.add_request(sub)
    first = core.abort("abort-twice")
    assert first is not None and first.finished
    assert core.abort("abort-twice") is None
    stray = Request(rid="stray", prompt_ids=[1, 2], params=SamplingParams())  # in no queue
    core.scheduler.finish(stray, "abort")
    core.scheduler.finish(stray, "abort")
    assert stray.status is Status.FINISHED
    while core.has_work:
        core.step()
    core.check_idle_integrity()


def test_the_slow_stop_regex_on_forced_text_is_a_400_and_the_engine_goes_on(engine, reference):
    """A grammar's forced opening fed to a stop regex too slow to search: that request fails with
    its input's error; requests beside it finish as without it."""
    core = engine.core
    bad = {"regex": "a{300}", "stop_regex": "(.*a){25}x", "max_new_tokens": 310, "temperature": 0}
    core.add_request(Submission("slow-stop", engine.encode("x"), SamplingParams.from_dict(bad)))
    got = run_all(engine, "beside-slow-")
    text, error, internal = got.pop("slow-stop")
    assert error is not None and "stop_regex took longer" in error and not internal
    assert {rid: text for rid, (text, _, _) in got.items()} == reference
    core.check_idle_integrity()
    engine.flush_cache()


def test_fatal_errors_are_told_apart():
    assert is_fatal(IntegrityError("leak"))
    assert is_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_fatal(InjectedFault("x"))
    assert not is_fatal(ValueError("bad"))
    boundary = FaultBoundary()
    with pytest.raises(IntegrityError):
        boundary.contain("r", "forward", IntegrityError("leak"))
    with pytest.raises(ValueError, match="unknown fault phase"):
        FaultHook("nowhere", "r")
