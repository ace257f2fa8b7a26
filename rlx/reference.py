"""The reference interpreter: SPEC section 1 as plain NumPy, the oracle every other test trusts.

Written for clarity, not speed. Each op computes in float64 and its results are rounded to the
node's declared dtype (float32 for attention), so a graph evaluates as the compiled code should.
A new op adds one entry to :data:`REFERENCE_IMPLS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rlx.bind import bind_inputs
from rlx.config import RuntimeConfig, resolve_config
from rlx.errors import RlxValueError
from rlx.ir.graph import Graph, Node, Value
from rlx.ir.ops import AttentionAttrs, AttentionBwdAttrs, InputAttrs, OpKind, attention_dims
from rlx.ir.printer import format_node, value_names
from rlx.ir.types import Layout, MaskKind, TensorType, Wrt

# ---------------------------------------------------------------------------- attention math


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
    """``out = softmax(mask(Q K^T / sqrt(D))) V`` in float64 (a new array in ``layout``)."""
    config = resolve_config(config)
    _check_shapes("attention_forward", q, k, v, None, mask, layout, mask_tensor)
    with np.errstate(all="ignore"):  # NaN/Inf in the inputs propagate by design; no warnings
        qh, kh, vh = (_to_heads(x, layout) for x in (q, k, v))
        probs, _ = _probabilities(qh, kh, mask, mask_tensor, config)
        return _from_heads(probs @ vh, layout)


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

    ``dS`` is zero wherever the mask replaced a score: those scores are constants, so no
    gradient may reach Q or K through them (even though a fully masked row has a uniform P).
    """
    config = resolve_config(config)
    _check_shapes("attention_backward", q, k, v, dy, mask, layout, mask_tensor)
    with np.errstate(all="ignore"):
        qh, kh, vh, dyh = (_to_heads(x, layout) for x in (q, k, v, dy))
        probs, replaced = _probabilities(qh, kh, mask, mask_tensor, config)
        grads: dict[Wrt, np.ndarray] = {}
        if wrt & Wrt.VALUE:
            grads[Wrt.VALUE] = _transpose(probs) @ dyh
        if wrt & (Wrt.QUERY | Wrt.KEY):
            dprobs = dyh @ _transpose(vh)
            dscores = probs * (dprobs - np.sum(probs * dprobs, axis=-1, keepdims=True)) / math.sqrt(qh.shape[-1])
            if replaced is not None:
                dscores = np.where(replaced, 0.0, dscores)
            grads[Wrt.QUERY] = dscores @ kh
            grads[Wrt.KEY] = _transpose(dscores) @ qh
        return tuple(_from_heads(grads[flag], layout) for flag in wrt.members)


