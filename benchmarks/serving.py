"""Online serving benchmark: stream a synthetic workload at a running `radixlm serve`.

Every request streams (greedy, `ignore_eos`, so output lengths are fixed); the client measures
TTFT, inter-token latencies (from SSE chunk arrival times) and E2E per request, and reports
throughput and p50/p90/p99 latencies as a table and a JSON file.

    python benchmarks/serving.py --url http://127.0.0.1:30000 --num-requests 200 --request-rate 4
    python benchmarks/serving.py --launch --num-requests 64 --concurrency 16 --input-len 256 \\
        --output-len 64 --shared-prefix-len 128 --compare-engine [-- engine flags, e.g. --dtype float32]

Arguments this script does not know are forwarded to `radixlm serve` (with `--launch` only).

Workload: prompts are random token ids in [100, 40000) (`--api native`, sent as `input_ids`) or
those ids decoded to text (`--api openai`, sent to /v1/completions, so the server re-tokenizes
and prompt lengths drift a little). `--shared-prefix-len N` makes every prompt start with the
same N tokens; `--input-len` counts them. Lengths are uniform in [L*(1-r), L*(1+r)] for
`--range-ratio r` (0: fixed). Arrivals are Poisson at `--request-rate` (inf: all at once), and
`--concurrency` caps the requests in flight; both may be given.

ITL: a chunk that brings k new tokens after a gap g counts k latencies of g/k (as SGLang's
bench_serving); with `--api openai` the token count per chunk is unknown, so each content chunk
counts once.

`--compare-engine` runs the same workload (same prompts, arrivals and concurrency cap) through
an in-process `Engine` built from the server's engine config (from /get_server_info, with its
KV pool size), via `Engine.async_stream`, and reports the server's overhead: the difference in
mean E2E and TTFT. A server launched here is stopped before the engine loads, so the two never
share the CPU. The in-process engine has no thread of its own: the coroutine that awaits drives
its steps on the event loop. So requests that arrive together are admitted a step apart (a
higher TTFT than the server's, whose engine runs in its own process), and a coroutine can get
two tokens back to back (ITL ~0 ms, then one long gap); E2E is the fairest comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

TOKEN_ID_RANGE = (100, 40000)  # ordinary tokens in Llama-family vocabularies: no specials, no bytes
HEALTH_POLL_S = 0.25
STOP_WAIT_S = 60.0
WARMUP = (16, 4)  # prompt tokens, output tokens of the untimed warm-up request


@dataclass(frozen=True)
class Settings:
    """One benchmark run, as given on the command line."""

    url: str | None = None
    launch: bool = False
    server_args: tuple[str, ...] = ()
    launch_timeout: float = 300.0
    api_key: str | None = None
    api: str = "native"
    num_requests: int = 64
    request_rate: float = math.inf
    concurrency: int | None = None
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    shared_prefix_len: int = 0
    seed: int = 0
    keep_cache: bool = False
    compare_engine: bool = False
    out: str = "benchmarks/results/serving.json"

    def __post_init__(self) -> None:
        if self.launch == (self.url is not None):
            raise ValueError("give exactly one of --url or --launch")
        if self.server_args and not self.launch:
            raise ValueError(f"unknown arguments {list(self.server_args)}: server flags need --launch")
        if self.api not in ("native", "openai"):
            raise ValueError(f"--api must be native or openai, got {self.api!r}")
        if self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be > 0 (inf: all at once)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if not 0 <= self.range_ratio < 1:
            raise ValueError("--range-ratio must be in [0, 1)")
        if self.output_len < 1 or self.input_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if self.shared_prefix_len < 0 or self.shared_prefix_len >= self.min_input_len:
            raise ValueError(f"--shared-prefix-len must be in [0, {self.min_input_len}): every prompt "
                             "needs at least one token of its own after the shared prefix")

    @property
    def min_input_len(self) -> int:
        return max(1, int(self.input_len * (1 - self.range_ratio)))


@dataclass(frozen=True)
class Workload:
    """The requests to send: prompts as token ids (and as text for the OpenAI API)."""

    prompt_ids: list[list[int]]
    prompt_texts: list[str] | None
    output_lens: list[int]
    arrivals: list[float]  # seconds after the start


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# -- workload ------------------------------------------------------------------------------
def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def build_workload(s: Settings, vocab_size: int, decode: Callable[[list[int]], str] | None) -> Workload:
    """Random prompts (shared prefix first), output lengths and Poisson arrival times, all from --seed."""
    rng = np.random.default_rng(s.seed)
    lo, hi = TOKEN_ID_RANGE[0], min(TOKEN_ID_RANGE[1], vocab_size)
    prefix = [int(t) for t in rng.integers(lo, hi, size=s.shared_prefix_len)]
    input_lens = _lengths(rng, s.input_len, s.range_ratio, s.num_requests)
    output_lens = _lengths(rng, s.output_len, s.range_ratio, s.num_requests)
    suffixes = [[int(t) for t in rng.integers(lo, hi, size=n - len(prefix))] for n in input_lens]
    prompt_ids = [prefix + suffix for suffix in suffixes]
    texts = None
    if decode is not None:  # decode the parts apart, so every text starts with the same prefix text
        prefix_text = decode(prefix) if prefix else ""
        texts = [prefix_text + decode(suffix) for suffix in suffixes]
    if math.isinf(s.request_rate):
        arrivals = [0.0] * s.num_requests
    else:
        gaps = rng.exponential(1.0 / s.request_rate, size=s.num_requests - 1)
        arrivals = [0.0, *(float(t) for t in np.cumsum(gaps))]
    return Workload(prompt_ids, texts, output_lens, arrivals)


async def run_workload(w: Workload, concurrency: int | None,
                       send: Callable[[int], Awaitable[RequestResult]]) -> tuple[list[RequestResult], float]:
    """Send request i at its arrival time (waiting for a slot if capped); returns results and duration."""
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        delay = start + w.arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is None:
            return await send(i)
        async with slots:
            return await send(i)

    results = await asyncio.gather(*(one(i) for i in range(len(w.prompt_ids))))
    return list(results), time.perf_counter() - start


class _Timer:
    """Turns token arrivals into TTFT and inter-token latencies."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last = self.start
        self.tokens = 0
        self.ttft = 0.0
        self.itl: list[float] = []

    def arrived(self, new_tokens: int) -> None:
        if new_tokens <= 0:
            return
        now = time.perf_counter()
        if self.tokens == 0:
            self.ttft = now - self.start
        else:
            self.itl.extend([(now - self.last) / new_tokens] * new_tokens)
        self.last, self.tokens = now, self.tokens + new_tokens

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


