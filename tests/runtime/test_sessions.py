"""SessionManager on a real RadixCache (no model): turns, branching, pins, the pinned-token cap,
TTL expiry on an injected clock, and a stateful property test of the pin bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixlm.runtime.radix_cache import NoCache, RadixCache, SlotAllocator
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.sessions import (
    SessionCapacityError,
    SessionError,
    SessionManager,
    SessionNotFoundError,
    SessionParams,
)


class ManualClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Rig:
    """A session manager over a radix cache, driven the way EngineCore drives it: a finished
    turn's tokens (all but the last output token, which has no KV yet) go into the cache first."""

    def __init__(self, num_slots: int = 400, max_pinned: int = 1000, ttl: float = 10.0, cache_cls=RadixCache) -> None:
        self.alloc = SlotAllocator(num_slots)
        self.cache = cache_cls(self.alloc, 1)
        self.clock = ManualClock()
        self.sm = SessionManager(self.cache, max_pinned, ttl, clock=self.clock)
        self.n = 0

    def turn(self, sid: str, new: list[int], output: list[int], **kw) -> str:
        """Plan, start and finish one turn; returns its rid."""
        rid = kw.pop("rid_name", None) or f"r{self.n}"
        self.n += 1
        plan = self.sm.plan_turn(SessionParams(sid, **kw), rid, new, len(output))
        self.sm.start_turn(plan, kw.get("replace", False))
        self.finish(rid, plan.prompt_ids, output)
        return rid

    def finish(self, rid: str, prompt: list[int], output: list[int], completed: bool = True) -> dict:
        tokens = (prompt + output)[:-1]
        if completed and tokens:
            m = self.cache.match_prefix(tokens)
            new = self.alloc.alloc(len(tokens) - len(m.slots))
            assert new is not None
            self.cache.insert(tokens, m.slots + new)
        return self.sm.finish_turn(rid, output, completed, 0)

    def check(self) -> None:
        self.cache.check_integrity()
        self.sm.check_integrity()
        assert self.cache.protected_size() <= self.sm.pinned_tokens


# -- open / close / errors ---------------------------------------------------------------------
def test_open_close_and_not_found():
    rig = Rig()
    sid = rig.sm.open()
    assert rig.sm.open("mine") == "mine" and rig.sm.num_open == 2
    with pytest.raises(SessionError, match="already open"):
        rig.sm.open("mine")
    rig.sm.close("mine")
    for bad in ("mine", "never"):
        with pytest.raises(SessionNotFoundError, match="not open"):
            rig.sm.close(bad)
        with pytest.raises(SessionNotFoundError):
            rig.sm.plan_turn(SessionParams(bad), "x", [1], 1)
    assert isinstance(SessionNotFoundError("x"), ValueError)
    assert rig.sm.num_open == 1 and rig.sm.describe(sid)["turns"] == []


@pytest.mark.parametrize("kwargs, match", [
    ({"capacity": 0}, "capacity"), ({"capacity": 2.5}, "capacity"), ({"ttl": 0}, "ttl"), ({"ttl": -1}, "ttl"),
    ({"session_id": ""}, "session_id"), ({"session_id": "x" * 300}, "session_id"),
])
def test_open_rejects_bad_arguments(kwargs, match):
    with pytest.raises(SessionError, match=match):
        Rig().sm.open(**kwargs)


@pytest.mark.parametrize("d, match", [
    ({}, "id is required"), ({"id": ""}, "non-empty"), ({"id": "s", "offset": -1}, "offset"),
    ({"id": "s", "replace": "yes"}, "replace"), ({"id": "s", "bogus": 1}, "bogus"), ([1], "object"),
])
def test_session_params_validation(d, match):
    with pytest.raises(SessionError, match=match):
        SessionParams.from_dict(d)


def test_session_params_accept_sglang_nulls():
    p = SessionParams.from_dict({"id": "s", "rid": None, "offset": None, "replace": None,
                                 "drop_previous_output": None})
    assert p == SessionParams("s")


