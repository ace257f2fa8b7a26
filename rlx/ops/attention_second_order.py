"""Gradients of gradients through attention: the rules of ``attention_bwd`` and
``flex_attention_bwd`` nodes.

A Hessian-vector product, a gradient penalty (``|dL/dx|^2`` as a loss) or a meta-learning step
differentiates a graph that already holds attention backward nodes (what ``rlx.grad`` emits for
attention). Their rules restate the node in the ops of SPEC 3 over the whole ``[B, H, Sq, Sk]``
scores and differentiate that with ``rlx.grad``, as JAX differentiates attention written in
``lax`` primitives and PyTorch's math path its double backward: the fixed-mask backward as SPEC
1 writes it (S, the mask, P, dV, dP, dS, dQ, dK); the programmable one as the first-order
gradient, taken by ``rlx.grad``, of the forward restated with its mods evaluated over index
grids (:func:`evaluate_region`), so no mod's derivative is written by hand. The restatements
materialise the scores, which the fused kernels never do: second-order terms need them (``dP``
meets the cotangent of ``dV`` in every entry), and these graphs are rare and small next to
training steps.

The mask's constants come from the compile-time ``RuntimeConfig`` (``g.config_value``), so the
restated P matches the kernels' for any ``attn_mask_neg_inf`` (a fully masked row is uniform for
a finite one, zero for ``-inf``) and ``mask_binary_threshold``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxValueError
from rlx.ir.types import Dim, Layout, MaskKind, Wrt

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value
    from rlx.ir.region import Region
    from rlx.ops.attention import AttentionBwdAttrs, AttentionDims
    from rlx.ops.flex_attention import FlexAttentionBwdAttrs, FlexDims

_HEADS_FIRST = (0, 2, 1, 3)  # BSHD <-> BHSD: its own inverse


def attention_bwd_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """Cotangents of q, k, v, dy (and a BIAS tensor) from those of the node's gradients."""
    operands = _slot_operands(graph, node)
    return _vjp(graph, node, operands, restate_attention_bwd(graph, node.attrs, *operands), cotangents, needed)


def flex_attention_bwd_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """Cotangents of a programmable backward's operands from those of its gradients.

    The node's results are functions of q, k, v, dy (and dlse) and the captured tensors alone:
    its ``out`` and ``lse`` operands are the forward's results, read to save recomputing them. So
    the restatement recomputes them, and those operands get no cotangent of their own (the
    forward's rule carries what flows through them). A tensor's gradient comes as partial sums
    (``tensor_grad_layout``) that ``rlx.grad`` adds with a ``sum`` over their first axis; the
    restatement spreads the whole gradient evenly over the partials, which is exact for
    cotangents equal across them, as such a sum gives: other readers of the partials are refused.
    """
    from rlx.autodiff import grad
    from rlx.ops.flex_attention import bwd_slots, flex_dims, tensor_grad_layout

    attrs: FlexAttentionBwdAttrs = node.attrs
    slots = bwd_slots(attrs)
    operands = _slot_operands(graph, node)
    named = dict(zip(slots, operands, strict=False))
    captured = operands[len(slots) :]
    q, k, v, dy = (named[slot] for slot in ("q", "k", "v", "dy"))
    dims = flex_dims(f"flex_attention_bwd (node {node.id})", q.type, k.type, v.type, attrs.layout)
    out, lse = restate_flex_attention(graph, attrs.score_mod, attrs.mask_mod, attrs.scale, attrs.layout, dims,
                                      q, k, v, captured)  # fmt: skip
    objective = graph.sum(graph.mul(dy, out))
    if attrs.lse_grad:  # an empty row's -inf LSE has no gradient: kept out of the product
        finite_lse = graph.where(graph.equal(lse, -math.inf), 0.0, lse)
        objective = graph.add(objective, graph.sum(graph.mul(named["dlse"], finite_lse)))
    by_flag = {Wrt.QUERY: q, Wrt.KEY: k, Wrt.VALUE: v}
    layout = tensor_grad_layout(attrs.score_mod, [c.type for c in captured], dims) if attrs.tensor_grads else []
    xs = [by_flag[flag] for flag in attrs.wrt.members] + [captured[tensor] for tensor, _, _, _ in layout]
    first = grad(graph, objective, xs)
    restated = first[: len(attrs.wrt.members)]
    for (_, partials, _, _), whole in zip(layout, first[len(restated) :], strict=True):
        if cotangents[len(restated)] is not None:
            _check_summed_partials(graph, node, len(restated))
        restated.append(_spread(graph, whole, partials))
    return _vjp(graph, node, operands, tuple(restated), cotangents, needed)


def _slot_operands(graph: Graph, node: Node) -> list[Value]:
    """One fresh value per operand slot: self-attention reads x as q, k and v, and each slot must
    get its own partial derivative (autodiff sums the slots' contributions)."""
    return [graph.reshape(value, value.shape) for value in node.inputs]


