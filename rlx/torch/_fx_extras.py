"""More torch calls of a TorchDynamo graph, each as rlx ops: padding modes, vector norms and
distances, a few activations, losses and tensor utilities (see :mod:`rlx.torch._fx_calls`, whose
tables include these).

Each follows torch's definition, including its gradient where the plain composition would give
another (``cdist`` at a zero distance, ``sign``), and raises :class:`Unsupported` for what it
does not cover, so that the graph runs eagerly rather than computing something else.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rlx.ir.graph import Graph, Value
from rlx.ops.arrays import safe_sqrt
from rlx.torch._fx_calls import (
    Unsupported,
    _axis_args,
    _float,
    _gather_elements,
    _promoted,
    _reduced,
    _static_length,
    _transpose,
    _value,
    check_kwargs,
    variance_arguments,
)

# ----------------------------------------------------------------------------- padding


def pad_indices(length: int, before: int, after: int, mode: str) -> np.ndarray:
    """Which entry of an axis of ``length`` each padded position reads, as torch's ``reflect``
    (mirrored without repeating the edge), ``replicate`` (the edge repeated) and ``circular``
    (wrapped around); negative pads crop."""
    positions = np.arange(-before, length + after)
    if mode == "replicate":
        return np.clip(positions, 0, length - 1)
    if mode == "circular":
        if before > length or after > length:
            raise Unsupported(f"circular padding by more than the axis ({before}, {after} of {length})")
        return positions % length
    if before >= length or after >= length:
        raise Unsupported(f"reflect padding of {length} entries by ({before}, {after}): torch needs less than the axis")
    period = 2 * (length - 1) if length > 1 else 1
    folded = np.abs(positions) % period
    return np.where(folded < length, folded, period - folded)


def padded(g: Graph, x: Any, pad: Sequence[int], mode: str) -> Value:
    """``F.pad`` in the modes ``reflect``, ``replicate`` and ``circular``: each padded axis (from
    the last backwards, ``(left, right, top, bottom, ...)``) gathers the entries it reads."""
    value = _float(x)
    if len(pad) % 2 or len(pad) // 2 > value.ndim or not all(type(p) is int for p in pad):
        raise Unsupported(f"pad {tuple(pad)} of a {value.ndim}-d tensor")
    for pair in range(len(pad) // 2):
        axis = value.ndim - 1 - pair
        before, after = pad[2 * pair], pad[2 * pair + 1]
        if before == after == 0:
            continue
        length = _static_length(value, axis, f"{mode} padding")
        value = g.take(value, g.constant(pad_indices(length, before, after, mode)), axis=axis)
    return value


# ----------------------------------------------------------------------------- elementwise


def sign(g: Graph, x: Any) -> Value:
    """``torch.sign``: 1, -1 or 0 (NaN gives 0, as torch's), with no gradient."""
    value = _float(x)
    return g.where(g.greater(value, 0.0), 1.0, g.where(g.less(value, 0.0), -1.0, 0.0))


def nan_to_num(g: Graph, x: Any, nan: float = 0.0, posinf: float | None = None, neginf: float | None = None) -> Value:
    """``torch.nan_to_num``: NaN, +inf and -inf replaced (by default with 0 and float32's extremes)."""
    value = _float(x)
    top = float(np.finfo(np.float32).max) if posinf is None else float(posinf)
    bottom = float(np.finfo(np.float32).min) if neginf is None else float(neginf)
    value = g.where(g.not_equal(value, value), float(nan), value)
    value = g.where(g.equal(value, float("inf")), top, value)
    return g.where(g.equal(value, float("-inf")), bottom, value)


def prelu(g: Graph, x: Any, weight: Any) -> Value:
    """``F.prelu``: ``x`` where positive, else ``weight * x``, one weight per channel (axis 1) or
    one for all."""
    value, slope = _float(x), _float(weight)
    if slope.ndim != 1:
        raise Unsupported(f"prelu weight of shape {slope.shape}")
    if slope.shape[0] != 1:
        if value.ndim < 2 or value.shape[1] != slope.shape[0]:
            raise Unsupported(f"prelu of {value.shape} with {slope.shape[0]} weights")
        slope = g.reshape(slope, (slope.shape[0], *(1,) * (value.ndim - 2)))
    return g.where(g.greater(value, 0.0), value, value * slope)


def lerp(g: Graph, start: Any, end: Any, weight: Any) -> Value:
    """``torch.lerp``: ``start + weight * (end - start)``."""
    a, b = _promoted(g, _value(g, start), _value(g, end))
    return a + _value(g, weight) * (b - a)


def addcmul(g: Graph, x: Any, a: Any, b: Any, *, value: float = 1.0) -> Value:
    """``torch.addcmul``: ``x + value * a * b``."""
    return _value(g, x) + _value(g, a) * _value(g, b) * float(value)


def addcdiv(g: Graph, x: Any, a: Any, b: Any, *, value: float = 1.0) -> Value:
    """``torch.addcdiv``: ``x + value * a / b``."""
    return _value(g, x) + _value(g, a) / _value(g, b) * float(value)


def _shrink(hard: bool) -> Callable[..., Any]:
    """``F.hardshrink`` (``x`` outside ``[-lambd, lambd]``, else 0) and ``F.softshrink`` (moved
    toward 0 by ``lambd``)."""

    def handler(g: Graph, x: Any, lambd: float = 0.5) -> Value:
        value = _float(x)
        outside = g.greater(g.abs(value), float(lambd))
        if hard:
            return g.where(outside, value, 0.0)
        return g.where(outside, value - sign(g, value) * float(lambd), 0.0)

    return handler


def _threshold(g: Graph, x: Any, threshold: float, value: float) -> Value:
    """``F.threshold``: ``x`` where above ``threshold``, else ``value``."""
    return g.where(g.greater(_float(x), float(threshold)), x, float(value))


def frac(g: Graph, x: Any) -> Value:
    """``torch.frac``: ``x - trunc(x)`` (gradient 1: trunc has none)."""
    return _float(x) - g.trunc(x)


ACTIVATIONS: dict[Any, Callable[..., Any]] = {
    F.selu: lambda g, x, inplace=False: g.selu(_float(x)),
    F.celu: lambda g, x, alpha=1.0, inplace=False: g.celu(_float(x), alpha),
    F.softsign: lambda g, x: g.softsign(_float(x)),
    F.tanhshrink: lambda g, x: _float(x) - g.tanh(x),
    F.hardshrink: _shrink(hard=True),
    F.softshrink: _shrink(hard=False),
    F.threshold: lambda g, x, threshold, value, inplace=False: _threshold(g, x, threshold, value),
    torch.threshold: _threshold,
    F.rrelu: lambda g, x, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False: _rrelu(
        g, x, lower, upper, training
    ),
    F.prelu: prelu,
}


def _rrelu(g: Graph, x: Any, lower: float, upper: float, training: bool) -> Value:
    """``F.rrelu`` in evaluation: a leaky ReLU of slope ``(lower + upper) / 2`` (training draws
    slopes at random: left to torch)."""
    if training:
        raise Unsupported("rrelu while training (random slopes)")
    value = _float(x)
    return g.where(g.greater_equal(value, 0.0), value, value * ((lower + upper) / 2))


# ----------------------------------------------------------------------------- norms, distances


def vector_norm(g: Graph, x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Value:
    """``torch.linalg.vector_norm``: ``g.vector_norm`` (a NaN entry gives NaN; the origin a 0
    gradient, as torch's)."""
    if dtype is not None:
        raise Unsupported("vector_norm with a dtype")
    return g.vector_norm(_float(x), ord, _axis_args(dim), keepdim)


def norm(g: Graph, x: Any, ord: Any = None, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Value:
    """``torch.linalg.norm``: a vector norm over one axis (or of a 1-d tensor, or over all axes
    with neither ``ord`` nor ``dim``), else a matrix norm over two axes (:func:`matrix_norm`)."""
    value = _float(x)
    axes = _axis_args(dim)
    if ord is None or ord == "fro":
        if ord == "fro" and not (axes is None or (isinstance(axes, tuple) and len(axes) == 2)):
            raise Unsupported(f"the Frobenius norm over {axes}")
        return vector_norm(g, value, 2, axes, keepdim, dtype=dtype)
    if type(axes) is int or (axes is None and value.ndim == 1):
        return vector_norm(g, value, ord, axes, keepdim, dtype=dtype)
    return matrix_norm(g, value, ord, (-2, -1) if axes is None else axes, keepdim, dtype=dtype)


def matrix_norm(
    g: Graph, x: Any, ord: Any = "fro", dim: Any = (-2, -1), keepdim: bool = False, *, dtype: Any = None
) -> Value:
    """``torch.linalg.matrix_norm``: ``g.matrix_norm`` over the two axes ``dim`` (moved last)."""
    if dtype is not None:
        raise Unsupported("matrix_norm with a dtype")
    value = _float(x)
    rows, columns = (int(d) % value.ndim for d in dim)
    if rows == columns:
        raise Unsupported(f"a matrix norm over the axes {tuple(dim)}")
    rest = [a for a in range(value.ndim) if a not in (rows, columns)]
    moved = g.transpose(value, (*rest, rows, columns)) if (rows, columns) != (value.ndim - 2, value.ndim - 1) else value
    result = g.matrix_norm(moved, ord)
    if not keepdim:
        return result
    for axis in sorted((rows, columns)):
        result = g.expand_dims(result, axis)
    return result


def svd(g: Graph, a: Any, full_matrices: bool = True, **kwargs: Any) -> tuple[Value, Value, Value]:
    """``torch.linalg.svd``: ``(U, S, Vh)`` of ``g.svd`` (each pair of vectors signed so that U's
    largest entry is positive, one of the signs torch's may have)."""
    check_kwargs(kwargs, out=None, driver=None)
    return g.svd(_float(a), full_matrices=bool(full_matrices))


def svdvals(g: Graph, a: Any, **kwargs: Any) -> Value:
    """``torch.linalg.svdvals``."""
    check_kwargs(kwargs, out=None, driver=None)
    return g.svdvals(_float(a))


def legacy_norm(g: Graph, x: Any, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: Any = None) -> Value:
    """``torch.norm`` / ``Tensor.norm``: ``p`` a number (a vector norm over ``dim``, or of all
    entries) or ``"fro"``."""
    if p == "fro" or p is None:
        p = 2
    if isinstance(p, str):
        raise Unsupported(f"torch.norm with p={p!r}")
    return vector_norm(g, x, p, dim, keepdim, dtype=dtype)


def cdist(g: Graph, x1: Any, x2: Any, p: float = 2.0, compute_mode: Any = None) -> Value:
    """``torch.cdist``: ``[..., P, M]`` and ``[..., R, M]`` to the ``p``-norm distances ``[..., P,
    R]``. The Euclidean one as ``|a|^2 + |b|^2 - 2 a.b`` (one product, as torch computes it from
    25 rows on), clamped at 0, with a zero gradient at a zero distance (torch's)."""
    a, b = _float(x1), _float(x2)
    if a.ndim < 2 or b.ndim < 2:
        raise Unsupported("cdist of tensors of fewer than 2 axes")
    if p == 2:
        squares = g.sum(a * a, axis=-1, keepdims=True) + _transpose(g, g.sum(b * b, axis=-1, keepdims=True), -1, -2)
        return safe_sqrt(g, g.maximum(squares - 2.0 * g.matmul(a, _transpose(g, b, -1, -2)), 0.0))
    difference = g.abs(g.expand_dims(a, -2) - g.expand_dims(b, -3))  # [..., P, R, M]
    return vector_norm(g, difference, p, -1)


def pdist(g: Graph, x: Any, p: float = 2.0) -> Value:
    """``F.pdist``: the distances of every pair of rows ``i < j`` of ``[N, M]``, row-major."""
    value = _float(x)
    rows = _static_length(value, 0, "pdist")
    pairs = np.array([i * rows + j for i in range(rows) for j in range(i + 1, rows)], np.int64)
    if p == 2:  # directly: the product form loses the small distances to rounding
        difference = g.expand_dims(value, 1) - g.expand_dims(value, 0)
        distances = safe_sqrt(g, g.sum(difference * difference, axis=-1))
    else:
        distances = cdist(g, value, value, p)
    return g.take(g.reshape(distances, (rows * rows,)), g.constant(pairs), axis=0)


# ----------------------------------------------------------------------------- tensor utilities


def outer(g: Graph, a: Any, b: Any) -> Value:
    """``torch.outer`` / ``torch.ger`` of two vectors."""
    first, second = _float(a), _float(b)
    if first.ndim != 1 or second.ndim != 1:
        raise Unsupported("outer of tensors that are not vectors")
    return g.expand_dims(first, 1) * g.expand_dims(second, 0)


def diag(g: Graph, x: Any, diagonal: int = 0) -> Value:
    """``torch.diag``: a vector's square matrix with it on diagonal ``diagonal``, or a matrix's
    diagonal ``diagonal`` as a vector."""
    value = _float(x)
    if value.ndim == 1:
        length = _static_length(value, 0, "diag")
        size, shift = length + abs(diagonal), max(diagonal, 0)
        on = np.zeros((size, size), np.bool_)
        on[np.arange(length) + max(-diagonal, 0), np.arange(length) + shift] = True
        by_column = g.take(value, g.constant(np.clip(np.arange(size) - shift, 0, length - 1)), axis=0)
        return g.where(g.constant(on), g.broadcast_to(by_column, (size, size)), 0.0)
    if value.ndim != 2:
        raise Unsupported(f"diag of a {value.ndim}-d tensor")
    height, width = _static_length(value, 0, "diag"), _static_length(value, 1, "diag")
    first_row, first_column = max(-diagonal, 0), max(diagonal, 0)
    length = max(min(height - first_row, width - first_column), 0)
    if length == 0:
        raise Unsupported("an empty diagonal")
    flat = [(first_row + i) * width + first_column + i for i in range(length)]
    return g.take(g.reshape(value, (height * width,)), g.constant(np.array(flat, np.int64)), axis=0)


def narrow(g: Graph, x: Any, dim: int, start: int, length: int) -> Value:
    """``torch.narrow``: ``length`` entries of axis ``dim`` from ``start`` (a slice, a view)."""
    value = _float(x)
    if type(start) is not int or type(length) is not int:
        raise Unsupported("narrow by dynamic bounds")
    axis = dim % value.ndim
    size = _static_length(value, axis, "narrow")
    first = start % size if start < 0 else start
    index: list[object] = [slice(None)] * value.ndim
    index[axis] = slice(first, first + length)
    return value[tuple(index)]


def repeat(g: Graph, x: Any, *sizes: Any) -> Value:
    """``Tensor.repeat``: the tensor tiled ``sizes`` times along each axis (new leading axes where
    there are more sizes than axes): per axis a broadcast beside it and a reshape."""
    counts = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else list(sizes)
    value = _float(x)
    if len(counts) < value.ndim or not all(type(c) is int and c >= 1 for c in counts):
        raise Unsupported(f"repeat{tuple(counts)} of a {value.ndim}-d tensor")
    value = g.reshape(value, (*(1,) * (len(counts) - value.ndim), *value.shape))
    for axis, count in enumerate(counts):
        if count == 1:
            continue
        shape = list(value.shape)
        spread = g.expand_dims(value, axis)
        tiled = g.broadcast_to(spread, (*shape[:axis], count, *shape[axis:]))
        value = g.reshape(tiled, (*shape[:axis], count * shape[axis], *shape[axis + 1 :]))  # type: ignore[operator]
    return value


def channel_shuffle(g: Graph, x: Any, groups: int) -> Value:
    """``F.channel_shuffle``: ``[N, C, ...]`` viewed as ``[N, groups, C / groups, ...]``, the two
    channel axes swapped, flattened back (ShuffleNet)."""
    value = _float(x)
    channels = _static_length(value, 1, "channel_shuffle")
    if type(groups) is not int or groups < 1 or channels % groups:
        raise Unsupported(f"channel_shuffle of {channels} channels into {groups} groups")
    rest = tuple(value.shape[2:])
    split = g.reshape(value, (value.shape[0], groups, channels // groups, *rest))
    swapped = g.transpose(split, (0, 2, 1, *range(3, split.ndim)))
    return g.reshape(swapped, (value.shape[0], channels, *rest))


def moments(root: bool) -> Callable[..., Any]:
    """``torch.var_mean`` / ``torch.std_mean``: the variance (or deviation) and the mean over the
    same axes (see :func:`rlx.torch._fx_calls.variance_arguments`)."""

    def handler(g: Graph, x: Any, *args: Any, **kwargs: Any) -> tuple[Value, Value]:
        dim, ddof, keepdim = variance_arguments(args, kwargs)
        value = _float(x)
        spread = g.var(value, axis=dim, keepdims=keepdim, ddof=ddof)
        return (g.sqrt(spread) if root else spread), g.mean(value, axis=dim, keepdims=keepdim)

    return handler


# ----------------------------------------------------------------------------- losses, layers


def pairwise_distance(g: Graph, x1: Any, x2: Any, p: float = 2.0, eps: float = 1e-6, keepdim: bool = False) -> Value:
    """``F.pairwise_distance``: the ``p``-norm of ``x1 - x2 + eps`` over the last axis."""
    a, b = _promoted(g, _value(g, x1), _value(g, x2))
    return vector_norm(g, a - b + float(eps), p, -1, keepdim)


def _legacy_reduced(g: Graph, loss: Value, reduction: str, legacy: tuple[Any, ...]) -> Value:
    """:func:`rlx.torch._fx_calls._reduced` of a loss whose positional arguments after its own
    are ``legacy`` (torch's ``size_average`` and ``reduce``, which ``_reduced`` refuses unless None)."""
    if len(legacy) > 2:
        raise Unsupported("a loss with its reduction passed by position")
    return _reduced(g, loss, reduction, *legacy)


def cosine_embedding_loss(
    g: Graph, x1: Any, x2: Any, target: Any, margin: float = 0.0, *legacy: Any, reduction: str = "mean"
) -> Value:
    """``F.cosine_embedding_loss``: ``1 - cos`` where the target is 1, ``max(0, cos - margin)``
    where it is -1, the cosine over axis 1 with torch's 1e-12 added to each squared norm."""
    a, b = _promoted(g, _value(g, x1), _value(g, x2))
    axis = a.ndim - 1 if a.ndim == 1 else 1
    products = g.sum(a * b, axis=axis)
    norms = g.sqrt((g.sum(a * a, axis=axis) + 1e-12) * (g.sum(b * b, axis=axis) + 1e-12))
    cosine = products / norms
    y = _value(g, target)
    positive = g.where(g.equal(y, 1), 1.0 - cosine, 0.0)
    negative = g.where(g.equal(y, -1), g.maximum(cosine - float(margin), 0.0), 0.0)
    return _legacy_reduced(g, positive + negative, reduction, legacy)


def triplet_margin_loss(
    g: Graph,
    anchor: Any,
    positive: Any,
    negative: Any,
    margin: float = 1.0,
    p: float = 2.0,
    eps: float = 1e-6,
    swap: bool = False,
    *legacy: Any,
    reduction: str = "mean",
) -> Value:
    """``F.triplet_margin_loss``: ``max(0, margin + d(a, p) - d(a, n))`` with the pairwise
    distance ``d`` (``swap``: the lesser of ``d(a, n)`` and ``d(p, n)``)."""
    near = pairwise_distance(g, anchor, positive, p, eps)
    far = pairwise_distance(g, anchor, negative, p, eps)
    if swap:
        far = g.minimum(far, pairwise_distance(g, positive, negative, p, eps))
    return _legacy_reduced(g, g.maximum(near - far + float(margin), 0.0), reduction, legacy)


def margin_ranking_loss(
    g: Graph, x1: Any, x2: Any, target: Any, margin: float = 0.0, *legacy: Any, reduction: str = "mean"
) -> Value:
    """``F.margin_ranking_loss``: ``max(0, -y (x1 - x2) + margin)``."""
    a, b = _promoted(g, _value(g, x1), _value(g, x2))
    return _legacy_reduced(g, g.maximum(-_value(g, target) * (a - b) + float(margin), 0.0), reduction, legacy)


def hinge_embedding_loss(
    g: Graph, x: Any, target: Any, margin: float = 1.0, *legacy: Any, reduction: str = "mean"
) -> Value:
    """``F.hinge_embedding_loss``: ``x`` where the target is not -1, plus ``max(0, margin - x)``
    where it is not 1, as torch adds them."""
    value, y = _float(x), _value(g, target)
    kept = g.where(g.not_equal(y, -1), value, 0.0)
    hinge = g.where(g.not_equal(y, 1), g.maximum(float(margin) - value, 0.0), 0.0)
    return _legacy_reduced(g, kept + hinge, reduction, legacy)


def soft_margin_loss(g: Graph, x: Any, target: Any, *legacy: Any, reduction: str = "mean") -> Value:
    """``F.soft_margin_loss``: ``log(1 + exp(-y x))``."""
    return _legacy_reduced(g, g.softplus(-_value(g, target) * _float(x)), reduction, legacy)


def multi_margin_loss(
    g: Graph,
    x: Any,
    target: Any,
    p: int = 1,
    margin: float = 1.0,
    weight: Any = None,
    *legacy: Any,
    reduction: str = "mean",
) -> Value:
    """``F.multi_margin_loss`` of ``[N, C]`` scores (or ``[C]``): per row ``sum over i != y of
    max(0, margin - x[y] + x[i])^p / C`` (times ``weight[y]``)."""
    if p not in (1, 2):
        raise Unsupported(f"multi_margin_loss with p={p}")
    scores, y = _float(x), _float(target)
    if scores.ndim not in (1, 2):
        raise Unsupported(f"multi_margin_loss of {scores.ndim}-d scores")
    classes = _static_length(scores, -1, "multi_margin_loss")
    hit = g.equal(g.one_hot(y, classes), 1)  # [N, C]: the target's class
    correct = g.sum(g.where(hit, scores, 0.0), axis=-1, keepdims=True)
    margins = g.maximum(float(margin) - correct + scores, 0.0)
    if p == 2:
        margins = margins * margins
    if weight is not None:
        margins = margins * g.take(_float(weight), y, axis=0)[..., None]
    loss = g.sum(g.where(hit, 0.0, margins), axis=-1) * (1.0 / classes)
    return _legacy_reduced(g, loss, reduction, legacy)


def bilinear(g: Graph, x1: Any, x2: Any, weight: Any, bias: Any = None) -> Value:
    """``F.bilinear``: ``y[..., o] = x1 W[o] x2 + b[o]`` (one product ``x1 @ W`` over the output
    features, then a weighted sum with ``x2``)."""
    a, b, w = _float(x1), _float(x2), _float(weight)
    if w.ndim != 3:
        raise Unsupported(f"bilinear weight of shape {w.shape}")
    outs, width = w.shape[0], w.shape[2]
    lead = tuple(a.shape[:-1])
    rows = g.reshape(a, (-1, a.shape[-1]))  # [R, in1]
    projected = g.matmul(rows, w)  # [O, R, in2]
    paired = g.sum(projected * g.reshape(b, (1, -1, width)), axis=-1)  # [O, R]
    out = g.reshape(g.transpose(paired, (1, 0)), (*lead, outs))
    return out if bias is None else out + _float(bias)


def local_response_norm(g: Graph, x: Any, size: int, alpha: float = 1e-4, beta: float = 0.75, k: float = 1.0) -> Value:
    """``F.local_response_norm``: ``x / (k + alpha * mean of x^2 over size channels)^beta``, the
    channel window zero-padded ``size // 2`` before and ``(size - 1) // 2`` after, as torch's."""
    value = _float(x)
    if value.ndim < 3:
        raise Unsupported(f"local_response_norm of a {value.ndim}-d tensor")
    channels = _static_length(value, 1, "local_response_norm")
    squares = value * value
    positions = np.arange(channels)
    window = np.zeros((channels, channels), np.float32)  # window[c, d]: channel d counts for c
    for offset in range(-(size // 2), (size - 1) // 2 + 1):
        inside = (positions + offset >= 0) & (positions + offset < channels)
        window[positions[inside], positions[inside] + offset] = 1.0 / size
    moved = g.transpose(squares, (*range(2, value.ndim), 0, 1))  # [..., N, C]
    averaged = g.matmul(moved, g.constant(window.T))  # [..., N, C]
    back = g.transpose(averaged, (value.ndim - 2, value.ndim - 1, *range(value.ndim - 2)))
    return value / g.pow(back * float(alpha) + float(k), float(beta))


def embedding_bag(
    g: Graph,
    ids: Any,
    weight: Any,
    offsets: Any = None,
    max_norm: Any = None,
    norm_type: float = 2,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: Any = None,
    include_last_offset: bool = False,
    padding_idx: Any = None,
) -> Value:
    """``F.embedding_bag`` of bags of one length (``ids [B, L]``, no offsets): the rows summed,
    averaged or maximised per bag (``per_sample_weights`` scale them, with ``sum``)."""
    if offsets is not None or max_norm is not None or scale_grad_by_freq or padding_idx is not None:
        raise Unsupported("embedding_bag with offsets, max_norm, scale_grad_by_freq or padding_idx")
    rows = g.embedding(_float(weight), _float(ids))
    if rows.ndim != 3:
        raise Unsupported("embedding_bag of ids that are not [bags, length]")
    if per_sample_weights is not None:
        if mode != "sum":
            raise Unsupported("per_sample_weights outside mode 'sum'")
        rows = rows * g.expand_dims(_float(per_sample_weights), -1)
    if mode == "sum":
        return g.sum(rows, axis=1)
    if mode == "mean":
        return g.mean(rows, axis=1)
    if mode == "max":
        return g.max(rows, axis=1)
    raise Unsupported(f"embedding_bag mode {mode!r}")


def fold(
    g: Graph, x: Any, output_size: Any, kernel_size: Any, dilation: Any = 1, padding: Any = 0, stride: Any = 1
) -> Value:
    """``F.fold`` (col2im, the transpose of ``F.unfold``): ``[N, C * kh * kw, L]`` summed back
    into ``[N, C, H, W]``, as a transposed convolution whose kernel picks each column's entry
    (one weight of 1 per channel and kernel offset, grouped by channel)."""
    value = _float(x)
    if value.ndim != 3:
        raise Unsupported(f"fold of a {value.ndim}-d tensor (only [N, C * kh * kw, L])")

    def pair(v: Any) -> tuple[int, int]:
        return (int(v), int(v)) if type(v) is int else (int(v[0]), int(v[1]))

    (height, width), (kh, kw), dil, pad, step = (pair(v) for v in (output_size, kernel_size, dilation, padding, stride))
    blocks = [
        (n + 2 * p - d * (k - 1) - 1) // s + 1
        for n, p, d, k, s in zip((height, width), pad, dil, (kh, kw), step, strict=True)
    ]
    taps = kh * kw
    rows = _static_length(value, 1, "fold")
    if rows % taps or value.shape[2] != blocks[0] * blocks[1]:
        raise Unsupported(f"fold of {value.shape} into {(height, width)} by a {(kh, kw)} kernel")
    channels = rows // taps
    columns = g.reshape(value, (value.shape[0], rows, blocks[0], blocks[1]))
    picks = np.zeros((rows, 1, kh, kw), np.float32)
    for c, i, j in itertools.product(range(channels), range(kh), range(kw)):
        picks[c * taps + i * kw + j, 0, i, j] = 1.0
    extra = tuple(
        n + 2 * p - ((b - 1) * s + d * (k - 1) + 1)
        for n, p, b, s, d, k in zip((height, width), pad, blocks, step, dil, (kh, kw), strict=True)
    )
    return g.conv_transpose(columns, g.constant(picks), None, step, pad, extra, channels, dil)


def index_add(g: Graph, x: Any, dim: int, index: Any, source: Any, *, alpha: float = 1) -> Value:
    """``torch.index_add``: ``source``'s slices along ``dim`` added into ``x`` at ``index`` (repeated
    indices add up), as a graph neural network's message sums write it: the scatter-add of rows
    that is ``embedding``'s gradient, with ``dim`` moved first. An index outside ``x`` is an error
    at call time, as torch's."""
    value, rows, ids = _float(x), _float(source), _float(index)
    if ids.ndim != 1 or rows.ndim != value.ndim:
        raise Unsupported("index_add by other than a 1-d index into a tensor of the source's rank")
    axis = dim % value.ndim
    order = (axis, *(a for a in range(value.ndim) if a != axis))
    moved = g.transpose(rows, order)  # [L, ...]
    count = value.shape[axis]
    summed = g.embedding_grad(g.reshape(moved, (moved.shape[0], -1)), ids, count)  # type: ignore[arg-type]
    placed = g.transpose(g.reshape(summed, (count, *moved.shape[1:])), tuple(int(i) for i in np.argsort(order)))
    return value + (placed if alpha == 1 else placed * float(alpha))


# ----------------------------------------------------------------------------- spatial transformers


def _normalized_positions(length: int, align_corners: bool) -> np.ndarray:
    """Where each of ``length`` pixels lies in ``[-1, 1]``: the corners' centres at -1 and 1 with
    ``align_corners``, else the corners' outer edges there."""
    if align_corners:
        return np.linspace(-1.0, 1.0, length) if length > 1 else np.zeros(1)
    return (2.0 * np.arange(length) + 1.0) / length - 1.0


def affine_grid(g: Graph, theta: Any, size: Any, align_corners: Any = None) -> Value:
    """``F.affine_grid`` of 2-d images: ``theta [N, 2, 3]`` applied to every output pixel's
    normalised ``(x, y, 1)``, ``[N, H, W, 2]`` (one product)."""
    matrix = _float(theta)
    shape = [int(d) for d in size]
    if len(shape) != 4 or matrix.ndim != 3 or tuple(matrix.shape[1:]) != (2, 3):
        raise Unsupported(f"affine_grid of size {tuple(shape)} (only 2-d images, theta [N, 2, 3])")
    height, width = shape[2], shape[3]
    xs, ys = _normalized_positions(width, bool(align_corners)), _normalized_positions(height, bool(align_corners))
    base = np.stack([np.tile(xs, height), np.repeat(ys, width), np.ones(height * width)], axis=1)
    points = g.matmul(g.constant(base.astype(np.float32)), g.transpose(matrix, (0, 2, 1)))  # [N, H*W, 2]
    return g.reshape(points, (shape[0], height, width, 2))


def grid_sample(
    g: Graph, x: Any, grid: Any, mode: str = "bilinear", padding_mode: str = "zeros", align_corners: Any = None
) -> Value:
    """``F.grid_sample`` of 2-d images (``x [N, C, H, W]``, ``grid [N, Ho, Wo, 2]`` of normalised
    ``(x, y)``): bilinear or nearest sampling, the pixels outside read as zeros or as the border's,
    as torch's. Each corner is a gather of single elements at a computed position, so the input
    gets the scattered gradient and the grid the gradient of the weights. Reflection padding and
    bicubic sampling are left to torch."""
    image, points = _float(x), _float(grid)
    if (
        image.ndim != 4
        or points.ndim != 4
        or mode not in ("bilinear", "nearest")
        or padding_mode not in ("zeros", "border")
    ):
        raise Unsupported(f"grid_sample in mode {mode!r}, padding {padding_mode!r} of {image.ndim - 2}-d images")
    batch, channels = image.shape[0], image.shape[1]
    height, width = _static_length(image, 2, "grid_sample"), _static_length(image, 3, "grid_sample")
    rows, columns = points.shape[1], points.shape[2]
    gx, gy = points[..., 0], points[..., 1]  # [N, Ho, Wo]

    def unnormalized(coordinate: Value, length: int) -> Value:
        if align_corners:
            place = (coordinate + 1.0) * ((length - 1) / 2.0)
        else:
            place = ((coordinate + 1.0) * length - 1.0) * 0.5
        return g.clip(place, 0.0, float(length - 1)) if padding_mode == "border" else place

    ix, iy = unnormalized(gx, width), unnormalized(gy, height)
    flat = g.reshape(image, (batch, channels, height * width))

    def corner(cx: Value, cy: Value) -> Value:
        """The pixels at integer positions ``(cx, cy)`` ([N, C, Ho, Wo]; zeros outside)."""
        inside = g.logical_and(
            g.logical_and(g.greater_equal(cx, 0.0), g.less_equal(cx, float(width - 1))),
            g.logical_and(g.greater_equal(cy, 0.0), g.less_equal(cy, float(height - 1))),
        )
        position = g.clip(cy, 0.0, float(height - 1)) * float(width) + g.clip(cx, 0.0, float(width - 1))
        ids = g.reshape(position.astype("int64"), (batch, 1, -1))  # type: ignore[arg-type]
        picked = _gather_elements(g, flat, 2, g.broadcast_to(ids, (batch, channels, ids.shape[2])))
        values = g.reshape(picked, (batch, channels, rows, columns))
        return g.where(g.expand_dims(inside, 1), values, 0.0)

    if mode == "nearest":
        return corner(g.round(ix), g.round(iy))
    x0, y0 = g.floor(ix), g.floor(iy)
    wx, wy = ix - x0, iy - y0  # weights of the far corners; floor has no gradient, so these carry the grid's
    x1, y1 = x0 + 1.0, y0 + 1.0
    total = None
    for cx, cy, weight in ((x0, y0, (1.0 - wx) * (1.0 - wy)), (x1, y0, wx * (1.0 - wy)),
                           (x0, y1, (1.0 - wx) * wy), (x1, y1, wx * wy)):  # fmt: skip
        term = corner(cx, cy) * g.expand_dims(weight, 1)
        total = term if total is None else total + term
    assert total is not None
    return total


# ----------------------------------------------------------------------------- linear algebra


def _batch_broadcast(g: Graph, a: Value, b: Value, vector: bool) -> tuple[Value, Value]:
    """``a [..., n, n]`` and ``b [..., n, k]`` (``[..., n]`` when ``vector``) with their batch
    dimensions broadcast, as torch.linalg broadcasts them."""
    rhs_batch = b.shape[:-1] if vector else b.shape[:-2]
    batch = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(rhs_batch))  # type: ignore[arg-type]
    if tuple(a.shape[:-2]) != batch:
        a = g.broadcast_to(a, (*batch, *a.shape[-2:]))
    if tuple(rhs_batch) != batch:
        b = g.broadcast_to(b, (*batch, *b.shape[len(rhs_batch) :]))
    return a, b


def _is_vector(a: Value, b: Value) -> bool:
    """torch.linalg.solve's rule: ``b`` is (a batch of) vectors when it is 1-d or has one axis
    fewer than ``a`` with ``a``'s leading shape."""
    return b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))


def linalg_solve(g: Graph, a: Any, b: Any, *, left: bool = True, **kwargs: Any) -> Value:
    """``torch.linalg.solve``: ``g.solve``; ``left=False`` solves ``x a = b``."""
    check_kwargs(kwargs, out=None)
    matrix, rhs = _float(a), _float(b)
    vector = _is_vector(matrix, rhs)
    if not left:
        if vector:
            raise Unsupported("solve with left=False of a vector")
        matrix, rhs = matrix.mT, rhs.mT
    matrix, rhs = _batch_broadcast(g, matrix, rhs, vector)
    if vector:
        return g.squeeze(g.solve(matrix, g.expand_dims(rhs, -1)), -1)
    solved = g.solve(matrix, rhs)
    return solved if left else solved.mT


def linalg_solve_triangular(
    g: Graph, a: Any, b: Any, *, upper: bool, left: bool = True, unitriangular: bool = False, **kwargs: Any
) -> Value:
    """``torch.linalg.solve_triangular``: ``g.solve_triangular``; ``left=False`` solves ``x a = b``
    as ``a^T x^T = b^T``."""
    check_kwargs(kwargs, out=None)
    matrix, rhs = _batch_broadcast(g, _float(a), _float(b), vector=False)
    if left:
        return g.solve_triangular(matrix, rhs, lower=not upper, unit_diagonal=bool(unitriangular))
    solved = g.solve_triangular(matrix, rhs.mT, lower=not upper, transpose_a=True, unit_diagonal=bool(unitriangular))
    return solved.mT


def cholesky(g: Graph, a: Any, upper: bool = False, **kwargs: Any) -> Value:
    """``torch.linalg.cholesky`` (and the older ``torch.cholesky``): the lower factor, or its
    transpose with ``upper``."""
    check_kwargs(kwargs, out=None)
    low = g.cholesky(_float(a))
    return low.mT if upper else low


def slogdet(g: Graph, a: Any, **kwargs: Any) -> tuple[Value, Value]:
    """``torch.linalg.slogdet``: ``(sign, logabsdet)``."""
    check_kwargs(kwargs, out=None)
    return g.slogdet(_float(a))


def logdet(g: Graph, a: Any) -> Value:
    """``torch.logdet``: ``log(det)``, NaN for a negative determinant and ``-inf`` for zero:
    ``logabsdet + log(sign)``."""
    sign, logabsdet = g.slogdet(_float(a))
    return logabsdet + g.log(sign)


def det(g: Graph, a: Any, **kwargs: Any) -> Value:
    """``torch.linalg.det``."""
    check_kwargs(kwargs, out=None)
    return g.det(_float(a))


def eigh(g: Graph, a: Any, UPLO: str = "L", **kwargs: Any) -> tuple[Value, Value]:
    """``torch.linalg.eigh``: ``g.eigh`` of the triangle ``UPLO`` names (the upper one as the lower
    of the transpose). Each eigenvector's largest entry is positive, one of the signs torch's may
    have. For the symmetric inputs eigh is for, the gradient is torch's; for others it is the
    derivative of reading one triangle, where torch's takes the input as symmetric."""
    check_kwargs(kwargs, out=None)
    if UPLO not in ("L", "U"):
        raise Unsupported(f"eigh with UPLO={UPLO!r}")
    matrix = _float(a)
    return g.eigh(matrix if UPLO == "L" else matrix.mT)


def eigvalsh(g: Graph, a: Any, UPLO: str = "L", **kwargs: Any) -> Value:
    """``torch.linalg.eigvalsh``: the eigenvalues of ``g.eigh``."""
    return eigh(g, a, UPLO, **kwargs)[0]


def inv(g: Graph, a: Any, **kwargs: Any) -> Value:
    """``torch.linalg.inv`` / ``torch.inverse``."""
    check_kwargs(kwargs, out=None)
    return g.inv(_float(a))


FUNCTIONS: dict[Any, Callable[..., Any]] = {
    **ACTIVATIONS,
    torch.sign: sign,
    torch.frac: frac,
    torch.nan_to_num: nan_to_num,
    torch.lerp: lerp,
    torch.addcmul: addcmul,
    torch.addcdiv: addcdiv,
    torch.linalg.vector_norm: vector_norm,
    torch.linalg.norm: norm,
    torch.norm: legacy_norm,
    torch.cdist: cdist,
    F.pdist: pdist,
    torch.outer: outer,
    torch.ger: outer,
    torch.diag: diag,
    torch.narrow: narrow,
    torch.channel_shuffle: channel_shuffle,
    F.pairwise_distance: pairwise_distance,
    torch.pairwise_distance: pairwise_distance,
    F.cosine_embedding_loss: cosine_embedding_loss,
    F.triplet_margin_loss: triplet_margin_loss,
    F.margin_ranking_loss: margin_ranking_loss,
    F.hinge_embedding_loss: hinge_embedding_loss,
    F.soft_margin_loss: soft_margin_loss,
    F.multi_margin_loss: multi_margin_loss,
    F.bilinear: bilinear,
    torch.bilinear: bilinear,
    F.local_response_norm: local_response_norm,
    F.embedding_bag: embedding_bag,
    F.fold: fold,
    torch.index_add: index_add,
    F.affine_grid: affine_grid,
    F.grid_sample: grid_sample,
    torch.var_mean: moments(root=False),
    torch.std_mean: moments(root=True),
    torch.linalg.solve: linalg_solve,
    torch.linalg.solve_triangular: linalg_solve_triangular,
    torch.linalg.cholesky: cholesky,
    torch.cholesky: cholesky,
    torch.linalg.slogdet: slogdet,
    torch.slogdet: slogdet,
    torch.logdet: logdet,
    torch.linalg.det: det,
    torch.det: det,
    torch.linalg.inv: inv,
    torch.inverse: inv,
    torch.linalg.eigh: eigh,
    torch.linalg.eigvalsh: eigvalsh,
    torch.linalg.svd: svd,
    torch.linalg.svdvals: svdvals,
    torch.linalg.matrix_norm: matrix_norm,
}

METHODS: dict[str, Callable[..., Any]] = {
    "sign": sign,
    "frac": frac,
    "nan_to_num": nan_to_num,
    "lerp": lerp,
    "addcmul": addcmul,
    "addcdiv": addcdiv,
    "norm": legacy_norm,
    "outer": outer,
    "diag": diag,
    "narrow": narrow,
    "repeat": repeat,
    "index_add": index_add,
    "cholesky": cholesky,
    "slogdet": slogdet,
    "logdet": logdet,
    "det": det,
    "inverse": inv,
}
