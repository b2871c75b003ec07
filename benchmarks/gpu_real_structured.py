"""JSON extraction on a real model on the GPU: free text vs json_schema (jumps by the measured
cost, the same only while one request runs, every jump, no jump, and masks only on a rejected
greedy token), at batch 1 (prompts one at a time) / 16 / 64 (docs/benchmarks.md, "Structured output on the GPU with real
weights"). Random weights force nothing past the first key, so jump-forward cannot pay off there;
the default model's own weights (its GGUF file) write the records benchmarks/structured_output.py
asks for, whose keys and punctuation the schema forces.

    python3 benchmarks/gpu_real_structured.py --model path/to/SmolLM2-135M-Instruct.Q4_1.gguf [--out results.json]
        [--profile]   (then: where a bs64 json_schema run spends host time, cProfile)
        [--phases]    (host ms per bs64 step: waiting for tokens, output path, masks, the rest)
        [--batches 1,16,64] [--modes 1,2,3,4,5,6]   (indices into MODES; free text always runs)
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import time
from typing import Any

from structured_output import SCHEMA, _valid, prompts

from radixlm.runtime.constrained.jump_forward import JumpPolicy
from radixlm.runtime.engine import Engine

OUT = 96
# The records' mean length in tokens under the schema (44.0 a record at bs16/64 in every run so
# far): "free, same length" writes as many tokens of free text, so the two pay the same prefill
# and admission per token and the ratio shows the grammar's own cost.
SAME_LENGTH = 44
MODES = ["free", "json_schema", "json_schema, jumps alone", "json_schema, every jump", "json_schema, no jump-forward",
         "json_schema, mask on reject", "free, same length",
         "json_schema, jumps alone, fill pool 12"]


def _params(mode: str) -> dict[str, Any]:
    """A mode's sampling params (its jump policy and mask config are set on the engine)."""
    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": OUT}
    if mode.startswith("free"):
        params["ignore_eos"] = True
        params["max_new_tokens"] = SAME_LENGTH if mode == "free, same length" else OUT
    else:
        params.update(json_schema=json.dumps(SCHEMA), jump_forward=mode != "json_schema, no jump-forward")
    return params


def run(engine: Engine, chats: list, mode: str, one_at_a_time: bool) -> dict[str, Any]:
    params = _params(mode)
    core = engine.core
    policy, config = core.output.jump_policy, core.grammar.config
    if mode == "json_schema, every jump":
        core.output.jump_policy = JumpPolicy()
    if mode.startswith("json_schema, jumps alone"):  # the measured policy, and jumps only while one request runs
        core.output.jump_policy = dataclasses.replace(policy, max_running=1)
    backend = core.grammar.service.backend
    executor = getattr(backend, "_executor", None)
    if mode == "json_schema, jumps alone, fill pool 12" and executor is not None:  # llguidance's default pool
        import llguidance

        backend._executor = llguidance.LLExecutor(12)
        backend._cache.clear()  # the compiled grammar hands its matchers the pool
    if mode == "json_schema, mask on reject":
        core.grammar.config = dataclasses.replace(config, mask_on_reject=True)
    engine.flush_cache()
    t0 = time.perf_counter()
    try:
        outs = [engine.generate(c, params) for c in chats] if one_at_a_time else engine.generate(chats, params)
    finally:
        core.output.jump_policy, core.grammar.config = policy, config
        if executor is not None and backend._executor is not executor:
            backend._executor = executor
            backend._cache.clear()
    dt = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    passes = sum(o["meta_info"]["forward_passes"] for o in outs)
    return {"out_tok_s": tokens / dt, "tokens_per_output": tokens / len(outs), "passes_per_output": passes / len(outs),
            "valid": sum(_valid(o["text"]) for o in outs) if not mode.startswith("free") else None, "n": len(outs)}


