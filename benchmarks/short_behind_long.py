"""A short request sent right behind a long prompt, and a decode running while a long prompt comes.

Starts `radixlm serve` (this checkout; with `--compare DIR`, a second one from another checkout,
e.g. a git worktree of the code before a change, run side by side: each repetition goes to both
servers in turn, so the load of a shared machine falls on both alike) and measures over HTTP:
- idle: a short request (a 16-token prompt, 128 new tokens by default, streamed) alone;
- behind: the same request sent 0.1 s after a long prompt, either 5,000 prompt tokens
  (`/generate`, 16 new tokens) or a chat with 128 tools (`/v1/chat/completions`, tool_choice
  auto, 16 tokens); every long prompt is new (no cache hits), so each chat also compiles its
  tools' grammar;
- decode: a streamed decode's tokens/s alone, then while a long prompt prefills (from the long
  prompt's sending to its first token), and that prompt's time to first token.
Reports the p50/p99 of the short request's latency over its idle p50, the decode's slowdown and the
long prompts' time to first token. Writes benchmarks/results/short_behind_long.json.

    python benchmarks/short_behind_long.py [--reps 10] [--decode-reps 3] [--compare DIR]
        [--labels after,before] [--out FILE] [-- server flags]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_harness import Server, start_server  # noqa: E402

KINDS = ["string", "integer", "boolean", "number"]
BEHIND_S = 0.1  # the short request leaves this long after the long prompt
POOL = ("--max-total-tokens", "16384")  # a fixed KV pool (sized from free memory, it shrinks on a shared machine)


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


def long_ids(n: int, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 40000 + 500 for i in range(n)]


async def sse(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)


async def generate(session: aiohttp.ClientSession, url: str, ids: list[int], n: int,
                   stamps: list[float] | None = None) -> dict[str, float]:
    """A streamed /generate: when it was sent, its TTFT and latency; ``stamps`` gets each token's
    arrival time."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft, got = None, 0
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
    return {"sent": t0, "ttft": ttft or 0.0, "latency": time.perf_counter() - t0}


async def chat_tools(session: aiohttp.ClientSession, url: str, salt: int, n_tools: int) -> dict[str, float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "What is record 7?"}],
            "tools": tools(n_tools, salt), "tool_choice": "auto", "max_tokens": 16, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in sse(resp):
            assert "error" not in event, event
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - t0
    return {"sent": t0, "ttft": ttft or 0.0, "latency": time.perf_counter() - t0}


class Bench:
    def __init__(self, session: aiohttp.ClientSession, args: argparse.Namespace) -> None:
        self.session, self.args = session, args
        self.short = list(range(1000, 1000 + args.short_prompt))
        self.salt = 0

    def _salt(self) -> int:
        self.salt += 1
        return self.salt

    async def long(self, url: str, kind: str) -> dict[str, float]:
        if kind == "prompt":
            return await generate(self.session, url, long_ids(self.args.long_tokens, self._salt()), 16)
        return await chat_tools(self.session, url, self._salt(), self.args.tools)

    async def short_request(self, url: str) -> dict[str, float]:
        salt = self._salt()
        return await generate(self.session, url, [t + salt for t in self.short], self.args.short_new)

    async def behind(self, url: str, kind: str) -> tuple[dict[str, float], dict[str, float]]:
        """(the short request, the long one it was sent behind)."""
        long_task = asyncio.create_task(self.long(url, kind))
        await asyncio.sleep(BEHIND_S)
        short = await self.short_request(url)
        return short, await long_task

    async def decode_during(self, url: str, kind: str) -> dict[str, float]:
        """A decode's tokens/s alone, then while a long prompt prefills; the long prompt's TTFT."""
        stamps: list[float] = []
        salt = self._salt()
        dec = asyncio.create_task(generate(self.session, url, [t + salt for t in self.short], self.args.decode_new, stamps))
        while len(stamps) < 48:
            await asyncio.sleep(0.01)
        alone = 32 / (stamps[47] - stamps[15])
        long = await self.long(url, kind)
        end = long["sent"] + long["ttft"]
        assert not dec.done(), "the decode ended before the long prompt's first token: raise --decode-new"
        during = sum(1 for t in stamps if long["sent"] <= t <= end) / (end - long["sent"])
        dec.cancel()  # (the server aborts it when the stream closes)
        await asyncio.gather(dec, return_exceptions=True)
        return {"alone_tok_s": alone, "during_tok_s": during, "long_ttft_s": long["ttft"]}


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def summary(raw: dict[str, list[Any]]) -> dict[str, Any]:
    idle = [x["latency"] for x in raw["idle"]]
    idle_p50 = statistics.median(idle)
    out: dict[str, Any] = {"idle_latency_p50_s": idle_p50, "idle_ttft_p50_s": statistics.median(x["ttft"] for x in raw["idle"])}
    for kind in ("prompt", "tools"):
        pairs = raw[f"behind_{kind}"]
        if pairs:
            lat = [s["latency"] for s, _ in pairs]
            out[f"behind_{kind}"] = {
                "latency_p50_s": statistics.median(lat), "latency_p99_s": pct(lat, 99),
                "p50_over_idle": statistics.median(lat) / idle_p50, "p99_over_idle": pct(lat, 99) / idle_p50,
                "ttft_p50_s": statistics.median(s["ttft"] for s, _ in pairs),
                "long_ttft_p50_s": statistics.median(long["ttft"] for _, long in pairs)}
        dec = raw[f"decode_{kind}"]
        if dec:
            out[f"decode_{kind}"] = {
                "slowdown_p50": statistics.median(d["alone_tok_s"] / max(d["during_tok_s"], 1e-9) for d in dec),
                "alone_tok_s_p50": statistics.median(d["alone_tok_s"] for d in dec),
                "during_tok_s_p50": statistics.median(d["during_tok_s"] for d in dec),
                "long_ttft_p50_s": statistics.median(d["long_ttft_s"] for d in dec)}
    return out


