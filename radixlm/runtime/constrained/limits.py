"""Size limits on constraints, checked before anything compiles.

Grammar engines compile some inputs in time that grows much faster than their size (xgrammar's
schemas of many properties, enums and ``choices`` lists of many strings: docs/machines.md), and
deep nesting overflows Python's recursion limit, or the grammar
engine's stack (llguidance follows ``$ref`` chains recursively: ~1,000 definitions that
each refer to the next crash the process). These checks are linear in the spec's size, iterative
(no recursion), and say what is too big and the limit. A schema's bytes are bounded loosely (real
API schemas reach hundreds of KB); what it costs to compile is bounded by these checks, the
compile time limit (``compile_pool.py``) and the grammar engine's own limits. Measurements and the
reasons for each default: docs/reliability.md, "Grammar, sampling-parameter and IR fuzzing". The
defaults admit every schema of JSONSchemaBench (largest 59,862 bytes, deepest 63 levels, 67
through ``$ref``, longest enum 463 values, largest count 131,072).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_SHORTEST_TEXT", "GrammarBounds", "NoFiniteText", "SpecLimits", "check_spec", "endless_error",
           "grammar_bounds", "ref_nesting"]

# JSON Schema keywords holding a count that a grammar unrolls or counts up to.
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")
# Keywords whose values are data, not subschemas: their contents are not counted as nesting.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
# Keywords whose values map names to subschemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# {m}, {m,}, {m,n} (regex and EBNF)
_SURROGATE = re.compile("[\ud800-\udfff]")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True)
class SpecLimits:
    """The largest constraint a request may carry. ``max_bytes``: the text of a regex, a grammar,
    the choices' UTF-8 bytes together; ``max_schema_bytes``: a schema's compact JSON (a structural
    tag's, its schemas included); ``max_nesting``: JSON containers inside one another in a schema,
    open groups in a regex or EBNF rule; ``max_ref_nesting``: JSON containers inside one another
    with each local ``$ref`` read as the schema it names; ``max_enum``: values of one ``enum`` and
    strings of one ``choices``; ``max_repeat``: a ``{m,n}`` count and the value of
    ``minLength``/``maxItems``/... ."""

    max_bytes: int = 131_072
    max_schema_bytes: int = 1_048_576
    max_nesting: int = 128
    max_ref_nesting: int = 1024
    max_enum: int = 4096
    max_repeat: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_schema_bytes", "max_nesting", "max_ref_nesting", "max_enum", "max_repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _too_big(kind: str, what: str, value: int, limit: int, flag: str) -> ValueError:
    return ValueError(f"{kind} is too large: {what} is {value:,}, the limit is {limit:,} "
                      f"(server option --grammar-max-{flag})")


def check_spec(kind: str, norm: Any, limits: SpecLimits) -> None:
    """Raise ValueError if the normalized spec (see ``normalize_spec``) passes a limit."""
    texts = norm if kind == "choices" else (norm,)
    if kind == "choices" and len(norm) > limits.max_enum:
        raise _too_big(kind, "the number of choices", len(norm), limits.max_enum, "enum")
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if kind in ("json_schema", "structural_tag"):
        if size > limits.max_schema_bytes:
            raise _too_big(kind, "its size in bytes", size, limits.max_schema_bytes, "schema-bytes")
    elif size > limits.max_bytes:
        raise _too_big(kind, "its size in bytes", size, limits.max_bytes, "bytes")
    for text in texts:
        bad = _SURROGATE.search(text)
        if bad:
            raise ValueError(f"{kind} is not valid Unicode text: it holds the lone surrogate "
                             f"U+{ord(bad.group()):04X} (a \\u escape of half a UTF-16 pair?)")
    if kind == "json_schema":
        _check_schema(json.loads(norm), limits)
    elif kind == "structural_tag":
        for s in json.loads(norm)["structures"]:
            _check_schema(s["schema"], limits)
    elif kind in ("regex", "ebnf"):
        depth = _group_depth(norm, quotes=kind == "ebnf")
        if depth > limits.max_nesting:
            raise _too_big(kind, "the nesting of parenthesized groups", depth, limits.max_nesting, "nesting")
        _check_repeats(kind, norm, limits)


def _check_repeats(kind: str, text: str, limits: SpecLimits) -> None:
    for m in _REPEAT.finditer(text):
        if m.start() and text[m.start() - 1] == "\\":
            continue  # an escaped brace: literal text
        count = max(int(g) for g in m.groups() if g)
        if count > limits.max_repeat:
            raise _too_big(kind, f"the repetition count in {m.group(0)!r}", count, limits.max_repeat, "repeat")


def _check_schema(schema: Any, limits: SpecLimits) -> None:
    """Nesting, enum sizes, counts, patterns and ``multipleOf`` of a parsed schema, walked
    without recursion."""
    kind = "json_schema"
    stack: list[tuple[Any, int, str]] = [(schema, 1, "")]
    refs = False
    while stack:
        node, depth, where = stack.pop()
        if depth > limits.max_nesting:
            raise _too_big(kind, "its nesting depth (objects and arrays inside one another)", depth,
                           limits.max_nesting, "nesting")
        if isinstance(node, list):
            stack.extend((v, depth + 1, f"{where}/{i}") for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        refs = refs or isinstance(node.get("$ref"), str)
        step = node.get("multipleOf")
        if "multipleOf" in node and (isinstance(step, bool) or not isinstance(step, (int, float)) or not step > 0):
            raise ValueError(f"json_schema is not valid: 'multipleOf' must be a number greater than 0, got "
                             f"{json.dumps(step)} (at {where or '/'})")
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > limits.max_enum:
            raise _too_big(kind, "the number of enum values", len(enum), limits.max_enum, "enum")
        for key in COUNT_KEYWORDS:
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limits.max_repeat:
                raise _too_big(kind, f"{key!r}", int(min(value, 10**18)), limits.max_repeat, "repeat")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            depth_in = _group_depth(pattern, quotes=False)
            if depth_in > limits.max_nesting:
                raise _too_big(kind, "the nesting of groups in a 'pattern'", depth_in, limits.max_nesting, "nesting")
            _check_repeats(kind, pattern, limits)
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema: a property "enum" is no keyword
                stack.extend((sub, depth + 2, f"{where}/{_escape(key)}/{_escape(name)}") for name, sub in value.items())
            elif key not in _DATA_KEYWORDS and isinstance(value, (dict, list)):
                stack.append((value, depth + 1, f"{where}/{_escape(key)}"))
    if refs:
        depth = ref_nesting(schema)
        if depth > limits.max_ref_nesting:
            raise _too_big(kind, "its nesting through $ref (objects and arrays inside one another, each $ref "
                           "read as the schema it names)", depth, limits.max_ref_nesting, "ref-nesting")


def _escape(key: str) -> str:
    """A key as a JSON pointer writes it."""
    return key.replace("~", "~0").replace("/", "~1")


def resolve_local(ref: str, root: Any) -> Any:
    """The node a local ``$ref`` (``#``, ``#/a/b``, percent-encoded or JSON-pointer-escaped) names in
    ``root``; None for any other, or when it names nothing there."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _own_nesting(node: Any) -> tuple[int, list[str]]:
    """How deep containers nest in the schema ``node`` (``$defs`` left out: they count where
    a ``$ref`` names them) and the ``$ref`` strings it holds."""
    best, refs = 0, []
    stack: list[tuple[Any, int]] = [(node, 1)]
    while stack:
        n, depth = stack.pop()
        best = max(best, depth)
        if isinstance(n, list):
            stack.extend((v, depth + 1) for v in n)
            continue
        if not isinstance(n, dict):
            continue
        if isinstance(n.get("$ref"), str):
            refs.append(n["$ref"])
        for key, value in n.items():
            if key in ("$defs", "definitions"):
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((sub, depth + 2) for sub in value.values())
            elif key not in _DATA_KEYWORDS and isinstance(value, (dict, list)):
                stack.append((value, depth + 1))
    return best, refs


def ref_nesting(schema: Any) -> int:
    """An upper bound of how deep JSON containers nest in ``schema`` when each local ``$ref`` is
    read as the schema it names: what a grammar engine that compiles references recursively
    descends through. A reference back into a cycle is not followed again (an engine refers to
    the rule it is building), so a cycle of schemas counts each member once: the longest path
    through the graph of referenced schemas, each strongly connected component weighing the sum
    of its members' own nesting. Linear in the schema's size; no recursion."""
    index: dict[int, int] = {}
    nodes: list[Any] = []
    todo: list[int] = []

    def node_id(node: Any) -> int:
        if id(node) not in index:
            index[id(node)] = len(nodes)
            nodes.append(node)
            todo.append(len(nodes) - 1)
        return index[id(node)]

    node_id(schema)
    own: dict[int, int] = {}
    succ: dict[int, list[int]] = {}
    while todo:
        i = todo.pop()
        own[i], refs = _own_nesting(nodes[i])
        succ[i] = [node_id(t) for t in (resolve_local(r, schema) for r in refs) if isinstance(t, (dict, list))]
    comp = _components(len(nodes), succ)
    # Tarjan numbers components sinks first: each one's successors are done before it
    members: dict[int, list[int]] = {}
    for v, c in enumerate(comp):
        members.setdefault(c, []).append(v)
    longest: dict[int, int] = {}
    for c in sorted(members):
        after = max((longest[comp[w]] for v in members[c] for w in succ[v] if comp[w] != c), default=0)
        longest[c] = sum(own[v] for v in members[c]) + after
    return longest[comp[0]]


def _components(n: int, succ: dict[int, list[int]]) -> list[int]:
    """Strongly connected components of a graph (Tarjan's, iterative): per vertex, its
    component's number, sinks numbered first."""
    order = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    comp = [-1] * n
    stack: list[int] = []
    counter = components = 0
    for start in range(n):
        if order[start] >= 0:
            continue
        order[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack[start] = True
        work = [(start, 0)]
        while work:
            v, i = work[-1]
            if i < len(succ[v]):
                work[-1] = (v, i + 1)
                w = succ[v][i]
                if order[w] < 0:
                    order[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], order[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == order[v]:
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp[w] = components
                    if w == v:
                        break
                components += 1
    return comp


def _group_depth(text: str, quotes: bool) -> int:
    """The deepest nesting of ``( )`` in a regex (``quotes=False``) or an EBNF grammar, skipping
    escaped characters, character classes ``[...]`` and, in EBNF, quoted literals."""
    depth = best = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a class: ']' right after '[' or '[^' is a literal
            i += 1
            if i < n and text[i] == "^":
                i += 1
            if i < n and text[i] == "]":
                i += 1
            while i < n and text[i] != "]":
                i += 2 if text[i] == "\\" else 1
        elif quotes and c in "\"'":
            i += 1
            while i < n and text[i] != c:
                i += 2 if text[i] == "\\" else 1
        elif quotes and c == "#":  # EBNF comment to the end of the line
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            best = max(best, depth)
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1
    return best


# -- what a compiled grammar can produce -------------------------------------------------------
# xgrammar's serialized grammar (Grammar.serialize_json): each expression is
# ``[type, payload length, payload...]``; the types this analysis reads:
_XBYTES, _XCLASS, _XCLASS_STAR, _XEMPTY, _XRULE_REF, _XSEQUENCE, _XCHOICES, _XREPEAT = 0, 1, 2, 3, 4, 5, 6, 8
_XREGEX = 12  # an inline regex (a JSON schema's pattern): a finite automaton, counted as 0 bytes long
# The longest shortest text any rule of a grammar may have, in bytes; past it a grammar is refused
# (an exponential blow-up such as ``r0 ::= r1 r1; r1 ::= r2 r2; ...``): its forced text would not fit
# any context either. Generous: ``minLength: 1000000`` (the --grammar-max-repeat default) fits.
MAX_SHORTEST_TEXT = 8 * 1024 * 1024
_TOO_LONG = MAX_SHORTEST_TEXT + 1  # lengths saturate here
_NEVER = 2 * _TOO_LONG  # no finite text at all


class UnknownGrammar(Exception):
    """The serialized grammar holds something this analysis does not read."""


@dataclass(frozen=True)
class GrammarBounds:
    """What the analysis of one compiled grammar found.

    ``jump_safe``: the text the grammar forces from any state it can reach is finite (every rule
    reachable from the root derives a finite text, and no user lookahead can make one a dead end),
    so asking the grammar engine for it terminates; when False, jump-forward is off for it."""

    jump_safe: bool


def grammar_bounds(kind: str, serialized: str) -> GrammarBounds:
    """Check a compiled grammar (xgrammar's ``serialize_json`` text) for rules that can never end.

    Raises ValueError when a rule reachable from the root derives no finite text (the grammar
    accepts nothing, or it has a branch that forces text forever once entered: ``root ::= "a" root``,
    a schema object that requires itself), or when a reachable rule's shortest text is longer than
    ``MAX_SHORTEST_TEXT`` bytes. Linear in the grammar's size per round, iterative (no recursion)."""
    try:
        data = json.loads(serialized)
        rules = [(str(r[0]), int(r[1]), int(r[2])) for r in data["rules"]]
        exprs = _exprs(data["grammar_expr_data"], data["grammar_expr_indptr"])
        root = int(data["root_rule_id"])
        shortest = _shortest_texts(rules, exprs)
        reachable = _reachable(root, rules, exprs)
    except (UnknownGrammar, KeyError, IndexError, TypeError, ValueError):
        return GrammarBounds(jump_safe=False)  # cannot tell: never ask the engine for forced text
    for r in reachable:
        if shortest[r] == _NEVER:
            raise endless_error(kind, None if r == root else rules[r][0])
        if shortest[r] == _TOO_LONG:
            raise ValueError(f"{kind} is too large: its shortest text (rule {rules[r][0]!r}) is longer than "
                             f"{MAX_SHORTEST_TEXT:,} bytes")
    lookahead = any(rules[r][2] >= 0 for r in reachable)
    return GrammarBounds(jump_safe=not (lookahead and kind in ("ebnf", "choices")))


class NoFiniteText(ValueError):
    """A constraint with no finite text, or with a part that can never end once entered."""


def endless_error(kind: str, rule: str | None) -> NoFiniteText:
    """The error for a constraint with no finite text (``rule`` None) or with a part, ``rule``,
    that can never end once entered."""
    if rule is not None:
        return NoFiniteText(f"{kind} has a part that can never end once entered (rule {rule!r} requires itself "
                          "again on every path); make that recursion optional or remove it")
    example = ("a property that is required and refers back to its own object, or an anyOf whose branches all "
               "do" if kind == "json_schema" else 'root ::= "a" root, or root ::= "[" root "]" | "{" root "}"')
    return NoFiniteText(f"{kind} accepts no finite text: every way through it requires itself again (e.g. {example}); "
                      "make the recursion optional")


def _exprs(flat: list[int], indptr: list[int]) -> list[tuple[int, list[int]]]:
    """``indptr`` holds where each expression starts; the last one runs to the end of ``flat``."""
    ends = [*indptr[1:], len(flat)]
    out = []
    for start, end in zip(indptr, ends):
        chunk = flat[start:end]
        out.append((int(chunk[0]), [int(x) for x in chunk[2:2 + int(chunk[1])]]))
    return out


def _shortest_texts(rules: list[tuple[str, int, int]], exprs: list[tuple[int, list[int]]]) -> list[int]:
    """Per rule, the length in bytes of its shortest text (``_NEVER``: none; ``_TOO_LONG``: past
    ``MAX_SHORTEST_TEXT``): a work
    list re-evaluates a rule's body whenever a rule it refers to got shorter."""
    bodies = [_post_order(exprs, body) for _, body, _ in rules]
    users: list[set[int]] = [set() for _ in rules]
    for r, order in enumerate(bodies):
        for e in order:
            kind, args = exprs[e]
            if kind in (_XRULE_REF, _XREPEAT):
                users[args[0]].add(r)
    shortest = [_NEVER] * len(rules)
    work = list(range(len(rules)))
    queued = set(work)
    values: dict[int, int] = {}
    while work:
        r = work.pop()
        queued.discard(r)
        for e in bodies[r]:
            values[e] = _expr_shortest(exprs[e], values, shortest)
        value = values[rules[r][1]]
        if value < shortest[r]:
            shortest[r] = value
            for u in users[r] - queued:
                queued.add(u)
                work.append(u)
    return shortest


def _expr_shortest(expr: tuple[int, list[int]], values: dict[int, int], shortest: list[int]) -> int:
    kind, args = expr
    if kind == _XBYTES:
        return _cap(len(args))
    if kind == _XCLASS:
        return 1
    if kind in (_XCLASS_STAR, _XEMPTY, _XREGEX):
        return 0
    if kind == _XRULE_REF:
        return shortest[args[0]]
    if kind == _XSEQUENCE:
        parts = [values[a] for a in args]
        return _NEVER if _NEVER in parts else _cap(sum(parts))
    if kind == _XCHOICES:
        return min((values[a] for a in args), default=_NEVER)
    if kind == _XREPEAT:
        low, inner = args[1], shortest[args[0]]
        if low <= 0:
            return 0
        return _NEVER if inner == _NEVER else _cap(low * inner)
    raise UnknownGrammar(f"expression type {kind}")


def _cap(n: int) -> int:
    return min(n, _TOO_LONG)


def _post_order(exprs: list[tuple[int, list[int]]], root: int) -> list[int]:
    """The expression ``root`` and those it holds, each after its parts (sequences and choices nest)."""
    seen: set[int] = set()
    order: list[int] = []
    stack: list[tuple[int, bool]] = [(root, False)]
    while stack:
        e, done = stack.pop()
        if done:
            order.append(e)
            continue
        if e in seen:
            continue
        seen.add(e)
        stack.append((e, True))
        kind, args = exprs[e]
        if kind in (_XSEQUENCE, _XCHOICES):
            stack.extend((a, False) for a in args if a not in seen)
    return order


def _reachable(root: int, rules: list[tuple[str, int, int]], exprs: list[tuple[int, list[int]]]) -> list[int]:
    """Rules reachable from the root (through bodies and lookaheads), root first."""
    seen_rules = {root}
    order = [root]
    stack = [rules[root][1]] + ([rules[root][2]] if rules[root][2] >= 0 else [])
    seen_exprs: set[int] = set()
    while stack:
        e = stack.pop()
        if e in seen_exprs:
            continue
        seen_exprs.add(e)
        kind, args = exprs[e]
        if kind in (_XSEQUENCE, _XCHOICES):
            stack.extend(args)
        elif kind in (_XRULE_REF, _XREPEAT) and args[0] not in seen_rules:
            r = args[0]
            seen_rules.add(r)
            order.append(r)
            stack.append(rules[r][1])
            if rules[r][2] >= 0:
                stack.append(rules[r][2])
    return order
