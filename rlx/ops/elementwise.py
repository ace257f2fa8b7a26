"""Elementwise ops: broadcasting binary arithmetic, unary math, comparisons, logic and ``where``.

Each op is one row of a table below: its NumPy reference (computed in float64) and its gradient,
written with other graph ops so that second derivatives and fusion come for free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, GradFn, OpDef, no_gradient, register_op
from rlx.ir.types import DTYPE_NAMES, TensorType, as_dtype
from rlx.ops._batching import batch_elementwise
from rlx.ops._common import (
    BOOL,
    F32,
    INT_DTYPES,
    as_value,
    broadcast_shapes,
    is_int,
    op_kind,
    require_bool,
    require_float,
    sum_to_shape,
)

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class NoAttrs:
    """Attributes of an op that has none (printed as nothing)."""


@dataclass(frozen=True)
class GeluAttrs:
    approximate: str = "none"  # "none" (erf) or "tanh", as torch.nn.functional.gelu

    def __post_init__(self) -> None:
        if self.approximate not in ("none", "tanh"):
            raise RlxValueError(f"gelu: approximate must be 'none' or 'tanh', got {self.approximate!r}")


@dataclass(frozen=True)
class CastAttrs:
    """The result's dtype, by its IR name (``"f32"``, ``"i32"``, ``"i64"``, ``"bool"``).

    float32 is the default, so that the common cast (a mask or ids to float weights) has default
    attrs and joins fused elementwise chains, whose steps carry no attrs; the others are loop
    nests of their own."""

    dtype: str = "f32"

    def __post_init__(self) -> None:
        if self.dtype not in CAST_TARGETS:
            raise RlxValueError(f"cast: dtype must be one of {', '.join(CAST_TARGETS)}, got {self.dtype!r}")


CAST_TARGETS = ("f32", "i32", "i64", "bool")  # what graph values hold; rlx computes floats in float32


# ----------------------------------------------------------------------------- shape rules


def _float_unary(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    require_float(what, "x", inputs[0])
    return (inputs[0],)


# Ops that also compute on integers (NumPy's wrapping arithmetic in the operands' own dtype):
# positions and offsets of ids (``arange(S) + past``), and ``//`` and ``%`` (a position's row and
# column in a grid, its place in a window). True division, powers and math stay float.
INTEGER_ARITHMETIC = ("add", "sub", "mul", "maximum", "minimum", "neg", "abs", "floor_divide", "remainder", "fmod")


def _arithmetic_unary(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    if inputs[0].dtype not in INT_DTYPES:
        require_float(what, "x", inputs[0])
    return (inputs[0],)


def _arithmetic_binary(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    a, b = inputs
    if a.dtype in INT_DTYPES or b.dtype in INT_DTYPES:
        if a.dtype != b.dtype:
            raise RlxTypeError(
                f"{what}: a and b must have the same dtype, got {a.dtype_name} ({a}) and {b.dtype_name} ({b}) "
                "(convert one with .astype)"
            )
        return (TensorType(broadcast_shapes(what, a.shape, b.shape), a.dtype),)
    return _float_binary(what, inputs, attrs)


def _float_binary(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    require_float(what, "a", inputs[0])
    require_float(what, "b", inputs[1])
    return (TensorType(broadcast_shapes(what, inputs[0].shape, inputs[1].shape), F32),)


def _compare(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    a, b = inputs
    if a.dtype != b.dtype:
        raise RlxTypeError(
            f"{what}: a and b must have the same dtype, got {a.dtype_name} ({a}) and {b.dtype_name} ({b})"
        )
    return (TensorType(broadcast_shapes(what, a.shape, b.shape), BOOL),)


def _logical_binary(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    require_bool(what, "a", inputs[0])
    require_bool(what, "b", inputs[1])
    return (TensorType(broadcast_shapes(what, inputs[0].shape, inputs[1].shape), BOOL),)


def _bitwise_binary(kinds: str) -> Callable[..., tuple[TensorType, ...]]:
    """The shape rule of NumPy's bitwise ops: operands of one dtype whose kind is in ``kinds``
    (``"ib"``: ints or bools; ``"i"``: ints only, for the shifts)."""
    allowed = "int32 or int64" if kinds == "i" else "int32, int64 or bool"

    def infer(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
        a, b = inputs
        if a.dtype != b.dtype or a.dtype.kind not in kinds:
            raise RlxTypeError(
                f"{what}: a and b must have one dtype, {allowed}, got {a.dtype_name} ({a}) and {b.dtype_name} ({b})"
            )
        return (TensorType(broadcast_shapes(what, a.shape, b.shape), a.dtype),)

    return infer


def _bitwise_unary(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    (x,) = inputs
    if x.dtype.kind not in "ib":
        raise RlxTypeError(f"{what}: x must be int32, int64 or bool, got {x.dtype_name} ({x})")
    return (x,)


def _logical_unary(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    require_bool(what, "x", inputs[0])
    return (inputs[0],)


def _where(what: str, inputs: Sequence[TensorType], attrs: object) -> tuple[TensorType, ...]:
    cond, a, b = inputs
    require_bool(what, "cond", cond)
    if a.dtype != b.dtype:
        raise RlxTypeError(
            f"{what}: a and b must have the same dtype, got {a.dtype_name} ({a}) and {b.dtype_name} ({b})"
        )
    return (TensorType(broadcast_shapes(what, cond.shape, a.shape, b.shape), a.dtype),)


def _cast(what: str, inputs: Sequence[TensorType], attrs: CastAttrs) -> tuple[TensorType, ...]:
    return (TensorType(inputs[0].shape, DTYPE_NAMES[attrs.dtype]),)


# ----------------------------------------------------------------------------- references


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x) if np.size(x) else np.asarray(x, dtype=np.float64)


def _gelu(x: np.ndarray, attrs: GeluAttrs) -> np.ndarray:
    if attrs.approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # Two branches so that neither overflows: exp of a non-positive number only.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


UNARY_REFERENCE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "neg": np.negative,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "abs": np.abs,
    "sign": np.sign,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "relu": lambda x: np.maximum(x, 0.0),
    "silu": lambda x: x * _sigmoid(x),
    "erf": _erf,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "atan": np.arctan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "log2": np.log2,
    "log10": np.log10,
    "exp2": np.exp2,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "softplus": lambda x: np.logaddexp(0.0, x),
    "floor": np.floor,
    "ceil": np.ceil,
    "trunc": np.trunc,
    "round": np.round,  # halves to even, as NumPy and torch
}


def _quietly(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """``fn`` without NumPy's warnings for division by zero (ints give 0, floats inf or NaN)."""

    def quiet(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(a, b)

    return quiet


BINARY_REFERENCE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "pow": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "floor_divide": _quietly(np.floor_divide),  # ``a // b``: Python's and NumPy's, toward -inf
    "remainder": _quietly(np.remainder),  # ``a % b``: the divisor's sign, as Python, NumPy and torch
    "fmod": _quietly(np.fmod),  # C's: the dividend's sign (torch.fmod, math.fmod)
    "atan2": np.arctan2,  # the angle of the point (b, a): numpy.arctan2(a, b), torch.atan2(a, b)
}

