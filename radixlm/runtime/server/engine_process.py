"""The engine-core process: receives requests, runs the step loop, sends outputs back.

It runs the same EngineCore as the in-process Engine, in its own process so that HTTP
parsing, tokenizing and JSON never stall the model, and the model never stalls the server.
"""

from __future__ import annotations

import gc
import os
import signal
import traceback
from typing import Any

import zmq

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.distributed import RankFailure
from radixlm.runtime.engine_core import EngineCore
from radixlm.runtime.intake import Submission
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
        "programs_scheduled": len(sched.programs),
        "program_held_tokens": sched.held_tokens,
        "steps": core.steps,
        "prompt_tokens_total": core.prompt_tokens_total,
        "cached_tokens_total": core.cached_tokens_total,
        **core.sessions.stats_dict(),
    }


def run_engine_process(config: EngineConfig, in_addr: str, out_addr: str) -> None:
    """Entry point of the engine process (spawned by EngineClient)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(out_addr)
    try:
        core = EngineCore(config)
        core.warm_up()
        # The model, tokenizer and grammar vocabularies are millions of long-lived objects: keep
        # them out of the cyclic collector, whose full passes would otherwise stall steps.
        gc.collect()
        gc.freeze()
    except Exception as e:  # noqa: BLE001 - reported to the server, which exits with it
        outbox.send_pyobj(Ready({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
        return
    outbox.send_pyobj(Ready(core.info()))
    try:
        _serve(core, inbox, outbox)
    except Exception as e:
        core.close(graceful=False)
        # Tell the server why before dying; it notices the exit itself (the process sentinel).
        outbox.send_pyobj(Crashed(f"{type(e).__name__}: {e}"))
        ctx.destroy(linger=CRASH_LINGER_MS)
        raise  # the traceback goes to stderr (the server's log) and the exit code is 1
    core.close()


def _serve(core: EngineCore, inbox: zmq.Socket[Any], outbox: zmq.Socket[Any]) -> None:
    """Handle messages and step while there is work; returns on Shutdown or when the server is gone."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the server died without a Shutdown (SIGKILL): don't linger as an orphan
            return
        core.check_ranks()  # a dead tensor-parallel rank ends this process, idle or not: the server restarts it
        timeout = 0 if core.has_work else PARENT_CHECK_MS
        core.sessions.expire()  # also while idle, so expired sessions stop pinning KV
        while poller.poll(timeout):
            msg = inbox.recv_pyobj()
            if isinstance(msg, Shutdown):
                for rid in list(core.requests):
                    out = core.abort(rid)
                    if out is not None:
                        outbox.send_pyobj(StepOutputs([out]))
                outbox.send_pyobj(Reply(-1))
                return
            _handle(core, msg, outbox)
            timeout = 0
        if core.has_work:
            try:
                outputs = core.step()
            except RankFailure:
                raise  # the ranks are out of step: the engine process exits and the server restarts it
            except Exception as e:  # noqa: BLE001 - a broken step fails its requests, not the engine
                message = f"engine step failed: {type(e).__name__}: {e}"
                for rid in list(core.requests):
                    core.abort(rid)
                    outbox.send_pyobj(RequestFailed(rid, message, bad_input=False))
                continue
            for out in outputs:
                if out.error is not None:  # failed before it ran: its constraint did not compile
                    outbox.send_pyobj(RequestFailed(out.rid, out.error, bad_input=True))
            outputs = [o for o in outputs if o.error is None]
            if outputs:
                outbox.send_pyobj(StepOutputs(outputs))


def _handle(core: EngineCore, msg: Any, outbox: zmq.Socket[Any]) -> None:
    if isinstance(msg, Submission):  # parsed and checked at the edge: it goes in as it is
        try:
            core.add_request(msg)
        except ValueError as e:
            outbox.send_pyobj(RequestFailed(msg.rid, str(e), bad_input=True,
                                            not_found=isinstance(e, SessionNotFoundError)))
    elif isinstance(msg, EndProgram):
        core.end_program(msg.program_id)
    elif isinstance(msg, AbortRequest):
        out = core.abort(msg.rid)
        if out is not None:
            outbox.send_pyobj(StepOutputs([out]))
    elif isinstance(msg, Query):
        if msg.kind == "flush_cache":
            ok = not core.has_work
            if ok:
                core.flush_cache()
            outbox.send_pyobj(Reply(msg.token, {"flushed": ok}))
        elif msg.kind == "check":
            outbox.send_pyobj(Reply(msg.token, core.integrity_report()))
        elif msg.kind in ("open_session", "close_session"):
            outbox.send_pyobj(Reply(msg.token, _session_query(core, msg.kind, msg.args)))
        else:
            outbox.send_pyobj(Reply(msg.token, engine_stats(core)))


def _session_query(core: EngineCore, kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """Open or close a session; an error comes back as {"error", "status"} (404: not open)."""
    try:
        if kind == "open_session":
            return {"session_id": core.sessions.open(args.get("session_id"), args.get("capacity"), args.get("ttl"))}
        core.sessions.close(args["session_id"])
        return {"session_id": args["session_id"]}
    except SessionError as e:
        return {"error": str(e), "status": 404 if isinstance(e, SessionNotFoundError) else 400}
