"""EngineRequest: one request from admission to finish, the one object every phase of a step uses.

The scheduler sees it as its `Request` (token ids, params, KV bookkeeping); the fields added
here (text, stop matching, the request's random draws, logprobs, grammar state, timing) belong
to the engine's output processing and grammar stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.scheduler import Request
from radixlm.runtime.speculation.drafts import DraftLength, PromptLookup
from radixlm.runtime.stop import StopMatcher

if TYPE_CHECKING:
    from radixlm.runtime.constrained.grammar import GrammarMatcher
    from radixlm.runtime.intake import Submission
    from radixlm.runtime.sampling.sampler import RowGenerator
    from radixlm.runtime.sampling_params import SamplingParams


@dataclass(eq=False, kw_only=True)
class EngineRequest(Request):
    detok: IncrementalDetokenizer
    stop: StopMatcher
    eos_ids: frozenset[int]  # tokens that end the output (empty with ignore_eos)
    generator: RowGenerator | None = None  # its draws, when it samples
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # output so far
    text: str = ""
    sent_tokens: int = 0  # output ids already reported
    replace_from: int | None = None  # reported ids that jump-forward re-tokenized, to report again
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    output_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # grammar
    matcher: GrammarMatcher | None = None
    jump_forward: bool = False
    forced_tokens: int = 0  # output tokens that jump-forward appended
    # speculative decoding: its own tokens indexed for drafts, and how long its drafts may be
    lookup: PromptLookup = field(default_factory=PromptLookup)
    spec: DraftLength | None = None
    # timing
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    forward_passes: int = 0

    @property
    def constrained(self) -> bool:
        return self.matcher is not None

    @classmethod
    def start(cls, sub: Submission, prompt_ids: list[int], params: SamplingParams, tokenizer: Any,
              eos_ids: frozenset[int], generator: RowGenerator | None, jump_forward: bool) -> EngineRequest:
        """The request a submission starts (``prompt_ids`` and ``params``: a session turn's, with
        its history), its text and stops empty, its draws from ``generator``."""
        return cls(
            rid=sub.rid, prompt_ids=prompt_ids, params=params,
            logprob_start_len=sub.logprob_start_len if sub.return_logprob else -1,
            detok=IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens,
                                         prompt_ids[-4:]),
            stop=StopMatcher(params.stop, keep_stop=params.no_stop_trim, regexes=params.stop_regex),
            eos_ids=frozenset() if params.ignore_eos else eos_ids, generator=generator,
            return_logprob=sub.return_logprob, top_logprobs_num=sub.top_logprobs_num,
            jump_forward=jump_forward, program=sub.program,
        )