# -- turns ---------------------------------------------------------------------------------------
def test_turns_append_to_history_and_branch():
    rig = Rig()
    sid = rig.sm.open()
    r1 = rig.turn(sid, [1, 2, 3], [4, 5])
    # no rid: continue the newest turn
    plan = rig.sm.plan_turn(SessionParams(sid), "a", [6], 3)
    assert plan.prompt_ids == [1, 2, 3, 4, 5, 6] and plan.history_len == 5 and plan.parent == r1
    r2 = rig.turn(sid, [6], [7])
    r3 = rig.turn(sid, [8], [9])
    assert rig.sm.turn_tokens(sid, r3) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # continuing an earlier turn branches; the other branch stays valid
    r4 = rig.turn(sid, [10], [11], rid=r1)
    assert rig.sm.turn_tokens(sid, r4) == [1, 2, 3, 4, 5, 10, 11]
    assert rig.sm.describe(sid)["head"] == r4 and r3 in rig.sm.describe(sid)["turns"]
    # offset and drop_previous_output cut the history
    assert rig.sm.plan_turn(SessionParams(sid, rid=r2, offset=4), "b", [0], 1).prompt_ids == [1, 2, 3, 4, 0]
    assert rig.sm.plan_turn(SessionParams(sid, rid=r2, drop_previous_output=True), "b", [0], 1).prompt_ids == \
        [1, 2, 3, 4, 5, 6, 0]
    with pytest.raises(SessionError, match="offset 99"):
        rig.sm.plan_turn(SessionParams(sid, rid=r2, offset=99), "b", [0], 1)
    with pytest.raises(SessionError, match="no turn 'nope'"):
        rig.sm.plan_turn(SessionParams(sid, rid="nope"), "b", [0], 1)
    with pytest.raises(SessionError, match="already has a turn"):
        rig.sm.plan_turn(SessionParams(sid), r2, [0], 1)
    rig.check()


def test_replace_drops_the_later_turns():
    rig = Rig()
    sid = rig.sm.open()
    r1 = rig.turn(sid, [1, 2], [3])
    r2 = rig.turn(sid, [4], [5])
    r3 = rig.turn(sid, [6], [7])
    r2b = rig.turn(sid, [40], [50], rid=r1, replace=True)
    turns = rig.sm.describe(sid)["turns"]
    assert r2 not in turns and r3 not in turns and turns == [r1, r2b]
    assert rig.sm.turn_tokens(sid, r2b) == [1, 2, 3, 40, 50]
    with pytest.raises(SessionError, match="no turn"):
        rig.sm.plan_turn(SessionParams(sid, rid=r3), "x", [1], 1)
    # replace without rid: the prompt is the whole conversation, every turn is dropped
    r5 = rig.turn(sid, [9, 9, 9], [8], replace=True)
    assert rig.sm.describe(sid)["turns"] == [r5] and rig.sm.turn_tokens(sid, r5) == [9, 9, 9, 8]
    # ... and its history is what it shares with the newest turn (a client resending the conversation)
    plan = rig.sm.plan_turn(SessionParams(sid, replace=True), "r6", [9, 9, 9, 8, 1], 1)
    assert plan.history_len == 4 and plan.prompt_ids == [9, 9, 9, 8, 1]
    assert rig.sm.plan_turn(SessionParams(sid, replace=True), "r7", [9, 7], 1).history_len == 1
    rig.check()


def test_running_turns_cannot_be_continued_or_replaced_and_aborts_are_forgotten():
    rig = Rig()
    sid = rig.sm.open()
    r1 = rig.turn(sid, [1, 2], [3])
    plan = rig.sm.plan_turn(SessionParams(sid), "run", [4], 2)
    rig.sm.start_turn(plan, False)
    with pytest.raises(SessionError, match="still running"):
        rig.sm.plan_turn(SessionParams(sid, rid="run"), "x", [5], 1)
    with pytest.raises(SessionError, match="still running"):
        rig.sm.plan_turn(SessionParams(sid, rid=r1, replace=True), "x", [5], 1)
    # a sibling branch may run at the same time
    assert rig.sm.plan_turn(SessionParams(sid, rid=r1), "x", [5], 1).prompt_ids == [1, 2, 3, 5]
    meta = rig.finish("run", plan.prompt_ids, [7], completed=False)
    assert meta == {"session_id": sid, "session_history_tokens": 3}
    assert rig.sm.describe(sid)["turns"] == [r1] and rig.sm.describe(sid)["head"] == r1
    rig.check()


def test_an_aborted_replace_moves_the_pin_back_to_the_head():
    rig = Rig()
    sid = rig.sm.open()
    r1 = rig.turn(sid, [1, 2, 3], [4])
    rig.turn(sid, [5, 6], [7])
    assert rig.sm.pinned_tokens == 6
    plan = rig.sm.plan_turn(SessionParams(sid, rid=r1, replace=True), "x", [9], 1)
    rig.sm.start_turn(plan, True)
    assert rig.sm.pinned_tokens == 6  # while it runs, the dropped turn's path (sharing r1's) stays pinned
    rig.finish("x", plan.prompt_ids, [9], completed=False)
    # all of r1 is cached now (its last token was computed by r2): 4 tokens
    assert rig.sm.describe(sid)["head"] == r1 and rig.sm.pinned_tokens == 4 == rig.cache.protected_size()
    plan = rig.sm.plan_turn(SessionParams(sid, replace=True), "y", [9], 1)
    rig.sm.start_turn(plan, True)
    rig.finish("y", plan.prompt_ids, [9], completed=False)
    assert rig.sm.describe(sid)["head"] is None and rig.sm.pinned_tokens == 0 == rig.cache.protected_size()
    rig.check()


