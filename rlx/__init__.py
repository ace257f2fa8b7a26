"""rlx: a graph-IR compiler for machine-learning models, with attention at its heart.

Build a graph with :class:`Graph`, differentiate with :func:`grad`, transform with
:mod:`rlx.passes`, check with :mod:`rlx.reference` and JIT-compile with :func:`compile`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlx.config import RuntimeConfig
from rlx.errors import RlxError, RlxKeyError, RlxMemoryError, RlxTypeError, RlxValueError
from rlx.ir import Graph, Layout, MaskKind, Node, OpKind, TensorType, Value, Wrt, parse

__version__ = "0.1.0"

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from rlx.codegen.executable import Executable


def grad(graph: Graph | Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Reverse-mode gradients.

    ``rlx.grad(g, y, xs, dy=None)``: of ``y`` w.r.t. each of ``xs`` in graph ``g``, as new values
    of ``g``; ``dy`` may be left out for a scalar ``y`` (the seed is 1), or be a number or an
    array of ``y``'s shape.

    ``rlx.grad(fn, argnums=0, has_aux=False)``: a function giving the gradient of ``fn``'s
    scalar result w.r.t. its arguments ``argnums``, as ``jax.grad`` (see :mod:`rlx.tracing`).
    """
    if not isinstance(graph, Graph) and callable(graph):
        from rlx.tracing import grad_of_function

        return grad_of_function(graph, *args, **kwargs)
    from rlx.autodiff import grad as _grad

    return _grad(graph, *args, **kwargs)


def compile(graph: Graph, passes: Sequence[str] | None = None, config: RuntimeConfig | None = None) -> Executable:
    """JIT-compile ``graph`` (never mutated) into an executable; ``passes=[]`` skips all passes."""
    from rlx.codegen.executable import compile_graph

    return compile_graph(graph, passes=passes, config=config)


def load(path: str) -> Executable:
    """An executable written by ``exe.save(path)``, in this or any later process (no recompiling on the same CPU)."""
    from rlx.codegen.executable import load as _load

    return _load(path)


def __getattr__(name: str) -> Any:
    # Submodules load lazily so that `import rlx` stays cheap and llvmlite loads only to compile.
    import importlib

    if name in ("passes", "reference", "codegen", "autodiff", "models", "mods", "random", "lax"):
        return importlib.import_module(f"rlx.{name}")
    if name == "attention_merge":
        return importlib.import_module("rlx.merge").attention_merge
    if name in ("jit", "value_and_grad"):
        return getattr(importlib.import_module("rlx.tracing"), name)
    if name in ("custom_vjp", "custom_jvp"):
        return getattr(importlib.import_module("rlx.custom_gradients"), name)
    if name in ("checkpoint", "remat"):
        return importlib.import_module("rlx.checkpointing").checkpoint
    if name == "checkpoint_policies":
        return importlib.import_module("rlx.checkpoint_policies")
    if name == "vmap":
        return importlib.import_module("rlx.vectorize").vmap
    if name in ("vjp", "jvp", "jacrev", "jacfwd", "hessian"):
        return getattr(importlib.import_module("rlx.jacobians"), name)
    # rlx.exp(x), rlx.softmax(x), ...: the Graph's ops as functions of values (rlx.where, rlx.tanh,
    # ... on an attention mod's symbolic scalars too: the vocabulary of mods).
    function = importlib.import_module("rlx.functional").op_function(name)
    if function is not None:
        return function
    raise AttributeError(f"module 'rlx' has no attribute {name!r}")


__all__ = [
    "Graph",
    "Layout",
    "MaskKind",
    "Node",
    "OpKind",
    "RlxError",
    "RlxKeyError",
    "RlxMemoryError",
    "RlxTypeError",
    "RlxValueError",
    "RuntimeConfig",
    "TensorType",
    "Value",
    "Wrt",
    "abs",
    "attention_merge",
    "checkpoint",
    "checkpoint_policies",
    "compile",
    "custom_jvp",
    "custom_vjp",
    "exp",
    "grad",
    "hessian",
    "jacfwd",
    "jacrev",
    "jit",
    "jvp",
    "lax",
    "load",
    "log",
    "maximum",
    "minimum",
    "parse",
    "power",
    "remat",
    "sigmoid",
    "sqrt",
    "tanh",
    "value_and_grad",
    "vjp",
    "vmap",
    "where",
]
