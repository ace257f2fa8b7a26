"""How many query rows an attention kernel's strips take, decided at compile time or per call.

The strip height decides which path the strip products take (OpenBLAS's small-matrix path,
rlx's register tiles, OpenBLAS's packed path), how much of a causal strip's work is the hidden
triangle above its diagonal, and how many scratch bytes a thread holds. The measurements behind
each rule are in :func:`strip_heights`. The rules depend on the sequence lengths; everything
else they read (mask, gradients, layout, head width) is fixed per kernel. So a kernel's rules
are a table of caps by key length (:class:`StripHeights`), which a kernel of static lengths
applies at compile time and one of symbolic lengths (rlx.torch's, a decode loop's) applies in
native code on every call: before, symbolic kernels took 128 rows whatever the lengths, and
ran 20-25% slower than static ones on causal masks (B8 H8 S256 D64, BHSD backward 7.5 against
6.0 ms, forward 3.4 against 2.8).
"""

from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from rlx.codegen.irutil import i64, smax, smin

SCRATCH_BUDGET = 64 << 20  # bytes of strip buffers per thread at most
SMALL_PATH_MACS = 1_000_000  # OpenBLAS (SkylakeX) runs products up to this many multiply-adds unpacked
SMALL_PATH_ROWS = 32  # the short strip height, and the shortest a budget leaves
EVERY_LENGTH = 1 << 62  # the bound of the last cap: every key length


