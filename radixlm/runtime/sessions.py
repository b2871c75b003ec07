"""Multi-turn sessions: a tree of turns whose newest path stays pinned in the prefix cache.

A session holds its turns (each: request id, parent turn, full token sequence prompt + output).
A new turn's prompt is the tokens of the turn it continues plus the new tokens, so its history
is read from the cache. Between turns the session keeps one lock (a *pin*) on the cache node
ending its newest finished turn, which protects that whole path from eviction. Pins are
bounded: a global cap on pinned tokens (least recently used sessions are unpinned past it), a
time-to-live per session (idle sessions are closed), and an unpin on demand when the scheduler
cannot place work otherwise. An unpinned session stays valid: its next turn recomputes what was
evicted and pins again. Plain ints and lists only: no torch here.
"""

from __future__ import annotations

import heapq
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.radix_cache import IntegrityError, PrefixCache
from radixlm.runtime.sampling_params import SamplingParams

MAX_SESSION_ID_LEN = 256


class SessionError(ValueError):
    """A session request that cannot be served as asked (HTTP 400)."""


class SessionNotFoundError(SessionError):
    """The session was never opened, was closed, or expired (HTTP 404)."""


class SessionCapacityError(SessionError):
    """A turn would take its session past the capacity it was opened with (HTTP 400)."""


@dataclass(frozen=True)
class SessionParams:
    """Which session a request belongs to and where it attaches (SGLang's `session_params`).

    ``rid``: the turn to continue (default: the session's newest finished turn). ``replace``:
    drop the later turns of ``rid`` (every turn when ``rid`` is None, so the prompt is the whole
    conversation). ``offset``: keep only the first ``offset`` tokens of the history.
    ``drop_previous_output``: continue from the prompt of ``rid`` without its output.
    """

    id: str
    rid: str | None = None
    offset: int | None = None
    replace: bool = False
    drop_previous_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise SessionError("session_params.id must be a non-empty string (the id open_session returned)")
        if self.rid is not None and (not isinstance(self.rid, str) or not self.rid):
            raise SessionError("session_params.rid must be a non-empty string: the request id of a turn")
        if self.offset is not None and (type(self.offset) is not int or self.offset < 0):
            raise SessionError(f"session_params.offset must be an integer >= 0, got {self.offset!r}")
        for name in ("replace", "drop_previous_output"):
            if not isinstance(getattr(self, name), bool):
                raise SessionError(f"session_params.{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SessionParams:
        """Build from a mapping; unknown keys are an error naming them."""
        if not isinstance(d, Mapping):
            raise SessionError("session_params must be an object {id, rid?, offset?, replace?}")
        names = ("id", "rid", "offset", "replace", "drop_previous_output")
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise SessionError(f"unknown session_params field(s) {unknown}; valid: {', '.join(names)}")
        if "id" not in d:
            raise SessionError("session_params.id is required")
        flags = ("replace", "drop_previous_output")  # SGLang clients send null for "not set"
        fields: dict[str, Any] = {k: False if k in flags and v is None else v for k, v in d.items()}
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "rid": self.rid, "offset": self.offset, "replace": self.replace,
                "drop_previous_output": self.drop_previous_output}


@dataclass(frozen=True)
class TurnPlan:
    """A validated turn, before it is registered: its full prompt and output budget."""

    session_id: str
    rid: str
    parent: str | None
    prompt_ids: list[int]
    history_len: int  # prompt tokens the session already held (a resent conversation: shared with the head)
    max_new_tokens: int | None  # the session's capacity left for output; None: no cap

    def cap(self, params: SamplingParams) -> SamplingParams:
        """``params`` with max_new_tokens cut to what the session's capacity leaves."""
        if self.max_new_tokens is None or params.max_new_tokens <= self.max_new_tokens:
            return params
        return SamplingParams.from_dict({**params.to_dict(), "max_new_tokens": self.max_new_tokens})


