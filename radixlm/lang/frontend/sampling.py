"""Sampling arguments of the DSL: defined in radixlm.runtime.programs.sampling (the runtime runs graphs too, and never imports the DSL);
re-exported here for the DSL and for compatibility."""

from radixlm.runtime.programs.sampling import (
    DSL_NAMES,
    DTYPE_REGEX,
    SamplingArgs,
    convert_dtype,
)

__all__ = [
    "convert_dtype",
    "DSL_NAMES",
    "DTYPE_REGEX",
    "SamplingArgs",
]
