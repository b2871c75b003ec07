"""Program-aware admission: the order in which the scheduler admits the requests of LM programs.

An agent program is a chain of requests, each sent once the one before it has answered. Under an
order that knows nothing of programs (lpm, fcfs), a program's next request queues behind the first
requests of programs that just came, at every step of its chain, so all programs under way share
the rows and the longest chains wait longest. With requests that name their program
(`ProgramTag`) and ``SchedulerConfig.program_scheduling`` on, the scheduler finishes the programs
it started first (p99 program latency 1.7-2.0x lower on the GPU, docs/benchmarks.md):

- Requests of started programs go before those that start new programs (or have none), oldest
  program first, each fork's sibling branches back to back; new programs start in the order they
  came (first come, first served takes the place of the scheduler's policy: under lpm a new program
  whose prompt shares a longer cached prefix started before older ones again and again).
- New programs start only while fewer than ``program_active_cap`` started programs are under way
  (a program the server runs counts until it ends, a client's between two of its requests for
  ``program_gap_steps`` steps, as its next request is on its way). Without the cap, each step a
  program spent between two requests let a new one start, and the younger ones waited hundreds of
  steps between their requests. With nothing running the cap is ignored: the server never idles.
- Fairness: an admission that overtakes waiting requests (admits one that comes after them in
  the base order) counts once against each of them; a request counted ``program_fairness`` times goes
  first, and nothing after it may be admitted before it. A request that cannot run now (it waits
  for a prefix in flight, or for a program to end) is not counted as overtaken.
- A fork's prefix prefill keeps its KV locked in the cache until its branches are admitted, so it
  is computed once even under cache pressure; when memory is short, such holds go before
  sessions' pins, and before any running request is retracted.

The scheduler keeps the mechanics (rows, KV, budgets) and asks `ProgramAdmission`: `start_pass`
gives one admission pass its order and says, request by request, whether one may be admitted now;
the other methods note what happened. Plain ints and lists: no torch.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from radixlm.runtime.config import SchedulerConfig
from radixlm.runtime.radix_cache import PrefixCache
from radixlm.runtime.scheduler.request import ProgramTag, Request

# Programs remembered as started when nobody ends them (a client naming its programs): the oldest
# are forgotten past this many per running-request row.
PROGRAMS_PER_ROW = 4


@dataclass
class _Hold:
    """A fork's prefix, locked in the cache until ``remaining`` branch requests were admitted."""

    node: object
    tokens: int
    remaining: int


@dataclass
class _Program:
    started: int  # admission order of its first request
    holds: dict[str, _Hold] = field(default_factory=dict)
    idle_since: int | None = None  # the step its last request in flight ended (None: never yet)
    managed: bool = False  # the server runs it and ends it (end): under way until then


