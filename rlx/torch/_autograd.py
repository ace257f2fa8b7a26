"""What every rlx.torch autograd function shares: a graph break under torch.compile, and
first derivatives only (a gradient made with ``create_graph=True`` raises when differentiated)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from rlx.errors import RlxValueError


def _eager_under_torch_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as one graph break under ``torch.compile``: it runs as it is, with rlx's compiled
    code and autograd, while torch compiles the code around it.

    Without this, dynamo traced into rlx's Python (NumPy views, ctypes, caches) and broke the
    graph at every one of them, with a warning each: correct, but a screen of warnings and
    seconds of tracing for a model that calls attention once per layer.

    Outside torch.compile the call goes straight to ``fn``: the disabled function's wrapper
    (dynamo's frame-callback bookkeeping) cost a decode step 5-10 us, a fifth of a short call.
    """
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


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
