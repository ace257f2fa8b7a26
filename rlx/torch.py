"""rlx from PyTorch (SPEC section 5): drop-in SDPA and flex_attention with a CPU backward, graphs as torch functions.

``import rlx.torch as rt``::

    o = rt.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False)
    o = rt.flex_attention(q, k, v, score_mod=None, mask_mod=None, scale=None, enable_gqa=False, return_lse=False)
    f = rt.compile(g)          # f(**tensors) -> dict of tensors, differentiable

Tensors are torch's ``[B, H, S, D]`` (rlx's ``Layout.BHSD``), so nothing is re-laid out.
Contiguous float32 CPU tensors go in and come out without a copy (NumPy views of the same
memory); float16 and bfloat16 are computed in float32 and returned in the input dtype. Mods
written for torch's flex_attention run unchanged: ``torch.where``, ``torch.tanh``, comparisons
and captured tensors indexed by the symbols are traced into rlx regions (tensors they capture
become graph inputs, so a learnable bias gets its gradient). Compiled code is cached by shapes,
dtypes and the traced mods (``rlx.compile``'s cache, keyed by the printed graph): a second call
with the same shapes compiles nothing.

torch is an optional dependency (``pip install "rlx[torch]"``); ``import rlx`` never imports it.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError('rlx.torch needs PyTorch: pip install "rlx[torch]"') from exc

import rlx
import rlx.mods as _mods
from rlx.codegen.executable import Executable
from rlx.codegen.pool import openmp_in_use, use_openmp
from rlx.errors import RlxError, RlxTypeError, RlxValueError
from rlx.ir.graph import Graph, Value
from rlx.ir.ops import OpKind
from rlx.ir.types import Layout, Wrt, is_symbol

__all__ = ["compile", "flex_attention", "scaled_dot_product_attention"]

_COMPUTED = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- tensors <-> arrays


def _check_tensor(tensor: object, name: str, kinds: str = "float") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise RlxTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:  # (tensor.device.type costs 0.4 us a call; this, 0.07)
        raise RlxTypeError(f"{name} is on device {tensor.device}; rlx runs on the CPU (move it with .cpu())")
    if kinds == "float" and tensor.dtype not in _COMPUTED:
        raise RlxTypeError(f"{name} has dtype {tensor.dtype}; rlx.torch takes float32, float16 or bfloat16")
    return tensor


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A float32 (or int/bool) NumPy view of a CPU tensor: no copy when it is contiguous float32."""
    x = tensor.detach() if tensor.requires_grad else tensor
    if x.dtype == torch.float32:
        pass  # the common case: each call below costs a microsecond even when it does nothing
    elif x.is_floating_point():
        x = x.float()  # half precisions are computed in float32
    elif x.dtype not in (torch.int32, torch.int64, torch.bool):
        x = x.to(torch.int64)  # int8/int16/uint8 index tensors
    return (x if x.is_contiguous() else x.contiguous()).numpy()


def _tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    out = torch.from_numpy(array)
    return out if dtype == torch.float32 else out.to(dtype)


def _rlx_dtype(tensor: torch.Tensor) -> str:
    if tensor.is_floating_point():
        return "float32"
    if tensor.dtype == torch.bool:
        return "bool"
    return "int32" if tensor.dtype == torch.int32 else "int64"


# ----------------------------------------------------------------------------- torch mods -> regions


class _Capture:
    """The torch tensors one trace captured, each a graph input named ``c0``, ``c1``, ..."""

    def __init__(self, graph: Graph, declared: dict[int, tuple[int | str, ...]] | None = None) -> None:
        self.graph = graph
        self.tensors: list[torch.Tensor] = []
        self.values: list[Value] = []
        self.declared = declared or {}  # id(tensor) -> the shape to declare (symbolic sequence dims)

    def value(self, tensor: torch.Tensor) -> Value:
        for known, value in zip(self.tensors, self.values, strict=True):
            if known is tensor:
                return value
        _check_tensor(tensor, f"a tensor captured by a mod (shape {tuple(tensor.shape)})", kinds="any")
        shape = self.declared.get(id(tensor), tuple(tensor.shape))
        value = self.graph.input(f"c{len(self.tensors)}", shape, dtype=_rlx_dtype(tensor))
        self.tensors.append(tensor)
        self.values.append(value)
        return value


_capturing = threading.local()

