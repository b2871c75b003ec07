"""The shape of a Llama-family model, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF `architectures` entry -> our family name. All of them run on radixlm's one Llama module.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

SUPPORTED_ROPE_SCALING = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF `rope_scaling`); kind 'default' means none."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelArch:
    """Everything the model runtime needs to know about a model's shape."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling = RopeScaling()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelArch:
        """Build from a parsed HF config; raise ValueError naming what is unsupported."""
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"radixlm runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            arch = cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                rope_scaling=_rope_scaling(rope, source),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing required field {e.args[0]!r}") from None
        if arch.num_heads % arch.num_kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({arch.num_kv_heads})"
            )
        return arch

    @classmethod
    def from_dir(cls, path: Path) -> ModelArch:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{cfg_path}: not found; a model folder needs config.json")
        return cls.from_hf_config(json.loads(cfg_path.read_text()), str(cfg_path))


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _rope_scaling(raw: dict[str, Any] | None, source: str) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ValueError(f"{source}: rope_scaling type {kind!r} is not supported; use one of {SUPPORTED_ROPE_SCALING}")
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )
