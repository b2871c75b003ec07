"""Multi-turn chat sessions on the default model: TTFT per turn and cache hit rate per turn.

(1) TTFT per turn over 8 turns of 4 chats taken round-robin (one request at a time), with an
    unrelated prompt after each round big enough to evict everything unpinned (a busy server):
    radixlm sessions (history pinned) vs radixlm re-sending the full history vs llama.cpp
    re-sending the full history (same GGUF; its prompt cache keeps only the previous prompt,
    so round-robin chats share only the system prompt with it; it gets no evicting prompt).
    Greedy, fixed output lengths (ignore_eos), so every system sees histories of equal length.
(2) Pressure: 16 sessions x 8 turns, each round followed by unrelated prompts sized to evict
    everything unpinned; hit rate (cached / history tokens) per turn, pinning on vs off
    (max_pinned_tokens 0). Each session has its own system prompt, so nothing but its own history
    can be cached for it. Not a timing: run it anywhere.

    python benchmarks/sessions.py [--skip-timing] [--skip-pressure] [--skip-llama-cpp] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass
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
EVICT_CHUNK = 2048  # evicting prompts are split so their prefill stays cheap


@dataclass(frozen=True)
class Sizes:
    chats: int = 4
    turns: int = 8
    out_tokens: int = 32
    system_repeats: int = 4  # the system prompt holds FACTS this many times (~300 tokens at 4)
    kv_tokens: int = 8192
    pressure_sessions: int = 16
    pressure_turns: int = 8
    pressure_kv_tokens: int = 8192
    pressure_max_pinned: int = 6144  # room for all 16 sessions' ~350-token histories


QUICK = Sizes(chats=2, turns=3, out_tokens=4, system_repeats=1, kv_tokens=2048, pressure_sessions=4,
              pressure_turns=3, pressure_kv_tokens=1536, pressure_max_pinned=768)


class Chat:
    """Token ids of one chat's turns (chatml): the first turn with the system prompt, every later
    one closing the assistant's reply (fixed length, so it has no <|im_end|> of its own)."""

    def __init__(self, tok, index: int, system_repeats: int, own_system: bool = False) -> None:
        self.tok, self.index = tok, index
        who = f"You are assistant {index}, a helpful assistant." if own_system else "You are a helpful assistant."
        self.system = f"{who} Background: " + " ".join(FACTS * system_repeats)

    def question(self, turn: int) -> str:
        return f"Question {turn} of chat {self.index}: tell me more about this: {FACTS[(self.index + turn) % 8]}"

    def turn_ids(self, turn: int) -> list[int]:
        if turn == 0:
            msgs = [{"role": "system", "content": self.system}, {"role": "user", "content": self.question(0)}]
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        else:
            text = f"<|im_end|>\n<|im_start|>user\n{self.question(turn)}<|im_end|>\n<|im_start|>assistant\n"
        return self.tok.encode(text, add_special_tokens=False)


def evict_unpinned(engine: Engine, rng: random.Random) -> None:
    """Unrelated prompts whose KV takes every slot not pinned: all unpinned history goes."""
    left = engine.core.allocator.num_slots - engine.core.cache.protected_size() - 16
    while left > 0:
        n = min(left, EVICT_CHUNK)
        engine.generate(input_ids=[rng.randrange(1000, 40000) for _ in range(n)], sampling_params={"max_new_tokens": 1})
        left -= n


# -- (1) TTFT per turn -----------------------------------------------------------------------------
def ttft_radixlm(engine: Engine, chats: list[Chat], sz: Sizes, sessions: bool) -> dict:
    params = {"temperature": 0, "max_new_tokens": sz.out_tokens, "ignore_eos": True}
    rng = random.Random(0)
    sids = [engine.open_session() for _ in chats] if sessions else []
    histories: list[list[int]] = [[] for _ in chats]
    ttft: list[list[float]] = [[] for _ in range(sz.turns)]
    hit: list[list[float]] = [[] for _ in range(sz.turns)]
    outputs: list[list[list[int]]] = [[] for _ in chats]
    for t in range(sz.turns):
        for c, chat in enumerate(chats):
            new = chat.turn_ids(t)
            if sessions:
                out = engine.generate(input_ids=new, sampling_params=params, session_params={"id": sids[c]})
            else:
                out = engine.generate(input_ids=histories[c] + new, sampling_params=params)
            meta = out["meta_info"]
            ttft[t].append(meta["ttft"])
            if histories[c]:
                hit[t].append(meta["cached_tokens"] / len(histories[c]))
            histories[c] += new + out["output_ids"]
            outputs[c].append(out["output_ids"])
        evict_unpinned(engine, rng)
    for sid in sids:
        engine.close_session(sid)
    return {"ttft_per_turn": [statistics.mean(x) for x in ttft],
            "hit_rate_per_turn": [statistics.mean(x) if x else None for x in hit],
            "history_tokens_last_turn": statistics.mean(len(h) for h in histories), "outputs": outputs}


