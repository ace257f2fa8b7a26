"""torch's sorts, order statistics and scatters in a TorchDynamo graph, as rlx ops (see
:mod:`rlx.torch._fx_calls`, whose tables include these).

``torch.sort``, ``argsort``, ``msort``, ``topk``, ``kthvalue`` and ``median`` are one ``sort``
each (stable: equal entries keep their order, NaN above every number, as torch's stable sort);
``torch.cummax``, ``cummin`` and ``logcumsumexp`` are rlx's running scans of those names;
``torch.scatter_add`` by any index is ``scatter_add_along_axis``; ``torch.scatter`` of a number
follows from it, and ``index_put`` that accumulates is ``index_add``. Where torch leaves the
result undefined (``scatter`` of a tensor with repeated indices) or rlx would compute something
else, the call raises :class:`Unsupported` and the graph runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from rlx.ir.graph import Graph, Value
from rlx.ops.sort import sort_with_indices
from rlx.torch._fx_calls import Unsupported, _float, _running, _value, check_kwargs
from rlx.torch._fx_extras import index_add


def sort(g: Graph, x: Any, dim: int = -1, descending: bool = False, stable: bool | None = False) -> tuple[Value, Value]:
    """``torch.sort``: values and int64 indices. rlx's sort is stable, one of the orders torch's
    unstable sort may give."""
    return sort_with_indices(g, _float(x), axis=int(dim), descending=bool(descending))


def argsort(g: Graph, x: Any, dim: int = -1, descending: bool = False, stable: bool = False) -> Value:
    """``torch.argsort`` (stable)."""
    return g.argsort(_float(x), axis=int(dim), descending=bool(descending))


def logcumsumexp(g: Graph, x: Any, dim: int, **kwargs: Any) -> Value:
    """``torch.logcumsumexp``: ``log(cumsum(exp(x)))`` without overflow."""
    check_kwargs(kwargs, out=None)
    return g.logcumsumexp(_float(x).astype("float32"), axis=int(dim))


def msort(g: Graph, x: Any) -> Value:
    """``torch.msort``: sorted along the first axis."""
    return g.sort(_float(x), axis=0)


def topk(
    g: Graph, x: Any, k: int, dim: int = -1, largest: bool = True, sorted: bool = True, **kwargs: Any
) -> tuple[Value, Value]:
    """``torch.topk``: the ``k`` largest (smallest) entries in order and their positions."""
    check_kwargs(kwargs, out=None)
    if type(k) is not int:
        raise Unsupported(f"topk of a k that is not a number ({type(k).__name__})")
    return g.topk(_float(x), k, axis=int(dim), largest=bool(largest))


def kthvalue(g: Graph, x: Any, k: int, dim: int = -1, keepdim: bool = False, **kwargs: Any) -> tuple[Value, Value]:
    """``torch.kthvalue``: the ``k``-th smallest entry (from 1) along ``dim`` and its position."""
    check_kwargs(kwargs, out=None)
    value = _float(x)
    axis = int(dim) % max(value.ndim, 1)
    length = value.shape[axis]
    if type(k) is not int or not isinstance(length, int) or not 1 <= k <= length:
        raise Unsupported(f"kthvalue k={k!r} of an axis of {length}")
    values, positions = sort_with_indices(g, value, axis=axis)
    return _picked(g, values, axis, k - 1, keepdim), _picked(g, positions, axis, k - 1, keepdim)


def _picked(g: Graph, x: Value, axis: int, at: int, keepdim: bool) -> Value:
    """``x``'s entry ``at`` along ``axis``, the axis kept (size 1) or dropped."""
    part = x[(slice(None),) * axis + (slice(at, at + 1),)]
    return part if keepdim else g.squeeze(part, axis)


