"""The process's team of native worker threads, started once and reused by every call.

A call used to start its team with ``pthread_create`` and end it with ``pthread_join``: 35-60 µs
on the benchmark host (a KVM guest), as much as a decode step's whole kernel, so small calls ran
on one thread to avoid it. Here workers are started on first need and then wait for work: a
call takes the pool (``rlx_pool_acquire``), posts its team function (``rlx_pool_run``), runs
member 0 itself and waits until every worker is done, as an OpenMP runtime does.

Waiting is a short spin (a loop of calls finds the workers still awake), then sleep on a
condition variable (an idle process burns nothing). The pool serves one call at a time: a call
made while another Python thread's call holds it gets 0 from ``rlx_pool_acquire`` and starts
its own threads, the old way. A child made by ``os.fork`` has none of the parent's workers, so
the pool is reset in it (``rlx_pool_after_fork``, registered with ``os.register_at_fork``).

The runtime is one small LLVM module written out below, compiled and linked once per process;
generated code imports its two functions by address, like BLAS.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

from llvmlite import ir

from rlx.codegen.irutil import I32, PTR, declare

ACQUIRE = "rlx_pool_acquire"  # i32 (i32 wanted): members the call may use (>= 2), or 0: no pool
RUN = "rlx_pool_run"  # void (ptr team, ptr shared, i32 members): run team(shared, tid) on each
_RESET = "rlx_pool_after_fork"
IMPORTED_LIBC = (
    "pthread_create",
    "pthread_detach",
    "pthread_mutex_lock",
    "pthread_mutex_unlock",
    "pthread_cond_wait",
    "pthread_cond_broadcast",
    "clock_gettime",
)
MAX_WORKERS = 255
SPIN_NS = 200_000  # how long a waiting thread spins before it sleeps

_PAUSE = "call void @llvm.x86.sse2.pause()" if platform.machine() in ("x86_64", "AMD64") else ""
_PAUSE_DECLARATION = "declare void @llvm.x86.sse2.pause()" if _PAUSE else ""

# pthread_mutex_t and pthread_cond_t are 40 and 48 bytes on x86-64 glibc (48 and 48 on aarch64);
# all zeros is their static initialiser.
_RUNTIME_IR = f"""
@pool.lock = internal global i32 0           ; 1 while a call owns the pool
@pool.generation = internal global i32 0     ; bumped once per posted call
@pool.remaining = internal global i32 0      ; workers yet to finish the posted call
@pool.workers = internal global i32 0        ; workers started
@pool.team = internal global ptr null        ; the posted call: team(shared, tid) for tid < members
@pool.shared = internal global ptr null
@pool.members = internal global i32 0
@pool.mutex = internal global [64 x i8] zeroinitializer, align 16
@pool.work = internal global [64 x i8] zeroinitializer, align 16   ; signalled when a call is posted
@pool.done = internal global [64 x i8] zeroinitializer, align 16   ; signalled by the last worker

declare i32 @pthread_create(ptr, ptr, ptr, ptr)
declare i32 @pthread_detach(i64)
declare i32 @pthread_mutex_lock(ptr)
declare i32 @pthread_mutex_unlock(ptr)
declare i32 @pthread_cond_wait(ptr, ptr)
declare i32 @pthread_cond_broadcast(ptr)
declare i32 @clock_gettime(i32, ptr)
declare void @llvm.memset.p0.i64(ptr, i8, i64, i1)
{_PAUSE_DECLARATION}

define internal i64 @now() {{
  %spec = alloca [2 x i64]
  call i32 @clock_gettime(i32 1, ptr %spec)
  %sec = load i64, ptr %spec
  %nsec.at = getelementptr [2 x i64], ptr %spec, i64 0, i64 1
  %nsec = load i64, ptr %nsec.at
  %ns = mul i64 %sec, 1000000000
  %t = add i64 %ns, %nsec
  ret i64 %t
}}

