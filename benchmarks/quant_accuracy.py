"""How far the CPU's number formats move the default model's next-token log-probabilities from the
fp32 model of the same weights (the GGUF's Q4_1/Q8_0 values dequantized): mean and max |Δ logprob|
of the sampled-from distribution over the tokens of a text, every position teacher-forced.

    python benchmarks/quant_accuracy.py [--tokens 1000] [--skip-llama-cpp]

Rows: bf16 dense weights; q4 on torch's int4 kernel (bf16 activations); q4 on the native VNNI
kernels (int8 activation blocks of 32, as at batch-1 decode), each run 4 rows a call like a decode
step of 4; where the processor has avx512_bf16, the fp32 rows again with the prompt attention's
products in bf16 (as `--dtype auto` serves them there: `formats.choose_attention`); llama.cpp on the
same GGUF (`logits_all`), for the peer's own error.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from radixlm.runtime.batch import SeqStep
from radixlm.runtime.config import default_cache_dir
from radixlm.runtime.kernels import native
from radixlm.runtime.model.formats import QuantChoice
from radixlm.runtime.model.loader import build_model
from radixlm.runtime.model.source import DEFAULT_MODEL, resolve_model
from radixlm.runtime.model_runner import ModelRunner


def _text_ids(tokenizer, n: int) -> list[int]:
    text = "\n".join(p.read_text() for p in sorted(Path(__file__).resolve().parents[1].glob("docs/*.md")))
    return tokenizer(text, add_special_tokens=False).input_ids[:n]


@torch.inference_mode()
def _logprobs(model, ids: list[int], prompt_bf16: bool = False) -> torch.Tensor:
    runner = ModelRunner(model, num_slots=len(ids) + 8, max_requests=1, max_context=len(ids) + 8,
                         prompt_bf16=prompt_bf16)
    logits = runner.forward([SeqStep(0, 0, ids, list(range(1, len(ids) + 1)), 0, prefix_slots=[])])
    return torch.log_softmax(logits.float(), -1)


def _llama_cpp(gguf: str, ids: list[int]) -> torch.Tensor:
    from llama_cpp import Llama

    llm = Llama(gguf, n_ctx=len(ids) + 8, logits_all=True, verbose=False, n_threads=torch.get_num_threads())
    llm.eval(ids)
    return torch.log_softmax(torch.tensor(llm.scores[: len(ids)], dtype=torch.float32), -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    src = resolve_model(DEFAULT_MODEL, default_cache_dir())
    from transformers import AutoTokenizer

    ids = _text_ids(AutoTokenizer.from_pretrained(str(src.tokenizer_dir)), args.tokens)
    build = lambda dtype, quant=None: build_model(src.arch, src.weights_dir, dtype, "cpu",  # noqa: E731
                                                  max_positions=len(ids) + 8, quant=quant,
                                                  gguf=src.gguf_path if quant else None)
    dense = build(torch.float32)
    ref = _logprobs(dense, ids)
    rows: dict[str, torch.Tensor] = {"bf16 dense": _logprobs(build(torch.bfloat16), ids)}
    bf16_prompts = native.prefill_bf16_available()
    if bf16_prompts:
        rows["fp32 dense, bf16 prompt attention"] = _logprobs(dense, ids, prompt_bf16=True)
    # dense_above 4 would send a whole prompt to the dense copy: None keeps every row on the
    # quantized kernels, MAX_ROWS rows a call, each row computed as a decode step computes it
    four_bit = QuantChoice("q4", None, "accuracy")
    if native.available():
        rows["q4, native VNNI kernels (int8 activation blocks)"] = _logprobs(build(torch.bfloat16, four_bit), ids)
        # as `auto` serves where the processor has no native bf16
        served = build(torch.float32, four_bit)
        rows["q4 fp32, native kernels (int8 activation blocks)"] = _logprobs(served, ids)
        if bf16_prompts:
            rows["q4 fp32, native kernels, bf16 prompt attention"] = _logprobs(served, ids, prompt_bf16=True)
    os.environ["RADIXLM_NATIVE"] = "0"
    native.isa.cache_clear()
    rows["q4, torch's int4 kernel (bf16 activations)"] = _logprobs(build(torch.bfloat16, four_bit), ids)
    if not args.skip_llama_cpp:
        rows["llama.cpp (Q4_1 GGUF)"] = _llama_cpp(str(src.gguf_path), ids)
    results = {}
    print(f"{len(ids)} tokens of docs/*.md; |Δ logprob| of the next-token distribution against fp32, "
          "over the log-probability of each position's argmax under fp32")
    top = ref.argmax(-1, keepdim=True)
    for name, lp in rows.items():
        delta = (lp.gather(-1, top) - ref.gather(-1, top)).abs().squeeze(-1)
        results[name] = {"mean": delta.mean().item(), "max": delta.max().item(),
                         "argmax_agrees": (lp.argmax(-1) == ref.argmax(-1)).float().mean().item()}
        print(f"  {name:52s} mean {results[name]['mean']:.4f}  max {results[name]['max']:.3f}  "
              f"argmax agrees {results[name]['argmax_agrees']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"tokens": len(ids), "results": results}, indent=1))


if __name__ == "__main__":
    main()
