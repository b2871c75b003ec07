"""Raw model speed on the default model: decode tok/s at batch 1/8/16/32 and prefill tok/s,
and 16-concurrent throughput; radixlm (each --quantization given: auto = the GGUF's own 4-bit
weights on a bf16 CPU, none = dense) next to HF transformers (bf16, same weights) and llama.cpp
(same GGUF, same threads). Each system runs --reps times, interleaved, so load from other work on
a shared machine falls on all of them alike; the best of the repetitions is reported (and all of
them kept in the JSON), and next to the ratios of the bests the median of each repetition's own ratio.

    python benchmarks/model_speed.py [--reps 3] [--quantizations auto,none] [--skip-hf] [--skip-llama-cpp]
        [--out benchmarks/results/model_speed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
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


def llama_cpp(llm, tokenizer) -> tuple[float, float]:
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


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quantizations", default="auto,none")
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--out", default="benchmarks/results/model_speed.json")
    args = ap.parse_args()
    import transformers

    threads = torch.get_num_threads()
    batches = [int(b) for b in args.batches.split(",")]
    engines = {f"radixlm {q}": Engine(max_total_tokens=20000, quantization=q) for q in args.quantizations.split(",")}
    first = next(iter(engines.values()))
    formats = {name: {k: e.core.info()[k] for k in ("dtype", "dtype_reason", "quantization", "quantization_reason")}
               for name, e in engines.items()}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    hf_model = None
    if not args.skip_hf:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(first.core.source.weights_dir), dtype=torch.bfloat16).eval()
        runs["HF bf16"] = []
    llm = None
    if not args.skip_llama_cpp:
        from llama_cpp import Llama

        # n_batch 2048 with n_ubatch 512: llama.cpp's server defaults (its 1k prefill here: ~8% faster than n_batch 512)
        llm = Llama(model_path=str(builtin_gguf_path(DEFAULT_MODEL)), n_ctx=2048, n_threads=threads, n_batch=2048,
                    n_ubatch=512, verbose=False)
        runs["llama.cpp"] = []
    loads = [_load()]
    for rep in range(args.reps):
        for name, engine in engines.items():
            r = {}
            for bs in batches:
                r[f"decode_bs{bs}"] = ours(engine, bs)
                print(f"  {name} decode_bs{bs}: {r[f'decode_bs{bs}']:.1f} tok/s (load {_load()})", flush=True)
            r["prefill"] = ours_prefill(engine)
            print(f"  {name} prefill: {r['prefill']:.1f} tok/s", flush=True)
            runs[name].append(r)
        if hf_model is not None:
            r = {f"decode_bs{bs}": hf(hf_model, first.tokenizer, bs) for bs in batches}
            r["prefill"] = hf_prefill(hf_model, first.tokenizer)
            runs["HF bf16"].append(r)
        if llm is not None:
            d, p = llama_cpp(llm, first.tokenizer)
            runs["llama.cpp"].append({"decode_bs1": d, "prefill": p})
            print(f"  llama.cpp decode_bs1: {d:.1f} tok/s, prefill {p:.1f} tok/s", flush=True)
        loads.append(_load())
        print(f"rep {rep}: load {loads[-1]}: " + json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    best = {name: {m: max(r[m] for r in rs) for m in rs[0]} for name, rs in runs.items()}
    rows = [f"decode_bs{bs}" for bs in batches] + ["prefill"]
    names = list(best)
    print(f"{'tok/s (best of ' + str(args.reps) + ')':<22}" + "".join(f"{n:>16}" for n in names))
    for row in rows:
        print(f"{row:<22}" + "".join(f"{best[n].get(row, float('nan')):>16.1f}" for n in names))
    lc = best.get("llama.cpp", {})
    ratios = {}
    for name in engines:
        b = best[name]
        if lc:
            ratios[name] = {"decode_bs1 / llama.cpp bs1": b["decode_bs1"] / lc["decode_bs1"],
                            "prefill / llama.cpp": b["prefill"] / lc["prefill"]}
            if "decode_bs16" in b:
                ratios[name]["decode_bs16 / llama.cpp bs1"] = b["decode_bs16"] / lc["decode_bs1"]
            # each repetition ran both systems back to back: its ratio shares that moment's load
            for m in ("decode_bs1", "prefill"):
                ratios[name][f"{m} / llama.cpp, median of reps"] = statistics.median(
                    o[m] / p[m] for o, p in zip(runs[name], runs["llama.cpp"]))
            print(name, " ".join(f"{k}: {v:.2f}x" for k, v in ratios[name].items()))
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flag_line = next((ln.split(":", 1)[1].split() for ln in flags.splitlines() if ln.startswith("Flags")), [])
    model_name = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("Model name")), "")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": model_name or platform.processor(),
            "cpu_flags": [f for f in flag_line if f.startswith(("avx", "amx", "fma"))], "threads": threads,
            "torch": torch.__version__, "transformers": transformers.__version__, "loadavg_1_5_15": loads,
            "formats": formats, "reps": args.reps}
    # what the kernels were told to use (a run that emulates the AVX2-only kind on an AVX-512 CPU)
    meta["isa_env"] = {k: os.environ[k] for k in ("RADIXLM_NATIVE_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
                       if k in os.environ}
    from radixlm.runtime.kernels import native

    meta["radixlm_native_isa"] = native.isa() if native.available() else None
    try:
        import llama_cpp as _lc

        meta["llama_cpp_python"] = _lc.__version__
        meta["llama_cpp_system_info"] = _lc.llama_print_system_info().decode()
    except ImportError:
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "best": best, "ratios": ratios, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
