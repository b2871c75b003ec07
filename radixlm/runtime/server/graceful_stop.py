"""Stop a server process the way an operator would: SIGTERM, a wait for its clean exit, SIGKILL
after that; for scripts that start servers (benchmarks, tests)."""

from __future__ import annotations

import signal
import subprocess

STOP_WAIT_S = 60.0  # for a SIGTERMed server to drain and exit before it is killed


def graceful_stop(proc: subprocess.Popen[bytes], wait_s: float = STOP_WAIT_S) -> int:
    """SIGTERM `proc` (if it still runs), wait up to `wait_s` for it to exit, kill it after
    that; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)
