"""JSONSchemaBench (MaskBench split) through our grammar backends, token by token.

For every schema of every file in ``../shared/data/jsonschemabench/``: compile it (coverage),
feed each ``valid`` instance's JSON text, tokenized with the default model's tokenizer (SmolLM2),
through a matcher — every token must be in the mask and accepted, then the stop token (the
grammar must be complete) — and each invalid instance, which must be refused somewhere (a token
or the final stop). A schema *passes* (MaskBench's rule) when it compiles, every valid instance
is accepted and every invalid one refused; an invalid instance accepted is a *wrong acceptance*.
Grammar time per token is fill_mask + accept; µs/mask is fill_mask alone.

Configuration (see docs/structured-output.md, "JSONSchemaBench"):
- xgrammar: compact separators, strict mode (no properties beyond those a schema names: what
  generation uses), any property order; llguidance: compact separators, not strict (the properties the
  schema allows, as a validator reads it; generation closes objects, see close_objects);
  outlines-core: compact separators (it has no any-order or strict switch).
- Instances are serialized compactly (``json.dumps(separators=(",", ":"), ensure_ascii=False)``)
  with each object's keys put in the order its own subschema names them (``properties``, then
  those of its ``$ref``/``allOf``/``anyOf``/``oneOf``; unnamed keys last), the order the
  order-fixed backends generate in.

Each (schema, backend) runs in one of ``--workers`` processes (2 by default) under a time and
memory cap; a task past either is killed and counted as not compiled ("timeout", "memory").

    python benchmarks/jsonschemabench.py [--limit N] [--backends xgrammar,llguidance,llguidance-raw,outlines|all]

llguidance-raw is llguidance without our schema preparation: the peer our backend is held against.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

from radixlm.runtime.constrained.grammar import (
    GrammarBackend,
    GrammarConfig,
    bitmask_width,
)
from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend
from radixlm.runtime.constrained.registry import GRAMMAR_BACKENDS

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data" / "jsonschemabench"
FILES = ("Github_trivial", "Github_easy", "Glaiveai2K", "Handwritten", "Synthesized")
class RawLLGuidance(LLGuidanceBackend):
    """llguidance as it comes: none of our schema preparation (format drops and refusals,
    minProperties refusal, finite schemas compiled as the enum of their accepted values): the
    peer our llguidance backend is held against."""

    name = "llguidance-raw"

    def _checked(self, schema: Any) -> Any:
        return schema


FACTORIES = {**GRAMMAR_BACKENDS, RawLLGuidance.name: RawLLGuidance}
BACKEND_CONFIGS = {
    "xgrammar": GrammarConfig(json_any_order=True),
    "llguidance": GrammarConfig(json_strict=False),  # a validator's semantics: unnamed properties allowed
    "llguidance-raw": GrammarConfig(json_strict=False),
    "outlines": GrammarConfig(),
}
# Published coverage (JSONSchemaBench paper, Llama-3.2-1B), from the data folder's README.
PUBLISHED = {
    "Github_easy": {"Guidance": 0.86, "XGrammar": 0.79, "llama.cpp": 0.75, "Outlines": 0.59},
    "Glaiveai2K": {"Guidance": 0.96, "XGrammar": 0.93, "llama.cpp": 0.95, "Outlines": 0.95},
}
MAX_FAILURES_KEPT = 3


# --- the pipeline (also used by tests/runtime/constrained/test_jsonschemabench.py) ----------


def load_rows(data_dir: Path, file: str, limit: int | None = None) -> list[dict]:
    """The first ``limit`` rows (all when None) of one benchmark file."""
    rows = []
    with (data_dir / f"{file}.jsonl").open() as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            rows.append(json.loads(line))
    return rows


def property_order(schema: Any) -> dict[str, int]:
    """Each property name's rank by first mention under any ``properties`` of the schema."""
    order: dict[str, int] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                for name in props:
                    order.setdefault(name, len(order))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return order


