"""Router benchmark: a multi-tenant workload over 2 replicas behind `radixlm route`, per policy.

    python benchmarks/router.py                        # defaults below; JSON to benchmarks/results/router.json
    python benchmarks/router.py --tenants 8 --users 12 --system-words 300 --kv-tokens 2400 --rounds 2

Workload: `--tenants` system prompts (random words, `--system-words` each) × `--users` users, one
question each, interleaved in a random (seeded) order, with at most
`--concurrency` in flight, greedy, `--output-len` tokens (`ignore_eos`), through `/generate` as text.

Peers, side by side in one run on the same processes:
- 2 replicas (`--kv-tokens` KV slots each, `OMP_NUM_THREADS=threads/2`) behind the router, once per
  policy (`--policies`); their caches are flushed before each run;
- 1 replica with the same total KV (2 × `--kv-tokens`), requests sent to it directly (its hit rate is
  the reference: one cache that sees all the traffic).

The KV pool is sized so one replica cannot hold every tenant's system prompt but one of two replicas
can hold half of them: the case a cache-aware router exists for. Hit rate = cached / prompt tokens
as the replicas report them per request (`meta_info`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

WORDS = ("apple river mountain quantum ledger harbor violet engine orbit lantern meadow cipher falcon granite "
         "velvet summit tundra beacon prism willow canyon ember glacier nectar quartz saffron timber vortex "
         "zephyr marble cobalt delta fjord garnet hollow island jasper kelp lagoon mosaic nomad oasis pepper "
         "quill raven sierra tango umber vessel walnut yonder zenith anchor bramble citadel dune estuary").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A `radixlm` subprocess on a free port, ready once /health answers 200 (`wait`)."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="radixlm-bench-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "radixlm.cli", *args, "--port", str(self.port)],
                                     stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})
        os.close(fd)

    def wait(self, deadline_s: float = 600.0, min_workers: int = 2) -> None:
        end = time.monotonic() + deadline_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}:\n{Path(self.log_path).read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200 and json.loads(resp.read()).get("healthy_workers", 2) >= min_workers:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"not healthy after {deadline_s:.0f} s")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log_path)


@dataclass(frozen=True)
class Request:
    tenant: int
    text: str


def build_workload(tenants: int, users: int, system_words: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    systems = [f"System {t}: you are assistant number {t}. Rules: " + " ".join(rng.choices(WORDS, k=system_words))
               for t in range(tenants)]
    out = []
    for u in range(users):
        for t in range(tenants):
            q = " ".join(rng.choices(WORDS, k=8))
            out.append(Request(t, f"{systems[t]}\nUser {u}: what do {q} have in common?\nAssistant:"))
    rng.shuffle(out)  # tenants interleaved at random (a fixed cycle would line up with round robin)
    return out


async def run(url: str, workload: list[Request], concurrency: int, output_len: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = []
    workers: dict[int, set[str]] = {}

    async def one(session: aiohttp.ClientSession, r: Request) -> None:
        async with sem:
            t0 = time.perf_counter()
            async with session.post(url + "/generate", json={
                    "text": r.text, "sampling_params": {"temperature": 0, "max_new_tokens": output_len,
                                                        "ignore_eos": True}}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{resp.status}: {body}")
                workers.setdefault(r.tenant, set()).add(resp.headers.get("X-Radixlm-Worker", url))
            meta = body["meta_info"]
            results.append({"prompt": meta["prompt_tokens"], "cached": meta["cached_tokens"],
                            "output": meta["completion_tokens"], "e2e": time.perf_counter() - t0})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, r) for r in workload))
        duration = time.perf_counter() - t0
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    return {"requests": len(results), "duration_s": round(duration, 2),
            "req_per_s": round(len(results) / duration, 3),
            "output_tok_per_s": round(sum(r["output"] for r in results) / duration, 2),
            "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": round(cached / prompt, 4),
            "mean_e2e_s": round(sum(r["e2e"] for r in results) / len(results), 3),
            "workers_per_tenant": round(sum(len(v) for v in workers.values()) / len(workers), 2)}


def flush(url: str) -> None:
    req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--system-words", type=int, default=300, help="words per system prompt (~1.3 tokens each)")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=2400, help="KV pool of each of the 2 replicas")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="CPU threads of the two replicas together (each gets half)")
    ap.add_argument("--single-threads", type=int, default=None,
                    help="CPU threads of the single replica (default: half of --threads, as each of the two: "
                         "on a loaded machine a 2-thread torch process stalls on its slowest thread)")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    ap.add_argument("--rounds", type=int, default=1, help="runs per configuration, alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overhead", action="store_true",
                    help="also send the workload to the single replica through a router of its own")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "router.json"))
    ap.add_argument("serve_args", nargs="*", help="after --: extra `radixlm serve` flags for every replica")
    a = ap.parse_args(argv)
    workload = build_workload(a.tenants, a.users, a.system_words, a.seed)
    half = str(max(1, a.threads // 2))
    kv = ["--max-total-tokens", str(a.kv_tokens)]
    replicas = [Proc(["serve", *kv, *a.serve_args], {"OMP_NUM_THREADS": half}) for _ in range(2)]
    single = Proc(["serve", "--max-total-tokens", str(2 * a.kv_tokens), *a.serve_args],
                  {"OMP_NUM_THREADS": str(a.single_threads or half)})
    routers: dict[str, Proc] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    try:
        for p in (*replicas, single):
            p.wait()
        for policy in a.policies:
            routers[policy] = Proc(["route", "--policy", policy, "--worker-urls", *(r.url for r in replicas)])
            routers[policy].wait()
        targets = {f"router:{p}": routers[p].url for p in a.policies} | {"single_replica": single.url}
        if a.overhead:  # the single replica again, through a router of its own: what the extra hop costs
            routers["overhead"] = Proc(["route", "--worker-urls", single.url])
            routers["overhead"].wait(min_workers=1)
            targets["single_replica_via_router"] = routers["overhead"].url
        for rnd in range(a.rounds):
            for name, url in targets.items():
                for p in (*replicas, single):
                    flush(p.url)
                got = asyncio.run(run(url, workload, a.concurrency, a.output_len))
                rows.setdefault(name, []).append(got)
                print(f"round {rnd} {name:24s} {json.dumps(got)}", flush=True)
    finally:
        for p in (*routers.values(), *replicas, single):
            p.stop()

    def mean(name: str, key: str) -> float:
        return sum(r[key] for r in rows[name]) / len(rows[name])

    summary = {name: {k: round(mean(name, k), 4) for k in ("hit_rate", "req_per_s", "output_tok_per_s", "mean_e2e_s")}
               for name in rows}
    if "router:cache_aware" in rows and "router:round_robin" in rows:
        summary["cache_aware_vs_round_robin_throughput"] = round(
            mean("router:cache_aware", "req_per_s") / mean("router:round_robin", "req_per_s"), 3)
        summary["cache_aware_minus_single_hit_rate_points"] = round(
            100 * (mean("router:cache_aware", "hit_rate") - mean("single_replica", "hit_rate")), 2)
    import aiohttp as _aiohttp
    import torch

    result = {"date": datetime.date.today().isoformat(), "command": " ".join(["python", "benchmarks/router.py",
                                                                                *(argv or sys.argv[1:])]),
              "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "aiohttp": _aiohttp.__version__},
              "settings": {k: v for k, v in vars(a).items() if k != "out"}, "summary": summary, "runs": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
