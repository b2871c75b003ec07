"""Model loading fails with errors that name the file and tensor at fault."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model.source import resolve_model

CONFIG = dict(
    architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    return tmp_path


def _load(path: Path):
    return build_model(ModelArch.from_dir(path), path, torch.float32, "cpu", 64)


def test_valid_folder_loads(model_dir):
    assert _load(model_dir).arch.num_layers == 2


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="config.json: not found"):
        ModelArch.from_dir(tmp_path)


def test_unknown_architecture(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: unsupported architecture \['GPT2LMHeadModel'\]"):
        ModelArch.from_dir(model_dir)


def test_unsupported_rope_scaling():
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        ModelArch.from_hf_config(dict(CONFIG, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_missing_field():
    cfg = dict(CONFIG)
    del cfg["hidden_size"]
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        ModelArch.from_hf_config(cfg)


def test_missing_weights_file(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors files"):
        _load(model_dir)


def test_missing_tensor_is_named(model_dir):
    st = model_dir / "model.safetensors"
    tensors = load_file(st)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, st)
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        _load(model_dir)


def test_wrong_shape_names_file_and_tensor(model_dir):
    st = model_dir / "model.safetensors"
    tensors = load_file(st)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(tensors, st)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has "
                                         r"shape \(8, 32\), but config.json implies \(16, 32\)"):
        _load(model_dir)


def test_unexpected_tensor(model_dir):
    st = model_dir / "model.safetensors"
    tensors = load_file(st)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, st)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
        _load(model_dir)


def test_unknown_model_spec(tmp_path):
    with pytest.raises(ValueError, match="not found: give a built-in name"):
        resolve_model(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(ValueError, match="unknown dummy config 'llama-9'"):
        resolve_model("dummy:llama-9", tmp_path)


def test_bad_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="broken.gguf: not a readable GGUF file"):
        resolve_model(str(bad), tmp_path / "cache")
