"""Sampling arguments of the DSL: one dataclass, merged field by field with dataclasses.replace.

Every field defaults to None, meaning "inherit": a gen call's values override the run's
defaults (``func.run(temperature=0)``), which override the runtime's own defaults
(radixlm.runtime.sampling_params.SamplingParams). Names are the runtime's native names;
``gen`` also takes SGLang's frontend spellings ``max_tokens`` / ``min_tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingArgs:
    """Sampling values set by a gen call or a run; None fields inherit."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, int):
            object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,))
        elif isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> SamplingArgs:
        """Build from keyword arguments (e.g. run()'s); unknown names are a ValueError."""
        unknown = sorted(set(kwargs) - cls.names())
        if unknown:
            raise ValueError(f"unknown sampling argument(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(sorted(cls.names()))}")
        args = cls(**kwargs)
        args.check()
        return args

    def set_fields(self) -> dict[str, Any]:
        """The fields this object sets (not None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def merged(self, override: SamplingArgs) -> SamplingArgs:
        """These values, with every field that ``override`` sets replaced."""
        return dataclasses.replace(self, **override.set_fields())

    def check(self) -> None:
        """Raise ValueError (naming the field) when the values are invalid for the runtime."""
        SamplingParams.from_dict(self.set_fields())

    def to_native(self, **extra: Any) -> dict[str, Any]:
        """The runtime's native ``sampling_params`` dict: the set fields plus ``extra``."""
        out = self.set_fields()
        for key in ("stop", "stop_token_ids"):
            if key in out:
                out[key] = list(out[key])
        out.update({k: v for k, v in extra.items() if v is not None})
        return out


# Regexes for gen(dtype=...) and how the matched text becomes a value. Integers and floats are
# bounded in length so a greedy model that keeps choosing digits still terminates.
DTYPE_REGEX: dict[str, str] = {
    "int": r"-?(0|[1-9][0-9]{0,17})",
    "float": r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,12})?",
    "bool": r"(True|False)",
    "str": r'"[^"\\\n]{0,512}"',
}


def convert_dtype(dtype: str, text: str) -> Any:
    """The value a dtype-constrained generation stands for (its text is kept in the state)."""
    t = text.strip()
    if dtype == "int":
        return int(t)
    if dtype == "float":
        return float(t)
    if dtype == "bool":
        return t == "True"
    return t[1:-1] if len(t) >= 2 and t[0] == t[-1] == '"' else t
