"""JSON Schemas that xgrammar enforces exactly; refusals, by name, of what it only approximates.

xgrammar compiles most of JSON Schema, but some constructs it drops with a warning or silently:
it would compile the schema and let outputs through that break it. The promise of constrained
decoding is that every finished output validates, so :func:`prepare_json_schema` walks the
schema the way a validator would (from the root, following local ``$ref``\\ s) and either
returns the schema to compile or raises :class:`UnsupportedSchema` naming the construct and
where it is. The rules (docs/structured-output.md, "What xgrammar cannot enforce") were found
by reading the grammars xgrammar builds (``xgrammar.Grammar.from_json_schema``) and checked by
generating under every JSONSchemaBench schema (tests/runtime/constrained/test_schema_check.py).

A few rewrites let xgrammar enforce a schema it would otherwise get wrong; each one only
narrows what the schema accepts, so outputs still validate against the original:

- a schema without ``type`` whose keywords belong to some types (``minLength``, ``minimum``,
  ``required``...) gets those types: xgrammar would otherwise accept any JSON value there;
- ``enum`` / ``const`` values that do not match a sibling ``type`` are dropped (xgrammar emits
  enum values without looking at ``type``);
- a ``oneOf`` whose branches provably exclude each other becomes ``anyOf`` (the same set).

Pure Python; the input is never modified.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import regex

__all__ = ["UnsupportedSchema", "prepare_json_schema"]


class UnsupportedSchema(ValueError):
    """A schema construct the grammar engine cannot enforce exactly."""


class _Unsatisfiable(UnsupportedSchema):
    """No value is valid under this (sub)schema."""


MAX_REWRITES = 256  # merges of one schema (a $ref that refers to itself with siblings loops)


STRING_KEYWORDS = ("minLength", "maxLength", "pattern")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
ARRAY_KEYWORDS = ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "contains",
                  "minContains", "maxContains", "uniqueItems", "unevaluatedItems")
OBJECT_KEYWORDS = ("properties", "patternProperties", "additionalProperties", "propertyNames",
                   "required", "minProperties", "maxProperties", "dependentRequired",
                   "dependentSchemas", "dependencies", "unevaluatedProperties")
COMBINATORS = ("anyOf", "oneOf", "allOf")
# Keywords that constrain an instance. Anything else (title, description, default, format,
# x-..., $defs, ...) the validator does not assert (format only with a FormatChecker).
ASSERTIONS = frozenset((
    "type", "enum", "const", *STRING_KEYWORDS, *NUMBER_KEYWORDS, *ARRAY_KEYWORDS,
    *OBJECT_KEYWORDS, *COMBINATORS, "not", "if", "$ref", "$dynamicRef", "$recursiveRef",
))
_FAMILIES = (("string", STRING_KEYWORDS), ("number", NUMBER_KEYWORDS),
             ("array", ARRAY_KEYWORDS), ("object", OBJECT_KEYWORDS))
_TYPES = frozenset(("string", "number", "integer", "boolean", "null", "array", "object"))

# keyword -> why it is refused wherever a validator would reach it
REFUSED = {
    "not": "a grammar cannot enforce it",
    "if": "if/then/else is not enforced by the grammar engine",
    "dependentRequired": "the grammar engine ignores it",
    "dependencies": "the grammar engine ignores it",
    "dependentSchemas": "the grammar engine ignores it",
    "contains": "the grammar engine ignores it",
    "uniqueItems": "a grammar cannot enforce it",
    "$dynamicRef": "dynamic references are not supported",
    "$recursiveRef": "dynamic references are not supported",
}
# A regex construct xgrammar drops with a warning (its other unsupported constructs fail to
# compile with their own error).
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_LEGACY_DRAFT = re.compile(r"draft-0[3-7]/")
# A pattern that is one single-character atom, repeated: [class], \d-like escape, or '.'
_ONE_ATOM = re.compile(r"\^?(?P<atom>\[(?:\\.|[^\]\\])+\]|\\[dDwWsS]|\.)"
                       r"(?P<rep>[+*]|\{\d+(?:,\d*)?\})\$?")


def prepare_json_schema(schema: Any) -> Any:
    """The schema to compile for ``schema`` (a copy, maybe narrowed), or UnsupportedSchema."""
    if not isinstance(schema, dict):
        return schema
    try:
        return _Checker(copy.deepcopy(schema)).run()
    except RecursionError:
        raise UnsupportedSchema("the schema nests too deeply to check") from None


def _types(node: dict[str, Any]) -> set[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None


def _value_types(v: Any) -> set[str]:
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v.is_integer()):
        return {"integer", "number"}
    if isinstance(v, float):
        return {"number"}
    if isinstance(v, str):
        return {"string"}
    return {"array"} if isinstance(v, list) else {"object"}


def canonical_json(v: Any) -> str:
    """A key under which two JSON values are equal iff the validator calls them equal (1 and 1.0
    are; true and 1 are not; object key order does not count)."""
    def norm(x: Any) -> Any:
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, (int, float)):
            return ["#num", float(x)]
        if isinstance(x, list):
            return [norm(y) for y in x]
        return {k: norm(y) for k, y in x.items()}
    return json.dumps(norm(v), sort_keys=True)


def _overlap(a: set[str], b: set[str]) -> bool:
    if a & b:
        return True
    return ("integer" in a and "number" in b) or ("number" in a and "integer" in b)


def _listed(node: dict[str, Any]) -> Any:
    """The values a schema node lists: its const (as a list of one), else its enum (None if none)."""
    return [node["const"]] if "const" in node else node.get("enum")


def _all_outside(values: list[Any], other: dict[str, Any]) -> bool:
    """Whether none of ``values`` is valid under ``other``, by the values it lists or its types."""
    o_vals = _listed(other)
    o_keys = {canonical_json(v) for v in o_vals} if isinstance(o_vals, list) else None
    o_types = _types(other)
    return all((o_keys is not None and canonical_json(v) not in o_keys)
               or (o_types is not None and not _overlap(_value_types(v), o_types)) for v in values)


def _anchor_in_middle(pattern: str) -> bool:
    """True when ``^`` / ``$`` stands anywhere but at the ends of a top-level alternative
    (xgrammar drops such anchors, which can turn an impossible pattern into a possible one)."""
    n, i = len(pattern), 0
    in_class = False
    at_start = [True]  # per open group: did it open where an alternative starts?
    alt_start = True  # nothing but '(' since the start of the current alternative
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            alt_start = False
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class, alt_start = True, False
        elif c == "(":
            at_start.append(alt_start)
            if pattern.startswith("(?:", i):
                i += 2
        elif c == ")":
            if len(at_start) > 1:
                at_start.pop()
            alt_start = False
        elif c == "|":
            alt_start = at_start[-1]
        elif c == "^":
            if not alt_start:
                return True
        elif c == "$":
            j, depth = i + 1, len(at_start) - 1
            while j < n and pattern[j] == ")":
                j, depth = j + 1, depth - 1
            if not (j == n or (pattern[j] == "|" and depth == 0)):
                return True
        else:
            alt_start = False
        i += 1
    return False


SEARCH_TIMEOUT_S = 0.1  # a user pattern may backtrack for hours: '^(a|aa)+$' on 'aaa...ab'


def _search(pattern: str, text: str) -> bool:
    # The `regex` module, not `re`: it can stop a search after a timeout and release the GIL
    # meanwhile (`re` held the GIL, stalling the whole engine process, for as long as it ran).
    try:
        return regex.search(pattern, text, timeout=SEARCH_TIMEOUT_S, concurrent=True) is not None
    except (regex.error, TimeoutError):
        return True  # unknown: assume it matches


class _Unmergeable(Exception):
    pass


_MIN_KEYS = ("minLength", "minItems", "minProperties", "minimum", "minContains")
_MAX_KEYS = ("maxLength", "maxItems", "maxProperties", "maximum", "maxContains")


def _merge(a: Any, b: Any, deref: Any) -> Any:
    """A schema accepting exactly what both ``a`` and ``b`` accept (allOf), for the common
    cases; raises _Unmergeable otherwise. ``deref`` follows a bare ``$ref``."""
    a, b = deref(a), deref(b)
    if a is True or a == {}:
        return copy.deepcopy(b)
    if b is True or b == {}:
        return copy.deepcopy(a)
    if a is False or b is False:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        raise _Unmergeable("a subschema is not an object")
    if "$ref" in a or "$ref" in b:  # a $ref with keywords beside it: their intersection
        side, other = (a, b) if "$ref" in a else (b, a)
        target = deref({"$ref": side["$ref"]})
        if isinstance(target, dict) and "$ref" in target:
            raise _Unmergeable(f"unresolved $ref {side['$ref']!r}")
        rest = {k: v for k, v in side.items() if k != "$ref"}
        return _merge(_merge(rest, target, deref), other, deref)
    if "allOf" in a or "allOf" in b:
        inner_a = [{k: v for k, v in a.items() if k != "allOf"}, *a.get("allOf", [])]
        inner_b = [{k: v for k, v in b.items() if k != "allOf"}, *b.get("allOf", [])]
        out: Any = True
        for part in (*inner_a, *inner_b):
            out = _merge(out, part, deref)
        return out
    comb_a = [c for c in ("anyOf", "oneOf") if c in a]
    comb_b = [c for c in ("anyOf", "oneOf") if c in b]
    if comb_a and comb_b:
        raise _Unmergeable("combinators on both sides")
    if comb_a or comb_b:  # allOf(x, anyOf(B)) == anyOf(allOf(x, B_i)); the same for oneOf
        outer, inner = (a, b) if comb_b else (b, a)
        kind = (comb_a or comb_b)[0]
        rest = {k: v for k, v in inner.items() if k != kind}
        branches = [_merge(outer, _merge(rest, br, deref), deref) for br in inner[kind]]
        return {kind: branches}
    out = copy.deepcopy(a)
    for key, bv in b.items():
        if key not in out:
            out[key] = copy.deepcopy(bv)
            continue
        av = out[key]
        if av == bv or key not in ASSERTIONS:
            continue
        if key == "type":
            ta = {av} if isinstance(av, str) else set(av)
            tb = {bv} if isinstance(bv, str) else set(bv)
            both = (ta & tb) | ({"integer"} if ("integer" in ta and "number" in tb)
                                or ("number" in ta and "integer" in tb) else set())
            if not both:
                return False
            out[key] = sorted(both) if len(both) > 1 else next(iter(both))
        elif key == "required":
            out[key] = list(dict.fromkeys([*av, *bv]))
        elif key in ("enum", "const"):
            keys = {canonical_json(v) for v in (bv if key == "enum" else [bv])}
            kept = [v for v in (av if key == "enum" else [av]) if canonical_json(v) in keys]
            if not kept:
                return False
            out[key] = kept if key == "enum" else kept[0]
        elif key in _MIN_KEYS and not isinstance(av, bool) and not isinstance(bv, bool):
            out[key] = max(av, bv)
        elif key in _MAX_KEYS and not isinstance(av, bool) and not isinstance(bv, bool):
            out[key] = min(av, bv)
        elif key == "properties":
            merged = dict(av)
            for name, sub in bv.items():
                merged[name] = _merge(av[name], sub, deref) if name in av else sub
            out[key] = merged
        elif key == "items" and isinstance(av, dict) and isinstance(bv, dict):
            out[key] = _merge(av, bv, deref)
        else:
            raise _Unmergeable(f"both give {key!r}")
    if "enum" in out and "const" in out:
        if canonical_json(out["const"]) not in {canonical_json(v) for v in out["enum"]}:
            return False
        del out["enum"]
    # additionalProperties / items are relative to their side's properties / prefixItems
    for side, other in ((a, b), (b, a)):
        extra = side.get("additionalProperties")
        if extra is not None and extra is not True:
            if side.get("patternProperties") or other.get("patternProperties"):
                raise _Unmergeable("additionalProperties next to patternProperties")
            own = side.get("properties") or {}
            for name in list(other.get("properties") or {}):
                if name in own:
                    continue
                if extra is False:
                    if name in (out.get("required") or []):
                        return False
                    del out["properties"][name]  # forbidden by this side; never generated
                else:
                    out["properties"][name] = _merge(out["properties"][name], extra, deref)
        if "prefixItems" in side and "items" in other and "prefixItems" not in other:
            raise _Unmergeable("items next to prefixItems")
    return out


def _outside_classes(pattern: str) -> Iterator[tuple[int, str]]:
    """(index, character) of each regex character that is neither escaped nor inside a
    character class."""
    in_class, i = False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        else:
            yield i, c
        i += 1


def _repeated_group_with_repeat(pattern: str) -> bool:
    """True for a group that is repeated or optional and itself holds a repeat, such as
    ``(-[a-z]+)?``: xgrammar's JSON-string regexes then let the group's first part be skipped
    (``1.2a`` passes ``^1\\.2(-[a-z]+)?$``)."""
    stack = [False]  # per open group: holds a quantifier
    opened = -1  # index of the last group opening
    for i, c in _outside_classes(pattern):
        if c == "(":
            stack.append(False)
            opened = i
        elif c == ")" and len(stack) > 1:
            inner = stack.pop()
            if inner and i + 1 < len(pattern) and pattern[i + 1] in "?*+{":
                return True
            stack[-1] = stack[-1] or inner
        elif c in "*+" or (c == "?" and opened != i - 1) or (c == "{" and re.match(r"\{\d", pattern[i:])):
            stack[-1] = True  # (a '?' right after '(' opens (?: and friends: no quantifier)
    return False


def _dot_outside_class(pattern: str) -> bool:
    return any(c == "." for _, c in _outside_classes(pattern))


class _Checker:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.original = copy.deepcopy(root)  # refs of a schema "as written" resolve here
        self.legacy_ref = bool(_LEGACY_DRAFT.search(str(root.get("$schema", ""))))
        self.seen_refs: set[str] = set()
        self.rewrites = 0

    def run(self) -> Any:
        return self.node(self.root, "")

    def fail(self, path: str, what: str) -> UnsupportedSchema:
        return UnsupportedSchema(f"{what} (at {path or '/'})")

    def unsat(self, path: str, what: str) -> UnsupportedSchema:
        return _Unsatisfiable(f"{what}: no value is valid (at {path or '/'})")

    def resolve(self, ref: Any, root: Any) -> tuple[Any, str] | None:
        """The node a local ``$ref`` points at, or None for a ref xgrammar resolves itself."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        hit = _follow_pointer(ref, root)
        return None if hit is None else (hit[0], ref[1:])

    def deref(self, node: Any, root: Any, strict: bool = False) -> Any:
        """Follow ``$ref`` chains to the schema they name; ``strict``: only a ``$ref`` with no
        other assertion beside it (else siblings are ignored, which widens the schema)."""
        for _ in range(32):
            if not (isinstance(node, dict) and "$ref" in node):
                return node
            if strict and not self.legacy_ref and ASSERTIONS.intersection(node) != {"$ref"}:
                return node
            hit = self.resolve(node["$ref"], root)
            if hit is None:
                return node
            node = hit[0]
        return node

    # -- the walk -------------------------------------------------------------------------

    def node(self, node: Any, path: str) -> Any:
        if not isinstance(node, dict):
            return node  # booleans; anything else xgrammar reports itself
        for key, why in REFUSED.items():
            if key in node and not (key == "uniqueItems" and node[key] is False):
                raise self.fail(path, f"the keyword {key!r} is not supported: {why}")
        assertions = ASSERTIONS.intersection(node)
        if "$ref" in node:
            ref = node["$ref"]
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                raise self.fail(path, f"'$ref' {ref!r} is not supported: only references inside the schema "
                                      "('#/$defs/...', '#/definitions/...') are")
            others = sorted(assertions - {"$ref"})
            if others and not self.legacy_ref:
                # xgrammar ignores keywords beside a $ref: inline the target, intersected with them
                siblings = {k: v for k, v in node.items() if k != "$ref"}
                target = self.deref({"$ref": node["$ref"]}, self.root, strict=True)
                merged = self.merged(path, f"'$ref' next to {', '.join(others)}", [siblings, target])
                node.clear()
                node.update(merged)
                return self.node(node, path)
            hit = self.resolve(node["$ref"], self.root)
            if hit is not None and hit[1] not in self.seen_refs:
                self.seen_refs.add(hit[1])
                target, where = hit
                replaced = self.node(target, where)
                assert replaced is target or not isinstance(target, dict)
            return node
        combinators = [c for c in COMBINATORS if c in node]
        if combinators:
            return self.combinator(node, path, combinators, assertions)
        if "enum" in node or "const" in node:
            return self.enum(node, path, assertions)
        types = _types(node)
        if types is None:
            if "type" in node:
                return node  # malformed: xgrammar reports it
            inferred = {fam for fam, kws in _FAMILIES if any(k in node for k in kws)}
            if not inferred:
                return node
            types = inferred
            node["type"] = sorted(inferred) if len(inferred) > 1 else next(iter(inferred))
        if "string" in types:
            self.string(node, path)
        if types & {"number", "integer"}:
            self.number(node, path, types)
        if "object" in types:
            self.object(node, path)
        if "array" in types:
            self.array(node, path)
        return node

    def merged(self, path: str, what: str, parts: list[Any]) -> dict[str, Any]:
        """The intersection of ``parts`` as one schema, or UnsupportedSchema naming ``what``."""
        self.rewrites += 1
        if self.rewrites > MAX_REWRITES:
            raise self.fail(path, f"{what} is not supported here: merging it does not end (a recursive $ref?)")
        try:
            out: Any = True
            for part in parts:
                out = _merge(out, part, lambda n: self.deref(n, self.root, strict=True))
        except _Unmergeable as e:
            raise self.fail(path, f"{what} is not supported: the grammar engine compiles them apart, and "
                                  f"they could not be merged into one schema ({e})") from None
        if out is False:
            raise self.unsat(path, what)
        return out if isinstance(out, dict) else {}

    def combinator(self, node: dict[str, Any], path: str, combinators: list[str],
                   assertions: frozenset[str]) -> dict[str, Any]:
        kind = combinators[0]
        others = sorted(assertions - {kind})
        branches = node[kind]
        if not isinstance(branches, list) or not branches:
            return node  # malformed: xgrammar reports it
        if kind == "allOf" or others:
            # xgrammar compiles a combinator's branches alone (siblings dropped) and keeps only the
            # first of several allOf subschemas: rewrite to an equivalent schema it handles.
            siblings = {k: v for k, v in node.items() if k != kind}
            if kind == "allOf":
                what = f"'allOf' next to {', '.join(others)}" if others else "'allOf' with several subschemas"
                merged = self.merged(path, what, [siblings, *branches])
            else:
                what = f"{kind!r} next to {', '.join(others)}"
                merged = {kind: [self.merged(path, what, [siblings, b]) for b in branches]}
                merged.update({k: v for k, v in siblings.items() if k not in ASSERTIONS})
            node.clear()
            node.update(merged)
            result: dict[str, Any] = self.node(node, path)
            return result
        originals, prepared = [], []
        for i, b in enumerate(branches):
            before = copy.deepcopy(b)
            try:
                prepared.append(self.node(b, f"{path}/{kind}/{i}"))
            except _Unsatisfiable:
                continue  # a branch no value fits never matches: leave it out
            originals.append(before)
        if not prepared:
            raise self.unsat(path, f"every {kind} branch")
        node[kind] = prepared
        if kind == "oneOf":
            for i, gen in enumerate(node[kind]):
                for j, other in enumerate(originals):
                    if i != j and not self.excludes(gen, other):
                        raise self.fail(path, f"'oneOf' whose branches {min(i, j)} and {max(i, j)} may both match "
                                              "is not supported: a grammar cannot enforce 'exactly one'; use anyOf, "
                                              "or make the branches exclusive (different types or a const "
                                              "discriminator property)")
            node["anyOf"] = node.pop("oneOf")
        return node

    def enum(self, node: dict[str, Any], path: str, assertions: frozenset[str]) -> dict[str, Any]:
        others = sorted(assertions - {"enum", "const", "type"})
        if others:
            raise self.fail(path, f"'enum'/'const' next to {', '.join(others)} is not supported: the grammar "
                                  "engine emits the listed values without checking them; list only values that pass")
        if "const" in node:
            values = [node["const"]]
            if "enum" in node and isinstance(node["enum"], list):
                if canonical_json(node["const"]) not in {canonical_json(v) for v in node["enum"]}:
                    raise self.unsat(path, "'const' is not one of the 'enum' values")
                del node["enum"]
        elif isinstance(node["enum"], list):
            values = node["enum"]
        else:
            return node  # malformed: xgrammar reports it
        types = _types(node)
        if types is not None:
            kept = [v for v in values if _overlap(_value_types(v), types)]
            if not kept:
                raise self.unsat(path, "no 'enum'/'const' value matches 'type'")
            if len(kept) < len(values):
                if "const" in node:
                    node["const"] = kept[0]
                else:
                    node["enum"] = kept
        return node

    def string(self, node: dict[str, Any], path: str) -> None:
        if "pattern" in node and "format" in node:
            del node["format"]  # xgrammar would enforce the format and drop the pattern;
            # the validator asserts the pattern only (format is an annotation without a checker)
        if "pattern" in node and ("minLength" in node or "maxLength" in node) and "format" not in node:
            self.length_into_pattern(node, path)
        lengths = [k for k in ("minLength", "maxLength") if k in node]
        for k in ("pattern", "format"):
            if k in node and lengths:
                raise self.fail(path, f"{' and '.join(lengths)} together with {k!r} is not supported: the grammar "
                                      f"engine ignores the length then; put the length into the pattern")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            self.pattern(pattern, path)

    def length_into_pattern(self, node: dict[str, Any], path: str) -> None:
        """``[a-z]+`` with maxLength 12 -> ``^[a-z]{1,12}$``: one repeated single-character atom
        carries the length in its repeat count (xgrammar ignores a length beside a pattern).
        The new pattern is matched whole, so its strings also match the original (searched)."""
        m = _ONE_ATOM.fullmatch(node["pattern"]) if isinstance(node["pattern"], str) else None
        lo_len, hi_len = node.get("minLength", 0), node.get("maxLength")
        if m is None or isinstance(lo_len, bool) or not isinstance(lo_len, int) or (
                hi_len is not None and (isinstance(hi_len, bool) or not isinstance(hi_len, int))):
            return
        atom, rep = m.group("atom"), m.group("rep")
        if rep == "+":
            lo, hi = 1, None
        elif rep == "*":
            lo, hi = 0, None
        else:
            lo_s, comma, hi_s = rep[1:-1].partition(",")
            lo = int(lo_s)
            hi = int(hi_s) if hi_s else (None if comma else lo)
        lo = max(lo, lo_len)
        hi = hi_len if hi is None else (hi if hi_len is None else min(hi, hi_len))
        if hi is not None and lo > hi:
            raise self.unsat(path, "the pattern's repeat count and minLength/maxLength do not overlap")
        node["pattern"] = f"^{atom}{{{lo},{'' if hi is None else hi}}}$"
        node.pop("minLength", None)
        node.pop("maxLength", None)

    def pattern(self, pattern: str, path: str, key: bool = False) -> None:
        if _repeated_group_with_repeat(pattern):
            raise self.fail(path, f"pattern {pattern!r}: a repeated or optional group holding a repeat (like "
                                  "'(-[a-z]+)?') is not supported: the grammar engine compiles it wrongly inside "
                                  "JSON strings")
        if key and _dot_outside_class(pattern):
            raise self.fail(path, f"patternProperties {pattern!r}: '.' in a key pattern is not supported: the "
                                  "grammar engine lets it match a raw '\"' there; use a class such as [^\"]")
        if _LOOKAROUND.search(pattern):
            raise self.fail(path, f"pattern {pattern!r}: lookaround assertions are not supported "
                                  "(the grammar engine ignores them)")
        if _anchor_in_middle(pattern):
            raise self.fail(path, f"pattern {pattern!r}: '^' or '$' inside the pattern is not supported "
                                  "(the grammar engine ignores it); anchor only at the ends")

    def number(self, node: dict[str, Any], path: str, types: set[str]) -> None:
        if "multipleOf" not in node:
            return
        m = node["multipleOf"]
        if "number" in types:
            raise self.fail(path, "'multipleOf' on a number is not supported: the grammar engine ignores it "
                                  "(it is enforced on integers without a range)")
        ranged = [k for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in node]
        if ranged:
            raise self.fail(path, f"'multipleOf' together with {', '.join(ranged)} is not supported: the grammar "
                                  "engine ignores the multipleOf then")
        if not (isinstance(m, int) or (isinstance(m, float) and m.is_integer())):
            raise self.fail(path, "'multipleOf' that is not a whole number is not supported on an integer")

    def object(self, node: dict[str, Any], path: str) -> None:
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        required = node.get("required")
        pattern_props = node.get("patternProperties")
        additional = node.get("additionalProperties")
        open_additional = additional is not None and additional is not False
        if not open_additional:
            # "name": false only forbids the key; strict generation never writes unnamed keys
            for name in [k for k, v in props.items() if v is False]:
                if isinstance(required, list) and name in required:
                    raise self.unsat(path, f"required property {name!r} has the schema false")
                del props[name]
            if isinstance(pattern_props, dict):
                for pat in [k for k, v in pattern_props.items() if v is False]:
                    del pattern_props[pat]
        if isinstance(required, list):
            for name in [r for r in required if isinstance(r, str) and r not in props]:
                if additional is False:
                    raise self.unsat(path, f"required property {name!r} is not allowed (additionalProperties is false)")
                if isinstance(pattern_props, dict) and any(_search(p, name) for p in pattern_props):
                    raise self.fail(path, f"required property {name!r} is not listed in 'properties': the grammar "
                                          "engine never generates it; add it to 'properties'")
                # the validator checks it against additionalProperties (or nothing): name it so
                props[name] = additional if isinstance(additional, dict) else {}
                node["properties"] = props
        if isinstance(pattern_props, dict) and pattern_props:
            if open_additional:
                raise self.fail(path, "'patternProperties' together with 'additionalProperties' is not supported: "
                                      "the grammar engine may give a pattern-matching key the additional schema")
            for pat in pattern_props:
                self.pattern(pat, f"{path}/patternProperties", key=True)
                for name in props:
                    if _search(pat, name):
                        raise self.fail(path, f"property {name!r} also matches patternProperties {pat!r}: its value "
                                              "must pass both schemas, which the grammar engine does not intersect")
        n_required = len(set(required)) if isinstance(required, list) else 0
        min_props = node.get("minProperties")
        if (open_additional or pattern_props) and isinstance(min_props, (int, float)) and min_props > n_required:
            raise self.fail(path, "'minProperties' beyond the required properties together with "
                                  "additionalProperties/patternProperties is not supported: a repeated key counts "
                                  "twice for the grammar but once for the validator")
        for name, sub in list(props.items()):
            try:
                props[name] = self.node(sub, f"{path}/properties/{name}")
            except _Unsatisfiable:
                if open_additional or (isinstance(required, list) and name in required):
                    raise
                del props[name]  # an optional property no value fits: never generate it
        if isinstance(pattern_props, dict):
            for pat, sub in pattern_props.items():
                pattern_props[pat] = self.node(sub, f"{path}/patternProperties/{pat}")
        if isinstance(additional, dict):
            node["additionalProperties"] = self.node(additional, f"{path}/additionalProperties")
        names = node.get("propertyNames")
        if isinstance(names, dict):
            if "type" not in names and "enum" not in names and "const" not in names and "$ref" not in names:
                names = {**names, "type": "string"}  # property names are strings
            node["propertyNames"] = self.node(names, f"{path}/propertyNames")

    def array(self, node: dict[str, Any], path: str) -> None:
        items = node.get("items")
        if isinstance(items, dict):
            node["items"] = self.node(items, f"{path}/items")
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            node["prefixItems"] = [self.node(s, f"{path}/prefixItems/{i}") for i, s in enumerate(prefix)]

    # -- exclusiveness --------------------------------------------------------------------

    def gen_types(self, node: Any) -> set[str] | None:
        """Types of the values generated under ``node`` (already prepared), None if unknown."""
        if not isinstance(node, dict):
            return None
        if "enum" in node or "const" in node:
            vals = _listed(node)
            if isinstance(vals, list):
                return set().union(*(_value_types(v) for v in vals)) if vals else set()
        return _types(node)

    def excludes(self, gen: Any, other: Any, depth: int = 0) -> bool:
        """True if no value generated under ``gen`` (prepared) is valid under ``other`` (as written)."""
        gen, other = self.deref(gen, self.root), self.deref(other, self.original)
        if gen is False or other is False:
            return True
        if not isinstance(gen, dict) or not isinstance(other, dict) or depth > 8:
            return False
        g_vals = _listed(gen)
        if isinstance(g_vals, list):
            return _all_outside(g_vals, other)
        o_vals, o_types = _listed(other), _types(other)
        g_types = self.gen_types(gen)
        if g_types is None:
            return False
        if o_types is not None and not _overlap(g_types, o_types):
            return True
        if isinstance(o_vals, list) and not any(_overlap(_value_types(v), g_types) for v in o_vals):
            return True
        if g_types == {"object"}:
            return self.objects_exclude(gen, other, depth)
        return False

    def objects_exclude(self, gen: dict[str, Any], other: dict[str, Any], depth: int) -> bool:
        g_props = _dict_field(gen, "properties")
        o_props = _dict_field(other, "properties")
        g_req = _list_field(gen, "required")
        o_req = _list_field(other, "required")
        # a property gen always writes whose value other refuses
        for p in g_req:
            if p in o_props and p in g_props and self.excludes(g_props[p], o_props[p], depth + 1):
                return True
        # a property other requires that gen never writes (strict: only named properties)
        closed = gen.get("additionalProperties") in (None, False) and not gen.get("patternProperties")
        return closed and any(p not in g_props for p in o_req)


