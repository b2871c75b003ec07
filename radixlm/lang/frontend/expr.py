"""DSL expressions: what ``s += ...`` takes. Each expression is a short list of IR nodes.

``gen``, ``select`` and the role helpers build nodes of the request graph directly, so a traced
program and a program run step by step execute the very same nodes.
"""

from __future__ import annotations

import inspect
import json
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

from radixlm.lang.frontend.tools import declare
from radixlm.runtime.programs.choices import (
    METHODS,
    ChoicesMethod,
    token_length_normalized,
)
from radixlm.runtime.programs.ir import (
    Constraint,
    GenNode,
    Role,
    RoleBeginNode,
    RoleEndNode,
    SelectNode,
    TextNode,
)
from radixlm.runtime.programs.sampling import DSL_NAMES, DTYPE_REGEX, SamplingArgs
from radixlm.runtime.sampling_params import PARAMS, SamplingParams, check_fields

DType = type | Literal["int", "float", "bool", "str"] | None
DTypeName = Literal["int", "float", "bool", "str"]
_DTYPES = {int: "int", float: "float", bool: "bool", str: "str"}


class Expr:
    """A sequence of nodes; ``a + b`` concatenates, and plain strings become constant text."""

    __slots__ = ("nodes",)

    def __init__(self, nodes: Sequence[Any]) -> None:
        self.nodes: tuple[Any, ...] = tuple(nodes)

    def __add__(self, other: ExprLike) -> Expr:
        return Expr(self.nodes + to_expr(other).nodes)

    def __radd__(self, other: ExprLike) -> Expr:
        return Expr(to_expr(other).nodes + self.nodes)

    def __repr__(self) -> str:
        return f"Expr({', '.join(n.op for n in self.nodes)})"


ExprLike = Expr | str | int | float | bool


def to_expr(value: ExprLike) -> Expr:
    """An expression for ``value``: expressions as they are, anything else as its str() text."""
    if isinstance(value, Expr):
        return value
    if value is None:
        raise TypeError("cannot append None to a program state")
    return Expr([TextNode(text=str(value))])


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    *,  # SGLang's positional order differs across its versions: the rest is keyword-only
    regex: str | None = None,
    json_schema: str | dict[str, Any] | type | None = None,
    ebnf: str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesMethod | str = token_length_normalized,
    dtype: DType = None,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    tools: Sequence[Callable[..., Any]] | None = None,
    **sampling: Any,
) -> Expr:
    """Generate text into variable ``name`` (SGLang's gen).

    ``max_tokens`` / ``min_tokens`` are the runtime's max_new_tokens / min_new_tokens. The other
    sampling keywords are the runtime's sampling parameters the DSL takes, listed below (from
    radixlm.runtime.sampling_params.SamplingParams; None inherits the run's value).
    ``json_schema`` takes a dict, a JSON string or a Pydantic model class. ``dtype`` (int,
    float, bool, str) constrains the output with a regex and stores the converted value.
    ``choices`` makes this a select(). ``tools`` (typed Python functions) makes the generation
    exactly one call of one of them; the variable holds a FunctionCall (docs/dsl.md, "Tools").
    """
    if choices is not None:
        return select(name, choices, choices_method=choices_method)
    sampling = _gen_sampling(sampling, max_tokens, min_tokens)
    dtype_name = _dtype_name(dtype)
    constraint = _constraint(regex, json_schema, ebnf, dtype_name)
    if tools is None:
        return Expr([GenNode(name=name, sampling=SamplingArgs(**sampling), constraint=constraint, dtype=dtype_name,
                             return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)])
    if constraint is not None or return_logprob or top_logprobs_num:
        raise ValueError("gen(tools=...) takes no regex, json_schema, ebnf, dtype or logprobs: "
                         "the tools' parameter schemas are its constraint")
    if sampling.get("n", 1) != 1:
        raise ValueError("gen(tools=...) makes one call; n must be 1")
    specs, binder = declare(tools)
    return Expr([GenNode(name=name, sampling=SamplingArgs(**sampling), tools=specs).with_binder(binder)])


def _gen_sampling(sampling: dict[str, Any], max_tokens: int | None, min_tokens: int | None) -> dict[str, Any]:
    """gen()'s sampling keywords as SamplingArgs fields; an unknown keyword is a TypeError, as in Python."""
    for key in sampling:
        if key not in GEN_SAMPLING_NAMES:
            raise TypeError(f"gen() got an unexpected keyword argument {key!r}")
    out = {k: v for k, v in sampling.items() if v is not None}
    if isinstance(out.get("stop"), Sequence) and not isinstance(out["stop"], str):
        out["stop"] = tuple(out["stop"])
    if isinstance(out.get("stop_token_ids"), Sequence):
        out["stop_token_ids"] = tuple(out["stop_token_ids"])
    if max_tokens is not None:
        out["max_new_tokens"] = max_tokens
    if min_tokens is not None:
        out["min_new_tokens"] = min_tokens
    return out


