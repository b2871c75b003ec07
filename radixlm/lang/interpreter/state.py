"""A program state's data: defined in radixlm.runtime.programs.state (the runtime runs graphs too, and never imports the DSL);
re-exported here for the DSL and for compatibility."""

from radixlm.runtime.programs.state import (
    StateCore,
    TextEvent,
)

__all__ = [
    "StateCore",
    "TextEvent",
]
