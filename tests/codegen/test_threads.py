"""Thread count never changes a bit of the result; concurrent calls and compiles are safe.

The parallel-for hands out (batch, head) items to native threads; every item is computed by one
thread with the same code, so any thread count, the serial override and repeated calls must give
bit-identical outputs. ``RLX_NUM_THREADS`` and ``RLX_ATTN_BWD_SERIAL`` are read at compile time.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import pytest
from codegen_helpers import assert_outputs_close, case_inputs, multi_graph
from helpers import Case

import rlx
from rlx import Graph, Layout, MaskKind, RuntimeConfig, Wrt
from rlx.codegen import Executable

CASE = Case(40, 48, head_dim=16, batch=2, heads=3, mask=MaskKind.sliding_window(9), layout=Layout.BSHD)
WRTS = (Wrt.ALL, Wrt.VALUE, Wrt.QUERY | Wrt.KEY)


@pytest.fixture(autouse=True)
def _clean_thread_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start every test without the thread overrides, whatever the outer environment says."""
    monkeypatch.delenv("RLX_NUM_THREADS", raising=False)
    monkeypatch.delenv("RLX_ATTN_BWD_SERIAL", raising=False)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return multi_graph(CASE, wrts=WRTS, name="threads")


def _three_calls(exe: Executable, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Call three times; the calls must agree bit for bit. Returns the first result."""
    first = exe(**arrays)
    for _ in range(2):
        again = exe(**arrays)
        for name, value in first.items():
            assert np.array_equal(again[name], value), f"{name} differs between calls"
    return first


def _assert_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert list(got) == list(want)
    for name, value in want.items():
        assert np.array_equal(got[name], value), f"{name}: {what} is not bit-identical to one thread"


def test_thread_counts_and_overrides_are_bit_identical(
    graph: Graph, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """num_threads 1, 2, 3, RLX_ATTN_BWD_SERIAL=1 and RLX_NUM_THREADS=2: same bits; exe.threads says which."""
    arrays = case_inputs(CASE, rng)
    serial = rlx.compile(graph, config=RuntimeConfig(num_threads=1))
    assert serial.threads == 1
    want = _three_calls(serial, arrays)
    assert_outputs_close(want, rlx.reference.run(graph, **arrays))

    for threads in (2, 3):
        exe = rlx.compile(graph, config=RuntimeConfig(num_threads=threads))
        assert exe.threads == threads
        _assert_identical(_three_calls(exe, arrays), want, f"num_threads={threads}")

    with monkeypatch.context() as env:
        env.setenv("RLX_ATTN_BWD_SERIAL", "1")
        forced = rlx.compile(graph, config=RuntimeConfig(num_threads=3))
    assert forced.threads == 1  # the override wins over the config, and sticks after the env is gone
    _assert_identical(_three_calls(forced, arrays), want, "RLX_ATTN_BWD_SERIAL=1")

    with monkeypatch.context() as env:
        env.setenv("RLX_NUM_THREADS", "2")
        from_env = rlx.compile(graph)
    assert from_env.threads == 2
    _assert_identical(_three_calls(from_env, arrays), want, "RLX_NUM_THREADS=2")


def test_config_beats_rlx_num_threads(graph: Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLX_NUM_THREADS", "2")
    assert rlx.compile(graph, config=RuntimeConfig(num_threads=3)).threads == 3


def test_serial_override_off_values(graph: Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """``RLX_ATTN_BWD_SERIAL`` empty or 0 does not force one thread."""
    for value in ("", "0"):
        monkeypatch.setenv("RLX_ATTN_BWD_SERIAL", value)
        assert rlx.compile(graph, config=RuntimeConfig(num_threads=2)).threads == 2


def test_default_uses_every_available_core(graph: Graph) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert rlx.compile(graph).threads == cores


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_rlx_num_threads(value: str, graph: Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad ``RLX_NUM_THREADS`` is a ValueError at compile time that names the variable."""
    monkeypatch.setenv("RLX_NUM_THREADS", value)
    with pytest.raises(rlx.RlxValueError) as info:
        rlx.compile(graph)
    assert isinstance(info.value, ValueError)
    assert "RLX_NUM_THREADS" in str(info.value)


def test_more_threads_than_work_items(rng: np.random.Generator) -> None:
    """Eight threads for two (batch, head) items: the spare threads are never started; same bits."""
    case = Case(9, 11, head_dim=4, batch=1, heads=2, mask=MaskKind.CAUSAL, layout=Layout.BHSD)
    g = multi_graph(case, wrts=(Wrt.ALL,))
    arrays = case_inputs(case, rng)
    want = rlx.compile(g, config=RuntimeConfig(num_threads=1))(**arrays)
    wide = rlx.compile(g, config=RuntimeConfig(num_threads=8))
    assert wide.threads == 8
    _assert_identical(_three_calls(wide, arrays), want, "num_threads=8")


def _run_in_threads(count: int, work: Callable[[int], None]) -> None:
    """Start ``count`` threads together on ``work(index)``; re-raise the first failure."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            barrier.wait()
            work(index)
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("native_threads", [1, 2])
def test_one_executable_called_from_four_threads(native_threads: int, graph: Graph) -> None:
    """Four Python threads call the same executable at once, each with its own inputs, many times."""
    exe = rlx.compile(graph, config=RuntimeConfig(num_threads=native_threads))
    inputs = [case_inputs(CASE, np.random.default_rng(seed)) for seed in range(4)]
    expected = [rlx.reference.run(graph, **arrays) for arrays in inputs]
    serial = [exe(**arrays) for arrays in inputs]  # what each thread must reproduce bit for bit

    def work(index: int) -> None:
        for _ in range(6):
            got = exe(**inputs[index])
            _assert_identical(got, serial[index], f"thread {index}")
            assert_outputs_close(got, expected[index], context=f"thread {index}")

    _run_in_threads(4, work)


def test_executables_sharing_a_program_called_concurrently(graph: Graph) -> None:
    """Two Executables from the compile cache share one program; concurrent calls stay independent."""
    first, second = rlx.compile(graph), rlx.compile(graph)
    assert first._program is second._program
    inputs = [case_inputs(CASE, np.random.default_rng(100 + seed)) for seed in range(4)]
    serial = [first(**arrays) for arrays in inputs]

    def work(index: int) -> None:
        exe = first if index % 2 else second
        for _ in range(4):
            _assert_identical(exe(**inputs[index]), serial[index], f"thread {index}")

    _run_in_threads(4, work)


def test_concurrent_compiles_and_calls() -> None:
    """Four threads each compile a different graph and run it at the same time."""
    cases = [
        Case(7, 9, mask=MaskKind.CAUSAL),
        Case(6, 6, mask=MaskKind.CUSTOM, layout=Layout.BHSD),
        Case(5, 8, mask=MaskKind.BIAS),
        Case(9, 4, mask=MaskKind.sliding_window(1), layout=Layout.BHSD),
    ]
    graphs = [multi_graph(case, wrts=(Wrt.ALL,), name=f"concurrent{i}") for i, case in enumerate(cases)]
    inputs = [case_inputs(case, np.random.default_rng(i)) for i, case in enumerate(cases)]
    expected = [rlx.reference.run(g, **arrays) for g, arrays in zip(graphs, inputs, strict=True)]

    def work(index: int) -> None:
        exe = rlx.compile(graphs[index], config=RuntimeConfig(num_threads=2))
        for _ in range(3):
            assert_outputs_close(exe(**inputs[index]), expected[index], context=f"graph {index}")

    _run_in_threads(4, work)


def test_no_thread_is_started_for_a_call_with_one_item_per_step() -> None:
    """A member that finds no item would only cost its start and join: a graph whose every
    kernel is one work item starts no thread (its code has no pthread_create), a wider one
    does, and with item counts known per call the count of members is computed per call."""
    tiny = Graph("tiny")
    x = tiny.input("x", (16,))
    tiny.output(y=tiny.exp(x) * 2.0)
    exe = rlx.compile(tiny, config=RuntimeConfig(num_threads=4))
    assert "pthread_create" not in exe.llvm_ir
    values = np.linspace(-1, 1, 16, dtype=np.float32)
    np.testing.assert_allclose(exe(x=values)["y"], np.exp(values) * 2, rtol=1e-6)

    wide = Graph("wide")
    x = wide.input("x", (256, 1024))
    wide.output(y=wide.exp(x) * 2.0)
    assert "pthread_create" in rlx.compile(wide, config=RuntimeConfig(num_threads=4)).llvm_ir

    symbolic = Graph("symbolic")
    x = symbolic.input("x", ("n", 1024))
    symbolic.output(y=symbolic.exp(x) * 2.0)
    exe = rlx.compile(symbolic, config=RuntimeConfig(num_threads=4))
    assert "members.wanted" in exe.llvm_ir
    for rows in (1, 3, 700):
        values = np.random.default_rng(rows).uniform(-1, 1, (rows, 1024)).astype(np.float32)
        np.testing.assert_allclose(exe(x=values)["y"], np.exp(values) * 2, rtol=1e-6)


def _native_threads() -> int:
    """Threads of this process as the OS sees them (Python's and native ones)."""
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_calls_reuse_the_pools_workers() -> None:
    """A call's team comes from the process's pool: after the first call, a thousand calls of
    two executables start no thread, and results stay bit-identical to one thread."""
    wide = Graph("pooled")
    x = wide.input("x", (64, 1024))
    wide.output(y=wide.exp(x) * 2.0)
    exes = [rlx.compile(wide, config=RuntimeConfig(num_threads=n)) for n in (2, 3)]
    assert "rlx_pool_acquire" in exes[0].llvm_ir
    one = rlx.compile(wide, config=RuntimeConfig(num_threads=1))
    values = np.random.default_rng(5).uniform(-2, 2, (64, 1024)).astype(np.float32)
    want = one(x=values)["y"]
    for exe in exes:
        exe(x=values)
    before = _native_threads()
    for _ in range(500):
        for exe in exes:
            assert np.array_equal(exe(x=values)["y"], want)
    assert _native_threads() == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    """The parent's workers do not exist in a child made by fork: the child's calls must start
    their own instead of waiting for them forever."""
    import time

    graph = multi_graph(CASE, wrts=(Wrt.ALL,), name="forked")
    exe = rlx.compile(graph, config=RuntimeConfig(num_threads=2))
    arrays = case_inputs(CASE, np.random.default_rng(11))
    want = exe(**arrays)  # the pool's workers are running now
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        ok = True
        try:
            for _ in range(5):
                got = exe(**arrays)
                ok = ok and all(np.array_equal(got[name], value) for name, value in want.items())
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 120
    while True:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            os.kill(child, 9)
            os.waitpid(child, 0)
            pytest.fail("the forked child hung in a threaded call")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's results differ"


@pytest.mark.parametrize("cap", [1, 2, 3, 8])
def test_a_call_capped_to_fewer_threads_is_bit_identical(graph: Graph, cap: int) -> None:
    arrays = case_inputs(CASE, np.random.default_rng(7))
    exe = rlx.compile(graph, config=RuntimeConfig(num_threads=3))
    want = exe(**arrays)
    got = exe.run(arrays, threads=cap)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_a_capped_call_of_symbolic_sizes_and_a_matmul() -> None:
    g = Graph("capped")
    x = g.input("x", ("S", 96))
    w = g.input("w", (96, 80))
    g.output(y=g.softmax(x @ w, axis=-1))
    exe = rlx.compile(g, config=RuntimeConfig(num_threads=2))
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((96, 80)).astype(np.float32)
    for rows in (1, 33, 400):
        arrays = {"x": rng.standard_normal((rows, 96)).astype(np.float32), "w": weight}
        np.testing.assert_array_equal(exe.run(arrays, threads=1)["y"], exe(**arrays)["y"])


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_bad_thread_cap_is_an_error(graph: Graph, bad: object) -> None:
    exe = rlx.compile(graph, config=RuntimeConfig(num_threads=2))
    with pytest.raises(rlx.RlxValueError, match="threads"):
        exe.run(case_inputs(CASE, np.random.default_rng(7)), threads=bad)  # type: ignore[arg-type]


_CAP_SCRIPT = """
import os, numpy as np, rlx
from rlx import Graph, RuntimeConfig, mods

def threads():
    return len(os.listdir("/proc/self/task"))

g = Graph("cap")
q, k, v = (g.input(n, (2, "S", 4, 16)) for n in "qkv")
doc = g.input("doc", (2, "S"), dtype="int64")
g.output(out=g.attention(q, k, v, mask_mod=mods.document(doc)))  # a block map made per call
exe = rlx.compile(g, config=RuntimeConfig(num_threads=2))
rng = np.random.default_rng(0)
arrays = {n: rng.standard_normal((2, 300, 4, 16)).astype(np.float32) for n in "qkv"}
arrays["doc"] = np.sort(rng.integers(0, 3, (2, 300)), axis=1)
before = threads()
capped = [exe.run(arrays, threads=1)["out"] for _ in range(3)]
after_capped = threads()
full = exe(**arrays)["out"]
print(after_capped - before, threads() - before, all(np.array_equal(c, full) for c in capped))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_a_capped_call_starts_no_worker() -> None:
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key not in ("RLX_NUM_THREADS", "RLX_ATTN_BWD_SERIAL")}
    result = subprocess.run([sys.executable, "-c", _CAP_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "1", "True"]


@pytest.mark.parametrize("threads", [2, 4, 7])
def test_members_that_outwait_the_barriers_spin_sleep_and_wake(threads: int) -> None:
    """A serial step (the embedding gradient's scatter-add, on member 0) long enough that the
    other members stop spinning at the barrier after it and sleep, between steps that every
    member shares; more members than cores too. Every call is bit-identical to one thread's."""
    rng = np.random.default_rng(21)
    g = Graph("barriers")
    table = g.input("table", (20000, 64))
    ids = g.input("ids", (64, 512), dtype="int32")
    rows = g.embedding(table, ids)
    loss = g.sum(g.tanh(rows) * rows)
    (d_table,) = rlx.grad(g, loss, [table])
    g.output(loss=loss, d_table=g.exp(d_table * 0.5) + d_table)
    arrays = {
        "table": rng.standard_normal((20000, 64), dtype=np.float32),
        "ids": rng.integers(0, 20000, (64, 512)).astype(np.int32),
    }
    want = rlx.compile(g, config=RuntimeConfig(num_threads=1))(**arrays)
    exe = rlx.compile(g, config=RuntimeConfig(num_threads=threads))
    for _ in range(5):
        got = exe(**arrays)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


def _current_cpu() -> int:
    """The CPU this thread runs on (field 39 of /proc/thread-self/stat)."""
    with open("/proc/thread-self/stat") as stat:
        text = stat.read()
    return int(text[text.rindex(")") + 2 :].split()[36])


@pytest.mark.skipif(
    not os.path.isdir("/proc/thread-self") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 CPUs"
)
def test_the_pools_workers_are_kept_off_the_callers_cpu() -> None:
    """A call steers the pool's workers to every CPU the caller may use but the one it runs on
    (a KVM guest's scheduler otherwise wakes a long-idle worker onto the caller's CPU). The caller
    is checked on the same CPU before and after the call, so a migration in between cannot make
    the test pass or fail by chance; other threads (OpenBLAS's) keep their own masks."""
    from rlx.codegen import pool

    wide = Graph("steered")
    x = wide.input("x", (64, 1024))
    wide.output(y=wide.exp(x) * 2.0)
    exe = rlx.compile(wide, config=RuntimeConfig(num_threads=2))
    values = np.ones((64, 1024), np.float32)
    allowed = os.sched_getaffinity(0)
    me = threading.get_native_id()
    shared = pool.openmp_in_use()  # rlx.torch, imported by an earlier test, lends torch's threads
    if shared:
        pool.use_openmp(None)
    try:
        for _ in range(50):
            before = _current_cpu()
            exe(x=values)
            if _current_cpu() != before:
                continue
            masks = [os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task") if int(tid) != me]
            assert allowed - {before} in masks
            return
        pytest.skip("the calling thread moved between CPUs in every try")
    finally:
        if shared:
            from rlx.torch.threads import share_torch_threads

            share_torch_threads()


_ONE_CPU_SCRIPT = """
import os, numpy as np, rlx
from rlx import Graph, RuntimeConfig
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
g = Graph("one_cpu")
x = g.input("x", (64, 1024))
g.output(y=g.exp(x) * 2.0)
values = np.random.default_rng(3).uniform(-1, 1, (64, 1024)).astype(np.float32)
want = rlx.compile(g, config=RuntimeConfig(num_threads=1))(x=values)["y"]
exe = rlx.compile(g, config=RuntimeConfig(num_threads=3))
print(all(np.array_equal(exe(x=values)["y"], want) for _ in range(20)))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_a_caller_confined_to_one_cpu_still_runs_its_team() -> None:
    """With one CPU allowed there is no other CPU to steer the workers to: they share it, as
    before, and the results are the one-thread results."""
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key not in ("RLX_NUM_THREADS", "RLX_ATTN_BWD_SERIAL")}
    command = [sys.executable, "-c", _ONE_CPU_SCRIPT]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]


_NO_STEERING_SCRIPT = """
import numpy as np, rlx
import rlx.codegen.pool as pool
from rlx import Graph, RuntimeConfig
pool._STEERING = False  # as on a C library without sched_getcpu / pthread_setaffinity_np
g = Graph("unsteered")
x = g.input("x", (64, 1024))
g.output(y=g.exp(x) * 2.0)
values = np.random.default_rng(3).uniform(-1, 1, (64, 1024)).astype(np.float32)
want = rlx.compile(g, config=RuntimeConfig(num_threads=1))(x=values)["y"]
exe = rlx.compile(g, config=RuntimeConfig(num_threads=2))
print(all(np.array_equal(exe(x=values)["y"], want) for _ in range(20)), "pthread_setaffinity_np" in str(
    pool.IMPORTED_LIBC))
"""


def test_a_c_library_without_the_steering_functions_still_runs_teams() -> None:
    """Where the C library lacks the functions the steering calls, the runtime links stubs in
    their place (the workers are not steered) and teams run as before."""
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key not in ("RLX_NUM_THREADS", "RLX_ATTN_BWD_SERIAL")}
    command = [sys.executable, "-c", _NO_STEERING_SCRIPT]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]
