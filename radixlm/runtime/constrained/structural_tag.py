"""SGLang's ``structural_tag`` constraint: free text, in which each trigger starts a tagged
segment ``begin + JSON + end`` whose JSON follows that structure's schema.

Accepted shapes (SGLang's, as its OpenAI ``response_format`` and its ``sampling_params`` carry them):

- ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``
- ``{"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [...],
  "tags": [{"type": "tag", "begin", "content": {"type": "json_schema", "json_schema": {...}}, "end"}]}}``
  (the newer form, as far as it says the same thing).

Both normalize to ``{"structures": [...], "triggers": [...]}`` (pure Python, no grammar engine).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KIND = "structural_tag"


@dataclass(frozen=True)
class Structure:
    begin: str
    schema: Any  # a JSON schema (dict or bool)
    end: str


def _err(message: str) -> ValueError:
    return ValueError(f"structural_tag: {message}")


def parse(spec: Any) -> tuple[list[Structure], list[str]]:
    """The structures and triggers of a structural tag (its JSON text or object); ValueError
    naming the field that is wrong."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise _err(f"not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise _err(f"must be a JSON object, got {type(spec).__name__}")
    if spec.get("type", KIND) != KIND:
        raise _err(f"type must be 'structural_tag', got {spec.get('type')!r}")
    if "format" in spec:
        unknown = set(spec) - {"type", "format"}
        if unknown:
            raise _err(f"unknown field {sorted(unknown)[0]!r} next to format")
        return _from_format(spec["format"])
    unknown = set(spec) - {"type", "structures", "triggers"}
    if unknown:
        raise _err(f"unknown field {sorted(unknown)[0]!r}; expected structures and triggers (or format)")
    raw = spec.get("structures")
    if not isinstance(raw, list) or not raw:
        raise _err("structures must be a non-empty list of {begin, schema, end}")
    structures = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"}:
            raise _err(f"structures[{i}] must be an object with begin, schema and end only")
        structures.append(_structure(s.get("begin"), s.get("schema"), s.get("end", ""), f"structures[{i}]"))
    return structures, _triggers(spec.get("triggers"), structures)


def _from_format(fmt: Any) -> tuple[list[Structure], list[str]]:
    if not isinstance(fmt, dict) or fmt.get("type") != "triggered_tags":
        kind = fmt.get("type") if isinstance(fmt, dict) else type(fmt).__name__
        raise _err(f"format of type {kind!r} is not supported; radixlm takes format {{type: triggered_tags}} "
                   "(or the structures/triggers form)")
    for flag in ("at_least_one", "stop_after_first"):
        if fmt.get(flag):
            raise _err(f"format.{flag} is not supported (only its default, false)")
    unknown = set(fmt) - {"type", "triggers", "tags", "at_least_one", "stop_after_first"}
    if unknown:
        raise _err(f"format has unknown field {sorted(unknown)[0]!r}")
    tags = fmt.get("tags")
    if not isinstance(tags, list) or not tags:
        raise _err("format.tags must be a non-empty list of tags")
    structures = []
    for i, t in enumerate(tags):
        where = f"format.tags[{i}]"
        if not isinstance(t, dict) or t.get("type", "tag") != "tag" or set(t) - {"type", "begin", "content", "end"}:
            raise _err(f"{where} must be {{type: tag, begin, content, end}}")
        content = t.get("content")
        if not isinstance(content, dict) or content.get("type") != "json_schema" or \
                set(content) - {"type", "json_schema", "style"} or content.get("style", "json") != "json":
            raise _err(f"{where}.content must be {{type: json_schema, json_schema: {{...}}}} (other content "
                       "types are not supported)")
        structures.append(_structure(t.get("begin"), content.get("json_schema"), t.get("end", ""), where))
    return structures, _triggers(fmt.get("triggers"), structures, "format.triggers")


def _structure(begin: Any, schema: Any, end: Any, where: str) -> Structure:
    if not isinstance(begin, str) or not begin:
        raise _err(f"{where}.begin must be a non-empty string")
    if not isinstance(end, str):
        raise _err(f"{where}.end must be a string")
    if schema is None:
        schema = {}  # any JSON value
    if not isinstance(schema, (dict, bool)):
        raise _err(f"{where}.schema must be a JSON schema object, got {type(schema).__name__}")
    return Structure(begin, schema, end)


def _triggers(raw: Any, structures: list[Structure], where: str = "triggers") -> list[str]:
    if not isinstance(raw, list) or not raw or not all(isinstance(t, str) and t for t in raw):
        raise _err(f"{where} must be a non-empty list of non-empty strings")
    triggers = list(dict.fromkeys(raw))
    for a in triggers:
        for b in triggers:
            if a != b and b.startswith(a):
                raise _err(f"{where}: {a!r} is a prefix of {b!r}; triggers must not start one another")
    for s in structures:
        if not any(s.begin.startswith(t) for t in triggers):
            raise _err(f"begin {s.begin!r} starts with none of the {where} ({', '.join(map(repr, triggers))}); "
                       "every begin must start with a trigger")
    return triggers


def normalize(spec: Any) -> str:
    """The cache key and compiled form: compact JSON ``{"structures": [...], "triggers": [...]}``."""
    structures, triggers = parse(spec)
    return json.dumps({"structures": [{"begin": s.begin, "schema": s.schema, "end": s.end} for s in structures],
                       "triggers": triggers}, separators=(",", ":"), ensure_ascii=False)


def load(norm: str) -> tuple[list[Structure], list[str]]:
    """The structures and triggers of a normalized spec."""
    data = json.loads(norm)
    return [Structure(s["begin"], s["schema"], s["end"]) for s in data["structures"]], list(data["triggers"])


def by_trigger(structures: list[Structure], triggers: list[str]) -> list[tuple[str, list[Structure]]]:
    """Each trigger with the structures whose begin starts with it (triggers that start none dropped)."""
    out = []
    for t in triggers:
        group = [s for s in structures if s.begin.startswith(t)]
        if group:
            out.append((t, group))
    return out
