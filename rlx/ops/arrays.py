"""NumPy's array functions that models reach for, built from the registered ops (no op of their own).

``logsumexp``, ``pad``, ``flip``, ``roll``, ``tril`` and ``triu`` are what a NumPy or JAX user
writes (``jax.nn.logsumexp``, ``jnp.pad``, ...) and what the TorchDynamo translation maps torch's
functions of the same meaning onto: one definition each. Like :mod:`rlx.ops.composite`, each is
a few calls of the ops, so its shape rule, reference, gradient and lowering are theirs, and they
take symbolic lengths where the ops do: positions along an axis of a per-call length are a running
sum of ones (:func:`positions`), not a constant.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ops._common import as_value, is_int, normalize_axes, normalize_axis, require_float

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value
    from rlx.ir.types import Dim


def positions(graph: Graph, length: Dim) -> Value:
    """``arange(length)`` as int64: a constant for a static length, else a running sum of ones
    (its length is the call's)."""
    if isinstance(length, int):
        return graph.constant(np.arange(length, dtype=np.int64))
    return _ones_before(graph, length, reverse=False)


def _ones_before(graph: Graph, length: Dim, reverse: bool) -> Value:
    """For each of ``length`` places, how many come before it (after it, ``reverse``): int64."""
    one = graph.constant(np.ones((), np.int64))
    return graph.cumsum(graph.broadcast_to(one, (length,)), reverse=reverse) - one


def logsumexp(graph: Graph, x: object, axis: object = None, keepdims: bool = False) -> Value:
    """``jax.nn.logsumexp`` / ``scipy.special.logsumexp``: ``log(sum(exp(x)))`` over ``axis``,
    shifted by the maximum (which the gradient does not see: it cancels), so that nothing
    overflows; a slice of only ``-inf`` gives ``-inf``, not NaN, and a zero gradient. Its gradient
    is the softmax."""
    value = as_value(graph, x, "logsumexp: x")
    require_float("logsumexp", "x", value.type)
    axes = normalize_axes("logsumexp", axis, value.ndim)
    peak = graph.stop_gradient(graph.max(value, axis=axes, keepdims=True))
    shift = graph.where(graph.equal(peak, float("-inf")), 0.0, peak)
    summed = graph.sum(graph.exp(value - shift), axis=axes, keepdims=True)
    # An all -inf slice sums to 0: its log is -inf, taken from a 1 so that no 0/0 reaches the
    # gradient (torch's and JAX's give NaN there; this one gives 0, as attention's empty rows).
    empty = graph.equal(summed, 0.0)
    total = graph.where(empty, float("-inf"), graph.log(graph.where(empty, 1.0, summed)) + shift)
    return total if keepdims else graph.reshape(total, tuple(d for a, d in enumerate(value.shape) if a not in axes))


def pad(graph: Graph, x: object, pad_width: object, value: float | int | bool = 0) -> Value:
    """``numpy.pad(x, pad_width, constant_values=value)``: ``pad_width`` an int (every side of
    every axis), a ``(before, after)`` pair (every axis) or one pair per axis, non-negative;
    blocks of ``value`` (in ``x``'s dtype) concatenated on each side."""
    array = as_value(graph, x, "pad: x")
    widths = _pad_widths(pad_width, array.ndim)
    fill = graph.constant(np.array(value, dtype=array.dtype))
    for axis, (before, after) in enumerate(widths):
        head, tail = array.shape[:axis], array.shape[axis + 1 :]
        parts = [graph.broadcast_to(fill, (*head, before, *tail))] if before else []
        parts.append(array)
        if after:
            parts.append(graph.broadcast_to(fill, (*head, after, *tail)))
        if len(parts) > 1:
            array = graph.concat(parts, axis=axis)
    return array


def _pad_widths(pad_width: object, rank: int) -> list[tuple[int, int]]:
    def bad() -> RlxValueError:
        return RlxValueError(
            f"pad: pad_width must be an int, a (before, after) pair or {rank} such pairs of non-negative "
            f"ints, got {pad_width!r}"
        )

    # NumPy's forms, each made a list of pairs: n, (before, after), ((before, after),), one pair per axis
    if is_int(pad_width):
        pairs: object = [(pad_width, pad_width)]
    elif isinstance(pad_width, Sequence) and len(pad_width) == 2 and all(is_int(w) for w in pad_width):
        pairs = [pad_width]
    else:
        pairs = pad_width
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence) or len(pairs) not in (1, rank):
        raise bad()
    widths = []
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise bad()
        if not all(is_int(w) and w >= 0 for w in pair):
            raise bad()
        widths.append((int(pair[0]), int(pair[1])))
    return widths * rank if len(widths) == 1 else widths


