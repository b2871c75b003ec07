"""The grammar's host work per decode step at a batch size, without a model.

A batch of B constrained rows writes person records (benchmarks/structured_output.py's schema,
compact JSON, tokenized by the model's tokenizer), each row at its own point of its record, as
a decode step would see them. Each simulated step takes the engine's grammar calls in order:
accept one token per row, ask whether each grammar is complete, fill the next masks. A row that
ends its record starts the next one. Reported per step and per row: accept (one call per row,
and llguidance's parallel `consume_token_par` in one call), the completeness checks, the mask
fill at several sizes of llguidance's thread pool, and the fill beside 1 ms of Python on the main
thread (the host making a step's text): after it, or in a thread meanwhile, at two GIL switch
intervals; and the inverse, a fixed 1 ms of Python work in a thread while the step's thread fills
(the fill releases the GIL, so the thread waiting for it can run meanwhile).

    python benchmarks/grammar_host.py [--tokenizer DIR] [--batches 16,64] [--steps 200]
        [--threads 0,1,2,4,8] [--out benchmarks/results/grammar_host.json]
        [--process]   (instead: the grammar's step work in a process of its own that owns the
                       matchers, beside 1 ms of the step's Python, against all on the step's thread)

--tokenizer defaults to the default model's (converted once into the cache dir).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_output import CITIES, JOBS, NAMES, SCHEMA  # noqa: E402

from radixlm.runtime.config import ConstraintConfig  # noqa: E402
from radixlm.runtime.constrained.bitmask import allocate_bitmask  # noqa: E402
from radixlm.runtime.constrained.grammar import fill_masks  # noqa: E402
from radixlm.runtime.constrained.service import GrammarService  # noqa: E402
from radixlm.runtime.tokenizer_loader import load_tokenizer  # noqa: E402


def records(tokenizer: Any, n: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        name = rng.choice(NAMES)
        rec = {"name": name, "age": rng.randint(20, 70), "city": rng.choice(CITIES), "occupation": rng.choice(JOBS),
               "email": name.lower().replace(" ", ".") + "@example.com"}
        out.append(list(tokenizer.encode(json.dumps(rec, separators=(",", ":")), add_special_tokens=False)))
    return out


def default_tokenizer_dir() -> str:
    from radixlm.runtime.config import default_cache_dir
    from radixlm.runtime.model.source import DEFAULT_MODEL, resolve_model

    return str(resolve_model(DEFAULT_MODEL, default_cache_dir()).tokenizer_dir)


class Batch:
    """B rows, each a matcher somewhere in its record; ``grammars``: K compiles of the schema,
    row j on compile j * K // B (rows share a lexer only within their block)."""

    def __init__(self, grammars: list[Any], recs: list[list[int]], size: int) -> None:
        self.grammars, self.recs, self.size = grammars, recs, size
        self.rows: list[tuple[Any, list[int], int]] = []
        for j in range(size):
            rec = recs[j % len(recs)]
            m = self._grammar(j).new_matcher()
            k = (j * 7) % len(rec)
            assert all(m.accept(t) for t in rec[:k])
            self.rows.append((m, rec, k))

    def _grammar(self, j: int) -> Any:
        return self.grammars[j * len(self.grammars) // self.size]

    def next_tokens(self) -> list[int]:
        return [rec[k] for _, rec, k in self.rows]

    def advance(self) -> None:
        """Each row moved one token on; a row past its record's end starts the next record."""
        for j, (m, rec, k) in enumerate(self.rows):
            if k + 1 < len(rec):
                self.rows[j] = (m, rec, k + 1)
            else:
                nxt = self.recs[(self.recs.index(rec) + 1) % len(self.recs)]
                self.rows[j] = (self._grammar(j).new_matcher(), nxt, 0)

    @property
    def matchers(self) -> list[Any]:
        return [m for m, _, _ in self.rows]


def python_work(rounds: int) -> None:
    """A fixed amount of small Python calls, GIL held between them (the host making text)."""
    d: dict[int, str] = {}
    for _ in range(rounds):
        for i in range(50):
            d[i] = str(i) + "x"


def rounds_for(seconds: float) -> int:
    """How many python_work rounds take ``seconds`` on this thread alone."""
    t0 = time.perf_counter()
    python_work(500)
    return max(1, int(500 * seconds / (time.perf_counter() - t0)))


def busy_python(seconds: float) -> None:
    """Stand-in for the host making a step's text: small Python calls, GIL held between them."""
    end = time.perf_counter() + seconds
    d: dict[int, str] = {}
    while time.perf_counter() < end:
        for i in range(50):
            d[i] = str(i) + "x"


def run(service: GrammarService, recs: list[list[int]], size: int, steps: int, threads: list[int],
        lexers: int) -> dict[str, Any]:
    import llguidance

    # K compiles of the schema, each with a lexer of its own (0: one per row)
    grammars = [_compile(service) for _ in range(lexers or size)]
    executors = {n: llguidance.LLExecutor(n) if n else llguidance.LLExecutor() for n in threads}
    bitmask = allocate_bitmask(size, service.vocab.vocab_size)
    rows = list(range(size))
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    go, done = threading.Event(), threading.Event()
    work: dict[str, Any] = {}

    def filler() -> None:
        while True:
            go.wait()
            go.clear()
            fill_masks(work["matchers"], bitmask, rows)
            done.set()

    threading.Thread(target=filler, daemon=True).start()
    rounds = rounds_for(0.001)
    text_go, text_done = threading.Event(), threading.Event()

    def text_maker() -> None:  # the inverse: the text in a thread while the step loop fills
        while True:
            text_go.wait()
            text_go.clear()
            python_work(rounds)
            text_done.set()

    threading.Thread(target=text_maker, daemon=True).start()
    batch = Batch(grammars, recs, size)
    fills = [f"fill, pool {n or 'default'}" for n in threads]
    fills += [f"1 ms Python {how} (switch {switch * 1e3:g} ms)"
              for switch in (0.005, 0.0001) for how in ("then the fill", "with the fill in a thread")]
    fills += [f"1 ms of Python work {how} (switch {switch * 1e3:g} ms)" for switch in (0.005, 0.0002)
              for how in ("then the fill", "in a thread, the fill on the step's thread")]
    for step in range(steps):
        ms = batch.matchers
        toks = batch.next_tokens()
        for m in ms:
            m._settle()
        if step % 2 == 0:  # the engine today: one call per row
            timed("accept, a call per row", lambda a, b: [m.accept(t) for m, t in zip(a, b)], ms, toks)
        else:  # llguidance's parallel consume, one call
            raw = [(m._m, t) for m, t in zip(ms, toks)]
            assert all(timed("accept, consume_token_par", executors[threads[0]].consume_token_par, raw))
            for m in ms:
                m._accepted += 1
        timed("is_completed, a call per row", lambda a: [m.is_completed() for m in a], ms)
        # the first fill after the accepts does the work (the same state's second fill is cheaper):
        # one variant a step, in turn
        name = fills[step % len(fills)]
        if name.startswith("fill, pool"):
            ex = executors[threads[fills.index(name)]]
            for m in ms:
                m._executor = ex
            timed(name, fill_masks, ms, bitmask, rows)
        elif name.startswith("1 ms of Python work"):
            sys.setswitchinterval(0.005 if "switch 5 ms" in name else 0.0002)
            t0 = time.perf_counter()
            if "in a thread" in name:
                text_go.set()
                fill_masks(ms, bitmask, rows)
                text_done.wait()
                text_done.clear()
            else:
                python_work(rounds)
                fill_masks(ms, bitmask, rows)
            times.setdefault(name, []).append(time.perf_counter() - t0)
            sys.setswitchinterval(0.005)
        else:
            sys.setswitchinterval(0.005 if "switch 5 ms" in name else 0.0001)
            t0 = time.perf_counter()
            if "in a thread" in name:
                work["matchers"] = ms
                go.set()
                busy_python(0.001)
                done.wait()
                done.clear()
            else:
                busy_python(0.001)
                fill_masks(ms, bitmask, rows)
            times.setdefault(name, []).append(time.perf_counter() - t0)
            sys.setswitchinterval(0.005)
        batch.advance()
    return {name: {"median_us_per_step": statistics.median(v) * 1e6,
                   "median_us_per_row": statistics.median(v) * 1e6 / size} for name, v in times.items()}


def _grammar_process(tokenizer_dir: str, size: int, names: tuple[str, str], conn: Any) -> None:
    """A process that owns the batch's matchers: each step it takes the rows' tokens from shared
    memory, accepts them, asks each grammar whether it is complete and fills the next masks into
    shared memory, then answers with its own time for that work."""
    from multiprocessing import shared_memory

    import numpy as np
    import torch

    from radixlm.runtime.constrained.bitmask import bitmask_width

    tokenizer = load_tokenizer(tokenizer_dir)
    service = GrammarService(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                             ConstraintConfig(grammar_backend="llguidance"))
    grammar = _compile(service)
    batch = Batch([grammar], records(tokenizer, 20), size)
    tok_mem, mask_mem = (shared_memory.SharedMemory(name=n) for n in names)
    tokens = np.ndarray((size,), np.int32, buffer=tok_mem.buf)
    width = bitmask_width(service.vocab.vocab_size)
    bitmask = torch.frombuffer(mask_mem.buf, dtype=torch.int32, count=size * width).view(size, width)
    rows = list(range(size))
    conn.send("ready")
    while conn.recv():
        t0 = time.perf_counter()
        ms = batch.matchers
        for m, t in zip(ms, tokens.tolist()):
            m.accept(t)
        complete = sum(m.is_completed() for m in ms)
        fill_masks(ms, bitmask, rows)
        conn.send((time.perf_counter() - t0, complete))
        batch.advance()
    del tokens, bitmask
    tok_mem.close()
    mask_mem.close()
    service.shutdown()


def _compile(service: GrammarService) -> Any:
    from radixlm.runtime.constrained.grammar import normalize_spec

    _, norm = normalize_spec("json_schema", json.dumps(SCHEMA))
    backend: Any = service.backend
    return backend._compile_uncached("json_schema", backend._enforceable_schema(norm))


def process_run(service: GrammarService, tokenizer_dir: str, recs: list[list[int]], size: int,
                steps: int) -> dict[str, Any]:
    """A step's grammar work (accept, completeness checks, the mask fill) beside 1 ms of Python
    work (the host making text): all on the step's thread, or the grammar in a process of its own
    that owns the matchers, sent the tokens and answering through shared memory and a pipe."""
    import multiprocessing
    from multiprocessing import shared_memory

    import numpy as np

    from radixlm.runtime.constrained.bitmask import bitmask_width

    width = bitmask_width(service.vocab.vocab_size)
    rounds = rounds_for(0.001)
    grammar = _compile(service)
    local = Batch([grammar], recs, size)  # the step's own matchers (the serial way)
    bitmask = allocate_bitmask(size, service.vocab.vocab_size)
    rows = list(range(size))
    times: dict[str, list[float]] = {"grammar on the step's thread, then 1 ms of Python work": [],
                                     "grammar process while the step's thread does 1 ms of Python work": [],
                                     "the grammar process's own work": [], "1 ms of Python work alone": []}
    for _ in range(steps):
        ms = local.matchers
        t0 = time.perf_counter()
        for m, t in zip(ms, local.next_tokens()):
            m.accept(t)
        sum(m.is_completed() for m in ms)
        fill_masks(ms, bitmask, rows)
        python_work(rounds)
        times["grammar on the step's thread, then 1 ms of Python work"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        python_work(rounds)
        times["1 ms of Python work alone"].append(time.perf_counter() - t0)
        local.advance()
    tok_mem = shared_memory.SharedMemory(create=True, size=4 * size)
    mask_mem = shared_memory.SharedMemory(create=True, size=4 * size * width)
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_grammar_process, args=(tokenizer_dir, size, (tok_mem.name, mask_mem.name),
                                                      child_conn), daemon=True)
    proc.start()
    try:
        assert conn.recv() == "ready"
        tokens = np.ndarray((size,), np.int32, buffer=tok_mem.buf)
        shared = Batch([grammar], recs, size)  # the same rows as the process's: a source of tokens only
        for _ in range(steps):
            t0 = time.perf_counter()
            tokens[:] = shared.next_tokens()
            conn.send(True)
            python_work(rounds)
            own, _ = conn.recv()
            times["grammar process while the step's thread does 1 ms of Python work"].append(
                time.perf_counter() - t0)
            times["the grammar process's own work"].append(own)
            shared.advance()
        conn.send(False)
        proc.join(30)
        del tokens
    finally:
        if proc.is_alive():
            proc.kill()
        tok_mem.close()
        tok_mem.unlink()
        mask_mem.close()
        mask_mem.unlink()
    return {name: {"median_us_per_step": statistics.median(v) * 1e6,
                   "median_us_per_row": statistics.median(v) * 1e6 / size} for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", default="0,1,2,4,8", help="llguidance pool sizes (0: its default)")
    ap.add_argument("--lexers", type=int, default=1,
                    help="compiles of the schema, rows in blocks on them (0: one per row, no lexer shared)")
    ap.add_argument("--process", action="store_true",
                    help="instead: the grammar's work in a process of its own beside the step's Python")
    ap.add_argument("--out", default="benchmarks/results/grammar_host.json")
    args = ap.parse_args()
    tokenizer_dir = args.tokenizer or default_tokenizer_dir()
    tokenizer = load_tokenizer(tokenizer_dir)
    stop_ids = [tokenizer.eos_token_id]
    service = GrammarService(tokenizer, len(tokenizer), stop_ids, ConstraintConfig(grammar_backend="llguidance"))
    recs = records(tokenizer, 20)
    threads = [int(x) for x in args.threads.split(",")]
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                              "lexers": args.lexers,
                              "python": sys.version.split()[0], "batches": {}}
    for size in (int(b) for b in args.batches.split(",")):
        got = (process_run(service, tokenizer_dir, recs, size, args.steps) if args.process
               else run(service, recs, size, args.steps, threads, args.lexers))
        result["batches"][size] = got
        lexers = "one compile" if args.process else f"{args.lexers or size} lexers"
        print(f"\nbatch {size}, {lexers}: median us a step (us a row)")
        for name, row in got.items():
            print(f"  {name:70s} {row['median_us_per_step']:9.1f}  ({row['median_us_per_row']:6.1f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    service.shutdown()


if __name__ == "__main__":
    main()
