"""StepRun: one step from its forward pass to its outputs.

A step is built by the scheduler, run (its forward pass), drawn (masks and sampling; the tokens
stay on the device, in the model runner's token table, and their copy to the host starts) and
processed (the tokens on the host become outputs). In the plain order the four follow each
other; with the overlap schedule a step is processed during the next one's forward pass, and a
step whose constrained rows follow a token the host has not read yet is drawn after the host has
processed the step before (their masks need the grammars past that token)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from radixlm.runtime.output_processor import RequestOutput
from radixlm.runtime.request import EngineRequest
from radixlm.runtime.scheduler import Scheduled, Status


def _no_tokens() -> list[int]:
    return []


@dataclass
class StepRun:
    """``step``: what the scheduler built; ``samplers``: the requests whose row draws a token,
    ``logits`` their rows (masked once drawn; kept after the draw only when a request wants
    logprobs), ``marks`` each one's forced-token count when the step was built (a jump since
    drops its row); once drawn, ``tokens`` on the device and ``fetch``, which waits for their
    copy on the host; ``ended``: the outputs of the requests it ended (faults), until taken;
    ``checks``: the requests whose draft it checks, with the draft, and ``check_fetch``, which
    waits for the model's greedy token at each of their rows (speculative decoding)."""

    step: list[Scheduled]
    samplers: list[EngineRequest] = field(default_factory=list)
    logits: torch.Tensor | None = None
    marks: list[int] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    fetch: Callable[[], list[int]] = _no_tokens
    ended: list[RequestOutput] = field(default_factory=list)
    checks: list[tuple[EngineRequest, tuple[int, ...]]] = field(default_factory=list)
    check_fetch: Callable[[], list[int]] = _no_tokens
    check_logits: torch.Tensor | None = None  # their rows, when one wants logprobs

    def drawn(self, samplers: list[EngineRequest], tokens: torch.Tensor, fetch: Callable[[], list[int]],
              logits: torch.Tensor | None) -> None:
        """Record the draw: the requests that drew, their tokens, the wait for them on the host."""
        self.samplers, self.tokens, self.fetch, self.logits = samplers, tokens, fetch, logits

    def take_ended(self) -> list[RequestOutput]:
        """The outputs of the requests it ended (each is reported once, at once)."""
        ended, self.ended = self.ended, []
        return ended

    @property
    def live(self) -> bool:
        """Whether processing it still tells a request something: one drew and has not finished since."""
        return any(r.status is not Status.FINISHED for r in [*self.samplers, *(r for r, _ in self.checks)])