@dataclass(frozen=True)
class StripHeights:
    """One kernel's strip-height rules: ``caps`` are ``(rows, largest Sk)`` in ascending order of
    Sk, the first whose bound holds applying (the last bounds every length); ``buffers`` strips
    of ``rows x Sk`` floats share :data:`SCRATCH_BUDGET`. Strips are balanced (``ceil(Sq / n)``
    rows each) so that no strip is a sliver."""

    caps: tuple[tuple[int, int], ...]
    buffers: int

    def cap(self, seq_k: int) -> int:
        return next(rows for rows, largest in self.caps if seq_k <= largest)

    def rows(self, seq_q: int, seq_k: int) -> int:
        """The strip height for these lengths (at least 1, at most ``seq_q``)."""
        seq_q, seq_k = max(seq_q, 1), max(seq_k, 1)
        target = max(SMALL_PATH_ROWS, min(self.cap(seq_k), SCRATCH_BUDGET // (4 * seq_k * self.buffers)))
        strips = -(-seq_q // target)
        return -(-seq_q // strips)

    def emit_rows(self, b: ir.IRBuilder, seq_q: ir.Value, seq_k: ir.Value) -> ir.Value:
        """:meth:`rows` in native code, for the lengths of a call."""
        seq_q, seq_k = smax(b, seq_q, i64(1)), smax(b, seq_k, i64(1))
        cap: ir.Value = i64(self.caps[-1][0])
        for rows, largest in reversed(self.caps[:-1]):
            cap = b.select(b.icmp_signed("<=", seq_k, i64(largest)), i64(rows), cap, name="strip.cap")
        budget = b.sdiv(i64(SCRATCH_BUDGET), b.mul(seq_k, i64(4 * self.buffers)), name="strip.budget")
        target = smax(b, i64(SMALL_PATH_ROWS), smin(b, cap, budget), name="strip.target")
        strips = b.sdiv(b.add(seq_q, b.sub(target, i64(1))), target, name="strips.n")
        return b.sdiv(b.add(seq_q, b.sub(strips, i64(1))), strips, name="block.q")

    def most_floats(self, seq_k: int) -> int:
        """A bound on ``rows(Sq, s) * s`` over every ``Sq`` and every ``s <= seq_k``, that grows
        with ``seq_k``: what a thread's scratch holds for calls of up to ``seq_k`` keys."""
        seq_k = max(seq_k, 1)
        tallest = max(rows for rows, largest in self._reached(seq_k))
        return max(SMALL_PATH_ROWS * seq_k, min(tallest * seq_k, SCRATCH_BUDGET // (4 * self.buffers)))

    def most_rows(self) -> int:
        """The tallest strip any call takes."""
        return max(SMALL_PATH_ROWS, *(rows for rows, _ in self.caps))

    def _reached(self, seq_k: int) -> list[tuple[int, int]]:
        """The caps that apply to some length up to ``seq_k``."""
        reached, below = [], 0
        for rows, largest in self.caps:
            if largest > below:
                reached.append((rows, largest))
            if largest >= seq_k:
                break
            below = max(below, largest)
        return reached


def strip_heights(
    needs_dp: bool,
    causal_like: bool,
    strided_rows: bool = False,
    head_dim: int = 64,
    small_path: bool = True,
    banded: bool = False,
) -> StripHeights:
    """The strip-height rules of one kernel, from measurements on the benchmark shapes (see
    benchmarks/README.md); ``head_dim`` is the wider of D and Dv, ``small_path`` whether OpenBLAS
    runs small products unpacked (``Blas.has_small_path``), ``banded`` whether a causal-like
    kernel's products skip what lies above each strip's diagonal (``lower_attention.BANDS``).

    Tall strips turn the rank-``block_q`` updates of dK/dV into efficient GEMMs: at Sk = 16384,
    512 rows ran 1.5x faster than 64 (AMD EPYC host). On an Intel Xeon host 256 rows were 5-10%
    faster than 512 in the backward at S = 4096-16384 and as fast in the forward, with half the
    scratch, so long sequences use 256. A causal-like strip computes the hidden triangle above its
    diagonal, a fraction ``block_q / 2 Sk`` of the whole, so causal-like masks take shorter
    strips: 64 rows up to Sk = 1024 (Intel Xeon, B·H = 32-96, backward against 128 rows: 25%
    faster at S = 128, 13% at 256, 5% at 512, even at 1024), 128 up to 2048. Where a head's rows
    are strided (``strided_rows``: BSHD with several heads) every strip of the backward adds into
    dK and dV rows a cache line or two apart, so there the backward keeps 64 rows only below
    Sk = 512 (BSHD: 14% faster at 256, 2% at 384; 3% slower at 512, 5% at 1024). Without a mask,
    Sk <= 128 takes 64 rows too: the strip products fit OpenBLAS's small-matrix path (SkylakeX
    kernels, up to 10^6 multiply-adds, no packing) and the strips stay in L1 (backward 9% faster
    at B8 H12 S128 than one 128-row strip; 256 and 384 keys ran fastest with the longest strips),
    except in the strided backward, where one strip of up to 128 rows ran 3-9% faster since its
    products run on the register tiles (B8 H12 S128 BSHD), and in the strided forward where 128
    rows move the products onto the tiles (B8 H12 S128 D64: 15% faster; but 5% slower at S100,
    whose 128-row products stay on the path, and at D128, whose 64-row products are on tiles).
    Shorter still, 32 rows, where that keeps a strip's products on that path (at most 10^6
    multiply-adds) and a taller strip would leave it.
    Causal-like, up to Sk = 512 and Sk·D = 32768 (a causal strip's products see half the keys on
    average): B4 H8 S512 D64, 32 rows against 64: forward 5.2 against 6.1 ms, backward 11.8
    against 13.6 (S256: 4.2 against 5.0, 10.0 against 11.5; S256 D128 3.2 against 3.6; but S512
    D128 ran fastest with 64); the strided (BSHD) backward too, since its products moved to the
    register tiles (B4 H8 D64, 32 rows against the 64 or 128 it had: S256 3.66 against 3.84 ms,
    S384 7.24 against 7.73, S512 14.25 against 15.13; medians of 25 interleaved calls; S512 D128
    38.9 against 33.3, so the Sk·D bound holds). Unmasked, 128 < Sk <= 256 with 32·Sk·D within
    the path: B8 H12 S256 D64 backward 15.5 ms with 32 rows, 17.6 with 256, 19.3 with 64 (just
    over the path); D128 stays at 256 rows, which ran fastest there. Not where the rows are
    strided: there the BSHD backward ran fastest with 256 unmasked rows.
    Without the small-matrix path (OpenBLAS's Haswell kernels, on AMD Zen) every strip product
    runs on the register tiles, and the unmasked rules that keep products on that path have
    nothing to keep: such a host takes the long-sequence height everywhere unmasked (AMD EPYC,
    Zen 3; B8 H12 D64, interleaved medians of 21: S = 200 and 256 forward 0.92-0.94x the time
    of the 32-row strips, backward BHSD 0.92x, BSHD 0.98x; S = 128 within 1-3% either way). The
    causal-like rules stand: 32-row strips hide less of the triangle there too (B4 H8 S512 D64
    forward: 8.58 ms with 32 rows, 8.86 with 64, 9.02 with 128).
    Banded causal-like strips (every product on the tiles, none on a small-matrix path) compute
    no hidden triangle, so they no longer need to be short, and tall ones make the products of
    dK and dV sum over more rows per pass over them: 128 rows while Sk·D <= 65536, 256 beyond
    (AMD EPYC, Zen 3, BSHD, B·H = 8-96, medians of 11-21 interleaved calls; against the 32 rows
    of before: S512 D64 backward 19.3 against 21.1 ms, forward 8.3 against 9.5; S256 10.7
    against 11.8 and 5.2 against 5.7; S1024 and longer as fast as the 128 and 256 of before,
    which hid little; S768 D128 forward 12.9 with 256 rows against 14.2 with 128).
    Scratch stays O(block_q · Sk) per thread, capped by :data:`SCRATCH_BUDGET`.
    """
    buffers = 2 if needs_dp else 1
    strided_backward = needs_dp and strided_rows
    caps: list[tuple[int, int]]
    if causal_like and banded and not small_path:
        caps = [(128, 65536 // head_dim)]
    elif causal_like:
        short = min(512, 32768 // head_dim)
        caps = [(SMALL_PATH_ROWS, short), (64, 511 if strided_backward else 1024), (128, 2048)]
    elif not small_path:
        caps = []
    else:
        if strided_backward:
            caps = [(128, 128)]
        elif strided_rows:  # 128 rows where that moves the products off the small-matrix path onto the tiles
            on_path_64, on_path_128 = SMALL_PATH_MACS // (64 * head_dim), SMALL_PATH_MACS // (128 * head_dim)
            caps = [(64, min(on_path_128, 128)), (128, min(on_path_64, 128)), (64, 128)]
        else:
            caps = [(64, 128)]
        if not strided_rows:
            caps.append((SMALL_PATH_ROWS, min(256, SMALL_PATH_MACS // (SMALL_PATH_ROWS * head_dim))))
    caps.append((256, EVERY_LENGTH))
    return StripHeights(tuple(caps), buffers)


def choose_block_q(
    seq_q: int,
    seq_k: int,
    needs_dp: bool,
    causal_like: bool,
    strided_rows: bool = False,
    head_dim: int = 64,
    small_path: bool = True,
    banded: bool = False,
) -> int:
    """Query rows per strip for these lengths (:func:`strip_heights`' rules)."""
    return strip_heights(needs_dp, causal_like, strided_rows, head_dim, small_path, banded).rows(seq_q, seq_k)
