"""Which prompt work a step takes beside decodes: whole prompts before pieces of long ones, a
step's prompt tokens cut to a time limit, and pieces of long prompts paced so running decodes are
slowed by at most `decode_slowdown` on average. Steps cost what `cost` says on the scheduler's
clock (exact binary fractions, so the expected budgets are exact)."""

from __future__ import annotations

import pytest
from sched_sim import Sim, reference_output
from test_scheduler import assert_outputs_match_reference, prefill_steps

from radixlm.runtime.config import SchedulerConfig
from radixlm.runtime.scheduler import Scheduled
from radixlm.runtime.scheduler.pacing import REFRESH_STEPS, WINDOW, StepCosts
from radixlm.runtime.scheduler.scheduler import MIN_TIMED_PIECE

DECODE_S = 1.0  # a step of decodes alone


def cost(token_s: float):
    """A step's seconds: the fixed part plus token_s for each prompt token it feeds."""

    def seconds(step: list[Scheduled]) -> float:
        return DECODE_S + token_s * sum(len(s.seq.token_ids) for s in step if s.prefill)

    return seconds


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed) % 50 for i in range(n)]


def fed(step: list[Scheduled]) -> list[tuple[str, int]]:
    return [(s.req.rid, len(s.seq.token_ids)) for s in step]


def test_a_short_prompt_goes_before_the_piece_of_a_long_one_in_flight():
    sim = Sim(1000, chunked_prefill_size=16, max_prefill_tokens=16)
    sim.add("long", prompt(100), 2)
    sim.step()
    sim.add("medium", prompt(20, 1), 2)  # longer than a step's budget: keeps its place behind the long one
    sim.add("short", prompt(5, 2), 2)
    assert fed(sim.step()) == [("short", 5), ("long", 11)]
    assert fed(sim.step()) == [("short", 1), ("long", 16)]
    sim.run()
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_pieces_of_a_long_prompt_slow_decodes_at_most_decode_slowdown():
    """A piece of 16 adds 8 decode steps' time; the limit of 3x leaves 2 a step: after each
    piece, decode steps alone pay it back, and the decodes run 3x slower on average."""
    sim = Sim(2000, chunked_prefill_size=16, prefill_step_seconds=0, decode_slowdown=3, step_seconds=cost(0.5))
    sim.add("dec", prompt(5), 300)
    for _ in range(1 + WINDOW):  # its prompt, then decodes alone: the fixed part is measured
        sim.step()
    sim.add("long", prompt(160, 1), 2)
    start = len(sim.history)
    while not sim.requests["long"].output_ids:
        sim.step()
    steps = sim.history[start:]
    pieces = [any(s.req.rid == "long" for s in step) for step in steps]
    assert sum(pieces) == 10
    assert pieces[:7] == [True, False, False, True, False, False, False]  # credit 2 -> -4 -> 0 -> -6 -> 0
    for i in (i for i, piece in enumerate(pieces) if piece):  # before each piece, the decodes were slowed 3x at most
        elapsed = sum(cost(0.5)(step) for step in steps[:i])
        assert elapsed <= 3 * DECODE_S * i + 2 * DECODE_S  # (+ the credit saved up before the first piece)
    assert all(any(s.req.rid == "dec" and not s.prefill for s in step) for step in steps), "a decode every step"
    sim.run()
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_a_machine_slowed_from_outside_does_not_starve_the_pieces():
    """Every step runs 10x slower than when the fixed part was measured (other processes on the
    cores): the decodes' own steps earn 10x more too, so the pieces come about as often."""
    load = [1.0]
    sim = Sim(2000, chunked_prefill_size=16, prefill_step_seconds=0, decode_slowdown=3,
              step_seconds=lambda step: load[0] * cost(0.5)(step))
    sim.add("dec", prompt(5), 300)
    for _ in range(1 + WINDOW):
        sim.step()
    load[0] = 10.0
    sim.add("long", prompt(160, 1), 2)
    start = len(sim.history)
    while not sim.requests["long"].output_ids:
        sim.step()
    steps = sim.history[start:]
    assert sum(any(s.req.rid == "long" for s in step) for step in steps) == 10
    assert len(steps) <= 10 * 5  # unloaded: a piece every 4 steps
    sim.run()
    assert_outputs_match_reference(sim)


