"""What one request graph may ask of the server (POST /run_program); each limit is a server flag.

The IR's own validator bounds the structure (radixlm.runtime.programs.ir); these limits bound the
work: nodes, fork width and depth, constant text, and generations. A graph past one is refused
with a 400 naming the flag to raise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.programs.ir import ForkNode, GenNode, Graph, SelectNode, TextNode


@dataclass(frozen=True)
class ProgramLimits:
    max_program_nodes: int = 10_000  # nodes of one graph, fork branches' included
    max_program_fork_width: int = 64  # branches of one fork
    max_program_fork_depth: int = 8  # forks nested in forks (the IR itself allows at most 32)
    max_program_text_bytes: int = 4 * 1024 * 1024  # UTF-8 bytes of the graph's texts and select choices
    max_program_gens: int = 1024  # generations of one program (a gen with n samples counts n)

    def __post_init__(self) -> None:
        for name in ("max_program_nodes", "max_program_fork_width", "max_program_fork_depth",
                     "max_program_text_bytes", "max_program_gens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class LimitProblem:
    flag: str  # the limit's name, e.g. max_program_nodes
    message: str

    @property
    def option(self) -> str:
        return "--" + self.flag.replace("_", "-")


@dataclass
class _Count:
    nodes: int = 0
    text_bytes: int = 0
    gens: int = 0
    widest: int = 0
    deepest: int = 0


def check_limits(graph: Graph, limits: ProgramLimits, default_n: int | None = None) -> list[LimitProblem]:
    """Every limit ``graph`` exceeds (empty when it fits); ``default_n``: the run's default n."""
    count = _Count()
    _walk(graph.nodes, 0, count, default_n or 1)
    found = [
        ("max_program_nodes", count.nodes, "nodes"),
        ("max_program_fork_width", count.widest, "branches in one fork"),
        ("max_program_fork_depth", count.deepest, "levels of nested forks"),
        ("max_program_text_bytes", count.text_bytes, "bytes of text"),
        ("max_program_gens", count.gens, "generations"),
    ]
    problems = []
    for flag, value, what in found:
        limit = getattr(limits, flag)
        if value > limit:
            problems.append(LimitProblem(flag, f"the graph has {value} {what}, more than the server's limit of "
                                               f"{limit} (--{flag.replace('_', '-')})"))
    return problems


def _walk(nodes: Sequence[Any], depth: int, count: _Count, default_n: int) -> None:
    count.deepest = max(count.deepest, depth)
    for node in nodes:
        count.nodes += 1
        if isinstance(node, TextNode):
            count.text_bytes += len(node.text.encode("utf-8", "surrogatepass"))
        elif isinstance(node, SelectNode):
            count.text_bytes += sum(len(c.encode("utf-8", "surrogatepass")) for c in node.choices)
        elif isinstance(node, GenNode):
            count.gens += node.sampling.n or default_n
        elif isinstance(node, ForkNode):
            count.widest = max(count.widest, len(node.branches))
            for branch in node.branches:
                _walk(branch, depth + 1, count, default_n)
