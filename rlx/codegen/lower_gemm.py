"""``matmul`` as calls to BLAS ``sgemm``: strided views in place, batches and row blocks in parallel.

Each operand is a view whose last two dimensions have one unit stride (the scheduler copies any
other view first): a unit column stride is a plain row-major matrix with the row stride as its
leading dimension, a unit row stride is the transposed case. A weight shared by a batch of
activations (``x [B, S, E] @ w [E, F]``) is one GEMM over ``B*S`` rows when the rows of x are
evenly spaced. A single product of moderate size is one call on OpenBLAS's own threads (they
share packed panels); larger products and batches run as work items (batch, block of rows) on
rlx's threads, the blocks depending on the shape only (see ``BLAS_THREADED_MACS``). OpenBLAS
splits only M and N across threads, never K, so every element is the same sum in the same order
whatever the thread count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llvmlite import ir

from rlx.codegen.blas import NO_TRANS, ROW_MAJOR, SET_THREADS, SGEMM, TRANS
from rlx.codegen.irutil import F32, I32, I64, PTR, VOID, declare, gep, i32, i64
from rlx.codegen.views import View
from rlx.errors import RlxValueError

_INT32_MAX = 2**31 - 1
# Up to this many multiply-adds a single product runs on OpenBLAS's threads, which share packed
# panels (1024x256x768 in a block: 43 ms against 53 for row blocks); above it, row blocks on
# rlx's team are as fast, and they leave no OpenBLAS worker spinning for ~0.1 s after the call
# (measured: attention in the same call ran 2x slower beside those spinning workers).
BLAS_THREADED_MACS = 1 << 28


@dataclass(frozen=True)
class Operand:
    """One matrix operand of every batch item: transpose flag, leading dim, batch strides, row stride."""

    trans: int
    ld: int
    batch_strides: tuple[int, ...]
    row_stride: int  # elements between consecutive rows of the (un-transposed) matrix
    offset: int


@dataclass(frozen=True)
class GemmSpec:
    batch: tuple[int, ...]
    m: int
    n: int
    k: int
    a: Operand
    b: Operand
    block_rows: int
    blas_threads: int = 1  # > 1: one call on that many OpenBLAS threads (a single large matrix)

    @property
    def blocks(self) -> int:
        return -(-self.m // self.block_rows)

    @property
    def items(self) -> int:
        return math.prod(self.batch) * self.blocks


def blas_reads_in_place(view: View) -> bool:
    """Whether sgemm can read this matrix view as it is: one unit stride, the other at least the
    row length (the leading dimension). The scheduler copies any other operand first."""
    rows, cols = view.shape[-2], view.shape[-1]
    row_stride, col_stride = view.strides[-2], view.strides[-1]
    if col_stride == 1 or cols == 1:
        return row_stride >= max(cols, 1) or rows == 1
    if row_stride == 1 or rows == 1:
        return col_stride >= max(rows, 1) or cols == 1
    return False


def _operand(view: View, batch: tuple[int, ...]) -> Operand:
    rows, cols = view.shape[-2], view.shape[-1]
    row_stride, col_stride = view.strides[-2], view.strides[-1]
    if col_stride == 1 or cols == 1:
        trans, ld = NO_TRANS, max(row_stride, cols, 1) if rows > 1 else max(cols, 1)
    else:
        trans, ld = TRANS, max(col_stride, rows, 1) if cols > 1 else max(rows, 1)
    lead = len(batch) - (len(view.shape) - 2)
    strides = [0] * lead + [0 if size == 1 else s for size, s in zip(view.shape[:-2], view.strides[:-2], strict=True)]
    return Operand(trans, ld, tuple(strides), row_stride, view.offset)


def gemm_spec(a: View, b: View, out_shape: tuple[int, ...], threads: int = 1) -> GemmSpec:
    batch = out_shape[:-2]
    m, n, k = out_shape[-2], out_shape[-1], a.shape[-1]
    op_a, op_b = _operand(a, batch), _operand(b, batch)
    # Fold the batch into the rows when b is shared and a's rows are evenly spaced across it.
    if batch and all(s == 0 for s in op_b.batch_strides) and op_a.trans == NO_TRANS:
        spacing = op_a.row_stride if m > 1 else op_a.ld
        expected = spacing * m
        foldable = True
        for size, stride in zip(reversed(batch), reversed(op_a.batch_strides), strict=True):
            if size > 1 and stride != expected:
                foldable = False
                break
            expected *= size
        if foldable:
            m = m * math.prod(batch)
            batch = ()
            op_a = Operand(op_a.trans, spacing, (), spacing, op_a.offset)
            op_b = Operand(op_b.trans, op_b.ld, (), op_b.row_stride, op_b.offset)
    for size in (m, n, k, op_a.ld, op_b.ld):
        if size > _INT32_MAX:
            raise RlxValueError(f"matmul: a matrix dimension of {size} exceeds the 32-bit BLAS limit")
    if not batch and threads > 1 and m * n * k <= BLAS_THREADED_MACS:
        return GemmSpec(batch, m, n, k, op_a, op_b, m, threads)
    block_rows = max(16, min(256, -(-m // 8)))
    return GemmSpec(batch, m, n, k, op_a, op_b, block_rows)


def emit_gemm_item(module: ir.Module, spec: GemmSpec, name: str) -> ir.Function:
    """``void item(ptr args, i64 item, ptr scratch)``: args = [a, b, out] base pointers."""
    sgemm = declare(module, SGEMM, VOID, [I32] * 6 + [F32, PTR, I32, PTR, I32, F32, PTR, I32])
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=name)
    fn.linkage = "internal"
    args, item, _ = fn.args
    bld = ir.IRBuilder(fn.append_basic_block("entry"))
    a_base = bld.load(gep(bld, args, [i64(0)], PTR), typ=PTR, name="a")
    b_base = bld.load(gep(bld, args, [i64(1)], PTR), typ=PTR, name="b")
    c_base = bld.load(gep(bld, args, [i64(2)], PTR), typ=PTR, name="c")
    batch_index = bld.sdiv(item, i64(spec.blocks), name="batch")
    block = bld.srem(item, i64(spec.blocks), name="block")
    m0 = bld.mul(block, i64(spec.block_rows), name="m0")
    rows = bld.sub(i64(spec.m), m0)
    rows = bld.select(bld.icmp_signed("<", rows, i64(spec.block_rows)), rows, i64(spec.block_rows), name="rows")
    a_off: ir.Value = i64(spec.a.offset)
    b_off: ir.Value = i64(spec.b.offset)
    c_off: ir.Value = bld.mul(batch_index, i64(spec.m * spec.n))
    rest = batch_index
    for size, sa, sb in zip(
        reversed(spec.batch), reversed(spec.a.batch_strides), reversed(spec.b.batch_strides), strict=True
    ):
        digit = bld.srem(rest, i64(size))
        rest = bld.sdiv(rest, i64(size))
        a_off = bld.add(a_off, bld.mul(digit, i64(sa)))
        b_off = bld.add(b_off, bld.mul(digit, i64(sb)))
    a_off = bld.add(a_off, bld.mul(m0, i64(spec.a.row_stride)))
    c_off = bld.add(c_off, bld.mul(m0, i64(spec.n)))
    a_ptr = gep(bld, a_base, [a_off], F32, "a.block")
    b_ptr = gep(bld, b_base, [b_off], F32, "b.item")
    c_ptr = gep(bld, c_base, [c_off], F32, "c.block")
    rows32 = bld.trunc(rows, I32)
    set_threads = declare(module, SET_THREADS, VOID, [I32])
    if spec.blas_threads > 1:
        bld.call(set_threads, [i32(spec.blas_threads)])
    bld.call(
        sgemm,
        [
            i32(ROW_MAJOR),
            i32(spec.a.trans),
            i32(spec.b.trans),
            rows32,
            i32(spec.n),
            i32(spec.k),
            ir.Constant(F32, 1.0),
            a_ptr,
            i32(spec.a.ld),
            b_ptr,
            i32(spec.b.ld),
            ir.Constant(F32, 0.0),
            c_ptr,
            i32(max(spec.n, 1)),
        ],
    )
    if spec.blas_threads > 1:
        bld.call(set_threads, [i32(1)])
    bld.ret_void()
    return fn
