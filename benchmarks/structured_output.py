"""JSON extraction on the default model: free text vs constrained vs constrained + jump-forward.

60 chat prompts each ask for one person record as JSON. Every mode runs the same prompts
greedily, batched (all prompts in flight, as a server would see them) and the first 20 one at a time (bs1,
like the llama.cpp peer, which constrains with its own JSON-schema grammar). Reported per mode:
forward passes per output, output tokens/s, grammar microseconds per output token, and how
many outputs are valid JSON that matches the schema.

Constrained modes run once per grammar backend (``--backends``, default: every registered one).

    python benchmarks/structured_output.py [--skip-llama-cpp] [--prompts 60] [--bs1-prompts 20] [--backends all]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import jsonschema
import torch

from radixlm.runtime.constrained.registry import GRAMMAR_BACKENDS
from radixlm.runtime.engine import Engine
from radixlm.runtime.model.source import DEFAULT_MODEL, builtin_gguf_path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "maxLength": 60},
    },
    "required": ["name", "age", "city", "occupation", "email"],
}
NAMES = ["Alice Martin", "Bruno Keller", "Chen Wei", "Dana Scott", "Emeka Obi", "Farah Haddad", "Gustav Berg",
         "Hana Sato", "Ivan Petrov", "Julia Costa"]
CITIES = ["Lyon", "Berlin", "Osaka", "Lagos", "Toronto", "Lima"]
JOBS = ["nurse", "carpenter", "data analyst", "teacher", "pilot", "chef"]
MAX_NEW = 96


def prompts(n: int) -> list[list[dict[str, str]]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        name, city, job, age = rng.choice(NAMES), rng.choice(CITIES), rng.choice(JOBS), rng.randint(20, 70)
        email = name.lower().replace(" ", ".") + "@example.com"
        text = f"{name} is a {age}-year-old {job} from {city}. You can reach them at {email}."
        out.append([{"role": "user", "content": "Extract name, age, city, occupation and email as a JSON object "
                     f"with exactly those keys.\nText: {text}"}])
    return out


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def run_mode(engine: Engine, chats: list, params: dict, batched: bool) -> dict:
    core = engine.core
    core.grammar.reset_counters()
    engine.flush_cache()
    t0 = time.perf_counter()
    if batched:
        outs = engine.generate(chats, params)
    else:
        outs = [engine.generate(c, params) for c in chats]
    dt = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    passes = sum(o["meta_info"]["forward_passes"] for o in outs)
    return {
        "seconds": dt,
        "output_tokens": tokens,
        "out_tok_s": tokens / dt,
        "forward_passes_per_output": passes / len(outs),
        "tokens_per_output": tokens / len(outs),
        "grammar_us_per_token": core.grammar.seconds / max(tokens, 1) * 1e6,
        # where it goes (radixlm.runtime.constrained.stage.PHASES)
        "grammar_us_per_token_by_phase": {k: v / max(tokens, 1) * 1e6 for k, v in core.grammar.phase_seconds.items()},
        "valid": sum(_valid(o["text"]) for o in outs),
        "n": len(outs),
    }


def run_llama_cpp(chats: list, tok) -> dict:
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(model_path=str(builtin_gguf_path(DEFAULT_MODEL)), n_ctx=2048, n_threads=2, verbose=False)
    grammar = LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)
    texts, tokens = [], 0
    t0 = time.perf_counter()
    for chat in chats:
        ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
        out: list[int] = []
        for t in llm.generate(ids, temp=0.0, top_k=1, grammar=grammar):
            if t == llm.token_eos() or len(out) >= MAX_NEW:
                break
            out.append(t)
        tokens += len(out)
        texts.append(llm.detokenize(out).decode("utf-8", "replace"))
    dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": tokens, "out_tok_s": tokens / dt,
            "forward_passes_per_output": tokens / len(chats), "tokens_per_output": tokens / len(chats),
            "grammar_us_per_token": None, "valid": sum(_valid(t) for t in texts), "n": len(chats)}


def _cpu_flags() -> list[str]:
    """The lscpu flags that decide CPU speed here (avx512_bf16 above all)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in flags.split(":")[1].split() if f.startswith(("avx", "amx")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--bs1-prompts", type=int, default=20, help="prompts for the one-at-a-time runs")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--backends", default="all", help="comma-separated grammar backends, or all")
    ap.add_argument("--out", default="benchmarks/results/structured_output.json")
    args = ap.parse_args()
    backends = list(GRAMMAR_BACKENDS) if args.backends == "all" else args.backends.split(",")
    chats = prompts(args.prompts)
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW}
    constrained = {
        "constrained": {**greedy, "json_schema": SCHEMA, "jump_forward": False},
        "constrained + jump-forward": {**greedy, "json_schema": SCHEMA},
    }
    results: dict[str, dict] = {}
    tokenizer = None
    for n, backend in enumerate(backends):
        engine = Engine(max_total_tokens=40000, grammar_backend=backend)
        tokenizer = engine.tokenizer
        engine.generate(chats[0], constrained["constrained + jump-forward"])  # warm up: compile, first steps
        modes = {**({"free text": greedy} if n == 0 else {}), **constrained}
        for batched in (True, False):
            subset = chats if batched else chats[: args.bs1_prompts]
            for mode, params in modes.items():
                name = mode if mode == "free text" else f"{mode}, {backend}"
                results[f"radixlm {name} ({'batched' if batched else 'bs1'})"] = run_mode(engine, subset, params, batched)
        engine.shutdown()
    if not args.skip_llama_cpp:
        results["llama.cpp json-schema grammar (bs1)"] = run_llama_cpp(chats[: args.bs1_prompts], tokenizer)
    print(f"{'system':<58}{'passes/out':>11}{'tok/out':>9}{'out tok/s':>11}{'grammar us/tok':>16}{'valid':>9}")
    for name, r in results.items():
        g = f"{r['grammar_us_per_token']:.1f}" if r["grammar_us_per_token"] is not None else "-"
        print(f"{name:<58}{r['forward_passes_per_output']:>11.1f}{r['tokens_per_output']:>9.1f}"
              f"{r['out_tok_s']:>11.1f}{g:>16}{r['valid']:>5}/{r['n']}")
    print("grammar us/token by phase:")
    for name, r in results.items():
        if r.get("grammar_us_per_token_by_phase") and r["grammar_us_per_token"]:
            print(f"  {name:<58} " + "  ".join(f"{k} {v:.1f}" for k, v in r["grammar_us_per_token_by_phase"].items()))
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "threads": torch.get_num_threads(),
            "prompts": args.prompts, "max_new_tokens": MAX_NEW, "cpu_flags": _cpu_flags()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