def test_a_short_prompt_is_not_held_back_while_long_pieces_wait():
    sim = Sim(2000, chunked_prefill_size=16, prefill_step_seconds=0, decode_slowdown=3, step_seconds=cost(0.5))
    sim.add("dec", prompt(5), 300)
    for _ in range(1 + WINDOW):
        sim.step()
    sim.add("long", prompt(160, 1), 2)
    assert fed(sim.step()) == [("dec", 1), ("long", 16)]
    assert not sim.sched.costs.pieces_may_run
    sim.add("short", prompt(6, 2), 3)
    assert fed(sim.step()) == [("dec", 1), ("short", 6)]  # its whole prompt; the long one's piece waits
    assert fed(sim.step()) == [("dec", 1), ("short", 1)]
    sim.run()
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_a_jumps_forced_tokens_are_not_held_back_with_the_pieces():
    sim = Sim(2000, chunked_prefill_size=16, prefill_step_seconds=0, decode_slowdown=3, step_seconds=cost(0.5))
    jumper = sim.add("jumper", prompt(5), 40)
    for _ in range(1 + WINDOW):
        sim.step()
    long = sim.add("long", prompt(160, 1), 2)
    sim.step()
    assert not sim.sched.costs.pieces_may_run
    jumper.output_ids.extend([1, 2, 3])  # forced tokens a jump forward wrote, without KV yet
    assert fed(sim.step()) == [("jumper", 4)]  # with the decodes; the long prompt's piece waits
    sim.run()
    assert long.output_ids == reference_output(long.prompt_ids, 2)
    sim.check_idle()


def test_no_pacing_without_decode_slowdown():
    sim = Sim(2000, chunked_prefill_size=16, prefill_step_seconds=0, decode_slowdown=0, step_seconds=cost(0.5))
    sim.add("dec", prompt(5), 300)
    for _ in range(1 + WINDOW):
        sim.step()
    sim.add("long", prompt(160, 1), 2)
    sim.run()
    steps = [i for i, _ in prefill_steps(sim, "long")]
    assert steps == list(range(steps[0], steps[0] + 10)), "pieces run back to back"
    assert_outputs_match_reference(sim)


@pytest.mark.parametrize(("limit", "pieces"), [(4.0, [48, 48, 48, 48, 8]), (1.5, [32] * 6 + [8])])
def test_a_prompt_alone_takes_what_runs_within_prefill_step_seconds(limit, pieces):
    """A token costs 1/16 s beside the step's 1 s: within 4 s a step feeds 48 tokens; within 1.5 s
    it would feed 8, but a step feeds at least MIN_TIMED_PIECE."""
    assert MIN_TIMED_PIECE == 32
    sim = Sim(1000, chunked_prefill_size=512, max_prefill_tokens=4096, prefill_step_seconds=limit,
              step_seconds=cost(0.0625))
    sim.sched.costs.decode_times.append(DECODE_S)
    sim.sched.costs.token_times.append(0.0625)
    sim.add("solo", prompt(200), 2)
    sim.run()
    assert [len(s.seq.token_ids) for _, s in prefill_steps(sim, "solo")] == pieces
    assert sim.sched.costs.token_s == 0.0625  # measured again on each piece
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_a_prompt_alone_takes_the_chunk_before_any_cost_is_known():
    """A prompt token's cost is known once a step of decodes alone was measured (the fixed part)
    and then a step with prompt tokens; until then a step feeds at most the chunk."""
    sim = Sim(1000, chunked_prefill_size=16, max_prefill_tokens=64, prefill_step_seconds=0.001,
              step_seconds=cost(0.0625))
    sim.add("first", prompt(100), 2)
    sim.run()
    assert [len(s.seq.token_ids) for _, s in prefill_steps(sim, "first")] == [16] * 6 + [4]
    assert sim.sched.costs.token_s is None and sim.sched.costs.decode_s == DECODE_S
    sim.add("second", prompt(100, 1), 2)
    sim.run()
    assert [len(s.seq.token_ids) for _, s in prefill_steps(sim, "second")] == [16, 32, 32, 20]  # then MIN_TIMED_PIECE


