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
    from collections.abc import Sequence

    import numpy as np

    from rlx.codegen.executable import Executable


def grad(graph: Graph, y: Value, xs: Sequence[Value], dy: Value | float | np.ndarray | None = None) -> list[Value]:
    """Reverse-mode gradients of ``y`` w.r.t. each of ``xs``; ``dy`` may be left out for a scalar ``y``
    (the seed is 1), or be a number or an array of ``y``'s shape."""
    from rlx.autodiff import grad as _grad

    return _grad(graph, y, xs, dy)


def compile(graph: Graph, passes: Sequence[str] | None = None, config: RuntimeConfig | None = None) -> Executable:
    """JIT-compile ``graph`` (never mutated) into an executable; ``passes=[]`` skips all passes."""
    from rlx.codegen.executable import compile_graph

    return compile_graph(graph, passes=passes, config=config)


def load(path: str) -> Executable:
    """An executable written by ``exe.save(path)``, in this or any later process (no recompiling on the same CPU)."""
    from rlx.codegen.executable import load as _load

    return _load(path)


_MOD_FUNCTIONS = ("abs", "exp", "log", "maximum", "minimum", "power", "sigmoid", "sqrt", "tanh", "where")


def __getattr__(name: str) -> Any:
    # Submodules load lazily so that `import rlx` stays cheap and llvmlite loads only to compile.
    import importlib

    if name in ("passes", "reference", "codegen", "autodiff", "models", "mods"):
        return importlib.import_module(f"rlx.{name}")
    if name in _MOD_FUNCTIONS:  # rlx.where, rlx.tanh, ...: the vocabulary of attention mods
        return getattr(importlib.import_module("rlx.mods"), name)
    if name == "attention_merge":
        return importlib.import_module("rlx.merge").attention_merge
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
    "compile",
    "exp",
    "grad",
    "load",
    "log",
    "maximum",
    "minimum",
    "parse",
    "power",
    "sigmoid",
    "sqrt",
    "tanh",
    "where",
]
