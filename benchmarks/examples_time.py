"""Time each example end to end, as a user runs it: `python examples/...` in a fresh process.

    python benchmarks/examples_time.py                 # every example once
    python benchmarks/examples_time.py --repeat 2      # keep each example's fastest run
    python benchmarks/examples_time.py --calibrate     # also bs1 decode ms/token after each run

Records wall seconds and CPU seconds (user + sys of the example and every process it started)
with the machine's load average around the run. On a machine shared with other work the wall
time is an upper bound of what an idle machine takes; results go to
benchmarks/results/examples_time.json (merged: an example's faster run replaces a slower one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["examples/agents/react_agent.py", "examples/agents/tree_of_thought.py",
            "examples/agents/json_extraction.py", "examples/agents/multi_turn_chat.py",
            "examples/serve_and_query.py"]
RESULTS = ROOT / "benchmarks" / "results" / "examples_time.json"


def run_one(path: str) -> dict[str, float | int]:
    """One run of an example: wall and CPU seconds, exit code, load average before and after."""
    before_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, path], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    cpu = (after_cpu.ru_utime - before_cpu.ru_utime) + (after_cpu.ru_stime - before_cpu.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_before": round(load_before, 1),
            "load_after": round(os.getloadavg()[0], 1)}


CALIBRATE = """
import time
from radixlm.runtime.engine import Engine
e = Engine()
params = {"temperature": 0, "max_new_tokens": 17, "ignore_eos": True}
e.generate("Count: one, two,", params)
out = e.generate("Count: one, two,", params)
m = out["meta_info"]
print((m["e2e_latency"] - m["ttft"]) / (m["completion_tokens"] - 1) * 1000)
e.shutdown()
"""


def decode_ms_per_token() -> float:
    """bs1 greedy decode ms/token of the default model now (docs/benchmarks.md, "Model speed", has it on an idle machine)."""
    out = subprocess.run([sys.executable, "-c", CALIBRATE], cwd=ROOT, capture_output=True, text=True, check=True)
    return round(float(out.stdout.strip().splitlines()[-1]), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="runs per example; the fastest is kept")
    ap.add_argument("--calibrate", action="store_true",
                    help="after each run, time bs1 decode (ms/token) to show how loaded the machine was")
    ap.add_argument("examples", nargs="*", default=EXAMPLES, help="example paths (default: all)")
    args = ap.parse_args()
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"results": {}}
    results = old["results"]
    for path in args.examples:
        for _ in range(args.repeat):
            got = run_one(path)
            if args.calibrate:
                got["decode_ms_per_token_after"] = decode_ms_per_token()
            print(f"{path}: {got}", flush=True)
            if path not in results or got["wall_s"] < results[path]["wall_s"]:
                results[path] = {**got, "date": datetime.date.today().isoformat()}
            meta = {"machine": platform.platform(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "note": "wall is an upper bound: the machine was shared with other work (see load)"}
            RESULTS.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")  # after each run


if __name__ == "__main__":
    main()
