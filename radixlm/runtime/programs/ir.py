"""The request graph: a versioned, JSON-serializable IR of one traced program (pydantic models).

A graph is a sequence of nodes for the root state. A ``fork`` node holds one node sequence per
branch; a later ``join`` node in the same sequence names the fork it gathers. Loading validates
the structure (versions, known ops, balanced roles and variable scopes, joins after their forks,
no fork left unjoined whose branches set variables, sampling values) and raises ``GraphError``
with every problem found.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from radixlm.runtime.programs.sampling import SamplingArgs
from radixlm.runtime.tool_calls import MAX_TOOLS, NAME_PATTERN

IR_VERSION: Literal[1] = 1
# Forks nest at most this deep, so every valid graph also loads from its own JSON text (the JSON
# parser stops at 200 levels of nesting; each fork takes four).
MAX_FORK_DEPTH = 32
Role = Literal["system", "user", "assistant"]
JoinMode = Literal["gather_variable", "concate_and_append"]
JOIN_MODES: tuple[JoinMode, ...] = ("gather_variable", "concate_and_append")


class GraphError(ValueError):
    """A request graph failed validation; the message lists each problem with its location, and
    ``problems`` holds them one by one ("location: what is wrong")."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


class _StructureProblems(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextNode(_Node):
    """Constant text appended to the state."""

    op: Literal["text"] = "text"
    text: str


class RoleBeginNode(_Node):
    op: Literal["role_begin"] = "role_begin"
    role: Role


class RoleEndNode(_Node):
    op: Literal["role_end"] = "role_end"
    role: Role


class VarBeginNode(_Node):
    """Start of ``var_scope(name)``: the text up to the matching end becomes variable ``name``."""

    op: Literal["var_begin"] = "var_begin"
    name: str = Field(min_length=1)


class VarEndNode(_Node):
    op: Literal["var_end"] = "var_end"
    name: str = Field(min_length=1)


class Constraint(_Node):
    """An output constraint passed to the runtime's grammar backend."""

    kind: Literal["regex", "json_schema", "ebnf"]
    spec: str = Field(min_length=1)


class ToolSpec(_Node):
    """A tool a gen may call, as data: its name, description and JSON-schema parameters (the
    function itself stays with the program that offered it)."""

    name: str = Field(pattern=NAME_PATTERN.pattern)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @field_validator("parameters")
    @classmethod
    def _parameters_describe_an_object(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type", "object") != "object":
            raise ValueError(f"parameters must describe an object (type 'object'), got type {v.get('type')!r}")
        return v


class GenNode(_Node):
    """One generation call; its sampling values override the run's defaults field by field.

    With ``tools`` the generation is exactly one call of one of them (docs/dsl.md, "Tools") and
    its variable holds the call ``{"name", "arguments"}``; a program run in-process may attach a
    binder that turns that data into a call of its own function (``with_binder``)."""

    op: Literal["gen"] = "gen"
    name: str | None = None
    sampling: SamplingArgs = SamplingArgs()
    constraint: Constraint | None = None
    dtype: Literal["int", "float", "bool", "str"] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0)
    tools: list[ToolSpec] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    _binder: Callable[[Any], Any] | None = PrivateAttr(default=None)

    @field_validator("sampling")
    @classmethod
    def _sampling_is_valid(cls, v: SamplingArgs) -> SamplingArgs:
        v.check()
        return v

    @model_validator(mode="after")
    def _tools_are_alone(self) -> GenNode:
        if self.tools is None:
            return self
        names = [t.name for t in self.tools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tool name {twice[0]!r} is used twice; tool names must be unique")
        if self.constraint is not None or self.dtype is not None:
            raise ValueError("a gen with tools takes no regex, json_schema, ebnf or dtype: the tools' schemas "
                             "are its constraint")
        if (self.sampling.n or 1) != 1:
            raise ValueError("a gen with tools makes one call; n must be 1")
        return self

    def with_binder(self, binder: Callable[[Any], Any]) -> GenNode:
        """This node, whose call values ``binder`` turns into the caller's own objects (in-process
        only: a binder is never serialized)."""
        self._binder = binder
        return self

    def bind(self, value: Any) -> Any:
        """A call value as the program that made this node wants it (unchanged without a binder)."""
        return value if self._binder is None else self._binder(value)


class SelectNode(_Node):
    """Pick one of ``choices`` by the logprobs the model gives each after the state's text."""

    op: Literal["select"] = "select"
    name: str | None = None
    choices: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    method: Literal["token_length_normalized", "greedy_token_selection",
                    "unconditional_likelihood_normalized"] = "token_length_normalized"


class ForkNode(_Node):
    """Copy the state into ``len(branches)`` branches that run concurrently."""

    op: Literal["fork"] = "fork"
    id: int = Field(ge=0)
    branches: list[list[Node]] = Field(min_length=1)


class JoinNode(_Node):
    """Wait for fork ``fork``'s branches; gather their new variables as lists (or append their text)."""

    op: Literal["join"] = "join"
    fork: int = Field(ge=0)
    mode: JoinMode = "gather_variable"


Node = Annotated[
    TextNode | RoleBeginNode | RoleEndNode | VarBeginNode | VarEndNode | GenNode | SelectNode | ForkNode | JoinNode,
    Field(discriminator="op"),
]
ForkNode.model_rebuild()


class Graph(BaseModel):
    """A traced program: its name and the root state's node sequence."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = IR_VERSION
    program: str = ""
    nodes: list[Node]

    @model_validator(mode="after")
    def _check_structure(self) -> Graph:
        problems: list[str] = []
        _check_sequence(self.nodes, "nodes", set(), [], problems)
        problems += [f"{u.location}: {dropped_variables(f'fork {u.fork}', u.names)}: add "
                     f'{{"op": "join", "fork": {u.fork}}} after it in the same node list (each variable becomes '
                     f"a list of the branches' values)" for u in unjoined_forks(self.nodes)]
        if problems:
            raise _StructureProblems(problems)
        return self

    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, data: str | bytes | dict[str, Any]) -> Graph:
        """Load and validate a graph; raises GraphError naming every invalid field."""
        try:
            if isinstance(data, dict):
                return cls.model_validate(data)
            return cls.model_validate_json(data)
        except ValidationError as e:
            problems = _problems(e)
            raise GraphError(f"invalid request graph ({len(problems)} problem(s)):\n"
                             + "\n".join(f"  {p}" for p in problems), problems) from None


def _check_sequence(nodes: list[Any], where: str, fork_ids: set[int], open_roles: list[str],
                    problems: list[str], depth: int = 0) -> None:
    """Roles and var scopes balance (a branch inherits the roles open at its fork); joins follow
    their forks; fork ids are unique; forks nest at most MAX_FORK_DEPTH deep."""
    roles = list(open_roles)
    scopes: list[str] = []
    forks_here: set[int] = set()
    for i, node in enumerate(nodes):
        at = f"{where}[{i}]"
        if isinstance(node, RoleBeginNode):
            if roles:
                problems.append(f"{at}: role {node.role!r} begins inside the open role {roles[-1]!r}")
            roles.append(node.role)
        elif isinstance(node, RoleEndNode):
            if not roles or roles[-1] != node.role:
                problems.append(f"{at}: role_end {node.role!r} without a matching role_begin")
            else:
                roles.pop()
        elif isinstance(node, VarBeginNode):
            scopes.append(node.name)
        elif isinstance(node, VarEndNode):
            if not scopes or scopes[-1] != node.name:
                problems.append(f"{at}: var_end {node.name!r} without a matching var_begin")
            else:
                scopes.pop()
        elif isinstance(node, ForkNode):
            if depth == MAX_FORK_DEPTH:
                problems.append(f"{_short(at)}: forks nested more than {MAX_FORK_DEPTH} deep")
                continue
            if node.id in fork_ids:
                problems.append(f"{at}: fork id {node.id} is used twice")
            fork_ids.add(node.id)
            forks_here.add(node.id)
            for b, branch in enumerate(node.branches):
                _check_sequence(branch, f"{at}.branches[{b}]", fork_ids, roles, problems, depth + 1)
        elif isinstance(node, JoinNode):
            if node.fork not in forks_here:
                problems.append(f"{at}: join of fork {node.fork}, which is not forked earlier in this sequence")
            forks_here.discard(node.fork)
    if scopes:
        problems.append(f"{where}: var_scope {scopes[-1]!r} is never closed")


@dataclass(frozen=True)
class UnjoinedFork:
    """A fork never joined although its branches set variables: a run would drop them."""

    location: str  # the fork node's path, e.g. "nodes[2].branches[0][1]"
    fork: int
    names: tuple[str, ...]  # the variables its branches set, in order, each once


def unjoined_forks(nodes: Sequence[Node], where: str = "nodes") -> list[UnjoinedFork]:
    """Each fork in ``nodes`` (or in a joined fork's branches) with no join after it in its own
    sequence, whose branches set variables. Nothing reads a branch's variables but a join, so these
    would be lost; the DSL refuses such a program and the IR such a graph."""
    return _unjoined_forks(nodes, where, 0)


def _unjoined_forks(nodes: Sequence[Node], where: str, depth: int) -> list[UnjoinedFork]:
    joined = {n.fork for n in nodes if isinstance(n, JoinNode)}
    found = []
    for i, n in enumerate(nodes):
        if not isinstance(n, ForkNode) or depth == MAX_FORK_DEPTH:  # deeper forks are refused already
            continue
        at = f"{where}[{i}]"
        if n.id in joined:
            for b, branch in enumerate(n.branches):
                found += _unjoined_forks(branch, f"{at}.branches[{b}]", depth + 1)
            continue
        names = _set_names([node for branch in n.branches for node in branch], depth + 1)
        if names:
            found.append(UnjoinedFork(_short(at), n.id, tuple(dict.fromkeys(names))))
    return found


def _set_names(nodes: Sequence[Node], depth: int) -> list[str]:
    """The variables ``nodes`` set (nested forks' branches included)."""
    names: list[str] = []
    for n in nodes:
        if isinstance(n, ForkNode) and depth < MAX_FORK_DEPTH:
            names += _set_names([node for branch in n.branches for node in branch], depth + 1)
        elif isinstance(n, (GenNode, SelectNode, VarEndNode)) and n.name:
            names.append(n.name)
    return names


def dropped_variables(fork: str, names: Sequence[str]) -> str:
    """The words for a fork whose branches' variables would be dropped (the DSL's errors and the IR's)."""
    return f"{fork} is never joined, so the variables its branches set ({', '.join(dict.fromkeys(names))}) " \
           f"would be dropped"


def _problems(e: ValidationError) -> list[str]:
    """Each problem as "location: what is wrong" (structure problems one by one)."""
    out = []
    for err in e.errors():
        loc = _short(".".join(str(p) for p in err["loc"]) or "<root>")
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _StructureProblems):
            out.extend(cause.problems)
        else:
            out.append(f"{loc}: {err['msg']}")
    return out


def _short(location: str) -> str:
    """A location in a deeply nested graph: its start and its end say where."""
    return location if len(location) <= 160 else f"{location[:80]}...{location[-60:]}"


def graph_json_schema() -> str:
    """The graph's JSON Schema, for clients that build graphs in other languages."""
    return json.dumps(Graph.model_json_schema(), indent=2)
