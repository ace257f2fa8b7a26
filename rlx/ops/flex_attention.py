"""Programmable attention (SPEC section 4): ``flex_attention`` and its backward, defined once.

``g.attention(q, k, v, score_mod=..., mask_mod=..., scale=..., return_lse=...)`` builds a
``flex_attention`` node: operands ``q, k, v`` then the tensors the mods read (captured, in
first-read order); attrs hold the traced regions (:mod:`rlx.ir.region`). It has two results,
``out`` and ``lse`` ``[B, H, Sq]``; the builder returns ``lse`` only when asked. ``k``/``v`` may
have fewer heads than ``q`` (GQA: query head ``h`` reads kv head ``h // (H // Hkv)``) and ``v``
its own head dim ``Dv``.

Reverse mode emits ``flex_attention_bwd`` nodes that take the forward's ``out`` and ``lse``
(FlashAttention-2: ``P = exp(s - lse)``, ``D = rowsum(dY * out)``), one per wanted gradient,
which ``fuse-attention-bwd`` merges. Gradients of captured float tensors that the score_mod
reads come out as per-work-item partial sums ``[P, *shape]`` that a graph ``sum`` reduces in a
fixed order: deterministic whatever the thread count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.dims import dim_text, poly
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.region import GradientRegion, Interval, Region
from rlx.ir.types import Dim, Layout, TensorType, Wrt
from rlx.ops._batching import batch_by_unrolling
from rlx.ops._common import F32, op_kind, zeros
from rlx.ops.attention import array_dims, from_heads, no_pair_grads, no_pairs, static_sizes, to_heads

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class FlexAttentionAttrs:
    """Mods as traced regions (``None``: identity score / every key visible) and the score scale."""

    score_mod: Region | None = None
    mask_mod: Region | None = None
    scale: float | None = None  # None: 1 / sqrt(D)
    layout: Layout = Layout.BSHD


@dataclass(frozen=True)
class FlexAttentionBwdAttrs:
    """Gradients for the ``wrt`` operands, plus (``tensor_grads``) the score_mod's float tensors."""

    wrt: Wrt
    tensor_grads: bool = False
    lse_grad: bool = False  # an extra operand dlse [B, H, Sq] follows lse
    score_mod: Region | None = None
    mask_mod: Region | None = None
    scale: float | None = None
    layout: Layout = Layout.BSHD
    # Recompute the row statistics from the scores (operands q, k, v, dy only), as the fixed-mask
    # backward does: exact where exp(s - lse) is not (rows of huge scores, a MaskKind's finite neg).
    recompute: bool = False


@dataclass(frozen=True)
class FlexDims:
    batch: Dim  # the batch and the sequence lengths may be symbolic dimensions, sized per call
    heads: int
    kv_heads: int
    seq_q: Dim
    seq_k: Dim
    head_dim: int
    value_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def flex_dims(what: str, q: TensorType, k: TensorType, v: TensorType, layout: Layout) -> FlexDims:
    """Check q, k, v (f32, rank 4, GQA-compatible heads) and return the sizes."""
    for label, ty in (("q", q), ("k", k), ("v", v)):
        if ty.dtype != F32:
            raise RlxTypeError(f"{what}: {label} must be f32, got {ty.dtype_name} ({ty})")
        if ty.rank != 4:
            names = "[B, S, H, D]" if layout is Layout.BSHD else "[B, H, S, D]"
            raise RlxValueError(f"{what}: {label} must have rank 4 ({names}), got {ty}")
    b, sq, h, d = layout.split(q.shape)
    kb, sk, hkv, kd = layout.split(k.shape)
    vb, vs, vh, dv = layout.split(v.shape)
    h, d, hkv, dv = static_sizes(what, layout, q, k, v, (h, d, hkv, dv))
    if kb != b or kd != d:
        raise RlxValueError(f"{what}: k must have batch {b} and head dim {d} like q {q} (layout {layout}), got {k}")
    if h % hkv:
        raise RlxValueError(f"{what}: q's {h} heads must be a multiple of k's {hkv} heads (GQA), got q {q}, k {k}")
    if (vb, vs, vh) != (b, sk, hkv):
        raise RlxValueError(f"{what}: v must have batch {b}, {sk} keys and {hkv} heads like k {k}, got {v}")
    return FlexDims(b, h, hkv, sq, sk, d, dv)  # only the batch and the sequence lengths may be symbolic


