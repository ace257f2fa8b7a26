"""Explicitly vectorised row loops: a 16-lane main loop and a scalar remainder, same body.

rlx does not rely on LLVM's loop vectoriser. The llvmlite wheels ship LLVM with assertions on,
and the vectoriser's cost model asserts (aborting the process) on some loop shapes that user
graphs can produce. So each row loop is written once as a body that is generic in its width
(``Lanes``), and emitted twice: over 16-float vectors, then over the leftover scalars.
Reductions keep one partial result per lane and combine them in a fixed order, so results
depend only on the row length, never on threads or timing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from rlx.codegen.expf import define_expf, define_softmax_expf
from rlx.codegen.irutil import F32, I1, REDUCE, alloca_entry, for_range, gep_f32, i64, intrinsic, smin

WIDTH = 16  # floats per vector: one AVX-512 register, two AVX2 registers


@dataclass(frozen=True)
class Lanes:
    """Emits float code at one width: ``1`` (scalar) or ``WIDTH`` (vector)."""

    module: ir.Module
    width: int

    @property
    def type(self) -> ir.Type:
        return F32 if self.width == 1 else ir.VectorType(F32, self.width)

    @property
    def suffix(self) -> str:
        return "f32" if self.width == 1 else f"v{self.width}f32"

    def const(self, value: float) -> ir.Constant:
        return ir.Constant(self.type, value if self.width == 1 else [value] * self.width)

    def splat(self, b: ir.IRBuilder, scalar: ir.Value) -> ir.Value:
        return splat(b, scalar, self.width)

    def load(self, b: ir.IRBuilder, base: ir.Value, index: ir.Value, name: str = "") -> ir.Value:
        return b.load(gep_f32(b, base, index), typ=self.type, align=4, name=name)

    def store(self, b: ir.IRBuilder, value: ir.Value, base: ir.Value, index: ir.Value) -> None:
        b.store(value, gep_f32(b, base, index), align=4)

    def maximum(self, b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
        """IEEE 754-2019 maximum: NaN if either operand is NaN, so a NaN row stays NaN (as in NumPy)."""
        fn = intrinsic(self.module, f"llvm.maximum.{self.suffix}", self.type, [self.type, self.type])
        return b.call(fn, [x, y])

    def exp(self, b: ir.IRBuilder, x: ir.Value, name: str = "") -> ir.Value:
        return b.call(define_expf(self.module, self.width), [x], name=name)

    def softmax_exp(self, b: ir.IRBuilder, x: ir.Value, name: str = "") -> ir.Value:
        """``exp(x)`` for ``x`` a score minus its row max (``<= 0`` or NaN): the cheaper kernel."""
        return b.call(define_softmax_expf(self.module, self.width), [x], name=name)


class _Literal(ir.Constant):
    """A vector constant written as LLVM's one word for it (``undef``, ``zeroinitializer``):
    llvmlite spells a vector constant out lane by lane, and splats are everywhere in generated
    code (16 lanes: ~400 characters an instruction to format and parse, a fifth of the tile
    library's text)."""

    def __init__(self, typ: ir.Type, word: str) -> None:
        super().__init__(typ, None)
        self.word = word

    def _to_string(self) -> str:
        return self.word

    def _get_reference(self) -> str:
        return self.word


def zero_vector(ty: ir.VectorType) -> ir.Constant:
    """The all-zeros vector of ``ty``, written ``zeroinitializer``."""
    return _Literal(ty, "zeroinitializer")


def splat(b: ir.IRBuilder, scalar: ir.Value, width: int) -> ir.Value:
    """``scalar`` (of any element type) in every one of ``width`` lanes; itself when ``width`` is 1."""
    if width == 1:
        return scalar
    ty = ir.VectorType(scalar.type, width)
    vector = b.insert_element(_Literal(ty, "undef"), scalar, ir.Constant(ir.IntType(32), 0))
    zeros = _Literal(ir.VectorType(ir.IntType(32), width), "zeroinitializer")
    return b.shuffle_vector(vector, _Literal(ty, "undef"), zeros)


def sum_lanes(b: ir.IRBuilder, partial: ir.Value) -> ir.Value:
    """The sum of a float vector's lanes, in a fixed order."""
    vec = partial.type
    reduce = intrinsic(b.module, f"llvm.vector.reduce.fadd.v{vec.count}f32", F32, [F32, vec])
    return b.call(reduce, [ir.Constant(F32, 0.0), partial], fastmath=REDUCE)


def max_ignoring_nan(b: ir.IRBuilder, x: ir.Value, acc: ir.Value) -> ir.Value:
    """``x > acc ? x : acc``: one ``maxps`` on x86, where LLVM's IEEE ``maximum`` costs six
    instructions and a chain through ``acc`` twice as long. A NaN ``x`` leaves ``acc``, so the
    callers keep apart whether they met a NaN (:func:`any_lane` of the ``uno`` masks)."""
    return b.select(b.fcmp_ordered(">", x, acc), x, acc)


def any_lane(b: ir.IRBuilder, mask: ir.Value) -> ir.Value:
    """True (an ``i1``) if any lane of the ``<N x i1>`` ``mask`` is set."""
    count = mask.type.count
    return b.call(intrinsic(b.module, f"llvm.vector.reduce.or.v{count}i1", I1, [mask.type]), [mask])


def fold_max_ignoring_nan(b: ir.IRBuilder, vector: ir.Value) -> ir.Value:
    """The largest lane of ``vector`` by halving: log2(lanes) steps, where a lane-by-lane fold
    waits on each one."""
    count = vector.type.count
    while count > 1:
        half = count // 2
        low = b.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined), _lanes(range(half)))
        high = b.shuffle_vector(vector, ir.Constant(vector.type, ir.Undefined), _lanes(range(half, count)))
        vector, count = max_ignoring_nan(b, high, low), half
    return b.extract_element(vector, ir.Constant(ir.IntType(32), 0))


