"""Sessions on the Engine with the default model (fp32, greedy): turns equal full-history
requests and read their history from the cache, branches equal fresh histories, pinned
sessions keep their KV under eviction pressure (and lose it with pinning off), errors."""

from __future__ import annotations

import asyncio
import random

import pytest

from radixlm.runtime.engine import Engine
from radixlm.runtime.sessions import (
    SessionCapacityError,
    SessionError,
    SessionNotFoundError,
)

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
CHAT = {"temperature": 0, "max_new_tokens": 12}
QUESTIONS = ["My name is Ada.", "What is the capital of France?", "Name a number.", "And a colour?"]


def _chat_turns(engine: Engine, questions: list[str]) -> list[list[int]]:
    """Token ids of chat turns: the first with the template's system prompt, each later one
    appended after the assistant's reply (which ends with <|im_end|>)."""
    first = engine.encode([{"role": "user", "content": questions[0]}])
    later = [engine.encode(f"\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in questions[1:]]
    return [first] + later


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _engine(**kw) -> Engine:
    opts = {"dtype": "float32", "max_total_tokens": 2048, "context_length": 2048}
    opts.update(kw)
    return Engine(**opts)


@pytest.fixture(scope="module")
def engine():
    e = _engine()
    yield e
    e.shutdown()


def _run_session(engine: Engine, turns: list[list[int]], params: dict) -> list[dict]:
    sess = engine.session()
    outs = [sess.generate(input_ids=t, sampling_params=params) for t in turns]
    sess.close()
    return outs


def test_turn_n_equals_full_history_and_reads_it_from_the_cache(engine):
    engine.flush_cache()
    turns = _chat_turns(engine, QUESTIONS + ["Thanks!"])
    sess = engine.session()
    outs, histories = [], [[]]
    for i, new in enumerate(turns):
        out = sess.generate(input_ids=new, sampling_params=CHAT)
        meta, history = out["meta_info"], histories[-1]
        assert meta["session_id"] == sess.id and meta["session_history_tokens"] == len(history)
        assert meta["prompt_tokens"] == len(history) + len(new)
        if i:
            assert meta["cached_tokens"] >= len(history) - 1
        outs.append(out)
        histories.append(history + new + out["output_ids"])
    sess.close()
    engine.core.check_idle_integrity()
    assert engine.core.cache.protected_size() == 0
    # each turn equals its full history sent without a session, on a cold cache
    for new, history, out in zip(turns, histories, outs):
        engine.flush_cache()
        ref = engine.generate(input_ids=history + new, sampling_params=CHAT)
        assert ref["output_ids"] == out["output_ids"] and ref["meta_info"]["cached_tokens"] == 0


def test_branch_replacing_turn_2_equals_a_fresh_history(engine):
    engine.flush_cache()
    turns = _chat_turns(engine, QUESTIONS)
    sess = engine.session()
    outs = [sess.generate(input_ids=t, sampling_params=CHAT) for t in turns]
    new2 = _chat_turns(engine, ["", "What is the capital of Italy?"])[1]
    branch = sess.generate(input_ids=new2, sampling_params=CHAT, rid=outs[0]["meta_info"]["id"], replace=True)
    assert branch["meta_info"]["cached_tokens"] >= len(turns[0]) + len(outs[0]["output_ids"]) - 1
    later = [sess.generate(input_ids=t, sampling_params=CHAT) for t in turns[2:]]  # continue the new branch
    # the old turns 2-4 are gone
    with pytest.raises(SessionError, match="no turn"):
        sess.generate(input_ids=turns[3], sampling_params=CHAT, rid=outs[2]["meta_info"]["id"])
    sess.close()
    engine.flush_cache()
    fresh = _run_session(engine, [turns[0], new2, *turns[2:]], CHAT)
    assert [o["output_ids"] for o in fresh] == [o["output_ids"] for o in (outs[0], branch, *later)]
    assert branch["text"] != outs[1]["text"], (branch["text"], outs[1]["text"])  # the new turn 2 really differs
    engine.core.check_idle_integrity()


def test_errors_not_found_capacity_and_shape(engine):
    with pytest.raises(SessionNotFoundError, match="not open"):
        engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, session_params={"id": "nope"})
    sid = engine.open_session(capacity=20)
    engine.generate(input_ids=list(range(100, 110)), sampling_params=GREEDY, session_params={"id": sid})
    with pytest.raises(SessionCapacityError, match=r"at most 20 tokens.*21 \(16 of history \+ 5 new\)"):
        engine.generate(input_ids=list(range(200, 205)), sampling_params=GREEDY, session_params={"id": sid})
    # the output is cut to what the capacity leaves
    out = engine.generate(input_ids=[300, 301], sampling_params=GREEDY, session_params={"id": sid})
    assert out["meta_info"]["completion_tokens"] == 2 and out["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(ValueError, match="one prompt with n=1"):
        engine.generate(input_ids=[1, 2], sampling_params={**GREEDY, "n": 2}, session_params={"id": sid})
    with pytest.raises(ValueError, match="one prompt with n=1"):
        engine.generate(input_ids=[[1, 2], [3, 4]], sampling_params=GREEDY, session_params={"id": sid})
    engine.close_session(sid)
    with pytest.raises(SessionNotFoundError):
        engine.generate(input_ids=[1, 2], sampling_params=GREEDY, session_params={"id": sid})
    with pytest.raises(SessionNotFoundError):
        engine.close_session(sid)
    engine.core.check_idle_integrity()


def test_async_turns_of_several_sessions_batch_together(engine):
    engine.flush_cache()
    turns = _chat_turns(engine, QUESTIONS[:3])[1:]
    alone = [_run_session(engine, [engine.encode(f"Session {k}:")] + turns, GREEDY) for k in range(3)]
    sessions = [engine.session() for _ in range(3)]

    async def run() -> list[list[dict]]:
        outs: list[list[dict]] = [[] for _ in sessions]
        for step in range(3):
            res = await asyncio.gather(*(
                s.async_generate(input_ids=engine.encode(f"Session {k}:") if step == 0 else turns[step - 1],
                                 sampling_params=GREEDY) for k, s in enumerate(sessions)))
            for k, r in enumerate(res):
                outs[k].append(r)
        return outs

    together = asyncio.run(run())
    assert [[o["output_ids"] for o in s] for s in together] == [[o["output_ids"] for o in s] for s in alone]
    assert all(o["meta_info"]["cached_tokens"] >= o["meta_info"]["session_history_tokens"] - 1
               for s in together for o in s)
    for s in sessions:
        s.close()


def test_ttl_expiry_and_flush_keep_sessions_valid(engine):
    clock = ManualClock()
    engine.core.sessions.clock = clock  # the engine's own manager, on a clock the test moves
    sid = engine.open_session(ttl=30)
    engine.generate(input_ids=list(range(100, 120)), sampling_params=GREEDY, session_params={"id": sid})
    assert engine.core.cache.protected_size() == 25
    engine.flush_cache()  # unpins, drops the cache: the session stays open and recomputes
    out = engine.generate(input_ids=[5, 6], sampling_params=GREEDY, session_params={"id": sid})
    assert out["meta_info"]["cached_tokens"] == 0 and out["meta_info"]["prompt_tokens"] == 28
    clock.now = 29.0
    assert engine.core.sessions.expire() == []
    clock.now = 31.0
    with pytest.raises(SessionNotFoundError, match="expired"):
        engine.generate(input_ids=[7], sampling_params=GREEDY, session_params={"id": sid})
    assert engine.core.cache.protected_size() == 0 and engine.core.sessions.stats.expired == 1
    engine.core.check_idle_integrity()


def test_pinned_kv_never_starves_a_request_that_needs_the_memory():
    e = _engine(max_total_tokens=300, max_pinned_tokens=300)
    try:
        sids = [e.open_session() for _ in range(4)]
        for k, sid in enumerate(sids):
            e.generate(input_ids=list(range(1000 + 50 * k, 1050 + 50 * k)), sampling_params=GREEDY,
                       session_params={"id": sid})
        assert e.core.sessions.pinned_tokens == 4 * 55
        # needs 180 slots, 80 are free: only unpinning sessions (oldest first) makes room
        out = e.generate(input_ids=list(range(5000, 5180)), sampling_params=GREEDY)
        assert out["meta_info"]["completion_tokens"] == 6
        assert e.core.sessions.stats.unpinned_pressure == 2
        assert e.core.sessions.describe(sids[-1])["pinned_tokens"] == 55  # the newest kept their pins
        e.core.check_idle_integrity()
    finally:
        e.shutdown()


def test_a_request_out_of_decode_memory_gets_the_pins_before_it_is_ended():
    e = _engine(max_total_tokens=300, max_pinned_tokens=300)
    try:
        sids = [e.open_session() for _ in range(4)]
        prompts = [list(range(1000 + 50 * k, 1050 + 50 * k)) for k in range(4)]
        firsts = [e.generate(input_ids=p, sampling_params=GREEDY, session_params={"id": sid})
                  for p, sid in zip(prompts, sids)]
        assert e.core.sessions.pinned_tokens == 4 * 55
        # 80 slots are free: the 40-token prompt fits, its 60 output tokens do not
        out = e.generate(input_ids=list(range(5000, 5040)),
                         sampling_params={"temperature": 0, "max_new_tokens": 60, "ignore_eos": True})
        meta = out["meta_info"]
        assert meta["completion_tokens"] == 60 and meta["retractions"] == 0  # not ended at ~40
        assert e.core.sessions.stats.unpinned_pressure == 1
        assert [e.core.sessions.describe(s)["pinned_tokens"] for s in sids] == [0, 55, 55, 55]
        # every session still works: the unpinned one recomputes its evicted history, the others read it
        turns = [e.generate(input_ids=[7, 8, 9], sampling_params=GREEDY, session_params={"id": sid}) for sid in sids]
        history = [p + f["output_ids"] for p, f in zip(prompts, firsts)]
        assert turns[0]["meta_info"]["cached_tokens"] < len(history[0]) - 1
        assert all(t["meta_info"]["cached_tokens"] >= len(h) - 1 for t, h in zip(turns[1:], history[1:]))
        e.flush_cache()
        ref = e.generate(input_ids=history[0] + [7, 8, 9], sampling_params=GREEDY)
        assert ref["output_ids"] == turns[0]["output_ids"]
        e.core.check_idle_integrity()
    finally:
        e.shutdown()


def _pressure(max_pinned: int | None, sessions: int = 3, turns: int = 3) -> list[list[float]]:
    """Each round: one turn of every session (batched), then a prompt long enough to evict
    everything unpinned. Returns the hit rate (cached / history tokens) per session per turn
    after the first."""
    e = _engine(max_total_tokens=400, max_pinned_tokens=max_pinned)
    rng = random.Random(0)
    params = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}
    try:
        sids = [e.open_session() for _ in range(sessions)]
        rates: list[list[float]] = [[] for _ in sids]

        async def round_(t: int) -> list[dict]:
            return await asyncio.gather(*(
                e.async_generate(input_ids=[rng.randrange(1000, 20000) for _ in range(24 if t == 0 else 8)],
                                 sampling_params=params, session_params={"id": sid}) for sid in sids))

        for t in range(turns):
            for k, out in enumerate(asyncio.run(round_(t))):
                if t:
                    rates[k].append(out["meta_info"]["cached_tokens"] / out["meta_info"]["session_history_tokens"])
            size = e.core.allocator.num_slots - e.core.cache.protected_size() - 16
            e.generate(input_ids=[rng.randrange(1000, 20000) for _ in range(size)],
                       sampling_params={"max_new_tokens": 1})
            cache = e.core.cache  # besides the pins and this prompt, at most 16 tokens survived
            assert cache.total_size() - cache.protected_size() <= size + 16
        return rates
    finally:
        e.shutdown()


def test_under_pressure_pinned_sessions_keep_their_history_and_unpinned_lose_it():
    pinned = _pressure(None)
    assert min(min(r) for r in pinned) >= 0.95
    unpinned = _pressure(0)
    assert max(max(r) for r in unpinned) <= 0.1
