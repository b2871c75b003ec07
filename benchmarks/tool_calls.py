"""Tool-call validity and time per call: `radixlm serve` with the default model, the official
openai client, 5 tools of varied schemas, sampled calls with tool_choice required and auto,
jump-forward on and off (one server each). Every returned call is parsed and validated with
`jsonschema` against its tool's parameters. Writes benchmarks/results/tool_calls.json.

    python benchmarks/tool_calls.py --requests 100
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_harness import start_server  # noqa: E402

TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "The current weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}},
    {"name": "search", "description": "Search the web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"]}},
    {"name": "send_email", "description": "Send an email", "parameters": {
        "type": "object", "properties": {"to": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                "minItems": 1, "maxItems": 3},
                                         "subject": {"type": "string", "maxLength": 60},
                                         "urgent": {"type": "boolean"}},
        "required": ["to", "subject"]}},
    {"name": "book_flight", "description": "Book a flight", "parameters": {
        "type": "object", "properties": {"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
                                         "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["from", "to", "date", "passengers"]}},
    {"name": "convert", "description": "Convert an amount between currencies", "parameters": {
        "type": "object", "properties": {"amount": {"type": "number", "minimum": 0},
                                         "currency": {"$ref": "#/$defs/Pair"}},
        "required": ["amount", "currency"],
        "$defs": {"Pair": {"type": "object", "properties": {"source": {"enum": ["USD", "EUR", "GBP"]},
                                                            "target": {"enum": ["USD", "EUR", "GBP"]}},
                           "required": ["source", "target"]}}}},
]
QUESTIONS = ["What is the weather in Paris?", "Find recent news about Mars rovers.",
             "Email Ana that the meeting moved to 3pm.", "Book a flight from Boston to Lisbon on March 3.",
             "How much is 120 dollars in euros?"]
# Earlier turns in which the assistant called a tool (what makes the small model call under auto).
FEW_SHOT = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Rome", "unit": "celsius"})}}]},
    {"role": "user", "content": "Search for cheap hotels in Oslo."},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "search", "arguments": json.dumps({"query": "cheap hotels Oslo"})}}]},
]


def lscpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    keep = ("Model name", "CPU(s)", "Thread(s) per core")
    lines = [" ".join(ln.split()) for ln in out.splitlines() if ln.split(":")[0].strip() in keep]
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    return "; ".join([*lines, "SIMD flags: " + " ".join(simd)])


def run_mode(client: openai.OpenAI, mode: str, requests: int, max_tokens: int, seed0: int) -> dict[str, Any]:
    tools = [{"type": "function", "function": t} for t in TOOLS]
    schemas = {t["name"]: t["parameters"] for t in TOOLS}
    calls = valid = unparsable = text_answers = cut = 0
    errors: list[str] = []
    call_times: list[float] = []
    start = time.perf_counter()
    for i in range(requests):
        q = QUESTIONS[i % len(QUESTIONS)]
        messages = [*(FEW_SHOT if mode == "auto" else []), {"role": "user", "content": q}]
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="m", messages=messages, tools=tools, tool_choice=mode,
                                           temperature=1.0, seed=seed0 + i, max_tokens=max_tokens)
        dt = time.perf_counter() - t0
        choice = r.choices[0]
        got = choice.message.tool_calls or []
        if not got:
            if choice.finish_reason == "length":
                cut += 1
            else:
                text_answers += 1
            continue
        for c in got:
            calls += 1
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                unparsable += 1
                continue
            try:
                jsonschema.validate(args, schemas[c.function.name])
                valid += 1
            except (jsonschema.ValidationError, KeyError) as e:
                errors.append(f"{c.function.name}: {str(e).splitlines()[0]}")
        call_times.append(dt / len(got))
    wall = time.perf_counter() - start
    return {"mode": mode, "requests": requests, "calls": calls, "valid": valid, "unparsable": unparsable,
            "text_answers": text_answers, "cut_by_max_tokens": cut, "invalid_examples": errors[:5],
            "s_per_call_mean": sum(call_times) / len(call_times) if call_times else None,
            "s_per_call_median": sorted(call_times)[len(call_times) // 2] if call_times else None,
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100, help="requests per tool_choice mode and jump setting")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tool_calls.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the server on the way out
    results = []
    for jump in ("true", "false"):
        server = start_server("--dtype", args.dtype, "--max-total-tokens", "16384", "--jump-forward", jump)
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            for mode in ("required", "auto"):
                row = {"jump_forward": jump == "true", **run_mode(client, mode, args.requests, args.max_tokens, 1000)}
                print(json.dumps(row), flush=True)
                results.append(row)
        finally:
            server.stop()
    out = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(["python", *sys.argv]),
           "hardware": lscpu_flags(),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(), "openai": openai.__version__,
           "load_average": os.getloadavg(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
