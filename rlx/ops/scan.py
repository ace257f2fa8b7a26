"""``cumsum``: running sums along one axis (``numpy.cumsum``, ``jax.lax.cumsum`` with ``reverse``).

Positions from a padding mask (``mask.cumsum(-1) - 1``, as transformers computes them for
left-padded batches) and offsets of variable-length pieces are running sums of ints; the
gradient of a float one is the running sum of the cotangent taken from the other end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import TensorType
from rlx.ops._common import F32, INT_DTYPES, as_value, normalize_axis, op_kind

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value

I64 = np.dtype(np.int64)


@dataclass(frozen=True)
class ScanAttrs:
    axis: int  # non-negative (the builder normalises it)
    reverse: bool = False  # sum from the end: out[i] = x[i] + x[i+1] + ...


def _infer(what: str, inputs: Sequence[TensorType], attrs: ScanAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    if x.dtype != F32 and x.dtype not in INT_DTYPES:
        raise RlxTypeError(
            f"{what}: x must be float32, int32 or int64, got {x.dtype_name} ({x}); a mask counts with "
            ".astype('int64') (or 'float32')"
        )
    if isinstance(attrs.axis, bool) or not isinstance(attrs.axis, int) or not 0 <= attrs.axis < x.rank:
        raise RlxValueError(f"{what}: axis {attrs.axis!r} must be in [0, {x.rank}) for {x}")
    # Ints sum in int64, as NumPy and torch do (a mask's running count never wraps in int32).
    return (TensorType(x.shape, F32 if x.dtype == F32 else I64),)


def _reference(args: Sequence[np.ndarray], attrs: ScanAttrs, ctx: EvalContext) -> np.ndarray:
    x = np.asarray(args[0])
    x = x.astype(np.int64) if x.dtype.kind == "i" else x
    if attrs.reverse:
        return np.flip(np.cumsum(np.flip(x, attrs.axis), axis=attrs.axis), attrs.axis)
    return np.cumsum(x, axis=attrs.axis)


def _grad(graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """Each input entry adds into every running sum from it on: its gradient sums those cotangents."""
    (dy,) = cotangents
    assert dy is not None
    if node.outputs[0].dtype != F32:
        return [None]
    return [cumsum(graph, dy, node.attrs.axis, reverse=not node.attrs.reverse)]


def cumsum(graph: Graph, x: object, axis: int | None = None, reverse: bool = False) -> Value:
    """Running sums of ``x`` along ``axis``, as ``numpy.cumsum`` (``axis=None``: of ``x``
    flattened); ``reverse=True`` sums from the end, as ``jax.lax.cumsum``. Ints sum in int64."""
    value = as_value(graph, x, "cumsum: x")
    if not isinstance(reverse, bool):
        raise RlxTypeError(f"cumsum: reverse must be a bool, got {type(reverse).__name__}")
    if axis is None:
        value = graph.reshape(value, (-1,)) if value.ndim != 1 else value
        axis = 0
    position = normalize_axis("cumsum", axis, value.ndim)
    return graph.add_node(op_kind("cumsum"), [value], ScanAttrs(position, reverse)).outputs[0]


register_op(OpDef("cumsum", ("x",), ScanAttrs, _infer, _reference, _grad, builder=cumsum))
