"""``embedding_grad``: rows of ``dy`` added into a zeroed ``[V, E]`` table at their ids; and
``scatter_add_along_axis``, the same for single entries along one axis.

``embedding_grad`` is serial on purpose: the rows are added in index order, so repeated ids sum in the same order on
every run and for every thread count (a parallel scatter-add would need atomics and lose that).
Ids from graph inputs were checked against ``V`` before the call (``rlx.bind.check_index_inputs``);
ids the graph computes are checked here, row by row: a bad one adds nothing and is reported in
the node's fault word (:class:`rlx.codegen.lower.IndexFault`).
"""

from __future__ import annotations

from llvmlite import ir

from rlx.codegen.irutil import F32, I1, I32, I64, PTR, VOID, for_range, gep, gep_f32, i64
from rlx.codegen.sizes import emit_size, load_symbols
from rlx.codegen.vector import Lanes, vector_fill, vector_loop
from rlx.codegen.views import View
from rlx.ir.dims import product
from rlx.ir.types import Dim


def emit_scatter_item(
    module: ir.Module,
    dy: View,
    ids: View,
    out_shape: tuple[Dim, Dim],
    ids_itemsize: int,
    name: str,
    symbols: tuple[str, ...] = (),
    checked: bool = False,
) -> ir.Function:
    """``void item(ptr args, i64 item, ptr scratch)``; args = [dy, ids, out] (then, with
    ``symbols``, the call's sizes table, then, ``checked``, the fault word); one item."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=name)
    fn.linkage = "internal"
    args = fn.args[0]
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sizes = {}
    if symbols:
        table = b.load(gep(b, args, [i64(3)], PTR), typ=PTR, name="sizes")
        sizes = load_symbols(b, table, symbols)
    dy_ptr = gep_f32(b, b.load(gep(b, args, [i64(0)], PTR), typ=PTR), emit_size(b, dy.offset, sizes), "dy")
    id_type = I32 if ids_itemsize == 4 else I64
    ids_ptr = gep(b, b.load(gep(b, args, [i64(1)], PTR), typ=PTR), [emit_size(b, ids.offset, sizes)], id_type, "ids")
    out_ptr = b.load(gep(b, args, [i64(2)], PTR), typ=PTR, name="out")
    rows, width = (emit_size(b, dim, sizes) for dim in out_shape)
    count = emit_size(b, product(ids.shape), sizes)
    vector_fill(b, out_ptr, i64(0), b.mul(rows, width), 0.0, "zero")
    fault = b.load(gep(b, args, [i64(4 if symbols else 3)], PTR), typ=PTR, name="fault") if checked else None
    with for_range(b, 0, count, "r") as r:
        row_id = b.load(gep(b, ids_ptr, [r], id_type), typ=id_type)
        row_id = b.sext(row_id, I64) if id_type == I32 else row_id
        good = b.icmp_unsigned("<", row_id, rows) if fault is not None else ir.Constant(I1, 1)
        with b.if_else(good) as (add_row, report):
            with add_row:
                target = gep_f32(b, out_ptr, b.mul(row_id, width), "target")
                source = gep_f32(b, dy_ptr, b.mul(r, width), "source")

                def add(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> None:
                    lanes.store(b, b.fadd(lanes.load(b, target, j), lanes.load(b, source, j)), target, j)

                vector_loop(b, i64(0), width, "col", add)
            with report:
                if fault is not None:
                    b.store(row_id, fault)
    b.ret_void()
    return fn


def emit_scatter_along_axis_item(
    module: ir.Module,
    shape: tuple[Dim, ...],
    axis: int,
    size: Dim,
    ids_itemsize: int,
    name: str,
    symbols: tuple[str, ...] = (),
    checked: bool = False,
) -> ir.Function:
    """``scatter_add_along_axis``: ``void item(ptr args, i64 item, ptr scratch)``; args = [updates,
    ids, out] (then, with ``symbols``, the call's sizes table, then, ``checked``, the fault word).

    The updates and ids are dense ``[outer, n, inner]`` (``shape`` split at ``axis``), the result
    dense ``[outer, size, inner]``. Item ``o`` zeroes the result's slab ``o`` and adds the updates
    of slab ``o`` into it in order: items write disjoint slabs, so they run in parallel and the
    sums of repeated ids are the same for every thread count."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=name)
    fn.linkage = "internal"
    args, item = fn.args[0], fn.args[1]
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sizes = {}
    if symbols:
        sizes = load_symbols(b, b.load(gep(b, args, [i64(3)], PTR), typ=PTR, name="sizes"), symbols)
    steps = emit_size(b, shape[axis], sizes)
    inner = emit_size(b, product(shape[axis + 1 :]), sizes)
    length = emit_size(b, size, sizes)
    source_base = b.mul(item, b.mul(steps, inner), name="source.base")
    target_base = b.mul(item, b.mul(length, inner), name="target.base")
    id_type = I32 if ids_itemsize == 4 else I64
    updates = gep_f32(b, b.load(gep(b, args, [i64(0)], PTR), typ=PTR), source_base, "updates")
    ids = gep(b, b.load(gep(b, args, [i64(1)], PTR), typ=PTR), [source_base], id_type, "ids")
    out = gep_f32(b, b.load(gep(b, args, [i64(2)], PTR), typ=PTR), target_base, "out")
    vector_fill(b, out, i64(0), b.mul(length, inner), 0.0, "zero")
    fault = b.load(gep(b, args, [i64(4 if symbols else 3)], PTR), typ=PTR, name="fault") if checked else None
    with for_range(b, 0, steps, "j") as j, for_range(b, 0, inner, "k") as k:
        at = b.add(b.mul(j, inner), k)
        target = b.load(gep(b, ids, [at], id_type), typ=id_type)
        target = b.sext(target, I64) if id_type == I32 else target
        good = b.icmp_unsigned("<", target, length) if fault is not None else ir.Constant(I1, 1)
        with b.if_else(good) as (add, report):
            with add:
                slot = gep_f32(b, out, b.add(b.mul(target, inner), k), "slot")
                value = b.load(gep_f32(b, updates, at), typ=F32)
                b.store(b.fadd(b.load(slot, typ=F32), value), slot)
            with report:
                if fault is not None:
                    b.store(target, fault)
    b.ret_void()
    return fn
