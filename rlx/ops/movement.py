"""Ops that only move elements: ``reshape``, ``transpose``, ``split``, ``concat``, ``broadcast_to``,
``unfold``.

They work on any dtype. In compiled code they are strided views wherever the strides allow.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.dims import SizeLike, dim_text, exact_quotient, poly, product, total
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import Dim, TensorType
from rlx.ops._batching import batch_moving_axes, to_rank
from rlx.ops._common import (
    as_value,
    dim_tuple,
    expand_ellipsis,
    int_tuple,
    is_int,
    normalize_axis,
    op_kind,
    sum_to_shape,
    zeros,
)

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class ShapeAttrs:
    shape: tuple[Dim, ...]


@dataclass(frozen=True)
class PermAttrs:
    perm: tuple[int, ...]


@dataclass(frozen=True)
class SplitAttrs:
    axis: int  # non-negative
    sizes: tuple[Dim, ...]  # symbolic where the axis is: ("P", 1) of an axis "P+1"


@dataclass(frozen=True)
class ConcatAttrs:
    axis: int  # non-negative


@dataclass(frozen=True)
class UnfoldAttrs:
    axis: int  # non-negative
    size: int  # entries per window
    step: int  # between the starts of neighbouring windows


# ----------------------------------------------------------------------------- reshape


def _reshape_infer(what: str, inputs: Sequence[TensorType], attrs: ShapeAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    shape = dim_tuple(what, "shape", attrs.shape)
    if any(isinstance(d, int) and d < 1 for d in shape):
        raise RlxValueError(f"{what}: every dimension must be >= 1, got shape {shape}")
    if product(shape) != product(x.shape):  # equal polynomials have one canonical form
        raise RlxValueError(
            f"{what}: cannot reshape {x} ({_count(x.shape)} elements) to {list(shape)} ({_count(shape)} elements)"
        )
    return (TensorType(shape, x.dtype),)


def _count(shape: Sequence[Dim]) -> str:
    count = product(shape)
    return str(count) if isinstance(count, int) or len(count.terms) == 1 else f"({count})"


def _missing_dim(old: Sequence[Dim], known: Sequence[Dim]) -> Dim | None:
    """The dimension a reshape's -1 stands for: the element count of ``old`` over that of
    ``known``, if it divides exactly. Dimensions the two shapes share cancel first, so a sum such
    as ``P+1`` (which no monomial divides) carries through ``(B, P+1, 4, 64) -> (B, P+1, -1)``."""
    rest = Counter(old)
    unmatched = []
    for dim in known:
        if rest[dim] > 0:
            rest[dim] -= 1
        else:
            unmatched.append(dim)
    quotient = exact_quotient(product(rest.elements()), product(unmatched))
    if quotient is None or (isinstance(quotient, int) and quotient < 1):
        return None
    return dim_text(quotient)


def reshape(graph: Graph, x: object, shape: Sequence[int | str]) -> Value:
    """As ``numpy.reshape`` (row-major); one entry may be -1. A symbolic dimension of ``x`` (see
    ``g.input``) may appear in ``shape`` by name, or be merged with other axes: ``(2, N, 4)`` to
    ``(-1, 4)`` gives ``(2*N, 4)``, and ``(2*N, 4)`` to ``(2, N, 4)`` splits it again."""
    value = as_value(graph, x, "reshape: x")
    dims: list[Dim] = list(dim_tuple("reshape", "shape", shape))
    if dims.count(-1) > 1:
        raise RlxValueError(f"reshape: at most one -1 is allowed, got {tuple(dims)}")
    if -1 in dims:
        missing = _missing_dim(value.shape, [d for d in dims if d != -1])
        if missing is None or any(isinstance(d, int) and d < 1 for d in dims if d != -1):
            raise RlxValueError(
                f"reshape: cannot reshape {value.type} ({_count(value.shape)} elements) to {tuple(dims)}"
            )
        dims[dims.index(-1)] = missing
    return graph.add_node(op_kind("reshape"), [value], ShapeAttrs(tuple(dims))).outputs[0]


def _reshape_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    assert cts[0] is not None
    return [graph.reshape(cts[0], node.inputs[0].shape)]


# ----------------------------------------------------------------------------- transpose


def _transpose_infer(what: str, inputs: Sequence[TensorType], attrs: PermAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    perm = int_tuple(what, "axes", attrs.perm)
    if sorted(perm) != list(range(x.rank)):
        raise RlxValueError(f"{what}: axes {perm} is not a permutation of the {x.rank} axes of {x}")
    return (TensorType(tuple(x.shape[a] for a in perm), x.dtype),)


def transpose(graph: Graph, x: object, axes: Sequence[int] | None = None) -> Value:
    """As ``numpy.transpose``: ``axes`` a permutation (negative entries allowed); None reverses."""
    value = as_value(graph, x, "transpose: x")
    rank = len(value.shape)
    perm = tuple(reversed(range(rank))) if axes is None else int_tuple("transpose", "axes", axes)
    perm = tuple(a % rank if -rank <= a < rank else a for a in perm) if rank else perm
    return graph.add_node(op_kind("transpose"), [value], PermAttrs(perm)).outputs[0]


def _transpose_grad(
    graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    assert cts[0] is not None
    return [graph.transpose(cts[0], tuple(int(a) for a in np.argsort(node.attrs.perm)))]


# ----------------------------------------------------------------------------- split / concat


def _split_infer(what: str, inputs: Sequence[TensorType], attrs: SplitAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    if x.rank == 0 or not 0 <= attrs.axis < x.rank:
        raise RlxValueError(f"{what}: axis {attrs.axis} is out of range for {x}")
    sizes = dim_tuple(what, "sizes", attrs.sizes)
    if not sizes or any(isinstance(s, int) and s < 1 for s in sizes) or total(sizes) != poly(x.shape[attrs.axis]):
        raise RlxValueError(
            f"{what}: sizes {sizes} must be >= 1 and add up to {x.shape[attrs.axis]} (axis {attrs.axis} of {x})"
        )
    shape = list(x.shape)
    types = []
    for size in sizes:
        shape[attrs.axis] = size
        types.append(TensorType(tuple(shape), x.dtype))
    return tuple(types)


def split(graph: Graph, x: object, n: int | Sequence[int | str], axis: int = -1) -> tuple[Value, ...]:
    """``n`` equal parts along ``axis`` (or parts of the given sizes); always a tuple.

    Along a symbolic axis the sizes are symbolic too: an axis ``P+1`` splits into ``("P", 1)``,
    and ``n`` equal parts need a length that ``n`` divides for every size of its symbols
    (``2*N`` in two parts of ``N``)."""
    value = as_value(graph, x, "split: x")
    if value.shape == ():
        raise RlxValueError("split: x must have at least one axis, got a scalar")
    ax = normalize_axis("split", axis, len(value.shape))
    length = value.shape[ax]
    sizes: tuple[Dim, ...]
    if isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)):
        part = exact_quotient(poly(length), int(n)) if n >= 1 else None
        if part is None or (isinstance(part, int) and part < 1):
            raise RlxValueError(
                f"split: axis {axis} of {value.type} has size {length}, which {n} parts cannot share equally"
            )
        sizes = (dim_text(part),) * int(n)
    elif isinstance(n, Sequence) and not isinstance(n, (str, bytes)):
        sizes = dim_tuple("split", "sizes", n)
    else:
        raise RlxTypeError(f"split: n must be an int or a sequence of sizes, got {type(n).__name__}")
    return graph.add_node(op_kind("split"), [value], SplitAttrs(ax, sizes)).outputs


def _split_reference(args: Sequence[np.ndarray], attrs: SplitAttrs, ctx: EvalContext) -> tuple[np.ndarray, ...]:
    return tuple(np.split(args[0], np.cumsum(ctx.resolve(attrs.sizes))[:-1], axis=attrs.axis))


def _split_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    parts = [ct if ct is not None else zeros(graph, out.shape) for ct, out in zip(cts, node.outputs, strict=True)]
    return [parts[0] if len(parts) == 1 else graph.concat(parts, axis=node.attrs.axis)]


def _concat_infer(what: str, inputs: Sequence[TensorType], attrs: ConcatAttrs) -> tuple[TensorType, ...]:
    first = inputs[0]
    if first.rank == 0 or not 0 <= attrs.axis < first.rank:
        raise RlxValueError(f"{what}: axis {attrs.axis} is out of range for {first}")
    for i, ty in enumerate(inputs[1:], start=1):
        if ty.dtype != first.dtype:
            raise RlxTypeError(f"{what}: part {i} is {ty}, but part 0 is {first}: the dtypes differ")
        others = [d for a, d in enumerate(ty.shape) if a != attrs.axis]
        if ty.rank != first.rank or others != [d for a, d in enumerate(first.shape) if a != attrs.axis]:
            raise RlxValueError(f"{what}: part {i} {ty} does not match part 0 {first} except along axis {attrs.axis}")
    shape = list(first.shape)
    shape[attrs.axis] = dim_text(total(ty.shape[attrs.axis] for ty in inputs))  # a cache "P" and a row: "P+1"
    return (TensorType(tuple(shape), first.dtype),)


def concat(graph: Graph, parts: Sequence[object], axis: int = 0) -> Value:
    """As ``numpy.concatenate``: parts agree except along ``axis``."""
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence):
        raise RlxTypeError(f"concat: parts must be a list of Values, got {type(parts).__name__}")
    if not parts:
        raise RlxValueError("concat: need at least one part to concatenate")  # NumPy's ValueError
    values = [as_value(graph, p, f"concat: part {i}") for i, p in enumerate(parts)]
    if values[0].shape == ():
        raise RlxValueError("concat: parts must have at least one axis, got a scalar")
    ax = normalize_axis("concat", axis, len(values[0].shape))
    return graph.add_node(op_kind("concat"), values, ConcatAttrs(ax)).outputs[0]


def _concat_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    assert cts[0] is not None
    sizes = [v.shape[node.attrs.axis] for v in node.inputs]
    if len(sizes) == 1:
        return [cts[0]]
    return list(graph.split(cts[0], sizes, axis=node.attrs.axis))


# ----------------------------------------------------------------------------- broadcast_to


def _broadcast_infer(what: str, inputs: Sequence[TensorType], attrs: ShapeAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    shape = dim_tuple(what, "shape", attrs.shape)
    lead = len(shape) - x.rank
    if (
        lead < 0
        or any(isinstance(d, int) and d < 1 for d in shape)
        or any(size not in (1, shape[lead + i]) for i, size in enumerate(x.shape))
    ):
        raise RlxValueError(f"{what}: cannot broadcast {x} to {list(shape)}")
    return (TensorType(shape, x.dtype),)


def broadcast_to(graph: Graph, x: object, shape: Sequence[int | str]) -> Value:
    """As ``numpy.broadcast_to`` (``shape`` may name symbolic dimensions)."""
    value = as_value(graph, x, "broadcast_to: x")
    return graph.add_node(
        op_kind("broadcast_to"), [value], ShapeAttrs(dim_tuple("broadcast_to", "shape", shape))
    ).outputs[0]


def _broadcast_grad(
    graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    assert cts[0] is not None
    if node.inputs[0].dtype != np.float32:
        return [None]
    return [sum_to_shape(graph, cts[0], node.inputs[0].shape)]


def _float_only(grad):  # type: ignore[no-untyped-def]
    """Int and bool tensors move through these ops too; only float ones carry gradients."""

    def rule(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> Sequence[Value | None]:
        if node.inputs[0].dtype != np.float32:
            return [None] * len(node.inputs)
        return grad(graph, node, cts, needed)

    return rule


def _batch_reshape(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> Sequence[Value]:
    return (graph.reshape(operands[0], (size, *node.attrs.shape)),)


def _batch_transpose(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> Sequence[Value]:
    return (graph.transpose(operands[0], (0, *(axis + 1 for axis in node.attrs.perm))),)


def _batch_broadcast(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> Sequence[Value]:
    shape = node.attrs.shape
    return (graph.broadcast_to(to_rank(graph, operands[0], len(shape)), (size, *shape)),)


register_op(
    OpDef(
        "reshape",
        ("x",),
        ShapeAttrs,
        _reshape_infer,
        lambda args, attrs, ctx: np.reshape(args[0], ctx.resolve(attrs.shape)),
        _float_only(_reshape_grad),
        builder=reshape,
        batch=_batch_reshape,
        view=True,
    )
)
register_op(
    OpDef(
        "transpose",
        ("x",),
        PermAttrs,
        _transpose_infer,
        lambda args, attrs, ctx: np.transpose(args[0], attrs.perm),
        _float_only(_transpose_grad),
        builder=transpose,
        batch=_batch_transpose,
        view=True,
    )
)
register_op(
    OpDef(
        "split",
        ("x",),
        SplitAttrs,
        _split_infer,
        _split_reference,
        _float_only(_split_grad),
        builder=split,
        view=True,
        batch=batch_moving_axes("axis"),
    )
)
register_op(
    OpDef(
        "concat",
        ("parts*",),
        ConcatAttrs,
        _concat_infer,
        lambda args, attrs, ctx: np.concatenate(args, axis=attrs.axis),
        _float_only(_concat_grad),
        builder=concat,
        batch=batch_moving_axes("axis"),
        view=True,
    )
)
register_op(
    OpDef(
        "broadcast_to",
        ("x",),
        ShapeAttrs,
        _broadcast_infer,
        lambda args, attrs, ctx: np.broadcast_to(args[0], ctx.resolve(attrs.shape)),
        _broadcast_grad,
        builder=broadcast_to,
        batch=_batch_broadcast,
        view=True,
    )
)


# ----------------------------------------------------------------------------- unfold


def _unfold_infer(what: str, inputs: Sequence[TensorType], attrs: UnfoldAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    if not 0 <= attrs.axis < x.rank:
        raise RlxValueError(f"{what}: axis {attrs.axis} is out of range for {x}")
    length = x.shape[attrs.axis]
    if not isinstance(length, int):
        raise RlxValueError(f"{what}: axis {attrs.axis} of {x} must have a static size to unfold, got {length!r}")
    if not (is_int(attrs.size) and is_int(attrs.step)) or attrs.size < 1 or attrs.step < 1:
        raise RlxValueError(f"{what}: size and step must be ints >= 1, got size {attrs.size!r}, step {attrs.step!r}")
    if attrs.size > length:
        raise RlxValueError(f"{what}: a window of {attrs.size} does not fit axis {attrs.axis} of {x} (size {length})")
    shape = list(x.shape)
    shape[attrs.axis] = (length - attrs.size) // attrs.step + 1
    return (TensorType((*shape, attrs.size), x.dtype),)


def _unfold_reference(args: Sequence[np.ndarray], attrs: UnfoldAttrs, ctx: EvalContext) -> np.ndarray:
    windows = np.lib.stride_tricks.sliding_window_view(args[0], attrs.size, axis=attrs.axis)
    index = [slice(None)] * windows.ndim
    index[attrs.axis] = slice(None, None, attrs.step)
    return np.ascontiguousarray(windows[tuple(index)])


def unfold(graph: Graph, x: object, axis: int, size: int, step: int = 1) -> Value:
    """``torch.Tensor.unfold(axis, size, step)``: every window of ``size`` entries along ``axis``,
    ``step`` apart, as a new last axis; ``axis`` then counts the windows, ``(L - size) // step +
    1``. ``out[..., j, ..., i] = x[..., j * step + i, ...]``. Windows overlap where ``step <
    size``: compiled, the result is a strided view of ``x``'s buffer (a window's entry and the
    next window share a stride), as NumPy's ``sliding_window_view``, so it costs nothing until
    something copies it (a ViT's patch matrix, in one loop nest)."""
    value = as_value(graph, x, "unfold: x")
    position = normalize_axis("unfold", axis, len(value.shape))
    for label, number in (("size", size), ("step", step)):
        if not is_int(number):
            raise RlxTypeError(f"unfold: {label} must be an int, got {type(number).__name__}")
    return graph.add_node(op_kind("unfold"), [value], UnfoldAttrs(position, int(size), int(step))).outputs[0]


def _unfold_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """Each window entry came from ``x[j * step + i]``: its cotangent is added back there, one
    scatter-add along the axis (windows that overlap add up)."""
    from rlx.ops.gather import scatter_add_along_axis

    dy = cts[0]
    assert dy is not None
    attrs: UnfoldAttrs = node.attrs
    axis, rank = attrs.axis, len(dy.shape)
    windows = int(dy.shape[axis])  # type: ignore[call-overload]
    # [..., n, ..., size] -> [..., n, size, ...] -> [..., n * size, ...]
    perm = (*range(axis + 1), rank - 1, *range(axis + 1, rank - 1))
    moved = graph.transpose(dy, perm)
    shape = list(moved.shape)
    flat_shape = (*shape[:axis], windows * attrs.size, *shape[axis + 2 :])
    flat = graph.reshape(moved, flat_shape)
    positions = (np.arange(windows)[:, None] * attrs.step + np.arange(attrs.size)[None, :]).reshape(-1)
    ids_shape = [1] * len(flat_shape)
    ids_shape[axis] = windows * attrs.size
    ids = graph.broadcast_to(graph.constant(positions.astype(np.int32).reshape(ids_shape)), flat_shape)
    return [scatter_add_along_axis(graph, flat, ids, axis, node.inputs[0].shape[axis])]


register_op(
    OpDef(
        "unfold",
        ("x",),
        UnfoldAttrs,
        _unfold_infer,
        _unfold_reference,
        _float_only(_unfold_grad),
        builder=unfold,
        batch=batch_moving_axes("axis"),
        view=True,
        summary="every window of size entries along an axis, step apart (torch's Tensor.unfold)",
    )
)


# ----------------------------------------------------------------------------- basic indexing


def getitem(graph: Graph, x: Value, index: object) -> Value:
    """``x[index]`` with NumPy's basic indexing: ints, slices (any step), ``...`` and ``None``.

    Built from ``split`` and ``reshape``, so it is a view once compiled and its gradient is
    ``split``'s (the part's cotangent placed among zeros). A slice with a step (``x[..., ::2]``,
    ``x[..., 1::2]``, as interleaved rotary embeddings take them) is a view too where its elements
    fit in whole groups of ``step`` (see :func:`_strided`); a negative step gathers (``take``).
    An int indexes from the end when negative and must be in range (NumPy's ``IndexError``, as
    an ``RlxValueError``); slice bounds are clamped, as in NumPy. Along a symbolic axis of
    length ``S`` the bounds are symbolic too: ``x[:, -1]`` is the part at ``S-1``, ``x[:, 1:]``
    has length ``S-1`` (next-token targets), ``x[:, :-1]`` too; a call whose ``S`` is too short
    for them (an index or a bound past the end, which NumPy would clamp) is an ``RlxValueError``
    before anything runs. An index holding arrays or int values is NumPy's advanced indexing: see
    :mod:`rlx.ops.advanced_index`.
    """
    entries = list(index) if isinstance(index, tuple) else [index]
    from rlx.ops.advanced_index import advanced_getitem, is_array_index

    if any(is_array_index(entry) for entry in entries):
        return advanced_getitem(graph, x, tuple(entries))
    for entry in entries:
        if not (entry is None or entry is Ellipsis or isinstance(entry, slice) or is_int(entry)):
            raise RlxTypeError(
                f"indexing {x.type}: only ints, slices, ..., None, int arrays and int values index a value, "
                f"got {type(entry).__name__}"
            )
    entries, _ = expand_ellipsis(f"indexing {x.type}", entries, x.ndim)
    value, axis = x, 0
    shape: list[Dim | None] = []  # the result's dims, None where an int dropped the axis
    for entry in entries:
        if entry is None:
            shape.append(1)
            continue
        length = value.shape[axis]
        if isinstance(entry, slice) and entry.step not in (None, 1):
            value = _strided(graph, x, value, axis, entry)
            shape.append(value.shape[axis])
            axis += 1
            continue
        bounds = _bounds(x, axis, length, entry)
        if bounds is not None:
            start, stop = bounds
            pieces = [start, stop - start, poly(length) - stop]
            sizes = [dim_text(piece) for piece in pieces if piece != 0]
            value = split(graph, value, sizes, axis=axis)[0 if start == 0 else 1]
        shape.append(None if is_int(entry) else value.shape[axis])
        axis += 1
    result_shape = tuple(d for d in shape if d is not None)
    return value if result_shape == value.shape else reshape(graph, value, result_shape)


def _bounds(x: Value, axis: int, length: Dim, entry: object) -> tuple[SizeLike, SizeLike] | None:
    """``[start, stop)`` that ``entry`` (an int or a slice) takes along an axis of ``length``;
    None where it takes the whole axis."""
    if isinstance(length, str):
        return _symbolic_bounds(x, axis, length, entry)
    if is_int(entry):
        position = int(entry)
        if not -length <= position < length:
            raise RlxValueError(
                f"indexing {x.type}: index {position} is out of bounds for axis {axis} of size {length}"
            )
        position %= length
        return None if length == 1 else (position, position + 1)
    assert isinstance(entry, slice)
    for bound in (entry.start, entry.stop):
        if bound is not None and not is_int(bound):
            raise RlxTypeError(f"indexing {x.type}: slice bounds must be ints, got {type(bound).__name__}")
    start, stop, _ = entry.indices(length)
    if stop <= start:
        raise RlxValueError(
            f"indexing {x.type}: {entry} takes nothing from axis {axis} of size {length} (rlx has no empty values)"
        )
    return None if (start, stop) == (0, length) else (start, stop)


def _symbolic_bounds(x: Value, axis: int, length: str, entry: object) -> tuple[SizeLike, SizeLike] | None:
    """:func:`_bounds` along a symbolic axis: a negative index or bound counts from the end
    (``S-1``); the parts before and after must be sizes for every long enough ``S`` (a symbol
    term never negative), and the call checks that ``S`` is long enough (``rlx.bind.short_dims``)."""
    end = poly(length)

    def position(bound: object, default: SizeLike) -> SizeLike:
        if bound is None:
            return default
        if not is_int(bound):
            raise RlxTypeError(f"indexing {x.type}: slice bounds must be ints, got {type(bound).__name__}")
        return end + int(bound) if int(bound) < 0 else int(bound)  # type: ignore[call-overload]

    if is_int(entry):
        start = position(entry, 0)
        stop = start + 1
    else:
        assert isinstance(entry, slice)
        start, stop = position(entry.start, 0), position(entry.stop, end)
    taken = stop - start
    if isinstance(taken, int) and taken <= 0:
        raise RlxValueError(f"indexing {x.type}: {entry} takes nothing from axis {axis} (rlx has no empty values)")
    if not isinstance(taken, int) and any(c < 0 for monomial, c in taken.terms if monomial):
        raise RlxValueError(
            f"indexing {x.type}: {entry} along axis {axis} of symbolic length {length} takes a part of length "
            f"{taken}, which shrinks as the axis grows (a bound from the end and a larger one from the start)"
        )
    return None if (start == 0 and stop == end) else (start, stop)


def _strided(graph: Graph, x: Value, value: Value, axis: int, entry: slice) -> Value:
    """``value`` sliced by ``entry`` (a step other than 1) along ``axis``; other axes unchanged.

    The taken elements ``first, first + step, ...`` are one column of a ``(count, step)`` grid
    over a part of the axis: the part ``[first, first + count*step)`` with the column 0, or,
    where that runs past the end, ``[first - step + 1, last + 1)`` with the last column. Both are
    a split, a reshape and a split: views, whose gradient places the cotangent on exactly the
    taken elements. Where neither part fits (``x[::3]`` of 5), the last element is concatenated
    to the rest. A negative step reverses, which no strided view of rlx's plans expresses: the
    elements are gathered (``take``, ``embedding``'s rows), and a float gradient scatters back.
    """
    length = value.shape[axis]
    for bound in (entry.start, entry.stop, entry.step):
        if bound is not None and not is_int(bound):
            raise RlxTypeError(f"indexing {x.type}: slice bounds and steps must be ints, got {type(bound).__name__}")
    if entry.step == 0:
        raise RlxValueError(f"indexing {x.type}: slice step cannot be zero")
    if not isinstance(length, int):
        raise RlxValueError(
            f"indexing {x.type}: {entry} along axis {axis} of symbolic length {length} takes one element in "
            f"{abs(int(entry.step))}, a count that is not a polynomial in the axis length; "
            "only steps of 1 slice a symbolic axis"
        )
    taken = range(*entry.indices(length))
    if not taken:
        raise RlxValueError(
            f"indexing {x.type}: {entry} takes nothing from axis {axis} of size {length} (rlx has no empty values)"
        )
    if len(taken) == 1:
        return _part(graph, value, axis, taken[0], 1)
    step = taken.step
    if step < 0:
        from rlx.ops.composite import take

        return take(graph, value, graph.constant(np.asarray(list(taken), np.int64)), axis)
    first, last, count = taken[0], taken[-1], len(taken)
    if first + count * step <= length:
        grid = _part(graph, value, axis, first, count * step)
        return _column(graph, grid, axis, count, step, 0)
    if first >= step - 1:
        grid = _part(graph, value, axis, first - step + 1, count * step)
        return _column(graph, grid, axis, count, step, step - 1)
    rest = _strided(graph, x, value, axis, slice(first, last, step))
    return concat(graph, [rest, _part(graph, value, axis, last, 1)], axis)


def _part(graph: Graph, value: Value, axis: int, start: int, size: int) -> Value:
    """``value``'s elements ``[start, start + size)`` along a static ``axis``: a split."""
    length = value.shape[axis]
    assert isinstance(length, int) and start >= 0 and start + size <= length
    if size == length:
        return value
    sizes = [piece for piece in (start, size, length - start - size) if piece]
    return split(graph, value, sizes, axis=axis)[0 if start == 0 else 1]


def _column(graph: Graph, grid: Value, axis: int, count: int, step: int, column: int) -> Value:
    """Column ``column`` of ``grid``'s ``axis`` read as ``(count, step)``, that axis now ``count``."""
    shape = grid.shape
    rows = reshape(graph, grid, (*shape[:axis], count, step, *shape[axis + 1 :]))
    picked = _part(graph, rows, axis + 1, column, 1)
    return reshape(graph, picked, (*shape[:axis], count, *shape[axis + 1 :]))