def _dict_field(node: dict[str, Any], key: str) -> dict[str, Any]:
    """``node[key]`` when it is an object, else {}."""
    value = node.get(key)
    return value if isinstance(value, dict) else {}


def _list_field(node: dict[str, Any], key: str) -> list[Any]:
    """``node[key]`` when it is an array, else []."""
    value = node.get(key)
    return value if isinstance(value, list) else []


def _follow_pointer(ref: str, root: Any) -> tuple[Any] | None:
    """The node the JSON pointer after ``#`` in ``ref`` names in ``root`` (in a 1-tuple: the node
    may be anything), or None when it names nothing."""
    node: Any = root
    for p in (p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]):
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
        else:
            return None
    return (node,)


def _plain_deref(node: Any, root: Any) -> Any:
    """Follow a ``$ref`` that stands alone (no assertion beside it) to the local schema it names;
    anything else is returned as it is."""
    for _ in range(32):
        if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)) or ASSERTIONS.intersection(node) != {"$ref"}:
            return node
        ref = node["$ref"]
        hit = _follow_pointer(ref, root) if ref.startswith("#/") or ref == "#" else None
        if hit is None:
            return node
        node = hit[0]
    return node


def exclude_each_other(a: Any, b: Any, root: Any, budget: list[int] | None = None) -> bool:
    """True when no JSON value is valid under both ``a`` and ``b`` as a validator reads them
    (False when it cannot tell): their types are disjoint, or their listed values are, or one is
    an object schema and a property that one of them requires has schemas in both that exclude
    each other (a discriminator). ``budget``: comparisons left, shared by the calls of one
    schema (a hostile one could ask for exponentially many); none left counts as "cannot tell"."""
    budget = [10_000] if budget is None else budget
    budget[0] -= 1
    a, b = _plain_deref(a, root), _plain_deref(b, root)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict) or budget[0] < 0:
        return False
    for x, y in ((a, b), (b, a)):
        x_vals = _listed(x)
        if isinstance(x_vals, list) and _all_outside(x_vals, y):
            return True
    a_types, b_types = _types(a), _types(b)
    if a_types is not None and b_types is not None and not _overlap(a_types, b_types):
        return True
    if {"object"} in (a_types, b_types):  # a value valid under both is an object: a discriminator?
        a_props, b_props = _dict_field(a, "properties"), _dict_field(b, "properties")
        required = set(_list_field(a, "required")) | set(_list_field(b, "required"))  # present in such a value
        return any(isinstance(p, str) and p in a_props and p in b_props
                   and exclude_each_other(a_props[p], b_props[p], root, budget) for p in required)
    return False
