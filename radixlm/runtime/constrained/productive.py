"""Which parts of a schema or grammar can end: the classic productivity fixpoint.

A grammar rule is *productive* when some text derives from it: when some alternative of it uses
only productive symbols. A rule that is not can never end once entered: ``root ::= "[" root "]"
| "{" root "}"`` has no finite text, though no single path through it is forced. The same holds
for a JSON schema: a subschema is productive when some finite JSON value satisfies it, which
needs every ``$ref``, ``allOf`` part and required property of it to be productive, and one
branch of each ``anyOf`` / ``oneOf``. The least fixpoint is found with a work list (each
symbol's "all of" / "one of" counts go down as its parts turn productive): linear time, no
recursion.

- :func:`productive_schema`: a subschema no finite value satisfies accepts nothing, like
  ``false``, so it is replaced by ``false`` (the same schema; a grammar engine then never
  enters it); ValueError when the whole schema is one.
- :func:`check_lark`: ValueError when a rule that the start rule reaches is not productive.
  Grammars this reader does not follow are left to the grammar engine.
"""

from __future__ import annotations

import re
from typing import Any

from radixlm.runtime.constrained.limits import endless_error, resolve_local

__all__ = ["check_lark", "productive_schema"]


class _Circuit:
    """Gates that turn true once enough of their inputs are: ``need`` of them (all of an "all
    of" gate's, one of a "one of" gate's). A gate that needs none is true from the start."""

    def __init__(self) -> None:
        self.need: list[int] = []
        self.users: list[list[int]] = []

    def gate(self, need: int) -> int:
        self.need.append(need)
        self.users.append([])
        return len(self.need) - 1

    def wire(self, source: int, gate: int) -> None:
        self.users[source].append(gate)

    def settle(self) -> list[bool]:
        """Which gates turn true."""
        true = [n <= 0 for n in self.need]
        need = list(self.need)
        work = [g for g, t in enumerate(true) if t]
        while work:
            g = work.pop()
            for u in self.users[g]:
                need[u] -= 1
                if need[u] == 0 and not true[u]:
                    true[u] = True
                    work.append(u)
        return true


# -- JSON Schema ---------------------------------------------------------------------------------
_ONE = ("additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
        "unevaluatedItems", "unevaluatedProperties", "items")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")


def _subschemas(node: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(container, key) of each place in ``node`` that holds a subschema."""
    out: list[tuple[Any, Any]] = []
    for word in _ONE:
        if isinstance(node.get(word), (dict, bool)):
            out.append((node, word))
    for word in _MANY:
        if isinstance(node.get(word), list):
            out.extend((node[word], i) for i, v in enumerate(node[word]) if isinstance(v, (dict, bool)))
    for word in _MAPS:
        if isinstance(node.get(word), dict):
            out.extend((node[word], k) for k, v in node[word].items() if isinstance(v, (dict, bool)))
    return out


def _clauses(node: dict[str, Any], root: Any) -> list[list[Any]]:
    """What a value valid under ``node`` needs of its subschemas: every clause needs one of its
    subschemas (or constants) to accept something. Only what is necessary: a subschema not named
    here may still refuse every value, which makes the analysis miss it, never wrong."""
    clauses: list[list[Any]] = []
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = resolve_local(ref, root)
        if isinstance(target, (dict, bool)):
            clauses.append([target])
    for part in node.get("allOf", []) if isinstance(node.get("allOf"), list) else []:
        clauses.append([part])
    for word in ("anyOf", "oneOf"):
        if isinstance(node.get(word), list) and node[word]:
            clauses.append(list(node[word]))
    kind = node.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    if kinds == {"object"}:  # an object with every required key, each value valid under its property
        props = node.get("properties")
        for key in node.get("required", []) if isinstance(node.get("required"), list) else []:
            if isinstance(props, dict) and isinstance(key, str) and key in props:
                clauses.append([props[key]])
    elif kinds == {"array"}:  # the first minItems items
        least = node.get("minItems", 0)
        least = int(least) if isinstance(least, (int, float)) and not isinstance(least, bool) else 0
        items = node.get("items")
        prefix = node.get("prefixItems", items if isinstance(items, list) else [])
        prefix = prefix if isinstance(prefix, list) else []
        clauses.extend([s] for s in prefix[:least])
        if least > len(prefix):
            rest = node.get("additionalItems") if isinstance(items, list) else items
            if rest is not None:
                clauses.append([rest])
    return clauses


def productive_schema(schema: Any) -> Any:
    """``schema`` (changed in place) with each subschema that no finite JSON value satisfies
    replaced by ``false``; ValueError when that is the whole schema."""
    if not isinstance(schema, dict):
        return schema
    index: dict[int, int] = {id(schema): 0}
    nodes: list[dict[str, Any]] = [schema]
    places: list[tuple[Any, Any, int]] = []
    for node in nodes:  # grows while it is walked
        for container, key in _subschemas(node):
            child = container[key]
            if isinstance(child, dict):
                if id(child) not in index:
                    index[id(child)] = len(nodes)
                    nodes.append(child)
                places.append((container, key, index[id(child)]))
    circuit = _Circuit()
    gates = [circuit.gate(0) for _ in nodes]  # their needs are set below, once the clauses are known
    for g, node in zip(gates, nodes):
        clauses = _clauses(node, schema)
        for clause in clauses:
            if any(m is True or (isinstance(m, dict) and id(m) not in index) for m in clause):
                circuit.need[g] -= 1  # met already (a value, or a $ref into no schema of this walk)
                continue
            either = circuit.gate(1)
            for m in clause:
                if isinstance(m, dict):
                    circuit.wire(gates[index[id(m)]], either)
            circuit.wire(either, g)
        circuit.need[g] += len(clauses)
    productive = circuit.settle()
    if not productive[gates[0]]:
        raise endless_error("json_schema", None)
    for container, key, i in places:
        if not productive[gates[i]]:
            container[key] = False
    return schema


# -- Lark (llguidance's grammar language; GBNF is converted to it) -------------------------------
_LARK_TOKEN = re.compile(r"""
    (?P<space>[ \t\r]+|//[^\n]*|\#[^\n]*)
  | (?P<nl>\n)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<alias>->[ \t]*[A-Za-z_][A-Za-z_0-9]*)
  | (?P<special><[^<>\n]*>)
  | (?P<directive>%[a-z_]+)
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<number>\d+)
  | (?P<range>\.\.)
  | (?P<punct>[:|()\[\]?*+~{},.&!=-])
