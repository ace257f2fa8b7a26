"""Where an attention kernel's time goes: per-thread nanosecond counters in profiling builds.

Both attention lowerings (fixed masks and mods) time their products, their softmax rows and
their dS rows into the same counters, so ``Executable.attention_breakdown`` splits either kind
of kernel, and the benchmarks print one breakdown table for both. The counters are the last 64
bytes of each thread's scratch: a thread's items run one after another, so adding to them needs
no atomics, and a call's kernels never run at once, so every attention node of a graph shares
them. Only static shapes are profiled (a symbolic length sizes the scratch per call).
"""

from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from rlx.codegen.irutil import I8, I64, clock, gep, i64

# The counters, in order: products (sgemm, register tiles, the transposed copies of K and V),
# softmax (mods, mask, max, exp, sums), dS (the softmax backward, with a score_mod's
# derivative), and the whole item; the rest of an item is addressing, tile maps and zeroing.
BREAKDOWN = ("blas", "softmax", "softmax_backward", "kernel")
COUNTERS_BYTES = 64  # whole cache line, so no two threads' counters share one


class KernelClock:
    """The counters of the function being emitted, or nothing at all in a build that does not profile."""

    def __init__(self, module: ir.Module, enabled: bool, counters_at: int) -> None:
        self.now = clock(module) if enabled else None
        self.counters_at = counters_at  # byte offset of the counters in a thread's scratch
        self.counters: ir.Value | None = None  # this thread's counters, in the function being emitted

    @property
    def enabled(self) -> bool:
        return self.now is not None

    def point_at(self, b: ir.IRBuilder, scratch: ir.Value) -> None:
        """Find this thread's counters from its scratch (profiling builds)."""
        if self.enabled:
            self.counters = gep(b, scratch, [i64(self.counters_at)], I8, "counters")

    def start(self, b: ir.IRBuilder) -> ir.Value | None:
        """The time now, where the function being emitted counts; else None."""
        return self.now(b) if self.now is not None and self.counters is not None else None

    def count(self, b: ir.IRBuilder, what: str, started: ir.Value | None) -> None:
        """Add the nanoseconds since ``started`` (from :meth:`start`) to counter ``what``."""
        if started is None or self.counters is None or self.now is None:
            return
        slot = gep(b, self.counters, [i64(BREAKDOWN.index(what))], I64)
        b.store(b.add(b.load(slot, typ=I64), b.sub(self.now(b), started)), slot)

    def timed(self, b: ir.IRBuilder, what: str, emit: Callable[[], object]) -> None:
        """Emit ``emit()`` and, in a profiling build, count its time as ``what``."""
        started = self.start(b)
        emit()
        self.count(b, what, started)
