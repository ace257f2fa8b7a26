"""Scaled-dot-product attention and its backward: SPEC section 1, defined once.

``attention`` is the forward; ``attention_bwd`` recomputes scores and softmax and produces the
gradients its ``wrt`` flags name, in Q, K, V order. Reverse mode emits one single-``wrt``
backward node per operand; ``rlx.passes.fuse_attention_bwd`` merges siblings, and ``dce`` narrows
a half-used one (:func:`_narrow_attention_bwd`). The lowering is ``rlx/codegen/lower_attention.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx.config import RuntimeConfig, resolve_config
from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import Dim, Layout, MaskKind, TensorType, Wrt
from rlx.ops._batching import batch_into_leading
from rlx.ops._common import F32, op_kind, zeros

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value
    from rlx.ir.region import Region


@dataclass(frozen=True)
class AttentionAttrs:
    """Forward scaled-dot-product attention: ``softmax(mask(Q K^T / sqrt(D))) V``."""

    mask: MaskKind = MaskKind.NONE
    layout: Layout = Layout.BSHD


@dataclass(frozen=True)
class AttentionBwdAttrs:
    """Attention backward that recomputes scores and softmax; one output per ``wrt`` flag."""

    wrt: Wrt
    mask: MaskKind = MaskKind.NONE
    layout: Layout = Layout.BSHD


@dataclass(frozen=True)
class AttentionDims:
    """The sizes an attention node works on, read from its operand types."""

    batch: Dim  # the batch and the sequence lengths may be symbolic dimensions, sized per call
    heads: int
    seq_q: Dim
    seq_k: Dim
    head_dim: int
    kv_heads: int = 0  # 0: as many as heads (k and v may have fewer: GQA / MQA)
    value_dim: int = 0  # 0: head_dim (v may have its own head dim)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_heads", self.kv_heads or self.heads)
        object.__setattr__(self, "value_dim", self.value_dim or self.head_dim)

    @property
    def group(self) -> int:
        """Query heads per kv head: query head h reads kv head h // group."""
        return self.heads // self.kv_heads


def attention_dims(
    what: str,
    q: TensorType,
    k: TensorType,
    v: TensorType,
    layout: Layout,
    dy: TensorType | None = None,
    mask: MaskKind = MaskKind.NONE,
    mask_tensor: TensorType | None = None,
) -> AttentionDims:
    """Check the operands of an attention (or attention backward) node and return its sizes.

    Raises ``RlxTypeError`` for a dtype other than float32 and ``RlxValueError`` for a wrong
    rank, a size mismatch, or a missing / extra / misshapen mask tensor. Messages name ``what``.
    """
    tensors = [("q", q), ("k", k), ("v", v)] + ([("dy", dy)] if dy is not None else [])
    operands = tensors + ([("mask_input", mask_tensor)] if mask_tensor is not None else [])
    for label, ty in operands:
        if ty.dtype != F32:
            raise RlxTypeError(f"{what}: {label} must be f32, got {ty.dtype_name} ({ty})")
    # Only q, k, v and dy are rank 4; the mask tensor's shape is checked below.
    for label, ty in tensors:
        if ty.rank != 4:
            raise RlxValueError(f"{what}: {label} must have rank 4 ({_layout_names(layout)}), got {ty}")
    b, sq, h, d = layout.split(q.shape)
    kb, sk, hkv, kd = layout.split(k.shape)
    dv = layout.split(v.shape)[3]
    h, d, hkv, dv = static_sizes(what, layout, q, k, v, (h, d, hkv, dv))
    if (kb, kd) != (b, d) or hkv > h or h % hkv:
        raise RlxValueError(
            f"{what}: k must have batch {b}, heads {h} and head_dim {d} like q {q} "
            f"(or a number of heads dividing {h}: GQA) (layout {layout}: {_layout_names(layout)}), got {k}"
        )
    want_v = layout.join(b, sk, hkv, dv)
    if v.shape != want_v:
        raise RlxValueError(f"{what}: v must be f32{list(want_v)} to match q {q} and k {k}, got {v}")
    want_q = layout.join(b, sq, h, dv)
    if dy is not None and dy.shape != want_q:
        raise RlxValueError(f"{what}: dy must be f32{list(want_q)} (the shape of the output), got {dy}")
    if mask.needs_tensor:
        if mask_tensor is None:
            raise RlxValueError(f"{what}: mask {mask} needs a mask_input tensor")
        want_mask = (b, sk) if mask == MaskKind.CUSTOM else (b, h, sq, sk)
        if mask_tensor.shape != want_mask:
            meaning = "[B, Sk] key padding" if mask == MaskKind.CUSTOM else "[B, H, Sq, Sk] additive bias"
            raise RlxValueError(
                f"{what}: mask_input for mask {mask} must be f32{list(want_mask)} ({meaning}), got {mask_tensor}"
            )
    elif mask_tensor is not None:
        raise RlxValueError(f"{what}: mask {mask} takes no mask_input tensor (only custom and bias do)")
    return AttentionDims(batch=b, heads=h, seq_q=sq, seq_k=sk, head_dim=d, kv_heads=hkv, value_dim=dv)


