"""Client-driven programs vs POST /run_program, over HTTP to the same `radixlm serve`.

Client-driven: RuntimeEndpoint(programs="client"), one /generate round trip per gen, select and
fork prefill. /run_program: RuntimeEndpoint(programs="server"), the whole graph in one request.
Workloads (greedy, fixed output lengths with ignore_eos so both sides do the same work):
(a) a 10-gen chain; (b) tree-of-thought, forks 3 wide x 3 deep (39 gens, 27 selects);
(c) JSON extraction with 4 fields as separate gens. Each at 1 program and at 32 concurrent
programs (run_batch), reporting wall time per program (1) and per batch (32).

    python benchmarks/run_program.py [--quick] [--url URL] [--out benchmarks/results/run_program.json]

Without --url it starts `radixlm serve` on 127.0.0.1 (float32, default model) and stops it after.

    python benchmarks/run_program.py --scheduling [--programs 64] [--rounds 2] [--arrival-rate R]
        [--seed S] [--out benchmarks/results/program_scheduling.json]

Program-aware scheduling on vs off: two fresh servers side by side (`--program-scheduling on`
and `off`), for --rounds; the three workloads mixed (program i is workload i % 3), sent as
/run_program requests. With --arrival-rate 0 (the default) all --programs are sent at once;
with R > 0 they arrive over time, Poisson at R programs per second (exponential gaps drawn from
random.Random(--seed)), into a server that is busy with the earlier ones (give it a
--max-running-requests cap below the demand in --server-args to queue them). Both servers get
the same graphs on the same schedule, at the same moments. p50/p90/p99/max/mean of each
program's latency (from its own send to its response) and the wall time from the first send to
the last response.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

import radixlm as rl
from radixlm.lang.backends.runtime_endpoint import RuntimeEndpoint

TOKENS = 6
FIXED = {"max_tokens": TOKENS, "ignore_eos": True}


def document(i: int, words: int) -> str:
    """Program i's own opening document of ``words`` words (none when 0): a long prefix that its
    gens, and a fork's branches, share, and that other programs do not."""
    if words <= 0:
        return ""
    rng = random.Random(i)
    vocab = ("field", "river", "stone", "market", "winter", "garden", "letter", "bridge", "lamp", "harbor",
             "orchard", "signal", "ledger", "meadow", "engine", "canvas")
    return f"Document {i}: " + " ".join(rng.choice(vocab) for _ in range(words)) + ".\n"


@rl.function
def chain(s, i: int, doc: int = 0):
    s += document(i, doc)
    s += f"Story {i}. Write one short sentence per line.\n"
    for k in range(10):
        s += f"Line {k + 1}:" + rl.gen(f"line{k}", **FIXED) + "\n"


def _expand(s, depth: int, width: int) -> None:
    if depth == 0:
        s += "\nCorrect? Answer:" + rl.select("verdict", [" yes", " no"])
        return
    branches = s.fork(width)
    for b in branches:
        b += "\nStep:" + rl.gen(f"step{depth}", **FIXED)
        _expand(b, depth - 1, width)
    branches.join()


@rl.function
def tree_of_thought(s, i: int, doc: int = 0):
    s += document(i, doc)
    s += f"Problem {i}: a farmer has {i + 2} fields with 4 rows each. How many rows?"
    _expand(s, 3, 3)


@rl.function
def json_fields(s, i: int, doc: int = 0):
    s += document(i, doc)
    s += rl.user(f"Contact {i}: Ana Lima, 3{i} years old, lives in Porto, email ana{i}@example.com. "
                 "Give the fields as JSON.")
    with s.assistant():
        s += '{"name": "' + rl.gen("name", regex=r"[A-Za-z ]{1,20}", max_tokens=8) + '", '
        s += '"age": ' + rl.gen("age", regex=r"[0-9]{1,3}", max_tokens=4) + ", "
        s += '"city": "' + rl.gen("city", regex=r"[A-Za-z ]{1,20}", max_tokens=8) + '", '
        s += '"email": "' + rl.gen("email", regex=r"[a-z0-9.]{1,16}@[a-z]{1,12}\.com", max_tokens=16) + '"}'


WORKLOADS = {"10-gen chain": chain, "tree-of-thought 3x3": tree_of_thought, "JSON 4 fields": json_fields}