def test_capacity_is_checked_with_numbers_and_caps_the_output():
    rig = Rig()
    sid = rig.sm.open(capacity=10)
    rig.turn(sid, [1, 2, 3, 4], [5, 6])
    plan = rig.sm.plan_turn(SessionParams(sid), "a", [7, 8], 100)
    assert plan.max_new_tokens == 2
    assert plan.cap(SamplingParams(max_new_tokens=100)).max_new_tokens == 2
    assert plan.cap(SamplingParams(max_new_tokens=1)).max_new_tokens == 1
    with pytest.raises(SessionCapacityError, match=r"at most 10 tokens.* 10 \(6 of history \+ 4 new\)"):
        rig.sm.plan_turn(SessionParams(sid), "b", [7, 8, 9, 10], 5)
    # prefill only (max_new_tokens 0) may fill the session exactly
    assert rig.sm.plan_turn(SessionParams(sid), "c", [7, 8, 9, 10], 0).max_new_tokens == 0


def test_strip_bos_only_on_appended_turns():
    alloc = SlotAllocator(50)
    sm = SessionManager(RadixCache(alloc), 100, 10.0, strip_bos=1)
    sid = sm.open()
    plan = sm.plan_turn(SessionParams(sid), "a", [1, 5, 6], 1)
    assert plan.prompt_ids == [1, 5, 6]  # the first turn keeps its BOS
    sm.start_turn(plan, False)
    sm.finish_turn("a", [7], True, 0)
    assert sm.plan_turn(SessionParams(sid), "b", [1, 8], 1).prompt_ids == [1, 5, 6, 7, 8]


# -- pins ------------------------------------------------------------------------------------------
def test_pinned_history_survives_eviction_and_close_frees_it():
    rig = Rig()
    sid = rig.sm.open()
    rig.turn(sid, list(range(10, 30)), [31, 32, 33])
    assert rig.sm.pinned_tokens == 22 == rig.cache.protected_size()
    # unrelated traffic, then evict everything evictable
    rig.finish("other", list(range(100, 150)), [1])
    rig.cache.evict(10**6)
    assert len(rig.cache.match_prefix(list(range(10, 30)) + [31, 32]).slots) == 22
    assert rig.cache.total_size() == 22
    # the next turn moves the pin to the longer path; the old one is released
    rig.turn(sid, [40, 41], [42])
    assert rig.sm.pinned_tokens == 25 == rig.cache.protected_size()
    rig.sm.close(sid)
    assert rig.sm.pinned_tokens == 0 == rig.cache.protected_size()
    rig.cache.evict(10**6)
    assert rig.cache.total_size() == 0
    rig.check()


def test_cap_unpins_least_recently_used_sessions_which_stay_valid():
    rig = Rig(max_pinned=25)
    a, b, c = rig.sm.open("a"), rig.sm.open("b"), rig.sm.open("c")
    rig.turn(a, list(range(100, 111)), [1])  # pins 11
    rig.turn(b, list(range(200, 211)), [1])  # pins 11: 22 in all
    rig.turn(c, list(range(300, 311)), [1])  # 33 > 25: a, least recently used, is unpinned
    assert rig.sm.pinned_tokens == 22 and rig.sm.stats.unpinned_cap == 1
    assert rig.sm.describe(a)["pinned_tokens"] == 0 and rig.sm.describe(c)["pinned_tokens"] == 11
    rig.cache.evict(10**6)
    assert rig.cache.match_prefix(list(range(100, 111))).slots == []
    # a is still open: its next turn has its history and pins again (now b is the oldest)
    r = rig.turn(a, [5], [6])
    assert rig.sm.turn_tokens(a, r)[:12] == list(range(100, 111)) + [1]
    assert rig.sm.describe(b)["pinned_tokens"] == 0 and rig.sm.describe(a)["pinned_tokens"] == 13
    rig.check()


def test_pinning_off_and_no_cache():
    for rig in (Rig(max_pinned=0), Rig(cache_cls=NoCache)):
        sid = rig.sm.open()
        rig.turn(sid, [1, 2, 3], [4])
        assert rig.sm.pinned_tokens == 0 and rig.cache.protected_size() == 0
        assert rig.sm.plan_turn(SessionParams(sid), "x", [5], 1).prompt_ids == [1, 2, 3, 4, 5]
        rig.check()


