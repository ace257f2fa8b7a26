"""Gathers and scatter-adds of single entries along one axis: ``take_along_axis`` and
``scatter_add_along_axis`` (``numpy.take_along_axis``/``numpy.add.at``, ``torch.gather``/
``torch.scatter_add``).

``take_along_axis(x, ids, axis)`` reads ``x`` with the index along ``axis`` replaced by ``ids``
at every position: a sort's values from its indices, the log-probability of each target, a
beam's scores by its back-pointers. It is read inline by the loop nest of whatever consumes
it, as ``embedding``'s rows are. Its gradient puts each cotangent back where it was read from,
adding where ids repeat: ``scatter_add_along_axis``, a kernel of its own that walks each run of
the axis in order, so sums of repeated ids do not depend on the thread count.

Ids must lie in ``[0, x.shape[axis])``, as ``torch.gather``'s (NumPy would wrap a negative
one): ids from graph inputs are checked before the call, ids the graph computes by the kernels
that read them, and a bad one is an error of the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.dims import parse_dim
from rlx.ir.opdef import EvalContext, IndexOperand, OpDef, register_op
from rlx.ir.types import Dim, TensorType
from rlx.ops._batching import batch_moving_axes
from rlx.ops._common import (
    BOOL,
    F32,
    INT_DTYPES,
    as_value,
    broadcast_shapes,
    normalize_axis,
    op_kind,
    require_axis_attr,
    require_float,
    require_int,
    sum_to_shape,
)
from rlx.ops.index import check_indices

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class AxisAttrs:
    axis: int  # non-negative (the builder normalises it)


@dataclass(frozen=True)
class ScatterAttrs:
    axis: int  # non-negative
    size: Dim  # the result's length along axis: an int or a symbolic dimension


def _others(what: str, x: TensorType, ids: TensorType, axis: int) -> tuple[Dim, ...]:
    """The result's shape: ``ids``'s length along ``axis``, the other axes broadcast."""
    if ids.rank != x.rank:
        raise RlxValueError(f"{what}: ids must have x's rank {x.rank} (one index per entry), got {ids}")
    without = [tuple(shape[:axis]) + (1,) + tuple(shape[axis + 1 :]) for shape in (x.shape, ids.shape)]
    shape = list(broadcast_shapes(what, *without))
    shape[axis] = ids.shape[axis]
    return tuple(shape)


# ----------------------------------------------------------------------------- take_along_axis


def _take_infer(what: str, inputs: Sequence[TensorType], attrs: AxisAttrs) -> tuple[TensorType, ...]:
    x, ids = inputs
    if x.dtype not in (F32, BOOL, *INT_DTYPES):
        require_float(what, "x", x)
    require_int(what, "ids", ids)
    require_axis_attr(what, attrs.axis, x)
    return (TensorType(_others(what, x, ids, attrs.axis), x.dtype),)


def _take_reference(args: Sequence[np.ndarray], attrs: AxisAttrs, ctx: EvalContext) -> np.ndarray:
    x, ids = args
    check_indices("take_along_axis", ids, x.shape[attrs.axis], "index")
    shape = np.broadcast_shapes(*(s[: attrs.axis] + (1,) + s[attrs.axis + 1 :] for s in (x.shape, ids.shape)))
    x = np.broadcast_to(x, shape[: attrs.axis] + (x.shape[attrs.axis],) + shape[attrs.axis + 1 :])
    ids = np.broadcast_to(ids, shape[: attrs.axis] + (ids.shape[attrs.axis],) + shape[attrs.axis + 1 :])
    return np.take_along_axis(x, ids.astype(np.int64), attrs.axis)


def _take_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    dy = cts[0]
    assert dy is not None
    x, ids = node.inputs
    if x.dtype != F32:
        return [None, None]
    axis = node.attrs.axis
    full_ids = graph.broadcast_to(ids, dy.shape) if tuple(ids.shape) != tuple(dy.shape) else ids
    placed = scatter_add_along_axis(graph, dy, full_ids, axis, x.shape[axis])
    return [sum_to_shape(graph, placed, x.shape), None]


def take_along_axis(graph: Graph, x: object, ids: object, axis: int) -> Value:
    """``numpy.take_along_axis(x, ids, axis)`` (``torch.gather(x, axis, ids)`` where the shapes
    agree): ``out[i, j, k] = x[i, ids[i, j, k], k]`` for ``axis`` 1. ``ids`` has ``x``'s rank;
    the other axes broadcast. Ids must lie in ``[0, x.shape[axis])``."""
    value = as_value(graph, x, "take_along_axis: x")
    index = as_value(graph, ids, "take_along_axis: ids")
    position = normalize_axis("take_along_axis", axis, value.ndim)
    return graph.add_node(op_kind("take_along_axis"), [value, index], AxisAttrs(position)).outputs[0]


# ----------------------------------------------------------------------------- scatter_add_along_axis


def _scatter_infer(what: str, inputs: Sequence[TensorType], attrs: ScatterAttrs) -> tuple[TensorType, ...]:
    updates, ids = inputs
    require_float(what, "updates", updates)
    require_int(what, "ids", ids)
    if tuple(ids.shape) != tuple(updates.shape):
        raise RlxValueError(f"{what}: ids must have the updates' shape {updates}, got {ids}")
    require_axis_attr(what, attrs.axis, updates)
    size = attrs.size
    if isinstance(size, str) and parse_dim(size) != size:
        raise RlxValueError(f"{what}: size must be an int or a symbolic dimension, got {size!r}")
    if isinstance(size, int) and (isinstance(size, bool) or size < 1):
        raise RlxValueError(f"{what}: size must be >= 1, got {size!r}")
    shape = list(updates.shape)
    shape[attrs.axis] = size
    return (TensorType(tuple(shape), F32),)


def _scatter_reference(args: Sequence[np.ndarray], attrs: ScatterAttrs, ctx: EvalContext) -> np.ndarray:
    updates, ids = args
    (size,) = ctx.resolve((attrs.size,))
    check_indices("scatter_add_along_axis", ids, size, "index")
    shape = list(updates.shape)
    shape[attrs.axis] = size
    out = np.zeros(shape)
    where: list[np.ndarray] = list(np.indices(updates.shape, sparse=True))
    where[attrs.axis] = ids.astype(np.int64)
    np.add.at(out, tuple(where), updates)
    return out


def _scatter_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """Each update landed at its id: its cotangent is read back from there."""
    assert cts[0] is not None
    return [take_along_axis(graph, cts[0], node.inputs[1], node.attrs.axis), None]


def scatter_add_along_axis(graph: Graph, updates: object, ids: object, axis: int, size: Dim) -> Value:
    """Zeros of ``updates``'s shape with ``size`` entries along ``axis``, each update added at its
    id along that axis (``out[i, ids[i, j, k], k] += updates[i, j, k]`` for ``axis`` 1; repeated
    ids add up): ``torch.zeros(...).scatter_add(axis, ids, updates)``, the gradient of
    :func:`take_along_axis`. ``ids`` has the updates' shape; ``size`` is an int or a symbolic
    dimension."""
    operands = [
        as_value(graph, updates, "scatter_add_along_axis: updates"),
        as_value(graph, ids, "scatter_add_along_axis: ids"),
    ]
    if isinstance(size, bool) or not isinstance(size, (int, np.integer, str)):
        raise RlxTypeError(f"scatter_add_along_axis: size must be an int or a symbolic dimension, got {size!r}")
    position = normalize_axis("scatter_add_along_axis", axis, operands[0].ndim)
    attrs = ScatterAttrs(position, size if isinstance(size, str) else int(size))
    return graph.add_node(op_kind("scatter_add_along_axis"), operands, attrs).outputs[0]


register_op(
    OpDef(
        "take_along_axis",
        ("x", "ids"),
        AxisAttrs,
        _take_infer,
        _take_reference,
        _take_grad,
        builder=take_along_axis,
        batch=batch_moving_axes("axis"),
        no_grad=frozenset({"ids"}),
        index_operands=(
            IndexOperand("ids", lambda node: node.inputs[0].shape[node.attrs.axis], "index", checked_in_kernel=True),
        ),
    )
)
register_op(
    OpDef(
        "scatter_add_along_axis",
        ("updates", "ids"),
        ScatterAttrs,
        _scatter_infer,
        _scatter_reference,
        _scatter_grad,
        builder=scatter_add_along_axis,
        batch=batch_moving_axes("axis"),
        no_grad=frozenset({"ids"}),
        index_operands=(IndexOperand("ids", lambda node: node.attrs.size, "index", checked_in_kernel=True),),
    )
)