def static_sizes(
    what: str, layout: Layout, q: TensorType, k: TensorType, v: TensorType, sizes: tuple[Dim, ...]
) -> tuple[int, ...]:
    """Heads and head dims as ints: the kernels are generated for them. Only the batch and the
    sequence lengths may be symbolic dimensions."""
    if not all(isinstance(size, int) for size in sizes):
        raise RlxValueError(
            f"{what}: only the batch and the sequence lengths of attention operands may be symbolic dimensions; the "
            f"heads and head dims must be static (layout {layout}: {_layout_names(layout)}), got q {q}, k {k}, v {v}"
        )
    return sizes  # type: ignore[return-value]


def _layout_names(layout: Layout) -> str:
    return "[B, S, H, D]" if layout is Layout.BSHD else "[B, H, S, D]"


def _attention_shape(what: str, inputs: Sequence[TensorType], attrs: AttentionAttrs) -> tuple[TensorType, ...]:
    if len(inputs) not in (3, 4):
        raise RlxValueError(f"{what}: attention takes q, k, v and an optional mask tensor, got {len(inputs)} inputs")
    q, k, v = inputs[:3]
    dims = attention_dims(what, q, k, v, attrs.layout, None, attrs.mask, inputs[3] if len(inputs) == 4 else None)
    return (TensorType(attrs.layout.join(dims.batch, dims.seq_q, dims.heads, dims.value_dim), F32),)


def _attention_bwd_shape(what: str, inputs: Sequence[TensorType], attrs: AttentionBwdAttrs) -> tuple[TensorType, ...]:
    if len(inputs) not in (4, 5):
        raise RlxValueError(
            f"{what}: attention_bwd takes q, k, v, dy and an optional mask tensor, got {len(inputs)} inputs"
        )
    q, k, v, dy = inputs[:4]
    attention_dims(what, q, k, v, attrs.layout, dy, attrs.mask, inputs[4] if len(inputs) == 5 else None)
    by_flag = {Wrt.QUERY: q, Wrt.KEY: k, Wrt.VALUE: v}
    return tuple(TensorType(by_flag[flag].shape, F32) for flag in attrs.wrt.members)


def check_wrt(wrt: object, what: str) -> Wrt:
    """Validate a user ``wrt`` argument: a non-empty ``Wrt`` flag set."""
    if not isinstance(wrt, Wrt):
        raise RlxTypeError(f"{what}: wrt must be an rlx.Wrt flag, got {type(wrt).__name__}")
    if not wrt:
        raise RlxValueError(f"{what}: wrt must name at least one of Wrt.QUERY, Wrt.KEY, Wrt.VALUE")
    return wrt


def check_mask(mask: object, what: str) -> MaskKind:
    if not isinstance(mask, MaskKind):
        raise RlxTypeError(f"{what}: mask must be an rlx.MaskKind, got {type(mask).__name__}")
    return mask


def check_layout(layout: object, what: str) -> Layout:
    if not isinstance(layout, Layout):
        raise RlxTypeError(f"{what}: layout must be an rlx.Layout, got {type(layout).__name__}")
    return layout


# ----------------------------------------------------------------------------- float64 reference


