"""``x.at[index].set(v)``, ``.add(v)``, ``.multiply(v)``, ``.min(v)``, ``.max(v)``, ``.get()``:
JAX's functional index updates (a new value; ``x`` is unchanged), for every index that
``x[index]`` takes (:func:`rlx.ops.movement.getitem`, :mod:`rlx.ops.advanced_index`).

How each is built, from ops that have references, gradients and lowerings already:

- A basic index of ints, slices of step 1, ``...`` and ``None`` names a block of ``x``: ``set``
  concatenates ``x``'s neighbours of the block around ``v`` along each indexed axis, so the
  result is views around ``v``, in any dtype, and exact.
- Any other index (arrays, steps) places ``v`` with the transpose of ``x[index]``, the
  scatter that is its gradient: a float ``x`` only. ``add`` adds what lands on each entry,
  so repeated entries accumulate, as JAX's ``add``. ``set`` writes a number where the index
  lands, and a value's entries there, averaged where the index repeats an entry (JAX leaves
  which write wins undefined; NumPy's last one wins).
- ``set`` of a number through a bool value of ``x``'s leading axes (``x[mask] = 0`` in
  NumPy) is a ``where``: the one bool index whose result has a shape known before the call.
- ``multiply``, ``min`` and ``max`` read the block, combine and ``set`` it: an index that can
  repeat an entry (an index array of the call, or a constant one that repeats) would combine
  repeated writes differently from JAX, so it is refused.

``v`` is a number, an array or a value, converted to ``x``'s dtype and broadcast to the shape
of ``x[index]``, as JAX does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ops._common import F32, as_value, expand_ellipsis, is_int

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value


class IndexUpdateHelper:
    """``x.at``: indexing it gives the updates of ``x`` at that index."""

    def __init__(self, x: Value) -> None:
        self._x = x

    def __getitem__(self, index: object) -> IndexUpdate:
        return IndexUpdate(self._x, index)

    def __repr__(self) -> str:
        return f"<the index updates of {self._x.type}>"


class IndexUpdate:
    """``x.at[index]``: each method builds a new value of ``x``'s shape and dtype."""

    def __init__(self, x: Value, index: object) -> None:
        self._x = x
        self._index = index

    def get(self) -> Value:
        """``x[index]``."""
        return self._x[self._index]

    def set(self, values: object) -> Value:
        """``x`` with ``values`` written at ``index``."""
        return _built(self._x, lambda g: _set(g, self._x, self._index, values))

    def add(self, values: object) -> Value:
        """``x`` with ``values`` added at ``index`` (repeated entries add up)."""
        return _built(self._x, lambda g: _add(g, self._x, self._index, values))

    def multiply(self, values: object) -> Value:
        """``x`` with the entries at ``index`` multiplied by ``values``."""
        return _built(self._x, lambda g: _combine(g, self._x, self._index, values, "mul"))

    def min(self, values: object) -> Value:
        """``x`` with the entries at ``index`` replaced by their minimum with ``values``."""
        return _built(self._x, lambda g: _combine(g, self._x, self._index, values, "minimum"))

    def max(self, values: object) -> Value:
        """``x`` with the entries at ``index`` replaced by their maximum with ``values``."""
        return _built(self._x, lambda g: _combine(g, self._x, self._index, values, "maximum"))


def _built(x: Value, build: Any) -> Value:
    """``build(graph)``, all or nothing: an error leaves no stray nodes."""
    from rlx.ir.graph import _all_or_nothing

    result: Value = _all_or_nothing(build)(x.graph)
    return result


def _block(x: Value, index: object) -> list[slice] | None:
    """The slices (one per axis of ``x``) that a basic index without steps names, an int being
    a slice of one and static bounds clamped as NumPy clamps them; None for any other index."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if not all(e is None or e is Ellipsis or isinstance(e, slice) or is_int(e) for e in entries):
        return None
    expanded, _ = expand_ellipsis(f"indexing {x.type}", entries, x.ndim)
    entries = [e for e in expanded if e is not None]  # a new axis of one names no entries of x
    parts = []
    for entry, length in zip(entries, x.shape, strict=True):
        if isinstance(entry, slice) and entry.step not in (None, 1):
            return None
        if is_int(entry):
            position = int(entry)
            part = slice(position, position + 1 if position != -1 else None)
        else:
            assert isinstance(entry, slice)
            part = entry
        if isinstance(length, int):
            if is_int(entry) and not -length <= int(entry) < length:
                return None  # getitem's error names the bound
            start, stop, _ = part.indices(length)
            part = slice(start, max(start, stop)) if (start, stop) != (0, length) else slice(None)
        parts.append(part)
    return parts


def _placed(graph: Graph, x: Value, index: object, values: object) -> tuple[Value, Value]:
    """``(y, v)``: the part ``y = x[index]`` and ``values`` in ``x``'s dtype broadcast to it."""
    part = x[index]
    if _is_number(values):
        value = graph.constant(np.asarray(values, dtype=x.dtype))
    else:
        value = as_value(graph, values, "at[...]: values")
        if value.dtype != x.dtype:
            value = graph.cast(value, str(np.dtype(x.dtype)))
    if value.shape != part.shape:
        value = graph.broadcast_to(value, part.shape)
    return part, value