def ttft_llama_cpp(chats: list[Chat], sz: Sizes) -> dict:
    from peers import LlamaCppPeer

    peer = LlamaCppPeer(builtin_gguf_path(DEFAULT_MODEL), n_ctx=4096)
    histories: list[list[int]] = [[] for _ in chats]
    ttft: list[list[float]] = [[] for _ in range(sz.turns)]
    for t in range(sz.turns):
        for c, chat in enumerate(chats):
            prompt = histories[c] + chat.turn_ids(t)
            res = peer.generate([prompt], sz.out_tokens)
            ttft[t].append(res.ttfts[0])
            histories[c] = prompt + res.outputs[0]
    return {"ttft_per_turn": [statistics.mean(x) for x in ttft]}


def run_ttft(sz: Sizes, skip_llama_cpp: bool) -> dict:
    engine = Engine(max_total_tokens=sz.kv_tokens)
    engine.generate("warm up", {"max_new_tokens": 2})
    chats = [Chat(engine.tokenizer, c, sz.system_repeats) for c in range(sz.chats)]
    results = {}
    for name, sessions in (("radixlm sessions", True), ("radixlm full-history resend", False)):
        engine.flush_cache()
        results[name] = ttft_radixlm(engine, chats, sz, sessions)
    engine.shutdown()
    same = results["radixlm sessions"].pop("outputs") == results["radixlm full-history resend"].pop("outputs")
    if not skip_llama_cpp:
        results["llama.cpp full-history resend"] = ttft_llama_cpp(chats, sz)
    print(f"\nTTFT per turn (ms), {sz.chats} chats round-robin, {sz.out_tokens} output tokens per turn")
    print(f"{'system':<32}" + "".join(f"{'t' + str(t + 1):>8}" for t in range(sz.turns)))
    for name, r in results.items():
        print(f"{name:<32}" + "".join(f"{1000 * x:>8.1f}" for x in r["ttft_per_turn"]))
    return {"sizes": sz.__dict__, "same_outputs_sessions_vs_resend": same, "systems": results}


# -- (2) pressure ------------------------------------------------------------------------------------
def pressure(sz: Sizes, max_pinned: int) -> dict:
    """Hit rate per turn of sessions whose rounds are separated by evicting traffic."""
    engine = Engine(max_total_tokens=sz.pressure_kv_tokens, max_pinned_tokens=max_pinned)
    rng = random.Random(1)
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    sids = [engine.open_session() for _ in range(sz.pressure_sessions)]
    chats = [Chat(engine.tokenizer, c, 0, own_system=True) for c in range(sz.pressure_sessions)]  # unrelated users
    rates: list[list[float]] = [[] for _ in range(sz.pressure_turns)]

    async def one_round(t: int) -> list[dict]:
        return await asyncio.gather(*(
            engine.async_generate(input_ids=chat.turn_ids(t), sampling_params=params, session_params={"id": sid})
            for chat, sid in zip(chats, sids)))

    for t in range(sz.pressure_turns):
        for out in asyncio.run(one_round(t)):
            meta = out["meta_info"]
            if meta["session_history_tokens"]:
                rates[t].append(meta["cached_tokens"] / meta["session_history_tokens"])
        evict_unpinned(engine, rng)
    stats = engine.core.sessions.stats_dict()
    engine.shutdown()
    per_turn = [{"turn": t + 1, "min": min(r), "mean": statistics.mean(r)} for t, r in enumerate(rates) if r]
    return {"max_pinned_tokens": max_pinned, "per_turn": per_turn, "session_stats": stats}


def run_pressure(sz: Sizes) -> dict:
    results = {"pinning on": pressure(sz, sz.pressure_max_pinned), "pinning off": pressure(sz, 0)}
    print(f"\nHit rate per turn (cached / history tokens), {sz.pressure_sessions} sessions x {sz.pressure_turns} "
          f"turns, evicting traffic between rounds, KV pool {sz.pressure_kv_tokens} tokens")
    print(f"{'':<14}" + "".join(f"{'t' + str(x['turn']):>8}" for x in results["pinning on"]["per_turn"]))
    for name, r in results.items():
        print(f"{name + ' min':<14}" + "".join(f"{x['min']:>8.1%}" for x in r["per_turn"]))
        print(f"{name + ' mean':<14}" + "".join(f"{x['mean']:>8.1%}" for x in r["per_turn"]))
    return {"sizes": {k: v for k, v in sz.__dict__.items() if k.startswith("pressure")}, **results}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-timing", action="store_true", help="only the pressure experiment")
    ap.add_argument("--skip-pressure", action="store_true", help="only the TTFT timing")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check that the script works")
    ap.add_argument("--out", default="benchmarks/results/sessions.json")
    args = ap.parse_args()
    sz = QUICK if args.quick else Sizes()
    out_path = Path(args.out)
    doc = json.loads(out_path.read_text()) if out_path.exists() else {}
    doc["meta"] = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                   "threads": torch.get_num_threads(), "quick": args.quick}
    if not args.skip_timing:
        doc["ttft"] = run_ttft(sz, args.skip_llama_cpp)
    if not args.skip_pressure:
        doc["pressure"] = run_pressure(sz)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
