"""Where the step loop's time goes: seconds summed by phase."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

# Where the step loop's time goes (EngineCore.step_seconds, /get_server_info): picking the work,
# the forward pass (its launch on CUDA), masks and sampling, waiting for the tokens on the host,
# making outputs; and, in the engine process, taking in messages and sending outputs.
STEP_PHASES = ("schedule", "forward", "sample", "wait", "process", "intake", "send")


class PhaseClock:
    """Seconds by phase (`seconds`, read by /get_server_info); `with clock("forward"): ...`
    adds the block's time to its phase (a block that raises adds none)."""

    def __init__(self, phases: Iterable[str]) -> None:
        self.seconds = dict.fromkeys(phases, 0.0)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[phase] += time.perf_counter() - start

    def reset(self) -> None:
        """Zero every phase (in place: holders of `seconds` see it)."""
        for phase in self.seconds:
            self.seconds[phase] = 0.0
