"""Per-request sampling parameters (SGLang's native ``sampling_params``), validated.

Pure Python: no torch here, so the scheduler and the server can use it freely.
Logprob options (``return_logprob``, ``top_logprobs_num``, ...) are request-level and live
with the request, not here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

MAX_STOP_STRINGS = 32
# Temperatures below this decode greedily: dividing logits by a tinier value risks overflow,
# and the distribution is a point mass in fp32 anyway (vLLM uses the same cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "choices")
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output; defaults match SGLang's native API.

    ``top_k == -1`` means off. ``temperature == 0`` (below ``GREEDY_TEMPERATURE_EPS``) or
    ``top_k == 1`` means greedy.
    ``stop`` / ``stop_token_ids`` accept a str / list and are stored as tuples;
    ``json_schema`` accepts a dict or a Pydantic model class and is stored as compact JSON text;
    ``choices`` (a list of strings: the output is exactly one of them) is stored as a tuple.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    choices: tuple[str, ...] | None = None
    jump_forward: bool = True

    def __post_init__(self) -> None:
        self._normalize()
        self._validate()

    # -- normalization -------------------------------------------------------------------
    def _normalize(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise ValueError(
                f"stop must be a string or a list of strings, got {type(stop).__name__}"
            )
        object.__setattr__(self, "stop", stop)

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif _is_int(ids):
            ids = (ids,)
        elif isinstance(ids, (list, tuple, set, frozenset)):
            ids = tuple(ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of ints, got {type(ids).__name__}"
            )
        object.__setattr__(self, "stop_token_ids", ids)

        schema = self.json_schema
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):  # a Pydantic model
            schema = schema.model_json_schema()
        if isinstance(schema, (Mapping, bool)):
            try:
                text = json.dumps(schema, separators=(",", ":"))
            except RecursionError:  # the limit (--grammar-max-nesting) is far below Python's
                raise ValueError("json_schema is too large: it nests too deeply to read") from None
            except (TypeError, ValueError) as e:
                raise ValueError(f"json_schema is not JSON-serializable: {e}") from None
            object.__setattr__(self, "json_schema", text)
        if isinstance(self.choices, (list, tuple)):
            object.__setattr__(self, "choices", tuple(self.choices))
        # Accept ints for float fields, but store floats so equality/hash are uniform.
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if _is_int(v):
                try:
                    object.__setattr__(self, name, float(v))
                except OverflowError:
                    raise ValueError(f"{name} must be a finite number, got an integer too large for a float") from None

    # -- validation ----------------------------------------------------------------------
    def _validate(self) -> None:
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            v = getattr(self, name)
            if not _is_int(v):
                raise ValueError(f"{name} must be an int, got {v!r}")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "no_stop_trim",
            "jump_forward",
        ):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool (true/false), got {v!r}")

        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens, got min_new_tokens="
                f"{self.min_new_tokens} > max_new_tokens={self.max_new_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature:g}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p:g}")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 means off), got {self.repetition_penalty:g}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v:g}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if not s:
                raise ValueError("stop strings must be non-empty, got ''")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0, got {t!r}")

        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or null, got {self.seed!r}")

        given = []
        for name in CONSTRAINT_FIELDS:
            v = getattr(self, name)
            if v is None:
                continue
            if name == "choices":
                if not isinstance(v, tuple) or not v or not all(isinstance(c, str) for c in v):
                    raise ValueError(f"choices must be a non-empty list of strings, got {v!r}")
            elif not isinstance(v, str):
                raise ValueError(f"{name} must be a string, got {type(v).__name__}")
            given.append(name)
        if len(given) > 1:
            raise ValueError(
                f"at most one of {', '.join(CONSTRAINT_FIELDS)} may be set, got {', '.join(given)}"
            )

    # -- conversions ---------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names of all sampling parameters, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "SamplingParams":
        """Build from a JSON-ish dict (SGLang native ``sampling_params``).

        Unknown keys raise ``ValueError``. A key whose value is ``None`` (JSON ``null``) takes
        the default. ``stop`` may be a str or list; ``json_schema`` may be a dict.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(
                f"sampling_params must be an object/dict, got {type(d).__name__}"
            )
        valid = cls.field_names()
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in valid:
                raise ValueError(
                    f"unknown sampling parameter {key!r}; valid keys: {', '.join(valid)}"
                )
            if value is not None:
                kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``SamplingParams.from_dict(p.to_dict()) == p``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        if self.choices is not None:
            out["choices"] = list(self.choices)
        return out

    @property
    def constraint(self) -> tuple[str, str | tuple[str, ...]] | None:
        """(kind, spec) of the output constraint, or None when the output is free text."""
        for name in CONSTRAINT_FIELDS:
            v = getattr(self, name)
            if v is not None:
                return name, v
        return None

    @property
    def is_greedy(self) -> bool:
        """True when decoding takes the argmax: temperature 0 (< 1e-5) or top_k 1."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1
