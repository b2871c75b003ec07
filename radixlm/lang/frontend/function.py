"""``@function``: an LM program, with run / run_batch (sync and async), streaming and tracing."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from radixlm.lang.backends.base import Backend
from radixlm.lang.context import DEFAULT_CONTEXT
from radixlm.lang.interpreter.runner import (
    ProgramState,
    TraceError,
    quietly,
    run_graph_on,
    run_many,
    run_one,
    trace,
)
from radixlm.lang.sessions import Session, SessionRun
from radixlm.runtime.programs.executor import RunContext
from radixlm.runtime.programs.ir import Graph
from radixlm.runtime.programs.sampling import SamplingArgs
from radixlm.runtime.programs.state import StateCore

DEFAULT_CONCURRENCY = 64


class SglFunction:
    """A program: a Python function whose first parameter is the state ``s``."""

    def __init__(self, func: Callable[..., Any]) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
            raise TypeError(f"@function {func.__name__}: the first parameter must be the state `s`")
        self.func = func
        self.name = func.__qualname__
        self._params = {p.name for p in params[1:]}
        self._var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        functools.update_wrapper(self, func)

    def __call__(self, s: Any, *args: Any, **kwargs: Any) -> Any:
        """Call as a sub-program on another program's state."""
        return self.func(s, *args, **kwargs)

    # -- arguments -------------------------------------------------------------------------
    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], SamplingArgs]:
        """Program arguments, and the sampling defaults given among the keywords."""
        program, sampling = {}, {}
        for key, value in kwargs.items():
            if key in self._params or (key not in SamplingArgs.names() and self._var_kw):
                program[key] = value
            elif key in SamplingArgs.names():
                sampling[key] = value
            else:
                raise TypeError(f"{self.name}() got an unexpected argument {key!r} (neither a parameter "
                                f"of the program nor a sampling argument)")
        return program, SamplingArgs.from_kwargs(sampling)

    # -- single runs -------------------------------------------------------------------------
    def run(self, *args: Any, backend: Any = None, stream: bool = False, session: Session | None = None,
            **kwargs: Any) -> ProgramState:
        """Run once. Keywords are the program's arguments or sampling defaults (``temperature=0``,
        ``max_new_tokens=64``, ...). With ``stream=True`` the state returns at once; iterate
        ``state.text_iter()``. With ``session`` (radixlm.session(...)) the state starts where the
        session's last run ended and the session continues from where this one ends, its KV
        pinned in the runtime in between. The program's exception is raised here."""
        if not stream:
            _no_running_loop("run")
        core, coro = self._start(args, backend, stream, session, kwargs)
        if stream:
            loop = asyncio.new_event_loop()
            return ProgramState(core, loop.create_task(quietly(coro)), loop)
        asyncio.run(coro)
        return ProgramState(core)

    async def arun(self, *args: Any, backend: Any = None, stream: bool = False, session: Session | None = None,
                   **kwargs: Any) -> ProgramState:
        """run() for asyncio; with ``stream=True`` iterate the state with ``async for``."""
        core, coro = self._start(args, backend, stream, session, kwargs)
        if stream:
            return ProgramState(core, asyncio.get_running_loop().create_task(quietly(coro)))
        await coro
        return ProgramState(core)

    def _start(self, args: Sequence[Any], backend: Any, stream: bool, session: Session | None,
               kwargs: dict[str, Any]) -> tuple[StateCore, Coroutine[Any, Any, None]]:
        """A run's state and the coroutine that runs the program on it (a session is claimed now,
        so a closed or busy one fails at the call)."""
        be = _session_backend(session, backend)
        program, defaults = self._split(kwargs)
        core = StateCore()
        link = SessionRun.begin(session, core) if session is not None else None
        return core, run_one(be, self.func, self.name, args, program, defaults, stream, core, link)

    # -- batches -------------------------------------------------------------------------------
    def run_batch(self, batch: Sequence[dict[str, Any] | Sequence[Any]], *, backend: Any = None,
                  concurrency: int = DEFAULT_CONCURRENCY, num_threads: int | str | None = None,
                  progress_bar: bool = False, **defaults: Any) -> list[ProgramState]:
        """Run the program once per item (a dict of keyword arguments, or a list of positional
        ones), at most ``concurrency`` at a time (``num_threads`` is SGLang's name for it; its
        ``"auto"`` leaves ``concurrency``). A failing program does not stop the others: its state's
        ``error()`` holds the exception."""
        _no_running_loop("run_batch")
        threads = None if num_threads == "auto" else num_threads
        if isinstance(threads, str):
            raise ValueError(f"num_threads must be an int or 'auto', got {num_threads!r}")
        return asyncio.run(self.arun_batch(batch, backend=backend, concurrency=threads or concurrency,
                                           progress_bar=progress_bar, **defaults))

    async def arun_batch(self, batch: Sequence[dict[str, Any] | Sequence[Any]], *, backend: Any = None,
                         concurrency: int = DEFAULT_CONCURRENCY, progress_bar: bool = False,
                         **defaults: Any) -> list[ProgramState]:
        """run_batch() for asyncio."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        be = DEFAULT_CONTEXT.backend(backend)
        sampling = SamplingArgs.from_kwargs(defaults)
        calls = []
        for item in batch:
            if isinstance(item, dict):
                program, extra = self._split(item)
                if extra.set_fields():
                    raise TypeError(f"batch items hold program arguments; pass sampling defaults "
                                    f"({', '.join(extra.set_fields())}) to run_batch itself")
                calls.append(((), program))
            else:
                calls.append((tuple(item), {}))
        bar = _progress(len(calls)) if progress_bar else None
        try:
            cores = await run_many(be, self.func, self.name, calls, sampling, concurrency,
                                   (lambda: bar.update(1)) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        return [ProgramState(c) for c in cores]

    # -- graphs ---------------------------------------------------------------------------------
    def trace(self, *args: Any, **kwargs: Any) -> Graph:
        """The request graph of one call; TraceError when control flow reads generated values."""
        program, _ = self._split(kwargs)
        traced = trace(self.func, self.name, args, program)
        if traced.graph is None:
            raise TraceError(f"{self.name} reads a generated value (s[...], s.text(), ...) to decide what "
                             f"to do next, so it has no static graph; run() executes it step by step")
        return traced.graph


def function(func: Callable[..., Any] | None = None) -> Any:
    """Decorator that makes an LM program (SGLang's ``@function``); ``s`` is its first parameter."""
    if func is None:
        return function
    return SglFunction(func)


def run_graph(graph: Graph | str | bytes, *, backend: Any = None, **defaults: Any) -> ProgramState:
    """Run a request graph (a Graph or its JSON, validated on load)."""
    _no_running_loop("run_graph")
    return asyncio.run(arun_graph(graph, backend=backend, **defaults))


async def arun_graph(graph: Graph | str | bytes, *, backend: Any = None, **defaults: Any) -> ProgramState:
    """run_graph() for asyncio."""
    g = graph if isinstance(graph, Graph) else Graph.from_json(graph)
    be = DEFAULT_CONTEXT.backend(backend)
    core = StateCore()
    async with be.connect() as conn:
        await run_graph_on(g, core, RunContext(conn, be.chat_template, SamplingArgs.from_kwargs(defaults),
                                               program=g.program))
    return ProgramState(core)


def _session_backend(session: Session | None, backend: Any) -> Backend:
    """The backend of a run: the session's when it has one (``backend`` may only name it again)."""
    if session is None:
        return DEFAULT_CONTEXT.backend(backend)
    if not isinstance(session, Session):
        raise TypeError(f"session= takes a radixlm.session(...) handle, got {type(session).__name__}")
    if backend is not None and backend is not session.backend and backend is not getattr(session.backend, "engine", None):
        raise ValueError(f"session {session.id!r} lives on the backend that opened it; drop backend= or pass that one")
    return session.backend


def _no_running_loop(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{what}() was called inside a running event loop; use `await func.a{what}(...)`")


def _progress(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="programs", unit="prog")
