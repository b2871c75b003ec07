"""Client-driven programs vs POST /run_program, over HTTP to the same `radixlm serve`.

Client-driven: RuntimeEndpoint(programs="client"), one /generate round trip per gen, select and
fork prefill. /run_program: RuntimeEndpoint(programs="server"), the whole graph in one request.
Workloads (greedy, fixed output lengths with ignore_eos so both sides do the same work):
(a) a 10-gen chain; (b) tree-of-thought, forks 3 wide x 3 deep (39 gens, 27 selects);
(c) JSON extraction with 4 fields as separate gens. Each at 1 program and at 32 concurrent
programs (run_batch), reporting wall time per program (1) and per batch (32).

    python benchmarks/run_program.py [--quick] [--url URL] [--out benchmarks/results/run_program.json]

Without --url it starts `radixlm serve` on 127.0.0.1 (bfloat16, default model) and stops it after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import radixlm as rl
from radixlm.lang.backends.runtime_endpoint import RuntimeEndpoint

TOKENS = 6
FIXED = {"max_tokens": TOKENS, "ignore_eos": True}


@rl.function
def chain(s, i: int):
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
def tree_of_thought(s, i: int):
    s += f"Problem {i}: a farmer has {i + 2} fields with 4 rows each. How many rows?"
    _expand(s, 3, 3)


@rl.function
def json_fields(s, i: int):
    s += rl.user(f"Contact {i}: Ana Lima, 3{i} years old, lives in Porto, email ana{i}@example.com. "
                 "Give the fields as JSON.")
    with s.assistant():
        s += '{"name": "' + rl.gen("name", regex=r"[A-Za-z ]{1,20}", max_tokens=8) + '", '
        s += '"age": ' + rl.gen("age", regex=r"[0-9]{1,3}", max_tokens=4) + ", "
        s += '"city": "' + rl.gen("city", regex=r"[A-Za-z ]{1,20}", max_tokens=8) + '", '
        s += '"email": "' + rl.gen("email", regex=r"[a-z0-9.]{1,16}@[a-z]{1,12}\.com", max_tokens=16) + '"}'


WORKLOADS = {"10-gen chain": chain, "tree-of-thought 3x3": tree_of_thought, "JSON 4 fields": json_fields}


def start_server(args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "radixlm.cli", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a running radixlm server (default: start one)")
    ap.add_argument("--quick", action="store_true", help="8 concurrent programs instead of 32, one repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="the started server's dtype (float32 is fastest on CPU)")
    ap.add_argument("--only", help="run only the workloads whose name contains this text")
    ap.add_argument("--sizes", help="comma-separated numbers of concurrent programs (default 1,32; quick 1,8)")
    ap.add_argument("--out", default="benchmarks/results/run_program.json")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(["--dtype", args.dtype])
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
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "cpu": platform.processor(),
            "cores": os.cpu_count(), "quick": args.quick, "model": f"SmolLM2-135M-Instruct {args.dtype}",
            "output_tokens_per_gen": TOKENS, "command": " ".join(sys.argv)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
