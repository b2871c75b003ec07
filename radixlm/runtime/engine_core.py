"""EngineCore: scheduler + model runner + sampling + output processing, single-threaded.

One `step()` runs one forward pass and returns what each request gained. The in-process
Engine drives it from a thread; the server drives the same loop in its own process.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.constrained.bitmask import allocate_bitmask, apply_bitmask_
from radixlm.runtime.constrained.grammar import Grammar, GrammarMatcher
from radixlm.runtime.constrained.service import GrammarService
from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.batch import SeqStep
from radixlm.runtime.kernels.sampling import SampleOutput, SamplingBatch, make_generator, sample, sample_tokens
from radixlm.runtime.cuda_graph import graph_buckets
from radixlm.runtime.intake import Submission
from radixlm.runtime.kv_pool import activation_reserve, pool_slots
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model.source import ModelSource, resolve_model
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.radix_cache import CACHES, SlotAllocator
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Request, Scheduled, Scheduler, Status
from radixlm.runtime.sessions import SessionManager, SessionParams, prepended_bos
from radixlm.runtime.stop import StopMatcher

DEFAULT_CONTEXT_CAP = 8192
COMPILE_WAIT_S = 0.05  # with nothing to run but grammars compiling, how long one step waits


@dataclass
class RequestOutput:
    """What one request gained in a step (deltas), plus its totals once finished.

    ``replace_from``: jump-forward re-tokenized output tokens already reported; drop the output
    ids from this index on before appending ``token_ids_delta`` (text is only ever appended).
    ``error``: the request failed before it ran (its constraint did not compile); it is finished.
    """

    rid: str
    text_delta: str
    token_ids_delta: list[int]
    finished: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    replace_from: int | None = None
    error: str | None = None

    def apply_ids(self, ids: list[int]) -> None:
        """Bring a list of this request's output ids up to date with this output."""
        if self.replace_from is not None:
            del ids[self.replace_from :]
        ids.extend(self.token_ids_delta)


@dataclass(frozen=True)
class _Ahead:
    """A decode step queued on the device before the host saw the previous step's tokens (the
    overlap schedule): its requests, its logits and the tokens drawn from them (still on the
    device), the sampling batch of that draw, and the states its draw started from (see
    `_rng_states`), to redo it for the requests still running when some finished meanwhile."""

    scheduled: list[Scheduled]
    logits: torch.Tensor
    tokens: torch.Tensor
    batch: SamplingBatch
    rng: list[tuple[torch.Generator, torch.Tensor]]