_TORCH_TO_RLX: dict[Any, Callable[..., Any]] = {
    torch.where: _mods.where,
    torch.tanh: _mods.tanh,
    torch.exp: _mods.exp,
    torch.log: _mods.log,
    torch.abs: _mods.abs,
    torch.sigmoid: _mods.sigmoid,
    torch.sqrt: _mods.sqrt,
    torch.minimum: _mods.minimum,
    torch.maximum: _mods.maximum,
    torch.Tensor.tanh: _mods.tanh,
    torch.Tensor.exp: _mods.exp,
    torch.Tensor.abs: _mods.abs,
    torch.Tensor.sigmoid: _mods.sigmoid,
    torch.Tensor.log: _mods.log,
    torch.Tensor.sqrt: _mods.sqrt,
    torch.pow: _mods.power,
    torch.Tensor.pow: _mods.power,
    torch.Tensor.__pow__: _mods.power,
    torch.Tensor.__rpow__: lambda exponent, base: _mods.power(base, exponent),
}
_BINARY = {
    torch.Tensor.add: "__add__",
    torch.Tensor.__add__: "__add__",
    torch.Tensor.__radd__: "__radd__",
    torch.Tensor.sub: "__sub__",
    torch.Tensor.__sub__: "__sub__",
    torch.Tensor.__rsub__: "__rsub__",
    torch.Tensor.mul: "__mul__",
    torch.Tensor.__mul__: "__mul__",
    torch.Tensor.__rmul__: "__rmul__",
    torch.Tensor.div: "__truediv__",
    torch.Tensor.__truediv__: "__truediv__",
    torch.Tensor.__rtruediv__: "__rtruediv__",
    torch.Tensor.__eq__: "__eq__",
    torch.Tensor.__ne__: "__ne__",
    torch.Tensor.__lt__: "__lt__",
    torch.Tensor.__le__: "__le__",
    torch.Tensor.__gt__: "__gt__",
    torch.Tensor.__ge__: "__ge__",
    torch.Tensor.__and__: "__and__",
    torch.Tensor.__or__: "__or__",
}


def _clamp(x: Any, min: Any = None, max: Any = None) -> Any:
    if min is not None:
        x = _mods.maximum(x, min)
    if max is not None:
        x = _mods.minimum(x, max)
    return x


def _torch_function(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A torch function called on symbols inside a traced mod, as rlx region steps."""
    if func is torch.Tensor.__getitem__:
        tensor, index = args
        capture: _Capture | None = getattr(_capturing, "current", None)
        if capture is None:
            raise RlxTypeError("a torch tensor indexed by symbols outside rlx.torch's tracing")
        return _mods.read(capture.value(tensor), index)
    if func in _TORCH_TO_RLX:
        return _TORCH_TO_RLX[func](*args, **kwargs)
    if func in (torch.clamp, torch.Tensor.clamp):
        return _clamp(*args, **kwargs)
    if func in _BINARY:
        tensor, other = args
        if isinstance(tensor, torch.Tensor):
            if tensor.ndim != 0:
                raise RlxTypeError(
                    "a mod combined a whole tensor with a symbol; index captured tensors by the symbols "
                    "(bias[b, h, q_idx, kv_idx])"
                )
            tensor = tensor.item()
        if isinstance(other, torch.Tensor) and other.ndim == 0:
            other = other.item()
        name = _BINARY[func]
        if isinstance(tensor, _mods.Sym):
            return getattr(tensor, name)(other)
        swapped = {"__add__": "__radd__", "__mul__": "__rmul__", "__sub__": "__rsub__", "__truediv__": "__rtruediv__"}
        mirrored = {"__lt__": "__gt__", "__le__": "__ge__", "__gt__": "__lt__", "__ge__": "__le__"}
        name = swapped.get(name, mirrored.get(name, name))
        return getattr(other, name)(tensor)
    name = getattr(func, "__name__", repr(func))
    raise RlxTypeError(
        f"torch.{name} cannot be traced inside an attention mod; use +, -, *, /, comparisons, &, |, ~, "
        "torch.where, torch.tanh, torch.exp, torch.log, torch.abs, torch.sigmoid, torch.sqrt, torch.pow, "
        "torch.minimum, torch.maximum, torch.clamp, and captured tensors indexed by the symbols"
    )


_mods.TORCH_HANDLER = _torch_function


# ----------------------------------------------------------------------------- flex attention


@dataclass
class _Plan:
    """A traced and compiled attention call: its forward and (built on first use) its backward."""

    graph: Graph
    forward: Executable
    captured: list[torch.Tensor]
    backward_exe: dict[tuple[bool, bool], Executable]
    threads: int | None = None  # this call's thread cap (see _threads_for)

    def backward(self, tensor_grads: bool, lse_grad: bool) -> Executable:
        key = (tensor_grads, lse_grad)
        if key not in self.backward_exe:
            self.backward_exe[key] = rlx.compile(_backward_graph(self.graph, tensor_grads, lse_grad))
        return self.backward_exe[key]


def _backward_graph(forward: Graph, tensor_grads: bool, lse_grad: bool) -> Graph:
    """q, k, v, out, dy, lse, [dlse], captured -> dq, dk, dv and the captured float tensors' gradients."""
    node = forward.outputs["out"].node
    attrs = node.attrs
    g = Graph("flex_bwd")
    q, k, v = (g.input(name, forward.inputs[name].shape) for name in "qkv")
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
        layout = tensor_grad_layout(attrs.score_mod, [c.type for c in captured], dims)
        for (tensor, _, _, _), partial in zip(layout, outputs[3:], strict=True):
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
) -> _Plan:
    """Trace the mods and find (or compile) the plan. The batch and the sequence lengths are
    symbolic, so one compilation serves every size, unless the mods need them static (they use
    the lengths themselves): then the graph has this call's sizes. Captured tensors keep their
    own shapes (an SDPA mask's sequence axes excepted, see ``declared``)."""
    threads = _threads_for(_attention_flops(q, k, v))
    try:
        graph, captured = _flex_graph(q, k, v, score_mod, mask_mod, scale, symbolic=True, declared=declared)
    except RlxError:
        graph, captured = _flex_graph(q, k, v, score_mod, mask_mod, scale, symbolic=False)
    return _plan_cache(graph, captured, threads)