def dims_are_static(dims: FlexDims) -> bool:
    """Whether the batch and both lengths are known at build time (else per call)."""
    return all(isinstance(size, int) for size in (dims.batch, dims.seq_q, dims.seq_k))


def captured_kinds(types: Sequence[TensorType]) -> list[tuple[tuple[Dim, ...], str]]:
    return [(t.shape, "f" if t.dtype.kind == "f" else "b" if t.dtype.kind == "b" else "i") for t in types]


def check_regions(
    what: str, score_mod: Region | None, mask_mod: Region | None, dims: FlexDims, captured: Sequence[TensorType]
) -> None:
    """Kinds of the regions' results and, by interval bounds, that every tensor index stays in range."""
    shapes = captured_kinds(captured)
    for label, region, want in (("score_mod", score_mod, "number"), ("mask_mod", mask_mod, "bool")):
        if region is None:
            continue
        if not isinstance(region, Region):
            raise RlxTypeError(f"{what}: {label} must be a traced Region, got {type(region).__name__}")
        try:
            kinds = region.check(shapes)
        except ValueError as exc:
            raise RlxValueError(f"{what}: {label}: {exc}") from None
        if (kinds[-1] == "b") != (want == "bool"):
            raise RlxTypeError(f"{what}: {label} must give a {want}, its result is {kinds[-1]!r}")
        if label == "mask_mod" and "score" in set().union(*region.dependences()):
            raise RlxValueError(f"{what}: mask_mod cannot read the score")
        if dims_are_static(dims) and all(t.is_static for t in captured):
            _check_index_ranges(what, label, region, dims, captured)
        # else: the sizes are known per call, and so is the check (check_index_ranges_per_call)


def reads_in_range_by_construction(
    score_mod: Region | None, mask_mod: Region | None, dims: FlexDims, captured: Sequence[TensorType]
) -> bool:
    """Whether every tensor read of the mods stays in range at any sizes, by the shapes alone: on
    each axis the index is ``0``, a constant below a static size, or the index symbol whose range
    is that axis's own dimension (``b`` on an axis of the batch's size, ``h`` of the heads',
    ``q_idx`` of Sq's, ``kv_idx`` of Sk's), as an SDPA mask ``[B|1, H|1, Sq|1, Sk|1]`` is read.
    Such mods need no check per call (:func:`check_index_ranges_per_call`)."""
    ranges: dict[str, Dim] = {"b": dims.batch, "h": dims.heads, "q_idx": dims.seq_q, "kv_idx": dims.seq_k}
    for region in (score_mod, mask_mod):
        if region is None:
            continue
        for step, tensor in region.reads():
            shape = captured[tensor].shape
            for (kind, value), size in zip(region.steps[step].args[1:], shape, strict=True):
                if kind == "k" and isinstance(value, int) and not isinstance(value, bool):
                    if not (value == 0 or (isinstance(size, int) and 0 <= value < size)):
                        return False
                elif kind != "s" or str(value) not in ranges or ranges[str(value)] != size:
                    return False
    return True


def check_index_ranges_per_call(
    what: str, score_mod: Region | None, mask_mod: Region | None, dims: FlexDims, captured: Sequence[TensorType]
) -> None:
    """The interval check of :func:`check_regions` at one call's sizes (dims and types resolved)."""
    for label, region in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if region is not None and region.reads():
            _check_index_ranges(what, label, region, dims, captured)


def positions_read_from_tensors(region: Region, captured: Sequence[TensorType]) -> list[tuple[int, int, int, int]]:
    """``(read step, tensor, axis, source tensor)`` for each axis a read indexes with an entry of an
    integer tensor, as read (``bias[doc[b, q_idx], kv_idx]``: axis 0 of ``bias`` by ``doc``'s entries).

    Such an index is as good as the entries: the interval check cannot bound it, so the entries of
    the source are checked against the axis before each call (:func:`mod_index_operands`, which
    the executable and the reference check as they check ``embedding``'s ids).
    """
    found = []
    for step, tensor in region.reads():
        for axis, (kind, value) in enumerate(region.steps[step].args[1:]):
            if kind != "t" or region.steps[int(value)].op != "read":
                continue
            source = int(region.steps[int(value)].args[0][1])
            if captured[source].dtype.kind == "i":
                found.append((step, tensor, axis, source))
    return found


