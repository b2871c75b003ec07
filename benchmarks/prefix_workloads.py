"""Prefix-sharing workloads on the default model, radix cache on vs off, next to HF transformers
`generate` (bf16, batched) and llama.cpp (same GGUF, sequential; it keeps only the KV of the
previous prompt's common prefix).

(a) 64 requests sharing a ~1,000-token few-shot prefix; (b) 8 chat histories x 4 turns;
(c) one ~600-token prefix x 8 continuations. Greedy, fixed output lengths (ignore_eos).

    python benchmarks/prefix_workloads.py [--skip-hf] [--skip-llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from radixlm.runtime.engine import Engine
from radixlm.runtime.model.source import DEFAULT_MODEL, builtin_gguf_path

FACTS = [
    "The Nile is the longest river in Africa.", "Mount Everest is the highest mountain on Earth.",
    "Water boils at 100 degrees Celsius at sea level.", "The Pacific is the largest ocean.",
    "Light travels at about 300,000 kilometres per second.", "Honey never spoils if kept sealed.",
    "The heart pumps blood through the body.", "Paris is the capital of France.",
]


def few_shot_prefix(tokenizer, target: int) -> str:
    lines, i = [], 0
    while len(tokenizer.encode("\n".join(lines))) < target:
        lines.append(f"Q: Tell me fact {i}. A: {FACTS[i % len(FACTS)]}")
        i += 1
    return "\n".join(lines) + "\n"


def workload_a(tok) -> list[list[int]]:
    prefix = few_shot_prefix(tok, 1000)
    return [tok.encode(prefix + f"Q: Tell me fact {100 + i}. A:") for i in range(64)]


def workload_c(tok) -> list[list[int]]:
    prefix = few_shot_prefix(tok, 600)
    return [tok.encode(prefix + f"Q: Summarise fact {i} in other words. A:") for i in range(8)]


def chat_turns(tok, replies: list[list[str]], turn: int) -> list[list[int]]:
    """Prompts for `turn` of 8 chats given earlier replies (so each peer continues its own)."""
    out = []
    for c in range(8):
        msgs = [{"role": "system", "content": f"You are assistant number {c}. " + " ".join(FACTS)}]
        for t in range(turn + 1):
            msgs.append({"role": "user", "content": f"Question {t} of chat {c}: tell me about {FACTS[(c + t) % 8]}"})
            if t < turn:
                msgs.append({"role": "assistant", "content": replies[c][t]})
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def run_ours(engine: Engine, prompts: list[list[int]], new: int) -> dict:
    p = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    t0 = time.perf_counter()
    res = engine.generate(input_ids=prompts, sampling_params=p)
    dt = time.perf_counter() - t0
    return _summary(dt, len(prompts) * new, [r["meta_info"]["ttft"] for r in res],
                    sum(r["meta_info"]["cached_tokens"] for r in res), sum(map(len, prompts)),
                    [r["text"] for r in res])


def _summary(dt, n_out, ttfts, cached, prompt_tokens, texts=None) -> dict:
    return {"seconds": dt, "out_tok_s": n_out / dt, "mean_ttft": statistics.mean(ttfts) if ttfts else None,
            "hit_rate": cached / prompt_tokens if cached is not None else None, "texts": texts}


def ours_chat(engine: Engine, tok, new: int) -> dict:
    replies: list[list[str]] = [[] for _ in range(8)]
    total, ttfts, cached, prompt_tokens = 0.0, [], 0, 0
    for turn in range(4):
        r = run_ours(engine, chat_turns(tok, replies, turn), new)
        total += r["seconds"]
        ttfts.append(r["mean_ttft"])
        prompt_tokens += sum(map(len, chat_turns(tok, replies, turn)))
        cached += r["hit_rate"] * sum(map(len, chat_turns(tok, replies, turn)))
        for c in range(8):
            replies[c].append(r["texts"][c])
    return _summary(total, 32 * new, ttfts, cached, prompt_tokens)


def peer_chat(peer, tok, new: int) -> dict:
    replies: list[list[str]] = [[] for _ in range(8)]
    total, ttfts = 0.0, []
    for turn in range(4):
        prompts = chat_turns(tok, replies, turn)
        res = peer.generate(prompts, new)
        total += res.seconds
        ttfts += res.ttfts
        for c in range(8):
            replies[c].append(tok.decode(res.outputs[c], skip_special_tokens=True))
    return _summary(total, 32 * new, ttfts, None, 1)


def main() -> None:
    from peers import HFPeer, LlamaCppPeer

    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/prefix_workloads.json")
    args = ap.parse_args()
    results: dict[str, dict[str, dict]] = {}
    engines = {"radix": Engine(max_total_tokens=40000), "no-cache": Engine(max_total_tokens=40000, cache="none")}
    tok = engines["radix"].tokenizer
    work = {"a": (workload_a(tok), 16), "c": (workload_c(tok), 32)}
    for name, engine in engines.items():
        engine.generate("warm up", {"max_new_tokens": 2})
        for w, (prompts, new) in work.items():
            engine.flush_cache()
            results.setdefault(w, {})[f"radixlm {name}"] = run_ours(engine, prompts, new)
        engine.flush_cache()
        results.setdefault("b", {})[f"radixlm {name}"] = ours_chat(engine, tok, 24)
        engine.shutdown()
    peers = {}
    if not args.skip_hf:
        peers["HF generate"] = HFPeer(engines["radix"].core.source.weights_dir)
    if not args.skip_llama_cpp:
        peers["llama.cpp"] = LlamaCppPeer(builtin_gguf_path(DEFAULT_MODEL))
    for pname, peer in peers.items():
        for w, (prompts, new) in work.items():
            res = peer.generate(prompts, new)
            results[w][pname] = _summary(res.seconds, len(prompts) * new, res.ttfts, None, 1)
        results["b"][pname] = peer_chat(peer, tok, 24)
    print(f"{'workload':<10}{'system':<20}{'seconds':>9}{'out tok/s':>11}{'mean TTFT':>11}{'hit rate':>10}"
          f"{'speed-up vs':>14}")
    for w in ("a", "b", "c"):
        base = results[w]["radixlm radix"]["seconds"]
        for system, r in results[w].items():
            r.pop("texts", None)
            ttft = f"{r['mean_ttft']:.3f}" if r["mean_ttft"] is not None else "-"
            hit = f"{r['hit_rate']:.1%}" if r["hit_rate"] is not None else "-"
            print(f"{w:<10}{system:<20}{r['seconds']:>9.2f}{r['out_tok_s']:>11.1f}{ttft:>11}{hit:>10}"
                  f"{r['seconds'] / base:>13.2f}x")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "threads": torch.get_num_threads()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
