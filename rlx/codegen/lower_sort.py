"""``sort``: one work item per row of the sorted (last) axis, sorted by the C library's ``qsort_r``.

An item writes its row's positions ``0 .. n-1`` into the indices result, has ``qsort_r`` sort
them with a comparator of the keys they point at (emitted here, one per dtype and direction),
then gathers the values by them. The comparator is a total order, NaN above every number and
equal keys by position, so the result is the stable sort's whatever algorithm the C library
runs, and the same for every thread count.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir

from rlx.codegen.irutil import I32, I64, PTR, VOID, declare, element_type, for_range, gep, i64
from rlx.codegen.sizes import emit_size, load_symbols
from rlx.ir.types import Dim

QSORT_R = "qsort_r"  # glibc's: (base, count, size, compare(a, b, context), context)


def emit_sort_item(
    module: ir.Module,
    shape: tuple[Dim, ...],
    dtype: np.dtype,
    descending: bool,
    name: str,
    symbols: tuple[str, ...] = (),
) -> ir.Function:
    """``void item(ptr args, i64 item, ptr scratch)``; args = [x, values, indices] (then, with
    ``symbols``, the call's sizes table), all dense with ``shape``; item ``i`` sorts row ``i``."""
    key_type = element_type(dtype)
    compare = _comparator(module, key_type, descending)
    qsort = declare(module, QSORT_R, VOID, [PTR, I64, I64, PTR, PTR])
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=name)
    fn.linkage = "internal"
    args, item = fn.args[0], fn.args[1]
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sizes = {}
    if symbols:
        sizes = load_symbols(b, b.load(gep(b, args, [i64(3)], PTR), typ=PTR, name="sizes"), symbols)
    length = emit_size(b, shape[-1], sizes)
    base = b.mul(item, length, name="row")
    keys = gep(b, b.load(gep(b, args, [i64(0)], PTR), typ=PTR), [base], key_type, "keys")
    values = gep(b, b.load(gep(b, args, [i64(1)], PTR), typ=PTR), [base], key_type, "values")
    order = gep(b, b.load(gep(b, args, [i64(2)], PTR), typ=PTR), [base], I64, "order")
    with for_range(b, 0, length, "start") as j:
        b.store(j, gep(b, order, [j], I64))
    b.call(qsort, [order, length, i64(8), compare, keys])
    with for_range(b, 0, length, "gather") as j:
        source = b.load(gep(b, order, [j], I64), typ=I64)
        b.store(b.load(gep(b, keys, [source], key_type), typ=key_type), gep(b, values, [j], key_type))
    b.ret_void()
    return fn


def _comparator(module: ir.Module, key_type: ir.Type, descending: bool) -> ir.Function:
    """``i32 compare(ptr a, ptr b, ptr keys)`` of two positions by their keys: negative when
    ``a`` goes first. Keys by ``<`` (NaN above every number), ties by position."""
    name = f"rlx.sort.compare.{key_type}.{'down' if descending else 'up'}"
    existing = module.globals.get(name)
    if existing is not None:
        return existing  # type: ignore[return-value]
    fn = ir.Function(module, ir.FunctionType(I32, [PTR, PTR, PTR]), name=name)
    fn.linkage = "internal"
    a_ptr, b_ptr, keys = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    first, second = b.load(a_ptr, typ=I64, name="a"), b.load(b_ptr, typ=I64, name="b")
    key_a = b.load(gep(b, keys, [first], key_type), typ=key_type)
    key_b = b.load(gep(b, keys, [second], key_type), typ=key_type)

    def below(x: ir.Value, y: ir.Value) -> ir.Value:
        """``x`` sorts below ``y`` ascending: ``x < y``, or ``y`` is NaN and ``x`` is not."""
        if isinstance(key_type, ir.FloatType):
            return b.or_(b.fcmp_ordered("<", x, y), b.and_(b.fcmp_unordered("uno", y, y), b.fcmp_ordered("ord", x, x)))
        return b.icmp_signed("<", x, y)

    a_first, b_first = (
        (below(key_b, key_a), below(key_a, key_b)) if descending else (below(key_a, key_b), below(key_b, key_a))
    )
    by_position = b.sub(b.zext(b.icmp_signed(">", first, second), I32), b.zext(b.icmp_signed("<", first, second), I32))
    result = b.select(a_first, ir.Constant(I32, -1), b.select(b_first, ir.Constant(I32, 1), by_position))
    b.ret(result)
    return fn
