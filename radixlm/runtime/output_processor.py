"""Output processing, the last phase of a step: each sampled token becomes text and an output.

Per token: the grammar accepts it (and may jump over forced text), the detokenizer and stop
matcher turn it into text, logprobs are recorded, and the scheduler says whether the request
is finished (by a stop, or by length); a finished request gets its totals (`meta`).

The processor only reads the scheduler: what it decides for the scheduler (a `Finish`, a
`Rewind` of the KV a jump replaced) goes to the engine core's `apply`, at once, so the
requests processed after it in the same step see it applied.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.constrained.jump_forward import JumpPolicy
from radixlm.runtime.constrained.stage import GrammarStage
from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.faults import FaultBoundary
from radixlm.runtime.request import EngineRequest
from radixlm.runtime.scheduler import Scheduler, Status
from radixlm.runtime.stop import StopRegexTimeout


@dataclass
class RequestOutput:
    """What one request gained in a step (deltas), plus its totals once finished.

    ``replace_from``: jump-forward re-tokenized output tokens already reported; drop the output
    ids from this index on before appending ``token_ids_delta`` (text is only ever appended).
    ``meta``: the totals once finished; before that, a logprob request's logprobs of the new tokens.
    ``error``: the request failed (its constraint did not compile, its grammar engine failed,
    or a fault was raised on its behalf); it is finished. ``internal``: the fault was the
    engine's, not the request's input (HTTP 500 ``internal_error`` rather than 400).
    """

    rid: str
    text_delta: str
    token_ids_delta: list[int]
    finished: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    replace_from: int | None = None
    error: str | None = None
    internal: bool = False

    def apply_ids(self, ids: list[int]) -> None:
        """Bring a list of this request's output ids up to date with this output."""
        if self.replace_from is not None:
            del ids[self.replace_from :]
        ids.extend(self.token_ids_delta)


@dataclass(frozen=True)
class Finish:
    """End the request: the scheduler releases what it holds (``keep_in_cache`` False: its KV
    beyond the cached prefix is freed, not cached)."""

    reason: str
    keep_in_cache: bool = True


@dataclass(frozen=True)
class Rewind:
    """Drop the request's KV of positions >= ``length`` (jump-forward replaced their tokens)."""

    length: int


Decision = Finish | Rewind