def phases(engine: Engine, chats: list, mode: str) -> dict[str, float]:
    """Host milliseconds per step of one batched run, by phase: waiting for the sampled tokens
    (the device's share), the output path (grammar accept, text, stops), masking (of which the
    grammar engine's fill and the apply), and the rest (scheduling, launching the forward and
    the sampling)."""
    from radixlm.runtime.constrained import stage as grammar_stage

    core = engine.core
    spent: dict[str, float] = {"wait": 0.0, "output": 0.0, "mask": 0.0, "fill": 0.0, "apply": 0.0}
    saved = (core.runner.fetch_ids, core.output.append, core.grammar.mask, grammar_stage.fill_masks,
             grammar_stage.apply_bitmask_)

    def timed(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return call

    core.runner.fetch_ids = lambda ids: timed("wait", saved[0](ids))  # type: ignore[method-assign]
    core.output.append = timed("output", saved[1])  # type: ignore[method-assign]
    core.grammar.mask = timed("mask", saved[2])  # type: ignore[method-assign]
    grammar_stage.fill_masks = timed("fill", saved[3])
    grammar_stage.apply_bitmask_ = timed("apply", saved[4])
    params = _params(mode)
    engine.flush_cache()
    steps0 = core.steps
    t0 = time.perf_counter()
    try:
        engine.generate(chats, params)
    finally:
        total = time.perf_counter() - t0
        del core.runner.fetch_ids, core.output.append, core.grammar.mask
        grammar_stage.fill_masks, grammar_stage.apply_bitmask_ = saved[3], saved[4]
    steps = max(core.steps - steps0, 1)
    out = {k: 1e3 * v / steps for k, v in spent.items()}
    out["rest"] = 1e3 * total / steps - out["wait"] - out["output"] - out["mask"]
    out["step"] = 1e3 * total / steps
    out["steps"] = steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--bs1-prompts", type=int, default=8, help="prompts run one at a time for batch 1")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--phases", action="store_true", help="host ms per bs64 step by phase")
    ap.add_argument("--modes", default=",".join(str(i) for i in range(len(MODES))),
                    help="indices into MODES (0, free text, always runs)")
    args = ap.parse_args()
    engine = Engine(args.model, device=args.device, dtype="bfloat16", max_running_requests=128)
    engine.core.warm_up()
    p = engine.core.output.jump_policy
    print(f"jump policy: decode step {1e3 * p.decode_s:.2f} ms, extend penalty {1e3 * p.penalty_s:.2f} ms, "
          f"min gain at 1/16/64 running: {p.min_gain(1)}/{p.min_gain(16)}/{p.min_gain(64)}", flush=True)
    modes = [MODES[0]] + [MODES[int(i)] for i in args.modes.split(",") if int(i)]
    res: dict[str, Any] = {"jump_policy": dataclasses.asdict(p)}
    for bs in (int(b) for b in args.batches.split(",")):
        chats, alone = (prompts(args.bs1_prompts), True) if bs == 1 else (prompts(bs), False)
        for mode in modes:
            run(engine, chats, mode, alone)  # warm: lazily built lexer states, first shapes
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for mode in modes + modes[::-1]:  # each mode twice, in both orders; the faster run kept
            runs[mode].append(run(engine, chats, mode, alone))
        res[bs] = {m: max(rs, key=lambda r: r["out_tok_s"]) for m, rs in runs.items()}
        row = {m: r["out_tok_s"] for m, r in res[bs].items()}
        j = res[bs][modes[1]]
        valid = "/".join(f"{r['valid']}" for m, r in res[bs].items() if not m.startswith("free"))
        print(f"bs{bs}: free {row['free']:.0f} out tok/s; " + "; ".join(
            f"{m} {row[m]:.0f} ({row[m] / row['free']:.2f}x)" for m in modes[1:])
            + f"; {modes[1]} passes/out {j['passes_per_output']:.1f} for {j['tokens_per_output']:.1f} tokens;"
            f" valid {valid} of {j['n']}", flush=True)
        if "free, same length" in row:
            short = row["free, same length"]
            print(f"bs{bs} against free text of the same length ({short:.0f} out tok/s): " + "; ".join(
                f"{m} {row[m] / short:.2f}x" for m in modes[1:] if not m.startswith("free")), flush=True)
    if args.phases:
        for mode in ("free", "free, same length", "json_schema, no jump-forward") * 2:
            ph = phases(engine, prompts(64), mode)
            res[f"phases bs64 {mode}"] = ph
            print(f"phases bs64 {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()) + " (ms a step)",
                  flush=True)
    if args.profile:
        chats = prompts(64)
        prof = cProfile.Profile()
        prof.enable()
        r = run(engine, chats, "json_schema", False)
        prof.disable()
        print(f"profiled bs64 json_schema: {r['out_tok_s']:.0f} out tok/s", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
