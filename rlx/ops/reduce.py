"""Reductions over any set of axes: ``sum``, ``mean``, ``max``, ``min``, with or without
``keepdims``; and ``argmax``/``argmin`` along one axis, which pick positions (int64)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, no_gradient, register_op
from rlx.ir.types import Dim, TensorType
from rlx.ops._batching import batch_moving_axes
from rlx.ops._common import (
    F32,
    as_value,
    keep_axes,
    normalize_axes,
    normalize_axis,
    op_kind,
    reciprocal_count,
    require_float,
)

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class ReduceAttrs:
    """Reduced axes, sorted and non-negative (the builder normalises ``None`` and negative axes)."""

    axes: tuple[int, ...]
    keepdims: bool = False


def reduced_shape(shape: tuple[Dim, ...], axes: tuple[int, ...], keepdims: bool) -> tuple[Dim, ...]:
    if keepdims:
        return tuple(1 if i in axes else size for i, size in enumerate(shape))
    return tuple(size for i, size in enumerate(shape) if i not in axes)


def _infer(what: str, inputs: Sequence[TensorType], attrs: ReduceAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    require_float(what, "x", x)
    if not isinstance(attrs.axes, tuple) or any(not isinstance(a, int) or isinstance(a, bool) for a in attrs.axes):
        raise RlxTypeError(f"{what}: axes must be a tuple of ints, got {attrs.axes!r}")
    if list(attrs.axes) != sorted(set(attrs.axes)) or any(not 0 <= a < x.rank for a in attrs.axes):
        raise RlxValueError(f"{what}: axes {attrs.axes} must be distinct, sorted and in [0, {x.rank}) for {x}")
    return (TensorType(reduced_shape(x.shape, attrs.axes, attrs.keepdims), F32),)


def _broadcast_back(graph: Graph, node: Node, dy: Value) -> Value:
    """``dy`` reshaped to keepdims form and broadcast to the operand's shape."""
    x = node.inputs[0]
    axes = node.attrs.axes
    kept = keep_axes(graph, dy, x.shape, axes) if not node.attrs.keepdims else dy
    return graph.broadcast_to(kept, x.shape) if kept.shape != x.shape else kept


def _sum_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    assert cts[0] is not None
    return [_broadcast_back(graph, node, cts[0])]


def _mean_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    assert cts[0] is not None
    return [_broadcast_back(graph, node, cts[0] * reciprocal_count(graph, node.inputs[0], node.attrs.axes))]


def _max_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """The gradient goes to the maxima (minima for ``min``), split evenly between ties (as
    ``torch.amax`` and ``torch.amin``)."""
    assert cts[0] is not None
    x, attrs = node.inputs[0], node.attrs
    peak = _broadcast_back(graph, node, node.outputs[0])
    hit = graph.equal(x, peak)
    ties = graph.sum(graph.where(hit, 1.0, 0.0), axis=attrs.axes, keepdims=True)
    share = keep_axes(graph, cts[0], x.shape, attrs.axes) if not attrs.keepdims else cts[0]
    return [graph.where(hit, graph.broadcast_to(share / ties, x.shape), 0.0)]


def _builder(name: str):  # type: ignore[no-untyped-def]
    def reduce(graph: Graph, x: object, axis: object = None, keepdims: bool = False) -> Value:
        value = as_value(graph, x, f"{name}: x")
        if not isinstance(keepdims, (bool, np.bool_)):
            raise RlxTypeError(f"{name}: keepdims must be a bool, got {type(keepdims).__name__}")
        axes = normalize_axes(name, axis, len(value.shape))
        return graph.add_node(op_kind(name), [value], ReduceAttrs(axes, bool(keepdims))).outputs[0]

    reduce.__name__ = reduce.__qualname__ = name
    reduce.__doc__ = f"``{name}`` over ``axis`` (None: all axes; an int or a tuple), as NumPy's ``keepdims``."
    return reduce


def _reference(fn):  # type: ignore[no-untyped-def]
    return lambda args, attrs, ctx: fn(args[0], axis=attrs.axes, keepdims=attrs.keepdims)


def _max_reference(args: Sequence[np.ndarray], attrs: ReduceAttrs, ctx: EvalContext) -> np.ndarray:
    return np.max(args[0], axis=attrs.axes, keepdims=attrs.keepdims, initial=-np.inf)  # empty: -inf, as JAX


def _min_reference(args: Sequence[np.ndarray], attrs: ReduceAttrs, ctx: EvalContext) -> np.ndarray:
    return np.min(args[0], axis=attrs.axes, keepdims=attrs.keepdims, initial=np.inf)


def _decompose_min(graph: Graph, node: Node) -> tuple[Value, ...]:
    """``-max(-x)``: the code generator's max reduction (NaN kept) serves both."""
    x, attrs = node.inputs[0], node.attrs
    return (-graph.max(-x, axis=attrs.axes, keepdims=attrs.keepdims),)