def _local_ref(ref: Any, root: Any) -> Any:
    """The schema a local ``$ref`` (``#``, ``#/$defs/x``) points to, or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _applicable(schema: Any, root: Any) -> list[dict]:
    """``schema`` and what it pulls in, in the order its keywords come (``$ref`` targets,
    ``allOf``/``anyOf``/``oneOf`` branches): the order an order-fixed grammar reads them in."""
    out: list[dict] = []
    todo, seen = [schema], set()
    while todo:
        node = todo.pop(0)
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        out.append(node)
        pulled: list[Any] = []
        for key, value in node.items():
            if key == "$ref":
                pulled.append(_local_ref(value, root))
            elif key in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
                pulled.extend(value)
        todo[:0] = pulled
    return out


def serialize(data: Any, schema: Any, root: Any = None) -> str:
    """Compact JSON with each object's keys in the order of the ``properties`` that apply to it
    (its subschema's, then those of its ``$ref``/``allOf``/``anyOf``/``oneOf``; unnamed keys
    last, as they were): the order order-fixed grammars (llguidance, outlines) generate in."""
    root = schema if root is None else root

    def reorder(node: Any, sub: Any) -> Any:
        parts = _applicable(sub, root)
        if isinstance(node, dict):
            props: dict[str, Any] = {}
            for part in parts:
                if isinstance(part.get("properties"), dict):
                    for name, value in part["properties"].items():
                        props.setdefault(name, value)
            rank = {name: i for i, name in enumerate(props)}
            keys = sorted(enumerate(node), key=lambda ik: (rank.get(ik[1], math.inf), ik[0]))
            return {k: reorder(node[k], props.get(k)) for _, k in keys}
        if isinstance(node, list):
            items = next((p["items"] for p in parts if isinstance(p.get("items"), (dict, list))), None)
            prefix = next((p["prefixItems"] for p in parts if isinstance(p.get("prefixItems"), list)), [])
            if isinstance(items, list):  # draft-4 tuple
                prefix, items = items, None
            return [reorder(v, prefix[i] if i < len(prefix) else items) for i, v in enumerate(node)]
        return node

    return json.dumps(reorder(data, schema), separators=(",", ":"), ensure_ascii=False)


def has_unnamed_key(data: Any, order: dict[str, int]) -> bool:
    """Whether some object in ``data`` has a key the schema never names (strict mode refuses it)."""
    if isinstance(data, dict):
        return any(k not in order for k in data) or any(has_unnamed_key(v, order) for v in data.values())
    if isinstance(data, list):
        return any(has_unnamed_key(v, order) for v in data)
    return False


@dataclass
class SchemaResult:
    """One schema through one backend."""

    file: str
    name: str
    backend: str
    compiled: bool = False
    error: str = ""
    compile_s: float = 0.0
    valid: int = 0
    valid_accepted: int = 0
    valid_unnamed_key: int = 0  # valid instances with a key the schema never names
    invalid: int = 0
    invalid_rejected: int = 0
    no_forced_text: str = ""  # outlines: why the grammar has no character FSM
    tokens: int = 0
    grammar_s: float = 0.0  # fill_mask + accept, summed over tokens
    mask_s: float = 0.0  # fill_mask alone, summed over tokens
    mask_mismatches: int = 0  # tokens whose mask bit disagreed with accept()
    engine_errors: int = 0  # instances or walks the grammar engine failed on (RuntimeError)
    walks: int = 0  # random walks through the grammar (model-free generation)
    walks_finished: int = 0  # ... that reached a stop token within WALK_MAX_TOKENS
    walks_valid: int = 0  # ... finished ones that validate with the jsonschema library
    walk_compile_error: str = ""  # generation's config refused what the acceptance config compiled
    schema_error: str = ""  # the schema fails its own metaschema: outputs are not validated
    failures: list[str] = field(default_factory=list)


@dataclass
class Fed:
    """One instance fed through a matcher."""

    refused_at: int | None  # index of the first refused token (the stop token is the last), or None
    tokens: int
    grammar_s: float  # fill_mask + accept
    mask_s: float  # fill_mask alone
    mismatches: int  # tokens whose mask bit disagreed with accept()


def feed(matcher: Any, ids: list[int], row: np.ndarray, stop: int) -> Fed:
    """Feed ``ids`` then ``stop`` through ``matcher``, masking before each token."""
    spent = masking = 0.0
    mismatches = 0
    for i, t in enumerate([*ids, stop]):
        t0 = time.perf_counter()
        matcher.fill_mask(row)
        t1 = time.perf_counter()
        ok = matcher.accept(t)
        spent += time.perf_counter() - t0
        masking += t1 - t0
        if bool((int(row[t // 32]) >> (t % 32)) & 1) != ok:
            mismatches += 1
        if not ok:
            return Fed(i, i + 1, spent, masking, mismatches)
    return Fed(None, len(ids) + 1, spent, masking, mismatches)


WALK_MAX_TOKENS = 256
_STRUCTURAL = set(b'"{}[],:')


def _allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])


def random_walk(matcher: Any, decoded: list[bytes], stop: int, rng: np.random.Generator,
                row: np.ndarray, structural: np.ndarray) -> str | None:
    """Text generated by picking random allowed tokens (a stop token with probability 1/2 once
    allowed; structural tokens, ``"{}[],:`` or one byte, with probability 2/3 so strings
    close), or None if no stop came within WALK_MAX_TOKENS. Exercises every corner of the
    grammar a model might reach, without a model."""
    out = bytearray()
    for _ in range(WALK_MAX_TOKENS):
        if matcher.fill_mask(row):
            allowed = _allowed(row, len(decoded))
        else:
            allowed = np.flatnonzero(structural >= 0)
        if stop in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            assert matcher.accept(stop)
            return out.decode("utf-8", errors="surrogateescape")  # json.loads refuses bad bytes
        allowed = allowed[allowed != stop]
        if not len(allowed):
            return None
        pick = allowed[structural[allowed] > 0] if rng.random() < 2 / 3 else allowed
        t = int(rng.choice(pick if len(pick) else allowed))
        assert matcher.accept(t), "a token in the mask was refused"
        out += decoded[t]
    return None


def structural_tokens(decoded: list[bytes]) -> np.ndarray:
    """1 for tokens of one byte or holding a JSON structural character, 0 for other text
    tokens, -1 for tokens with no text (special, padding)."""
    return np.array([(-1 if not b else int(len(b) == 1 or bool(_STRUCTURAL.intersection(b))))
                     for b in decoded], dtype=np.int8)


def validate_walks(res: SchemaResult, grammar: Any, schema: Any, decoded: list[bytes], stop: int,
                   walks: int, structural: np.ndarray, row: np.ndarray) -> None:
    """Random-walk ``walks`` outputs and check the finished ones with the jsonschema library."""
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        validator = cls(schema)
    except jsonschema.SchemaError as e:
        res.schema_error = e.message[:200]
        return
    rng = np.random.default_rng(zlib.crc32(res.name.encode()))
    for _ in range(walks):
        res.walks += 1
        try:
            text = random_walk(grammar.new_matcher(), decoded, stop, rng, row, structural)
        except RuntimeError:
            res.engine_errors += 1
            continue
        if text is None:
            continue
        res.walks_finished += 1
        try:
            errors = [e.message for e in validator.iter_errors(json.loads(text))]
        except (json.JSONDecodeError, jsonschema.exceptions._RefResolutionError) as e:
            errors = [f"{type(e).__name__}: {e}"]
        except Exception as e:  # noqa: BLE001 - a validator crash is a finding, not a stop
            errors = [f"validator {type(e).__name__}: {e}"]
        if errors:
            res.failures.append(f"walk output invalid ({errors[0][:160]}): {text[:300]}")
        else:
            res.walks_valid += 1


def check_schema(backend: GrammarBackend, file: str, row: dict,
                 encode: Callable[[str], list[int]], stop: int, walks: int = 0,
                 structural: np.ndarray | None = None, walk_backend: GrammarBackend | None = None) -> SchemaResult:
    """Compile ``row["schema"]``, run its test instances through matchers, and check
    ``walks`` random-walk outputs with the jsonschema library."""
    res = SchemaResult(file=file, name=row["name"], backend=backend.name)
    t0 = time.perf_counter()
    try:
        grammar = backend.compile("json_schema", row["schema"])
    except ValueError as e:
        res.error = str(e)
        return res
    finally:
        res.compile_s = time.perf_counter() - t0
    res.compiled = True
    res.no_forced_text = getattr(grammar, "char_fsm_error", "")
    order = property_order(row["schema"])
    bitmask = np.zeros(bitmask_width(grammar.vocab_size), dtype=np.int32)
    for n, test in enumerate(row["tests"]):
        text = serialize(test["data"], row["schema"])
        matcher = grammar.new_matcher()
        try:
            fed = feed(matcher, encode(text), bitmask, stop)
        except RuntimeError as e:  # the engine failed mid-way: a request ends with an error, no output
            res.engine_errors += 1
            res.valid += test["valid"]
            res.invalid += not test["valid"]
            res.invalid_rejected += not test["valid"]
            if len(res.failures) < MAX_FAILURES_KEPT:
                res.failures.append(f"#{n} engine error: {str(e)[:200]}")
            continue
        bad = fed.refused_at
        res.tokens += fed.tokens
        res.grammar_s += fed.grammar_s
        res.mask_s += fed.mask_s
        res.mask_mismatches += fed.mismatches
        if test["valid"]:
            res.valid += 1
            res.valid_accepted += bad is None and matcher.is_terminated()
            if bad is not None:
                res.valid_unnamed_key += has_unnamed_key(test["data"], order)
                if len(res.failures) < MAX_FAILURES_KEPT:
                    res.failures.append(f"valid #{n} refused at token {bad}: {text[:160]}")
        else:
            res.invalid += 1
            res.invalid_rejected += bad is not None
            if bad is None and len(res.failures) < MAX_FAILURES_KEPT:
                res.failures.append(f"invalid #{n} accepted ({test['description'][:80]}): {text[:160]}")
    if walks:
        decoded = list(backend.vocab.decoded)
        if structural is None:
            structural = structural_tokens(decoded)
        if walk_backend is not None:  # generation's config (xgrammar's any-order mode lets keys repeat)
            try:
                grammar = walk_backend.compile("json_schema", row["schema"])
            except ValueError as e:  # compiles for acceptance, not as generation compiles it
                res.walk_compile_error = str(e)[:200]
                return res
        validate_walks(res, grammar, row["schema"], decoded, stop, walks, structural, bitmask)
    return res


class Checker:
    """Tokenizer + backends of the default model, built once per process."""

    def __init__(self, backends: tuple[str, ...], walks: int = 0, model: str | None = None) -> None:
        from transformers import AutoTokenizer

        from radixlm.runtime.config import default_cache_dir
        from radixlm.runtime.constrained.tokenizer_info import build_tokenizer_vocab
        from radixlm.runtime.model.source import DEFAULT_MODEL, resolve_model

        source = resolve_model(model or DEFAULT_MODEL, default_cache_dir())
        self.tokenizer = AutoTokenizer.from_pretrained(str(source.tokenizer_dir))
        vocab = build_tokenizer_vocab(self.tokenizer, source.arch.vocab_size)
        self.stop = vocab.stop_ids[0]
        self.backends = {name: FACTORIES[name](vocab, BACKEND_CONFIGS[name]) for name in backends}
        self.structural = structural_tokens(list(vocab.decoded))
        self.walks = walks
        # Random walks compile with the config generation uses (schema property order).
        self.walk_backends = {name: FACTORIES[name](vocab, GrammarConfig()) if walks else None
                              for name in backends}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check(self, backend: str, file: str, row: dict) -> SchemaResult:
        return check_schema(self.backends[backend], file, row, self.encode, self.stop, self.walks,
                            self.structural, self.walk_backends[backend])


# --- process pool with a per-task time and memory cap ---------------------------------------


def _worker(conn: Connection, backends: tuple[str, ...], walks: int, model: str | None) -> None:
    checker = Checker(backends, walks, model)
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        backend, file, row, walk = task
        checker.walks = walks if walk else 0
        conn.send(asdict(checker.check(backend, file, row)))


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


@dataclass
class _Slot:
    proc: mp.Process
    conn: Connection
    task: tuple[str, str, dict, bool] | None = None
    started: float = 0.0
    ready: bool = False


def run_pool(tasks: list[tuple[str, str, dict, bool]], backends: tuple[str, ...], workers: int,
             timeout_s: float, max_rss: int, walks: int = 0, model: str | None = None) -> Iterator[dict]:
    """Yield one result dict per task, from ``workers`` processes; a task past ``timeout_s``
    (counted once its worker is ready) or ``max_rss`` bytes kills its worker (restarted)."""
    ctx = mp.get_context("spawn")
    todo = list(reversed(tasks))

    def spawn() -> _Slot:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, backends, walks, model), daemon=True)
        proc.start()
        child.close()
        return _Slot(proc, parent)

    slots = [spawn() for _ in range(min(workers, len(tasks)))]
    pending = len(tasks)
    while pending:
        for slot in slots:
            if slot.ready and slot.task is None and todo:
                slot.task, slot.started = todo.pop(), time.monotonic()
                slot.conn.send(slot.task)
        for conn in wait([s.conn for s in slots], timeout=0.2):
            slot = next(s for s in slots if s.conn is conn)
            try:
                msg = conn.recv()
            except EOFError:
                msg = None
            if msg == "ready":
                slot.ready = True
            elif msg is not None:
                slot.task = None
                pending -= 1
                yield msg
        now = time.monotonic()
        for i, slot in enumerate(slots):
            if slot.task is None:
                if not slot.proc.is_alive() and pending:
                    raise RuntimeError(f"worker {slot.proc.pid} died with exit code {slot.proc.exitcode}")
                continue
            why = ""
            if now - slot.started > timeout_s:
                why = f"timeout: over {timeout_s:.0f} s"
            elif _rss_bytes(slot.proc.pid) > max_rss:
                why = f"memory: over {max_rss >> 20} MiB"
            elif not slot.proc.is_alive():
                why = f"crash: exit code {slot.proc.exitcode}"
            if why:
                backend, file, row = slot.task[:3]
                slot.proc.kill()
                slot.proc.join()
                pending -= 1
                yield asdict(SchemaResult(file=file, name=row["name"], backend=backend, error=why,
                                          compile_s=now - slot.started))
                slots[i] = spawn()
    for slot in slots:
        slot.conn.send(None)
        slot.proc.join(timeout=5)


# --- report ---------------------------------------------------------------------------------


def passes(r: dict) -> bool:
    """MaskBench's rule: compiled, every valid instance accepted, every invalid one refused."""
    return (bool(r["compiled"]) and not r["engine_errors"] and r["valid_accepted"] == r["valid"]
            and r["invalid_rejected"] == r["invalid"])


