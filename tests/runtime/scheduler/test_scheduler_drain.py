"""Property test: random workloads drain with correct outputs, valid KV and no leaked slots."""

from __future__ import annotations

import functools
import math

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_sim import Sim, expected_prompt_logits, reference_output

from radixlm.runtime.scheduler import ProgramTag


@functools.cache
def alone_output(prompt: tuple[int, ...], max_new: int, cache: str, page_size: int) -> tuple[list[int], str]:
    """The request run alone on a fresh scheduler with a pool that fits it."""
    sim = Sim(len(prompt) + max_new + 1, cache=cache, page_size=page_size)
    req = sim.add("alone", list(prompt), max_new)
    sim.run()
    sim.check_idle()
    return list(req.output_ids), req.finish_reason


@st.composite
def workloads(draw, tight: bool = False):
    """(cache, page_size, pool, scheduler config, requests); tight: pools that force retraction."""
    cache = draw(st.sampled_from(["radix", "none"]))
    page_size = draw(st.sampled_from([1, 2])) if cache == "radix" else 1
    # prompts share prefixes of a few bases over a small alphabet; long bases trigger dedup
    bases = draw(st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=3))
    n = draw(st.integers(2 if tight else 1, 20))
    aborts = not tight and draw(st.booleans())
    reqs = []
    for i in range(n):
        base = draw(st.sampled_from(bases))
        cut = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        suffix = draw(st.lists(st.integers(0, 49), max_size=8))
        prompt = base[:cut] + suffix or [draw(st.integers(0, 49))]
        max_new = draw(st.integers(6, 12) if tight else st.integers(0, 12))
        arrive = draw(st.one_of(st.just(0), st.just(0), st.integers(0, 12)))
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(0, 25))) if aborts else None
        lsl = draw(st.one_of(st.just(-1), st.just(-1), st.integers(0, len(prompt) + 1)))
        # requests of a few programs: fork-prefix prefills that hold their KV, and branches
        program = None
        if draw(st.booleans()):
            group = draw(st.sampled_from([None, "f0", "f1"]))
            hold = draw(st.integers(0, 3)) if group is not None and max_new == 0 else 0
            program = ProgramTag(draw(st.sampled_from(["p0", "p1", "p2"])), group, hold)
        reqs.append((f"r{i}", prompt, max_new, arrive, abort_at, lsl, program))
    demands = [len(p) + m for _, p, m, *_ in reqs]
    # from the largest single request (0) to twice the total demand
    frac = draw(st.sampled_from([0, 1 / 4, 1 / 3] if tight else [0, 1 / 3, 1 / 2, 1, 2]))
    pool = max(max(demands), math.ceil(sum(demands) * frac))
    ratios = [(0.7, 0.1), (0.2, 0.2)] if tight else [(0.7, 0.1), (0.2, 0.2), (1.0, 1.0)]
    init_ratio, min_ratio = draw(st.sampled_from(ratios))
    config = dict(
        policy=draw(st.sampled_from(["lpm", "dfs-weight", "fcfs"])),
        chunked_prefill_size=draw(st.sampled_from([0, 4, 512])),
        max_prefill_tokens=draw(st.sampled_from([4096, 8])),
        max_running_requests=draw(st.sampled_from([64, 3])),
        program_scheduling=draw(st.booleans()),
        program_fairness=draw(st.sampled_from([1, 2, 64])),
        lpm_max_queue=draw(st.sampled_from([128, 4])),
        init_new_token_ratio=init_ratio,
        min_new_token_ratio=min_ratio,
        # measured step costs: a frozen clock, or a fixed part of 1 s and a cost per prompt token
        step_seconds=draw(st.sampled_from([None, paced(0.0625), paced(0.5), paced(3.0)])),
        decode_slowdown=draw(st.sampled_from([0, 1.5, 3.0])),
        prefill_step_seconds=draw(st.sampled_from([0, 0.1, 4.0])),
    )
    return cache, page_size, pool, config, reqs


def paced(token_s: float):
    def seconds(step) -> float:
        return 1.0 + token_s * sum(len(s.seq.token_ids) for s in step if s.prefill)

    return seconds


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(workloads())
def test_random_workloads_drain(workload):
    check_drain(workload)


@SETTINGS
@given(workloads(tight=True))
def test_tight_pools_drain(workload):
    check_drain(workload)


def check_drain(workload) -> None:
    """Run the workload to the end; outputs, KV validity and slot accounting are checked."""
    cache, page_size, pool, config, reqs = workload
    sim = Sim(pool, cache=cache, page_size=page_size, **config)
    aborted: set[str] = set()

    def before_step(sim: Sim) -> None:
        idle = not sim.sched.has_work
        for rid, prompt, max_new, arrive, abort_at, lsl, program in reqs:
            # arrive at step `arrive`, or as soon as the scheduler would otherwise be idle
            if rid not in sim.requests and (arrive <= sim.num_steps or idle):
                sim.add(rid, prompt, max_new, logprob_start_len=lsl, program=program)
            if abort_at is not None and abort_at == sim.num_steps and rid in sim.requests:
                if sim.sched.abort(rid) is not None:
                    aborted.add(rid)

    sim.run(before_step=before_step)
    event(f"retracted: {sim.sched.num_retractions > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"served from cache: {any(r.cached_tokens for r in sim.requests.values())}")
    assert len(sim.requests) == len(reqs)
    event(f"fork prefix held: {sim.sched.held_tokens > 0}")
    for name in ("p0", "p1", "p2"):  # the server ends each program when its response is sent
        sim.sched.end_program(name)
    assert not sim.sched.programs.started
    sim.check_idle()
    for rid, prompt, max_new, _, _, lsl, _ in reqs:
        req = sim.requests[rid]
        ref = reference_output(prompt, max_new)
        if rid in aborted:
            assert req.finish_reason == "abort"
            assert req.output_ids == ref[: len(req.output_ids)], f"{rid}: aborted output diverged"
            continue
        alone, alone_reason = alone_output(tuple(prompt), max_new, cache, page_size)
        assert alone == ref and alone_reason == "length"
        assert req.finish_reason == "length", f"{rid}: finished with {req.finish_reason!r}"
        assert req.output_ids == alone, f"{rid}: output differs from the request run alone"
        logits = sim.prompt_logit_pos[rid]
        if max_new == 0 and lsl < 0:
            assert logits == [], f"{rid}: logits returned for a prefill-only request"
        else:
            assert sorted(logits) == expected_prompt_logits(len(prompt), lsl), f"{rid}: prompt logit rows"
