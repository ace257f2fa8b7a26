"""``x[ids]``, ``x[:, rows, cols]``, ``x[[0, 2]]``, ``x[np_mask]``: NumPy's advanced indexing.

An index holding integer arrays (int Values of the graph, lists, NumPy arrays) or a constant
NumPy bool array picks entries as ``numpy.ndarray.__getitem__`` does, and is built from ops
that exist already, so it has their reference, gradient (a scatter-add where ids repeat) and
lowering:

1. the basic entries (slices, ``None``) are applied first, with each indexed axis kept whole;
2. the indexed axes move to the front and, when there are several, merge into one, whose
   index is the flat position ``sum(i_k * stride_k)`` (the index arrays broadcast there);
3. one ``take`` along that axis gathers, and the indexed result axes go where NumPy puts
   them: in place of the indexed axes when those are adjacent in the index, else first.

An int beside an array counts as an index array, as in NumPy (it takes part in the placement
rule). Negative entries count from the end. Constant indices are wrapped and checked while the
graph is built (NumPy's ``IndexError`` as an ``RlxValueError``); an index the call supplies is
wrapped by the graph, and one still outside its axis is an error of the call, raised by the
gather before it reads memory. A bool Value as an index would give a shape that depends on the
data: that is refused (use ``g.where``), as JAX refuses it under ``jit``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.types import Dim
from rlx.ops._common import BOOL, INT_DTYPES, broadcast_shapes, expand_ellipsis, is_int

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value

INT64 = np.dtype(np.int64)


def is_array_index(entry: object) -> bool:
    """Whether ``entry`` makes an index an advanced one: an array (a 0-d one too, as NumPy's
    ``x[np.array(1)]``), a list or a Value, not a slice, an int, ``None`` or ``...``."""
    from rlx.ir.graph import Value

    return isinstance(entry, (Value, list, np.ndarray))


@dataclass(frozen=True)
class _Indexed:
    """One indexed axis: its position among the basic result's axes and its index."""

    axis: int
    ids: Value | np.ndarray  # int64 ndarray (wrapped and checked) or an int Value
    length: Dim  # of the axis


@dataclass(frozen=True)
class AdvancedIndex:
    """An advanced index taken apart: the basic entries to apply first (each indexed axis kept
    whole), the indexed axes of that basic result with their indices, and whether those stood
    together in the index (NumPy's rule for where the index's axes go)."""

    basic: tuple[object, ...]
    indexed: tuple[_Indexed, ...]
    adjacent: bool


def parse_advanced(x: Value, index: tuple[object, ...]) -> AdvancedIndex:
    """``index`` of ``x`` taken apart and checked (constant indices wrapped into their axes),
    building no node."""
    from rlx.ir.graph import Value

    what = f"indexing {x.type}"
    entries = _expand_bool_arrays(what, [_as_entry(what, entry) for entry in index])
    entries, origins = expand_ellipsis(what, entries, x.ndim)  # where each stood: NumPy's placement rule

    basic: list[object] = []
    indexed: list[_Indexed] = []
    places: list[int] = []  # where each indexed entry stands in the index
    axis = 0  # of x
    for place, entry in enumerate(entries):
        if entry is None or isinstance(entry, slice):
            basic.append(entry)
            axis += entry is not None
            continue
        length = x.shape[axis]
        ids = entry if isinstance(entry, Value) else _checked_constant(what, entry, axis, length)
        indexed.append(_Indexed(len(basic), ids, length))
        places.append(origins[place])
        basic.append(slice(None))
        axis += 1
    broadcast_shapes(f"{what}: the index arrays", *(item.ids.shape for item in indexed))  # NumPy's IndexError
    adjacent = places == list(range(places[0], places[0] + len(places)))
    return AdvancedIndex(tuple(basic), tuple(indexed), adjacent)


