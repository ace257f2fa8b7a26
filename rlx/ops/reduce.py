"""Reductions over any set of axes: ``sum``, ``mean``, ``max``, with or without ``keepdims``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import Dim, TensorType
from rlx.ops._common import F32, as_value, keep_axes, normalize_axes, op_kind, reciprocal_count, require_float

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
    """The gradient goes to the maxima, split evenly between ties (as ``torch.amax``)."""
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


def _decompose_mean(graph: Graph, node: Node) -> tuple[Value, ...]:
    x, attrs = node.inputs[0], node.attrs
    return (graph.sum(x, axis=attrs.axes, keepdims=attrs.keepdims) * reciprocal_count(graph, x, attrs.axes),)


register_op(OpDef("sum", ("x",), ReduceAttrs, _infer, _reference(np.sum), _sum_grad, builder=_builder("sum")))
register_op(
    OpDef(
        "mean",
        ("x",),
        ReduceAttrs,
        _infer,
        _reference(np.mean),
        _mean_grad,
        builder=_builder("mean"),
        decompose=_decompose_mean,
    )
)
register_op(OpDef("max", ("x",), ReduceAttrs, _infer, _max_reference, _max_grad, builder=_builder("max")))
