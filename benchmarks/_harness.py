"""Benchmark plumbing that knows nothing about attention: machine facts, timing, memory, BLAS rate.

Kept apart from ``attention_bwd.py`` so that the attention benchmark reads as "what is measured"
while this file holds "how a number is taken". Linux only where it reads ``/proc``; every reader
returns ``None`` instead of failing when a file is missing, so the benchmark still runs elsewhere.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# ----------------------------------------------------------------------------- machine and versions


def core_count() -> int:
    """Cores this process may run on (the affinity mask, not the host's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def cpu_model() -> str:
    """The CPU model string from /proc/cpuinfo (``platform.processor()`` is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The vector-ISA flags that decide which kernels BLAS and LLVM may use."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "fma", "sse4", "amx")))
    except OSError:
        pass
    return []


def git_revision(repo: Path) -> dict[str, object]:
    """Commit and dirty flag of the tree being measured: the kernels change under active tuning."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "rlx")
    return {"commit": git("rev-parse", "HEAD"), "rlx_tree_dirty": None if status is None else bool(status)}


# ----------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Stats:
    """Summary of one implementation's timed repetitions, in seconds."""

    median: float
    minimum: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        return cls(statistics.median(samples), min(samples), tuple(samples))


def geomean(values: Iterable[float]) -> float | None:
    """Geometric mean: the right average of speed ratios (a 2x win and a 2x loss cancel)."""
    values = [v for v in values if v > 0 and math.isfinite(v)]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def median_or_none(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


# ----------------------------------------------------------------------------- timing


class Timeable(Protocol):
    """Something to time: ``setup`` runs untimed before every ``run`` (e.g. dropping old gradients)."""

    def setup(self) -> None: ...

    def run(self) -> object: ...


def time_interleaved(calls: Mapping[str, Timeable], repeat: int, gap: float) -> dict[str, list[float]]:
    """Time each call ``repeat`` times, interleaved so that machine noise hits every implementation alike.

    Repetition r starts its round at the r-th implementation (a rotation), so no implementation
    always runs right after the same neighbour. ``gap`` seconds of sleep before every timed call let
    the previous call's BLAS/OpenMP worker threads stop spinning: measured here, OpenBLAS threads
    still busy-waiting after a NumPy matmul made the next PyTorch call up to 2x slower. The garbage
    collector is off while a call runs and results are freed outside the timer.
    """
    return time_bursts(calls, repeat, gap, warm=0).cold


@dataclass(frozen=True)
class Bursts:
    """Per implementation: the first call after each gap (``cold``), and the ``warm`` calls that
    followed it back to back in the same burst."""

    cold: dict[str, list[float]]
    warm: dict[str, list[float]]


def time_bursts(calls: Mapping[str, Timeable], repeat: int, gap: float, warm: int) -> Bursts:
    """:func:`time_interleaved`, each timed call followed by ``warm`` more of the same, back to back.

    The first call of a burst finds the implementation's worker threads asleep after the gap; the
    next ones find them awake, as the calls of a training loop do. On a KVM guest that takes
    milliseconds to wake an idle virtual CPU, the two differ by more than the implementations do
    (attention forward, B8 H12 S128: torch 2.0 ms back to back, 6.7 after a 50 ms gap), so the
    benchmarks report both. The gap still comes before every burst, never inside one.
    """
    names = list(calls)
    cold: dict[str, list[float]] = {name: [] for name in names}
    later: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeat):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            for index in range(1 + warm):
                calls[name].setup()
                if index == 0:
                    gc.collect()
                    time.sleep(gap)
                gc.disable()
                try:
                    start = time.perf_counter()
                    result = calls[name].run()
                    elapsed = time.perf_counter() - start
                finally:
                    gc.enable()
                del result
                (cold if index == 0 else later)[name].append(elapsed)
    return Bursts(cold, later)


def add_warm_option(parser: argparse.ArgumentParser) -> None:
    """``--warm``: how many calls :func:`time_bursts` times right after each timed one."""
    help_text = "calls timed right after each timed one (default 2; 0: none)"
    parser.add_argument("--warm", type=int, default=2, help=help_text)


def warm_heading(warm: int) -> str:
    """The title of a benchmark's table of warm calls."""
    return (
        f"Warm: the {warm} calls right after each timed one, back to back (as a training loop calls), median;"
        " the threads the first call woke are awake"
    )


WARM_NOT_TARGETS = "(the targets are judged on the first calls, above)"
SAME_SIZE_NOTE = (
    "(% same-size sgemm: the rate over that of an n³ sgemm of about the case's FLOPs on rlx's OpenBLAS, timed"
    " among the same interleaved calls after the same gaps; the targets are judged on % sgemm, the 2048³ rate)"
)


def timed(call: Timeable) -> tuple[object, float]:
    """One untimed setup and one timed run (the warm-up, whose result feeds the correctness check)."""
    call.setup()
    start = time.perf_counter()
    result = call.run()
    return result, time.perf_counter() - start


# ----------------------------------------------------------------------------- CPU used by others


def _machine_cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, from the first line of /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy / hz, (busy + idle + iowait) / hz


class ForeignLoad:
    """How many cores other processes kept busy while we measured: the shared machine's noise level.

    Machine-wide busy CPU time (/proc/stat) minus this process's own (and its children's) CPU time,
    divided by the wall time. Recorded with each case so a slow number can be told from a busy box.
    """

    def __init__(self) -> None:
        self._start = (time.perf_counter(), _own_cpu_seconds(), _machine_cpu_seconds())

    def cores(self) -> float | None:
        wall0, own0, machine0 = self._start
        machine1 = _machine_cpu_seconds()
        if machine0 is None or machine1 is None:
            return None
        wall = time.perf_counter() - wall0
        foreign = (machine1[0] - machine0[0]) - (_own_cpu_seconds() - own0)
        return max(0.0, foreign / wall) if wall > 0 else None


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


# ----------------------------------------------------------------------------- memory from /proc


def proc_status_kib(field: str) -> int | None:
    """A ``Vm*`` field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: resident peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: writing 5 to clear_refs); False when not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    hwm, rss = proc_status_kib("VmHWM"), proc_status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 64  # a few pages may fault in between


def extra_peak_bytes(call: Callable[[], object]) -> tuple[int | None, object]:
    """Peak resident memory during ``call`` above the resident memory just before it, in bytes.

    VmHWM is the kernel's exact page-level high-water mark, so no sampling thread can miss a short
    spike. Returns ``None`` where the peak cannot be reset (non-Linux, restricted /proc).
    """
    gc.collect()
    if not reset_peak_rss():
        return None, call()
    baseline = proc_status_kib("VmRSS")
    result = call()
    peak = proc_status_kib("VmHWM")
    if baseline is None or peak is None:
        return None, result
    return max(0, peak - baseline) * 1024, result


# ----------------------------------------------------------------------------- the BLAS that rlx calls


_SGEMM_TYPE = ctypes.CFUNCTYPE(
    None,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_int,
)


class RlxOpenBlas:
    """rlx's own OpenBLAS (``rlx.codegen.blas.load_blas``), called through private ctypes prototypes.

    Private prototypes built from symbol addresses leave the argtypes of the shared ``CDLL``
    attributes untouched, so nothing here can change how rlx itself calls the library.
    """

    def __init__(self) -> None:
        from rlx.codegen.blas import load_blas

        self._blas = load_blas()
        library = self._blas.library
        self.sgemm_address_value = self._blas.sgemm_address
        self.sgemm = _SGEMM_TYPE(self._blas.sgemm_address)
        self._set_threads = ctypes.CFUNCTYPE(None, ctypes.c_int)(self._address("scipy_openblas_set_num_threads"))
        self._get_threads = ctypes.CFUNCTYPE(ctypes.c_int)(self._address("scipy_openblas_get_num_threads"))
        has_corename = hasattr(library, "scipy_openblas_get_corename")
        self._corename = (
            ctypes.CFUNCTYPE(ctypes.c_char_p)(self._address("scipy_openblas_get_corename")) if has_corename else None
        )

    def _address(self, name: str) -> int:
        address = ctypes.cast(getattr(self._blas.library, name), ctypes.c_void_p).value
        if not address:
            raise RuntimeError(f"{name} not found in {self._blas.path}")
        return int(address)

    @property
    def path(self) -> str:
        return self._blas.path

    def corename(self) -> str | None:
        """The kernel family OpenBLAS picked at load time (DYNAMIC_ARCH builds choose per CPU)."""
        return self._corename().decode() if self._corename else None

    def threads(self) -> int:
        return int(self._get_threads())

    def set_threads(self, count: int) -> None:
        self._set_threads(count)


@dataclass(frozen=True)
class SgemmRate:
    """Large-sgemm throughput of rlx's OpenBLAS in GFLOP/s."""

    n: int
    threads: int
    gflops_multi: float  # one n^3 sgemm on ``threads`` OpenBLAS threads (median)
    gflops_single: float  # the same on one thread (median)
    samples_multi: tuple[float, ...]
    samples_single: tuple[float, ...]
    foreign_load_cores: float | None  # cores other processes kept busy meanwhile

    @property
    def gflops_single_times_threads(self) -> float:
        return self.gflops_single * self.threads


def measure_sgemm(blas: RlxOpenBlas, n: int, threads: int, repeat: int, gap: float) -> SgemmRate:
    """Time ``C = A @ B`` (n x n x n, float32, row major) on 1 and on ``threads`` OpenBLAS threads.

    Both are kept: on a shared machine the multi-thread rate drops with other processes' load,
    while one thread times x threads estimates what the cores could do if each were ours.

    rlx pins its OpenBLAS to one thread (it parallelises over batch x heads itself), so the thread
    count is raised only for this measurement and restored to the value found, in a ``finally``.
    """
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.zeros((n, n), dtype=np.float32)

    def run() -> float:
        start = time.perf_counter()
        blas.sgemm(101, 111, 111, n, n, n, 1.0, a.ctypes.data, n, b.ctypes.data, n, 0.0, c.ctypes.data, n)
        return time.perf_counter() - start

    previous = blas.threads()
    flops = 2.0 * n**3
    foreign = ForeignLoad()
    rates: dict[int, list[float]] = {}
    try:
        for count in (1, threads):
            blas.set_threads(count)
            run()  # warm-up: first touch of the workspace, thread start-up
            rates[count] = []
            for _ in range(repeat):
                time.sleep(gap)
                rates[count].append(flops / run() / 1e9)
    finally:
        blas.set_threads(previous)
    if not np.allclose(c[:2, :2], a[:2] @ b[:, :2], rtol=1e-3, atol=1e-2):
        raise RuntimeError("sgemm through rlx's OpenBLAS returned a wrong product; the rate would be meaningless")
    return SgemmRate(
        n,
        threads,
        statistics.median(rates[threads]),
        statistics.median(rates[1]),
        tuple(rates[threads]),
        tuple(rates[1]),
        foreign.cores(),
    )


class SameSizeSgemm:
    """An n x n x n sgemm on rlx's OpenBLAS with about the FLOPs of a benchmark case, on ``threads``
    threads: what the machine's best-kept kernel does with a call of that size. Timed among the
    case's interleaved calls (:func:`time_bursts`), it meets the same gaps, the same wake-up of
    idle cores and the same neighbours, so an implementation's rate over this one's says how
    close it runs to the machine for calls of its size; the 2048³ rate is that of a call long
    enough to hide the first milliseconds after a gap, which weigh on a 5 ms call.

    rlx keeps its OpenBLAS on one thread (it parallelises itself), so ``setup`` raises the thread
    count, untimed, and ``run`` puts it back after the product (``openblas_set_num_threads``
    lowering the count only stores it)."""

    def __init__(self, blas: RlxOpenBlas, flops: float, threads: int) -> None:
        self.blas, self.threads = blas, threads
        self.n = max(16, round((flops / 2.0) ** (1.0 / 3.0)))
        rng = np.random.default_rng(0)
        self.a, self.b = (rng.standard_normal((self.n, self.n), dtype=np.float32) for _ in range(2))
        self.c = np.zeros((self.n, self.n), dtype=np.float32)
        self.previous = blas.threads()

    @property
    def flops(self) -> float:
        return 2.0 * self.n**3

    def setup(self) -> None:
        self.previous = self.blas.threads()
        self.blas.set_threads(self.threads)

    def run(self) -> None:
        n, a, b, c = self.n, self.a, self.b, self.c
        try:
            self.blas.sgemm(101, 111, 111, n, n, n, 1.0, a.ctypes.data, n, b.ctypes.data, n, 0.0, c.ctypes.data, n)
        finally:
            self.blas.set_threads(self.previous)

    def check(self) -> None:
        """Raise if the last product is wrong (a rate of a wrong product means nothing)."""
        if not np.allclose(self.c[:2, :2], self.a[:2] @ self.b[:, :2], rtol=1e-3, atol=1e-2):
            raise RuntimeError(f"the {self.n}³ sgemm through rlx's OpenBLAS returned a wrong product")


@dataclass(frozen=True)
class WakeRamp:
    """How fast one core works right after ``gap`` seconds of sleep, against its warm speed.

    Chunks of the same work (``n``³ sgemm on one OpenBLAS thread, each timed) run back to back
    after every gap; ``cold_s[i]`` is the median time of the i-th chunk after the gap, ``warm_s``
    that of chunks after the first ``len(cold_s)``. On the KVM hosts of this project the first
    milliseconds after a gap ran at a fraction of the warm speed for every program, rlx and torch
    alike: it is the host's, and it weighs on short calls (the benchmarks' cold columns)."""

    gap: float
    n: int
    warm_s: float
    cold_s: tuple[float, ...]

    def _chunks(self, work_s: float) -> int:
        """How many chunks make ``work_s`` seconds of warm work (at least one, at most those measured)."""
        return max(1, min(len(self.cold_s), round(work_s / self.warm_s)))

    def first_speed(self, work_s: float) -> float:
        """Warm speed's fraction reached over the first ``work_s`` seconds of warm work."""
        count = self._chunks(work_s)
        return count * self.warm_s / sum(self.cold_s[:count])

    def extra_s(self, work_s: float) -> float:
        """How much longer ``work_s`` seconds of warm work took right after the gap (up to the
        chunks measured)."""
        count = self._chunks(work_s)
        return sum(self.cold_s[:count]) - count * self.warm_s

    def as_dict(self) -> dict[str, object]:
        return {"gap_s": self.gap, "n": self.n, "warm_chunk_s": self.warm_s, "cold_chunks_s": list(self.cold_s),
                "first_ms_speed": self.first_speed(1e-3), "extra_s_for_5ms": self.extra_s(5e-3)}  # fmt: skip

    def summary(self) -> str:
        return (
            f"host wake-up (one core, OpenBLAS {self.n}³ chunks of {self.warm_s * 1e6:.0f} us): after a "
            f"{self.gap * 1e3:.0f} ms gap its first 1 ms of work ran at {self.first_speed(1e-3):.0%} of the warm "
            f"speed, its first 5 ms at {self.first_speed(5e-3):.0%} (+{self.extra_s(5e-3) * 1e3:.1f} ms)"
        )


def measure_wake_ramp(blas: RlxOpenBlas, gap: float, repeat: int = 11, chunks: int = 80, n: int = 160) -> WakeRamp:
    """:class:`WakeRamp`: ``repeat`` times, sleep ``gap`` and time ``2 * chunks`` sgemm chunks."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.zeros((n, n), dtype=np.float32)
    args = (101, 111, 111, n, n, n, 1.0, a.ctypes.data, n, b.ctypes.data, n, 0.0, c.ctypes.data, n)
    previous = blas.threads()
    times = np.empty((repeat, 2 * chunks))
    try:
        blas.set_threads(1)
        for _ in range(20):
            blas.sgemm(*args)
        for r in range(repeat):
            time.sleep(gap)
            for i in range(2 * chunks):
                start = time.perf_counter()
                blas.sgemm(*args)
                times[r, i] = time.perf_counter() - start
    finally:
        blas.set_threads(previous)
    medians = np.median(times, axis=0)
    return WakeRamp(gap, n, float(np.median(medians[chunks:])), tuple(float(t) for t in medians[:chunks]))


# ----------------------------------------------------------------------------- NumPy's own BLAS threads


def numpy_blas_info() -> list[dict[str, object]]:
    """NumPy's BLAS (threadpoolctl's view) or an empty list when threadpoolctl is not installed."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    numpy_dir = os.path.dirname(np.__file__)
    return [info for info in threadpool_info() if _belongs_to(str(info.get("filepath", "")), numpy_dir)]


