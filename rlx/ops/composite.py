"""NumPy conveniences built from the registered ops, with no op of their own.

``stack``, ``expand_dims``, ``squeeze``, ``take``, ``clip``, ``var`` and ``std`` are what a NumPy or JAX
user reaches for; each is a few calls of the ops above (as ``jax.numpy`` functions are of
``lax`` primitives), so their shape rules, references, gradients and lowerings are those ops'
and the printed graph shows the ops they became.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.dims import product
from rlx.ops._common import as_value, is_int, normalize_axes, normalize_axis

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value


def expand_dims(graph: Graph, x: object, axis: int | Sequence[int]) -> Value:
    """``numpy.expand_dims``: new axes of size 1 at ``axis`` (positions in the result)."""
    value = as_value(graph, x, "expand_dims: x")
    axes = [axis] if is_int(axis) else list(axis) if isinstance(axis, Sequence) else None
    if axes is None:
        raise RlxTypeError(f"expand_dims: axis must be an int or a tuple of ints, got {type(axis).__name__}")
    rank = value.ndim + len(axes)
    positions = normalize_axes("expand_dims", tuple(axes), rank)
    dims = iter(value.shape)
    return graph.reshape(value, tuple(1 if i in positions else next(dims) for i in range(rank)))


def squeeze(graph: Graph, x: object, axis: int | Sequence[int] | None = None) -> Value:
    """``numpy.squeeze``: drop the axes of size 1 (all of them, or those named, which must be 1)."""
    value = as_value(graph, x, "squeeze: x")
    if axis is None:
        axes = tuple(i for i, d in enumerate(value.shape) if d == 1)
    else:
        axes = normalize_axes("squeeze", axis, value.ndim)
        wrong = [a for a in axes if value.shape[a] != 1]
        if wrong:
            raise RlxValueError(f"squeeze: axis {wrong[0]} of {value.type} has size {value.shape[wrong[0]]}, not 1")
    if not axes:
        return value
    return graph.reshape(value, tuple(d for i, d in enumerate(value.shape) if i not in axes))


def stack(graph: Graph, values: Sequence[object], axis: int = 0) -> Value:
    """``numpy.stack``: values of one shape joined along a new axis."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise RlxTypeError("stack: values must be a non-empty list of values")
    parts = [as_value(graph, v, f"stack: values[{i}]") for i, v in enumerate(values)]
    shapes = {part.type.shape for part in parts}
    if len(shapes) != 1:
        raise RlxValueError(f"stack: all values must have one shape, got {', '.join(str(p.type) for p in parts)}")
    position = normalize_axis("stack", axis, parts[0].ndim + 1)
    expanded = [expand_dims(graph, part, position) for part in parts]
    return expanded[0] if len(expanded) == 1 else graph.concat(expanded, axis=position)


def clip(graph: Graph, x: object, lo: object = None, hi: object = None) -> Value:
    """``numpy.clip`` / ``torch.clamp``: ``x`` held within ``[lo, hi]`` (numbers or values that
    broadcast; either may be None). The gradient is torch's: 1 where ``lo <= x <= hi``, else it
    goes to the bound. A NaN stays NaN (its gradient passes, where torch's is 0)."""
    value = as_value(graph, x, "clip: x")
    if lo is None and hi is None:
        raise RlxValueError("clip: give lo, hi or both")
    if lo is not None:
        value = graph.where(graph.less(value, lo), lo, value)
    if hi is not None:
        value = graph.where(graph.greater(value, hi), hi, value)
    return value


def var(graph: Graph, x: object, axis: object = None, keepdims: bool = False, ddof: int = 0) -> Value:
    """``numpy.var``: the mean squared deviation from the mean over ``axis``; ``ddof=1`` divides
    by ``n - 1`` (``torch.var``'s default), 0 by ``n``."""
    value = as_value(graph, x, "var: x")
    if not is_int(ddof) or int(ddof) < 0:
        raise RlxValueError(f"var: ddof must be a non-negative int, got {ddof!r}")
    axes = normalize_axes("var", axis, value.ndim)
    correction = 1.0
    if ddof:  # checked before anything is built, so that an error leaves the graph as it was
        count = product(value.shape[a] for a in axes)
        if not isinstance(count, int):
            raise RlxValueError(f"var: ddof over a symbolic axis of {value.type} is not supported")
        if count <= ddof:
            raise RlxValueError(f"var: ddof={ddof} leaves no degrees of freedom over {count} elements")
        correction = count / (count - int(ddof))
    deviation = value - graph.mean(value, axis=axes, keepdims=True)
    squares = graph.mean(deviation * deviation, axis=axes, keepdims=keepdims)
    return squares * correction if ddof else squares


def std(graph: Graph, x: object, axis: object = None, keepdims: bool = False, ddof: int = 0) -> Value:
    """``numpy.std``: the square root of :func:`var`."""
    return graph.sqrt(var(graph, x, axis=axis, keepdims=keepdims, ddof=ddof))


def take(graph: Graph, x: object, ids: object, axis: int = 0) -> Value:
    """``numpy.take(x, ids, axis)``: ``x``'s entries at integer ``ids`` along ``axis``, the
    ids' shape in its place. Rows of ``embedding`` (any dtype; float values get gradients): ids
    outside ``[0, x.shape[axis])`` are an error of the call (before native code where they are
    a graph input, by the gather where the graph computes them)."""
    value = as_value(graph, x, "take: x")
    index = as_value(graph, ids, "take: ids")
    position = normalize_axis("take", axis, value.ndim)
    order = (position, *(a for a in range(value.ndim) if a != position))
    front = graph.transpose(value, order) if position else value
    rest = tuple(front.shape[1:])
    table = graph.reshape(front, (value.shape[position], -1)) if value.ndim != 2 else front
    rows = graph.embedding(table, index)
    picked = graph.reshape(rows, (*index.shape, *rest)) if rows.shape != (*index.shape, *rest) else rows
    if not position:
        return picked
    count = index.ndim
    perm = (*range(count, count + position), *range(count), *range(count + position, picked.ndim))
    return graph.transpose(picked, perm)
