"""Scheduler table tests, driven without a model (see sched_sim.py)."""

from __future__ import annotations

import math

import pytest
from sched_sim import Sim, expected_prompt_logits, reference_output

from radixlm.runtime.scheduler import Scheduled, Status
from radixlm.runtime.scheduler.scheduler import DEDUP_MIN


def assert_outputs_match_reference(sim: Sim) -> None:
    for req in sim.requests.values():
        if req.finish_reason != "abort":
            assert req.finish_reason == "length", f"{req.rid}: {req.finish_reason}"
            assert req.output_ids == reference_output(req.prompt_ids, req.params.max_new_tokens), req.rid


def prefill_steps(sim: Sim, rid: str) -> list[tuple[int, Scheduled]]:
    """(step index, Scheduled) of each step that fed rid's prompt."""
    return [(i, s) for i, step in enumerate(sim.history) for s in step if s.req.rid == rid and s.prefill]


# -- retraction ----------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_tight_pool_retracts_and_resumes_with_identical_outputs(cache):
    prompts = [[i, i + 1, i + 2, 7, 7] for i in range(4)]
    demand = len(prompts[0]) + 30
    sim = Sim(demand + 25, cache=cache)  # fits one request, not four
    for i, p in enumerate(prompts):
        sim.add(f"r{i}", p, 30)
    sim.run()
    assert sim.sched.num_retractions > 0
    retracted = [r for r in sim.requests.values() if r.retractions > 0]
    assert retracted and all(r.output_ids for r in retracted)
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_retraction_resets_new_token_ratio():
    sim = Sim(60)
    for i in range(4):
        sim.add(f"r{i}", [i, 1, 2, 3, 4], 30)
    ratios = []
    while sim.sched.has_work:
        before = sim.sched.num_retractions
        sim.step()
        if sim.sched.num_retractions > before:
            ratios.append(sim.sched.new_token_ratio)
    assert ratios and all(r == sim.config.init_new_token_ratio for r in ratios)
    assert_outputs_match_reference(sim)