# -- HTTP clients --------------------------------------------------------------------------
async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """Parsed `data: {json}` events up to `data: [DONE]`."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:"):].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)
    raise aiohttp.ClientPayloadError("the stream ended before data: [DONE]")


async def native_request(session: aiohttp.ClientSession, url: str, ids: list[int], n: int) -> RequestResult:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    timer = _Timer()
    try:
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                return RequestResult(False, error=f"HTTP {resp.status}: {(await resp.text())[:300]}")
            meta: dict[str, Any] = {}
            async for event in sse_events(resp):
                if "error" in event:
                    return RequestResult(False, error=str(event["error"])[:300])
                timer.arrived(len(event["output_ids"]) - timer.tokens)
                meta = event.get("meta_info") or meta
    except aiohttp.ClientError as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    return RequestResult(True, len(ids), timer.tokens, int(meta.get("cached_tokens") or 0),
                         timer.ttft, timer.elapsed(), timer.itl)


async def openai_request(session: aiohttp.ClientSession, url: str, model: str, text: str, n: int) -> RequestResult:
    body = {"model": model, "prompt": text, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    timer = _Timer()
    usage: dict[str, Any] = {}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return RequestResult(False, error=f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for event in sse_events(resp):
                if "error" in event:
                    return RequestResult(False, error=str(event["error"])[:300])
                if event.get("choices") and event["choices"][0].get("text"):
                    timer.arrived(1)
                usage = event.get("usage") or usage
    except aiohttp.ClientError as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return RequestResult(True, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", timer.tokens)),
                         int(cached), timer.ttft, timer.elapsed(), timer.itl)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_json(url: str, api_key: str | None, method: str = "GET", timeout: float = 30.0) -> Any:
    req = urllib.request.Request(url, method=method, headers=_headers(api_key))
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


async def bench_server(s: Settings, url: str, w: Workload, model: str) -> tuple[list[RequestResult], float]:
    connector = aiohttp.TCPConnector(limit=0)  # the concurrency cap is ours, not the pool's
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=_headers(s.api_key),
                                     read_bufsize=1 << 20) as session:
        async def send(i: int) -> RequestResult:
            if s.api == "native":
                return await native_request(session, url, w.prompt_ids[i], w.output_lens[i])
            assert w.prompt_texts is not None
            return await openai_request(session, url, model, w.prompt_texts[i], w.output_lens[i])

        warm = await native_request(session, url, w.prompt_ids[0][: WARMUP[0]], WARMUP[1])
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        if not s.keep_cache:
            await asyncio.to_thread(http_json, url + "/flush_cache", s.api_key, "POST")
        return await run_workload(w, s.concurrency, send)


# -- in-process engine ---------------------------------------------------------------------
def engine_options(server_info: dict[str, Any]) -> dict[str, Any]:
    """The server's engine config as flat Engine(...) options, with its actual KV pool size."""
    cfg = server_info["engine_config"]
    opts: dict[str, Any] = {k: v for part in ("model", "cache", "scheduler") for k, v in cfg[part].items()}
    opts["attention_backend"] = cfg["attention_backend"]
    opts["max_total_tokens"] = server_info["engine"].get("max_total_tokens") or opts["max_total_tokens"]
    return opts


