"""Generate under real-world JSON Schemas: every output that finishes must validate.

Samples schemas from ../shared/data/jsonschemabench (every file, seeded), asks the default
model for an instance of each, greedily and sampled, with constrained decoding + jump-forward,
and checks each finished output with the `jsonschema` library. Outputs cut by
max_new_tokens must report finish_reason "length". Schemas the grammar engine cannot compile
are counted, not generated.

    python benchmarks/schema_generation.py [--schemas 200] [--max-new-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema

from radixlm.runtime.engine import Engine

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschemabench"


def sample_schemas(n: int, seed: int = 0, data: Path = DATA) -> list[tuple[str, dict[str, Any]]]:
    """n (name, schema) pairs drawn evenly across the dataset's files."""
    rng = random.Random(seed)
    files = sorted(data.glob("*.jsonl"))
    per_file = {f: [json.loads(line) for line in f.read_text().splitlines() if line.strip()] for f in files}
    picked: list[tuple[str, dict[str, Any]]] = []
    for i, f in enumerate(files):
        k = n // len(files) + (1 if i < n % len(files) else 0)
        for row in rng.sample(per_file[f], min(k, len(per_file[f]))):
            picked.append((row["name"], row["schema"]))
    return picked


def check(schema: dict[str, Any], out: dict[str, Any]) -> tuple[str, str]:
    """(verdict, why): 'valid', 'invalid' (a finished output that fails the schema, why = the
    validator's message), 'length' (cut short) or 'schema error' (the schema fails its own
    metaschema, so there is nothing to validate against)."""
    reason = out["meta_info"]["finish_reason"]["type"]
    if reason == "length":
        return "length", ""
    cls = jsonschema.validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        return "schema error", e.message
    try:
        error = jsonschema.exceptions.best_match(cls(schema).iter_errors(json.loads(out["text"])))
    except json.JSONDecodeError as e:
        return "invalid", f"not JSON: {e}"
    return ("invalid", error.message) if error is not None else ("valid", "")


def run(engine: Engine, schemas: list[tuple[str, dict[str, Any]]], max_new: int) -> dict[str, Any]:
    modes = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.7, "top_p": 0.95, "seed": 1}}
    counts: dict[str, Counter] = {m: Counter() for m in modes}
    failures: list[dict[str, Any]] = []
    compiled: list[tuple[str, dict[str, Any]]] = []
    for name, schema in schemas:
        try:
            engine.generate("{", {"json_schema": schema, "max_new_tokens": 0})
            compiled.append((name, schema))
        except ValueError as e:
            counts["greedy"]["not compiled"] += 1
            failures.append({"schema": name, "error": str(e)})
    for mode, extra in modes.items():
        chats = [[{"role": "user", "content": f"Produce one JSON instance of this schema:\n{json.dumps(s)[:1500]}"}]
                 for _, s in compiled]
        params = [{"max_new_tokens": max_new, "json_schema": s, **extra} for _, s in compiled]
        outs = engine.generate(chats, params)
        for (name, schema), out in zip(compiled, outs):
            verdict, why = check(schema, out)
            counts[mode][verdict] += 1
            if verdict in ("invalid", "schema error"):  # the whole text: a cut copy misleads
                failures.append({"schema": name, "mode": mode, "verdict": verdict, "error": why,
                                 "finish_reason": out["meta_info"]["finish_reason"], "text": out["text"]})
    return {"counts": {m: dict(c) for m, c in counts.items()}, "compiled": len(compiled), "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default="benchmarks/results/schema_generation.json")
    args = ap.parse_args()
    engine = Engine(max_total_tokens=60000, context_length=4096)
    t0 = time.perf_counter()
    res = run(engine, sample_schemas(args.schemas), args.max_new_tokens)
    res["seconds"] = time.perf_counter() - t0
    engine.shutdown()
    print(f"schemas: {args.schemas}, compiled: {res['compiled']}, seconds: {res['seconds']:.0f}")
    for mode, c in res["counts"].items():
        print(f"{mode:<8} " + ", ".join(f"{k}: {v}" for k, v in sorted(c.items())))
    res["meta"] = {"date": time.strftime("%Y-%m-%d"), "schemas": args.schemas, "max_new_tokens": args.max_new_tokens}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