def flip(graph: Graph, x: object, axis: object = None) -> Value:
    """``numpy.flip``: the entries along each named axis (every axis for None) in reverse order,
    gathered by reversed positions."""
    value = as_value(graph, x, "flip: x")
    for position in normalize_axes("flip", axis, value.ndim):
        length = value.shape[position]
        if length == 1:
            continue
        if isinstance(length, int):
            reversed_ids = graph.constant(np.arange(length - 1, -1, -1, dtype=np.int64))
        else:
            reversed_ids = _ones_before(graph, length, reverse=True)  # arange(length)[::-1]
        value = graph.take(value, reversed_ids, axis=position)
    return value


def roll(graph: Graph, x: object, shift: object, axis: object = None) -> Value:
    """``numpy.roll``: along each axis the entries moved ``shift`` places on, those that pass the
    end coming back at the start; without ``axis``, of the flattened value, reshaped back. A
    static length is two slices concatenated; a per-call one gathers at ``(i - shift) mod n``."""
    value = as_value(graph, x, "roll: x")
    shifts = [shift] if is_int(shift) else list(shift) if isinstance(shift, Sequence) else None
    if shifts is None or not all(is_int(s) for s in shifts):
        raise RlxTypeError(f"roll: shift must be an int or a tuple of ints, got {shift!r}")
    if axis is None:
        if len(shifts) != 1:
            raise RlxValueError(f"roll: without an axis, shift must be one int, got {shift!r}")
        flat = graph.reshape(value, (-1,))
        return graph.reshape(roll(graph, flat, shifts[0], 0), value.shape)
    axes = [axis] if is_int(axis) else list(axis) if isinstance(axis, Sequence) else None
    if axes is None:
        raise RlxTypeError(f"roll: axis must be an int, a tuple of ints or None, got {axis!r}")
    if len(shifts) == 1 and len(axes) > 1:
        shifts = shifts * len(axes)
    if len(shifts) != len(axes):
        raise RlxValueError(f"roll: {len(shifts)} shifts for {len(axes)} axes")
    for amount, named in zip(shifts, axes, strict=True):
        position = normalize_axis("roll", named, value.ndim)
        length = value.shape[position]
        before = (slice(None),) * position
        if isinstance(length, int):
            amount = int(amount) % length if length else 0
            if amount:
                tail, head = (
                    value[(*before, slice(length - amount, None))],
                    value[(*before, slice(None, length - amount))],
                )
                value = graph.concat([tail, head], axis=position)
            continue
        places = positions(graph, length)
        count = places[-1:] + graph.constant(np.ones((), np.int64))  # [n], the call's length
        sources = graph.remainder(places - graph.constant(np.array(int(amount), np.int64)), count)
        value = graph.take(value, sources, axis=position)
    return value


def tril(graph: Graph, x: object, k: int = 0) -> Value:
    """``numpy.tril``: ``x`` with the entries above its ``k``-th diagonal (of the last two axes)
    set to zero."""
    return _triangle(graph, x, k, lower=True)


def triu(graph: Graph, x: object, k: int = 0) -> Value:
    """``numpy.triu``: ``x`` with the entries below its ``k``-th diagonal set to zero."""
    return _triangle(graph, x, k, lower=False)


def _triangle(graph: Graph, x: object, k: int, lower: bool) -> Value:
    what = "tril" if lower else "triu"
    value = as_value(graph, x, f"{what}: x")
    if value.ndim < 2:
        raise RlxValueError(f"{what}: x must have rank >= 2 (its last two axes are the matrix), got {value.type}")
    if not is_int(k):
        raise RlxTypeError(f"{what}: k must be an int, got {type(k).__name__}")
    rows = graph.reshape(positions(graph, value.shape[-2]), (value.shape[-2], 1))
    columns = graph.reshape(positions(graph, value.shape[-1]), (1, value.shape[-1]))
    offset = columns - rows
    bound = graph.constant(np.array(int(k), np.int64))
    keep = graph.less_equal(offset, bound) if lower else graph.greater_equal(offset, bound)
    return graph.where(keep, value, graph.constant(np.zeros((), dtype=value.dtype)))


