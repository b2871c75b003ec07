"""Per-request sampling parameters (SGLang's native ``sampling_params``), declared once.

Each field of `SamplingParams` carries a `Param` in its metadata: its help text, its kind and
bounds, its OpenAI name and whether the DSL's ``gen`` takes it. Validation here, the server's
OpenAPI schema and OpenAI field mapping, the CLI flags and the DSL's arguments all read that
declaration (`PARAMS`), so a new field is one line here.

Pure Python: no torch here, so the scheduler and the server can use it freely.
Logprob options (``return_logprob``, ``top_logprobs_num``, ...) are request-level and live
with the request, not here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from radixlm.runtime.stop import MAX_STOP_REGEXES, compile_stop_regex

MAX_STOP_STRINGS = 32
MAX_LOGIT_BIAS = 4096  # tokens one request may bias
MAX_LOGIT_BIAS_VALUE = 1e9  # |bias|: finite in fp32 next to any logit, and -inf (masked) + bias stays -inf
OPENAI_MAX_LOGIT_BIAS = 100.0  # |bias| the OpenAI routes take (OpenAI's own range)
# Temperatures below this decode greedily: dividing logits by a tinier value risks overflow,
# and the distribution is a point mass in fp32 anyway (vLLM uses the same cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5
# Above this the distribution is uniform in fp32 anyway; far above it logits / T underflow and
# T * x overflows (1e300 made EOS sampleable inside min_new_tokens).
MAX_TEMPERATURE = 100.0
# A top_p below the smallest normal float32 (~1.2e-38) decodes greedily: the sampler holds top_p in
# float32, where it becomes 0 or a subnormal that a device may flush to 0, and a nucleus of mass 0
# would keep no token at all. So small a nucleus is the most likely token alone (as in vLLM and
# SGLang, which always keep that token).
MIN_SAMPLED_TOP_P = 2.0**-126
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "choices", "structural_tag")
# SGLang's names for parameters declared here under another name.
ALIASES: dict[str, str] = {"sampling_seed": "seed"}
# SGLang sampling parameters of features this runtime lacks: accepted when empty (null, {}, or
# the value that turns them off), else a ValueError saying why.
EMPTY_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "custom_params": ((None, {}), "it holds arguments for custom logit processors, which this server does not run"),
    "watermark": ((None, {}), "this server does not watermark outputs"),
    "beam_width": ((None, 1), "this server does not run beam search"),
}

# int, float, bool: scalars; seed: an int or null; text: a string or null; stop: strings;
# stop_regex: regular expressions; token_ids: token ids; logit_bias: {token id: bias};
# schema: a JSON schema (text, dict or Pydantic model); choices: strings.
Kind = Literal["int", "float", "bool", "seed", "text", "stop", "stop_regex", "token_ids", "logit_bias", "schema",
               "choices"]


@dataclass(frozen=True)
class Param:
    """What one sampling parameter is, for everything that reads or describes it."""

    help: str
    kind: Kind
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is out of range
    off: int | None = None  # a value outside the bounds that turns the parameter off
    note: str = ""  # said after the bounds in errors: what a special value means
    openai: str | None = ""  # its OpenAI request field: "" the same name, None not an OpenAI field
    openai_hi: float | None = None  # the OpenAI API's own, tighter upper bound
    dsl: bool = False  # gen() / func.run() take it as a sampling argument

    def range_text(self) -> str:
        """The bounds as errors say them: '>= 0', 'in (0, 1]', '-1 (off) or >= 1'."""
        lo, hi = self.lo, self.hi
        if self.off is not None:
            text = f"{self.off} (off) or >= {lo:g}"
        elif lo is not None and hi is not None:
            text = f"in {'(' if self.lo_open else '['}{lo:g}, {hi:g}]"
        elif lo is not None:
            text = f"{'>' if self.lo_open else '>='} {lo:g}"
        else:
            text = f"<= {hi:g}"
        return f"{text} ({self.note})" if self.note else text

    def in_range(self, v: float) -> bool:
        if self.off is not None and v == self.off:
            return True
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or v <= self.hi


def _param(default: Any, help: str, kind: Kind, **meta: Any) -> Any:
    return dataclasses.field(default=default, metadata={"param": Param(help, kind, **meta)})


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output; defaults match SGLang's native API.

    ``top_k == -1`` means off. ``temperature == 0`` (below ``GREEDY_TEMPERATURE_EPS``),
    ``top_k == 1`` or a ``top_p`` below ``MIN_SAMPLED_TOP_P`` means greedy.
    ``stop`` / ``stop_token_ids`` accept a str / list and are stored as tuples;
    ``json_schema`` accepts a dict or a Pydantic model class and is stored as compact JSON text;
    ``choices`` (a list of strings: the output is exactly one of them) is stored as a tuple;
    ``logit_bias`` accepts ``{token id (int or decimal text): bias}`` and is stored as sorted
    ``(id, bias)`` pairs; an empty ``structural_tag`` is unset (as SGLang).
    """

    max_new_tokens: int = _param(128, "most tokens to generate; 0: prefill only (scores the prompt)", "int",
                                 lo=0, openai="max_tokens", dsl=True)
    min_new_tokens: int = _param(0, "fewest tokens to generate before EOS or a stop may end the output "
                                    "(at most max_new_tokens)", "int", lo=0, openai="min_tokens", dsl=True)
    temperature: float = _param(1.0, "softmax temperature; 0: greedy", "float", lo=0, hi=MAX_TEMPERATURE,
                                note="0 means greedy", openai_hi=2, dsl=True)
    top_p: float = _param(1.0, "nucleus sampling: keep the most likely tokens up to this probability mass "
                               "(below 1.2e-38, the smallest normal float32: greedy)",
                          "float", lo=0, lo_open=True, hi=1, dsl=True)
    top_k: int = _param(-1, "keep only the k most likely tokens; -1: off", "int", lo=1, off=-1, dsl=True)
    min_p: float = _param(0.0, "drop tokens less likely than min_p times the most likely one", "float",
                          lo=0, hi=1, dsl=True)
    repetition_penalty: float = _param(1.0, "divide the logits of tokens already seen by this; 1: off", "float",
                                       lo=0, lo_open=True, note="1 means off", dsl=True)
    frequency_penalty: float = _param(0.0, "subtract this times a token's count so far from its logit", "float",
                                      lo=-2, hi=2, dsl=True)
    presence_penalty: float = _param(0.0, "subtract this from the logit of every token seen so far", "float",
                                     lo=-2, hi=2, dsl=True)
    stop: tuple[str, ...] = _param((), f"strings that end the output (at most {MAX_STOP_STRINGS}); "
                                       "not included unless no_stop_trim", "stop", dsl=True)
    stop_token_ids: tuple[int, ...] = _param((), "token ids that end the output", "token_ids", dsl=True)
    stop_regex: tuple[str, ...] = _param((), f"regular expressions that end the output at their first match (at most "
                                             f"{MAX_STOP_REGEXES}, 256 bytes each); the match is not included unless "
                                             "no_stop_trim", "stop_regex", openai=None)
    ignore_eos: bool = _param(False, "keep generating past the end-of-sequence token", "bool", dsl=True)
    skip_special_tokens: bool = _param(True, "leave special tokens out of the output text", "bool")
    spaces_between_special_tokens: bool = _param(True, "put spaces between special tokens in the output text",
                                                 "bool")
    no_stop_trim: bool = _param(False, "keep the matched stop string at the end of the output", "bool")
    n: int = _param(1, "completions per prompt (a server counts each against its --max-queued-requests)", "int", lo=1,
                    dsl=True)
    seed: int | None = _param(None, "sampling seed (taken mod 2**64); copies of n > 1 get seed + i", "seed",
                              dsl=True)
    regex: str | None = _param(None, "the output matches this regular expression", "text")
    json_schema: str | None = _param(None, "the output is JSON valid under this schema (object or its text)",
                                     "schema")
    ebnf: str | None = _param(None, "the output is in this EBNF grammar", "text")
    choices: tuple[str, ...] | None = _param(None, "the output is exactly one of these strings", "choices",
                                             openai=None)
    structural_tag: str | None = _param(None, "SGLang's structural tag (its JSON object or text): free text with "
                                              "triggered JSON sections", "schema", openai=None)
    jump_forward: bool = _param(True, "emit the text a grammar forces without a forward pass", "bool",
                                openai=None)
    logit_bias: tuple[tuple[int, float], ...] = _param(
        (), f"{{token id: bias}}: each bias (|bias| <= {MAX_LOGIT_BIAS_VALUE:g}) is added to its token's logit before "
            f"sampling (at most {MAX_LOGIT_BIAS} tokens)", "logit_bias", openai_hi=OPENAI_MAX_LOGIT_BIAS)
    stream_interval: int = _param(1, "a stream sends a chunk every this many output tokens (and at the end)", "int",
                                  lo=1, openai=None)

    def __post_init__(self) -> None:
        for name, p in PARAMS.items():
            value = getattr(self, name)
            if value is DEFAULTS[name]:  # a default is stored normalized and valid (tested): most fields
                continue
            value = normalize_value(name, p, value)
            object.__setattr__(self, name, value)
            check_value(name, p, value)
        self._check_together()

    def _check_together(self) -> None:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be <= max_new_tokens, got min_new_tokens="
                f"{self.min_new_tokens} > max_new_tokens={self.max_new_tokens}"
            )
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
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
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a JSON-ish dict (SGLang native ``sampling_params``).

        Unknown keys raise ``ValueError``. A key whose value is ``None`` (JSON ``null``) takes
        the default. ``stop`` may be a str or list; ``json_schema`` may be a dict.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be an object/dict, got {type(d).__name__}")  # noqa: TRY004
        d = _resolve_sglang_names(d)
        check_names(d, "unknown sampling parameter {name!r}; valid keys: {valid}")
        return cls(**{key: value for key, value in d.items() if value is not None})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``SamplingParams.from_dict(p.to_dict()) == p``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["stop_regex"] = list(self.stop_regex)
        out["logit_bias"] = {str(t): b for t, b in self.logit_bias}
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
        """True when decoding takes the argmax: temperature 0 (< 1e-5), top_k 1, or top_p < ~1.2e-38."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1 or self.top_p < MIN_SAMPLED_TOP_P

    @property
    def penalizes_output(self) -> bool:
        """Whether each token's draw reads the output so far (repetition, frequency or presence penalty)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


