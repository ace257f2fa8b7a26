"""rlx on torch's OpenMP threads: one team for both libraries once ``rlx.torch`` is imported.

The parallel calls of every executable then run as OpenMP regions of torch's runtime instead of
on rlx's own workers. These cases check that the results do not change by a bit (against rlx's
own workers and against one thread), that no rlx worker is started in that mode, that calls from
several Python threads at once stay correct, that a forked child goes back to rlx's workers,
and that a runtime which may not give a region the threads asked (``OMP_DYNAMIC``, a thread
limit of 1) is not used.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import rlx
from rlx import Graph, RuntimeConfig
from rlx.codegen.pool import openmp_in_use

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
rt = pytest.importorskip("rlx.torch")
from rlx.torch.threads import loaded_openmp  # noqa: E402

needs_libgomp = pytest.mark.skipif(loaded_openmp() is None, reason="torch is not built with GNU OpenMP here")


def _graph() -> Graph:
    """Attention, a matmul and fused loops: every kind of parallel step."""
    g = Graph("threads")
    x = g.input("x", (2, 96, 64))
    w = g.input("w", (64, 192))
    q, k, v = g.split(x @ w, 3)
    heads = [g.transpose(g.reshape(t, (2, 96, 4, 16)), (0, 2, 1, 3)) for t in (q, k, v)]
    o = g.attention(*heads, mask=rlx.MaskKind.CAUSAL, layout=rlx.Layout.BHSD)
    g.output(y=g.softmax(o * 2.0 + 1.0, axis=-1))
    return g


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 96, 64), dtype=np.float32)
    return {"x": x, "w": rng.standard_normal((64, 192), dtype=np.float32)}


@needs_libgomp
def test_results_are_bit_identical_on_torch_threads_and_on_rlx_workers() -> None:
    arrays = _arrays()
    one = rlx.compile(_graph(), config=RuntimeConfig(num_threads=1))(**arrays)["y"]
    exe = rlx.compile(_graph(), config=RuntimeConfig(num_threads=2))
    before = openmp_in_use()
    try:
        assert rt.share_torch_threads()
        torch.ones(1 << 16).sum()  # torch's workers awake, as in a training loop
        shared = exe(**arrays)["y"]
        assert not rt.share_torch_threads(False)
        own = exe(**arrays)["y"]
    finally:
        rt.share_torch_threads(before)
    np.testing.assert_array_equal(shared, one)
    np.testing.assert_array_equal(own, one)


@needs_libgomp
def test_calls_from_several_python_threads_at_once() -> None:
    arrays = _arrays()
    exe = rlx.compile(_graph(), config=RuntimeConfig(num_threads=2))
    want = rlx.compile(_graph(), config=RuntimeConfig(num_threads=1))(**arrays)["y"]
    results: list[np.ndarray] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                results.append(exe(**arrays)["y"])
        except BaseException as error:  # reported below
            errors.append(error)

    workers = [threading.Thread(target=work) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not errors and len(results) == 60
    for got in results:
        np.testing.assert_array_equal(got, want)


def test_inference_sdpa_from_several_python_threads_at_once() -> None:
    """rlx.torch's direct path (per-thread pointer tables and arenas, the generated call layout,
    the scratch strides per bucket of lengths) from three Python threads, each decoding its own
    growing cache across length buckets, against torch's SDPA."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    errors: list[BaseException] = []
    worst: list[float] = []

    def work(seed: int) -> None:
        try:
            gen = torch.Generator().manual_seed(seed)
            k = v = torch.empty(1, 4, 0, 32)
            for _ in range(150):
                new = torch.randn(2, 1, 4, 1, 32, generator=gen)
                k, v = torch.cat([k, new[0]], dim=2), torch.cat([v, new[1]], dim=2)
                q = torch.randn(1, 4, 1, 32, generator=gen)
                got = rt.scaled_dot_product_attention(q, k, v)
                worst.append(float((got - sdpa(q, k, v)).abs().max()))
        except BaseException as error:  # reported below
            errors.append(error)

    workers = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert not errors and len(worst) == 450
    assert max(worst) < 1e-5


def _run(code: str, **env: str) -> str:
    environment = {**os.environ, **env}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


_COUNT_THREADS = """
    import os, numpy as np, torch, rlx, rlx.torch as rt
    from rlx.codegen.pool import openmp_in_use
    from rlx import Graph, RuntimeConfig
    g = Graph("g")
    x = g.input("x", (512, 1024))
    g.output(y=g.exp(x) * 2.0)  # many items whatever the machine's cores: a team of 2 works
    exe = rlx.compile(g, config=RuntimeConfig(num_threads=2))
    torch.set_num_threads(2)
    torch.ones(1 << 20).exp().sum()  # starts torch's OpenMP workers
    before = len(os.listdir("/proc/self/task"))
    exe(x=np.ones((512, 1024), np.float32))
    print(openmp_in_use(), len(os.listdir("/proc/self/task")) - before)
"""


@needs_libgomp
def test_no_rlx_worker_starts_on_torch_threads_and_one_does_without() -> None:
    assert _run(_COUNT_THREADS) == "True 0"
    assert _run(_COUNT_THREADS, RLX_TORCH_OPENMP="0") == "False 1"