def masked_positions(
    mask: MaskKind, mask_tensor: np.ndarray | None, seq_q: int, seq_k: int, threshold: float
) -> np.ndarray | None:
    """Where the mask REPLACES scores by ``neg``, broadcastable to ``[B, H, Sq, Sk]``.

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
    row_max = np.max(scores, axis=-1, keepdims=True)
    row_max = np.where(np.isneginf(row_max), 0.0, row_max)
    exps = np.exp(scores - row_max)
    total = np.sum(exps, axis=-1, keepdims=True)
    return exps / np.where(total == 0.0, 1.0, total)  # total is 0 only for all -inf rows


def _probabilities(
    qh: np.ndarray, kh: np.ndarray, mask: MaskKind, mask_tensor: np.ndarray | None, config: RuntimeConfig
) -> tuple[np.ndarray, np.ndarray | None]:
    """Softmax probabilities ``[B, H, Sq, Sk]`` and the positions whose scores the mask replaced."""
    scores = (qh @ _transpose(kh)) / math.sqrt(qh.shape[-1])
    if mask == MaskKind.BIAS:
        scores = scores + np.asarray(mask_tensor, dtype=np.float64)
    replaced = masked_positions(mask, mask_tensor, qh.shape[-2], kh.shape[-2], config.mask_binary_threshold)
    if replaced is not None:
        scores = np.where(replaced, config.attn_mask_neg_inf, scores)  # assignment, not addition
    return safe_softmax(scores), replaced


def _to_heads(x: np.ndarray, layout: Layout) -> np.ndarray:
    """float64 view in ``[B, H, S, D]`` so that each head is a trailing ``[S, D]`` matrix."""
    x = np.asarray(x, dtype=np.float64)
    return x if layout is Layout.BHSD else x.transpose(0, 2, 1, 3)


def _from_heads(x: np.ndarray, layout: Layout) -> np.ndarray:
    """Inverse of :func:`_to_heads` (the BSHD swap is its own inverse), as a new dense array."""
    return np.ascontiguousarray(x if layout is Layout.BHSD else x.transpose(0, 2, 1, 3))


def _transpose(x: np.ndarray) -> np.ndarray:
    return x.swapaxes(-1, -2)


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
        return TensorType(tuple(np.shape(x)))

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


# ---------------------------------------------------------------------------- interpreter


@dataclass(frozen=True)
class EvalContext:
    """What an op implementation may read besides its operands."""

    config: RuntimeConfig
    inputs: Mapping[str, np.ndarray]


ReferenceImpl = Callable[[Node, Sequence[np.ndarray], EvalContext], tuple[np.ndarray, ...]]


def _eval_input(node: Node, args: Sequence[np.ndarray], ctx: EvalContext) -> tuple[np.ndarray, ...]:
    assert isinstance(node.attrs, InputAttrs)
    return (ctx.inputs[node.attrs.name],)


def _eval_attention(node: Node, args: Sequence[np.ndarray], ctx: EvalContext) -> tuple[np.ndarray, ...]:
    attrs = node.attrs
    assert isinstance(attrs, AttentionAttrs)
    mask_tensor = args[3] if len(args) > 3 else None
    out = attention_forward(*args[:3], mask=attrs.mask, layout=attrs.layout, mask_tensor=mask_tensor, config=ctx.config)
    return (out,)


def _eval_attention_bwd(node: Node, args: Sequence[np.ndarray], ctx: EvalContext) -> tuple[np.ndarray, ...]:
    attrs = node.attrs
    assert isinstance(attrs, AttentionBwdAttrs)
    mask_tensor = args[4] if len(args) > 4 else None
    return attention_backward(
        *args[:4], wrt=attrs.wrt, mask=attrs.mask, layout=attrs.layout, mask_tensor=mask_tensor, config=ctx.config
    )


REFERENCE_IMPLS: dict[OpKind, ReferenceImpl] = {
    OpKind.INPUT: _eval_input,
    OpKind.ATTENTION: _eval_attention,
    OpKind.ATTENTION_BWD: _eval_attention_bwd,
}


def run(graph: Graph, /, config: RuntimeConfig | None = None, **arrays: object) -> dict[str, np.ndarray]:
    """Evaluate ``graph`` on keyword arrays; returns ``{output name: new float32 array}``."""
    return evaluate(graph, arrays, config=config)


def evaluate(
    graph: Graph, inputs: Mapping[str, object], *, config: RuntimeConfig | None = None
) -> dict[str, np.ndarray]:
    """:func:`run` with the inputs as a mapping (for an input named ``config``, say)."""
    config = resolve_config(config)
    graph.verify()
    ctx = EvalContext(config, bind_inputs(graph, inputs))
    env: dict[Value, np.ndarray] = {}
    for node in graph.nodes:
        results = _eval_node(graph, node, [env[value] for value in node.inputs], ctx)
        for value, result in zip(node.outputs, results, strict=True):
            with np.errstate(over="ignore"):  # float64 beyond float32 range rounds to inf, as in f32 code
                env[value] = np.asarray(result).astype(value.type.dtype, copy=False)
    return {name: np.array(env[value], copy=True) for name, value in graph.outputs.items()}


def _eval_node(graph: Graph, node: Node, args: list[np.ndarray], ctx: EvalContext) -> tuple[np.ndarray, ...]:
    """Run one node; a failure is re-raised as the same kind of error naming the node's IR line."""
    try:
        impl = REFERENCE_IMPLS.get(node.op)
        if impl is None:
            raise NotImplementedError(f"no reference implementation for op {node.op}")
        results = tuple(impl(node, args, ctx))
        if len(results) != len(node.types):
            raise RlxValueError(f"reference {node.op} returned {len(results)} results for {len(node.types)} outputs")
        return results
    except Exception as exc:
        line = format_node(node, value_names(graph))
        message = f"{exc}\n  while evaluating node {node.id} of graph {graph.name!r}: {line}"
        try:
            wrapped = type(exc)(message)
        except Exception:  # an exception class with an unusual constructor: annotate in place
            exc.args = (message,)
            raise
        raise wrapped from exc