async def run(servers: dict[str, Server], args: argparse.Namespace, raw: dict[str, dict[str, list[Any]]]) -> None:
    """Fills ``raw`` repetition by repetition (what was measured survives a run cut short)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        bench = Bench(session, args)
        for s in servers.values():
            await bench.short_request(s.url)  # (a fresh server's first request pays one-time costs)
        names = list(servers)
        for rep in range(args.reps):
            for name in names[rep % 2:] + names[: rep % 2]:  # alternate which server goes first
                url, r = servers[name].url, raw[name]
                r["idle"].append(await bench.short_request(url))
                for kind in ("prompt", "tools"):
                    r[f"behind_{kind}"].append(await bench.behind(url, kind))
                    if rep < args.decode_reps:
                        r[f"decode_{kind}"].append(await bench.decode_during(url, kind))
            print(f"rep {rep + 1}:", json.dumps({n: summary(raw[n]) for n in names}), flush=True)


@contextlib.contextmanager
def serving(args: argparse.Namespace) -> Iterator[dict[str, Server]]:
    labels = args.labels.split(",")
    servers: dict[str, Server] = {}
    try:
        servers[labels[0]] = start_server(*POOL, *args.server_args)
        if args.compare:
            here = os.getcwd()
            os.chdir(args.compare)  # (`python -m radixlm.cli` imports the package from its working directory)
            try:
                servers[labels[1]] = start_server(*POOL, *args.server_args)
            finally:
                os.chdir(here)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10, help="short requests behind each kind of long prompt, per server")
    ap.add_argument("--decode-reps", type=int, default=3, help="long prompts of each kind arriving while a decode streams")
    ap.add_argument("--short-prompt", type=int, default=16)
    ap.add_argument("--short-new", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=5000)
    ap.add_argument("--tools", type=int, default=128)
    ap.add_argument("--decode-new", type=int, default=6000, help="the streamed decode's length (it is cut when measured)")
    ap.add_argument("--compare", default=None, help="another checkout to serve side by side (e.g. a worktree of the code before a change)")
    ap.add_argument("--labels", default="this,compare", help="names of this checkout's server and --compare's")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "short_behind_long.json"))
    ap.add_argument("server_args", nargs="*", help="flags for `radixlm serve`, after --")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the servers and save on the way out
    load_start = os.getloadavg()
    raw: dict[str, dict[str, list[Any]]] = {}
    with serving(args) as servers:
        for name in servers:
            raw[name] = {k: [] for k in ("idle", "behind_prompt", "behind_tools", "decode_prompt", "decode_tools")}
        try:
            asyncio.run(run(servers, args, raw))
        finally:
            out = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(["python", *sys.argv]),
                   "hardware": lscpu_flags(), "python": platform.python_version(),
                   "load_average": {"start": load_start, "end": os.getloadavg()},
                   "settings": {k: v for k, v in vars(args).items() if k != "out"},
                   "checkouts": {name: str(Path(args.compare if i else ".").resolve()) for i, name in enumerate(servers)},
                   "summary": {name: summary(r) for name, r in raw.items() if r["idle"]}, "raw": raw}
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
            print(json.dumps(out["summary"], indent=1))
            print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
