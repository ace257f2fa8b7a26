"""``conv``: N-d convolution (cross-correlation, as torch's ``F.conv1d/2d/3d``), its transpose
(``conv_transpose``, as ``F.conv_transpose1d/2d/3d``), and max and average pooling.

``conv`` is an op of its own, composite (as softmax): its shape rule, float64 reference and
gradient rule live here, and the ``decompose`` pass rebuilds it as im2col written in graph ops:
the input padded with zeros (a ``concat``), one strided slice per kernel offset (views), those
slices concatenated into the column matrix (a loop nest per slice writes it), and one
``matmul`` of it with the weights: a single BLAS product with the whole kernel in its inner
dimension. The column matrix is laid out as planes of output positions (``[N, G, Cg*K, P]``,
multiplied per image by the weights ``[G, Og, Cg*K]`` into NCHW directly) where the output's
last axis fills a vector, else channels last (``[N, *out, K*Cg]``, one product over all the
batch's positions, then a transpose): see :func:`_columns_as_planes`.

The op exists for its gradient. Differentiated through the im2col ops, the input's gradient is
the column matrix's cotangent scattered back window by window: one padded copy of the input per
kernel offset, summed (a 3x3 kernel: 18 kernels and nine full-size buffers). The rule here is
the one of torch's ``convolution_backward`` and ``jax.lax.conv_general_dilated``'s transpose:
the input's gradient is itself a convolution, of the output's gradient (dilated by the stride,
padded by the kernel's reach less the padding) with the kernel flipped and its channel axes
swapped: one more column matrix and one BLAS product. The weight's gradient is the column matrix
of the forward times the output's gradient (the same helper builds both, so ``cse`` shares the
matrix). Pooling has no op: its windows are strided slices combined by ``maximum`` or summed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.dims import dim_text, product
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import Dim, TensorType
from rlx.ops._batching import again, all_with_examples, batch_by_unrolling, batch_into_leading
from rlx.ops._common import F32, as_value, is_int, op_kind, require_float, zeros

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


# The output's last axis makes im2col write planes from this many positions on (the AVX2 vector's
# floats): see _columns_as_planes.
PLANE_MIN_RUN = 8


@dataclass(frozen=True)
class ConvAttrs:
    """One entry per spatial axis. ``pads_low``/``pads_high`` are the zeros put before and after
    the axis; a negative pad crops that many entries instead (the transpose of a convolution
    padded by more than its kernel reaches). ``flip`` reverses the kernel along every spatial
    axis (the input's gradient is such a convolution)."""

    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    pads_low: tuple[int, ...]
    pads_high: tuple[int, ...]
    groups: int = 1
    flip: bool = False


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
    value, kernel, spatial = _operands(graph, x, weight, "conv")
    strides = _per_axis("stride", stride, spatial, low=1)
    dilations = _per_axis("dilation", dilation, spatial, low=1)
    if isinstance(groups, bool) or not is_int(groups) or groups < 1:
        raise RlxValueError(f"conv: groups must be a positive int, got {groups!r}")
    taps = [int(t) for t in kernel.shape[2:]]  # type: ignore[arg-type]
    reach = [d * (t - 1) for d, t in zip(dilations, taps, strict=True)]
    pads = _padding(padding, spatial, reach, strides)
    attrs = ConvAttrs(
        tuple(strides), tuple(dilations), tuple(p[0] for p in pads), tuple(p[1] for p in pads), int(groups)
    )
    out = graph.add_node(op_kind("conv"), [value, kernel], attrs).outputs[0]
    return _add_bias(graph, out, bias, "conv")


def conv_transpose(
    graph: Graph,
    x: object,
    weight: object,
    bias: object = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    output_padding: int | Sequence[int] = 0,
    groups: int = 1,
    dilation: int | Sequence[int] = 1,
) -> Value:
    """Transposed convolution of ``x [N, C, *spatial]`` with ``weight [C, O / groups, *kernel]``,
    as ``torch.nn.functional.conv_transpose1d/2d/3d`` (same argument order): the gradient of a
    ``conv`` with these arguments w.r.t. its input, ``[N, O, *out]`` with
    ``out = (L - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1``."""
    value, kernel, spatial = _operands(graph, x, weight, "conv_transpose")
    strides = _per_axis("stride", stride, spatial, low=1)
    dilations = _per_axis("dilation", dilation, spatial, low=1)
    pads = _per_axis("padding", padding, spatial, low=0)
    extra = _per_axis("output_padding", output_padding, spatial, low=0)
    if isinstance(groups, bool) or not is_int(groups) or groups < 1:
        raise RlxValueError(f"conv_transpose: groups must be a positive int, got {groups!r}")
    channels = int(value.shape[1])  # type: ignore[arg-type]
    if kernel.shape[0] != channels or channels % groups:
        raise RlxValueError(
            f"conv_transpose: weight must be [C, O/groups, *kernel] with C = {channels} (x's channels) divisible "
            f"by groups={groups}, got {kernel.type}"
        )
    if any(e >= max(s, d) for e, s, d in zip(extra, strides, dilations, strict=True)):
        raise RlxValueError(
            f"conv_transpose: output_padding {tuple(extra)} must be smaller than the stride or the dilation (as torch)"
        )
    taps = [int(t) for t in kernel.shape[2:]]  # type: ignore[arg-type]
    sizes = [int(s) for s in value.shape[2:]]  # type: ignore[arg-type]
    out_sizes = [
        (n - 1) * s - 2 * p + d * (t - 1) + e + 1
        for n, s, p, d, t, e in zip(sizes, strides, pads, dilations, taps, extra, strict=True)
    ]
    if min(out_sizes) < 1:
        raise RlxValueError(f"conv_transpose: the output of x {value.type} would be empty ({tuple(out_sizes)})")
    # The convolution it transposes: x's shape in, this output's shape out.
    forward = ConvAttrs(tuple(strides), tuple(dilations), tuple(pads), tuple(pads), int(groups))
    out = _input_gradient(graph, value, kernel, (value.shape[0], kernel.shape[1] * groups, *out_sizes), forward)
    return _add_bias(graph, out, bias, "conv_transpose")


def _operands(graph: Graph, x: object, weight: object, what: str) -> tuple[Value, Value, int]:
    value = as_value(graph, x, f"{what}: x")
    kernel = as_value(graph, weight, f"{what}: weight")
    spatial = kernel.ndim - 2
    layout = "[C, O/groups, *kernel]" if what == "conv_transpose" else "[O, C/groups, *kernel]"
    if spatial not in (1, 2, 3) or value.ndim != spatial + 2:
        raise RlxValueError(
            f"{what}: weight must be {layout} with 1 to 3 kernel axes and x [N, C, *spatial] of the same count, "
            f"got x {value.type} and weight {kernel.type}"
        )
    if value.dtype != np.float32 or kernel.dtype != np.float32:
        raise RlxTypeError(f"{what}: x and weight must be float32, got {value.type} and {kernel.type}")
    if not all(isinstance(d, int) for d in (*value.shape[1:], *kernel.shape)):
        raise RlxValueError(f"{what}: channels, spatial axes and kernel must be static, got x {value.type}")
    return value, kernel, spatial


def _add_bias(graph: Graph, out: Value, bias: object, what: str) -> Value:
    if bias is None:
        return out
    b = as_value(graph, bias, f"{what}: bias")
    if b.shape != (out.shape[1],):
        raise RlxValueError(f"{what}: bias must be [{out.shape[1]}], got {b.type}")
    return out + graph.reshape(b, (out.shape[1], *(1,) * (out.ndim - 2)))


# ----------------------------------------------------------------------------- the op


def _out_sizes(sizes: Sequence[int], taps: Sequence[int], attrs: ConvAttrs) -> list[int]:
    return [
        (n + lo + hi - d * (t - 1) - 1) // s + 1
        for n, t, s, d, lo, hi in zip(
            sizes, taps, attrs.strides, attrs.dilations, attrs.pads_low, attrs.pads_high, strict=True
        )
    ]


def _infer(what: str, inputs: Sequence[TensorType], attrs: ConvAttrs) -> tuple[TensorType, ...]:
    x, w = inputs
    require_float(what, "x", x)
    require_float(what, "weight", w)
    spatial = w.rank - 2
    if spatial not in (1, 2, 3) or x.rank != spatial + 2:
        raise RlxValueError(f"{what}: x [N, C, *spatial] and weight [O, C/groups, *kernel] (1 to 3 axes), got {x}, {w}")
    fields = (attrs.strides, attrs.dilations, attrs.pads_low, attrs.pads_high)
    if any(len(f) != spatial for f in fields) or min(attrs.strides + attrs.dilations) < 1 or attrs.groups < 1:
        raise RlxValueError(f"{what}: strides, dilations and pads need {spatial} entries (strides, dilations >= 1)")
    if not all(isinstance(d, int) for d in (*x.shape[1:], *w.shape)):
        raise RlxValueError(f"{what}: channels, spatial axes and kernel must be static, got x {x} and weight {w}")
    channels, outputs = int(x.shape[1]), int(w.shape[0])  # type: ignore[arg-type]
    groups = attrs.groups
    if channels % groups or outputs % groups or w.shape[1] != channels // groups:
        second = channels // groups if channels % groups == 0 else "C/groups"
        raise RlxValueError(
            f"{what}: x has {channels} channels and weight is {w}: with groups={groups} the weight's second axis "
            f"must be {second} and both channel counts divisible by groups"
        )
    out = _out_sizes(x.shape[2:], w.shape[2:], attrs)  # type: ignore[arg-type]
    if min(out) < 1:
        raise RlxValueError(f"{what}: the kernel {w.shape[2:]} does not fit x {x} padded by {fields[2:]}")
    return (TensorType((x.shape[0], outputs, *out), F32),)


def _padded_array(x: np.ndarray, low: Sequence[int], high: Sequence[int]) -> np.ndarray:
    """``x`` with ``low``/``high`` zeros around each spatial axis (negative: entries cropped)."""
    out = x
    for axis, (lo, hi) in enumerate(zip(low, high, strict=True), start=2):
        n = out.shape[axis]
        shape = list(out.shape)
        shape[axis] = n + lo + hi
        result = np.zeros(shape, out.dtype)
        first, last = max(lo, 0), min(n + lo + hi, n + lo)  # entries of the result inside x
        if first < last:
            target = [slice(None)] * out.ndim
            source = [slice(None)] * out.ndim
            target[axis], source[axis] = slice(first, last), slice(first - lo, last - lo)
            result[tuple(target)] = out[tuple(source)]
        out = result
    return out


def _reference(args: Sequence[np.ndarray], attrs: ConvAttrs, ctx: EvalContext) -> np.ndarray:
    x, w = args
    spatial = w.ndim - 2
    if attrs.flip:
        w = w[(slice(None), slice(None), *(slice(None, None, -1),) * spatial)]
    padded = _padded_array(x, attrs.pads_low, attrs.pads_high)
    taps = w.shape[2:]
    out_sizes = _out_sizes(x.shape[2:], taps, attrs)
    groups, batch = attrs.groups, x.shape[0]
    per_group, outs = x.shape[1] // groups, w.shape[0] // groups
    padded = padded.reshape(batch, groups, per_group, *padded.shape[2:])
    kernel = w.reshape(groups, outs, per_group, *taps)
    out = np.zeros((batch, groups, outs, *out_sizes))
    for offsets in itertools.product(*(range(t) for t in taps)):
        window = tuple(
            slice(o * d, o * d + (n - 1) * s + 1, s)
            for o, d, s, n in zip(offsets, attrs.dilations, attrs.strides, out_sizes, strict=True)
        )
        patch = padded[(slice(None), slice(None), slice(None), *window)]  # [N, G, Cg, *out]
        out += np.einsum("ngc...,goc->ngo...", patch, kernel[(slice(None),) * 3 + tuple(offsets)])
    return out.reshape(batch, groups * outs, *out_sizes)


def _grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """The input's gradient is the transposed convolution of ``dy`` (:func:`_input_gradient`);
    the weight's is the forward's column matrix times ``dy``, per group."""
    dy = cts[0]
    assert dy is not None
    x, w = node.inputs
    attrs: ConvAttrs = node.attrs
    dx = _input_gradient(graph, dy, w, x.shape, attrs) if needed[0] else None
    dw = _weight_gradient(graph, x, dy, w, attrs) if needed[1] else None
    return [dx, dw]


def _input_gradient(graph: Graph, dy: Value, w: Value, x_shape: tuple[object, ...], attrs: ConvAttrs) -> Value:
    """The gradient w.r.t. the input ``[N, C, *L]`` of a convolution by ``w`` with ``attrs``,
    given ``dy [N, O, *n]`` (what ``conv_transpose`` computes).

    With stride 1 it is a convolution of ``dy`` with the kernel flipped and its channel axes
    swapped, padded by the kernel's reach less the padding: entry ``i`` gathers
    ``dy[i + lo - t*d] * w[t]``, so ``dy`` padded by ``P = (k-1)*d - lo`` before (and what makes
    the length ``L`` after) read at ``i + u*d`` with ``u = k-1-t``. That is one column matrix of
    ``dy`` and one BLAS product, a loop nest where the convolution is depthwise. With a larger
    stride the same convolution would read ``dy`` dilated by zeros, a product ``stride**axes``
    times larger than needed: there :func:`_strided_input_gradient` puts the column matrix's
    cotangent back by phases.
    """
    spatial = w.ndim - 2
    groups = attrs.groups
    taps = [int(t) for t in w.shape[2:]]  # type: ignore[arg-type]
    sizes = [int(s) for s in x_shape[2:]]  # type: ignore[call-overload]
    if any(s != 1 for s in attrs.strides):
        return _strided_input_gradient(graph, dy, w, sizes, attrs)
    outs, per_group = int(w.shape[0]) // groups, int(w.shape[1])  # type: ignore[call-overload]
    # [O, Cg, *k] -> [G, Og, Cg, *k] -> [G, Cg, Og, *k] -> [C, Og, *k]: channels swapped per group.
    swapped = graph.reshape(w, (groups, outs, per_group, *taps))
    swapped = graph.transpose(swapped, (0, 2, 1, *range(3, spatial + 3)))
    swapped = graph.reshape(swapped, (groups * per_group, outs, *taps))
    low = tuple((t - 1) * d - lo for t, d, lo in zip(taps, attrs.dilations, attrs.pads_low, strict=True))
    lengths = [int(n) for n in dy.shape[2:]]  # type: ignore[call-overload]
    high = tuple(size + lo - n for size, lo, n in zip(sizes, attrs.pads_low, lengths, strict=True))
    transposed = ConvAttrs((1,) * spatial, attrs.dilations, low, high, groups, not attrs.flip)
    return graph.add_node(op_kind("conv"), [dy, swapped], transposed).outputs[0]


def _strided_input_gradient(graph: Graph, dy: Value, w: Value, sizes: list[int], attrs: ConvAttrs) -> Value:
    """The input's gradient of a strided convolution: the column matrix's cotangent
    ``dy @ W^T`` (one BLAS product per group) put back where each kernel offset read, by phases.

    Along an axis of stride ``s``, kernel offset ``o`` read the padded input at ``j*s + o*d``:
    the positions of phase ``r = o*d mod s``, shifted by ``o*d // s`` on that phase's grid. So
    each phase of the padded gradient is a sum of the offsets' blocks, each padded by its shift
    (concats of zeros, read inline), and the phases interleave by one reshape: one loop nest
    writes the whole gradient. Differentiating through the strided slices instead put every
    offset's block into a copy dilated by zeros, then padded, then summed: several full-size
    buffers per kernel offset.
    """
    spatial = w.ndim - 2
    groups = attrs.groups
    taps = tuple(int(t) for t in w.shape[2:])  # type: ignore[arg-type]
    outs, per_group = int(w.shape[0]) // groups, int(w.shape[1])  # type: ignore[call-overload]
    lengths = [int(n) for n in dy.shape[2:]]  # type: ignore[call-overload]
    padded = [size + lo + hi for size, lo, hi in zip(sizes, attrs.pads_low, attrs.pads_high, strict=True)]
    steps = [-(-p // s) for p, s in zip(padded, attrs.strides, strict=True)]  # phase grid lengths
    last = graph.transpose(dy, (0, *range(2, spatial + 2), 1))  # [N, *n, O]
    batch = dy.shape[0]
    parts = []
    for group in range(groups):
        matrix = _kernel_matrix(graph, w, group, groups)  # [K*Cg, Og]
        part = last if groups == 1 else last[..., group * outs : (group + 1) * outs]
        columns = graph.matmul(part, graph.transpose(matrix, (1, 0)))  # [N, *n, K*Cg]
        blocks = graph.split(columns, len(_offsets(taps, attrs.flip)), axis=-1) if math.prod(taps) > 1 else (columns,)
        phases: dict[tuple[int, ...], Value] = {}
        for block, offsets in zip(blocks, _offsets(taps, attrs.flip), strict=True):
            phase, shift = _phase(offsets, attrs.dilations, attrs.strides)
            placed = block
            for axis, (a, n, q) in enumerate(zip(shift, lengths, steps, strict=True), start=1):
                placed = _pad_or_crop(graph, placed, axis, a, q - n - a, 0.0)
            phases[phase] = placed if phase not in phases else phases[phase] + placed
        # Interleave: [N, q1, s1, q2, s2, ..., Cg] -> [N, q1*s1, q2*s2, ..., Cg].
        grid = (batch, *(d for q in steps for d in (q, 1)), per_group)
        pieces = {}
        for phase in itertools.product(*(range(s) for s in attrs.strides)):
            found = phases.get(phase)
            pieces[phase] = zeros(graph, grid) if found is None else graph.reshape(found, grid)
        for axis in reversed(range(spatial)):
            merged: dict[tuple[int, ...], Value] = {}
            for phase in itertools.product(*(range(s) for s in attrs.strides[:axis])):
                run = [pieces[(*phase, r)] for r in range(attrs.strides[axis])]
                merged[phase] = graph.concat(run, axis=2 + 2 * axis) if len(run) > 1 else run[0]
            pieces = merged
        whole = graph.reshape(
            pieces[()], (batch, *(q * s for q, s in zip(steps, attrs.strides, strict=True)), per_group)
        )
        for axis, (size, lo, q, s) in enumerate(zip(sizes, attrs.pads_low, steps, attrs.strides, strict=True), start=1):
            whole = _pad_or_crop(graph, whole, axis, -lo, size - q * s + lo, 0.0)
        parts.append(whole)
    out = graph.concat(parts, axis=-1) if groups > 1 else parts[0]  # [N, *L, C]
    return graph.transpose(out, (0, spatial + 1, *range(1, spatial + 1)))


def _weight_gradient(graph: Graph, x: Value, dy: Value, w: Value, attrs: ConvAttrs) -> Value:
    """``dW`` per group: the forward's column matrix (built by the same calls, so ``cse`` shares
    it) times ``dy``, both with their rows flattened: one BLAS product each."""
    spatial = w.ndim - 2
    groups = attrs.groups
    taps = tuple(int(t) for t in w.shape[2:])  # type: ignore[arg-type]
    outs, per_group = int(w.shape[0]) // groups, int(w.shape[1])  # type: ignore[call-overload]
    if per_group == 1 and outs == 1:  # depthwise: sums of products, one per kernel offset
        padded = _padded(graph, x, attrs, channels_last=False)
        entries = []
        for offsets in _offsets(taps, attrs.flip):
            window = _window(padded, offsets, attrs, dy.shape[2:], first_spatial=2)
            entries.append(graph.sum(dy * window, axis=(0, *range(2, spatial + 2))))  # [C]
        stacked = graph.stack(entries, axis=1)  # [C, K]
        return graph.reshape(stacked, tuple(w.shape))
    out_sizes = [int(n) for n in dy.shape[2:]]  # type: ignore[call-overload]
    if _columns_as_planes(outs, out_sizes):
        columns = _plane_columns(graph, x, attrs, taps, out_sizes)  # [N, G, Cg * K, P], the forward's
        planes = graph.reshape(dy, (dy.shape[0], groups, outs, math.prod(out_sizes)))  # [N, G, Og, P]
        per_image = graph.matmul(planes, graph.transpose(columns, (0, 1, 3, 2)))  # [N, G, Og, Cg * K]
        return graph.reshape(graph.sum(per_image, axis=0), tuple(w.shape))
    last = graph.transpose(dy, (0, *range(2, spatial + 2), 1))  # [N, *out, O]
    parts = []
    for group, columns in enumerate(_column_matrices(graph, x, attrs, taps)):
        rows = graph.reshape(columns, (-1, columns.shape[-1]))  # [N * out, K * Cg]
        part = last if groups == 1 else last[..., group * outs : (group + 1) * outs]
        # dY^T @ columns, [Og, K*Cg], not its transpose: the weight's layout [Og, Cg, *k] then
        # reads each output channel's row of it, Cg floats apart, instead of Og*K*Cg floats apart
        # down a column (a [128, 64, 3, 3] gradient 0.20 -> 0.03 ms on a Zen 3 core pair).
        product = graph.matmul(graph.transpose(graph.reshape(part, (-1, outs)), (1, 0)), rows)  # [Og, K*Cg]
        product = graph.reshape(product, (outs, *taps, per_group))  # [Og, *k, Cg] -> [Og, Cg, *k]
        parts.append(graph.transpose(product, (0, spatial + 1, *range(1, spatial + 1))))
    return graph.concat(parts, axis=0) if groups > 1 else parts[0]


# ----------------------------------------------------------------------------- decomposition


def _decompose(graph: Graph, node: Node) -> tuple[Value, ...]:
    x, w = node.inputs
    return (_decomposed(graph, x, w, node.attrs),)


def _decomposed(graph: Graph, x: Value, w: Value, attrs: ConvAttrs) -> Value:
    """The convolution in graph ops: im2col and one BLAS product per group, or, where every
    output channel reads one input channel (depthwise), a sum of the windows times the weights
    (one loop nest, no product)."""
    spatial = w.ndim - 2
    groups = attrs.groups
    taps = tuple(int(t) for t in w.shape[2:])  # type: ignore[arg-type]
    outs, per_group = int(w.shape[0]) // groups, int(w.shape[1])  # type: ignore[call-overload]
    out_sizes = _out_sizes(x.shape[2:], taps, attrs)  # type: ignore[arg-type]
    if per_group == 1 and outs == 1:
        padded = _padded(graph, x, attrs, channels_last=False)
        total: Value | None = None
        for index, offsets in enumerate(_offsets(taps, attrs.flip)):
            window = _window(padded, offsets, attrs, out_sizes, first_spatial=2)  # [N, C, *out]
            weight = graph.reshape(w[(slice(None), 0, *np.unravel_index(index, taps))], (-1, *(1,) * spatial))
            term = window * weight
            total = term if total is None else total + term
        assert total is not None
        return total
    if _columns_as_planes(outs, out_sizes):
        columns = _plane_columns(graph, x, attrs, taps, out_sizes)  # [N, G, Cg * K, P]
        kernels = graph.reshape(w, (groups, outs, per_group * math.prod(taps)))  # [G, Og, Cg * K]
        return graph.reshape(graph.matmul(kernels, columns), (x.shape[0], groups * outs, *out_sizes))
    results = []
    for group, columns in enumerate(_column_matrices(graph, x, attrs, taps)):
        results.append(graph.matmul(columns, _kernel_matrix(graph, w, group, groups)))
    out = graph.concat(results, axis=-1) if groups > 1 else results[0]  # [N, *out, O]
    return graph.transpose(out, (0, spatial + 1, *range(1, spatial + 1)))


def _columns_as_planes(outs: int, out_sizes: Sequence[int]) -> bool:
    """Whether im2col writes its columns as planes of the output's positions (``[N, G, Cg*K,
    P]``, Caffe's layout: the product ``W [Og, Cg*K] @ columns`` per image gives ``[N, O, *out]``
    with no transpose) rather than channels last (``[N, *out, K*Cg]``, one product over every
    position of the batch).

    The column matrix is written window by window. Channels last, a window's rows are ``Cg``
    floats long and read across the input's planes (``H*W`` floats apart in NCHW); as planes,
    its rows run along the output's last axis, read along the input's. So planes win where the
    last axis fills the vector lanes: one core pair of an AMD EPYC, a 7x7 stride-2 stem over
    3 channels of [16, 3, 96, 96], forward 10.7 -> 4.0 ms (torch 5.1), with the weight's
    gradient 18.4 -> 8.0; 3x3 over [8, 8, 64, 64] 6.1 -> 2.2 (torch 2.4); [16, 32, 24, 24]
    3.8 -> 3.3; even at [16, 64, 12, 12]; and worse at [16, 128, 6, 6] (3.0 -> 3.4), whose rows
    of 6 fill no vector. The weight's gradient as planes is a product per image summed over
    the batch, ``[N, G, Og, Cg*K]``: not larger than the column matrix while ``Og <= P``."""
    return out_sizes[-1] >= PLANE_MIN_RUN and outs <= math.prod(out_sizes)


def _plane_columns(graph: Graph, x: Value, attrs: ConvAttrs, taps: tuple[int, ...], out_sizes: Sequence[int]) -> Value:
    """The im2col matrix as planes, ``[N, G, Cg * K, P]`` (channel, then kernel offset, as the
    weight's ``[O, Cg, *k]`` flattens; ``P`` the output positions): each window ``[N, C,
    *out]`` is a strided view of the padded input, stacked after the channels."""
    groups = attrs.groups
    batch, channels = x.shape[0], int(x.shape[1])  # type: ignore[call-overload]
    per_group = channels // groups
    # The groups split off x itself (a view of its buffer), not off the padded value: reshaping a
    # pad (a concat read inline) would copy it.
    grouped = graph.reshape(x, (batch, groups, per_group, *x.shape[2:]))  # [N, G, Cg, *sizes]
    padded = _spatially_padded(graph, grouped, attrs, first=3)
    shape = (batch, groups, per_group, 1, *out_sizes)
    windows = [
        graph.reshape(_window(padded, offsets, attrs, out_sizes, first_spatial=3), shape)
        for offsets in _offsets(taps, attrs.flip)
    ]
    stacked = graph.concat(windows, axis=3) if len(windows) > 1 else windows[0]  # [N, G, Cg, K, *out]
    return graph.reshape(stacked, (batch, groups, per_group * len(windows), math.prod(out_sizes)))


def _kernel_matrix(graph: Graph, w: Value, group: int, groups: int) -> Value:
    """Group ``group``'s weights ``[Og, Cg, *kernel] -> [*kernel, Cg, Og] -> [K*Cg, Og]``: rows in
    the column matrices' order (kernel offset, then channel)."""
    outs = int(w.shape[0]) // groups  # type: ignore[call-overload]
    kernel = w if groups == 1 else w[group * outs : (group + 1) * outs]
    return graph.reshape(graph.transpose(kernel, (*range(2, w.ndim), 1, 0)), (-1, outs))


def _phase(
    offsets: Sequence[int], dilations: Sequence[int], strides: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where kernel offset ``offsets`` reads along strided axes: at ``j*s + o*d``, which is phase
    ``o*d mod s`` of each axis, from ``o*d // s`` on along that phase's grid."""
    reach = [o * d for o, d in zip(offsets, dilations, strict=True)]
    phase = tuple(r % s for r, s in zip(reach, strides, strict=True))
    shift = tuple(r // s for r, s in zip(reach, strides, strict=True))
    return phase, shift


def _offsets(taps: Sequence[int], flip: bool) -> list[tuple[int, ...]]:
    """The kernel offsets in the weight's order, each as the offset of the window it reads: a
    flipped kernel's entry ``t`` reads the window at ``k - 1 - t``."""
    offsets = list(itertools.product(*(range(t) for t in taps)))
    return [tuple(t - 1 - o for o, t in zip(offset, taps, strict=True)) for offset in offsets] if flip else offsets


def _padded(graph: Graph, x: Value, attrs: ConvAttrs, channels_last: bool) -> Value:
    """``x`` padded (or cropped) around each spatial axis, channels moved last if asked."""
    spatial = x.ndim - 2
    if channels_last:
        return _spatially_padded(graph, graph.transpose(x, (0, *range(2, spatial + 2), 1)), attrs, first=1)
    return _spatially_padded(graph, x, attrs, first=2)


def _spatially_padded(graph: Graph, x: Value, attrs: ConvAttrs, first: int) -> Value:
    """``x`` padded (or cropped) by ``attrs`` along its spatial axes, which start at ``first``."""
    for axis, (lo, hi) in enumerate(zip(attrs.pads_low, attrs.pads_high, strict=True), start=first):
        x = _pad_or_crop(graph, x, axis, lo, hi, 0.0)
    return x


def _window(
    padded: Value, offsets: Sequence[int], attrs: ConvAttrs, out_sizes: Sequence[object], first_spatial: int
) -> Value:
    """The strided slice of ``padded`` that kernel offset ``offsets`` reads for every output."""
    index: list[object] = [slice(None)] * first_spatial
    for o, d, s, n in zip(offsets, attrs.dilations, attrs.strides, out_sizes, strict=True):
        index.append(slice(o * d, o * d + (n - 1) * s + 1, s))  # type: ignore[operator]
    return padded[tuple(index)]


def _column_matrices(graph: Graph, x: Value, attrs: ConvAttrs, taps: tuple[int, ...]) -> list[Value]:
    """Per group, the im2col matrix ``[N, *out, K * Cg]``: one window per kernel offset, channels last."""
    groups = attrs.groups
    per_group = int(x.shape[1]) // groups  # type: ignore[call-overload]
    out_sizes = _out_sizes(x.shape[2:], taps, attrs)  # type: ignore[arg-type]
    padded = _padded(graph, x, attrs, channels_last=True)  # [N, *padded, C]
    matrices = []
    for group in range(groups):
        source = padded if groups == 1 else padded[..., group * per_group : (group + 1) * per_group]
        columns = [
            _window(source, offsets, attrs, out_sizes, first_spatial=1) for offsets in _offsets(taps, attrs.flip)
        ]
        matrices.append(graph.concat(columns, axis=-1) if len(columns) > 1 else columns[0])
    return matrices


def _batch_conv(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> Sequence[Value]:
    """A shared kernel convolves every example's images as one batch. Kernels per example make
    one grouped convolution, as JAX batches them: the examples' channels side by side
    (``[N, n*C, ...]``), their kernels stacked (``[n*O, C/g, ...]``), ``n*g`` groups."""
    if not batched[1]:
        return _FOLD_IMAGES(graph, node, operands, batched, size)
    if not isinstance(size, int):  # the groups are a static count
        return batch_by_unrolling(graph, node, operands, batched, size)
    x, w = all_with_examples(graph, operands, batched, size)
    images, channels, spatial = x.shape[1], x.shape[2], x.shape[3:]
    side_by_side = graph.transpose(x, (1, 0, *range(2, x.ndim)))
    merged = graph.reshape(side_by_side, (images, dim_text(product((size, channels))), *spatial))
    kernels = graph.reshape(w, (dim_text(product(w.shape[:2])), *w.shape[2:]))
    attrs = replace(node.attrs, groups=node.attrs.groups * size)
    (out,) = again(graph, node, [merged, kernels], attrs)
    split = graph.reshape(out, (images, size, w.shape[1], *out.shape[2:]))
    return (graph.transpose(split, (1, 0, *range(2, split.ndim))),)


_FOLD_IMAGES = batch_into_leading(0)

register_op(
    OpDef(
        "conv",
        ("x", "weight"),
        ConvAttrs,
        _infer,
        _reference,
        _grad,
        builder=conv,
        decompose=_decompose,
        batch=_batch_conv,
        summary="N-d convolution (cross-correlation) as torch's F.conv*d",
    )
)


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


REDUCED_WINDOW_MIN = 8  # tiling windows of at least this many entries pool by a reduction (see _tiled_pool)


def pool(
    graph: Graph,
    x: object,
    kind: str,
    window: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    count_include_pad: bool = True,
    ceil_mode: bool = False,
    divisor_override: int | None = None,
) -> Value:
    """Max or average pooling of ``x [N, C, *spatial]`` over windows of the spatial axes, as
    ``torch.nn.functional.max_pool1d/2d/3d`` and ``avg_pool*d``: the windows are strided slices
    of ``x`` padded with ``-inf`` (max) or zeros (average), combined by ``maximum`` or summed;
    ``stride`` defaults to the window. With ``ceil_mode`` the output takes one more window
    where the last would only partly fit, as long as it starts inside ``x`` or its left
    padding (torch's rule). An average divides by the window's entries inside ``x`` and its
    padding (never those past the padding, which only ``ceil_mode`` reaches), by the entries
    inside ``x`` alone with ``count_include_pad=False``, or by ``divisor_override``. Where a
    window holds its maximum twice, the first entry (in the window's row-major order) gets all
    its gradient, as in torch's ``max_pool`` (:func:`_first_maximum`)."""
    what = f"{kind}_pool"
    value, sizes = _pooled_input(graph, x, what)
    spatial = len(sizes)
    taps = _per_axis("window", window, spatial, low=1)
    strides = taps if stride is None else _per_axis("stride", stride, spatial, low=1)
    dilations = _per_axis("dilation", dilation, spatial, low=1)
    pads = _per_axis("padding", padding, spatial, low=0)
    if divisor_override is not None and (not is_int(divisor_override) or int(divisor_override) < 1):
        raise RlxValueError(f"{what}: divisor_override must be a positive int or None, got {divisor_override!r}")
    if any(2 * p > t for p, t in zip(pads, taps, strict=True)):
        raise RlxValueError(f"{what}: padding {tuple(pads)} must be at most half the window {tuple(taps)} (as torch)")
    reach = [d * (t - 1) for d, t in zip(dilations, taps, strict=True)]
    out_sizes = [_pooled_size(n, p, r, st, ceil_mode) for n, p, r, st in zip(sizes, pads, reach, strides, strict=True)]
    if min(out_sizes) < 1:
        raise RlxValueError(f"{what}: the window {tuple(taps)} does not fit x {value.type} padded by {tuple(pads)}")
    # Past the right padding: what ceil_mode's last window reaches beyond it (entries of no count).
    beyond = [
        max(0, (o - 1) * st + r + 1 - (n + 2 * p))
        for o, st, r, n, p in zip(out_sizes, strides, reach, sizes, pads, strict=True)
    ]
    tiled = strides == taps and not any(pads) and not any(beyond) and set(dilations) == {1}
    if tiled and math.prod(taps) >= REDUCED_WINDOW_MIN:
        divisor = int(divisor_override) if divisor_override is not None else math.prod(taps)
        return _tiled_pool(graph, value, kind, taps, out_sizes, divisor)
    fill = float("-inf") if kind == "max" else 0.0
    windows = _phase_windows(graph, value, taps, strides, dilations, pads, beyond, out_sizes, fill)
    channels_first = (0, spatial + 1, *range(1, spatial + 1))  # the windows are channels-last
    if kind == "max":
        if math.prod(sizes) < EXACT_FLOAT_POSITIONS:
            geometry = _WindowGeometry(sizes, taps, strides, dilations, pads, out_sizes)
            return _max_by_position(graph, value, windows, geometry)
        return graph.transpose(_first_maximum(graph, windows), channels_first)
    total = windows[0]
    for part in windows[1:]:
        total = total + part
    total = graph.transpose(total, channels_first)
    if divisor_override is not None:
        return total * (1.0 / int(divisor_override))
    if (count_include_pad or not any(pads)) and not any(beyond):
        return total * (1.0 / len(windows))
    # Entries each window divides by: the same pooling of ones (of x, or of x and its padding).
    if count_include_pad:
        ones = [n + 2 * p for n, p in zip(sizes, pads, strict=True)]
        inside = np.pad(np.ones(ones), [(0, extra) for extra in beyond])
    else:
        inside = np.pad(np.ones(sizes), [(p, p + e) for p, e in zip(pads, beyond, strict=True)])
    counts = np.zeros(out_sizes)
    for offsets in itertools.product(*(range(t) for t in taps)):
        counts += inside[tuple(slice(o * d, o * d + (n - 1) * s + 1, s)
                               for o, d, s, n in zip(offsets, dilations, strides, out_sizes, strict=True))]  # fmt: skip
    return total / graph.constant(counts.astype(np.float32))


def _tiled_pool(graph: Graph, x: Value, kind: str, taps: list[int], out_sizes: list[int], divisor: int) -> Value:
    """Pooling by windows that tile ``x`` (stride = window, no padding): ``x`` (cut to whole
    windows) seen as ``[N, C, o1, k1, o2, k2, ...]`` and reduced over the ``k`` axes. A global
    average pool is one mean instead of ``H·W`` slices summed in one loop nest (which, read inline
    by a gradient, made LLVM's code for it megabytes). The maximum's gradient goes to the window's
    first maximum in row-major order, and to its last NaN where it holds one, as in
    :func:`_first_maximum`: the position is picked, then the entry taken there."""
    spatial = len(taps)
    whole = tuple(
        slice(None, o * k) if o * k != n else slice(None) for o, k, n in zip(out_sizes, taps, x.shape[2:], strict=True)
    )
    cut = x[(slice(None), slice(None), *whole)] if any(part != slice(None) for part in whole) else x
    split = graph.reshape(cut, (*cut.shape[:2], *itertools.chain.from_iterable(zip(out_sizes, taps, strict=True))))
    window_axes = tuple(3 + 2 * a for a in range(spatial))
    if kind == "avg":
        total = graph.sum(split, axis=window_axes)
        return total * (1.0 / divisor)
    order = (0, 1, *(2 + 2 * a for a in range(spatial)), *window_axes)
    flat = graph.reshape(graph.transpose(split, order), (*cut.shape[:2], *out_sizes, math.prod(taps)))
    positions = graph.constant(np.arange(math.prod(taps), dtype=np.float32))
    last_nan = graph.max(graph.where(graph.not_equal(flat, flat), positions, -1.0), axis=-1, keepdims=True)
    first = graph.argmax(flat, axis=-1, keepdims=True)
    chosen = graph.where(graph.less(last_nan, 0.0), first, last_nan.astype("int64"))
    return graph.squeeze(graph.take_along_axis(flat, chosen, -1), -1)


def adaptive_pool(graph: Graph, x: object, kind: str, output_size: int | Sequence[int | None]) -> Value:
    """Adaptive max or average pooling of ``x [N, C, *spatial]`` to ``output_size`` (an int, or
    one per spatial axis, None keeping that axis), as ``torch.nn.functional.adaptive_max_pool*d``
    and ``adaptive_avg_pool*d``: output ``i`` of an axis of length ``L`` pools entries
    ``floor(i*L/out)`` to ``ceil((i+1)*L/out)``. Where every output size divides its axis the
    windows are equal and strided (:func:`pool`); otherwise the axes are pooled one after the
    other (the last first), each as ``K`` (the longest window) gathers of one entry per window, a
    shorter window repeating its last entry (which changes neither a maximum nor which entry is first)
    and an average counting only its own. The maximum's gradient goes to the window's first
    maximum in row-major order, as torch's."""
    what = f"adaptive_{kind}_pool"
    value, sizes = _pooled_input(graph, x, what)
    spatial = len(sizes)
    wanted = [output_size] * spatial if is_int(output_size) else list(output_size)  # type: ignore[arg-type]
    if len(wanted) != spatial:
        raise RlxValueError(f"{what}: output_size needs {spatial} entries, got {output_size!r}")
    outs = [n if w is None else w for w, n in zip(wanted, sizes, strict=True)]
    if not all(is_int(o) and not isinstance(o, bool) and int(o) >= 1 for o in outs):
        raise RlxValueError(f"{what}: output sizes must be ints >= 1 (or None), got {output_size!r}")
    if all(n % int(o) == 0 for n, o in zip(sizes, outs, strict=True)):  # type: ignore[call-overload]
        window = [n // int(o) for n, o in zip(sizes, outs, strict=True)]  # type: ignore[call-overload]
        return pool(graph, value, kind, window)
    result = value
    # The last axis first: a maximum then keeps each row's first entry, and the first row of those,
    # the window's first maximum in row-major order (torch's).
    for axis in reversed(range(2, spatial + 2)):
        result = _adaptive_axis(graph, result, kind, axis, sizes[axis - 2], int(outs[axis - 2]))  # type: ignore[call-overload]
    return result


def _adaptive_axis(graph: Graph, x: Value, kind: str, axis: int, length: int, out: int) -> Value:
    """Adaptive pooling along one axis (see :func:`adaptive_pool`)."""
    starts = [i * length // out for i in range(out)]
    ends = [-(-(i + 1) * length // out) for i in range(out)]
    longest = max(e - s for s, e in zip(starts, ends, strict=True))

    def entry(position: int) -> Value:
        index: list[object] = [slice(None)] * x.ndim
        index[axis] = slice(position, position + 1)
        return x[tuple(index)]

    gathers = []
    for offset in range(longest):
        picked = [entry(min(s + offset, e - 1)) for s, e in zip(starts, ends, strict=True)]
        gathers.append(graph.concat(picked, axis=axis) if len(picked) > 1 else picked[0])
    if kind == "max":
        return _first_maximum(graph, gathers)
    shape = [1] * x.ndim
    shape[axis] = out
    total: Value | None = None
    for offset, gathered in enumerate(gathers):
        inside = np.array([offset < e - s for s, e in zip(starts, ends, strict=True)], np.float32).reshape(shape)
        term = gathered if inside.all() else gathered * graph.constant(inside)
        total = term if total is None else total + term
    assert total is not None
    counts = np.array([e - s for s, e in zip(starts, ends, strict=True)], np.float32).reshape(shape)
    return total / graph.constant(counts)


def _pooled_input(graph: Graph, x: object, what: str) -> tuple[Value, list[int]]:
    """The value a pooling reads, checked (float32 ``[N, C, *spatial]``, 1 to 3 static spatial
    axes), and its spatial sizes."""
    value = as_value(graph, x, f"{what}: x")
    spatial = value.ndim - 2
    if spatial not in (1, 2, 3) or value.dtype != np.float32:
        raise RlxValueError(f"{what}: x must be float32 [N, C, *spatial] with 1 to 3 spatial axes, got {value.type}")
    sizes = [value.shape[2 + a] for a in range(spatial)]
    if not all(isinstance(n, int) for n in sizes):
        raise RlxValueError(f"{what}: the spatial axes must be static, got {value.type}")
    return value, [int(n) for n in sizes]  # type: ignore[call-overload]


def _pooled_size(size: int, pad: int, reach: int, stride: int, ceil_mode: bool) -> int:
    """Windows along one axis, as torch's ``pooling_output_shape``: in ceil mode one more where
    the last would only partly fit, unless it would start past ``x`` and its left padding."""
    span = size + 2 * pad - reach - 1
    if not ceil_mode or span < 0:
        return span // stride + 1
    count = -(-span // stride) + 1
    return count - 1 if (count - 1) * stride >= size + pad else count


EXACT_FLOAT_POSITIONS = 1 << 24  # positions in a plane below this are exact as float32


@dataclass(frozen=True)
class _WindowGeometry:
    """Where each window of a pooling reads: the input's spatial sizes and the pooling's."""

    sizes: Sequence[int]
    taps: Sequence[int]
    strides: Sequence[int]
    dilations: Sequence[int]
    pads: Sequence[int]
    out_sizes: Sequence[int]

    def positions(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per kernel offset (row-major, as the windows), the flat position in an input plane
        each output reads ``[*out]`` and whether it lies inside the input (not the padding)."""
        result = []
        for offsets in itertools.product(*(range(t) for t in self.taps)):
            axes = [
                np.arange(n) * s + o * d - p
                for n, s, o, d, p in zip(self.out_sizes, self.strides, offsets, self.dilations, self.pads, strict=True)
            ]
            grids = np.meshgrid(*axes, indexing="ij")
            inside = np.ones(tuple(self.out_sizes), bool)
            for grid, size in zip(grids, self.sizes, strict=True):
                inside &= (grid >= 0) & (grid < size)
            clipped = tuple(np.clip(grid, 0, size - 1) for grid, size in zip(grids, self.sizes, strict=True))
            flat = np.ravel_multi_index(clipped, tuple(self.sizes))
            result.append((flat, inside))
        return result


def _max_by_position(graph: Graph, x: Value, windows: Sequence[Value], geometry: _WindowGeometry) -> Value:
    """Max pooling as torch's kernels compute it: per output, the position of the maximum
    (walking the window in row-major order, an entry inside ``x`` is taken where it is greater
    than the maximum so far or NaN: ties go to the first maximum, NaN to the last), then
    ``x`` read there. The windows (channels last) only decide the position; the result is a
    ``take_along_axis`` of ``x``, whose gradient is one scatter-add of the cotangent into the
    positions (the maximum's chain of selects, differentiated, made every input entry re-decide
    each window it lies in: nine windows of nine entries for a 3x3 pool)."""
    placed = geometry.positions()
    shape = (1, *geometry.out_sizes, 1)  # broadcast over the batch and the channels (last)
    first_inside = np.full(tuple(geometry.out_sizes), -1.0)
    for flat, inside in reversed(placed):
        first_inside = np.where(inside, flat, first_inside)
    assert (first_inside >= 0).all(), "pool() admits no window wholly in the padding"
    held: Value = graph.broadcast_to(graph.constant(np.float32(-np.inf)), windows[0].shape)
    at: Value = graph.constant(first_inside.astype(np.float32).reshape(shape))
    for window, (flat, inside) in zip(windows, placed, strict=True):
        entry = graph.stop_gradient(window)
        takes = graph.logical_or(graph.greater(entry, held), graph.not_equal(entry, entry))
        if not inside.all():
            takes = graph.logical_and(takes, graph.constant(inside.reshape(shape)))
        held = graph.where(takes, entry, held)
        at = graph.where(takes, graph.constant(flat.astype(np.float32).reshape(shape)), at)
    batch, channels = x.shape[0], x.shape[1]
    plane, outputs = math.prod(geometry.sizes), math.prod(geometry.out_sizes)
    # Flattened channels last, the positions are computed with the channels in the vector lanes
    # (as the windows run) into a buffer of their own; channels first they are a view of it.
    ids = graph.transpose(graph.reshape(at.astype("int32"), (batch, outputs, channels)), (0, 2, 1))
    flat_x = graph.reshape(x, (batch, channels, plane))
    picked = graph.take_along_axis(flat_x, ids, axis=2)
    return graph.reshape(picked, (batch, channels, *geometry.out_sizes))


def _first_maximum(graph: Graph, windows: Sequence[Value]) -> Value:
    """The elementwise maximum of ``windows``, whose gradient goes, as in torch's ``max_pool``,
    all to the first window (in the kernel's row-major order) that holds the maximum.

    ``maximum``'s own rule splits a tie in halves, and a chain of them splits a three-way tie
    1/4, 1/4, 1/2: after a ReLU, whole windows of zeros tie, and such gradients differed from
    torch's everywhere. Here the first window equal to the maximum is found (the least ``k``
    with ``windows[k] == max``) and the result is that window's value, selected, so autodiff
    sends ``dy`` to it alone. A window holding NaN gives NaN and its gradient to its last NaN,
    as torch's kernels do (they take a value when it is greater than the maximum so far or NaN).
    """
    largest = windows[0]
    for part in windows[1:]:
        largest = graph.maximum(largest, part)
    if len(windows) == 1:
        return largest
    held = graph.stop_gradient(largest)
    count = float(len(windows))
    first: Value | None = None  # the least k with windows[k] == max, else count
    last_nan: Value | None = None  # the greatest k with windows[k] NaN, else -1
    for k, part in enumerate(windows):
        index = graph.where(graph.equal(part, held), float(k), count)
        first = index if first is None else graph.minimum(first, index)
        nan = graph.where(graph.not_equal(part, part), float(k), -1.0)
        last_nan = nan if last_nan is None else graph.maximum(last_nan, nan)
    assert first is not None and last_nan is not None
    chosen = graph.where(graph.less(last_nan, 0.0), first, last_nan)
    selected = graph.where(graph.equal(chosen, 0.0), windows[0], 0.0)
    for k, part in enumerate(windows[1:], start=1):
        selected = graph.where(graph.equal(chosen, float(k)), part, selected)
    return selected


def _phase_windows(
    graph: Graph,
    x: Value,
    taps: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int],
    beyond: Sequence[int],
    out_sizes: Sequence[int],
    fill: float,
) -> list[Value]:
    """The windows a pooling reads, one per kernel offset, each ``[N, *out, C]``.

    ``x`` goes channels-last, is padded with ``fill`` (``pads`` on both sides, ``beyond`` more
    after: ceil mode's last windows), and up to a multiple of the stride, and
    is viewed as ``[N, q1, s1, q2, s2, ..., C]``: offset ``o`` reads phase ``o*d mod s`` of each
    axis from ``o*d // s`` on, a unit-stride slice. So a window's gradient is its cotangent
    padded on the phase grid and placed in its phase (concats along axes that are not the
    last, read inline), and the windows' gradients sum in one loop nest; strided slices would
    have put each into a copy dilated by zeros first.
    """
    spatial = x.ndim - 2
    last = graph.transpose(x, (0, *range(2, spatial + 2), 1))  # [N, *spatial, C]
    steps = []
    for axis, (p, extra, s) in enumerate(zip(pads, beyond, strides, strict=True), start=1):
        length = int(last.shape[axis]) + 2 * p + extra  # type: ignore[call-overload]
        steps.append(-(-length // s))
        last = _pad_or_crop(graph, last, axis, p, p + extra + steps[-1] * s - length, fill)
    grid = graph.reshape(
        last, (x.shape[0], *(d for q, s in zip(steps, strides, strict=True) for d in (q, s)), x.shape[1])
    )
    windows = []
    for offsets in itertools.product(*(range(t) for t in taps)):
        phase, shift = _phase(offsets, dilations, strides)
        index: list[object] = [slice(None)]
        for r, a, n in zip(phase, shift, out_sizes, strict=True):
            index.extend((slice(a, a + n), r))
        windows.append(grid[tuple(index)])
    return windows


def _pad_or_crop(graph: Graph, x: Value, axis: int, low: int, high: int, fill: float) -> Value:
    """``x`` with ``low`` and ``high`` entries of ``fill`` around ``axis``; a negative count
    crops that many entries instead (entry ``m`` of the result is ``x[m - low]``, or ``fill``
    outside ``x``)."""
    size = int(x.shape[axis])  # type: ignore[call-overload]
    first, last = max(-low, 0), min(size, size + high)  # the entries of x that remain
    length = size + low + high
    shape = list(x.shape)

    def filled(count: int) -> Value:
        shape[axis] = count
        return graph.broadcast_to(graph.constant(np.float32(fill)), tuple(shape))

    if first >= last:
        return filled(length)
    index: list[object] = [slice(None)] * x.ndim
    index[axis] = slice(first, last)
    kept = x[tuple(index)] if (first, last) != (0, size) else x
    before, after = max(low, 0), max(high, 0)
    parts = [p for p in (filled(before) if before else None, kept, filled(after) if after else None) if p is not None]
    return graph.concat(parts, axis=axis) if len(parts) > 1 else kept