@needs_libgomp
@pytest.mark.parametrize("env", [{"OMP_DYNAMIC": "true"}, {"OMP_THREAD_LIMIT": "1"}], ids=["dynamic", "limit"])
def test_a_runtime_that_may_shrink_a_region_is_not_used(env: dict[str, str]) -> None:
    out = _run(
        """
        import numpy as np, torch, rlx, rlx.torch as rt
        from rlx.codegen.pool import openmp_in_use
        from rlx import Graph, RuntimeConfig
        g = Graph("g")
        x = g.input("x", (300, 40))
        g.output(y=x @ g.transpose(x, (1, 0)))
        got = rlx.compile(g, config=RuntimeConfig(num_threads=2))(x=np.ones((300, 40), np.float32))["y"]
        print(openmp_in_use(), bool((got == 40).all()))
        """,
        **env,
    )
    assert out == "False True"


@needs_libgomp
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("linked", [True, False], ids=["after-calls", "before-any-call"])
def test_a_forked_child_runs_on_rlx_workers(linked: bool) -> None:
    # Whether or not the parent's runtime was linked (by a call) before the fork, the child leaves
    # torch's OpenMP team alone.
    out = _run(
        f"""
        import os, numpy as np, torch, rlx, rlx.torch as rt
        from rlx.codegen.pool import openmp_in_use
        from rlx import Graph, RuntimeConfig
        g = Graph("g")
        x = g.input("x", (300, 40))
        g.output(y=x @ g.transpose(x, (1, 0)))
        ones = np.ones((300, 40), np.float32)
        exe = None
        if {linked}:
            exe = rlx.compile(g, config=RuntimeConfig(num_threads=2))
            assert (exe(x=ones)["y"] == 40).all()
        torch.ones(1 << 20).exp().sum()
        pid = os.fork()
        if pid == 0:
            exe = exe or rlx.compile(g, config=RuntimeConfig(num_threads=2))
            os._exit(0 if (exe(x=ones)["y"] == 40).all() and not openmp_in_use() else 3)
        _, status = os.waitpid(pid, 0)
        print(openmp_in_use(), os.waitstatus_to_exitcode(status))
        """
    )
    assert out == "True 0"


@needs_libgomp
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_regions_keep_the_hosts_team_size_and_start_no_thread() -> None:
    # libgomp ends surplus threads when a region is smaller than the last one and starts them
    # for a larger one: every region rlx opens has torch's team size, so no call creates threads.
    g = Graph("team")
    x = g.input("x", (64, 1024))
    g.output(y=g.exp(x) * 2.0)
    exes = [rlx.compile(g, config=RuntimeConfig(num_threads=n)) for n in (2, 3, 4)]
    values = np.ones((64, 1024), np.float32)
    before = openmp_in_use()
    try:
        assert rt.share_torch_threads()
        for exe in exes:
            exe(x=values)
        torch.ones(1 << 20).exp().sum()
        threads = len(os.listdir("/proc/self/task"))
        for _ in range(50):
            for exe in exes:
                exe(x=values)
            torch.ones(1 << 20).exp().sum()
        assert len(os.listdir("/proc/self/task")) == threads
    finally:
        rt.share_torch_threads(before)


@needs_libgomp
def test_a_host_on_one_thread_leaves_rlx_its_own_workers() -> None:
    # OMP_NUM_THREADS=1 under torchrun: torch has no team to share; rlx's calls take its own
    # pool (one worker, started once), never a thread per call.
    out = _run(
        """
        import os, numpy as np, torch, rlx, rlx.torch as rt
        from rlx.codegen.pool import openmp_in_use
        from rlx import Graph, RuntimeConfig
        g = Graph("g")
        x = g.input("x", (300, 40))
        g.output(y=x @ g.transpose(x, (1, 0)), z=g.exp(g.broadcast_to(g.mean(x), (512, 1024))))
        exe = rlx.compile(g, config=RuntimeConfig(num_threads=2))
        ones = np.ones((300, 40), np.float32)
        before = len(os.listdir("/proc/self/task"))
        results = [bool((exe(x=ones)["y"] == 40).all()) for _ in range(50)]
        print(openmp_in_use(), len(os.listdir("/proc/self/task")) - before, all(results))
        """,
        OMP_NUM_THREADS="1",
    )
    assert out == "True 1 True"


@needs_libgomp
def test_switching_the_mode_while_calls_run() -> None:
    arrays = _arrays()
    exe = rlx.compile(_graph(), config=RuntimeConfig(num_threads=2))
    want = rlx.compile(_graph(), config=RuntimeConfig(num_threads=1))(**arrays)["y"]
    before = openmp_in_use()
    stop = threading.Event()
    wrong: list[int] = []

    def work() -> None:
        while not stop.is_set():
            if not np.array_equal(exe(**arrays)["y"], want):
                wrong.append(1)

    worker = threading.Thread(target=work)
    worker.start()
    try:
        for turn in range(200):
            rt.share_torch_threads(turn % 2 == 0)
    finally:
        stop.set()
        worker.join(timeout=120)
        rt.share_torch_threads(before)
    assert not wrong
