"""A short request sent right behind a long prompt, and a decode running while a long prompt comes.

Starts `radixlm serve` (from the current directory's tree) and measures, over real HTTP:
- idle: a short request (a 16-token prompt, 128 new tokens by default) alone, latency and TTFT;
- behind: the same request sent 0.1 s after a long prompt, which is either a 5,000-token prompt
  (`/generate`, 16 new tokens) or a chat with 128 tools (`/v1/chat/completions`, tool_choice
  auto, 16 tokens); each repetition's long prompt is new (no cache hits), so each 128-tool chat
  also compiles its tools' grammar;
- decode: a streamed decode's tokens/s alone against while a long prompt prefills (from the long
  prompt's arrival to its first token), and that long prompt's time to first token.
Reports p50/p99 of the short request's latency over its idle p50, and the decode slowdown.
Writes benchmarks/results/short_behind_long.json.

    python benchmarks/short_behind_long.py [--reps 10] [--label after] [--out FILE] [-- server flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.runtime.server.server_harness import start_server  # noqa: E402

KINDS = ["string", "integer", "boolean", "number"]
BEHIND_S = 0.1  # the short request leaves this long after the long prompt


def lscpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    keep = ("Model name", "CPU(s)", "CPU family", "Model")
    lines = [" ".join(ln.split()) for ln in out.splitlines() if ln.split(":")[0].strip() in keep]
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    return "; ".join([*lines, "SIMD flags: " + " ".join(simd)])


def tools(n: int, salt: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": f"tool_{salt}_{i}", "description": f"Looks up record {i}",
        "parameters": {"type": "object", "properties": {"key": {"type": KINDS[i % 4]}}, "required": ["key"]}}}
        for i in range(n)]


def long_ids(n: int, rep: int) -> list[int]:
    return [(i * 7919 + rep * 104729) % 40000 + 500 for i in range(n)]


async def sse(resp: aiohttp.ClientResponse):  # type: ignore[no-untyped-def]
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)


async def stream_generate(session: aiohttp.ClientSession, url: str, ids: list[int], n: int,
                          stamps: list[float] | None = None) -> dict[str, float]:
    """A streamed /generate: its TTFT and latency; ``stamps`` gets each token's arrival time."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                                  "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft = None
    got = 0
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in sse(resp):
            assert "error" not in event, event
            now = time.perf_counter()
            new = len(event["output_ids"]) - got
            got += new
            if new and ttft is None:
                ttft = now - t0
            if stamps is not None:
                stamps.extend([now] * new)
    assert got == n, (got, n)
    return {"ttft": ttft or 0.0, "latency": time.perf_counter() - t0, "sent": t0}


async def chat_tools(session: aiohttp.ClientSession, url: str, salt: int, n_tools: int) -> dict[str, float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "What is record 7?"}],
            "tools": tools(n_tools, salt), "tool_choice": "auto", "max_tokens": 16, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in sse(resp):
            assert "error" not in event, event
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - t0
    return {"ttft": ttft or 0.0, "latency": time.perf_counter() - t0, "sent": t0}


