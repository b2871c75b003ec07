"""Start a real `radixlm serve` process on 127.0.0.1 for DSL tests (as tests/runtime/server does)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

START_DEADLINE_S = 240.0


@dataclass
class DslServer:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        os.unlink(self.log_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*args: str) -> DslServer:
    """Start `python -m radixlm.cli serve` and wait (bounded) until /health answers 200."""
    port = _free_port()
    fd, log_path = tempfile.mkstemp(prefix="radixlm-dsl-serve-", suffix=".log")
    cmd = [sys.executable, "-m", "radixlm.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    os.close(fd)
    server = DslServer(proc, f"http://127.0.0.1:{port}", log_path)
    end = time.monotonic() + START_DEADLINE_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while the model loads
        if time.monotonic() > end:
            server.stop()
            raise RuntimeError(f"the server was not healthy within {START_DEADLINE_S:.0f} s:\n{server.log()}")
        time.sleep(0.2)