@dataclass(eq=False)
class _Track:
    """Engine-side state of a request: text, stop matching, seed, logprobs, timing."""

    req: Request
    detok: IncrementalDetokenizer
    stop: StopMatcher
    generator: torch.Generator | None
    return_logprob: bool
    top_logprobs_num: int
    eos_ids: frozenset[int]
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    text: str = ""
    matched_stop: str | int | None = None
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    sent_tokens: int = 0
    replace_from: int | None = None
    matcher: GrammarMatcher | None = None
    jump_forward: bool = False
    forced_tokens: int = 0  # output tokens that jump-forward appended
    forward_passes: int = 0


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        mc = config.model
        self.source = source or resolve_model(mc.model, Path(mc.cache_dir), mc.tokenizer_path)
        arch = self.source.arch
        self.device = torch.device(mc.device)
        dtype = getattr(torch, mc.dtype)
        self.context_length = mc.context_length or min(arch.max_position_embeddings, DEFAULT_CONTEXT_CAP)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.source.tokenizer_dir))
        self.model = build_model(arch, self.source.weights_dir, dtype, self.device, self.context_length, mc.seed)
        cc = config.cache
        if cc.cache not in CACHES:
            raise ValueError(f"unknown cache {cc.cache!r}; choose one of {sorted(CACHES)}")
        sc = config.scheduler
        num_slots = cc.max_total_tokens or self._pool_slots(dtype)
        gc = config.cuda_graph
        max_graph_bs = min(gc.cuda_graph_max_bs or sc.max_running_requests, sc.max_running_requests)
        self.runner = ModelRunner(
            self.model, num_slots, sc.max_running_requests, self.context_length, config.attention_backend_name,
            () if gc.disable_cuda_graph else graph_buckets(max_graph_bs),
        )
        self.allocator = SlotAllocator(num_slots)
        self.cache = CACHES[cc.cache](self.allocator, cc.page_size)
        pin_cap = cc.max_pinned_tokens if cc.max_pinned_tokens is not None else num_slots // 2
        self.sessions = SessionManager(self.cache, pin_cap, cc.session_ttl, strip_bos=prepended_bos(self.tokenizer))
        self.scheduler = Scheduler(sc, self.cache, self.allocator, self.context_length, self.sessions.unpin_lru)
        self.eos_ids = frozenset(arch.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self.tracks: dict[str, _Track] = {}
        self.overlap = sc.overlap_schedule if sc.overlap_schedule is not None else self.device.type == "cuda"
        self._ahead: _Ahead | None = None
        self.ahead_steps = 0  # decode steps queued ahead of the host (the overlap schedule)
        self._grammars: GrammarService | None = None
        self._compiling: dict[str, Future[Grammar]] = {}
        self.grammar_seconds = 0.0  # masks, accepts and jumps, for the per-token grammar cost
        self.grammar_tokens = 0
        self.steps = 0
        self.prompt_tokens_total = 0  # of finished requests, for the cache hit rate
        self.cached_tokens_total = 0

    def _pool_slots(self, dtype: torch.dtype) -> int:
        """KV pool tokens from free memory; on CUDA, what the weights and a reserve for
        activations and CUDA graphs leave."""
        arch, cc, sc = self.source.arch, self.config.cache, self.config.scheduler
        reserve = 0
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            tokens = max(sc.max_prefill_tokens, sc.chunked_prefill_size or self.context_length)
            reserve = activation_reserve(arch, dtype, tokens + sc.max_running_requests, sc.max_running_requests)
        return pool_slots(arch, dtype, _available_memory(self.device), cc.fraction_for(self.device.type), reserve)

    def info(self) -> dict[str, Any]:
        """What the server reports about the model (get_model_info / get_server_info)."""
        tok = self.tokenizer
        return {
            "model_path": str(self.source.weights_dir or self.source.name),
            "model_name": self.source.name,
            "tokenizer_path": str(self.source.tokenizer_dir),
            "context_length": self.context_length,
            "vocab_size": self.source.arch.vocab_size,
            "dtype": self.config.model.dtype,
            "device": str(self.device),
            "max_total_tokens": self.allocator.num_slots,
            "max_running_requests": self.config.scheduler.max_running_requests,
            "eos_token_ids": sorted(self.eos_ids),
            "chat_template": getattr(tok, "chat_template", None) is not None,
        }

    def warm_up(self) -> None:
        """One short request through every stage, then an empty cache."""
        self.add_request(Submission("warm-up", [self.source.arch.bos_token_id or 1] * 4,
                                    SamplingParams(max_new_tokens=2, temperature=0)))
        while self.has_work:
            self.step()
        self.cache.reset()
        self.steps = self.prompt_tokens_total = self.cached_tokens_total = 0

    # -- requests ------------------------------------------------------------------------
    def add_request(self, sub: Submission) -> None:
        """Queue a request; with ``sub.session``, ``sub.prompt_ids`` are the new turn's tokens,
        appended to the history of the turn it continues (radixlm.runtime.sessions)."""
        rid, prompt_ids, params, session = sub.rid, sub.prompt_ids, sub.params, sub.session
        return_logprob, logprob_start_len, top_logprobs_num = sub.return_logprob, sub.logprob_start_len, sub.top_logprobs_num
        if rid in self.tracks:
            raise ValueError(f"request id {rid!r} is already in use")
        plan = None
        if session is not None:
            plan = self.sessions.plan_turn(session, rid, list(prompt_ids), params.max_new_tokens)
            prompt_ids, params = plan.prompt_ids, plan.cap(params)
        vocab = self.source.arch.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"request {rid}: token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:  # (blocked as an end token before min_new_tokens, it would fail a whole step)
            raise ValueError(f"stop_token_ids holds token id {bad}, outside the vocabulary [0, {vocab})")
        if top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
        start = logprob_start_len if return_logprob else -1
        req = Request(rid, list(prompt_ids), params, logprob_start_len=start)
        self.scheduler.validate(req)
        constraint = params.constraint
        if constraint is not None:
            self._compiling[rid] = self.grammars.submit(*constraint)
        else:
            self.scheduler.add(req)
        tail = prompt_ids[-4:]
        self.tracks[rid] = _Track(
            req=req,
            detok=IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens, tail
            ),
            stop=StopMatcher(params.stop, keep_stop=params.no_stop_trim),
            generator=make_generator(params.seed, self.device) if params.seed is not None else None,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            eos_ids=frozenset() if params.ignore_eos else self.eos_ids,
            jump_forward=params.jump_forward and self.config.constraint.jump_forward,
        )
        if plan is not None:
            self.sessions.start_turn(plan, session.replace)

    @property
    def grammars(self) -> GrammarService:
        """The grammar service, built on the first constrained request."""
        if self._grammars is None:
            self._grammars = GrammarService(
                self.tokenizer, self.source.arch.vocab_size, sorted(self.eos_ids), self.config.constraint
            )
        return self._grammars

    def abort(self, rid: str) -> RequestOutput | None:
        track = self.tracks.get(rid)
        if track is None:
            return None
        future = self._compiling.pop(rid, None)
        if future is not None:
            future.cancel()
            track.req.finish_reason = "abort"
        else:
            self.scheduler.finish(track.req, "abort")
        return self._finish_output(track)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._compiling) or self._ahead is not None

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready join the scheduler; a failed compile fails its request
        (its output, with ``error`` set, is returned)."""
        failed: list[RequestOutput] = []
        if self._compiling and not self.scheduler.has_work:
            wait(self._compiling.values(), timeout=COMPILE_WAIT_S, return_when=FIRST_COMPLETED)
        for rid, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            track = self.tracks[rid]
            try:
                track.matcher = future.result().new_matcher()
            except ValueError as e:
                track.req.finish_reason = "abort"
                out = self._finish_output(track)
                out.error = str(e)
                failed.append(out)
                continue
            self.scheduler.add(track.req)
        return failed

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed = self._admit_compiled() if self._compiling else []
        self.sessions.expire()
        if self._ahead is not None:
            return failed + self._step_ahead()
        scheduled = self.scheduler.schedule()  # unpins sessions, oldest first, when work would not fit
        if not scheduled:
            return failed + self._drain_finished_without_step()
        self.steps += 1
        logits = self.runner.forward([s.seq for s in scheduled])
        sample_rows: list[int] = []
        samplers: list[Scheduled] = []
        off = 0
        for s in scheduled:
            k = s.seq.num_logits
            track = self.tracks[s.req.rid]
            track.forward_passes += 1
            if track.return_logprob and s.req.wants_input_logprobs:
                self._input_logprobs(track, s, logits[off : off + k - (1 if s.samples else 0)])
            if s.samples:
                sample_rows.append(off + k - 1)
                samplers.append(s)
            off += k
        outputs: list[RequestOutput] = []
        if samplers:
            outputs = self._sample_and_append(logits[sample_rows], samplers, len(samplers) == len(scheduled))
        self.scheduler.end_step(scheduled)
        outputs += self._drain_finished_without_step(skip={o.rid for o in outputs})
        return failed + outputs

    def _input_logprobs(self, track: _Track, s: Scheduled, rows: torch.Tensor) -> None:
        req = track.req
        if not track.input_logprobs and req.logprob_start_len == 0:
            track.input_logprobs.append((None, req.prompt_ids[0]))
        targets = req.prompt_ids[s.first_logit_pos + 1 : s.first_logit_pos + 1 + rows.shape[0]]
        if not targets:  # e.g. a one-token prompt scored with max_new_tokens=0: no next prompt token
            return
        rows = rows[: len(targets)]
        lp = torch.log_softmax(rows.float(), dim=-1)
        picked = lp[torch.arange(len(targets)), torch.tensor(targets)].tolist()
        track.input_logprobs.extend(zip(picked, targets))

    def _sample_and_append(self, logits: torch.Tensor, samplers: list[Scheduled],
                           whole_step: bool = False) -> list[RequestOutput]:
        tracks = [self.tracks[s.req.rid] for s in samplers]
        self._apply_grammar_masks(logits, tracks)
        batch = self._sampling_batch(tracks)
        if whole_step and self._can_look_ahead(samplers):
            return self._append_and_look_ahead(samplers, sample_tokens(logits, batch), batch)
        want_lp = any(t.return_logprob for t in tracks)
        out = sample(logits, batch, [t.top_logprobs_num if t.return_logprob else 0 for t in tracks], want_lp)
        return self._append(tracks, out)

    def _sampling_batch(self, tracks: list[_Track]) -> SamplingBatch:
        """This step's sampling parameters, with the min_new_tokens blocks of its requests."""
        blocks = [  # a grammar, not min_new_tokens, decides where constrained output may end
            sorted(t.eos_ids | set(t.req.params.stop_token_ids))
            if len(t.req.output_ids) < t.req.params.min_new_tokens and t.matcher is None
            else []
            for t in tracks
        ]
        return SamplingBatch.build(
            [t.req.params for t in tracks],
            [t.req.output_ids for t in tracks],
            [t.generator for t in tracks],
            self.source.arch.vocab_size,
            self.device,
            blocks if any(blocks) else None,
        )

    def _append(self, tracks: list[_Track], out: SampleOutput) -> list[RequestOutput]:
        """Each request's sampled token: grammar, text, stops, finishing."""
        now = time.perf_counter()
        results = []
        for i, (track, tok) in enumerate(zip(tracks, out.token_ids)):
            req = track.req
            req.output_ids.append(tok)
            if track.matcher is not None and not self._grammar_accept(track.matcher, tok):
                self.scheduler.finish(req, "abort")
                results.append(self._finish_output(track))
                continue
            track.first_token_at = track.first_token_at or now
            if track.return_logprob:
                track.output_logprobs.append((out.logprobs[i], tok))
                if track.top_logprobs_num:
                    track.output_top_logprobs.append([(lp, t) for t, lp in out.top_logprobs[i]])
            results.append(self._advance_text(track, tok))
        return results

    # -- the overlap schedule -----------------------------------------------------------
    def _can_look_ahead(self, step: list[Scheduled]) -> bool:
        """Whether the next step of these decoding requests can be queued before their tokens
        reach the host: every running request decodes here, nothing waits to be admitted, and
        each request's next token needs nothing the host has not sent yet (greedy or sampled,
        seeded or not, but no penalties over its output, no grammar, logprobs or min_new_tokens
        block) and cannot be its last by length."""
        if not self.overlap or self.scheduler.waiting or self._compiling or len(step) != len(self.scheduler.running):
            return False
        for s in step:
            req, track = s.req, self.tracks[s.req.rid]
            p = req.params
            if (s.prefill or not s.samples or len(s.seq.token_ids) != 1 or req.rewrite_row
                    or track.matcher is not None or track.return_logprob
                    or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                    or len(req.output_ids) + 1 < p.min_new_tokens or req.remaining_new_tokens() < 2
                    or req.fill_len + 2 > self.context_length):
                return False
        return True

    def _append_and_look_ahead(self, step: list[Scheduled], tokens: torch.Tensor,
                               batch: SamplingBatch) -> list[RequestOutput]:
        """Queue the next step on `tokens` (this step's, drawn with `batch`, on the device), then
        do the host work of this step while the device runs it."""
        fetch = self.runner.fetch_ids(tokens)  # queued before the next step, so it does not wait for it
        reqs = [s.req for s in step]
        if self.scheduler.extend_ahead(reqs):
            seqs = [SeqStep(row=r.row, cached_len=len(r.slots) - 1, token_ids=[0], slots=[r.slots[-1]], logit_start=0)
                    for r in reqs]
            logits = self.runner.forward(seqs, ids=tokens)
            # the same requests, parameters and generators; _can_look_ahead ruled out a block
            # (and penalties, so the batch's output ids, one token behind, are not read)
            batch = replace(batch, block_rows=None, block_tokens=None)
            rng = self._rng_states(batch)
            self._ahead = _Ahead([Scheduled(r, q, q.cached_len, True, False) for r, q in zip(reqs, seqs)],
                                 logits, sample_tokens(logits, batch), batch, rng)
            self.ahead_steps += 1
        results = self._append([self.tracks[r.rid] for r in reqs], SampleOutput(fetch(), None, None))
        # a request that just finished took its queued step's slot with it (finish releases all
        # its slots; the KV written there is its last token's, valid for the cache)
        if self._ahead is not None and all(s.req.status is Status.FINISHED for s in self._ahead.scheduled):
            _set_states(self._ahead.rng)  # the plain loop never draws this step
            self._ahead = None
        return results

    def _step_ahead(self) -> list[RequestOutput]:
        """Take the tokens of the step queued ahead, for its requests still running."""
        ahead, self._ahead = self._ahead, None
        assert ahead is not None
        live = [i for i, s in enumerate(ahead.scheduled) if s.req.status is Status.RUNNING]
        step = [ahead.scheduled[i] for i in live]
        if not step:
            _set_states(ahead.rng)
            return self._drain_finished_without_step()
        tokens, batch = ahead.tokens, ahead.batch
        if len(step) < len(ahead.scheduled):
            # Redo the draw as the plain loop makes it, over the requests left: from the same
            # generator states, so unseeded rows take the same share of the default generator.
            _set_states(ahead.rng)
            batch = self._sampling_batch([self.tracks[s.req.rid] for s in step])
            tokens = sample_tokens(ahead.logits[torch.tensor(live, device=ahead.logits.device)], batch)
        self.steps += 1
        for s in step:
            self.tracks[s.req.rid].forward_passes += 1
        if self._can_look_ahead(step):
            outputs = self._append_and_look_ahead(step, tokens, batch)
        else:
            outputs = self._append([self.tracks[s.req.rid] for s in step], SampleOutput(tokens.tolist(), None, None))
        self.scheduler.end_step(step)
        return outputs + self._drain_finished_without_step(skip={o.rid for o in outputs})

    def _rng_states(self, batch: SamplingBatch) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The generators a draw with `batch` advances, with their states before it: the
        device's default generator (unseeded rows) and each seeded row's own. Host-side reads,
        no device sync."""
        if batch.all_greedy:
            return []
        dev = self.device
        default = (torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]
                   if dev.type == "cuda" else torch.default_generator)
        return [(g, g.get_state()) for g in [default, *(g for _, g in batch.seeded)]]

    def _advance_text(self, track: _Track, tok: int) -> RequestOutput:
        req = track.req
        p = req.params
        reason: str | None = None
        delta, matched = "", None
        if tok in track.eos_ids or tok in p.stop_token_ids:
            reason, track.matched_stop = "stop", tok
        if reason is None or p.no_stop_trim:  # a matched stop token stays out of the text
            delta, matched = track.stop.feed(track.detok.push([tok]))
            if reason is None and matched is None and track.matcher is not None:
                forced, matched, done = self._grammar_advance(track)
                delta += forced
                if done:
                    reason, track.matched_stop = "stop", self.grammars.vocab.stop_ids[0]
        if matched is not None:
            reason, track.matched_stop = "stop", matched
        elif reason is None and (len(req.output_ids) >= p.max_new_tokens or req.fill_len >= self.context_length):
            reason = "length"
        if reason is not None and matched is None:  # the stream ends: release held-back text
            tail, matched = track.stop.feed(track.detok.flush())
            delta += tail
            if matched is None:
                delta += track.stop.flush()
                matched = track.stop.matched
            if matched is not None:
                reason, track.matched_stop = "stop", matched
        track.text += delta
        if reason is None:
            return self._output(track, delta)
        self.scheduler.finish(req, reason)
        return self._finish_output(track, delta)

    def _drain_finished_without_step(self, skip: set[str] = frozenset()) -> list[RequestOutput]:
        """Requests the scheduler ended on its own (max_new_tokens=0, out of memory)."""
        done = [t for rid, t in self.tracks.items() if t.req.finish_reason is not None and rid not in skip]
        return [self._finish_output(t) for t in done]

    def _output(self, track: _Track, delta: str) -> RequestOutput:
        ids = track.req.output_ids[track.sent_tokens :]
        track.sent_tokens = len(track.req.output_ids)
        out = RequestOutput(track.req.rid, delta, ids, replace_from=track.replace_from)
        track.replace_from = None
        return out

    # -- constrained decoding ------------------------------------------------------------
    def _apply_grammar_masks(self, logits: torch.Tensor, tracks: list[_Track]) -> None:
        """Each constrained row gets its grammar's bitmask; other rows stay untouched."""
        rows = [i for i, t in enumerate(tracks) if t.matcher is not None]
        if not rows:
            return
        t0 = time.perf_counter()
        bitmask = allocate_bitmask(len(rows), logits.shape[-1])
        masked = [j for j, i in enumerate(rows) if tracks[i].matcher.fill_mask(bitmask[j])]
        if masked:
            apply_bitmask_(logits, bitmask[masked], [rows[j] for j in masked])
        self.grammar_seconds += time.perf_counter() - t0

    def _grammar_accept(self, matcher: GrammarMatcher, tok: int) -> bool:
        t0 = time.perf_counter()
        ok = matcher.accept(tok)
        self.grammar_seconds += time.perf_counter() - t0
        self.grammar_tokens += 1
        return ok

    def _grammar_advance(self, track: _Track) -> tuple[str, str | None, bool]:
        """After a sampled token: jump over forced text. Returns (text added, stop string
        matched in it, whether the grammar is complete and allows nothing but a stop token)."""
        t0 = time.perf_counter()
        req, matcher = track.req, track.matcher
        assert matcher is not None
        text, matched = "", None
        if track.jump_forward:
            limit = min(req.params.max_new_tokens, self.context_length - len(req.prompt_ids))
            floor = max(req.tree_len - len(req.prompt_ids), 0)
            jump = self.grammars.jump_forward.jump(matcher, req.output_ids, floor, limit)
            if jump is not None:
                text, matched = self._apply_jump(track, jump.keep, list(jump.new_ids), jump.text)
        done = matched is None and matcher.is_completed() and self._only_stop_allowed(matcher)
        self.grammar_seconds += time.perf_counter() - t0
        return text, matched, done

    def _apply_jump(self, track: _Track, keep: int, new_ids: list[int], text: str) -> tuple[str, str | None]:
        req = track.req
        del req.output_ids[keep:]
        req.output_ids.extend(new_ids)
        self.scheduler.rewind(req, len(req.prompt_ids) + keep)
        track.forced_tokens += len(new_ids)
        if track.return_logprob:  # forced tokens have probability 1 under the constraint
            del track.output_logprobs[keep:]
            track.output_logprobs.extend((0.0, t) for t in new_ids)
            if track.top_logprobs_num:
                del track.output_top_logprobs[keep:]
                track.output_top_logprobs.extend([(0.0, t)] for t in new_ids)
        if keep < track.sent_tokens:
            track.sent_tokens = keep
            track.replace_from = keep if track.replace_from is None else min(track.replace_from, keep)
        p = req.params
        track.detok = IncrementalDetokenizer(
            self.tokenizer, p.skip_special_tokens, p.spaces_between_special_tokens, req.fill_ids[-4:]
        )
        return track.stop.feed(text)

    def _only_stop_allowed(self, matcher: GrammarMatcher) -> bool:
        row = allocate_bitmask(1, self.source.arch.vocab_size)[0]
        if not matcher.fill_mask(row):
            return False
        for t in self.grammars.vocab.stop_ids:
            bit = 1 << (t % 32)
            row[t // 32] &= ~(bit - (1 << 32) if bit >= 1 << 31 else bit)  # int32 words
        return not bool(row.any())

    def _finish_output(self, track: _Track, delta: str = "") -> RequestOutput:
        out = self._output(track, delta)
        out.finished = True
        out.meta = self._meta(track)
        req = track.req
        out.meta.update(self.sessions.finish_turn(req.rid, req.output_ids, req.finish_reason != "abort",
                                                  req.cached_tokens))
        del self.tracks[track.req.rid]
        return out

    def _meta(self, track: _Track) -> dict[str, Any]:
        req = track.req
        self.prompt_tokens_total += len(req.prompt_ids)
        self.cached_tokens_total += req.cached_tokens
        now = time.perf_counter()
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": _finish_reason(req.finish_reason, track.matched_stop),
            "e2e_latency": now - track.created,
            "ttft": (track.first_token_at - track.created) if track.first_token_at else None,
            "retractions": req.retractions,
            "forward_passes": track.forward_passes,
        }
        if track.matcher is not None:
            meta["forced_tokens"] = track.forced_tokens
        if track.return_logprob:
            meta["input_token_logprobs"] = track.input_logprobs
            meta["output_token_logprobs"] = track.output_logprobs
            if track.top_logprobs_num:
                meta["output_top_logprobs"] = track.output_top_logprobs
        return meta

    # -- introspection -------------------------------------------------------------------
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
            except AssertionError as e:
                errors.append(f"{name}: {e}")
        alloc, cache = self.allocator, self.cache
        held = sum(len(r.slots) - r.tree_len for r in self.scheduler.running)
        free, cached, total = alloc.num_free, cache.total_size(), alloc.num_slots
        if free + cached + held != total:
            errors.append(f"KV slots leaked: free {free} + cached {cached} + held by requests {held} != total {total}")
        idle = not self.has_work and not self.tracks
        pinned = self.sessions.pinned_tokens
        if idle and cache.protected_size() > pinned:
            errors.append(f"{cache.protected_size()} cached tokens locked while idle, sessions pin only {pinned}")
        return {
            "ok": not errors, "errors": errors, "idle": idle,
            "running_requests": len(self.scheduler.running), "waiting_requests": len(self.scheduler.waiting),
            "kv_slots_total": total, "kv_slots_free": free, "kv_slots_held_by_requests": held,
            "cache_tokens": cached, "cache_evictable_tokens": cache.evictable_size(),
            "cache_protected_tokens": cache.protected_size(), "session_pinned_tokens": pinned,
        }

    def check_idle_integrity(self) -> None:
        """With no request in flight: nothing locked, every slot free or held by the cache."""
        assert not self.scheduler.has_work and not self.tracks
        report = self.integrity_report()
        assert report["ok"], report["errors"]

    def flush_cache(self) -> None:
        """Drop every cached prefix; sessions stay open, unpinned (their next turns recompute)."""
        self.sessions.unpin_all()
        self.cache.reset()


def _set_states(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    """Put generators back to states saved by `EngineCore._rng_states`."""
    for gen, state in states:
        gen.set_state(state)


def _finish_reason(reason: str | None, matched: str | int | None) -> dict[str, Any]:
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": reason}
