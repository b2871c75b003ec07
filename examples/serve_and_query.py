"""Start `radixlm serve`, drive it over real HTTP like a small agent would, then shut it down.

    python examples/serve_and_query.py                    # the default model (SmolLM2-135M-Instruct, bf16)
    python examples/serve_and_query.py --dtype float32    # any other argument goes to `radixlm serve`

Steps: (1) a native /generate batch of 4 questions that share a few-shot prefix, printing each
answer and `meta_info.cached_tokens` (the prefix is prefilled once and then read from the radix
cache); (2) a chat completion over the OpenAI API with the official `openai` client, streamed
token by token, that builds on the answers of step 1; (3) the cache statistics of
/get_server_info. The server runs on a free port of 127.0.0.1 and gets SIGTERM at the end; the
example exits 0 once it has stopped cleanly. Under a minute on a laptop CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai

FEW_SHOT = (
    "Answer each question with one short sentence.\n\n"
    "Q: What is the capital of Italy?\nA: The capital of Italy is Rome.\n\n"
    "Q: How many days are in a week?\nA: A week has seven days.\n\n"
    "Q: What do cows drink?\nA: Cows drink water.\n\n"
)
ANSWER_TOKENS = 24  # most per answer of step 1
CHAT_TOKENS = 48  # most for the chat reply of step 2
QUESTIONS = [
    "What is the largest planet?",
    "What color is a clear daytime sky?",
    "How many legs does a spider have?",
    "What do bees make?",
]


class Server:
    """`radixlm serve` in a subprocess on a free port, its log in a temporary file."""

    def __init__(self, args: Sequence[str]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="radixlm-serve-", suffix=".log")
        cmd = [sys.executable, "-m", "radixlm.cli", "serve", "--port", str(self.port), *args]
        print(f"$ radixlm serve --port {self.port} {' '.join(args)}".rstrip())
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        os.close(fd)  # the child holds its own copy

    def wait_ready(self, deadline_s: float) -> None:
        """Poll /health until 200; raise if the process exits or the deadline passes."""
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        print(f"server ready on {self.url} after {time.monotonic() - t0:.1f} s")
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while the model loads
            if time.monotonic() - t0 > deadline_s:
                raise RuntimeError(f"the server was not ready after {deadline_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])

    def stop(self, wait_s: float = 60.0) -> int:
        """SIGTERM and wait for a clean exit (kill if it hangs); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                print(f"the server did not exit within {wait_s:.0f} s of SIGTERM; killing it", file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log_path)
        return int(self.proc.returncode)


def call(url: str, body: dict[str, Any] | None = None) -> Any:
    """GET (no body) or POST a JSON body; the parsed JSON reply. HTTP errors raise with the server's message."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None


def ask_batch(url: str) -> list[str]:
    """Step 1: one native /generate call with 4 prompts that share the few-shot prefix."""
    print("\n== 1. native /generate: a batch of 4 questions sharing a few-shot prefix")
    params = {"temperature": 0, "max_new_tokens": ANSWER_TOKENS, "stop": ["\n"]}
    outs = call(url + "/generate", {"text": [f"{FEW_SHOT}Q: {q}\nA:" for q in QUESTIONS], "sampling_params": params})
    answers = []
    for q, out in zip(QUESTIONS, outs):
        meta = out["meta_info"]
        answers.append(out["text"].strip())
        print(f"Q: {q}\nA: {answers[-1]}\n   [prompt {meta['prompt_tokens']} tokens, cached {meta['cached_tokens']}, "
              f"{meta['completion_tokens']} generated, ttft {meta['ttft'] * 1000:.0f} ms]")
    return answers


def chat_stream(url: str, answers: list[str]) -> None:
    """Step 2: a streamed chat completion through the official openai client, built on step 1."""
    print("\n== 2. OpenAI API: streamed chat completion (official openai client)")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    notes = "\n".join(f"- {q} {a}" for q, a in zip(QUESTIONS, answers))
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": f"Here are some notes:\n{notes}\nWrite one sentence that uses two of them."}]
    t0, first = time.perf_counter(), None
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=CHAT_TOKENS,
                                            stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    print()
    if usage is not None:
        print(f"   [model {model}, {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} generated, "
              f"first token after {((first or t0) - t0) * 1000:.0f} ms]")


def show_cache_stats(url: str) -> None:
    """Step 3: what the radix cache holds and how many prompt tokens it served."""
    print("\n== 3. /get_server_info stats")
    info = call(url + "/get_server_info")
    stats = info["stats"] or {}
    for key, value in stats.items():
        print(f"   {key}: {value}")
    prompt, cached = stats.get("prompt_tokens_total"), stats.get("cached_tokens_total")
    if prompt:
        print(f"   => {cached} of {prompt} prompt tokens came from the radix cache ({cached / prompt:.0%})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Start radixlm serve and query it over HTTP.",
                                 epilog="Other arguments are passed to `radixlm serve` (e.g. --dtype float32).")
    ap.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for /health")
    ns, serve_args = ap.parse_known_args(argv)
    t0 = time.perf_counter()
    server = Server(serve_args)
    ok = False
    try:
        server.wait_ready(ns.startup_timeout)
        answers = ask_batch(server.url)
        chat_stream(server.url, answers)
        show_cache_stats(server.url)
        ok = True
    except (RuntimeError, openai.OpenAIError) as e:
        print(f"error: {e}", file=sys.stderr)
    finally:  # also on Ctrl-C: never leave the server running
        if server.proc.poll() is None:
            print("\nstopping the server (SIGTERM)")
        code = server.stop()
    print(f"server exited with code {code}; {time.perf_counter() - t0:.1f} s in all")
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
