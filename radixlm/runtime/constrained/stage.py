"""GrammarStage: the constrained-decoding phase of a step.

It builds the grammar service on the first constrained request and compiles each new request's
constraint, both off the step loop (running requests keep stepping), masks the logits of a step's
constrained rows (one bitmask fill per row and step), accepts the sampled tokens and plans the
jump over forced text. A failing grammar engine fails its own request, never the step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, NamedTuple

import numpy as np
import torch

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.bitmask import allocate_bitmask, apply_bitmask_
from radixlm.runtime.constrained.grammar import Grammar, accept_tokens, fill_masks
from radixlm.runtime.constrained.jump_forward import MAX_JUMP_CHARS, Jump
from radixlm.runtime.constrained.service import ERROR_PREFIX, GrammarService, check_constraint
from radixlm.runtime.request import EngineRequest

log = logging.getLogger(__name__)

COMPILE_WAIT_S = 0.05  # with nothing to run but grammars compiling, how long one step waits
# where the grammar's time goes: filling and applying masks, testing a drawn token (mask on
# reject), accepting tokens, and after a token (planning the jump, asking whether it is complete)
PHASES = ("mask", "test", "accept", "after_token")
# a greedy row whose drawn token its grammar refuses tries this many next-best tokens before its mask
NEXT_BEST_TRIES = 8


class GrammarStep(NamedTuple):
    """What the grammar made of a sampled token: the jump over forced text (or None), and
    whether the output is complete with nothing but a stop token allowed next."""

    jump: Jump | None
    done: bool


_NOTHING = GrammarStep(None, False)


class GrammarStage:
    def __init__(self, make_service: Callable[[], GrammarService], vocab_size: int, config: ConstraintConfig) -> None:
        self._make_service = make_service
        self._service: GrammarService | None = None
        self._building: Future[GrammarService] | None = None
        self._awaiting: dict[str, EngineRequest] = {}  # constrained requests waiting for the service
        self.vocab_size = vocab_size
        self.config = config
        self._compiling: dict[str, tuple[EngineRequest, Future[Grammar]]] = {}
        # a row filled after a token (to ask whether only a stop token may follow), kept for the next step
        self._next_rows: dict[str, tuple[torch.Tensor, bool]] = {}
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)  # for the per-token grammar cost
        self.tokens = 0
        self.masks_skipped = 0  # greedy rows whose drawn token the grammar allowed without a mask
        self.next_best = 0  # of them, rows whose drawn token was refused and a next-best one allowed
        # the masks of a step, reused: two, so a step never overwrites a copy still in flight
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    @property
    def service(self) -> GrammarService:
        """The grammar service (waited for while it is being built); its build's error if it failed."""
        if self._service is None:
            self._service = self._build().result()
        return self._service

    def _build(self) -> Future[GrammarService]:
        """The service's build, started in a thread of its own on first use: it describes the
        tokenizer to the grammar engine, token by token (docs/machines.md), which on the step loop
        would stall every running request."""
        if self._building is None:
            building: Future[GrammarService] = Future()

            def build() -> None:
                try:
                    building.set_result(self._make_service())
                except BaseException as e:  # noqa: BLE001 - reported to each request that waits for it
                    building.set_exception(e)

            self._building = building
            threading.Thread(target=build, name="grammar-service", daemon=True).start()
        return self._building

    # -- compiling ---------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        """Start compiling req's constraint (once the service is built); a malformed spec raises
        ValueError here."""
        constraint = req.params.constraint
        assert constraint is not None
        if self._service is None:
            check_constraint(*constraint, self.config)
            self._build()
            self._awaiting[req.rid] = req
            return
        self._compiling[req.rid] = (req, self._service.submit(*constraint))

    @property
    def compiling(self) -> bool:
        return bool(self._compiling or self._awaiting)

    def cancel(self, rid: str) -> bool:
        """Forget a request still compiling; True if it was."""
        if self._awaiting.pop(rid, None) is not None:
            return True
        entry = self._compiling.pop(rid, None)
        if entry is None:
            return False
        entry[1].cancel()
        return True

    def _start_awaiting(self, idle: bool) -> list[tuple[EngineRequest, str]]:
        """Once the service is built, start compiling the requests that waited for it; those
        that cannot be, with the error (the build's, if it failed)."""
        building = self._build()
        if idle and not self._compiling:
            wait([building], timeout=COMPILE_WAIT_S)
        if not building.done():
            return []
        waiting, self._awaiting = list(self._awaiting.values()), {}
        try:
            service = self.service
        except Exception as e:  # noqa: BLE001 - each waiting request fails with it, not the step
            log.exception("building the grammar service failed")
            message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            return [(req, f"{ERROR_PREFIX} {message}") for req in waiting]
        failed = []
        for req in waiting:
            try:
                self._compiling[req.rid] = (req, service.submit(*req.params.constraint))  # type: ignore[misc]
            except ValueError as e:
                failed.append((req, str(e)))
        return failed

    def ready(self, idle: bool) -> tuple[list[EngineRequest], list[tuple[EngineRequest, str]]]:
        """Requests whose grammar compiled (with their matcher set), and those whose compile
        failed (with the error). ``idle``: nothing else to run, so wait a little for one."""
        failed = self._start_awaiting(idle) if self._awaiting else []
        if idle and self._compiling:
            wait([f for _, f in self._compiling.values()], timeout=COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        done: list[EngineRequest] = []
        for rid, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                req.matcher = future.result().new_matcher()
            except ValueError as e:
                failed.append((req, str(e)))
                continue
            done.append(req)
        return done, failed

    # -- the step ----------------------------------------------------------------------
    def mask(self, logits: torch.Tensor, reqs: list[EngineRequest],
             skip: Sequence[int] = ()) -> list[tuple[EngineRequest, str]]:
        """Give each constrained row of ``logits`` (but those in ``skip``) its grammar's bitmask;
        other rows stay as they are. Returns the requests whose grammar engine failed (their rows
        stay unmasked: the caller ends them)."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None and i not in skip]
        if not rows:
            return []
        t0 = time.perf_counter()
        bitmask = self._bitmask(len(rows), pinned=logits.device.type == "cuda")
        masked = [False] * len(rows)
        to_fill: list[int] = []
        for j, i in enumerate(rows):
            kept = self._next_rows.pop(reqs[i].rid, None)
            if kept is None:
                to_fill.append(j)
            else:
                bitmask[j], masked[j] = kept
        matchers = [reqs[rows[j]].matcher for j in to_fill]
        failed: list[tuple[EngineRequest, str]] = []
        for j, got in zip(to_fill, fill_masks(matchers, bitmask, to_fill)):  # type: ignore[arg-type]
            if isinstance(got, Exception):
                failed.append((reqs[rows[j]], self.engine_error("masking", got)))
            else:
                masked[j] = got
        for j, m in enumerate(masked):
            if not m:  # every token allowed (or the row failed: its request ends, the row is moot)
                bitmask[j] = -1
        if any(masked):
            apply_bitmask_(logits, bitmask, rows)
        self._spent("mask", t0, time.perf_counter())
        return failed

    def unmasked_rows(self, logits: torch.Tensor, reqs: list[EngineRequest]) -> list[int]:
        """The constrained rows whose mask can wait until their token is drawn (``rejected``
        then says which need it): greedy rows on the host, without logprobs, whose grammar engine
        can test one token. The argmax of the raw row, when the grammar allows it, is the argmax
        of the masked row, so the output is the same token for token; a CPU step then skips the
        mask fill and apply, which cost far more than the test once the forward pass has swept the
        grammar's tables out of the caches."""
        if not (self.config.mask_on_reject if self.config.mask_on_reject is not None
                else logits.device.type == "cpu"):
            return []
        return [i for i, r in enumerate(reqs)
                if r.matcher is not None and r.params.is_greedy and not r.return_logprob
                and hasattr(r.matcher, "allows") and r.rid not in self._next_rows]

    def rejected(self, reqs: list[EngineRequest], tokens: list[int], rows: Sequence[int],
                 logits: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
        """The rows among ``rows`` whose drawn token their grammar forbids (or whose grammar engine
        failed on the test: masking the row again reports the failure), and the rows whose token
        was replaced in ``tokens``. Given ``logits`` whose argmax drew ``tokens``, a refused row
        first tries its next-best tokens (:meth:`_next_allowed`), and needs no mask when its
        grammar allows one of them."""
        t0 = time.perf_counter()
        if len(rows) == 1 and self._allows(reqs[rows[0]].matcher, tokens[rows[0]]):
            # one row whose token is allowed (a request alone): said in as few steps as can be, since
            # after a CPU forward pass each one reads memory that pass swept out of the caches (a
            # refused token, rare, is tested again below)
            self.masks_skipped += 1
            self._spent("test", t0, time.perf_counter())
            return [], []
        out: list[int] = []
        picked: list[int] = []
        for i in rows:
            matcher: Any = reqs[i].matcher  # (a matcher with ``allows``: unmasked_rows picked it)
            try:
                if matcher.allows(tokens[i]):
                    continue
                better = None if logits is None else self._next_allowed(matcher, logits[i], tokens[i])
            except Exception:  # noqa: BLE001 - the row's mask fill raises it again, for its request alone
                better = None
            if better is None:
                out.append(i)
            else:
                tokens[i] = better
                picked.append(i)
        self.next_best += len(picked)
        self.masks_skipped += len(rows) - len(out)
        self._spent("test", t0, time.perf_counter())
        return out, picked

    @staticmethod
    def _allows(matcher: Any, token: int) -> bool:
        """Whether ``matcher`` allows ``token``; False where its grammar engine fails (the row is
        then masked, which reports the failure for its request alone)."""
        try:
            return bool(matcher.allows(token))
        except Exception:  # noqa: BLE001 - see above
            return False

    def _next_allowed(self, matcher: Any, row: torch.Tensor, refused: int) -> int | None:
        """A greedy row whose drawn token ``refused`` its grammar forbids: its next-best tokens in
        the order argmax takes them (the highest logit first, the lowest id among equals), tested
        in turn; the first the grammar allows is the masked row's argmax. None (the row is masked)
        when none of the next ``NEXT_BEST_TRIES`` is allowed, or one of them is a stop token,
        whose test cannot say, or every logit left is -inf. ``row`` is left as it was."""
        on_host = row.device.type == "cpu" and row.dtype == torch.float32
        x = row.numpy() if on_host else row.float().cpu().numpy()  # (a copy: nothing to put back)
        stops = self.service.vocab.stop_ids
        hidden = [(refused, float(x[refused]))]
        x[refused] = -np.inf
        try:
            for _ in range(NEXT_BEST_TRIES):
                t = int(x.argmax())
                if t in stops or x[t] == -np.inf:
                    return None
                if matcher.allows(t):
                    return t
                hidden.append((t, float(x[t])))
                x[t] = -np.inf
            return None
        finally:
            for t, v in hidden:
                x[t] = v

    def _bitmask(self, n: int, pinned: bool) -> torch.Tensor:
        """n rows of a reused mask buffer (the two buffers take turns)."""
        self._turn ^= 1
        if len(self._buffers) < 2 or self._buffers[self._turn].shape[0] < n:
            size = max(n, 8, *(b.shape[0] for b in self._buffers))
            self._buffers = [allocate_bitmask(size, self.vocab_size, pinned) for _ in range(2)]
        return self._buffers[self._turn][:n]

    def accept_all(self, reqs: list[EngineRequest], tokens: list[int]) -> list[bool | Exception]:
        """Advance each request's matcher over its token, a backend's matchers at once; entry i:
        whether the grammar took it, or the grammar engine's exception."""
        t0 = time.perf_counter()
        out = accept_tokens([r.matcher for r in reqs], tokens)  # type: ignore[misc]
        self._spent("accept", t0, time.perf_counter())
        self.tokens += len(reqs)
        return out

    def after_token(self, req: EngineRequest, limit: int, floor: int, min_gain: int | None = 1) -> GrammarStep:
        """After an accepted token: the jump over the text the grammar now forces (the output
        may grow to ``limit`` tokens; tokens before ``floor`` stay; a jump adds at least
        ``min_gain`` tokens; None: no jump), and whether the output is complete with only a stop
        token allowed next."""
        matcher = req.matcher
        assert matcher is not None
        t0 = time.perf_counter()
        step = _NOTHING
        # the forced text, asked once: most tokens force nothing, and then no jump is planned
        forced = matcher.forced_text(MAX_JUMP_CHARS) if req.jump_forward and min_gain is not None else ""
        if forced and min_gain is not None:
            planned = self.service.jump_forward.jump(matcher, req.output_ids, floor, limit, min_gain, forced)
            if planned is not None:
                step = GrammarStep(planned, False)
        if matcher.is_completed():
            only_stop_next = getattr(matcher, "only_stop_next", None)
            if only_stop_next is not None and only_stop_next():  # the matcher knows: no mask needed
                step = GrammarStep(step.jump, True)
            else:
                # the next step's row, filled now: it also says whether only a stop token may follow
                row = allocate_bitmask(1, self.vocab_size)[0]
                is_masked = matcher.fill_mask(row)
                if is_masked and self._only_stop_allowed(row):
                    step = GrammarStep(step.jump, True)
                else:
                    self._next_rows[req.rid] = (row, is_masked)
        self._spent("after_token", t0, time.perf_counter())
        return step

    def jump_at_start(self, req: EngineRequest, limit: int) -> Jump | None:
        """Before a request's first forward pass: the jump over the text its grammar forces at
        the start (``{"name":"``), or None. Its tokens join the prompt's prefill, so it costs no
        step of its own and needs no gain. Not for requests that want the prompt's logprobs (their
        prefill returns those logits, and forced output would stand in their way)."""
        matcher = req.matcher
        assert matcher is not None
        if not req.jump_forward or req.output_ids or req.logprob_start_len >= 0:
            return None
        t0 = time.perf_counter()
        try:
            return self.service.jump_forward.jump(matcher, [], 0, limit)
        finally:
            self._spent("after_token", t0, time.perf_counter())

    def forget(self, rid: str) -> None:
        """req finished: drop what was kept for its next step."""
        self._next_rows.pop(rid, None)

    @property
    def stop_id(self) -> int:
        """The stop token reported when a grammar ends the output."""
        return self.service.vocab.stop_ids[0]

    def _only_stop_allowed(self, row: torch.Tensor) -> bool:
        row = row.clone()
        for t in self.service.vocab.stop_ids:
            bit = 1 << (t % 32)
            row[t // 32] &= ~(bit - (1 << 32) if bit >= 1 << 31 else bit)  # int32 words
        return not bool(row.any())

    @staticmethod
    def engine_error(what: str, e: BaseException) -> str:
        log.exception("grammar engine failed while %s", what)
        return f"{ERROR_PREFIX} the grammar engine failed while {what} ({type(e).__name__}: {e})"

    def shutdown(self) -> None:
        building = self._building
        if self._service is None and building is not None and building.done() and building.exception() is None:
            self._service = building.result()
        if self._service is not None:
            self._service.shutdown()

    @property
    def seconds(self) -> float:
        """The grammar's time in all: masks, tests, accepts and jumps."""
        return sum(self.phase_seconds.values())

    def _spent(self, phase: str, t0: float, t1: float) -> None:
        self.phase_seconds[phase] += t1 - t0

    def reset_counters(self) -> None:
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.tokens = self.masks_skipped = self.next_best = 0

    def stats(self) -> dict[str, Any]:
        return {"grammar_seconds": self.seconds, "grammar_tokens": self.tokens,
                "grammar_masks_skipped": self.masks_skipped, "grammar_next_best": self.next_best}
