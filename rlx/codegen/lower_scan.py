"""The running scans (``cumsum``, ``cumprod``, ``cummax``, ``cummin``, ``logcumsumexp``): a kernel
of their own, one work item per run of the scanned axis.

The operand and the results are dense ``[outer, n, inner]`` (the scheduler copies a strided
operand first). An item walks its ``n`` rows in order (from the end with ``reverse``), each row
the previous row's result combined with its own entries: sums and products of floats vectorised
across ``inner``, of ints (int32 or int64 in, int64 out, wrapping) one entry at a time; running
extremes (and the positions they came from) and log-sum-exps one entry at a time. The order of
operations is fixed, so results do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from rlx.codegen.blas import LIBM
from rlx.codegen.expf import define_expf
from rlx.codegen.irutil import F32, I32, I64, PTR, VOID, declare, element_type, for_range, gep, i64, intrinsic
from rlx.codegen.sizes import emit_size, load_symbols
from rlx.codegen.vector import Lanes, vector_loop
from rlx.ir.dims import product
from rlx.ir.types import Dim

SCAN_OPS = frozenset({"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"})


def emit_scan_item(
    module: ir.Module,
    shape: tuple[Dim, ...],
    axis: int,
    reverse: bool,
    combine: str,
    source: np.dtype,
    name: str,
    symbols: tuple[str, ...] = (),
) -> ir.Function:
    """``void item(ptr args, i64 item, ptr scratch)``; args = [x, out] (``cummax``/``cummin``:
    [x, out, positions]; then, with ``symbols``, the call's sizes table); item ``i`` scans
    ``x[i, :, :]`` of ``x`` seen as ``[outer, n, inner]``, combining by ``combine``: the op's name."""
    extremes = combine in ("cummax", "cummin")
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=name)
    fn.linkage = "internal"
    args, item = fn.args[0], fn.args[1]
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sizes = {}
    if symbols:
        table = b.load(gep(b, args, [i64(3 if extremes else 2)], PTR), typ=PTR, name="sizes")
        sizes = load_symbols(b, table, symbols)
    x_ptr = b.load(gep(b, args, [i64(0)], PTR), typ=PTR, name="x")
    out_ptr = b.load(gep(b, args, [i64(1)], PTR), typ=PTR, name="out")
    positions_ptr = b.load(gep(b, args, [i64(2)], PTR), typ=PTR, name="positions") if extremes else None
    steps = emit_size(b, shape[axis], sizes)
    inner = emit_size(b, product(shape[axis + 1 :]), sizes)
    base = b.mul(item, b.mul(steps, inner), name="base")
    floats = source == np.float32
    element = element_type(source)

    def position_at(step: ir.Value) -> ir.Value:
        """Where along the axis step ``step`` of the walk is (from the end with ``reverse``)."""
        return b.sub(b.sub(steps, i64(1)), step) if reverse else step

    def row_at(step: ir.Value) -> ir.Value:
        """The offset of row ``step`` of the walk."""
        return b.add(base, b.mul(position_at(step), inner))

    multiplies = combine == "cumprod"

    def add_rows(row: ir.Value, previous: ir.Value | None, step: ir.Value) -> None:
        """``out[row] = x[row]`` combined with ``out[previous]`` across the inner entries (and, for
        the extremes, the positions they came from)."""
        if extremes or combine == "logcumsumexp":
            with for_range(b, 0, inner, "col") as j:
                value = b.load(gep(b, x_ptr, [b.add(row, j)], element), typ=element)
                if extremes:
                    assert positions_ptr is not None
                    position = position_at(step)
                    if previous is not None:
                        held = b.load(gep(b, out_ptr, [b.add(previous, j)], element), typ=element)
                        better = _replaces(b, value, held, combine == "cummax", floats)
                        value = b.select(better, value, held)
                        earlier = b.load(gep(b, positions_ptr, [b.add(previous, j)], I64), typ=I64)
                        position = b.select(better, position, earlier)
                    b.store(position, gep(b, positions_ptr, [b.add(row, j)], I64))
                elif previous is not None:
                    held = b.load(gep(b, out_ptr, [b.add(previous, j)], F32), typ=F32)
                    value = _log_add_exp(b, held, value)
                b.store(value, gep(b, out_ptr, [b.add(row, j)], element))
            return
        if floats:

            def body(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> None:
                value = lanes.load(b, x_ptr, b.add(row, j))
                if previous is not None:
                    before = lanes.load(b, out_ptr, b.add(previous, j))
                    value = b.fmul(before, value) if multiplies else b.fadd(before, value)
                lanes.store(b, value, out_ptr, b.add(row, j))

            vector_loop(b, i64(0), inner, "col", body)
            return
        with for_range(b, 0, inner, "col") as j:
            value = b.load(gep(b, x_ptr, [b.add(row, j)], element), typ=element)
            value = b.sext(value, I64) if element == I32 else value
            if previous is not None:
                before = b.load(gep(b, out_ptr, [b.add(previous, j)], I64), typ=I64)
                value = b.mul(before, value) if multiplies else b.add(before, value)
            b.store(value, gep(b, out_ptr, [b.add(row, j)], I64))

    add_rows(row_at(i64(0)), None, i64(0))
    with for_range(b, 1, steps, "step") as step:
        add_rows(row_at(step), row_at(b.sub(step, i64(1))), step)
    b.ret_void()
    return fn


def _replaces(b: ir.IRBuilder, entry: ir.Value, held: ir.Value, largest: bool, floats: bool) -> ir.Value:
    """torch's rule: the entry replaces the running extreme where it is NaN, or where neither is
    NaN and it is at least as large (small): ties and NaN go to the latest position."""
    if not floats:
        return b.icmp_signed(">=" if largest else "<=", entry, held)
    # Ordered comparisons are false where either is NaN: "held is no NaN and entry >= held".
    ordered = b.fcmp_ordered(">=" if largest else "<=", entry, held)
    return b.or_(b.fcmp_unordered("uno", entry, entry), ordered)


def _log_add_exp(b: ir.IRBuilder, a: ir.Value, x: ir.Value) -> ir.Value:
    """torch's ``_log_add_exp_helper``: the larger plus ``log1p(exp(smaller - larger))``, or ``a``
    where both are the same infinity; NaN in either gives NaN."""
    module = b.module
    a_larger = b.fcmp_ordered(">", a, x)
    high, low = b.select(a_larger, a, x), b.select(a_larger, x, a)
    log1p = declare(module, LIBM["log1p"], F32, [F32])
    blended = b.fadd(high, b.call(log1p, [b.call(define_expf(module), [b.fsub(low, high)])]))
    magnitude = b.call(intrinsic(module, "llvm.fabs.f32", F32, [F32]), [low])
    infinite = b.fcmp_ordered("==", magnitude, ir.Constant(F32, float("inf")))
    same = b.and_(b.fcmp_ordered("==", low, high), infinite)
    return b.select(same, a, blended)
