"""Continuous batching over a prefix cache: one call of `schedule()` per forward step.

Every step carries all decoding requests (one token each) plus as many prompt tokens as the
prefill budget allows (chunked when a prompt is longer), so long prompts never stall decodes.
Within a step, decodes go first, then waiting prompts that fit the step whole, then the pieces
of longer prompts. The budget is cut to what runs in `prefill_step_seconds` (a prompt token's
cost measured on recent steps, `StepCosts`), and while requests decode, pieces of long prompts
wait whenever they have made the decodes more than `decode_slowdown` times slower on average.
Admission is by KV budget; when decode runs out of slots, the cache is evicted first, then
idle KV held outside requests (session pins) is reclaimed, and only then the request that loses
least is retracted (its KV goes into the cache, it waits again and resumes with the same
output). Plain ints and lists only: no torch here.

Program-aware admission (config.program_scheduling) is a policy the scheduler asks
(`programs.ProgramAdmission`): in what order to try the waiting requests, which may be admitted
now, and which fork prefixes to keep locked for their branches.

Where steps can replay as CUDA graphs (`GraphRoom`), short prompt pieces that would push a step
past what a graph holds wait for the next step instead: an eager step costs many times a replayed
one, so one step of 32 programs' next prompts, all arriving together, costs more than two replayed
steps (docs/machines.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.config import SchedulerConfig
from radixlm.runtime.radix_cache import PrefixCache, SlotAllocator
from radixlm.runtime.scheduler.pacing import StepCosts
from radixlm.runtime.scheduler.policy import POLICIES
from radixlm.runtime.scheduler.programs import ProgramAdmission
from radixlm.runtime.scheduler.request import Request, Status

# A waiting request whose next DEDUP_MIN uncached tokens equal those of a request being
# prefilled right now waits one step, then reads them from the cache instead of recomputing.
DEDUP_MIN = 16
# The fewest prompt tokens a step's time limit leaves a step (a slow model or a loaded machine
# must still make progress, in pieces that do not cost mostly per-step overhead).
MIN_TIMED_PIECE = 32


@dataclass(frozen=True)
class GraphRoom:
    """What a step replayed as a CUDA graph holds: ``rows`` tokens in all (a decode row each),
    ``extend_tokens`` at most of one sequence."""

    rows: int
    extend_tokens: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.extend_tokens < 1:
            raise ValueError(f"a graph room needs rows and extend_tokens >= 1, got {self.rows}, {self.extend_tokens}")

    def left(self, step: Sequence[Scheduled]) -> int | None:
        """Tokens this step can still take and replay; None when it runs eager anyway, or when
        it has no room for a piece of ``extend_tokens`` (then holding pieces back could keep
        them waiting for as long as the decodes fill it)."""
        n = sum(len(s.seq.token_ids) for s in step)
        if n + self.extend_tokens > self.rows or any(len(s.seq.token_ids) > self.extend_tokens for s in step):
            return None
        return self.rows - n


@dataclass(frozen=True)
class Scheduled:
    """One request's part of a step: what to run and what to do with its logits."""

    req: Request
    seq: SeqStep
    first_logit_pos: int  # absolute position of the first logit row returned
    samples: bool  # the last logit row picks the next output token
    prefill: bool  # prompt tokens (a chunk, or a resumed request's context), not one decode token
    draft: tuple[int, ...] = ()  # a decode that also checks these guessed tokens (a logit row each)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: PrefixCache,
        allocator: SlotAllocator,
        max_context: int,
        reclaim: Callable[[], bool] | None = None,
        graph_room: GraphRoom | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``reclaim``: release one holder of locked cache KV that no request needs (a session's
        pin, least recently used first), so that it becomes evictable; False when none is left.
        Called before a running request is retracted or ended for lack of KV, and when nothing
        at all can be scheduled. ``graph_room``: what a step replayed as a CUDA graph holds
        (None: no graphs). ``clock``: seconds, read when a step is scheduled and when it ends
        (``end_step``), to measure what steps cost."""
        if config.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {config.policy!r}; choose one of {sorted(POLICIES)}")
        self.config = config
        self.cache = cache
        self.allocator = allocator
        self.max_context = max_context
        self.reclaim = reclaim
        self.graph_room = graph_room
        self.clock = clock
        self.costs = StepCosts(config.decode_slowdown)
        # the steps scheduled and not yet ended (two while one is in flight, with the overlap
        # schedule): their parts by id, the parts, and when each was scheduled
        self._timed: list[tuple[set[int], list[Scheduled], float]] = []
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.free_rows = list(range(config.max_running_requests - 1, -1, -1))
        self._arrivals = 0
        self.num_retractions = 0
        self.new_token_ratio = config.init_new_token_ratio
        self.programs = ProgramAdmission(config, cache)
        self._steps = 0

    # -- requests in and out -------------------------------------------------------------
    def arrive(self, req: Request) -> None:
        """Validate req and give it its place in line, now: a request that first compiles its
        grammar joins the queue later (``add``) but keeps the place it took when it came, so first
        come, first served (and the order new programs start in) goes by when requests came."""
        self.validate(req)
        req.arrival = self._arrivals
        self._arrivals += 1

    def add(self, req: Request) -> None:
        """Queue req (given its place in line here unless ``arrive`` gave it one)."""
        if req.arrival < 0:
            self.arrive(req)
        req.status = Status.WAITING
        self.waiting.append(req)
        self.programs.queued(req, self._steps)

    def validate(self, req: Request) -> None:
        """Raise ValueError when req can never run here (empty, or longer than context or pool)."""
        if not req.prompt_ids:
            raise ValueError(f"request {req.rid}: the prompt is empty; give at least one token")
        if len(req.prompt_ids) >= self.max_context:
            raise ValueError(
                f"request {req.rid}: prompt of {len(req.prompt_ids)} tokens does not fit the context length "
                f"{self.max_context}; shorten it"
            )
        if len(req.prompt_ids) > self.allocator.num_slots:
            raise ValueError(
                f"request {req.rid}: prompt of {len(req.prompt_ids)} tokens needs more KV slots than the pool "
                f"holds ({self.allocator.num_slots}); raise max_total_tokens or shorten the prompt"
            )

    def finish(self, req: Request, reason: str, keep_in_cache: bool = True) -> None:
        """End a request (done, stopped or aborted) and release everything it holds. Idempotent:
        a finished request, or one in no queue (never added), is only marked finished.
        ``keep_in_cache`` False: its KV beyond the cached prefix is freed, not cached (a request
        that failed mid-step may hold KV that does not match its tokens)."""
        if req.status is Status.FINISHED:
            return
        queued = False
        if any(r is req for r in self.running):
            self._release(req, keep_in_cache=keep_in_cache)
            self.running.remove(req)
            queued = True
        elif any(r is req for r in self.waiting):
            self.waiting.remove(req)
            queued = True
        req.status = Status.FINISHED
        req.finish_reason = reason
        if queued:
            self.programs.gone(req, self._steps)

    def end_reason(self, req: Request) -> str | None:
        """Why req is finished after its newest token: "stop" (a stop matched), "length" (its
        max_new_tokens, or the context, is full), or None (it goes on)."""
        if req.matched_stop is not None:
            return "stop"
        if len(req.output_ids) >= req.params.max_new_tokens or req.known_len >= self.max_context:
            return "length"
        return None

    def rewind(self, req: Request, length: int) -> None:
        """Drop the KV of positions >= length (their tokens were replaced, e.g. by jump-forward).

        Only positions past the cached prefix may go: the cache owns the ones before tree_len."""
        assert length >= req.tree_len, (req.rid, length, req.tree_len)
        if length < len(req.slots):
            self.allocator.free(req.slots[length:])
            del req.slots[length:]

    def needs_host(self) -> bool:
        """Whether a running request's next step needs its newest token, still on the device, on
        the host first: its draw penalizes the output so far (the overlap schedule then processes
        the step in flight before it schedules the next)."""
        return any(r.unseen and r.params.penalizes_output for r in self.running)

    def _may_step(self, req: Request) -> bool:
        """Whether a decoding request steps now. Past a token the host has not read yet only if the
        next draw needs nothing from the host and can come: that token cannot be its last (by
        max_new_tokens or the context)."""
        return not req.unseen or (req.remaining_new_tokens() > 0 and req.fill_len < self.max_context
                                  and not req.params.penalizes_output)

    @property
    def prefill_budget(self) -> int:
        """Prompt tokens one step may feed while other requests decode or wait (the chunk)."""
        return self.config.chunked_prefill_size or self.config.max_prefill_tokens

    def _step_budget(self, decoding: Sequence[Request], prefilling: Sequence[Request]) -> int:
        """Prompt tokens this step may feed: the chunk, but a prompt alone on the server (nothing
        decoding, no other prompt in flight or waiting) up to ``max_prefill_tokens``. Chunks keep
        other requests' tokens coming between the pieces of a long prompt; with none to serve they
        only cost the prompt speed (a long prompt runs faster in one step than in chunks:
        docs/machines.md; docs/benchmarks.md). Either is cut to what is expected to run in
        ``prefill_step_seconds`` (not below MIN_TIMED_PIECE): where prompts are slow (a CPU) a step
        of the token limits takes seconds, and every request arriving meanwhile waits for it
        (docs/machines.md)."""
        alone = not decoding and len(prefilling) + len(self.waiting) == 1
        tokens = max(self.prefill_budget, self.config.max_prefill_tokens) if alone else self.prefill_budget
        seconds = self.config.prefill_step_seconds
        if not seconds:
            return tokens
        if self.costs.token_s is None:  # nothing measured yet: no step longer than the chunk
            return min(tokens, self.prefill_budget)
        fit = self.costs.tokens_within(seconds)
        return tokens if fit is None else min(tokens, max(fit, MIN_TIMED_PIECE))

    def abort(self, rid: str) -> Request | None:
        for req in self.waiting + self.running:
            if req.rid == rid:
                self.finish(req, "abort")
                return req
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> list[Scheduled]:
        """Pick this step's work and allocate KV slots for it."""
        self._steps += 1
        start = self.clock()
        out = self._schedule()
        # KV held for later (fork prefixes, session pins) never starves live requests: reclaim it until work fits
        while not out and self.has_work and self._reclaim():
            out = self._schedule()
        if out:
            self._timed = [*self._timed[-1:], ({id(s) for s in out}, out, start)]
        return out

    def _reclaim(self) -> bool:
        """Release one holder of locked KV that no running request needs: the oldest fork-prefix
        hold, else a session pin (the engine's hook); False when none is left."""
        return self.programs.release_hold() or (self.reclaim is not None and self.reclaim())

    def _schedule(self) -> list[Scheduled]:
        c = self.config
        self.new_token_ratio = max(self.new_token_ratio - c.new_token_ratio_decay, c.min_new_token_ratio)
        decoding = [r for r in self.running if r.is_decoding and self._may_step(r)]
        prefilling = [r for r in self.running if not r.is_decoding]
        out: list[Scheduled] = []
        for r in self._make_room_for_decode(decoding):
            out += self._draft_steps(r) if self._draft_slots(r) else [self._step(r, 1, prefill=False)]
        budget = self._step_budget(decoding, prefilling)
        generating = bool(out) or any(r.output_ids for r in prefilling)  # (a jump's extend is generating too)
        pieces = not generating or self.costs.pieces_may_run
        # past their prompt, a jump's forced tokens (or a resumed request's context) go with the decodes
        budget = self._feed([r for r in prefilling if r.output_ids], budget, out)
        if self.waiting and budget > 0 and self.free_rows and (prefilling or not pieces):
            # prompts that fit this step whole go before the pieces of longer ones
            whole = self._admit(budget, self._room(out), whole=True)
            budget -= sum(len(s.seq.token_ids) for s in whole)
            out += whole
        if not pieces:  # the decodes are owed time: long prompts wait
            return out
        budget = self._feed([r for r in prefilling if not r.output_ids], budget, out)  # prompts in flight
        if self.waiting and budget > 0 and self.free_rows:
            out.extend(self._admit(budget, self._room(out)))
        return out

    def _feed(self, reqs: Sequence[Request], budget: int, out: list[Scheduled]) -> int:
        """Append the next piece of each of reqs (running) to out while the budget and the KV last;
        the budget left (0 once the KV ran out: nothing more is fed this step)."""
        for req in reqs:
            if budget <= 0:
                return 0
            s = self._prefill_chunk(req, budget)
            if s is None:
                return 0
            budget -= len(s.seq.token_ids)
            out.append(s)
        return budget

    def _room(self, step: Sequence[Scheduled]) -> int | None:
        return None if self.graph_room is None else self.graph_room.left(step)

    def end_step(self, step: Sequence[Scheduled]) -> None:
        """After the step's tokens were appended: put just-finished prompts into the cache, so
        requests arriving with the same prefix reuse it while this one still runs."""
        for s in step:
            req = s.req
            done_prompt = len(req.slots) >= req.fill_len - (1 if s.samples else 0)
            if not s.prefill or req.status is not Status.RUNNING or not done_prompt:
                continue
            if not s.samples and req.remaining_new_tokens() == 0:  # max_new_tokens=0: prefill only, to warm the cache
                self.finish(req, "length")
                self.programs.hold_prefix(req)
            elif self.cache.shares_prefixes:  # the step's tokens, not a slot queued ahead since
                self._cache_prefix(req, upto=s.seq.cached_len + len(s.seq.token_ids))
        # its time from when it was scheduled (less any part that failed; with the overlap schedule
        # that spans the scheduling of the step after it, as the steps' pace does)
        for i, (ids, parts, start) in enumerate(self._timed):
            if step and all(id(s) in ids for s in step):
                del self._timed[: i + 1]
                prompt = sum(len(s.seq.token_ids) for s in parts if s.prefill)
                self.costs.observe(self.clock() - start, prompt, sum(not s.prefill for s in parts))
                break

    # -- programs ------------------------------------------------------------------------
    def end_program(self, program_id: str) -> None:
        """The program finished (or failed): forget it and release the fork prefixes it holds."""
        self.programs.end(program_id)

    @property
    def held_tokens(self) -> int:
        """Tokens of fork prefixes held for branches not yet admitted (overlaps counted twice)."""
        return self.programs.held_tokens

    # -- internals -----------------------------------------------------------------------
    def _step(self, req: Request, n: int, prefill: bool) -> Scheduled:
        """Feed req's next n tokens; their slots must already be at the end of req.slots."""
        start = len(req.slots) - n
        end = start + n
        samples = end == req.fill_len and req.remaining_new_tokens() > 0
        logit_start = min(max(req.first_logit_pos() - start, 0), n)
        if not samples and not req.wants_input_logprobs:
            logit_start = n
        seq = SeqStep(
            row=req.row,
            cached_len=start,
            token_ids=req.fill_ids[start:end],
            slots=req.slots[start:],
            logit_start=logit_start,
            prefix_slots=req.slots[:start] if req.rewrite_row else None,
        )
        req.rewrite_row = False
        return Scheduled(req, seq, start + logit_start, samples, prefill)

    def _draft_slots(self, req: Request) -> bool:
        """Give a decoding request with a draft one slot per draft token (none and no draft when
        the pool is short: a guess never evicts a running request)."""
        if not req.draft:
            return False
        slots = self._alloc(len(req.draft))
        if slots is None:
            req.draft = []
            return False
        req.slots.extend(slots)
        return True

    def _draft_steps(self, req: Request) -> list[Scheduled]:
        """Feed req's newest token and its draft (their slots taken) as decode rows of req's row,
        one a token, each attending up to itself: the model computes each exactly as the decode
        of that token would. The first carries the draft; its logits and the others' follow."""
        draft, req.draft = tuple(req.draft), []
        start = len(req.slots) - 1 - len(draft)
        prefix = req.slots[:start] if req.rewrite_row else None
        req.rewrite_row = False
        tokens = req.fill_ids[start : start + 1] + list(draft)
        return [Scheduled(req, SeqStep(row=req.row, cached_len=start + i, token_ids=[t], slots=[req.slots[start + i]],
                                       logit_start=0, prefix_slots=prefix if i == 0 else None),
                          start + i, i == 0, False, draft if i == 0 else ())
                for i, t in enumerate(tokens)]

    def _alloc(self, n: int) -> list[int] | None:
        if self.allocator.num_free < n:
            self.cache.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    def _make_room_for_decode(self, decoding: list[Request]) -> list[Request]:
        """Give each decoding request one slot, retracting others if the pool is out."""
        decoding = list(decoding)
        while decoding:
            slots = self._alloc(len(decoding))
            if slots is not None:
                for req, slot in zip(decoding, slots):
                    req.slots.append(slot)
                return decoding
            if self._reclaim():  # idle holds and pins go before any running request
                continue
            if len(self.running) == 1:
                # alone and still out of memory: the request cannot grow any further (once the
                # host has its newest token, which its output keeps)
                if not decoding[0].unseen:
                    self.finish(decoding[0], "length")
                return []
            victim = min(decoding, key=lambda r: (len(r.output_ids), -r.arrival))
            self._retract(victim)
            decoding.remove(victim)
        return []

    def _retract(self, req: Request) -> None:
        req.draft = []
        self._release(req, keep_in_cache=True)
        self.running.remove(req)
        req.status = Status.WAITING
        req.retractions += 1
        self.num_retractions += 1
        self.new_token_ratio = self.config.init_new_token_ratio
        self.waiting.insert(0, req)

    def _release(self, req: Request, keep_in_cache: bool) -> None:
        """Give the cache what req computed, unlock its prefix, free its row."""
        if keep_in_cache and req.slots and self.cache.shares_prefixes:
            self._cache_prefix(req, relock=False)
        else:
            self.allocator.free(req.slots[req.tree_len :])
        if req.node is not None:
            self.cache.unlock(req.node)
        req.node, req.slots, req.tree_len = None, [], 0
        self.free_rows.append(req.row)
        req.row = -1
        req.rewrite_row = True

    def _cache_prefix(self, req: Request, relock: bool = True, upto: int | None = None) -> None:
        """Insert req's computed tokens (the first ``upto``; default all with slots) into the
        cache; keep using the cache's slots."""
        # (slots past the tokens the host has, a checked draft's rejected guesses or a token still
        # on the device, are freed below)
        computed = min(len(req.slots), req.known_len) if upto is None else upto
        tokens = req.fill_ids[:computed]
        already = self.cache.insert(tokens, req.slots[:computed])
        inserted = computed // self.cache.page_size * self.cache.page_size
        if already > req.tree_len:  # someone cached these first: our copies are duplicates
            self.allocator.free(req.slots[req.tree_len : already])
        if not relock:
            self.allocator.free(req.slots[inserted:])
            return
        match = self.cache.match_prefix(tokens)
        self.cache.lock(match.node)
        if req.node is not None:
            self.cache.unlock(req.node)
        if match.slots != req.slots[: len(match.slots)]:
            req.rewrite_row = True
        req.slots = match.slots + req.slots[len(match.slots) :]
        req.node, req.tree_len = match.node, len(match.slots)

    def _refresh_matches(self) -> None:
        for req in self.waiting:
            limit = min(req.fill_len - 1, req.first_logit_pos())
            m = self.cache.match_prefix(req.fill_ids[:limit])
            req.prefix_hint, req.node = len(m.slots), m.node

    def _policy_order(self) -> list[Request]:
        """The waiting requests in the scheduling policy's order; first come, first served under
        program scheduling, whose order of programs takes the policy's place (and which then
        spares the prefix matches that lpm and dfs-weight redo for every waiting request each step)."""
        policy = self.config.policy
        if self.config.program_scheduling or (policy == "lpm" and len(self.waiting) > self.config.lpm_max_queue):
            policy = "fcfs"
        if policy != "fcfs":
            self._refresh_matches()
        return POLICIES[policy](self.waiting)

    def _expected_need(self, req: Request, cached: int) -> int:
        """Slots req is expected to still take: its uncomputed prompt plus a share of its output."""
        return req.fill_len - max(cached, len(req.slots)) + int(req.remaining_new_tokens() * self.new_token_ratio)

    def _admit(self, budget: int, room: int | None, whole: bool = False) -> list[Scheduled]:
        """Admit waiting requests while the budgets allow. ``room``: tokens the step can still take
        and replay as a CUDA graph (None: no limit); a short prompt piece past it waits. ``whole``:
        only requests whose prompt fits the budget whole (the rest keep their place in line)."""
        out: list[Scheduled] = []
        in_flight = [r for r in self.running if len(r.slots) < r.fill_len or not r.output_ids]
        reserved = sum(self._expected_need(r, 0) for r in self.running)
        headroom = self.allocator.num_free + self.cache.evictable_size() - reserved
        # the order of programs, the fairness bound and the cap on programs under way
        programs = self.programs.start_pass(self._policy_order(), len(self.free_rows), self._steps)
        longest = 0 if self.graph_room is None else self.graph_room.extend_tokens  # a piece a graph holds
        for req in programs.order:
            if budget <= 0 or not self.free_rows:
                break
            if req.unseen:  # retracted while its last token was in flight: it comes back once the host has it
                programs.defer(req)
                continue
            if not programs.may_admit(req, idle=not self.running):
                continue
            limit = min(req.fill_len - 1, req.first_logit_pos())
            match = self.cache.match_prefix(req.fill_ids[:limit])
            cached = len(match.slots)
            piece = min(req.fill_len - cached, budget)  # (the prompt tokens it would feed now)
            if room is not None and room < piece <= longest:
                break  # the step stays a graph; this piece goes first next step
            # only a cache that shares prefixes can serve them to the waiting request later
            if self.cache.shares_prefixes and any(self._shares_uncached(req, other, cached) for other in in_flight):
                programs.defer(req)  # it waits for that prefix
                continue
            if whole and req.fill_len - cached > budget:
                continue  # (it goes after the pieces of prompts in flight)
            need = self._expected_need(req, cached)
            if need > headroom and self.running:
                break
            evictable = self.cache.evictable_size()
            self.cache.lock(match.node)
            # the matched prefix counted as evictable room in headroom; locked, it no longer is
            need += evictable - self.cache.evictable_size()
            if need > headroom and self.running:
                self.cache.unlock(match.node)
                break
            req.node, req.slots, req.tree_len = match.node, list(match.slots), cached
            if req.retractions == 0:
                req.cached_tokens = min(cached, len(req.prompt_ids))  # (output a jump wrote at the start may be cached too)
            req.row = self.free_rows.pop()
            req.rewrite_row = True
            req.status = Status.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            s = self._prefill_chunk(req, budget)
            if s is None:  # no KV for even one token right now: wait
                self._release(req, keep_in_cache=False)
                self.running.remove(req)
                req.status = Status.WAITING
                self.waiting.insert(0, req)
                break
            headroom -= need
            budget -= len(s.seq.token_ids)
            out.append(s)
            if room is not None:  # (a long piece runs the step eager: then anything may join it)
                room = None if piece > longest else room - piece
            in_flight.append(req)
            programs.admitted(req)
        programs.close()
        return out

    @staticmethod
    def _shares_uncached(req: Request, other: Request, cached: int) -> bool:
        end = cached + DEDUP_MIN
        return req.fill_len - 1 >= end and other.fill_len >= end and req.fill_ids[:end] == other.fill_ids[:end]

    def _prefill_chunk(self, req: Request, budget: int) -> Scheduled | None:
        n = min(req.fill_len - len(req.slots), budget)
        slots = self._alloc(n)
        if slots is None:
            return None
        req.slots.extend(slots)
        return self._step(req, n, prefill=True)
