"""`radixlm serve --dp-size N`: N `radixlm serve` replicas on free local ports plus the router, one command."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from radixlm.router.config import RouterConfig
from radixlm.router.runner import route

log = logging.getLogger("radixlm.router")
# (radixlm/runtime/server/runner.py reads it: the router never imports the runtime)
LAUNCHER_PID_ENV = "RADIXLM_LAUNCHER_PID"
STOP_WAIT_S = 60.0  # after SIGTERM, past the replicas' own grace, before they are killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replica_env(index: int, dp_size: int, gpus: int, base: dict[str, str]) -> dict[str, str]:
    """One GPU per replica where there are GPUs (round robin past their count); on CPU, the cores
    shared out (a replica's torch would otherwise take them all and the N would contend)."""
    env = dict(base)
    if gpus > 0:
        visible = [d for d in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if d] or [str(g) for g in range(gpus)]
        env["CUDA_VISIBLE_DEVICES"] = visible[index % len(visible)]
    elif "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // dp_size))
    return env


async def serve_replicas(replica_args: Sequence[str], dp_size: int, gpus: int, options: dict[str, Any]) -> int:
    """Start the replicas, route over them (RouterConfig(**options) with their urls) until
    SIGTERM/SIGINT, then stop them all. Exit code: the router's, or 1 when every replica exited."""
    ports = [free_port() for _ in range(dp_size)]
    config = RouterConfig(worker_urls=tuple(f"http://127.0.0.1:{p}" for p in ports), **options)  # bad flags: here
    procs = []
    for i, port in enumerate(ports):
        cmd = [sys.executable, "-m", "radixlm.cli", "serve", *replica_args, "--host", "127.0.0.1",
               "--port", str(port)]
        env = {**replica_env(i, dp_size, gpus, dict(os.environ)), LAUNCHER_PID_ENV: str(os.getpid())}
        # Own process groups: a ctrl-C in the terminal reaches the launcher alone, which stops them in order.
        procs.append(await asyncio.create_subprocess_exec(*cmd, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                          start_new_session=True))
        log.info("replica %d: pid %d on http://127.0.0.1:%d", i, procs[-1].pid, port)
    stop = asyncio.Event()
    all_gone = asyncio.create_task(_all_exit(procs, stop))
    try:
        code = await route(config, stop)
    finally:
        all_gone.cancel()
        await _stop(procs)
    if all_gone.done() and not all_gone.cancelled() and all_gone.result():
        log.error("every replica exited; stopping")
        return 1
    return code


async def _all_exit(procs: Sequence[asyncio.subprocess.Process], stop: asyncio.Event) -> bool:
    await asyncio.gather(*(p.wait() for p in procs))
    stop.set()
    return True


async def _stop(procs: Sequence[asyncio.subprocess.Process]) -> None:
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), STOP_WAIT_S)
    except TimeoutError:
        for p in procs:
            if p.returncode is None:
                log.warning("replica pid %d did not stop; killing it", p.pid)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        await asyncio.gather(*(p.wait() for p in procs))