def prepended_bos(tokenizer: Any) -> int | None:
    """The BOS id a tokenizer puts before plain text, or None if it puts none (e.g. chatml models,
    whose 'BOS' <|im_start|> opens every message and must never be stripped)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if bos is not None and list(tokenizer.encode("a"))[:1] == [bos] else None


def _shared_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass(eq=False)
class _Turn:
    rid: str
    parent: str | None
    tokens: list[int]  # prompt, then output once finished
    prompt_len: int
    history_len: int  # leading prompt tokens taken from the parent turn
    finished: bool = False
    children: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Pin:
    node: object
    tokens: int
    rid: str  # the turn whose path it holds


@dataclass(eq=False)
class _Session:
    id: str
    capacity: int | None
    ttl: float
    last_used: float
    turns: dict[str, _Turn] = field(default_factory=dict)
    head: str | None = None  # the newest finished turn
    pin: _Pin | None = None
    running: int = 0  # turns in flight

    @property
    def deadline(self) -> float:
        return self.last_used + self.ttl


@dataclass
class SessionStats:
    """Counters since start (what `stats` reports and the metrics export)."""

    turns: int = 0
    turn_history_tokens: int = 0
    turn_cached_tokens: int = 0
    expired: int = 0
    closed: int = 0
    unpinned_cap: int = 0
    unpinned_pressure: int = 0


class SessionManager:
    """Open sessions, their turns and pins over one prefix cache."""

    def __init__(
        self,
        cache: PrefixCache,
        max_pinned_tokens: int,
        default_ttl: float,
        clock: Callable[[], float] = time.monotonic,
        strip_bos: int | None = None,
    ) -> None:
        if max_pinned_tokens < 0:
            raise ValueError(f"max_pinned_tokens must be >= 0, got {max_pinned_tokens}")
        if not default_ttl > 0:
            raise ValueError(f"the session ttl must be > 0 seconds, got {default_ttl}")
        self.cache = cache
        self.max_pinned_tokens = max_pinned_tokens
        self.default_ttl = default_ttl
        self.clock = clock
        self.strip_bos = strip_bos  # the BOS the tokenizer prepends to text: dropped from appended turns
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._turn_owner: dict[str, str] = {}  # rid of a turn in flight -> session id
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries are skipped
        self._pinned = 0
        self.stats = SessionStats()

    # -- open / close ------------------------------------------------------------------------
    def open(self, session_id: str | None = None, capacity: int | None = None, ttl: float | None = None) -> str:
        """Open a session; returns its id (a fresh one unless ``session_id`` is given)."""
        self.expire()
        if session_id is None:
            session_id = uuid.uuid4().hex
        if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID_LEN:
            raise SessionError(f"session_id must be a non-empty string of at most {MAX_SESSION_ID_LEN} characters")
        if session_id in self._sessions:
            raise SessionError(f"session {session_id!r} is already open; close it first or pick another id")
        if capacity is not None and (type(capacity) is not int or capacity < 1):
            raise SessionError(f"capacity must be a positive number of tokens, got {capacity!r}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
            raise SessionError(f"ttl must be a positive number of seconds, got {ttl!r}")
        sess = _Session(session_id, capacity, float(ttl or self.default_ttl), self.clock())
        self._sessions[session_id] = sess
        heapq.heappush(self._deadlines, (sess.deadline, session_id))
        return session_id

    def close(self, session_id: str) -> None:
        """Close a session: unpin its KV, forget its turns (turns in flight finish unrecorded)."""
        self._remove(self._get(session_id))
        self.stats.closed += 1

    def _remove(self, sess: _Session) -> None:
        self._unpin(sess)
        del self._sessions[sess.id]
        for rid in [r for r, s in self._turn_owner.items() if s == sess.id]:
            del self._turn_owner[rid]

    def _get(self, session_id: str) -> _Session:
        self.expire()
        sess = self._sessions.get(session_id)
        if sess is None:
            raise SessionNotFoundError(
                f"session {session_id!r} is not open (never opened, closed, or expired after its ttl)")
        return sess

    def _touch(self, sess: _Session) -> None:
        sess.last_used = self.clock()
        self._sessions.move_to_end(sess.id)
        heapq.heappush(self._deadlines, (sess.deadline, sess.id))

    # -- turns -------------------------------------------------------------------------------
    def plan_turn(self, params: SessionParams, rid: str, new_ids: list[int], max_new_tokens: int) -> TurnPlan:
        """Validate a turn and build its prompt; registers nothing (see ``start_turn``)."""
        sess = self._get(params.id)
        if rid in sess.turns:
            raise SessionError(f"session {sess.id!r} already has a turn with request id {rid!r}; use a new rid")
        parent = params.rid
        if parent is None and not params.replace:
            parent = sess.head
        history: list[int] = []
        if parent is not None:
            turn = sess.turns.get(parent)
            if turn is None:
                raise SessionError(f"session {sess.id!r} has no turn {parent!r} to continue (never sent, "
                                   "aborted, or dropped by a replace)")
            if not turn.finished:
                raise SessionError(f"turn {parent!r} of session {sess.id!r} is still running; "
                                   "continue it once it has finished")
            history = turn.tokens[: turn.prompt_len] if params.drop_previous_output else turn.tokens
            if params.offset is not None:  # 0 too: keep none of the history
                if params.offset > len(history):
                    raise SessionError(f"session_params.offset {params.offset} is past the {len(history)} "
                                       f"tokens of turn {parent!r}")
                history = history[: params.offset]
            if params.replace:
                self._check_droppable(sess, turn.children)
        elif params.replace:
            self._check_droppable(sess, [r for r, t in sess.turns.items() if t.parent is None])
        if history and new_ids and self.strip_bos is not None and new_ids[0] == self.strip_bos:
            new_ids = new_ids[1:]
        prompt = history + new_ids
        if not prompt:
            raise SessionError("the turn is empty: give at least one new token")
        cap_left: int | None = None
        if sess.capacity is not None:
            need = len(prompt) + (1 if max_new_tokens > 0 else 0)
            if need > sess.capacity:
                raise SessionCapacityError(
                    f"session {sess.id!r} holds at most {sess.capacity} tokens, but this turn's prompt has "
                    f"{len(prompt)} ({len(history)} of history + {len(new_ids)} new) and its output needs at "
                    f"least {need - len(prompt)} more; open a session with a larger capacity")
            cap_left = sess.capacity - len(prompt)
        held = len(history)
        if parent is None and params.replace and sess.head is not None:
            # the whole conversation was sent again (OpenAI chat, the DSL): its history is the part
            # it shares with the session's newest turn
            held = _shared_len(sess.turns[sess.head].tokens, prompt)
        return TurnPlan(sess.id, rid, parent, prompt, held, cap_left)

    def _check_droppable(self, sess: _Session, rids: list[str]) -> None:
        for rid in self._subtree(sess, rids):
            if not sess.turns[rid].finished:
                raise SessionError(f"cannot replace: turn {rid!r} of session {sess.id!r} is still running")

    @staticmethod
    def _subtree(sess: _Session, rids: list[str]) -> list[str]:
        out, stack = [], list(rids)
        while stack:
            rid = stack.pop()
            out.append(rid)
            stack.extend(sess.turns[rid].children)
        return out

    def start_turn(self, plan: TurnPlan, replace: bool) -> None:
        """Register a planned turn (after the scheduler accepted it); apply ``replace``."""
        sess = self._sessions[plan.session_id]
        if replace:
            roots = sess.turns[plan.parent].children if plan.parent is not None else [
                r for r, t in sess.turns.items() if t.parent is None]
            for rid in self._subtree(sess, list(roots)):
                del sess.turns[rid]
            if plan.parent is not None:
                sess.turns[plan.parent].children = []
            if sess.head not in sess.turns:
                sess.head = plan.parent
        sess.turns[plan.rid] = _Turn(plan.rid, plan.parent, list(plan.prompt_ids), len(plan.prompt_ids),
                                     plan.history_len)
        if plan.parent is not None:
            sess.turns[plan.parent].children.append(plan.rid)
        sess.running += 1
        self._turn_owner[plan.rid] = sess.id
        self._touch(sess)

    def finish_turn(self, rid: str, output_ids: list[int], completed: bool, cached_tokens: int) -> dict[str, Any]:
        """A turn ended. Completed: record its output, make it the head and pin its KV (the
        caller has already put its tokens into the cache). Aborted: forget it. Returns what the
        request's meta should add ({} for requests outside sessions)."""
        sid = self._turn_owner.pop(rid, None)
        if sid is None:
            return {}
        sess = self._sessions[sid]
        sess.running -= 1
        turn = sess.turns[rid]
        history = turn.history_len
        if not completed:
            del sess.turns[rid]
            if turn.parent is not None:
                sess.turns[turn.parent].children.remove(rid)
            self._touch(sess)
            if sess.pin is not None and sess.pin.rid not in sess.turns:  # a replace dropped the pinned turn
                if sess.head is not None:
                    self._pin(sess, sess.head)
                else:
                    self._unpin(sess)
            return {"session_id": sid, "session_history_tokens": history}
        turn.tokens.extend(output_ids)
        turn.finished = True
        sess.head = rid
        self.stats.turns += 1
        self.stats.turn_history_tokens += history
        self.stats.turn_cached_tokens += cached_tokens
        self._touch(sess)
        self._pin(sess, rid)
        return {"session_id": sid, "session_history_tokens": history}

    def turn_tokens(self, session_id: str, rid: str) -> list[int]:
        """The full token sequence (prompt + output) of a turn."""
        sess = self._get(session_id)
        turn = sess.turns.get(rid)
        if turn is None:
            raise SessionError(f"session {session_id!r} has no turn {rid!r}")
        return list(turn.tokens)

    # -- pins --------------------------------------------------------------------------------
    def _pin(self, sess: _Session, rid: str) -> None:
        """Move the session's pin to the cached part of turn ``rid``'s path."""
        match = self.cache.match_prefix(sess.turns[rid].tokens)
        old = sess.pin
        if match.slots:
            self.cache.lock(match.node)  # before unlocking the old pin: the paths usually share a prefix
            sess.pin = _Pin(match.node, len(match.slots), rid)
            self._pinned += len(match.slots)
        else:
            sess.pin = None
        if old is not None:
            self.cache.unlock(old.node)
            self._pinned -= old.tokens
        while self._pinned > self.max_pinned_tokens:
            victim = next(s for s in self._sessions.values() if s.pin is not None)
            self._unpin(victim)
            self.stats.unpinned_cap += 1

    def _unpin(self, sess: _Session) -> None:
        if sess.pin is not None:
            self.cache.unlock(sess.pin.node)
            self._pinned -= sess.pin.tokens
            sess.pin = None

    def unpin_lru(self) -> bool:
        """Unpin the least recently used pinned session (memory pressure); False if none is pinned."""
        for sess in self._sessions.values():
            if sess.pin is not None:
                self._unpin(sess)
                self.stats.unpinned_pressure += 1
                return True
        return False

    def unpin_all(self) -> None:
        """Unpin every session (before the cache is flushed); sessions stay open."""
        for sess in self._sessions.values():
            self._unpin(sess)

    def expire(self) -> list[str]:
        """Close sessions idle past their ttl (never one with a turn in flight); returns their ids."""
        now = self.clock()
        out: list[str] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, sid = heapq.heappop(heap)
            sess = self._sessions.get(sid)
            if sess is None or sess.deadline != deadline or sess.running:
                continue  # closed, touched since (a later entry exists), or busy (re-pushed when it ends)
            self._remove(sess)
            self.stats.expired += 1
            out.append(sid)
        if len(heap) > 2 * len(self._sessions) + 64:  # drop stale entries now and then
            self._deadlines = [(s.deadline, s.id) for s in self._sessions.values()]
            heapq.heapify(self._deadlines)
        return out

    # -- introspection -----------------------------------------------------------------------
    @property
    def num_open(self) -> int:
        return len(self._sessions)

    @property
    def pinned_tokens(self) -> int:
        """Tokens pinned, summed over sessions (a prefix two sessions share counts twice)."""
        return self._pinned

    def describe(self, session_id: str) -> dict[str, Any]:
        """One session's state: turns, head, pinned tokens, capacity, ttl."""
        sess = self._get(session_id)
        return {"session_id": sess.id, "capacity": sess.capacity, "ttl": sess.ttl, "head": sess.head,
                "turns": list(sess.turns), "running_turns": sess.running,
                "pinned_tokens": sess.pin.tokens if sess.pin else 0,
                "head_tokens": len(sess.turns[sess.head].tokens) if sess.head else 0}

    def stats_dict(self) -> dict[str, int]:
        s = self.stats
        return {"sessions_open": self.num_open, "sessions_pinned": sum(1 for x in self._sessions.values() if x.pin),
                "session_pinned_tokens": self._pinned, "session_turns_total": s.turns,
                "session_history_tokens_total": s.turn_history_tokens,
                "session_cached_tokens_total": s.turn_cached_tokens, "sessions_expired_total": s.expired,
                "sessions_closed_total": s.closed, "session_unpins_cap_total": s.unpinned_cap,
                "session_unpins_pressure_total": s.unpinned_pressure}

    def check_integrity(self) -> None:
        """Pinned-token total, heads and parent/child links agree; IntegrityError names the first
        that does not."""
        pinned = sum(s.pin.tokens for s in self._sessions.values() if s.pin)
        _check(self._pinned == pinned, f"pinned-token count {self._pinned} != the pins' {pinned}")
        _check(self._pinned <= self.max_pinned_tokens, f"{self._pinned} pinned tokens > cap {self.max_pinned_tokens}")
        for sid, sess in self._sessions.items():
            _check(sess.head is None or sess.turns[sess.head].finished, f"session {sid}: head turn unfinished")
            _check(sess.pin is None or sess.pin.rid == sess.head or sess.running > 0,  # moved when a turn ends
                   f"session {sid}: pin not on the head turn")
            running = sum(1 for t in sess.turns.values() if not t.finished)
            _check(sess.running == running, f"session {sid}: {sess.running} running turns counted, {running} found")
            for rid, t in sess.turns.items():
                _check(t.parent is None or rid in sess.turns[t.parent].children, f"turn {rid}: not its parent's child")
                _check(all(sess.turns[c].parent == rid for c in t.children), f"turn {rid}: a child names another parent")
        for rid, sid in self._turn_owner.items():
            _check(not self._sessions[sid].turns[rid].finished, f"turn {rid}: finished but still owned")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)