def _vjp(
    graph: Graph,
    node: Node,
    operands: list[Value],
    restated: tuple[Value, ...],
    cotangents: Sequence[Value | None],
    needed: Sequence[bool],
) -> list[Value | None]:
    """The cotangents of ``operands`` (the node's, slot by slot) given those of ``restated``."""
    from rlx.autodiff import grad

    terms = [graph.sum(graph.mul(cotangent, value)) for cotangent, value in zip(cotangents, restated, strict=True)
             if cotangent is not None]  # fmt: skip
    total = terms[0]
    for term in terms[1:]:
        total = graph.add(total, term)
    wanted = [slot for slot, want in enumerate(needed) if want]
    grads = grad(graph, total, [operands[slot] for slot in wanted])
    result: list[Value | None] = [None] * len(node.inputs)
    for slot, value in zip(wanted, grads, strict=True):
        result[slot] = value
    return result


def _check_summed_partials(graph: Graph, node: Node, index: int) -> None:
    """Refuse a node whose partial tensor gradients are read otherwise than summed over axis 0."""
    partials = node.outputs[index]
    summed = all(
        user.op.value == "sum" and user.attrs.axes == (0,) and not user.attrs.keepdims
        for user, _ in graph.uses(partials)
    )
    if not summed or graph.output_names_of(partials):
        raise RlxValueError(
            f"grad: the partial tensor gradients of flex_attention_bwd (node {node.id}) are read otherwise than "
            "summed over their first axis; only their sum has a second-order rule"
        )


def _spread(graph: Graph, whole: Value, partials: Dim) -> Value:
    """``whole`` divided evenly over ``partials`` rows: ``[partials, *whole.shape]``."""
    share = graph.reshape(graph.div(whole, _length(graph, partials)), (1, *whole.shape))
    return graph.broadcast_to(share, (partials, *whole.shape))


def restate_attention_bwd(
    graph: Graph, attrs: AttentionBwdAttrs, q: Value, k: Value, v: Value, dy: Value, *mask_input: Value
) -> tuple[Value, ...]:
    """The node's outputs (its ``wrt`` gradients, in Q, K, V order) from matmul, softmax and where,
    SPEC 1's formulas step by step."""
    from rlx.ops.attention import attention_dims

    dims = attention_dims(
        "attention_bwd", q.type, k.type, v.type, attrs.layout, dy.type, attrs.mask,
        mask_input[0].type if mask_input else None,
    )  # fmt: skip
    qh, dyh = _heads(graph, q, attrs.layout), _heads(graph, dy, attrs.layout)
    kh, vh = (_expanded(graph, _heads(graph, x, attrs.layout), dims) for x in (k, v))
    scale = 1.0 / math.sqrt(dims.head_dim)
    scores = graph.mul(graph.matmul(qh, graph.transpose(kh, (0, 1, 3, 2))), scale)
    if attrs.mask == MaskKind.BIAS:
        scores = graph.add(scores, mask_input[0])
    hidden = _hidden(graph, attrs.mask, dims, mask_input)
    if hidden is not None:
        scores = graph.where(hidden, graph.config_value("attn_mask_neg_inf"), scores)
    p, _ = _softmax_and_lse(graph, scores)  # a row masked whole under neg = -inf: P = 0, not NaN
    dp = graph.matmul(dyh, graph.transpose(vh, (0, 1, 3, 2)))
    row_dot = graph.sum(graph.mul(p, dp), axis=-1, keepdims=True)
    ds = graph.mul(graph.mul(p, graph.sub(dp, row_dot)), scale)
    if hidden is not None:
        ds = graph.where(hidden, 0.0, ds)
    grads = {
        Wrt.QUERY: lambda: graph.matmul(ds, kh),
        Wrt.KEY: lambda: _grouped(graph, graph.matmul(graph.transpose(ds, (0, 1, 3, 2)), qh), dims),
        Wrt.VALUE: lambda: _grouped(graph, graph.matmul(graph.transpose(p, (0, 1, 3, 2)), dyh), dims),
    }
    return tuple(_heads(graph, grads[flag](), attrs.layout) for flag in attrs.wrt.members)


def _heads(graph: Graph, x: Value, layout: Layout) -> Value:
    """``[B, H, S, D]`` from ``layout``, each head a trailing matrix; and back (its own inverse)."""
    return x if layout is Layout.BHSD else graph.transpose(x, _HEADS_FIRST)


def _expanded(graph: Graph, x: Value, dims: AttentionDims | FlexDims) -> Value:
    """A kv-side ``[B, Hkv, Sk, D]`` with each kv head repeated for its query heads (GQA)."""
    if dims.group == 1:
        return x
    batch, heads, rows, width = x.shape
    spread = graph.broadcast_to(
        graph.reshape(x, (batch, heads, 1, rows, width)), (batch, heads, dims.group, rows, width)
    )
    return graph.reshape(spread, (batch, dims.heads, rows, width))


