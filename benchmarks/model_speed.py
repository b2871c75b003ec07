"""Raw model speed on the default model: decode tok/s at batch 1/8/16/32 and prefill tok/s,
and 16-concurrent throughput; radixlm next to HF transformers (bf16, same weights) and llama.cpp (same GGUF).

    python benchmarks/model_speed.py [--skip-llama-cpp] [--out benchmarks/results/model_speed.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from radixlm.runtime.engine import Engine
from radixlm.runtime.model.source import DEFAULT_MODEL, builtin_gguf_path

PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 64, 64, 1024


def _prompts(tokenizer, bs: int, length: int) -> list[list[int]]:
    base = tokenizer.encode("The history of the radix tree begins with a simple idea about prefixes. " * 200)
    return [[(t + i) % 40000 + 100 if j == 0 else t for j, t in enumerate(base[:length])] for i in range(bs)]


def ours(engine: Engine, bs: int) -> float:
    """Decode tok/s: output tokens after the first, over the time after the first token."""
    prompts = _prompts(engine.tokenizer, bs, PROMPT_LEN)
    p = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    engine.generate(input_ids=prompts[:1], sampling_params=dict(p, max_new_tokens=4))  # warm-up
    engine.flush_cache()
    t0 = time.perf_counter()
    res = engine.generate(input_ids=prompts, sampling_params=p)
    total = time.perf_counter() - t0
    ttft = max(r["meta_info"]["ttft"] for r in res)
    return bs * (NEW_TOKENS - 1) / (total - ttft)


def ours_prefill(engine: Engine) -> float:
    prompt = _prompts(engine.tokenizer, 1, PREFILL_LEN)[0]
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
    return PREFILL_LEN / (time.perf_counter() - t0)


@torch.inference_mode()
def hf(model, tokenizer, bs: int) -> float:
    prompts = torch.tensor(_prompts(tokenizer, bs, PROMPT_LEN))
    kw = dict(do_sample=False, pad_token_id=2)
    model.generate(prompts[:1], max_new_tokens=4, min_new_tokens=4, **kw)
    t0 = time.perf_counter()
    model.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kw)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, **kw)
    return bs * (NEW_TOKENS - 1) / (time.perf_counter() - t0 - first)


@torch.inference_mode()
def hf_prefill(model, tokenizer) -> float:
    ids = torch.tensor(_prompts(tokenizer, 1, PREFILL_LEN))
    model(ids[:, :32])
    t0 = time.perf_counter()
    model(ids)
    return PREFILL_LEN / (time.perf_counter() - t0)


def llama_cpp(tokenizer) -> tuple[float, float]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(builtin_gguf_path(DEFAULT_MODEL)), n_ctx=2048, n_threads=2, n_batch=512,
                verbose=False)
    prompt = _prompts(tokenizer, 1, PREFILL_LEN)[0]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    prefill = PREFILL_LEN / (time.perf_counter() - t0)
    llm.reset()
    short = _prompts(tokenizer, 1, PROMPT_LEN)[0]
    n, t_first = 0, 0.0
    t0 = time.perf_counter()
    for _ in llm.generate(short, temp=0.0, top_k=1, reset=True):
        n += 1
        if n == 1:
            t_first = time.perf_counter()
        if n >= NEW_TOKENS:
            break
    decode = (NEW_TOKENS - 1) / (time.perf_counter() - t_first)
    return decode, prefill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/model_speed.json")
    args = ap.parse_args()
    import transformers

    engine = Engine(max_total_tokens=20000)
    results: dict[str, dict[str, float]] = {"radixlm": {}, "hf": {}, "llama.cpp": {}}
    for bs in (1, 8, 16, 32):
        results["radixlm"][f"decode_bs{bs}"] = ours(engine, bs)
    results["radixlm"]["prefill"] = ours_prefill(engine)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(engine.core.source.weights_dir), dtype=torch.bfloat16).eval()
    for bs in (1, 8, 16, 32):
        results["hf"][f"decode_bs{bs}"] = hf(model, engine.tokenizer, bs)
    results["hf"]["prefill"] = hf_prefill(model, engine.tokenizer)
    if not args.skip_llama_cpp:
        d, p = llama_cpp(engine.tokenizer)
        results["llama.cpp"].update(decode_bs1=d, prefill=p)
    rows = ["decode_bs1", "decode_bs8", "decode_bs16", "decode_bs32", "prefill"]
    print(f"{'tok/s':<12}{'radixlm':>10}{'HF bf16':>10}{'llama.cpp':>11}{'vs HF':>8}{'vs l.cpp':>9}")
    for r in rows:
        o, h, lc = (results[k].get(r) for k in ("radixlm", "hf", "llama.cpp"))
        print(f"{r:<12}{o:>10.1f}{h:>10.1f}{(lc or float('nan')):>11.1f}{o / h:>7.2f}x"
              f"{(o / lc if lc else float('nan')):>8.2f}x")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
