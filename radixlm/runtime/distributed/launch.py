"""Starting and watching the worker ranks (1 .. size-1) of one engine.

Each worker is a fresh `python -m <module>` process (not a multiprocessing child: the server's
engine process is a daemon, which may not have any). The engine's config travels as JSON on the
command line; the ranks meet at a rendezvous file in a private temporary folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.distributed.group import RankFailure
from radixlm.runtime.distributed.step import StepChannel


class WorkerSet:
    """The worker processes of one engine, started by rank 0."""

    def __init__(self, module: str, config: dict[str, Any], size: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="radixlm-tp-")
        self.init_file = os.path.join(self.dir, "rendezvous")
        self.size = size
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(cpu_threads(size)))
        text = json.dumps(config)
        self.procs = [
            subprocess.Popen([sys.executable, "-m", module, "--rank", str(r), "--size", str(size),
                              "--init-file", self.init_file, "--config", text], env=env)
            for r in range(1, size)
        ]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        """Raise RankFailure if a worker has exited."""
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            if code is not None:
                raise RankFailure(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {code}")

    def stop(self, grace_s: float = 10.0) -> None:
        """Wait up to `grace_s` for the workers to exit (after the channel's stop), then kill the rest."""
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def cpu_threads(size: int) -> int:
    """Intra-op threads for each of `size` CPU ranks: the host's cores split evenly (each rank
    would otherwise start a thread per core, and the all-reduces wait for the slowest)."""
    return max(1, (os.cpu_count() or 1) // size)


def exit_with_parent(poll_s: float = 0.5) -> None:
    """Worker side: end this process when the engine that started it is gone, wherever the
    worker is blocked (a thread watching the parent id, which changes when it dies)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="radixlm-tp-parent-watch", daemon=True).start()


CLOSE_WAIT_S = 30.0  # how long rank 0's teardown of the process group may wait for its peers


class Leader:
    """Rank 0's side: each step goes to the workers before rank 0 runs it too."""

    def __init__(self, channel: StepChannel, workers: WorkerSet) -> None:
        self.channel = channel
        self.workers = workers
        self.steps_sent = 0
        self.send_seconds = 0.0  # host time spent sending steps (benchmarks/tp_cpu.py reports it)

    def send(self, seqs: list[SeqStep], ids: torch.Tensor | None) -> None:
        start = time.perf_counter()
        self.workers.check()
        try:
            self.channel.send(seqs, ids)
        except RuntimeError as e:
            raise RankFailure(f"sending a step to the tensor-parallel ranks failed: {e}") from e
        self.steps_sent += 1
        self.send_seconds += time.perf_counter() - start

    def stop(self) -> None:
        """Tell the workers to exit, leave the process group while they leave theirs, then wait
        for them. NCCL tears its communicators down together (every rank inside
        destroy_process_group at once): rank 0 leaving only after its workers had exited waited
        for good (docs/machines.md). A peer already gone cannot join the teardown,
        so rank 0 waits for it at most CLOSE_WAIT_S."""
        try:
            self.channel.stop()
        except RuntimeError:
            pass  # a worker is already gone; stop() below reaps the rest
        closer = threading.Thread(target=self.channel.group.close, name="radixlm-tp-close", daemon=True)
        closer.start()
        closer.join(CLOSE_WAIT_S)
        self.workers.stop()