def _lanes(indices: range) -> ir.Constant:
    return ir.Constant(ir.VectorType(ir.IntType(32), len(indices)), list(indices))


Body = Callable[[ir.IRBuilder, ir.Value, Lanes], None]
Term = Callable[[ir.IRBuilder, ir.Value, Lanes], ir.Value]


MAX_ACCUMULATORS = 4  # independent partial maxima: each waits on its own maxps (4 cycles)


def _split(b: ir.IRBuilder, start: ir.Value, stop: ir.Value, step: int = WIDTH) -> ir.Value:
    """End of the part in whole steps: ``start + floor((stop - start) / step) * step``."""
    count = b.sub(stop, start)
    whole = b.mul(b.sdiv(count, i64(step)), i64(step))
    return b.add(start, whole, name="vec.end")


def whole_vectors_end(b: ir.IRBuilder, start: ir.Value, stop: ir.Value, cap: ir.Value, name: str = "") -> ir.Value:
    """``stop`` rounded up to whole vectors of a loop from ``start`` (``start + k·WIDTH``), at most
    ``cap``: a row loop that ends there has no scalar tail, which costs more than the lanes it
    would save when they hold hidden keys (``-inf`` scores, zero P or dS)."""
    whole = b.and_(b.add(b.sub(stop, start), i64(WIDTH - 1)), i64(-WIDTH))
    return smin(b, b.add(start, whole), cap, name=name)


def vector_loop(b: ir.IRBuilder, start: ir.Value, stop: ir.Value, name: str, body: Body) -> None:
    """``for j in range(start, stop): body(j)`` — 16 lanes at a time, then one at a time."""
    module = b.module
    middle = _split(b, start, stop)
    with for_range(b, start, middle, f"{name}.v", step=WIDTH) as j:
        body(b, j, Lanes(module, WIDTH))
    with for_range(b, middle, stop, f"{name}.s") as j:
        body(b, j, Lanes(module, 1))