def _flex_graph(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | None,
    scale: float | None,
    symbolic: bool,
    declared: dict[int, tuple[int | str, ...]] | None = None,
) -> tuple[Graph, list[torch.Tensor]]:
    g = Graph("flex")
    batch, seq_q, seq_k = ("B", "Sq", "Sk") if symbolic else (q.shape[0], q.shape[2], k.shape[2])
    qi = g.input("q", (batch, q.shape[1], seq_q, q.shape[3]))
    ki = g.input("k", (batch, k.shape[1], seq_k, k.shape[3]))
    vi = g.input("v", (batch, v.shape[1], seq_k, v.shape[3]))
    capture = _Capture(g, declared if symbolic else None)
    _capturing.current = capture
    try:
        out, lse = g.attention(
            qi, ki, vi, score_mod=score_mod, mask_mod=mask_mod, scale=scale, layout=Layout.BHSD, return_lse=True
        )
    finally:
        _capturing.current = None
    g.output(out=out, lse=lse)
    return g, capture.tensors


def _loaded_openmp() -> str | None:
    """The path of the GNU OpenMP runtime (libgomp) loaded in this process, if any: torch's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libgomp"):
                    return path
    except OSError:
        pass
    return None


def share_torch_threads(enabled: bool = True) -> bool:
    """Run rlx's multi-threaded calls on torch's OpenMP threads (the default once ``rlx.torch``
    is imported; ``RLX_TORCH_OPENMP=0`` leaves rlx on its own workers). Returns whether it does.

    torch's workers spin for a while after each of its ops; rlx's own workers would wait for the
    cores they hold (an attention call right after a torch op took 21 ms instead of 17 on two
    cores), and a call with little work paid more to start its threads than it gained. On one
    team, a call right after torch's ops finds the workers awake. Each region has torch's team
    size (``torch.get_num_threads()``, at most the executable's threads); when torch runs one
    thread (``OMP_NUM_THREADS=1`` under torchrun) rlx's calls use its own workers.
    """
    library = _loaded_openmp() if enabled and torch.backends.openmp.is_available() else None
    return use_openmp(library)


share_torch_threads(os.environ.get("RLX_TORCH_OPENMP", "").strip() != "0")


_plans: dict[str, tuple[Executable, dict[tuple[bool, bool], Executable]]] = {}
_sdpa_plans: dict[tuple[Any, ...], _Plan] = {}  # SDPA calls by shapes and mask kind: no tracing
_plans_lock = threading.Lock()


SMALL_ATTENTION_FLOPS = 1 << 20
"""Below this many FLOPs an attention call runs on the calling thread (on torch's threads).

Measured with a torch matmul before each call, as in a model, on two cores: from ~1 MFLOP up
two threads win on torch's OpenMP team (B4 H4 S32 D16: 85 us against 95; the char LM's B16
H4 S64 D16: 322 against 539; a decode step against 1000 keys: 127 against 131, 250 keys: 89
against 79).
"""

SMALL_ATTENTION_FLOPS_OWN_WORKERS = 1 << 26
"""The same threshold when rlx runs on its own workers (``RLX_TORCH_OPENMP=0``, or torch without
GNU OpenMP). They compete with torch's workers, which keep spinning after torch's ops: on the
char-LM example two threads made the run 1.5x slower than one, and a decode step 3x slower.
"""


def _threads_for(flops: float) -> int | None:
    """One thread for small attention calls (see :data:`SMALL_ATTENTION_FLOPS`), else all.

    A cap on the call, not a build: one executable serves both, so a decode loop or a batch of
    a new length crossing the threshold compiles nothing.
    """
    small = SMALL_ATTENTION_FLOPS if openmp_in_use() else SMALL_ATTENTION_FLOPS_OWN_WORKERS
    return 1 if flops < small else None


def _plan_cache(graph: Graph, captured: list[torch.Tensor], threads: int | None) -> _Plan:
    """One forward and its backwards per distinct traced graph (shapes, dtypes and mods)."""
    key = str(graph)
    with _plans_lock:
        found = _plans.get(key)
    if found is None:
        found = (rlx.compile(graph), {})
        with _plans_lock:
            _plans[key] = found
    return _Plan(graph, found[0], captured, found[1], threads)


def _eager_under_torch_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as one graph break under ``torch.compile``: it runs as it is, with rlx's compiled
    code and autograd, while torch compiles the code around it.

    Without this, dynamo traced into rlx's Python (NumPy views, ctypes, caches) and broke the
    graph at every one of them, with a warning each: correct, but a screen of warnings and
    seconds of tracing for a model that calls attention once per layer.
    """
    return torch.compiler.disable(fn)  # type: ignore[no-any-return]


class _SecondDerivative(torch.autograd.Function):
    """The node behind gradients made with ``create_graph=True``: differentiating them raises."""

    @staticmethod
    def forward(ctx: Any, *grads: torch.Tensor) -> Any:
        return tuple(grad.clone() for grad in grads)

    @staticmethod
    def backward(ctx: Any, *_: Any) -> Any:
        raise RlxValueError(
            "rlx.torch's attention computes first derivatives only: a gradient of rlx attention made with "
            "create_graph=True cannot be differentiated again (as torch's CPU flash-attention backward cannot)"
        )


def _once_differentiable(backward: Callable[..., Any]) -> Callable[..., Any]:
    """An ``autograd.Function.backward`` that runs outside autograd, whose gradients raise when
    differentiated again.

    Like torch's ``once_differentiable``, except that the error does not depend on the incoming
    gradients requiring grad: with ``create_graph=True`` on ``loss.sum()`` they do not, and torch's
    decorator then hands back plain tensors, so a gradient penalty built on them would silently
    get no second-order term. Here every gradient made with ``create_graph=True`` hangs off a
    :class:`_SecondDerivative` node, and a backward through it is an error, as torch's own CPU
    flash-attention backward is.
    """

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        with torch.no_grad():
            results = backward(ctx, *grads)
        if not torch.is_grad_enabled():  # the usual backward: create_graph=False
            return results
        present = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor) and r.is_floating_point()]
        if not present:
            return results
        marked = _SecondDerivative.apply(*(results[i].detach().requires_grad_() for i in present))
        out = list(results)
        for i, tensor in zip(present, marked, strict=True):
            out[i] = tensor
        return tuple(out)

    return wrapper


