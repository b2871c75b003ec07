"""SamplingStage: a step's masking and sampling, and the logprobs of what it drew.

Each runs inside the step's fault boundary: when the batch raises, its rows go alone and a
request whose row raises alone fails (`fail`, an internal error); a request whose grammar
engine fails ends without one (`refuse`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from radixlm.runtime.constrained.stage import GrammarStage
from radixlm.runtime.faults import FaultBoundary
from radixlm.runtime.output_processor import RequestOutput
from radixlm.runtime.request import EngineRequest
from radixlm.runtime.sampling.sampler import (
    RowGenerator,
    SamplingBatch,
    make_generator,
    sample_tokens,
    token_logprobs,
    with_logprobs,
)
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler import Scheduled

Logprobs = tuple[list[float] | None, list[list[tuple[int, float]]] | None]


class SamplingStage:
    def __init__(self, grammar: GrammarStage, faults: FaultBoundary, vocab_size: int, device: torch.device,
                 fail: Callable[[EngineRequest, str, BaseException], RequestOutput],
                 refuse: Callable[[EngineRequest, str], RequestOutput]) -> None:
        """``fail(req, phase, error)``: end a request after a fault raised on its behalf;
        ``refuse(req, error)``: end a request whose grammar engine failed."""
        self.grammar = grammar
        self.faults = faults
        self.vocab_size = vocab_size
        self.device = device
        self.fail = fail
        self.refuse = refuse

    def batch(self, reqs: list[EngineRequest]) -> SamplingBatch:
        """The step's sampling parameters, with the min_new_tokens blocks of its requests (their
        outputs counted with the tokens still on the device)."""
        blocks = [  # a grammar, not min_new_tokens, decides where constrained output may end
            sorted(r.eos_ids | set(r.params.stop_token_ids))
            if r.generated < r.params.min_new_tokens and r.matcher is None else []
            for r in reqs
        ]
        return SamplingBatch.build([r.params for r in reqs], [r.output_ids for r in reqs],
                                   [r.generator for r in reqs], self.vocab_size, self.device,
                                   blocks if any(blocks) else None)

    def sample(self, logits: torch.Tensor, reqs: list[EngineRequest],
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
            ended.append(self.fail(reqs[i], "sampling", e))

        with torch.inference_mode():  # the forward's logits are inference tensors; masks write them in place
            kept, parts = self.faults.isolate(range(len(reqs)), run, fault)
        failed = {id(req): error for part in parts for req, error in part[0]}
        ended.extend(self.refuse(req, failed[id(req)]) for req in reqs if id(req) in failed)
        tokens = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts]) if parts else logits[:0, 0].long()
        if len(kept) < len(reqs):
            logits = logits[kept]
        return [reqs[i] for i in kept], logits, tokens

    def _mask_and_sample(self, logits: torch.Tensor,
                         reqs: list[EngineRequest]) -> tuple[list[tuple[EngineRequest, str]], torch.Tensor]:
        """Mask the constrained rows and draw a token per row; the rows whose mask can wait are
        drawn first and masked (and drawn again) only if their grammar forbids that token.
        Returns the requests whose grammar engine failed, with the error, and the tokens."""
        rids = [r.rid for r in reqs]
        self.faults.check("mask", rids)
        lazy = self.grammar.unmasked_rows(logits, reqs)
        failed = self.grammar.mask(logits, reqs, skip=lazy)
        batch = self.batch(reqs)
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
            tokens[redo] = sample_tokens(sub, self.batch(again))
        return failed, tokens

    def output_logprobs(self, logits: torch.Tensor, samplers: list[EngineRequest], ids: list[int],
                        tokens: torch.Tensor, ended: list[RequestOutput]) -> Logprobs:
        """The sampled tokens' logprobs (and top logprobs) of a run's rows; a request whose row
        raises alone fails (its entries are then placeholders nobody reads)."""
        nums = [r.top_logprobs_num if r.return_logprob else 0 for r in samplers]

        def rows(idx: Sequence[int]) -> Logprobs:
            self.faults.check("logprobs", [samplers[i].rid for i in idx])
            if len(idx) == len(samplers):
                out = with_logprobs(logits, ids, tokens, nums, True)
            else:
                at = list(idx)
                out = with_logprobs(logits[at], [ids[i] for i in at], tokens[at], [nums[i] for i in at], True)
            return out.logprobs, out.top_logprobs

        def fault(i: int, e: BaseException) -> None:
            ended.append(self.fail(samplers[i], "logprobs", e))

        kept, parts = self.faults.isolate(range(len(samplers)), rows, fault)
        if len(kept) == len(samplers):
            return parts[0]
        lps: list[float] = [0.0] * len(samplers)
        tops: list[list[tuple[int, float]]] = [[] for _ in samplers]
        for i, (lp, top) in zip(kept, parts):
            lps[i] = lp[0] if lp is not None else 0.0
            tops[i] = top[0] if top is not None else []
        return lps, tops


def add_input_logprobs(req: EngineRequest, s: Scheduled, rows: torch.Tensor) -> None:
    """Append the logprobs of the prompt tokens that ``rows`` (the step's logits of ``s``) predict."""
    if not req.input_logprobs and req.logprob_start_len == 0:
        req.input_logprobs.append((None, req.prompt_ids[0]))
    targets = req.prompt_ids[s.first_logit_pos + 1 : s.first_logit_pos + 1 + rows.shape[0]]
    if targets:  # (none for a one-token prompt scored with max_new_tokens=0)
        req.input_logprobs.extend(zip(token_logprobs(rows, targets), targets))


def request_generator(params: SamplingParams) -> RowGenerator | None:
    """A sampled request's generator (None: greedy), seeded with its own seed or one drawn from
    torch's default CPU generator (so `torch.manual_seed` makes unseeded runs repeatable)."""
    if params.is_greedy:
        return None
    return make_generator(params.seed if params.seed is not None else int(torch.randint(0, 1 << 62, (1,)).item()))