COMPARE_REFERENCE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "equal": np.equal,
    "not_equal": np.not_equal,
}

LOGICAL_REFERENCE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
}

# NumPy's bitwise ops on ints (and on bools, for and/or/xor/not). A shift by an amount outside
# [0, bits) gives NumPy's answer: 0 to the left, the sign's fill to the right.
BITWISE_REFERENCE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "bitwise_and": np.bitwise_and,
    "bitwise_or": np.bitwise_or,
    "bitwise_xor": np.bitwise_xor,
    "left_shift": np.left_shift,
    "right_shift": np.right_shift,
}
SHIFTS = ("left_shift", "right_shift")


def _cast_reference(args: Sequence[np.ndarray], attrs: CastAttrs, ctx: EvalContext) -> np.ndarray:
    """NumPy's ``astype``, except float to int: toward zero, saturating at the int's range, NaN
    to 0 (XLA's and so JAX's rule, and LLVM's ``fptosi.sat``; NumPy leaves those undefined).
    Floats stay float64 here, as everywhere in the reference."""
    x = np.asarray(args[0])
    target = DTYPE_NAMES[attrs.dtype]
    if target == np.float32:
        return x.astype(np.float64)
    if target.kind == "i" and x.dtype.kind == "f":
        info = np.iinfo(target)
        t = np.trunc(np.where(np.isnan(x), 0.0, x))
        above, below = t >= 2.0 ** (info.bits - 1), t < info.min
        out = np.where(above | below, 0.0, t).astype(target)
        out[above], out[below] = info.max, info.min
        return out
    return x.astype(target)