# gen() takes these two by SGLang's names (max_tokens, min_tokens, also positionally); the other
# sampling keywords by the runtime's names.
GEN_SAMPLING_NAMES: tuple[str, ...] = tuple(n for n in DSL_NAMES if n not in ("max_new_tokens", "min_new_tokens"))


def _document_gen() -> None:
    """gen()'s signature and docstring list its sampling keywords, from SamplingParams' declaration."""
    sig = inspect.signature(gen)
    hints = typing.get_type_hints(SamplingParams)
    fixed = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hints[n] | None)
             for n in GEN_SAMPLING_NAMES]
    gen.__signature__ = sig.replace(parameters=[*fixed, *extra])  # type: ignore[attr-defined]
    lines = [f"    ``{n}``: {PARAMS[n].help}" for n in GEN_SAMPLING_NAMES]
    gen.__doc__ = f"{gen.__doc__}\n    Sampling keywords:\n\n" + "\n".join(lines) + "\n"


_document_gen()


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """gen() of an integer (the variable holds an int)."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """gen() of a double-quoted string (the variable holds the text between the quotes)."""
    return gen(name, dtype=str, **kwargs)


def select(name: str | None = None, choices: Sequence[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesMethod | str = token_length_normalized) -> Expr:
    """Append the choice the model scores highest after the state's text; store it in ``name``.

    ``temperature`` is in SGLang's place in the signature; choices are scored deterministically,
    so only 0 is taken."""
    check_fields({"temperature": temperature})
    if temperature != 0:
        raise ValueError(f"select scores every choice and picks the best one deterministically, so only "
                         f"temperature=0 is taken (got {temperature!r})")
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select choices must be non-empty strings, got {list(choices)!r}")
    method = choices_method.name if isinstance(choices_method, ChoicesMethod) else choices_method
    method = {"greedy": "greedy_token_selection"}.get(method, method)
    if method not in METHODS:
        raise ValueError(f"unknown choices_method {method!r}; use one of {', '.join(METHODS)}")
    return Expr([SelectNode(name=name, choices=list(choices), method=typing.cast(Any, method))])  # checked above


def _dtype_name(dtype: DType) -> DTypeName | None:
    if dtype is None:
        return None
    name = _DTYPES.get(dtype, dtype) if isinstance(dtype, type) else dtype
    if name not in DTYPE_REGEX:
        raise ValueError(f"dtype must be int, float, bool or str, got {dtype!r}")
    return typing.cast(DTypeName, name)


def _constraint(regex: str | None, json_schema: Any, ebnf: str | None, dtype: str | None) -> Constraint | None:
    given = [(k, v) for k, v in (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf),
                                 ("dtype", dtype)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"gen takes at most one of regex, json_schema, ebnf, dtype; got {', '.join(k for k, _ in given)}")
    if not given:
        return None
    kind, spec = given[0]
    if kind == "dtype":
        return Constraint(kind="regex", spec=DTYPE_REGEX[spec])
    if kind == "json_schema":
        if isinstance(spec, type) and hasattr(spec, "model_json_schema"):
            spec = spec.model_json_schema()
        if not isinstance(spec, str):
            spec = json.dumps(spec, separators=(",", ":"))
    return Constraint(kind=typing.cast(Any, kind), spec=spec)


# -- roles ---------------------------------------------------------------------------------
def _role(role: Role, expr: ExprLike | None) -> Expr:
    if expr is None:
        raise TypeError(f"{role}() takes the message content; use `with s.{role}():` for the block form")
    return Expr([RoleBeginNode(role=role), *to_expr(expr).nodes, RoleEndNode(role=role)])


def system(expr: ExprLike | None = None) -> Expr:
    """A system message around ``expr``, formatted by the model's chat template."""
    return _role("system", expr)


def user(expr: ExprLike | None = None) -> Expr:
    """A user message around ``expr``."""
    return _role("user", expr)


def assistant(expr: ExprLike | None = None) -> Expr:
    """An assistant message around ``expr`` (usually a gen)."""
    return _role("assistant", expr)


def system_begin() -> Expr:
    return Expr([RoleBeginNode(role="system")])


def system_end() -> Expr:
    return Expr([RoleEndNode(role="system")])


def user_begin() -> Expr:
    return Expr([RoleBeginNode(role="user")])


def user_end() -> Expr:
    return Expr([RoleEndNode(role="user")])


def assistant_begin() -> Expr:
    return Expr([RoleBeginNode(role="assistant")])


def assistant_end() -> Expr:
    return Expr([RoleEndNode(role="assistant")])


def image(path: str) -> Expr:
    """Not supported: radixlm serves text-only models."""
    raise NotImplementedError(
        "image() is not supported: radixlm serves text-only (Llama-family) models, so programs "
        "cannot include images")


def video(path: str, num_frames: int = 0) -> Expr:
    """Not supported: radixlm serves text-only models."""
    raise NotImplementedError(
        "video() is not supported: radixlm serves text-only (Llama-family) models, so programs "
        "cannot include videos")