class ProgramAdmission:
    """The started programs (oldest first) and what the scheduler asks of them; with program
    scheduling off it holds nothing and defers nothing. ``now``: the scheduler's step count."""

    def __init__(self, config: SchedulerConfig, cache: PrefixCache) -> None:
        self.on = config.program_scheduling
        self.config = config
        self.cache = cache
        self.started: OrderedDict[str, _Program] = OrderedDict()
        self._count = 0  # programs started so far
        self._live: dict[str, int] = {}  # program id -> its requests waiting or running
        # a started program's next request after it had none in flight: how many came, how many
        # after program_gap_steps, and the steps they took in all (how long a round trip takes)
        self.returns = self.returns_late = self.return_steps = 0

    # -- what happened -------------------------------------------------------------------
    def queued(self, req: Request, now: int) -> None:
        """req joined the waiting queue."""
        if req.program is None or not self.on:
            return
        pid = req.program.id
        if pid not in self._live:
            self._returned(pid, now)
        self._live[pid] = self._live.get(pid, 0) + 1

    def gone(self, req: Request, now: int) -> None:
        """req, waiting or running, finished."""
        if req.program is None or not self.on:
            return
        pid = req.program.id
        left = self._live.get(pid, 0) - 1
        if left > 0:
            self._live[pid] = left
            return
        self._live.pop(pid, None)
        prog = self.started.get(pid)
        if prog is not None:
            prog.idle_since = now

    def hold_prefix(self, req: Request) -> None:
        """req's prompt was prefilled and it ends there: a fork's prefix keeps its KV locked until
        its branches are admitted."""
        tag = req.program
        if tag is None or not tag.hold or tag.group is None or not self.on or not self.cache.shares_prefixes:
            return
        prog = self._start(tag)
        match = self.cache.match_prefix(req.prompt_ids)
        if not match.slots:
            return
        old = prog.holds.pop(tag.group, None)
        if old is not None:
            self.cache.unlock(old.node)
        self.cache.lock(match.node)
        prog.holds[tag.group] = _Hold(match.node, len(match.slots), tag.hold)

    def release_hold(self) -> bool:
        """Unlock the oldest fork-prefix hold (memory is short); False when none is left."""
        for prog in self.started.values():
            for group in prog.holds:
                self.cache.unlock(prog.holds.pop(group).node)
                return True
        return False

    def end(self, program_id: str) -> None:
        """The program finished (or failed): forget it and release the fork prefixes it holds."""
        prog = self.started.pop(program_id, None)
        if prog is not None:
            for hold in prog.holds.values():
                self.cache.unlock(hold.node)

    @property
    def held_tokens(self) -> int:
        """Tokens of fork prefixes held for branches not yet admitted (overlaps counted twice)."""
        return sum(h.tokens for p in self.started.values() for h in p.holds.values())

    # -- an admission pass ---------------------------------------------------------------
    def start_pass(self, base: list[Request], free_rows: int, now: int) -> AdmissionPass:
        """A pass over the waiting requests, ``base``: all of them in the base order (first come,
        first served under program scheduling), with ``free_rows`` rows free."""
        return AdmissionPass(self, base, free_rows, now)

    # -- internals -----------------------------------------------------------------------
    def _returned(self, program_id: str, now: int) -> None:
        """A started program's request came while it had none in flight: count the round trip."""
        prog = self.started.get(program_id)
        if prog is None or prog.idle_since is None:
            return
        steps = now - prog.idle_since
        self.returns += 1
        self.returns_late += steps > self.config.program_gap_steps
        self.return_steps += steps

    def _active(self, now: int) -> int:
        """Started programs with a request waiting or running, run by the server and not yet
        ended, or between two of their requests for at most program_gap_steps steps."""
        gap = self.config.program_gap_steps
        return sum(1 for pid, p in self.started.items()
                   if pid in self._live or p.managed or (p.idle_since is not None and now - p.idle_since <= gap))

    def _start(self, tag: ProgramTag) -> _Program:
        prog = self.started.get(tag.id)
        if prog is None:
            prog = self.started[tag.id] = _Program(self._count, managed=tag.managed)
            self._count += 1
            while len(self.started) > PROGRAMS_PER_ROW * self.config.max_running_requests:
                self.end(next(iter(self.started)))
        return prog

    def _admitted(self, req: Request) -> None:
        """req's program has started; a branch's first request counts down its fork's hold."""
        tag = req.program
        if tag is None:
            return
        prog = self._start(tag)
        if tag.group is None or tag.hold:
            return
        hold = prog.holds.get(tag.group)
        if hold is not None:
            hold.remaining -= 1
            if hold.remaining <= 0:
                del prog.holds[tag.group]
                self.cache.unlock(hold.node)

    def _preferred(self, req: Request) -> bool:
        return req.program is not None and req.program.id in self.started

    def _order(self, base: list[Request]) -> list[Request]:
        """``base`` regrouped: requests at the fairness bound first, then those of started programs
        (oldest program first, each fork's siblings together), then the rest in base order."""
        pos = {id(r): i for i, r in enumerate(base)}
        group_at: dict[tuple[str, str | None], int] = {}  # where each fork group first appears
        for r in base:
            if r.program is not None:
                group_at.setdefault((r.program.id, r.program.group), pos[id(r)])

        def program_rank(r: Request) -> tuple[int, int, int]:
            assert r.program is not None
            return self.started[r.program.id].started, group_at[(r.program.id, r.program.group)], pos[id(r)]

        bound = self.config.program_fairness
        urgent = [r for r in base if r.passed_over >= bound]
        preferred = sorted((r for r in base if r.passed_over < bound and self._preferred(r)), key=program_rank)
        rest = [r for r in base if r.passed_over < bound and not self._preferred(r)]
        return urgent + preferred + rest


