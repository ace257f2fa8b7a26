"""``rlx.torch.scaled_dot_product_attention``: torch's SDPA on rlx's fixed-mask kernels (no mask,
or causal with ``Sq == Sk``) or, with a mask tensor, on the programmable ones."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import rlx
import rlx.mods as _mods
from rlx.codegen.executable import DirectRunner, Executable
from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.graph import Graph
from rlx.ir.types import Layout
from rlx.torch._autograd import _eager_under_torch_compile, _twice_differentiable
from rlx.torch._layouts import _layout_inputs, _layout_names, _layout_tensors, _strided_layout
from rlx.torch._tensors import _COMPUTED, _array, _check_tensor, _dense, _direct, _float, _tensor, _written
from rlx.torch.flex import _TORCH_DTYPES, _check_scale, _flex_forward, _Plan, _plan, _plans_lock, _run_by_address
from rlx.torch.graphs import CompiledGraph
from rlx.torch.graphs import compile as compile_graph_function
from rlx.torch.threads import _attention_flops, _threads_for

_sdpa_plans: dict[tuple[Any, ...], _Plan] = {}  # SDPA calls by shapes and mask kind: no tracing


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch's ``scaled_dot_product_attention`` on rlx: same signature, layout, masks and results.

    A bool ``attn_mask`` is True where a query attends; a float one is added to the scores (and
    gets a gradient if it requires one). ``is_causal`` is top-left aligned, as in torch. rlx has
    no dropout: ``dropout_p`` other than 0 is an error, never silently ignored.

    Under ``torch.compile`` a call the fixed-mask kernels take (no mask, or causal with
    ``Sq = Sk``; 4-D tensors) is the custom op ``rlx::sdpa``, and a float32 call with a bool or
    float mask that needs no gradient is ``rlx::sdpa_masked``: both compile into the graph with
    their backward (``fullgraph=True`` works). Any other call is one graph break.
    """
    if torch.compiler.is_compiling():
        if _fixed_op_takes(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
            return torch.ops.rlx.sdpa.default(query, key, value, is_causal, None if scale is None else float(scale))
        if _masked_op_takes(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
            out, _ = torch.ops.rlx.sdpa_masked.default(
                query, key, value, attn_mask, is_causal, None if scale is None else float(scale)
            )
            return out  # type: ignore[no-any-return]
        return _sdpa_graph_break(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if attn_mask is None:
        out = _inference_call(query, key, value, dropout_p, is_causal, scale, enable_gqa)
    else:
        out = _masked_inference_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if out is not None:
        return out
    return _sdpa_eager(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# Inference plans by what selects a plan (heads and head dims, flags): the forward's direct
# runner. Lengths and batch are not in the key: a decode loop at Sk = 1..N meets one entry.
_inference_runners: dict[tuple[Any, ...] | None, DirectRunner] = {}  # never under None


def _inference_call(
    q: object, k: object, v: object, dropout_p: object, is_causal: bool, scale: object, enable_gqa: bool
) -> torch.Tensor | None:
    """The call of an inference loop (no mask, nothing for autograd to record, contiguous float32
    tensors) in as few steps as the checks allow, else None: the general path takes it.

    A decode step of a model (a projection, the KV cache's ``torch.cat``, attention) leaves
    little of the Python objects a call touches in the caches, and there every function a call
    passes through cost microseconds: the general path's checks and plan lookups took longer
    than the kernel. A call whose heads, head dims and flags an earlier call had takes that
    call's plan and runner (:class:`DirectRunner`): the compiled graph's own shape check (its
    call layout, which refuses what :func:`_fixed_op_takes` refuses for that plan: batches,
    lengths or head dims that disagree, a causal call with ``Sq != Sk``, an empty dimension),
    :func:`_direct` (dtype, device, contiguity, alignment) and autograd's flags are what is
    left per call. Any other call goes through :func:`_fixed_op_takes` and the general path's
    plan, and is kept for the next.
    """
    plain = type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor
    plain = plain and (scale is None or type(scale) is float) and dropout_p == 0.0
    if plain:
        assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        runner = _inference_runners.get(_runner_key(q, k, v, is_causal, scale, enable_gqa))
        if runner is not None:
            if not _direct(q, k, v):
                return None
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                return None
            qs, ks, vs = q.shape, k.shape, v.shape
            layout = runner.layout((qs, ks, vs))
            if layout is not None:
                shape = layout.buffers[0][1]
                # q is a contiguous float32 CPU tensor (_direct): a new one like it, when out has
                # its shape (Dv = D), takes 1.5 us where torch.empty's arguments take 2.3
                same = shape == qs
                out = torch.empty_like(q, memory_format=torch.contiguous_format) if same else _written(shape)
                flops = 2.0 * qs[0] * qs[1] * qs[2] * ks[2] * (qs[3] + vs[3])  # _attention_flops, inlined
                runner(layout, [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()], _threads_for(flops))
                return out
    if not _fixed_op_takes(q, k, v, None, dropout_p, is_causal, scale, enable_gqa):
        return None
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    if not _direct(q, k, v):
        return None
    plan = _fixed_plan(q, k, v, is_causal, scale)  # type: ignore[arg-type]
    assert plan is not None  # _fixed_op_takes refuses causal calls with Sq != Sk
    if plain and plan.layout == "bhsd":
        runner = (plan.executables.get("forward") or plan.executable("forward")).direct_runner
        if runner is not None and runner.inputs == ("q", "k", "v") and runner.outputs == ("out",):
            with _plans_lock:
                _inference_runners.setdefault(_runner_key(q, k, v, is_causal, scale, enable_gqa), runner)
    return _fixed_out(plan, q, k, v, _attention_flops(q, k, v), direct=True)


# Masked inference plans (batched generation's padding mask) by heads, head dims, flags and the
# mask's pattern (which of its axes follow the batch and the lengths): the forward's runner.
_masked_runners: dict[tuple[Any, ...], DirectRunner] = {}


def _masked_inference_call(
    q: object,
    k: object,
    v: object,
    mask: object,
    dropout_p: object,
    is_causal: bool,
    scale: object,
    enable_gqa: bool,
) -> torch.Tensor | None:
    """A masked call of an inference loop (4-D contiguous float32 tensors, a 4-D mask that needs
    no gradient, nothing for autograd to record) by the runner of the symbolic plan an earlier
    call of the same heads, head dims, flags and mask pattern ran by address (kept by
    :func:`_keep_masked_runner`), else None: the general path takes it. The runner's layout
    checks the shapes against that plan's declarations (batch, lengths and the mask's axes), and
    declines a call whose kernel would read a block map (a large one): only what the general
    path would run the same way by address is taken. A batched decode step (B2 H8 D64) spent
    ~20 us in the general path's checks, plan lookup and plan object before its kernel."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return None
    if type(mask) is not torch.Tensor or dropout_p != 0.0 or not (scale is None or type(scale) is float):
        return None
    key = _masked_runner_key(q, k, v, mask, is_causal, scale, enable_gqa)
    runner = _masked_runners.get(key) if key is not None else None
    if runner is None or mask.requires_grad:
        return None
    if not _direct(q, k, v) or not _direct(mask, dtype=mask.dtype):  # the key holds the mask's dtype
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    qs, ks, vs = q.shape, k.shape, v.shape
    layout = runner.layout((qs, ks, vs, mask.shape))
    if layout is None:
        return None
    flops = 2.0 * qs[0] * qs[1] * qs[2] * ks[2] * (qs[3] + vs[3])  # _attention_flops, inlined
    return _run_by_address(runner, layout, (q, k, v, mask), _threads_for(flops))["out"]


def _masked_runner_key(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    is_causal: bool,
    scale: object,
    enable_gqa: bool,
) -> tuple[Any, ...] | None:
    """What selects a masked inference call's plan (:data:`_masked_runners`), with the mask's
    axes as :func:`_masked_plan` declares them; None for tensors that are not 4-D."""
    if not q.ndim == k.ndim == v.ndim == mask.ndim == 4:
        return None
    m = mask.shape
    batch, seq_q, seq_k = ("B" if m[0] == q.shape[0] else m[0]), ("Sq" if m[2] == q.shape[2] else m[2]), m[3]
    pattern = (batch, m[1], seq_q, "Sk" if seq_k == k.shape[2] else seq_k)
    return (q.shape[1], q.shape[3], k.shape[1], v.shape[3], is_causal, scale, enable_gqa, pattern, mask.dtype)


def _keep_masked_runner(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    is_causal: bool,
    scale: object,
    enable_gqa: bool,
    plan: _Plan,
) -> None:
    """Keep the runner of a masked call's plan for :func:`_masked_inference_call`: a plan of
    symbolic lengths taking contiguous ``[B, H, S, D]`` tensors and the mask by address."""
    key = _masked_runner_key(q, k, v, mask, is_causal, scale, enable_gqa)
    if key is None or key in _masked_runners or plan.layout != "bhsd" or mask.requires_grad:
        return
    if plan.graph.inputs["q"].type.is_static:
        return
    runner = plan.forward.direct_runner
    if runner is None or runner.inputs != ("q", "k", "v", "c0") or set(runner.outputs) != {"out", "lse"}:
        return
    if _TORCH_DTYPES.get(runner.dtypes[3]) != mask.dtype:  # a half or double mask: computed from a float32 copy
        return
    with _plans_lock:
        _masked_runners.setdefault(key, runner)  # the key holds the mask's dtype, which the graph declares


def _runner_key(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: object, enable_gqa: bool
) -> tuple[Any, ...] | None:
    """What selects an inference call's plan (:data:`_inference_runners`): heads, head dims and
    flags; None for tensors that are not 4-D."""
    if not q.ndim == k.ndim == v.ndim == 4:
        return None
    return (q.shape[1], q.shape[3], k.shape[1], v.shape[3], is_causal, scale, enable_gqa)


def _fixed_op_takes(
    q: object,
    k: object,
    v: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: bool,
    scale: object,
    enable_gqa: bool,
) -> bool:
    """Is this a call ``rlx::sdpa`` computes exactly as the eager path would (and without an
    error the eager path would raise)? Shapes are read as torch.compile traces them (guards)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    if attn_mask is not None or dropout_p != 0.0 or (scale is not None and not isinstance(scale, (int, float))):
        return False
    if isinstance(scale, bool) or not (q.ndim == k.ndim == v.ndim == 4) or not (q.dtype == k.dtype == v.dtype):
        return False
    if q.dtype not in _COMPUTED or not (q.is_cpu and k.is_cpu and v.is_cpu):
        return False
    (batch, heads, seq_q, dim), (kv_batch, kv_heads, seq_k, key_dim) = q.shape, k.shape
    same = batch == kv_batch == v.shape[0] and kv_heads == v.shape[1] and seq_k == v.shape[2] and dim == key_dim
    grouped = heads == kv_heads or (kv_heads >= 1 and heads % kv_heads == 0 and (enable_gqa or kv_heads == 1))
    sizes = min(batch, heads, seq_q, seq_k, dim, v.shape[3]) > 0
    return bool(same and grouped and sizes and not (is_causal and seq_q != seq_k))


def _masked_op_takes(
    q: object,
    k: object,
    v: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: bool,
    scale: object,
    enable_gqa: bool,
) -> bool:
    """Is this a masked call ``rlx::sdpa_masked`` computes exactly as the eager path would?

    float32 only (the eager path keeps a half-precision call's ``out`` in float32 for the
    backward, which an op's saved outputs would not), and a mask that needs no gradient.
    """
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.requires_grad or not attn_mask.is_cpu:
        return False
    if attn_mask.dtype != torch.bool and attn_mask.dtype not in _COMPUTED:
        return False
    if not _fixed_op_takes(q, k, v, None, dropout_p, False, scale, enable_gqa):
        return False
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    if q.dtype != torch.float32 or attn_mask.ndim > 4:
        return False
    try:
        torch.broadcast_shapes(attn_mask.shape, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    except RuntimeError:
        return False
    return True


def _sdpa_eager(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """SDPA outside a compiled graph: check the arguments, then the fixed-mask kernels or the
    programmable ones (one graph break when torch.compile meets it)."""
    if dropout_p != 0.0:
        raise RlxValueError(
            f"scaled_dot_product_attention: dropout_p={dropout_p}, but rlx has no dropout; pass dropout_p=0.0 "
            "(or apply dropout outside attention)"
        )
    q = _check_tensor(query, "query")
    k = _check_tensor(key, "key")
    v = _check_tensor(value, "value")
    scale = _check_scale(scale, "scaled_dot_product_attention")
    if not q.dtype == k.dtype == v.dtype:  # as torch's SDPA (its flex_attention takes mixed dtypes)
        raise RlxTypeError(
            "scaled_dot_product_attention: query, key and value must have the same dtype, got "
            f"{q.dtype}, {k.dtype} and {v.dtype}"
        )
    mask = None if attn_mask is None else _check_tensor(attn_mask, "attn_mask", kinds="any")
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise RlxTypeError(f"scaled_dot_product_attention: attn_mask must be bool or float, got {mask.dtype}")
    same_batch = q.ndim == k.ndim == v.ndim == 4 and q.shape[0] == k.shape[0] == v.shape[0]
    if same_batch and q.numel() and k.numel() and v.numel() and (mask is None or mask.ndim <= 4):
        return _sdpa(q, k, v, mask, is_causal, scale, enable_gqa)
    return _sdpa_batched(q, k, v, mask, is_causal, scale, enable_gqa)


_sdpa_graph_break = _eager_under_torch_compile(_sdpa_eager)  # what torch.compile meets: one graph break


def _sdpa_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """SDPA on ``[..., H, S, D]`` tensors, as torch takes them: 2-D and 3-D ones, and any number of
    leading batch dims that broadcast against each other, flattened into one batch for the kernels
    (torch's autograd sums the gradients of broadcast dims back)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.ndim < 2:
            raise RlxValueError(f"scaled_dot_product_attention: {name} must be [..., S, D], got shape {tuple(t.shape)}")
    if q.shape[-1] == 0:
        raise RlxValueError(f"scaled_dot_product_attention: query and key have head dim 0 ({tuple(q.shape)})")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise RlxValueError(
            "scaled_dot_product_attention: query and key need the same head dim and key and value the same "
            f"length, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    given_rank = max(q.ndim, k.ndim, v.ndim)
    rank = max(given_rank, 3)
    q, k, v = (t.reshape((1,) * (rank - t.ndim) + tuple(t.shape)) for t in (q, k, v))
    try:
        leading = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    except RuntimeError:
        raise RlxValueError(
            "scaled_dot_product_attention: the batch dims of query, key and value do not broadcast: "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        ) from None
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if v.shape[-3] != kv_heads:
        raise RlxValueError(f"scaled_dot_product_attention: key has {kv_heads} heads and value {v.shape[-3]}")
    out_shape = (*leading, heads, q.shape[-2], v.shape[-1])
    if mask is not None:
        try:
            torch.broadcast_shapes(mask.shape, out_shape[:-1] + (k.shape[-2],))
        except RuntimeError:
            raise RlxValueError(
                f"scaled_dot_product_attention: attn_mask of shape {tuple(mask.shape)} does not broadcast to "
                f"[..., H, Sq, Sk] = {list(out_shape[:-1] + (k.shape[-2],))}"
            ) from None
    batch = math.prod(leading)

    def flat(t: torch.Tensor, heads_of_t: int) -> torch.Tensor:
        return t.expand(*leading, heads_of_t, *t.shape[-2:]).reshape(batch, heads_of_t, *t.shape[-2:])

    q4, k4, v4 = flat(q, heads), flat(k, kv_heads), flat(v, kv_heads)
    if mask is not None and mask.ndim > 3:
        mask = mask.reshape((1,) * (len(leading) + 3 - mask.ndim) + tuple(mask.shape))
        if any(size != 1 for size in mask.shape[:-3]):
            mask = mask.expand(*leading, *mask.shape[-3:])
        mask = mask.reshape(-1, *mask.shape[-3:])
    if 0 in q4.shape or 0 in k4.shape or 0 in v4.shape:
        out = _sdpa_empty(q4, k4, v4, scale)
    else:
        out = _sdpa(q4, k4, v4, mask, is_causal, scale, enable_gqa)
    out = out.reshape(out_shape)
    return out.reshape(out_shape[rank - given_rank :]) if given_rank < rank else out


def _sdpa_empty(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Attention with no queries, no keys or no batch, in torch's own terms: there is nothing to
    compute (no keys give zeros; a mask has no entries to apply), and autograd still connects
    the result to every input."""
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(q @ k.transpose(-1, -2) * factor, dim=-1) @ v


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """SDPA on 4-D ``[B, H, S, D]`` tensors of one batch size. One key head broadcasts over the
    query heads, as in torch: that is GQA with a single group, whatever ``enable_gqa`` says."""
    if k.shape[1] != q.shape[1] and not enable_gqa and k.shape[1] != 1:
        raise RlxValueError(
            f"scaled_dot_product_attention: query has {q.shape[1]} heads and key {k.shape[1]}; pass enable_gqa=True"
        )
    if k.shape[1:3] != v.shape[1:3] or q.shape[3] != k.shape[3]:
        raise RlxValueError(
            "scaled_dot_product_attention: key and value need the same heads and length, and query and key the "
            f"same head dim; got query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}"
        )
    fixed = _fixed_plan(q, k, v, is_causal, scale, _strided_layout(q, k, v)) if attn_mask is None else None
    if fixed is not None:
        return _fixed_forward(fixed, q, k, v)
    plan = _masked_plan(q, k, v, attn_mask, is_causal, scale)
    out, _ = _flex_forward(plan, q, k, v)
    recorded = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if attn_mask is not None and not recorded:
        _keep_masked_runner(q, k, v, attn_mask, is_causal, scale, enable_gqa, plan)
    return out


def _masked_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> _Plan:
    """The programmable-attention plan for an SDPA call the fixed-mask kernels cannot express
    (a mask tensor, or causal with ``Sq != Sk``), with this call's mask as its captured tensor."""
    # SDPA's mods are fixed by the arguments' shapes and kinds, so a traced plan is reused without
    # tracing again: only the mask tensor (the one captured value) changes between calls.
    mask_kind = None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype)
    plan_key: tuple[Any, ...] = (tuple(q.shape), tuple(k.shape), tuple(v.shape), is_causal, scale, mask_kind)
    # The mask as [B|1, H|1, Sq|1, Sk|1]: the captured tensor of the plan.
    full = None if attn_mask is None else attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
    mask_shape: tuple[int | str, ...] | None = None
    symbolic_key: tuple[Any, ...] | None = None
    if full is not None and not (full.is_floating_point() and full.requires_grad):
        # A mask's batch, query and key axes follow the batch and the sequence lengths: declared
        # symbolic, so one compilation serves every size (a mask that needs a gradient stays
        # static for now).
        shape = tuple(full.shape)
        mask_shape = (
            "B" if shape[0] == q.shape[0] else shape[0],
            shape[1],
            "Sq" if shape[2] == q.shape[2] else shape[2],
            "Sk" if shape[3] == k.shape[2] else shape[3],
        )
        symbolic_key = (q.shape[1:2], q.shape[3], k.shape[1:2], v.shape[3], scale, mask_shape, full.dtype, is_causal)
        if symbolic_key in _sdpa_plans:
            plan_key = symbolic_key
    cached = _sdpa_plans.get(plan_key)
    if cached is not None:
        captured = [] if full is None else [full]
        threads = _threads_for(_attention_flops(q, k, v))
        return _Plan(cached.graph, cached.forward, captured, cached.backward_exe, threads)
    score_mod = mask_mod = None
    if attn_mask is not None and full is not None:  # checked by _sdpa_eager: a CPU tensor, bool or float
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        try:
            torch.broadcast_shapes(attn_mask.shape, target)
        except RuntimeError:
            raise RlxValueError(
                f"scaled_dot_product_attention: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"[B, H, Sq, Sk] = {list(target)}"
            ) from None
        broadcast = tuple(dim == 1 for dim in (mask_shape or full.shape))  # declared 1: read at index 0
        if attn_mask.dtype == torch.bool:
            mask_mod = _indexed(full, broadcast, lambda value, b, h, q_idx, kv_idx: value)
        else:
            combine = lambda value, score, b, h, q_idx, kv_idx: score + value  # noqa: E731
            score_mod = _indexed(full, broadcast, combine, with_score=True)
    if is_causal:  # with a mask as well, both apply (as torch does)
        mask_mod = _mods.causal if mask_mod is None else _mods.and_(mask_mod, _mods.causal)
    declared = None if mask_shape is None else {id(full): mask_shape}
    plan = _plan(q, k, v, score_mod, mask_mod, scale, declared)
    if symbolic_key is not None and not plan.graph.inputs["q"].type.is_static:
        plan_key = symbolic_key
    with _plans_lock:
        _sdpa_plans[plan_key] = plan
    return plan


@dataclass
class _FixedPlan:
    """SDPA without a mask tensor, on the fixed-mask kernels: compiled once for every sequence length.

    The graphs declare the sequence lengths as symbolic dimensions (``"Sq"``/``"Sk"``, or one
    ``"S"`` when causal), so a decode loop whose KV cache grows by a token a step, or training on
    batches of varying length, reuses one compilation. Calls below :data:`SMALL_ATTENTION_FLOPS`
    run on one thread of the same build (:func:`_threads_for`).

    ``layout`` is how the graphs take q, k and v (see :func:`_strided_layout`): ``"bhsd"``
    contiguous tensors (strided ones copied), ``"bshd"`` each the transpose of a contiguous
    ``[B, S, H, D]`` tensor (separate projections viewed as heads), ``"qkv"`` three slices of
    one fused projection ``[B, S, 3·H·D]``, whose strided views the kernels read in place. The
    last two return ``out`` and the gradients as torch's kernel does for such inputs: transposes
    of ``[B, S, H, D]`` tensors.
    """

    forward_graph: Graph
    backward_graph: Graph
    executables: dict[str, Executable]
    layout: str = "bhsd"
    is_causal: bool = False
    scale: float | None = None
    differentiable: CompiledGraph | None = None  # backward_graph through rt.compile (create_graph=True)

    def executable(self, which: str) -> Executable:
        exe = self.executables.get(which)
        if exe is None:
            exe = rlx.compile(self.forward_graph if which == "forward" else self.backward_graph)
            with _plans_lock:
                exe = self.executables.setdefault(which, exe)
        return exe


_fixed_plans: dict[tuple[Any, ...], _FixedPlan] = {}


def _fixed_plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None, layout: str = "bhsd"
) -> _FixedPlan | None:
    """The plan for SDPA on the fixed-mask kernels, or None where they cannot express the call.

    They align a causal mask bottom-right; torch's ``is_causal`` is top-left, the same only when
    ``Sq == Sk``. Causal calls with ``Sq != Sk`` take the programmable-attention path (compiled
    per shape), as do calls with an ``attn_mask``. ``layout``: see :class:`_FixedPlan`.
    """
    _, heads, seq_q, dim = q.shape
    kv_heads, seq_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    if is_causal and seq_q != seq_k:
        return None
    # The kernels scale scores by 1/sqrt(D); another scale multiplies q first (in the graph, so
    # its gradient follows).
    factor = 1.0 if scale is None else float(scale) * math.sqrt(dim)
    # A model's own 1/sqrt(D) (transformers passes scale=head_dim**-0.5) can miss 1.0 by an ulp
    # of float64 (D = 32, 48, 96, 112, 128): q times its float32, which is 1.0, is q itself, so
    # that call needs no product in the graph (a kernel, and no by-address inference path).
    if np.float32(factor) == np.float32(1.0):
        factor = 1.0
    key = (heads, kv_heads, dim, value_dim, is_causal, factor, layout)
    plan = _fixed_plans.get(key)
    if plan is None:
        # The batch and the lengths are symbolic: a smaller last batch, or a decode batch that
        # shrinks as sequences finish, runs on the same machine code.
        sq, sk = ("S", "S") if is_causal else ("Sq", "Sk")
        mask = rlx.MaskKind.CAUSAL if is_causal else rlx.MaskKind.NONE
        forward = Graph("sdpa")
        if layout == "qkv":  # q, k and v slices of one tensor: one length
            sq = sk = "S"
        shapes = ("B", heads, sq, dim), ("B", kv_heads, sk, dim), ("B", kv_heads, sk, value_dim)
        qi, ki, vi = _layout_inputs(forward, layout, *shapes)
        scaled = qi if factor == 1.0 else qi * factor
        kernel_layout = Layout.BHSD if layout == "bhsd" else Layout.BSHD
        forward.output(out=forward.attention(scaled, ki, vi, mask=mask, layout=kernel_layout))
        backward = forward.copy()
        out = backward.outputs["out"]
        if layout == "qkv":  # the gradients of the three views, not of the fused tensor
            reads = next(node.inputs[:3] for node in backward.nodes if node.op is rlx.OpKind.ATTENTION)
            qb, kb, vb = (reads[0].node.inputs[0] if factor != 1.0 else reads[0]), reads[1], reads[2]
        else:
            qb, kb, vb = (backward.inputs[name] for name in "qkv")
        backward.remove_output("out")
        dq, dk, dv = rlx.grad(backward, out, [qb, kb, vb], backward.input("dy", out.shape))
        backward.output(dq=dq, dk=dk, dv=dv)
        plan = _FixedPlan(forward, backward, {}, layout, is_causal, scale)
        with _plans_lock:
            plan = _fixed_plans.setdefault(key, plan)
    return plan


def _fixed_forward(plan: _FixedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on the fixed-mask kernels: through autograd only when a gradient can be asked for.

    A call that autograd would not record (no input requires grad, or grad mode is off: decoding)
    skips ``autograd.Function``, whose bookkeeping cost as much as a small call's kernel.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FixedFunction.apply(plan, q, k, v)  # type: ignore[no-any-return]
    return _fixed_out(plan, q, k, v, _attention_flops(q, k, v))


def _fixed_out(
    plan: _FixedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flops: float, direct: bool = False
) -> torch.Tensor:
    """The fixed-mask forward kernel's ``out``, in the query's dtype.

    Float32 tensors go to native code by address (strided ones copied contiguous first;
    ``direct``: the caller has checked them with :func:`_direct`), and ``out`` is a new torch
    tensor it writes into (:meth:`Executable.run_direct`): no NumPy array in or out, which cost
    a decode step (one query, 1-1000 keys) a sixth of its time once the growing KV cache had
    pushed the Python objects those arrays touch out of the caches.
    """
    exe, threads = plan.executables.get("forward") or plan.executable("forward"), _threads_for(flops)
    if plan.layout != "bhsd":
        return _strided_out(plan, exe, q, k, v, threads)
    dense = [q, k, v] if direct else _dense(q, k, v)
    if dense is not None:
        out = _written((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))
        inputs = [(t.data_ptr(), t.shape) for t in dense]  # torch.Size: tuples
        if exe.run_direct(inputs, {"out": (out.data_ptr(), out.shape)}, threads):
            return out
    arrays = {"q": _array(q), "k": _array(k), "v": _array(v)}
    result = exe.run(arrays, threads)
    return _tensor(result["out"], q.dtype)


def _strided_out(
    plan: _FixedPlan, exe: Executable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threads: int | None
) -> torch.Tensor:
    """``out`` of a ``"bshd"`` or ``"qkv"`` plan: written as ``[B, S, H, Dv]``, returned as its
    ``[B, H, S, Dv]`` transpose (as torch's kernel returns it for such inputs)."""
    inputs = _layout_tensors(plan.layout, q, k, v)
    out = _written((q.shape[0], q.shape[2], q.shape[1], v.shape[3]))
    if not exe.run_direct([(t.data_ptr(), t.shape) for t in inputs], {"out": (out.data_ptr(), out.shape)}, threads):
        out = torch.from_numpy(exe.run(_named_arrays(plan, inputs), threads)["out"])
    return out.transpose(1, 2)


def _named_arrays(plan: _FixedPlan, inputs: list[torch.Tensor]) -> dict[str, np.ndarray]:
    """A strided plan's inputs by their graph names, as NumPy views (the path a program that
    takes more than addresses runs on)."""
    names = _layout_names(plan.layout)
    return {name: _array(t) for name, t in zip([*names, "dy"], inputs, strict=False)}


class _FixedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _FixedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        flops = _attention_flops(q, k, v)
        ctx.plan, ctx.flops = plan, flops
        ctx.save_for_backward(q, k, v)
        ctx.set_materialize_grads(False)
        return _fixed_out(plan, q, k, v, flops)

    @staticmethod
    def _differentiable_backward(ctx: Any, d_out: torch.Tensor | None) -> Any:
        """The gradients as a torch function of q, k, v and d_out (``create_graph=True``)."""
        q, k, v = ctx.saved_tensors
        if d_out is None:
            return None, None, None, None
        plan: _FixedPlan = ctx.plan
        # A graph on [B, H, S, D] tensors, or on their transposes: views that autograd follows.
        layout = "bhsd" if plan.layout == "bhsd" else "bshd"
        graphs = _fixed_plan(q, k, v, plan.is_causal, plan.scale, layout)
        assert graphs is not None, "the forward took the fixed-mask kernels"
        if graphs.differentiable is None:
            graphs.differentiable = compile_graph_function(graphs.backward_graph)
        tensors = [_float(t) for t in (q, k, v, d_out)]
        if layout == "bshd":
            tensors = [t.transpose(1, 2) for t in tensors]
        grads = graphs.differentiable(**dict(zip(("q", "k", "v", "dy"), tensors, strict=True)))
        result: list[torch.Tensor | None] = [None]
        for name, t, need in zip(("dq", "dk", "dv"), (q, k, v), ctx.needs_input_grad[1:], strict=True):
            grad = grads[name].transpose(1, 2) if layout == "bshd" else grads[name]
            result.append(grad.to(t.dtype) if need else None)
        return tuple(result)

    @staticmethod
    @_twice_differentiable(_differentiable_backward)
    def backward(ctx: Any, d_out: torch.Tensor | None) -> Any:
        q, k, v = ctx.saved_tensors
        if d_out is None:
            return None, None, None, None
        grads = _fixed_grads(ctx.plan, q, k, v, d_out, ctx.flops)
        return (None, *(grad if need else None for grad, need in zip(grads, ctx.needs_input_grad[1:], strict=True)))


def _fixed_grads(
    plan: _FixedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor, flops: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv from the fixed-mask backward kernel, each in its input's dtype (``flops``: the
    forward's, which pick the thread count). Contiguous float32 tensors go to native code by
    address and the gradients are new torch tensors it writes (as :func:`_fixed_out` does)."""
    exe, threads = plan.executables.get("backward") or plan.executable("backward"), _threads_for(2.5 * flops)
    if plan.layout != "bhsd":
        # The gradient of a transposed out: [B, S, H, Dv] again (each step a no-op where it is).
        dy = d_out.transpose(1, 2).float().resolve_neg().contiguous()
        tensors = [*_layout_tensors(plan.layout, q, k, v), dy]
        rows = [_written((t.shape[0], t.shape[2], t.shape[1], t.shape[3])) for t in (q, k, v)]
        outputs = {f"d{n}": (g.data_ptr(), g.shape) for n, g in zip("qkv", rows, strict=True)}
        if not exe.run_direct([(t.data_ptr(), t.shape) for t in tensors], outputs, threads):
            grads = exe.run(_named_arrays(plan, tensors), threads)
            rows = [torch.from_numpy(grads[f"d{n}"]) for n in "qkv"]
        return rows[0].transpose(1, 2), rows[1].transpose(1, 2), rows[2].transpose(1, 2)
    dense = _dense(q, k, v, d_out)  # strided views (a split projection, a transpose's gradient) copied
    if dense is not None:
        written = [_written(t.shape) for t in (q, k, v)]
        inputs = [(t.data_ptr(), t.shape) for t in dense]
        outputs = {f"d{n}": (g.data_ptr(), g.shape) for n, g in zip("qkv", written, strict=True)}
        if exe.run_direct(inputs, outputs, threads):
            return written[0], written[1], written[2]
    arrays = {"q": _array(q), "k": _array(k), "v": _array(v), "dy": _array(d_out)}
    grads = exe.run(arrays, threads)
    dq, dk, dv = (_tensor(grads[f"d{n}"], t.dtype) for n, t in zip("qkv", (q, k, v), strict=True))
    return dq, dk, dv


def _indexed(
    mask: torch.Tensor, broadcast: tuple[bool, ...], combine: Callable[..., Any], with_score: bool = False
) -> Callable[..., Any]:
    """A mod reading ``mask[b, h, q_idx, kv_idx]``, with 0 on the dims it broadcasts over
    (``broadcast``: the plan declares the axis 1). An axis of size 1 that the plan declares as
    its dimension (a mask of one key for a call of one key) is indexed by the symbol: the plan
    serves the next call, of more keys, too."""

    def pick(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        index = tuple(0 if one else sym for one, sym in zip(broadcast, (b, h, q_idx, kv_idx), strict=True))
        if all(broadcast):
            # Indexed by numbers only, torch would read the value now and the trace would bake it
            # in, while SDPA's plans are reused for every mask of this shape: index by a symbol.
            index = (b * 0, *index[1:])
        return mask[index]

    if with_score:
        return lambda score, b, h, q_idx, kv_idx: combine(pick(b, h, q_idx, kv_idx), score, b, h, q_idx, kv_idx)
    return lambda b, h, q_idx, kv_idx: combine(pick(b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)