# ----------------------------------------------------------------------------- gradients


def _unary_grad(rule: Callable[[Graph, Value, Value, Value], Value]) -> GradFn:
    """Adapt ``rule(graph, x, y, dy) -> dx`` to the generic signature."""

    def grad(
        graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
    ) -> list[Value | None]:
        (dy,) = cotangents
        assert dy is not None
        if node.outputs[0].dtype != F32:  # integer arithmetic: nothing to differentiate
            return [None]
        return [rule(graph, node.inputs[0], node.outputs[0], dy)]

    return grad


SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_dx(graph: Graph, x: Value, y: Value, dy: Value, approximate: str) -> Value:
    if approximate == "tanh":  # torch's GeluBackward formula for approximate="tanh"
        kappa = 0.044715
        inner = SQRT_2_OVER_PI * (x + kappa * x * x * x)
        t = graph.tanh(inner)
        d_inner = SQRT_2_OVER_PI * (1.0 + 3.0 * kappa * x * x)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * d_inner)
    cdf = 0.5 * (1.0 + graph.erf(x * (1.0 / math.sqrt(2.0))))
    pdf = INV_SQRT_2PI * graph.exp(-0.5 * x * x)
    return dy * (cdf + x * pdf)


def _gelu_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    (dy,) = cotangents
    assert dy is not None
    return [_gelu_dx(graph, node.inputs[0], node.outputs[0], dy, node.attrs.approximate)]


def _silu_dx(graph: Graph, x: Value, y: Value, dy: Value) -> Value:
    s = graph.sigmoid(x)
    return dy * (s * (1.0 + x * (1.0 - s)))