; Spin until %word != %value for up to {SPIN_NS} ns; true if it changed.
define internal i1 @spin_while_equal(ptr %word, i32 %value) {{
entry:
  %start = call i64 @now()
  br label %check
check:
  %i = phi i64 [0, %entry], [%i.next, %pause], [%i.next, %clock]
  %current = load atomic i32, ptr %word acquire, align 4
  %changed = icmp ne i32 %current, %value
  br i1 %changed, label %yes, label %pause
pause:
  {_PAUSE}
  %i.next = add i64 %i, 1
  %every = and i64 %i.next, 255
  %look = icmp eq i64 %every, 0
  br i1 %look, label %clock, label %check
clock:
  %t = call i64 @now()
  %spent = sub i64 %t, %start
  %more = icmp slt i64 %spent, {SPIN_NS}
  br i1 %more, label %check, label %no
yes:
  ret i1 1
no:
  ret i1 0
}}

; Wait until %word != %value: spin, then sleep on %cond (whoever changes %word broadcasts it
; under the mutex, so no wake-up is lost).
define internal void @wait_while_equal(ptr %word, i32 %value, ptr %cond) {{
entry:
  %changed = call i1 @spin_while_equal(ptr %word, i32 %value)
  br i1 %changed, label %done, label %sleep
sleep:
  call i32 @pthread_mutex_lock(ptr @pool.mutex)
  br label %check
check:
  %current = load atomic i32, ptr %word acquire, align 4
  %same = icmp eq i32 %current, %value
  br i1 %same, label %wait, label %wake
wait:
  call i32 @pthread_cond_wait(ptr %cond, ptr @pool.mutex)
  br label %check
wake:
  call i32 @pthread_mutex_unlock(ptr @pool.mutex)
  br label %done
done:
  ret void
}}

define internal void @broadcast(ptr %cond) {{
  call i32 @pthread_mutex_lock(ptr @pool.mutex)
  call i32 @pthread_cond_broadcast(ptr %cond)
  call i32 @pthread_mutex_unlock(ptr @pool.mutex)
  ret void
}}

; A worker: its tid in the low 32 bits of %arg, the generation it was started in above them.
define internal ptr @worker(ptr %arg) {{
entry:
  %packed = ptrtoint ptr %arg to i64
  %tid = and i64 %packed, 4294967295
  %high = lshr i64 %packed, 32
  %first = trunc i64 %high to i32
  br label %wait
wait:
  %seen = phi i32 [%first, %entry], [%generation, %finish], [%generation, %signal]
  call void @wait_while_equal(ptr @pool.generation, i32 %seen, ptr @pool.work)
  %generation = load atomic i32, ptr @pool.generation acquire, align 4
  %members = load i32, ptr @pool.members
  %members.64 = zext i32 %members to i64
  %member = icmp ult i64 %tid, %members.64
  br i1 %member, label %run, label %finish
run:
  %team = load ptr, ptr @pool.team
  %shared = load ptr, ptr @pool.shared
  call void %team(ptr %shared, i64 %tid)
  br label %finish
finish:
  %before = atomicrmw sub ptr @pool.remaining, i32 1 acq_rel
  %last = icmp eq i32 %before, 1
  br i1 %last, label %signal, label %wait
signal:
  call void @broadcast(ptr @pool.done)
  br label %wait
}}

