"""``softmax`` and ``log_softmax`` over one axis, and the ``rms_norm`` / ``layer_norm`` of the last axis.

They are ops of their own, not compositions, so the printed IR reads like the model and the
reference is the numerically safe textbook form; their gradients are compositions of primitives,
which the fusion pass turns back into one loop nest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import Dim, TensorType
from rlx.ops._batching import again, batch_moving_axes, to_rank, with_examples
from rlx.ops._common import as_value, is_number, normalize_axis, op_kind, require_float, sum_to_shape

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class AxisAttrs:
    axis: int  # non-negative


def _softmax_infer(what: str, inputs: Sequence[TensorType], attrs: AxisAttrs) -> tuple[TensorType, ...]:
    (x,) = inputs
    require_float(what, "x", x)
    if x.rank == 0 or not 0 <= attrs.axis < x.rank:
        raise RlxValueError(f"{what}: axis {attrs.axis} is out of range for {x}")
    return (x,)


def _softmax_reference(args: Sequence[np.ndarray], attrs: AxisAttrs, ctx: EvalContext) -> np.ndarray:
    x = args[0]
    e = np.exp(x - np.max(x, axis=attrs.axis, keepdims=True, initial=-np.inf))
    return e / np.sum(e, axis=attrs.axis, keepdims=True)


def _log_softmax_reference(args: Sequence[np.ndarray], attrs: AxisAttrs, ctx: EvalContext) -> np.ndarray:
    x = args[0]
    shifted = x - np.max(x, axis=attrs.axis, keepdims=True, initial=-np.inf)
    return shifted - np.log(np.sum(np.exp(shifted), axis=attrs.axis, keepdims=True))


def _softmax_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    dy, y, axis = cts[0], node.outputs[0], node.attrs.axis
    assert dy is not None
    return [y * (dy - graph.sum(dy * y, axis=axis, keepdims=True))]


def _log_softmax_grad(
    graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    dy, y, axis = cts[0], node.outputs[0], node.attrs.axis
    assert dy is not None
    return [dy - graph.exp(y) * graph.sum(dy, axis=axis, keepdims=True)]


def _axis_builder(name: str):  # type: ignore[no-untyped-def]
    def build(graph: Graph, x: object, axis: int = -1) -> Value:
        value = as_value(graph, x, f"{name}: x")
        if value.shape == ():
            raise RlxValueError(f"{name}: x must have at least one axis, got a scalar")
        return graph.add_node(op_kind(name), [value], AxisAttrs(normalize_axis(name, axis, len(value.shape)))).outputs[
            0
        ]

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"``{name}`` over ``axis`` (default the last), max-subtracted as torch's."
    return build


def _decompose_softmax(graph: Graph, node: Node) -> tuple[Value, ...]:
    x, axis = node.inputs[0], node.attrs.axis
    e = graph.exp(x - graph.max(x, axis=axis, keepdims=True))
    return (e / graph.sum(e, axis=axis, keepdims=True),)


def _decompose_log_softmax(graph: Graph, node: Node) -> tuple[Value, ...]:
    x, axis = node.inputs[0], node.attrs.axis
    shifted = x - graph.max(x, axis=axis, keepdims=True)
    return (shifted - graph.log(graph.sum(graph.exp(shifted), axis=axis, keepdims=True)),)


register_op(
    OpDef(
        "softmax",
        ("x",),
        AxisAttrs,
        _softmax_infer,
        _softmax_reference,
        _softmax_grad,
        builder=_axis_builder("softmax"),
        batch=batch_moving_axes("axis"),
        decompose=_decompose_softmax,
    )
)
register_op(
    OpDef(
        "log_softmax",
        ("x",),
        AxisAttrs,
        _softmax_infer,
        _log_softmax_reference,
        _log_softmax_grad,
        builder=_axis_builder("log_softmax"),
        batch=batch_moving_axes("axis"),
        decompose=_decompose_log_softmax,
    )
)


# ----------------------------------------------------------------------------- norms


@dataclass(frozen=True)
class NormAttrs:
    eps: float


def _norm_infer(what: str, inputs: Sequence[TensorType], attrs: NormAttrs) -> tuple[TensorType, ...]:
    x = inputs[0]
    require_float(what, "x", x)
    if x.rank == 0:
        raise RlxValueError(f"{what}: x must have at least one axis, got a scalar")
    for label, ty in zip(("weight", "bias"), inputs[1:], strict=False):
        require_float(what, label, ty)
        if ty.shape != (x.shape[-1],):
            raise RlxValueError(f"{what}: {label} must be f32[{x.shape[-1]}] (the last axis of x {x}), got {ty}")
    if not isinstance(attrs.eps, float) or not attrs.eps >= 0:
        raise RlxValueError(f"{what}: eps must be a float >= 0, got {attrs.eps!r}")
    return (x,)


def _rms_norm_reference(args: Sequence[np.ndarray], attrs: NormAttrs, ctx: EvalContext) -> np.ndarray:
    x, weight = args
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + attrs.eps) * weight


def _layer_norm_reference(args: Sequence[np.ndarray], attrs: NormAttrs, ctx: EvalContext) -> np.ndarray:
    x, weight = args[0], args[1]
    centred = x - np.mean(x, axis=-1, keepdims=True)
    out = centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + attrs.eps) * weight
    return out + args[2] if len(args) > 2 else out


def _rms_norm_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    dy = cts[0]
    assert dy is not None
    x, weight = node.inputs
    r = graph.rsqrt(graph.mean(x * x, axis=-1, keepdims=True) + node.attrs.eps)
    xhat = x * r
    dxhat = dy * weight
    dx = r * (dxhat - xhat * graph.mean(dxhat * xhat, axis=-1, keepdims=True)) if needed[0] else None
    dw = sum_to_shape(graph, dy * xhat, weight.shape) if needed[1] else None
    return [dx, dw]


def _layer_norm_grad(
    graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    dy = cts[0]
    assert dy is not None
    x, weight = node.inputs[0], node.inputs[1]
    centred = x - graph.mean(x, axis=-1, keepdims=True)
    r = graph.rsqrt(graph.mean(centred * centred, axis=-1, keepdims=True) + node.attrs.eps)
    xhat = centred * r
    dxhat = dy * weight
    dx = None
    if needed[0]:
        mean_dxhat = graph.mean(dxhat, axis=-1, keepdims=True)
        dx = r * (dxhat - mean_dxhat - xhat * graph.mean(dxhat * xhat, axis=-1, keepdims=True))
    grads: list[Value | None] = [dx, sum_to_shape(graph, dy * xhat, weight.shape) if needed[1] else None]
    if len(node.inputs) > 2:
        grads.append(sum_to_shape(graph, dy, node.inputs[2].shape) if needed[2] else None)
    return grads


def _check_eps(name: str, eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise RlxTypeError(f"{name}: eps must be a float, got {type(eps).__name__}")
    return float(eps)


def _per_feature(graph: Graph, x: Value, operand: object, what: str) -> Value:
    """A norm's weight or bias: a Value as given; a Python number broadcast over the last axis,
    as ``* weight`` reads in the formula. Only numbers are broadcast: a tensor must be ``[E]``,
    and the shape rule says so when it is not."""
    if is_number(operand) and x.shape:
        return graph.broadcast_to(graph.constant(float(operand)), (x.shape[-1],))  # type: ignore[arg-type]
    return as_value(graph, operand, what)


def rms_norm(graph: Graph, x: object, weight: object = None, eps: float = 1e-6) -> Value:
    """``x * rsqrt(mean(x*x, -1) + eps) * weight`` over the last axis (weight None: ones; a number
    scales every feature)."""
    xv = as_value(graph, x, "rms_norm: x")
    wv = _per_feature(graph, xv, 1.0 if weight is None else weight, "rms_norm: weight")
    return graph.add_node(op_kind("rms_norm"), [xv, wv], NormAttrs(_check_eps("rms_norm", eps))).outputs[0]


def layer_norm(graph: Graph, x: object, weight: object = None, bias: object = None, eps: float = 1e-5) -> Value:
    """As ``torch.nn.functional.layer_norm`` over the last axis: biased variance, optional bias
    (numbers for either apply to every feature)."""
    xv = as_value(graph, x, "layer_norm: x")
    operands = [xv, _per_feature(graph, xv, 1.0 if weight is None else weight, "layer_norm: weight")]
    if bias is not None:
        operands.append(_per_feature(graph, xv, bias, "layer_norm: bias"))
    return graph.add_node(op_kind("layer_norm"), operands, NormAttrs(_check_eps("layer_norm", eps))).outputs[0]


def _decompose_rms_norm(graph: Graph, node: Node) -> tuple[Value, ...]:
    """The same builder calls as the gradient rule, so cse shares ``rsqrt(mean(x*x) + eps)`` with it."""
    x, weight = node.inputs
    r = graph.rsqrt(graph.mean(x * x, axis=-1, keepdims=True) + node.attrs.eps)
    return (x * r * weight,)


def _decompose_layer_norm(graph: Graph, node: Node) -> tuple[Value, ...]:
    x, weight = node.inputs[0], node.inputs[1]
    centred = x - graph.mean(x, axis=-1, keepdims=True)
    r = graph.rsqrt(graph.mean(centred * centred, axis=-1, keepdims=True) + node.attrs.eps)
    out = centred * r * weight
    return (out + node.inputs[2] if len(node.inputs) > 2 else out,)


def _batch_norm(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> Sequence[Value]:
    """Shared weights (a model's) stay operands; weights per example scale and shift the
    normalised rows as elementwise ops."""
    x = with_examples(graph, operands[0], batched[0], size)
    if not any(batched[1:]):
        return again(graph, node, [x, *operands[1:]])
    eps = node.attrs.eps
    rank = node.outputs[0].ndim
    weight, *bias = (to_rank(graph, v, rank) if flag else v for v, flag in zip(operands[1:], batched[1:], strict=True))
    if node.op.value == "rms_norm":
        return (graph.rms_norm(x, None, eps) * weight,)
    out = graph.layer_norm(x, None, None, eps) * weight
    return (out + bias[0] if bias else out,)


register_op(
    OpDef(
        "rms_norm",
        ("x", "weight"),
        NormAttrs,
        _norm_infer,
        _rms_norm_reference,
        _rms_norm_grad,
        builder=rms_norm,
        batch=_batch_norm,
        decompose=_decompose_rms_norm,
    )
)
register_op(
    OpDef(
        "layer_norm",
        ("x", "weight", "bias?"),
        NormAttrs,
        _norm_infer,
        _layer_norm_reference,
        _layer_norm_grad,
        builder=layer_norm,
        batch=_batch_norm,
        decompose=_decompose_layer_norm,
    )
)
