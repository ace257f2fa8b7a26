"""Running sums, products, extremes and log-sum-exps along one axis: ``cumsum`` and ``cumprod``
(``numpy.cumsum`` and ``numpy.cumprod``, ``jax.lax.cumsum``/``cumprod`` with ``reverse``),
``cummax`` and ``cummin`` with the positions they came from, and ``logcumsumexp`` (torch's).

Positions from a padding mask (``mask.cumsum(-1) - 1``, as transformers computes them for
left-padded batches) and offsets of variable-length pieces are running sums of ints; the
gradient of a float one is the running sum of the cotangent taken from the other end. Running
products are survival probabilities and discounted returns (``cumprod(1 - p)``); their gradient
divides by the entries where it can and treats each row's first zero apart (see
:func:`_cumprod_grad`), as torch's does, so a zero gives exact gradients rather than NaN.
A running maximum (a drawdown, a monotone envelope) sends each cotangent to the entry it holds;
a running log-sum-exp (a log-space cumulative probability) is computed as ``log(exp(a) + exp(b))``
step by step, never overflowing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import TensorType
from rlx.ops._batching import batch_moving_axes
from rlx.ops._common import F32, INT_DTYPES, as_value, normalize_axis, op_kind, require_axis_attr
from rlx.ops.gather import scatter_add_along_axis

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value

I64 = np.dtype(np.int64)


@dataclass(frozen=True)
class ScanAttrs:
    axis: int  # non-negative (the builder normalises it)
    reverse: bool = False  # from the end: out[i] = x[i] + x[i+1] + ... (or x[i] * x[i+1] * ...)


def _infer(what: str, inputs: Sequence[TensorType], attrs: ScanAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    if x.dtype != F32 and x.dtype not in INT_DTYPES:
        raise RlxTypeError(
            f"{what}: x must be float32, int32 or int64, got {x.dtype_name} ({x}); a mask counts with "
            ".astype('int64') (or 'float32')"
        )
    require_axis_attr(what, attrs.axis, x)
    # Ints run in int64, as NumPy and torch do (a mask's running count never wraps in int32).
    return (TensorType(x.shape, F32 if x.dtype == F32 else I64),)


def _reference(scan: Callable[..., np.ndarray]) -> Callable[[Sequence[np.ndarray], ScanAttrs, EvalContext], np.ndarray]:
    def reference(args: Sequence[np.ndarray], attrs: ScanAttrs, ctx: EvalContext) -> np.ndarray:
        x = np.asarray(args[0])
        x = x.astype(np.int64) if x.dtype.kind == "i" else x
        if attrs.reverse:
            return np.flip(scan(np.flip(x, attrs.axis), axis=attrs.axis), attrs.axis)
        return scan(x, axis=attrs.axis)

    return reference


def _cumsum_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """Each input entry adds into every running sum from it on: its gradient sums those cotangents."""
    (dy,) = cotangents
    assert dy is not None
    if node.outputs[0].dtype != F32:
        return [None]
    return [cumsum(graph, dy, node.attrs.axis, reverse=not node.attrs.reverse)]


def _cumprod_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """``dx[i] = sum over j >= i of dy[j] * y[j] / x[i]`` (j and i in the scan's order), where
    ``x[i]`` is no zero; that is where an entry comes before its row's first zero. At the first
    zero ``z`` the quotient is undefined: ``dx[z] = prod(x[k], k < z) * sum over j >= z of dy[j] *
    prod(x[k], z < k <= j)``. Past it every product holds that zero and another factor: 0.
    torch's rule, in graph ops, so second derivatives come with it."""
    (dy,) = cotangents
    assert dy is not None
    if node.outputs[0].dtype != F32:
        return [None]
    (x,), y = node.inputs, node.outputs[0]
    axis, reverse = node.attrs.axis, node.attrs.reverse
    is_zero = graph.equal(x, 0.0)
    zeros_so_far = cumsum(graph, is_zero.astype("float32"), axis, reverse=reverse)
    before = graph.equal(zeros_so_far, 0.0)
    first = graph.logical_and(is_zero, graph.equal(zeros_so_far, 1.0))
    divided = cumsum(graph, dy * y, axis, reverse=not reverse) / graph.where(before, x, 1.0)
    prefix = cumprod(graph, graph.where(before, x, 1.0), axis, reverse=reverse)  # prod of x[k], k < z, at z
    after = cumprod(graph, graph.where(graph.logical_or(before, first), 1.0, x), axis, reverse=reverse)
    at_first = prefix * cumsum(graph, dy * after, axis, reverse=not reverse)
    return [graph.where(before, divided, graph.where(first, at_first, 0.0))]


def _scan_builder(name: str) -> Callable[..., Value]:
    def scan(graph: Graph, x: object, axis: int | None = None, reverse: bool = False) -> Value:
        value = as_value(graph, x, f"{name}: x")
        if not isinstance(reverse, bool):
            raise RlxTypeError(f"{name}: reverse must be a bool, got {type(reverse).__name__}")
        if axis is None:
            value = graph.reshape(value, (-1,)) if value.ndim != 1 else value
            axis = 0
        position = normalize_axis(name, axis, value.ndim)
        return graph.add_node(op_kind(name), [value], ScanAttrs(position, reverse)).outputs[0]

    scan.__name__ = scan.__qualname__ = name
    what = "sums" if name == "cumsum" else "products"
    scan.__doc__ = (
        f"Running {what} of ``x`` along ``axis``, as ``numpy.{name}`` (``axis=None``: of ``x`` flattened); "
        f"``reverse=True`` runs from the end, as ``jax.lax.{name}``. Ints run in int64 (wrapping)."
    )
    return scan


cumsum = _scan_builder("cumsum")
cumprod = _scan_builder("cumprod")

_AXIS = batch_moving_axes("axis")
register_op(
    OpDef("cumsum", ("x",), ScanAttrs, _infer, _reference(np.cumsum), _cumsum_grad, builder=cumsum, batch=_AXIS)
)
register_op(
    OpDef("cumprod", ("x",), ScanAttrs, _infer, _reference(np.cumprod), _cumprod_grad, builder=cumprod, batch=_AXIS)
)


# ----------------------------------------------------------------------------- running extremes


def _extreme_infer(what: str, inputs: Sequence[TensorType], attrs: ScanAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    if x.dtype != F32 and x.dtype not in INT_DTYPES:
        raise RlxTypeError(f"{what}: x must be float32, int32 or int64, got {x.dtype_name} ({x})")
    require_axis_attr(what, attrs.axis, x)
    if attrs.reverse:
        raise RlxValueError(f"{what}: runs from the start only (as torch.{what}); flip x for the other way")
    return (x, TensorType(x.shape, I64))


def _extreme_reference(
    largest: bool,
) -> Callable[[Sequence[np.ndarray], ScanAttrs, EvalContext], tuple[np.ndarray, ...]]:
    """torch's rule, entry by entry: an entry replaces the running extreme where it is NaN, or
    where neither is NaN and it is at least as large (small): ties and NaN go to the latest."""

    def reference(args: Sequence[np.ndarray], attrs: ScanAttrs, ctx: EvalContext) -> tuple[np.ndarray, ...]:
        x = np.moveaxis(np.asarray(args[0]), attrs.axis, 0)
        values, positions = np.empty_like(x), np.zeros(x.shape, np.int64)
        floats = x.dtype.kind == "f"
        for i in range(x.shape[0]):
            if i == 0:
                values[0], positions[0] = x[0], 0
                continue
            entry, held = x[i], values[i - 1]
            better = entry >= held if largest else entry <= held
            if floats:
                better = np.isnan(entry) | (~np.isnan(held) & better)
            values[i] = np.where(better, entry, held)
            positions[i] = np.where(better, i, positions[i - 1])
        return np.moveaxis(values, 0, attrs.axis), np.moveaxis(positions, 0, attrs.axis)

    return reference


def _extreme_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """Each running extreme is one entry of ``x``: its cotangent goes back there."""
    dvalues = cotangents[0]
    if dvalues is None or node.outputs[0].dtype != F32:
        return [None]
    axis = node.attrs.axis
    return [scatter_add_along_axis(graph, dvalues, node.outputs[1], axis, node.inputs[0].shape[axis])]


def _extreme_builder(name: str) -> Callable[..., tuple[Value, Value]]:
    def extreme(graph: Graph, x: object, axis: int) -> tuple[Value, Value]:
        value = as_value(graph, x, f"{name}: x")
        position = normalize_axis(name, axis, value.ndim)
        node = graph.add_node(op_kind(name), [value], ScanAttrs(position))
        return node.outputs[0], node.outputs[1]

    extreme.__name__ = extreme.__qualname__ = name
    kind = "maximum" if name == "cummax" else "minimum"
    extreme.__doc__ = (
        f"The running {kind} of ``x`` along ``axis`` and where each came from (int64 positions along "
        f"the axis), as ``torch.{name}``: ties and NaN give the latest position, and NaN stays."
    )
    return extreme


cummax = _extreme_builder("cummax")
cummin = _extreme_builder("cummin")


# ----------------------------------------------------------------------------- running log-sum-exp


def _logcumsumexp_infer(what: str, inputs: Sequence[TensorType], attrs: ScanAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    if x.dtype != F32:
        raise RlxTypeError(f"{what}: x must be float32, got {x.dtype_name} ({x})")
    require_axis_attr(what, attrs.axis, x)
    return (x,)


def _log_add_exp(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """torch's ``_log_add_exp_helper``: the larger plus ``log1p(exp(smaller - larger))``, or either
    where both are the same infinity (``-inf`` for an empty sum so far)."""
    high, low = np.maximum(a, b), np.minimum(a, b)
    with np.errstate(invalid="ignore", over="ignore"):
        blended = high + np.log1p(np.exp(low - high))
    same_infinity = (low == high) & np.isinf(low)
    return np.where(same_infinity, a, blended)


def _logcumsumexp_reference(args: Sequence[np.ndarray], attrs: ScanAttrs, ctx: EvalContext) -> np.ndarray:
    x = np.asarray(args[0])
    x = np.flip(x, attrs.axis) if attrs.reverse else x
    moved = np.moveaxis(x, attrs.axis, 0)
    out = np.empty_like(moved)
    for i in range(moved.shape[0]):
        out[i] = moved[0] if i == 0 else _log_add_exp(out[i - 1], moved[i])
    out = np.moveaxis(out, 0, attrs.axis)
    return np.flip(out, attrs.axis) if attrs.reverse else out


LOWEST_FLOAT = float(np.finfo(np.float32).min)


def _logcumsumexp_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """``dx[i] = sum over j >= i of dy[j] * exp(x[i] - y[j])``, in log space so that nothing
    overflows: the positive and the negative cotangents apart, each ``exp(x + running
    log-sum-exp from the other end of (log|dy| - y))`` (TensorFlow's and torch's formula)."""
    (dy,) = cotangents
    assert dy is not None
    (x,), y = node.inputs, node.outputs[0]
    axis, reverse = node.attrs.axis, node.attrs.reverse

    def part(weights: Value) -> Value:
        # Entries without weight are the lowest finite float, as torch's rule has them, not -inf:
        # the rule of this logcumsumexp (a second derivative) subtracts its running sums from
        # them, and a run of -inf gave -inf - -inf = NaN there, which wrong second-order
        # gradients came out of; from the lowest float every term is finite and its exp 0.
        logs = graph.where(graph.greater(weights, 0.0), graph.log(graph.maximum(weights, 1e-45)), LOWEST_FLOAT)
        return graph.exp(logcumsumexp(graph, logs - y, axis, reverse=not reverse) + x)

    return [part(dy) - part(-dy)]


def logcumsumexp(graph: Graph, x: object, axis: int, reverse: bool = False) -> Value:
    """``log(cumsum(exp(x)))`` along ``axis`` without overflow, as ``torch.logcumsumexp``
    (``reverse=True``: from the end)."""
    value = as_value(graph, x, "logcumsumexp: x")
    if not isinstance(reverse, bool):
        raise RlxTypeError(f"logcumsumexp: reverse must be a bool, got {type(reverse).__name__}")
    position = normalize_axis("logcumsumexp", axis, value.ndim)
    return graph.add_node(op_kind("logcumsumexp"), [value], ScanAttrs(position, reverse)).outputs[0]


for _name, _largest in (("cummax", True), ("cummin", False)):
    register_op(
        OpDef(
            _name,
            ("x",),
            ScanAttrs,
            _extreme_infer,
            _extreme_reference(_largest),
            _extreme_grad,
            builder=cummax if _largest else cummin,
            batch=_AXIS,
        )
    )
register_op(
    OpDef(
        "logcumsumexp",
        ("x",),
        ScanAttrs,
        _logcumsumexp_infer,
        _logcumsumexp_reference,
        _logcumsumexp_grad,
        builder=logcumsumexp,
        batch=_AXIS,
    )
)