def set_numpy_blas_threads(count: int) -> bool:
    """Set the thread count of NumPy's bundled OpenBLAS only (never rlx's, which must stay at 1)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return False
    numpy_dir = os.path.dirname(np.__file__)
    changed = False
    for controller in ThreadpoolController().lib_controllers:
        if controller.user_api == "blas" and _belongs_to(controller.filepath, numpy_dir):
            controller.set_num_threads(count)
            changed = True
    return changed


def _belongs_to(filepath: str, numpy_dir: str) -> bool:
    """numpy wheels ship their BLAS in ``numpy.libs`` beside the package, or inside it."""
    site = os.path.dirname(numpy_dir)
    return filepath.startswith((numpy_dir, os.path.join(site, "numpy.libs")))


# ----------------------------------------------------------------------------- text tables


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A fixed-width Markdown table: readable in a terminal and pasteable into a README."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(cell).rjust(width) for cell, width in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (width + 1) + ":" for width in widths) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


# ----------------------------------------------------------------------------- roofline and breakdown


def measure_bandwidth(megabytes: int = 256, repeat: int = 5) -> float:
    """Memory bandwidth in GB/s: the best of ``repeat`` copies of an array far larger than the
    caches (bytes read plus bytes written, one thread: NumPy's copy)."""
    source = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best / 1e9


def attention_breakdown(executable: object, arrays: Mapping[str, np.ndarray], repeat: int = 3) -> dict[str, float]:
    """Fractions of an attention call's kernel time (CPU time over all threads) spent in BLAS,
    in the softmax (mask, max, exp, sums), in dS (the softmax backward) and elsewhere, from a
    build compiled with ``CodegenOptions(profile=True)``; the median of ``repeat`` calls."""
    runs = [executable.attention_breakdown(**arrays) for _ in range(repeat)]  # type: ignore[attr-defined]
    median = {name: float(np.median([run[name] for run in runs])) for name in runs[0]}
    total = median["kernel"] or 1.0
    fractions = {name: median[name] / total for name in ("blas", "softmax", "softmax_backward")}
    fractions["other"] = max(0.0, 1.0 - sum(fractions.values()))
    return fractions


def roofline(flops: float, nbytes: float, seconds: float, gflops: float, bandwidth_gbs: float) -> dict[str, float]:
    """Where a measured call sits against the machine's two ceilings, both measured in the run:
    the bound is ``max(flops / sgemm rate, bytes / bandwidth)``; ``attained`` is bound / measured."""
    compute_s = flops / (gflops * 1e9)
    memory_s = nbytes / (bandwidth_gbs * 1e9)
    bound = max(compute_s, memory_s)
    return {
        "flops": flops,
        "bytes": nbytes,
        "intensity": flops / nbytes,
        "compute_bound_s": compute_s,
        "memory_bound_s": memory_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "attained": bound / seconds,
    }


def breakdown_table(rows: Sequence[tuple[str, dict[str, float], dict[str, float]]]) -> str:
    """One line per case: roofline numbers and the time split of the profiled kernel."""
    header = ["case", "GFLOP", "MB moved", "FLOP/B", "bound", "% of bound", "products", "softmax+mask", "dS", "other"]
    lines = []
    for label, roof, split in rows:
        lines.append([
            label, f"{roof['flops'] / 1e9:.2f}", f"{roof['bytes'] / 1e6:.1f}", f"{roof['intensity']:.0f}",
            roof["bound"], f"{roof['attained']:.0%}", f"{split['blas']:.0%}", f"{split['softmax']:.0%}",
            f"{split['softmax_backward']:.0%}", f"{split['other']:.0%}",
        ])  # fmt: skip
    return markdown_table(header, lines)


# ----------------------------------------------------------------------------- rlx's BLAS against torch's


@dataclass(frozen=True)
class Product:
    """``count`` matrix products ``C[m, n] = op(A) @ op(B)``, ``op`` transposing where flagged, each
    operand's rows ``lda``/``ldb``/``ldc`` floats apart (0: contiguous). The attention kernels'
    strips and transposed copies have rows an odd number of cache lines apart (``strip_ld``),
    and a product timed with rows a power of two of lines apart (512 keys: 2 KB) ran up to a
    quarter slower than in the kernel, its rows falling into a few sets of L1."""

    m: int
    n: int
    k: int
    trans_a: bool = False
    trans_b: bool = False
    count: int = 1
    lda: int = 0
    ldb: int = 0
    ldc: int = 0

    def leading(self) -> tuple[int, int, int]:
        """The leading dimensions of A, B and C as stored (row-major), contiguous where 0."""
        a_columns = self.m if self.trans_a else self.k
        b_columns = self.k if self.trans_b else self.n
        return self.lda or a_columns, self.ldb or b_columns, self.ldc or self.n

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    @property
    def label(self) -> str:
        return f"{self.m}x{self.n}x{self.k} {'T' if self.trans_a else 'N'}{'T' if self.trans_b else 'N'}"


@dataclass(frozen=True)
class BlasComparison:
    """Seconds the same products take on one thread: through what rlx's kernels call (OpenBLAS, or
    the register tiles where the attention kernels take them), through OpenBLAS alone, and
    through torch's BLAS."""

    rlx_s: float
    openblas_s: float
    torch_s: float
    flops: float
    per_product: tuple[tuple[str, float, float, float], ...]  # (label, rlx, OpenBLAS, torch GFLOP/s)
    torch_timing: str  # how torch's BLAS was called: "native" (MKL's sgemm_ in a loop) or "torch.mm"

    @property
    def torch_speedup(self) -> float:
        """How many times faster torch's BLAS runs these products than what rlx's kernels call."""
        return self.rlx_s / self.torch_s

    def as_dict(self) -> dict[str, object]:
        """The JSON form: the sums, the speed-up and each product's rates."""
        products = [{"product": label, "rlx_gflops": ours, "rlx_openblas_gflops": openblas, "torch_blas_gflops": theirs}
                    for label, ours, openblas, theirs in self.per_product]  # fmt: skip
        return {"rlx_s": self.rlx_s, "openblas_s": self.openblas_s, "torch_s": self.torch_s, "flops": self.flops,
                "torch_speedup": self.torch_speedup, "torch_timing": self.torch_timing,
                "products": products}  # fmt: skip


def compare_blas(
    blas: RlxOpenBlas, products: Sequence[Product], burst: float = 0.05, rounds: int = 5, tiles: bool = False
) -> BlasComparison:
    """Time each product on ONE thread through rlx's OpenBLAS, through rlx's register tiles where
    the attention kernels take them (``tiles``: the products are an attention kernel's), and
    through torch's BLAS (MKL in the x86 wheels), alternating bursts of ``burst`` seconds,
    ``rounds`` of each; the best burst counts. Each is called in a loop of native code, as the
    kernels call them: through ctypes or ``torch.mm`` every call paid ~5 us of Python, as much
    as a small strip product itself. torch's BLAS is MKL's ``sgemm_`` as libtorch exports it;
    where it does not, ``torch.mm`` (``torch_timing`` says which). This says what part of a gap
    to torch is the BLAS's: an implementation whose products take longer than torch's own cannot
    beat torch by more than the rest of torch's time. Needs torch."""
    import torch

    from rlx.codegen.lower_attention import tiles_take

    previous_torch, previous_blas = torch.get_num_threads(), blas.threads()
    torch.set_num_threads(1)
    blas.set_threads(1)
    loops = NativeProducts(blas)
    rlx_s = openblas_s = torch_s = 0.0
    rows = []
    try:
        for product in products:
            uses_tiles = tiles and tiles_take(product.m, product.n, product.k, product.trans_a, product.trans_b)
            ours, theirs, tiled = loops.time(product, burst, rounds, uses_tiles)
            rlx_s += (tiled if uses_tiles else ours) * product.count
            openblas_s += ours * product.count
            torch_s += theirs * product.count
            one = 2.0 * product.m * product.n * product.k / 1e9
            rows.append((product.label, one / (tiled if uses_tiles else ours), one / ours, one / theirs))
    finally:
        torch.set_num_threads(previous_torch)
        blas.set_threads(previous_blas)
    flops = sum(p.flops for p in products)
    timing = "native" if loops.mkl_sgemm else "torch.mm"
    return BlasComparison(rlx_s, openblas_s, torch_s, flops, tuple(rows), timing)


_LOOP_ARGS = (ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
              ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
              ctypes.c_int64)  # fmt: skip
_MKL_SGEMM = "rlx_benchmark_mkl_sgemm"


class NativeProducts:
    """Loops of native code that call one product ``reps`` times: through rlx's OpenBLAS
    (``cblas_sgemm``), rlx's register tiles, and MKL's Fortran ``sgemm_`` found in libtorch.

    Each loop takes ``(reps, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc)``, row-major,
    ``C = op(A) op(B)``. MKL is column-major: the same C comes from ``C^T = op(B)^T op(A)^T``.
    """

    def __init__(self, blas: RlxOpenBlas) -> None:
        from llvmlite import ir

        import rlx.codegen.jit as jit
        from rlx.codegen.blas import SGEMM
        from rlx.codegen.irutil import F32, I8, I32, I64, PTR, VOID, declare, for_range
        from rlx.codegen.tile_gemm import PRODUCT_ARGS, host_tile_shape, runtime_symbols

        self.mkl_sgemm = _mkl_sgemm_address()
        shape = host_tile_shape()
        module = ir.Module(name="benchmark_products")
        args = [I64, I32, I32, I64, I64, I64, PTR, I64, PTR, I64, PTR, I64]
        sgemm = declare(module, SGEMM, VOID, [I32] * 6 + [F32, PTR, I32, PTR, I32, F32, PTR, I32])
        imports = {SGEMM: blas.sgemm_address_value}
        names = ["openblas_loop"]
        if self.mkl_sgemm:
            imports[_MKL_SGEMM] = self.mkl_sgemm
            names.append("mkl_loop")
        if shape is not None:
            imports |= runtime_symbols(shape)
            names.append("tiles_loop")
        for name in names:
            fn = ir.Function(module, ir.FunctionType(VOID, args), name=name)
            reps, trans_a, trans_b, m, n, k, a, lda, b_mat, ldb, c, ldc = fn.args
            b = ir.IRBuilder(fn.append_basic_block("entry"))
            sizes = [b.trunc(value, I32) for value in (m, n, k, lda, ldb, ldc)]
            one, zero = ir.Constant(F32, 1.0), ir.Constant(F32, 0.0)
            call: Callable[[], object]
            if name == "openblas_loop":
                flags = [b.add(flag, ir.Constant(I32, 111)) for flag in (trans_a, trans_b)]  # 111 N, 112 T
                call_args = [ir.Constant(I32, 101), *flags, *sizes[:3], one, a, sizes[3], b_mat, sizes[4], zero, c,
                             sizes[5]]  # fmt: skip
                call = functools.partial(b.call, sgemm, call_args)
            elif name == "mkl_loop":  # Fortran, column-major, every argument by reference
                cell = functools.partial(_stored, b)
                # 'N' (78) or 'T' (84); C^T = op(B)^T op(A)^T, so B's flag and sizes come first
                chars = [cell(b.trunc(b.add(b.mul(flag, ir.Constant(I32, 6)), ir.Constant(I32, 78)), I8), I8)
                         for flag in (trans_b, trans_a)]  # fmt: skip
                refs = [cell(value, I32) for value in sizes]
                call_args = [*chars, refs[1], refs[0], refs[2], cell(one, F32), b_mat, refs[4], a, refs[3],
                             cell(zero, F32), c, refs[5]]  # fmt: skip
                mkl = declare(module, _MKL_SGEMM, VOID, [PTR] * 13)
                call = functools.partial(b.call, mkl, call_args)
            else:
                assert shape is not None
                products = [declare(module, shape.product_name(flag), VOID, PRODUCT_ARGS) for flag in (False, True)]
                transposed = b.icmp_signed("!=", trans_a, ir.Constant(I32, 0))
                call_args = [m, n, k, one, a, lda, b_mat, ldb, zero, c, ldc, *[ir.Constant(I64, 0)] * 3]  # as stored
                call = functools.partial(_call_either, b, transposed, products[1], products[0], call_args)
            with for_range(b, 0, reps, "rep"):
                call()
            b.ret_void()
        with jit._lock:
            code = jit.jit_state().target_machine.emit_object(jit._optimized_module(str(module)))
            tracker = jit._link(code, imports, tuple(names))
        self._tracker = tracker  # keeps the code alive
        signature = ctypes.CFUNCTYPE(None, *_LOOP_ARGS)
        self.loops = {name: signature(int(tracker[name])) for name in names}

    def time(self, p: Product, burst: float, rounds: int, tiles: bool) -> tuple[float, float, float]:
        """Seconds of one product through OpenBLAS, torch's BLAS and the tiles (``tiles`` False: not
        timed, 0): the best burst of each, checked against each other."""
        rng = np.random.default_rng(0)
        lda, ldb, ldc = p.leading()
        a = rng.standard_normal((p.k if p.trans_a else p.m, lda), dtype=np.float32)
        b = rng.standard_normal((p.n if p.trans_b else p.k, ldb), dtype=np.float32)
        outputs = {name: np.zeros((p.m, ldc), dtype=np.float32) for name in ("openblas", "torch", "tiles")}
        reps = max(1, int(2e6 / (p.m * p.n * p.k)))  # about a millisecond a call

        def native(name: str, loop: str) -> Callable[[], None]:
            c = outputs[name]
            fn = self.loops[loop]
            return lambda: fn(reps, int(p.trans_a), int(p.trans_b), p.m, p.n, p.k, a.ctypes.data, lda,
                              b.ctypes.data, ldb, c.ctypes.data, ldc)  # fmt: skip

        calls = {"openblas": native("openblas", "openblas_loop")}
        if self.mkl_sgemm:
            calls["torch"] = native("torch", "mkl_loop")
        else:
            import torch

            ta = torch.from_numpy(a)[:, : (p.m if p.trans_a else p.k)]
            tb = torch.from_numpy(b)[:, : (p.k if p.trans_b else p.n)]
            ta, tb = (ta.t() if p.trans_a else ta), (tb.t() if p.trans_b else tb)
            tc = torch.from_numpy(outputs["torch"])[:, : p.n]

            def torch_mm() -> None:
                for _ in range(reps):
                    torch.mm(ta, tb, out=tc)

            calls["torch"] = torch_mm
        if tiles:
            calls["tiles"] = native("tiles", "tiles_loop")
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(rounds):
            for name, call in calls.items():
                call()
                count, start = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - start) < burst:
                    call()
                    count += 1
                best[name] = min(best[name], elapsed / count / reps)
        for name in calls:
            if not np.allclose(
                outputs[name][:, : p.n], outputs["openblas"][:, : p.n], rtol=1e-3, atol=1e-3 * math.sqrt(p.k)
            ):
                raise RuntimeError(f"{name} and OpenBLAS disagree on the product {p.label}")
        return best["openblas"], best["torch"], best.get("tiles", 0.0)