UNARY_GRAD: dict[str, GradFn] = {
    "neg": _unary_grad(lambda g, x, y, dy: -dy),
    "exp": _unary_grad(lambda g, x, y, dy: dy * y),
    "log": _unary_grad(lambda g, x, y, dy: dy / x),
    "sqrt": _unary_grad(lambda g, x, y, dy: dy * 0.5 / y),
    "rsqrt": _unary_grad(lambda g, x, y, dy: dy * -0.5 * y * y * y),
    "abs": _unary_grad(lambda g, x, y, dy: dy * g.sign(x)),
    "sign": no_gradient,
    # Piecewise constant: zero almost everywhere, as torch's gradients of them.
    "floor": no_gradient,
    "ceil": no_gradient,
    "trunc": no_gradient,
    "round": no_gradient,
    "tanh": _unary_grad(lambda g, x, y, dy: dy * (1.0 - y * y)),
    "sigmoid": _unary_grad(lambda g, x, y, dy: dy * y * (1.0 - y)),
    "relu": _unary_grad(lambda g, x, y, dy: g.where(g.greater(x, 0.0), dy, 0.0)),
    "silu": _unary_grad(_silu_dx),
    "erf": _unary_grad(lambda g, x, y, dy: dy * (2.0 / math.sqrt(math.pi)) * g.exp(-(x * x))),
    "sin": _unary_grad(lambda g, x, y, dy: dy * g.cos(x)),
    "cos": _unary_grad(lambda g, x, y, dy: -(dy * g.sin(x))),
    "tan": _unary_grad(lambda g, x, y, dy: dy * (1.0 + y * y)),
    "atan": _unary_grad(lambda g, x, y, dy: dy / (1.0 + x * x)),
    "asin": _unary_grad(lambda g, x, y, dy: dy * g.rsqrt(1.0 - x * x)),
    "acos": _unary_grad(lambda g, x, y, dy: -(dy * g.rsqrt(1.0 - x * x))),
    "sinh": _unary_grad(lambda g, x, y, dy: dy * g.cosh(x)),
    "cosh": _unary_grad(lambda g, x, y, dy: dy * g.sinh(x)),
    "asinh": _unary_grad(lambda g, x, y, dy: dy * g.rsqrt(x * x + 1.0)),
    "acosh": _unary_grad(lambda g, x, y, dy: dy * g.rsqrt(x * x - 1.0)),
    "atanh": _unary_grad(lambda g, x, y, dy: dy / (1.0 - x * x)),
    "log2": _unary_grad(lambda g, x, y, dy: dy / (x * math.log(2.0))),
    "log10": _unary_grad(lambda g, x, y, dy: dy / (x * math.log(10.0))),
    "exp2": _unary_grad(lambda g, x, y, dy: dy * y * math.log(2.0)),
    "log1p": _unary_grad(lambda g, x, y, dy: dy / (1.0 + x)),
    "expm1": _unary_grad(lambda g, x, y, dy: dy * (y + 1.0)),
    "softplus": _unary_grad(lambda g, x, y, dy: dy * g.sigmoid(x)),
}


def _binary_grad(rule: Callable[[Graph, Value, Value, Value, Value], tuple[Value | None, Value | None]]) -> GradFn:
    """Adapt ``rule(graph, a, b, out, dy) -> (da, db)`` and undo broadcasting of each operand."""

    def grad(
        graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
    ) -> list[Value | None]:
        (dy,) = cotangents
        assert dy is not None
        a, b = node.inputs
        if node.outputs[0].dtype != F32:  # integer arithmetic: nothing to differentiate
            return [None, None]
        da, db = rule(graph, a, b, node.outputs[0], dy)
        return [
            sum_to_shape(graph, da, a.shape) if needed[0] and da is not None else None,
            sum_to_shape(graph, db, b.shape) if needed[1] and db is not None else None,
        ]

    return grad


def _pow_grads(g: Graph, a: Value, b: Value, out: Value, dy: Value) -> tuple[Value, Value]:
    da = dy * b * g.pow(a, b - 1.0)
    # d/db a^b = a^b log(a); taken as 0 where a == 0 and b >= 0 (the limit), as torch does.
    safe = g.logical_and(g.equal(a, 0.0), g.greater_equal(b, 0.0))
    db = g.where(safe, 0.0, dy * out * g.log(g.where(safe, 1.0, a)))
    return da, db


def _atan2_grads(g: Graph, a: Value, b: Value, out: Value, dy: Value) -> tuple[Value, Value]:
    """d atan2(a, b) = (b da - a db) / (a^2 + b^2): torch's rule, NaN at the origin as torch's."""
    scale = dy / (a * a + b * b)
    return scale * b, -(scale * a)


def _extremum_grads(g: Graph, a: Value, b: Value, out: Value, dy: Value, a_wins: Value) -> tuple[Value, Value]:
    """Ties split the gradient evenly between a and b (torch's rule for maximum and minimum)."""
    tie = g.equal(a, b)
    share = g.where(tie, dy * 0.5, dy)
    return g.where(g.logical_or(a_wins, tie), share, 0.0), g.where(g.logical_not(a_wins), share, 0.0)


