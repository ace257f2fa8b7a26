"""Register-tiled products for the attention kernels' strips, emitted through LLVM.

The strip products of an attention kernel have one side equal to the head dim or the strip
height (32-256) and are called thousands of times per call. OpenBLAS runs those of up to 10^6
multiply-adds on its small-matrix path at close to the core's FMA rate, but everything larger
(a 128-row strip over 512 keys, ``P V`` over 1024 keys) goes through its general path, which
packs both operands on every call: measured on one core of an AVX-512 Xeon, in a native loop,
32x512x64 ran at 104 GFLOP/s, 64x64x512 at 116 and 128x512x64 at 134, where MKL ran the same
products at 164-179. This kernel packs nothing but the panels of B that would be read from
far apart (see ``_ProductEmitter._all_tiles``), and reads B pre-packed where the caller packed
it once for many products. Each tile of ``rows`` x ``vectors`` SIMD vectors of C stays in
registers while ``k`` runs; every step loads one row of the tile's columns of B and broadcasts
one element of A per row into fused multiply-adds (14 x 2 vectors of 16 floats: 28 of
AVX-512's 32 registers). The same products ran at 140-180 GFLOP/s. A causal strip's products
skip what lies above its diagonal (:class:`Band`).

Products of the block (projections, MLP) stay on BLAS: they are large enough for its packing
to pay off. Only the attention kernels call this, and only for ``op(B) = B`` (row-major, any
leading dimension); ``A`` may be transposed (``dV += P^T dY``). Results depend only on the
shapes: each element of C sums its ``k`` products in order, whatever the thread count.

The products are a small runtime library, compiled once per process on first use (like the
thread pool) and linked into generated code by address, as BLAS is: a graph's own code only
calls them, so its compile time does not grow with them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from rlx.codegen.irutil import (
    F32,
    I1,
    I32,
    I64,
    PTR,
    VOID,
    declare,
    f32,
    for_range,
    gep_f32,
    i32,
    i64,
    intrinsic,
    smax,
    smin,
)
from rlx.codegen.vector import splat, zero_vector

K_BLOCK = 512  # terms of k per pass over C: a tile's rows of A and a panel of B stay in L2
# A wide product's panel of B is copied contiguous when B's rows lie at least this many floats (a
# page) apart and C has this many rows to reuse the copy (see _ProductEmitter._all_tiles).
FAR_ROWS_LD = 1024
FAR_COPY_MIN_ROWS = 64
FAR_DIAGONAL = 1 << 40  # a diagonal no index reaches: that side of the band skips nothing

# (m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, band, diagonal, b_panels): sgemm's arguments
# without order and transposes, the band of a causal strip that the product may skip
# (:class:`Band`), and ``b_panels`` > 0 where B comes packed: panel p holds B's columns
# p·columns .. (p + 1)·columns - 1 row after row, ``columns`` floats a row (zeros past B's last
# column), and panel p + 1 starts b_panels floats after panel p (ldb is then not read). The
# attention kernels pack a head's V or K so once per head (lower_attention.emit_panel_copy),
# where the products would copy each panel of it again for every strip.
PRODUCT_ARGS = [I64, I64, I64, F32, PTR, I64, PTR, I64, F32, PTR, I64, I64, I64, I64]


class Band:
    """What part of a product a causal strip needs, given a ``diagonal`` d (:data:`PRODUCT_ARGS`).

    The strips of a causal attention kernel are lower triangles of scores: row i of a strip sees
    keys j <= i + d. Computed whole, a strip of R rows spends R^2/2 of its products on scores
    the mask hides, and on the zeros they become. A banded product skips the tiles of C, or the
    steps of k, that only those touch: the sums it does compute add the same terms in the same
    order, so its results are bitwise those of the whole product wherever the caller reads them.

    - ``NONE``: the whole product.
    - ``OUT_LOWER``: only C[i, j] with j <= i + d is needed (S = Q K^T, dP = dY V^T); a tile
      wholly above the diagonal is left unwritten.
    - ``K_UPPER``: op(A)[i, p] is 0 for p > i + d (out = P V, dQ = dS K): row i sums p <= i + d.
    - ``K_LOWER``: op(A)[i, p] is 0 for p < i - d (dV += P^T dY, dK += dS^T Q: A's row i is key
      i, which strip rows from i - d on see): row i sums p >= i - d.
    """

    NONE = 0
    OUT_LOWER = 1
    K_UPPER = 2
    K_LOWER = 3


# (a, a's row stride, a's column stride, b panel, ldb, c, ldc, k, alpha, beta, i, j, columns): one
# tile at row i, column j of C; a points at the tile's first row of op(A), whose element (r, p)
# is a[r·row stride + p·column stride], and the b panel at B's column j (or a copy of it).
_TILE_ARGS = [PTR, I64, I64, PTR, I64, PTR, I64, I64, F32, F32, I64, I64, I64]


@dataclass(frozen=True)
class TileShape:
    """A register tile of C: ``rows`` rows of ``vectors`` SIMD vectors of ``width`` floats."""

    rows: int
    vectors: int
    width: int

    @property
    def columns(self) -> int:
        return self.vectors * self.width

    @property
    def row_steps(self) -> tuple[int, ...]:
        """Tile heights, largest first: whole tiles, then what is left of the rows in tiles of
        4 and of 1 (a 32-row strip is 14 + 14 + 4), so no row is computed twice. Few heights
        keep the library small: it is compiled at the first attention call of a process."""
        return tuple(sorted({self.rows, min(4, self.rows), 1}, reverse=True))

    def step_cycles(self, height: int) -> int:
        """Cycles of one step of k for a tile of ``height`` rows, on a core of two FMA pipes of
        latency 4: ``height·vectors`` FMAs, at most two a cycle, each chain at most one per 4
        cycles (a row of 1 takes as long as a row of 4)."""
        return max(height * self.vectors // 2, 4)

    def remainder_cycles(self, rows: int) -> int:
        """Cycles of one step of k for ``rows`` rows in tiles of 4 and of 1 (see row_steps)."""
        return rows // 4 * self.step_cycles(4) + rows % 4 * self.step_cycles(1)

    def rows_given_back(self, remainder: int) -> int:
        """Whole tiles to leave to the short ones when ``remainder`` rows (``m`` mod ``rows``)
        are left over: 1 where 4-row tiles cover the remainder and one whole tile in fewer
        cycles than 1-row tiles cover the remainder alone (128 rows: 20·6 + 2·4, not 21·6 +
        2·1), else 0."""
        own = self.remainder_cycles(remainder)
        shared = self.remainder_cycles(remainder + self.rows) - self.step_cycles(self.rows)
        return int(shared < own)

    def product_name(self, trans_a: bool) -> str:
        return f"rlx_tile_gemm_{'tn' if trans_a else 'nn'}_{self.rows}x{self.vectors}x{self.width}"


AVX512_TILE = TileShape(rows=14, vectors=2, width=16)  # 28 accumulators of 32 zmm registers
AVX2_TILE = TileShape(rows=6, vectors=2, width=8)  # 12 accumulators of 16 ymm registers


def tile_shape_for(features: str) -> TileShape | None:
    """The tile for a CPU with these LLVM features (``+avx512f,...``), or None: no FMA vectors,
    and BLAS keeps every product."""
    enabled = {flag[1:] for flag in features.split(",") if flag.startswith("+")}
    if {"avx512f", "fma"} <= enabled:
        return AVX512_TILE
    if {"avx2", "fma"} <= enabled:
        return AVX2_TILE
    return None


@functools.cache
def host_tile_shape() -> TileShape | None:
    """The tile for this machine's CPU (the one the JIT compiles for)."""
    from rlx.codegen.jit import jit_state

    return tile_shape_for(jit_state().features)


