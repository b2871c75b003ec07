"""The overlap schedule: the next decode step is queued on the device on the tokens the step
before it drew there, before the host has seen them, so the device runs it while the host
processes that step's outputs (docs/gpu.md). A step queued ahead whose rows include constrained
ones samples after the host has advanced their grammars, while its forward pass runs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.constrained.stage import GrammarStage
from radixlm.runtime.faults import FaultBoundary, is_fatal
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.output_processor import RequestOutput
from radixlm.runtime.request import EngineRequest
from radixlm.runtime.sampling.sampler import sample_tokens
from radixlm.runtime.sampling.stage import SamplingStage
from radixlm.runtime.scheduler import Scheduled, Scheduler, Status

log = logging.getLogger("radixlm.engine")


@dataclass(frozen=True)
class StepRun:
    """A step queued on the device: what it runs, the requests that sample (in the order of
    `tokens`), their tokens (still on the device) with the copy to the host already started,
    the sampled rows' logits when a request wants logprobs, and the requests it already ended."""

    step: list[Scheduled]
    samplers: list[EngineRequest]
    tokens: torch.Tensor
    fetch: Callable[[], list[int]]
    logits: torch.Tensor | None = None
    ended: tuple[RequestOutput, ...] = ()
    queued_ahead: bool = False  # counted as a step when processed, for the requests still running


@dataclass(frozen=True)
class AheadForward:
    """A decode step queued ahead whose rows include constrained ones: its forward pass runs on
    the device while the host processes the step before it, and it samples once that step's
    tokens have advanced the grammars (`marks`: each request's output length and forced-token
    count the row was queued for; a request that jumped forward or ended since drops its row)."""

    step: list[Scheduled]
    reqs: list[EngineRequest]
    logits: torch.Tensor
    marks: list[tuple[int, int]]


