"""Op kinds, their attribute classes and their shape rules.

Adding an op means: one ``OpKind`` member, one frozen attrs dataclass, one shape rule here; a
reference function in ``rlx.reference``, a gradient rule in ``rlx.autodiff`` and a lowering in
``rlx.codegen``, each keyed by the ``OpKind``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.types import Layout, MaskKind, TensorType, Wrt

F32 = np.dtype(np.float32)


class OpKind(enum.Enum):
    """Every operation the IR knows; the value is the op's name in textual IR."""

    INPUT = "input"
    ATTENTION = "attention"
    ATTENTION_BWD = "attention_bwd"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class InputAttrs:
    """A graph input: its name (unique in the graph); shape and dtype are the node's type."""

    name: str


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


Attrs = InputAttrs | AttentionAttrs | AttentionBwdAttrs

ShapeRule = Callable[[str, Sequence[TensorType], Attrs], tuple[TensorType, ...]]


@dataclass(frozen=True)
class AttentionDims:
    """The sizes an attention node works on, read from its operand types."""

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int


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
    _, sk, _, _ = layout.split(k.shape)
    want_q = layout.join(b, sq, h, d)
    want_kv = layout.join(b, sk, h, d)
    if k.shape != want_kv:
        raise RlxValueError(
            f"{what}: k must have batch {b}, heads {h} and head_dim {d} like q {q} "
            f"(layout {layout}: {_layout_names(layout)}), got {k}"
        )
    if v.shape != want_kv:
        raise RlxValueError(f"{what}: v must be f32{list(want_kv)} to match q {q} and k {k}, got {v}")
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
    return AttentionDims(batch=b, heads=h, seq_q=sq, seq_k=sk, head_dim=d)


def _layout_names(layout: Layout) -> str:
    return "[B, S, H, D]" if layout is Layout.BSHD else "[B, H, S, D]"


def _check_attrs(what: str, attrs: object, cls: type) -> None:
    if not isinstance(attrs, cls):
        raise RlxTypeError(f"{what}: attrs must be {cls.__name__}, got {type(attrs).__name__}")


def _attention_shape(what: str, inputs: Sequence[TensorType], attrs: Attrs) -> tuple[TensorType, ...]:
    _check_attrs(what, attrs, AttentionAttrs)
    assert isinstance(attrs, AttentionAttrs)  # for the type checker
    if len(inputs) not in (3, 4):
        raise RlxValueError(f"{what}: attention takes q, k, v and an optional mask tensor, got {len(inputs)} inputs")
    q, k, v = inputs[:3]
    attention_dims(what, q, k, v, attrs.layout, None, attrs.mask, inputs[3] if len(inputs) == 4 else None)
    return (TensorType(q.shape, F32),)


def _attention_bwd_shape(what: str, inputs: Sequence[TensorType], attrs: Attrs) -> tuple[TensorType, ...]:
    _check_attrs(what, attrs, AttentionBwdAttrs)
    assert isinstance(attrs, AttentionBwdAttrs)  # for the type checker
    if len(inputs) not in (4, 5):
        raise RlxValueError(
            f"{what}: attention_bwd takes q, k, v, dy and an optional mask tensor, got {len(inputs)} inputs"
        )
    q, k, v, dy = inputs[:4]
    attention_dims(what, q, k, v, attrs.layout, dy, attrs.mask, inputs[4] if len(inputs) == 5 else None)
    by_flag = {Wrt.QUERY: q, Wrt.KEY: k, Wrt.VALUE: v}
    return tuple(TensorType(by_flag[flag].shape, F32) for flag in attrs.wrt.members)


def _input_shape(what: str, inputs: Sequence[TensorType], attrs: Attrs) -> tuple[TensorType, ...]:
    raise RlxValueError(f"{what}: input nodes carry their own type; declare them with Graph.input(name, shape)")


SHAPE_RULES: dict[OpKind, ShapeRule] = {
    OpKind.INPUT: _input_shape,
    OpKind.ATTENTION: _attention_shape,
    OpKind.ATTENTION_BWD: _attention_bwd_shape,
}

ATTRS_CLASS: dict[OpKind, type] = {
    OpKind.INPUT: InputAttrs,
    OpKind.ATTENTION: AttentionAttrs,
    OpKind.ATTENTION_BWD: AttentionBwdAttrs,
}


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
