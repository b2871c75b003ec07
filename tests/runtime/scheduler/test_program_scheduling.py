"""Program-aware admission, driven without a model (see sched_sim.py): running programs first within
the fairness bound, fork siblings together, fork prefixes held until their branches are admitted."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_sim import Sim, reference_output

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import ProgramTag, Request


def psim(*args, **kwargs) -> Sim:
    """A Sim with program scheduling on unless told otherwise (the flag's default is off)."""
    kwargs.setdefault("program_scheduling", True)
    return Sim(*args, **kwargs)


def admission_order(sim: Sim) -> list[str]:
    """rids in the order they were first admitted (their first prefill chunk)."""
    seen: list[str] = []
    for step in sim.history:
        for s in step:
            if s.prefill and s.req.rid not in seen:
                seen.append(s.req.rid)
    return seen


def step_until(sim: Sim, cond) -> None:
    for _ in range(500):
        if cond():
            return
        sim.step()
    raise AssertionError("condition never met")


def tag(program: str, group: str | None = None, hold: int = 0) -> ProgramTag:
    return ProgramTag(program, group, hold)


# -- running programs first --------------------------------------------------------------------
def test_a_running_programs_next_request_goes_before_a_new_program():
    orders = {}
    for on in (True, False):
        sim = psim(1000, policy="fcfs", max_running_requests=1, program_scheduling=on)
        sim.add("a1", [1, 2, 3], 2, program=tag("A"))
        sim.step()  # a1 admitted: program A runs
        sim.add("b1", [4, 5, 6], 2, program=tag("B"))  # a new program, arrived first
        sim.add("a2", [1, 2, 3, 7], 2, program=tag("A"))  # A's next gen
        sim.run()
        orders[on] = admission_order(sim)
    assert orders[True] == ["a1", "a2", "b1"]
    assert orders[False] == ["a1", "b1", "a2"]  # off: first come, first served


def test_older_programs_go_first_and_fork_siblings_stay_together():
    sim = psim(1000, policy="fcfs", max_running_requests=2)
    sim.add("p", [1, 2], 1, program=tag("P"))
    sim.add("q", [3, 4], 1, program=tag("Q"))
    sim.run()  # both started: P before Q
    for i in range(2):  # interleaved arrivals of two forks' branches
        sim.add(f"q{i}", [3, 4, 10 + i], 1, program=tag("Q", "root/f0"))
        sim.add(f"p{i}", [1, 2, 20 + i], 1, program=tag("P", "root/f0"))
    sim.run()
    assert admission_order(sim)[2:] == ["p0", "p1", "q0", "q1"]


def test_new_programs_start_in_the_order_they_came():
    """Under lpm a new program whose prompt shares a longer cached prefix would start first (and,
    with such programs arriving, an older one would wait again and again); with program scheduling
    on, new programs start first come, first served."""
    orders = {}
    for on in (True, False):
        sim = psim(1000, policy="lpm", max_running_requests=1, program_scheduling=on)
        sim.add("x", list(range(1, 21)), 1)  # leaves its 20 tokens in the cache
        sim.run()
        sim.add("b1", [40, 41, 42], 1, program=tag("B"))
        sim.add("c1", list(range(1, 21)) + [43], 1, program=tag("C"))
        sim.run()
        orders[on] = admission_order(sim)
    assert orders[True] == ["x", "b1", "c1"]
    assert orders[False] == ["x", "c1", "b1"]  # off: the longest cached prefix first


def test_requests_without_a_program_are_never_preferred_but_not_starved():
    sim = psim(1000, policy="fcfs", max_running_requests=1, program_fairness=2)
    sim.add("a0", [1], 1, program=tag("A"))
    sim.step()
    sim.add("plain", [9, 9], 1)
    for i in range(1, 6):
        sim.add(f"a{i}", [1, i + 1], 1, program=tag("A"))
    sim.run()
    order = admission_order(sim)
    assert order.index("plain") == 3  # passed over by exactly program_fairness = 2 later arrivals


def test_the_fairness_bound_counts_only_requests_actually_overtaken():
    """a1 and a2 arrived before b1, so admitting them first passes nobody: only a3 overtakes b1,
    once, which the bound of 2 allows. (Counting every running program's admission against every
    waiting request made b1 urgent after a1 and a2, and a3 waited behind it.)"""
    sim = psim(1000, policy="fcfs", max_running_requests=1, program_fairness=2)
    sim.add("a0", [1], 1, program=tag("A"))
    sim.step()  # program A runs
    for rid, prog in [("a1", "A"), ("a2", "A"), ("b1", "B"), ("a3", "A")]:
        sim.add(rid, [1, int(rid[1]) + 1, ord(prog)], 1, program=tag(prog))
    sim.run()
    assert admission_order(sim) == ["a0", "a1", "a2", "a3", "b1"]
    assert sim.requests["b1"].passed_over == 1


def test_a_request_waiting_for_a_prefix_in_flight_is_not_overtaken():
    """s2 shares s1's prompt, which s1 is still prefilling (chunks of 32): s2 waits for it, so the
    requests admitted meanwhile do not overtake it. (Counted as overtaken, s2 became urgent after
    c and, still unable to run, kept d and every later request out: under fcfs with programs
    arriving, the H100 ran half as fast with program scheduling on.)"""
    prefix = list(range(1, 41))
    sim = psim(1000, policy="fcfs", max_running_requests=4, program_fairness=1, chunked_prefill_size=32)
    sim.add("s1", prefix + [41], 2, program=tag("S"))
    sim.add("s2", prefix + [42], 2, program=tag("S"))
    sim.add("c", [7, 8, 9], 2, program=tag("C"))
    sim.add("d", [4, 5, 6], 2, program=tag("D"))
    sim.step()  # s1's first 32 tokens: the whole budget
    sim.step()  # s1's last 9; s2 waits for them; c and d go
    assert admission_order(sim) == ["s1", "c", "d"]
    assert sim.requests["s2"].passed_over == 0
    sim.run()
    assert sorted(admission_order(sim)) == ["c", "d", "s1", "s2"]


@st.composite
def program_streams(draw):
    """(fairness bound, max running, requests (rid, prompt, max_new, arrival step, program))."""
    bound = draw(st.sampled_from([1, 2, 3, 8]))
    rows = draw(st.sampled_from([1, 2, 3]))
    n = draw(st.integers(2, 24))
    reqs = []
    for i in range(n):
        program = draw(st.one_of(st.none(), st.sampled_from(["A", "B", "C", "D"])))
        group = draw(st.sampled_from([None, "f0", "f1"])) if program else None
        prompt = [i % 50, (i * 7) % 50, 49 - i % 50]  # distinct prompts: no shared-prefix waits
        reqs.append((f"r{i}", prompt, draw(st.integers(1, 4)), draw(st.integers(0, 30)),
                     tag(program, group) if program else None))
    return bound, rows, reqs


def run_stream(bound: int, rows: int, reqs, on: bool) -> Sim:
    # (no cap on the programs under way: a request held back by it is not overtaken, tested below)
    sim = psim(4000, policy="fcfs", max_running_requests=rows, program_fairness=bound, program_scheduling=on,
               program_active_cap=10**6)

    def before_step(sim: Sim) -> None:
        idle = not sim.sched.has_work
        for rid, prompt, max_new, arrive, program in reqs:
            if rid not in sim.requests and (arrive <= sim.num_steps or idle):
                sim.add(rid, prompt, max_new, program=program)

    sim.run(before_step=before_step)
    assert sim.sched.num_retractions == 0
    return sim


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program_streams())
def test_no_request_is_overtaken_by_more_than_the_fairness_bound(stream):
    """fcfs + program scheduling: for every request, at most program_fairness requests that arrived
    after it are admitted before it (off: none), and its count of them is exact; outputs are those
    of the requests run alone."""
    bound, rows, reqs = stream
    for on in (True, False):
        sim = run_stream(bound, rows, reqs, on)
        order = admission_order(sim)
        arrival = {rid: r.arrival for rid, r in sim.requests.items()}
        for k, rid in enumerate(order):
            overtakers = [o for o in order[:k] if arrival[o] > arrival[rid]]
            assert len(overtakers) <= (bound if on else 0), (rid, overtakers)
            if on:  # counted exactly, admission by admission or once after a pass
                assert sim.requests[rid].passed_over == len(overtakers), rid
        for rid, prompt, max_new, _, _ in reqs:
            assert sim.requests[rid].output_ids == reference_output(prompt, max_new), rid
        for name in "ABCD":
            sim.sched.end_program(name)
        sim.check_idle()


