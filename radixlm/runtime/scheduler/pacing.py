"""What the engine's steps cost, measured as they run, and the prompt work they may take.

A step is modeled as a fixed part, the time of a step of decodes alone (on a small batch,
mostly reading the weights), plus a cost for each prompt token fed on top of it. Both are the
median of the last few steps measured, so they follow the model, the device, the depth of the
prompt in flight, the batch and the machine's load, and one step slowed from outside (another
process on the cores) moves neither: no constant in here is a property of one device. On a GPU
a prompt token costs a small fraction of a decode step; on a CPU, where a prompt is bound by
arithmetic, a sizable fraction of one (docs/machines.md).

Two uses (config: ``prefill_step_seconds``, ``decode_slowdown``):
- ``tokens_within(s)``: how many prompt tokens keep a step within ``s`` seconds.
- A credit that lets pieces of long prompts slow running decodes by at most ``slowdown`` times
  on average: each step of decodes earns ``(slowdown - 1)`` times the fixed part and pays what
  its prompt tokens cost; while the credit is negative, pieces of long prompts wait. What is owed
  is owed to the decodes running: a step with none forgives it.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# The last few measurements of each kind are kept, and their median believed: on a loaded machine
# one step can take hundreds of times its neighbours' time, and charged as measured it would hold
# the pieces back for seconds (docs/machines.md).
WINDOW = 4
# While decodes run beside pieces of a long prompt, a step of decodes alone is measured at least
# this often (the pieces wait one step), so the fixed part follows the batch.
REFRESH_STEPS = 32


def _window() -> deque[float]:
    return deque(maxlen=WINDOW)


@dataclass
class StepCosts:
    slowdown: float  # 0: no limit on the decodes' slowdown
    decode_times: deque[float] = field(default_factory=_window)  # steps of decodes alone
    token_times: deque[float] = field(default_factory=_window)  # a prompt token, beside the fixed part
    credit: float = 0.0  # seconds of prompt work the decodes may still take on; < 0: pieces wait
    since_decode: int = 0  # steps with prompt tokens since the last step of decodes alone

    @property
    def decode_s(self) -> float | None:
        """A step of decodes alone (None: none measured yet)."""
        return statistics.median(self.decode_times) if self.decode_times else None

    @property
    def token_s(self) -> float | None:
        """Each prompt token a step feeds on top of the fixed part (None: none measured yet)."""
        return statistics.median(self.token_times) if self.token_times else None

    def observe(self, seconds: float, prompt_tokens: int, decodes: int) -> None:
        """A step took ``seconds``: it fed ``prompt_tokens`` prompt tokens (prompt pieces, a jump's
        forced tokens) and ``decodes`` decode rows."""
        if prompt_tokens:
            # (before the fixed part is known, or no longer than it, a step says nothing of the tokens)
            extra = seconds - (self.decode_s if self.decode_s is not None else seconds)
            if extra > 0:
                self.token_times.append(extra / prompt_tokens)
            self.since_decode += 1
        elif decodes:
            self.decode_times.append(seconds)
            self.since_decode = 0
        if not decodes:
            self.credit = max(self.credit, 0.0)
            return
        decode_s, token_s = self.decode_s, self.token_s
        if self.slowdown and decode_s is not None:
            allowance = (self.slowdown - 1) * decode_s  # (also the most saved up)
            self.credit = min(self.credit + allowance - prompt_tokens * (token_s or 0.0), allowance)

    @property
    def pieces_may_run(self) -> bool:
        """Whether a step of running decodes may also take pieces of long prompts now: not while
        the decodes are owed time, nor when a step of decodes alone is due to be measured (fewer
        than WINDOW measured yet, or none for REFRESH_STEPS steps)."""
        if not self.slowdown:
            return True
        due = len(self.decode_times) < WINDOW or self.since_decode >= REFRESH_STEPS
        return not due and self.credit >= 0

    def tokens_within(self, seconds: float) -> int | None:
        """Prompt tokens a step is expected to feed within ``seconds`` (beside its fixed part);
        None while no prompt token was measured."""
        token_s = self.token_s
        if token_s is None:
            return None
        return max(int((seconds - (self.decode_s or 0.0)) / token_s), 0)
