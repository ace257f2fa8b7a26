"""Inline a traced attention region (:mod:`rlx.ir.region`) into a kernel's loop, at any lane width.

Each step is emitted with the registered elementwise op's scalar formula (the same arithmetic
as a fused loop nest; :class:`rlx.codegen.fused.LaneMath`), so a mod costs what its arithmetic
costs: no call per element. Values that do not depend on the key index are *uniform*: computed
once per query row at width 1 and splatted where a vector needs them (the ALiBi slope
``slopes[h]``, a document id ``doc[b, q_idx]``). Tensor reads load a vector when they walk the
key axis contiguously, a scalar when uniform, and gather lane by lane otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from llvmlite import ir

from rlx.codegen.fused import LaneMath
from rlx.codegen.irutil import F32, I1, I8, I32, I64, gep
from rlx.codegen.vector import any_lane, splat
from rlx.codegen.views import dense_strides
from rlx.ir.opdef import REGISTRY
from rlx.ir.region import Ref, Region
from rlx.ir.types import TensorType


@dataclass(frozen=True)
class LaneValue:
    value: ir.Value
    uniform: bool  # the same in every lane (a scalar)


@dataclass(frozen=True)
class Tensor:
    """A captured tensor as the kernel sees it: base pointer, type and row-major strides."""

    pointer: ir.Value
    type: TensorType
    runtime_strides: tuple[ir.Value, ...] | None = None  # i64 values, when the shape names symbols

    @property
    def strides(self) -> tuple[int | ir.Value, ...]:
        if self.runtime_strides is not None:
            return self.runtime_strides
        return cast(tuple[int, ...], dense_strides(self.type.static_shape))  # a static shape: ints


class _Shim:
    """What LaneMath needs of an emitter: the builder and the module."""

    def __init__(self, b: ir.IRBuilder) -> None:
        self.b = b
        self.module = b.module


class RegionEmitter:
    """Emits steps of one region for one loop body; ``values`` caches what was emitted."""

    def __init__(
        self,
        b: ir.IRBuilder,
        region: Region,
        kinds: list[str],
        width: int,
        symbols: dict[str, LaneValue],
        tensors: list[Tensor],
        uniform: dict[int, LaneValue] | None = None,
    ) -> None:
        self.b = b
        self.region = region
        self.kinds = kinds
        self.width = width
        self.symbols = symbols
        self.tensors = tensors
        self.values: dict[int, LaneValue] = dict(uniform or {})
        self.deps = region.dependences()

    # ------------------------------------------------------------------ public

    def emit(self, steps: Iterable[int]) -> None:
        for index in steps:
            if index not in self.values:
                self.values[index] = self._step(index)

    def uniform_steps(self) -> list[int]:
        """Steps that depend on neither the score nor the key index: once per query row."""
        return [i for i, deps in enumerate(self.deps) if not deps & {"score", "kv_idx"}]

    def get(self, ref: Ref, kind: str) -> ir.Value:
        """``ref`` as a full-width value of ``kind`` (``f``, ``i`` or ``b``)."""
        return self._widen(self._lane(ref, kind))

    # ------------------------------------------------------------------ steps

    def _ty(self, kind: str, width: int) -> ir.Type:
        element = {"f": F32, "i": I64, "b": I1}[kind]
        return element if width == 1 else ir.VectorType(element, width)

    def _lane(self, ref: Ref, kind: str) -> LaneValue:
        source_kind, value = ref
        if source_kind == "k":
            number = float(value) if kind == "f" else int(value)
            return LaneValue(ir.Constant(self._ty(kind, 1), number), True)
        if source_kind == "s":
            lane = self.symbols[str(value)]
            have = "f" if value == "score" else "i"
        else:
            lane = self.values[int(value)]
            have = self.kinds[int(value)]
        if have == kind:
            return lane
        if have == "i" and kind == "f":
            if lane.uniform or self.width == 1:
                return LaneValue(self.b.sitofp(lane.value, F32), lane.uniform)
            return LaneValue(ints_to_floats(self.b, lane.value, self.width), False)
        raise AssertionError(f"region value of kind {have} used as {kind}")

    def _widen(self, lane: LaneValue) -> ir.Value:
        if lane.uniform and self.width > 1:
            return splat(self.b, lane.value, self.width)
        return lane.value

    def _step(self, index: int) -> LaneValue:
        step = self.region.steps[index]
        kind = self.kinds[index]
        if step.op == "read":
            return self._read(index)
        arg_kinds = self._operand_kinds(step.op, step.args, kind)
        lanes = [self._lane(ref, k) for ref, k in zip(step.args, arg_kinds, strict=True)]
        uniform = all(lane.uniform for lane in lanes)
        width = 1 if uniform else self.width
        args = [lane.value if uniform else self._widen(lane) for lane in lanes]
        math = LaneMath(_Shim(self.b), width)  # type: ignore[arg-type]  # it reads only .b and .module
        if step.op == "id":
            return LaneValue(args[0], uniform)
        if step.op in ("floordiv", "mod"):
            return LaneValue(self._int_division(step.op, args[0], args[1], width), uniform)
        definition = REGISTRY[step.op]
        assert definition.scalar is not None
        return LaneValue(definition.scalar(math, *args, definition.attrs()), uniform)

    def _operand_kinds(self, op: str, args: tuple[Ref, ...], result: str) -> list[str]:
        """The kind each operand is converted to: ints join floats as floats."""
        have = [self._kind_of(ref) for ref in args]
        if op in ("exp", "log", "tanh", "sigmoid", "sqrt", "div"):
            return ["f"] * len(args)
        if op == "where":
            return ["b", result, result]
        if op in ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal"):
            if "b" in have:
                return ["b", "b"]
            common = "f" if "f" in have else "i"
            return [common, common]
        if op in ("logical_and", "logical_or", "logical_not"):
            return ["b"] * len(args)
        return [result] * len(args)

    def _kind_of(self, ref: Ref) -> str:
        kind, value = ref
        if kind == "s":
            return "f" if value == "score" else "i"
        if kind == "t":
            return self.kinds[int(value)]
        if isinstance(value, bool):
            return "b"
        return "i" if isinstance(value, int) else "f"

    def _int_division(self, op: str, a: ir.Value, d: ir.Value, width: int) -> ir.Value:
        """Python's floor division and modulo on ints; a zero divisor gives 0 (as NumPy), never a trap."""
        b = self.b
        zero = ir.Constant(self._ty("i", width), 0 if width == 1 else [0] * width)
        one = ir.Constant(self._ty("i", width), 1 if width == 1 else [1] * width)
        by_zero = b.icmp_signed("==", d, zero)
        safe = b.select(by_zero, one, d)
        quotient = b.sdiv(a, safe)
        remainder = b.srem(a, safe)
        adjust = b.and_(
            b.icmp_signed("!=", remainder, zero),
            b.icmp_signed("!=", b.icmp_signed("<", remainder, zero), b.icmp_signed("<", safe, zero)),
        )
        if op == "floordiv":
            result = b.select(adjust, b.sub(quotient, one), quotient)
        else:
            result = b.select(adjust, b.add(remainder, safe), remainder)
        return b.select(by_zero, zero, result)

    # ------------------------------------------------------------------ reads

    def offset_of(self, index: int) -> LaneValue:
        """The linear element offset a read step addresses."""
        step = self.region.steps[index]
        tensor = self.tensors[int(step.args[0][1])]
        lanes = [self._lane(ref, "i") for ref in step.args[1:]]
        uniform = all(lane.uniform for lane in lanes)
        width = 1 if uniform else self.width
        total: ir.Value | None = None
        for lane, stride in zip(lanes, tensor.strides, strict=True):
            value = lane.value if uniform else self._widen(lane)
            if isinstance(stride, ir.Value):  # known per call
                factor = stride if width == 1 else splat(self.b, stride, width)
                term = self.b.mul(value, factor)
            elif stride == 1:
                term = value
            else:
                term = self.b.mul(value, ir.Constant(value.type, stride if width == 1 else [stride] * width))
            total = term if total is None else self.b.add(total, term)
        if total is None:
            total = ir.Constant(I64, 0)
        return LaneValue(total, uniform)

    def contiguous(self, index: int) -> bool:
        """A read whose last index is exactly ``kv_idx`` and whose others do not depend on it."""
        step = self.region.steps[index]
        *others, last = step.args[1:]
        if last != ("s", "kv_idx"):
            return False
        return all(not (self._deps_of(ref) & {"kv_idx", "score"}) for ref in others)

    def _deps_of(self, ref: Ref) -> frozenset[str]:
        kind, value = ref
        if kind == "s":
            return frozenset({str(value)})
        if kind == "t":
            return self.deps[int(value)]
        return frozenset()

    def _read(self, index: int) -> LaneValue:
        step = self.region.steps[index]
        tensor = self.tensors[int(step.args[0][1])]
        element, kind = _element(tensor.type)
        b = self.b
        if self.width > 1 and self.contiguous(index):
            first = self._lane_zero_offset(index)
            vector_ty = ir.VectorType(element, self.width)
            loaded = b.load(gep(b, tensor.pointer, [first], element), typ=vector_ty, align=1)
            return LaneValue(_widen_loaded(b, loaded, kind, self.width), False)
        offset = self.offset_of(index)
        if offset.uniform:
            loaded = b.load(gep(b, tensor.pointer, [offset.value], element), typ=element, align=1)
            return LaneValue(_widen_loaded(b, loaded, kind, 1), True)
        lanes = []
        for lane in range(self.width):
            position = b.extract_element(offset.value, ir.Constant(I32, lane))
            lanes.append(b.load(gep(b, tensor.pointer, [position], element), typ=element, align=1))
        packed: ir.Value = ir.Constant(ir.VectorType(element, self.width), ir.Undefined)
        for lane, value in enumerate(lanes):
            packed = b.insert_element(packed, value, ir.Constant(I32, lane))
        return LaneValue(_widen_loaded(b, packed, kind, self.width), False)

    def _lane_zero_offset(self, index: int) -> ir.Value:
        """The offset of lane 0 of a contiguous read (its kv index is the loop variable)."""
        saved = self.symbols["kv_idx"]
        self.symbols["kv_idx"] = self.symbols["kv_idx.lane0"]
        try:
            return self.offset_of(index).value
        finally:
            self.symbols["kv_idx"] = saved