def _grouped(graph: Graph, x: Value, dims: AttentionDims | FlexDims) -> Value:
    """A query-head ``[B, H, Sk, D]`` summed over each kv head's group: ``[B, Hkv, Sk, D]``."""
    if dims.group == 1:
        return x
    batch, _, rows, width = x.shape
    return graph.sum(graph.reshape(x, (batch, dims.kv_heads, dims.group, rows, width)), axis=2)


def _hidden(graph: Graph, mask: MaskKind, dims: AttentionDims, mask_input: Sequence[Value]) -> Value | None:
    """Where the mask replaces scores, broadcastable to ``[B, H, Sq, Sk]``; None for none."""
    if mask == MaskKind.CUSTOM:
        (padding,) = mask_input
        below = graph.less(padding, graph.config_value("mask_binary_threshold"))
        return graph.reshape(below, (padding.shape[0], 1, 1, padding.shape[1]))
    if not mask.is_causal_like:
        return None
    rows, row_count = _positions(graph, dims.seq_q)
    keys, key_count = _positions(graph, dims.seq_k)
    diagonal = graph.reshape(rows, (dims.seq_q, 1))
    if dims.seq_q != dims.seq_k:  # bottom-right aligned: offset max(Sk - Sq, 0)
        diagonal = graph.add(diagonal, graph.maximum(graph.sub(key_count, row_count), 0.0))
    keys = graph.reshape(keys, (1, dims.seq_k))
    hidden = graph.greater(keys, diagonal)
    if mask.window is not None:
        hidden = graph.logical_or(hidden, graph.less(keys, graph.sub(diagonal, float(mask.window))))
    return hidden


def _positions(graph: Graph, length: Dim) -> tuple[Value, Value]:
    """``arange(length)`` and ``length`` as float32 values (exact below 2**24; a symbolic length
    is counted per call)."""
    if isinstance(length, int):
        return graph.constant(np.arange(length, dtype=np.float32)), _length(graph, length)
    ones = graph.broadcast_to(graph.constant(1.0), (length,))
    return graph.sub(graph.cumsum(ones), 1.0), _length(graph, length)


def _length(graph: Graph, length: Dim) -> Value:
    """``length`` as a float32 value: a constant, or counted per call for a symbolic one."""
    if isinstance(length, int):
        return graph.constant(float(length))
    return graph.sum(graph.broadcast_to(graph.constant(1.0), (length,)))


def restate_flex_attention(
    graph: Graph,
    score_mod: Region | None,
    mask_mod: Region | None,
    scale: float | None,
    layout: Layout,
    dims: FlexDims,
    q: Value,
    k: Value,
    v: Value,
    captured: Sequence[Value],
) -> tuple[Value, Value]:
    """``(out, lse)`` of programmable attention (SPEC 4) from matmul, the mods over index grids
    and a softmax whose rows without a visible key are 0 (LSE ``-inf``)."""
    qh = _heads(graph, q, layout)
    kh, vh = (_expanded(graph, _heads(graph, x, layout), dims) for x in (k, v))
    factor = 1.0 / math.sqrt(dims.head_dim) if scale is None else scale
    scores = graph.mul(graph.matmul(qh, graph.transpose(kh, (0, 1, 3, 2))), factor)
    symbols = _grid_symbols(graph, dims)
    full = scores.shape
    if score_mod is not None:
        scores = evaluate_region(graph, score_mod, {**symbols, "score": scores}, captured)
    if mask_mod is not None:
        visible = evaluate_region(graph, mask_mod, symbols, captured)
        scores = graph.where(visible, scores, -math.inf)
    if scores.shape != full:  # a score_mod that ignores the score (a constant, a bias by position)
        scores = graph.broadcast_to(scores, full)
    p, lse = _softmax_and_lse(graph, scores)
    return _heads(graph, graph.matmul(p, vh), layout), lse


def _softmax_and_lse(graph: Graph, scores: Value) -> tuple[Value, Value]:
    """Row softmax and log-sum-exp; a row of ``-inf`` scores gives 0 and ``-inf``."""
    peak = graph.max(scores, axis=-1, keepdims=True)
    empty = graph.equal(peak, -math.inf)
    shift = graph.where(empty, 0.0, peak)
    weights = graph.exp(graph.sub(scores, shift))
    total = graph.sum(weights, axis=-1, keepdims=True)
    p = graph.div(weights, graph.where(graph.equal(total, 0.0), 1.0, total))
    lse = graph.add(graph.log(total), shift)
    return p, graph.reshape(lse, lse.shape[:-1])


