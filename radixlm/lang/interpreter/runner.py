"""Running programs: trace to a graph (or fall back to step by step), run one or a batch, stream.

Everything is asyncio; ``run``/``run_batch`` are a synchronous façade that runs the coroutine on
a fresh event loop. A streamed sync run keeps its own loop and advances it while the caller
iterates ``text_iter()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from radixlm.lang.backends.base import Backend, Connection, GraphConnection
from radixlm.lang.interpreter.handles import (
    LiveRun,
    LiveState,
    NeedsValue,
    Tracer,
    TracingState,
    unjoined_fork_error,
)
from radixlm.lang.sessions import SessionRun
from radixlm.runtime.programs.executor import RunContext, execute, run_sequence
from radixlm.runtime.programs.ir import Graph, RoleBeginNode, RoleEndNode, TextNode
from radixlm.runtime.programs.sampling import SamplingArgs
from radixlm.runtime.programs.state import StateCore

# A shared prefix shorter than this is not worth a separate prefill request before a batch.
MIN_SHARED_PREFIX_CHARS = 64


class TraceError(ValueError):
    """The program's control flow depends on generated values, so it has no static graph."""


@dataclass(frozen=True)
class Trace:
    """A traced call: its graph when the whole program traced, and the nodes recorded before
    tracing stopped otherwise (their constant prefix still serves as a cache hint)."""

    graph: Graph | None
    recorded: list[Any]
    sites: dict[int, str]


def trace(func: Callable[..., Any], name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Trace:
    """Run ``func`` on a tracing state. The program's own exceptions propagate unchanged; a fork
    that would drop its branches' variables (never joined) is a ValueError."""
    tracer = Tracer()
    root = TracingState(tracer)
    try:
        func(root, *args, **kwargs)
    except NeedsValue:
        return Trace(None, list(root.recorded), tracer.sites)
    problems = root.unjoined_forks()
    if problems:
        raise unjoined_fork_error(problems)
    return Trace(Graph(program=name, nodes=root.nodes()), list(root.recorded), tracer.sites)


async def run_traced(func: Callable[..., Any], name: str, args: Sequence[Any], kwargs: dict[str, Any],
                     core: StateCore, ctx: RunContext, pool: Executor | None, traced: Trace | None = None) -> None:
    """Run one program on ``core``: as a graph when it traces, else step by step. ``core``
    finishes with the program's error, which is also raised."""
    try:
        traced = traced or trace(func, name, args, kwargs)
        if traced.graph is not None:
            if not await _run_remote(traced.graph, core, ctx):  # in the runtime when it can
                await run_sequence(core, traced.graph.nodes, dataclasses.replace(ctx, sites=traced.sites,
                                                                                 conn=_program_conn(ctx)))
        elif isinstance(ctx.conn, GraphConnection) and ctx.conn.requires_graphs:
            raise TraceError(f"{name} reads a generated value, so it has no static graph to run on the server; "
                             "use RuntimeEndpoint(..., programs='auto') to run it step by step")
        else:
            await _run_live(func, args, kwargs, core, dataclasses.replace(ctx, conn=_program_conn(ctx)), pool)
    except BaseException as e:
        core.finish(e)
        raise
    core.finish()


async def run_graph_on(graph: Graph, core: StateCore, ctx: RunContext) -> None:
    """Run a loaded graph (e.g. received as JSON) on ``core``."""
    try:
        if not await _run_remote(graph, core, ctx):
            await run_sequence(core, graph.nodes, ctx)
    except BaseException as e:
        core.finish(e)
        raise
    core.finish()


def _program_conn(ctx: RunContext) -> Connection:
    """The run's connection for one program run step by step, under an id of its own."""
    return ctx.conn.for_program(f"program-{uuid.uuid4().hex}")


async def _run_remote(graph: Graph, core: StateCore, ctx: RunContext) -> bool:
    """Run the whole graph in the runtime when the connection can (POST /run_program)."""
    return isinstance(ctx.conn, GraphConnection) and await ctx.conn.run_graph(graph, core, ctx)


async def _run_live(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], core: StateCore,
                    ctx: RunContext, pool: Executor | None) -> None:
    loop = asyncio.get_running_loop()
    run = LiveRun(loop, ctx)
    root = LiveState(core, run)
    try:
        await loop.run_in_executor(pool, functools.partial(func, root, *args, **kwargs))
        await run.settle()
        problems = run.unjoined_forks()
        if problems:
            raise unjoined_fork_error(problems)
    except BaseException:
        run.cancel()
        raise


async def shared_prefix_hint(traces: Sequence[Trace], conn: Connection, ctx: RunContext) -> str:
    """Prefill the constant text every program of a batch starts with, once; returns it."""
    if len(traces) < 2:
        return ""
    texts = []
    for t in traces:
        scratch = StateCore()
        for node in t.recorded:
            if not isinstance(node, (TextNode, RoleBeginNode, RoleEndNode)):
                break
            await execute(scratch, node, ctx)
        texts.append(scratch.text)
    common = os.path.commonprefix(texts)
    if len(common) < max(len(t) for t in texts):  # cut where a new token surely starts
        cut = max(common.rfind(" "), common.rfind("\n"))
        common = common[:cut] if cut > 0 else ""
    if len(common) < MIN_SHARED_PREFIX_CHARS:
        return ""
    await conn.prefill(common)
    return common