def test_unpin_lru_and_unpin_all():
    rig = Rig()
    a, b = rig.sm.open(), rig.sm.open()
    rig.turn(a, [1, 2, 3], [4])
    rig.turn(b, [5, 6, 7], [8])
    assert rig.sm.unpin_lru() and rig.sm.describe(a)["pinned_tokens"] == 0
    assert rig.sm.describe(b)["pinned_tokens"] == 3
    rig.sm.unpin_all()
    assert not rig.sm.unpin_lru() and rig.cache.protected_size() == 0
    rig.cache.reset()  # what a flush does after unpin_all
    assert rig.sm.num_open == 2


# -- ttl ---------------------------------------------------------------------------------------------
def test_ttl_expiry_on_an_injected_clock():
    rig = Rig(ttl=10.0)
    a = rig.sm.open("a")
    b = rig.sm.open("b", ttl=100.0)
    rig.turn(a, [1, 2, 3], [4])
    rig.clock.now = 9.0
    rig.turn(a, [5], [6])  # touched: lives until 19
    rig.clock.now = 15.0
    assert rig.sm.expire() == [] and rig.sm.num_open == 2
    # a turn in flight keeps its session alive past the ttl
    plan = rig.sm.plan_turn(SessionParams(a), "busy", [7], 1)
    rig.sm.start_turn(plan, False)
    rig.clock.now = 40.0
    assert rig.sm.expire() == []
    rig.finish("busy", plan.prompt_ids, [8])
    rig.clock.now = 50.1
    assert rig.sm.expire() == ["a"] and rig.sm.pinned_tokens == 0 and rig.cache.protected_size() == 0
    with pytest.raises(SessionNotFoundError, match="expired"):
        rig.sm.plan_turn(SessionParams(a), "x", [1], 1)
    rig.clock.now = 100.5
    with pytest.raises(SessionNotFoundError):  # looked up after its ttl: expired on the spot
        rig.sm.close(b)
    assert rig.sm.stats.expired == 2 and rig.sm.num_open == 0
    rig.check()


# -- stateful property test -------------------------------------------------------------------------
class SessionMachine(RuleBasedStateMachine):
    """Random opens, turns (finished or aborted, continuing, branching, replacing), closes, clock
    moves, evictions and unpins: the manager's books, the cache's locks and the cap always agree,
    and every pinned head survives a full eviction."""

    @initialize(cap=st.integers(0, 60))
    def setup(self, cap):
        self.rig = Rig(num_slots=2000, max_pinned=cap, ttl=5.0)
        self.next_tok = 10

    def _open_ids(self):
        return list(self.rig.sm._sessions)

    @rule(ttl=st.sampled_from([None, 2.0, 20.0]))
    def open(self, ttl):
        self.rig.sm.open(ttl=ttl)

    @precondition(lambda self: self.rig.sm.num_open > 0)
    @rule(data=st.data(), n_new=st.integers(1, 6), n_out=st.integers(1, 4), completed=st.booleans(),
          branch=st.booleans(), replace=st.booleans())
    def turn(self, data, n_new, n_out, completed, branch, replace):
        sid = data.draw(st.sampled_from(self._open_ids()))
        turns = self.rig.sm.describe(sid)["turns"]
        rid = data.draw(st.sampled_from(turns)) if branch and turns else None
        new = list(range(self.next_tok, self.next_tok + n_new))
        out = list(range(self.next_tok + n_new, self.next_tok + n_new + n_out))
        self.next_tok += n_new + n_out
        name = f"t{self.next_tok}"
        plan = self.rig.sm.plan_turn(SessionParams(sid, rid=rid, replace=replace), name, new, n_out)
        self.rig.sm.start_turn(plan, replace)
        self.rig.finish(name, plan.prompt_ids, out, completed)

    @precondition(lambda self: self.rig.sm.num_open > 0)
    @rule(data=st.data())
    def close(self, data):
        self.rig.sm.close(data.draw(st.sampled_from(self._open_ids())))

    @rule(dt=st.floats(0, 8))
    def tick(self, dt):
        self.rig.clock.now += dt
        self.rig.sm.expire()

    @rule()
    def evict_all(self):
        self.rig.cache.evict(10**9)
        for sess in self.rig.sm._sessions.values():
            if sess.pin is not None:
                head = sess.turns[sess.head].tokens
                assert len(self.rig.cache.match_prefix(head).slots) == sess.pin.tokens >= len(head) - 1

    @rule()
    def unpin_lru(self):
        self.rig.sm.unpin_lru()

    @invariant()
    def books_agree(self):
        if hasattr(self, "rig"):
            self.rig.check()
            assert self.rig.sm.pinned_tokens <= self.rig.sm.max_pinned_tokens


SessionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
test_session_machine = SessionMachine.TestCase
