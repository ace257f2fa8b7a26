"""Helpers the op definitions share: operand checks, broadcasting, axes, and gradient plumbing."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.dims import parse_dim
from rlx.ir.types import Dim, TensorType

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value

F32 = np.dtype(np.float32)
BOOL = np.dtype(np.bool_)
INT_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def op_kind(name: str) -> Any:
    """The ``OpKind`` member called ``name``, looked up late: ``OpKind`` is built from the registry."""
    from rlx.ir.ops import OpKind

    return OpKind(name)


def is_number(x: object) -> bool:
    """A Python or NumPy real number (bools excluded: ``True`` is not a float operand)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def is_int(x: object) -> TypeGuard[int | np.integer]:
    """A Python or NumPy integer (bools excluded: ``True`` is not an index or an axis)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def as_value(graph: Graph, x: object, what: str) -> Value:
    """A Value of ``graph`` as is; a Python number or a NumPy array becomes a constant.

    A number is a float32 scalar; an array keeps its dtype (float64 becomes float32), as
    ``g.constant`` makes it. That is what JAX does with a NumPy array met while tracing, and it
    lets ``x @ w_np`` and ``np_mask & m`` read as they would in NumPy.
    """
    from rlx.ir.graph import Value

    if isinstance(x, Value):
        return x
    if is_number(x):
        return graph.constant(float(x))  # type: ignore[arg-type]
    if isinstance(x, (bool, np.bool_)):
        # Most often ``value == other``, which compares identity and gives a Python bool.
        raise RlxTypeError(
            f"{what}: got the Python bool {bool(x)}; == and != on Values compare identity, so compare "
            "with g.equal(a, b) or g.not_equal(a, b) (or <, <=, >, >=)"
        )
    if isinstance(x, np.ndarray):
        return graph.constant(x)
    raise RlxTypeError(f"{what}: expected an rlx Value, a Python number or a NumPy array, got {type(x).__name__}")


def require_float(what: str, label: str, ty: TensorType) -> None:
    if ty.dtype != F32:
        hint = " (convert it with .astype('float32'))" if ty.dtype == BOOL or ty.dtype in INT_DTYPES else ""
        raise RlxTypeError(f"{what}: {label} must be f32, got {ty.dtype_name} ({ty}){hint}")


def require_bool(what: str, label: str, ty: TensorType) -> None:
    if ty.dtype != BOOL:
        raise RlxTypeError(f"{what}: {label} must be bool, got {ty.dtype_name} ({ty})")


def require_axis_attr(what: str, axis: object, ty: TensorType) -> None:
    """``RlxValueError`` unless ``axis`` (an attribute, non-negative once built) is an axis of ``ty``."""
    if isinstance(axis, bool) or not isinstance(axis, int) or not 0 <= axis < ty.rank:
        raise RlxValueError(f"{what}: axis {axis!r} must be in [0, {ty.rank}) for {ty}")


def require_int(what: str, label: str, ty: TensorType) -> None:
    if ty.dtype not in INT_DTYPES:
        raise RlxTypeError(f"{what}: {label} must be int32 or int64, got {ty.dtype_name} ({ty})")


def broadcast_shapes(what: str, *shapes: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """NumPy broadcasting of ``shapes``; ``RlxValueError`` naming ``what`` if they do not broadcast."""
    rank = max(len(shape) for shape in shapes)
    result = []
    for axis in range(-rank, 0):
        sizes = {shape[axis] for shape in shapes if len(shape) >= -axis} - {1}
        if len(sizes) > 1:
            listed = " and ".join(str(list(shape)) for shape in shapes)
            raise RlxValueError(
                f"{what}: shapes {listed} do not broadcast (axis {axis}: sizes {sorted(sizes, key=str)})"
            )
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def normalize_axis(what: str, axis: object, rank: int) -> int:
    """One axis in ``[-rank, rank)`` as a non-negative int."""
    if not is_int(axis):
        raise RlxTypeError(f"{what}: axis must be an int, got {type(axis).__name__}")
    if not -rank <= axis < rank:
        raise RlxValueError(f"{what}: axis {axis} is out of range for rank {rank}")
    return int(axis) % rank


def normalize_axes(what: str, axis: object, rank: int) -> tuple[int, ...]:
    """``None`` (every axis), an int or a sequence of ints -> sorted distinct non-negative axes."""
    if axis is None:
        return tuple(range(rank))
    if is_int(axis):
        return (normalize_axis(what, axis, rank),)
    if isinstance(axis, (str, bytes)) or not isinstance(axis, Sequence):
        raise RlxTypeError(f"{what}: axis must be None, an int or a tuple of ints, got {type(axis).__name__}")
    axes = [normalize_axis(what, a, rank) for a in axis]
    if len(set(axes)) != len(axes):
        raise RlxValueError(f"{what}: axis {tuple(axis)} repeats an axis")
    return tuple(sorted(axes))


def int_tuple(what: str, label: str, values: object) -> tuple[int, ...]:
    """A tuple of Python ints from a user sequence (NumPy ints accepted)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RlxTypeError(f"{what}: {label} must be a tuple of ints, got {type(values).__name__}")
    out = []
    for v in values:
        if not is_int(v):
            raise RlxTypeError(f"{what}: {label} entries must be ints, got {v!r}")
        out.append(int(v))
    return tuple(out)