define i32 @{ACQUIRE}(i32 %wanted) {{
entry:
  %many = icmp sgt i32 %wanted, 1
  br i1 %many, label %take, label %none
take:
  %taken = cmpxchg ptr @pool.lock, i32 0, i32 1 acquire monotonic
  %ok = extractvalue {{ i32, i1 }} %taken, 1
  br i1 %ok, label %grow, label %none
grow:
  %generation = load atomic i32, ptr @pool.generation acquire, align 4
  %generation.64 = zext i32 %generation to i64
  %tag = shl i64 %generation.64, 32
  %handle = alloca i64
  %need.raw = sub i32 %wanted, 1
  %cap = icmp slt i32 %need.raw, {MAX_WORKERS}
  %need = select i1 %cap, i32 %need.raw, i32 {MAX_WORKERS}
  br label %check
check:
  %have = load i32, ptr @pool.workers
  %short = icmp slt i32 %have, %need
  br i1 %short, label %start, label %ready
start:
  %tid = add i32 %have, 1
  %tid.64 = zext i32 %tid to i64
  %packed = or i64 %tag, %tid.64
  %arg = inttoptr i64 %packed to ptr
  %status = call i32 @pthread_create(ptr %handle, ptr null, ptr @worker, ptr %arg)
  %started = icmp eq i32 %status, 0
  br i1 %started, label %keep, label %ready
keep:
  %thread = load i64, ptr %handle
  call i32 @pthread_detach(i64 %thread)
  store i32 %tid, ptr @pool.workers
  br label %check
ready:
  %workers = load i32, ptr @pool.workers
  %available = add i32 %workers, 1
  %fewer = icmp slt i32 %available, %wanted
  %members = select i1 %fewer, i32 %available, i32 %wanted
  %useful = icmp sgt i32 %members, 1
  br i1 %useful, label %done, label %release
release:
  store atomic i32 0, ptr @pool.lock release, align 4
  br label %none
done:
  ret i32 %members
none:
  ret i32 0
}}

define void @{RUN}(ptr %team, ptr %shared, i32 %members) {{
entry:
  store ptr %team, ptr @pool.team
  store ptr %shared, ptr @pool.shared
  store i32 %members, ptr @pool.members
  %workers = load i32, ptr @pool.workers
  store atomic i32 %workers, ptr @pool.remaining release, align 4
  atomicrmw add ptr @pool.generation, i32 1 seq_cst
  call void @broadcast(ptr @pool.work)
  call void %team(ptr %shared, i64 0)
  call void @wait_until_workers_done()
  store atomic i32 0, ptr @pool.lock release, align 4
  ret void
}}

; The caller's wait: until @pool.remaining is 0.
define internal void @wait_until_workers_done() {{
entry:
  br label %check
check:
  %left = load atomic i32, ptr @pool.remaining acquire, align 4
  %finished = icmp eq i32 %left, 0
  br i1 %finished, label %done, label %wait
wait:
  call void @wait_while_equal(ptr @pool.remaining, i32 %left, ptr @pool.done)
  br label %check
done:
  ret void
}}

; In a child made by fork: no workers exist there, and the parent may have held the pool.
define void @{_RESET}() {{
  call void @llvm.memset.p0.i64(ptr @pool.mutex, i8 0, i64 64, i1 0)
  call void @llvm.memset.p0.i64(ptr @pool.work, i8 0, i64 64, i1 0)
  call void @llvm.memset.p0.i64(ptr @pool.done, i8 0, i64 64, i1 0)
  store i32 0, ptr @pool.workers
  store i32 0, ptr @pool.remaining
  store atomic i32 0, ptr @pool.lock release, align 4
  ret void
}}
"""


@functools.cache
def pool_symbols() -> dict[str, int]:
    """Compile and link the runtime (once per process); the addresses of its functions."""
    from rlx.codegen.jit import link_runtime

    addresses = link_runtime(_RUNTIME_IR, IMPORTED_LIBC, (ACQUIRE, RUN, _RESET))
    reset = ctypes.CFUNCTYPE(None)(addresses[_RESET])
    os.register_at_fork(after_in_child=reset)
    return {ACQUIRE: addresses[ACQUIRE], RUN: addresses[RUN]}


def declare_pool(module: ir.Module) -> tuple[ir.Function, ir.Function]:
    """``(acquire, run)`` declared in a generated module."""
    acquire = declare(module, ACQUIRE, I32, [I32])
    run = declare(module, RUN, ir.VoidType(), [PTR, PTR, I32])
    return acquire, run