def isnan(graph: Graph, x: object) -> Value:
    """``numpy.isnan``: bool, True where ``x`` is NaN (never for int or bool values)."""
    value = as_value(graph, x, "isnan: x")
    if value.dtype != np.float32:
        return _filled(graph, value, False)
    return graph.not_equal(value, value)


def isinf(graph: Graph, x: object) -> Value:
    """``numpy.isinf``: bool, True where ``x`` is +inf or -inf."""
    value = as_value(graph, x, "isinf: x")
    if value.dtype != np.float32:
        return _filled(graph, value, False)
    return graph.equal(graph.abs(value), float("inf"))


def isfinite(graph: Graph, x: object) -> Value:
    """``numpy.isfinite``: bool, True where ``x`` is neither NaN nor infinite."""
    value = as_value(graph, x, "isfinite: x")
    if value.dtype != np.float32:
        return _filled(graph, value, True)
    return graph.logical_not(graph.logical_or(isnan(graph, value), isinf(graph, value)))


def _filled(graph: Graph, like: Value, flag: bool) -> Value:
    return graph.broadcast_to(graph.constant(np.array(flag)), like.shape)


def any_of(graph: Graph, x: object, axis: object = None, keepdims: bool = False) -> Value:
    """``numpy.any``: bool, whether some entry over ``axis`` is nonzero (True, or NaN); False
    over no entries."""
    return _truth(graph, x, axis, keepdims, "any")


def all_of(graph: Graph, x: object, axis: object = None, keepdims: bool = False) -> Value:
    """``numpy.all``: bool, whether every entry over ``axis`` is nonzero; True over no entries."""
    return _truth(graph, x, axis, keepdims, "all")


def _truth(graph: Graph, x: object, axis: object, keepdims: bool, what: str) -> Value:
    value = as_value(graph, x, f"{what}: x")
    axes = normalize_axes(what, axis, value.ndim)
    zero = graph.constant(np.zeros((), dtype=value.dtype))
    nonzero = value if value.dtype == np.bool_ else graph.not_equal(value, zero)
    flags = nonzero.astype("float32")
    if what == "any":  # the largest flag is 1 where one is; -inf over no entries
        return graph.greater(graph.max(flags, axis=axes, keepdims=keepdims), 0.0)
    return graph.greater(graph.min(flags, axis=axes, keepdims=keepdims), 0.0)  # +inf over no entries


def prod(graph: Graph, x: object, axis: object = None, keepdims: bool = False) -> Value:
    """``numpy.prod`` of float32 values over ``axis``: the last entry of a running product
    (``cumprod``, whose gradient is exact through zeros, as torch's ``prod``'s); 1 over no entries."""
    value = as_value(graph, x, "prod: x")
    require_float("prod", "x", value.type)
    axes = normalize_axes("prod", axis, value.ndim)
    kept = [a for a in range(value.ndim) if a not in axes]
    order = (*kept, *axes)
    front = graph.transpose(value, order) if order != tuple(range(value.ndim)) else value
    rows = graph.reshape(front, (*(value.shape[a] for a in kept), -1)) if len(axes) != 1 else front
    length = rows.shape[-1]
    if not isinstance(length, int) or length == 0:  # a leading 1: the product of no entries
        one = graph.broadcast_to(graph.constant(np.ones((), np.float32)), (*rows.shape[:-1], 1))
        rows = graph.concat([one, rows], axis=-1)
    last = graph.cumprod(rows, axis=-1)[..., -1]
    if not keepdims:
        return last
    return graph.reshape(last, tuple(1 if a in axes else value.shape[a] for a in range(value.ndim)))