def advanced_getitem(graph: Graph, x: Value, index: tuple[object, ...]) -> Value:
    """``x[index]`` for an index with at least one array entry (see the module's docstring)."""
    from rlx.ops.movement import getitem

    parsed = parse_advanced(x, index)
    if not all(isinstance(entry, slice) and entry == slice(None) for entry in parsed.basic):
        x = getitem(graph, x, parsed.basic)
    return _gather(graph, x, list(parsed.indexed), parsed.adjacent)


def repeats_an_entry(x: Value, index: tuple[object, ...]) -> bool:
    """Whether ``x[index]`` (an advanced index) may read one entry of ``x`` twice: always for an
    index value of the call, else whether the broadcast constant index tuples repeat."""
    parsed = parse_advanced(x, index)
    arrays = [item.ids for item in parsed.indexed]
    if not all(isinstance(ids, np.ndarray) for ids in arrays) or not all(
        isinstance(item.length, int) for item in parsed.indexed
    ):
        return True  # known only in the call (negative constants wrap into a symbolic length too)
    keys = np.stack([a.reshape(-1) for a in np.broadcast_arrays(*arrays)], axis=1)  # type: ignore[arg-type]
    return len(np.unique(keys, axis=0)) != len(keys)


def _as_entry(what: str, entry: object) -> object:
    """An index entry as ``None``, ``...``, a slice, an int64 ndarray, a bool ndarray or an int Value."""
    from rlx.ir.graph import Value

    if entry is None or entry is Ellipsis or isinstance(entry, slice):
        return entry
    if isinstance(entry, Value):
        if entry.dtype == BOOL:
            raise RlxTypeError(
                f"{what}: indexing by a bool value picks a number of entries known only when the graph runs; "
                "keep the shape with g.where(mask, x, 0) (or multiply by the mask)"
            )
        if entry.dtype not in INT_DTYPES:
            raise RlxTypeError(f"{what}: an index value must be int32 or int64, got {entry.type}")
        return entry
    if is_int(entry):
        return np.asarray(int(entry), dtype=np.int64)
    if isinstance(entry, (list, np.ndarray)):
        try:
            array = np.asarray(entry)
        except ValueError as error:  # ragged lists
            raise RlxValueError(f"{what}: an index list must be rectangular ({error})") from None
        if array.dtype == np.bool_:
            return array
        if array.size == 0 and array.dtype == np.float64:  # [] is an empty int index in NumPy
            array = array.astype(np.int64)
        if not np.issubdtype(array.dtype, np.integer):
            raise RlxTypeError(f"{what}: index arrays must hold ints (or bools), got dtype {array.dtype}")
        return array.astype(np.int64)
    raise RlxTypeError(
        f"{what}: only ints, slices, ..., None, int arrays and int values index a value, got {type(entry).__name__}"
    )


def _expand_bool_arrays(what: str, entries: list[object]) -> list[object]:
    """A constant bool array covering ``k`` axes becomes the ``k`` int arrays of its ``nonzero``."""
    expanded: list[object] = []
    for entry in entries:
        if isinstance(entry, np.ndarray) and entry.dtype == np.bool_:
            if entry.ndim == 0:
                raise RlxTypeError(f"{what}: a bool scalar index (NumPy's new axis of length 0 or 1) is not supported")
            if not entry.any():
                raise RlxValueError(f"{what}: the bool index selects nothing (rlx has no empty values)")
            expanded.extend(np.nonzero(entry))
        else:
            expanded.append(entry)
    return expanded


def _checked_constant(what: str, ids: object, axis: int, length: Dim) -> np.ndarray:
    """A constant index, negative entries counted from the end, each inside the axis."""
    assert isinstance(ids, np.ndarray)
    if ids.size == 0:
        raise RlxValueError(f"{what}: an empty index array selects nothing (rlx has no empty values)")
    if not isinstance(length, int):  # wrapped by the graph like an index of the call
        return ids
    bad = ids[(ids < -length) | (ids >= length)]
    if bad.size:
        raise RlxValueError(f"{what}: index {int(bad.flat[0])} is out of bounds for axis {axis} of size {length}")
    return np.where(ids < 0, ids + length, ids).astype(np.int64)


