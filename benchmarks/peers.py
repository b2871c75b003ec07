"""Peers for CPU benchmarks: HF transformers `generate` and llama.cpp on the same weights.

llama.cpp comes from `pip install llama-cpp-python` (compiles ~9 min; benchmarks only, not CI).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class PeerResult:
    outputs: list[list[int]]
    seconds: float
    ttfts: list[float]


class HFPeer:
    """transformers generate, bf16, batched with left padding (no prefix sharing)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        self.pad = 2

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 16) -> PeerResult:
        outs: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            gen = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=self.pad,
            )
            outs.extend(gen[:, width:].tolist())
        return PeerResult(outs, time.perf_counter() - t0, [])


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the original GGUF; one sequence at a time, and it
    reuses the KV of the longest common prefix with the previous prompt only."""

    def __init__(self, gguf_path: Path, n_ctx: int = 4096) -> None:
        from llama_cpp import Llama

        # n_batch 2048 with n_ubatch 512: llama.cpp's server defaults (its 1k prefill here: ~8% faster than n_batch 512)
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=2, n_batch=2048, n_ubatch=512,
                         verbose=False)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> PeerResult:
        outs, ttfts = [], []
        t0 = time.perf_counter()
        for p in prompts:
            start = time.perf_counter()
            toks: list[int] = []
            for tok in self.llm.generate(p, temp=0.0, top_k=1):  # reuses the common prefix
                if not toks:
                    ttfts.append(time.perf_counter() - start)
                toks.append(tok)
                if len(toks) >= max_new_tokens:
                    break
            outs.append(toks)
        return PeerResult(outs, time.perf_counter() - t0, ttfts)
