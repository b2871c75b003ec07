"""EngineRequest: one request from admission to finish, the one object every phase of a step uses.

The scheduler sees it as its `Request` (token ids, params, KV bookkeeping); the fields added
here (text, stop matching, the request's random draws, logprobs, grammar state, timing) belong
to the engine's output processing and grammar stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.scheduler import Request
from radixlm.runtime.stop import StopMatcher

if TYPE_CHECKING:
    from radixlm.runtime.constrained.grammar import GrammarMatcher
    from radixlm.runtime.sampling.sampler import RowGenerator


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
    # timing
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    forward_passes: int = 0

    @property
    def constrained(self) -> bool:
        return self.matcher is not None
