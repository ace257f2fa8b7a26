"""``conv`` and ``pool``: N-d convolution (cross-correlation, as torch's ``F.conv1d/2d/3d``) and
max and average pooling, built from the registered ops, with no op of their own.

It is im2col written in graph ops: the input padded with zeros (a ``concat``), channels moved
last (a view), one strided slice per kernel offset (views), those slices concatenated along the
channels into the column matrix (one loop nest writes it), and one ``matmul`` of it with the
weights reshaped to ``[prod(kernel) * C, O]``: a single BLAS product with the whole kernel in
its inner dimension. Its gradients are those ops' (the slices' gradients place the columns'
cotangents back, summed where windows overlap), so a convolution differentiates with no rule of
its own, and the printed graph shows what it became.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ops._common import as_value, is_int

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value


def conv(
    graph: Graph,
    x: object,
    weight: object,
    bias: object = None,
    stride: int | Sequence[int] = 1,
    padding: int | str | Sequence[int] | Sequence[tuple[int, int]] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Value:
    """Convolution of ``x [N, C, *spatial]`` with ``weight [O, C / groups, *kernel]`` (1, 2 or 3
    spatial axes), as ``torch.nn.functional.conv1d/2d/3d``: ``[N, O, *out]``, plus ``bias [O]``.

    ``stride`` and ``dilation`` are an int or one per spatial axis; ``padding`` is an int, one
    per axis, ``(low, high)`` pairs per axis (as ``jax.lax.conv_general_dilated``), ``"valid"``
    (none) or ``"same"`` (the output as long as the input; stride 1, as torch). ``groups``
    splits the channels, as torch's (``groups == C`` is a depthwise convolution)."""
    value = as_value(graph, x, "conv: x")
    kernel = as_value(graph, weight, "conv: weight")
    spatial = kernel.ndim - 2
    if spatial not in (1, 2, 3) or value.ndim != spatial + 2:
        raise RlxValueError(
            f"conv: weight must be [O, C/groups, *kernel] with 1 to 3 kernel axes and x [N, C, *spatial] of the "
            f"same count, got x {value.type} and weight {kernel.type}"
        )
    if value.dtype != np.float32 or kernel.dtype != np.float32:
        raise RlxTypeError(f"conv: x and weight must be float32, got {value.type} and {kernel.type}")
    sizes = [value.shape[2 + a] for a in range(spatial)]
    taps = [kernel.shape[2 + a] for a in range(spatial)]
    if not all(isinstance(s, int) for s in (*sizes, *taps, kernel.shape[0], kernel.shape[1], value.shape[1])):
        raise RlxValueError(f"conv: channels, spatial axes and kernel must be static, got x {value.type}")
    strides = _per_axis("stride", stride, spatial, low=1)
    dilations = _per_axis("dilation", dilation, spatial, low=1)
    if isinstance(groups, bool) or not is_int(groups) or groups < 1:
        raise RlxValueError(f"conv: groups must be a positive int, got {groups!r}")
    channels, outputs = int(value.shape[1]), int(kernel.shape[0])
    if channels % groups or outputs % groups or kernel.shape[1] != channels // groups:
        raise RlxValueError(
            f"conv: x has {channels} channels and weight is {kernel.type}: with groups={groups} the weight's "
            f"second axis must be {channels // groups if channels % groups == 0 else 'C/groups'} and both channel "
            "counts divisible by groups"
        )
    reach = [d * (t - 1) for d, t in zip(dilations, taps, strict=True)]  # type: ignore[operator]
    pads = _padding(padding, spatial, reach, strides)
    padded = [s + lo + hi for s, (lo, hi) in zip(sizes, pads, strict=True)]  # type: ignore[operator]
    out_sizes = [(p - r - 1) // s + 1 for p, r, s in zip(padded, reach, strides, strict=True)]
    if min(out_sizes) < 1:
        raise RlxValueError(
            f"conv: the kernel {tuple(taps)} (dilation {tuple(dilations)}) does not fit x {value.type} padded by "
            f"{tuple(pads)}"
        )
    # Channels last, zero-padded: [N, *padded, C].
    last = graph.transpose(value, (0, *range(2, spatial + 2), 1))
    for axis, (low, high) in enumerate(pads, start=1):
        last = _pad_with(graph, last, axis, low, high, 0.0)
    results = []
    per_group, outs_per_group = channels // groups, outputs // groups
    for group in range(groups):
        source = last if groups == 1 else last[..., group * per_group : (group + 1) * per_group]
        columns = []
        for offsets in itertools.product(*(range(t) for t in taps)):  # type: ignore[arg-type]
            index: list[object] = [slice(None)]
            for o, d, s, n in zip(offsets, dilations, strides, out_sizes, strict=True):
                start = o * d
                index.append(slice(start, start + (n - 1) * s + 1, s))
            columns.append(source[tuple(index)])
        matrix = graph.concat(columns, axis=-1) if len(columns) > 1 else columns[0]  # [N, *out, K*Cg]
        w = kernel if groups == 1 else kernel[group * outs_per_group : (group + 1) * outs_per_group]
        # [Og, Cg, *kernel] -> [*kernel, Cg, Og] -> [K*Cg, Og], rows in the columns' order.
        w = graph.reshape(graph.transpose(w, (*range(2, spatial + 2), 1, 0)), (-1, outs_per_group))
        results.append(graph.matmul(matrix, w))
    out = graph.concat(results, axis=-1) if groups > 1 else results[0]  # [N, *out, O]
    out = graph.transpose(out, (0, spatial + 1, *range(1, spatial + 1)))
    if bias is not None:
        b = as_value(graph, bias, "conv: bias")
        if b.shape != (outputs,):
            raise RlxValueError(f"conv: bias must be [{outputs}], got {b.type}")
        out = out + graph.reshape(b, (outputs, *(1,) * spatial))
    return out


def _per_axis(what: str, value: object, spatial: int, low: int) -> list[int]:
    values = [value] * spatial if is_int(value) else list(value)  # type: ignore[call-overload]
    if len(values) != spatial or not all(is_int(v) and not isinstance(v, bool) and int(v) >= low for v in values):
        raise RlxValueError(f"conv: {what} must be an int >= {low} or {spatial} of them, got {value!r}")
    return [int(v) for v in values]


def _padding(padding: object, spatial: int, reach: list[int], strides: list[int]) -> list[tuple[int, int]]:
    """``(low, high)`` zeros per spatial axis."""
    if padding == "valid":
        return [(0, 0)] * spatial
    if padding == "same":
        if any(s != 1 for s in strides):
            raise RlxValueError("conv: padding='same' needs stride 1 (as torch)")
        return [(r // 2, r - r // 2) for r in reach]  # torch puts the odd one at the end
    if isinstance(padding, str):
        raise RlxValueError(f"conv: padding must be 'valid', 'same', an int or per-axis values, got {padding!r}")
    if is_int(padding):
        entries: list[object] = [padding] * spatial
    else:
        entries = list(padding)  # type: ignore[call-overload]
    if len(entries) != spatial:
        raise RlxValueError(f"conv: padding must have {spatial} entries, got {padding!r}")
    pairs = [(e, e) if is_int(e) else tuple(e) for e in entries]  # type: ignore[arg-type]
    if not all(len(p) == 2 and all(is_int(v) and not isinstance(v, bool) and int(v) >= 0 for v in p) for p in pairs):
        raise RlxValueError(f"conv: padding entries must be ints >= 0 or (low, high) pairs of them, got {padding!r}")
    return [(int(p[0]), int(p[1])) for p in pairs]


def pool(
    graph: Graph,
    x: object,
    kind: str,
    window: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    count_include_pad: bool = True,
) -> Value:
    """Max or average pooling of ``x [N, C, *spatial]`` over windows of the spatial axes, as
    ``torch.nn.functional.max_pool1d/2d/3d`` and ``avg_pool*d`` (floor mode): the windows are
    strided slices of ``x`` padded with ``-inf`` (max) or zeros (average), combined by
    ``maximum`` or summed; ``stride`` defaults to the window. An average over windows that reach
    into the padding divides by the whole window, or with ``count_include_pad=False`` by the
    entries inside ``x``. Where a window holds its maximum twice, the entries share its gradient
    (``maximum``'s rule); torch's ``max_pool`` gives all of it to one of them."""
    what = f"{kind}_pool"
    value = as_value(graph, x, f"{what}: x")
    spatial = value.ndim - 2
    if spatial not in (1, 2, 3) or value.dtype != np.float32:
        raise RlxValueError(f"{what}: x must be float32 [N, C, *spatial] with 1 to 3 spatial axes, got {value.type}")
    sizes = [value.shape[2 + a] for a in range(spatial)]
    if not all(isinstance(s, int) for s in sizes):
        raise RlxValueError(f"{what}: the spatial axes must be static, got {value.type}")
    taps = _per_axis("window", window, spatial, low=1)
    strides = taps if stride is None else _per_axis("stride", stride, spatial, low=1)
    dilations = _per_axis("dilation", dilation, spatial, low=1)
    pads = _per_axis("padding", padding, spatial, low=0)
    if any(2 * p > t for p, t in zip(pads, taps, strict=True)):
        raise RlxValueError(f"{what}: padding {tuple(pads)} must be at most half the window {tuple(taps)} (as torch)")
    reach = [d * (t - 1) for d, t in zip(dilations, taps, strict=True)]
    out_sizes = [(s + 2 * p - r - 1) // st + 1 for s, p, r, st in zip(sizes, pads, reach, strides, strict=True)]  # type: ignore[operator]
    if min(out_sizes) < 1:
        raise RlxValueError(f"{what}: the window {tuple(taps)} does not fit x {value.type} padded by {tuple(pads)}")
    fill = float("-inf") if kind == "max" else 0.0
    padded = value
    for axis, p in enumerate(pads, start=2):
        padded = _pad_with(graph, padded, axis, p, p, fill)
    windows = []
    for offsets in itertools.product(*(range(t) for t in taps)):
        index: list[object] = [slice(None), slice(None)]
        for o, d, s, n in zip(offsets, dilations, strides, out_sizes, strict=True):
            index.append(slice(o * d, o * d + (n - 1) * s + 1, s))
        windows.append(padded[tuple(index)])
    if kind == "max":
        result = windows[0]
        for part in windows[1:]:
            result = graph.maximum(result, part)
        return result
    total = windows[0]
    for part in windows[1:]:
        total = total + part
    if count_include_pad or not any(pads):
        return total * (1.0 / len(windows))
    # Entries of each window inside x: the same pooling of ones, computed now.
    inside = np.pad(np.ones([int(s) for s in sizes], np.float64), [(p, p) for p in pads])
    counts = np.zeros(out_sizes)
    for offsets in itertools.product(*(range(t) for t in taps)):
        counts += inside[tuple(slice(o * d, o * d + (n - 1) * s + 1, s)
                               for o, d, s, n in zip(offsets, dilations, strides, out_sizes, strict=True))]  # fmt: skip
    return total / graph.constant(counts.astype(np.float32))


def _pad_with(graph: Graph, x: Value, axis: int, low: int, high: int, fill: float) -> Value:
    """``x`` with ``low`` and ``high`` entries of ``fill`` around ``axis``."""
    pieces = []
    for count in (low, high):
        shape = list(x.shape)
        shape[axis] = count
        pieces.append(graph.broadcast_to(graph.constant(np.float32(fill)), tuple(shape)) if count else None)
    parts = [p for p in (pieces[0], x, pieces[1]) if p is not None]
    return graph.concat(parts, axis=axis) if len(parts) > 1 else x
