"""What an engine reports about itself: the model it serves (get_model_info / get_server_info)
and the integrity of its KV bookkeeping."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from radixlm.runtime.config import EngineConfig
from radixlm.runtime.distributed.launch import WorkerSet
from radixlm.runtime.engine_build import NumberFormats
from radixlm.runtime.model.llama import LlamaModel
from radixlm.runtime.model.source import ModelSource
from radixlm.runtime.radix_cache import IntegrityError, PrefixCache, SlotAllocator
from radixlm.runtime.request import EngineRequest
from radixlm.runtime.scheduler import Scheduler
from radixlm.runtime.sessions import SessionManager


class ReportedEngine(Protocol):
    """What these reports read of an engine (EngineCore is one)."""

    config: EngineConfig
    source: ModelSource
    formats: NumberFormats
    model: LlamaModel
    tokenizer: Any
    device: torch.device
    context_length: int
    eos_ids: frozenset[int]
    workers: WorkerSet | None
    allocator: SlotAllocator
    cache: PrefixCache
    sessions: SessionManager
    scheduler: Scheduler
    requests: dict[str, EngineRequest]

    @property
    def has_work(self) -> bool: ...


def engine_info(core: ReportedEngine) -> dict[str, Any]:
    """What the server reports about the model (get_model_info / get_server_info)."""
    return {
        "model_path": str(core.source.weights_dir or core.source.name),
        "model_name": core.source.name,
        "tokenizer_path": str(core.source.tokenizer_dir),
        "context_length": core.context_length,
        "vocab_size": core.source.arch.vocab_size,
        "dtype": core.formats.dtype.dtype,
        "dtype_reason": core.formats.dtype.reason,
        "quantization": core.formats.quant.method,
        "quantization_reason": core.formats.quant.reason,
        "quant_dense_above": core.formats.quant.dense_above,
        "attention_dtype": core.formats.attention.dtype,
        "attention_dtype_reason": core.formats.attention.reason,
        "packed_weights": core.model.packed_weights(),
        "native_products": core.model.native_products(),
        "device": str(core.device),
        "tp_size": core.config.parallel.tp_size,
        "tp_worker_pids": [] if core.workers is None else core.workers.pids,
        "max_total_tokens": core.allocator.num_slots,
        "max_running_requests": core.config.scheduler.max_running_requests,
        "eos_token_ids": sorted(core.eos_ids),
        "chat_template": getattr(core.tokenizer, "chat_template", None) is not None,
    }


def integrity_report(core: ReportedEngine) -> dict[str, Any]:
    """Check the KV bookkeeping at any moment; the figures and every broken invariant.

    Every slot is free, held by the radix cache, or held by a running request beyond its
    cached prefix; nothing else. While idle, only session pins may lock cache nodes.
    Walks the whole tree: O(cached tokens), so it is for tests and soak runs, not per step.
    """
    errors: list[str] = []
    for name, check in (("radix cache", core.cache.check_integrity), ("sessions", core.sessions.check_integrity)):
        try:
            check()
        except IntegrityError as e:
            errors.append(f"{name}: {e}")
    alloc, cache = core.allocator, core.cache
    slots_held = sum(len(r.slots) - r.tree_len for r in core.scheduler.running)
    free, cached, total = alloc.num_free, cache.total_size(), alloc.num_slots
    if free + cached + slots_held != total:
        errors.append(f"KV slots leaked: free {free} + cached {cached} + held by requests {slots_held} "
                      f"!= total {total}")
    idle = not core.has_work and not core.requests
    pinned, program_held = core.sessions.pinned_tokens, core.scheduler.held_tokens
    if idle and cache.protected_size() > pinned + program_held:
        errors.append(f"{cache.protected_size()} cached tokens locked while idle, sessions pin only {pinned} "
                      f"and programs' fork prefixes hold {program_held}")
    return {
        "ok": not errors, "errors": errors, "idle": idle,
        "running_requests": len(core.scheduler.running), "waiting_requests": len(core.scheduler.waiting),
        "kv_slots_total": total, "kv_slots_free": free, "kv_slots_held_by_requests": slots_held,
        "cache_tokens": cached, "cache_evictable_tokens": cache.evictable_size(),
        "cache_protected_tokens": cache.protected_size(), "session_pinned_tokens": pinned,
        "program_held_tokens": program_held,
    }
