"""Frozen configuration, one dataclass per component; CLI flags derive from these fields."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixlm.runtime.model.source import DEFAULT_MODEL

DTYPES = ("bfloat16", "float32", "float16")


def default_cache_dir() -> Path:
    """$RADIXLM_CACHE, else ~/.cache/radixlm (read when a config is built, never at import)."""
    return Path(os.environ.get("RADIXLM_CACHE") or Path.home() / ".cache" / "radixlm")


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    device: str = "cpu"
    cache_dir: str = field(default_factory=lambda: str(default_cache_dir()))
    context_length: int | None = None  # default: the model's, capped at 8192
    seed: int = 0  # for dummy weights

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")


@dataclass(frozen=True)
class CacheConfig:
    cache: str = "radix"  # a name in radixlm.runtime.radix_cache.CACHES
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction
    mem_fraction: float = 0.15  # of free device memory (of RAM on CPU) for the KV pool

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if not 0 < self.mem_fraction < 1:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "lpm"  # a name in radixlm.runtime.scheduler.POLICIES
    max_running_requests: int = 64
    chunked_prefill_size: int = 512  # 0 turns chunking off
    max_prefill_tokens: int = 4096  # new prompt tokens admitted per step
    lpm_max_queue: int = 128  # past this many waiting requests, lpm falls back to fcfs
    # Admission reserves ratio * (remaining max_new_tokens) for each running request. Most
    # requests stop early, so the ratio decays step by step towards its floor; a retraction
    # (decode ran out of slots) resets it to the initial value.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_prefill_tokens", "lpm_max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.min_new_token_ratio <= self.init_new_token_ratio <= 1:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
        if self.chunked_prefill_size < 0:
            raise ValueError(f"chunked_prefill_size must be >= 0 (0 = off), got {self.chunked_prefill_size}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    attention_backend: str = "torch"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments, each naming a field of one component."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}}
        top: dict[str, Any] = {}
        owners = {f.name: part for part, typ in _COMPONENTS.items() for f in dataclasses.fields(typ)}
        for key, value in kwargs.items():
            if key in owners:
                parts[owners[key]][key] = value
            elif key == "attention_backend":
                top[key] = value
            else:
                valid = sorted([*owners, "attention_backend"])
                raise ValueError(f"unknown engine option {key!r}; valid options: {', '.join(valid)}")
        return cls(**{p: _COMPONENTS[p](**v) for p, v in parts.items()}, **top)


_COMPONENTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