def _attention_arrays(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, captured: Sequence[torch.Tensor], **more: torch.Tensor
) -> dict[str, np.ndarray]:
    """An attention plan's graph inputs by name: q, k, v, the captured tensors (``c0``, ``c1``, ...)
    and ``more`` (the backward's ``out``, ``lse``, ``dy``)."""
    arrays = {"q": _array(q), "k": _array(k), "v": _array(v)}
    arrays |= {f"c{i}": _array(t) for i, t in enumerate(captured)}
    return arrays | {name: _array(t) for name, t in more.items()}


class _FlexFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *captured: torch.Tensor
    ) -> Any:
        result = plan.forward.run(_attention_arrays(q, k, v, captured), plan.threads)
        out = _tensor(result["out"], q.dtype)
        lse = torch.from_numpy(result["lse"])
        ctx.plan = plan
        # Saved as tensors, so torch refuses a backward after any of them was modified in place.
        ctx.save_for_backward(q, k, v, out, lse, *captured)
        ctx.float_out = result["out"]  # out in float32 (``out`` itself may be bf16/f16)
        ctx.dtypes = [t.dtype for t in (q, k, v, *captured)]
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, d_out: torch.Tensor | None, d_lse: torch.Tensor | None) -> Any:
        plan: _Plan = ctx.plan
        needs = ctx.needs_input_grad[1:]
        float_captured = [i for i, t in enumerate(plan.captured) if t.is_floating_point()]
        tensor_grads = any(needs[3 + i] for i in float_captured)
        q, k, v, out, lse, *captured = ctx.saved_tensors
        arrays = _attention_arrays(q, k, v, captured, lse=lse)
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
            result.append(_tensor(grads[name], dtypes[i]) if needs[i] else None)
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
    plan = _plan(q, k, v, score_mod, mask_mod, scale)
    out, lse = _FlexFunction.apply(plan, q, k, v, *plan.captured)
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


