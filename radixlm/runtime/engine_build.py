"""Building an engine's model and runner: the context length, the number formats, the KV pool's
size and the CUDA graphs' rows. Rank 0 (EngineCore) and every tensor-parallel worker rank
(radixlm.runtime.distributed.worker) build through here, in step."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.cuda_graph import GRAPH_EXTEND_ROWS, graph_buckets
from radixlm.runtime.distributed import TPGroup, check_devices, check_tp_size
from radixlm.runtime.kv_pool import activation_reserve, pool_slots
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.dense_linear import amx_packing
from radixlm.runtime.model.formats import (
    DtypeChoice,
    QuantChoice,
    choose_attention,
    choose_dtype,
    choose_quantization,
    cpu_flags,
    native_tiles_run,
)
from radixlm.runtime.model.gguf_quant import GGUFLinears, four_bit_share
from radixlm.runtime.model.llama import LlamaModel
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model.quant_linear import GGUF_BLOCK_METHODS
from radixlm.runtime.model.source import ModelSource, resolve_model
from radixlm.runtime.model_runner import ModelRunner

log = logging.getLogger("radixlm.engine")

DEFAULT_CONTEXT_CAP = 8192

def model_source(config: EngineConfig) -> ModelSource:
    """The model the config names: its architecture, weights and tokenizer folder."""
    mc = config.model
    return resolve_model(mc.model, Path(mc.cache_dir), mc.tokenizer_path)


def check_parallel(config: EngineConfig, arch: ModelArch | None = None) -> None:
    """A one-line ValueError when --tp-size does not split the model's heads and MLP evenly, or
    names more ranks than GPUs (`arch`: the model's, resolved from the config when None)."""
    size, mc = config.parallel.tp_size, config.model
    if size == 1:
        return
    if arch is None:
        arch = model_source(config).arch
    check_tp_size(arch, size)
    check_devices(mc.device, size)


def context_length(config: EngineConfig, model_max: int) -> int:
    """The engine's context length: the configured one, else the model's capped at DEFAULT_CONTEXT_CAP."""
    return config.model.context_length or min(model_max, DEFAULT_CONTEXT_CAP)


@dataclass(frozen=True)
class NumberFormats:
    """The weights' and activations' number formats this engine runs, with the GGUF file whose
    quantized blocks the linear layers load from (None: dense weights)."""

    dtype: DtypeChoice
    quant: QuantChoice
    gguf: GGUFLinears | None
    attention: DtypeChoice  # what the CPU's native prompt attention multiplies in


def number_formats(config: EngineConfig, source: ModelSource, device: torch.device) -> NumberFormats:
    """--dtype and --quantization resolved for this device and model (docs/engine.md, "Number
    formats"), logged with their reasons. Tensor parallelism shards dense weights, so `auto` keeps
    them dense there."""
    mc = config.model
    path = source.gguf_path  # (its share of 4-bit weights is remembered beside the converted weights)
    sharded = config.parallel.tp_size > 1

    @functools.cache
    def four_bit() -> bool:  # (asked for the dtype and again for the quantization: read once)
        return path is not None and four_bit_share(path, source.weights_dir) > 0.5

    native_four_bit = (device.type == "cpu" and mc.dtype == "auto" and mc.quantization == "auto" and not sharded
                       and native_tiles_run(four_bit, mc.quant_dense_above))
    dtype = choose_dtype(mc.dtype, device.type, cpu_flags() if device.type == "cpu" else None,
                         native_four_bit=native_four_bit)
    gguf = None
    if sharded and mc.quantization == "auto":
        quant = QuantChoice("none", None, "tensor parallelism shards dense weights")
    else:
        def choose(four_bit: bool) -> QuantChoice:
            return choose_quantization(mc.quantization, device.type, dtype.dtype, four_bit, mc.quant_dense_above,
                                       auto_dtype=mc.dtype == "auto", amx=device.type == "cpu" and amx_packing())

        quant = choose(choose(True) != choose(False) and (native_four_bit or four_bit()))
        if path is not None and quant.method in GGUF_BLOCK_METHODS:  # the file's own blocks (int4 as it holds it)
            gguf = GGUFLinears(path)
    attention = choose_attention(mc.dtype, dtype.dtype, device.type, source.arch.head_dim, config.attention_backend_name)
    log.info("dtype %s: %s", dtype.dtype, dtype.reason)
    log.info("quantization %s: %s", quant.method, quant.reason)
    log.info("prompt attention in %s: %s", attention.dtype, attention.reason)
    return NumberFormats(dtype, quant, gguf, attention)


def build_runner(config: EngineConfig, source: ModelSource, device: torch.device,
                 group: TPGroup | None, formats: NumberFormats) -> tuple[LlamaModel, ModelRunner]:
    """The model (this rank's shard with `group`) and its runner; every rank runs this, in step,
    so the KV pool has the same number of slots on every rank (the smallest any can hold)."""
    mc, sc = config.model, config.scheduler
    if device.type == "cuda":  # compiled kernels stay in radixlm's cache: a restart loads them
        os.environ.setdefault("TRITON_CACHE_DIR", str(Path(mc.cache_dir) / "triton"))
    dtype = getattr(torch, formats.dtype.dtype)
    ctx = context_length(config, source.arch.max_position_embeddings)
    model = build_model(source.arch, source.weights_dir, dtype, device, ctx, mc.seed, group, formats.quant,
                        formats.gguf)
    num_slots = config.cache.max_total_tokens or _pool_slots(config, model.shard, dtype, device, ctx)
    if group is not None:
        num_slots = group.min_host(num_slots)
    runner = ModelRunner(model, num_slots, sc.max_running_requests, ctx, config.attention_backend_name,
                         () if config.cuda_graph.disable_cuda_graph else graph_buckets(_graph_rows(config)),
                         prompt_bf16=formats.dtype.dtype == "float32" and formats.attention.dtype == "bfloat16")
    return model, runner


def _graph_rows(config: EngineConfig) -> int:
    """The most rows (tokens) a captured step holds: a full batch of decodes and room for short
    extends beside them, unless --cuda-graph-max-bs says otherwise."""
    return config.cuda_graph.cuda_graph_max_bs or config.scheduler.max_running_requests + GRAPH_EXTEND_ROWS


def _pool_slots(config: EngineConfig, shard: ModelArch, dtype: torch.dtype, device: torch.device, ctx: int) -> int:
    """KV pool tokens from free memory; on CUDA, what the weights and a reserve for
    activations and CUDA graphs leave. `shard`: this rank's share of the model."""
    cc, sc = config.cache, config.scheduler
    reserve = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        tokens = max(sc.max_prefill_tokens, sc.chunked_prefill_size or ctx)
        rows = max(sc.max_running_requests, 0 if config.cuda_graph.disable_cuda_graph else _graph_rows(config))
        reserve = activation_reserve(shard, dtype, tokens + rows, rows)
    return pool_slots(shard, dtype, _available_memory(device), cc.fraction_for(device.type), reserve)



def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
