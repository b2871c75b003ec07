"""Finite schemas: a JSON Schema whose values are all listed somewhere in it becomes an enum.

When a schema's own ``enum`` or ``const`` (or that of an ``allOf`` branch, or of every branch of
an ``anyOf`` / ``oneOf``) lists every value it can accept, the values it does accept are exactly
those of the list that pass the whole schema. A JSON Schema validator decides each one, so the
schema compiles to ``{"enum": [...]}`` of the survivors: exact whatever else the schema says
(``not``, ``if``/``then``, ``uniqueItems``, keywords no grammar engine enforces). The JSON Schema
test suite's corner cases (JSONSchemaBench's Synthesized file) are mostly of this form.
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.constrained.schema_check import canonical_json as _key

__all__ = ["finite_schema", "listed_values"]

_BRANCHES = ("anyOf", "oneOf")


def _intersect(a: list[Any] | None, b: list[Any] | None) -> list[Any] | None:
    if a is None:
        return b
    if b is None:
        return a
    keys = {_key(v) for v in b}
    return [v for v in a if _key(v) in keys]


def _texts(node: Any) -> list[str]:
    """The strings of a JSON value, object keys included."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, str):
            out.append(n)
        elif isinstance(n, dict):
            out.extend(n)
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return out


def _risky_pattern(schema: Any, values: list[Any]) -> bool:
    """Whether the validator could take too long on a regex of ``schema`` (a ``pattern``, a
    ``patternProperties`` key) against the listed values: it runs them in Python's backtracking
    engine, where ``^(a+)+$`` takes exponential time. A regex with no quantifier (``*+?{``)
    costs at most its length times the text's, squared; one with a single quantifier a power of
    the text's length more, so texts stay under 1,024 characters; more quantifiers are risky."""
    regexes: list[Any] = []
    stack = [schema]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if "pattern" in n:
                regexes.append(n["pattern"])
            if isinstance(n.get("patternProperties"), dict):
                regexes += list(n["patternProperties"])
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    if any(not isinstance(r, str) for r in regexes):
        return True
    most = max((sum(r.count(c) for c in "*+?{") for r in regexes), default=0)
    return most > 1 or (most == 1 and max(map(len, _texts(values)), default=0) > 1024)


def listed_values(schema: Any) -> list[Any] | None:
    """Every value ``schema`` can accept, when parts of it list them all (a superset: the whole
    schema may refuse some); None when nothing bounds it to a list."""
    if not isinstance(schema, dict):
        return [] if schema is False else None
    bound: list[Any] | None = None
    if "const" in schema:
        bound = [schema["const"]]
    if isinstance(schema.get("enum"), list):
        bound = _intersect(bound, list(schema["enum"]))
    for branch in schema.get("allOf", []) if isinstance(schema.get("allOf"), list) else []:
        bound = _intersect(bound, listed_values(branch))
    for word in _BRANCHES:
        branches = schema.get(word)
        if isinstance(branches, list) and branches:
            each = [listed_values(b) for b in branches]
            if all(v is not None for v in each):
                union: dict[str, Any] = {}
                for values in each:
                    union.update((_key(v), v) for v in values or [])
                bound = _intersect(bound, list(union.values()))
    if bound is None:
        return None
    unique: dict[str, Any] = {}
    for v in bound:
        unique.setdefault(_key(v), v)
    return list(unique.values())


def finite_schema(schema: Any, max_values: int) -> dict[str, Any] | None:
    """``{"enum": values}`` for a schema bounded by listed values (those the whole schema accepts,
    by a JSON Schema validator, in their listed order); None when nothing bounds it, or when
    more than ``max_values`` are listed. ValueError when none of the listed values passes."""
    values = listed_values(schema)
    if values is None or len(values) > max_values or not isinstance(schema, dict) or set(schema) in ({"enum"}, {"const"}):
        return None  # unbounded, too many, or a plain enum / const already
    if _risky_pattern(schema, values):
        return None  # the validator's regex engine backtracks: a hostile pattern would never end
    import jsonschema  # lazy: only for schemas of this form

    # a schema that names no draft is read as the newest and as draft 7 (which still has
    # "dependencies"): a value is kept only if both accept it
    drafts = ([jsonschema.validators.validator_for(schema)] if "$schema" in schema
              else [jsonschema.Draft202012Validator, jsonschema.Draft7Validator])
    try:
        validators = []
        for cls in drafts:
            cls.check_schema(schema)
            validators.append(cls(schema))
        kept = [v for v in values if all(x.is_valid(v) for x in validators)]
    except Exception:  # noqa: BLE001 - not a schema the validator can decide (say, a $ref it cannot resolve): compiled as it is
        return None
    if not kept:
        raise ValueError("no value that its enum/const lists satisfies the whole schema: it accepts nothing")
    return {"enum": kept}