def mod_index_operands(node: Node) -> list[tuple[int, Dim, str]]:
    """``OpDef.node_index_operands`` of the flex nodes: the captured int tensors whose entries index
    another captured tensor (:func:`positions_read_from_tensors`), each with that axis's size."""
    attrs = node.attrs
    first = len(flex_slots(attrs))
    captured = node.inputs[first:]
    types = [value.type for value in captured]
    operands = []
    for label, region in (("score_mod", attrs.score_mod), ("mask_mod", attrs.mask_mod)):
        if region is None:
            continue
        for _, tensor, axis, source in positions_read_from_tensors(region, types):
            meaning = f"{label} index into axis {axis} of captured tensor {tensor} ({types[tensor]})"
            operands.append((first + source, types[tensor].shape[axis], meaning))
    return operands


def _check_index_ranges(what: str, label: str, region: Region, dims: FlexDims, captured: Sequence[TensorType]) -> None:
    full: dict[str, Interval] = {
        "score": (np.float64(-np.inf), np.float64(np.inf)),
        "b": (np.float64(0), np.float64(int(dims.batch) - 1)),
        "h": (np.float64(0), np.float64(dims.heads - 1)),
        "q_idx": (np.float64(0), np.float64(int(dims.seq_q) - 1)),
        "kv_idx": (np.float64(0), np.float64(int(dims.seq_k) - 1)),
        "q_len": (np.float64(dims.seq_q), np.float64(dims.seq_q)),
        "kv_len": (np.float64(dims.seq_k), np.float64(dims.seq_k)),
    }

    by_entries = {(step, axis) for step, _, axis, _ in positions_read_from_tensors(region, captured)}

    def read_bounds(step: int, tensor: int, index: list[Interval]) -> Interval:
        shape = captured[tensor].static_shape
        for axis, ((lo, hi), size) in enumerate(zip(index, shape, strict=True)):
            if (step, axis) in by_entries:
                continue  # an entry of an int tensor: checked before each call (mod_index_operands)
            if not (float(lo) >= 0 and float(hi) <= size - 1):
                unbounded = not (math.isfinite(float(lo)) and math.isfinite(float(hi)))
                raise RlxValueError(
                    f"{what}: {label} step {step} reads captured tensor {tensor} ({captured[tensor]}) with index "
                    f"{axis} in [{_fmt(lo)}, {_fmt(hi)}], outside [0, {size - 1}]; indices must stay in range for "
                    f"every b < {dims.batch}, h < {dims.heads}, q_idx < {dims.seq_q}, kv_idx < {dims.seq_k}"
                    + (_ENTRY_INDEX_HINT if unbounded else "")
                )
        return np.float64(-np.inf), np.float64(np.inf)

    region.bounds(full, read_bounds)


_ENTRY_INDEX_HINT = (
    "; an index taken from a tensor's entries must be the entry itself (table[doc[b, q_idx], kv_idx]), "
    "whose values are checked before each call, not arithmetic on it"
)


def _fmt(x: np.ndarray) -> str:
    value = float(x)
    return str(int(value)) if math.isfinite(value) else str(value)


def tensor_grad_layout(
    region: Region | None, captured: Sequence[TensorType], dims: FlexDims
) -> list[tuple[int, Dim, bool, bool]]:
    """``(tensor, partials, by_batch, by_kv_head)`` for each captured float tensor the score_mod reads.

    A backward work item is one (batch, kv head); items write disjoint gradient entries when
    every read indexes one dimension with exactly ``b`` and one with exactly ``h``. Otherwise each
    item accumulates into its own partial (one per batch, per kv head, or both) and a graph
    ``sum`` adds the partials in a fixed order.
    """
    if region is None:
        return []
    kinds = region.check(captured_kinds(captured))
    reads: dict[int, list[int]] = {}
    for step, tensor in region.float_reads(kinds):
        reads.setdefault(tensor, []).append(step)
    layout = []
    for tensor, steps in reads.items():
        exact_b = all(("s", "b") in region.steps[s].args[1:] for s in steps)
        exact_h = all(("s", "h") in region.steps[s].args[1:] for s in steps)
        batches = 1 if exact_b else poly(dims.batch)  # a symbolic batch: "B" partials
        partials = dim_text(batches * (1 if exact_h else dims.kv_heads))
        layout.append((tensor, partials, not exact_b, not exact_h))
    return layout


