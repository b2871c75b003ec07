"""The IR's executor: defined in radixlm.runtime.programs.executor (the runtime runs graphs too, and never imports the DSL);
re-exported here for the DSL and for compatibility."""

from radixlm.runtime.programs.executor import (
    RunContext,
    SessionLink,
    SessionTurns,
    execute,
    failed_at,
    gather_all,
    plain_spans,
    run_branch,
    run_sequence,
)

__all__ = [
    "execute",
    "failed_at",
    "gather_all",
    "plain_spans",
    "run_branch",
    "run_sequence",
    "RunContext",
    "SessionLink",
    "SessionTurns",
]