# -- programs under way capped ------------------------------------------------------------------
def test_no_new_program_starts_while_the_cap_is_reached():
    """cap 2 with 4 rows: programs A and B run, C waits for one of them to end (its rows stay
    free meanwhile); a request of no program is not held back; the passes C waited through are
    not counted against the fairness bound (it could not start)."""
    sim = psim(1000, policy="fcfs", max_running_requests=4, program_active_cap=2, program_fairness=1)
    sim.add("a1", [1, 2, 3], 6, program=tag("A"))
    sim.add("b1", [4, 5, 6], 6, program=tag("B"))
    sim.step()
    sim.add("c1", [7, 8, 9], 2, program=tag("C"))
    sim.add("x", [10, 11, 12], 2)  # no program
    sim.step()
    assert admission_order(sim) == ["a1", "b1", "x"]
    assert sim.requests["c1"].passed_over == 0
    step_until(sim, lambda: sim.requests["a1"].status.value == "finished")
    sim.sched.end_program("A")
    sim.step()
    assert admission_order(sim) == ["a1", "b1", "x", "c1"]
    sim.run()
    for name in "BC":
        sim.sched.end_program(name)
    sim.check_idle()


def test_a_program_between_two_requests_keeps_its_place_for_program_gap_steps():
    """cap 1: A's next request, arriving within program_gap_steps steps of its last one's end,
    runs before B starts; once A has sent nothing for longer, B starts."""
    for late, expected in ((1, ["x", "a1", "a2", "b1"]), (4, ["x", "a1", "b1", "a2"])):
        sim = psim(1000, policy="fcfs", max_running_requests=3, program_active_cap=1, program_gap_steps=2)
        sim.add("x", [9, 9, 9], 20)  # no program: keeps the server busy
        sim.add("a1", [1, 2, 3], 1, program=tag("A"))
        sim.step()
        sim.add("b1", [4, 5, 6], 1, program=tag("B"))
        sim.step()  # a1 ended in the step before; A is between two requests
        for _ in range(late - 1):
            sim.step()
        sim.add("a2", [1, 2, 3, 7], 1, program=tag("A"))
        sim.run()
        assert admission_order(sim) == expected, late
        for name in "AB":
            sim.sched.end_program(name)
        sim.check_idle()