async def engine_request(engine: Any, prompt: str | list[int], n: int) -> RequestResult:
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    timer = _Timer()
    meta: dict[str, Any] = {}
    kwargs: dict[str, Any] = {"input_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    try:
        async for chunk in engine.async_stream(sampling_params=params, **kwargs):
            timer.arrived(len(chunk["output_ids"]))  # engine chunks carry deltas
            meta = chunk["meta_info"] or meta
    except ValueError as e:
        return RequestResult(False, error=str(e))
    return RequestResult(True, int(meta.get("prompt_tokens", 0)), timer.tokens, int(meta.get("cached_tokens") or 0),
                         timer.ttft, timer.elapsed(), timer.itl)


def bench_engine(s: Settings, w: Workload, options: dict[str, Any]) -> tuple[list[RequestResult], float]:
    from radixlm.runtime.engine import Engine

    engine = Engine(**options)
    try:
        engine.generate(input_ids=w.prompt_ids[0][: WARMUP[0]], sampling_params={"max_new_tokens": WARMUP[1]})
        if not s.keep_cache:
            engine.flush_cache()

        async def send(i: int) -> RequestResult:
            prompt = w.prompt_ids[i] if s.api == "native" else (w.prompt_texts or [])[i]
            return await engine_request(engine, prompt, w.output_lens[i])

        return asyncio.run(run_workload(w, s.concurrency, send))
    finally:
        engine.shutdown()


# -- report --------------------------------------------------------------------------------
def _stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_len for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "first_error": next((r.error for r in results if not r.ok), None),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "cache_hit_rate": sum(r.cached_tokens for r in done) / prompt_tokens if prompt_tokens else None,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_s": _stats([r.ttft for r in done]),
        "itl_s": _stats([x for r in done for x in r.itl]),
        "e2e_s": _stats([r.e2e for r in done]),
        "requests": [{"prompt_len": r.prompt_len, "output_len": r.output_len, "cached_tokens": r.cached_tokens,
                      "ttft_s": r.ttft, "e2e_s": r.e2e, "error": r.error or None} for r in results],
    }


def overhead(server: dict[str, Any], engine: dict[str, Any]) -> dict[str, float | None]:
    """Server minus in-process engine, per request (seconds)."""
    def diff(metric: str) -> float | None:
        a, b = server[metric]["mean"], engine[metric]["mean"]
        return None if a is None or b is None else a - b
    return {"mean_e2e_s": diff("e2e_s"), "mean_ttft_s": diff("ttft_s"), "mean_itl_s": diff("itl_s")}


def format_table(s: Settings, server: dict[str, Any], engine: dict[str, Any] | None) -> str:
    cols = ["server"] + (["engine", "server-engine"] if engine else [])
    mode = f"rate {s.request_rate:g} req/s" + (f", concurrency {s.concurrency}" if s.concurrency else "")
    lines = [(f"radixlm serving benchmark: {s.api} API, {s.num_requests} requests, {mode}, input {s.input_len} "
              f"(shared prefix {s.shared_prefix_len}), output {s.output_len}, range ratio {s.range_ratio:g}"),
             f"{'':<28}" + "".join(f"{c:>15}" for c in cols)]

    def row(label: str, get: Callable[[dict[str, Any]], Any], fmt: str, delta: bool = False) -> None:
        cells = [get(server)] + ([get(engine)] if engine else [])
        if engine and delta:
            a, b = cells
            cells.append(None if a is None or b is None else a - b)
        elif engine:
            cells.append(None)
        lines.append(f"{label:<28}" + "".join(f"{'-' if c is None else format(c, fmt):>15}" for c in cells))

    row("completed / failed", lambda m: f"{m['completed']} / {m['failed']}", "s")
    row("duration (s)", lambda m: m["duration_s"], ".2f", delta=True)
    row("request throughput (req/s)", lambda m: m["request_throughput"], ".2f")
    row("output throughput (tok/s)", lambda m: m["output_throughput"], ".1f")
    row("total throughput (tok/s)", lambda m: m["total_throughput"], ".1f")
    row("cache hit rate", lambda m: m["cache_hit_rate"], ".1%")
    for metric, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        for stat in ("mean", "p50", "p90", "p99"):
            row(f"{label} {stat} (ms)", lambda m, k=metric, st=stat: None if m[k][st] is None else 1000 * m[k][st],
                ".1f", delta=True)
    for name, m in (("server", server), ("engine", engine)):
        if m and m["first_error"]:
            lines.append(f"{name}: first error: {m['first_error']}")
    return "\n".join(lines)


