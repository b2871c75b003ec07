"""The native kernels' thread pool, in IR: how a job is posted, run in parts and joined.

The protocol, over the control block (`native_abi.CONTROL`, zeroed before the workers start):

- The caller writes the job into `job` (its op, then its op's struct of words), then (with
  workers) bumps `seq` (seq_cst) and calls `wake`; it runs part 0 itself (`part`, which
  dispatches on the op), then waits until each worker's `done` equals the new `seq`.
- Worker i (`worker(ctl, i)`, on a Python thread that ctypes let go of the GIL) runs part i + 1
  of every `seq` it has not seen, then stores that `seq` in its `done` (release). Between jobs
  it spins on `seq` with `pause`: SPIN_BUSY times while `busy` is set (a forward pass, whose
  next product comes in microseconds), SPIN_IDLE times otherwise, then sleeps: it sets its
  `asleep`, reads `seq` again (seq_cst, so that a post between its last look and `asleep`
  is seen) and waits on the futex at `seq` for the value it last saw (the low 32 bits: a futex
  word is 32 bits, little-endian).
- `wake` wakes all sleepers on `seq` at once if any worker has `asleep` set; a worker woken
  clears `asleep` and looks at `seq` again (a spurious wake just loops).
- `stop` set, then a `seq` bump and `wake`: every worker returns.
- `run_on(ctl, workers, threads)` runs the posted job on these workers (threads 0) or, where
  the module was given libgomp's entry points, on `threads` threads of the OpenMP pool that
  torch's own ops run on (`GOMP_parallel` over `omp_parts`; `omp_parts` holds the part count).

The futex is called through libc's `syscall`, with the numbers of Linux on x86-64 (the only
target the kernels are built for: their instructions are x86's).
"""

from __future__ import annotations

from collections.abc import Mapping

from radixlm.runtime.kernels import native_abi as abi
from radixlm.runtime.kernels.ir_builder import FunctionBuilder

SYS_FUTEX = 202  # Linux x86-64's futex syscall number (x86-32: 240, arm64: 98)
FUTEX_PRIVATE_FLAG = 128  # the futex is private to this process
FUTEX_WAIT_PRIVATE = 0 | FUTEX_PRIVATE_FLAG  # FUTEX_WAIT (0): sleep while *addr == val
FUTEX_WAKE_PRIVATE = 1 | FUTEX_PRIVATE_FLAG  # FUTEX_WAKE (1): wake up to val sleepers
WAKE_ALL = 2**31 - 1  # FUTEX_WAKE's count for "all"
SPIN_BUSY = 200_000  # pause loops a worker spins for the next job while a forward pass is busy
SPIN_IDLE = 64  # ... and otherwise, before it sleeps

_C = abi.CONTROL
_WORKERS = _C.index("workers")
_DONE, _ASLEEP = abi.WORKER.index("done"), abi.WORKER.index("asleep")
DECLARATIONS = "declare i64 @syscall(i64, ...)\ndeclare void @llvm.x86.sse2.pause()\n"


def _worker_slot(dst: str, worker: str, field: str) -> str:
    """%dst: a pointer to `field` of worker `worker`'s slot (an i64 operand)."""
    return _C.gep(dst, "%ctl", "workers", f"i64 {worker}", f"i32 {abi.WORKER.index(field)}")


def _worker(types: frozenset[str]) -> str:
    b = FunctionBuilder(abi.WORKER_LOOP, types)
    b.emit(f"""entry:
{_C.gep("seqp", "%ctl", "seq")}
{_C.gep("stopp", "%ctl", "stop")}
{_C.gep("busyp", "%ctl", "busy")}
{_worker_slot("donep", "%i", "done")}
{_worker_slot("sleepp", "%i", "asleep")}
  %part = add i64 %i, 1
  br label %wait
wait:
  %seen = phi i64 [0, %entry], [%seen, %spin], [%seen, %woke], [%s, %ran]
  %spins = phi i64 [0, %entry], [%spins.next, %spin], [0, %woke], [0, %ran]
  %s = load atomic i64, ptr %seqp acquire, align 8
  %stop = load atomic i64, ptr %stopp monotonic, align 8
  %stopping = icmp ne i64 %stop, 0
  br i1 %stopping, label %exit, label %check
check:
  %new = icmp ne i64 %s, %seen
  br i1 %new, label %run, label %idle
idle:
  %busy = load atomic i64, ptr %busyp monotonic, align 8
  %isbusy = icmp ne i64 %busy, 0
  %limit = select i1 %isbusy, i64 {SPIN_BUSY}, i64 {SPIN_IDLE}
  %keep = icmp ult i64 %spins, %limit
  br i1 %keep, label %spin, label %sleep
spin:
  call void @llvm.x86.sse2.pause()
  %spins.next = add i64 %spins, 1
  br label %wait
sleep:
  store atomic i64 1, ptr %sleepp seq_cst, align 8
  %s2 = load atomic i64, ptr %seqp seq_cst, align 8
  %changed = icmp ne i64 %s2, %seen
  br i1 %changed, label %woke, label %block
block:
  %expect = and i64 %seen, 4294967295
  %ignored = call i64 (i64, ...) @syscall(i64 {SYS_FUTEX}, ptr %seqp, i64 {FUTEX_WAIT_PRIVATE}, i64 %expect, ptr null)
  br label %woke
woke:
  store atomic i64 0, ptr %sleepp seq_cst, align 8
  br label %wait
run:
  call void @part(ptr %ctl, i64 %part)
  store atomic i64 %s, ptr %donep release, align 8
  br label %ran
ran:
  br label %wait
exit:
  ret void""")
    return b.text()