def test_a_program_the_server_runs_stays_under_way_until_it_ends():
    """cap 1: A is run by the server (managed), so it keeps its place between two requests however
    long the next one takes; B starts only once A has ended. A client's program (the test above)
    loses it after program_gap_steps."""
    sim = psim(1000, policy="fcfs", max_running_requests=3, program_active_cap=1, program_gap_steps=2)
    sim.add("x", [9, 9, 9], 30)  # no program: keeps the server busy
    sim.add("a1", [1, 2, 3], 1, program=ProgramTag("A", managed=True))
    sim.step()
    sim.add("b1", [4, 5, 6], 1, program=tag("B"))
    for _ in range(10):  # far past the gap
        sim.step()
    assert "b1" not in admission_order(sim)
    sim.add("a2", [1, 2, 3, 7], 1, program=ProgramTag("A", managed=True))
    sim.step()
    sim.step()
    assert admission_order(sim) == ["x", "a1", "a2"]
    sim.sched.end_program("A")
    sim.run()
    assert admission_order(sim) == ["x", "a1", "a2", "b1"]
    sim.sched.end_program("B")
    sim.check_idle()


def test_a_programs_round_trips_are_counted():
    """Each request of a started program that comes while it has none in flight is a round trip:
    counted, with its steps, and as late when it took longer than program_gap_steps."""
    sim = psim(1000, policy="fcfs", max_running_requests=3, program_gap_steps=2)
    sim.add("x", [9, 9, 9], 30)
    sim.add("a1", [1, 2, 3], 1, program=tag("A"))
    sim.step()  # a1 ends in its first step
    sim.add("a2", [1, 2, 3, 4], 1, program=tag("A"))  # back at once
    sim.step()
    for _ in range(5):
        sim.step()
    sim.add("a3", [1, 2, 3, 4, 5], 1, program=tag("A"))  # 5 steps later: late
    sim.run()
    s = sim.sched
    assert (s.programs.returns, s.programs.returns_late) == (2, 1)
    assert s.programs.return_steps == 0 + 5
    sim.sched.end_program("A")
    sim.check_idle()


