"""The tensor-parallel process group of one engine: its collectives and its control channel.

The ranks meet in a gloo default group (start-up only); then two groups over the same ranks:
the device group (NCCL on CUDA, gloo on CPU; --dist-timeout) carries the model's all-reduces and
gathers; a gloo group carries the per-step batch description from rank 0 (plain ints on the host). Both come from torch.distributed; nothing here is a transport
of our own."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The control group's receivers wait for rank 0's next step for as long as the engine idles;
# a dead peer still ends the wait at once (its sockets close), so no time limit is needed there.
_IDLE_WAIT = datetime.timedelta(days=3650)
_START_WAIT = datetime.timedelta(seconds=600)


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or a collective failed: the ranks may be out of step, so the
    engine cannot go on and must be restarted (the server's restart path)."""


@dataclass(frozen=True)
class TPGroup:
    """This process's rank among `size`, and the two process groups."""

    rank: int
    size: int
    device: torch.device
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    timeout: datetime.timedelta

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        dist.all_reduce(t, group=self.device_group)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `t` along the last dimension, in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_host(self, t: torch.Tensor) -> None:
        """Rank 0's int64 host tensor `t` into every rank's `t` (same shape), over gloo. The
        receivers wait as long as rank 0 idles; rank 0 waits at most the group's timeout."""
        work = dist.broadcast(t, src=0, group=self.cpu_group, async_op=True)
        if self.rank == 0:
            work.wait(timeout=self.timeout)
        else:
            work.wait()

    def broadcast_device(self, t: torch.Tensor) -> None:
        """Rank 0's device tensor `t` into every rank's `t`."""
        dist.broadcast(t, src=0, group=self.device_group)

    def min_host(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(rank: int, size: int, init_file: str, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the group rendezvousing at `init_file` (a file path every rank of one engine shares)."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # ("cuda" alone names no index: the first GPU)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    # The rendezvous waits for every worker to start (imports and model lookup: tens of seconds
    # on a loaded host), whatever --dist-timeout says; the groups below carry the steps.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=max(timeout, _START_WAIT))
    device_group = dist.new_group(backend=backend, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_WAIT)
    group = TPGroup(rank, size, device, device_group, cpu_group, timeout)
    # The communicators come up now, before any CUDA graph captures a collective.
    group.all_reduce(torch.zeros(1, device=device))
    return group


def tp_device(device: str, rank: int) -> torch.device:
    """The device of `rank`: CUDA ranks take consecutive GPUs from the configured one; CPU ranks share the host."""
    base = torch.device(device)
    if base.type != "cuda" or rank == 0:
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def check_devices(device: str, size: int) -> None:
    """One line saying what to change when `size` ranks cannot start here: more CUDA ranks than
    visible GPUs, or a second tensor-parallel engine in a process that already runs one."""
    if size > 1 and dist.is_initialized():
        raise ValueError("this process already runs a tensor-parallel engine (torch.distributed is initialized): "
                         "shut it down first, or run the second engine in its own process")
    base = torch.device(device)
    if base.type != "cuda" or size == 1:
        return
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    first = base.index or 0
    if first + size > visible:
        fix = (f"lower --tp-size to at most {visible - first} or make more GPUs visible" if visible > first
               else "run on --device cpu (gloo) or make GPUs visible")
        raise ValueError(f"--tp-size {size} needs {size} GPUs from cuda:{first}, but {visible} are visible: {fix}")
