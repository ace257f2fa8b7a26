"""A vector float32 exp. LLVM's ``llvm.exp`` is scalarised to one libm call per lane.

Cephes' expf: ``n = round(x·log2 e)``, ``r = x − n·ln 2`` (split in two constants), a degree-5
polynomial for ``e^r`` and ``2^n`` built from the exponent bits. Only selects and arithmetic, so
it is emitted at any width (``<16 x float>`` in the softmax loops). Accurate to ~1 ulp for ``x``
in [−87.3, 88]; below that the result is 0, above 88.72 it is +inf, NaN stays NaN. Softmax only
feeds it ``x <= 0``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from rlx.codegen.irutil import CONTRACT, F32, I32, intrinsic

EXP_LOW = -87.33654  # below: result underflows to 0 (2^n would be subnormal)
EXP_HIGH = 88.0  # clamp so that n <= 127; x > EXP_OVERFLOW is +inf
EXP_OVERFLOW = 88.72283
_LOG2E = 1.44269504088896341
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


@dataclass(frozen=True)
class _Types:
    """The float and int types of one width, and constants of them."""

    width: int

    @property
    def float_type(self) -> ir.Type:
        return ir.VectorType(F32, self.width) if self.width > 1 else F32

    @property
    def int_type(self) -> ir.Type:
        return ir.VectorType(I32, self.width) if self.width > 1 else I32

    def f(self, value: float) -> ir.Constant:
        return ir.Constant(self.float_type, [value] * self.width if self.width > 1 else value)

    def i(self, value: int) -> ir.Constant:
        return ir.Constant(self.int_type, [value] * self.width if self.width > 1 else value)


def _define(
    module: ir.Module, name: str, width: int, body: Callable[[ir.IRBuilder, ir.Value, _Types], ir.Value]
) -> ir.Function:
    """``name(x)`` on ``width`` floats (once per module): internal, always inlined, ``body``'s value."""
    existing = module.globals.get(name)
    if existing is not None:
        return existing  # type: ignore[return-value]
    types = _Types(width)
    fn = ir.Function(module, ir.FunctionType(types.float_type, [types.float_type]), name=name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fn.attributes.add("nounwind")
    (x,) = fn.args
    x.name = "x"
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    b.ret(body(b, x, types))
    return fn


def _scaled_exp(b: ir.IRBuilder, r: ir.Value, two_n: ir.Value, c: Callable[[float], ir.Constant]) -> ir.Value:
    """``e^r · 2^n`` for ``|r| <= ln2 / 2``: Cephes' ``e^r = 1 + r + r^2 · poly(r)``, the degree-5
    ``poly`` in Estrin's scheme, ``(c4 r + c5) + r^2 ((c2 r + c3) + r^2 (c0 r + c1))``, and the
    1 added in the FMA that scales by ``2^n``: ``q · 2^n + 2^n`` rounds as ``(q + 1) · 2^n``
    (a power of two scales exactly). Horner's five FMAs in a row, then the add and the
    multiply, made the exp one chain too long for the core to overlap enough loop iterations:
    a softmax row took ~10 cycles per vector of 8 floats on AMD's Zen 3, whose FMAs need 5.5."""
    c0, c1, c2, c3, c4, c5 = (c(value) for value in _POLY)
    r2 = b.fmul(r, r, name="r2")
    low = b.fadd(b.fmul(c4, r, flags=CONTRACT), c5, flags=CONTRACT)
    middle = b.fadd(b.fmul(c2, r, flags=CONTRACT), c3, flags=CONTRACT)
    high = b.fadd(b.fmul(c0, r, flags=CONTRACT), c1, flags=CONTRACT)
    upper = b.fadd(b.fmul(high, r2, flags=CONTRACT), middle, flags=CONTRACT)
    poly = b.fadd(b.fmul(upper, r2, flags=CONTRACT), low, flags=CONTRACT)
    q = b.fadd(b.fmul(poly, r2, flags=CONTRACT), r, flags=CONTRACT, name="q")  # e^r - 1
    return b.fadd(b.fmul(q, two_n, flags=CONTRACT), two_n, flags=CONTRACT, name="exp")


def define_expf(module: ir.Module, width: int = 1) -> ir.Function:
    """Define (once per width) ``rlx_expf`` on float or ``<width x float>``, internal, inlined."""
    suffix = f"v{width}f32" if width > 1 else "f32"

    def body(b: ir.IRBuilder, x: ir.Value, t: _Types) -> ir.Value:
        c = t.f
        floor = intrinsic(module, f"llvm.floor.{suffix}", t.float_type, [t.float_type])
        clamped = b.select(b.fcmp_ordered("<", x, c(EXP_LOW)), c(EXP_LOW), x, name="lo")
        clamped = b.select(b.fcmp_ordered(">", clamped, c(EXP_HIGH)), c(EXP_HIGH), clamped, name="xc")
        n = b.call(floor, [b.fadd(b.fmul(clamped, c(_LOG2E), flags=CONTRACT), c(0.5), flags=CONTRACT)], name="n")
        r = b.fsub(clamped, b.fmul(n, c(_LN2_HI)), name="r.hi")
        r = b.fsub(r, b.fmul(n, c(_LN2_LO)), name="r")
        exponent = b.shl(b.add(b.fptosi(n, t.int_type), t.i(127)), t.i(23), name="bits")
        result = _scaled_exp(b, r, b.bitcast(exponent, t.float_type, name="two.n"), c)
        result = b.select(b.fcmp_ordered("<", x, c(EXP_LOW)), c(0.0), result)
        result = b.select(b.fcmp_ordered(">", x, c(EXP_OVERFLOW)), c(float("inf")), result)
        return b.select(b.fcmp_unordered("uno", x, x), x, result, name="exp.nan")

    return _define(module, "rlx_expf" if width == 1 else f"rlx_expf.v{width}", width, body)


_MAGIC = 12582912.0 + 127.0  # 1.5 * 2^23 + bias: adding it rounds to an integer held in the low mantissa bits


def define_softmax_expf(module: ir.Module, width: int) -> ir.Function:
    """``rlx_softmax_expf.vN``: exp of a score minus its row max, so ``x <= 0`` (or NaN), in half
    the operations of :func:`define_expf`.

    Softmax rows spend a sixth of the forward attention kernel in exp. With no overflow to
    handle, ``n = round(x·log2 e)`` and ``2^n`` come from one FMA with a magic constant: the sum
    ``x·log2 e + 1.5·2^23 + 127`` holds ``n + 127`` in its low mantissa bits, so the exponent bits
    are that sum's bits shifted left by 23 (no float-to-int conversion, whose NaN is poison in
    LLVM). Same Cephes reduction and polynomial, ~1 ulp; ``x < -87.34`` (``-inf`` included)
    gives exactly 0, NaN stays NaN.
    """

    def body(b: ir.IRBuilder, x: ir.Value, t: _Types) -> ir.Value:
        c = t.f
        sum_ = b.fadd(b.fmul(x, c(_LOG2E), flags=CONTRACT), c(_MAGIC), flags=CONTRACT, name="t")
        n = b.fsub(sum_, c(_MAGIC), name="n")
        r = b.fsub(x, b.fmul(n, c(_LN2_HI), flags=CONTRACT), flags=CONTRACT, name="r.hi")
        r = b.fsub(r, b.fmul(n, c(_LN2_LO), flags=CONTRACT), flags=CONTRACT, name="r")
        two_n = b.bitcast(b.shl(b.bitcast(sum_, t.int_type), t.i(23)), t.float_type, name="two.n")
        result = _scaled_exp(b, r, two_n, c)
        return b.select(b.fcmp_ordered("<", x, c(EXP_LOW)), c(0.0), result, name="exp.low")

    return _define(module, f"rlx_softmax_expf.v{width}", width, body)
