"""EngineCore: one engine's step loop, single-threaded.

A step has three phases::

    run = queued-ahead step  or  schedule() -> run(): forward, grammar masks, sampling
    queue the next decode step's forward on the device (the overlap schedule), if it may
    process(run): its tokens to the host -> output processing (text, stops, finishing)
    a queued step with constrained rows: fill their masks (the forward runs meanwhile), sample

The plain loop and the overlap loop are the same phases; the overlap loop only runs the second
and the fourth. The in-process Engine drives `step()` from its callers; the server from its own process.
"""

from __future__ import annotations

import functools
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.config import EngineConfig
from radixlm.runtime.constrained.jump_forward import JumpPolicy
from radixlm.runtime.constrained.registry import check_grammar_backend
from radixlm.runtime.constrained.service import GrammarService
from radixlm.runtime.cuda_graph import GRAPH_EXTEND_ROWS, GRAPH_EXTEND_TOKENS, graph_buckets
from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.distributed import TPGroup, check_devices, check_tp_size, init_tp_group, tp_device
from radixlm.runtime.distributed.launch import Leader, WorkerSet, cpu_threads, exit_with_parent
from radixlm.runtime.distributed.step import StepChannel
from radixlm.runtime.faults import FaultBoundary, is_fatal
from radixlm.runtime.grammar_stage import GrammarStage
from radixlm.runtime.intake import Submission
from radixlm.runtime.kernels.kv_pool import activation_reserve, pool_slots
from radixlm.runtime.kernels.packed import amx_packing
from radixlm.runtime.kernels.quant import GGUF_BLOCK_METHODS
from radixlm.runtime.kernels.sampling import SamplingBatch, make_generator, sample_tokens, token_logprobs, with_logprobs
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.formats import (
    DtypeChoice,
    QuantChoice,
    choose_attention,
    choose_dtype,
    choose_quantization,
    cpu_flags,
    native_tiles_run,
)
from radixlm.runtime.model.gguf_quant import GGUFLinears, four_bit_share
from radixlm.runtime.model.llama import LlamaModel
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model.source import ModelSource, resolve_model
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.output_processor import OutputProcessor, RequestOutput
from radixlm.runtime.radix_cache import CACHES, IntegrityError, SlotAllocator
from radixlm.runtime.request import EngineRequest
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import GraphRoom, Scheduled, Scheduler, Status
from radixlm.runtime.sessions import SessionManager, prepended_bos
from radixlm.runtime.stop import StopMatcher
from radixlm.runtime.tokenizer_loader import load_tokenizer

log = logging.getLogger("radixlm.engine")

__all__ = ["EngineCore", "RequestOutput"]