def declare_tile_gemm(module: ir.Module, trans_a: bool, shape: TileShape) -> ir.Function:
    """``C = alpha op(A) B + beta C`` (row-major; ``op(A)`` is m x k, B is k x n), declared in a
    generated module: :data:`PRODUCT_ARGS`, i64 sizes. As in BLAS, C is not read when beta is 0."""
    return declare(module, shape.product_name(trans_a), VOID, PRODUCT_ARGS)


def tile_symbols(llvm_ir: str) -> dict[str, int]:
    """The addresses of the host's products, when generated code (``llvm_ir``) calls them."""
    shape = host_tile_shape()
    if shape is None or not any(shape.product_name(trans_a) in llvm_ir for trans_a in (False, True)):
        return {}
    return runtime_symbols(shape)


@functools.cache
def runtime_symbols(shape: TileShape) -> dict[str, int]:
    """Compile and link the products of one tile shape (once per process): name -> address."""
    from rlx.codegen.jit import link_runtime

    names = tuple(shape.product_name(trans_a) for trans_a in (False, True))
    return link_runtime(str(runtime_module(shape)), (), names)  # compiled without LSR: jit.LLVM_FLAGS


def runtime_module(shape: TileShape) -> ir.Module:
    """Both products of one tile shape (A as stored, A transposed), sharing their tiles: a tile
    reads A through a row and a column stride, so one tile serves both."""
    module = ir.Module(name=f"rlx_tiles_{shape.rows}x{shape.vectors}x{shape.width}")
    tiles = {height: _define_tile(module, shape, height) for height in shape.row_steps}
    for trans_a in (False, True):
        fn = ir.Function(module, ir.FunctionType(VOID, PRODUCT_ARGS), name=shape.product_name(trans_a))
        fn.attributes.add("nounwind")
        for index in (4, 6, 9):
            fn.args[index].add_attribute("noalias")
        _ProductEmitter(ir.IRBuilder(fn.append_basic_block("entry")), fn, shape, tiles, trans_a).emit()
    return module


