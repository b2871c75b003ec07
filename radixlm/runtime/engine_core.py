"""EngineCore: scheduler + model runner + sampling + output processing, single-threaded.

One `step()` runs one forward pass and returns what each request gained. The in-process
Engine drives it from a thread; the server drives the same loop in its own process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.kernels.sampling import SamplingBatch, make_generator, sample
from radixlm.runtime.kv_pool import KVPool
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model.source import ModelSource, resolve_model
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.radix_cache import CACHES, SlotAllocator
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Request, Scheduled, Scheduler
from radixlm.runtime.stop import StopMatcher

DEFAULT_CONTEXT_CAP = 8192


@dataclass
class RequestOutput:
    """What one request gained in a step (deltas), plus its totals once finished."""

    rid: str
    text_delta: str
    token_ids_delta: list[int]
    finished: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


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


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        mc = config.model
        self.source = source or resolve_model(mc.model, Path(mc.cache_dir))
        arch = self.source.arch
        self.device = torch.device(mc.device)
        dtype = getattr(torch, mc.dtype)
        self.context_length = mc.context_length or min(arch.max_position_embeddings, DEFAULT_CONTEXT_CAP)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.source.tokenizer_dir))
        self.model = build_model(arch, self.source.weights_dir, dtype, self.device, self.context_length, mc.seed)
        cc = config.cache
        if cc.cache not in CACHES:
            raise ValueError(f"unknown cache {cc.cache!r}; choose one of {sorted(CACHES)}")
        num_slots = cc.max_total_tokens or max(
            int(_available_memory(self.device) * cc.mem_fraction) // KVPool.bytes_per_token(arch, dtype), 256
        )
        sc = config.scheduler
        self.runner = ModelRunner(
            self.model, num_slots, sc.max_running_requests, self.context_length, config.attention_backend
        )
        self.allocator = SlotAllocator(num_slots)
        self.cache = CACHES[cc.cache](self.allocator, cc.page_size)
        self.scheduler = Scheduler(sc, self.cache, self.allocator, self.context_length)
        self.eos_ids = frozenset(arch.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self.tracks: dict[str, _Track] = {}
        self.steps = 0
        self.prompt_tokens_total = 0  # of finished requests, for the cache hit rate
        self.cached_tokens_total = 0

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
        self.add_request("warm-up", [self.source.arch.bos_token_id or 1] * 4,
                         SamplingParams(max_new_tokens=2, temperature=0))
        while self.has_work:
            self.step()
        self.cache.reset()
        self.steps = self.prompt_tokens_total = self.cached_tokens_total = 0

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> None:
        if rid in self.tracks:
            raise ValueError(f"request id {rid!r} is already in use")
        vocab = self.source.arch.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"request {rid}: token id {bad} is outside the vocabulary [0, {vocab})")
        if top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
        if params.regex or params.json_schema or params.ebnf:
            raise ValueError("constrained decoding (regex / json_schema / ebnf) is not available yet")
        start = logprob_start_len if return_logprob else -1
        req = Request(rid, list(prompt_ids), params, logprob_start_len=start)
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
        )

    def abort(self, rid: str) -> RequestOutput | None:
        track = self.tracks.get(rid)
        if track is None:
            return None
        self.scheduler.finish(track.req, "abort")
        return self._finish_output(track)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return self._drain_finished_without_step()
        self.steps += 1
        logits = self.runner.forward([s.seq for s in scheduled])
        sample_rows: list[int] = []
        samplers: list[Scheduled] = []
        off = 0
        for s in scheduled:
            k = s.seq.num_logits
            track = self.tracks[s.req.rid]
            if track.return_logprob and s.req.wants_input_logprobs:
                self._input_logprobs(track, s, logits[off : off + k - (1 if s.samples else 0)])
            if s.samples:
                sample_rows.append(off + k - 1)
                samplers.append(s)
            off += k
        outputs: list[RequestOutput] = []
        if samplers:
            outputs = self._sample_and_append(logits[sample_rows], samplers)
        self.scheduler.end_step(scheduled)
        outputs += self._drain_finished_without_step(skip={o.rid for o in outputs})
        return outputs

    def _input_logprobs(self, track: _Track, s: Scheduled, rows: torch.Tensor) -> None:
        req = track.req
        if not track.input_logprobs and req.logprob_start_len == 0:
            track.input_logprobs.append((None, req.prompt_ids[0]))
        if rows.shape[0] == 0:
            return
        targets = req.prompt_ids[s.first_logit_pos + 1 : s.first_logit_pos + 1 + rows.shape[0]]
        lp = torch.log_softmax(rows.float(), dim=-1)
        picked = lp[torch.arange(len(targets)), torch.tensor(targets)].tolist()
        track.input_logprobs.extend(zip(picked, targets))

    def _sample_and_append(self, logits: torch.Tensor, samplers: list[Scheduled]) -> list[RequestOutput]:
        tracks = [self.tracks[s.req.rid] for s in samplers]
        params = [t.req.params for t in tracks]
        blocks = [
            sorted(t.eos_ids | set(t.req.params.stop_token_ids))
            if len(t.req.output_ids) < t.req.params.min_new_tokens
            else []
            for t in tracks
        ]
        batch = SamplingBatch.build(
            params,
            [t.req.output_ids for t in tracks],
            [t.generator for t in tracks],
            self.source.arch.vocab_size,
            self.device,
            blocks if any(blocks) else None,
        )
        want_lp = any(t.return_logprob for t in tracks)
        out = sample(logits, batch, [t.top_logprobs_num if t.return_logprob else 0 for t in tracks], want_lp)
        now = time.perf_counter()
        results = []
        for i, (track, tok) in enumerate(zip(tracks, out.token_ids)):
            req = track.req
            req.output_ids.append(tok)
            track.first_token_at = track.first_token_at or now
            if track.return_logprob:
                track.output_logprobs.append((out.logprobs[i], tok))
                if track.top_logprobs_num:
                    track.output_top_logprobs.append([(lp, t) for t, lp in out.top_logprobs[i]])
            results.append(self._advance_text(track, tok))
        return results

    def _advance_text(self, track: _Track, tok: int) -> RequestOutput:
        req = track.req
        p = req.params
        reason: str | None = None
        delta, matched = "", None
        if tok in track.eos_ids or tok in p.stop_token_ids:
            reason, track.matched_stop = "stop", tok
        if reason is None or p.no_stop_trim:  # a matched stop token stays out of the text
            delta, matched = track.stop.feed(track.detok.push([tok]))
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
        return RequestOutput(track.req.rid, delta, ids)

    def _finish_output(self, track: _Track, delta: str = "") -> RequestOutput:
        out = self._output(track, delta)
        out.finished = True
        out.meta = self._meta(track)
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
        }
        if track.return_logprob:
            meta["input_token_logprobs"] = track.input_logprobs
            meta["output_token_logprobs"] = track.output_logprobs
            if track.top_logprobs_num:
                meta["output_top_logprobs"] = track.output_top_logprobs
        return meta

    # -- introspection -------------------------------------------------------------------
    def check_idle_integrity(self) -> None:
        """With no request in flight: nothing locked, every slot free or held by the cache."""
        assert not self.scheduler.has_work and not self.tracks
        self.cache.check_integrity()
        assert self.cache.protected_size() == 0
        assert self.allocator.num_free + self.cache.total_size() == self.allocator.num_slots


def _finish_reason(reason: str | None, matched: str | int | None) -> dict[str, Any]:
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": reason}
