"""MaskProcess: a step's grammar masks filled in a process of its own, while the step loop makes text.

The step loop's matchers stay the authority (they accept, test, jump and decide when an output is
complete). The mask process keeps a mirror matcher per constrained request and, asked for a
step's rows, first brings each mirror to the tokens its request has taken (a rollback, then the
new tokens: the mirror's tokens are remembered here, so only the difference travels), then fills
the rows' bitmasks into shared memory. Asking returns at once; the step loop turns each sampled
token into text meanwhile and collects the masks when it needs them. A grammar engine's bitmask
fill releases the GIL, but a thread filling beside the step loop's Python still waits for the
interpreter between its calls (docs/benchmarks.md, "A step's masks on one thread"); a process
does not.

Anything the process cannot do (it is still starting, it died, a mirror disagrees, an answer is
late) leaves those rows to the step loop's own fill, so outputs never depend on it: a dead process
is logged once and not restarted. It is a fresh `python -m` process (the server's engine process
is a daemon, which may not have multiprocessing children), met over a local socket, and it ends
when the engine does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from radixlm.runtime.config import ConstraintConfig
from radixlm.runtime.constrained.grammar import bitmask_width

log = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 10.0  # an answer later than this: the process is taken for dead


# Tokens of each mirror's tail remembered to find where a request's tokens changed: a jump over
# forced text rewrites at most the last few output tokens (jump_forward.DEFAULT_WINDOW).
TAIL = 64


@dataclass(frozen=True)
class MirrorRow:
    """One row asked of the process: the request, its constraint, and the tokens it has taken
    (``tokens``, then ``pending`` if not None: a token accepted but not yet appended)."""

    rid: str
    constraint: tuple[str, Any]
    tokens: Sequence[int]
    pending: int | None = None

    def __len__(self) -> int:
        return len(self.tokens) + (self.pending is not None)

    def span(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the row."""
        out = list(self.tokens[start:end])
        if self.pending is not None and start <= len(self.tokens) < end:
            out.append(self.pending)
        return out


@dataclass
class _Mirror:
    length: int
    tail: list[int]  # its last TAIL tokens


def _kept(mirror: _Mirror, row: MirrorRow) -> int | None:
    """How many of the mirror's tokens the row still starts with; None: it changed before the
    remembered tail (the mirror is built again)."""
    start = mirror.length - len(mirror.tail)
    now = row.span(start, mirror.length)
    k = 0
    while k < len(now) and now[k] == mirror.tail[k]:
        k += 1
    if k == 0 and start > 0:
        return None
    return start + k