# The declaration: every sampling parameter's Param, in field order.
PARAMS: dict[str, Param] = {f.name: f.metadata["param"] for f in dataclasses.fields(SamplingParams)}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def _resolve_sglang_names(d: Mapping[str, Any]) -> dict[str, Any]:
    """``d`` with SGLang's aliases under their names here and its empty-only keys checked and dropped."""
    out = dict(d)
    for key, (empty, why) in EMPTY_ONLY.items():
        v = out.pop(key, None)
        if not any(v is e or (type(v) is type(e) and v == e) for e in empty):
            raise ValueError(f"{key} is not supported: {why}; send null (got {v!r})")
    for alias, name in ALIASES.items():
        v = out.pop(alias, None)
        if v is None:
            continue
        if out.get(name) is not None and out[name] != v:
            raise ValueError(f"{alias} and {name} are the same parameter ({alias} is SGLang's name); "
                             f"give one, or equal values (got {v!r} and {out[name]!r})")
        out[name] = v
    return out


def check_names(values: Mapping[str, Any], message: str) -> None:
    """ValueError (``message`` formatted with the first unknown ``name`` and the ``valid`` ones) when a
    key is not a sampling parameter."""
    for key in values:
        if key not in PARAMS:
            raise ValueError(message.format(name=key, valid=", ".join(PARAMS)))