# ----------------------------------------------------------------------------- shape rules


def _flex_infer(what: str, inputs: Sequence[TensorType], attrs: FlexAttentionAttrs) -> tuple[TensorType, ...]:
    if len(inputs) < 3:
        raise RlxValueError(f"{what}: flex_attention takes q, k, v and the captured tensors, got {len(inputs)} inputs")
    dims = flex_dims(what, inputs[0], inputs[1], inputs[2], attrs.layout)
    check_regions(what, attrs.score_mod, attrs.mask_mod, dims, inputs[3:])
    _check_scale(what, attrs.scale)
    out = attrs.layout.join(dims.batch, dims.seq_q, dims.heads, dims.value_dim)
    return (TensorType(out, F32), TensorType((dims.batch, dims.heads, dims.seq_q), F32))


def _check_scale(what: str, scale: object) -> None:
    if scale is not None and (not isinstance(scale, float) or not math.isfinite(scale)):
        raise RlxValueError(f"{what}: scale must be a finite float or None, got {scale!r}")


def bwd_slots(attrs: FlexAttentionBwdAttrs) -> tuple[str, ...]:
    """The operands before the captured tensors: q, k, v, out, dy, lse and (lse_grad) dlse, or
    with ``recompute`` just q, k, v and dy."""
    if attrs.recompute:
        return ("q", "k", "v", "dy")
    return ("q", "k", "v", "out", "dy", "lse") + (("dlse",) if attrs.lse_grad else ())


def flex_slots(attrs: FlexAttentionAttrs | FlexAttentionBwdAttrs) -> tuple[str, ...]:
    """The named operands of a flex node, before its captured tensors."""
    return bwd_slots(attrs) if isinstance(attrs, FlexAttentionBwdAttrs) else ("q", "k", "v")


def bwd_operands(attrs: FlexAttentionBwdAttrs) -> int:
    """How many operands come before the captured tensors (:func:`bwd_slots`)."""
    return len(bwd_slots(attrs))


def _flex_bwd_infer(what: str, inputs: Sequence[TensorType], attrs: FlexAttentionBwdAttrs) -> tuple[TensorType, ...]:
    slots = bwd_slots(attrs)
    if attrs.recompute and attrs.lse_grad:
        raise RlxValueError(f"{what}: a backward that recomputes the row statistics takes no dlse (lse_grad)")
    if len(inputs) < len(slots):
        raise RlxValueError(f"{what}: flex_attention_bwd takes {', '.join(slots)} and the captured tensors")
    named = dict(zip(slots, inputs, strict=False))
    q, k, v = named["q"], named["k"], named["v"]
    dims = flex_dims(what, q, k, v, attrs.layout)
    captured = inputs[len(slots) :]
    check_regions(what, attrs.score_mod, attrs.mask_mod, dims, captured)
    _check_scale(what, attrs.scale)
    want_out = TensorType(attrs.layout.join(dims.batch, dims.seq_q, dims.heads, dims.value_dim), F32)
    want_lse = TensorType((dims.batch, dims.heads, dims.seq_q), F32)
    wants = {"out": want_out, "dy": want_out, "lse": want_lse, "dlse": want_lse}
    for label, ty, want in ((label, named[label], wants[label]) for label in slots[3:]):
        if ty != want:
            raise RlxValueError(f"{what}: {label} must be {want}, got {ty}")
    if not attrs.wrt and not attrs.tensor_grads:
        raise RlxValueError(f"{what}: asks for no gradient (wrt is empty and tensor_grads is off)")
    by_flag = {Wrt.QUERY: q, Wrt.KEY: k, Wrt.VALUE: v}
    results = [by_flag[flag] for flag in attrs.wrt.members]
    if attrs.tensor_grads:
        for tensor, partials, _, _ in tensor_grad_layout(attrs.score_mod, captured, dims):
            results.append(TensorType((partials, *captured[tensor].shape), F32))
    return tuple(TensorType(t.shape, F32) for t in results)