class _ProductEmitter:
    """The loops of one product: blocks of ``k``, and in each every tile of C, column panel by
    column panel (a tall product's panels of B copied contiguous first)."""

    def __init__(
        self, b: ir.IRBuilder, fn: ir.Function, shape: TileShape, tiles: dict[int, ir.Function], trans_a: bool
    ) -> None:
        self.b, self.shape, self.tiles, self.trans_a = b, shape, tiles, trans_a
        (
            self.m, self.n, self.k, self.alpha, self.a, self.lda, self.b_mat, self.ldb, self.beta, self.c, self.ldc,
            self.band, self.diagonal, self.b_panels,
        ) = fn.args  # fmt: skip

    def emit(self) -> None:
        b, shape = self.b, self.shape
        # The band as three diagonals, each far off where its mode is not the band's: every
        # tile's limits are then a few min/max, with no branch on the mode for LLVM to unswitch
        # into copies of the loops (which doubled the library's compile time).
        self.diagonals = {
            mode: b.select(b.icmp_signed("==", self.band, i64(mode)), self.diagonal, i64(FAR_DIAGONAL), name=f"d{mode}")
            for mode in (Band.OUT_LOWER, Band.K_UPPER, Band.K_LOWER)
        }
        # A tall product's column panel of B, copied per block of k: see _all_tiles.
        self.panel = b.alloca(ir.VectorType(F32, shape.width), size=i64(K_BLOCK * shape.vectors), name="b.panel")
        self.panel.align = 64
        # One pass even for k = 0, which leaves beta C (zeros for beta 0), as BLAS does.
        with for_range(b, 0, smax(b, self.k, i64(1)), "kblock", K_BLOCK) as k0:
            self.depth = smin(b, i64(K_BLOCK), b.sub(self.k, k0), name="k.block")  # 0 when k is 0
            first = b.icmp_signed("==", k0, i64(0), name="k.first")
            self.block_beta = b.select(first, self.beta, f32(1.0), name="beta.block")  # later blocks add
            self.strides = [i64(1), self.lda] if self.trans_a else [self.lda, i64(1)]  # A's rows, columns
            self.k0 = k0
            self.a_block = gep_f32(b, self.a, b.mul(k0, self.strides[1]), name="a.block")
            self.packed_b = b.icmp_signed(">", self.b_panels, i64(0), name="b.packed")
            b_row_stride = b.select(self.packed_b, i64(shape.columns), self.ldb)  # within a panel if packed
            self.b_block = gep_f32(b, self.b_mat, b.mul(k0, b_row_stride), name="b.block")
            self._all_tiles()
        b.ret_void()

    def _all_tiles(self) -> None:
        """Every tile of C for this block of k. Tall products (``m > n``: ``P V``, ``dV += P^T
        dY``, ``dQ = dS K``) take column panels outermost and copy each panel of B contiguous
        first: B's rows are often a head's rows, H·D floats apart in BSHD, and a panel of 32
        columns read in place fell into a few L1 sets and came from L2 for every tile (256 x 64
        x 512 with B's rows 3 KB apart: 155 GFLOP/s in place, 180 copied; OpenBLAS 141). Wide
        ones (``Q K^T``, whose B is the transposed copy of K, its rows an odd number of lines
        apart) read their panels in place while those rows are less than a page apart, and copy
        them beyond (:data:`FAR_ROWS_LD`), where each step of k would touch another page: over
        1024-16384 keys 1.05-1.65x faster copied from 64-row strips on (256 x 2048 x 64: 138 ->
        160 GFLOP/s; 256 x 16384 x 128: 96 -> 159), 0.9-1.03x for 32 rows; under 1024 keys
        0.93-1.02x. A last panel narrower than a tile is always copied: its columns past B's
        last would be read past B."""
        b, columns = self.b, self.shape.columns
        tall = b.icmp_signed(">", self.m, self.n, name="tall")
        far = b.and_(
            b.icmp_signed(">=", self.ldb, i64(FAR_ROWS_LD)),
            b.icmp_signed(">=", self.m, i64(FAR_COPY_MIN_ROWS)),
            name="far.rows",
        )
        # OUT_LOWER: the panels from column m + d on lie wholly above the diagonal
        n = smax(b, smin(b, b.add(self.m, self.diagonals[Band.OUT_LOWER]), self.n), i64(0), name="n.band")
        with for_range(b, 0, n, "panel", columns) as j:
            whole = b.icmp_signed("<=", b.add(j, i64(columns)), self.n, name="panel.whole")
            unpacked = b.or_(b.or_(tall, far), b.not_(whole), name="panel.unpacked")
            copied = b.and_(unpacked, b.not_(self.packed_b), name="panel.copied")
            with b.if_then(copied):
                self._copy_panel(j)
            packed = gep_f32(b, self.b_block, b.mul(b.sdiv(j, i64(columns)), self.b_panels), name="b.panel.packed")
            in_place = b.select(self.packed_b, packed, gep_f32(b, self.b_block, j), name="b.panel.in.place")
            panel = b.select(copied, b.bitcast(self.panel, PTR), in_place, name="b.panel")
            contiguous = b.or_(copied, self.packed_b)
            self._panel(j, panel, b.select(contiguous, i64(columns), self.ldb, name="b.panel.ld"))

    def _panel(self, j: ir.Value, b_panel: ir.Value, ldb: ir.Value) -> None:
        """The tiles of the column panel at ``j``, every row of C, in :attr:`TileShape.row_steps`."""
        b = self.b
        columns = smin(b, i64(self.shape.columns), b.sub(self.n, j), name="columns")
        operands = [*self.strides, b_panel, ldb, self.c, self.ldc, self.depth, self.alpha, self.block_beta]
        i, whole_rows_end = i64(0), self._whole_rows_end()
        for height in self.shape.row_steps:
            tile = functools.partial(self._tile, self.tiles[height], height, operands, j, columns)
            i = self._rows(i, height, tile, whole_rows_end if height == self.shape.rows else self.m)

    def _tile(
        self, tile: ir.Function, height: int, operands: list[ir.Value], j: ir.Value, columns: ir.Value, i: ir.Value
    ) -> None:
        """One tile's call, over the steps of this block of k that its band leaves (:class:`Band`).

        Only whole tiles look at the band: the short ones (a strip's last few rows) compute
        their whole tile, which gives the same values where the caller reads them (the terms
        the band would skip are 0), and the band's logic at every call site had made the
        library a fifth slower to compile."""
        b = self.b
        if height != self.shape.rows:
            a_tile = gep_f32(b, self.a_block, b.mul(i, self.strides[0]), name="a.tile")
            b.call(tile, [a_tile, *operands, i, j, columns])
            return
        b_panel, ldb, c, ldc, depth, alpha, beta = operands[2:]
        d_out, d_upper, d_lower = (self.diagonals[mode] for mode in (Band.OUT_LOWER, Band.K_UPPER, Band.K_LOWER))
        # rows i .. i + height - 1 sum p < i + height + d_upper and p >= i - d_lower (in this block)
        upper_end = b.sub(b.add(i, i64(height)), b.sub(self.k0, d_upper), name="upper.end")
        end = smax(b, smin(b, upper_end, depth), i64(0), name="tile.end")
        start = smax(b, smin(b, b.sub(b.sub(i, d_lower), self.k0), end), i64(0), name="tile.start")
        steps = b.sub(end, start, name="tile.steps")
        # Above the diagonal (OUT_LOWER), or no step of k in this block to add to C: no call.
        # With beta != 1 (the first block) a tile with no step still scales C, as BLAS would.
        above = b.icmp_signed(">", j, b.add(b.add(i, i64(height - 1)), d_out), name="tile.above")
        idle = b.and_(b.icmp_signed("==", steps, i64(0)), b.fcmp_ordered("==", beta, f32(1.0)))
        with b.if_then(b.not_(b.or_(above, idle), name="tile.runs")):
            a_tile = gep_f32(b, self.a_block, b.add(b.mul(i, self.strides[0]), b.mul(start, self.strides[1])))
            # in bytes: the panel may be the copy, whose pointer llvmlite keeps typed as vectors
            b_offset = b.mul(b.mul(start, ldb), i64(4), name="b.tile.offset")
            b_start = b.inttoptr(b.add(b.ptrtoint(b_panel, I64), b_offset), PTR, name="b.tile")
            b.call(tile, [a_tile, *operands[:2], b_start, ldb, c, ldc, steps, alpha, beta, i, j, columns])

    def _copy_panel(self, j: ir.Value) -> None:
        """B[:depth, j : j + columns] into :attr:`panel`, rows of ``columns`` floats (zeros past
        B's last column)."""
        b, width = self.b, self.shape.width
        whole = b.icmp_signed("<=", b.add(j, i64(self.shape.columns)), self.n, name="copy.whole")
        with b.if_else(whole) as (plain, masked):
            with plain:
                self._copy_rows(j, lambda at, v: b.load(at, typ=ir.VectorType(F32, width), align=4))
            with masked:
                masks = _column_masks(b, b.sub(self.n, j, name="real.columns"), self.shape)
                self._copy_rows(j, lambda at, v: _masked_load(b, at, masks[v]))

    def _copy_rows(self, j: ir.Value, load: Callable[[ir.Value, int], ir.Value]) -> None:
        """The copy loop of :meth:`_copy_panel`, reading vector ``v`` of a row at ``at`` with
        ``load``. Whole panels take plain loads: a masked load (vmaskmovps) issued on every row
        made the copy a twentieth of a short backward's time on AMD's Zen 3 (B8 H12 S128)."""
        b, width, vectors = self.b, self.shape.width, self.shape.vectors
        with for_range(b, 0, self.depth, "copy") as p:
            row = gep_f32(b, self.b_block, b.add(b.mul(p, self.ldb), j), name="b.row")
            for v in range(vectors):
                value = load(gep_f32(b, row, i64(v * width)), v)
                b.store(value, b.gep(self.panel, [b.add(b.mul(p, i64(vectors)), i64(v))], inbounds=True), align=64)

    def _whole_rows_end(self) -> ir.Value:
        """Where the whole tiles stop: before ``m``, less one whole tile where the short tiles
        do the rest faster with it (:meth:`TileShape.rows_given_back`)."""
        b, rows = self.b, self.shape.rows
        remainder = b.srem(self.m, i64(rows), name="rows.left")
        end = self.m
        for left in range(1, rows):
            if self.shape.rows_given_back(left):
                back = b.and_(b.icmp_signed("==", remainder, i64(left)), b.icmp_signed(">=", self.m, i64(rows + left)))
                end = b.select(back, b.sub(self.m, i64(rows + left)), end)
        return end

    def _rows(self, start: ir.Value, height: int, body: Callable[[ir.Value], None], stop: ir.Value) -> ir.Value:
        """``for i = start; i + height <= stop; i += height: body(i)``; returns where it stopped."""
        b = self.b
        before = b.block
        cond, inner, end = (b.append_basic_block(f"rows{height}.{part}") for part in ("cond", "body", "end"))
        b.branch(cond)
        b.position_at_end(cond)
        index = b.phi(I64, name=f"rows{height}")
        index.add_incoming(start, before)
        b.cbranch(b.icmp_signed("<=", b.add(index, i64(height)), stop), inner, end)
        b.position_at_end(inner)
        body(index)
        index.add_incoming(b.add(index, i64(height), name=f"rows{height}.next"), b.block)
        b.branch(cond)
        b.position_at_end(end)
        return index


