"""The process's team of native worker threads, started once and reused by every call.

A call used to start its team with ``pthread_create`` and end it with ``pthread_join``: 35-60 µs
on the benchmark host (a KVM guest), as much as a decode step's whole kernel, so small calls ran
on one thread to avoid it. Here workers are started on first need and then wait for work: a
call takes the pool (``rlx_pool_acquire``), posts its team function (``rlx_pool_run``), runs
member 0 itself and waits until every worker is done, as an OpenMP runtime does.

Waiting is a short spin (a loop of calls finds the workers still awake), then sleep on a
condition variable (an idle process burns nothing). Each call keeps the workers off the CPU the
caller runs on (``@steer_workers``): a KVM guest's scheduler wakes a long-idle worker onto the
caller's CPU, and the two then share it for milliseconds. The pool serves one call at a time:
a call made while another Python thread's call holds it gets 0 from ``rlx_pool_acquire`` and
starts its own threads, the old way. A child made by ``os.fork`` has none of the parent's workers, so
the pool is reset in it (``rlx_pool_after_fork``, registered with ``os.register_at_fork``).

In OpenMP mode (:func:`use_openmp`, switched on by ``rlx.torch``) a call's team is instead an
OpenMP region of the host's runtime, torch's libgomp: the host's workers, spinning after its own
ops, take rlx's items at once instead of holding the cores rlx's workers wait for.

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

ACQUIRE = "rlx_pool_acquire"  # i32 (i32 wanted, i32 most): members (>= 2; negated: OpenMP), or 0: no pool
RUN = "rlx_pool_run"  # void (ptr team, ptr start, ptr shared, i32 members): start(shared, n), team(shared, tid)
USE_OPENMP = "rlx_pool_use_openmp"  # see use_openmp()
BARRIER = "rlx_pool_barrier"  # void (ptr words): a team's barrier between kernels (BARRIER_WORDS)
_RESET = "rlx_pool_after_fork"
IMPORTED_LIBC = (
    "pthread_create",
    "pthread_detach",
    "pthread_mutex_lock",
    "pthread_mutex_unlock",
    "pthread_cond_wait",
    "pthread_cond_broadcast",
    "clock_gettime",
    "sched_yield",
)
# What @steer_workers calls (glibc, musl); where the C library lacks one, the runtime defines all
# three as stubs that fail, and the workers are not steered.
STEERING_LIBC = ("sched_getcpu", "sched_getaffinity", "pthread_setaffinity_np")
_STEERING = all(hasattr(ctypes.CDLL(None), name) for name in STEERING_LIBC)
_STEERING_IMPORTED = """declare i32 @sched_getcpu()
declare i32 @sched_getaffinity(i32, i64, ptr)
declare i32 @pthread_setaffinity_np(i64, i64, ptr)"""
_STEERING_STUBS = """define internal i32 @sched_getcpu() {
  ret i32 -1
}
define internal i32 @sched_getaffinity(i32 %pid, i64 %size, ptr %mask) {
  ret i32 -1
}
define internal i32 @pthread_setaffinity_np(i64 %thread, i64 %size, ptr %mask) {
  ret i32 -1
}"""
_STEERING_MARK = "; the steering functions"
MAX_WORKERS = 255
SPIN_NS = 200_000  # how long a waiting thread spins before it sleeps
BARRIER_WORDS = 4  # i32 arrived, generation, members, sleepers
BARRIER_MEMBERS = 2  # the word a team's start sets to its members (the others start at zero)

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
@pool.threads = internal global [{MAX_WORKERS} x i64] zeroinitializer  ; the workers' pthread_t, for steering
@pool.steered = internal global i32 -1       ; the CPU the workers were last steered off (see @steer_workers)
@pool.mutex = internal global [64 x i8] zeroinitializer, align 16
@pool.work = internal global [64 x i8] zeroinitializer, align 16   ; signalled when a call is posted
@pool.done = internal global [64 x i8] zeroinitializer, align 16   ; signalled by the last worker
@pool.arrived = internal global [64 x i8] zeroinitializer, align 16  ; a barrier with sleepers opened
; OpenMP mode (see rlx_pool_use_openmp): on while @omp.enabled is 1. The host's runtime functions
; are set before the mode is first switched on and never cleared (a call that found the mode on
; may still be about to use them when another thread switches it off).
@omp.enabled = internal global i32 0
@omp.parallel = internal global ptr null       ; GOMP_parallel(fn, data, threads, flags)
@omp.thread_num = internal global ptr null     ; omp_get_thread_num()
@omp.num_threads = internal global ptr null    ; omp_get_num_threads()
@omp.in_parallel = internal global ptr null    ; omp_in_parallel()
@omp.max_threads = internal global ptr null    ; omp_get_max_threads(): the host's team size
@omp.limit = internal global i32 0             ; the most threads a region gets

declare i32 @pthread_create(ptr, ptr, ptr, ptr)
declare i32 @pthread_detach(i64)
declare i32 @pthread_mutex_lock(ptr)
declare i32 @pthread_mutex_unlock(ptr)
declare i32 @pthread_cond_wait(ptr, ptr)
declare i32 @pthread_cond_broadcast(ptr)
declare i32 @clock_gettime(i32, ptr)
declare i32 @sched_yield()
{_STEERING_MARK}
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

; Spin until %word != %value for up to {SPIN_NS} ns; true if it changed. Every 256 pauses the
; spinner also yields its core: where a team has more members than the machine has free cores
; (RLX_NUM_THREADS above the cores, or calls from several Python threads), the member the others
; wait for gets to run. Without it the transformer block at 8 members on 2 cores took 48.7 ms a
; call instead of 24.5; on a free core sched_yield returns at once.
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
  call i32 @sched_yield()
  %t = call i64 @now()
  %spent = sub i64 %t, %start
  %more = icmp slt i64 %spent, {SPIN_NS}
  br i1 %more, label %check, label %no
yes:
  ret i1 1
no:
  ret i1 0
}}

; Wait until %word != %value: spin, then sleep on %cond.
define internal void @wait_while_equal(ptr %word, i32 %value, ptr %cond) {{
entry:
  %changed = call i1 @spin_while_equal(ptr %word, i32 %value)
  br i1 %changed, label %done, label %sleep
sleep:
  call void @sleep_while_equal(ptr %word, i32 %value, ptr %cond)
  br label %done
done:
  ret void
}}

; Sleep on %cond until %word != %value (whoever changes %word broadcasts it under the mutex, so
; no wake-up is lost). The check is sequentially consistent, as the barrier's count of sleepers
; needs (see the barrier).
define internal void @sleep_while_equal(ptr %word, i32 %value, ptr %cond) {{
entry:
  call i32 @pthread_mutex_lock(ptr @pool.mutex)
  br label %check
check:
  %current = load atomic i32, ptr %word seq_cst, align 4
  %same = icmp eq i32 %current, %value
  br i1 %same, label %wait, label %wake
wait:
  call i32 @pthread_cond_wait(ptr %cond, ptr @pool.mutex)
  br label %check
wake:
  call i32 @pthread_mutex_unlock(ptr @pool.mutex)
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

; OpenMP mode: a team as large as the host's own (at most %most, the call's build), whatever the
; call's items: libgomp ends surplus threads when a region is smaller than the last and starts
; them again for a larger one, so regions of varying sizes would create threads call after call.
; The count comes back negated, which tells @{RUN} to open a region. A host running one thread
; (OMP_NUM_THREADS=1 under torchrun) has no team to share: the call takes rlx's workers.
define i32 @{ACQUIRE}(i32 %wanted, i32 %most) {{
entry:
  %many = icmp sgt i32 %wanted, 1
  br i1 %many, label %openmp, label %none
openmp:
  %omp = call i1 @use_openmp()
  br i1 %omp, label %omp.members, label %take
omp.members:
  %max.threads = load ptr, ptr @omp.max_threads
  %host = call i32 %max.threads()
  %limit = load i32, ptr @omp.limit
  %host.over = icmp sgt i32 %host, %limit
  %host.team = select i1 %host.over, i32 %limit, i32 %host
  %over = icmp sgt i32 %most, %host.team
  %omp.count = select i1 %over, i32 %host.team, i32 %most
  %useful.omp = icmp sgt i32 %omp.count, 1
  br i1 %useful.omp, label %omp.done, label %take
omp.done:
  %omp.tagged = sub i32 0, %omp.count
  ret i32 %omp.tagged
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
  %slot = getelementptr [{MAX_WORKERS} x i64], ptr @pool.threads, i64 0, i32 %have
  store i64 %thread, ptr %slot
  store i32 %tid, ptr @pool.workers
  store i32 -1, ptr @pool.steered               ; the new worker is not steered yet
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

; Whether this call runs on the host's OpenMP threads: the mode is on and the calling thread is
; not inside a parallel region already (where a nested region would get one thread).
define internal i1 @use_openmp() {{
entry:
  %enabled = load atomic i32, ptr @omp.enabled acquire, align 4
  %on = icmp ne i32 %enabled, 0
  br i1 %on, label %check, label %no
check:
  %in.parallel = load ptr, ptr @omp.in_parallel
  %inside = call i32 %in.parallel()
  %outside = icmp eq i32 %inside, 0
  ret i1 %outside
no:
  ret i1 0
}}

; The body of the OpenMP region: member 0 starts the team for the threads the region has (the
; members wait for that before their first step), then every thread runs its share.
%omp.call = type {{ ptr, ptr, ptr }}
define internal void @omp_body(ptr %call) {{
entry:
  %team.at = getelementptr %omp.call, ptr %call, i32 0, i32 0
  %team = load ptr, ptr %team.at
  %start.at = getelementptr %omp.call, ptr %call, i32 0, i32 1
  %start = load ptr, ptr %start.at
  %shared.at = getelementptr %omp.call, ptr %call, i32 0, i32 2
  %shared = load ptr, ptr %shared.at
  %thread.num = load ptr, ptr @omp.thread_num
  %tid = call i32 %thread.num()
  %first = icmp eq i32 %tid, 0
  br i1 %first, label %begin, label %work
begin:
  %num.threads = load ptr, ptr @omp.num_threads
  %members = call i32 %num.threads()
  call void %start(ptr %shared, i32 %members)
  br label %work
work:
  %tid.64 = zext i32 %tid to i64
  call void %team(ptr %shared, i64 %tid.64)
  ret void
}}

define void @{RUN}(ptr %team, ptr %start, ptr %shared, i32 %members) {{
entry:
  %omp = icmp slt i32 %members, 0
  br i1 %omp, label %openmp, label %pool
openmp:
  %omp.members = sub i32 0, %members
  %call = alloca %omp.call
  %team.at = getelementptr %omp.call, ptr %call, i32 0, i32 0
  store ptr %team, ptr %team.at
  %start.at = getelementptr %omp.call, ptr %call, i32 0, i32 1
  store ptr %start, ptr %start.at
  %shared.at = getelementptr %omp.call, ptr %call, i32 0, i32 2
  store ptr %shared, ptr %shared.at
  %parallel = load ptr, ptr @omp.parallel
  call void %parallel(ptr @omp_body, ptr %call, i32 %omp.members, i32 0)
  ret void
pool:
  call void @steer_workers()
  call void %start(ptr %shared, i32 %members)
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

; Run calls on the host's OpenMP threads (null: rlx's own workers again).
define void @{USE_OPENMP}(ptr %parallel, ptr %thread.num, ptr %num.threads, ptr %in.parallel, ptr %max.threads,
                          i32 %limit) {{
entry:
  %off = icmp eq ptr %parallel, null
  br i1 %off, label %disable, label %enable
disable:
  store atomic i32 0, ptr @omp.enabled release, align 4
  ret void
enable:
  store ptr %thread.num, ptr @omp.thread_num
  store ptr %max.threads, ptr @omp.max_threads
  store ptr %num.threads, ptr @omp.num_threads
  store ptr %in.parallel, ptr @omp.in_parallel
  store i32 %limit, ptr @omp.limit
  store ptr %parallel, ptr @omp.parallel
  store atomic i32 1, ptr @omp.enabled release, align 4
  ret void
}}

; Keep the workers off the caller's CPU: each may run on any CPU the caller may, but the one
; the caller is on. Why: a worker asleep for long is woken by the caller, and the scheduler of a
; KVM guest places it on the waker's CPU when the other vCPU is halted (it counts a halted vCPU
; as preempted, so not idle): the two then share one CPU for milliseconds while the other idles.
; Seen with perf sched on the benchmark host: after 50 ms of idleness an attention forward at
; B8 H12 S128 took 4.4-5.6 ms on "2 threads" against 2.0 back to back ("migrated: cpu 0 => 1").
; The masks change only when the caller is found on another CPU than last time (two system
; calls, a few microseconds); a caller allowed one CPU alone leaves them as they are.
define internal void @steer_workers() {{
entry:
  %cpu = call i32 @sched_getcpu()
  %last = load i32, ptr @pool.steered
  %same = icmp eq i32 %cpu, %last
  %negative = icmp slt i32 %cpu, 0
  %beyond = icmp sge i32 %cpu, 1024
  %odd = or i1 %negative, %beyond
  %skip = or i1 %same, %odd
  br i1 %skip, label %done, label %read
read:
  store i32 %cpu, ptr @pool.steered
  %mask = alloca [16 x i64], align 8
  %status = call i32 @sched_getaffinity(i32 0, i64 128, ptr %mask)
  %failed = icmp ne i32 %status, 0
  br i1 %failed, label %done, label %clear
clear:
  %word.index = lshr i32 %cpu, 6
  %bit.index = and i32 %cpu, 63
  %bit.64 = zext i32 %bit.index to i64
  %bit = shl i64 1, %bit.64
  %word.at = getelementptr [16 x i64], ptr %mask, i64 0, i32 %word.index
  %word = load i64, ptr %word.at
  %not.bit = xor i64 %bit, -1
  %cleared = and i64 %word, %not.bit
  store i64 %cleared, ptr %word.at
  br label %any
any:
  %w = phi i32 [0, %clear], [%w.next, %any]
  %seen = phi i64 [0, %clear], [%seen.next, %any]
  %at = getelementptr [16 x i64], ptr %mask, i64 0, i32 %w
  %value = load i64, ptr %at
  %seen.next = or i64 %seen, %value
  %w.next = add i32 %w, 1
  %more = icmp ult i32 %w.next, 16
  br i1 %more, label %any, label %decide
decide:
  %others = icmp ne i64 %seen.next, 0
  %workers = load i32, ptr @pool.workers
  %some = icmp sgt i32 %workers, 0
  %steer = and i1 %others, %some
  br i1 %steer, label %loop, label %done
loop:
  %i = phi i32 [0, %decide], [%i.next, %loop]
  %slot = getelementptr [{MAX_WORKERS} x i64], ptr @pool.threads, i64 0, i32 %i
  %thread = load i64, ptr %slot
  call i32 @pthread_setaffinity_np(i64 %thread, i64 128, ptr %mask)
  %i.next = add i32 %i, 1
  %again = icmp slt i32 %i.next, %workers
  br i1 %again, label %loop, label %done
done:
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

; A team's barrier between two kernels. %words: i32 arrived, generation, members, sleepers (zero
; but members when the call starts). The last member to arrive opens the next generation; the
; others spin for up to {SPIN_NS} ns, as the members of a kernel finish within microseconds of
; each other, and only then sleep on @pool.arrived. pthread_barrier_wait slept at once, and on
; a KVM guest each wake-up delayed the next kernel: the transformer block's 37 kernels took
; 28.6 ms a call instead of 24.2. Sleepers are counted, so opening a barrier that nobody
; sleeps at costs no system call (the count and the generation are sequentially consistent:
; the opener sees a sleeper, or the sleeper sees the new generation under the mutex).
define void @{BARRIER}(ptr %words) {{
entry:
  %generation.at = getelementptr i32, ptr %words, i64 1
  %members.at = getelementptr i32, ptr %words, i64 {BARRIER_MEMBERS}
  %sleepers.at = getelementptr i32, ptr %words, i64 3
  %generation = load atomic i32, ptr %generation.at acquire, align 4
  %members = load i32, ptr %members.at
  %before = atomicrmw add ptr %words, i32 1 acq_rel
  %arrived = add i32 %before, 1
  %last = icmp eq i32 %arrived, %members
  br i1 %last, label %open, label %wait
open:
  store atomic i32 0, ptr %words monotonic, align 4
  atomicrmw add ptr %generation.at, i32 1 seq_cst
  %sleepers = load atomic i32, ptr %sleepers.at seq_cst, align 4
  %any = icmp ne i32 %sleepers, 0
  br i1 %any, label %wake, label %done
wake:
  call void @broadcast(ptr @pool.arrived)
  br label %done
wait:
  %changed = call i1 @spin_while_equal(ptr %generation.at, i32 %generation)
  br i1 %changed, label %done, label %sleep
sleep:
  atomicrmw add ptr %sleepers.at, i32 1 seq_cst
  call void @sleep_while_equal(ptr %generation.at, i32 %generation, ptr @pool.arrived)
  atomicrmw sub ptr %sleepers.at, i32 1 seq_cst
  br label %done
done:
  ret void
}}

; In a child made by fork: no workers exist there, and the parent may have held the pool.
define void @{_RESET}() {{
  store atomic i32 0, ptr @omp.enabled release, align 4
  call void @llvm.memset.p0.i64(ptr @pool.mutex, i8 0, i64 64, i1 0)
  call void @llvm.memset.p0.i64(ptr @pool.work, i8 0, i64 64, i1 0)
  call void @llvm.memset.p0.i64(ptr @pool.done, i8 0, i64 64, i1 0)
  call void @llvm.memset.p0.i64(ptr @pool.arrived, i8 0, i64 64, i1 0)
  store i32 0, ptr @pool.workers
  store i32 -1, ptr @pool.steered
  store i32 0, ptr @pool.remaining
  store atomic i32 0, ptr @pool.lock release, align 4
  ret void
}}
"""