BINARY_GRAD: dict[str, GradFn] = {
    "add": _binary_grad(lambda g, a, b, out, dy: (dy, dy)),
    "sub": _binary_grad(lambda g, a, b, out, dy: (dy, -dy)),
    "mul": _binary_grad(lambda g, a, b, out, dy: (dy * b, dy * a)),
    "div": _binary_grad(lambda g, a, b, out, dy: (dy / b, -(dy * out) / b)),
    "pow": _binary_grad(_pow_grads),
    "maximum": _binary_grad(lambda g, a, b, out, dy: _extremum_grads(g, a, b, out, dy, g.greater(a, b))),
    "minimum": _binary_grad(lambda g, a, b, out, dy: _extremum_grads(g, a, b, out, dy, g.less(a, b))),
    "floor_divide": no_gradient,  # piecewise constant
    # a % b = a - b * (a // b): torch's rule, the quotient held constant.
    "remainder": _binary_grad(lambda g, a, b, out, dy: (dy, -(dy * g.floor_divide(a, b)))),
    # fmod(a, b) = a - b * trunc(a / b), the quotient held constant (torch's rule).
    "fmod": _binary_grad(lambda g, a, b, out, dy: (dy, -(dy * g.trunc(a / b)))),
    "atan2": _binary_grad(_atan2_grads),
}


def _where_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    (dy,) = cotangents
    assert dy is not None
    cond, a, b = node.inputs
    if a.dtype != F32:
        return [None, None, None]
    da = sum_to_shape(graph, graph.where(cond, dy, 0.0), a.shape) if needed[1] else None
    db = sum_to_shape(graph, graph.where(cond, 0.0, dy), b.shape) if needed[2] else None
    return [None, da, db]


def _cast_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """Float to float passes the cotangent on; from or to an int or bool there is no gradient."""
    (dy,) = cotangents
    return [dy if node.inputs[0].dtype == F32 and node.outputs[0].dtype == F32 else None]


# ----------------------------------------------------------------------------- builders


# Ops whose operands (where: the two values) only need to agree in dtype: a Python int beside an
# integer operand becomes an integer constant of that dtype (``g.not_equal(ids, 0)``), as NumPy
# and torch compare an int tensor with an int.
_SAME_DTYPE_OPERANDS = {
    "less": (0, 1),
    "less_equal": (0, 1),
    "greater": (0, 1),
    "greater_equal": (0, 1),
    "equal": (0, 1),
    "not_equal": (0, 1),
    "where": (1, 2),
    **{name: (0, 1) for name in INTEGER_ARITHMETIC if name not in ("neg", "abs")},
    **{name: (0, 1) for name in BITWISE_REFERENCE},
}


def _elementwise(graph: Graph, name: str, operands: Sequence[object], attrs: object = None) -> Value:
    from rlx.ir.graph import Value

    what = f"{name}"
    operands = list(operands)
    slots = _SAME_DTYPE_OPERANDS.get(name, ())
    int_dtypes = [
        x.dtype for i, x in enumerate(operands) if i in slots and isinstance(x, Value) and x.dtype.kind == "i"
    ]
    if int_dtypes:
        dtype = int_dtypes[0]
        for i in slots:
            operand = operands[i]
            if is_int(operand):
                number = int(operand)
                if not np.iinfo(dtype).min <= number <= np.iinfo(dtype).max:
                    raise RlxValueError(f"{name}: {number} does not fit operand {i}'s dtype {dtype} beside the other")
                operands[i] = graph.constant(np.array(number, dtype=dtype))
    values = [as_value(graph, x, f"{what} operand {i}") for i, x in enumerate(operands)]
    return graph.add_node(op_kind(name), values, attrs if attrs is not None else NoAttrs()).outputs[0]


def _make_builder(name: str, arity: int) -> Callable[..., Value]:
    if arity == 1:

        def unary(graph: Graph, x: object) -> Value:
            return _elementwise(graph, name, [x])

        builder: Callable[..., Value] = unary
    elif arity == 2:

        def binary(graph: Graph, a: object, b: object) -> Value:
            return _elementwise(graph, name, [a, b])

        builder = binary
    else:

        def ternary(graph: Graph, cond: Value, a: object, b: object) -> Value:
            return _elementwise(graph, name, [cond, a, b])

        builder = ternary
    builder.__name__ = builder.__qualname__ = name
    builder.__doc__ = f"Elementwise ``{name}`` with NumPy broadcasting; Python numbers become constants."
    return builder