def _define_tile(module: ir.Module, shape: TileShape, height: int) -> ir.Function:
    """C[i : i + height, j : j + columns] = alpha op(A)[rows, :k] B[:k, cols] (+ beta C), its
    ``height`` x ``vectors`` accumulators in registers while ``k`` runs (:data:`_TILE_ARGS`)."""
    fn = ir.Function(module, ir.FunctionType(VOID, _TILE_ARGS), name=f"tile.{height}")
    fn.linkage = "internal"
    fn.attributes.add("nounwind")
    fn.attributes.add("noinline")  # a call per tile costs nothing next to its k steps
    a, row_stride, column_stride, b_mat, ldb, c, ldc, depth, alpha, beta, i, j, columns = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    width, vectors = shape.width, shape.vectors
    vector, mask_type = ir.VectorType(F32, width), ir.VectorType(I1, width)
    fma = intrinsic(module, f"llvm.fma.v{width}f32", vector, [vector] * 3)
    masked_store = intrinsic(module, f"llvm.masked.store.v{width}f32.p0", VOID, [vector, PTR, I32, mask_type])
    zero = zero_vector(vector)
    # Lanes of C that exist: all but in the last panel of a width that is not a multiple. B's
    # panel is read whole, with plain loads: a last panel narrower than the tile is always a
    # copy, zeros past B's last column (_ProductEmitter), so no load reads past B.
    masks = _column_masks(b, columns, shape)

    def load(base: ir.Value, offset: ir.Value, mask: ir.Value) -> ir.Value:
        return _masked_load(b, gep_f32(b, base, offset), mask)

    def store(value: ir.Value, offset: ir.Value, mask: ir.Value) -> None:
        b.call(masked_store, [value, gep_f32(b, c, offset), i32(4), mask])

    bases, placement = _row_bases(height)
    a_bases = [gep_f32(b, a, b.mul(i64(base), row_stride)) for base in bases]
    row_offsets = {multiple: b.mul(i64(multiple), row_stride) for _, multiple in placement}
    b_panel = b_mat
    before = b.block
    loop, done = b.append_basic_block("k"), b.append_basic_block("k.done")
    b.cbranch(b.icmp_signed(">", depth, i64(0)), loop, done)
    b.position_at_end(loop)
    p = b.phi(I64, name="p")
    p.add_incoming(i64(0), before)
    a_steps = [b.phi(PTR, name=f"a.base{base}") for base in bases]
    for phi, start in zip(a_steps, a_bases, strict=True):
        phi.add_incoming(start, before)
    accumulators = [[b.phi(vector, name=f"acc{r}.{v}") for v in range(vectors)] for r in range(height)]
    for row in accumulators:
        for acc in row:
            acc.add_incoming(zero, before)
    b_row = b.mul(p, ldb)
    b_values = [b.load(gep_f32(b, b_panel, b.add(b_row, i64(v * width))), typ=vector, align=4) for v in range(vectors)]
    updated = []
    for r in range(height):
        base, multiple = placement[r]
        a_value = splat(b, b.load(gep_f32(b, a_steps[base], row_offsets[multiple]), typ=F32), width)
        updated.append([b.call(fma, [a_value, b_values[v], accumulators[r][v]]) for v in range(vectors)])
    following = b.add(p, i64(1))
    last = b.block
    p.add_incoming(following, last)
    for phi in a_steps:
        phi.add_incoming(gep_f32(b, phi, column_stride), last)
    for row, new_row in zip(accumulators, updated, strict=True):
        for acc, new in zip(row, new_row, strict=True):
            acc.add_incoming(new, last)
    b.cbranch(b.icmp_signed("<", following, depth), loop, done)
    b.position_at_end(done)
    sums = []
    for r in range(height):
        phis = [b.phi(vector, name=f"sum{r}.{v}") for v in range(vectors)]
        for v, phi in enumerate(phis):
            phi.add_incoming(zero, before)
            phi.add_incoming(updated[r][v], last)
        sums.append(phis)
    # C = alpha·sums + beta·C; with beta 0, C is not read (it may hold NaN) and is alpha·sums.
    # A whole panel's C is written with plain stores: a masked store (vmaskmovps) costs a dozen
    # micro-ops on AMD's Zen cores (one core of an AMD EPYC, a 6 x 16 x 64 product: 58 GFLOP/s
    # with masked stores, 78 with plain ones). Only the last panel of a width that is not a
    # multiple of the tile's takes masks.
    alpha_vector, beta_vector = splat(b, alpha, width), splat(b, beta, width)
    reads_c = b.fcmp_ordered("!=", beta, f32(0.0), name="reads.c")
    scaled = [[b.fmul(alpha_vector, sums[r][v]) for v in range(vectors)] for r in range(height)]
    offsets = [
        [b.add(b.mul(b.add(i, i64(r)), ldc), b.add(j, i64(v * width))) for v in range(vectors)] for r in range(height)
    ]
    whole = b.icmp_signed("==", columns, i64(shape.columns), name="panel.whole")
    with b.if_else(whole) as (plain, masked):
        with plain, b.if_else(reads_c) as (accumulate, overwrite):
            with accumulate:
                for r, v in itertools.product(range(height), range(vectors)):
                    at = gep_f32(b, c, offsets[r][v])
                    old = b.load(at, typ=vector, align=4)
                    b.store(b.call(fma, [beta_vector, old, scaled[r][v]]), at, align=4)
            with overwrite:
                for r, v in itertools.product(range(height), range(vectors)):
                    b.store(scaled[r][v], gep_f32(b, c, offsets[r][v]), align=4)
        with masked:
            for r, v in itertools.product(range(height), range(vectors)):
                old = load(c, offsets[r][v], b.and_(masks[v], splat(b, reads_c, width)))
                store(
                    b.select(reads_c, b.call(fma, [beta_vector, old, scaled[r][v]]), scaled[r][v]),
                    offsets[r][v],
                    masks[v],
                )
    b.ret_void()
    return fn