# ----------------------------------------------------------------------------- SDPA


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
    return _sdpa_eager(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


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


@_eager_under_torch_compile
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
    fixed = _fixed_plan(q, k, v, is_causal, scale) if attn_mask is None else None
    if fixed is not None:
        return _fixed_forward(fixed, q, k, v)
    plan = _masked_plan(q, k, v, attn_mask, is_causal, scale)
    out, _ = _FlexFunction.apply(plan, q, k, v, *plan.captured)
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
            "B" if shape[0] == q.shape[0] and shape[0] != 1 else shape[0],
            shape[1],
            "Sq" if shape[2] == q.shape[2] and shape[2] != 1 else shape[2],
            "Sk" if shape[3] == k.shape[2] and shape[3] != 1 else shape[3],
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
        if attn_mask.dtype == torch.bool:
            mask_mod = _indexed(full, lambda value, b, h, q_idx, kv_idx: value)
        else:
            score_mod = _indexed(full, lambda value, score, b, h, q_idx, kv_idx: score + value, with_score=True)
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
    """

    forward_graph: Graph
    backward_graph: Graph
    executables: dict[str, Executable]

    def executable(self, which: str) -> Executable:
        exe = self.executables.get(which)
        if exe is None:
            exe = rlx.compile(self.forward_graph if which == "forward" else self.backward_graph)
            with _plans_lock:
                exe = self.executables.setdefault(which, exe)
        return exe


_fixed_plans: dict[tuple[Any, ...], _FixedPlan] = {}


def _fixed_plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None
) -> _FixedPlan | None:
    """The plan for SDPA on the fixed-mask kernels, or None where they cannot express the call.

    They align a causal mask bottom-right; torch's ``is_causal`` is top-left, the same only when
    ``Sq == Sk``. Causal calls with ``Sq != Sk`` take the programmable-attention path (compiled
    per shape), as do calls with an ``attn_mask``.
    """
    _, heads, seq_q, dim = q.shape
    kv_heads, seq_k, value_dim = k.shape[1], k.shape[2], v.shape[3]
    if is_causal and seq_q != seq_k:
        return None
    # The kernels scale scores by 1/sqrt(D); another scale multiplies q first (in the graph, so
    # its gradient follows).
    factor = 1.0 if scale is None else float(scale) * math.sqrt(dim)
    key = (heads, kv_heads, dim, value_dim, is_causal, factor)
    plan = _fixed_plans.get(key)
    if plan is None:
        # The batch and the lengths are symbolic: a smaller last batch, or a decode batch that
        # shrinks as sequences finish, runs on the same machine code.
        sq, sk = ("S", "S") if is_causal else ("Sq", "Sk")
        mask = rlx.MaskKind.CAUSAL if is_causal else rlx.MaskKind.NONE
        forward = Graph("sdpa")
        qi = forward.input("q", ("B", heads, sq, dim))
        ki = forward.input("k", ("B", kv_heads, sk, dim))
        vi = forward.input("v", ("B", kv_heads, sk, value_dim))
        scaled = qi if factor == 1.0 else qi * factor
        forward.output(out=forward.attention(scaled, ki, vi, mask=mask, layout=Layout.BHSD))
        backward = forward.copy()
        qb, kb, vb = (backward.inputs[name] for name in "qkv")
        out = backward.outputs["out"]
        backward.remove_output("out")
        dq, dk, dv = rlx.grad(backward, out, [qb, kb, vb], backward.input("dy", out.shape))
        backward.output(dq=dq, dk=dk, dv=dv)
        plan = _FixedPlan(forward, backward, {})
        with _plans_lock:
            plan = _fixed_plans.setdefault(key, plan)
    return plan


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    return 2.0 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * (q.shape[3] + v.shape[3])


def _fixed_forward(plan: _FixedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on the fixed-mask kernels: through autograd only when a gradient can be asked for.

    A call that autograd would not record (no input requires grad, or grad mode is off: decoding)
    skips ``autograd.Function``, whose bookkeeping cost as much as a small call's kernel.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FixedFunction.apply(plan, q, k, v)  # type: ignore[no-any-return]
    return _fixed_out(plan, q, k, v, _attention_flops(q, k, v))


def _fixed_out(plan: _FixedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flops: float) -> torch.Tensor:
    """The fixed-mask forward kernel's ``out``, in the query's dtype."""
    arrays = {"q": _array(q), "k": _array(k), "v": _array(v)}
    result = plan.executable("forward").run(arrays, _threads_for(flops))
    return _tensor(result["out"], q.dtype)


class _FixedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _FixedPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        flops = _attention_flops(q, k, v)
        ctx.plan, ctx.flops = plan, flops
        ctx.save_for_backward(q, k, v)
        ctx.set_materialize_grads(False)
        return _fixed_out(plan, q, k, v, flops)

    @staticmethod
    @_once_differentiable
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
    forward's, which pick the thread count)."""
    arrays = {"q": _array(q), "k": _array(k), "v": _array(v), "dy": _array(d_out)}
    grads = plan.executable("backward").run(arrays, _threads_for(2.5 * flops))
    dq, dk, dv = (_tensor(grads[f"d{n}"], t.dtype) for n, t in zip("qkv", (q, k, v), strict=True))
    return dq, dk, dv


def _indexed(mask: torch.Tensor, combine: Callable[..., Any], with_score: bool = False) -> Callable[..., Any]:
    """A mod reading ``mask[b, h, q_idx, kv_idx]``, with 0 on the dims it broadcasts over."""

    def pick(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        index = tuple(0 if size == 1 else sym for size, sym in zip(mask.shape, (b, h, q_idx, kv_idx), strict=True))
        if all(size == 1 for size in mask.shape):
            # Indexed by numbers only, torch would read the value now and the trace would bake it
            # in, while SDPA's plans are reused for every mask of this shape: index by a symbol.
            index = (b * 0, *index[1:])
        return mask[index]

    if with_score:
        return lambda score, b, h, q_idx, kv_idx: combine(pick(b, h, q_idx, kv_idx), score, b, h, q_idx, kv_idx)
    return lambda b, h, q_idx, kv_idx: combine(pick(b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)


# ----------------------------------------------------------------------------- whole graphs


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


_COTANGENT = "rlx_cotangent_"  # names of the backward graph's extra inputs and outputs
_GRAD = "rlx_grad_"
_SAVED = "rlx_saved_"  # values the training forward hands to the backward


@dataclass(frozen=True)
class _Training:
    """The backward graph cut in two where it reads the forward's values, as autograd does.

    ``forward`` computes the graph's outputs plus every forward value the backward reads (named
    ``saved``, in order); ``backward`` takes those values as inputs instead of recomputing the
    forward. A value whose shape an input cannot declare (a product of symbols, like ``2*S``
    from a reshape) is not saved: the backward recomputes it from what it reads.
    """

    forward: Executable
    backward: Executable
    saved: tuple[str, ...]


def _saved_values(joint: Graph, cotangents: Iterable[str]) -> list[Value]:
    """The values of ``joint`` computed without any cotangent (forward values) that a node
    depending on a cotangent reads: what the backward needs from the forward."""
    backward_values = {joint.inputs[name] for name in cotangents}
    saved: dict[Value, None] = {}
    for node in joint.nodes:
        if any(value in backward_values for value in node.inputs):
            backward_values.update(node.outputs)
            for value in node.inputs:
                if value not in backward_values and value.node.op not in (OpKind.INPUT, OpKind.CONSTANT):
                    saved[value] = None
    return [value for value in saved if all(isinstance(d, int) or is_symbol(d) for d in value.shape)]


def _fresh(name: str, taken: Mapping[str, object]) -> str:
    """``name``, or ``name`` with the first numeric suffix not in ``taken`` (a backward graph of a
    backward graph names its cotangents after outputs that already carry these prefixes)."""
    fresh, suffix = name, 1
    while fresh in taken:
        fresh, suffix = f"{name}_{suffix}", suffix + 1
    return fresh


class CompiledGraph:
    """An rlx graph as a differentiable torch function: ``f(**tensors) -> {output name: tensor}``.

    The backward graph comes from ``rlx.grad`` of ``sum_i <output_i, d output_i>`` with respect to
    every float input. A call autograd records runs the training pair (:attr:`training`, compiled
    on the first such call): a forward that also returns the values the backward reads, and a
    backward that takes them instead of computing the forward again (on the char-LM example,
    forward + backward 10.7 ms a step against 12.6). Under ``create_graph=True`` the whole
    backward graph runs as a torch function of its own, so gradients differentiate again, to any
    order the graph's ops allow (attention's backward has no gradient of its own: an
    ``RlxError`` says so).
    """

    def __init__(self, graph: Graph) -> None:
        if not isinstance(graph, Graph):
            raise RlxTypeError(f"rlx.torch.compile expects an rlx.Graph, got {type(graph).__name__}")
        self.graph = graph.copy()
        self.forward = rlx.compile(self.graph)
        self._backward: Executable | None = None
        self._backward_function: CompiledGraph | None = None
        # The backward graph's names: a cotangent input per float output, a gradient per input.
        self.cotangent_names: dict[str, str] = {}
        self.grad_names: dict[str, str] = {}
        self.names = list(self.graph.inputs)
        self.outputs = list(self.graph.outputs)

    @functools.cached_property
    def differentiable(self) -> bool:
        """Whether any float output depends on float inputs: there is a backward to compute."""
        graph = self.graph
        float_inputs = any(graph.inputs[name].dtype == np.float32 for name in self.names)
        return float_inputs and any(value.dtype == np.float32 for value in graph.outputs.values())

    def backward_executable(self) -> Executable:
        if self._backward is None:
            self._backward = rlx.compile(self.backward_graph)
        return self._backward

    def backward_function(self) -> CompiledGraph:
        """The backward graph as a torch function of its own, for ``create_graph=True``: its
        backward is ``rlx.grad`` of the backward graph, so gradients differentiate to any order."""
        if self._backward_function is None:
            self._backward_function = CompiledGraph(self.backward_graph)
        return self._backward_function

    @functools.cached_property
    def training(self) -> _Training | None:
        """The forward that also returns what the backward reads, and that backward: a training
        step computes the forward once (the backward graph alone recomputes it). None where the
        graph has no backward (no float output or input), or one ``rlx.grad`` cannot build (a
        backward graph with attention's backward in it, differentiated again): its error is
        raised when a backward runs, as before, not by the forward."""
        if not self.differentiable:
            return None
        try:
            joint = self.backward_graph
        except RlxError:
            return None
        return self._split(joint)

    def _split(self, joint: Graph) -> _Training:
        saved = _saved_values(joint, self.cotangent_names.values())
        names: list[str] = []
        forward = joint.copy()
        for name in list(forward.outputs):
            forward.remove_output(name)
        for name, value in self.graph.outputs.items():
            forward.output(**{name: Value(forward.node(value.node.id), value.index)})
        backward = joint.copy()
        for value in saved:
            name = _fresh(f"{_SAVED}{len(names)}", {**forward.outputs, **backward.inputs})
            names.append(name)
            forward.output(**{name: Value(forward.node(value.node.id), value.index)})
            original = Value(backward.node(value.node.id), value.index)
            backward.replace_all_uses_with(original, backward.input(name, value.shape, value.dtype))
        return _Training(rlx.compile(forward), rlx.compile(backward), tuple(names))

    @functools.cached_property
    def backward_graph(self) -> Graph:
        """The graph's inputs, a cotangent input per float output, and a gradient output per
        float input (the forward's outputs are not outputs here: a backward graph of this graph,
        for a second derivative, names its cotangents after them)."""
        g = self.graph.copy()
        total: Value | None = None
        for name, value in list(g.outputs.items()):
            g.remove_output(name)
            if value.dtype == np.float32:
                cotangent = self.cotangent_names[name] = _fresh(_COTANGENT + name, g.inputs)
                term = g.sum(value * g.input(cotangent, value.shape))
                total = term if total is None else total + term
        xs = [g.inputs[name] for name in self.names if g.inputs[name].dtype == np.float32]
        if total is None or not xs:
            raise RlxValueError("rlx.torch.compile: nothing to differentiate (no float outputs or no float inputs)")
        for x, grad in zip(xs, rlx.grad(g, total, xs), strict=True):
            name = self.grad_names[x.node.attrs.name] = _fresh(_GRAD + x.node.attrs.name, g.outputs)
            g.output(**{name: grad})
        return g

    @_eager_under_torch_compile
    def __call__(self, *args: Any, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        if args:
            raise RlxTypeError(f"pass the inputs by name: f({', '.join(f'{n}=...' for n in self.names)})")
        missing = [n for n in self.names if n not in tensors]
        unknown = [n for n in tensors if n not in self.names]
        if missing or unknown:
            raise rlx.RlxKeyError(f"expected inputs {self.names}; missing {missing}, unknown {unknown}")
        ordered = []
        for name in self.names:
            declared = self.graph.inputs[name].dtype
            tensor = _check_tensor(tensors[name], name, kinds="float" if declared == np.float32 else "any")
            ordered.append(tensor if declared == np.float32 else _index_tensor(tensor, declared, name))
        recorded = torch.is_grad_enabled() and any(t.requires_grad for t in ordered)  # a backward may come
        results = _GraphFunction.apply(self, recorded, *ordered)
        return dict(zip(self.outputs, results, strict=True))


_INDEX_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def _index_tensor(tensor: torch.Tensor, declared: np.dtype, name: str) -> torch.Tensor:
    """An integer tensor in the integer dtype its input declares: torch makes int64 indices by
    default, and a graph may declare int32 ones. Converted only when every value fits, so an id
    past the int32 range is an error here, never a wrapped-around valid id."""
    want = _INDEX_DTYPES.get(np.dtype(declared))
    if want is None or tensor.dtype == want or tensor.is_floating_point() or tensor.dtype == torch.bool:
        return tensor  # (bool inputs, and floats where ints are declared: the binder names the mismatch)
    info = torch.iinfo(want)
    if tensor.numel() and (int(tensor.min()) < info.min or int(tensor.max()) > info.max):
        raise RlxValueError(
            f"input {name!r}: values {int(tensor.min())}..{int(tensor.max())} do not fit the declared {want}"
        )
    return tensor.to(want)


class _GraphFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, compiled: CompiledGraph, recorded: bool, *tensors: torch.Tensor) -> Any:
        arrays = {name: _array(t) for name, t in zip(compiled.names, tensors, strict=True)}
        ctx.saved_arrays, ctx.backward_exe = {}, None
        training = compiled.training if recorded else None
        if training is not None:
            # Training: the forward also returns what the backward reads, held until it runs.
            result = training.forward(**arrays)
            ctx.saved_arrays = {name: result.pop(name) for name in training.saved}
            ctx.backward_exe = training.backward
        else:
            result = compiled.forward(**arrays)
        ctx.compiled = compiled
        # Saved as tensors, so torch refuses a backward after any of them was modified in place.
        ctx.save_for_backward(*tensors)
        ctx.shapes = {name: array.shape for name, array in result.items()}  # symbolic dims resolved
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.set_materialize_grads(False)
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        outs = []
        for name in compiled.outputs:
            array = result[name]
            outs.append(_tensor(array, dtype) if array.dtype == np.float32 else torch.from_numpy(array))
        non_float = [o for o in outs if not o.is_floating_point()]
        if non_float:
            ctx.mark_non_differentiable(*non_float)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor | None) -> Any:
        compiled: CompiledGraph = ctx.compiled
        inputs = _backward_inputs(compiled, ctx, cotangents)
        dtypes = dict(zip(compiled.names, ctx.dtypes, strict=True))
        wanted = [name for name, needed in zip(compiled.names, ctx.needs_input_grad[2:], strict=True) if needed]
        if torch.is_grad_enabled():  # create_graph=True: the backward graph runs as a torch function
            grads = compiled.backward_function()(**inputs)
            found = {name: grads[compiled.grad_names[name]].to(dtypes[name]) for name in wanted}
        else:
            # From the values the training forward saved, else the backward graph that recomputes them.
            exe = ctx.backward_exe or compiled.backward_executable()
            arrays = {name: _array(tensor) for name, tensor in inputs.items()} | ctx.saved_arrays
            results = exe(**{name: arrays[name] for name in exe.graph.inputs})
            found = {name: _tensor(results[compiled.grad_names[name]], dtypes[name]) for name in wanted}
        return (None, None, *(found.get(name) for name in compiled.names))


def _backward_inputs(
    compiled: CompiledGraph, ctx: Any, cotangents: tuple[torch.Tensor | None, ...]
) -> dict[str, torch.Tensor]:
    """The backward graph's inputs: the forward's, and a cotangent per float output (zeros for
    one autograd left undefined)."""
    graph = compiled.backward_graph  # (built on first use, naming the cotangents)
    inputs = dict(zip(compiled.names, ctx.saved_tensors, strict=True))
    for name, ct in zip(compiled.outputs, cotangents, strict=True):
        if name in compiled.cotangent_names:
            inputs[compiled.cotangent_names[name]] = ct if ct is not None else torch.zeros(ctx.shapes[name])
    return {name: inputs[name] for name in graph.inputs}


def compile(graph: Graph) -> CompiledGraph:
    """Any rlx graph as a differentiable torch function (inputs by name, dict of tensors out)."""
    return CompiledGraph(graph)