def gelu(graph: Graph, x: object, approximate: str = "none") -> Value:
    """GELU as ``torch.nn.functional.gelu``: exact (erf) or ``approximate="tanh"``."""
    if not isinstance(approximate, str):
        raise RlxTypeError(f"gelu: approximate must be a str, got {type(approximate).__name__}")
    return _elementwise(graph, "gelu", [x], GeluAttrs(approximate))


def stop_gradient(graph: Graph, x: object) -> Value:
    """``x`` itself, through which no gradient flows (``jax.lax.stop_gradient``, torch's
    ``detach``): a target held fixed, a running average, a straight-through estimator's branch."""
    return graph.add_node(op_kind("stop_gradient"), [as_value(graph, x, "stop_gradient: x")], NoAttrs()).outputs[0]


def cast(graph: Graph, x: object, dtype: object) -> Value:
    """``x`` converted to ``dtype`` (float32, int32, int64 or bool), as NumPy's ``astype``: a
    mask to float weights (``m.astype("float32")``), floats to ints toward zero (saturating, NaN
    to 0, as JAX), anything to bool as ``!= 0``. To the dtype ``x`` has: ``x`` itself."""
    value = as_value(graph, x, "cast: x")
    target = as_dtype(dtype)
    name = next((n for n in CAST_TARGETS if DTYPE_NAMES[n] == target), None)
    if name is None:
        raise RlxTypeError(f"cast: rlx values hold float32, int32, int64 or bool, got {target}")
    if value.dtype == target:
        return value
    return graph.add_node(op_kind("cast"), [value], CastAttrs(name)).outputs[0]


def _unary_ref(
    fn: Callable[[np.ndarray], np.ndarray],
) -> Callable[[Sequence[np.ndarray], object, EvalContext], np.ndarray]:
    return lambda args, attrs, ctx: fn(args[0])