@functools.cache
def pool_symbols() -> dict[str, int]:
    """Compile and link the runtime (once per process); the addresses of its functions."""
    from rlx.codegen.jit import link_runtime

    # quick: the pool waits on atomics and futexes, where LLVM's fast instruction selection
    # loses nothing (a 37-kernel training step and a decode call ran as fast), and it is the
    # first module a process compiles: 15 ms of machine code became 3, ~14 ms of the first compile
    exports = (ACQUIRE, RUN, _RESET, USE_OPENMP, BARRIER)
    steering = _STEERING_IMPORTED if _STEERING else _STEERING_STUBS
    imported = IMPORTED_LIBC + (STEERING_LIBC if _STEERING else ())
    addresses = link_runtime(_RUNTIME_IR.replace(_STEERING_MARK, steering), imported, exports, quick=True)
    reset = ctypes.CFUNCTYPE(None)(addresses[_RESET])
    os.register_at_fork(after_in_child=reset)
    _set_openmp(addresses[USE_OPENMP])
    return {name: addresses[name] for name in (ACQUIRE, RUN, USE_OPENMP, BARRIER)}


def declare_pool(module: ir.Module) -> tuple[ir.Function, ir.Function]:
    """``(acquire, run)`` declared in a generated module."""
    acquire = declare(module, ACQUIRE, I32, [I32, I32])
    run = declare(module, RUN, ir.VoidType(), [PTR, PTR, PTR, I32])
    return acquire, run