def dim_tuple(what: str, label: str, values: object) -> tuple[int | str, ...]:
    """Like :func:`int_tuple`, but an entry may also be a symbolic dimension: a name (``"Sk"``), or
    a polynomial of names and ints (``"2*Sk"`` as a reshape that merges axes prints it, ``"P+1"``
    as a concat does); it is kept in canonical form."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise RlxTypeError(f"{what}: {label} must be a tuple of ints, got {type(values).__name__}")
    out: list[int | str] = []
    for v in values:
        if isinstance(v, str):
            dim = parse_dim(v)
            if dim is None:
                raise RlxValueError(
                    f"{what}: {label}: a symbolic dimension must be an identifier (or a product or sum "
                    f"such as '2*Sk' or 'P+1'), got {v!r}"
                )
            out.append(dim)
        elif not is_int(v):
            raise RlxTypeError(f"{what}: {label} entries must be ints, got {v!r} (or symbolic dimension names)")
        else:
            out.append(int(v))
    return tuple(out)


def to_f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


# ----------------------------------------------------------------------------- gradient helpers


def sum_to_shape(graph: Graph, grad: Value, shape: tuple[Dim, ...]) -> Value:
    """Undo broadcasting: sum ``grad`` over the axes that broadcasting added or stretched."""
    if grad.shape == shape:
        return grad
    lead = len(grad.shape) - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, size in enumerate(shape) if size == 1 and grad.shape[lead + i] != 1
    )
    summed = graph.sum(grad, axis=axes, keepdims=False) if axes else grad
    return summed if summed.shape == shape else graph.reshape(summed, shape)


def zeros(graph: Graph, shape: tuple[Dim, ...]) -> Value:
    """A float32 zero tensor of ``shape`` (a broadcast scalar: no buffer)."""
    zero = graph.constant(0.0)
    return zero if shape == () else graph.broadcast_to(zero, shape)


def keep_axes(graph: Graph, reduced: Value, full: tuple[Dim, ...], axes: tuple[int, ...]) -> Value:
    """Reshape a reduction without keepdims back to rank ``len(full)`` (size 1 on ``axes``)."""
    shape = tuple(1 if i in axes else size for i, size in enumerate(full))
    return reduced if reduced.shape == shape else graph.reshape(reduced, shape)


def reciprocal_count(graph: Graph, x: Value, axes: tuple[int, ...]) -> float | Value:
    """1 / (elements reduced): a number, or, over a symbolic dimension, a value computed per call."""
    sizes = [x.shape[a] for a in axes]
    static = math.prod(d for d in sizes if isinstance(d, int))
    symbolic = tuple(a for a in axes if isinstance(x.shape[a], str))
    if not symbolic:
        return 1.0 / static
    ones = graph.broadcast_to(graph.constant(1.0), tuple(x.shape[a] for a in symbolic))
    return graph.div(1.0 / static, graph.sum(ones, axis=None))


def expand_ellipsis(what: str, entries: Sequence[object], rank: int) -> tuple[list[object], list[int]]:
    """An index's entries with ``...`` (or, without one, the end) standing for the axes the others
    leave, as whole slices; and where each entry stood in the index. An ellipsis's slices keep
    its place even when it stands for no axis: NumPy's advanced indexing counts it there."""
    if sum(entry is Ellipsis for entry in entries) > 1:
        raise RlxValueError(f"{what}: an index can only have a single ellipsis ('...')")
    used = sum(entry is not None and entry is not Ellipsis for entry in entries)
    if used > rank:
        raise RlxValueError(f"{what}: too many indices ({used}) for a value of rank {rank}")
    fill: list[object] = [slice(None)] * (rank - used)
    at = next((place for place, entry in enumerate(entries) if entry is Ellipsis), None)  # not ==: arrays
    if at is None:
        return [*entries, *fill], [*range(len(entries)), *[len(entries)] * len(fill)]
    return [*entries[:at], *fill, *entries[at + 1 :]], [*range(at), *[at] * len(fill), *range(at + 1, len(entries))]