DEFAULT_CONTEXT_CAP = 8192
# Where the step loop's time goes (EngineCore.step_seconds, /get_server_info): picking the work,
# the forward pass (its launch on CUDA), masks and sampling, queueing the next step ahead (the
# overlap schedule), waiting for the tokens on the host, making outputs; and, in the engine
# process, taking in messages and sending outputs.
STEP_PHASES = ("schedule", "forward", "sample", "ahead", "wait", "process", "intake", "send")
# Prompt lengths of the start-up requests on CUDA, one wave (one batch) per list: each wave's
# prefill and decode steps hit other kernel shapes (1 row: GEMV; 2-32 rows: the few-row kernel,
# specialized on rows % 16; more: cuBLAS; the extend attention at several lengths).
_WARM_UP_GREEDY = SamplingParams(max_new_tokens=3, temperature=0)
_WARM_UP_SAMPLED = SamplingParams(max_new_tokens=3, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01)
# The jump-cost probe: requests of a jump's size (a few tokens extended, then decoded), timed alone.
_JUMP_PROBES, _JUMP_PROBE_TOKENS = 3, 8
_JUMP_PROBE_PARAMS = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
_WARM_UP_WAVES = [[1], [5], [16], [17], [40], [512], [3, 9], [4] * 16, [4] * 17, [6] * 40]


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


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        self.config = config
        mc, cc, sc = config.model, config.cache, config.scheduler
        self.source = source or resolve_model(mc.model, Path(mc.cache_dir), mc.tokenizer_path)
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
            self.workers = WorkerSet(__name__, config.flat(), tp_size)
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
                                      self._finish_turn, JumpPolicy(max_running=self._jump_cap()), self.faults)
        self.requests: dict[str, EngineRequest] = {}
        self._ahead: StepRun | None = None
        self._ahead_forward: AheadForward | None = None
        self.ahead_steps = 0  # decode steps queued ahead of the host (the overlap schedule)
        self.ahead_extends = 0  # jump-forward extends among them
        self.steps = 0
        self.prompt_steps = 0  # steps that fed some prompt (or a jump's forced tokens), not only decodes
        self.rows_fed = 0  # the steps' sequences in all: over steps, the mean batch
        self.tokens_fed = 0  # the steps' tokens in all (prompt pieces, forced tokens, decodes)
        # seconds by phase of the step loop (the engine process adds its intake and send)
        self.step_seconds = dict.fromkeys(STEP_PHASES, 0.0)

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
        """What the server reports about the model (get_model_info / get_server_info)."""
        return {
            "model_path": str(self.source.weights_dir or self.source.name),
            "model_name": self.source.name,
            "tokenizer_path": str(self.source.tokenizer_dir),
            "context_length": self.context_length,
            "vocab_size": self.source.arch.vocab_size,
            "dtype": self.formats.dtype.dtype,
            "dtype_reason": self.formats.dtype.reason,
            "quantization": self.formats.quant.method,
            "quantization_reason": self.formats.quant.reason,
            "quant_dense_above": self.formats.quant.dense_above,
            "attention_dtype": self.formats.attention.dtype,
            "attention_dtype_reason": self.formats.attention.reason,
            "packed_weights": self.model.packed_weights(),
            "native_products": self.model.native_products(),
            "device": str(self.device),
            "tp_size": self.config.parallel.tp_size,
            "tp_worker_pids": [] if self.workers is None else self.workers.pids,
            "max_total_tokens": self.allocator.num_slots,
            "max_running_requests": self.config.scheduler.max_running_requests,
            "eos_token_ids": sorted(self.eos_ids),
            "chat_template": getattr(self.tokenizer, "chat_template", None) is not None,
        }

    def warm_up(self) -> None:
        """Start-up, the engine's first phase: run every kind of step its requests will, so none
        of them pays for a kernel's first compile, then empty the cache. On CUDA (decode graphs
        were captured at load): prefills of 1, a few (the few-row kernel), 16 and many tokens,
        alone and batched; eager and graph decode batches; greedy and sampled rows. On the CPU
        there is nothing to compile: one short request."""
        bos = self.source.arch.bos_token_id or 1
        waves = _WARM_UP_WAVES if self.device.type == "cuda" else [[4]]
        cap = max(8, min(self.context_length // 2, self.config.scheduler.chunked_prefill_size or 512))
        for w, lengths in enumerate(waves):
            for i, n in enumerate(lengths):
                params = _WARM_UP_SAMPLED if i % 2 else _WARM_UP_GREEDY
                self.add_request(Submission(f"warm-up-{w}-{i}", [bos] * min(n, cap), params))
            while self.has_work:
                self.step()
        if self.device.type == "cuda":
            self.output.jump_policy = self._measure_jump_cost()
        self.cache.reset()
        self.steps = self.prompt_steps = self.rows_fed = self.tokens_fed = self.runner.graph_steps = 0
        self.step_seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self.output.totals.prompt_tokens = self.output.totals.cached_tokens = 0

    def _measure_jump_cost(self) -> JumpPolicy:
        """What a jump costs here (JumpPolicy): one request alone, timed step by step with its
        host work, whose first step extends a few tokens (as a jump does) and whose later steps
        decode one; the cheapest of a few tries."""
        vocab = self.source.arch.vocab_size
        extend, decode = [], []
        for k in range(_JUMP_PROBES):
            prompt = [(1000 + 97 * (k * _JUMP_PROBE_TOKENS + j)) % vocab for j in range(_JUMP_PROBE_TOKENS)]
            self.add_request(Submission(f"warm-up-jump-{k}", prompt, _JUMP_PROBE_PARAMS))
            times = []
            while self.has_work:
                t0 = time.perf_counter()
                self.step()
                torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t0)
            extend.append(times[0])
            decode.extend(times[2:])  # (the second step queues the third's forward ahead: two passes)
        if not decode:  # (a context too short for the probe's decode steps: keep the cautious default)
            return self.output.jump_policy
        decode_s = statistics.median(decode)
        policy = JumpPolicy(decode_s, max(0.0, min(extend) - decode_s), self._jump_cap())
        log.info("jump-forward: an extend step costs %.2f ms more than a %.2f ms decode step: a jump must add "
                 ">= %d forced tokens per running request", 1e3 * policy.penalty_s, 1e3 * decode_s,
                 policy.min_gain(1) or 0)
        return policy

    def _jump_cap(self) -> int | None:
        """--jump-forward-max-running, or its default: on CUDA with the overlap schedule, jumps
        only while one request runs. A jump's extend step is queued ahead with the batch's next
        decodes, but at bs16 and bs64 on an H100 the host, not the GPU, sets the pace of a
        constrained step there, and planning jumps (the forced text after every token) costs more
        host time than the passes they spare (docs/structured-output.md)."""
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
        vocab = self.source.arch.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"request {rid}: token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:  # (blocked as an end token before min_new_tokens, it would fail a whole step)
            raise ValueError(f"stop_token_ids holds token id {bad}, outside the vocabulary [0, {vocab})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias holds token id {bad}, outside the vocabulary [0, {vocab})")
        if sub.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {sub.top_logprobs_num}")
        req = EngineRequest(
            rid=rid, prompt_ids=prompt_ids, params=params,
            logprob_start_len=sub.logprob_start_len if sub.return_logprob else -1,
            detok=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                         params.spaces_between_special_tokens, prompt_ids[-4:]),
            stop=StopMatcher(params.stop, keep_stop=params.no_stop_trim, regexes=params.stop_regex),
            eos_ids=frozenset() if params.ignore_eos else self.eos_ids,
            generator=None if params.is_greedy else make_generator(_seed(params)),
            return_logprob=sub.return_logprob, top_logprobs_num=sub.top_logprobs_num,
            jump_forward=params.jump_forward and self.config.constraint.jump_forward,
            program=sub.program,
        )
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
        return self.scheduler.has_work or self.grammar.compiling or self._ahead is not None

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward pass (or take the one queued ahead); what each
        request gained."""
        outputs = self._admit_compiled() if self.grammar.compiling else []
        self.sessions.expire()
        run, self._ahead = self._ahead or self._schedule_and_run(), None
        if run is not None:
            t0 = time.perf_counter()
            self._queue_ahead(run)
            self.step_seconds["ahead"] += time.perf_counter() - t0
            outputs += self._process(run)
        if self._ahead_forward is not None:
            t0 = time.perf_counter()
            self._ahead, self._ahead_forward = self._sample_ahead(self._ahead_forward), None
            self.step_seconds["sample"] += time.perf_counter() - t0
        outputs += self._ended_elsewhere()
        if self.faults.unchecked:  # a fault was contained: what every request shares must be intact
            self.faults.unchecked = False
            report = self.integrity_report()
            if not report["ok"]:
                raise IntegrityError("after a request's fault: " + "; ".join(report["errors"]))
        return outputs

    def _fail(self, req: EngineRequest, phase: str, e: BaseException) -> RequestOutput:
        """End req after a fault raised on its behalf (500); fatal errors propagate."""
        return self.output.fail(req, self.faults.contain(req.rid, phase, e), internal=True)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready join the scheduler; a failed compile fails its request."""
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

    def _schedule_and_run(self) -> StepRun | None:
        """Phases 1 and 2: pick the step's work, run the forward pass, mask and sample."""
        clock = self.step_seconds
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()  # unpins sessions, oldest first, when work would not fit
        t1 = time.perf_counter()
        clock["schedule"] += t1 - t0
        if not scheduled:
            return None
        self._count_step(scheduled)
        ended: list[RequestOutput] = []
        scheduled, logits = self._forward(scheduled, ended)
        t0 = time.perf_counter()
        clock["forward"] += t0 - t1
        if logits is None:  # every sequence of the step failed
            return StepRun([], [], torch.zeros(0, dtype=torch.long, device=self.device), lambda: [], ended=tuple(ended))
        rows: list[int] = []
        samplers: list[EngineRequest] = []
        off = 0
        for s in scheduled:
            req = self.requests[s.req.rid]
            req.forward_passes += 1
            k = s.seq.num_logits
            if req.return_logprob and req.wants_input_logprobs:
                try:
                    self.faults.check("logprobs", [req.rid])
                    self._input_logprobs(req, s, logits[off : off + k - (1 if s.samples else 0)])
                except Exception as e:  # noqa: BLE001 - ends this request only
                    ended.append(self._fail(req, "logprobs", e))
            if s.samples and req.status is Status.RUNNING:
                rows.append(off + k - 1)
                samplers.append(req)
            off += k
        if not samplers:
            return StepRun(scheduled, [], torch.zeros(0, dtype=torch.long, device=self.device), lambda: [], ended=tuple(ended))
        if len(rows) < logits.shape[0] or logits.device.type != "cpu":
            # a non-blocking index: masks fill while the forward runs (on CUDA a copy also when
            # every row samples: the logits may live in a CUDA graph's output, which the next step overwrites)
            logits = logits[self.runner.to_device(rows)]
        samplers, logits, tokens = self._sample(logits, samplers, ended)
        want_lp = any(r.return_logprob for r in samplers)
        clock["sample"] += time.perf_counter() - t0
        return StepRun(scheduled, samplers, tokens, self.runner.fetch_ids(tokens), logits if want_lp else None,
                       tuple(ended))

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

    def _sample(self, logits: torch.Tensor, reqs: list[EngineRequest],
                ended: list[RequestOutput]) -> tuple[list[EngineRequest], torch.Tensor, torch.Tensor]:
        """Mask and sample each row of ``logits`` (one a request). If that raises, each row goes
        alone and the requests whose row raises alone fail. Returns the requests that drew a
        token, their logits rows (masked) and their tokens."""
        def run(idx: Sequence[int]) -> tuple[list[tuple[EngineRequest, str]], torch.Tensor]:
            if len(idx) == len(reqs):
                return self._mask_and_sample(logits, reqs)
            rows = logits[list(idx)]
            out = self._mask_and_sample(rows, [reqs[i] for i in idx])
            logits[list(idx)] = rows  # (masked, for their logprobs)
            return out

        def fault(i: int, e: BaseException) -> None:
            ended.append(self._fail(reqs[i], "sampling", e))

        with torch.inference_mode():  # the forward's logits are inference tensors; masks write them in place
            kept, parts = self.faults.isolate(range(len(reqs)), run, fault)
        failed = {id(req): error for part in parts for req, error in part[0]}
        ended.extend(self.output.fail(req, failed[id(req)]) for req in reqs if id(req) in failed)
        tokens = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts]) if parts else logits[:0, 0].long()
        if len(kept) < len(reqs):
            logits = logits[kept]
        return [reqs[i] for i in kept], logits, tokens

    def _queue_ahead(self, run: StepRun) -> None:
        """The overlap schedule: queue the next decode step of `run`'s requests on the device, on
        the tokens `run` drew there, before the host sees them. If that raises, the step queued
        ahead is dropped (its slots freed) and the requests' next step runs the plain way, whose
        fault boundaries end the request at fault."""
        held = {id(r): len(r.slots) for r in self.scheduler.running}
        try:
            self._try_queue_ahead(run)
        except Exception as e:  # noqa: BLE001 - see above; fatal errors propagate
            if is_fatal(e):
                raise
            log.warning("queueing a step ahead failed (%s: %s); the requests step again without it",
                        type(e).__name__, e)
            self._ahead = self._ahead_forward = None
            for r in self.scheduler.running:
                if id(r) in held and len(r.slots) > held[id(r)]:
                    self.scheduler.rewind(r, held[id(r)])

    def _try_queue_ahead(self, run: StepRun) -> None:
        live = [i for i, r in enumerate(run.samplers) if r.status is Status.RUNNING]
        reqs = [run.samplers[i] for i in live]
        others = self.scheduler.jumped_besides(reqs)  # requests whose extend joins the step
        if others is None:
            return
        jumped = [self.requests[r.rid] for r in others]
        if not self._can_look_ahead(run, reqs + jumped):
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
        self.ahead_steps += 1
        self.ahead_extends += len(extends)
        if any(r.matcher is not None for r in reqs + jumped):  # masks need the grammars past this run's tokens
            marks = [(len(r.output_ids) + 1, r.forced_tokens) for r in reqs]
            marks += [(len(r.output_ids), r.forced_tokens) for r in jumped]
            self._ahead_forward = AheadForward(step, reqs + jumped, logits, marks)
            return
        self.faults.check("sample", [r.rid for r in reqs])
        tokens = sample_tokens(logits, self._sampling_batch(reqs, ahead=True))
        self._ahead = StepRun(step, reqs, tokens, self.runner.fetch_ids(tokens), queued_ahead=True)

    def _sample_ahead(self, ahead: AheadForward) -> StepRun | None:
        """Phase 4 of the overlap loop: the grammars have taken the previous run's tokens; fill
        the queued step's masks while its forward pass runs, then sample. Rows whose request
        ended or jumped forward meanwhile are dropped (the scheduler gives them a fresh step)."""
        keep = [i for i, (r, mark) in enumerate(zip(ahead.reqs, ahead.marks))
                if r.status is Status.RUNNING and (len(r.output_ids), r.forced_tokens) == mark
                and len(r.slots) == r.fill_len]
        if not keep:
            return None
        reqs = [ahead.reqs[i] for i in keep]
        with torch.inference_mode():  # the forward's logits are inference tensors; masks write them in place
            logits = ahead.logits if len(keep) == len(ahead.reqs) else ahead.logits[self.runner.to_device(keep)]
        ended: list[RequestOutput] = []
        sampled, _, tokens = self._sample(logits, reqs, ended)
        mine = {id(r) for r in sampled}
        step = [ahead.step[i] for i in keep if id(ahead.reqs[i]) in mine]
        return StepRun(step, sampled, tokens, self.runner.fetch_ids(tokens), ended=tuple(ended), queued_ahead=True)

    def _mask_and_sample(self, logits: torch.Tensor,
                         reqs: list[EngineRequest]) -> tuple[list[tuple[EngineRequest, str]], torch.Tensor]:
        """Mask the constrained rows and draw a token per row; the rows whose mask can wait are
        drawn first and masked (and drawn again) only if their grammar forbids that token.
        Returns the requests whose grammar engine failed, with the error, and the tokens."""
        rids = [r.rid for r in reqs]
        self.faults.check("mask", rids)
        lazy = self.grammar.unmasked_rows(logits, reqs)
        failed = self.grammar.mask(logits, reqs, skip=lazy)
        batch = self._sampling_batch(reqs)
        self.faults.check("sample", rids)
        tokens = sample_tokens(logits, batch)
        redo: list[int] = []
        if lazy:
            drawn = tokens.tolist()
            redo, picked = self.grammar.rejected(reqs, drawn, lazy, logits if batch.raw_argmax else None)
            for i in picked:  # a next-best token the grammar allows
                tokens[i] = drawn[i]
        if redo:
            again, sub = [reqs[i] for i in redo], logits[redo]
            failed += self.grammar.mask(sub, again)
            tokens[redo] = sample_tokens(sub, self._sampling_batch(again))
        return failed, tokens

    def _can_look_ahead(self, run: StepRun, reqs: list[EngineRequest]) -> bool:
        """Whether the next step of these requests can be queued before the run's tokens reach
        the host: all running requests are in it (a decode, or the extend of a jump forward),
        nothing waits to be admitted, and each next token needs nothing the host has not sent yet
        (no penalties over the output, logprobs or min_new_tokens block; a grammar's mask is
        filled after the host has the tokens, while the queued forward runs) and cannot be the
        request's last by length. The run's own rows are decodes, or extends of requests with
        output (a jump's forced tokens: the row after them is a decode again)."""
        sched = self.scheduler
        if (not self.overlap or not reqs or sched.waiting or self.grammar.compiling
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

    def _count_step(self, step: Sequence[Scheduled]) -> None:
        self.steps += 1
        self.rows_fed += len(step)
        self.tokens_fed += sum(len(s.seq.token_ids) for s in step)
        self.prompt_steps += any(s.prefill for s in step)

    def _process(self, run: StepRun) -> list[RequestOutput]:
        """Phase 3: the run's tokens on the host become outputs; finished requests leave."""
        t0 = time.perf_counter()
        ids = run.fetch()
        t1 = time.perf_counter()
        self.step_seconds["wait"] += t1 - t0
        live = [i for i, r in enumerate(run.samplers) if r.status is Status.RUNNING]
        if run.queued_ahead and live:
            self._count_step(run.step)
            for i in live:
                run.samplers[i].forward_passes += 1
        ended = list(run.ended)
        lps = tops = None
        if run.logits is not None:
            lps, tops = self._output_logprobs(run, ids, ended)
        live = [i for i in live if run.samplers[i].status is Status.RUNNING]
        reqs = [run.samplers[i] for i in live]
        outputs = ended + self.output.append(
            reqs, [ids[i] for i in live],
            None if lps is None else [lps[i] for i in live], None if tops is None else [tops[i] for i in live])
        self.scheduler.end_step(run.step)
        self.step_seconds["process"] += time.perf_counter() - t1
        return [self._end(o) if o.finished else o for o in outputs]

    def _output_logprobs(self, run: StepRun, ids: list[int], ended: list[RequestOutput]
                         ) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
        """The sampled tokens' logprobs (and top logprobs) of a run's rows; a request whose row
        raises alone fails (its entries are then placeholders nobody reads)."""
        logits = run.logits
        assert logits is not None
        nums = [r.top_logprobs_num if r.return_logprob else 0 for r in run.samplers]

        def rows(idx: Sequence[int]) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
            self.faults.check("logprobs", [run.samplers[i].rid for i in idx])
            if len(idx) == len(run.samplers):
                out = with_logprobs(logits, ids, run.tokens, nums, True)
            else:
                at = list(idx)
                out = with_logprobs(logits[at], [ids[i] for i in at], run.tokens[at], [nums[i] for i in at], True)
            return out.logprobs, out.top_logprobs

        def fault(i: int, e: BaseException) -> None:
            ended.append(self._fail(run.samplers[i], "logprobs", e))

        kept, parts = self.faults.isolate(range(len(run.samplers)), rows, fault)
        if len(kept) == len(run.samplers):
            return parts[0]
        lps: list[float] = [0.0] * len(run.samplers)
        tops: list[list[tuple[int, float]]] = [[] for _ in run.samplers]
        for i, (lp, top) in zip(kept, parts):
            lps[i] = lp[0] if lp is not None else 0.0
            tops[i] = top[0] if top is not None else []
        return lps, tops

    def _ended_elsewhere(self) -> list[RequestOutput]:
        """Requests the scheduler ended on its own (max_new_tokens=0, out of memory)."""
        done = [r for r in self.requests.values() if r.status is Status.FINISHED]
        return [self._end(self.output.finish(r)) for r in done]

    def _end(self, out: RequestOutput) -> RequestOutput:
        self.requests.pop(out.rid, None)
        return out

    def _sampling_batch(self, reqs: list[EngineRequest], ahead: bool = False) -> SamplingBatch:
        """The step's sampling parameters, with the min_new_tokens blocks of its requests (for a
        step queued ahead, their outputs are one token longer than the host knows yet)."""
        n = 1 if ahead else 0
        blocks = [  # a grammar, not min_new_tokens, decides where constrained output may end
            sorted(r.eos_ids | set(r.params.stop_token_ids))
            if len(r.output_ids) + n < r.params.min_new_tokens and r.matcher is None else []
            for r in reqs
        ]
        return SamplingBatch.build([r.params for r in reqs], [r.output_ids for r in reqs],
                                   [r.generator for r in reqs], self.source.arch.vocab_size, self.device,
                                   blocks if any(blocks) else None)

    def _input_logprobs(self, req: EngineRequest, s: Scheduled, rows: torch.Tensor) -> None:
        if not req.input_logprobs and req.logprob_start_len == 0:
            req.input_logprobs.append((None, req.prompt_ids[0]))
        targets = req.prompt_ids[s.first_logit_pos + 1 : s.first_logit_pos + 1 + rows.shape[0]]
        if targets:  # (none for a one-token prompt scored with max_new_tokens=0)
            req.input_logprobs.extend(zip(token_logprobs(rows, targets), targets))

    def _finish_turn(self, req: EngineRequest) -> dict[str, Any]:
        return self.sessions.finish_turn(req.rid, req.output_ids, req.finish_reason != "abort", req.cached_tokens)

    # -- introspection -------------------------------------------------------------------
    @property
    def prompt_tokens_total(self) -> int:
        """Prompt tokens of finished requests (for the cache hit rate)."""
        return self.output.totals.prompt_tokens

    @property
    def cached_tokens_total(self) -> int:
        return self.output.totals.cached_tokens

    def integrity_report(self) -> dict[str, Any]:
        """Check the KV bookkeeping at any moment; the figures and every broken invariant.

        Every slot is free, held by the radix cache, or held by a running request beyond its
        cached prefix; nothing else. While idle, only session pins may lock cache nodes.
        Walks the whole tree: O(cached tokens), so it is for tests and soak runs, not per step.
        """
        errors: list[str] = []
        for name, check in (("radix cache", self.cache.check_integrity), ("sessions", self.sessions.check_integrity)):
            try:
                check()
            except IntegrityError as e:
                errors.append(f"{name}: {e}")
        alloc, cache = self.allocator, self.cache
        held = sum(len(r.slots) - r.tree_len for r in self.scheduler.running)
        free, cached, total = alloc.num_free, cache.total_size(), alloc.num_slots
        if free + cached + held != total:
            errors.append(f"KV slots leaked: free {free} + cached {cached} + held by requests {held} != total {total}")
        idle = not self.has_work and not self.requests
        pinned, held = self.sessions.pinned_tokens, self.scheduler.held_tokens
        if idle and cache.protected_size() > pinned + held:
            errors.append(f"{cache.protected_size()} cached tokens locked while idle, sessions pin only {pinned} "
                          f"and programs' fork prefixes hold {held}")
        return {
            "ok": not errors, "errors": errors, "idle": idle,
            "running_requests": len(self.scheduler.running), "waiting_requests": len(self.scheduler.waiting),
            "kv_slots_total": total, "kv_slots_free": free, "kv_slots_held_by_requests": held,
            "cache_tokens": cached, "cache_evictable_tokens": cache.evictable_size(),
            "cache_protected_tokens": cache.protected_size(), "session_pinned_tokens": pinned,
            "program_held_tokens": held,
        }

    def check_idle_integrity(self) -> None:
        """With no request in flight: nothing locked, every slot free or held by the cache."""
        if self.has_work or self.requests:
            raise IntegrityError(f"not idle: {len(self.requests)} requests in flight")
        report = self.integrity_report()
        if not report["ok"]:
            raise IntegrityError("; ".join(report["errors"]))

    def flush_cache(self) -> None:
        """Drop every cached prefix; sessions stay open, unpinned (their next turns recompute)."""
        self.sessions.unpin_all()
        self.cache.reset()


def check_parallel(config: EngineConfig, arch: ModelArch | None = None) -> None:
    """A one-line ValueError when --tp-size does not split the model's heads and MLP evenly, or
    names more ranks than GPUs (`arch`: the model's, resolved from the config when None)."""
    size, mc = config.parallel.tp_size, config.model
    if size == 1:
        return
    if arch is None:
        arch = resolve_model(mc.model, Path(mc.cache_dir), mc.tokenizer_path).arch
    check_tp_size(arch, size)
    check_devices(mc.device, size)


def context_length(config: EngineConfig, model_max: int) -> int:
    """The engine's context length: the configured one, else the model's capped at DEFAULT_CONTEXT_CAP."""
    return config.model.context_length or min(model_max, DEFAULT_CONTEXT_CAP)


@dataclass(frozen=True)
class NumberFormats:
    """The weights' and activations' number formats this engine runs, with the GGUF file whose
    quantized blocks the linear layers load from (None: dense weights)."""

    dtype: DtypeChoice
    quant: QuantChoice
    gguf: GGUFLinears | None
    attention: DtypeChoice  # what the CPU's native prompt attention multiplies in


def number_formats(config: EngineConfig, source: ModelSource, device: torch.device) -> NumberFormats:
    """--dtype and --quantization resolved for this device and model (docs/engine.md, "Number
    formats"), logged with their reasons. Tensor parallelism shards dense weights, so `auto` keeps
    them dense there."""
    mc = config.model
    path = source.gguf_path  # (its share of 4-bit weights is remembered beside the converted weights)
    sharded = config.parallel.tp_size > 1

    @functools.cache
    def four_bit() -> bool:  # (asked for the dtype and again for the quantization: read once)
        return path is not None and four_bit_share(path, source.weights_dir) > 0.5

    native_four_bit = (device.type == "cpu" and mc.dtype == "auto" and mc.quantization == "auto" and not sharded
                       and native_tiles_run(four_bit, mc.quant_dense_above))
    dtype = choose_dtype(mc.dtype, device.type, cpu_flags() if device.type == "cpu" else None,
                         native_four_bit=native_four_bit)
    gguf = None
    if sharded and mc.quantization == "auto":
        quant = QuantChoice("none", None, "tensor parallelism shards dense weights")
    else:
        def choose(four_bit: bool) -> QuantChoice:
            return choose_quantization(mc.quantization, device.type, dtype.dtype, four_bit, mc.quant_dense_above,
                                       auto_dtype=mc.dtype == "auto", amx=device.type == "cpu" and amx_packing())

        quant = choose(choose(True) != choose(False) and (native_four_bit or four_bit()))
        if path is not None and quant.method in GGUF_BLOCK_METHODS:  # the file's own blocks (int4 as it holds it)
            gguf = GGUFLinears(path)
    attention = choose_attention(mc.dtype, dtype.dtype, device.type, source.arch.head_dim, config.attention_backend_name)
    log.info("dtype %s: %s", dtype.dtype, dtype.reason)
    log.info("quantization %s: %s", quant.method, quant.reason)
    log.info("prompt attention in %s: %s", attention.dtype, attention.reason)
    return NumberFormats(dtype, quant, gguf, attention)


def build_runner(config: EngineConfig, source: ModelSource, device: torch.device,
                 group: TPGroup | None, formats: NumberFormats) -> tuple[LlamaModel, ModelRunner]:
    """The model (this rank's shard with `group`) and its runner; every rank runs this, in step,
    so the KV pool has the same number of slots on every rank (the smallest any can hold)."""
    mc, sc = config.model, config.scheduler
    if device.type == "cuda":  # compiled kernels stay in radixlm's cache: a restart loads them
        os.environ.setdefault("TRITON_CACHE_DIR", str(Path(mc.cache_dir) / "triton"))
    dtype = getattr(torch, formats.dtype.dtype)
    ctx = context_length(config, source.arch.max_position_embeddings)
    model = build_model(source.arch, source.weights_dir, dtype, device, ctx, mc.seed, group, formats.quant,
                        formats.gguf)
    num_slots = config.cache.max_total_tokens or _pool_slots(config, model.shard, dtype, device, ctx)
    if group is not None:
        num_slots = group.min_host(num_slots)
    runner = ModelRunner(model, num_slots, sc.max_running_requests, ctx, config.attention_backend_name,
                         () if config.cuda_graph.disable_cuda_graph else graph_buckets(_graph_rows(config)),
                         prompt_bf16=formats.dtype.dtype == "float32" and formats.attention.dtype == "bfloat16")
    return model, runner


def _graph_rows(config: EngineConfig) -> int:
    """The most rows (tokens) a captured step holds: a full batch of decodes and room for short
    extends beside them, unless --cuda-graph-max-bs says otherwise."""
    return config.cuda_graph.cuda_graph_max_bs or config.scheduler.max_running_requests + GRAPH_EXTEND_ROWS


def _pool_slots(config: EngineConfig, shard: ModelArch, dtype: torch.dtype, device: torch.device, ctx: int) -> int:
    """KV pool tokens from free memory; on CUDA, what the weights and a reserve for
    activations and CUDA graphs leave. `shard`: this rank's share of the model."""
    cc, sc = config.cache, config.scheduler
    reserve = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        tokens = max(sc.max_prefill_tokens, sc.chunked_prefill_size or ctx)
        rows = max(sc.max_running_requests, 0 if config.cuda_graph.disable_cuda_graph else _graph_rows(config))
        reserve = activation_reserve(shard, dtype, tokens + rows, rows)
    return pool_slots(shard, dtype, _available_memory(device), cc.fraction_for(device.type), reserve)


def run_tp_worker(rank: int, size: int, init_file: str, config: EngineConfig) -> None:
    """A worker rank (> 0): build this rank's shard and run every step rank 0 sends, until it stops."""
    exit_with_parent()
    mc = config.model
    source = resolve_model(mc.model, Path(mc.cache_dir), mc.tokenizer_path)
    device = tp_device(mc.device, rank)
    group = init_tp_group(rank, size, init_file, device, config.parallel.dist_timeout)
    _, runner = build_runner(config, source, device, group, number_formats(config, source, device))
    channel = StepChannel(group)
    while (step := channel.receive()) is not None:
        runner.forward(step.seqs, step.ids)
    group.close()


def _worker_main() -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="a tensor-parallel worker rank (started by the engine)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init-file", required=True)
    parser.add_argument("--config", required=True, help="EngineConfig.flat() as JSON")
    ns = parser.parse_args()
    run_tp_worker(ns.rank, ns.size, ns.init_file, EngineConfig.from_kwargs(**json.loads(ns.config)))


def _seed(params: SamplingParams) -> int:
    """A sampled request's seed: its own, or one drawn from torch's default CPU generator (so
    `torch.manual_seed` makes unseeded runs repeatable)."""
    if params.seed is not None:
        return params.seed
    return int(torch.randint(0, 1 << 62, (1,)).item())


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    _worker_main()