def test_full_reservation_admits_only_what_fits():
    """With new_token_ratio 1 admission reserves every request's whole output: no retraction."""
    sim = Sim(60, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    for i in range(4):
        sim.add(f"r{i}", [i, 1, 2, 3, 4], 30)
    first = sim.step()
    assert [s.req.rid for s in first] == ["r0"]  # 35 + 35 > 60
    sim.run()
    assert sim.sched.num_retractions == 0
    assert max(len(step) for step in sim.history) == 1
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_admission_does_not_count_a_locked_prefix_as_room():
    """The prefix a request matches was evictable a moment ago; once the request locks it, it
    is no room for others. With full reservation nothing may be over-admitted."""
    sim = Sim(40, init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    prefix = list(range(20))
    sim.add("warm", prefix, 0)
    sim.run()
    assert sim.cache.evictable_size() == 20 and sim.allocator.num_free == 20
    a = sim.add("a", prefix + [30], 10)
    sim.add("b", [40 + i % 10 for i in range(10)], 10)
    assert [s.req.rid for s in sim.step()] == ["a"]  # a locks 20 and needs 11: b's 20 do not fit
    assert a.cached_tokens == 20
    sim.run()
    assert sim.sched.num_retractions == 0
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_alone_out_of_memory_finishes_with_length():
    sim = Sim(10)
    req = sim.add("big", [1, 2, 3], 50)  # needs 52 slots, the pool has 10
    sim.run()
    assert req.finish_reason == "length"
    assert 0 < len(req.output_ids) < 50
    assert req.output_ids == reference_output(req.prompt_ids, 50)[: len(req.output_ids)]
    assert req.retractions == 0
    sim.check_idle()


def _pin(sim: Sim, tokens: list[int], hook: bool = True) -> list[object]:
    """Cache ``tokens`` and lock them as a session pin does; with ``hook`` the scheduler may
    reclaim (unlock) them. Returns the pins still held."""
    sim.add("warm", tokens, 0)
    sim.run()
    pins = [sim.cache.match_prefix(tokens).node]
    sim.cache.lock(pins[0])

    def reclaim() -> bool:
        if not pins:
            return False
        sim.cache.unlock(pins.pop())
        return True

    sim.sched.reclaim = reclaim if hook else None
    return pins


def test_alone_out_of_memory_reclaims_idle_pins_before_ending():
    sim = Sim(60)
    pins = _pin(sim, list(range(10, 50)))  # 40 locked, 20 free
    req = sim.add("big", [1, 2, 3], 40)  # needs 43 slots
    sim.run()
    assert not pins and req.retractions == 0
    assert req.output_ids == reference_output(req.prompt_ids, 40)  # not cut short
    sim.check_idle()


@pytest.mark.parametrize("hook", [True, False])
def test_idle_pins_are_reclaimed_before_a_running_request_is_retracted(hook):
    sim = Sim(60, init_new_token_ratio=0.1, min_new_token_ratio=0.1)  # admits both; they outgrow the pool
    pins = _pin(sim, list(range(10, 40)), hook)
    sim.add("a", [1, 2, 3, 4, 5], 20)
    sim.add("b", [6, 7, 8, 9, 1], 20)
    sim.run()
    assert_outputs_match_reference(sim)
    if hook:
        assert not pins and sim.sched.num_retractions == 0
        sim.check_idle()
    else:  # the pin stays, so a running request is retracted instead
        assert pins and sim.sched.num_retractions > 0


def test_prompt_phase_request_is_never_retracted_as_a_decoder():
    """A prompt cut by the chunk budget with one token left has no output yet: it must be
    prefilled, not treated as a decoding request (nor retracted as one, which would return its
    prompt logits twice)."""
    sim = Sim(20, chunked_prefill_size=6, init_new_token_ratio=0.1, min_new_token_ratio=0.1)
    a = sim.add("a", [1, 2], 18)
    for _ in range(11):
        sim.step()
    assert len(a.output_ids) == 11
    b = sim.add("b", [3, 4, 5, 6, 7, 8, 9], 1, logprob_start_len=0)
    sim.run()
    assert b.retractions == 0
    assert sorted(sim.prompt_logit_pos["b"]) == list(range(7))
    assert_outputs_match_reference(sim)
    sim.check_idle()


# -- chunked prefill -----------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_chunked_prefill_interleaves_with_decodes(cache):
    sim = Sim(1000, cache=cache, chunked_prefill_size=16)
    sim.add("dec", [5, 6, 7, 8, 9], 40)
    sim.step()  # dec's prompt; from now on it decodes
    long_prompt = [(i * 7) % 50 for i in range(100)]
    sim.add("long", long_prompt, 3)
    sim.run()
    steps = prefill_steps(sim, "long")
    assert len(steps) == math.ceil(100 / 16)
    assert [len(s.seq.token_ids) for _, s in steps] == [16] * 6 + [4]
    assert [s.seq.cached_len for _, s in steps] == list(range(0, 100, 16))
    assert [s.samples for _, s in steps] == [False] * 6 + [True]
    assert all(s.seq.num_logits == 0 for _, s in steps[:-1]) and steps[-1][1].seq.num_logits == 1
    for i, _ in steps:
        decodes = [s for s in sim.history[i] if s.req.rid == "dec"]
        assert len(decodes) == 1 and not decodes[0].prefill and decodes[0].samples
    assert [i for i, _ in steps] == list(range(steps[0][0], steps[0][0] + 7)), "chunks run back to back"
    assert_outputs_match_reference(sim)
    sim.check_idle()


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_a_prompt_alone_is_not_chunked(cache):
    """Nothing decoding and nothing else waiting: a prompt feeds up to max_prefill_tokens a step
    (the chunk only bounds the wait of other requests' tokens); past that it is cut there."""
    sim = Sim(1000, cache=cache, chunked_prefill_size=16, max_prefill_tokens=64)
    sim.add("a", [(i * 7) % 50 for i in range(60)], 3)
    sim.add("b", [(i * 3) % 50 for i in range(150)], 2)  # waits: "a" does not run alone
    sim.step()
    assert [(s.req.rid, len(s.seq.token_ids)) for s in sim.history[-1]] == [("a", 16)]
    sim.run()
    # "b" shares a's last chunk, takes chunks while "a" decodes, then runs alone (64 a step)
    assert [len(s.seq.token_ids) for _, s in prefill_steps(sim, "b")] == [4, 16, 16, 64, 50]
    solo = sim.add("solo", [50 + i % 40 for i in range(100)], 2)
    before = len(sim.history)
    sim.run()
    assert [len(s.seq.token_ids) for _, s in prefill_steps(sim, "solo")] == [64, 36]
    assert len(sim.history) - before == 3  # two prefill steps (the second samples), one decode
    assert solo.output_ids == reference_output(solo.prompt_ids, 2)
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_chunk_budget_is_shared_by_prompts_in_one_step():
    sim = Sim(1000, chunked_prefill_size=8)
    for i in range(3):
        sim.add(f"r{i}", [i * 10 + j for j in range(5)], 2)
    step = sim.step()
    assert [(s.req.rid, s.seq.cached_len, len(s.seq.token_ids)) for s in step] == [("r0", 0, 5), ("r1", 0, 3)]
    step = sim.step()
    fed = {s.req.rid: (s.seq.cached_len, len(s.seq.token_ids)) for s in step if s.prefill}
    assert fed == {"r1": (3, 2), "r2": (0, 5)}
    sim.run()
    assert_outputs_match_reference(sim)
    sim.check_idle()


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_prompt_cut_one_token_short_still_prefills(cache):
    """Prompt 9, chunk 8 (alone too): the last prompt token is a prefill step of its own, never empty."""
    sim = Sim(40, cache=cache, chunked_prefill_size=8, max_prefill_tokens=8)
    req = sim.add("a", list(range(9)), 0)
    sim.run()
    assert req.finish_reason == "length" and req.output_ids == []
    assert sim.num_steps == 2
    assert [(s.seq.cached_len, len(s.seq.token_ids)) for _, s in prefill_steps(sim, "a")] == [(0, 8), (8, 1)]
    sim.check_idle()
    if cache == "radix":
        assert sim.cache.total_size() == 9  # the finished prompt was cached


# -- in-batch prefix dedup -----------------------------------------------------------------


def _shared_prefix_requests(sim: Sim, n: int = 4, prefix_len: int = 40) -> list:
    prefix = [(i * 13 + 5) % 50 for i in range(prefix_len)]
    return [sim.add(f"r{i}", prefix + [i, 40 + i, 3, 2, 1], 4) for i in range(n)]


def test_in_batch_dedup_prefills_a_shared_prefix_once():
    sim = Sim(1000)
    reqs = _shared_prefix_requests(sim)
    first = sim.step()
    assert [s.req.rid for s in first] == ["r0"]
    sim.run()
    assert reqs[0].cached_tokens == 0
    assert all(r.cached_tokens >= 40 for r in reqs[1:])
    # the prefix's 40 tokens were computed once: 45 + 3 * 5 prompt tokens fed in total
    fed = sum(len(s.seq.token_ids) for step in sim.history for s in step if s.prefill)
    assert fed == 45 + 3 * 5
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_in_batch_dedup_waits_for_a_chunked_prompt_to_finish():
    sim = Sim(1000, chunked_prefill_size=16)
    reqs = _shared_prefix_requests(sim, n=2)
    sim.run()
    assert reqs[1].cached_tokens >= 40
    r0_last = prefill_steps(sim, "r0")[-1][0]
    r1_first = prefill_steps(sim, "r1")[0][0]
    assert r0_last == 2 and r1_first == r0_last + 1  # 45 tokens in chunks of 16, then r1
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_short_shared_prefix_is_not_deduplicated():
    sim = Sim(1000)
    prefix = list(range(DEDUP_MIN - 1))
    for i in range(3):
        sim.add(f"r{i}", prefix + [40 + i, 1], 2)
    assert len(sim.step()) == 3
    sim.run()
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_no_dedup_wait_without_a_shared_cache():
    """NoCache never serves a prefix, so waiting for another request's prompt gains nothing."""
    sim = Sim(1000, cache="none")
    reqs = _shared_prefix_requests(sim)
    assert len(sim.step()) == 4
    sim.run()
    assert all(r.cached_tokens == 0 for r in reqs)
    assert_outputs_match_reference(sim)
    sim.check_idle()


# -- policies ------------------------------------------------------------------------------

PA = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # cached, 12 tokens
PB = [20, 21, 22, 23, 24, 25, 26, 27]  # cached, 8 tokens


def _policy_sim(policy: str) -> Sim:
    sim = Sim(1000, policy=policy)
    sim.add("warm-a", PA, 0)
    sim.add("warm-b", PB, 0)
    sim.run()
    assert sim.cache.total_size() == len(PA) + len(PB)
    # arrival order: c (nothing cached), a1, b1, a2, b2, b3
    sim.add("c1", [40, 41, 42], 2)
    sim.add("a1", PA + [30], 2)
    sim.add("b1", PB + [31], 2)
    sim.add("a2", PA + [32], 2)
    sim.add("b2", PB + [33], 2)
    sim.add("b3", PB + [34], 2)
    return sim


def _admission_order(policy: str) -> list[str]:
    sim = _policy_sim(policy)
    step = sim.step()  # ample budget and rows: everything is admitted in policy order
    sim.run()
    assert_outputs_match_reference(sim)
    sim.check_idle()
    return [s.req.rid for s in step]


def test_lpm_prefers_the_longest_cached_prefix():
    assert _admission_order("lpm") == ["a1", "a2", "b1", "b2", "b3", "c1"]


def test_fcfs_keeps_arrival_order():
    assert _admission_order("fcfs") == ["c1", "a1", "b1", "a2", "b2", "b3"]


def test_dfs_weight_groups_shared_prefixes_heaviest_first():
    # root's own requests first, then the heavier subtree (three b's), then the a's
    assert _admission_order("dfs-weight") == ["c1", "b1", "b2", "b3", "a1", "a2"]


def test_dfs_weight_nested_groups_stay_contiguous():
    sim = Sim(1000, policy="dfs-weight")
    base = [1, 2, 3, 4]
    sim.add("warm", base + [5, 6], 0)
    sim.add("warm2", base + [7, 8], 0)
    sim.run()
    # subtree base+[5,6]: x1, x2; subtree base+[7,8]: y1, y2, y3; interleaved arrivals
    sim.add("x1", base + [5, 6, 40], 1)
    sim.add("y1", base + [7, 8, 41], 1)
    sim.add("x2", base + [5, 6, 42], 1)
    sim.add("y2", base + [7, 8, 43], 1)
    sim.add("y3", base + [7, 8, 44], 1)
    order = [s.req.rid for s in sim.step()]
    assert order == ["y1", "y2", "y3", "x1", "x2"]


def test_lpm_one_admission_per_step_follows_the_cache():
    """With one row, lpm admits the request with the longest cached prefix each time."""
    sim = Sim(1000, policy="lpm", max_running_requests=1)
    sim.add("warm", PA, 0)
    sim.run()
    sim.add("none", [45, 46, 47], 1)
    sim.add("half", PA[:6] + [30, 31], 1)
    sim.add("full", PA + [32], 1)
    sim.run()
    firsts = []
    for step in sim.history:
        for s in step:
            if s.req.rid not in firsts and s.req.rid != "warm":
                firsts.append(s.req.rid)
    assert firsts == ["full", "half", "none"]
    assert sim.requests["full"].cached_tokens == len(PA)
    assert sim.requests["half"].cached_tokens == 6


@pytest.mark.parametrize("queue", [3, 4])
def test_lpm_falls_back_to_fcfs_on_a_long_queue(queue):
    sim = Sim(1000, policy="lpm", lpm_max_queue=queue)
    sim.add("warm-a", PA, 0)
    sim.run()
    sim.add("c1", [40, 41, 42], 1)
    sim.add("b1", PB + [31], 1)
    sim.add("a1", PA + [30], 1)
    sim.add("a2", PA + [32], 1)
    order = [s.req.rid for s in sim.step()]
    assert order == (["c1", "b1", "a1", "a2"] if queue < 4 else ["a1", "a2", "c1", "b1"])


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        Sim(10, policy="random")


# -- abort ---------------------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_abort_while_waiting(cache):
    sim = Sim(100, cache=cache, max_running_requests=1)
    a = sim.add("a", [1, 2, 3], 5)
    b = sim.add("b", [4, 5, 6], 5)
    sim.step()
    assert b.status is Status.WAITING
    assert sim.sched.abort("b") is b
    assert b.status is Status.FINISHED and b.finish_reason == "abort" and b not in sim.sched.waiting
    assert sim.sched.abort("b") is None and sim.sched.abort("nope") is None
    sim.run()
    assert a.output_ids == reference_output(a.prompt_ids, 5) and b.output_ids == []
    sim.check_idle()


@pytest.mark.parametrize(("cache", "page_size"), [("radix", 1), ("radix", 2), ("none", 1)])
def test_abort_mid_chunked_prefill(cache, page_size):
    sim = Sim(200, cache=cache, page_size=page_size, chunked_prefill_size=8)
    other = sim.add("other", [9, 9, 9], 20)
    prompt = [(i * 3) % 50 for i in range(41)]
    req = sim.add("long", prompt, 5)
    sim.step()
    sim.step()
    assert req.status is Status.RUNNING and 0 < len(req.slots) < len(prompt)
    sim.sched.finish(req, "abort")
    assert req.finish_reason == "abort" and not req.slots and req.row == -1
    sim.check_invariants()
    computed = [s.seq.cached_len + len(s.seq.token_ids) for _, s in prefill_steps(sim, "long")][-1]
    sim.run()
    assert other.output_ids == reference_output(other.prompt_ids, 20)
    sim.check_idle()
    # the computed part of the aborted prompt is reused by the same prompt later
    again = sim.add("again", prompt, 2)
    sim.run()
    expected = computed // page_size * page_size if cache == "radix" else 0
    assert again.cached_tokens == expected
    assert again.output_ids == reference_output(prompt, 2)
    sim.check_idle()


@pytest.mark.parametrize("cache", ["radix", "none"])
def test_abort_while_decoding(cache):
    sim = Sim(200, cache=cache)
    a = sim.add("a", [1, 2, 3, 4], 30)
    b = sim.add("b", [1, 2, 3, 5], 30)
    for _ in range(5):
        sim.step()
    assert a.is_decoding and len(a.output_ids) == 5
    assert sim.sched.abort("a") is a
    assert a.finish_reason == "abort" and a.output_ids == reference_output(a.prompt_ids, 30)[:5]
    sim.check_invariants()
    sim.run()
    assert b.output_ids == reference_output(b.prompt_ids, 30)
    sim.check_idle()


def test_abort_a_retracted_request():
    sim = Sim(60)
    for i in range(4):
        sim.add(f"r{i}", [i, 1, 2, 3, 4], 30)
    while sim.sched.num_retractions == 0:
        sim.step()
    victim = next(r for r in sim.requests.values() if r.retractions and r.status is Status.WAITING)
    sim.sched.abort(victim.rid)
    assert victim.finish_reason == "abort"
    sim.run()
    assert_outputs_match_reference(sim)
    sim.check_idle()


def test_abort_everything_at_every_step_frees_everything():
    for stop_at in range(0, 12):
        sim = Sim(80, chunked_prefill_size=4)
        sim.add("a", list(range(10)), 6)
        sim.add("b", list(range(10)) + [20, 21], 6)
        sim.add("c", [30, 31, 32, 33, 34, 35], 6)
        for _ in range(stop_at):
            if sim.sched.has_work:
                sim.step()
        for rid in "abc":
            sim.sched.abort(rid)
        sim.check_idle()


# -- max_new_tokens = 0 ---------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("chunk", [0, 4])
def test_max_new_tokens_zero_prefills_into_the_cache(page_size, chunk):
    sim = Sim(100, page_size=page_size, chunked_prefill_size=chunk, max_prefill_tokens=chunk or 4096)
    prompt = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0]
    warm = sim.add("warm", prompt, 0)
    sim.run()
    assert warm.finish_reason == "length" and warm.output_ids == []
    assert sim.num_steps == (math.ceil(len(prompt) / chunk) if chunk else 1)
    assert all(not s.samples and s.seq.num_logits == 0 for step in sim.history for s in step)
    sim.check_idle()
    assert sim.cache.total_size() == len(prompt) // page_size * page_size
    again = sim.add("again", prompt, 3)
    sim.run()
    assert again.cached_tokens == (len(prompt) - 1) // page_size * page_size
    assert again.output_ids == reference_output(prompt, 3)
    sim.check_idle()


def test_max_new_tokens_zero_without_cache():
    sim = Sim(100, cache="none")
    req = sim.add("warm", [1, 2, 3], 0)
    sim.run()
    assert req.finish_reason == "length" and req.output_ids == [] and sim.num_steps == 1
    sim.check_idle()
    assert sim.allocator.num_free == 100


# -- input validation ----------------------------------------------------------------------


def test_empty_prompt_is_rejected():
    sim = Sim(100)
    with pytest.raises(ValueError, match="prompt is empty"):
        sim.add("e", [], 4)
    assert not sim.sched.has_work


def test_prompt_at_context_length_is_rejected():
    sim = Sim(100, max_context=16)
    with pytest.raises(ValueError, match="context length 16"):
        sim.add("long", list(range(16)), 4)
    sim.add("ok", list(range(15)), 0)
    sim.run()
    sim.check_idle()


def test_prompt_larger_than_the_pool_is_rejected():
    sim = Sim(10)
    with pytest.raises(ValueError, match=r"more KV slots than the pool holds \(10\)"):
        sim.add("big", list(range(11)), 1)
    assert not sim.sched.has_work
    sim.add("fits", list(range(10)), 0)
    sim.run()
    sim.check_idle()


# -- input logprobs ------------------------------------------------------------------------


def _logit_positions(sim: Sim, rid: str) -> list[int]:
    out = []
    for step in sim.history:
        for s in step:
            if s.req.rid == rid and s.seq.num_logits:
                assert s.first_logit_pos == s.seq.cached_len + s.seq.logit_start
                out.extend(range(s.first_logit_pos, s.seq.cached_len + len(s.seq.token_ids)))
    return out


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("page_size", [1, 2])
def test_logprob_start_len_zero_covers_every_prompt_position_once(chunk, page_size):
    prompt = [(i * 11 + 3) % 50 for i in range(30)]
    sim = Sim(200, page_size=page_size, chunked_prefill_size=chunk)
    sim.add("warm", prompt, 2)
    sim.run()
    req = sim.add("lp", prompt, 3, logprob_start_len=0)
    sim.run()
    assert req.cached_tokens == 0  # logits are needed from position 0: nothing may be skipped
    positions = _logit_positions(sim, "lp")
    assert positions[: len(prompt)] == list(range(len(prompt)))
    assert positions[len(prompt) :] == [len(prompt), len(prompt) + 1]  # the decodes
    assert req.output_ids == reference_output(prompt, 3)
    sim.check_idle()


@pytest.mark.parametrize("start", [1, 5, 29, 30, 40])
def test_logprob_start_len_limits_the_cached_prefix(start):
    prompt = [(i * 11 + 3) % 50 for i in range(30)]
    sim = Sim(200, chunked_prefill_size=8)
    sim.add("warm", prompt, 0)
    sim.run()
    req = sim.add("lp", prompt, 1, logprob_start_len=start)
    sim.run()
    first = max(min(start - 1, len(prompt) - 1), 0)
    assert req.cached_tokens == first
    assert _logit_positions(sim, "lp") == expected_prompt_logits(len(prompt), start) == list(range(first, 30))
    sim.check_idle()


def test_logprobs_of_a_prefill_only_request():
    prompt = list(range(12))
    sim = Sim(100, chunked_prefill_size=5)
    sim.add("lp", prompt, 0, logprob_start_len=3)
    sim.run()
    assert _logit_positions(sim, "lp") == list(range(2, 12))
    assert sim.requests["lp"].finish_reason == "length"
    sim.check_idle()