def _binary_ref(
    fn: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> Callable[[Sequence[np.ndarray], object, EvalContext], np.ndarray]:
    return lambda args, attrs, ctx: fn(args[0], args[1])


# ----------------------------------------------------------------------------- scalar formulas
# ``scalar(e, *operands, attrs)``: how codegen computes one element (or one vector of lanes).
# ``e`` is the code emitter: arithmetic on lanes of f32, bool (i1) or int (i64) values.


def _libm(name: str) -> Callable[..., object]:
    """One element by the C math library's float function of the op's name."""
    return lambda e, x, attrs: e.call(name, x)


SCALAR: dict[str, Callable[..., object]] = {
    "neg": lambda e, x, attrs: e.neg(x),
    "exp": lambda e, x, attrs: e.exp(x),
    "log": lambda e, x, attrs: e.call("log", x),
    "sqrt": lambda e, x, attrs: e.sqrt(x),
    "rsqrt": lambda e, x, attrs: e.div(e.const(1.0, x), e.sqrt(x)),
    "abs": lambda e, x, attrs: e.abs(x),
    # sign(NaN) is NaN and sign(0) is 0: x * 0 gives both.
    "sign": lambda e, x, attrs: e.select(
        e.compare(">", x, e.const(0.0, x)),
        e.const(1.0, x),
        e.select(e.compare("<", x, e.const(0.0, x)), e.const(-1.0, x), e.mul(x, e.const(0.0, x))),
    ),
    "tanh": lambda e, x, attrs: e.tanh(x),
    "sigmoid": lambda e, x, attrs: e.div(e.const(1.0, x), e.add(e.const(1.0, x), e.exp(e.neg(x)))),
    "relu": lambda e, x, attrs: e.maximum(x, e.const(0.0, x)),
    "erf": lambda e, x, attrs: e.erf(x),
    "sin": lambda e, x, attrs: e.call("sin", x),
    "cos": lambda e, x, attrs: e.call("cos", x),
    **{
        name: _libm(name)
        for name in ("tan", "atan", "asin", "acos", "sinh", "cosh", "asinh", "acosh", "atanh", "log2", "log10", "exp2")
    },
    "log1p": lambda e, x, attrs: e.call("log1p", x),
    "expm1": lambda e, x, attrs: e.call("expm1", x),
    "floor": lambda e, x, attrs: e.rounded("floor", x),
    "ceil": lambda e, x, attrs: e.rounded("ceil", x),
    "trunc": lambda e, x, attrs: e.rounded("trunc", x),
    "round": lambda e, x, attrs: e.rounded("roundeven", x),
    "floor_divide": lambda e, a, b, attrs: e.floor_divide(a, b),
    "remainder": lambda e, a, b, attrs: e.remainder(a, b),
    "fmod": lambda e, a, b, attrs: e.fmod(a, b),
    "add": lambda e, a, b, attrs: e.add(a, b),
    "sub": lambda e, a, b, attrs: e.sub(a, b),
    "mul": lambda e, a, b, attrs: e.mul(a, b),
    "div": lambda e, a, b, attrs: e.div(a, b),
    "pow": lambda e, a, b, attrs: e.call("pow", a, b),
    "atan2": lambda e, a, b, attrs: e.call("atan2", a, b),
    "maximum": lambda e, a, b, attrs: e.maximum(a, b),
    "minimum": lambda e, a, b, attrs: e.minimum(a, b),
    "less": lambda e, a, b, attrs: e.compare("<", a, b),
    "less_equal": lambda e, a, b, attrs: e.compare("<=", a, b),
    "greater": lambda e, a, b, attrs: e.compare(">", a, b),
    "greater_equal": lambda e, a, b, attrs: e.compare(">=", a, b),
    "equal": lambda e, a, b, attrs: e.compare("==", a, b),
    "not_equal": lambda e, a, b, attrs: e.compare("!=", a, b),
    "logical_and": lambda e, a, b, attrs: e.logical("and", a, b),
    "logical_or": lambda e, a, b, attrs: e.logical("or", a, b),
    "logical_not": lambda e, x, attrs: e.logical("not", x),
    "bitwise_and": lambda e, a, b, attrs: e.logical("and", a, b),
    "bitwise_or": lambda e, a, b, attrs: e.logical("or", a, b),
    "bitwise_xor": lambda e, a, b, attrs: e.logical("xor", a, b),
    "bitwise_not": lambda e, x, attrs: e.logical("not", x),
    "left_shift": lambda e, a, b, attrs: e.shift("left", a, b),
    "right_shift": lambda e, a, b, attrs: e.shift("right", a, b),
    "where": lambda e, c, a, b, attrs: e.select(c, a, b),
    "cast": lambda e, x, attrs: e.convert(x, DTYPE_NAMES[attrs.dtype]),
    "stop_gradient": lambda e, x, attrs: x,
}


def _decompose_gelu(graph: Graph, node: Node) -> tuple[Value, ...]:
    x = node.inputs[0]
    if node.attrs.approximate == "tanh":
        return (0.5 * x * (1.0 + graph.tanh(SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x)))),)
    return (0.5 * x * (1.0 + graph.erf(x * (1.0 / math.sqrt(2.0)))),)


def _decompose_silu(graph: Graph, node: Node) -> tuple[Value, ...]:
    x = node.inputs[0]
    return (x * graph.sigmoid(x),)


def _decompose_softplus(graph: Graph, node: Node) -> tuple[Value, ...]:
    """``max(x, 0) + log1p(exp(-|x|))``: no overflow for large x, no lost digits for small."""
    x = node.inputs[0]
    return (graph.relu(x) + graph.log1p(graph.exp(-graph.abs(x))),)


DECOMPOSE = {"silu": _decompose_silu, "softplus": _decompose_softplus}