def check_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """Normalize and check each of some parameters on its own (no defaults, no checks across
    fields); returns the normalized values. The DSL's partial arguments are checked this way."""
    check_names(values, "unknown sampling parameter {name!r}; valid keys: {valid}")
    out = {}
    for name, value in values.items():
        out[name] = normalize_value(name, PARAMS[name], value)
        check_value(name, PARAMS[name], out[name])
    return out


def normalize_value(name: str, p: Param, v: Any) -> Any:
    """The stored form of a value: tuples for lists, JSON text for a schema, floats for ints."""
    if p.kind == "float" and _is_int(v):
        try:
            return float(v)  # stored as floats so equality and hash are uniform
        except OverflowError:
            raise ValueError(f"{name} must be a finite number, got an integer too large for a float") from None
    if p.kind == "stop":
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        if isinstance(v, (list, tuple)):
            return tuple(v)
        raise ValueError(f"{name} must be a string or a list of strings, got {type(v).__name__}")
    if p.kind == "token_ids":
        if v is None:
            return ()
        if _is_int(v):
            return (v,)
        if isinstance(v, (list, tuple, set, frozenset)):
            return tuple(v)
        raise ValueError(f"{name} must be a list of ints, got {type(v).__name__}")
    if p.kind == "stop_regex":
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        if isinstance(v, (list, tuple)):
            return tuple(v)
        raise ValueError(f"{name} must be a string or a list of strings, got {type(v).__name__}")
    if p.kind == "logit_bias":
        return _logit_bias(name, v)
    if p.kind == "schema":
        if name == "structural_tag" and v == "":
            return None  # SGLang: an empty structural tag is unset
        return _schema_text(name, v)
    if p.kind == "choices" and isinstance(v, (list, tuple)):
        return tuple(v)
    return v