def declare_barrier(module: ir.Module) -> ir.Function:
    """The team barrier (``void (ptr words)``) declared in a generated module."""
    return declare(module, BARRIER, ir.VoidType(), [PTR])


_openmp: tuple[int | None, ...] | None = None  # the functions and thread limit use_openmp() found
_OPENMP_FUNCTIONS = (
    "GOMP_parallel",
    "omp_get_thread_num",
    "omp_get_num_threads",
    "omp_in_parallel",
    "omp_get_max_threads",
)
_MOST_OPENMP_THREADS = MAX_WORKERS + 1


def use_openmp(library: str | None) -> bool:
    """Run every later multi-threaded call on the threads of an OpenMP runtime already loaded in
    the process (GNU libgomp's ABI, at path ``library``), or on rlx's own workers again (None).

    Why: a host such as torch keeps its OpenMP workers spinning after each of its ops. On a
    machine with as many cores as threads, rlx's workers then wait for cores those spinners hold:
    an attention call right after a torch op took 21 ms instead of 17. Borrowing the host's
    threads makes it one team, as two OpenMP libraries share one runtime. Each region's member 0
    sizes rlx's barrier for the threads the region really got, so a region with fewer threads
    than asked (a thread limit) runs correctly on those. Returns whether the mode is on: not if
    the runtime is not loaded, lacks a function, or adjusts team sizes dynamically
    (``OMP_DYNAMIC``). A child made by ``os.fork`` goes back to rlx's workers.
    """
    global _openmp
    if library is None:
        _openmp = None
    else:
        try:  # RTLD_NOLOAD: only a runtime the host has loaded already, never a second copy
            runtime = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
            functions = [ctypes.cast(getattr(runtime, name), ctypes.c_void_p).value for name in _OPENMP_FUNCTIONS]
            dynamic = runtime.omp_get_dynamic()
            limit = runtime.omp_get_thread_limit()
        except (OSError, AttributeError):
            return False
        if dynamic or not all(functions) or limit < 2:
            return False
        _openmp = (*functions, min(limit, _MOST_OPENMP_THREADS))
    if pool_symbols.cache_info().currsize:  # linked already: switch now (else when it is linked)
        _set_openmp(pool_symbols()[USE_OPENMP])
    return _openmp is not None


def openmp_in_use() -> bool:
    """Whether multi-threaded calls run on the host's OpenMP threads (see :func:`use_openmp`)."""
    return _openmp is not None


def _forget_openmp() -> None:
    """In a child made by ``os.fork``: rlx's own workers, whether or not the runtime was linked
    before the fork (if it was, its own reset switched the mode off there too)."""
    global _openmp
    _openmp = None


os.register_at_fork(after_in_child=_forget_openmp)


def _set_openmp(address: int) -> None:
    set_mode = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * len(_OPENMP_FUNCTIONS), ctypes.c_int)(address)
    set_mode(*(_openmp if _openmp is not None else (None,) * len(_OPENMP_FUNCTIONS) + (0,)))
