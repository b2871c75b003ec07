"""The ``s`` a program receives: a tracing state, or a live state that runs step by step.

Both speak the same syntax (``s += expr``, ``with s.user():``, ``s.var_scope``, ``s.fork``).
Tracing records nodes and stops (``NeedsValue``) at the first read of a generated value; the
program then runs again live: its body runs in one worker thread, each ``s += ...`` is chained
onto that state's queue of operations on the event loop (forked states run concurrently), and a
read waits for its state's queue to drain.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Self

from radixlm.lang.frontend.expr import ExprLike, assistant, system, to_expr, user
from radixlm.runtime.programs.executor import RunContext, execute, gather_all
from radixlm.runtime.programs.ir import (
    JOIN_MODES,
    ForkNode,
    JoinMode,
    JoinNode,
    Role,
    RoleBeginNode,
    RoleEndNode,
    VarBeginNode,
    VarEndNode,
    dropped_variables,
    unjoined_forks,
)
from radixlm.runtime.programs.state import StateCore

_LANG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class NeedsValue(BaseException):
    """Raised while tracing when the program reads a generated value (BaseException so that a
    program's ``except Exception`` does not swallow it)."""


def call_site() -> str | None:
    """file:line of the innermost caller outside radixlm.lang (the program's own line)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LANG_DIR):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else None


class StateSyntax:
    """The program-facing syntax, over ``_add`` (nodes), ``_fork`` and ``_read``."""

    def _add(self, nodes: Sequence[Any], site: str | None) -> None:
        raise NotImplementedError

    def _fork(self, size: int) -> ForkGroup:
        raise NotImplementedError

    def _read(self) -> StateCore:
        """The state's data once every operation added so far has run."""
        raise NotImplementedError

    def __iadd__(self, other: ExprLike) -> Self:
        self._add(to_expr(other).nodes, call_site())
        return self

    def _role(self, role: Role, wrap: Callable[[ExprLike], Any], expr: ExprLike | None) -> Any:
        if expr is None:
            return self._role_block(role)
        self._add(wrap(expr).nodes, call_site())
        return None

    def system(self, expr: ExprLike | None = None) -> Any:
        """``s.system(text)`` appends a system message; ``with s.system():`` opens one."""
        return self._role("system", system, expr)

    def user(self, expr: ExprLike | None = None) -> Any:
        return self._role("user", user, expr)

    def assistant(self, expr: ExprLike | None = None) -> Any:
        return self._role("assistant", assistant, expr)

    @contextmanager
    def _role_block(self, role: Role) -> Iterator[None]:
        self._add([RoleBeginNode(role=role)], call_site())
        yield
        self._add([RoleEndNode(role=role)], call_site())

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """The text appended inside the block becomes variable ``name``."""
        self._add([VarBeginNode(name=name)], call_site())
        yield
        self._add([VarEndNode(name=name)], call_site())

    def fork(self, size: int = 1) -> ForkGroup:
        """``size`` copies of this state that continue independently and concurrently."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be an int >= 1, got {size!r}")
        return self._fork(size)

    # -- reads ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def get_var(self, name: str) -> Any:
        core = self._read()
        if name not in core.variables:
            raise KeyError(f"no variable {name!r}; defined: {', '.join(core.variables) or 'none'}")
        return core.variables[name]

    def get_meta_info(self, name: str) -> Any:
        return self._read().meta.get(name)

    def text(self) -> str:
        return self._read().text

    def messages(self) -> list[dict[str, str]]:
        return list(self._read().messages)


class ForkGroup:
    """The states of one fork: index or iterate them; ``+=`` appends to each; ``join()`` waits."""

    def __init__(self, parent: StateSyntax, states: list[StateSyntax], join: Callable[[JoinMode], None]) -> None:
        self.parent, self.states, self._join = parent, states, join

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[StateSyntax]:
        return iter(self.states)

    def __getitem__(self, i: int) -> StateSyntax:
        return self.states[i]

    def __iadd__(self, other: ExprLike) -> Self:
        nodes, site = to_expr(other).nodes, call_site()
        for s in self.states:
            s._add(nodes, site)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Gather the branches' new variables into the parent as lists (``gather_variable``) or
        append their new text to it (``concate_and_append``)."""
        for known in JOIN_MODES:
            if mode == known:
                self._join(known)
                return
        raise ValueError(f"join mode must be gather_variable or concate_and_append, got {mode!r}")


# -- tracing --------------------------------------------------------------------------------
@dataclass
class Tracer:
    """Shared by the states of one trace: fork ids and where each node was added."""

    next_fork: int = 0
    sites: dict[int, str] = field(default_factory=dict)
    fork_sites: dict[int, str | None] = field(default_factory=dict)  # fork id -> where the program forked


@dataclass
class _PendingFork:
    id: int
    branches: list[TracingState]


class TracingState(StateSyntax):
    """Records nodes; a read raises NeedsValue."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.recorded: list[Any] = []

    def _add(self, nodes: Sequence[Any], site: str | None) -> None:
        for n in nodes:
            if site is not None:
                self.tracer.sites[id(n)] = site
            self.recorded.append(n)

    def _fork(self, size: int) -> ForkGroup:
        fork = _PendingFork(self.tracer.next_fork, [TracingState(self.tracer) for _ in range(size)])
        self.tracer.fork_sites[fork.id] = call_site()
        self.tracer.next_fork += 1
        self.recorded.append(fork)
        return ForkGroup(self, list(fork.branches),
                         lambda mode: self._add([JoinNode(fork=fork.id, mode=mode)], call_site()))

    def _read(self) -> StateCore:
        raise NeedsValue()

    def nodes(self) -> list[Any]:
        """The recorded sequence as IR nodes (pending forks become fork nodes)."""
        return [ForkNode(id=n.id, branches=[b.nodes() for b in n.branches]) if isinstance(n, _PendingFork) else n
                for n in self.recorded]

    def unjoined_forks(self) -> list[str]:
        """Each fork recorded here (or in a joined fork's branches) that is never joined although its
        branches set variables: a traced program read none of them (a read ends the trace), so the
        run would drop them. The IR's own rule (``unjoined_forks``), told with where each fork was made."""
        return [_unjoined(f"fork {u.fork}", self.tracer.fork_sites.get(u.fork), u.names)
                for u in unjoined_forks(self.nodes())]


def _unjoined(fork: str, site: str | None, names: Sequence[str]) -> str:
    return dropped_variables(f"{fork}{f' (forked at {site})' if site else ''}", names)


def unjoined_fork_error(problems: Sequence[str]) -> ValueError:
    """The error of a program whose forks would drop their branches' variables."""
    return ValueError("; ".join(problems) + ": call join() on the fork (each variable becomes a list of the branches' "
                      "values) or read them from the branches (forks[i]['name']); join('concate_and_append') keeps "
                      "the branches' text instead")


# -- live, step by step ----------------------------------------------------------------------
class LiveRun:
    """The event loop a live program's thread talks to, and every state the program made."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ctx: RunContext) -> None:
        self.loop, self.ctx = loop, ctx
        self.states: list[LiveState] = []
        self.forks: list[_LiveFork] = []

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` on the loop, after every earlier call (FIFO)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def wait(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def settle(self) -> None:
        """Wait for every state's queue; on failure cancel the rest."""
        await gather_all([s.tail for s in self.states if s.tail is not None])

    def cancel(self) -> None:
        for s in self.states:
            if s.tail is not None:
                s.tail.cancel()

    def unjoined_forks(self) -> list[str]:
        """Each fork of the finished run that was never joined, none of whose branches the program
        read, although they set variables: those were dropped."""
        problems = []
        for i, f in enumerate(self.forks):
            if f.joined or any(c.was_read for c in f.children):
                continue
            known = f.at_fork.get("known", set())
            names = [name for c in f.children for name in c.core.variables if name not in known]
            if names:
                problems.append(_unjoined(f"fork {i}", f.site, names))
        return problems


@dataclass
class _LiveFork:
    """One fork of a live run: its branches, where it was made, and whether it was joined."""

    children: list[LiveState]
    site: str | None
    at_fork: dict[str, Any]  # the parent's variables and text length when the branches began
    joined: bool = False


class LiveState(StateSyntax):
    """A state whose operations run on the loop as they are added."""

    def __init__(self, core: StateCore, run: LiveRun) -> None:
        self.core, self.run = core, run
        self.tail: asyncio.Task[None] | None = None  # the last queued operation (loop-owned)
        self.was_read = False  # the program read this state (a fork branch's variables, say)
        run.states.append(self)

    def _chain(self, make_op: Callable[[], Awaitable[None]]) -> None:
        """On the loop: queue an operation after this state's last one."""
        prev = self.tail

        async def op() -> None:
            if prev is not None:
                await prev
            await make_op()

        self.tail = self.run.loop.create_task(op())

    def _add(self, nodes: Sequence[Any], site: str | None) -> None:
        async def run_nodes() -> None:
            for n in nodes:
                await execute(self.core, n, self.run.ctx, site)

        self.run.call(self._chain, run_nodes)

    def _fork(self, size: int) -> ForkGroup:
        children = [LiveState(StateCore(), self.run) for _ in range(size)]
        at_fork: dict[str, Any] = {}
        record = _LiveFork(children, call_site(), at_fork)
        self.run.forks.append(record)

        def start() -> None:  # on the loop
            prev = self.tail

            async def fork_op() -> None:
                if prev is not None:
                    await prev
                if self.core.text:
                    await self.run.ctx.conn.prefill(self.core.text)
                at_fork.update(known=set(self.core.variables), base=len(self.core.text))
                for c in children:
                    c.core.__dict__.update(self.core.branch().__dict__)

            task = self.run.loop.create_task(fork_op())
            self.tail = task
            for c in children:
                c.tail = task

        def join(mode: JoinMode) -> None:
            record.joined = True

            def chain_join() -> None:  # on the loop, after the branches' queued operations
                tails = [c.tail for c in children if c.tail is not None]

                async def join_op() -> None:
                    await gather_all(tails)
                    self.core.join([c.core for c in children], mode, at_fork["known"], at_fork["base"])

                self._chain(join_op)

            self.run.call(chain_join)

        self.run.call(start)
        return ForkGroup(self, list(children), join)

    def _read(self) -> StateCore:
        self.was_read = True

        async def settled() -> None:
            if self.tail is not None:
                await self.tail

        self.run.wait(settled())
        return self.core