def attention_forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    mask: MaskKind = MaskKind.NONE,
    layout: Layout = Layout.BSHD,
    mask_tensor: np.ndarray | None = None,
    config: RuntimeConfig | None = None,
) -> np.ndarray:
    """``out = softmax(mask(Q K^T / sqrt(D))) V`` in float64 (a new array in ``layout``).

    The mask runs as the mods it stands for (:func:`mask_regions`), through programmable
    attention's reference: one definition of what attention computes.
    """
    from rlx.ops.flex_attention import FlexAttentionAttrs, flex_attention_forward

    config = resolve_config(config)
    _check_shapes("attention_forward", q, k, v, None, mask, layout, mask_tensor)
    if no_pairs(q, k):
        return np.zeros((*np.shape(q)[:-1], np.shape(v)[-1]))
    score_mod, mask_mod, captured = _as_mods(mask, mask_tensor, config)
    out, _ = flex_attention_forward(q, k, v, captured, FlexAttentionAttrs(score_mod, mask_mod, None, layout))
    return out


def attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dy: np.ndarray,
    *,
    wrt: Wrt = Wrt.ALL,
    mask: MaskKind = MaskKind.NONE,
    layout: Layout = Layout.BSHD,
    mask_tensor: np.ndarray | None = None,
    config: RuntimeConfig | None = None,
) -> tuple[np.ndarray, ...]:
    """The gradients selected by ``wrt``, in Q, K, V order, in float64 (new arrays in ``layout``).

    ``dS`` is zero wherever the mask replaced a score: those scores are constants (the mask's
    score_mod ``where(hidden, neg, score)`` has derivative 0 there), so no gradient reaches Q or
    K through them, even though a fully masked row has a uniform P.
    """
    from rlx.ops.flex_attention import (
        FlexAttentionAttrs,
        FlexAttentionBwdAttrs,
        flex_attention_backward,
        flex_attention_forward,
    )

    config = resolve_config(config)
    _check_shapes("attention_backward", q, k, v, dy, mask, layout, mask_tensor)
    if no_pairs(q, k):
        return no_pair_grads(q, k, v, wrt)
    score_mod, mask_mod, captured = _as_mods(mask, mask_tensor, config)
    # D = rowsum(dY * out), not rowsum(P * dP) over the visible keys alone: a NaN in the value
    # row of a hidden key reaches out (0 * NaN) and so every gradient of that row, as SPEC 1's
    # formula and the fixed kernels' plain rowsum(P * dP) propagate it.
    out, _ = flex_attention_forward(q, k, v, captured, FlexAttentionAttrs(score_mod, mask_mod, None, layout))
    attrs = FlexAttentionBwdAttrs(wrt, score_mod=score_mod, mask_mod=mask_mod, layout=layout)
    shapes = [TensorType(np.shape(t), F32) for t in captured]
    return flex_attention_backward(q, k, v, out, dy, None, None, captured, attrs, shapes)


def _as_mods(
    mask: MaskKind, mask_tensor: np.ndarray | None, config: RuntimeConfig
) -> tuple[Region | None, Region | None, list[np.ndarray]]:
    """The mask's traced regions and the arrays they read."""
    captured = [mask_tensor] if mask_tensor is not None and mask.needs_tensor else []
    mask_type = TensorType(tuple(np.shape(captured[0])), F32) if captured else None
    score_mod, mask_mod = mask_regions(mask, mask_type, config.attn_mask_neg_inf, config.mask_binary_threshold)
    return score_mod, mask_mod, captured


@functools.lru_cache(maxsize=256)
def mask_regions(
    mask: MaskKind, mask_type: TensorType | None, neg: float, threshold: float
) -> tuple[Region | None, Region | None]:
    """``(score_mod, mask_mod)`` regions of a MaskKind (:func:`rlx.mods.from_mask_kind`), whose
    one captured tensor, if any, is the node's ``mask_input`` of type ``mask_type``."""
    from rlx.ir.graph import Graph
    from rlx.mods import from_mask_kind, trace

    graph = Graph("mask")
    tensor = graph.input("mask_input", mask_type.shape, mask_type.dtype) if mask_type is not None else None
    score_mod, mask_mod = from_mask_kind(mask, tensor, neg=neg, threshold=threshold)
    captured: list[Value] = []
    score = trace(graph, score_mod, "score_mod", captured) if score_mod is not None else None
    masked = trace(graph, mask_mod, "mask_mod", captured) if mask_mod is not None else None
    return score, masked


