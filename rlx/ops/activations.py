"""The activations of ``jax.nn`` and ``torch.nn.functional`` that are not ops of their own.

Each is a line of the registered ops (``relu``, ``clip``, ``where``, ``softplus``, ...), so its
reference, gradient and lowering are theirs and a fused loop computes it inline. Their formulas
and their gradients at the kinks are torch's: the hard functions pass gradient only strictly
inside their bounds (a bound itself is a constant piece, so ``relu6`` has gradient 0 at 0 and at
6, unlike ``clip``, whose bounds pass it, as ``torch.clamp``'s do), ``leaky_relu`` and ``elu``
take their negative side's slope at 0. The TorchDynamo translation maps torch's functions of
these names onto them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ops._common import as_value, is_number, normalize_axis, require_float

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value

SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _float(graph: Graph, x: object, what: str) -> Value:
    value = as_value(graph, x, f"{what}: x")
    require_float(what, "x", value.type)
    return value


def _number(what: str, name: str, value: object) -> float:
    if not is_number(value):
        raise RlxTypeError(f"{what}: {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(float(value)):  # type: ignore[arg-type]
        raise RlxValueError(f"{what}: {name} must be finite, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def leaky_relu(graph: Graph, x: object, negative_slope: float = 0.01) -> Value:
    """``x`` where ``x > 0``, else ``negative_slope * x``."""
    value = _float(graph, x, "leaky_relu")
    slope = _number("leaky_relu", "negative_slope", negative_slope)
    return graph.where(graph.greater(value, 0.0), value, value * slope)


def elu(graph: Graph, x: object, alpha: float = 1.0) -> Value:
    """``x`` where ``x > 0``, else ``alpha * (exp(x) - 1)``."""
    value = _float(graph, x, "elu")
    return graph.where(graph.greater(value, 0.0), value, graph.expm1(value) * _number("elu", "alpha", alpha))


def celu(graph: Graph, x: object, alpha: float = 1.0) -> Value:
    """``max(x, 0) + min(0, alpha * (exp(x / alpha) - 1))``; ``alpha`` must not be 0."""
    value = _float(graph, x, "celu")
    scale = _number("celu", "alpha", alpha)
    if scale == 0:
        raise RlxValueError("celu: alpha must not be 0")
    return graph.where(graph.greater(value, 0.0), value, graph.expm1(value * (1.0 / scale)) * scale)


def selu(graph: Graph, x: object) -> Value:
    """``scale * elu(x, alpha)`` with the self-normalising constants."""
    value = _float(graph, x, "selu")
    return graph.where(graph.greater(value, 0.0), value, graph.expm1(value) * SELU_ALPHA) * SELU_SCALE


def _held(graph: Graph, value: Value, low: float, high: float, inside: Value) -> Value:
    """``inside`` where ``low < value < high``, else the bound passed (a constant: no gradient);
    NaN stays NaN."""
    return graph.where(graph.less_equal(value, low), low, graph.where(graph.greater_equal(value, high), high, inside))


def relu6(graph: Graph, x: object) -> Value:
    """``min(max(x, 0), 6)``: ``hard_tanh(x, 0, 6)``, as torch's."""
    value = _float(graph, x, "relu6")
    return _held(graph, value, 0.0, 6.0, value)


def hard_tanh(graph: Graph, x: object, min_val: float = -1.0, max_val: float = 1.0) -> Value:
    """``x`` held within ``[min_val, max_val]``."""
    low, high = _number("hard_tanh", "min_val", min_val), _number("hard_tanh", "max_val", max_val)
    if low > high:
        raise RlxValueError(f"hard_tanh: min_val {low} is above max_val {high}")
    value = _float(graph, x, "hard_tanh")
    return _held(graph, value, low, high, value)


def hard_sigmoid(graph: Graph, x: object) -> Value:
    """``relu6(x + 3) / 6``: 0 up to -3, 1 from 3."""
    value = _float(graph, x, "hard_sigmoid")
    return graph.where(
        graph.less_equal(value, -3.0), 0.0, graph.where(graph.greater_equal(value, 3.0), 1.0, value * (1.0 / 6.0) + 0.5)
    )


def hard_swish(graph: Graph, x: object) -> Value:
    """``x * hard_sigmoid(x)`` (``jax.nn.hard_swish``, torch's ``hardswish``)."""
    value = _float(graph, x, "hard_swish")
    return value * hard_sigmoid(graph, value)


def mish(graph: Graph, x: object) -> Value:
    """``x * tanh(softplus(x))``."""
    value = _float(graph, x, "mish")
    return value * graph.tanh(graph.softplus(value))


def log_sigmoid(graph: Graph, x: object) -> Value:
    """``log(sigmoid(x)) = -softplus(-x)``, without overflow for large ``|x|``."""
    return -graph.softplus(-_float(graph, x, "log_sigmoid"))


def softsign(graph: Graph, x: object) -> Value:
    """``x / (1 + |x|)``."""
    value = _float(graph, x, "softsign")
    return value / (graph.abs(value) + 1.0)


def glu(graph: Graph, x: object, axis: int = -1) -> Value:
    """The gated linear unit: ``x`` halved along ``axis`` into ``a, b``, then ``a * sigmoid(b)``."""
    value = _float(graph, x, "glu")
    position = normalize_axis("glu", axis, value.ndim)
    length = value.shape[position]
    if isinstance(length, int) and length % 2:
        raise RlxValueError(f"glu: axis {axis} of {value.type} has odd size {length}; it is halved")
    first, second = graph.split(value, 2, axis=position)
    return first * graph.sigmoid(second)


ACTIVATIONS = (
    leaky_relu,
    elu,
    celu,
    selu,
    relu6,
    hard_tanh,
    hard_sigmoid,
    hard_swish,
    mish,
    log_sigmoid,
    softsign,
    glu,
)
"""Attached to :class:`rlx.Graph` as methods of their names (``g.leaky_relu(x, 0.2)``)."""
