"""Request intake: what one completion to run is, as it reaches the engine core.

A `Submission` is built once at the edge (the in-process Engine or the HTTP server), from
prompts x n x a session turn, and travels typed to `EngineCore.add_request` (across the
engine-process boundary too).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.sessions import SessionParams


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
