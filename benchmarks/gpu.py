"""GPU benchmark on dummy-weight Llama-3-8B (bf16), one table from one run:

- HBM copy bandwidth measured here, and the bs1 decode roofline it implies (weight bytes plus
  KV bytes read per token over that bandwidth);
- decode output tok/s at batch 1/8/32/64/128 (input 128, output 256), triton attention + CUDA graphs
  + the overlap schedule, and at batch 1 and 64 with the overlap schedule off; at batch 64 also
  sampled (temperature 0.8, top-p 0.95, top-k 50) with the overlap schedule on and off;
- prefill tok/s at 1k/4k/8k tokens;
- HF transformers `generate` on the same config (random weights) at batch 1 and 64, and HF
  prefill;
- radix cache on vs off on 64 requests sharing a 2k-token prefix;
- structured output: a 5-field `json_schema` against free text (ignore_eos) at batch 1/16/64,
  max_new_tokens 128, output tokens over the whole generate call (the structured-output table).

    python benchmarks/gpu.py --tokenizer DIR [--out benchmarks/results/gpu.json] [--profile]

The tokenizer only serves the engine's detokenizer (prompts are token ids): any tokenizer
folder works, e.g. the default model's (~/.cache/radixlm/SmolLM2-*/).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

from radixlm.runtime.constrained.jump_forward import JumpPolicy
from radixlm.runtime.engine import Engine
from radixlm.runtime.kv_pool import KVPool
from radixlm.runtime.model.source import DUMMY_CONFIGS

MODEL = "dummy:llama-3-8b"
CONFIG = DUMMY_CONFIGS["llama-3-8b"]
DECODE_BS = (1, 8, 32, 64, 128)
IN_LEN, OUT_LEN = 128, 256
PREFILL_LENS = (1024, 4096, 8192)
HF_BS, HF_OUT = (1, 64), 64  # HF decodes fewer tokens: at ~13 tok/s, 256 would take 20 s
PREFIX_REQS, PREFIX_LEN, SUFFIX_LEN, PREFIX_OUT = 64, 2048, 32, 32


def hbm_copy_gbps(gib: int = 2, iters: int = 20) -> float:
    """Device-to-device copy, bytes read plus written, median of `iters` event-timed copies."""
    n = (gib << 30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * n * 2 / statistics.median(times) / 1e9


def weight_bytes_per_token() -> int:
    """Bytes of weights a decode step reads: everything but the embedding table (one row)."""
    h, i, layers, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"], CONFIG["vocab_size"]
    d = h // CONFIG["num_attention_heads"]
    kv = CONFIG["num_key_value_heads"] * d
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i + 2 * h
    return 2 * (layers * per_layer + h + v * h)


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 120000, (n, length), generator=gen).tolist()


SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


def decode_tok_s(engine: Engine, bs: int, sampling: dict[str, float] | None = None) -> float:
    """Output tok/s after the first token: bs * (OUT_LEN - 1) over the time after the last TTFT.
    Greedy unless `sampling` is given."""
    params = {"temperature": 0, "max_new_tokens": OUT_LEN, "ignore_eos": True, **(sampling or {})}
    engine.flush_cache()
    t0 = time.perf_counter()
    res = engine.generate(input_ids=random_prompts(bs, IN_LEN, seed=bs), sampling_params=params)
    total = time.perf_counter() - t0
    ttft = max(r["meta_info"]["ttft"] for r in res)
    return bs * (OUT_LEN - 1) / (total - ttft)


def prefill_tok_s(engine: Engine, length: int, repeats: int = 3) -> float:
    best = 0.0
    for r in range(repeats):
        engine.flush_cache()
        prompt = random_prompts(1, length, seed=length + r)[0]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})
        best = max(best, length / (time.perf_counter() - t0))
    return best


def shared_prefix_run(engine: Engine) -> float:
    """Seconds for 64 requests: one 2k-token prefix, 32 own tokens each, 32 new tokens each."""
    prefix = random_prompts(1, PREFIX_LEN, seed=99)[0]
    prompts = [prefix + s for s in random_prompts(PREFIX_REQS, SUFFIX_LEN, seed=100)]
    engine.flush_cache()
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": PREFIX_OUT,
                                                        "ignore_eos": True})
    return time.perf_counter() - t0


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                   "city": {"type": "string"}, "member": {"type": "boolean"}},
    "required": ["name", "age", "email", "city", "member"],
}
JSON_BS, JSON_OUT = (1, 16, 64), 128


def structured_tok_s(engine: Engine, bs: int, constrained: bool, jump_forward: bool = True) -> float:
    """Output tokens per second of one batched generate: the JSON schema (with or without
    jump-forward), or free text that runs to max_new_tokens."""
    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": JSON_OUT}
    params.update({"json_schema": json.dumps(PERSON_SCHEMA), "jump_forward": jump_forward} if constrained
                  else {"ignore_eos": True})
    engine.flush_cache()
    t0 = time.perf_counter()
    res = engine.generate(input_ids=random_prompts(bs, IN_LEN, seed=bs + 7), sampling_params=params)
    elapsed = time.perf_counter() - t0
    res = res if isinstance(res, list) else [res]
    return sum(r["meta_info"]["completion_tokens"] for r in res) / elapsed


def uncapped_tok_s(engine: Engine, bs: int) -> float:
    """json_schema with every jump taken (at any batch size, however few tokens it adds)."""
    policy, engine.core.output.jump_policy = engine.core.output.jump_policy, JumpPolicy()
    try:
        return structured_tok_s(engine, bs, True)
    finally:
        engine.core.output.jump_policy = policy


def structured_profile(engine: Engine) -> None:
    """json_schema vs free rows, then where a bs64 json_schema generate spends host time."""
    import cProfile
    import pstats

    structured_tok_s(engine, 2, True)
    for bs in JSON_BS:
        print(f"bs{bs}: free {structured_tok_s(engine, bs, False):.0f} / json_schema "
              f"{structured_tok_s(engine, bs, True):.0f} / without jump-forward "
              f"{structured_tok_s(engine, bs, True, False):.0f} / json_schema again "
              f"{structured_tok_s(engine, bs, True):.0f} / free again {structured_tok_s(engine, bs, False):.0f} "
              f"/ json_schema, jump-forward at any batch size {uncapped_tok_s(engine, bs):.0f} out tok/s", flush=True)
    core = engine.core
    steps, ahead = core.steps, core.ahead_steps
    prof = cProfile.Profile()
    prof.enable()
    v = structured_tok_s(engine, 64, True)
    prof.disable()
    print(f"bs64 json_schema {v:.0f} tok/s; steps {core.steps - steps}, queued ahead {core.ahead_steps - ahead}",
          flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(35)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(35)


def engine_for(tokenizer: str, cache: str, grammar_backend: str | None = None) -> Engine:
    grammar = {} if grammar_backend is None else {"grammar_backend": grammar_backend}
    engine = Engine(MODEL, device="cuda", dtype="bfloat16", tokenizer_path=tokenizer, cache=cache,
                    max_running_requests=128, chunked_prefill_size=8192, max_prefill_tokens=16384,
                    context_length=8448, **grammar)
    engine.core.warm_up()  # the server's start-up phase: every step shape's kernels compiled first
    return engine


def profile_top(engine: Engine, rows: int = 14) -> str:
    """The kernels that take the most GPU time in a 4k prefill, then in 32 bs1 and 32 bs64
    decode steps."""
    from torch.profiler import ProfilerActivity, profile

    tables = []
    for bs, length, out in ((1, 4096, 1), (1, 128, 32), (64, 128, 32)):
        engine.flush_cache()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(input_ids=random_prompts(bs, length, seed=7), sampling_params={
                "temperature": 0, "max_new_tokens": out, "ignore_eos": True})
        tables.append(f"bs{bs}, input {length}, output {out}:\n" + prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))
    return "\n".join(tables)


def host_profile_top(engine: Engine, bs: int, rows: int = 25) -> str:
    """The host functions that take the most time (cProfile, own time) in a decode of OUT_LEN
    tokens at batch `bs`: what the CPU does between graph replays."""
    import cProfile
    import io
    import pstats

    engine.flush_cache()
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(input_ids=random_prompts(bs, IN_LEN, seed=5),
                    sampling_params={"temperature": 0, "max_new_tokens": OUT_LEN, "ignore_eos": True})
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def hf_model() -> Any:
    import transformers

    cfg = transformers.LlamaConfig(**CONFIG)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


@torch.inference_mode()
def hf_decode_tok_s(model: Any, bs: int) -> float:
    ids = torch.tensor(random_prompts(bs, IN_LEN, seed=bs), device="cuda")
    kw: dict[str, Any] = dict(do_sample=False, pad_token_id=0)
    model.generate(ids[:1, :16], max_new_tokens=4, min_new_tokens=4, **kw)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=HF_OUT, min_new_tokens=HF_OUT, **kw)
    torch.cuda.synchronize()
    return bs * (HF_OUT - 1) / (time.perf_counter() - t0 - first)


@torch.inference_mode()
def hf_prefill_tok_s(model: Any, length: int) -> float:
    ids = torch.tensor(random_prompts(1, length, seed=length), device="cuda")
    model(ids[:, :64])
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids, logits_to_keep=1)
        torch.cuda.synchronize()
        best = max(best, length / (time.perf_counter() - t0))
    return best


def graph_step_ms(engine: Engine, bs: int, iters: int = 50) -> float:
    """GPU time of one captured decode step (replayed on whatever its buffers hold)."""
    graphs = engine.core.runner.graphs
    assert graphs is not None
    graph = graphs.graphs[bs][0]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def log(name: str, value: Any) -> None:
    print(f"  {name}: {value}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (for detokenizing only)")
    ap.add_argument("--out", default="benchmarks/results/gpu.json")
    ap.add_argument("--profile", action="store_true", help="also print the top GPU kernels")
    ap.add_argument("--host-profile", action="store_true", help="also print the top host functions of bs64 decode")
    ap.add_argument("--structured-only", action="store_true",
                    help="only the json_schema rows, with a host profile of bs64 and its step counts")
    ap.add_argument("--grammar-backend", default=None, help="grammar backend of --structured-only (default: the engine's)")
    args = ap.parse_args()
    if args.structured_only:
        structured_profile(engine_for(args.tokenizer, "radix", args.grammar_backend))
        return
    import transformers
    import triton

    t_start = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    res: dict[str, Any] = {"gpu": gpu, "date": date.today().isoformat(), "model": MODEL,
                           "versions": {"torch": torch.__version__, "triton": triton.__version__,
                                        "transformers": transformers.__version__,
                                        "python": platform.python_version()}}
    bw = hbm_copy_gbps()
    kv_bytes = KVPool.bytes_per_token(_arch(), torch.bfloat16) * (IN_LEN + OUT_LEN // 2)
    step_bytes = weight_bytes_per_token() + kv_bytes
    res["hbm_copy_gbps"] = bw
    res["bytes_per_bs1_step"] = step_bytes
    res["roofline_bs1_tok_s"] = bw * 1e9 / step_bytes

    log("HBM copy GB/s", f"{bw:.0f}")
    engine = engine_for(args.tokenizer, "radix")
    res["kv_pool_tokens"] = engine.core.allocator.num_slots
    res["decode_tok_s"], res["prefill_tok_s"] = {}, {}
    for bs in DECODE_BS:
        res["decode_tok_s"][bs] = v = decode_tok_s(engine, bs)
        log(f"decode bs{bs} tok/s", f"{v:.1f}")
    res["decode_tok_s_sampled"] = {"overlap": decode_tok_s(engine, 64, SAMPLED)}
    engine.core.overlap = False  # the same steps without the overlap schedule, for comparison
    res["decode_tok_s_no_overlap"] = {bs: decode_tok_s(engine, bs) for bs in (1, 64)}
    res["decode_tok_s_sampled"]["no_overlap"] = decode_tok_s(engine, 64, SAMPLED)
    engine.core.overlap = True
    log("decode bs1/bs64 tok/s, overlap off", [f"{v:.1f}" for v in res["decode_tok_s_no_overlap"].values()])
    log("decode bs64 sampled tok/s, overlap on/off", [f"{v:.1f}" for v in res["decode_tok_s_sampled"].values()])
    res["graph_step_ms"] = {bs: graph_step_ms(engine, bs) for bs in DECODE_BS}
    log("graph replay ms per bs", {bs: f"{v:.3f}" for bs, v in res["graph_step_ms"].items()})
    for n in PREFILL_LENS:
        res["prefill_tok_s"][n] = v = prefill_tok_s(engine, n)
        log(f"prefill {n} tok/s", f"{v:.0f}")
    structured_tok_s(engine, 2, True)  # the grammar compiler's first use
    res["structured_tok_s"] = {bs: {"free": structured_tok_s(engine, bs, False),
                                    "json_schema": structured_tok_s(engine, bs, True),
                                    "json_schema_no_jump": structured_tok_s(engine, bs, True, False)}
                               for bs in JSON_BS}
    log("free / json_schema / no jump-forward out tok/s per bs",
        {bs: f"{v['free']:.0f} / {v['json_schema']:.0f} / {v['json_schema_no_jump']:.0f}"
         for bs, v in res["structured_tok_s"].items()})
    res["shared_prefix_s"] = {"radix": shared_prefix_run(engine)}
    log("shared prefix, radix s", f"{res['shared_prefix_s']['radix']:.2f}")
    if args.profile:
        print(profile_top(engine), flush=True)
    if args.host_profile:
        for bs in (64,):
            print(f"host profile, decode bs{bs}:\n{host_profile_top(engine, bs)}", flush=True)
    engine.shutdown()
    del engine
    free_gpu()
    engine = engine_for(args.tokenizer, "none")
    res["shared_prefix_s"]["none"] = shared_prefix_run(engine)
    log("shared prefix, no cache s", f"{res['shared_prefix_s']['none']:.2f}")
    engine.shutdown()
    del engine
    free_gpu()

    model = hf_model()
    res["hf_decode_tok_s"], res["hf_prefill_tok_s"] = {}, {}
    for bs in HF_BS:
        res["hf_decode_tok_s"][bs] = v = hf_decode_tok_s(model, bs)
        log(f"HF decode bs{bs} tok/s", f"{v:.1f}")
    for n in PREFILL_LENS:
        res["hf_prefill_tok_s"][n] = v = hf_prefill_tok_s(model, n)
        log(f"HF prefill {n} tok/s", f"{v:.0f}")
    del model
    free_gpu()
    res["wall_s"] = time.perf_counter() - t_start
    print_table(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


def _arch() -> Any:
    from radixlm.runtime.model.arch import ModelArch

    return ModelArch.from_hf_config(CONFIG, source=MODEL)


def print_table(r: dict[str, Any]) -> None:
    roof = r["roofline_bs1_tok_s"]
    lines = [f"radixlm GPU benchmark: {r['model']} bf16 on {r['gpu']} ({r['date']})",
             f"HBM copy {r['hbm_copy_gbps']:.0f} GB/s; bs1 step reads {r['bytes_per_bs1_step'] / 1e9:.2f} GB "
             f"-> roofline {roof:.1f} tok/s; KV pool {r['kv_pool_tokens']} tokens; "
             f"bs1 graph step {r['graph_step_ms'][1]:.2f} ms on the GPU",
             f"{'metric':<34}{'radixlm':>12}{'HF':>12}{'ratio':>9}"]
    for bs, v in r["decode_tok_s"].items():
        hf = r["hf_decode_tok_s"].get(bs)
        graph_bound = bs / r["graph_step_ms"][bs] * 1e3  # tok/s if the GPU never waited for the host
        extra = f"  {v / graph_bound:.0%} of graph-bound {graph_bound:.0f}" + (f", {v / roof:.1%} of roofline" if bs == 1 else "")
        lines.append(f"{f'decode bs{bs} out tok/s (in {IN_LEN}, out {OUT_LEN})':<34}{v:>12.1f}"
                     + (f"{hf:>12.1f}{v / hf:>8.1f}x" if hf else f"{'':>12}{'':>9}") + extra)
    for bs, v in r["decode_tok_s_no_overlap"].items():
        lines.append(f"{f'decode bs{bs}, overlap schedule off':<34}{v:>12.1f}")
    sampled = ", ".join(f"{k}={v}" for k, v in SAMPLED.items())
    for mode, v in r.get("decode_tok_s_sampled", {}).items():
        lines.append(f"{f'decode bs64 sampled, {mode}':<34}{v:>12.1f}   ({sampled})")
    for n, v in r["prefill_tok_s"].items():
        hf = r["hf_prefill_tok_s"][n]
        lines.append(f"{f'prefill {n} tok/s':<34}{v:>12.0f}{hf:>12.0f}{v / hf:>8.2f}x")
    sp = r["shared_prefix_s"]
    lines.append(f"{f'{PREFIX_REQS} reqs, {PREFIX_LEN}-token shared prefix':<34}"
                 f"{sp['radix']:>10.2f} s (radix) {sp['none']:.2f} s (no cache): {sp['none'] / sp['radix']:.1f}x")
    for bs, v in r.get("structured_tok_s", {}).items():
        lines.append(f"{f'bs{bs} json_schema / free out tok/s':<34}{v['json_schema']:>12.0f}{v['free']:>12.0f}"
                     f"{v['json_schema'] / v['free']:>8.2f}x  (no jump-forward {v['json_schema_no_jump']:.0f}, "
                     f"{v['json_schema_no_jump'] / v['free']:.2f}x)")
    lines.append(f"(HF decodes {HF_OUT} tokens per request; whole run {r['wall_s']:.0f} s)")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