# -- launching a server --------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LaunchedServer:
    """`radixlm serve` as a subprocess on a free port; logs go to a temporary file."""

    def __init__(self, args: Sequence[str], deadline_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="radixlm-serve-", suffix=".log")
        cmd = [sys.executable, "-m", "radixlm.cli", "serve", "--port", str(self.port), *args]
        started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        os.close(fd)  # the child holds its own copy
        try:
            self._wait_healthy(deadline_s)
            self.ready_s = time.monotonic() - started
            print(f"server ready (/health 200) {self.ready_s:.1f} s after launch")
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} while starting; "
                                   f"its log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            if time.monotonic() > end:
                raise RuntimeError(f"the server was not healthy after {deadline_s:.0f} s; its log:\n{self.log_tail()}")
            time.sleep(HEALTH_POLL_S)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> int:
        """SIGTERM, wait for a clean exit (kill after STOP_WAIT_S); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log_path)
        return int(self.proc.returncode)


# -- main ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> Settings:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Unknown arguments are passed to `radixlm serve` (with --launch).")
    ap.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:30000")
    ap.add_argument("--launch", action="store_true", help="start `radixlm serve` on a free port, stop it at the end")
    ap.add_argument("--launch-timeout", type=float, default=300.0, help="seconds to wait for /health (default 300)")
    ap.add_argument("--api-key", help="bearer token, if the server has --api-key")
    ap.add_argument("--api", choices=("native", "openai"), default="native",
                    help="native: /generate with input_ids; openai: /v1/completions with text")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf)")
    ap.add_argument("--concurrency", type=int, help="most requests in flight (default: no cap)")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens, shared prefix included")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [L*(1-r), L*(1+r)]")
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-cache", action="store_true", help="do not flush the radix cache before the run")
    ap.add_argument("--compare-engine", action="store_true", help="also run the workload on an in-process Engine")
    ap.add_argument("--out", default="benchmarks/results/serving.json")
    ns, extra = ap.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    return Settings(url=ns.url.rstrip("/") if ns.url else None, launch=ns.launch, server_args=tuple(extra),
                    launch_timeout=ns.launch_timeout, api_key=ns.api_key, api=ns.api,
                    num_requests=ns.num_requests, request_rate=ns.request_rate, concurrency=ns.concurrency,
                    input_len=ns.input_len, output_len=ns.output_len, range_ratio=ns.range_ratio,
                    shared_prefix_len=ns.shared_prefix_len, seed=ns.seed, keep_cache=ns.keep_cache,
                    compare_engine=ns.compare_engine, out=ns.out)


def make_decoder(tokenizer_path: str) -> Callable[[list[int]], str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        s = parse_args(argv)
    except ValueError as e:
        print(f"serving.py: error: {e}", file=sys.stderr)
        return 2
    try:
        server = LaunchedServer(s.server_args, s.launch_timeout) if s.launch else None
    except RuntimeError as e:
        print(f"serving.py: error: {e}", file=sys.stderr)
        return 1
    try:
        url = server.url if server else s.url
        assert url is not None
        model_info = http_json(url + "/get_model_info", s.api_key)
        server_info = http_json(url + "/get_server_info", s.api_key)
        decode = make_decoder(model_info["tokenizer_path"]) if s.api == "openai" else None
        workload = build_workload(s, int(model_info["vocab_size"]), decode)
        results, duration = asyncio.run(bench_server(s, url, workload, model_info["served_model_name"]))
    finally:
        if server is not None:
            code = server.stop()
            if code != 0:
                print(f"warning: the server exited with code {code}", file=sys.stderr)
    server_summary = summarize(results, duration)
    engine_summary = None
    if s.compare_engine:
        engine_summary = summarize(*bench_engine(s, workload, engine_options(server_info)))

    print(format_table(s, server_summary, engine_summary))
    report = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv] if argv is None else ["python", __file__, *argv]),
        "settings": {**asdict(s), "request_rate": str(s.request_rate)},
        "environment": {"python": platform.python_version(), "platform": platform.platform(),
                        "machine": platform.machine(), "cpu_count": os.cpu_count()},
        "model": model_info.get("model_name"),
        "server_version": server_info.get("version"),
        "engine_config": server_info.get("engine_config"),
        "engine_info": server_info.get("engine"),
        "server": server_summary,
        "engine": engine_summary,
        "overhead": overhead(server_summary, engine_summary) if engine_summary else None,
    }
    Path(s.out).parent.mkdir(parents=True, exist_ok=True)
    Path(s.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {s.out}")
    return 0 if server_summary["failed"] == 0 and (engine_summary is None or engine_summary["failed"] == 0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