def vector_reduce(b: ir.IRBuilder, start: ir.Value, stop: ir.Value, name: str, kind: str, term: Term) -> ir.Value:
    """Fold ``term(j)`` over ``[start, stop)`` with ``kind`` ``"add"`` (from 0) or ``"max"`` (from -inf)."""
    assert kind in ("add", "max"), kind
    if kind == "max":
        return _max_reduce(b, start, stop, name, term)
    vec, one = Lanes(b.module, WIDTH), Lanes(b.module, 1)
    middle = _split(b, start, stop)
    vector_acc = alloca_entry(b, vec.type, f"{name}.vacc")
    b.store(vec.const(0.0), vector_acc)
    with for_range(b, start, middle, f"{name}.v", step=WIDTH) as j:
        b.store(b.fadd(b.load(vector_acc, typ=vec.type), term(b, j, vec), flags=REDUCE), vector_acc)
    scalar_acc = alloca_entry(b, F32, f"{name}.acc")
    b.store(sum_lanes(b, b.load(vector_acc, typ=vec.type)), scalar_acc)
    with for_range(b, middle, stop, f"{name}.s") as j:
        b.store(b.fadd(b.load(scalar_acc, typ=F32), term(b, j, one), flags=REDUCE), scalar_acc)
    return b.load(scalar_acc, typ=F32, name=name)


def _max_reduce(b: ir.IRBuilder, start: ir.Value, stop: ir.Value, name: str, term: Term) -> ir.Value:
    """The maximum of ``term(j)`` over ``[start, stop)``: -inf if empty, NaN if any term is NaN.

    Partial maxima that ignore NaN (one ``maxps`` each), and beside them a mask of the lanes
    that saw a NaN: a softmax row of 128 spent more time in LLVM's NaN-propagating ``maximum``
    and its serial lane fold than in its exps. A maximum is the same in any order (only the sign
    of a zero maximum may differ, and the order is fixed), so the partials change no value.
    """
    vec, one = Lanes(b.module, WIDTH), Lanes(b.module, 1)
    nan_mask = ir.VectorType(I1, WIDTH)
    middle = _split(b, start, stop)
    partials = [alloca_entry(b, vec.type, f"{name}.vacc{i}") for i in range(MAX_ACCUMULATORS)]
    for partial in partials:
        b.store(vec.const(-math.inf), partial)
    nan_lanes = alloca_entry(b, nan_mask, f"{name}.vnan")
    b.store(ir.Constant(nan_mask, None), nan_lanes)

    def accumulate(partial: ir.Value, j: ir.Value) -> None:
        value = term(b, j, vec)
        b.store(max_ignoring_nan(b, value, b.load(partial, typ=vec.type)), partial)
        b.store(b.or_(b.load(nan_lanes, typ=nan_mask), b.fcmp_unordered("uno", value, value)), nan_lanes)

    unrolled_end = _split(b, start, middle, WIDTH * MAX_ACCUMULATORS)
    with for_range(b, start, unrolled_end, f"{name}.u", step=WIDTH * MAX_ACCUMULATORS) as j:
        for i, partial in enumerate(partials):
            accumulate(partial, b.add(j, i64(i * WIDTH)))
    merged = b.load(partials[0], typ=vec.type)
    for partial in partials[1:]:
        merged = max_ignoring_nan(b, b.load(partial, typ=vec.type), merged)
    b.store(merged, partials[0])
    with for_range(b, unrolled_end, middle, f"{name}.v", step=WIDTH) as j:
        accumulate(partials[0], j)
    scalar_acc = alloca_entry(b, F32, f"{name}.acc")
    b.store(fold_max_ignoring_nan(b, b.load(partials[0], typ=vec.type)), scalar_acc)
    scalar_nan = alloca_entry(b, I1, f"{name}.nan")
    b.store(any_lane(b, b.load(nan_lanes, typ=nan_mask)), scalar_nan)
    with for_range(b, middle, stop, f"{name}.s") as j:
        value = term(b, j, one)
        b.store(max_ignoring_nan(b, value, b.load(scalar_acc, typ=F32)), scalar_acc)
        b.store(b.or_(b.load(scalar_nan, typ=I1), b.fcmp_unordered("uno", value, value)), scalar_nan)
    nan = b.load(scalar_nan, typ=I1)
    return b.select(nan, one.const(math.nan), b.load(scalar_acc, typ=F32), name=name)


def vector_fill(
    b: ir.IRBuilder, base: ir.Value, start: ir.Value, stop: ir.Value, value: float | ir.Value, name: str
) -> None:
    """``base[start:stop] = value`` (a constant or a float of the call)."""

    def fill(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> None:
        lanes.store(b, lanes.const(value) if isinstance(value, float) else lanes.splat(b, value), base, j)

    vector_loop(b, start, stop, name, fill)