class AdmissionPass:
    """One admission pass: the order to try the waiting requests in (``order``), whether each may
    be admitted now, and the count of who overtook whom (``Request.passed_over``).

    A request may overtake only those still below the fairness bound, checked in O(log n) a
    candidate (a heap of the requests at the bound): with a long queue, listing the ones each
    candidate overtakes costs a large share of the throughput under fcfs (docs/machines.md). While
    no request can reach the bound in this pass (each admission passes a request at most once), the
    passes are counted once at its end (``close``), not by a scan of the queue per admission (the
    same counts, less host time a step: docs/machines.md)."""

    def __init__(self, programs: ProgramAdmission, base: list[Request], free_rows: int, now: int) -> None:
        self.programs = programs
        self.on = programs.on
        self.order = programs._order(base) if self.on else base
        if not self.on:
            return
        config = programs.config
        self._base = base
        self._rank = {id(r): i for i, r in enumerate(base)}
        self._fairness = config.program_fairness
        self._blockers = _Blockers(self._rank)
        for r in base:
            if r.passed_over >= self._fairness:
                self._blockers.add(r)
        self._eager = max((r.passed_over for r in base), default=0) + free_rows >= self._fairness
        self._ranks: list[int] = []  # base ranks of the requests admitted, in order
        self._cutoff: dict[int, int] = {}  # id of a request admitted or deferred -> admissions before it
        self._cap = config.program_active_cap or 2 * config.max_running_requests
        self._active = programs._active(now)

    def may_admit(self, req: Request, idle: bool) -> bool:
        """Whether req may be admitted now: not after a request at the fairness bound, nor when it
        would start a new program while enough are under way and the server is not ``idle`` (then
        it is deferred, and starts when one of them ends)."""
        if not self.on:
            return True
        if self._blockers.before(req):
            return False
        if self._starts(req) and self._active >= self._cap and not idle:
            self.defer(req)
            return False
        return True

    def defer(self, req: Request) -> None:
        """req cannot run now: passing it overtakes nobody."""
        if not self.on:
            return
        self._cutoff[id(req)] = len(self._ranks)
        self._blockers.drop(req)

    def admitted(self, req: Request) -> None:
        """req was admitted: its program has started; count whom it overtook."""
        if not self.on:
            return
        self._active += self._starts(req)
        self.programs._admitted(req)
        self._blockers.drop(req)
        self._cutoff[id(req)] = len(self._ranks)
        rank = self._rank[id(req)]
        self._ranks.append(rank)
        if self._eager:  # those before it in the base order still waiting (not admitted, not deferred)
            for r in self._base[:rank]:
                if id(r) not in self._cutoff:
                    r.passed_over += 1
                    if r.passed_over == self._fairness:
                        self._blockers.add(r)

    def close(self) -> None:
        """The pass is over: count the passes not counted admission by admission. A request of the
        base order was passed by each admission of a later rank while it waited: all of them, or
        those before it was admitted or deferred."""
        if not self.on or self._eager:
            return
        ranks = sorted(self._ranks)
        for r in self._base:
            mine = self._rank[id(r)]
            before = self._cutoff.get(id(r))
            if before is None:
                r.passed_over += len(ranks) - bisect.bisect_right(ranks, mine)
            else:
                r.passed_over += sum(1 for x in self._ranks[:before] if x > mine)

    def _starts(self, req: Request) -> bool:
        """Whether admitting req starts a new program."""
        return req.program is not None and not self.programs._preferred(req)


class _Blockers:
    """Waiting requests that no later request (in the base order, ``rank``) may overtake, with the
    lowest rank among them at hand (a heap; dropped entries are skipped lazily)."""

    def __init__(self, rank: dict[int, int]) -> None:
        self.rank = rank
        self.live: set[int] = set()
        self.heap: list[tuple[int, int]] = []

    def add(self, req: Request) -> None:
        self.live.add(id(req))
        heapq.heappush(self.heap, (self.rank[id(req)], id(req)))

    def drop(self, req: Request) -> None:
        self.live.discard(id(req))

    def before(self, req: Request) -> bool:
        """Whether a blocker comes before req in the base order."""
        while self.heap and self.heap[0][1] not in self.live:
            heapq.heappop(self.heap)
        return bool(self.heap) and self.heap[0][0] < self.rank[id(req)]
