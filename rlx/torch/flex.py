"""``rlx.torch.flex_attention``: torch's flex_attention on rlx's programmable-attention kernels,
with a CPU backward; the plans (traced graph, forward and backwards) cached by graph."""

from __future__ import annotations

import functools
import numbers
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

import rlx
from rlx.codegen.executable import CallLayout, DirectRunner, Executable
from rlx.errors import RlxError, RlxTypeError, RlxValueError
from rlx.ir.graph import Graph
from rlx.ir.types import Layout, Wrt
from rlx.torch._autograd import _eager_under_torch_compile, _twice_differentiable
from rlx.torch._capture import _Capture, _capturing
from rlx.torch._fingerprint import mod_key
from rlx.torch._layouts import _layout_inputs, _layout_names, _layout_tensors, _strided_layout
from rlx.torch._tensors import _array, _check_tensor, _direct, _float, _tensor, _written
from rlx.torch.graphs import CompiledGraph
from rlx.torch.graphs import compile as compile_graph_function
from rlx.torch.threads import _attention_flops, _threads_for


@dataclass
class _Plan:
    """A traced and compiled attention call: its forward and (built on first use) its backward."""

    graph: Graph
    forward: Executable
    captured: list[torch.Tensor]
    backward_exe: dict[tuple[bool, bool], Executable]
    threads: int | None = None  # this call's thread cap (see _threads_for)
    layout: str = "bhsd"  # how the graphs take q, k and v (rlx.torch._layouts)
    # The backward graphs on q, k, v as [B, H, S, D] tensors or their transposes, through
    # rt.compile: what create_graph=True runs, differentiable again.
    differentiable: dict[tuple[bool, bool], CompiledGraph] = field(default_factory=dict)

    def backward(self, tensor_grads: bool, lse_grad: bool) -> Executable:
        key = (tensor_grads, lse_grad)
        if key not in self.backward_exe:
            self.backward_exe[key] = rlx.compile(_backward_graph(self.graph, self.layout, tensor_grads, lse_grad))
        return self.backward_exe[key]

    def differentiable_backward(self, tensor_grads: bool, lse_grad: bool) -> CompiledGraph:
        key = (tensor_grads, lse_grad)
        if key not in self.differentiable:
            layout = "bhsd" if self.layout == "bhsd" else "bshd"
            self.differentiable[key] = compile_graph_function(
                _backward_graph(self.graph, layout, tensor_grads, lse_grad)
            )
        return self.differentiable[key]


def _backward_graph(forward: Graph, layout: str, tensor_grads: bool, lse_grad: bool) -> Graph:
    """q, k, v (as ``layout`` takes them), out, dy, lse, [dlse], captured -> dq, dk, dv and the
    captured float tensors' gradients."""
    node = forward.outputs["out"].node
    attrs = node.attrs
    g = Graph("flex_bwd")
    shapes = []  # torch's [B, H, S, D] order, from the operands in the kernel's layout
    for value in node.inputs[:3]:
        batch, seq, heads, width = attrs.layout.split(value.shape)
        shapes.append((batch, heads, seq, width))
    q, k, v = _layout_inputs(g, layout, *shapes)
    out = g.input("out", forward.outputs["out"].shape)
    dy = g.input("dy", out.shape)
    lse = g.input("lse", forward.outputs["lse"].shape)
    dlse = (g.input("dlse", lse.shape),) if lse_grad else ()
    captured = [g.input(value.node.attrs.name, value.shape, dtype=value.dtype) for value in node.inputs[3:]]
    outputs = g.flex_attention_bwd(
        q, k, v, out, dy, lse, *dlse, *captured,
        wrt=Wrt.ALL, tensor_grads=tensor_grads, lse_grad=lse_grad,
        score_mod=attrs.score_mod, mask_mod=attrs.mask_mod, scale=attrs.scale, layout=attrs.layout,
    )  # fmt: skip
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    g.output(dq=outputs[0], dk=outputs[1], dv=outputs[2])
    if tensor_grads:
        from rlx.ops.flex_attention import flex_dims, tensor_grad_layout

        dims = flex_dims("rlx.torch", q.type, k.type, v.type, attrs.layout)
        partials = tensor_grad_layout(attrs.score_mod, [c.type for c in captured], dims)
        for (tensor, _, _, _), partial in zip(partials, outputs[3:], strict=True):
            g.output(**{f"d{captured[tensor].node.attrs.name}": g.sum(partial, axis=0)})
    return g


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | None,
    scale: float | None,
    declared: dict[int, tuple[int | str, ...]] | None = None,
    layout: str = "bhsd",
) -> _Plan:
    """Trace the mods and find (or compile) the plan. The batch and the sequence lengths are
    symbolic, so one compilation serves every size, unless the mods need them static (they use
    the lengths themselves): then the graph has this call's sizes. Captured tensors keep their
    own shapes (an SDPA mask's sequence axes excepted, see ``declared``). ``layout``: how the
    graphs take q, k and v (:mod:`rlx.torch._layouts`)."""
    threads = _threads_for(_attention_flops(q, k, v))
    try:
        graph, captured = _flex_graph(q, k, v, score_mod, mask_mod, scale, True, declared, layout)
    except RlxError:
        graph, captured = _flex_graph(q, k, v, score_mod, mask_mod, scale, False, None, layout)
    return _plan_cache(graph, captured, threads, layout)


