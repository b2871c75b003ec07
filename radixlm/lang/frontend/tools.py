"""Tools for ``gen(tools=[...])``: plain typed Python functions as tool declarations, and the call
a gen makes (name + validated arguments, invokable).

A function's parameter schema is derived with pydantic from its signature (every parameter needs
a type hint; defaults make a parameter optional), its docstring is the description. Only that
data goes into the request graph; the function stays here and is called client-side.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic

from radixlm.runtime.programs.ir import ToolSpec
from radixlm.runtime.tool_calls import GENERIC, NAME_PATTERN, Tool, generic_system_text


@dataclass(frozen=True)
class FunctionCall:
    """A call a gen made: the tool's ``name``, its ``arguments`` (validated against the function's
    signature, as the Python values it takes) and the ``function``; ``call()`` or ``invoke()`` runs it."""

    name: str
    arguments: dict[str, Any]
    function: Callable[..., Any] = field(repr=False)
    json_arguments: dict[str, Any] = field(default_factory=dict, repr=False)  # as the model wrote them

    def invoke(self) -> Any:
        """The function's result for these arguments."""
        return self.function(**self.arguments)

    def __call__(self) -> Any:
        return self.invoke()

    def to_dict(self) -> dict[str, Any]:
        """``{"name", "arguments"}`` as JSON data (the form a graph run on a server returns)."""
        return {"name": self.name, "arguments": dict(self.json_arguments)}


@dataclass(frozen=True)
class _Declared:
    spec: ToolSpec
    function: Callable[..., Any]
    model: type[pydantic.BaseModel]


def declare(tools: Any) -> tuple[list[ToolSpec], Callable[[Any], Any]]:
    """The tools' specs (data for the graph) and a binder that turns a generated call
    ``{"name", "arguments"}`` into a FunctionCall; ValueError saying what to fix for bad input."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence) or callable(tools):
        raise ValueError(f"tools must be a list of functions, got {type(tools).__name__}")
    if not tools:
        raise ValueError("tools is empty: give at least one function")
    declared: dict[str, _Declared] = {}
    for i, fn in enumerate(tools):
        d = _declare_one(fn, i)
        if d.spec.name in declared:
            raise ValueError(f"tools[{i}]: two tools are named {d.spec.name!r}; tool names must be unique "
                             "(rename one of the functions)")
        declared[d.spec.name] = d

    def bind(value: Any) -> Any:
        if isinstance(value, list):  # a variable gathered from fork branches
            return [bind(v) for v in value]
        if isinstance(value, FunctionCall) or not isinstance(value, dict) or value.get("name") not in declared:
            return value
        d = declared[value["name"]]
        arguments = value.get("arguments") or {}
        try:
            parsed = d.model.model_validate(arguments)
        except pydantic.ValidationError as e:
            raise ValueError(f"the call of {d.spec.name} has arguments its signature refuses: {e}") from None
        return FunctionCall(d.spec.name, {k: getattr(parsed, k) for k in type(parsed).model_fields}, d.function,
                            dict(arguments))

    return [d.spec for d in declared.values()], bind


def describe_tools(tools: Sequence[Callable[..., Any]]) -> str:
    """The tool list and the call format, as text for a system message (the generic format the
    calls of ``gen(tools=...)`` are written in; docs/tools.md)."""
    specs, _ = declare(tools)
    return generic_system_text([Tool(s.name, s.description, s.parameters) for s in specs], GENERIC)


def _declare_one(fn: Any, i: int) -> _Declared:
    where = f"tools[{i}]"
    if not callable(fn) or isinstance(fn, type):
        raise ValueError(f"{where} is {type(fn).__name__ if not isinstance(fn, type) else 'a class'}, not a "
                         "function: tools are plain typed Python functions")
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ValueError(f"{where}: a tool's name is its function's __name__, which must be 1 to 64 letters, digits, "
                         f"'_' or '-' (got {name!r}); use a def with such a name instead of a lambda or partial")
    model = _model_of(fn, f"{where} ({name})")
    parameters = _compact(model.model_json_schema())
    parameters.setdefault("properties", {})
    description = inspect.getdoc(fn) or ""
    return _Declared(ToolSpec(name=name, description=description, parameters=parameters), fn, model)


def _model_of(fn: Callable[..., Any], where: str) -> type[pydantic.BaseModel]:
    """A pydantic model of the function's parameters."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: its signature cannot be read; wrap it in a def with typed parameters") from None
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as e:  # noqa: BLE001 - any failure to resolve an annotation is the user's to fix
        raise ValueError(f"{where}: its type hints cannot be resolved ({e})") from None
    fields: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"{where}: *{p.name} / **{p.name} cannot be described as tool arguments; "
                             "declare each argument as a typed parameter")
        if p.kind is p.POSITIONAL_ONLY:
            raise ValueError(f"{where}: parameter {p.name!r} is positional-only; tools are called with keywords")
        if p.name not in hints:
            raise ValueError(f"{where}: parameter {p.name!r} has no type hint; annotate it "
                             f"(e.g. `{p.name}: str`) so its JSON schema can be derived")
        fields[p.name] = (hints[p.name], ... if p.default is p.empty else p.default)
    try:
        model: type[pydantic.BaseModel] = pydantic.create_model(f"{getattr(fn, '__name__', 'tool')}_arguments",
                                                                **fields)
        model.model_json_schema()
    except Exception as e:  # noqa: BLE001 - pydantic's reason, said to the user
        raise ValueError(f"{where}: its parameters have no JSON schema ({e}); use JSON-like types "
                         "(str, int, float, bool, lists, dicts, Literal, pydantic models)") from None
    return model


def _compact(schema: Any) -> Any:
    """A pydantic JSON schema without its generated titles (they add tokens to prompts, nothing else);
    property names called "title" are kept."""
    if isinstance(schema, list):
        return [_compact(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "title" and isinstance(v, str):
            continue
        if k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
            out[k] = {name: _compact(sub) for name, sub in v.items()}
        elif k in ("enum", "const", "default", "examples"):
            out[k] = v
        else:
            out[k] = _compact(v)
    return out