@dataclass
class Totals:
    """Prompt tokens of finished requests and how many of them came from the cache."""

    prompt_tokens: int = 0
    cached_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any, scheduler: Scheduler, grammar: GrammarStage, context_length: int,
                 on_finish: Callable[[EngineRequest], dict[str, Any]], jump_policy: JumpPolicy,
                 apply: Callable[[EngineRequest, Decision], None], faults: FaultBoundary | None = None) -> None:
        """``scheduler``: read only (end reasons, how many requests run); ``on_finish``: called
        once per finished request, returns extra meta (its session turn); ``jump_policy``: when a
        jump over forced text pays (the engine measures it at start-up); ``apply``: carries out a
        decision for the scheduler; ``faults``: where a fault in one request's output processing
        is contained."""
        self.faults = faults or FaultBoundary()
        self.jump_policy = jump_policy
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.grammar = grammar
        self.context_length = context_length
        self.on_finish = on_finish
        self.apply = apply
        self.totals = Totals()

    def append(self, reqs: list[EngineRequest], tokens: list[int], logprobs: list[float] | None = None,
               top_logprobs: list[list[tuple[int, float]]] | None = None) -> list[RequestOutput]:
        """Each request's sampled token: grammar, text, stops, finishing."""
        now = time.perf_counter()
        results = []
        constrained = [i for i, r in enumerate(reqs) if r.matcher is not None]
        accepted = dict(zip(constrained, self.grammar.accept_all([reqs[i] for i in constrained],
                                                                 [tokens[i] for i in constrained]))) if constrained else {}
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            req.output_ids.append(tok)
            took = accepted.get(i, True)
            if took is not True:  # refused: the request ends as aborted, without an error (as a sampler slip would)
                error = self.grammar.engine_error("accepting a token", took) if isinstance(took, Exception) else ""
                results.append(self.fail(req, error))
                continue
            try:
                self.faults.check("accept", [req.rid])
                req.first_token_at = req.first_token_at or now
                if req.return_logprob and logprobs is not None:
                    req.output_logprobs.append((logprobs[i], tok))
                    if req.top_logprobs_num and top_logprobs is not None:
                        req.output_top_logprobs.append([(lp, t) for t, lp in top_logprobs[i]])
                results.append(self._advance(req, tok))
            except StopRegexTimeout as e:  # a pattern too slow to search ends its request only (its input's fault)
                results.append(self.fail(req, str(e)))
            except Exception as e:  # noqa: BLE001 - a fault on this request's behalf ends it alone
                results.append(self.fail(req, self.faults.contain(req.rid, "output processing", e), internal=True))
        return results

    def _advance(self, req: EngineRequest, tok: int) -> RequestOutput:
        p = req.params
        delta = ""
        if tok in req.eos_ids or tok in p.stop_token_ids:
            req.matched_stop = tok
        if req.matched_stop is None or p.no_stop_trim:  # a matched stop token stays out of the text
            self.faults.check("detokenize", [req.rid])
            text = req.detok.push([tok])
            self.faults.check("stop", [req.rid])
            delta, matched = req.stop.feed(text)
            if req.matched_stop is None and matched is None and req.matcher is not None:
                try:
                    forced, matched, done = self._grammar_advance(req)
                except StopRegexTimeout:
                    raise
                except Exception as e:  # noqa: BLE001 - a grammar-engine failure ends its request only
                    return self.fail(req, self.grammar.engine_error("jumping forward", e))
                delta += forced
                if done:
                    req.matched_stop = self.grammar.stop_id
            if matched is not None:
                req.matched_stop = matched
        reason = self.scheduler.end_reason(req)
        if reason is not None and not isinstance(req.matched_stop, str):  # the stream ends: release held text
            tail, matched = req.stop.feed(req.detok.flush())
            delta += tail
            if matched is None:
                delta += req.stop.flush()
                matched = req.stop.matched
            if matched is not None:
                req.matched_stop, reason = matched, "stop"
        req.text += delta
        if reason is None:
            return self._output(req, delta)
        self.apply(req, Finish(reason))
        return self.finish(req, delta)

    def start(self, req: EngineRequest) -> RequestOutput | None:
        """A constrained request about to join the scheduler: the text its grammar forces at the
        start becomes output tokens that its prompt's prefill computes too, one forward pass less
        than sampling the first of them and jumping after it. Returns the output that carries the
        text (or ends the request: a grammar engine failure, a stop string inside the text), or
        None. Not while the jump policy allows no jumps at all (``jump_forward_max_running``)."""
        if self.jump_policy.min_gain(len(self.scheduler.running) + 1) is None:
            return None
        # room for one sampled token after the forced ones
        limit = min(req.params.max_new_tokens, self.context_length - len(req.prompt_ids)) - 1
        try:
            jump = self.grammar.jump_at_start(req, limit)
        except Exception as e:  # noqa: BLE001 - a grammar-engine failure ends its request only
            return self.end_unscheduled(req, "abort", error=self.grammar.engine_error("jumping forward", e))
        if jump is None:
            return None
        try:
            text, matched = self._apply_jump(req, jump.keep, list(jump.new_ids), jump.text)
        except StopRegexTimeout as e:  # a stop regex too slow on the forced text: its input's fault
            return self.end_unscheduled(req, "abort", error=str(e))
        if matched is not None:
            req.matched_stop = matched
            return self.end_unscheduled(req, "stop", text)
        req.text += text
        return self._output(req, text)

    def end_unscheduled(self, req: EngineRequest, reason: str, delta: str = "", error: str = "") -> RequestOutput:
        """End a request the scheduler never took (its grammar failed to compile, or ended it)."""
        req.status, req.finish_reason = Status.FINISHED, reason
        req.text += delta
        out = self.finish(req, delta)
        out.error = error or None
        return out

    def _grammar_advance(self, req: EngineRequest) -> tuple[str, str | None, bool]:
        """Jump over forced text. Returns (text added, stop string matched in it, whether the
        grammar is complete and allows nothing but a stop token)."""
        limit = min(req.params.max_new_tokens, self.context_length - len(req.prompt_ids))
        floor = max(req.tree_len - len(req.prompt_ids), 0)
        step = self.grammar.after_token(req, limit, floor, self.jump_policy.min_gain(len(self.scheduler.running)))
        text, matched = "", None
        if step.jump is not None:
            text, matched = self._apply_jump(req, step.jump.keep, list(step.jump.new_ids), step.jump.text)
        return text, matched, matched is None and step.done

    def _apply_jump(self, req: EngineRequest, keep: int, new_ids: list[int], text: str) -> tuple[str, str | None]:
        self.faults.check("jump", [req.rid])
        del req.output_ids[keep:]
        req.output_ids.extend(new_ids)
        self.apply(req, Rewind(len(req.prompt_ids) + keep))
        req.forced_tokens += len(new_ids)
        if req.return_logprob:  # forced tokens have probability 1 under the constraint
            del req.output_logprobs[keep:]
            req.output_logprobs.extend((0.0, t) for t in new_ids)
            if req.top_logprobs_num:
                del req.output_top_logprobs[keep:]
                req.output_top_logprobs.extend([(0.0, t)] for t in new_ids)
        if keep < req.sent_tokens:
            req.sent_tokens = keep
            req.replace_from = keep if req.replace_from is None else min(req.replace_from, keep)
        p = req.params
        req.detok = IncrementalDetokenizer(
            self.tokenizer, p.skip_special_tokens, p.spaces_between_special_tokens, req.fill_ids[-4:]
        )
        return req.stop.feed(text)

    def _output(self, req: EngineRequest, delta: str) -> RequestOutput:
        start = req.sent_tokens
        ids = req.output_ids[start:]
        req.sent_tokens = len(req.output_ids)
        out = RequestOutput(req.rid, delta, ids, replace_from=req.replace_from)
        if req.return_logprob and ids:  # a streaming client gets the new tokens' logprobs with them
            out.meta = {"output_token_logprobs": req.output_logprobs[start:]}
            if req.top_logprobs_num:
                out.meta["output_top_logprobs"] = req.output_top_logprobs[start:]
        req.replace_from = None
        return out

    def fail(self, req: EngineRequest, error: str, internal: bool = False) -> RequestOutput:
        """End req as aborted; a non-empty ``error`` is reported to its caller. ``internal``: a
        fault raised on its behalf, so its KV of the step is not cached (it may not match its
        tokens) and a failure of its last output is contained too."""
        self.apply(req, Finish("abort", keep_in_cache=not internal))
        req.status, req.finish_reason = Status.FINISHED, req.finish_reason or "abort"
        try:
            out = self.finish(req)
        except Exception as e:  # noqa: BLE001 - its totals are lost, its caller still hears of it
            if not internal:
                raise
            self.faults.contain(req.rid, "finishing", e)
            self.grammar.forget(req.rid)
            out = RequestOutput(req.rid, "", [], finished=True, meta={"id": req.rid, "finish_reason": {"type": "abort"}})
        out.error = error or None
        out.internal = internal and out.error is not None
        return out

    def finish(self, req: EngineRequest, delta: str = "") -> RequestOutput:
        """The last output of a finished request, with its totals."""
        self.faults.check("finish", [req.rid])
        out = self._output(req, delta)
        out.finished = True
        out.meta = self._meta(req)
        out.meta.update(self.on_finish(req))
        self.grammar.forget(req.rid)
        return out

    def _meta(self, req: EngineRequest) -> dict[str, Any]:
        self.totals.prompt_tokens += len(req.prompt_ids)
        self.totals.cached_tokens += req.cached_tokens
        now = time.perf_counter()
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": _finish_reason(req.finish_reason, req.matched_stop),
            "e2e_latency": now - req.created,
            "ttft": (req.first_token_at - req.created) if req.first_token_at else None,
            "retractions": req.retractions,
            "forward_passes": req.forward_passes,
        }
        if req.matcher is not None:
            meta["forced_tokens"] = req.forced_tokens
        if req.spec is not None:  # speculative decoding: drafts checked, and the tokens accepted of each
            meta["spec_verify_ct"] = req.spec.verified
            meta["spec_accept_lengths"] = list(req.spec.history)
        if req.return_logprob:
            meta["input_token_logprobs"] = req.input_logprobs
            meta["output_token_logprobs"] = req.output_logprobs
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = req.output_top_logprobs
        return meta


def _finish_reason(reason: str | None, matched: str | int | None) -> dict[str, Any]:
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": reason}
