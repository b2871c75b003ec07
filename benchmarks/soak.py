"""Soak and overload runs against a real `radixlm serve` (docs/reliability.md, "Soak" and "Overload").

Soak: thousands of mixed requests with bounded concurrency — native /generate, OpenAI
/v1/completions and /v1/chat/completions, streaming and not, constrained (json_schema, regex,
choices) and free, n > 1, logprobs, multi-turn sessions — while some clients disconnect
mid-request and some requests are aborted through /abort_request. Afterwards: nothing runs, the
KV slots add up (free + cached = total, nothing locked), the radix cache passes its integrity
check (GET /debug/check), a flush frees every slot, the processes' RSS is back near where it was
after the warm-up, and every completed greedy or seeded request, sent again alone, gives the
same text.

Overload: one burst of greedy `ignore_eos` requests whose prompts plus outputs add up to
`--overload-factor` times the KV pool, at a server started with a small pool and a queue limit:
every request gets its full answer or a 429 with a JSON body (none lost, no crash), requests
wait and are retracted, and every answer equals the same request run alone.

    python benchmarks/soak.py --launch --num-requests 2000 --concurrency 24
    python benchmarks/soak.py --launch --overload-only
    python benchmarks/soak.py --url http://127.0.0.1:30000 --num-requests 300  # started with --debug-routes true

`--launch` starts the servers itself (fp32, so greedy texts compare exactly; the soak server with
`--debug-routes true`); with `--url`, the server must have been started with it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from radixlm.testing import graceful_stop, http_call

WORDS = ("apple river stone cloud music paper garden window silver orange planet bridge forest "
         "candle engine market winter summer violet harbor lantern meadow pocket rocket").split()
SYSTEMS = ("You are a helpful assistant. Answer briefly.",
           "You are a poet. Reply in one short line.",
           "You are a careful accountant who double-checks every number before answering.")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
REGEX = r"[0-9]{1,3}(\.[0-9])?"
CHOICES = ["red", "green", "blue"]
IDLE_DEADLINE_S = 120.0
LAUNCH_DEADLINE_S = 300.0
SERVER_ARGS = ("--dtype", "float32")


@dataclass
class Call:
    """One generation request of the soak: the route, its body, and the fault to inject."""

    index: int
    route: str
    body: dict[str, Any]
    fault: str = ""  # "", "disconnect" (client goes away), "abort" (POST /abort_request mid-stream)
    fault_after: float = 0.0  # disconnect: SSE events to read first (stream), or seconds to wait (plain)

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def comparable(self) -> bool:
        """Greedy or seeded: the same request alone must give the same text."""
        p = self.body.get("sampling_params", self.body)
        return p.get("temperature", 1.0) == 0 or p.get("seed") is not None


@dataclass
class Outcome:
    """What one call got: HTTP status, per-choice texts and finish reasons, and which fault hit it."""

    index: int
    route: str
    status: int = 0
    texts: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    fault: str = ""  # the fault that took effect: "disconnect", "abort", or ""
    error: str = ""
    output_ids: list[list[int]] = field(default_factory=list)  # native routes only
    replay: dict[str, Any] | None = None  # the body that, sent alone, must give the same texts

    @property
    def completed(self) -> bool:
        return self.status == 200 and not self.fault and not self.error and all(
            f in ("stop", "length") for f in self.finish) and bool(self.finish)


# -- workload ------------------------------------------------------------------------------
def _prompt(rng: random.Random) -> str:
    return f"{rng.choice(SYSTEMS)} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24)))


def _sampling(rng: random.Random, max_new: int) -> dict[str, Any]:
    p: dict[str, Any] = {"max_new_tokens": rng.randint(1, max_new)}
    r = rng.random()
    if r < 0.6:
        p["temperature"] = 0
    elif r < 0.85:
        p.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 20))
    else:
        p["temperature"] = 1.0  # unseeded: not compared
    return p


def _constraint(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("json_schema", "regex", "choices"))
    return {"json_schema": json.dumps(SCHEMA)} if kind == "json_schema" else {"regex": REGEX} if kind == "regex" \
        else {"choices": CHOICES}


def build_calls(rng: random.Random, n: int, max_new: int, disconnect_rate: float, abort_rate: float) -> list[Call]:
    """n single calls of every kind; faults drawn independently."""
    calls = []
    for i in range(n):
        route = rng.choices(("/generate", "/v1/completions", "/v1/chat/completions"), (0.5, 0.25, 0.25))[0]
        sp = _sampling(rng, max_new)
        constrained = rng.random() < 0.2
        logprobs = rng.random() < 0.2
        n_choices = 2 if rng.random() < 0.15 else 1
        stream = rng.random() < 0.5
        if route == "/generate":
            if constrained:
                sp.update(_constraint(rng))
            if n_choices > 1:
                sp["n"] = n_choices
            body: dict[str, Any] = {"text": _prompt(rng), "sampling_params": sp, "stream": stream}
            if logprobs:
                body.update(return_logprob=True, top_logprobs_num=2)
        else:
            body = {"max_tokens": sp.pop("max_new_tokens"), **sp, "n": n_choices, "stream": stream}
            if route == "/v1/completions":
                body["prompt"] = _prompt(rng)
                if logprobs:
                    body["logprobs"] = 2
                if constrained:
                    body["regex"] = REGEX
            else:
                body["messages"] = [{"role": "system", "content": rng.choice(SYSTEMS)},
                                    {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))}]
                if logprobs:
                    body.update(logprobs=True, top_logprobs=2)
                if constrained:
                    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
            if stream and rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        call = Call(i, route, body)
        r = rng.random()
        if r < disconnect_rate:
            call.fault = "disconnect"
            call.fault_after = rng.randint(1, 3) if stream else rng.uniform(0.02, 0.4)
        elif r < disconnect_rate + abort_rate:
            call.fault = "abort"
            body["stream"] = True
            body.pop("stream_options", None)
            if route == "/generate":
                body["rid"] = f"soak-abort-{i}"
                body["sampling_params"].update(max_new_tokens=max(4 * max_new, 32), ignore_eos=True)
            else:
                call.route, call.body = "/generate", {"text": _prompt(rng), "rid": f"soak-abort-{i}", "stream": True,
                                                      "sampling_params": {"max_new_tokens": max(4 * max_new, 32),
                                                                          "ignore_eos": True, "temperature": 0}}
        if call.fault and call.route == "/generate" and "rid" not in call.body:
            call.body["rid"] = f"soak-{i}"
        calls.append(call)
    return calls


# -- one call ------------------------------------------------------------------------------
async def _events(resp: aiohttp.ClientResponse):
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            payload = line[6:]
            yield "[DONE]" if payload == b"[DONE]" else json.loads(payload)


class _Texts:
    """Per-choice texts and finish reasons, from whole responses or stream chunks."""

    def __init__(self, route: str) -> None:
        self.route = route
        self.text: dict[int, str] = {}
        self.finish: dict[int, str] = {}
        self.ids: dict[int, list[int]] = {}  # native output ids (cumulative in chunks too)

    def add_native(self, item: dict[str, Any], i: int) -> None:
        self.text[i] = item["text"]  # cumulative, in whole responses and in chunks alike
        self.ids[i] = item["output_ids"]
        reason = item["meta_info"].get("finish_reason")
        if reason:
            self.finish[i] = reason["type"]

    def add_openai(self, choice: dict[str, Any], stream: bool) -> None:
        i = choice["index"]
        if self.route == "/v1/completions":
            piece = choice.get("text") or ""
        else:
            piece = (choice.get("delta") if stream else choice.get("message")) or {}
            piece = piece.get("content") or ""
        self.text[i] = (self.text.get(i, "") if stream else "") + piece
        if choice.get("finish_reason"):
            self.finish[i] = choice["finish_reason"]

    def add(self, obj: Any, stream: bool) -> None:
        if "error" in obj:
            raise RuntimeError(f"error event: {obj['error']}")
        if self.route == "/generate":
            items = obj if isinstance(obj, list) else [obj]
            for k, item in enumerate(items):
                self.add_native(item, item.get("index", k) if stream else k)
        else:
            for choice in obj["choices"]:
                self.add_openai(choice, stream)

    def result(self) -> tuple[list[str], list[str]]:
        keys = sorted(self.text)
        return [self.text[k] for k in keys], [self.finish.get(k, "") for k in keys]


def _replay_body(call: Call) -> dict[str, Any]:
    body = {k: v for k, v in call.body.items() if k not in ("stream", "stream_options", "rid")}
    return json.loads(json.dumps(body))


async def run_call(http: aiohttp.ClientSession, url: str, call: Call) -> Outcome:
    """Send one call, inject its fault, and collect what came back."""
    out = Outcome(call.index, call.route)
    texts = _Texts(call.route)
    try:
        if call.fault == "disconnect" and not call.stream:
            try:
                async with asyncio.timeout(call.fault_after):
                    async with http.post(url + call.route, json=call.body) as resp:
                        out.status = resp.status
                        texts.add(await resp.json(), False)
            except TimeoutError:
                out.fault = "disconnect"
                return out
        else:
            async with http.post(url + call.route, json=call.body) as resp:
                out.status = resp.status
                if resp.status != 200:
                    out.error = (await resp.text())[:300]
                    return out
                if not call.stream:
                    texts.add(await resp.json(), False)
                else:
                    seen = 0
                    async for ev in _events(resp):
                        if ev == "[DONE]":
                            break
                        texts.add(ev, True)
                        seen += 1
                        if call.fault == "disconnect" and seen >= call.fault_after:
                            resp.close()  # drop the connection mid-stream
                            out.fault = "disconnect"
                            return out
                        if call.fault == "abort" and seen == 1:
                            async with http.post(url + "/abort_request", json={"rid": call.body["rid"]}) as r:
                                if r.status != 200:
                                    out.error = f"abort_request answered {r.status}"
                            out.fault = "abort"
    except (aiohttp.ClientError, RuntimeError, json.JSONDecodeError, KeyError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.texts, out.finish = texts.result()
    out.output_ids = [texts.ids[k] for k in sorted(texts.ids)]
    if out.fault == "abort" and "abort" not in out.finish:
        out.fault = ""  # it finished before the abort arrived: an ordinary completion
    if out.fault == "abort" and any(f not in ("abort", "stop", "length") for f in out.finish):
        out.error = f"aborted request ended with {out.finish}"  # a copy may finish before the abort lands
    if call.comparable and not out.fault:
        out.replay = {"route": call.route, "body": _replay_body(call)}
    return out


async def run_session(http: aiohttp.ClientSession, url: str, rng: random.Random, tokenizer: Any, index: int,
                      max_new: int, disconnect_last: bool) -> list[Outcome]:
    """Open a session, send 2-4 greedy turns (some streamed) as token ids, close it. Each turn's
    replay is the whole history as one plain prompt. With disconnect_last, the last turn is a
    stream the client drops."""
    async with http.post(url + "/open_session", json={"capacity": 2048}) as r:
        if r.status != 200:
            return [Outcome(index, "/open_session", r.status, error=(await r.text())[:300])]
        sid = await r.json()
    history: list[int] = []
    prev: str | None = None
    outs = []
    turns = rng.randint(2, 4)
    for t in range(turns):
        text = f"{rng.choice(SYSTEMS)} " if t == 0 else ""
        new = tokenizer.encode(text + " ".join(rng.choices(WORDS, k=rng.randint(2, 8))), add_special_tokens=False)
        sp = {"temperature": 0, "max_new_tokens": rng.randint(1, max_new)}
        body: dict[str, Any] = {"input_ids": new, "sampling_params": sp, "rid": f"sess-{index}-{t}",
                                "session_params": {"id": sid, "rid": prev}}
        drop = disconnect_last and t == turns - 1
        body["stream"] = drop or rng.random() < 0.5
        call = Call(index, "/generate", body, "disconnect" if drop else "", 1)
        out = await run_call(http, url, call)
        out.route = "session"
        if out.completed:
            out.replay = {"route": "/generate", "body": {"input_ids": history + new, "sampling_params": sp}}
            outs.append(out)
            history += new + out.output_ids[0]
            prev = body["rid"]
        else:
            outs.append(out)
            if not out.fault:
                break
    async with http.post(url + "/close_session", json={"session_id": sid}) as r:
        if r.status != 200:
            outs.append(Outcome(index, "/close_session", r.status, error=(await r.text())[:300]))
    return outs


# -- server-side checks --------------------------------------------------------------------
def http_json(url: str, path: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    return http_call(url + path, "POST" if body is not None else "GET", body, timeout=timeout)


def wait_idle(url: str, deadline_s: float = IDLE_DEADLINE_S) -> dict[str, Any]:
    """Poll /get_server_info until no request runs, waits or is in flight in the server."""
    end = time.monotonic() + deadline_s
    while True:
        _, info = http_json(url, "/get_server_info")
        st = info["stats"]
        if st["running_requests"] == 0 and st["waiting_requests"] == 0 and info["requests_in_flight"] == 0:
            return info
        if time.monotonic() > end:
            raise RuntimeError(f"the server did not become idle within {deadline_s:.0f} s: {st}")
        time.sleep(0.1)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def process_rss(url: str) -> dict[str, float]:
    _, info = http_json(url, "/get_server_info")
    return {"server": rss_mib(info["server_pid"]), "engine": rss_mib(info["engine_pid"])}


def kv_checks(url: str) -> dict[str, Any]:
    """With the server idle: /debug/check before and after /flush_cache."""
    info = wait_idle(url)
    status, before = http_json(url, "/debug/check")
    if status != 200:
        raise RuntimeError(f"/debug/check answered {status}: {before} (start the server with --debug-routes true)")
    flush_status, _ = http_json(url, "/flush_cache", {})
    _, after = http_json(url, "/debug/check")
    return {
        "running_requests": info["stats"]["running_requests"],
        "before_flush": before,
        "flush_status": flush_status,
        "after_flush": after,
        "no_leak": before["ok"] and before["kv_slots_free"] + before["cache_tokens"] == before["kv_slots_total"]
        and before["cache_protected_tokens"] == before["session_pinned_tokens"],
        "all_free_after_flush": after["ok"] and after["kv_slots_free"] == after["kv_slots_total"],
    }


async def replay(url: str, outcomes: list[Outcome], limit: int | None, rng: random.Random) -> dict[str, Any]:
    """Send comparable completed requests again, one at a time; list those whose text differs."""
    todo = [o for o in outcomes if o.completed and o.replay is not None]
    if limit is not None and len(todo) > limit:
        todo = rng.sample(todo, limit)
    mismatches = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        for o in todo:
            async with http.post(url + o.replay["route"], json=o.replay["body"]) as resp:
                got = _Texts(o.replay["route"])
                got.add(await resp.json(), False)
            texts, _ = got.result()
            if texts != o.texts:
                mismatches.append({"index": o.index, "route": o.route, "body": o.replay["body"],
                                   "soak": o.texts, "alone": texts})
    return {"compared": len(todo), "mismatches": mismatches}


# -- soak ----------------------------------------------------------------------------------
async def drive(url: str, calls: list[Call], sessions: int, concurrency: int, seed: int, max_new: int,
                disconnect_rate: float, tokenizer: Any) -> list[Outcome]:
    """Run the calls and the session conversations, interleaved, at most `concurrency` at a time."""
    rng = random.Random(seed + 1)
    sem = asyncio.Semaphore(concurrency)
    jobs: list[tuple[str, Any]] = [("call", c) for c in calls] + [("session", i) for i in range(sessions)]
    rng.shuffle(jobs)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as http:
        async def one(kind: str, item: Any) -> list[Outcome]:
            async with sem:
                if kind == "call":
                    return [await run_call(http, url, item)]
                r = random.Random(seed * 7919 + item)
                return await run_session(http, url, r, tokenizer, len(calls) + item, max_new,
                                         r.random() < disconnect_rate)

        results = await asyncio.gather(*[one(k, x) for k, x in jobs])
    return [o for group in results for o in group]


def load_tokenizer(url: str) -> Any:
    from transformers import AutoTokenizer

    _, info = http_json(url, "/get_model_info")
    return AutoTokenizer.from_pretrained(info["tokenizer_path"])


def soak(url: str, num_requests: int, concurrency: int, seed: int = 0, max_new: int = 8,
         disconnect_rate: float = 0.1, abort_rate: float = 0.05, session_share: float = 0.05,
         warmup: int = 50, replay_limit: int | None = None) -> dict[str, Any]:
    """The whole soak against a running server (started with --debug-routes true): warm-up,
    RSS, the mixed load, the checks, RSS again, the replay. Returns the report."""
    tokenizer = load_tokenizer(url)
    rng = random.Random(seed)
    sessions = int(num_requests * session_share)
    warm = build_calls(random.Random(seed + 99), warmup, max_new, disconnect_rate, abort_rate)
    asyncio.run(drive(url, warm, max(1, warmup // 20), concurrency, seed + 99, max_new, disconnect_rate, tokenizer))
    kv_checks(url)  # idle, flushed: the baseline
    rss_before = process_rss(url)
    _, info = http_json(url, "/get_server_info")
    retractions0 = info["stats"]["retractions"]
    calls = build_calls(rng, num_requests - sessions, max_new, disconnect_rate, abort_rate)
    t0 = time.perf_counter()
    outcomes = asyncio.run(drive(url, calls, sessions, concurrency, seed, max_new, disconnect_rate, tokenizer))
    load_s = time.perf_counter() - t0
    checks = kv_checks(url)
    rss_after = process_rss(url)
    _, info = http_json(url, "/get_server_info")
    t1 = time.perf_counter()
    rep = asyncio.run(replay(url, outcomes, replay_limit, rng))
    replay_s = time.perf_counter() - t1
    final = kv_checks(url)
    statuses = Counter(o.status for o in outcomes)
    return {
        "requests": len(outcomes),
        "session_turns": sum(o.route == "session" for o in outcomes),
        "by_route": dict(Counter(o.route for o in outcomes)),
        "statuses": {str(k): v for k, v in statuses.items()},
        "completed": sum(o.completed for o in outcomes),
        "disconnects": sum(o.fault == "disconnect" for o in outcomes),
        "aborts": sum(o.fault == "abort" for o in outcomes),
        "errors": [asdict(o) for o in outcomes if o.error][:20],
        "num_errors": sum(bool(o.error) for o in outcomes),
        "retractions": info["stats"]["retractions"] - retractions0,
        "checks": checks,
        "checks_after_replay": final,
        "rss_mib_before": rss_before,
        "rss_mib_after": rss_after,
        "replay": rep,
        "load_seconds": load_s,
        "replay_seconds": replay_s,
    }


# -- overload ------------------------------------------------------------------------------
def overload_bodies(seed: int, count: int, prompt_len: int, output_len: int, vocab: tuple[int, int] = (100, 40000)
                    ) -> list[dict[str, Any]]:
    """Greedy ignore_eos requests of fixed prompt and output lengths (random token ids); half stream."""
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(*vocab) for _ in range(prompt_len)], "stream": i % 2 == 1,
             "sampling_params": {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}}
            for i in range(count)]


async def _burst(url: str, bodies: list[dict[str, Any]]) -> tuple[list[tuple[int, Any]], int]:
    """Send every body at once; (status, final output or error body) each, and the most requests
    seen waiting in the engine (polled while the burst runs)."""
    most_waiting = 0
    done = asyncio.Event()

    async def watch(http: aiohttp.ClientSession) -> None:
        nonlocal most_waiting
        while not done.is_set():
            async with http.get(url + "/get_server_info") as r:
                most_waiting = max(most_waiting, (await r.json())["stats"]["waiting_requests"])
            await asyncio.sleep(0.05)

    async def one(http: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, Any]:
        async with http.post(url + "/generate", json=body) as resp:
            if resp.status != 200 or not body["stream"]:
                return resp.status, await resp.json(content_type=None)
            last = None
            async for ev in _events(resp):
                if ev != "[DONE]":
                    last = ev
            return resp.status, last

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as http:
        watcher = asyncio.create_task(watch(http))
        results = await asyncio.gather(*[one(http, b) for b in bodies])
        done.set()
        await watcher
    return results, most_waiting


def overload(url: str, factor: float = 3.0, prompt_len: int = 32, output_len: int = 32, seed: int = 0,
             replay_limit: int | None = None) -> dict[str, Any]:
    """Offer `factor` times the KV pool in one burst; count answers and 429s; replay answers alone
    (all, or `replay_limit` of them: every retracted one first)."""
    _, info = http_json(url, "/get_server_info")
    pool = info["stats"]["kv_slots_total"]
    limit = info["server_settings"]["max_queued_requests"]
    retractions0 = info["stats"]["retractions"]
    count = -(-int(factor * pool) // (prompt_len + output_len))
    bodies = overload_bodies(seed, count, prompt_len, output_len)
    t0 = time.perf_counter()
    results, most_waiting = asyncio.run(_burst(url, bodies))
    seconds = time.perf_counter() - t0
    full, rejected, lost = [], 0, []
    for i, (status, got) in enumerate(results):
        if status == 200 and got and got["meta_info"]["completion_tokens"] == output_len \
                and got["meta_info"]["finish_reason"]["type"] == "length":
            full.append((i, got))
        elif status == 429 and isinstance(got, dict) and got.get("error", {}).get("type") == "rate_limit_error":
            rejected += 1
        else:
            lost.append({"index": i, "status": status, "got": str(got)[:300]})
    _, info = http_json(url, "/get_server_info")
    retractions = info["stats"]["retractions"] - retractions0
    retracted = sum(1 for _, g in full if g["meta_info"]["retractions"] > 0)
    checks = kv_checks(url)
    sample = full
    if replay_limit is not None and len(full) > replay_limit:  # every retracted request, then the first others
        retracted_first = sorted(full, key=lambda x: -x[1]["meta_info"]["retractions"])
        sample = retracted_first[:max(replay_limit, retracted)]
    mismatches = []
    for i, got in sample:
        body = {k: v for k, v in bodies[i].items() if k != "stream"}
        status, alone = http_json(url, "/generate", body, timeout=300)
        if status != 200 or alone["output_ids"] != got["output_ids"]:
            mismatches.append(i)
    return {
        "kv_pool_tokens": pool, "max_queued_requests": limit, "requests": count,
        "tokens_per_request": prompt_len + output_len,
        "offered_tokens": count * (prompt_len + output_len),
        "overload_factor": count * (prompt_len + output_len) / pool,
        "full_answers": len(full), "rejected_429": rejected, "lost": lost,
        "most_waiting": most_waiting, "retractions": retractions, "retracted_requests": retracted,
        "compared_alone": len(sample), "mismatches": mismatches, "checks": checks, "seconds": seconds,
    }


# -- launching -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], threads: int = 1) -> tuple[subprocess.Popen, str, str]:
    """Start `radixlm serve` on a free port, torch on `threads` threads (OMP_NUM_THREADS);
    (process, url, log path) once /health answers 200."""
    port = _free_port()
    fd, log_path = tempfile.mkstemp(prefix="radixlm-soak-", suffix=".log")
    cmd = [sys.executable, "-m", "radixlm.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    os.close(fd)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + LAUNCH_DEADLINE_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; log: {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url, log_path
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > end:
            proc.kill()
            raise RuntimeError(f"the server was not healthy within {LAUNCH_DEADLINE_S:.0f} s")
        time.sleep(0.25)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--launch", action="store_true")
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--disconnect-rate", type=float, default=0.1)
    ap.add_argument("--abort-rate", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=200, help="requests before the first RSS reading")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of launched servers")
    ap.add_argument("--replay-limit", type=int, default=None, help="compare at most this many (default: all)")
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool of the soak server (--launch)")
    ap.add_argument("--overload-pool", type=int, default=1024, help="KV pool of the overload server (--launch)")
    ap.add_argument("--overload-queue", type=int, default=32, help="--max-queued-requests of the overload server")
    ap.add_argument("--overload-factor", type=float, default=3.0)
    ap.add_argument("--soak-only", action="store_true")
    ap.add_argument("--overload-only", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/soak.json")
    s = ap.parse_args()
    if s.launch == (s.url is not None):
        ap.error("give exactly one of --url or --launch")
    report: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "command": shlex.join([Path(sys.executable).name, *sys.argv]),
                              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    t0 = time.perf_counter()
    if not s.overload_only:
        proc = None
        url = s.url
        if s.launch:
            args = [*SERVER_ARGS, "--max-total-tokens", str(s.max_total_tokens), "--debug-routes", "true"]
            proc, url, _ = launch(args, s.threads)
            report["soak_server_args"] = args
        try:
            report["soak"] = soak(url, s.num_requests, s.concurrency, s.seed, s.max_new_tokens, s.disconnect_rate,
                                  s.abort_rate, warmup=s.warmup, replay_limit=s.replay_limit)
        finally:
            if proc is not None:
                report["soak_server_exit"] = graceful_stop(proc)
        print(json.dumps({k: v for k, v in report["soak"].items() if k != "errors"}, indent=1))
    if not s.soak_only and s.launch:
        args = [*SERVER_ARGS, "--max-total-tokens", str(s.overload_pool), "--max-queued-requests",
                str(s.overload_queue), "--debug-routes", "true"]
        proc, url, _ = launch(args, s.threads)
        report["overload_server_args"] = args
        try:
            report["overload"] = overload(url, s.overload_factor, seed=s.seed)
        finally:
            report["overload_server_exit"] = graceful_stop(proc)
        print(json.dumps(report["overload"], indent=1))
    report["seconds"] = time.perf_counter() - t0
    Path(s.out).parent.mkdir(parents=True, exist_ok=True)
    Path(s.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {s.out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
