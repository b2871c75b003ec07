"""select()'s choice methods: defined in radixlm.runtime.programs.choices (the runtime runs graphs too, and never imports the DSL);
re-exported here for the DSL and for compatibility."""

from radixlm.runtime.programs.choices import (
    METHODS,
    ChoicesMethod,
    Logprobs,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)

__all__ = [
    "ChoicesMethod",
    "greedy_token_selection",
    "Logprobs",
    "METHODS",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
]