def median(g: Graph, x: Any, dim: int | None = None, keepdim: bool = False, **kwargs: Any) -> Any:
    """``torch.median``: the lower of the two middle entries (entry ``(n - 1) // 2`` of the sorted
    axis), NaN where the axis holds a NaN (and then a NaN's position, as torch). Without ``dim``,
    of the whole tensor, values only."""
    check_kwargs(kwargs, out=None)
    value = _float(x)
    if dim is None:
        flat = g.reshape(value, (-1,))
        return g.squeeze(median(g, flat, 0, True)[0], 0)
    axis = int(dim) % max(value.ndim, 1)
    length = value.shape[axis]
    if not isinstance(length, int):
        raise Unsupported(f"median along an axis of dynamic length {length}")
    values, positions = sort_with_indices(g, value, axis=axis)
    nans = g.sum(g.not_equal(value, value).astype("float32"), axis=axis, keepdims=True).astype("int64")
    # NaN sorts last: the first of them sits at length - nans
    at = g.where(g.greater(nans, 0), length - nans, g.constant(np.int64((length - 1) // 2)))
    picked_values, picked_positions = g.take_along_axis(values, at, axis), g.take_along_axis(positions, at, axis)
    if keepdim:
        return picked_values, picked_positions
    return g.squeeze(picked_values, axis), g.squeeze(picked_positions, axis)


def _scattered(g: Graph, x: Value, dim: int, index: Any, source: Value) -> Value:
    """``source`` (cut to the index's shape) added at ``index`` along ``dim`` into zeros of x's
    shape: torch's ``scatter_add`` where the index covers x's other axes."""
    ids = _float(index)
    if not isinstance(ids, Value) or ids.ndim != x.ndim or source.ndim != x.ndim:
        raise Unsupported("scatter by an index of another rank than the tensor")
    axis = dim % x.ndim
    for a in range(x.ndim):
        if a != axis and ids.shape[a] != x.shape[a]:
            raise Unsupported(f"scatter by an index of shape {ids.shape} into {x.shape}: only along axis {axis}")
    pairs = list(zip(ids.shape, source.shape, strict=True))
    shorter = [isinstance(size, int) and isinstance(have, int) and size < have for size, have in pairs]
    if any(size != have and not short for (size, have), short in zip(pairs, shorter, strict=True)):
        raise Unsupported(f"scatter from a source of shape {source.shape} by an index of shape {ids.shape}")
    cut = tuple(slice(0, size) if size != have else slice(None) for size, have in pairs)
    part = source[cut] if any(c != slice(None) for c in cut) else source
    return g.scatter_add_along_axis(part, ids, axis, x.shape[axis])


def scatter_add(g: Graph, x: Any, dim: int, index: Any, src: Any, **kwargs: Any) -> Value:
    """``torch.scatter_add``: ``src``'s entries added into ``x`` at ``index`` along ``dim``
    (repeated indices add up); an index outside ``x`` is an error of the call."""
    check_kwargs(kwargs, out=None)
    value = _float(x)
    if value.dtype != np.float32:
        raise Unsupported(f"scatter_add into {value.dtype}")
    return value + _scattered(g, value, int(dim), index, _value(g, src))


def scatter(g: Graph, x: Any, dim: int, index: Any, src: Any = None, *, value: Any = None, **kwargs: Any) -> Value:
    """``torch.scatter`` of a number (``x.scatter(1, ids, 1.0)``, a one-hot): ``x`` with that
    number wherever the index points. A tensor ``src`` is left to torch, whose result is
    undefined where indices repeat."""
    check_kwargs(kwargs, reduce=None)
    number = value if src is None else src
    if isinstance(number, (Value, torch.Tensor)) or not isinstance(number, (int, float, bool)):
        raise Unsupported("scatter of a tensor (repeated indices would pick any entry)")
    target = _float(x)
    if target.dtype != np.float32:
        raise Unsupported(f"scatter into {target.dtype}")
    ids = _float(index)
    ones = g.broadcast_to(g.constant(np.float32(1.0)), tuple(ids.shape))
    hits = _scattered(g, target, int(dim), ids, ones)
    return g.where(g.greater(hits, 0.0), float(number), target)


def index_put(g: Graph, x: Any, indices: Any, values: Any, accumulate: bool = False) -> Value:
    """``torch.index_put`` (``x[ids] = v``, ``x.index_put_((ids,), v, accumulate=True)``) by one
    1-d int index of the first axis: accumulated, ``values``' rows added in (repeats add up); else
    one value for every indexed row (a number, or a row broadcast) put there. Rows of their own
    without accumulating are left to torch, whose result is undefined where indices repeat."""
    if not isinstance(indices, (tuple, list)) or len(indices) != 1:
        raise Unsupported("index_put by more than one index tensor")
    (ids,) = indices
    target, ids = _float(x), _float(ids)
    if not isinstance(ids, Value) or ids.ndim != 1 or ids.dtype == np.bool_ or target.dtype != np.float32:
        raise Unsupported("index_put by other than a 1-d int index into a float tensor")
    rows = (ids.shape[0], *target.shape[1:])
    if accumulate:
        source = _value(g, values)
        return index_add(g, target, 0, ids, g.broadcast_to(source, rows) if tuple(source.shape) != rows else source)
    put = _value(g, values)
    if put.ndim == target.ndim and put.shape[0] != 1:
        raise Unsupported("index_put of rows without accumulate (repeated indices would pick any row)")
    ones = g.broadcast_to(g.constant(np.float32(1.0)), (ids.shape[0], 1))
    hits = g.embedding_grad(ones, ids, target.shape[0])  # [rows, 1]
    shaped = g.reshape(hits, (target.shape[0], *(1,) * (target.ndim - 1)))
    return g.where(g.greater(shaped, 0.0), put.astype("float32"), target)


FUNCTIONS: dict[Any, Callable[..., Any]] = {
    torch.sort: sort,
    torch.argsort: argsort,
    torch.msort: msort,
    torch.topk: topk,
    torch.kthvalue: kthvalue,
    torch.median: median,
    torch.scatter_add: scatter_add,
    torch.scatter: scatter,
    torch.index_put: index_put,
    torch.cummax: _running("cummax"),
    torch.cummin: _running("cummin"),
    torch.logcumsumexp: logcumsumexp,
}

METHODS: dict[str, Callable[..., Any]] = {
    "sort": sort,
    "argsort": argsort,
    "msort": msort,
    "topk": topk,
    "kthvalue": kthvalue,
    "median": median,
    "scatter_add": scatter_add,
    "scatter": scatter,
    "index_put": index_put,
    "cummax": _running("cummax"),
    "cummin": _running("cummin"),
    "logcumsumexp": logcumsumexp,
}
