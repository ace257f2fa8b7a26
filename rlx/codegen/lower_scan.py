"""``cumsum`` and ``cumprod``: a kernel of their own, one work item per run of the scanned axis.

The operand and the result are dense ``[outer, n, inner]`` (the scheduler copies a strided
operand first). An item walks its ``n`` rows in order (from the end with ``reverse``), each row
the previous row's sums (products) with its own entries: float rows vectorised across ``inner``, int rows
(int32 or int64 in, int64 out, wrapping) one entry at a time. The order of operations is fixed,
so results do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from rlx.codegen.irutil import I32, I64, PTR, VOID, element_type, for_range, gep, i64
from rlx.codegen.sizes import emit_size, load_symbols
from rlx.codegen.vector import Lanes, vector_loop
from rlx.ir.dims import product
from rlx.ir.types import Dim


def emit_scan_item(
    module: ir.Module,
    shape: tuple[Dim, ...],
    axis: int,
    reverse: bool,
    multiplies: bool,
    source: np.dtype,
    name: str,
    symbols: tuple[str, ...] = (),
) -> ir.Function:
    """``void item(ptr args, i64 item, ptr scratch)``; args = [x, out] (then, with ``symbols``,
    the call's sizes table); item ``i`` scans ``x[i, :, :]`` of ``x`` seen as ``[outer, n, inner]``,
    running products where ``multiplies``, else sums."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=name)
    fn.linkage = "internal"
    args, item = fn.args[0], fn.args[1]
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sizes = {}
    if symbols:
        sizes = load_symbols(b, b.load(gep(b, args, [i64(2)], PTR), typ=PTR, name="sizes"), symbols)
    x_ptr = b.load(gep(b, args, [i64(0)], PTR), typ=PTR, name="x")
    out_ptr = b.load(gep(b, args, [i64(1)], PTR), typ=PTR, name="out")
    steps = emit_size(b, shape[axis], sizes)
    inner = emit_size(b, product(shape[axis + 1 :]), sizes)
    base = b.mul(item, b.mul(steps, inner), name="base")
    floats = source == np.float32
    element = element_type(source)

    def row_at(step: ir.Value) -> ir.Value:
        """The offset of row ``step`` of the walk (from the end with ``reverse``)."""
        position = b.sub(b.sub(steps, i64(1)), step) if reverse else step
        return b.add(base, b.mul(position, inner))

    def add_rows(row: ir.Value, previous: ir.Value | None) -> None:
        """``out[row] = x[row] (+ out[previous])`` across the inner entries."""
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

    add_rows(row_at(i64(0)), None)
    with for_range(b, 1, steps, "step") as step:
        add_rows(row_at(step), row_at(b.sub(step, i64(1))))
    b.ret_void()
    return fn
