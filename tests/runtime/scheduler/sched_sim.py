"""A model-free driver for the scheduler, used by the scheduler tests.

`Sim` mirrors what EngineCore does around a real model: `schedule()`, "sample" every
Scheduled that samples, finish requests that reached max_new_tokens, `end_step()`. The model
is replaced by `next_token`, a pure function of the request's tokens, so a request's output
must never depend on batching, chunking, caching or retraction.

It also plays the model runner's KV bookkeeping: a dict slot -> (token id, position) written
from every SeqStep and a request->slot table per row (prefix_slots rewrite positions
0..cached_len-1, new slots are appended at cached_len..). Before each step's writes land, every
sequence's attended prefix must hold exactly its request's tokens at those positions, in slots
that are still allocated and that nothing in the same step overwrites.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from radixlm.runtime.config import SchedulerConfig
from radixlm.runtime.radix_cache import NoCache, RadixCache, SlotAllocator
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import GraphRoom, ProgramTag, Request, Scheduled, Scheduler, Status

VOCAB = 50


def next_token(fill_ids: list[int]) -> int:
    """The stand-in for the model + sampler: depends only on the tokens so far."""
    return (sum(fill_ids[-3:]) * 31 + 7) % VOCAB


def reference_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        tok = next_token(ids)
        ids.append(tok)
        out.append(tok)
    return out


class Stalled(AssertionError):
    pass


class Sim:
    def __init__(
        self,
        num_slots: int,
        *,
        cache: str = "radix",
        page_size: int = 1,
        max_context: int = 4096,
        graph_room: GraphRoom | None = None,
        step_seconds: Callable[[list[Scheduled]], float] | None = None,
        **sched_kwargs,
    ) -> None:
        """``step_seconds``: what a step takes on the scheduler's clock. Without it the clock stands
        still and measures nothing, so the limits that need measured costs default to off
        (``prefill_step_seconds``, ``decode_slowdown``)."""
        if step_seconds is None:
            sched_kwargs = {"prefill_step_seconds": 0, "decode_slowdown": 0, **sched_kwargs}
        self.allocator = SlotAllocator(num_slots)
        cache_cls = {"radix": RadixCache, "none": NoCache}[cache]
        self.cache = cache_cls(self.allocator, page_size)
        self.config = SchedulerConfig(**sched_kwargs)
        self.now = 0.0
        self.step_seconds = step_seconds
        self.sched = Scheduler(self.config, self.cache, self.allocator, max_context, graph_room=graph_room,
                               clock=lambda: self.now)
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (token id, position) last written there
        self.table: dict[int, list[int]] = {}  # row -> slots of positions 0..len-1
        self.requests: dict[str, Request] = {}
        self.history: list[list[Scheduled]] = []
        # rid -> positions whose logits came back while the request had no output yet
        self.prompt_logit_pos: dict[str, list[int]] = defaultdict(list)
        self.num_steps = 0

    # -- driving ---------------------------------------------------------------------------
    def add(self, rid: str, prompt: list[int], max_new_tokens: int, logprob_start_len: int = -1,
            program: ProgramTag | None = None) -> Request:
        req = Request(
            rid, list(prompt), SamplingParams(max_new_tokens=max_new_tokens), logprob_start_len=logprob_start_len,
            program=program,
        )
        self.sched.add(req)
        self.requests[rid] = req
        return req

    def step(self) -> list[Scheduled]:
        step = self.sched.schedule()
        self._check_step(step)
        if self.step_seconds is not None and step:
            self.now += self.step_seconds(step)
        for s in step:
            if s.samples:
                req = s.req
                req.output_ids.append(next_token(req.fill_ids))
                if len(req.output_ids) >= req.params.max_new_tokens:
                    self.sched.finish(req, "length")
        self.sched.end_step(step)
        self.check_invariants()
        self.history.append(step)
        self.num_steps += 1
        return step

    def run(self, max_steps: int = 5000, before_step=None) -> None:
        """Step until the scheduler has no work; `before_step(sim)` may add or abort requests."""
        empty = 0
        while True:
            if before_step is not None:
                before_step(self)
            if not self.sched.has_work:
                return
            assert self.num_steps < max_steps, f"no drain after {max_steps} steps"
            step = self.step()
            empty = empty + 1 if not step else 0
            if empty >= 3:
                raise Stalled(
                    f"scheduler stalled: {len(self.sched.running)} running, {len(self.sched.waiting)} waiting, "
                    f"{self.allocator.num_free} free, cache {self.cache.total_size()} "
                    f"(evictable {self.cache.evictable_size()})"
                )

    # -- checks ----------------------------------------------------------------------------
    def _check_step(self, step: list[Scheduled]) -> None:
        sched = self.sched
        rows = [s.seq.row for s in step]
        assert len(set(rows)) == len(rows), f"two sequences share a row in one step: {rows}"
        assert len({id(s.req) for s in step}) == len(step), "a request appears twice in one step"
        reads: set[int] = set()
        writes: list[tuple[int, int, int]] = []  # (slot, token, position)
        new_rows: dict[int, list[int]] = {}
        for s in step:
            req, seq = s.req, s.seq
            rid = req.rid
            assert req.status is Status.RUNNING and req in sched.running, f"{rid}: scheduled but not running"
            assert seq.row == req.row and 0 <= seq.row < self.config.max_running_requests, f"{rid}: bad row"
            fill = req.fill_ids
            n, c = len(seq.token_ids), seq.cached_len
            assert n >= 1, f"{rid}: empty SeqStep at cached_len {c}"
            assert len(seq.slots) == n, f"{rid}: {n} tokens but {len(seq.slots)} slots"
            assert c + n <= len(fill), f"{rid}: step runs past the request's tokens"
            assert seq.token_ids == fill[c : c + n], f"{rid}: fed tokens are not fill_ids[{c}:{c + n}]"
            if seq.prefix_slots is not None:
                assert len(seq.prefix_slots) == c, f"{rid}: prefix_slots do not cover 0..cached_len-1"
                row_slots = list(seq.prefix_slots)
            else:
                assert seq.row in self.table, f"{rid}: no prefix_slots for a row the runner never filled"
                row_slots = self.table[seq.row]
                assert len(row_slots) == c, (
                    f"{rid}: row holds {len(row_slots)} positions but the step starts at {c} without prefix_slots"
                )
            for pos, slot in enumerate(row_slots):
                assert self.allocator.is_allocated(slot), f"{rid}: attends to freed slot {slot} (position {pos})"
                got = self.kv.get(slot)
                assert got == (fill[pos], pos), (
                    f"{rid}: slot {slot} at position {pos} holds {got}, expected {(fill[pos], pos)}"
                )
            reads.update(row_slots)
            for i, slot in enumerate(seq.slots):
                assert self.allocator.is_allocated(slot), f"{rid}: writes to unallocated slot {slot}"
                writes.append((slot, fill[c + i], c + i))
            new_rows[seq.row] = row_slots + list(seq.slots)
            # logits
            assert 0 <= seq.logit_start <= n, f"{rid}: logit_start {seq.logit_start} outside 0..{n}"
            assert s.first_logit_pos == c + seq.logit_start, f"{rid}: first_logit_pos disagrees with the seq"
            if s.samples:
                assert c + n == len(fill), f"{rid}: samples before its last token"
                assert seq.logit_start < n, f"{rid}: samples without a logit row"
                assert req.remaining_new_tokens() > 0, f"{rid}: samples past max_new_tokens"
            if not s.prefill:
                assert n == 1 and s.samples, f"{rid}: a decode step feeds one token and samples"
            if not req.output_ids:
                self.prompt_logit_pos[rid].extend(range(c + seq.logit_start, c + n))
        written = [w[0] for w in writes]
        assert len(set(written)) == len(written), "one slot written twice in a step"
        clobbered = reads.intersection(written)
        assert not clobbered, f"slots read as prefix and overwritten in the same step: {sorted(clobbered)}"
        for slot, tok, pos in writes:
            self.kv[slot] = (tok, pos)
        self.table.update(new_rows)

    def check_invariants(self) -> None:
        """After end_step: cache structure, slot conservation, rows, request states."""
        sched, alloc, cache = self.sched, self.allocator, self.cache
        cache.check_integrity()
        owned = 0
        for r in sched.running:
            assert r.status is Status.RUNNING
            assert 0 <= r.tree_len <= len(r.slots) <= r.fill_len, f"{r.rid}: bad slot bookkeeping"
            assert all(alloc.is_allocated(s) for s in r.slots), f"{r.rid}: holds a freed slot"
            owned += len(r.slots) - r.tree_len
            if not r.rewrite_row:
                assert self.table.get(r.row) == r.slots, f"{r.rid}: the runner's row disagrees with req.slots"
        assert alloc.num_free + cache.total_size() + owned == alloc.num_slots, (
            f"slots leaked: {alloc.num_free} free + {cache.total_size()} cached + {owned} owned "
            f"!= {alloc.num_slots}"
        )
        rows = [r.row for r in sched.running]
        assert len(set(rows)) == len(rows) and not set(rows) & set(sched.free_rows)
        assert len(rows) + len(sched.free_rows) == self.config.max_running_requests
        assert len(set(sched.free_rows)) == len(sched.free_rows)
        for r in sched.waiting:
            assert r.status is Status.WAITING and r.row == -1 and not r.slots and r.tree_len == 0
        assert len(sched.running) + len(sched.waiting) == len({id(r) for r in sched.running + sched.waiting})

    def check_idle(self) -> None:
        """Nothing in flight, nothing locked, every slot free or held by the cache."""
        sched = self.sched
        assert not sched.running and not sched.waiting and not sched.has_work
        self.cache.check_integrity()
        assert self.cache.protected_size() == 0
        assert self.allocator.num_free + self.cache.total_size() == self.allocator.num_slots
        assert sorted(sched.free_rows) == list(range(self.config.max_running_requests))
        for r in self.requests.values():
            assert r.status is Status.FINISHED and r.finish_reason is not None
            assert r.row == -1 and not r.slots and r.tree_len == 0

    # -- queries ---------------------------------------------------------------------------
    def step_rids(self, i: int) -> list[str]:
        return [s.req.rid for s in self.history[i]]


def expected_prompt_logits(prompt_len: int, logprob_start_len: int) -> list[int]:
    """Positions whose logits a request gets back before its first output token."""
    if logprob_start_len < 0:
        return [prompt_len - 1]
    first = max(min(logprob_start_len - 1, prompt_len - 1), 0)
    return list(range(first, prompt_len))