def _grid_symbols(graph: Graph, dims: FlexDims) -> dict[str, Value]:
    """A region's int symbols as int64 grids broadcasting to ``[B, H, Sq, Sk]``, and the lengths."""
    batch, _ = _int_positions(graph, dims.batch)
    rows, row_count = _int_positions(graph, dims.seq_q)
    keys, key_count = _int_positions(graph, dims.seq_k)
    heads = graph.constant(np.arange(dims.heads, dtype=np.int64).reshape(1, dims.heads, 1, 1))
    return {
        "b": graph.reshape(batch, (dims.batch, 1, 1, 1)),
        "h": heads,
        "q_idx": graph.reshape(rows, (1, 1, dims.seq_q, 1)),
        "kv_idx": graph.reshape(keys, (1, 1, 1, dims.seq_k)),
        "q_len": row_count,
        "kv_len": key_count,
    }


def _int_positions(graph: Graph, length: Dim) -> tuple[Value, Value]:
    """``arange(length)`` and ``length`` as int64 values."""
    if isinstance(length, int):
        return graph.constant(np.arange(length, dtype=np.int64)), graph.constant(np.int64(length))
    positions, count = _positions(graph, length)
    return graph.cast(positions, "int64"), graph.cast(count, "int64")


_UNARY = {"exp": "exp", "log": "log", "tanh": "tanh", "sigmoid": "sigmoid", "sqrt": "sqrt", "neg": "neg", "abs": "abs"}
_FLOAT_RESULT = frozenset({"exp", "log", "tanh", "sigmoid", "sqrt", "div"})
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "maximum": "maximum", "minimum": "minimum", "div": "div",
           "floordiv": "floor_divide", "mod": "remainder", "less": "less", "less_equal": "less_equal",
           "greater": "greater", "greater_equal": "greater_equal", "equal": "equal", "not_equal": "not_equal",
           "logical_and": "logical_and", "logical_or": "logical_or"}  # fmt: skip


def evaluate_region(graph: Graph, region: Region, symbols: dict[str, Value], tensors: Sequence[Value]) -> Value:
    """A traced mod as graph ops over broadcasting values of its symbols, with
    :meth:`Region.evaluate`'s semantics (NumPy's: an int and a float make a float, ``div`` is
    true division, ``floordiv`` and ``mod`` take the divisor's sign); ``read`` gathers a
    captured tensor at the flat position of its indices."""
    values: list[Value] = []

    def get(ref: tuple[str, object]) -> Value:
        kind, value = ref
        if kind == "s":
            return symbols[str(value)]
        if kind == "t":
            return values[int(value)]  # type: ignore[call-overload]
        if isinstance(value, bool):
            return graph.constant(np.bool_(value))
        if isinstance(value, int):
            return graph.constant(np.int64(value))
        return graph.constant(np.float32(float(value)))  # type: ignore[arg-type]

    for step in region.steps:
        if step.op == "read":
            tensor = tensors[int(step.args[0][1])]
            values.append(_read(graph, tensor, [get(ref) for ref in step.args[1:]]))
            continue
        args = [get(ref) for ref in step.args]
        if step.op == "id":
            values.append(args[0])
        elif step.op == "logical_not":
            values.append(graph.logical_not(args[0]))
        elif step.op == "where":
            a, b = _promoted(graph, args[1:], float_result=False)
            values.append(graph.where(args[0], a, b))
        elif step.op in _UNARY:
            (x,) = _promoted(graph, args, float_result=step.op in _FLOAT_RESULT)
            values.append(getattr(graph, _UNARY[step.op])(x))
        else:
            a, b = _promoted(graph, args, float_result=step.op in _FLOAT_RESULT)
            values.append(getattr(graph, _BINARY[step.op])(a, b))
    return values[-1]


def _promoted(graph: Graph, args: Sequence[Value], float_result: bool) -> list[Value]:
    """Ints (and bools among numbers) as float32 where a float takes part or the op makes one."""
    kinds = {arg.dtype.kind for arg in args}
    if float_result or "f" in kinds:
        return [arg if arg.dtype.kind == "f" else graph.cast(arg, "float32") for arg in args]
    return list(args)


def _read(graph: Graph, tensor: Value, index: Sequence[Value]) -> Value:
    """``tensor[i0, i1, ...]`` for broadcasting int index values: a gather at the flat position."""
    flat: Value | None = None
    for axis, position in enumerate(index):
        position = graph.cast(position, "int64") if position.dtype != np.int64 else position
        flat = position if flat is None else graph.add(graph.mul(flat, _int_size(graph, tensor.shape[axis])), position)
    assert flat is not None, "a read names at least one index"
    return graph.take(graph.reshape(tensor, (-1,)), flat)


def _int_size(graph: Graph, size: Dim) -> Value:
    return graph.constant(np.int64(size)) if isinstance(size, int) else graph.cast(_length(graph, size), "int64")