# ----------------------------------------------------------------------------- float64 reference


def _symbols(dims: FlexDims, scores: np.ndarray | None) -> dict[str, np.ndarray]:
    grid = {
        "b": np.arange(dims.batch).reshape(-1, 1, 1, 1),
        "h": np.arange(dims.heads).reshape(1, -1, 1, 1),
        "q_idx": np.arange(dims.seq_q).reshape(1, 1, -1, 1),
        "kv_idx": np.arange(dims.seq_k).reshape(1, 1, 1, -1),
        "q_len": np.asarray(dims.seq_q),
        "kv_len": np.asarray(dims.seq_k),
    }
    if scores is not None:
        grid["score"] = scores
    return grid


def _scores(q: np.ndarray, k: np.ndarray, dims: FlexDims, scale: float | None) -> np.ndarray:
    """``scale * Q K^T`` per query head, ``[B, H, Sq, Sk]``, kv heads repeated over their groups."""
    kh = np.repeat(k, dims.group, axis=1)
    return (q @ kh.swapaxes(-1, -2)) * (1.0 / math.sqrt(dims.head_dim) if scale is None else scale)


def _visible(mask_mod: Region | None, dims: FlexDims, tensors: Sequence[np.ndarray]) -> np.ndarray:
    if mask_mod is None:
        return np.ones((1, 1, 1, 1), dtype=bool)
    full = (int(dims.batch), dims.heads, int(dims.seq_q), int(dims.seq_k))
    return np.broadcast_to(mask_mod.evaluate(_symbols(dims, None), tensors), full)


def _softmax_and_lse(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row softmax of ``s`` (``-inf`` hides) and its log-sum-exp; an all-hidden row gives 0 and -inf."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)  # no keys: -inf
    m = np.where(np.isneginf(m), 0.0, m)
    e = np.exp(s - m)
    total = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(total == 0.0, 1.0, total), (np.log(total) + m)[..., 0]


def flex_attention_forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    captured: Sequence[np.ndarray],
    attrs: FlexAttentionAttrs,
) -> tuple[np.ndarray, np.ndarray]:
    """``(out, lse)`` in float64, materialising the scores: the oracle of the compiled kernels."""
    if no_pairs(q, k):
        return np.zeros((*np.shape(q)[:-1], np.shape(v)[-1])), np.full(_lse_shape(q, attrs.layout), -np.inf)
    qh, kh, vh = (to_heads(x, attrs.layout) for x in (q, k, v))
    dims = FlexDims(qh.shape[0], qh.shape[1], kh.shape[1], qh.shape[2], kh.shape[2], qh.shape[3], vh.shape[3])
    check_index_ranges_per_call("flex_attention", attrs.score_mod, attrs.mask_mod, dims, _types(captured))
    with np.errstate(all="ignore"):
        s = _scores(qh, kh, dims, attrs.scale)
        if attrs.score_mod is not None:
            s = np.broadcast_to(attrs.score_mod.evaluate(_symbols(dims, s), captured), s.shape).astype(np.float64)
        s = np.where(_visible(attrs.mask_mod, dims, captured), s, -np.inf)
        p, lse = _softmax_and_lse(s)
        out = p @ np.repeat(vh, dims.group, axis=1)
    return from_heads(out, attrs.layout), lse


