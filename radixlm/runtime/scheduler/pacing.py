"""What the engine's steps cost, measured as they run, and the prompt work they may take.

A step is modeled as a fixed part, the time of a step of decodes alone (on a small batch,
mostly reading the weights), plus a cost for each prompt token fed on top of it. Both are
moving averages of the steps just measured, so they follow the model, the device, the depth of
the prompt in flight and the load of the machine: no constant in here is a property of one
device. On a GPU a prompt token costs a small fraction of a decode step; on a 2-core CPU, where
a prompt is bound by arithmetic, ~1/3 of one (SmolLM2-135M, docs/benchmarks.md).

Two uses (config: ``prefill_step_seconds``, ``decode_slowdown``):
- ``tokens_within(s)``: how many prompt tokens keep a step within ``s`` seconds.
- A credit that lets pieces of long prompts slow running decodes by at most ``slowdown`` times
  on average: each step of decodes earns ``(slowdown - 1)`` decode steps' time and pays the time
  its prompt tokens added; while the credit is negative, pieces of long prompts wait.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.3  # the newest step's weight in the moving averages


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


@dataclass
class StepCosts:
    slowdown: float  # 0: no limit on the decodes' slowdown
    decode_s: float | None = None  # a step of decodes alone (None: none measured yet)
    token_s: float | None = None  # each prompt token a step feeds on top of that
    credit: float = 0.0  # seconds of prompt work the decodes may still take on; < 0: pieces wait

    def observe(self, seconds: float, prompt_tokens: int, decodes: int) -> None:
        """A step took ``seconds``: it fed ``prompt_tokens`` prompt tokens (prompt pieces, a jump's
        forced tokens) and ``decodes`` decode rows."""
        extra = 0.0
        if prompt_tokens:
            extra = max(seconds - (self.decode_s or 0.0), 0.0)
            self.token_s = _average(self.token_s, extra / prompt_tokens)
        elif decodes:
            self.decode_s = _average(self.decode_s, seconds)
        if decodes and self.slowdown and self.decode_s is not None:
            allowance = (self.slowdown - 1) * self.decode_s
            self.credit = min(self.credit + allowance - extra, allowance)

    @property
    def pieces_may_run(self) -> bool:
        """Whether a step of running decodes may also take pieces of long prompts now."""
        return not self.slowdown or self.credit >= 0

    def tokens_within(self, seconds: float) -> int | None:
        """Prompt tokens a step is expected to feed within ``seconds`` (beside a step's fixed part);
        None while no prompt was measured, or when prompt tokens measured free (a frozen clock)."""
        if not self.token_s:
            return None
        return max(int((seconds - (self.decode_s or 0.0)) / self.token_s), 0)