def _decompose_mean(graph: Graph, node: Node) -> tuple[Value, ...]:
    x, attrs = node.inputs[0], node.attrs
    return (graph.sum(x, axis=attrs.axes, keepdims=attrs.keepdims) * reciprocal_count(graph, x, attrs.axes),)


_AXES = batch_moving_axes("axes")
register_op(
    OpDef("sum", ("x",), ReduceAttrs, _infer, _reference(np.sum), _sum_grad, builder=_builder("sum"), batch=_AXES)
)
register_op(
    OpDef(
        "mean",
        ("x",),
        ReduceAttrs,
        _infer,
        _reference(np.mean),
        _mean_grad,
        builder=_builder("mean"),
        batch=_AXES,
        decompose=_decompose_mean,
    )
)
register_op(OpDef("max", ("x",), ReduceAttrs, _infer, _max_reference, _max_grad, builder=_builder("max"), batch=_AXES))
register_op(
    OpDef(
        "min",
        ("x",),
        ReduceAttrs,
        _infer,
        _min_reference,
        _max_grad,
        builder=_builder("min"),
        batch=_AXES,
        decompose=_decompose_min,
    )
)


# ----------------------------------------------------------------------------- argmax, argmin


@dataclass(frozen=True)
class ArgAttrs:
    """The one axis searched (non-negative) and whether it stays as a 1."""

    axis: int
    keepdims: bool = False


def _arg_infer(what: str, inputs: Sequence[TensorType], attrs: ArgAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    require_float(what, "x", x)
    if not isinstance(attrs.axis, int) or isinstance(attrs.axis, bool) or not 0 <= attrs.axis < x.rank:
        raise RlxValueError(f"{what}: axis {attrs.axis!r} must be an int in [0, {x.rank}) for {x}")
    return (TensorType(reduced_shape(x.shape, (attrs.axis,), attrs.keepdims), np.dtype(np.int64)),)


def _arg_reference(name: str):  # type: ignore[no-untyped-def]
    fn = np.argmax if name == "argmax" else np.argmin
    return lambda args, attrs, ctx: fn(args[0], axis=attrs.axis, keepdims=attrs.keepdims).astype(np.int64)


def _decompose_arg(name: str):  # type: ignore[no-untyped-def]
    """The first position holding the extremum, as NumPy's: ``min(where(x == peak, iota, n))``
    over the axis, with ``x != x`` beside the equality so that a NaN (which the max keeps) is
    the peak found first. Built from ops that fuse into one loop nest per reduction. Along a
    symbolic axis the positions are a running sum of ones (exact in float32 up to 2**24)."""

    def decompose(graph: Graph, node: Node) -> tuple[Value, ...]:
        x, attrs = node.inputs[0], node.attrs
        axis, length = attrs.axis, x.shape[attrs.axis]
        peak = graph.max(x if name == "argmax" else -x, axis=axis, keepdims=True)
        peak = peak if name == "argmax" else -peak
        hit = graph.logical_or(graph.equal(x, peak), graph.not_equal(x, x))
        column = (length,) + (1,) * (x.ndim - axis - 1)
        if isinstance(length, int):
            positions = graph.constant(np.arange(length, dtype=np.float32).reshape(column))
        else:
            positions = graph.cumsum(graph.broadcast_to(graph.constant(np.float32(1.0)), column), axis=0) - 1.0
        # Some entry is always hit (the peak, or a NaN): the fill is never the minimum.
        first = graph.min(graph.where(hit, positions, float("inf")), axis=axis)
        found = graph.cast(first, "int64")
        return (graph.reshape(found, node.outputs[0].shape) if attrs.keepdims else found,)

    return decompose


def _arg_builder(name: str):  # type: ignore[no-untyped-def]
    def arg(graph: Graph, x: object, axis: object = None, keepdims: bool = False) -> Value:
        value = as_value(graph, x, f"{name}: x")
        if not isinstance(keepdims, (bool, np.bool_)):
            raise RlxTypeError(f"{name}: keepdims must be a bool, got {type(keepdims).__name__}")
        if axis is not None:
            position = normalize_axis(name, axis, value.ndim)
            return graph.add_node(op_kind(name), [value], ArgAttrs(position, bool(keepdims))).outputs[0]
        flat = graph.reshape(value, (-1,)) if value.ndim != 1 else value
        found = graph.add_node(op_kind(name), [flat], ArgAttrs(0)).outputs[0]
        return graph.reshape(found, (1,) * value.ndim) if keepdims else found

    arg.__name__ = arg.__qualname__ = name
    arg.__doc__ = (
        f"``numpy.{name}``: the first position of the {'largest' if name == 'argmax' else 'smallest'} "
        "element along ``axis`` (None: of the flattened value), int64; a NaN counts as the extremum."
    )
    return arg


for _name in ("argmax", "argmin"):
    register_op(
        OpDef(
            _name,
            ("x",),
            ArgAttrs,
            _arg_infer,
            _arg_reference(_name),
            no_gradient,
            builder=_arg_builder(_name),
            decompose=_decompose_arg(_name),
            batch=batch_moving_axes("axis"),
        )
    )
