"""Pathological constraints through a grammar backend: what compiling them costs, and masks.

Each case (deeply nested JSON schemas, huge enums, catastrophic regexes, huge repetition counts,
the same through EBNF and ``choices``) is compiled in a worker process on the default model's
vocabulary, then a matcher runs up to ``--tokens`` steps (fill_mask, then accept the first
allowed token). Per case: the outcome (``ok``, the ``ValueError`` text, another exception type,
``timeout`` or ``crash``), compile seconds, the slowest mask+accept step, and the worker's peak
RSS growth. A case past ``--timeout`` seconds is killed and the worker restarted.

``--raw`` compiles with the engine alone (xgrammar's compiler, no radixlm checks), to show what
the limits in ``radixlm.runtime.constrained.limits`` protect against; the default goes through
``CachedGrammarBackend.compile`` as the server does (limits included).

    python benchmarks/grammar_pathological.py [--raw] [--only SUBSTR] [--timeout 30]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _nested_object(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _nested_array(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "minItems": 1}
    return schema


def _nested_anyof(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [schema, {"type": "string"}]}
    return schema


def _nested_groups(depth: int) -> str:
    return "(" * depth + "a" + ")" * depth


def _ebnf_nested(depth: int) -> str:
    return 'root ::= ' + "(" * depth + '"a"' + ")" * depth


# name -> (kind, spec factory). Factories keep the parent's memory small.
CASES: dict[str, tuple[str, Callable[[], Any]]] = {
    "json nested object x50": ("json_schema", lambda: _nested_object(50)),
    "json nested object x200": ("json_schema", lambda: _nested_object(200)),
    "json nested object x1000": ("json_schema", lambda: _nested_object(1000)),
    "json nested array x200": ("json_schema", lambda: _nested_array(200)),
    "json nested array x1000": ("json_schema", lambda: _nested_array(1000)),
    "json nested anyOf x200": ("json_schema", lambda: _nested_anyof(200)),
    "json enum 10k strings": ("json_schema", lambda: {"enum": [f"value{i}" for i in range(10_000)]}),
    "json enum 100k strings": ("json_schema", lambda: {"enum": [f"value{i}" for i in range(100_000)]}),
    "json enum 100k ints": ("json_schema", lambda: {"enum": list(range(100_000))}),
    "json 10k properties": ("json_schema", lambda: {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}),
    "json anyOf 10k branches": ("json_schema", lambda: {"anyOf": [{"const": f"c{i}"} for i in range(10_000)]}),
    "json pattern 100 KB": ("json_schema", lambda: {"type": "string", "pattern": "ab" * 50_000}),
    "json pattern (a|aa)+$": ("json_schema", lambda: {"type": "string", "pattern": "^(a|aa)+$"}),
    "json minItems 1M": ("json_schema", lambda: {"type": "array", "items": {"type": "integer"}, "minItems": 1_000_000}),
    "json maxItems 1M": ("json_schema", lambda: {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}),
    "json minItems=maxItems 100k": ("json_schema", lambda: {
        "type": "array", "items": {"type": "integer"}, "minItems": 100_000, "maxItems": 100_000}),
    "json minLength 1M": ("json_schema", lambda: {"type": "string", "minLength": 1_000_000}),
    "json maxLength 1M": ("json_schema", lambda: {"type": "string", "maxLength": 1_000_000}),
    "json minLength 1e18": ("json_schema", lambda: {"type": "string", "minLength": 10**18}),
    "json maxItems 1e30": ("json_schema", lambda: {"type": "array", "maxItems": 10**30}),
    "json minimum 1e300": ("json_schema", lambda: {"type": "integer", "minimum": 10**300}),
    "json minProperties 100k": ("json_schema", lambda: {"type": "object", "minProperties": 100_000}),
    "json $ref self loop": ("json_schema", lambda: {"$ref": "#"}),
    "json $ref chain loop": ("json_schema", lambda: {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    "json 1 MB description": ("json_schema", lambda: {"type": "integer", "description": "x" * 1_000_000}),
    "regex (a*)*b": ("regex", lambda: r"(a*)*b"),
    "regex (a|aa)+$": ("regex", lambda: r"(a|aa)+$"),
    "regex (x+x+)+y": ("regex", lambda: r"(x+x+)+y"),
    "regex a{1000}": ("regex", lambda: r"a{1000}"),
    "regex a{100000}": ("regex", lambda: r"a{100000}"),
    "regex a{1000000}": ("regex", lambda: r"a{1000000}"),
    "regex [\\s\\S]{0,100000}": ("regex", lambda: r"[\s\S]{0,100000}"),
    "regex (a{1000}){1000}": ("regex", lambda: r"(a{1000}){1000}"),
    "regex (a|b){1000}c{1000}": ("regex", lambda: r"(a|b){1000}c{1000}"),
    "regex .{0,1000}x.{0,1000}": ("regex", lambda: r".{0,1000}x.{0,1000}"),
    "regex nested groups x1000": ("regex", lambda: _nested_groups(1000)),
    "regex nested groups x100000": ("regex", lambda: _nested_groups(100_000)),
    "regex 100k alternatives": ("regex", lambda: "|".join(f"w{i}" for i in range(100_000))),
    "regex 1 MB literal": ("regex", lambda: "a" * 1_000_000),
    "ebnf a{1000000}": ("ebnf", lambda: 'root ::= "a"{1000000}'),
    "ebnf nested parens x1000": ("ebnf", lambda: _ebnf_nested(1000)),
    "ebnf left recursion": ("ebnf", lambda: 'root ::= root "a" | "a"'),
    "ebnf 100k alternatives": ("ebnf", lambda: "root ::= " + " | ".join(f'"w{i}"' for i in range(100_000))),
    "ebnf 10k rules chain": ("ebnf", lambda: "root ::= r0\n" + "".join(
        f'r{i} ::= "x" r{i + 1}\n' for i in range(10_000)) + 'r10000 ::= "y"'),
    "choices 100k": ("choices", lambda: [f"choice number {i}" for i in range(100_000)]),
    "choices one 1 MB string": ("choices", lambda: ["x" * 1_000_000]),
    # the largest of a kind that the default limits let through
    "at limit: json nested object x63": ("json_schema", lambda: _nested_object(63)),
    "at limit: json enum 4096 strings": ("json_schema", lambda: {"enum": [f"value{i}" for i in range(4096)]}),
    "at limit: json 1000 properties": ("json_schema", lambda: {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}),
    "at limit: json 4000 properties": ("json_schema", lambda: {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}),
    "at limit: choices 4096": ("choices", lambda: [f"choice number {i}" for i in range(4096)]),
    "at limit: regex 16k alternatives": ("regex", lambda: "|".join(f"w{i}" for i in range(16_000))),
    "at limit: regex 128 KiB literal": ("regex", lambda: "a" * 131_072),
    "at limit: ebnf 10k alternatives": ("ebnf", lambda: "root ::= " + " | ".join(f'"w{i}"' for i in range(10_000))),
}


# --- worker -----------------------------------------------------------------------------------

def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _compile_raw(backend: Any, kind: str, norm: Any) -> Any:
    """xgrammar's compiler as the backend calls it, without radixlm's checks."""
    from radixlm.runtime.constrained.grammar import choices_to_ebnf

    c, cfg = backend._compiler, backend.config
    if kind == "json_schema":
        return c.compile_json_schema(norm, any_whitespace=cfg.json_any_whitespace, separators=cfg.json_separators,
                                     strict_mode=cfg.json_strict, any_order=cfg.json_any_order)
    if kind == "regex":
        return c.compile_regex(norm)
    return c.compile_grammar(norm if kind == "ebnf" else choices_to_ebnf(norm))


def _run_case(backend: Any, kind: str, spec: Any, tokens: int, raw: bool) -> dict[str, Any]:
    import numpy as np

    from radixlm.runtime.constrained.grammar import XGrammarGrammar, bitmask_width, normalize_spec

    try:
        with open("/proc/self/clear_refs", "w") as f:  # reset the peak RSS counter
            f.write("5")
    except OSError:
        pass
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    try:
        if raw:
            _, norm = normalize_spec(kind, spec)
            grammar = XGrammarGrammar(kind, _compile_raw(backend, kind, norm), backend.vocab_size, backend._xgr)
        else:
            grammar = backend.compile(kind, spec)
    except ValueError as e:
        return {"outcome": "ValueError", "message": str(e)[:300], "compile_s": time.perf_counter() - t0,
                "peak_rss_mib": (_rss_kib("VmHWM") - base) / 1024}
    except Exception as e:  # noqa: BLE001 - reported: any other exception is a bug
        return {"outcome": type(e).__name__, "message": str(e)[:300], "compile_s": time.perf_counter() - t0,
                "peak_rss_mib": (_rss_kib("VmHWM") - base) / 1024}
    compile_s = time.perf_counter() - t0
    matcher = grammar.new_matcher()
    row = np.zeros(bitmask_width(backend.vocab_size), dtype=np.int32)
    worst, steps = 0.0, 0
    for _ in range(tokens):
        t1 = time.perf_counter()
        masked = matcher.fill_mask(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little") if masked else None
        allowed = [int(i) for i in np.flatnonzero(bits)[:64]] if bits is not None else list(range(64))
        allowed = [t for t in allowed if t < backend.vocab_size and t not in backend.vocab.stop_ids]
        if not allowed or not matcher.accept(allowed[0]):
            worst = max(worst, time.perf_counter() - t1)
            break
        worst = max(worst, time.perf_counter() - t1)
        steps += 1
    return {"outcome": "ok", "compile_s": compile_s, "steps": steps, "worst_step_ms": worst * 1e3,
            "peak_rss_mib": (_rss_kib("VmHWM") - base) / 1024}


def _worker(conn: Any, tokens: int, raw: bool) -> None:
    from transformers import AutoTokenizer

    from radixlm.runtime.config import default_cache_dir
    from radixlm.runtime.constrained import XGrammarBackend, build_tokenizer_vocab
    from radixlm.runtime.model.source import DEFAULT_MODEL, resolve_model

    src = resolve_model(DEFAULT_MODEL, default_cache_dir())
    tok = AutoTokenizer.from_pretrained(str(src.tokenizer_dir))
    backend = XGrammarBackend(build_tokenizer_vocab(tok, src.arch.vocab_size))
    conn.send("ready")
    while True:
        name = conn.recv()
        if name is None:
            return
        kind, factory = CASES[name]
        conn.send(_run_case(backend, kind, factory(), tokens, raw))


class _Worker:
    def __init__(self, tokens: int, raw: bool) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, tokens, raw), daemon=True)
        self.proc.start()
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            raise RuntimeError("the worker did not start")

    def run(self, name: str, timeout: float) -> dict[str, Any] | None:
        """The case's result; None when it ran past ``timeout`` or the worker died."""
        self.conn.send(name)
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.is_alive():
            if self.conn.poll(0.1):
                return self.conn.recv()
        return None

    def kill(self) -> int | None:
        self.proc.kill()
        self.proc.join()
        return self.proc.exitcode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", action="store_true", help="compile with the engine alone (no radixlm limits)")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--tokens", type=int, default=8, help="matcher steps after compiling")
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args()
    names = [n for n in CASES if args.only in n]
    worker = _Worker(args.tokens, args.raw)
    rows = []
    for name in names:
        wall = time.perf_counter()
        res = worker.run(name, args.timeout)
        if res is None:
            alive = worker.proc.is_alive()
            code = worker.kill()
            res = {"outcome": "timeout" if alive else f"crash (exit {code})"}
            res["wall_s"] = time.perf_counter() - wall
            worker = _Worker(args.tokens, args.raw)
        rows.append({"case": name, **res})
        msg = res.get("message", "")
        print(f"{name:32} {res['outcome']:10} compile {res.get('compile_s', res.get('wall_s', 0)):8.3f}s "
              f"step {res.get('worst_step_ms', 0):8.2f}ms rss +{res.get('peak_rss_mib', 0):7.1f}MiB {msg[:110]}",
              flush=True)
    worker.conn.send(None)
    worker.proc.join(10)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        "grammar_pathological_raw.json" if args.raw else "grammar_pathological.json")
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "raw": args.raw, "timeout_s": args.timeout, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
