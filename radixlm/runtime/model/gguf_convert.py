"""Convert a Llama-family GGUF file into a Hugging Face model folder (bf16 safetensors).

Conversion runs once; the folder then loads in about a second. Quantized tensors are
dequantized with the `gguf` package, and the Q/K row permutation that llama.cpp applies for
its interleaved RoPE is undone so the weights match the HF (rotate-half) layout.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

GGUF_TO_HF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_TO_HF_LAYER:
        return f"model.layers.{parts[1]}.{GGUF_TO_HF_LAYER[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head (pairs -> halves) reordering of Q/K output rows."""
    rows = w.shape[0]
    half = rows // n_head // 2
    out: np.ndarray = w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return out


def gguf_to_hf_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama' GGUF files convert")
    p = "llama."
    n_vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(_field(reader, p + "embedding_length")),
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": int(_field(reader, p + "attention.head_count")),
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv")),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "vocab_size": int(n_vocab),
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write config.json, model.safetensors and tokenizer files for `gguf_path` into `out_dir`.

    The folder appears atomically (written to a temporary sibling, then renamed), so a
    concurrent reader never sees half a conversion.
    """
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ValueError(f"{gguf_path}: GGUF file not found")
    try:
        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001 - any parse failure means the same thing to the user
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    config = gguf_to_hf_config(reader)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            arr = _unpermute_rope_rows(arr, n_head)
        elif name.endswith("k_proj.weight"):
            arr = _unpermute_rope_rows(arr, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(arr)).to(torch.bfloat16)

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(str(tmp))
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
