"""The default model (SmolLM2-135M-Instruct from its GGUF) against HF transformers, fp32."""

from __future__ import annotations

import pytest
import torch
import transformers

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model_runner import ModelRunner

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "List three primes."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def models(default_source, smol_tokenizer):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(default_source.weights_dir), dtype=torch.float32).eval()
    ours = build_model(default_source.arch, default_source.weights_dir, torch.float32, "cpu", max_positions=2048)
    return hf, ours


def _chat_ids(tokenizer, chat: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


def test_prefill_and_ragged_logits_match_hf(models, smol_tokenizer):
    hf, ours = models
    runner = ModelRunner(ours, num_slots=1024, max_requests=4, max_context=2048)
    prompts = [_chat_ids(smol_tokenizer, c) for c in CHATS]
    # first two prompts' first halves cached, then all three extend together
    slot = 1
    seqs = []
    for row, toks in enumerate(prompts):
        cached = len(toks) // 2 if row < 2 else 0
        slots = list(range(slot, slot + len(toks)))
        slot += len(toks)
        if cached:
            runner.forward([SeqStep(row, 0, toks[:cached], slots[:cached], cached, prefix_slots=[])])
        seqs.append(SeqStep(row, cached, toks[cached:], slots[cached:], 0, prefix_slots=slots[:cached]))
    logits = runner.forward(seqs)
    off = 0
    for toks, s in zip(prompts, seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([toks])).logits[0, s.cached_len :]
        assert _rel_err(logits[off : off + len(s.token_ids)], ref) < 1e-4
        off += len(s.token_ids)


def test_greedy_64_tokens_equal_hf_generate(models, smol_tokenizer):
    hf, ours = models
    runner = ModelRunner(ours, num_slots=1024, max_requests=4, max_context=2048)
    for row, chat in enumerate(CHATS):
        toks = _chat_ids(smol_tokenizer, chat)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([toks]), max_new_tokens=64, do_sample=False, min_new_tokens=64,
                pad_token_id=smol_tokenizer.eos_token_id,
            )[0, len(toks):].tolist()
        slots = list(range(1, len(toks) + 1))
        logits = runner.forward([SeqStep(row, 0, toks, slots, len(toks) - 1, prefix_slots=[])])
        out: list[int] = []
        eos = smol_tokenizer.eos_token_id
        while len(out) < 64:
            masked = logits[-1].clone()
            masked[eos] = float("-inf")  # HF's min_new_tokens blocks EOS the same way
            out.append(int(masked.argmax()))
            pos = len(toks) + len(out) - 1
            logits = runner.forward([SeqStep(row, pos, [out[-1]], [pos + 1], 0)])
        assert out == ref, smol_tokenizer.decode(out) + " != " + smol_tokenizer.decode(ref)
