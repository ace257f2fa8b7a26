"""``rlx.exp(x)``, ``rlx.softmax(x, axis=-1)``, ``rlx.matmul(a, b)``, ...: every op builder of
:class:`rlx.Graph` as a function of values, which builds the node in its operands' graph (as
``jnp.exp`` works on a traced array). Inside a function that :func:`rlx.jit` traces, the
arguments are values, so a model reads as it would in JAX.

The few names that attention mods use (``rlx.where``, ``rlx.exp``, ...) keep their meaning on
a mod's symbolic scalars and on numbers: a value among the operands picks the graph op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from rlx.errors import RlxTypeError
from rlx.ir.graph import Graph, Value

# Graph methods that manage the graph rather than build an op.
_NOT_OPS = frozenset(
    {
        "add_node",
        "config_value",
        "constant",
        "copy",
        "erase",
        "fused_elementwise",
        "input",
        "inputs",
        "name",
        "node",
        "nodes",
        "output",
        "output_names_of",
        "outputs",
        "parse",
        "remove_output",
        "replace_all_uses_with",
        "set_input",
        "to_dot",
        "users",
        "uses",
        "verify",
    }
)
MOD_FUNCTIONS = ("abs", "exp", "log", "maximum", "minimum", "power", "sigmoid", "sqrt", "tanh", "where")
_GRAPH_NAMES = {"power": "pow"}  # numpy's name for a mod, the Graph's for a value


@functools.cache
def op_function(name: str) -> Callable[..., Any] | None:
    """``rlx.<name>``: the Graph op ``name`` as a function of values, or None if there is none
    (one function per name: ``rlx.exp is rlx.exp``)."""
    method = _GRAPH_NAMES.get(name, name)
    if name.startswith("_") or method in _NOT_OPS or not callable(getattr(Graph, method, None)):
        return None

    def apply(*args: Any, **kwargs: Any) -> Any:
        graph = _graph_among((args, kwargs))
        if graph is None:
            if name in MOD_FUNCTIONS:  # a mod's symbolic scalars, or numbers
                from rlx import mods

                return getattr(mods, name)(*args, **kwargs)
            raise RlxTypeError(
                f"rlx.{name}: none of its arguments is a value of a graph (inside a function rlx.jit "
                f"traces, the array arguments are values; else build it with g.{method}(...))"
            )
        return getattr(graph, method)(*args, **kwargs)

    apply.__name__ = name
    apply.__qualname__ = name
    apply.__doc__ = f"``g.{method}(...)`` in the graph of the values among the arguments." + (
        f" On an attention mod's symbolic scalars: ``rlx.mods.{name}``." if name in MOD_FUNCTIONS else ""
    )
    return apply


def _graph_among(obj: object) -> Graph | None:
    """The graph of the first value in ``obj`` (searched through lists, tuples and dicts)."""
    if isinstance(obj, Value):
        return obj.graph
    if isinstance(obj, (list, tuple)):
        items: Any = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for item in items:
        graph = _graph_among(item)
        if graph is not None:
            return graph
    return None
