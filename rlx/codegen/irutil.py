"""Small IRBuilder helpers in the spirit of numba's cgutils: types, constants, loops, allocas.

Loops are emitted with ``for_range`` so generated IR reads like the Python that made it; loop
carried scalars live in entry-block allocas that LLVM's SROA turns into phis.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from llvmlite import ir

I1 = ir.IntType(1)
I8 = ir.IntType(8)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
F32 = ir.FloatType()
F64 = ir.DoubleType()
PTR = ir.PointerType()
VOID = ir.VoidType()

# Fast-math flags that are legal here: contraction into FMA everywhere, reassociation only on
# reductions (it lets the vectoriser split a sum over lanes). No nnan/ninf: NaN must propagate.
CONTRACT = ("contract",)
REDUCE = ("reassoc", "contract")


ELEMENT_TYPES = {"float32": F32, "bool": I8, "int32": I32, "int64": I64}
"""The dtypes compiled code holds, by NumPy name, and the LLVM type of one element (bool as a byte)."""


def element_type(dtype: object) -> ir.Type:
    """The LLVM type one element of an array of ``dtype`` is stored as (bool as a byte)."""
    name = str(dtype)
    if name not in ELEMENT_TYPES:
        raise AssertionError(f"no LLVM element type for {dtype}")
    return ELEMENT_TYPES[name]


def i32(value: int) -> ir.Constant:
    return ir.Constant(I32, value)


def i64(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def as_i64(value: int | ir.Value) -> ir.Value:
    """An i64 size known now (a constant) or one of the call (already a value)."""
    return i64(value) if isinstance(value, int) else value


def f32(value: float) -> ir.Constant:
    return ir.Constant(F32, value)


def alloca_entry(builder: ir.IRBuilder, ty: ir.Type, name: str, count: int | None = None) -> ir.AllocaInstr:
    """An alloca in the function's entry block, so it is not re-executed inside loops."""
    entry = builder.function.entry_basic_block
    with builder.goto_block(entry):
        if entry.instructions:
            builder.position_before(entry.instructions[0])
        return builder.alloca(ty, size=None if count is None else i64(count), name=name)


@contextmanager
def for_range(
    builder: ir.IRBuilder, start: ir.Value | int, stop: ir.Value | int, name: str, step: int = 1
) -> Iterator[ir.Value]:
    """``for name in range(start, stop, step)`` over i64; the body is emitted inside the ``with``."""
    start, stop = as_i64(start), as_i64(stop)
    before = builder.block
    cond = builder.append_basic_block(f"{name}.cond")
    body = builder.append_basic_block(f"{name}.body")
    end = builder.append_basic_block(f"{name}.end")
    builder.branch(cond)
    builder.position_at_end(cond)
    index = builder.phi(I64, name=name)
    index.add_incoming(start, before)
    builder.cbranch(builder.icmp_signed("<", index, stop, name=f"{name}.more"), body, end)
    builder.position_at_end(body)
    yield index
    following = builder.add(index, i64(step), name=f"{name}.next")
    index.add_incoming(following, builder.block)
    builder.branch(cond)
    builder.position_at_end(end)


def gep(
    builder: ir.IRBuilder,
    base: ir.Value,
    indices: list[ir.Value],
    element: ir.Type,
    name: str = "",
    inbounds: bool = True,
) -> ir.Value:
    """``getelementptr inbounds element, base, indices`` (``inbounds=False``: an address that may
    lie outside ``base``'s object, which ``inbounds`` would make poison).

    llvmlite's ``alloca`` returns typed pointers whose element type it already knows, and giving
    it ``source_etype`` as well yields a wrong result type; opaque pointers need it.
    """
    if base.type.is_opaque:
        return builder.gep(base, indices, inbounds=inbounds, source_etype=element, name=name)
    return builder.gep(base, indices, inbounds=inbounds, name=name)


def gep_f32(builder: ir.IRBuilder, base: ir.Value, offset: ir.Value | int, name: str = "") -> ir.Value:
    """``&base[offset]`` for a float buffer (offset in elements)."""
    return gep(builder, base, [as_i64(offset)], F32, name)


def smin(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, name: str = "") -> ir.Value:
    return builder.select(builder.icmp_signed("<", a, b), a, b, name=name)


def smax(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, name: str = "") -> ir.Value:
    return builder.select(builder.icmp_signed(">", a, b), a, b, name=name)


def clamp(builder: ir.IRBuilder, value: ir.Value, low: ir.Value, high: ir.Value, name: str = "") -> ir.Value:
    return smin(builder, smax(builder, value, low), high, name=name)


def declare(module: ir.Module, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    """Get or declare an external function."""
    existing = module.globals.get(name)
    if existing is not None:
        return existing  # type: ignore[return-value]
    return ir.Function(module, ir.FunctionType(ret, args), name=name)


def intrinsic(module: ir.Module, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return declare(module, name, ret, args)


def clock(module: ir.Module) -> Callable[[ir.IRBuilder], ir.Value]:
    """``now(b)``: ``clock_gettime(CLOCK_MONOTONIC)`` in nanoseconds, for profiling builds."""
    fn = declare(module, "clock_gettime", ir.IntType(32), [ir.IntType(32), PTR])
    spec_type = ir.ArrayType(I64, 2)

    def now(b: ir.IRBuilder) -> ir.Value:
        spec = alloca_entry(b, spec_type, "timespec")
        b.call(fn, [ir.Constant(ir.IntType(32), 1), spec])
        sec = b.load(gep(b, spec, [i64(0), i64(0)], spec_type), typ=I64)
        nsec = b.load(gep(b, spec, [i64(0), i64(1)], spec_type), typ=I64)
        return b.add(b.mul(sec, i64(1_000_000_000)), nsec)

    return now
