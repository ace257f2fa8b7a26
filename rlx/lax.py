"""``rlx.lax``: JAX's structured control flow (``scan``, ``fori_loop``, ``while_loop``,
``cond``, ``switch``) for functions traced by ``rlx.jit``, ``rlx.grad`` and the other transforms.

rlx has no loop or branch in its IR: a graph is a fixed set of ops, which is what lets the code
generator fuse and plan memory across all of it. So a loop is unrolled while tracing, once per
step (JAX's ``unroll=True``), and a branch on a value of the graph computes every branch and
selects the result with ``where``, as JAX's ``cond`` does under ``vmap``. The results and their
gradients are JAX's; what differs is cost. The graph grows with the number of steps (the
steps' kernels share their code, and a call runs them from tables, so a small RNN cell's
gradient traces and compiles in 0.6 s for 50 steps and 2.0 s for 200 on an Intel Xeon host),
and a trip count must be known when tracing: a Python int, or a leading axis of the scanned arrays. A branch on a value
runs every branch. A loop or branch whose bound or predicate is a value of the graph, where no
unrolling can say how many steps to take, is an error naming it.

Each function also takes arrays, as JAX's do: the call is traced and compiled once per shapes
(:func:`rlx.jit`), the functions passed to it static.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.graph import Graph, Value
from rlx.tracing import OnArrays, _flatten, _is_array, _Tree, _unflatten, graph_of

_on_arrays: dict[str, OnArrays] = {}


def _values_or_jitted(what: str, traced: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Graph | None, Any]:
    """The graph of the values among ``args``, or (called on arrays) the jitted call's result."""
    graph = graph_of(f"rlx.lax.{what}", args)
    if graph is not None:
        return graph, None
    runner = _on_arrays.setdefault(what, OnArrays(f"rlx.lax.{what}"))
    return None, runner(traced, args, {})


def _leaves(tree: Any) -> tuple[_Tree, list[object]]:
    found: list[tuple[str, object]] = []
    structure = _flatten(tree, "", found)
    return structure, [leaf for _, leaf in found]


def _signature(leaves: list[object]) -> list[object]:
    """What a carry must keep from step to step: each leaf's type (shape and dtype), or the leaf."""
    return [leaf.type if isinstance(leaf, Value) else type(leaf) for leaf in leaves]


def _check_carry(what: str, before: Any, after: Any) -> None:
    """A loop's carry keeps its structure and its leaves' shapes and dtypes, as JAX requires."""
    (tree_in, leaves_in), (tree_out, leaves_out) = _leaves(before), _leaves(after)
    if tree_in != tree_out:
        raise RlxTypeError(f"rlx.lax.{what}: the body returned a carry of another structure than it was given")
    for i, (a, b) in enumerate(zip(_signature(leaves_in), _signature(leaves_out), strict=True)):
        if a != b:
            raise RlxTypeError(f"rlx.lax.{what}: carry leaf {i} entered the body as {a} and left it as {b}")


def _static_count(what: str, name: str, count: object) -> int:
    if isinstance(count, Value):
        raise RlxTypeError(
            f"rlx.lax.{what}: {name} is a value of the graph; rlx unrolls loops while tracing, so it must be a "
            "Python int (or a NumPy integer)"
        )
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise RlxTypeError(f"rlx.lax.{what}: {name} must be an int, got {type(count).__name__}")
    return int(count)