def summarize(results: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per backend, per file: coverage, valid acceptance, invalid rejection, µs per token."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        s = out.setdefault(r["backend"], {}).setdefault(r["file"], {
            "schemas": 0, "compiled": 0, "passing": 0, "timeouts": 0, "valid": 0, "valid_accepted": 0,
            "valid_unnamed_key": 0, "invalid": 0, "invalid_rejected": 0, "tokens": 0,
            "grammar_s": 0.0, "mask_s": 0.0, "compile_s": 0.0, "mask_mismatches": 0, "engine_errors": 0,
            "no_forced_text": 0,
            "walks": 0, "walks_finished": 0, "walks_valid": 0, "schema_errors": 0,
        })
        s["schemas"] += 1
        s["compiled"] += r["compiled"]
        s["passing"] += passes(r)
        s["timeouts"] += r["error"].startswith(("timeout", "memory", "crash"))
        s["compile_s"] += r["compile_s"]
        s["no_forced_text"] += r["compiled"] and bool(r["no_forced_text"])
        s["schema_errors"] += bool(r.get("schema_error"))
        for k in ("valid", "valid_accepted", "valid_unnamed_key", "invalid", "invalid_rejected",
                  "tokens", "grammar_s", "mask_s", "mask_mismatches", "engine_errors", "walks", "walks_finished",
                  "walks_valid"):
            s[k] += r.get(k, 0)
    for files in out.values():
        total = {k: 0 for k in next(iter(files.values()))}
        for s in files.values():
            for k, v in s.items():
                total[k] += v
        files["total"] = total
        for s in files.values():
            s["coverage"] = s["compiled"] / s["schemas"] if s["schemas"] else None
            s["pass_rate"] = s["passing"] / s["schemas"] if s["schemas"] else None
            s["wrong_acceptances"] = s["invalid"] - s["invalid_rejected"]
            s["valid_acceptance"] = s["valid_accepted"] / s["valid"] if s["valid"] else None
            s["invalid_rejection"] = s["invalid_rejected"] / s["invalid"] if s["invalid"] else None
            s["us_per_token"] = 1e6 * s["grammar_s"] / s["tokens"] if s["tokens"] else None
            s["us_per_mask"] = 1e6 * s["mask_s"] / s["tokens"] if s["tokens"] else None
            s["mean_compile_ms"] = 1e3 * s["compile_s"] / s["schemas"] if s["schemas"] else None
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(summary: dict[str, dict[str, dict[str, Any]]]) -> str:
    """A markdown table: one line per (file, backend)."""
    lines = [
        "| file | backend | schemas | compiled | passing (exact) | wrong acceptances | published coverage | "
        "valid accepted | invalid rejected | walk outputs valid | µs/mask | µs/token | mean compile ms |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    files = [f for f in (*FILES, "total") if any(f in s for s in summary.values())]
    for f in files:
        pub = ", ".join(f"{k} {v:.2f}" for k, v in PUBLISHED.get(f, {}).items()) or "-"
        for backend, per_file in summary.items():
            s = per_file.get(f)
            if s is None:
                continue
            walked = f"{s['walks_valid']}/{s['walks_finished']}" if s["walks_finished"] else "-"
            head = (f"| {f} | {backend} | {s['schemas']} | {_pct(s['coverage'])} | {_pct(s['pass_rate'])} | "
                    f"{s['wrong_acceptances']} | {pub} | ")
            lines.append(
                head + f"{s['valid_accepted']}/{s['valid']} ({_pct(s['valid_acceptance'])}) | "
                f"{s['invalid_rejected']}/{s['invalid']} ({_pct(s['invalid_rejection'])}) | {walked} | "
                f"{s['us_per_mask']:.1f} | {s['us_per_token']:.1f} | {s['mean_compile_ms']:.0f} |"
                if s["tokens"] else
                head + f"- | - | {walked} | - | - | {s['mean_compile_ms']:.0f} |"
            )
    return "\n".join(lines)


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, default=DATA_DIR)
    ap.add_argument("--files", default=",".join(FILES), help="comma-separated file stems")
    ap.add_argument("--backends", default="xgrammar,llguidance,outlines",
                    help="comma-separated backends, or all")
    ap.add_argument("--limit", type=int, default=None, help="first N schemas of each file")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default=None,
                    help="model whose tokenizer to use (default: the default model; or a folder with its config and tokenizer)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per schema and backend")
    ap.add_argument("--outlines-every", type=int, default=5,
                    help="outlines runs on every K-th schema of each file (its index build is slow)")
    ap.add_argument("--walks", type=int, default=0,
                    help="random-walk outputs per compiled schema, validated with jsonschema")
    ap.add_argument("--walk-every", type=int, default=1,
                    help="random walks on every K-th schema of each file (each needs a second compile)")
    ap.add_argument("--max-rss-mib", type=int, default=3072, help="memory cap per worker")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "jsonschemabench.json")
    args = ap.parse_args()
    if not 1 <= args.workers <= (os.cpu_count() or 1):
        ap.error(f"--workers must be 1..{os.cpu_count()}")
    backends = tuple(BACKEND_CONFIGS) if args.backends == "all" else tuple(b for b in args.backends.split(",") if b)
    for b in backends:
        if b not in BACKEND_CONFIGS:
            ap.error(f"unknown backend {b!r}; choose from {sorted(BACKEND_CONFIGS)}")
    files = [f for f in args.files.split(",") if f]
    tasks = [
        (b, f, row, i % args.walk_every == 0)
        for f in files
        for i, row in enumerate(load_rows(args.data_dir, f, args.limit))
        for b in backends
        if b != "outlines" or i % args.outlines_every == 0
    ]
    t0 = time.time()
    results = []
    for i, r in enumerate(run_pool(tasks, backends, args.workers, args.timeout, args.max_rss_mib << 20, args.walks,
                                       args.model)):
        results.append(r)
        if (i + 1) % 200 == 0:
            print(f"  {i + 1}/{len(tasks)} tasks, {time.time() - t0:.0f} s", flush=True)
    wall = time.time() - t0
    summary = summarize(results)
    print(table(summary))
    print(f"wall {wall:.0f} s, {args.workers} workers")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.platform(),
        "cpus": os.cpu_count(),
        "versions": {d: _version(d) for d in ("xgrammar", "llguidance", "outlines_core", "interegular",
                                                "transformers")},
        "command": "python benchmarks/jsonschemabench.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
        "configs": {b: asdict(BACKEND_CONFIGS[b]) for b in backends},
        "wall_s": wall,
        "summary": summary,
        "results": sorted(results, key=lambda r: (r["file"], r["name"], r["backend"])),
    }, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