def _logit_bias(name: str, v: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or decimal text, as JSON keys are) -> sorted (id, bias) pairs."""
    if v is None:
        return ()
    if isinstance(v, tuple) and all(isinstance(e, tuple) and len(e) == 2 for e in v):
        v = dict(v)  # already stored
    if not isinstance(v, Mapping):
        raise ValueError(f"{name} must be an object {{token id: bias}}, got {type(v).__name__}")
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"{name} may bias at most {MAX_LOGIT_BIAS} tokens, got {len(v)}")
    out: dict[int, float] = {}
    for key, bias in v.items():
        if _is_int(key) and key >= 0:
            tid = key
        elif isinstance(key, str) and key.isascii() and key.isdigit():
            tid = int(key)
        else:
            raise ValueError(f"{name} keys must be token ids (ints >= 0, or their decimal text), got {key!r}")
        if not _is_real(bias) or not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS_VALUE:
            raise ValueError(f"{name}[{key!r}] must be a number in [-{MAX_LOGIT_BIAS_VALUE:g}, "
                             f"{MAX_LOGIT_BIAS_VALUE:g}], got {bias!r}")
        if tid in out:
            raise ValueError(f"{name} gives token id {tid} twice")
        out[tid] = float(bias)
    return tuple(sorted(out.items()))


def _schema_text(name: str, v: Any) -> Any:
    if isinstance(v, type) and hasattr(v, "model_json_schema"):  # a Pydantic model
        v = v.model_json_schema()
    if not isinstance(v, (Mapping, bool)):
        return v
    try:
        return json.dumps(v, separators=(",", ":"))
    except RecursionError:  # the limit (--grammar-max-nesting) is far below Python's
        raise ValueError(f"{name} is too large: it nests too deeply to read") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} is not JSON-serializable: {e}") from None


def show_float(v: float) -> str:
    """A number as sent, for an error message: repr (2.0000001 stays 2.0000001, where %g printed 2),
    a whole number without its '.0'."""
    if v.is_integer() and abs(v) < 1e16:
        return str(int(v))
    return repr(v)


def check_value(name: str, p: Param, v: Any) -> None:
    """ValueError naming the field when a normalized value is not valid for it."""
    if p.kind == "int" and not _is_int(v):
        raise ValueError(f"{name} must be an int, got {v!r}")
    if p.kind == "float" and (not _is_real(v) or not math.isfinite(v)):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if p.kind in ("int", "float") and not p.in_range(v):
        raise ValueError(f"{name} must be {p.range_text()}, got {show_float(v) if p.kind == 'float' else v}")
    if p.kind == "bool" and not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool (true/false), got {v!r}")
    if p.kind == "seed" and v is not None and not _is_int(v):
        raise ValueError(f"{name} must be an int or null, got {v!r}")
    if p.kind in ("text", "schema") and v is not None and not isinstance(v, str):
        raise ValueError(f"{name} must be a string, got {type(v).__name__}")
    if p.kind == "choices" and v is not None and (
            not isinstance(v, tuple) or not v or not all(isinstance(c, str) for c in v)):
        raise ValueError(f"{name} must be a non-empty list of strings, got {v!r}")
    if p.kind == "stop":
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"{name} accepts at most {MAX_STOP_STRINGS} strings, got {len(v)}")
        for s in v:
            if not isinstance(s, str):
                raise ValueError(f"{name} must contain only strings, got {s!r}")  # noqa: TRY004
            if not s:
                raise ValueError(f"{name} strings must be non-empty, got ''")
    if p.kind == "token_ids":
        for t in v:
            if not _is_int(t) or t < 0:
                raise ValueError(f"{name} must be ints >= 0, got {t!r}")
    if p.kind == "stop_regex":
        if len(v) > MAX_STOP_REGEXES:
            raise ValueError(f"{name} accepts at most {MAX_STOP_REGEXES} patterns, got {len(v)}")
        for i, r in enumerate(v):
            if not isinstance(r, str) or not r:
                raise ValueError(f"{name} must contain only non-empty strings, got {r!r}")
            compiled = compile_stop_regex(r, f"{name}[{i}]" if len(v) > 1 else name)
            if compiled.search("") is not None:
                raise ValueError(f"{name} {r!r} matches the empty text, so it would end every output at once")