def start_server(args: list[str], gpu: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A radixlm server on a free port (on GPU ``gpu`` alone, where given)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not start")


def flush(url: str) -> None:
    urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", data=b"{}", method="POST"), timeout=30)


STEP_STATS = ("steps", "prompt_steps", "graph_steps", "rows_fed", "tokens_fed",
              "program_returns", "program_returns_late", "program_return_steps")


def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a server process (not its engine process, a child of its own): its main
    thread (the event loop) and all its threads; nothing where /proc is not there."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def seconds(stat: str) -> float:
        fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime + stime

    try:
        return {"server cpu s": seconds(f"/proc/{pid}/stat"), "server loop cpu s": seconds(f"/proc/{pid}/task/{pid}/stat")}
    except OSError:
        return {}


def step_stats(url: str) -> dict[str, float]:
    """The engine's step counters (/get_server_info): steps, steps that fed a prompt, rows fed;
    and the step loop's seconds by phase, as "s <phase>"."""
    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as r:
        stats = json.load(r)["stats"]
    return {**{k: int(stats[k]) for k in STEP_STATS},
            **{f"s {k}": float(v) for k, v in stats.get("step_phase_seconds", {}).items()}}


def measure(func: Any, n: int, backend: Any, repeats: int) -> float:
    """Best wall time (s) of ``repeats`` runs of ``n`` concurrent programs (the cache flushed before each)."""
    best = float("inf")
    for _ in range(repeats):
        flush(backend.base_url)
        t0 = time.perf_counter()
        if n == 1:
            state = func.run(0, backend=backend, temperature=0)
            errors = [state.error()] if state.error() is not None else []
        else:
            states = func.run_batch([{"i": i} for i in range(n)], backend=backend, temperature=0, concurrency=n)
            errors = [s.error() for s in states if s.error() is not None]
        best = min(best, time.perf_counter() - t0)
        if errors:
            raise RuntimeError(f"programs failed: {errors[:2]!r}")
    return best


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between the sorted values."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s after the start) of n programs: Poisson arrivals at ``rate`` per second, the
    first at 0; all at 0 when rate is 0."""
    rng = random.Random(seed)
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + (rng.expovariate(rate) if rate > 0 else 0.0))
    return times


async def _send(http: aiohttp.ClientSession, url: str, graph: str) -> float:
    """One program to /run_program (greedy); its latency (s)."""
    t0 = time.perf_counter()
    body = {"graph": json.loads(graph), "sampling_defaults": {"temperature": 0}}
    async with http.post(url + "/run_program", json=body) as resp:
        out = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"program failed: {out}")
    return time.perf_counter() - t0


async def program_latencies(url: str, graphs: list[str], start: float, sends: list[float]) -> tuple[list[float], float]:
    """Send each graph at ``start + sends[i]`` (perf_counter seconds); each program's latency from
    its own send, and the wall time from ``start`` to the last response."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        async def one(graph: str, send: float) -> float:
            await asyncio.sleep(max(start + send - time.perf_counter(), 0.0))
            return await _send(http, url, graph)

        lat = await asyncio.gather(*(one(g, t) for g, t in zip(graphs, sends)))
        return list(lat), time.perf_counter() - start


async def closed_loop(url: str, graphs: list[str], start: float, concurrency: int) -> tuple[list[float], float]:
    """``concurrency`` clients, each sending its next program (the graphs in order) as soon as its
    last one answered, so that many programs are in flight until the graphs run out; each
    program's latency (in the graphs' order), and the wall time from ``start`` to the last response."""
    queue = list(reversed(range(len(graphs))))
    lat = [0.0] * len(graphs)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        async def client() -> None:
            while queue:
                i = queue.pop()
                lat[i] = await _send(http, url, graphs[i])

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return lat, time.perf_counter() - start


async def side_by_side(urls: list[str], graphs: list[str], sends: list[float],
                       concurrency: int = 0) -> list[tuple[list[float], float]]:
    """The same graphs sent to each server on the same schedule (or the same closed loop of
    ``concurrency`` clients), from the same moment."""
    start = time.perf_counter()
    if concurrency > 0:
        return list(await asyncio.gather(*(closed_loop(url, graphs, start, concurrency) for url in urls)))
    return list(await asyncio.gather(*(program_latencies(url, graphs, start, sends) for url in urls)))


def scheduling(args: argparse.Namespace) -> dict[str, Any]:
    """p50/p99 program latency of --programs programs, program scheduling on vs off: two servers
    side by side, sent the same graphs on the same schedule (so load from elsewhere hits both alike)."""
    funcs = list(WORKLOADS.values())
    graphs = [funcs[i % 3].trace(i, args.doc_words).to_json() for i in range(args.programs)]
    sends = arrival_times(args.programs, args.arrival_rate, args.seed)
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    latencies: dict[str, list[list[float]]] = {"on": [], "off": []}  # per round, in the graphs' order
    for round_ in range(args.rounds):
        gpus: list[str | None] = [*args.server_gpus.split(",")] if args.server_gpus else [None, None]
        if round_ % 2:
            gpus.reverse()  # the two modes swap GPUs every round, so a faster GPU favours neither
        servers = {mode: start_server(["--dtype", args.dtype, "--program-scheduling", mode, *args.server_args.split()],
                                      gpu) for mode, gpu in zip(("on", "off"), gpus)}
        try:
            urls = [url for _, url in servers.values()]
            asyncio.run(side_by_side(urls, graphs[:3], [0.0] * 3))  # warm-up: one program of each kind
            for url in urls:
                flush(url)
            pids = [proc.pid for proc, _ in servers.values()]
            before = [{**step_stats(url), **server_cpu(pid)} for url, pid in zip(urls, pids)]
            results = asyncio.run(side_by_side(urls, graphs, sends, args.concurrency))
            counts = [{k: after[k] - was[k] for k in after if k in was}
                      for was, after in zip(before, ({**step_stats(url), **server_cpu(pid)}
                                                     for url, pid in zip(urls, pids)))]
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(60)
        for mode, (lat, wall), steps in zip(servers, results, counts):
            row = {"p50": percentile(lat, 0.5), "p90": percentile(lat, 0.9), "p99": percentile(lat, 0.99),
                   "max": max(lat), "mean": statistics.mean(lat), "wall": wall, **steps}
            for k, name in enumerate(WORKLOADS):  # program i is workload i % 3
                row[f"p99 {name}"] = percentile(lat[k::3], 0.99)
            steady = ""
            if 0 < args.concurrency and 3 * args.concurrency <= args.programs:
                # the programs sent after the first C (sent together at the start) and before the
                # last C (which run while fewer than C programs are left in flight)
                middle = lat[args.concurrency : args.programs - args.concurrency]
                row["steady p50"], row["steady p99"] = percentile(middle, 0.5), percentile(middle, 0.99)
                steady = f"  steady state p50 {row['steady p50']:.2f} s  p99 {row['steady p99']:.2f} s"
            runs[mode].append(row)
            latencies[mode].append(lat)
            print(f"program scheduling {mode:3s}: {args.programs} programs  p50 {row['p50']:7.2f} s  "
                  f"p90 {row['p90']:7.2f} s  p99 {row['p99']:7.2f} s  max {row['max']:7.2f} s  "
                  f"mean {row['mean']:7.2f} s  wall {wall:7.2f} s  p99 by workload "
                  + ", ".join(f"{row[f'p99 {name}']:.2f}" for name in WORKLOADS) + steady
                  + f"  steps {steps['steps']} ({steps['prompt_steps']} with a prompt, {steps['graph_steps']} as a CUDA graph, "
                  f"{steps['rows_fed'] / max(steps['steps'], 1):.1f} rows, "
                  f"{steps['tokens_fed'] / max(steps['steps'], 1):.1f} tokens a step)  program round trips "
                  f"{steps['program_returns']} ({steps['program_returns_late']} past the gap, "
                  f"{steps['program_return_steps'] / max(steps['program_returns'], 1):.1f} steps each)"
                  + (f"  server cpu {steps['server cpu s'] / args.programs * 1e3:.1f} ms a program "
                     f"({steps['server loop cpu s'] / args.programs * 1e3:.1f} on its event loop)"
                     if "server cpu s" in steps else ""), flush=True)
            phases = {k[2:]: v for k, v in steps.items() if k.startswith("s ")}
            if phases:
                print(f"  ms a step ({mode}): " + "  ".join(f"{k} {v / max(steps['steps'], 1) * 1e3:.2f}"
                                                        for k, v in phases.items()), flush=True)
    best = {mode: {k: min(r[k] for r in rows) for k in rows[0]} for mode, rows in runs.items()}
    ratio = {k: best["off"][k] / best["on"][k] for k in best["on"] if best["on"][k]}
    print("off / on (best of rounds): " + "  ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    return {"arrival_rate": args.arrival_rate, "concurrency": args.concurrency, "seed": args.seed,
            "doc_words": args.doc_words, "last_send": sends[-1], "runs": runs, "best": best, "off_over_on": ratio,
            "latencies": latencies}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a running radixlm server (default: start one)")
    ap.add_argument("--quick", action="store_true", help="8 concurrent programs instead of 32, one repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="the started server's dtype (auto: what `radixlm serve` picks)")
    ap.add_argument("--only", help="run only the workloads whose name contains this text")
    ap.add_argument("--sizes", help="comma-separated numbers of concurrent programs (default 1,32; quick 1,8)")
    ap.add_argument("--out", default=None, help="default benchmarks/results/run_program.json "
                                                "(--scheduling: program_scheduling.json)")
    ap.add_argument("--server-args", default="", help="more flags for the started servers, e.g. "
                                                       "'--model dummy:smollm2-135m --device cuda'")
    ap.add_argument("--scheduling", action="store_true", help="program-aware scheduling on vs off")
    ap.add_argument("--programs", type=int, default=64, help="--scheduling: programs (all sent at once unless --arrival-rate or --concurrency)")
    ap.add_argument("--rounds", type=int, default=2, help="--scheduling: on/off pairs (fresh servers)")
    ap.add_argument("--arrival-rate", type=float, default=0.0,
                    help="--scheduling: programs per second, Poisson arrivals (0: all sent at once)")
    ap.add_argument("--seed", type=int, default=0, help="--scheduling: the arrival times' random seed")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="--scheduling: a closed loop of this many clients, each sending its next program when "
                         "the last one answered (0: the --arrival-rate schedule)")
    ap.add_argument("--doc-words", type=int, default=0,
                    help="--scheduling: each program opens with a document of its own of this many words (KV "
                         "pressure with a small --max-total-tokens in --server-args)")
    ap.add_argument("--server-gpus", default="",
                    help="--scheduling: two GPUs, one server on each, e.g. '0,1'; the modes swap GPUs every "
                         "round (default: both servers share what they see and take turns on it)")
    args = ap.parse_args()
    if args.server_gpus and len(args.server_gpus.split(",")) != 2:
        ap.error(f"--server-gpus takes two GPUs, the on server's and the off server's, e.g. '0,1'; got {args.server_gpus!r}")
    if args.concurrency < 0 or (args.concurrency and args.arrival_rate):
        ap.error("--concurrency must be >= 0, and not given with --arrival-rate")
    if args.arrival_rate < 0:
        ap.error(f"--arrival-rate must be >= 0 (0: all at once), got {args.arrival_rate}")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "cpu": platform.processor(),
            "cores": os.cpu_count(), "load_average": os.getloadavg(), "model": f"SmolLM2-135M-Instruct {args.dtype}",
            "server_args": args.server_args,
            "output_tokens_per_gen": TOKENS, "command": " ".join(sys.argv)}
    if args.scheduling:
        result = scheduling(args)
        meta["load_average_after"] = os.getloadavg()
        out = Path(args.out or "benchmarks/results/program_scheduling.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "programs": args.programs, **result}, indent=2))
        return
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(["--dtype", args.dtype, *args.server_args.split()])
    try:
        ways = {"client-driven": RuntimeEndpoint(url, programs="client"),
                "/run_program": RuntimeEndpoint(url, programs="server")}
        sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes else (1, 8) if args.quick else (1, 32)
        repeats = 1 if args.quick else args.repeats
        results: dict[str, Any] = {}
        for name, func in WORKLOADS.items():
            if args.only and args.only not in name:
                continue
            for n in sizes:
                row = dict.fromkeys(ways, float("inf"))
                for _ in range(repeats):  # the two ways alternate, so load from elsewhere hits both alike
                    for way, be in ways.items():
                        row[way] = min(row[way], measure(func, n, be, 1))
                row["speedup"] = row["client-driven"] / row["/run_program"]
                results[f"{name} @ {n}"] = row
                print(f"{name:22s} {n:3d} programs  client-driven {row['client-driven']:7.2f} s  "
                      f"/run_program {row['/run_program']:7.2f} s  ({row['speedup']:.2f}x)", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    meta["quick"] = args.quick
    meta["load_average_after"] = os.getloadavg()
    out = Path(args.out or "benchmarks/results/run_program.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