def flex_attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray | None,
    dy: np.ndarray,
    lse: np.ndarray | None,
    dlse: np.ndarray | None,
    captured: Sequence[np.ndarray],
    attrs: FlexAttentionBwdAttrs,
    shapes: Sequence[TensorType],
) -> tuple[np.ndarray, ...]:
    """The gradients ``attrs`` asks for, from ``out`` and ``lse`` as the compiled backward does.

    ``out=None, lse=None`` recompute the softmax from the scores instead (and ``D`` as
    ``rowsum(P * dP)``): exact even where every score of a row is huge (a fully masked row at a
    finite ``neg`` of -1e9), where ``exp(s - lse)`` would lose the row's few significant bits to
    cancellation.
    """
    layout = attrs.layout
    empty = no_pairs(q, k)
    if empty and not attrs.tensor_grads:
        return no_pair_grads(q, k, v, attrs.wrt)
    qh, kh, vh, dyh = (to_heads(x, layout) for x in (q, k, v, dy))
    dims = FlexDims(qh.shape[0], qh.shape[1], kh.shape[1], qh.shape[2], kh.shape[2], qh.shape[3], vh.shape[3])
    if not empty:  # no pairs: nothing is indexed (and an empty axis has no static size)
        check_index_ranges_per_call("flex_attention_bwd", attrs.score_mod, attrs.mask_mod, dims, _types(captured))
    scale = 1.0 / math.sqrt(dims.head_dim) if attrs.scale is None else attrs.scale
    grid = _symbols(dims, None)
    full = (int(dims.batch), dims.heads, int(dims.seq_q), int(dims.seq_k))
    with np.errstate(all="ignore"):
        raw = _scores(qh, kh, dims, attrs.scale)
        g_score: np.ndarray = np.ones(full)
        read_grads: list[np.ndarray] = []
        s = raw
        if attrs.score_mod is not None:
            kinds = attrs.score_mod.check(captured_kinds(shapes))
            gradient = attrs.score_mod.gradient(kinds)
            assert isinstance(gradient, GradientRegion)
            values = gradient.evaluate_all({**grid, "score": raw}, captured)

            def output(ref: Any) -> np.ndarray:
                kind, value = ref
                return np.broadcast_to(values[value] if kind == "t" else np.float64(value), full).astype(np.float64)

            s, g_score, *read_grads = (output(ref) for ref in gradient.outputs)
        visible = _visible(attrs.mask_mod, dims, captured)
        if lse is None:  # the row statistics recomputed from the scores, as the fixed-mask kernels do
            p, _ = _softmax_and_lse(np.where(visible, s, -np.inf))
        else:
            lse64 = np.asarray(lse, dtype=np.float64)[..., None]
            p = np.where(visible & ~np.isneginf(lse64), np.exp(s - lse64), 0.0)
        vg = np.repeat(vh, dims.group, axis=1)
        dp = dyh @ vg.swapaxes(-1, -2)
        if out is None:  # recomputed statistics: D = rowsum(P * dP), which equals rowsum(dY * out)
            delta = np.sum(np.where(p == 0.0, 0.0, p * dp), axis=-1, keepdims=True)
        else:
            delta = np.sum(dyh * to_heads(out, layout), axis=-1, keepdims=True)
        if dlse is not None:
            delta = delta - np.asarray(dlse, dtype=np.float64)[..., None]
        ds = np.where(visible, p * (dp - delta), 0.0)
        # A score the mod does not depend on (d s / d score = 0: a `where` that replaces it, as a
        # MaskKind's finite neg does) passes no gradient, not even a NaN from elsewhere in its row.
        ds_raw = np.where(visible & (g_score != 0.0), ds * g_score, 0.0)

        def group_sum(x: np.ndarray) -> np.ndarray:
            return x.reshape(int(dims.batch), dims.kv_heads, dims.group, *x.shape[2:]).sum(axis=2)

        grads: dict[Wrt, np.ndarray] = {
            Wrt.QUERY: scale * ds_raw @ np.repeat(kh, dims.group, axis=1),
            Wrt.KEY: group_sum(scale * ds_raw.swapaxes(-1, -2) @ qh),
            Wrt.VALUE: group_sum(p.swapaxes(-1, -2) @ dyh),
        }
        results = [from_heads(grads[flag], layout) for flag in attrs.wrt.members]
        if attrs.tensor_grads:
            results += _tensor_grads(attrs, dims, ds, read_grads, captured, shapes, grid)
    return tuple(results)