for _name, _fn in UNARY_REFERENCE.items():
    register_op(
        OpDef(
            _name,
            ("x",),
            NoAttrs,
            _arithmetic_unary if _name in INTEGER_ARITHMETIC else _float_unary,
            _unary_ref(_fn),
            UNARY_GRAD[_name],
            scalar=SCALAR.get(_name),
            decompose=DECOMPOSE.get(_name),
            builder=_make_builder(_name, 1),
            batch=batch_elementwise,
        )
    )
register_op(
    OpDef(
        "gelu",
        ("x",),
        GeluAttrs,
        _float_unary,
        lambda args, attrs, ctx: _gelu(args[0], attrs),
        _gelu_grad,
        decompose=_decompose_gelu,
        builder=gelu,
        batch=batch_elementwise,
    )
)
for _name, _fn2 in BINARY_REFERENCE.items():
    register_op(
        OpDef(
            _name,
            ("a", "b"),
            NoAttrs,
            _arithmetic_binary if _name in INTEGER_ARITHMETIC else _float_binary,
            _binary_ref(_fn2),
            BINARY_GRAD[_name],
            scalar=SCALAR[_name],
            builder=_make_builder(_name, 2),
            batch=batch_elementwise,
        )
    )
for _name, _fn2 in COMPARE_REFERENCE.items():
    register_op(
        OpDef(
            _name,
            ("a", "b"),
            NoAttrs,
            _compare,
            _binary_ref(_fn2),
            no_gradient,
            scalar=SCALAR[_name],
            builder=_make_builder(_name, 2),
            batch=batch_elementwise,
        )
    )
for _name, _fn2 in LOGICAL_REFERENCE.items():
    register_op(
        OpDef(
            _name,
            ("a", "b"),
            NoAttrs,
            _logical_binary,
            _binary_ref(_fn2),
            no_gradient,
            scalar=SCALAR[_name],
            builder=_make_builder(_name, 2),
            batch=batch_elementwise,
        )
    )
for _name, _fn2 in BITWISE_REFERENCE.items():
    register_op(
        OpDef(
            _name,
            ("a", "b"),
            NoAttrs,
            _bitwise_binary("i" if _name in SHIFTS else "ib"),
            _binary_ref(_fn2),
            no_gradient,
            scalar=SCALAR[_name],
            builder=_make_builder(_name, 2),
            batch=batch_elementwise,
        )
    )
register_op(
    OpDef(
        "bitwise_not",
        ("x",),
        NoAttrs,
        _bitwise_unary,
        _unary_ref(np.invert),
        no_gradient,
        scalar=SCALAR["bitwise_not"],
        builder=_make_builder("bitwise_not", 1),
        batch=batch_elementwise,
    )
)
register_op(
    OpDef(
        "logical_not",
        ("x",),
        NoAttrs,
        _logical_unary,
        _unary_ref(np.logical_not),
        no_gradient,
        scalar=SCALAR["logical_not"],
        builder=_make_builder("logical_not", 1),
        batch=batch_elementwise,
    )
)
register_op(
    OpDef(
        "where",
        ("cond", "a", "b"),
        NoAttrs,
        _where,
        lambda args, attrs, ctx: np.where(args[0], args[1], args[2]),
        _where_grad,
        scalar=SCALAR["where"],
        builder=_make_builder("where", 3),
        batch=batch_elementwise,
    )
)
register_op(
    OpDef(
        "cast",
        ("x",),
        CastAttrs,
        _cast,
        _cast_reference,
        _cast_grad,
        scalar=SCALAR["cast"],
        builder=cast,
        batch=batch_elementwise,
    )
)
register_op(
    OpDef(
        "stop_gradient",
        ("x",),
        NoAttrs,
        lambda what, inputs, attrs: (inputs[0],),  # any dtype: the value itself
        lambda args, attrs, ctx: args[0],
        no_gradient,  # the point of it: the cotangent stops here
        scalar=SCALAR["stop_gradient"],
        builder=stop_gradient,
        batch=batch_elementwise,
    )
)
