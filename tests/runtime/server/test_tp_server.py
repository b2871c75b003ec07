"""A tensor-parallel server (TP=2 over gloo, dummy:llama-tiny): a worker rank that dies or hangs
takes the server to 503 and a restart, never a hang; a --tp-size that cannot work fails at start
with one line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from server_harness import Server, process_running, start_server

from radixlm.testing import poll

pytestmark = pytest.mark.slow

GREEDY = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
LONG = {"text": "Count.", "sampling_params": {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True}}
DIST_TIMEOUT_S = 5
DEADLINE_S = 300.0  # polls give up after this (the machine is shared and slow); never a sleep


@pytest.fixture(scope="module")
def server():
    s = start_server("--model", "dummy:llama-tiny", "--dtype", "float32", "--tp-size", "2",
                     "--max-total-tokens", "4096", "--dist-timeout", str(DIST_TIMEOUT_S),
                     "--restart-on-failure", "--max-restarts", "2")
    yield s
    assert s.stop() == 0


def workers(server: Server) -> list[int]:
    info = server.server_info()
    assert info["engine"]["tp_size"] == 2
    pids: list[int] = info["engine"]["tp_worker_pids"]
    return pids


def wait_restarted(server: Server, restarts: int) -> None:
    poll("the restarted engine",
         lambda: server.get("/health")[0] == 200 and server.server_info()["engine_restarts"] == restarts)


def test_worker_killed_while_idle_restarts_the_engine(server: Server):
    reference = server.generate(GREEDY)["text"]
    [worker] = workers(server)
    engine = server.server_info()["engine_pid"]
    os.kill(worker, signal.SIGKILL)
    # (the 503's reason gains "; restarting it" once the server has decided to restart)
    health = poll("the restart", lambda: (r := server.get("/health"))[0] == 503
                  and "restarting" in r[1]["error"]["message"] and r[1])
    assert f"RankFailure: tensor-parallel rank 1 (pid {worker}) exited with code -9" in health["error"]["message"]
    wait_restarted(server, 1)
    info = server.server_info()
    assert info["engine_pid"] != engine and workers(server) != [worker]
    assert server.generate(GREEDY)["text"] == reference


def test_hung_worker_fails_the_request_within_the_timeout_then_restarts(server: Server):
    reference = server.generate(GREEDY)["text"]
    [worker] = workers(server)
    os.kill(worker, signal.SIGSTOP)  # alive but silent: only the collective's timeout can notice
    try:
        start = time.monotonic()
        status, body = server.post("/generate", LONG)
        assert status == 503, body
        assert "tensor-parallel" in body["error"]["message"]
        assert time.monotonic() - start < DEADLINE_S
        poll("the failed engine to kill its stopped worker", lambda: not process_running(worker))
    finally:
        with contextlib.suppress(ProcessLookupError):  # (if the test failed before the engine did)
            os.kill(worker, signal.SIGKILL)
    wait_restarted(server, 2)
    assert server.generate(GREEDY)["text"] == reference


@pytest.mark.parametrize(("args", "says"), [
    (["--tp-size", "2"], "--tp-size 2 does not fit this model: it must divide the model's 9 attention heads; "
                         "use one of 1, 3"),
    (["--model", "dummy:llama-tiny", "--device", "cuda", "--tp-size", "4"], "--tp-size 4 needs 4 GPUs"),
])
def test_tp_size_that_cannot_work_fails_at_start_in_one_line(args, says):
    proc = subprocess.run([sys.executable, "-m", "radixlm.cli", "serve", "--port", "1", *args],
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr
