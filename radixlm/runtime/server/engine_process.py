"""The engine-core process: receives requests, runs the step loop, sends outputs back.

It runs the same EngineCore as the in-process Engine, in its own process so that HTTP
parsing, tokenizing and JSON never stall the model, and the model never stalls the server.
"""

from __future__ import annotations

import signal
import traceback
from typing import Any

import zmq

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.engine_core import EngineCore
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.server.messages import (
    AbortRequest,
    AddRequest,
    Query,
    Ready,
    Reply,
    RequestFailed,
    Shutdown,
    StepOutputs,
)


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
        "steps": core.steps,
        "prompt_tokens_total": core.prompt_tokens_total,
        "cached_tokens_total": core.cached_tokens_total,
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
    except Exception as e:  # noqa: BLE001 - reported to the server, which exits with it
        outbox.send_pyobj(Ready({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
        return
    outbox.send_pyobj(Ready(core.info()))
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        timeout = 0 if core.has_work else None
        while poller.poll(timeout):
            msg = inbox.recv_pyobj()
            if isinstance(msg, Shutdown):
                for rid in list(core.tracks):
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
            except Exception as e:  # noqa: BLE001 - a broken step fails its requests, not the engine
                message = f"engine step failed: {type(e).__name__}: {e}"
                for rid in list(core.tracks):
                    core.abort(rid)
                    outbox.send_pyobj(RequestFailed(rid, message, bad_input=False))
                continue
            if outputs:
                outbox.send_pyobj(StepOutputs(outputs))


def _handle(core: EngineCore, msg: Any, outbox: zmq.Socket) -> None:
    if isinstance(msg, AddRequest):
        try:
            core.add_request(msg.rid, msg.prompt_ids, SamplingParams.from_dict(msg.params), msg.return_logprob,
                             msg.logprob_start_len, msg.top_logprobs_num)
        except ValueError as e:
            outbox.send_pyobj(RequestFailed(msg.rid, str(e), bad_input=True))
    elif isinstance(msg, AbortRequest):
        out = core.abort(msg.rid)
        if out is not None:
            outbox.send_pyobj(StepOutputs([out]))
    elif isinstance(msg, Query):
        if msg.kind == "flush_cache":
            ok = not core.has_work
            if ok:
                core.cache.reset()
            outbox.send_pyobj(Reply(msg.token, {"flushed": ok}))
        else:
            outbox.send_pyobj(Reply(msg.token, engine_stats(core)))
