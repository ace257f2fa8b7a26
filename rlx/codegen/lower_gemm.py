"""``matmul`` as calls to BLAS ``sgemm``: strided views in place, batches and row blocks in parallel.

Each operand is a view whose last two dimensions have one unit stride (the scheduler copies any
other view first): a unit column stride is a plain row-major matrix with the row stride as its
leading dimension, a unit row stride is the transposed case. A weight shared by a batch of
activations (``x [B, S, E] @ w [E, F]``) is one GEMM over ``B*S`` rows when the rows of x are
evenly spaced. Every product runs as work items (batch, block of rows, block of columns) on
rlx's threads, OpenBLAS itself on one thread.

How a product is split: as few blocks as give every core of the machine an equal share, no
more. Each ``sgemm`` call packs its whole B panel again, so small blocks pay that packing many
times: on the transformer block's products (2 cores), one row block per core ran 3-20% faster
than eight blocks of up to 256 rows, and the block's training step 5-10% faster. The split
depends on the shape and on the machine's core count (:func:`rlx.config.machine_cores`), never
on the threads a call runs with, and no block splits K: OpenBLAS's result for an element
depends on the blocks around it (measured: 1-ulp differences between row splits), so this is
what keeps every result bit-identical for any ``num_threads``.

Why not OpenBLAS's own threads for a single product: its workers busy-wait for ~0.1 s after each
threaded call, and on a machine with as many cores as threads they then compete with rlx's team
for the next kernels and with whatever else the process runs. Measured on the transformer
block's training step (B8 S128 E256, 2 cores), 15 of whose 16 products were single threaded
calls: the call took 41.7-46.9 ms with row and column blocks against 46.6-47.8 ms, and torch's
eager step in the same loop 46-58 ms against 75-77 ms while those workers spun.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from llvmlite import ir

from rlx.codegen.blas import NO_TRANS, ROW_MAJOR, SGEMM, TRANS, refuse_beyond_blas
from rlx.codegen.irutil import F32, I32, I64, PTR, VOID, declare, gep, i32, i64
from rlx.codegen.sizes import SizeLike, at_least, ceil_div, emit_size, load_symbols, size_of
from rlx.codegen.views import View
from rlx.config import machine_cores
from rlx.ir.dims import product
from rlx.ir.types import Dim

MIN_BLOCK_ROWS = 16  # shorter row blocks run far below the sgemm rate
MIN_BLOCK_COLS = 64  # narrower column blocks make OpenBLAS repack A for too little work
WHOLE_ROUNDS = 4  # a batch of at least this many items per core is split no further


@dataclass(frozen=True)
class Operand:
    """One matrix operand of every batch item: transpose flag, leading dim, batch strides, row stride."""

    trans: int
    ld: SizeLike
    batch_strides: tuple[SizeLike, ...]
    row_stride: SizeLike  # elements between consecutive rows of the (un-transposed) matrix
    offset: SizeLike


@dataclass(frozen=True)
class GemmSpec:
    """One matmul's BLAS calls; sizes are :class:`~rlx.codegen.sizes.Size` where a call sets them."""

    batch: tuple[SizeLike, ...]
    m: SizeLike
    n: SizeLike
    k: SizeLike
    a: Operand
    b: Operand
    row_blocks: int = 1  # the rows split into this many blocks of ``ceil(m / row_blocks)`` (some may be empty)
    column_blocks: int = 1  # the columns split into this many blocks of ``block_cols`` (n static)

    @property
    def block_rows(self) -> int | None:
        """Rows of a block, or None when they depend on the call's sizes."""
        return -(-self.m // self.row_blocks) if isinstance(self.m, int) else None

    @property
    def block_cols(self) -> SizeLike:
        if self.column_blocks == 1 or not isinstance(self.n, int):
            return self.n
        return -(-self.n // self.column_blocks)

    @property
    def items(self) -> int | None:
        """Work items (batch x row blocks x column blocks), or None when the batch depends on the call's sizes."""
        batch = product(self.batch)
        return batch * self.row_blocks * self.column_blocks if isinstance(batch, int) else None

    def emit_items(self, b: ir.IRBuilder, symbols: Mapping[str, ir.Value]) -> int | ir.Value:
        items = self.items
        if items is not None:
            return items
        batch = emit_size(b, product(self.batch), symbols)
        return b.mul(batch, i64(self.row_blocks * self.column_blocks), name="gemm.items")


def blas_reads_in_place(view: View) -> bool:
    """Whether sgemm can read this matrix view as it is: one unit stride, the other at least the
    row length (the leading dimension), for every call. The scheduler copies any other operand first."""
    rows, cols = view.shape[-2], view.shape[-1]
    row_stride, col_stride = view.strides[-2], view.strides[-1]
    if col_stride == 1 or cols == 1:
        return at_least(row_stride, cols) or rows == 1
    if row_stride == 1 or rows == 1:
        return at_least(col_stride, rows) or cols == 1
    return False


def _operand(view: View, batch: tuple[SizeLike, ...]) -> Operand:
    rows, cols = view.shape[-2], view.shape[-1]
    row_stride, col_stride = view.strides[-2], view.strides[-1]
    # Every dimension is >= 1, and an in-place view's stride across rows is at least a row.
    if col_stride == 1 or cols == 1:
        trans, ld = NO_TRANS, row_stride if rows != 1 and at_least(row_stride, cols) else size_of(cols)
    else:
        trans, ld = TRANS, col_stride if cols != 1 and at_least(col_stride, rows) else size_of(rows)
    lead = len(batch) - (len(view.shape) - 2)
    strides = [0] * lead + [0 if size == 1 else s for size, s in zip(view.shape[:-2], view.strides[:-2], strict=True)]
    return Operand(trans, ld, tuple(strides), row_stride, view.offset)


def gemm_spec(a: View, b: View, out_shape: tuple[Dim, ...], cores: int | None = None) -> GemmSpec:
    """The BLAS calls of ``a @ b``, split for ``cores`` (default: the machine's, see the module docstring)."""
    batch = tuple(size_of(d) for d in out_shape[:-2])
    m, n, k = size_of(out_shape[-2]), size_of(out_shape[-1]), size_of(a.shape[-1])
    op_a, op_b = _operand(a, batch), _operand(b, batch)
    # Fold the batch into the rows when b is shared and a's rows are evenly spaced across it.
    if batch and all(s == 0 for s in op_b.batch_strides) and op_a.trans == NO_TRANS:
        spacing = op_a.row_stride if m != 1 else op_a.ld
        expected = spacing * m
        foldable = True
        for size, stride in zip(reversed(batch), reversed(op_a.batch_strides), strict=True):
            if size != 1 and stride != expected:
                foldable = False
                break
            expected = expected * size
        if foldable:
            m = m * product(batch)
            batch = ()
            op_a = Operand(op_a.trans, spacing, (), spacing, op_a.offset)
            op_b = Operand(op_b.trans, op_b.ld, (), op_b.row_stride, op_b.offset)
    refuse_beyond_blas("matmul", *(size for size in (m, n, k, op_a.ld, op_b.ld) if isinstance(size, int)))
    spec = GemmSpec(batch, m, n, k, op_a, op_b)
    # A product that reads its A transposed (a weight's gradient, x^T dy) splits its larger side:
    # OpenBLAS ran half of 256 x 768 x 1024 in 1.42 ms as a column block, 1.57 as a row block
    # (64 x 192 x 1024: 98 against 120 us); products with A as stored run faster in row blocks.
    columns_first = op_a.trans == TRANS and isinstance(m, int) and isinstance(n, int) and n > m
    cores = machine_cores() if cores is None else cores
    row_blocks, column_blocks = _blocks(spec.items, m, n, cores, columns_first)
    return replace(spec, row_blocks=row_blocks, column_blocks=column_blocks)


def _blocks(batch: int | None, m: SizeLike, n: SizeLike, cores: int, columns_first: bool = False) -> tuple[int, int]:
    """Row and column blocks so that ``batch`` x blocks items share out evenly over ``cores``.

    A batch that already does (or is large, or known only per call) is not split. Otherwise the
    rows split first, into blocks of at least ``MIN_BLOCK_ROWS`` (rows known per call split
    anyway: an empty block does nothing), then the columns of what rows could not cover; with
    ``columns_first`` (static sizes), the columns first, into blocks of at least ``MIN_BLOCK_COLS``.
    """
    if batch is None or batch % cores == 0 or batch >= WHOLE_ROUNDS * cores:
        return 1, 1
    need = cores // math.gcd(batch, cores)
    if columns_first and isinstance(m, int) and isinstance(n, int):
        columns = min(need, max(1, n // MIN_BLOCK_COLS))
        rows = max(1, min(-(-need // columns), m // MIN_BLOCK_ROWS)) if columns < need else 1
        return rows, columns
    rows = min(need, max(1, m // MIN_BLOCK_ROWS)) if isinstance(m, int) else need
    columns = 1
    if rows < need and isinstance(n, int):
        columns = max(1, min(-(-need // rows), n // MIN_BLOCK_COLS))
    return rows, columns


def emit_gemm_item(module: ir.Module, spec: GemmSpec, name: str, symbols: tuple[str, ...] = ()) -> ir.Function:
    """``void item(ptr args, i64 item, ptr scratch)``: args = [a, b, out] base pointers (then, with
    ``symbols``, the call's sizes table)."""
    sgemm = declare(module, SGEMM, VOID, [I32] * 6 + [F32, PTR, I32, PTR, I32, F32, PTR, I32])
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=name)
    fn.linkage = "internal"
    args, item, _ = fn.args
    bld = ir.IRBuilder(fn.append_basic_block("entry"))
    a_base = bld.load(gep(bld, args, [i64(0)], PTR), typ=PTR, name="a")
    b_base = bld.load(gep(bld, args, [i64(1)], PTR), typ=PTR, name="b")
    c_base = bld.load(gep(bld, args, [i64(2)], PTR), typ=PTR, name="c")
    sizes: dict[str, ir.Value] = {}
    if symbols:
        table = bld.load(gep(bld, args, [i64(3)], PTR), typ=PTR, name="sizes")
        sizes = load_symbols(bld, table, symbols)

    def size(value: SizeLike) -> ir.Value:
        return emit_size(bld, value, sizes)

    blocks = spec.row_blocks * spec.column_blocks
    batch_index = bld.sdiv(item, i64(blocks), name="batch")
    block = bld.srem(item, i64(blocks), name="block")
    column_block = bld.srem(block, i64(spec.column_blocks), name="column.block")
    block = bld.sdiv(block, i64(spec.column_blocks), name="row.block")
    block_rows = ceil_div(bld, size(spec.m), spec.row_blocks)
    m0 = bld.mul(block, block_rows, name="m0")
    rows = bld.sub(size(spec.m), m0)
    rows = bld.select(bld.icmp_signed("<", rows, block_rows), rows, block_rows, name="rows")
    n0 = bld.mul(column_block, size(spec.block_cols), name="n0")
    cols = bld.sub(size(spec.n), n0)
    cols = bld.select(bld.icmp_signed("<", cols, size(spec.block_cols)), cols, size(spec.block_cols), name="cols")
    # The last row blocks of a few rows known per call may be empty; nothing to compute there.
    work = bld.append_basic_block("work")
    done = bld.append_basic_block("done")
    bld.cbranch(bld.icmp_signed(">", rows, i64(0)), work, done)
    bld.position_at_end(done)
    bld.ret_void()
    bld.position_at_end(work)
    a_off: ir.Value = size(spec.a.offset)
    b_off: ir.Value = size(spec.b.offset)
    c_off: ir.Value = bld.mul(batch_index, size(spec.m * spec.n))
    rest = batch_index
    for dim, sa, sb in zip(
        reversed(spec.batch), reversed(spec.a.batch_strides), reversed(spec.b.batch_strides), strict=True
    ):
        digit = bld.srem(rest, size(dim))
        rest = bld.sdiv(rest, size(dim))
        a_off = bld.add(a_off, bld.mul(digit, size(sa)))
        b_off = bld.add(b_off, bld.mul(digit, size(sb)))
    a_off = bld.add(a_off, bld.mul(m0, size(spec.a.row_stride)))
    # Column n0 of b: the next element of a row (no transpose), or the n0-th stored row (transposed).
    b_off = bld.add(b_off, n0 if spec.b.trans == NO_TRANS else bld.mul(n0, size(spec.b.ld)))
    c_off = bld.add(bld.add(c_off, bld.mul(m0, size(spec.n))), n0)
    a_ptr = gep(bld, a_base, [a_off], F32, "a.block")
    b_ptr = gep(bld, b_base, [b_off], F32, "b.item")
    c_ptr = gep(bld, c_base, [c_off], F32, "c.block")
    rows32 = bld.trunc(rows, I32)
    bld.call(
        sgemm,
        [
            i32(ROW_MAJOR),
            i32(spec.a.trans),
            i32(spec.b.trans),
            rows32,
            bld.trunc(cols, I32),
            bld.trunc(size(spec.k), I32),
            ir.Constant(F32, 1.0),
            a_ptr,
            bld.trunc(size(spec.a.ld), I32),
            b_ptr,
            bld.trunc(size(spec.b.ld), I32),
            ir.Constant(F32, 0.0),
            c_ptr,
            bld.trunc(size(spec.n), I32),
        ],
    )
    bld.ret_void()
    return fn
