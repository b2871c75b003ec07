"""A tensor-parallel worker rank (> 0): a fresh `python -m radixlm.runtime.distributed.worker`
process started by rank 0's WorkerSet; it builds its shard and runs every step rank 0 sends."""

from __future__ import annotations

import argparse
import json

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.distributed.group import init_tp_group, tp_device
from radixlm.runtime.distributed.launch import exit_with_parent
from radixlm.runtime.distributed.step import StepChannel
from radixlm.runtime.engine_build import build_runner, model_source, number_formats


def run_tp_worker(rank: int, size: int, init_file: str, config: EngineConfig) -> None:
    """A worker rank (> 0): build this rank's shard and run every step rank 0 sends, until it stops."""
    exit_with_parent()
    source = model_source(config)
    device = tp_device(config.model.device, rank)
    group = init_tp_group(rank, size, init_file, device, config.parallel.dist_timeout)
    _, runner = build_runner(config, source, device, group, number_formats(config, source, device))
    channel = StepChannel(group)
    while (step := channel.receive()) is not None:
        runner.forward(step.seqs, step.ids)
    group.close()


def _worker_main() -> None:
    parser = argparse.ArgumentParser(description="a tensor-parallel worker rank (started by the engine)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init-file", required=True)
    parser.add_argument("--config", required=True, help="EngineConfig.flat() as JSON")
    ns = parser.parse_args()
    run_tp_worker(ns.rank, ns.size, ns.init_file, EngineConfig.from_kwargs(**json.loads(ns.config)))


if __name__ == "__main__":
    _worker_main()