def _stored(b: Any, value: Any, ty: Any) -> Any:
    """A stack slot holding ``value`` (a Fortran argument)."""
    slot = b.alloca(ty)
    b.store(value, slot)
    return slot


def _call_either(b: Any, condition: Any, if_true: Any, if_false: Any, args: list[Any]) -> None:
    """``condition ? if_true(args) : if_false(args)`` in generated code."""
    with b.if_else(condition) as (then, otherwise):
        with then:
            b.call(if_true, args)
        with otherwise:
            b.call(if_false, args)


def _mkl_sgemm_address() -> int | None:
    """MKL's Fortran ``sgemm_`` in libtorch (the x86 wheels link MKL statically and export it), or
    None where this torch has none."""
    import torch

    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        handle = ctypes.CDLL(str(library))
        return ctypes.cast(handle.sgemm_, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def attention_products(
    batch: int, heads: int, seq: int, dim: int, causal: bool, backward: bool, strided_rows: bool = False
) -> list[Product]:
    """The products rlx's attention kernel calls BLAS for, strip by strip (its own strip height,
    ``strided_rows`` for BSHD heads): ``S = Q K^T`` and ``out = P V`` forward; ``S``, ``dP = dY
    V^T``, ``dV += P^T dY``, ``dQ = dS K`` and ``dK += dS^T Q`` backward, each operand's rows as
    far apart as in the kernel (strips and transposed copies an odd number of lines apart, a
    head's rows H·D floats apart in BSHD, or dense copies of them). A causal strip sees the
    keys up to its last row. From ``PACK_MIN_ROWS`` queries on, the kernel reads K and V from
    transposed copies, so ``S`` and ``dP`` are NN products; below, NT. Causal kernels on the
    register tiles band their strips (``lower_attention.BANDS``): a tall strip whose products
    skip what lies above its diagonal; these whole products take the short strips of the rules
    without bands, which compute about as much (the band skips per 6-row tile)."""
    from rlx.codegen.blas import load_blas
    from rlx.codegen.lower_attention import DENSE_ROWS_MIN_KEYS, may_pack, packed_ld, strip_ld
    from rlx.codegen.strip_heights import choose_block_q

    block_q = choose_block_q(seq, seq, needs_dp=backward, causal_like=causal, strided_rows=strided_rows, head_dim=dim,
                             small_path=load_blas().has_small_path)  # fmt: skip
    keys_transposed = not may_pack(seq)
    head_ld = heads * dim if strided_rows else dim  # a head's rows, as the kernel reads them in place
    strip_rows_ld = packed_ld(dim) if strided_rows and seq >= DENSE_ROWS_MIN_KEYS else head_ld  # Q, dY per strip
    keys_ld = head_ld if keys_transposed else packed_ld(seq)  # K (V) as stored, or its transposed copy
    counts: dict[tuple[int, ...], int] = {}
    for first in range(0, seq, block_q):
        rows = min(block_q, seq - first)
        keys = min(seq, first + rows) if causal else seq
        scores_ld = strip_ld(keys)
        # (m, n, k, trans_a, trans_b, lda, ldb, ldc)
        scores = (rows, keys, dim, False, keys_transposed, strip_rows_ld, keys_ld, scores_ld)
        shapes = [scores]
        if backward:
            shapes += [scores, (keys, dim, rows, True, False, scores_ld, head_ld, dim),
                       (rows, dim, keys, False, False, scores_ld, dim, dim),
                       (keys, dim, rows, True, False, scores_ld, head_ld, dim)]  # fmt: skip
        else:
            shapes.append((rows, dim, keys, False, False, scores_ld, dim, dim))
        for shape in shapes:
            counts[shape] = counts.get(shape, 0) + batch * heads
    return [
        Product(m, n, k, bool(ta), bool(tb), count, lda, ldb, ldc)
        for (m, n, k, ta, tb, lda, ldb, ldc), count in counts.items()
    ]


def blas_table(rows: Sequence[tuple[str, Mapping[str, object], float | None]]) -> str:
    """One line per case: its products on one thread (a :meth:`BlasComparison.as_dict`): through
    what rlx's kernel calls, OpenBLAS alone, torch's BLAS; and the share of the rlx kernel's time
    spent in its products (its profiling build)."""
    header = ["case", "products GFLOP", "rlx ms (tiles + OpenBLAS)", "OpenBLAS alone ms", "torch BLAS ms",
              "torch BLAS speed-up over rlx", "products share of rlx"]  # fmt: skip
    lines = []
    for label, c, share in rows:
        lines.append([
            label, f"{float(c['flops']) / 1e9:.2f}", f"{float(c['rlx_s']) * 1e3:.1f}",
            f"{float(c['openblas_s']) * 1e3:.1f}", f"{float(c['torch_s']) * 1e3:.1f}",
            f"{float(c['torch_speedup']):.2f}x", "-" if share is None else f"{share:.0%}",
        ])  # fmt: skip
    return markdown_table(header, lines)