def test_pieces_wait_for_a_step_of_decodes_alone_to_be_measured():
    """With no step of decodes alone measured, every step could carry a piece and the slowdown
    would never be known: the first WINDOW steps of decodes beside a piece hold the piece back."""
    sim = Sim(1000, chunked_prefill_size=16, max_prefill_tokens=16, step_seconds=cost(0.5))
    sim.add("dec", prompt(5), 20)
    sim.add("long", prompt(100, 1), 2)
    assert fed(sim.step()) == [("dec", 5), ("long", 11)]
    for _ in range(WINDOW):
        assert fed(sim.step()) == [("dec", 1)]
    assert sim.sched.costs.decode_s == DECODE_S
    assert fed(sim.step()) == [("dec", 1), ("long", 16)]
    sim.run()
    assert_outputs_match_reference(sim)


def test_step_costs_believe_the_median_of_the_last_measurements():
    assert WINDOW == 4
    costs = StepCosts(3.0)
    costs.observe(2.0, prompt_tokens=4, decodes=0)  # no fixed part known: the tokens' share unknown
    assert (costs.decode_s, costs.token_s, costs.credit) == (None, None, 0.0)
    assert not costs.pieces_may_run  # no step of decodes alone measured yet
    for seconds in (1.0, 1.0, 7.0):  # one slowed from outside
        costs.observe(seconds, prompt_tokens=0, decodes=3)
    assert (costs.decode_s, costs.credit) == (1.0, 2.0)
    assert not costs.pieces_may_run  # fewer than WINDOW steps of decodes alone measured
    costs.observe(1.0, prompt_tokens=0, decodes=3)
    assert costs.pieces_may_run
    costs.observe(9.0, prompt_tokens=16, decodes=3)  # 16 tokens beside the fixed part took 8 s
    assert (costs.token_s, costs.credit) == (0.5, -4.0) and not costs.pieces_may_run
    costs.observe(41.0, prompt_tokens=16, decodes=0)  # slowed from outside; nothing decodes: the debt is forgiven
    assert (costs.token_s, costs.credit) == (1.5, 0.0)
    costs.observe(9.0, prompt_tokens=16, decodes=3)
    assert costs.token_s == 0.5 and costs.credit == 2.0 - 16 * 0.5  # the median, not the slowed step, is charged
    assert costs.tokens_within(5.0) == 8
    costs.observe(0.5, prompt_tokens=8, decodes=3)  # no longer than the fixed part: the tokens unmeasured
    assert len(costs.token_times) == 3


def test_a_step_of_decodes_alone_is_measured_every_refresh_steps():
    """Pieces that slow the decodes less than the limit run every step, but one in REFRESH_STEPS."""
    sim = Sim(4000, chunked_prefill_size=16, prefill_step_seconds=0, step_seconds=cost(0.0625))
    sim.add("dec", prompt(5), 400)
    for _ in range(1 + WINDOW):
        sim.step()
    sim.add("long", prompt(1600, 1), 2)
    while not sim.requests["long"].output_ids:
        sim.step()
    steps = [i for i, _ in prefill_steps(sim, "long")]
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b - a > 1]
    assert len(steps) == 100 and gaps == [2] * (99 // REFRESH_STEPS)
    sim.run()
    assert_outputs_match_reference(sim)


@pytest.mark.parametrize(("field", "value"), [("decode_slowdown", 1.0), ("decode_slowdown", -2.0),
                                              ("prefill_step_seconds", -0.1)])
def test_bad_pacing_settings_are_rejected(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})