class OverlapSchedule:
    """The steps one engine queues ahead: ``run``, a queued step already sampled (the next
    `EngineCore.step()` takes it instead of scheduling), or ``forward``, one whose sampling waits
    for the grammars; ``steps`` and ``extends`` count them and the jump-forward extends among them."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, grammar: GrammarStage, sampling: SamplingStage,
                 faults: FaultBoundary, requests: dict[str, EngineRequest], context_length: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.grammar = grammar
        self.sampling = sampling
        self.faults = faults
        self.requests = requests
        self.context_length = context_length
        self.run: StepRun | None = None
        self.forward: AheadForward | None = None
        self.steps = 0
        self.extends = 0

    def queue(self, run: StepRun, enabled: bool) -> None:
        """Queue the next decode step of `run`'s requests on the device (if ``enabled`` and it
        may), on the tokens `run` drew there, before the host sees them. If that raises, the step
        queued ahead is dropped (its slots freed) and the requests' next step runs the plain way,
        whose fault boundaries end the request at fault."""
        held = {id(r): len(r.slots) for r in self.scheduler.running}
        try:
            self._try_queue(run, enabled)
        except Exception as e:  # noqa: BLE001 - see above; fatal errors propagate
            if is_fatal(e):
                raise
            log.warning("queueing a step ahead failed (%s: %s); the requests step again without it",
                        type(e).__name__, e)
            self.run = self.forward = None
            for r in self.scheduler.running:
                if id(r) in held and len(r.slots) > held[id(r)]:
                    self.scheduler.rewind(r, held[id(r)])

    def _try_queue(self, run: StepRun, enabled: bool) -> None:
        live = [i for i, r in enumerate(run.samplers) if r.status is Status.RUNNING]
        reqs = [run.samplers[i] for i in live]
        others = self.scheduler.jumped_besides(reqs)  # requests whose extend joins the step
        if others is None:
            return
        jumped = [self.requests[r.rid] for r in others]
        if not self._can_look_ahead(run, reqs + jumped, enabled):
            return
        extends = self.scheduler.extend_ahead(reqs, jumped)
        if extends is None:
            return
        seqs = [SeqStep(row=r.row, cached_len=len(r.slots) - 1, token_ids=[0], slots=[r.slots[-1]], logit_start=0)
                for r in reqs]
        ids = run.tokens if len(live) == len(run.samplers) else run.tokens[self.runner.to_device(live)]
        if extends:  # the forced tokens are on the host already
            ids = torch.cat([ids, self.runner.to_device([t for e in extends for t in e.seq.token_ids])])
        self.faults.check("forward", [r.rid for r in reqs + jumped])
        logits = self.runner.forward(seqs + [e.seq for e in extends], ids=ids)
        step = [Scheduled(r, q, q.cached_len, True, False) for r, q in zip(reqs, seqs)] + extends
        self.steps += 1
        self.extends += len(extends)
        if any(r.matcher is not None for r in reqs + jumped):  # masks need the grammars past this run's tokens
            marks = [(len(r.output_ids) + 1, r.forced_tokens) for r in reqs]
            marks += [(len(r.output_ids), r.forced_tokens) for r in jumped]
            self.forward = AheadForward(step, reqs + jumped, logits, marks)
            return
        self.faults.check("sample", [r.rid for r in reqs])
        tokens = sample_tokens(logits, self.sampling.batch(reqs, ahead=True))
        self.run = StepRun(step, reqs, tokens, self.runner.fetch_ids(tokens), queued_ahead=True)

    def sample(self) -> None:
        """Phase 4 of the overlap loop: the grammars have taken the previous run's tokens; fill
        the queued ``forward``'s masks while its forward pass runs, then sample it into ``run``."""
        assert self.forward is not None
        self.run, self.forward = self._sample(self.forward), None

    def _sample(self, ahead: AheadForward) -> StepRun | None:
        """Rows whose request ended or jumped forward meanwhile are dropped (the scheduler gives
        them a fresh step)."""
        keep = [i for i, (r, mark) in enumerate(zip(ahead.reqs, ahead.marks))
                if r.status is Status.RUNNING and (len(r.output_ids), r.forced_tokens) == mark
                and len(r.slots) == r.fill_len]
        if not keep:
            return None
        reqs = [ahead.reqs[i] for i in keep]
        with torch.inference_mode():  # the forward's logits are inference tensors; masks write them in place
            logits = ahead.logits if len(keep) == len(ahead.reqs) else ahead.logits[self.runner.to_device(keep)]
        ended: list[RequestOutput] = []
        sampled, _, tokens = self.sampling.sample(logits, reqs, ended)
        mine = {id(r) for r in sampled}
        step = [ahead.step[i] for i in keep if id(ahead.reqs[i]) in mine]
        return StepRun(step, sampled, tokens, self.runner.fetch_ids(tokens), ended=tuple(ended), queued_ahead=True)

    def _can_look_ahead(self, run: StepRun, reqs: list[EngineRequest], enabled: bool) -> bool:
        """Whether the next step of these requests can be queued before the run's tokens reach
        the host: all running requests are in it (a decode, or the extend of a jump forward),
        nothing waits to be admitted, and each next token needs nothing the host has not sent yet
        (no penalties over the output, logprobs or min_new_tokens block; a grammar's mask is
        filled after the host has the tokens, while the queued forward runs) and cannot be the
        request's last by length. The run's own rows are decodes, or extends of requests with
        output (a jump's forced tokens: the row after them is a decode again)."""
        sched = self.scheduler
        if (not enabled or not reqs or sched.waiting or self.grammar.compiling
                or len(reqs) != len(sched.running) or len(run.step) != len(run.samplers)):
            return False
        if any((s.prefill or len(s.seq.token_ids) != 1) and not s.req.output_ids
               for s in run.step if s.req.status is Status.RUNNING):
            return False
        for req in reqs:
            p = req.params
            if (req.rewrite_row or req.return_logprob or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                    or p.presence_penalty != 0.0 or len(req.output_ids) + 1 < p.min_new_tokens
                    or req.remaining_new_tokens() < 2 or req.fill_len + 2 > self.context_length):
                return False
        return True