class MaskProcess:
    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_ids: Sequence[int], config: ConstraintConfig,
                 max_rows: int) -> None:
        self.width = bitmask_width(vocab_size)
        self.max_rows = max_rows
        self._memory = shared_memory.SharedMemory(create=True, size=4 * max_rows * self.width)
        self.masks = torch.frombuffer(self._memory.buf, dtype=torch.int32,
                                      count=max_rows * self.width).view(max_rows, self.width)
        key = secrets.token_bytes(16)
        self._listener = Listener(family="AF_UNIX", authkey=key)
        self._conn: Connection | None = None
        threading.Thread(target=self._accept, name="radixlm-masks-accept", daemon=True).start()
        env = dict(os.environ, OMP_NUM_THREADS="1", RADIXLM_MASKS_KEY=key.hex())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "--address", str(self._listener.address), "--memory", self._memory.name,
             "--rows", str(max_rows), "--tokenizer", tokenizer_dir, "--vocab-size", str(vocab_size),
             "--stop-ids", json.dumps(list(stop_ids)), "--config", json.dumps(dataclasses.asdict(config))], env=env)
        self.ready = False
        self.dead = False
        self._mirrors: dict[str, _Mirror] = {}  # what each mirror matcher has taken
        self._forgotten: list[str] = []
        self._asked: dict[str, tuple[int, int]] | None = None  # rid -> (row, tokens) of the fill in flight
        self.rows_filled = 0

    def _accept(self) -> None:
        try:
            self._conn = self._listener.accept()
        except OSError:  # closed before the process came
            pass

    @property
    def usable(self) -> bool:
        """Started and alive: fills may be asked."""
        if self.dead:
            return False
        if not self.ready:
            if self._proc.poll() is not None:
                self._died("while starting")
            elif self._conn is not None:
                try:
                    if self._conn.poll():
                        self.ready = self._conn.recv() == "ready"
                except (EOFError, OSError):
                    self._died("while starting")
        return self.ready and not self.dead

    def forget(self, rid: str) -> None:
        """The request ended: its mirror goes with the next fill."""
        if self._mirrors.pop(rid, None) is not None:
            self._forgotten.append(rid)

    def ask(self, rows: Sequence[MirrorRow]) -> bool:
        """Start filling the masks of ``rows`` (row i into ``masks[i]``); False when not asked
        (not usable, too many rows, or a fill still in flight)."""
        if not rows or len(rows) > self.max_rows or self._asked is not None or not self.usable:
            return False
        work: list[tuple[int, str, tuple[str, Any] | None, int, list[int]]] = []
        for i, row in enumerate(rows):
            n = len(row)
            mirror = self._mirrors.get(row.rid)
            keep = None if mirror is None else _kept(mirror, row)
            if mirror is None or keep is None:
                work.append((i, row.rid, row.constraint, 0, row.span(0, n)))
            else:
                work.append((i, row.rid, None, mirror.length - keep, row.span(keep, n)))
            self._mirrors[row.rid] = _Mirror(n, row.span(max(0, n - TAIL), n))
        assert self._conn is not None
        try:
            self._conn.send((self._forgotten, work))
        except (OSError, ValueError):
            self._died("while asked")
            return False
        self._forgotten = []
        self._asked = {row.rid: (i, len(row)) for i, row in enumerate(rows)}
        return True

    def collect(self) -> dict[str, tuple[int, int, bool]]:
        """Wait for the fill in flight: for each row it filled, rid -> (row in ``masks``, tokens
        its mirror had taken, whether the mask forbids anything). Rows it could not fill are
        missing (their mirrors are dropped, to be built again)."""
        asked, self._asked = self._asked, None
        if asked is None or self.dead or self._conn is None:
            return {}
        try:
            if not self._conn.poll(REPLY_TIMEOUT_S):
                raise TimeoutError(f"no answer in {REPLY_TIMEOUT_S:g} s")
            results: list[bool | None] = self._conn.recv()
        except (EOFError, OSError, TimeoutError) as e:
            self._died(f"while filling ({type(e).__name__}: {e})")
            return {}
        out = {}
        for rid, (i, n) in asked.items():
            if results[i] is None:  # the mirror failed: built again from scratch next time
                self.forget(rid)
            else:
                out[rid] = (i, n, bool(results[i]))
        self.rows_filled += len(out)
        return out

    def _died(self, when: str) -> None:
        if not self.dead:
            log.warning("the grammar mask process stopped %s; the step loop fills its own masks from now on", when)
        self.dead = True
        self._asked = None
        self._mirrors.clear()

    def shutdown(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._listener.close()
        del self.masks
        self._memory.close()
        self._memory.unlink()
        self.dead = True


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open the engine's shared memory without adopting it: before Python 3.13 a process that
    opens a segment unlinks it when it exits, unless told otherwise."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:  # Python < 3.13
        from multiprocessing import resource_tracker

        memory = shared_memory.SharedMemory(name=name)
        resource_tracker.unregister(memory._name, "shared_memory")  # type: ignore[attr-defined]
        return memory


def _serve(conn: Connection, memory_name: str, max_rows: int, tokenizer_dir: str, vocab_size: int,
           stop_ids: list[int], config: ConstraintConfig) -> None:
    """The mask process: mirror matchers by request, brought up to date and filled on demand."""
    from radixlm.runtime.constrained.grammar import accept_run, fill_masks
    from radixlm.runtime.constrained.service import GrammarService
    from radixlm.runtime.tokenizer_loader import load_tokenizer

    service = GrammarService(load_tokenizer(tokenizer_dir), vocab_size, stop_ids, config)
    memory = _attach(memory_name)
    width = bitmask_width(vocab_size)
    masks = torch.frombuffer(memory.buf, dtype=torch.int32, count=max_rows * width).view(max_rows, width)
    mirrors: dict[str, Any] = {}
    conn.send("ready")
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the step loop is gone
                break
            if msg is None:
                break
            forgotten, work = msg
            for rid in forgotten:
                mirrors.pop(rid, None)
            results: list[bool | None] = [None] * len(work)
            live, rows = [], []
            for i, rid, constraint, back, tokens in work:
                try:
                    if constraint is not None:  # a new mirror (or one built again)
                        mirrors[rid] = service.submit(*constraint).result().new_matcher()
                    m = mirrors[rid]
                    if back > 0:
                        m.rollback(back)
                    if accept_run(m, tokens) != len(tokens):
                        raise ValueError("a mirror refused a token its request took")
                except Exception:  # noqa: BLE001 - the step loop fills this row itself
                    log.exception("grammar mask process: request %s", rid)
                    mirrors.pop(rid, None)
                    continue
                live.append(mirrors[rid])
                rows.append(i)
            if live:
                for i, got in zip(rows, fill_masks(live, masks, rows)):
                    results[i] = None if isinstance(got, Exception) else got
            conn.send(results)
    finally:
        del masks
        memory.close()
        service.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description="radixlm's grammar mask process (started by an engine)")
    ap.add_argument("--address", required=True)
    ap.add_argument("--memory", required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--vocab-size", type=int, required=True)
    ap.add_argument("--stop-ids", required=True)
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    conn = Client(args.address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop("RADIXLM_MASKS_KEY")))
    # the engine's end closes the socket: recv then ends the loop, wherever the engine went
    _serve(conn, args.memory, args.rows, args.tokenizer, args.vocab_size, json.loads(args.stop_ids),
           ConstraintConfig(**json.loads(args.config)))


if __name__ == "__main__":
    main()