def masked_positions(
    mask: MaskKind, mask_tensor: np.ndarray | None, seq_q: int, seq_k: int, threshold: float
) -> np.ndarray | None:
    """Where the mask REPLACES scores by ``neg``, broadcastable to ``[B, H, Sq, Sk]``: SPEC 1's
    formula written out, independent of the mods (tests check the two against each other).

    ``None`` when nothing is replaced (NONE, and BIAS, which adds instead of replacing).
    """
    if mask == MaskKind.CUSTOM:
        assert mask_tensor is not None
        return (np.asarray(mask_tensor) < threshold)[:, None, None, :]
    if mask.is_causal_like:
        offset = max(seq_k - seq_q, 0)  # bottom-right alignment: the last query sees the last key
        rows = np.arange(seq_q)[:, None]
        cols = np.arange(seq_k)[None, :]
        hidden = cols > offset + rows
        if mask.window is not None:
            hidden |= cols < offset + rows - mask.window
        return hidden
    return None


def safe_softmax(scores: np.ndarray) -> np.ndarray:
    """Max-subtracted softmax over the last axis; a row that is entirely ``-inf`` gives zeros, not NaN."""
    row_max = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)  # no keys: -inf
    row_max = np.where(np.isneginf(row_max), 0.0, row_max)
    exps = np.exp(scores - row_max)
    total = np.sum(exps, axis=-1, keepdims=True)
    return exps / np.where(total == 0.0, 1.0, total)  # total is 0 only for all -inf rows


def array_dims(x: np.ndarray) -> tuple[Dim, ...]:
    """A call's array's shape as a type's dimensions: a type has no size 0, so an empty axis (a
    call's zero-size dimension) reads as the symbol ``empty``."""
    return tuple(size or "empty" for size in np.shape(x))


def no_pairs(q: np.ndarray, k: np.ndarray) -> bool:
    """Whether a call has no (query, key) pair: no batch, no heads, no queries or no keys (every
    axis but the head dim, in either layout). Nothing is scored, masked or indexed then: the
    output is 0 (no keys), the LSE -inf, every gradient 0."""
    return 0 in np.shape(q)[:-1] or 0 in np.shape(k)[:-1]


def no_pair_grads(q: np.ndarray, k: np.ndarray, v: np.ndarray, wrt: Wrt) -> tuple[np.ndarray, ...]:
    """The gradients ``wrt`` asks for of a call with :func:`no_pairs`: zeros, in Q, K, V order."""
    return tuple(np.zeros(np.shape(x)) for x, flag in ((q, Wrt.QUERY), (k, Wrt.KEY), (v, Wrt.VALUE)) if flag in wrt)


def to_heads(x: np.ndarray, layout: Layout) -> np.ndarray:
    """float64 view in ``[B, H, S, D]`` so that each head is a trailing ``[S, D]`` matrix."""
    x = np.asarray(x, dtype=np.float64)
    return x if layout is Layout.BHSD else x.transpose(0, 2, 1, 3)


def from_heads(x: np.ndarray, layout: Layout) -> np.ndarray:
    """Inverse of :func:`to_heads` (the BSHD swap is its own inverse), as a new dense array."""
    return np.ascontiguousarray(x if layout is Layout.BHSD else x.transpose(0, 2, 1, 3))


def _check_shapes(
    what: str,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dy: np.ndarray | None,
    mask: MaskKind,
    layout: Layout,
    mask_tensor: np.ndarray | None,
) -> None:
    """Reuse the IR's shape rule so direct callers get the same messages as graph builders."""

    def shape_of(x: np.ndarray) -> TensorType:
        return TensorType(array_dims(x))

    attention_dims(
        what,
        shape_of(q),
        shape_of(k),
        shape_of(v),
        layout,
        None if dy is None else shape_of(dy),
        mask,
        None if mask_tensor is None else shape_of(mask_tensor),
    )


# ----------------------------------------------------------------------------- the op definitions


def _attention_reference(args: Sequence[np.ndarray], attrs: AttentionAttrs, ctx: EvalContext) -> np.ndarray:
    mask_tensor = args[3] if len(args) > 3 else None
    return attention_forward(
        *args[:3], mask=attrs.mask, layout=attrs.layout, mask_tensor=mask_tensor, config=ctx.config
    )


