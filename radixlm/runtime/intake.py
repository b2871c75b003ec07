"""Request intake: what one completion to run is, as it reaches the engine core.

A `Submission` is built once at the edge (the in-process Engine or the HTTP server), from
prompts x n x a session turn by `submissions`, and travels typed to `EngineCore.add_request`
(across the engine-process boundary too: the server sends the Submission itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.scheduler.request import ProgramTag
from radixlm.runtime.sessions import SessionParams

SESSION_TURN_ERROR = "a session turn is one prompt with n=1; send the others as separate turns"


def check_token_ids(rid: str, prompt_ids: Sequence[int], params: SamplingParams, vocab: int) -> None:
    """Raise ValueError naming the first token id of the prompt, stop_token_ids or logit_bias
    outside the vocabulary [0, vocab) (a stop token out of it, blocked as an end token before
    min_new_tokens, would fail a whole step)."""
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"request {rid}: token id {bad} is outside the vocabulary [0, {vocab})")
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab})")


@dataclass(frozen=True)
class Submission:
    """One completion: its id, prompt token ids, parsed sampling parameters, logprob options,
    and, for a session turn, which turn it continues (its prompt_ids are then the new turn's)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    session: SessionParams | None = None
    program: ProgramTag | None = None  # the program it belongs to (program-aware scheduling)
    # False: its caller reads only the finished output, so an engine process sends that alone
    # (radixlm.runtime.server.held_outputs); the in-process Engine ignores it
    stream: bool = True


@dataclass(frozen=True)
class PromptRequest:
    """One prompt of a request with its options, before its n completions are made; ``rid`` is
    the id its caller knows it by (its copies are ``rid-0``, ``rid-1``, ... when n > 1)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    program: ProgramTag | None = None


def submissions(prompts: Sequence[PromptRequest], session: SessionParams | None = None) -> list[list[Submission]]:
    """The completions of each prompt (prompt-major order): n copies, each with n = 1; copies of a
    seeded request get seeds seed+i, so each is its own sample yet reproducible. A session turn is
    one prompt with n = 1 (ValueError otherwise)."""
    if session is not None and (len(prompts) != 1 or prompts[0].params.n != 1):
        raise ValueError(SESSION_TURN_ERROR)
    return [_copies(p, session) for p in prompts]


def _copies(p: PromptRequest, session: SessionParams | None) -> list[Submission]:
    n = p.params.n
    if n == 1:
        return [Submission(p.rid, p.prompt_ids, p.params, p.return_logprob, p.logprob_start_len,
                           p.top_logprobs_num, session, p.program)]
    out = []
    for i in range(n):
        seed = None if p.params.seed is None else p.params.seed + i
        params = dataclasses.replace(p.params, n=1, seed=seed)
        out.append(Submission(f"{p.rid}-{i}", p.prompt_ids, params, p.return_logprob, p.logprob_start_len,
                              p.top_logprobs_num, program=p.program))
    return out
