"""EngineClient: the server process's handle on the engine-core process (asyncio + zmq)."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import signal
import tempfile
from collections.abc import AsyncGenerator
from typing import Any

import zmq
import zmq.asyncio

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine_core import RequestOutput
from radixlm.runtime.intake import Submission
from radixlm.runtime.server.engine_process import run_engine_process
from radixlm.runtime.server.messages import (
    AbortRequest,
    Crashed,
    EndProgram,
    Query,
    Ready,
    Reply,
    RequestFailed,
    Shutdown,
    StepOutputs,
)


class EngineDeadError(RuntimeError):
    """The engine process is gone; requests cannot be served until it is restarted."""


class RequestFailedError(Exception):
    def __init__(self, message: str, bad_input: bool, not_found: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input
        self.not_found = not_found


class EngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="radixlm-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._to_engine.bind(in_addr)
        self._from_engine.bind(out_addr)
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(config, in_addr, out_addr, os.getpid()), name="radixlm-engine",
            daemon=True
        )
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._tokens = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._exited: asyncio.Future[str] | None = None  # resolves with why, once the process has exited
        self._crash: str | None = None  # the exception the engine reported before it exited
        self._reaper: asyncio.Task[None] | None = None
        self._closing = False
        self.info: dict[str, Any] = {}
        self.dead: str | None = None  # why the engine is unavailable, once it is

    async def start(self, timeout: float = 600.0) -> dict[str, Any]:
        """Spawn the engine process and wait until it has loaded and warmed up the model."""
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        self._proc.start()
        # The sentinel becomes readable when the process exits, however it exits (SIGKILL included).
        loop.add_reader(self._proc.sentinel, self._on_sentinel)
        ready = asyncio.ensure_future(self._recv_ready())
        waiting: set[asyncio.Future[Any]] = {ready, self._exited}
        await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            if self._exited.done():
                raise RuntimeError(f"{self._exited.result()} while starting")
            self._proc.kill()
            raise RuntimeError(f"the engine did not become ready within {timeout:.0f} s")
        msg = ready.result()
        if "error" in msg.info:
            raise RuntimeError(f"the engine failed to start: {msg.info['error']}\n{msg.info.get('traceback', '')}")
        self.info = msg.info
        self._reader = asyncio.create_task(self._read_loop())
        return self.info

    async def _recv_ready(self) -> Ready:
        while True:
            msg = await self._from_engine.recv_pyobj()
            if isinstance(msg, Ready):
                return msg

    @property
    def pid(self) -> int | None:
        """The engine process's id (None before start)."""
        return self._proc.pid

    @property
    def num_active(self) -> int:
        return len(self._queues)

    async def wait_exit(self) -> str:
        """Wait until the engine process has exited; returns why (exit code or signal, and its error)."""
        assert self._exited is not None, "start() first"
        return await asyncio.shield(self._exited)

    async def generate(self, req: Submission) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs; closing the iterator early aborts the request."""
        if self.dead:
            raise EngineDeadError(self.dead)
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[req.rid] = q
        finished = False
        try:
            await self._to_engine.send_pyobj(req)
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(req.rid, None)
            if not finished and not self.dead:
                await self._to_engine.send_pyobj(AbortRequest(req.rid))

    async def abort(self, rid: str) -> None:
        if not self.dead:
            await self._to_engine.send_pyobj(AbortRequest(rid))

    async def end_program(self, program_id: str) -> None:
        if not self.dead:
            await self._to_engine.send_pyobj(EndProgram(program_id))

    async def query(self, kind: str, timeout: float = 30.0, args: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.dead:
            raise EngineDeadError(self.dead)
        token = next(self._tokens)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies[token] = fut
        await self._to_engine.send_pyobj(Query(kind, token, args or {}))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._replies.pop(token, None)

    async def _read_loop(self) -> None:
        while True:
            self._dispatch(await self._from_engine.recv_pyobj())

    def _dispatch(self, msg: Any) -> None:
        """Hand one engine message to whoever waits for it; never blocks (queues are unbounded here,
        the dispatcher bounds what each request may leave unread)."""
        if isinstance(msg, StepOutputs):
            for out in msg.outputs:
                q = self._queues.get(out.rid)
                if q is not None:
                    q.put_nowait(out)
        elif isinstance(msg, RequestFailed):
            q = self._queues.get(msg.rid)
            if q is not None:
                q.put_nowait(RequestFailedError(msg.message, msg.bad_input, msg.not_found))
        elif isinstance(msg, Reply):
            fut = self._replies.get(msg.token)
            if fut is not None and not fut.done():
                fut.set_result(msg.payload)
        elif isinstance(msg, Crashed):
            self._crash = msg.error

    def _on_sentinel(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        self._reaper = asyncio.create_task(self._on_exit())

    async def _on_exit(self) -> None:
        """The process has exited: read what it sent last, then fail everything in flight."""
        await asyncio.to_thread(self._proc.join)  # reaps it: exitcode is known after this
        if self._reader is not None:
            self._reader.cancel()
        while True:  # outputs and the crash report it sent before exiting
            try:
                self._dispatch(await self._from_engine.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:  # zmq.Again: nothing left (or the sockets are closed already)
                break
        why = "the server is shutting down" if self._closing else describe_exit(self._proc.exitcode, self._crash)
        self._mark_dead(why)
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(why)

    def _mark_dead(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(why))
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(why))

    async def close(self, grace: float = 10.0) -> None:
        """Abort what is in flight, stop the engine process, release the sockets."""
        self._closing = True
        if self._proc.is_alive() and not self.dead and self.info:
            await self._to_engine.send_pyobj(Shutdown())
            deadline = asyncio.get_running_loop().time() + grace
            while self._proc.is_alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        if self._proc.pid is not None:
            if self._proc.is_alive():
                self._proc.kill()
            if self._exited is not None and not self._exited.done():
                asyncio.get_running_loop().remove_reader(self._proc.sentinel)
                await asyncio.to_thread(self._proc.join, 5)
                if not self._exited.done():  # (the reader may have seen the exit while we waited)
                    self._exited.set_result("the server is shutting down")
        if self._reader is not None:
            self._reader.cancel()
        self._mark_dead("the server is shutting down")
        self._ctx.destroy(linger=0)
        for name in ("in", "out"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except FileNotFoundError:
                pass
        os.rmdir(self._dir)


def describe_exit(code: int | None, crash: str | None) -> str:
    """'the engine process died (killed by SIGKILL)', with the exception it reported, if any."""
    if code is not None and code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit code {code}"
    return f"the engine process died ({how})" + (f": {crash}" if crash else "")
