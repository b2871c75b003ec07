"""select() scoring: defined in radixlm.runtime.programs.select (the runtime runs graphs too, and never imports the DSL);
re-exported here for the DSL and for compatibility."""

from radixlm.runtime.programs.select import (
    WINDOW,
    SelectResult,
    divergence,
    run_select,
    score_spans,
)

__all__ = [
    "divergence",
    "run_select",
    "score_spans",
    "SelectResult",
    "WINDOW",
]