def _tensor_grads(
    attrs: FlexAttentionBwdAttrs,
    dims: FlexDims,
    ds: np.ndarray,
    read_grads: list[np.ndarray],
    captured: Sequence[np.ndarray],
    shapes: Sequence[TensorType],
    grid: dict[str, np.ndarray],
) -> list[np.ndarray]:
    region = attrs.score_mod
    assert region is not None
    kinds = region.check(captured_kinds(shapes))
    values = region.evaluate_all(grid | {"score": np.zeros((1, 1, 1, 1))}, captured)
    full = ds.shape
    partial_of = {tensor: (count, by_b, by_h) for tensor, count, by_b, by_h in tensor_grad_layout(region, shapes, dims)}
    sums = {t: np.zeros((int(count), *np.shape(captured[t]))) for t, (count, _, _) in partial_of.items()}
    batch = np.broadcast_to(grid["b"], full)
    kv_head = np.broadcast_to(grid["h"] // dims.group, full)
    for (step, tensor), local in zip(region.float_reads(kinds), read_grads, strict=True):
        _, by_b, by_h = partial_of[tensor]
        contribution = (ds * local).ravel()
        index = [
            np.broadcast_to(values[int(ref[1])] if ref[0] == "t" else _symbol_or_literal(ref, grid), full).ravel()
            for ref in region.steps[step].args[1:]
        ]
        part = np.zeros(full, dtype=np.int64)
        if by_b:
            part = part + batch * (dims.kv_heads if by_h else 1)
        if by_h:
            part = part + kv_head
        np.add.at(sums[tensor], (part.ravel(), *index), contribution)
    return [sums[tensor] for tensor in partial_of]


def _symbol_or_literal(ref: Any, grid: dict[str, np.ndarray]) -> np.ndarray:
    kind, value = ref
    return grid[value] if kind == "s" else np.asarray(value)


def _types(arrays: Sequence[np.ndarray]) -> list[TensorType]:
    """The types of captured arrays as a node declares them (floats are f32); an empty axis (a
    call's zero-size dimension, which no type has) reads as the symbol ``empty``."""
    types = []
    for array in arrays:
        dtype = np.asarray(array).dtype
        types.append(TensorType(array_dims(array), F32 if dtype.kind == "f" else dtype))
    return types


def _lse_shape(q: np.ndarray, layout: Layout) -> tuple[int, ...]:
    batch, first, second = np.shape(q)[:3]
    return (batch, first, second) if layout is Layout.BHSD else (batch, second, first)


def _flex_reference(args: Sequence[np.ndarray], attrs: FlexAttentionAttrs, ctx: EvalContext) -> tuple[np.ndarray, ...]:
    return flex_attention_forward(args[0], args[1], args[2], list(args[3:]), attrs)


def _flex_bwd_reference(
    args: Sequence[np.ndarray], attrs: FlexAttentionBwdAttrs, ctx: EvalContext
) -> tuple[np.ndarray, ...]:
    slots = bwd_slots(attrs)
    captured = list(args[len(slots) :])
    shapes = _types(captured)
    named: dict[str, np.ndarray | None] = {"out": None, "lse": None, "dlse": None}
    named.update(zip(slots, args, strict=False))
    q, k, v, dy = (np.asarray(named[slot]) for slot in ("q", "k", "v", "dy"))
    return flex_attention_backward(q, k, v, named["out"], dy, named["lse"], named["dlse"], captured, attrs, shapes)


# ----------------------------------------------------------------------------- gradient rule


def _flex_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """Single-gradient backward nodes reading the forward's out and lse; partials summed in the graph."""
    attrs: FlexAttentionAttrs = node.attrs
    d_out, d_lse = cotangents
    out, lse = node.outputs
    q, k, v = node.inputs[:3]
    captured = node.inputs[3:]
    if d_out is None:
        d_out = zeros(graph, out.shape)  # shapes may be symbolic
    dlse = () if d_lse is None else (d_lse,)
    operands = (q, k, v, out, d_out, lse, *dlse, *captured)

    def backward(wrt: Wrt, tensor_grads: bool) -> tuple[Value, ...]:
        bwd = FlexAttentionBwdAttrs(
            wrt, tensor_grads, d_lse is not None, attrs.score_mod, attrs.mask_mod, attrs.scale, attrs.layout
        )
        return graph.add_node(op_kind("flex_attention_bwd"), operands, bwd).outputs

    grads: list[Value | None] = [None] * len(node.inputs)
    for slot, flag in enumerate((Wrt.QUERY, Wrt.KEY, Wrt.VALUE)):
        if needed[slot]:
            grads[slot] = backward(flag, False)[0]
    dims = flex_dims("grad", q.type, k.type, v.type, attrs.layout)
    layout = tensor_grad_layout(attrs.score_mod, [c.type for c in captured], dims)
    if any(needed[3 + tensor] for tensor, _, _, _ in layout):
        partials = backward(Wrt(0), True)
        for (tensor, _, _, _), partial in zip(layout, partials, strict=True):
            if needed[3 + tensor]:
                grads[3 + tensor] = graph.sum(partial, axis=0)
    return grads


def _flex_bwd_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """Second-order gradients: the backward restated in general ops, its mods over index grids
    (:mod:`rlx.ops.attention_second_order`)."""
    from rlx.ops.attention_second_order import flex_attention_bwd_grad

    return flex_attention_bwd_grad(graph, node, cotangents, needed)


def _narrow_flex_bwd(graph: Graph, node: Node, used: list[Value]) -> None:
    """Keep only the gradients that are read: drop unread q/k/v flags, and tensor grads if none is read."""
    attrs: FlexAttentionBwdAttrs = node.attrs
    flags = attrs.wrt.members
    wrt = Wrt(0)
    tensor_used = False
    for value in used:
        if value.index < len(flags):
            wrt |= flags[value.index]
        else:
            tensor_used = True
    narrow_attrs = dataclasses.replace(attrs, wrt=wrt, tensor_grads=tensor_used)
    narrow = graph.add_node(op_kind("flex_attention_bwd"), node.inputs, narrow_attrs)
    new_flags = wrt.members
    for value in used:
        if value.index < len(flags):
            new_index = new_flags.index(flags[value.index])
        else:
            new_index = len(new_flags) + value.index - len(flags)
        graph.replace_all_uses_with(value, narrow.outputs[new_index])
    graph.erase(node)


# ----------------------------------------------------------------------------- builder


def flex_attention(
    graph: Graph,
    q: Value,
    k: Value,
    v: Value,
    score_mod: Callable[..., Any] | Region | None = None,
    mask_mod: Callable[..., Any] | Region | None = None,
    scale: float | None = None,
    layout: Layout = Layout.BSHD,
    return_lse: bool = False,
    captured: Sequence[Value] = (),
) -> Value | tuple[Value, Value]:
    """Attention with traced mods; ``(out, lse)`` if ``return_lse`` else ``out``.

    ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> bool``
    are traced now (see :mod:`rlx.mods`); already traced regions are taken with ``captured``.
    """
    from rlx.mods import trace

    if not isinstance(layout, Layout):
        raise RlxTypeError(f"attention: layout must be an rlx.Layout, got {type(layout).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise RlxTypeError(f"attention: scale must be a number, got {type(scale).__name__}")
        scale = float(scale)
        if not math.isfinite(scale):
            raise RlxValueError(f"attention: scale must be finite, got {scale}")
    tensors = list(captured)
    regions: list[Region | None] = []
    for kind, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is None or isinstance(mod, Region):
            regions.append(mod)
        else:
            regions.append(trace(graph, mod, kind, tensors))
    attrs = FlexAttentionAttrs(regions[0], regions[1], scale, layout)
    out, lse = graph.add_node(op_kind("flex_attention"), (q, k, v, *tensors), attrs).outputs
    return (out, lse) if return_lse else out


def _builder_flex_attention_bwd(graph: Graph, *inputs: Value, **attrs: Any) -> Value | tuple[Value, ...]:
    """``g.flex_attention_bwd(q, k, v, out, dy, lse, *captured, wrt=..., ...)``; ``rlx.grad`` makes these."""
    outputs = graph.add_node(op_kind("flex_attention_bwd"), inputs, FlexAttentionBwdAttrs(**attrs)).outputs
    return outputs[0] if len(outputs) == 1 else outputs


FLEX_ATTENTION = register_op(
    OpDef(
        "flex_attention",
        ("inputs*",),
        FlexAttentionAttrs,
        _flex_infer,
        _flex_reference,
        _flex_grad,
        builder=flex_attention,
        batch=batch_by_unrolling,
        node_index_operands=mod_index_operands,
        summary="attention with traced score_mod / mask_mod regions; returns out and lse",
    )
)
FLEX_ATTENTION_BWD = register_op(
    OpDef(
        "flex_attention_bwd",
        ("inputs*",),
        FlexAttentionBwdAttrs,
        _flex_bwd_infer,
        _flex_bwd_reference,
        _flex_bwd_grad,
        builder=_builder_flex_attention_bwd,
        batch=batch_by_unrolling,
        narrow=_narrow_flex_bwd,
        node_index_operands=mod_index_operands,
        summary="flex attention gradients from the forward's out and lse",
    )
)