def _gather(graph: Graph, x: Value, indexed: list[_Indexed], adjacent: bool) -> Value:
    """``take`` along the indexed axes of ``x`` (kept whole by the basic step), merged into one."""
    from rlx.ops.composite import take

    first = indexed[0].axis
    if len(indexed) == 1:
        ids = _wrapped(graph, indexed[0].ids, x.shape[first])
        return take(graph, x, ids, first)  # NumPy's placement: one indexed axis stays where it is
    axes = [item.axis for item in indexed]
    lengths = [x.shape[a] for a in axes]
    if not all(isinstance(length, int) for length in lengths):
        raise RlxValueError(
            f"indexing {x.type}: indexing several axes by arrays needs their lengths known when the graph is "
            f"built, got {lengths}"
        )
    sizes = [int(length) for length in lengths]  # type: ignore[arg-type]
    flat = _flat_position(graph, [item.ids for item in indexed], sizes)
    rest = [a for a in range(x.ndim) if a not in axes]
    moved = graph.transpose(x, (*axes, *rest)) if axes + rest != list(range(x.ndim)) else x
    merged = graph.reshape(moved, (math.prod(sizes), *moved.shape[len(axes) :]))
    picked = take(graph, merged, flat, 0)
    if not adjacent or first == 0:
        return picked
    count = picked.ndim - len(rest)  # the index's axes, now first
    perm = (*range(count, count + first), *range(count), *range(count + first, picked.ndim))
    return graph.transpose(picked, perm)


def _wrapped(graph: Graph, ids: Value | np.ndarray, length: Dim) -> Value | np.ndarray:
    """``ids`` with negative entries counted from the end of an axis of ``length``."""
    if isinstance(ids, np.ndarray) and isinstance(length, int):
        return ids  # wrapped and checked already
    value = _int64(graph, graph.constant(ids) if isinstance(ids, np.ndarray) else ids)
    return graph.where(graph.less(value, 0), value + _length_value(graph, length), value)


def _int64(graph: Graph, ids: Value) -> Value:
    return ids if ids.dtype == INT64 else graph.cast(ids, "int64")


def _length_value(graph: Graph, length: Dim) -> Value:
    """An axis's length as an int64 scalar of the graph (a symbolic one is the call's)."""
    if isinstance(length, int):
        return graph.constant(np.asarray(length, dtype=np.int64))
    from rlx.ops.arrays import positions

    return positions(graph, length)[-1] + 1


def _flat_position(graph: Graph, ids: list[Value | np.ndarray], sizes: list[int]) -> Value | np.ndarray:
    """``sum(i_k * stride_k)`` over the merged axes, the indices broadcast; an entry outside
    its axis makes the position -1, which the gather refuses."""
    strides = [math.prod(sizes[k + 1 :]) for k in range(len(sizes))]
    if all(isinstance(i, np.ndarray) for i in ids):
        arrays = np.broadcast_arrays(*ids)  # type: ignore[arg-type]
        return np.asarray(sum(a * s for a, s in zip(arrays, strides, strict=True)), dtype=np.int64)
    position: Value | None = None
    valid: Value | None = None
    for index, size, stride in zip(ids, sizes, strides, strict=True):
        if isinstance(index, np.ndarray):  # checked while building
            term: Value = graph.constant(index * stride)
        else:
            wide = _int64(graph, index)
            inside = graph.logical_and(graph.greater_equal(wide, -size), graph.less(wide, size))
            valid = inside if valid is None else graph.logical_and(valid, inside)
            term = graph.where(graph.less(wide, 0), wide + size, wide) * stride
        position = term if position is None else position + term
    assert position is not None and valid is not None
    return graph.where(valid, position, -1)
