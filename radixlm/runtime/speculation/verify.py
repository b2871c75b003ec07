"""Checking drafts: which requests draft, and what a checked draft adds to a request.

A draft is checked in the request's next decode: the newest token and the k guessed ones are fed
together (logits for each), so the model's greedy token at every position comes from one forward
pass. The guesses up to the first one the model disagrees with are accepted, then the model's own
token at that position: 1 to k + 1 tokens a pass, exactly what greedy decoding gives one at a
time. The KV written for rejected guesses is freed before the tokens are appended, so nothing of
a wrong guess stays (a guess taken from another request's text is only ever checked, never
output unless the model produces it itself).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixlm.runtime.output_processor import OutputProcessor, RequestOutput
from radixlm.runtime.request import EngineRequest
from radixlm.runtime.sampling.sampler import with_logprobs
from radixlm.runtime.scheduler import Scheduler, Status
from radixlm.runtime.speculation.drafts import DraftLength, DraftProposer


def may_draft(req: EngineRequest) -> bool:
    """Whether a request's next tokens may come from a checked draft: greedy, and its next token
    depends only on the model's argmax (no grammar, penalty, bias or min_new_tokens block)."""
    p = req.params
    return (req.matcher is None and p.is_greedy and not p.penalizes_output and not p.logit_bias
            and req.generated >= p.min_new_tokens)


def propose_drafts(running: Sequence[EngineRequest], proposer: DraftProposer) -> None:
    """Each greedy decoding request's guess of its next tokens (``Request.draft``), checked in its
    next step; the others' drafts are cleared."""
    for req in running:
        req.draft = []
        if req.is_decoding and not req.unseen and may_draft(req):
            if req.spec is None:
                req.spec = DraftLength(proposer.most)
            limit = min(req.spec.allowed(), req.remaining_new_tokens() - 1, proposer.context_length - req.fill_len - 1)
            req.draft = proposer.propose(req.fill_ids, req.lookup, limit)


def accepted_length(draft: Sequence[int], greedy: Sequence[int]) -> int:
    """How many leading guesses the model's greedy tokens confirm."""
    n = 0
    while n < len(draft) and draft[n] == greedy[n]:
        n += 1
    return n


def accept_drafts(checks: list[tuple[EngineRequest, tuple[int, ...]]], greedy: list[int], scheduler: Scheduler,
                  output: OutputProcessor, logits: torch.Tensor | None = None) -> list[RequestOutput]:
    """Each checked request's new tokens (``greedy``: the model's token at each row of the checks,
    in order), one output each; stops and finishing as for tokens drawn one at a time. ``logits``:
    the checks' rows, when a request wants logprobs (each accepted token's, from its own row)."""
    outputs: list[RequestOutput] = []
    at = 0
    for req, draft in checks:
        mine, start, at = greedy[at : at + len(draft) + 1], at, at + len(draft) + 1
        if req.status is not Status.RUNNING:  # (ended meanwhile: an abort, a fault)
            continue
        n = accepted_length(draft, mine)
        assert req.spec is not None
        req.spec.record(len(draft), n)
        scheduler.rewind(req, req.fill_len + n)  # KV of the newest token and the accepted guesses stays
        tokens = mine[: n + 1]  # (the accepted guesses are the model's own tokens there)
        lps: list[float] | None = None
        tops: list[list[tuple[int, float]]] | None = None
        if req.return_logprob and logits is not None:
            got = with_logprobs(logits[start : start + n + 1], tokens, torch.tensor(tokens, device=logits.device),
                                req.top_logprobs_num, True)
            lps, tops = got.logprobs, got.top_logprobs
        out: RequestOutput | None = None
        for i, tok in enumerate(tokens):
            [step] = output.append([req], [tok], None if lps is None else [lps[i]],
                                   None if tops is None else [tops[i]])
            out = step if out is None else _merged(out, step)
            if out.finished:
                break
        assert out is not None
        outputs.append(out)
    return outputs


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output for a request's tokens of one step (no jumps here: nothing is replaced)."""
    then.text_delta = first.text_delta + then.text_delta
    then.token_ids_delta = first.token_ids_delta + then.token_ids_delta
    return then