def _attention_bwd_reference(
    args: Sequence[np.ndarray], attrs: AttentionBwdAttrs, ctx: EvalContext
) -> tuple[np.ndarray, ...]:
    mask_tensor = args[4] if len(args) > 4 else None
    return attention_backward(
        *args[:4], wrt=attrs.wrt, mask=attrs.mask, layout=attrs.layout, mask_tensor=mask_tensor, config=ctx.config
    )


def _attention_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """dQ, dK, dV as separate single-``wrt`` nodes sharing the forward's mask, layout and mask tensor.

    A mask tensor gets a gradient too. ``CUSTOM`` key padding only decides, through a comparison
    with the threshold, which scores are replaced: piecewise constant, so its gradient is zero
    (as through any comparison). A ``BIAS`` is added to the scores: its gradient is ``dS`` before
    the scale, a ``[B, H, Sq, Sk]`` tensor the fixed kernels never form; see :func:`_bias_grads`.
    """
    attrs = node.attrs
    (dy,) = cotangents
    assert dy is not None
    q, k, v = node.inputs[:3]
    mask_input = node.inputs[3:]
    if mask_input and needed[3] and attrs.mask == MaskKind.BIAS:
        return _bias_grads(graph, node, dy, needed)
    grads: list[Value | None] = [None] * len(node.inputs)
    for slot, flag in enumerate((Wrt.QUERY, Wrt.KEY, Wrt.VALUE)):
        if needed[slot]:
            bwd_attrs = AttentionBwdAttrs(wrt=flag, mask=attrs.mask, layout=attrs.layout)
            grads[slot] = graph.add_node(op_kind("attention_bwd"), (q, k, v, dy, *mask_input), bwd_attrs).outputs[0]
    if mask_input and needed[3]:  # CUSTOM
        grads[3] = zeros(graph, mask_input[0].shape)
    return grads


def _bias_grads(graph: Graph, node: Node, dy: Value, needed: Sequence[bool]) -> list[Value | None]:
    """Every gradient of a ``BIAS`` attention whose bias needs one, from programmable backward
    nodes: the mask is the score_mod ``score + bias[b, h, i, j]``, whose tensor gradient those
    kernels accumulate, and they recompute the row statistics from the scores (``recompute``) as
    the fixed kernels do. Single-gradient nodes, as ``flex_attention``'s rule emits: the fusion
    pass merges them into one kernel (5 GEMMs per head for all four gradients), where the fixed
    kernels for dQ, dK, dV plus a kernel for the bias would take 7."""
    from rlx.ops.flex_attention import FlexAttentionBwdAttrs, flex_dims, tensor_grad_layout

    attrs = node.attrs
    q, k, v, bias = node.inputs
    # BIAS replaces no score, so neither neg nor the threshold enters its mods.
    score_mod, mask_mod = mask_regions(MaskKind.BIAS, bias.type, neg=-1e9, threshold=0.5)
    operands = (q, k, v, dy, bias)

    def backward(wrt: Wrt, tensor_grads: bool) -> tuple[Value, ...]:
        bwd = FlexAttentionBwdAttrs(
            wrt, tensor_grads, score_mod=score_mod, mask_mod=mask_mod, layout=attrs.layout, recompute=True
        )
        return graph.add_node(op_kind("flex_attention_bwd"), operands, bwd).outputs

    grads: list[Value | None] = [None] * len(node.inputs)
    for slot, flag in enumerate((Wrt.QUERY, Wrt.KEY, Wrt.VALUE)):
        if needed[slot]:
            grads[slot] = backward(flag, False)[0]
    dims = flex_dims(f"node {node.id}", q.type, k.type, v.type, attrs.layout)
    layout = tensor_grad_layout(score_mod, [bias.type], dims)
    assert [tensor for tensor, _, _, _ in layout] == [0], "the bias score_mod reads its one tensor"
    (partial,) = backward(Wrt(0), True)
    grads[3] = graph.sum(partial, axis=0)
    return grads


