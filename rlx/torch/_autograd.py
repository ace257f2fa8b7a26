"""What every rlx.torch autograd function shares: a graph break under torch.compile, and
backwards that run compiled kernels outside autograd, with a differentiable path for
``create_graph=True`` (:func:`_twice_differentiable`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


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


def _twice_differentiable(differentiable: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An ``autograd.Function.backward`` that runs its compiled kernels outside autograd, and with
    ``create_graph=True`` (a gradient penalty, a Hessian-vector product) runs
    ``differentiable(ctx, *grads)`` instead: the same gradients from the backward graph run
    through :func:`rlx.torch.compile`, a torch function of its own whose backward comes from
    ``rlx.grad`` (the attention backward nodes' second-order rules), so the gradient can be
    differentiated again."""

    def decorator(backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def wrapper(ctx: Any, *grads: Any) -> Any:
            if torch.is_grad_enabled():  # create_graph=True: autograd records this backward
                return differentiable(ctx, *grads)
            return backward(ctx, *grads)

        return wrapper

    return decorator