# -- the public state ------------------------------------------------------------------------
class ProgramState:
    """The result of a run: variables, text, messages, meta info; a stream while it runs.

    A failed program's state holds its error: ``error()`` returns it and reads raise it."""

    def __init__(self, core: StateCore, task: asyncio.Task[None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._core, self._task, self._loop = core, task, loop

    # -- waiting -------------------------------------------------------------------------
    def sync(self) -> ProgramState:
        """Wait (sync) until the program has finished."""
        if not self._core.done:
            if self._loop is None:
                raise RuntimeError("this program runs on an event loop: `await state.wait()` instead")
            self._advance(self._task)
        return self

    async def wait(self) -> ProgramState:
        """Wait (async) until the program has finished."""
        if self._task is not None and self._loop is None:
            await asyncio.shield(self._task)
        return self.sync()

    def _advance(self, awaitable: Any) -> Any:
        """Run the private loop until ``awaitable`` is done; close it once the program is done."""
        assert self._loop is not None
        try:
            return self._loop.run_until_complete(awaitable)
        finally:
            if self._task is not None and self._task.done() and not self._loop.is_closed():
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
                self._loop.close()

    def _done_core(self) -> StateCore:
        self.sync()
        if self._core.error is not None:
            raise self._core.error
        return self._core

    # -- reads ---------------------------------------------------------------------------
    def error(self) -> BaseException | None:
        """The program's exception, or None (waits for the program)."""
        self.sync()
        return self._core.error

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def get_var(self, name: str) -> Any:
        core = self._done_core()
        if name not in core.variables:
            raise KeyError(f"no variable {name!r}; defined: {', '.join(core.variables) or 'none'}")
        return core.variables[name]

    def get_meta_info(self, name: str) -> Any:
        return self._done_core().meta.get(name)

    def variables(self) -> dict[str, Any]:
        return dict(self._done_core().variables)

    def text(self) -> str:
        return self._done_core().text

    def messages(self) -> list[dict[str, str]]:
        return list(self._done_core().messages)

    # -- streaming -----------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The program's text as it is produced (only variable ``var_name``'s when given)."""
        i = 0
        while True:
            if self._loop is not None and not self._loop.is_closed():
                event = self._advance(self._core.wait_event(i))
            elif i < len(self._core.events):
                event = self._core.events[i]
            else:
                if self._core.error is not None:
                    raise self._core.error
                if not self._core.done:
                    raise RuntimeError("this program runs on an event loop: use `async for` / text_async_iter()")
                return
            if event is None:
                return
            i += 1
            if var_name is None or event.var == var_name:
                yield event.text

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """text_iter() for asyncio (a program started with ``await func.arun(stream=True)``)."""
        i = 0
        while True:
            event = await self._core.wait_event(i)
            if event is None:
                return
            i += 1
            if var_name is None or event.var == var_name:
                yield event.text

    def __aiter__(self) -> AsyncIterator[str]:
        return self.text_async_iter()

    def __repr__(self) -> str:
        status = "error" if self._core.error else ("done" if self._core.done else "running")
        return f"ProgramState({status}, text={self._core.text[-60:]!r})"


async def quietly(coro: Any) -> None:
    """Await a program whose error is kept in its state (streamed runs report it on reads)."""
    with contextlib.suppress(Exception):  # the state holds it
        await coro


async def run_one(backend: Backend, func: Callable[..., Any], name: str, args: Sequence[Any],
                  kwargs: dict[str, Any], defaults: SamplingArgs, stream: bool, core: StateCore,
                  session: SessionRun | None = None) -> None:
    """Run one program on ``core``; with ``session`` (begun on ``core``) its gens are turns."""
    try:
        async with backend.connect() as conn:
            ctx = RunContext(conn, backend.chat_template, defaults, stream, name, session=session)
            await run_traced(func, name, args, kwargs, core, ctx, None)
            if session is not None:
                try:
                    await session.finish(conn)
                except BaseException as e:
                    core.finish(e)
                    raise
    finally:
        if session is not None:
            session.release()


async def run_many(backend: Backend, func: Callable[..., Any], name: str,
                   calls: Sequence[tuple[Sequence[Any], dict[str, Any]]], defaults: SamplingArgs,
                   concurrency: int, progress: Callable[[], None] | None) -> list[StateCore]:
    """Run a batch; each program's error stays in its own state."""
    cores = [StateCore() for _ in calls]
    limit = asyncio.Semaphore(concurrency)
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="radixlm-program") as pool:
        async with backend.connect() as conn:
            ctx = RunContext(conn, backend.chat_template, defaults, False, name)
            traces: list[Trace | None] = []
            for (args, kwargs), core in zip(calls, cores):
                try:
                    traces.append(trace(func, name, args, kwargs))
                except Exception as e:  # noqa: BLE001 - the program failed while tracing; its state holds it
                    core.finish(e)
                    traces.append(None)
            await shared_prefix_hint([t for t in traces if t is not None], conn, ctx)

            async def one(call: tuple[Sequence[Any], dict[str, Any]], core: StateCore, traced: Trace | None) -> None:
                try:
                    if traced is not None:
                        async with limit:
                            with contextlib.suppress(Exception):  # kept in the program's state
                                await run_traced(func, name, call[0], call[1], core, ctx, pool, traced)
                finally:
                    if progress is not None:
                        progress()

            await asyncio.gather(*(one(c, core, t) for c, core, t in zip(calls, cores, traces)))
    return cores
