"""DSL programs the server tests run both ways (step by step over /generate, and /run_program)."""

from __future__ import annotations

import radixlm as rl


@rl.function
def forked(s, select: bool = True):
    """A gen, a fork of two branches (each a gen), then a select: two requests run at once (and
    the select scores its choices' prompts in one request, unless ``select`` is False)."""
    s += "List two fruits:" + rl.gen("first", max_tokens=4, ignore_eos=True)
    f = s.fork(2)
    for i, b in enumerate(f):
        b += f"\n{i}." + rl.gen("fruit", max_tokens=3, ignore_eos=True)
    f.join()
    if select:
        s += "\nDone:" + rl.select("done", choices=[" yes", " no"])