""", re.VERBOSE)


class _Unread(Exception):
    """A grammar this reader does not follow."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if out and out[-1][0] == "directive" and out[-1][1] in ("%json", "%regex", "%llguidance"):
            pos = _skip_object(text, pos)  # its JSON argument
            out.append(("string", ""))
            continue
        m = _LARK_TOKEN.match(text, pos)
        if m is None:
            raise _Unread(f"at {pos}")
        kind = m.lastgroup or ""
        if kind != "space":
            out.append((kind, m.group()))
        pos = m.end()
    return out


def _skip_object(text: str, pos: int) -> int:
    """The end of the JSON object starting at ``pos`` (after blanks)."""
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    if pos >= len(text) or text[pos] != "{":
        raise _Unread("a directive without its object")
    depth, quoted = 0, False
    while pos < len(text):
        c = text[pos]
        if quoted:
            if c == "\\":
                pos += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    raise _Unread("an unclosed object")


def _terminal(name: str) -> bool:
    """Lark names terminals in capitals (``NUMBER``, ``_WS``), rules in lowercase."""
    return name.lstrip("_")[:1].isupper()


class _LarkReader:
    """Rules (lowercase names) of a Lark grammar as gates of a circuit: a rule turns true when it
    is productive. Terminals (uppercase) are regular languages, never recursive: productive."""

    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.pos = 0
        self.circuit = _Circuit()
        self.rules: dict[str, int] = {}  # name -> its gate
        self.refs: dict[str, set[str]] = {}  # name -> rules its body names
        self.pending: list[tuple[int, str]] = []  # (reference gate, rule name)
        self.current = ""

    def peek(self, offset: int = 0) -> tuple[str, str]:
        i = self.pos + offset
        return self.toks[i] if i < len(self.toks) else ("end", "")

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        self.pos += 1
        return tok

    def read(self) -> None:
        while self.peek()[0] != "end":
            kind, value = self.peek()
            if kind == "nl":
                self.pos += 1
            elif kind == "directive":
                while self.peek()[0] not in ("nl", "end"):  # %llguidance {...}, %ignore X, %import ...
                    self.pos += 1
            elif kind == "name":
                self.definition()
            else:
                raise _Unread(f"{value!r} where a definition starts")
        for ref, name in self.pending:
            if name in self.rules:
                self.circuit.wire(self.rules[name], ref)
            else:
                self.circuit.need[ref] = 0  # not a rule here: llguidance reports it

    def definition(self) -> None:
        _, name = self.take()
        if self.peek()[1] == "[":  # name[lazy, max_tokens=...]
            while self.take()[1] != "]":
                if self.peek()[0] == "end":
                    raise _Unread("an unclosed rule option list")
        if self.peek()[1] == "." and self.peek(1)[0] == "number":  # priority
            self.pos += 2
        if self.take()[1] != ":":
            raise _Unread(f"no ':' after {name!r}")
        if _terminal(name):  # a regular language, productive; its body (with & and ~) names no rule
            depth = 0
            while self.peek()[0] != "end" and (depth or self.peek()[0] != "nl" or self._continues()):
                depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(self.take()[1], 0)
            self.rules[name] = self.circuit.gate(0)
            return
        self.current = name
        self.refs.setdefault(name, set())
        self.rules[name] = self.alternatives(top=True)

    def _continues(self) -> bool:
        """At a newline: whether the definition goes on (the next line starts with ``|``)."""
        j = self.pos
        while j < len(self.toks) and self.toks[j][0] == "nl":
            j += 1
        if j < len(self.toks) and self.toks[j][1] == "|":
            self.pos = j
            return True
        return False

    def alternatives(self, top: bool = False) -> int:
        branches = [self.sequence(top)]
        while True:
            if top and self.peek()[0] == "nl":
                self._continues()
            if self.peek()[1] != "|":
                break
            self.pos += 1
            branches.append(self.sequence(top))
        gate = self.circuit.gate(1)
        for b in branches:
            self.circuit.wire(b, gate)
        return gate

    def sequence(self, top: bool) -> int:
        items = []
        while True:
            kind, value = self.peek()
            if kind == "nl" and not top:
                self.pos += 1
                continue
            if kind in ("nl", "end") or value in ("|", ")", "]"):
                break
            if kind == "alias":  # -> name: a name for the tree llguidance does not build
                self.pos += 1
                continue
            items.append(self.item())
        gate = self.circuit.gate(len(items))
        for i in items:
            self.circuit.wire(i, gate)
        return gate

    def item(self) -> int:
        atom = self.atom()
        kind, value = self.peek()
        if value in ("?", "*"):
            self.pos += 1
            return self.circuit.gate(0)
        if value == "+":
            self.pos += 1
            return atom
        if value == "~":  # x ~ n or x ~ n..m
            self.pos += 1
            least = self.take()
            if least[0] != "number":
                raise _Unread("a repetition without its count")
            if self.peek()[0] == "range":
                self.pos += 2
            return atom if int(least[1]) > 0 else self.circuit.gate(0)
        if value == "{":  # x{n}, x{n,}, x{n,m}
            self.pos += 1
            least = self.take()
            while self.take()[1] != "}":
                if self.peek()[0] == "end":
                    raise _Unread("an unclosed repetition")
            if least[0] != "number":
                raise _Unread("a repetition without its count")
            return atom if int(least[1]) > 0 else self.circuit.gate(0)
        return atom

    def atom(self) -> int:
        kind, value = self.take()
        if value == "(":
            gate = self.alternatives()
            if self.take()[1] != ")":
                raise _Unread("an unclosed group")
            return gate
        if value == "[":
            self.alternatives()
            if self.take()[1] != "]":
                raise _Unread("an unclosed option")
            return self.circuit.gate(0)
        if kind in ("string", "regex", "special"):
            if kind == "string" and self.peek()[0] == "range":  # "a".."z"
                self.pos += 2
            return self.circuit.gate(0)
        if kind == "directive" and value in ("%json", "%regex"):
            self.pos += 1  # its object
            return self.circuit.gate(0)
        if kind == "name":
            if _terminal(value):
                return self.circuit.gate(0)
            ref = self.circuit.gate(1)
            self.pending.append((ref, value))
            self.refs[self.current].add(value)
            return ref
        raise _Unread(f"{value!r} in a rule")


def check_lark(text: str, kind: str = "ebnf") -> None:
    """ValueError when a rule the start rule reaches derives no finite text (every way through
    it requires itself again); nothing when it cannot tell (a grammar this reader does not follow)."""
    try:
        reader = _LarkReader(text)
        reader.read()
    except (_Unread, ValueError, IndexError, RecursionError):
        return
    if "start" not in reader.rules:
        return
    true = reader.circuit.settle()
    seen, work = {"start"}, ["start"]
    while work:
        name = work.pop()
        if not true[reader.rules[name]]:
            raise endless_error(kind, None if name == "start" else name)
        for ref in reader.refs.get(name, ()):
            if ref in reader.rules and ref not in seen:
                seen.add(ref)
                work.append(ref)