def _flex_graph(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | None,
    scale: float | None,
    symbolic: bool,
    declared: dict[int, tuple[int | str, ...]] | None = None,
    layout: str = "bhsd",
) -> tuple[Graph, list[torch.Tensor]]:
    g = Graph("flex")
    batch, seq_q, seq_k = ("B", "Sq", "Sk") if symbolic else (q.shape[0], q.shape[2], k.shape[2])
    if symbolic and layout == "qkv":  # slices of one tensor: one length
        seq_q = seq_k = "S"
    shapes = [(batch, t.shape[1], seq, t.shape[3]) for t, seq in ((q, seq_q), (k, seq_k), (v, seq_k))]
    qi, ki, vi = _layout_inputs(g, layout, *shapes)
    capture = _Capture(g, declared if symbolic else None)
    _capturing.current = capture
    kernel_layout = Layout.BHSD if layout == "bhsd" else Layout.BSHD
    try:
        out, lse = g.attention(
            qi, ki, vi, score_mod=score_mod, mask_mod=mask_mod, scale=scale, layout=kernel_layout, return_lse=True
        )
    finally:
        _capturing.current = None
    g.output(out=out, lse=lse)
    return g, capture.tensors


_plans: dict[str, tuple[Executable, dict[tuple[bool, bool], Executable]]] = {}

TRACES_KEPT = 32  # flex_attention calls' traces kept for reuse
_traces: OrderedDict[Hashable, _Trace] = OrderedDict()

_plans_lock = threading.Lock()


@dataclass(frozen=True)
class _Trace:
    """A kept trace: its plan without captured tensors, weak references to them (their shapes
    and dtypes are in the mods' key), and whether the graph has one call's sizes (mods that
    read the lengths), which then are part of its key."""

    plan: _Plan
    refs: list[weakref.ref[torch.Tensor]]
    sized: bool


def _traced_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | None,
    scale: float | None,
    layout: str,
) -> _Plan:
    """:func:`_plan`, reusing the trace of an earlier call whose mods read the same things
    (:mod:`rlx.torch._fingerprint`): a training loop traces its mods once. Mods without a key
    (one reads an object's attribute, say) are traced on every call.

    A trace whose graph has symbolic batch and lengths (the usual one) serves calls of any
    batch and lengths: it is kept under the heads, head dims and dtypes, so a decode loop,
    whose key length grows every step, traces once (it traced every step, ~0.5 ms a call). A
    trace made for one call's sizes is kept under them too.
    """
    mods = (mod_key(score_mod), mod_key(mask_mod))
    if mods[0] is None or mods[1] is None:
        return _plan(q, k, v, score_mod, mask_mod, scale, layout=layout)
    qs, ks, vs = q.shape, k.shape, v.shape
    key: tuple[Any, ...] = (mods, qs[1], qs[3], ks[1], ks[3], vs[1], vs[3], q.dtype, k.dtype, v.dtype, scale, layout)
    with _plans_lock:
        found = _traces.get(key)
        if found is not None:
            _traces.move_to_end(key)
            if found.sized:
                found = _traces.get((*key, qs, ks, vs))
    if found is not None:
        captured = [tensor for tensor in (ref() for ref in found.refs) if tensor is not None]
        if len(captured) == len(found.refs):  # all alive; the thread cap as this call gets it
            kept = found.plan  # a new _Plan, not dataclasses.replace: a decode step's microseconds
            threads = _threads_for(_attention_flops(q, k, v))
            return _Plan(kept.graph, kept.forward, captured, kept.backward_exe, threads, kept.layout)
    plan = _plan(q, k, v, score_mod, mask_mod, scale, layout=layout)
    # Kept without its captured tensors (weak references): a kept trace never keeps a tensor's
    # memory alive, so a mod indexing a new large tensor every call costs no memory.
    refs = [weakref.ref(t) for t in plan.captured]
    sized = all(isinstance(dim, int) for dim in plan.graph.inputs[_layout_names(layout)[0]].shape)
    trace = _Trace(replace(plan, captured=[]), refs, sized)
    with _plans_lock:
        _traces[key] = trace
        if sized:
            _traces[(*key, qs, ks, vs)] = trace
        while len(_traces) > TRACES_KEPT:
            _traces.popitem(last=False)
    return plan


