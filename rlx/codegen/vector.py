"""Explicitly vectorised row loops: a 16-lane main loop and a scalar remainder, same body.

rlx does not rely on LLVM's loop vectoriser. The llvmlite wheels ship LLVM with assertions on,
and the vectoriser's cost model asserts (aborting the process) on some loop shapes that user
graphs can produce. So each row loop is written once as a body that is generic in its width
(``Lanes``), and emitted twice: over 16-float vectors, then over the leftover scalars.
Reductions keep one partial result per lane and combine them in a fixed order, so results
depend only on the row length, never on threads or timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from rlx.codegen.expf import define_expf, define_softmax_expf
from rlx.codegen.irutil import F32, REDUCE, alloca_entry, for_range, gep_f32, i64, intrinsic

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


def splat(b: ir.IRBuilder, scalar: ir.Value, width: int) -> ir.Value:
    """``scalar`` (of any element type) in every one of ``width`` lanes; itself when ``width`` is 1."""
    if width == 1:
        return scalar
    ty = ir.VectorType(scalar.type, width)
    vector = b.insert_element(ir.Constant(ty, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width)
    return b.shuffle_vector(vector, ir.Constant(ty, ir.Undefined), zeros)


def fold_lanes(b: ir.IRBuilder, kind: str, partial: ir.Value) -> ir.Value:
    """Combine the lanes of a float vector: ``"add"`` (in a fixed order) or ``"max"`` (NaN-propagating)."""
    vec = partial.type
    suffix = f"v{vec.count}f32"
    if kind == "add":
        reduce = intrinsic(b.module, f"llvm.vector.reduce.fadd.{suffix}", F32, [F32, vec])
        return b.call(reduce, [ir.Constant(F32, 0.0), partial], fastmath=REDUCE)
    reduce = intrinsic(b.module, f"llvm.vector.reduce.fmaximum.{suffix}", F32, [vec])
    return b.call(reduce, [partial])


Body = Callable[[ir.IRBuilder, ir.Value, Lanes], None]
Term = Callable[[ir.IRBuilder, ir.Value, Lanes], ir.Value]


MAX_ACCUMULATORS = 4  # independent partial maxima: the NaN-propagating maximum's chain is ~7 cycles


def _split(b: ir.IRBuilder, start: ir.Value, stop: ir.Value, step: int = WIDTH) -> ir.Value:
    """End of the part in whole steps: ``start + floor((stop - start) / step) * step``."""
    count = b.sub(stop, start)
    whole = b.mul(b.sdiv(count, i64(step)), i64(step))
    return b.add(start, whole, name="vec.end")


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
    module = b.module
    vec, one = Lanes(module, WIDTH), Lanes(module, 1)
    identity = 0.0 if kind == "add" else float("-inf")

    def combine(lanes: Lanes, acc: ir.Value, value: ir.Value) -> ir.Value:
        return b.fadd(acc, value, flags=REDUCE) if kind == "add" else lanes.maximum(b, acc, value)

    middle = _split(b, start, stop)
    vector_acc = alloca_entry(b, vec.type, f"{name}.vacc")
    b.store(vec.const(identity), vector_acc)
    vectors_from = start
    if kind == "max":
        # A maximum is the same in any order (NaN and signed zeros included), so independent
        # partial maxima change no result; one accumulator would wait on each vector's chain.
        partials = [vector_acc] + [alloca_entry(b, vec.type, f"{name}.vacc{i}") for i in range(1, MAX_ACCUMULATORS)]
        for partial in partials[1:]:
            b.store(vec.const(identity), partial)
        vectors_from = _split(b, start, middle, WIDTH * MAX_ACCUMULATORS)
        with for_range(b, start, vectors_from, f"{name}.u", step=WIDTH * MAX_ACCUMULATORS) as j:
            for i, partial in enumerate(partials):
                value = term(b, b.add(j, i64(i * WIDTH)), vec)
                b.store(combine(vec, b.load(partial, typ=vec.type), value), partial)
        merged = b.load(vector_acc, typ=vec.type)
        for partial in partials[1:]:
            merged = combine(vec, merged, b.load(partial, typ=vec.type))
        b.store(merged, vector_acc)
    with for_range(b, vectors_from, middle, f"{name}.v", step=WIDTH) as j:
        b.store(combine(vec, b.load(vector_acc, typ=vec.type), term(b, j, vec)), vector_acc)
    folded = fold_lanes(b, kind, b.load(vector_acc, typ=vec.type))
    scalar_acc = alloca_entry(b, F32, f"{name}.acc")
    b.store(folded, scalar_acc)
    with for_range(b, middle, stop, f"{name}.s") as j:
        b.store(combine(one, b.load(scalar_acc, typ=F32), term(b, j, one)), scalar_acc)
    return b.load(scalar_acc, typ=F32, name=name)


def vector_fill(b: ir.IRBuilder, base: ir.Value, start: ir.Value, stop: ir.Value, value: float, name: str) -> None:
    """``base[start:stop] = value``."""
    vector_loop(b, start, stop, name, lambda b, j, lanes: lanes.store(b, lanes.const(value), base, j))