def vector_norm(graph: Graph, x: object, ord: object = 2, axis: object = None, keepdims: bool = False) -> Value:
    """``torch.linalg.vector_norm`` (``numpy.linalg.norm`` of a vector): ``(sum |x|^p)^(1/p)``
    over ``axis`` (every axis for None), the largest or least ``|x|`` for ``inf``/``-inf``, the
    count of nonzeros for 0. At the origin the gradient is 0, as torch's, not 0/0."""
    value = as_value(graph, x, "vector_norm: x")
    require_float("vector_norm", "x", value.type)
    axes = normalize_axes("vector_norm", axis, value.ndim)
    if isinstance(ord, str) and ord in ("inf", "-inf"):
        ord = float(ord)
    if isinstance(ord, bool) or not isinstance(ord, (int, float, np.integer, np.floating)) or np.isnan(ord):
        raise RlxValueError(f"vector_norm: ord must be a number, inf or -inf, got {ord!r}")
    p = float(ord)
    size = graph.abs(value)
    if p == float("inf"):
        return graph.max(size, axis=axes, keepdims=keepdims)
    if p == float("-inf"):
        return graph.min(size, axis=axes, keepdims=keepdims)
    if p == 0:
        return graph.sum(graph.not_equal(value, 0.0).astype("float32"), axis=axes, keepdims=keepdims)
    if p == 1:
        return graph.sum(size, axis=axes, keepdims=keepdims)
    powered = graph.sum(value * value if p == 2 else graph.pow(size, p), axis=axes, keepdims=keepdims)
    return _root_at_origin(graph, powered, p)


def safe_sqrt(graph: Graph, squares: Value) -> Value:
    """``sqrt`` of a sum of squares whose gradient is 0 where the sum is (not ``inf * 0``), as
    torch's norms and distances have it at the origin; NaN stays NaN."""
    return _root_at_origin(graph, squares, 2.0)


def _root_at_origin(graph: Graph, powered: Value, p: float) -> Value:
    """``powered ** (1 / p)``, 0 with a 0 gradient where ``powered`` is 0."""
    zero = graph.equal(powered, 0.0)
    safe = graph.where(zero, 1.0, powered)
    return graph.where(zero, 0.0, graph.sqrt(safe) if p == 2 else graph.pow(safe, 1.0 / p))


def tensordot(graph: Graph, a: object, b: object, axes: object = 2) -> Value:
    """``numpy.tensordot``: ``axes`` an int ``N`` (the last ``N`` axes of ``a`` with the first
    ``N`` of ``b``) or a pair of axis sequences; an :func:`rlx.ops.einsum.einsum`."""
    from rlx.ops.einsum import einsum

    left, right = as_value(graph, a, "tensordot: a"), as_value(graph, b, "tensordot: b")
    if is_int(axes):
        count = int(axes)
        if not 0 <= count <= min(left.ndim, right.ndim):
            raise RlxValueError(f"tensordot: axes={count} for operands of rank {left.ndim} and {right.ndim}")
        pairs = (list(range(left.ndim - count, left.ndim)), list(range(count)))
    elif isinstance(axes, Sequence) and len(axes) == 2:
        pairs = tuple([x] if is_int(x) else list(x) for x in axes)  # type: ignore[assignment]
        if len(pairs[0]) != len(pairs[1]):
            raise RlxValueError(f"tensordot: {len(pairs[0])} axes of a against {len(pairs[1])} of b")
        pairs = (
            [normalize_axis("tensordot", i, left.ndim) for i in pairs[0]],
            [normalize_axis("tensordot", i, right.ndim) for i in pairs[1]],
        )
    else:
        raise RlxTypeError(f"tensordot: axes must be an int or a pair of axis sequences, got {axes!r}")
    if left.ndim + right.ndim > len(string.ascii_letters):
        raise RlxValueError(f"tensordot: more than {len(string.ascii_letters)} axes in all")
    letters = iter(string.ascii_letters)
    a_labels = [next(letters) for _ in range(left.ndim)]
    b_labels = [next(letters) for _ in range(right.ndim)]
    for i, j in zip(pairs[0], pairs[1], strict=True):
        b_labels[j] = a_labels[i]
    out = [c for i, c in enumerate(a_labels) if i not in pairs[0]] + [
        c for j, c in enumerate(b_labels) if j not in pairs[1]
    ]
    return einsum(graph, f"{''.join(a_labels)},{''.join(b_labels)}->{''.join(out)}", left, right)
