"""SDPA as torch custom ops (``rlx::sdpa``, ``rlx::sdpa_masked`` and their backwards), so that a
model calling ``rt.scaled_dot_product_attention`` compiles with ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

from typing import Any

import torch

from rlx.torch.flex import _attention_arrays
from rlx.torch.sdpa import _fixed_grads, _fixed_out, _fixed_plan, _masked_plan
from rlx.torch.threads import _attention_flops


@torch.library.custom_op(
    "rlx::sdpa",
    mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, bool is_causal, float? scale) -> Tensor",
)
def _sdpa_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool, scale: float | None) -> Any:
    """SDPA on the fixed-mask kernels as a torch custom op, for ``torch.compile`` graphs."""
    plan = _fixed_plan(query, key, value, is_causal, scale)
    assert plan is not None, "rlx::sdpa takes what _fixed_op_takes accepts"
    return _fixed_out(plan, query, key, value, _attention_flops(query, key, value))


@_sdpa_op.register_fake
def _sdpa_op_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool, scale: Any) -> Any:
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


@torch.library.custom_op(
    "rlx::sdpa_backward",
    mutates_args=(),
    schema="(Tensor grad, Tensor query, Tensor key, Tensor value, bool is_causal, float? scale)"
    " -> (Tensor, Tensor, Tensor)",
)
def _sdpa_backward_op(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool, scale: Any
) -> Any:
    """dq, dk, dv of ``rlx::sdpa`` from the fixed-mask backward kernel."""
    plan = _fixed_plan(query, key, value, is_causal, scale)
    assert plan is not None
    return _fixed_grads(plan, query, key, value, grad, _attention_flops(query, key, value))


@_sdpa_backward_op.register_fake
def _qkv_grads_shape(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any) -> Any:
    """The fake of both backward ops: dq, dk, dv contiguous, as the kernels return them
    (``empty_like`` would keep a transposed view's strides)."""
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _sdpa_op_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    query, key, value, is_causal, scale = inputs
    ctx.save_for_backward(query, key, value)
    ctx.is_causal, ctx.scale = is_causal, scale


def _sdpa_op_backward(ctx: Any, grad: torch.Tensor) -> Any:
    query, key, value = ctx.saved_tensors
    dq, dk, dv = torch.ops.rlx.sdpa_backward.default(grad, query, key, value, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


_sdpa_op.register_autograd(_sdpa_op_backward, setup_context=_sdpa_op_setup)


@torch.library.custom_op(
    "rlx::sdpa_masked",
    mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, Tensor attn_mask, bool is_causal, float? scale)"
    " -> (Tensor, Tensor)",
)
def _sdpa_masked_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor, is_causal: bool, scale: Any
) -> Any:
    """Masked SDPA (``out`` and ``lse``) on the programmable kernels as a torch custom op: the
    backward op takes ``out`` and ``lse`` back, as the eager path saves them."""
    plan = _masked_plan(query, key, value, attn_mask, is_causal, scale)
    result = plan.forward.run(_attention_arrays(query, key, value, plan.captured), plan.threads)
    return torch.from_numpy(result["out"]), torch.from_numpy(result["lse"])


@_sdpa_masked_op.register_fake
def _sdpa_masked_op_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any) -> Any:
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return out, query.new_empty(query.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(
    "rlx::sdpa_masked_backward",
    mutates_args=(),
    schema="(Tensor grad, Tensor query, Tensor key, Tensor value, Tensor attn_mask, Tensor out, Tensor lse,"
    " bool is_causal, float? scale) -> (Tensor, Tensor, Tensor)",
)
def _sdpa_masked_backward_op(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: Any,
) -> Any:
    """dq, dk, dv of ``rlx::sdpa_masked`` from the programmable backward kernel."""
    plan = _masked_plan(query, key, value, attn_mask, is_causal, scale)
    arrays = _attention_arrays(query, key, value, plan.captured, out=out, lse=lse, dy=grad)
    exe = plan.backward(False, False)
    grads = exe.run({name: arrays[name] for name in exe.graph.inputs}, plan.threads)
    return tuple(torch.from_numpy(grads[name]) for name in ("dq", "dk", "dv"))


_sdpa_masked_backward_op.register_fake(_qkv_grads_shape)


def _sdpa_masked_op_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    query, key, value, attn_mask, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse)
    ctx.is_causal, ctx.scale = is_causal, scale


def _sdpa_masked_op_backward(ctx: Any, grad: torch.Tensor, _lse_grad: Any) -> Any:
    """The lse output is the op's own (SDPA returns ``out`` only), so no gradient comes into it."""
    query, key, value, attn_mask, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.rlx.sdpa_masked_backward.default(
        grad, query, key, value, attn_mask, out, lse, ctx.is_causal, ctx.scale
    )
    return dq, dk, dv, None, None, None


_sdpa_masked_op.register_autograd(_sdpa_masked_op_backward, setup_context=_sdpa_masked_op_setup)