def _is_number(values: object) -> bool:
    return isinstance(values, (int, float, bool, np.number, np.bool_))


def _set(graph: Graph, x: Value, index: object, values: object) -> Value:
    mask = _leading_mask(x, index)
    if mask is not None and _is_number(values):  # x[mask] = 0: the shape stays static
        number = graph.constant(np.asarray(values, dtype=x.dtype))
        return graph.where(graph.reshape(mask, (*mask.shape, *(1,) * (x.ndim - mask.ndim))), number, x)
    block = _block(x, index)
    if block is not None:
        if _names_nothing(x, block):
            return x  # as NumPy's x[1:1] = v
        _, value = _placed(graph, x, index, values)
        return _replaced(graph, x, block, graph.reshape(value, x[tuple(block)].shape), 0)
    _require_float(x, "set")
    part, value = _placed(graph, x, index, values)
    hits = _scatter(graph, x, part, graph.broadcast_to(graph.constant(np.ones((), np.float32)), part.shape))
    if _is_number(values):  # one number: written where the index lands, exactly
        return graph.where(graph.greater(hits, 0.0), graph.constant(np.asarray(values, np.float32)), x)
    written = _scatter(graph, x, part, value) / graph.maximum(hits, 1.0)
    return graph.where(graph.greater(hits, 0.0), written, x)


def _leading_mask(x: Value, index: object) -> Value | None:
    """A bool value of ``x``'s leading axes as the whole index, else None."""
    from rlx.ir.graph import Value as GraphValue

    if not isinstance(index, GraphValue) or index.dtype != np.bool_:
        return None
    if tuple(x.shape[: index.ndim]) != tuple(index.shape):
        raise RlxValueError(f"at[mask]: a bool mask {index.type} must match the leading axes of {x.type}")
    return index


def _names_nothing(x: Value, block: list[slice]) -> bool:
    return any(
        isinstance(length, int) and part.indices(length)[1] <= part.indices(length)[0]
        for part, length in zip(block, x.shape, strict=True)
    )


def _add(graph: Graph, x: Value, index: object, values: object) -> Value:
    block = _block(x, index)
    if block is not None and _names_nothing(x, block):
        return x
    if block is not None and x.dtype != F32:  # ints and bools: the block read and set
        part, value = _placed(graph, x, index, values)
        return _set(graph, x, index, part + value)
    _require_float(x, "add")
    part, value = _placed(graph, x, index, values)
    return x + _scatter(graph, x, part, value)


def _combine(graph: Graph, x: Value, index: object, values: object, how: str) -> Value:
    block = _block(x, index)
    if block is not None and _names_nothing(x, block):
        return x
    if block is None and _may_repeat(x, index):
        raise RlxValueError(
            f"at[...].{_METHODS[how]}: the index may name an entry of {x.type} more than once (an index "
            "array of the call, or a constant one that repeats), where repeated updates would have to combine; "
            "use an index that names each entry once"
        )
    part, value = _placed(graph, x, index, values)
    return _set(graph, x, index, getattr(graph, how)(part, value))


_METHODS = {"mul": "multiply", "minimum": "min", "maximum": "max"}


def _may_repeat(x: Value, index: object) -> bool:
    """Whether ``x[index]`` (not a block) may name one entry of ``x`` twice."""
    from rlx.ops.advanced_index import is_array_index, repeats_an_entry

    entries = index if isinstance(index, tuple) else (index,)
    return any(is_array_index(e) for e in entries) and repeats_an_entry(x, entries)  # steps never repeat


def _require_float(x: Value, how: str) -> None:
    if x.dtype != F32:
        raise RlxTypeError(
            f"at[...].{how}: an index of arrays or steps scatters, which rlx does for float32 values only, "
            f"got {x.type} (cast it, or index a block with ints and slices)"
        )


def _scatter(graph: Graph, x: Value, part: Value, values: Value) -> Value:
    """``values`` placed where ``part = x[index]`` read them, zeros elsewhere, adding where the
    index repeats: the transpose of the indexing, which is its gradient."""
    from rlx.autodiff import grad

    (placed,) = grad(graph, part, [x], values)
    return placed


def _replaced(graph: Graph, x: Value, parts: list[slice], block: Value, axis: int) -> Value:
    """``x`` with ``x[parts]`` (slices from ``axis`` on) replaced by ``block``: along each
    indexed axis, the block's neighbours concatenated around it."""
    if axis == x.ndim:
        return block
    part = parts[axis]
    whole = (slice(None),) * axis
    if part == slice(None):
        return _replaced(graph, x, parts, block, axis + 1)
    inner = _replaced(graph, x[(*whole, part)], parts, block, axis + 1)
    pieces = []
    if part.start not in (None, 0):
        pieces.append(x[(*whole, slice(None, part.start))])
    pieces.append(inner)
    if part.stop is not None and not (isinstance(x.shape[axis], int) and part.stop >= x.shape[axis]):
        pieces.append(x[(*whole, slice(part.stop, None))])
    return graph.concat(pieces, axis=axis) if len(pieces) > 1 else inner
