"""MaskProcesses: a step's grammar masks filled in processes of their own, while the step loop makes text.

The step loop's matchers stay the authority (they accept, test, jump and decide when an output is
complete). Each mask process keeps a mirror matcher for each of its constrained requests (a
request stays with one process) and, asked for a step's rows, first brings each mirror to the
tokens its request has taken (a rollback after a jump, then the new tokens: only the difference
travels), then fills the rows' bitmasks into shared memory. Several processes split the rows, and
each has its own compile of a grammar, so they do not contend for one lexer. Asking returns at once; the step loop turns each sampled
token into text meanwhile and collects the masks when it needs them. A grammar engine's bitmask
fill releases the GIL, but a thread filling beside the step loop's Python still waits for the
interpreter between its calls (docs/benchmarks.md, "A step's masks on one thread"); a process
does not.

Anything the processes cannot do (still starting, a mirror that cannot take its tokens, an answer
that is late, a process that died) leaves those rows to the step loop's own fill, so outputs never
depend on them: once one process is gone, all are stopped and the step loop fills every mask (a
warning is logged). Each is a fresh `python -m` process (the server's engine process is a daemon,
which may not have multiprocessing children), met over a local socket; it ends when the engine does.
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
import time
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


@dataclass(frozen=True)
class MirrorRow:
    """One row asked of the processes: the request, its constraint, and the tokens it has taken
    (``tokens``, then ``pending`` if not None: a token accepted but not yet appended).
    ``version`` changes whenever tokens already taken were rewritten (a jump over forced text:
    the request's forced-token count); while it stands, tokens were only appended, and only
    those travel. A new version builds the mirror again (jumps are rare where masks are filled
    ahead: on CUDA only while one request runs)."""

    rid: str
    constraint: tuple[str, Any]
    tokens: Sequence[int]
    pending: int | None = None
    version: int = 0

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
    worker: int  # the process that holds it
    length: int  # tokens it has taken
    version: int  # its request's version then


class _Worker:
    """One mask process: started, met over a local socket, asked and answered."""

    def __init__(self, args: list[str]) -> None:
        key = secrets.token_bytes(16)
        self.listener = Listener(family="AF_UNIX", authkey=key)
        self.conn: Connection | None = None
        self.ready = False
        threading.Thread(target=self._accept, name="radixlm-masks-accept", daemon=True).start()
        env = dict(os.environ, OMP_NUM_THREADS="1", RADIXLM_MASKS_KEY=key.hex())
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, "--address", str(self.listener.address), *args],
                                     env=env)

    def _accept(self) -> None:
        try:
            self.conn = self.listener.accept()
        except OSError:  # closed before the process came
            pass

    def started(self) -> bool:
        """Whether it said it is ready; raises EOFError if it is gone."""
        if not self.ready:
            if self.proc.poll() is not None:
                raise EOFError(f"exited with code {self.proc.returncode}")
            if self.conn is not None and self.conn.poll():
                self.ready = self.conn.recv() == "ready"
        return self.ready

    def stop(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(None)
            except (OSError, ValueError):
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


class MaskProcesses:
    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_ids: Sequence[int], config: ConstraintConfig,
                 max_rows: int, count: int = 1) -> None:
        """``count`` processes, for steps of up to ``max_rows`` constrained rows."""
        if count < 1:
            raise ValueError(f"mask processes: count must be >= 1, got {count}")
        self.width = bitmask_width(vocab_size)
        self.max_rows = max_rows
        self._memory = shared_memory.SharedMemory(create=True, size=4 * max_rows * self.width)
        self.masks = torch.frombuffer(self._memory.buf, dtype=torch.int32,
                                      count=max_rows * self.width).view(max_rows, self.width)
        args = ["--memory", self._memory.name, "--rows", str(max_rows), "--tokenizer", tokenizer_dir,
                "--vocab-size", str(vocab_size), "--stop-ids", json.dumps(list(stop_ids)),
                "--config", json.dumps(dataclasses.asdict(config))]
        self._workers = [_Worker(args) for _ in range(count)]
        self.ready = False
        self.dead = False
        self._mirrors: dict[str, _Mirror] = {}  # what each mirror matcher has taken
        self._load = [0] * count  # requests mirrored by each process
        self._forgotten: list[list[str]] = [[] for _ in range(count)]
        self._asked: list[list[tuple[str, int, int]]] | None = None  # per process: (rid, row, tokens) in flight
        self.rows_filled = 0
        self.process_seconds = 0.0  # the processes' own time on fills, all together

    @property
    def usable(self) -> bool:
        """All started and alive: fills may be asked."""
        if self.dead:
            return False
        if not self.ready:
            try:
                self.ready = all([w.started() for w in self._workers])
            except (EOFError, OSError) as e:
                self._died(f"while starting ({e})")
        return self.ready and not self.dead

    def forget(self, rid: str) -> None:
        """The request ended: its mirror goes with the next fill."""
        mirror = self._mirrors.pop(rid, None)
        if mirror is not None:
            self._forgotten[mirror.worker].append(rid)
            self._load[mirror.worker] -= 1

    def ask(self, rows: Sequence[MirrorRow]) -> bool:
        """Start filling the masks of ``rows`` (row i into ``masks[i]``); False when not asked
        (not usable, too many rows, or a fill still in flight)."""
        if not rows or len(rows) > self.max_rows or self._asked is not None or not self.usable:
            return False
        work: list[list[tuple[int, str, tuple[str, Any] | None, int, list[int]]]] = [[] for _ in self._workers]
        asked: list[list[tuple[str, int, int]]] = [[] for _ in self._workers]
        for i, row in enumerate(rows):
            n = len(row)
            mirror = self._mirrors.get(row.rid)
            if mirror is None:
                w = self._load.index(min(self._load))
                self._load[w] += 1
                mirror = self._mirrors[row.rid] = _Mirror(w, 0, -1)  # no version yet: built below
            w = mirror.worker
            if mirror.version == row.version and mirror.length <= n:  # only appended since
                work[w].append((i, row.rid, None, mirror.length, row.span(mirror.length, n)))
            else:  # new, or rewritten: (built again) from the constraint and every token
                work[w].append((i, row.rid, row.constraint, 0, row.span(0, n)))
            mirror.length, mirror.version = n, row.version
            asked[w].append((row.rid, i, n))
        try:
            for w, worker in enumerate(self._workers):
                if work[w]:  # (forgotten mirrors wait for the process's next work)
                    assert worker.conn is not None
                    worker.conn.send((self._forgotten[w], work[w]))
                    self._forgotten[w] = []
        except (OSError, ValueError) as e:
            self._died(f"while asked ({e})")
            return False
        self._asked = asked
        return True

    def collect(self) -> dict[str, tuple[int, int, bool]]:
        """Wait for the fill in flight: for each row filled, rid -> (row in ``masks``, tokens its
        mirror had taken, whether the mask forbids anything). Rows that could not be filled are
        missing (their mirrors are dropped, to be built again)."""
        asked, self._asked = self._asked, None
        if asked is None or self.dead:
            return {}
        out = {}
        try:
            for worker, rows in zip(self._workers, asked):
                if not rows:
                    continue
                assert worker.conn is not None
                if not worker.conn.poll(REPLY_TIMEOUT_S):
                    raise TimeoutError(f"no answer in {REPLY_TIMEOUT_S:g} s")
                results, spent = worker.conn.recv()
                self.process_seconds += spent
                for (rid, i, n), got in zip(rows, results):
                    if got is None:  # the mirror failed: built again from scratch next time
                        self.forget(rid)
                    else:
                        out[rid] = (i, n, got)
        except (EOFError, OSError, TimeoutError) as e:
            self._died(f"while filling ({type(e).__name__}: {e})")
            return {}
        self.rows_filled += len(out)
        return out

    def _died(self, when: str) -> None:
        if not self.dead:
            log.warning("a grammar mask process stopped %s; the step loop fills its own masks from now on", when)
            for w in self._workers:
                if w.proc.poll() is None:
                    w.proc.kill()
        self.dead = True
        self._asked = None
        self._mirrors.clear()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def shutdown(self) -> None:
        for w in self._workers:
            w.stop()
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
    """A mask process: mirror matchers by request (with the tokens each took), brought up to date
    and filled on demand."""
    from radixlm.runtime.constrained.grammar import accept_run, fill_masks
    from radixlm.runtime.constrained.service import GrammarService
    from radixlm.runtime.tokenizer_loader import load_tokenizer

    service = GrammarService(load_tokenizer(tokenizer_dir), vocab_size, stop_ids, config)
    memory = _attach(memory_name)
    width = bitmask_width(vocab_size)
    masks = torch.frombuffer(memory.buf, dtype=torch.int32, count=max_rows * width).view(max_rows, width)
    mirrors: dict[str, Any] = {}
    grammars: dict[tuple[str, str], Any] = {}  # by the constraint as sent: no parsing a spec twice
    conn.send("ready")
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the step loop is gone
                break
            if msg is None:
                break
            t0 = time.perf_counter()
            forgotten, work = msg
            for rid in forgotten:
                mirrors.pop(rid, None)
            results: list[bool | None] = [None] * len(work)
            live, rows, at = [], [], []
            for k, (i, rid, constraint, start, tokens) in enumerate(work):
                try:
                    if constraint is not None:  # a new mirror (or one built again)
                        kind, spec = constraint
                        key = (kind, spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True))
                        if key not in grammars:
                            grammars[key] = service.submit(kind, spec).result()
                        mirrors[rid] = (grammars[key].new_matcher(), 0)
                    m, taken = mirrors[rid]
                    if taken != start:
                        raise ValueError(f"the mirror has {taken} tokens, not {start}")
                    if accept_run(m, tokens) != len(tokens):
                        raise ValueError("a mirror refused a token its request took")
                    mirrors[rid] = (m, start + len(tokens))
                except Exception:  # noqa: BLE001 - the step loop fills this row itself
                    log.exception("grammar mask process: request %s", rid)
                    mirrors.pop(rid, None)
                    continue
                live.append(m)
                rows.append(i)
                at.append(k)
            if live:
                for k, got in zip(at, fill_masks(live, masks, rows)):
                    results[k] = None if isinstance(got, Exception) else got
            conn.send((results, time.perf_counter() - t0))
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