def _row_bases(height: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Where a tile reads its rows of A: the fewest base rows (row 0 among them) such that every
    row is ``base + m`` with ``m`` in 0, 1, 2, 4, 8, which x86 addresses in one operand as base
    pointer + index register · scale (14 rows from bases 0, 1, 5 and 10); returns the bases and,
    per row, (which base, m). Only the bases advance with k: a pointer per row needs more
    registers than x86 has, and the addresses came from a chain of adds on every step of k."""
    multiples = (0, 1, 2, 4, 8)
    for count in range(height):
        for others in itertools.combinations(range(1, height), count):
            bases = (0, *others)
            placement = []
            for row in range(height):
                found = next(((index, row - base) for index, base in enumerate(bases) if row - base in multiples), None)
                if found is None:
                    break
                placement.append(found)
            else:
                return list(bases), placement
    raise AssertionError("every row is its own base")


def _column_masks(b: ir.IRBuilder, count: ir.Value, shape: TileShape) -> list[ir.Value]:
    """Per vector of a panel, the mask of its lanes below column ``count`` (all set where the
    panel is whole)."""
    width = shape.width
    lanes = [
        ir.Constant(ir.VectorType(I64, width), list(range(v * width, (v + 1) * width))) for v in range(shape.vectors)
    ]
    limit = splat(b, count, width)
    return [b.icmp_signed("<", vector_lanes, limit, name="lanes") for vector_lanes in lanes]


def _masked_load(b: ir.IRBuilder, ptr: ir.Value, mask: ir.Value) -> ir.Value:
    """The lanes of ``mask`` from ``ptr``, zeros elsewhere (masked-off lanes are not read)."""
    width = mask.type.count
    vector = ir.VectorType(F32, width)
    load = intrinsic(b.module, f"llvm.masked.load.v{width}f32.p0", vector, [PTR, I32, mask.type, vector])
    return b.call(load, [ptr, i32(4), mask, zero_vector(vector)])
