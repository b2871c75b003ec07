"""EngineCore: one engine's step loop, single-threaded.

Every step is built by the scheduler and goes through the same phases::

    schedule -> forward -> draw (masks, sampling) -> process (text, stops, finishing)

The overlap schedule (on CUDA by default) only orders them differently: a step is scheduled and
its forward queued while the step before is still in flight, whose tokens the host processes
meanwhile; decodes past a token the host has not read yet read it on the device (the model
runner's token table). The in-process Engine drives `step()` from its callers; the server from
its own process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.constrained.jump_forward import JumpPolicy
from radixlm.runtime.constrained.registry import check_grammar_backend
from radixlm.runtime.constrained.service import GrammarService
from radixlm.runtime.constrained.stage import GrammarStage
from radixlm.runtime.cuda_graph import GRAPH_EXTEND_TOKENS
from radixlm.runtime.distributed import init_tp_group, tp_device, worker
from radixlm.runtime.distributed.launch import Leader, WorkerSet, cpu_threads
from radixlm.runtime.distributed.step import StepChannel
from radixlm.runtime.engine_build import build_runner, check_parallel, context_length, model_source, number_formats
from radixlm.runtime.engine_report import engine_info, integrity_report
from radixlm.runtime.faults import FaultBoundary
from radixlm.runtime.intake import Submission, check_token_ids
from radixlm.runtime.model.source import ModelSource
from radixlm.runtime.output_processor import Decision, Finish, OutputProcessor, RequestOutput, Rewind
from radixlm.runtime.phase_clock import STEP_PHASES, PhaseClock
from radixlm.runtime.radix_cache import CACHES, IntegrityError, SlotAllocator
from radixlm.runtime.request import EngineRequest
from radixlm.runtime.sampling.stage import SamplingStage, add_input_logprobs, request_generator
from radixlm.runtime.scheduler import GraphRoom, Scheduled, Scheduler, Status
from radixlm.runtime.sessions import SessionManager, prepended_bos
from radixlm.runtime.speculation.drafts import DraftProposer
from radixlm.runtime.speculation.verify import accept_drafts, propose_drafts
from radixlm.runtime.step_run import StepRun
from radixlm.runtime.tokenizer_loader import load_tokenizer
from radixlm.runtime.warm_up import measure_jump_cost, run_warm_up

__all__ = ["EngineCore", "RequestOutput"]


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        self.config = config
        mc, cc, sc = config.model, config.cache, config.scheduler
        self.source = source or model_source(config)
        arch = self.source.arch
        if cc.cache not in CACHES:
            raise ValueError(f"unknown cache {cc.cache!r}; choose one of {sorted(CACHES)}")
        check_grammar_backend(config.constraint.grammar_backend)  # fail at start, not at the first constrained request
        self.context_length = context_length(config, arch.max_position_embeddings)
        self.tokenizer = load_tokenizer(self.source.tokenizer_dir)
        tp_size = config.parallel.tp_size
        self.workers: WorkerSet | None = None
        self._threads_before: int | None = None  # torch's threads before this engine took its share
        if tp_size > 1:
            check_parallel(config, arch)  # bad sizes fail here, before any process starts
            self.workers = WorkerSet(worker.__name__, config.flat(), tp_size)
            if mc.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
                # rank 0 takes its share like the workers; the process gets its threads back at close()
                self._threads_before = torch.get_num_threads()
                torch.set_num_threads(cpu_threads(tp_size))
        self.device = tp_device(mc.device, 0)
        try:  # (what can fail once the workers run; they are stopped then)
            group = None if self.workers is None else init_tp_group(
                0, tp_size, self.workers.init_file, self.device, config.parallel.dist_timeout)
            self.formats = number_formats(config, self.source, self.device)
            self.model, self.runner = build_runner(config, self.source, self.device, group, self.formats)
        except BaseException:
            if self.workers is not None:
                self.workers.stop(grace_s=0)
            if self._threads_before is not None:
                torch.set_num_threads(self._threads_before)
            raise
        self.leader = None if group is None or self.workers is None else Leader(StepChannel(group), self.workers)
        self.runner.leader = self.leader
        num_slots = self.runner.pool.num_slots
        self.allocator = SlotAllocator(num_slots)
        self.cache = CACHES[cc.cache](self.allocator, cc.page_size)
        pin_cap = cc.max_pinned_tokens if cc.max_pinned_tokens is not None else num_slots // 2
        self.sessions = SessionManager(self.cache, pin_cap, cc.session_ttl, strip_bos=prepended_bos(self.tokenizer))
        graphs = self.runner.graphs
        room = None if graphs is None else GraphRoom(graphs.max_bs, GRAPH_EXTEND_TOKENS)
        self.scheduler = Scheduler(sc, self.cache, self.allocator, self.context_length, self.sessions.unpin_lru, room)
        eos = self.tokenizer.eos_token_id
        self.eos_ids = frozenset(arch.eos_token_ids) | ({eos} if eos is not None else set())
        self.grammar = GrammarStage(self._grammar_service, arch.vocab_size, config.constraint)
        self.faults = FaultBoundary()  # docs/reliability.md, "Fault boundaries"
        self.overlap = sc.overlap_schedule if sc.overlap_schedule is not None else self.device.type == "cuda"
        self.output = OutputProcessor(self.tokenizer, self.scheduler, self.grammar, self.context_length,
                                      self._finish_turn, JumpPolicy(max_running=self._jump_cap()), self._apply,
                                      self.faults)
        self.sampling = SamplingStage(self.grammar, self.faults, arch.vocab_size, self.device, self._fail,
                                      self.output.fail)
        self.requests: dict[str, EngineRequest] = {}
        self.drafts = DraftProposer.build(config.speculative, self.cache, self.context_length)
        self.in_flight: StepRun | None = None  # the step whose tokens the host reads next (overlap schedule)
        self.ahead_steps = 0  # steps run while the one before was in flight (overlap schedule)
        self.ahead_extends = 0  # their jump-forward extends (and resumed contexts)
        self.steps = 0
        self.prompt_steps = 0  # steps that fed some prompt (or a jump's forced tokens), not only decodes
        self.rows_fed = 0  # the steps' sequences in all: over steps, the mean batch
        self.tokens_fed = 0  # the steps' tokens in all (prompt pieces, forced tokens, decodes)
        self.clock = PhaseClock(STEP_PHASES)  # (the engine process adds its intake and send)
        self.step_seconds = self.clock.seconds

    def check_ranks(self) -> None:
        """Raise RankFailure if a tensor-parallel worker rank has exited (cheap: a non-blocking wait)."""
        if self.leader is not None:
            self.leader.workers.check()

    def close(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel worker ranks (nothing to do without tensor parallelism) and
        give the process back the torch threads rank 0 gave up for them; not `graceful`: kill the
        workers at once (the ranks may be out of step)."""
        if self.leader is not None:
            if graceful:
                self.leader.stop()
            else:
                self.leader.workers.stop(grace_s=0)
            self.leader = self.runner.leader = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _grammar_service(self) -> GrammarService:
        return GrammarService(self.tokenizer, self.source.arch.vocab_size, sorted(self.eos_ids), self.config.constraint)

    def info(self) -> dict[str, Any]:
        """What the server reports about the model (radixlm.runtime.engine_report)."""
        return engine_info(self)

    def warm_up(self) -> None:
        """Start-up, the engine's first phase (radixlm.runtime.warm_up): run every kind of step its
        requests will, so none of them pays for a kernel's first compile; on CUDA measure what a
        jump forward costs; then empty the cache and zero the counters."""
        run_warm_up(self)
        if self.device.type == "cuda":
            self.output.jump_policy = measure_jump_cost(self, self._jump_cap())
        self.cache.reset()
        self.steps = self.prompt_steps = self.rows_fed = self.tokens_fed = self.runner.graph_steps = 0
        self.clock.reset()
        self.output.totals.prompt_tokens = self.output.totals.cached_tokens = 0

    def _jump_cap(self) -> int | None:
        """--jump-forward-max-running, or its default: on CUDA with the overlap schedule, jumps
        only while one request runs: with batches the host, not the GPU, sets the pace of a
        constrained step, and planning jumps costs more host time than the passes they spare
        (docs/structured-output.md, docs/machines.md)."""
        cap = self.config.constraint.jump_forward_max_running
        return 1 if cap is None and self.device.type == "cuda" and self.overlap else cap

    # -- requests ------------------------------------------------------------------------
    def add_request(self, sub: Submission) -> None:
        """Queue a request; with ``sub.session``, ``sub.prompt_ids`` are the new turn's tokens,
        appended to the history of the turn it continues (radixlm.runtime.sessions)."""
        rid, prompt_ids, params = sub.rid, list(sub.prompt_ids), sub.params
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        plan = None
        if sub.session is not None:
            plan = self.sessions.plan_turn(sub.session, rid, prompt_ids, params.max_new_tokens)
            prompt_ids, params = plan.prompt_ids, plan.cap(params)
        check_token_ids(rid, prompt_ids, params, self.source.arch.vocab_size)
        if sub.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {sub.top_logprobs_num}")
        req = EngineRequest.start(sub, prompt_ids, params, self.tokenizer, self.eos_ids, request_generator(params),
                                  params.jump_forward and self.config.constraint.jump_forward)
        try:
            self.faults.check("admit", [rid])
            self.scheduler.arrive(req)  # its place in line, kept while its grammar compiles
            if params.constraint is not None:
                self.grammar.submit(req)  # joins the scheduler once compiled
            else:
                self.scheduler.add(req)
            self.requests[rid] = req
            if plan is not None:
                self.sessions.start_turn(plan, sub.session.replace if sub.session else False)
        except BaseException:  # nothing of a refused request stays behind
            self.grammar.cancel(rid)
            self.scheduler.finish(req, "abort", keep_in_cache=False)
            self.requests.pop(rid, None)
            raise

    def abort(self, rid: str) -> RequestOutput | None:
        """End a request wherever it is; its last output, or None if it is unknown."""
        req = self.requests.get(rid)
        if req is None:
            return None
        if self.grammar.cancel(rid):
            req.status, req.finish_reason = Status.FINISHED, "abort"
        else:
            self.scheduler.finish(req, "abort")
        return self._end(self.output.finish(req))

    def end_program(self, program_id: str) -> None:
        """A program's last request is done: the scheduler forgets it and releases its fork prefixes."""
        self.scheduler.end_program(program_id)

    @property
    def has_work(self) -> bool:
        return (self.scheduler.has_work or self.grammar.compiling
                or (self.in_flight is not None and self.in_flight.live))

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, forward, draw, process. With the overlap schedule the step before
        is processed while this one's forward runs on the device (first, when a request's next
        draw or draft needs its newest token on the host), and this one next time (radixlm.runtime.step_run)."""
        outputs = self._admit_compiled()
        before, self.in_flight = self.in_flight, None
        if before is not None and (self.drafts is not None or self.scheduler.needs_host()):
            outputs, before = outputs + self._process(before), None
        run = self._run(overlapped=before is not None)
        if before is not None:
            outputs += self._process(before)
        if run is not None:
            self._draw(run)  # (drawn already unless a mask waited for the step before)
            outputs += run.take_ended()
            if self.overlap:
                self.in_flight = run
            else:
                outputs += self._process(run)
        return self._end_step(outputs)

    def _end_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Finished requests leave, those the scheduler ended on its own too (max_new_tokens=0, out
        of memory); after a contained fault, what every request shares must be intact."""
        outputs = [self._end(o) if o.finished else o for o in outputs]
        done = [r for r in self.requests.values() if r.status is Status.FINISHED]
        outputs += [self._end(self.output.finish(r)) for r in done]
        if self.faults.unchecked:
            self.faults.unchecked = False
            self._check_integrity("after a request's fault: ")
        return outputs

    def _fail(self, req: EngineRequest, phase: str, e: BaseException) -> RequestOutput:
        """End req after a fault raised on its behalf (500); fatal errors propagate."""
        return self.output.fail(req, self.faults.contain(req.rid, phase, e), internal=True)

    def _apply(self, req: EngineRequest, decision: Decision) -> None:
        """Carry out what output processing decided for a request's place in the scheduler."""
        if isinstance(decision, Finish):
            self.scheduler.finish(req, decision.reason, keep_in_cache=decision.keep_in_cache)
        elif isinstance(decision, Rewind):
            self.scheduler.rewind(req, decision.length)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready join the scheduler; a failed compile fails its request.
        Idle sessions expire first."""
        self.sessions.expire()
        if not self.grammar.compiling:
            return []
        ready, failed = self.grammar.ready(idle=not self.scheduler.has_work)
        outputs = []
        for req in ready:
            try:
                out = self.output.start(req)  # the grammar's forced opening joins the prefill
            except Exception as e:  # noqa: BLE001 - ends this request only
                outputs.append(self._end(self._fail(req, "jump", e)))
                continue
            if out is not None and out.finished:
                outputs.append(self._end(out))
                continue
            if out is not None:
                outputs.append(out)
            self.scheduler.add(req)
        for req, error in failed:
            outputs.append(self._end(self.output.end_unscheduled(req, "abort", error=error)))
        return outputs

    def _run(self, overlapped: bool) -> StepRun | None:
        """Schedule the step; its forward pass, its prompts' logprobs, and the draw of its rows
        that sample, unless a constrained row's mask waits for the host to read the token before
        it. ``overlapped``: the step before is still in flight."""
        with self.clock("schedule"):
            if self.drafts is not None:  # (drafts need the newest tokens on the host: processed first above)
                propose_drafts([self.requests[r.rid] for r in self.scheduler.running], self.drafts)
            scheduled = self.scheduler.schedule()  # unpins sessions, oldest first, when work would not fit
        if not scheduled:
            return None
        run = StepRun(scheduled)
        with self.clock("forward"):
            self._count_step(scheduled, overlapped)
            scheduled, logits = self._forward(scheduled, run.ended)
        if logits is None:  # every sequence of the step failed
            run.drawn([], torch.zeros(0, dtype=torch.long, device=self.device), lambda: [], None)
            return run
        with self.clock("sample"):
            rows: list[int] = []
            checks: list[int] = []
            off = 0
            for s in scheduled:
                req = self.requests[s.req.rid]
                k = s.seq.num_logits
                if not s.samples and not s.prefill:  # a draft's later row (its first holds them all)
                    off += k
                    continue
                req.forward_passes += 1
                if req.return_logprob and req.wants_input_logprobs:
                    try:
                        self.faults.check("logprobs", [req.rid])
                        add_input_logprobs(req, s, logits[off : off + k - (1 if s.samples else 0)])
                    except Exception as e:  # noqa: BLE001 - ends this request only
                        run.ended.append(self._fail(req, "logprobs", e))
                if s.draft and req.status is Status.RUNNING:
                    checks.extend(range(off, off + 1 + len(s.draft)))
                    run.checks.append((req, s.draft))
                elif s.samples and req.status is Status.RUNNING:
                    rows.append(off + k - 1)
                    run.samplers.append(req)
                off += k
            if checks:  # a draft is checked greedily: the model's own token at each of its rows
                rows_of_checks = logits[self.runner.to_device(checks)]
                run.check_fetch = self.runner.fetch_ids(rows_of_checks.argmax(-1))
                run.check_logits = rows_of_checks if any(r.return_logprob for r, _ in run.checks) else None
            if run.samplers and (len(rows) < logits.shape[0] or logits.device.type != "cpu"):
                # a non-blocking index: masks fill while the forward runs (on CUDA a copy also when
                # every row samples: the logits may live in a CUDA graph's output, which the next step overwrites)
                logits = logits[self.runner.to_device(rows)]
            run.logits = logits
            run.marks = [r.forced_tokens for r in run.samplers]
            if not any(r.matcher is not None and r.unseen for r in run.samplers):
                self._draw(run)
        return run

    def _draw(self, run: StepRun) -> None:
        """Mask and sample the run's rows; each drawn token stays on the device (the runner's
        token table), its copy to the host started. A row whose request ended, was retracted or
        jumped forward since the step was built draws nothing (the scheduler steps it afresh)."""
        if run.tokens is not None:
            return
        with self.clock("sample"):
            keep = [i for i, (r, mark) in enumerate(zip(run.samplers, run.marks))
                    if r.status is Status.RUNNING and r.forced_tokens == mark]
            reqs = [run.samplers[i] for i in keep]
            if not reqs or run.logits is None:
                run.drawn([], torch.zeros(0, dtype=torch.long, device=self.device), lambda: [], None)
                return
            logits = run.logits
            if len(keep) < len(run.samplers):
                with torch.inference_mode():  # (the forward's logits are inference tensors)
                    logits = logits[self.runner.to_device(keep)]
            samplers, logits, tokens = self.sampling.sample(logits, reqs, run.ended)
            self.runner.keep_tokens([r.row for r in samplers], tokens)
            for r in samplers:
                r.unseen += 1
            run.drawn(samplers, tokens, self.runner.fetch_ids(tokens),
                      logits if any(r.return_logprob for r in samplers) else None)

    def _forward(self, scheduled: list[Scheduled],
                 ended: list[RequestOutput]) -> tuple[list[Scheduled], torch.Tensor | None]:
        """The step's forward pass. If it raises, each sequence runs alone and the ones that
        raise alone fail (their KV of this step is dropped); the rest keep their logits."""
        def run(part: Sequence[Scheduled]) -> torch.Tensor:
            self.faults.check("forward", [s.req.rid for s in part])
            logits = self.runner.forward([s.seq for s in part])
            # (alone, each part's logits are copied: a CUDA graph's output is overwritten by the next)
            return logits if len(part) == len(scheduled) else logits.clone()

        def fault(s: Scheduled, e: BaseException) -> None:
            ended.append(self._fail(self.requests[s.req.rid], "forward", e))

        kept, parts = self.faults.isolate(scheduled, run, fault)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else None
        return [scheduled[i] for i in kept], logits

    def _count_step(self, step: Sequence[Scheduled], overlapped: bool) -> None:
        self.steps += 1
        self.rows_fed += len(step)
        self.tokens_fed += sum(len(s.seq.token_ids) for s in step)
        self.prompt_steps += any(s.prefill for s in step)
        if overlapped:
            self.ahead_steps += 1
            self.ahead_extends += sum(s.prefill and s.req.generated > 0 for s in step)

    def _process(self, run: StepRun) -> list[RequestOutput]:
        """The run's tokens on the host become outputs; finished requests leave."""
        with self.clock("wait"):
            ids = run.fetch()
        with self.clock("process"):
            return self._outputs(run, ids)

    def _outputs(self, run: StepRun, ids: list[int]) -> list[RequestOutput]:
        for r in run.samplers:
            r.unseen -= 1
        # (a request retracted while its token was in flight is waiting: its token still counts)
        live = [i for i, r in enumerate(run.samplers) if r.status is not Status.FINISHED]
        reqs, tokens = [run.samplers[i] for i in live], [ids[i] for i in live]
        ended: list[RequestOutput] = []
        lps = tops = None
        if run.logits is not None and run.tokens is not None and live:
            at = None if len(live) == len(ids) else self.runner.to_device(live)
            logits, drawn = (run.logits, run.tokens) if at is None else (run.logits[at], run.tokens[at])
            lps, tops = self.sampling.output_logprobs(logits, reqs, tokens, drawn, ended)
        keep = [j for j, r in enumerate(reqs) if r.status is not Status.FINISHED]
        outputs = ended + self.output.append(
            [reqs[j] for j in keep], [tokens[j] for j in keep],
            None if lps is None else [lps[j] for j in keep], None if tops is None else [tops[j] for j in keep])
        if run.checks:
            outputs += accept_drafts(run.checks, run.check_fetch(), self.scheduler, self.output, run.check_logits)
        self.scheduler.end_step(run.step)
        return outputs

    def _end(self, out: RequestOutput) -> RequestOutput:
        self.requests.pop(out.rid, None)
        return out

    def _finish_turn(self, req: EngineRequest) -> dict[str, Any]:
        return self.sessions.finish_turn(req.rid, req.output_ids, req.finish_reason != "abort", req.cached_tokens)

    # -- introspection -------------------------------------------------------------------
    def integrity_report(self) -> dict[str, Any]:
        """The KV bookkeeping checked at any moment (radixlm.runtime.engine_report): the figures
        and every broken invariant. O(cached tokens): for tests and soak runs, not per step."""
        return integrity_report(self)

    def check_idle_integrity(self) -> None:
        """With no request in flight: nothing locked, every slot free or held by the cache."""
        if self.has_work or self.requests:
            raise IntegrityError(f"not idle: {len(self.requests)} requests in flight")
        self._check_integrity("")

    def _check_integrity(self, context: str) -> None:
        report = self.integrity_report()
        if not report["ok"]:
            raise IntegrityError(context + "; ".join(report["errors"]))

    def flush_cache(self) -> None:
        """Drop every cached prefix; sessions stay open, unpinned (their next turns recompute)."""
        self.sessions.unpin_all()
        self.cache.reset()

