"""Sorting along one axis: ``sort``, ``argsort`` and ``topk`` (``numpy.sort``/``argsort``,
``torch.sort``/``topk``, ``jax.lax.top_k``), all from one op.

The ``sort`` op sorts its operand's last axis (the builders move another axis there and back)
and has two results: the sorted values and, in int64, where each came from. The order is
total and stable: NaN sorts above every number (last ascending, first descending, as torch and
NumPy), and equal keys keep their order, so the indices are those of a stable sort (NumPy's
``kind="stable"``, torch's ``stable=True``) whatever the thread count. The values' gradient
goes back to where each value came from (:func:`rlx.ops.gather.scatter_add_along_axis`);
``topk`` is the first ``k`` of a sort, as JAX's ``top_k`` is on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import TensorType
from rlx.ops._batching import batch_trailing
from rlx.ops._common import F32, INT_DTYPES, as_value, is_int, normalize_axis, op_kind
from rlx.ops.gather import scatter_add_along_axis

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value

I64 = np.dtype(np.int64)


@dataclass(frozen=True)
class SortAttrs:
    descending: bool = False


def _infer(what: str, inputs: Sequence[TensorType], attrs: SortAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    if x.dtype != F32 and x.dtype not in INT_DTYPES:
        raise RlxTypeError(f"{what}: x must be float32, int32 or int64, got {x.dtype_name} ({x})")
    if x.rank < 1:
        raise RlxValueError(f"{what}: x must have at least one axis, got {x}")
    if not isinstance(attrs.descending, bool):
        raise RlxTypeError(f"{what}: descending must be a bool, got {type(attrs.descending).__name__}")
    return (x, TensorType(x.shape, I64))


def _sort_order(x: np.ndarray, descending: bool) -> np.ndarray:
    """The stable order of ``x``'s last axis, NaN above every number (the op's definition)."""
    positions = np.broadcast_to(np.arange(x.shape[-1]), x.shape)
    keys: tuple[np.ndarray, ...]
    if x.dtype.kind == "f":
        nan = np.isnan(x)
        filled = np.where(nan, 0.0, x)
        keys = (positions, -filled, ~nan) if descending else (positions, filled, nan)
    else:
        keys = (positions, ~x) if descending else (positions, x)  # ~x reverses two's complement order
    return np.lexsort(keys, axis=-1)


def _reference(args: Sequence[np.ndarray], attrs: SortAttrs, ctx: EvalContext) -> tuple[np.ndarray, ...]:
    x = np.asarray(args[0])
    order = _sort_order(x, attrs.descending)
    return np.take_along_axis(x, order, -1), order.astype(np.int64)


def _grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """Each sorted value came from one entry: its cotangent goes back there."""
    dvalues = cts[0]
    if dvalues is None or node.outputs[0].dtype != F32:
        return [None]
    return [scatter_add_along_axis(graph, dvalues, node.outputs[1], -1, node.inputs[0].shape[-1])]


def _sorted_last(graph: Graph, x: object, axis: int, descending: bool, what: str) -> tuple[Node, int]:
    """The ``sort`` node of ``x`` with ``axis`` moved last, and that axis (non-negative)."""
    value = as_value(graph, x, f"{what}: x")
    if not isinstance(descending, bool):
        raise RlxTypeError(f"{what}: descending must be a bool, got {type(descending).__name__}")
    if value.ndim == 0:
        raise RlxValueError(f"{what}: x must have at least one axis, got a scalar")
    position = normalize_axis(what, axis, value.ndim)
    last = value.ndim - 1
    if position != last:
        order = tuple(a for a in range(value.ndim) if a != position) + (position,)
        value = graph.transpose(value, order)
    return graph.add_node(op_kind("sort"), [value], SortAttrs(descending)), position


def _moved_back(graph: Graph, value: Value, axis: int) -> Value:
    """``value`` with its last axis put back at ``axis``."""
    last = value.ndim - 1
    if axis == last:
        return value
    order = list(range(last))
    order.insert(axis, last)
    return graph.transpose(value, tuple(order))


def sort(graph: Graph, x: object, axis: int = -1, descending: bool = False) -> Value:
    """``x`` sorted along ``axis`` (``numpy.sort``; ``descending=True`` from the largest), NaN
    above every number. Float values have gradients: each goes back to where it came from."""
    node, position = _sorted_last(graph, x, axis, descending, "sort")
    return _moved_back(graph, node.outputs[0], position)


def argsort(graph: Graph, x: object, axis: int = -1, descending: bool = False) -> Value:
    """The int64 positions that sort ``x`` along ``axis`` (``numpy.argsort(kind="stable")``,
    ``torch.argsort(stable=True)``): equal entries keep their order, NaN sorts above every number."""
    node, position = _sorted_last(graph, x, axis, descending, "argsort")
    return _moved_back(graph, node.outputs[1], position)


def sort_with_indices(graph: Graph, x: object, axis: int = -1, descending: bool = False) -> tuple[Value, Value]:
    """``torch.sort``: the sorted values and the int64 positions they came from (stable)."""
    node, position = _sorted_last(graph, x, axis, descending, "sort")
    return _moved_back(graph, node.outputs[0], position), _moved_back(graph, node.outputs[1], position)


def topk(graph: Graph, x: object, k: int, axis: int = -1, largest: bool = True) -> tuple[Value, Value]:
    """The ``k`` largest entries along ``axis`` (``largest=False``: the smallest) in order and
    their int64 positions, as ``torch.topk`` and ``jax.lax.top_k``; of equal entries the first
    comes first, and NaN counts as the largest."""
    if not is_int(k):
        raise RlxTypeError(f"topk: k must be an int, got {type(k).__name__}")
    node, position = _sorted_last(graph, x, axis, largest, "topk")
    length = node.inputs[0].shape[-1]
    if int(k) < 0 or (isinstance(length, int) and int(k) > length):
        raise RlxValueError(f"topk: k = {k} must be in [0, {length}] for an axis of {length}")
    picked = tuple(slice(None) for _ in range(node.inputs[0].ndim - 1)) + (slice(0, int(k)),)
    values, indices = node.outputs[0][picked], node.outputs[1][picked]
    return _moved_back(graph, values, position), _moved_back(graph, indices, position)


register_op(OpDef("sort", ("x",), SortAttrs, _infer, _reference, _grad, builder=sort, batch=batch_trailing))
