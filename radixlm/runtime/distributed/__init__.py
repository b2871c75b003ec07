"""Tensor parallelism over torch.distributed: shard plans, sharded layers, the step channel and the worker ranks."""

from radixlm.runtime.distributed.group import RankFailure, TPGroup, check_devices, init_tp_group, tp_device
from radixlm.runtime.distributed.sharding import ShardPlan, check_tp_size, valid_tp_sizes

__all__ = ["RankFailure", "ShardPlan", "TPGroup", "check_devices", "check_tp_size", "init_tp_group", "tp_device",
           "valid_tp_sizes"]