def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
) -> tuple[Any, Any]:
    """``jax.lax.scan``: ``carry, y = f(carry, x)`` for each ``x`` along the leading axis of
    ``xs`` (a value, or a nest of them, or None with ``length``), from the last with
    ``reverse``. Returns the final carry and the ``y``s stacked along a new leading axis (a nest
    like ``f``'s). Unrolled while tracing (``unroll`` is taken and changes nothing)."""
    if not callable(f):
        raise RlxTypeError(f"rlx.lax.scan: f must be a function, got {type(f).__name__}")
    if not isinstance(unroll, (bool, int)):
        raise RlxTypeError(f"rlx.lax.scan: unroll must be an int or a bool, got {type(unroll).__name__}")
    graph, result = _values_or_jitted("scan", _scan_on_arrays, (f, init, xs, length, reverse))
    if graph is None:
        return result  # type: ignore[no-any-return]
    xs_tree, xs_leaves = _leaves(xs) if xs is not None else (None, [])
    if not all(isinstance(leaf, Value) for leaf in xs_leaves):
        raise RlxTypeError(
            "rlx.lax.scan: xs must be values of the graph (or arrays), nested in dicts, lists and tuples"
        )
    lengths = {leaf.shape[0] if leaf.ndim else None for leaf in xs_leaves}  # type: ignore[attr-defined]
    if None in lengths:
        raise RlxValueError("rlx.lax.scan: every leaf of xs needs a leading axis to scan along")
    if length is not None:
        lengths.add(_static_count("scan", "length", length))
    if not lengths:
        raise RlxValueError("rlx.lax.scan: give xs or length")
    if len(lengths) != 1:
        raise RlxValueError(f"rlx.lax.scan: xs and length disagree on the number of steps: {sorted(map(str, lengths))}")
    steps = lengths.pop()
    if not isinstance(steps, int):
        raise RlxValueError(f"rlx.lax.scan: the number of steps must be static, got the symbolic {steps!r}")
    if steps < 1:
        raise RlxValueError("rlx.lax.scan: rlx unrolls a scan while tracing, which needs at least one step")
    carry = init
    ys: list[Any] = [None] * steps
    for step in reversed(range(steps)) if reverse else range(steps):
        x = _unflatten(xs_tree, iter([leaf[step] for leaf in xs_leaves])) if xs_tree else None  # type: ignore[index,arg-type]
        out = f(carry, x)
        if not isinstance(out, tuple) or len(out) != 2:
            raise RlxTypeError("rlx.lax.scan: f must return a pair (carry, y)")
        _check_carry("scan", carry, out[0])
        carry, ys[step] = out
    return carry, _stacked(graph, ys)


def _scan_on_arrays(f: Any, init: Any, xs: Any, length: Any, reverse: Any) -> Any:
    return scan(f, init, xs, length, reverse)


def _stacked(graph: Graph, ys: list[Any]) -> Any:
    """The steps' ``y``s (nests of one structure) as one nest of values with a new leading axis."""
    trees = [_leaves(y) for y in ys]
    tree = trees[0][0]
    if any(other != tree for other, _ in trees):
        raise RlxTypeError("rlx.lax.scan: f returned ys of different structures at different steps")
    columns = zip(*(leaves for _, leaves in trees), strict=True)
    stacked: list[Value | None] = []
    for i, column in enumerate(columns):
        if all(leaf is None for leaf in column):
            stacked.append(None)
            continue
        if not all(isinstance(leaf, (Value, int, float, np.ndarray)) for leaf in column):
            raise RlxTypeError(f"rlx.lax.scan: y leaf {i} is not a value, an array or a number")
        stacked.append(graph.stack(list(column), axis=0))
    return _unflatten(tree, iter(stacked))


def fori_loop(lower: int, upper: int, body_fun: Callable[[int, Any], Any], init_val: Any) -> Any:
    """``jax.lax.fori_loop``: ``val = body_fun(i, val)`` for ``i`` from ``lower`` to ``upper - 1``
    (Python ints: the loop is unrolled while tracing, ``i`` a Python int in the body)."""
    if not callable(body_fun):
        raise RlxTypeError(f"rlx.lax.fori_loop: body_fun must be a function, got {type(body_fun).__name__}")
    first, last = _static_count("fori_loop", "lower", lower), _static_count("fori_loop", "upper", upper)
    graph, result = _values_or_jitted("fori_loop", _fori_on_arrays, (first, last, body_fun, init_val))
    if graph is None:
        return result
    val = init_val
    for i in range(first, last):
        new = body_fun(i, val)
        _check_carry("fori_loop", val, new)
        val = new
    return val


def _fori_on_arrays(lower: Any, upper: Any, body_fun: Any, init_val: Any) -> Any:
    return fori_loop(lower, upper, body_fun, init_val)


def while_loop(cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any) -> Any:
    """``jax.lax.while_loop``, unrolled while tracing: ``cond_fun`` must decide each step from
    what is known then (Python numbers in the carry, the shapes of its values). A condition that
    is a value of the graph is an error: the number of steps would depend on the data."""
    if not callable(cond_fun) or not callable(body_fun):
        raise RlxTypeError("rlx.lax.while_loop: cond_fun and body_fun must be functions")
    graph, result = _values_or_jitted("while_loop", _while_on_arrays, (cond_fun, body_fun, init_val))
    if graph is None:
        return result
    val = init_val
    while True:
        keep_going = cond_fun(val)
        if isinstance(keep_going, Value):
            raise RlxTypeError(
                "rlx.lax.while_loop: cond_fun returned a value of the graph; rlx unrolls loops while tracing, so "
                "the condition must be a Python bool (use fori_loop or scan with a known number of steps)"
            )
        if not keep_going:
            return val
        new = body_fun(val)
        _check_carry("while_loop", val, new)
        val = new