def _plan_cache(graph: Graph, captured: list[torch.Tensor], threads: int | None, layout: str = "bhsd") -> _Plan:
    """One forward and its backwards per distinct traced graph (shapes, dtypes, mods, layout)."""
    key = str(graph)
    with _plans_lock:
        found = _plans.get(key)
    if found is None:
        found = (rlx.compile(graph), {})
        with _plans_lock:
            _plans[key] = found
    return _Plan(graph, found[0], captured, found[1], threads, layout)


def _attention_arrays(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    captured: Sequence[torch.Tensor],
    layout: str = "bhsd",
    **more: torch.Tensor,
) -> dict[str, np.ndarray]:
    """An attention plan's graph inputs by name: q, k, v (as ``layout`` takes them), the captured
    tensors (``c0``, ``c1``, ...) and ``more`` (the backward's ``out``, ``lse``, ``dy``)."""
    tensors = _layout_tensors(layout, q, k, v)
    arrays = {name: _array(t) for name, t in zip(_layout_names(layout), tensors, strict=True)}
    arrays |= {f"c{i}": _array(t) for i, t in enumerate(captured)}
    return arrays | {name: _array(t) for name, t in more.items()}


def _forward_arrays(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, captured: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``out`` (in the query's dtype, as torch lays it out), ``lse`` and ``out`` in float32."""
    result = plan.forward.run(_attention_arrays(q, k, v, captured, plan.layout), plan.threads)
    out = _tensor(result["out"], q.dtype)
    if plan.layout != "bhsd":  # written [B, S, H, Dv]: its transpose, as torch returns it
        out = out.transpose(1, 2)
    return out, torch.from_numpy(result["lse"]), result["out"]


def _forward_by_address(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``out`` and ``lse`` of a call autograd does not record, the kernel reading the tensors'
    memory and writing into new tensors (:class:`DirectRunner`), or None where it cannot: a
    layout other than contiguous ``[B, H, S, D]``, a tensor of another dtype than the graph
    declares or not dense (:func:`_direct`), a graph whose call needs more than addresses
    (index checks, a block map the call reads). No NumPy array in or out, no autograd
    ``Function``: in a decode loop those cost more than a short call's kernel."""
    runner = plan.forward.direct_runner if plan.layout == "bhsd" else None
    if runner is None or runner.outputs not in (("out", "lse"), ("lse", "out")):
        return None
    tensors = [q, k, v, *plan.captured]
    if runner.inputs != _input_names(len(plan.captured)):
        return None
    for t, dtype in zip(tensors, runner.dtypes, strict=True):
        wanted = _TORCH_DTYPES.get(dtype)
        if wanted is None or not _direct(t, dtype=wanted):
            return None
    layout = runner.layout([t.shape for t in tensors])
    if layout is None:
        return None
    outputs = _run_by_address(runner, layout, tensors, plan.threads)
    return outputs["out"], outputs["lse"]


def _run_by_address(
    runner: DirectRunner, layout: CallLayout, tensors: Sequence[torch.Tensor], threads: int | None
) -> dict[str, torch.Tensor]:
    """Run ``runner`` on the memory of its input ``tensors`` (checked by the caller) into new
    tensors, one per output (:func:`_written`)."""
    outputs = {name: _written(shape) for name, shape in zip(runner.outputs, runner.output_shapes(layout), strict=True)}
    runner(layout, [t.data_ptr() for t in tensors] + [outputs[name].data_ptr() for name in runner.outputs], threads)
    return outputs


_TORCH_DTYPES = {np.dtype(name): getattr(torch, name) for name in ("float32", "int32", "int64", "bool")}


@functools.cache
def _input_names(captured: int) -> tuple[str, ...]:
    """A ``"bhsd"`` plan's graph inputs, in declaration order (:func:`_attention_arrays`)."""
    return ("q", "k", "v", *(f"c{i}" for i in range(captured)))


def _flex_forward(plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``lse`` of a plan's forward: through autograd where it records the call, else
    (inference, a decode loop) by address where the call allows, else through arrays."""
    tensors = (q, k, v, *plan.captured)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        out, lse = _FlexFunction.apply(plan, *tensors)
        return out, lse
    found = _forward_by_address(plan, q, k, v)
    return found if found is not None else _forward_arrays(plan, q, k, v, plan.captured)[:2]


class _FlexFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *captured: torch.Tensor
    ) -> Any:
        out, lse, float_out = _forward_arrays(plan, q, k, v, captured)
        ctx.plan = plan
        # Saved as tensors, so torch refuses a backward after any of them was modified in place.
        ctx.save_for_backward(q, k, v, out, lse, *captured)
        ctx.float_out = float_out  # out in float32 (``out`` itself may be bf16/f16)
        ctx.dtypes = [t.dtype for t in (q, k, v, *captured)]
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def _differentiable_backward(ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None) -> Any:
        """The gradients as a torch function of q, k, v, d_out, d_lse and the captured tensors
        (``create_graph=True``). The saved ``out`` and ``lse`` go in detached: the rule of the
        graph's backward recomputes them (``rlx.ops.attention_second_order``)."""
        plan: _Plan = ctx.plan
        needs = ctx.needs_input_grad[1:]
        float_captured = [i for i, t in enumerate(plan.captured) if t.is_floating_point()]
        tensor_grads = any(needs[3 + i] for i in float_captured)
        q, k, v, out, lse, *captured = ctx.saved_tensors
        transposed = plan.layout != "bhsd"  # then the graph takes [B, S, H, D] tensors
        heads = [_float(t) for t in (q, k, v)]
        dy = _float(d_out) if d_out is not None else torch.zeros(out.shape, dtype=torch.float32)
        if transposed:
            heads, dy = [t.transpose(1, 2) for t in heads], dy.transpose(1, 2)
        # out in float32 as the graph laid it out ([B, S, H, Dv] for a transposed plan)
        tensors = {"out": torch.from_numpy(ctx.float_out), "dy": dy, "lse": lse.detach()}
        tensors.update(zip(("q", "k", "v"), heads, strict=True))
        if d_lse is not None:
            tensors["dlse"] = d_lse
        tensors.update({f"c{i}": _float(t) if t.is_floating_point() else t for i, t in enumerate(captured)})
        function = plan.differentiable_backward(tensor_grads, d_lse is not None)
        grads = function(**{name: tensors[name] for name in function.names})
        dtypes = ctx.dtypes
        result: list[torch.Tensor | None] = [None]
        for i, name in enumerate(("dq", "dk", "dv")):
            grad = grads[name].transpose(1, 2) if transposed else grads[name]
            result.append(grad.to(dtypes[i]) if needs[i] else None)
        for i in range(len(plan.captured)):
            key = f"dc{i}"
            result.append(grads[key].to(dtypes[3 + i]) if needs[3 + i] and key in grads else None)
        return tuple(result)

    @staticmethod
    @_twice_differentiable(_differentiable_backward)
    def backward(ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None) -> Any:
        plan: _Plan = ctx.plan
        needs = ctx.needs_input_grad[1:]
        float_captured = [i for i, t in enumerate(plan.captured) if t.is_floating_point()]
        tensor_grads = any(needs[3 + i] for i in float_captured)
        q, k, v, out, lse, *captured = ctx.saved_tensors
        arrays = _attention_arrays(q, k, v, captured, plan.layout, lse=lse)
        transposed = plan.layout != "bhsd"  # the graph's out, dy and gradients are [B, S, H, D]
        if transposed:
            out = out.transpose(1, 2)
            d_out = d_out.transpose(1, 2) if d_out is not None else None
        arrays["out"] = _array(out) if out.dtype == torch.float32 else ctx.float_out
        arrays["dy"] = _array(d_out) if d_out is not None else np.zeros_like(arrays["out"])
        lse_grad = d_lse is not None
        if d_lse is not None:
            arrays["dlse"] = _array(d_lse)
        exe = plan.backward(tensor_grads, lse_grad)
        grads = exe.run({name: arrays[name] for name in exe.graph.inputs}, plan.threads)
        dtypes = ctx.dtypes
        result: list[torch.Tensor | None] = [None]
        for i, name in enumerate(("dq", "dk", "dv")):
            grad = _tensor(grads[name], dtypes[i]) if needs[i] else None
            result.append(grad.transpose(1, 2) if grad is not None and transposed else grad)
        for i in range(len(plan.captured)):
            key = f"dc{i}"
            wanted = needs[3 + i] and key in grads
            result.append(_tensor(grads[key], dtypes[3 + i]) if wanted else None)
        return tuple(result)


def _check_scale(scale: object, where: str) -> float | None:
    """``scale`` as a float (None stays None); anything but a real number is an RlxTypeError."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise RlxTypeError(f"{where}: scale must be a number (or None for 1/sqrt(D)), got {type(scale).__name__}")
    return float(scale)


@_eager_under_torch_compile
def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    *,
    block_mask: Any = None,
    return_aux: Any = None,
) -> Any:
    """torch's ``flex_attention`` on CPU, forward and backward: ``[B, H, S, D]`` tensors.

    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` are written as
    for torch. A torch ``BlockMask`` is accepted for its ``mask_mod``, as ``block_mask=`` or in
    the fifth place, where torch's signature has it, so calls written for torch run unchanged.
    ``kernel_options`` tune torch's kernels and do not change results; rlx accepts and ignores
    them. ``return_aux=AuxRequest(lse=True)`` returns ``(out, AuxOutput(lse=...))`` as torch does.
    Differentiable w.r.t. query, key, value and float tensors the score_mod captures.
    """
    q = _check_tensor(query, "query")
    k = _check_tensor(key, "key")
    v = _check_tensor(value, "value")
    scale = _check_scale(scale, "flex_attention")
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.ndim != 4:
            raise RlxValueError(f"flex_attention: {name} must be [B, H, S, D], got shape {tuple(t.shape)}")
    if k.shape[1] != q.shape[1] and not enable_gqa:
        raise RlxValueError(
            f"flex_attention: query has {q.shape[1]} heads and key {k.shape[1]}; pass enable_gqa=True for GQA"
        )
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise RlxTypeError(f"flex_attention: kernel_options must be a dict, got {type(kernel_options).__name__}")
    if _is_block_mask(mask_mod):  # torch's fifth parameter is block_mask
        if block_mask is not None:
            raise RlxValueError("flex_attention: block_mask given twice (in the fifth place and by name)")
        mask_mod, block_mask = None, mask_mod
    if block_mask is not None:
        if mask_mod is not None:
            raise RlxValueError("flex_attention: give mask_mod or block_mask, not both")
        mask_mod = getattr(block_mask, "mask_mod", None)
        if mask_mod is None:
            raise RlxTypeError("flex_attention: block_mask must be a torch BlockMask (with a mask_mod)")
    want_lse = return_lse
    if return_aux is not None:
        if return_lse:
            raise RlxValueError("flex_attention: give return_lse or return_aux, not both (as torch)")
        if getattr(return_aux, "max_scores", False):
            raise RlxValueError(
                "flex_attention: return_aux asks for max_scores, which rlx does not compute; ask for lse only"
            )
        want_lse = bool(getattr(return_aux, "lse", False))
    plan = _traced_plan(q, k, v, score_mod, mask_mod, scale, _strided_layout(q, k, v))
    out, lse = _flex_forward(plan, q, k, v)
    if return_aux is not None:
        return out, _aux_output(lse if want_lse else None)
    return (out, lse) if return_lse else out


def _is_block_mask(candidate: object) -> bool:
    """Is ``candidate`` a torch ``BlockMask`` (passed where rlx's signature has ``mask_mod``)?"""
    return type(candidate).__name__ == "BlockMask" and hasattr(candidate, "mask_mod")


def _aux_output(lse: torch.Tensor | None) -> Any:
    """torch's ``AuxOutput(lse=..., max_scores=None)``: a torch that has ``return_aux`` has it."""
    from torch.nn.attention.flex_attention import AuxOutput

    return AuxOutput(lse=lse, max_scores=None)
