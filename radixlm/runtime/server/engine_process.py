"""The engine-core process: receives requests, runs the step loop, sends outputs back.

It runs the same EngineCore as the in-process Engine, in its own process so that HTTP
parsing, tokenizing and JSON never stall the model, and the model never stalls the server.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import time
import traceback
from typing import Any

import zmq

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine_core import EngineCore
from radixlm.runtime.faults import is_fatal
from radixlm.runtime.intake import Submission
from radixlm.runtime.radix_cache import IntegrityError
from radixlm.runtime.server.held_outputs import HeldOutputs
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
from radixlm.runtime.sessions import SessionError, SessionNotFoundError

log = logging.getLogger("radixlm.engine")

PARENT_CHECK_MS = 1000  # while idle, how often the engine checks that the server process still exists
CRASH_LINGER_MS = 2000  # how long a crashing engine waits for its last message to reach the server


def engine_stats(core: EngineCore) -> dict[str, Any]:
    sched, cache, alloc = core.scheduler, core.cache, core.allocator
    return {
        "running_requests": len(sched.running),
        "waiting_requests": len(sched.waiting),
        "kv_slots_total": alloc.num_slots,
        "kv_slots_free": alloc.num_free,
        "kv_slots_used_by_requests": alloc.num_slots - alloc.num_free - cache.total_size(),
        "cache_tokens": cache.total_size(),
        "cache_evictable_tokens": cache.evictable_size(),
        "cache_protected_tokens": cache.protected_size(),
        "retractions": sched.num_retractions,
        "programs_scheduled": len(sched.programs.started),
        "program_held_tokens": sched.held_tokens,
        "program_returns": sched.programs.returns,
        "program_returns_late": sched.programs.returns_late,
        "program_return_steps": sched.programs.return_steps,
        "steps": core.steps,
        "prompt_steps": core.prompt_steps,
        "rows_fed": core.rows_fed,
        "tokens_fed": core.tokens_fed,
        "graph_steps": core.runner.graph_steps,
        "step_phase_seconds": dict(core.step_seconds),
        "prompt_tokens_total": core.output.totals.prompt_tokens,  # (finished requests': the cache hit rate)
        "cached_tokens_total": core.output.totals.cached_tokens,
        **core.sessions.stats_dict(),
    }


class ServerGone(Exception):
    """The server process died without a Shutdown (SIGKILL): nothing reads the outputs any more."""


class Outbox:
    """The socket to the server. A send waits while the server is slow to read its outputs, but
    not once it is gone: a PUSH socket whose reader died blocks for good once its queue is full,
    and an engine stuck there would outlive the server, holding its memory."""

    def __init__(self, sock: zmq.Socket[Any], parent: int) -> None:
        self.sock = sock
        self.parent = parent
        sock.setsockopt(zmq.SNDTIMEO, PARENT_CHECK_MS)

    def check_parent(self) -> None:
        if os.getppid() != self.parent:
            raise ServerGone

    def send(self, msg: Any) -> None:
        while True:
            try:
                self.sock.send_pyobj(msg)
                return
            except zmq.Again:
                self.check_parent()


def run_engine_process(config: EngineConfig, in_addr: str, out_addr: str, parent: int) -> None:
    """Entry point of the engine process (spawned by EngineClient; ``parent``: the server's pid)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    sock = ctx.socket(zmq.PUSH)
    sock.connect(out_addr)
    outbox = Outbox(sock, parent)
    try:
        try:
            core = EngineCore(config)
            core.warm_up()
            # The model, tokenizer and grammar vocabularies are millions of long-lived objects: keep
            # them out of the cyclic collector, whose full passes would otherwise stall steps.
            gc.collect()
            gc.freeze()
        except Exception as e:  # noqa: BLE001 - reported to the server, which exits with it
            outbox.send(Ready({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
            return
        outbox.send(Ready(core.info()))
        try:
            _serve(core, inbox, outbox)
        except ServerGone:
            core.close(graceful=False)
            raise
        except Exception as e:
            core.close(graceful=False)
            # Tell the server why before dying; it notices the exit itself (the process sentinel).
            with contextlib.suppress(ServerGone):
                outbox.send(Crashed(f"{type(e).__name__}: {e}"))
            ctx.destroy(linger=CRASH_LINGER_MS)
            raise  # the traceback goes to stderr (the server's log) and the exit code is 1
        core.close()
    except ServerGone:  # don't linger as an orphan, nor wait at exit for queued outputs nobody reads
        ctx.destroy(linger=0)


def _serve(core: EngineCore, inbox: zmq.Socket[Any], outbox: Outbox) -> None:
    """Handle messages and step while there is work; returns on Shutdown, raises ServerGone when
    the server died without one."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    held = HeldOutputs()  # the outputs of requests nobody streams, until they finish
    while True:
        outbox.check_parent()
        core.check_ranks()  # a dead tensor-parallel rank ends this process, idle or not: the server restarts it
        timeout = 0 if core.has_work else PARENT_CHECK_MS
        core.sessions.expire()  # also while idle, so expired sessions stop pinning KV
        while poller.poll(timeout):
            t0 = time.perf_counter()
            msg = inbox.recv_pyobj()
            if isinstance(msg, Shutdown):
                for rid in list(core.requests):
                    out = core.abort(rid)
                    if out is not None:
                        outbox.send(StepOutputs(held.pass_on([out])))
                outbox.send(Reply(-1))
                return
            _handle(core, msg, outbox, held)
            core.step_seconds["intake"] += time.perf_counter() - t0
            timeout = 0
        if core.has_work:
            try:
                outputs = core.step()
            except Exception as e:  # noqa: BLE001 - fatal errors end the engine; others its requests
                _fail_step(core, e, outbox, held)
                continue
            for out in outputs:
                if out.error is not None:  # its constraint did not compile, or a fault ended it
                    held.drop(out.rid)
                    outbox.send(RequestFailed(out.rid, out.error, bad_input=not out.internal))
            outputs = held.pass_on(o for o in outputs if o.error is None)
            if outputs:
                t0 = time.perf_counter()
                outbox.send(StepOutputs(outputs))
                core.step_seconds["send"] += time.perf_counter() - t0


def _fail_step(core: EngineCore, e: Exception, outbox: Outbox, held: HeldOutputs) -> None:
    """A step raised outside every request's fault boundary (picking the step's work, say): its
    requests fail with 500 and the engine goes on if its KV bookkeeping is intact. Fatal errors
    (a dead rank, a device error, a failed integrity check) end the engine process, which the
    server restarts."""
    if is_fatal(e):
        raise e
    log.error("engine step failed: %s: %s; failing the %d requests in flight", type(e).__name__, e,
              len(core.requests), exc_info=e)
    message = f"internal error: the engine step failed ({type(e).__name__}: {e}); the server log has the traceback"
    for rid in list(core.requests):
        core.abort(rid)
        held.drop(rid)
        outbox.send(RequestFailed(rid, message, bad_input=False))
    report = core.integrity_report()
    if not report["ok"]:
        raise IntegrityError("after a failed step: " + "; ".join(report["errors"])) from e


def _handle(core: EngineCore, msg: Any, outbox: Outbox, held: HeldOutputs) -> None:
    if isinstance(msg, Submission):  # parsed and checked at the edge: it goes in as it is
        try:
            core.add_request(msg)
            if not msg.stream:
                held.hold(msg.rid)
        except ValueError as e:
            outbox.send(RequestFailed(msg.rid, str(e), bad_input=True,
                                            not_found=isinstance(e, SessionNotFoundError)))
        except Exception as e:  # noqa: BLE001 - a fault admitting it ends this request only
            outbox.send(RequestFailed(msg.rid, core.faults.contain(msg.rid, "admission", e), bad_input=False))
    elif isinstance(msg, EndProgram):
        core.end_program(msg.program_id)
    elif isinstance(msg, AbortRequest):
        out = core.abort(msg.rid)
        if out is not None:
            outbox.send(StepOutputs(held.pass_on([out])))
    elif isinstance(msg, Query):
        if msg.kind == "flush_cache":
            ok = not core.has_work
            if ok:
                core.flush_cache()
            outbox.send(Reply(msg.token, {"flushed": ok}))
        elif msg.kind == "check":
            outbox.send(Reply(msg.token, core.integrity_report()))
        elif msg.kind in ("open_session", "close_session"):
            outbox.send(Reply(msg.token, _session_query(core, msg.kind, msg.args)))
        else:
            outbox.send(Reply(msg.token, engine_stats(core)))


def _session_query(core: EngineCore, kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """Open or close a session; an error comes back as {"error", "status"} (404: not open)."""
    try:
        if kind == "open_session":
            return {"session_id": core.sessions.open(args.get("session_id"), args.get("capacity"), args.get("ttl"))}
        core.sessions.close(args["session_id"])
        return {"session_id": args["session_id"]}
    except SessionError as e:
        return {"error": str(e), "status": 404 if isinstance(e, SessionNotFoundError) else 400}
