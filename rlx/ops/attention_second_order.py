"""Gradients of gradients through attention: the rule of ``attention_bwd`` nodes.

A Hessian-vector product, a gradient penalty (``|dL/dx|^2`` as a loss) or a meta-learning step
differentiates a graph that already holds ``attention_bwd`` nodes (what ``rlx.grad`` emits for
``attention``). Their rule restates the node in the ops of SPEC 3 over the whole
``[B, H, Sq, Sk]`` scores, as SPEC 1 writes the backward (S, the mask, P, dV, dP, dS, dQ, dK),
and differentiates that with ``rlx.grad``, as JAX differentiates attention written in ``lax``
primitives and PyTorch's math path its double backward. The restatement materialises the
scores, which the fused kernels never do: second-order terms need them (``dP`` meets the
cotangent of ``dV`` in every entry), and these graphs are rare and small next to training steps.

The mask's constants come from the compile-time ``RuntimeConfig`` (``g.config_value``), so the
restated P matches the kernels' for any ``attn_mask_neg_inf`` (a fully masked row is uniform for
a finite one, zero for ``-inf``) and ``mask_binary_threshold``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlx.ir.types import Dim, Layout, MaskKind, Wrt

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value
    from rlx.ops.attention import AttentionBwdAttrs, AttentionDims

_HEADS_FIRST = (0, 2, 1, 3)  # BSHD <-> BHSD: its own inverse


def attention_bwd_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """Cotangents of q, k, v, dy (and a BIAS tensor) from those of the node's gradients."""
    from rlx.autodiff import grad

    # One fresh value per operand slot: self-attention reads x as q, k and v, and each slot must
    # get its own partial derivative (autodiff sums the slots' contributions).
    operands = [graph.reshape(value, value.shape) for value in node.inputs]
    restated = restate_attention_bwd(graph, node.attrs, *operands)
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
    p = _softmax_rows(graph, scores)
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
    return tuple(_from_heads(graph, grads[flag](), attrs.layout) for flag in attrs.wrt.members)


def _heads(graph: Graph, x: Value, layout: Layout) -> Value:
    """``[B, H, S, D]``: each head a trailing matrix."""
    return x if layout is Layout.BHSD else graph.transpose(x, _HEADS_FIRST)


def _from_heads(graph: Graph, x: Value, layout: Layout) -> Value:
    return x if layout is Layout.BHSD else graph.transpose(x, _HEADS_FIRST)


def _expanded(graph: Graph, x: Value, dims: AttentionDims) -> Value:
    """A kv-side ``[B, Hkv, Sk, D]`` with each kv head repeated for its query heads (GQA)."""
    if dims.group == 1:
        return x
    batch, heads, rows, width = x.shape
    spread = graph.broadcast_to(
        graph.reshape(x, (batch, heads, 1, rows, width)), (batch, heads, dims.group, rows, width)
    )
    return graph.reshape(spread, (batch, dims.heads, rows, width))


def _grouped(graph: Graph, x: Value, dims: AttentionDims) -> Value:
    """A query-head ``[B, H, Sk, D]`` summed over each kv head's group: ``[B, Hkv, Sk, D]``."""
    if dims.group == 1:
        return x
    batch, _, rows, width = x.shape
    return graph.sum(graph.reshape(x, (batch, dims.kv_heads, dims.group, rows, width)), axis=2)


def _softmax_rows(graph: Graph, scores: Value) -> Value:
    """Softmax over the keys, with SPEC 4's empty rows: a row whose scores are all ``-inf`` (a
    fully masked row under ``attn_mask_neg_inf = -inf``) is 0, not NaN."""
    empty = graph.equal(graph.max(scores, axis=-1, keepdims=True), -math.inf)
    p = graph.softmax(graph.where(empty, 0.0, scores), axis=-1)
    return graph.where(empty, 0.0, p)


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
        return graph.constant(np.arange(length, dtype=np.float32)), graph.constant(float(length))
    ones = graph.broadcast_to(graph.constant(1.0), (length,))
    return graph.sub(graph.cumsum(ones), 1.0), graph.sum(ones)