async def long_request(session: aiohttp.ClientSession, url: str, kind: str, rep: int,
                       args: argparse.Namespace) -> dict[str, float]:
    if kind == "prompt":
        return await stream_generate(session, url, long_ids(args.long_tokens, rep), 16)
    return await chat_tools(session, url, rep, args.tools)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def run(url: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Fills ``out`` scenario by scenario (what was measured survives a run cut short)."""
    short = list(range(1000, 1000 + args.short_prompt))
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await stream_generate(session, url, short, args.short_new)  # (a fresh server's first request pays one-time costs)
        idle = [await stream_generate(session, url, [t + r for t in short], args.short_new) for r in range(args.reps)]
        idle_p50 = statistics.median(x["latency"] for x in idle)
        idle_ttft = statistics.median(x["ttft"] for x in idle)
        out["idle"] = {"latency_s": [x["latency"] for x in idle], "ttft_s": [x["ttft"] for x in idle],
                       "latency_p50_s": idle_p50, "ttft_p50_s": idle_ttft}
        rep = 0
        for kind in ("prompt", "tools"):
            shorts, longs = [], []
            for _ in range(args.reps):
                rep += 1
                long_task = asyncio.create_task(long_request(session, url, kind, rep, args))
                await asyncio.sleep(BEHIND_S)
                shorts.append(await stream_generate(session, url, [t + 50 + rep for t in short], args.short_new))
                longs.append(await long_task)
            lat = [x["latency"] for x in shorts]
            out[f"behind_{kind}"] = {
                "latency_s": lat, "ttft_s": [x["ttft"] for x in shorts], "long_ttft_s": [x["ttft"] for x in longs],
                "latency_p50_s": statistics.median(lat), "latency_p99_s": pct(lat, 99),
                "p50_over_idle": statistics.median(lat) / idle_p50, "p99_over_idle": pct(lat, 99) / idle_p50,
                "ttft_p50_over_idle": statistics.median(x["ttft"] for x in shorts) / idle_ttft,
                "long_ttft_p50_s": statistics.median(x["ttft"] for x in longs),
            }
            print(kind, json.dumps({k: v for k, v in out[f"behind_{kind}"].items() if not isinstance(v, list)}),
                  flush=True)
            # a decode streaming when the long prompt comes: its tokens/s alone, then while the prompt prefills
            alone_rates, during_rates, long_ttfts = [], [], []
            for _ in range(args.decode_reps):
                rep += 1
                stamps: list[float] = []
                dec = asyncio.create_task(stream_generate(session, url, [t + 90 + rep for t in short],
                                                          args.decode_new, stamps))
                while len(stamps) < 48:
                    await asyncio.sleep(0.01)
                alone_rates.append(32 / (stamps[47] - stamps[15]))
                long = await long_request(session, url, kind, rep, args)
                end = long["sent"] + long["ttft"]
                assert not dec.done(), "the decode ended before the long prompt's first token: raise --decode-new"
                during = [t for t in stamps if long["sent"] <= t <= end]
                during_rates.append(len(during) / (end - long["sent"]))
                long_ttfts.append(long["ttft"])
                dec.cancel()  # (the server aborts it when the stream closes)
                await asyncio.gather(dec, return_exceptions=True)
            out[f"decode_{kind}"] = {
                "alone_tok_s": alone_rates, "during_tok_s": during_rates, "long_ttft_s": long_ttfts,
                "slowdown_p50": statistics.median(a / max(d, 1e-9) for a, d in zip(alone_rates, during_rates)),
                "long_ttft_p50_s": statistics.median(long_ttfts),
            }
            print(kind, "decode", json.dumps({k: v for k, v in out[f"decode_{kind}"].items() if not isinstance(v, list)}),
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10, help="short requests behind each kind of long prompt")
    ap.add_argument("--decode-reps", type=int, default=3, help="long prompts arriving while a decode streams")
    ap.add_argument("--short-prompt", type=int, default=16)
    ap.add_argument("--short-new", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=5000)
    ap.add_argument("--tools", type=int, default=128)
    ap.add_argument("--decode-new", type=int, default=6000)
    ap.add_argument("--label", default="", help="a name for this run in the result file (e.g. before, after)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "short_behind_long.json"))
    ap.add_argument("server_args", nargs="*", help="flags for `radixlm serve`, after --")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server and save on the way out
    results: dict[str, Any] = {"load_average_start": os.getloadavg()}
    # a fixed KV pool: sized from free memory, it shrinks on a shared machine below what 5,000 tokens need
    server = start_server("--max-total-tokens", "16384", *args.server_args)
    try:
        asyncio.run(run(server.url, args, results))
    finally:
        server.stop()
        save(args, results)


def save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    row = {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", *sys.argv]),
           "tree": os.getcwd(), "hardware": lscpu_flags(), "python": platform.python_version(),
           "load_average": os.getloadavg(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
           **results}
    path = Path(args.out)
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": [*runs, row]}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