def _attention_bwd_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """Second-order gradients: the node restated in general ops and differentiated
    (:mod:`rlx.ops.attention_second_order`)."""
    from rlx.ops.attention_second_order import attention_bwd_grad

    return attention_bwd_grad(graph, node, cotangents, needed)


def _narrow_attention_bwd(graph: Graph, node: Node, used: list[Value]) -> None:
    """Rebuild a multi-output backward with just the flags that are read (dce calls this)."""
    attrs = node.attrs
    flags = attrs.wrt.members
    wrt = Wrt(0)
    for value in used:
        wrt |= flags[value.index]
    narrow = graph.add_node(
        op_kind("attention_bwd"), node.inputs, AttentionBwdAttrs(wrt=wrt, mask=attrs.mask, layout=attrs.layout)
    )
    for value, new in zip(used, narrow.outputs, strict=True):
        graph.replace_all_uses_with(value, new)
    graph.erase(node)


def attention(
    graph: Graph,
    q: Value,
    k: Value,
    v: Value,
    mask: MaskKind = MaskKind.NONE,
    layout: Layout = Layout.BSHD,
    mask_input: Value | None = None,
    *,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> Value | tuple[Value, Value]:
    """Forward attention ``softmax(mask(Q K^T / sqrt(D))) V``; returns ``out`` shaped like q.

    With ``score_mod``, ``mask_mod``, ``scale`` or ``return_lse`` (SPEC section 4) this builds a
    ``flex_attention`` node instead (:mod:`rlx.ops.flex_attention`); the mods replace ``mask``.
    Keys and values may have fewer heads than q (GQA: query head h reads kv head
    ``h // (H // Hkv)``) and values their own head dim ``Dv`` (``out`` is then ``[.., Dv]``).
    """
    if score_mod is not None or mask_mod is not None or scale is not None or return_lse:
        from rlx.ops.flex_attention import flex_attention

        if mask != MaskKind.NONE or mask_input is not None:
            raise RlxValueError(
                "attention: mask=MaskKind... and mask_input cannot be combined with score_mod / mask_mod / "
                "scale / return_lse; express the mask as a mod (rlx.mods.causal, rlx.mods.sliding_window, ...)"
            )
        return flex_attention(
            graph, q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=scale, layout=layout, return_lse=return_lse
        )
    attrs = AttentionAttrs(check_mask(mask, "attention"), check_layout(layout, "attention"))
    inputs = (q, k, v) + ((mask_input,) if mask_input is not None else ())
    return graph.add_node(op_kind("attention"), inputs, attrs).outputs[0]


def attention_bwd(
    graph: Graph,
    q: Value,
    k: Value,
    v: Value,
    dy: Value,
    wrt: Wrt = Wrt.ALL,
    mask: MaskKind = MaskKind.NONE,
    layout: Layout = Layout.BSHD,
    mask_input: Value | None = None,
) -> Value | tuple[Value, ...]:
    """Gradients of attention w.r.t. the ``wrt`` operands, given the output cotangent ``dy``.

    One flag returns one Value; several return a tuple in Q, K, V order.
    """
    attrs = AttentionBwdAttrs(
        check_wrt(wrt, "attention_bwd"), check_mask(mask, "attention_bwd"), check_layout(layout, "attention_bwd")
    )
    inputs = (q, k, v, dy) + ((mask_input,) if mask_input is not None else ())
    outputs = graph.add_node(op_kind("attention_bwd"), inputs, attrs).outputs
    return outputs[0] if len(outputs) == 1 else outputs


ATTENTION = register_op(
    OpDef(
        "attention",
        ("q", "k", "v", "mask_input?"),
        AttentionAttrs,
        _attention_shape,
        _attention_reference,
        _attention_grad,
        builder=attention,
        batch=batch_into_leading(),
        summary="scaled-dot-product attention",
    )
)
ATTENTION_BWD = register_op(
    OpDef(
        "attention_bwd",
        ("q", "k", "v", "dy", "mask_input?"),
        AttentionBwdAttrs,
        _attention_bwd_shape,
        _attention_bwd_reference,
        _attention_bwd_grad,
        builder=attention_bwd,
        batch=batch_into_leading(),
        narrow=_narrow_attention_bwd,
        summary="attention gradients w.r.t. the wrt operands, recomputing the softmax",
    )
)