def _element(ty: TensorType) -> tuple[ir.Type, str]:
    kind = ty.dtype.kind
    if kind == "f":
        return F32, "f"
    if kind == "b":
        return I8, "b"
    return (I32 if ty.dtype.itemsize == 4 else I64), "i"


def _widen_loaded(b: ir.IRBuilder, loaded: ir.Value, kind: str, width: int) -> ir.Value:
    if kind == "f":
        return loaded
    if kind == "b":
        zero = ir.Constant(loaded.type, 0 if width == 1 else [0] * width)
        return b.icmp_unsigned("!=", loaded, zero)
    target = I64 if width == 1 else ir.VectorType(I64, width)
    return loaded if loaded.type == target else b.sext(loaded, target)


def ints_to_floats(b: ir.IRBuilder, value: ir.Value, width: int) -> ir.Value:
    """``sitofp`` of a ``<width x i64>``, through 32-bit ints where every lane fits in them.

    Without AVX-512 the CPU has no vector conversion from 64-bit ints, and LLVM converts such a
    vector lane by lane: an ALiBi mod (``slope · (kv_idx - q_idx)``) spent most of a causal
    forward's mod loop there (a quarter of the kernel, B4 H8 S1024). Region ints are i64, but
    those of a mod (indices, their differences) fit in 32 bits, where the conversion is one
    instruction; a vector with a lane outside takes the lane-by-lane path, so the result is
    always ``sitofp``'s."""
    vector = ir.VectorType(I64, width)
    below = b.icmp_signed("<", value, ir.Constant(vector, [-(1 << 31)] * width))
    above = b.icmp_signed(">", value, ir.Constant(vector, [(1 << 31) - 1] * width))
    floats = ir.VectorType(F32, width)
    with b.if_else(b.not_(any_lane(b, b.or_(below, above)), name="ints.fit")) as (narrow, wide):
        with narrow:
            quick = b.sitofp(b.trunc(value, ir.VectorType(I32, width)), floats)
            quick_block = b.block
        with wide:
            exact = b.sitofp(value, floats)
            exact_block = b.block
    result = b.phi(floats, name="ints.float")
    result.add_incoming(quick, quick_block)
    result.add_incoming(exact, exact_block)
    return result


def lane_indices(b: ir.IRBuilder, start: ir.Value, width: int) -> ir.Value:
    """``start + [0, 1, ..., width-1]`` as an i64 vector (or ``start`` itself at width 1)."""
    if width == 1:
        return start
    steps = ir.Constant(ir.VectorType(I64, width), list(range(width)))
    return b.add(splat(b, start, width), steps)


__all__ = ["LaneValue", "RegionEmitter", "Tensor", "ints_to_floats", "lane_indices"]
