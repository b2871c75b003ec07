"""DSL programs per second: run_batch on the Engine with the radix cache on vs off, and the same
programs driven as independent HF transformers `generate` calls (one call per gen, no sharing).

(a) few-shot QA: programs sharing a ~1,000-token few-shot prefix, one 8-token answer each;
(b) tree-of-thought: fork 2 x depth 3 (14 gens of 8 tokens, 8 selects) per program;
(c) multi-turn chat: 3 turns of 8-token replies per program.
Greedy, fixed output lengths (ignore_eos), so every runner does the same work.

    python benchmarks/dsl_programs.py [--quick] [--skip-hf] [--out benchmarks/results/dsl_programs.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch

import radixlm as rl
from radixlm.lang.backends.base import (
    Backend,
    Connection,
    GenOutput,
    GenRequest,
    StreamChunk,
    TokenLogprob,
)
from radixlm.runtime.chat_template import ChatTemplate, from_tokenizer
from radixlm.runtime.engine import Engine

FACTS = [
    "The Nile is the longest river in Africa.", "Mount Everest is the highest mountain on Earth.",
    "Water boils at 100 degrees Celsius at sea level.", "The Pacific is the largest ocean.",
    "Light travels at about 300,000 kilometres per second.", "Honey never spoils if kept sealed.",
]
TOKENS = 8
FIXED = {"max_tokens": TOKENS, "ignore_eos": True}


def few_shot_prefix(tokenizer: Any, target: int) -> str:
    lines, i = [], 0
    while len(tokenizer.encode("\n".join(lines))) < target:
        lines.append(f"Q: Tell me fact {i}. A: {FACTS[i % len(FACTS)]}")
        i += 1
    return "\n".join(lines) + "\n"


@rl.function
def few_shot_qa(s, prefix: str, i: int):
    s += prefix + f"Q: Tell me fact {100 + i}. A:" + rl.gen("answer", **FIXED)


def _expand(s, depth: int) -> None:
    if depth == 0:
        s += "\nCorrect? Answer:" + rl.select("verdict", [" yes", " no"])
        return
    branches = s.fork(2)
    for b in branches:
        b += "\nStep:" + rl.gen(f"step{depth}", **FIXED)
        _expand(b, depth - 1)
    branches.join()


@rl.function
def tree_of_thought(s, i: int):
    s += f"Problem {i}: a farmer has {i + 2} fields with 4 rows each. How many rows?"
    _expand(s, 3)


@rl.function
def chat(s, i: int):
    s += rl.system(f"You are assistant number {i}. " + " ".join(FACTS))
    for t in range(3):
        s += rl.user(f"Question {t}: tell me about {FACTS[(i + t) % len(FACTS)]}")
        s += rl.assistant(rl.gen(f"reply{t}", **FIXED))


class HFBackend(Backend):
    """HF transformers as a DSL backend: every gen is its own `generate` call (no KV sharing),
    select scores with one forward pass per prompt."""

    def __init__(self, model_dir: Path, tokenizer: Any) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
        self.tok = tokenizer
        self._template = from_tokenizer(tokenizer)

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Connection]:
        yield _HFConnection(self)


class _HFConnection(Connection):
    def __init__(self, be: HFBackend) -> None:
        self.be = be

    @torch.inference_mode()
    async def generate(self, req: GenRequest) -> list[GenOutput]:
        ids = torch.tensor([self.be.tok.encode(req.text)])
        n = req.sampling["max_new_tokens"]
        out = self.be.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False, pad_token_id=2)
        await asyncio.sleep(0)
        return [GenOutput(self.be.tok.decode(out[0, ids.shape[1]:]), {})]

    async def stream(self, req: GenRequest) -> AsyncIterator[StreamChunk]:
        raise NotImplementedError("the benchmark does not stream")
        yield  # pragma: no cover

    async def prefill(self, text: str) -> int:
        return len(self.be.tok.encode(text))

    @torch.inference_mode()
    async def input_logprobs(self, prompts: Sequence[Any], start: int) -> list[list[TokenLogprob]]:
        rows = []
        for p in prompts:
            ids = self.be.tok.encode(p) if isinstance(p, str) else list(p)
            logits = self.be.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            lps: list[float | None] = [None] + [logits[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
            rows.append(list(zip(lps, ids))[start:])
            await asyncio.sleep(0)
        return rows


def workloads(tok: Any, quick: bool) -> dict[str, tuple[Any, list[dict[str, Any]]]]:
    prefix = few_shot_prefix(tok, 1000)
    n_qa, n_tot, n_chat = (4, 1, 2) if quick else (32, 4, 8)
    return {
        "few-shot QA (1k shared prefix)": (few_shot_qa, [{"prefix": prefix, "i": i} for i in range(n_qa)]),
        "tree-of-thought (2x3 forks)": (tree_of_thought, [{"i": i} for i in range(n_tot)]),
        "multi-turn chat (3 turns)": (chat, [{"i": i} for i in range(n_chat)]),
    }


def measure(func: Any, batch: list[dict[str, Any]], backend: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    states = func.run_batch(batch, backend=backend, temperature=0)
    seconds = time.perf_counter() - t0
    errors = [repr(s.error()) for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"programs failed: {errors[:3]}")
    return {"programs": len(batch), "seconds": seconds, "programs_per_s": len(batch) / seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few programs per workload (checks the script)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/dsl_programs.json")
    args = ap.parse_args()

    runners: dict[str, Any] = {"radix": Engine(cache="radix"), "no cache": Engine(cache="none")}
    tok = runners["radix"].tokenizer
    if not args.skip_hf:
        runners["HF generate"] = HFBackend(runners["radix"].core.source.weights_dir, tok)
    results: dict[str, dict[str, Any]] = {}
    for name, (func, batch) in workloads(tok, args.quick).items():
        results[name] = {}
        for runner_name, backend in runners.items():
            if isinstance(backend, Engine):
                backend.flush_cache()
            results[name][runner_name] = r = measure(func, batch, backend)
            print(f"{name:34s} {runner_name:12s} {r['programs_per_s']:8.3f} programs/s ({r['seconds']:.1f} s)")
        base = results[name]["radix"]["programs_per_s"]
        for runner_name, r in results[name].items():
            r["radix_speedup"] = base / r["programs_per_s"]
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "cpu": platform.processor(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "quick": args.quick,
            "model": "SmolLM2-135M-Instruct bf16", "output_tokens_per_gen": TOKENS}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
