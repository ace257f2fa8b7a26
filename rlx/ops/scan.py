"""Running sums and products along one axis: ``cumsum`` and ``cumprod`` (``numpy.cumsum`` and
``numpy.cumprod``, ``jax.lax.cumsum``/``cumprod`` with ``reverse``).

Positions from a padding mask (``mask.cumsum(-1) - 1``, as transformers computes them for
left-padded batches) and offsets of variable-length pieces are running sums of ints; the
gradient of a float one is the running sum of the cotangent taken from the other end. Running
products are survival probabilities and discounted returns (``cumprod(1 - p)``); their gradient
divides by the entries where it can and treats each row's first zero apart (see
:func:`_cumprod_grad`), as torch's does, so a zero gives exact gradients rather than NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import TensorType
from rlx.ops._common import F32, INT_DTYPES, as_value, normalize_axis, op_kind, require_axis_attr

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

register_op(OpDef("cumsum", ("x",), ScanAttrs, _infer, _reference(np.cumsum), _cumsum_grad, builder=cumsum))
register_op(OpDef("cumprod", ("x",), ScanAttrs, _infer, _reference(np.cumprod), _cumprod_grad, builder=cumprod))