def _wake(types: frozenset[str]) -> str:
    b = FunctionBuilder(abi.WAKE, types)
    b.emit(f"""entry:
{_C.gep("seqp", "%ctl", "seq")}
  fence seq_cst
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i.next, %next]
  %go = icmp ult i64 %i, %workers
  br i1 %go, label %body, label %exit
body:
{_worker_slot("sleepp", "%i", "asleep")}
  %asleep = load atomic i64, ptr %sleepp seq_cst, align 8
  %isasleep = icmp ne i64 %asleep, 0
  br i1 %isasleep, label %futex, label %next
futex:
  %ignored = call i64 (i64, ...) @syscall(i64 {SYS_FUTEX}, ptr %seqp, i64 {FUTEX_WAKE_PRIVATE}, i64 {WAKE_ALL})
  br label %exit
next:
  %i.next = add i64 %i, 1
  br label %loop
exit:
  ret void""")
    return b.text()


def _run_job(types: frozenset[str]) -> str:
    b = FunctionBuilder(abi.RUN_JOB, types)
    b.emit(f"""entry:
{_C.gep("seqp", "%ctl", "seq")}
  %old = load atomic i64, ptr %seqp monotonic, align 8
  %seq = add i64 %old, 1
  %solo = icmp eq i64 %workers, 0
  br i1 %solo, label %mine, label %post
post:
  store atomic i64 %seq, ptr %seqp seq_cst, align 8
  call void @wake(ptr %ctl, i64 %workers)
  br label %mine
mine:
  call void @part(ptr %ctl, i64 0)
  br label %join
join:
  %i = phi i64 [0, %mine], [%i.next, %joined]
  %all = icmp uge i64 %i, %workers
  br i1 %all, label %exit, label %waitone
waitone:
{_worker_slot("donep", "%i", "done")}
  br label %poll
poll:
  %d = load atomic i64, ptr %donep acquire, align 8
  %ok = icmp eq i64 %d, %seq
  br i1 %ok, label %joined, label %pause
pause:
  call void @llvm.x86.sse2.pause()
  br label %poll
joined:
  %i.next = add i64 %i, 1
  br label %join
exit:
  ret void""")
    return "\n" + b.text()


def _part(parts: Mapping[int, str], default: str, types: frozenset[str]) -> str:
    """part(ctl, index): part `index` of the posted job: the `<name>_part` its op names in `parts`
    (`default` for any other op)."""
    cases = " ".join(f"i64 {op}, label %{name}" for op, name in parts.items())
    blocks = "\n".join(f"{name}:\n  call void @{name}_part(ptr %ctl, i64 %index)\n  ret void"
                       for name in (*parts.values(), default))
    b = FunctionBuilder(abi.PART, types)
    b.emit(f"""entry:
{_C.gep("opp", "%ctl", "job", "i64 0")}
  %op = load i64, ptr %opp, align 8
  switch i64 %op, label %{default} [ {cases} ]
{blocks}""")
    return "\n" + b.text()


def _run_on(omp: bool, types: frozenset[str]) -> str:
    """run_on(ctl, workers, threads): the posted job on our workers (threads 0), or on `threads`
    threads of the OpenMP pool (`omp`: the module was given libgomp's GOMP_parallel; otherwise
    always our workers). Between torch's ops the pool's threads spin for their next region, so a
    job on our workers would share the cores with them; on the pool itself each part takes the
    thread numbers it is given, whatever the pool's size."""
    b = FunctionBuilder(abi.RUN_ON, types)
    if not omp:
        b.emit("entry:", "  call void @run_job(ptr %ctl, i64 %workers)", "  ret void")
        return "\n" + b.text()
    b.emit(f"""entry:
  %inomp = icmp ne i64 %threads, 0
  br i1 %inomp, label %omp, label %ours
omp:
{_C.gep("partsp", "%ctl", "omp_parts")}
  store i64 %threads, ptr %partsp, align 8
  %n = trunc i64 %threads to i32
  call void @GOMP_parallel(ptr @omp_parts, ptr %ctl, i32 %n, i32 0)
  ret void
ours:
  call void @run_job(ptr %ctl, i64 %workers)
  ret void""")
    return f"""
declare void @GOMP_parallel(ptr, ptr, i32, i32)
declare i32 @omp_get_thread_num()
declare i32 @omp_get_num_threads()

define internal void @omp_parts(ptr %ctl) {{
entry:
{_C.gep("partsp", "%ctl", "omp_parts")}
  %parts = load i64, ptr %partsp, align 8
  %t = call i32 @omp_get_thread_num()
  %nt = call i32 @omp_get_num_threads()
  %first = zext i32 %t to i64
  %step = zext i32 %nt to i64
  br label %loop
loop:
  %i = phi i64 [%first, %entry], [%i.next, %body]
  %go = icmp ult i64 %i, %parts
  br i1 %go, label %body, label %exit
body:
  call void @part(ptr %ctl, i64 %i)
  %i.next = add i64 %i, %step
  br label %loop
exit:
  ret void
}}
""" + b.text()


def module_ir(parts: Mapping[int, str], default: str, omp: bool, types: frozenset[str]) -> str:
    """The pool's functions: worker, wake, run_job, part (dispatching each op of `parts` to its
    `<name>_part`, any other to `default`'s) and run_on (`omp`: on the OpenMP pool too)."""
    return _run_on(omp, types) + _worker(types) + "\n" + _wake(types) + _run_job(types) + _part(parts, default, types)
