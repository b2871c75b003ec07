"""Sampling arguments of the DSL: one dataclass, merged field by field with dataclasses.replace.

Its fields are the runtime's sampling parameters the DSL takes (those declared ``dsl`` in
radixlm.runtime.sampling_params.SamplingParams), made here from that declaration, and their values
are checked by it. Every field defaults to None, meaning "inherit": a gen call's values override
the run's defaults (``func.run(temperature=0)``), which override the runtime's own defaults.
Names are the runtime's native names; ``gen`` also takes SGLang's frontend spellings
``max_tokens`` / ``min_tokens``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from radixlm.runtime.sampling_params import PARAMS, SamplingParams, check_fields

# The sampling parameters the DSL takes, in declaration order.
DSL_NAMES: tuple[str, ...] = tuple(name for name, p in PARAMS.items() if p.dsl)


class _SamplingArgsBase:
    """The behaviour of SamplingArgs; its fields come from SamplingParams' declaration."""

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):
            v = getattr(self, name)
            if isinstance(v, (str, int)) and not isinstance(v, bool):
                object.__setattr__(self, name, (v,))
            elif isinstance(v, list):
                object.__setattr__(self, name, tuple(v))

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(DSL_NAMES)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> SamplingArgs:
        """Build from keyword arguments (e.g. run()'s); unknown names are a ValueError."""
        unknown = sorted(set(kwargs) - cls.names())
        if unknown:
            raise ValueError(f"unknown sampling argument(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(sorted(cls.names()))}")
        args = SamplingArgs(**kwargs)
        args.check()
        return args

    def set_fields(self) -> dict[str, Any]:
        """The fields this object sets (not None)."""
        return {name: getattr(self, name) for name in DSL_NAMES if getattr(self, name) is not None}

    def merged(self, override: _SamplingArgsBase) -> SamplingArgs:
        """These values, with every field that ``override`` sets replaced."""
        return typing.cast(SamplingArgs, dataclasses.replace(typing.cast(Any, self), **override.set_fields()))

    def check(self) -> None:
        """Raise ValueError (naming the field) when a value is invalid for the runtime; each value is
        checked on its own, as the runtime checks it (how values combine is checked when they run)."""
        check_fields(self.set_fields())

    def to_native(self, **extra: Any) -> dict[str, Any]:
        """The runtime's native ``sampling_params`` dict: the set fields plus ``extra``."""
        out = self.set_fields()
        for key in ("stop", "stop_token_ids"):
            if key in out:
                out[key] = list(out[key])
        out.update({k: v for k, v in extra.items() if v is not None})
        return out


def _make_sampling_args() -> type:
    hints = typing.get_type_hints(SamplingParams)
    fields = [(name, hints[name] | None, dataclasses.field(default=None)) for name in DSL_NAMES]
    cls = dataclasses.make_dataclass("SamplingArgs", fields, bases=(_SamplingArgsBase,), frozen=True)
    cls.__module__ = __name__
    cls.__doc__ = "Sampling values set by a gen call or a run; None fields inherit."
    return cls


if TYPE_CHECKING:
    class SamplingArgs(_SamplingArgsBase):
        """Sampling values set by a gen call or a run; None fields inherit."""

        def __init__(self, **values: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...
else:
    SamplingArgs = _make_sampling_args()


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