def test_the_cap_never_leaves_the_server_idle():
    """With nothing running, a new program starts even while the cap counts others as between
    two requests (a client that names its programs may never send their next one)."""
    sim = psim(1000, policy="fcfs", max_running_requests=2, program_active_cap=1, program_gap_steps=100)
    sim.add("a1", [1, 2, 3], 1, program=tag("A"))
    sim.run()
    sim.add("b1", [4, 5, 6], 1, program=tag("B"))
    sim.step()
    assert admission_order(sim) == ["a1", "b1"]


# -- fork prefixes held ------------------------------------------------------------------------
PREFIX = list(range(20))


def fork_prefix(sim: Sim, branches: int) -> None:
    sim.add("prefix", PREFIX, 0, program=tag("P", "root/f0", hold=branches))
    sim.run()


def test_a_fork_prefix_survives_eviction_until_its_last_branch_is_admitted():
    for on in (True, False):
        sim = psim(200, program_scheduling=on, max_running_requests=1)
        fork_prefix(sim, 3)
        assert sim.sched.held_tokens == (20 if on else 0)
        for i in range(3):
            sim.cache.evict(1000)  # memory pressure between branches: everything unlocked goes
            sim.add(f"b{i}", PREFIX + [30 + i], 2, program=tag("P", "root/f0"))
            step_until(sim, lambda i=i: f"b{i}" in admission_order(sim))
            assert sim.requests[f"b{i}"].cached_tokens == (20 if on else 0)
            sim.run()
        assert sim.sched.held_tokens == 0  # the third branch's admission released it
        sim.sched.end_program("P")
        sim.check_idle()


def test_ending_the_program_releases_what_it_holds():
    sim = psim(200)
    fork_prefix(sim, 3)
    sim.add("b0", PREFIX + [30], 1, program=tag("P", "root/f0"))
    sim.run()
    assert sim.sched.held_tokens == 20 and sim.cache.protected_size() >= 20
    sim.sched.end_program("P")  # the other branches failed, say: nothing stays locked
    assert sim.sched.held_tokens == 0 and not sim.sched.programs.started
    sim.check_idle()


def test_a_held_prefix_is_given_up_before_work_stalls():
    sim = psim(40, max_running_requests=4)
    fork_prefix(sim, 2)
    # a request of another program that fits only once the held prefix's 20 slots are evicted
    sim.add("other", [45] * 30, 5, program=tag("Q"))
    sim.run()
    assert sim.requests["other"].output_ids == reference_output([45] * 30, 5)
    assert sim.sched.held_tokens == 0
    sim.sched.end_program("P")
    sim.check_idle()


def test_programs_nobody_ends_are_forgotten_oldest_first():
    sim = psim(4000, max_running_requests=1)
    for i in range(6):
        sim.add(f"r{i}", [i + 1], 1, program=tag(f"P{i}"))
        sim.run()
    assert list(sim.sched.programs.started) == ["P2", "P3", "P4", "P5"]  # PROGRAMS_PER_ROW x 1 row


def test_program_tags_are_checked():
    for bad in [("",), ("x" * 257,), ("p", None, 2), ("p", "g", -1), ("p", "g", True)]:
        try:
            ProgramTag(*bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_a_request_keeps_its_place_in_line_while_it_waits_to_join():
    """A request numbered when it came (``arrive``: a constrained request, whose grammar compiles
    before it joins the queue) starts in that place: before new programs that came after it, though
    they joined the queue first; under the cap on programs under way, the place decides who starts."""
    for on in (True, False):
        sim = psim(1000, policy="fcfs", max_running_requests=1, program_scheduling=on, program_active_cap=1)
        late = Request("json", [9, 9, 9], SamplingParams(max_new_tokens=2), program=tag("J"))
        sim.sched.arrive(late)  # came first; its grammar compiles
        sim.add("chain", [1, 2, 3], 2, program=tag("C"))  # came second, joined the queue at once
        sim.add("tot", [4, 5, 6], 2, program=tag("T"))
        sim.sched.add(late)  # the compile is done
        sim.requests["json"] = late
        sim.run()
        assert admission_order(sim) == ["json", "chain", "tot"], on
