"""Our Llama-family model vs HF transformers on the same weights (fp32, tiny random configs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.model.arch import ModelArch
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model_runner import ModelRunner

TINY = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
)
CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(TINY, tie_word_embeddings=False)),
    "llama3-rope": (
        transformers.LlamaConfig,
        dict(TINY, rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                           high_freq_factor=4.0, original_max_position_embeddings=32)),
    ),
    "smollm2-tied": (transformers.LlamaConfig, dict(TINY, tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen2": (transformers.Qwen2Config, dict(TINY, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, dict(TINY, sliding_window=None)),
}
RTOL = 1e-4


def _save_hf(name: str, tmp: Path) -> tuple[transformers.PreTrainedModel, Path]:
    cfg_cls, kwargs = CONFIGS[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg_cls(**kwargs), dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases so a dropped tensor shows
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight") or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp)
    return hf, tmp


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err < RTOL, f"max relative error {err:.2e}"


@pytest.fixture(params=sorted(CONFIGS))
def pair(request, tmp_path):
    hf, path = _save_hf(request.param, tmp_path)
    ours = build_model(ModelArch.from_dir(path), path, torch.float32, "cpu", max_positions=256)
    return hf, ModelRunner(ours, num_slots=512, max_requests=8, max_context=256)


def test_prefill_then_decode_matches_hf(pair):
    hf, runner = pair
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (1, 24), generator=gen)
    slots = list(range(1, 25))
    logits = runner.forward([SeqStep(0, 0, ids[0].tolist(), slots, 0, prefix_slots=[])])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    _close(logits, ref)
    seq = ids[0].tolist()
    for step in range(16):  # 16 decode steps, one token each, through the KV pool
        nxt = int(ref[-1].argmax()) if step == 0 else int(logits[-1].argmax())
        seq.append(nxt)
        logits = runner.forward([SeqStep(0, len(seq) - 1, [nxt], [len(seq)], 0)])
        with torch.no_grad():
            ref_last = hf(torch.tensor([seq])).logits[0, -1:]
        _close(logits, ref_last)


def test_ragged_batch_with_cached_prefixes_matches_hf(pair):
    """4 sequences with cached lengths 0, 5, 17 and 30 and 1..9 new tokens, in one forward."""
    hf, runner = pair
    gen = torch.Generator().manual_seed(2)
    plan = [(0, 9), (5, 4), (17, 1), (30, 6)]
    next_slot = 1
    seqs, prompts = [], []
    for row, (cached, new) in enumerate(plan):
        toks = torch.randint(0, 97, (cached + new,), generator=gen).tolist()
        prompts.append(toks)
        slots = list(range(next_slot, next_slot + cached + new))
        next_slot += cached + new
        if cached:  # fill the prefix's KV with an earlier forward of its own
            runner.forward([SeqStep(row, 0, toks[:cached], slots[:cached], cached, prefix_slots=[])])
        seqs.append(SeqStep(row, cached, toks[cached:], slots[cached:], 0, prefix_slots=slots[:cached]))
    logits = runner.forward(seqs)
    offset = 0
    for toks, (cached, new) in zip(prompts, plan):
        with torch.no_grad():
            ref = hf(torch.tensor([toks])).logits[0, cached:]
        _close(logits[offset : offset + new], ref)
        offset += new
    assert offset == logits.shape[0]