def _while_on_arrays(cond_fun: Any, body_fun: Any, init_val: Any) -> Any:
    return while_loop(cond_fun, body_fun, init_val)


def cond(pred: Any, true_fun: Callable[..., Any], false_fun: Callable[..., Any], *operands: Any) -> Any:
    """``jax.lax.cond``: ``true_fun(*operands)`` if ``pred`` else ``false_fun(*operands)``. A
    Python (or NumPy) bool picks the branch while tracing; a scalar value of the graph runs both
    and selects with ``where`` (the gradient flows through the branch taken only)."""
    return switch(pred, [false_fun, true_fun], *operands, _what="cond")


def switch(index: Any, branches: Sequence[Callable[..., Any]], *operands: Any, _what: str = "switch") -> Any:
    """``jax.lax.switch``: ``branches[index](*operands)``, ``index`` clamped into range as JAX
    clamps it. A Python int picks the branch while tracing; a scalar int value of the graph runs
    every branch and selects with ``where``."""
    if isinstance(branches, (str, bytes)) or not isinstance(branches, Sequence) or not branches:
        raise RlxTypeError(f"rlx.lax.{_what}: branches must be a non-empty list of functions")
    if not all(callable(branch) for branch in branches):
        raise RlxTypeError(f"rlx.lax.{_what}: every branch must be a function")
    if any(_is_array(leaf) for leaf in _leaves((index, operands))[1]):
        # On arrays (and no value): jitted, an array selector then a value, the branches static.
        graph, result = _values_or_jitted(_what, _switch_on_arrays, (index, tuple(branches), _what, *operands))
        if graph is None:
            return result
    if not isinstance(index, Value):
        if isinstance(index, np.ndarray) and index.ndim == 0:
            index = index.item()
        if not isinstance(index, (bool, int, np.integer, np.bool_)):
            raise RlxTypeError(f"rlx.lax.{_what}: the {'predicate' if _what == 'cond' else 'index'} must be a "
                               f"bool, an int or a scalar value of the graph, got {type(index).__name__}")  # fmt: skip
        return branches[min(max(int(index), 0), len(branches) - 1)](*operands)
    if index.ndim != 0:
        raise RlxValueError(f"rlx.lax.{_what}: the selector must be a scalar, got {index.type}")
    graph = index.graph
    if index.dtype == np.bool_:
        index = index.astype("int32")
    elif index.dtype.kind != "i":
        raise RlxTypeError(f"rlx.lax.{_what}: the selector must be a bool or an int, got {index.type}")
    results = [branch(*operands) for branch in branches]
    trees = [_leaves(result) for result in results]
    tree, first_leaves = trees[0]
    for other_tree, leaves in trees[1:]:
        if other_tree != tree or _signature(leaves) != _signature(first_leaves):
            raise RlxTypeError(f"rlx.lax.{_what}: the branches return results of different structures or types")
    last = len(branches) - 1
    # Branch k is taken where index == k; past the ends, the first or the last (JAX clamps).
    taken = [graph.greater_equal(index, k) if k == last else graph.equal(index, k) for k in range(1, last + 1)]
    chosen = []
    for column in zip(*(leaves for _, leaves in trees), strict=True):
        if not any(isinstance(leaf, Value) for leaf in column) and all(leaf == column[0] for leaf in column):
            chosen.append(column[0])  # the same number (or None) from every branch
            continue
        values = [leaf if isinstance(leaf, Value) else graph.constant(leaf) for leaf in column]
        result = values[0]
        for k, value in enumerate(values[1:]):
            result = graph.where(taken[k], value, result)
        chosen.append(result)
    return _unflatten(tree, iter(chosen))


def _switch_on_arrays(index: Any, branches: tuple[Callable[..., Any], ...], what: str, *operands: Any) -> Any:
    return switch(index, branches, *operands, _what=what)
