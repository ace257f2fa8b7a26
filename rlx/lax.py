"""``rlx.lax``: JAX's structured control flow (``scan``, ``map``, ``fori_loop``,
``while_loop``, ``cond``, ``switch``) for functions traced by ``rlx.jit``, ``rlx.grad`` and the
other transforms, and its slices at run-time starts (``dynamic_slice``,
``dynamic_update_slice`` and their one-axis forms), built from ``take`` and ``.at[].set``.

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
from rlx.ops._common import as_value, normalize_axis
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
        counts = sorted(str(n) for n in lengths)
        raise RlxValueError(f"rlx.lax.scan: xs and length disagree on the number of steps: {counts}")
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


# ----------------------------------------------------------------------------- slices at run-time starts


def map(f: Callable[[Any], Any], xs: Any) -> Any:  # jax.lax.map (shadows the builtin in this module)
    """``jax.lax.map``: ``f`` applied to each slice of ``xs`` along its leading axis (a nest of
    values or arrays), the results stacked: ``scan`` with no carry, unrolled as it is."""
    if not callable(f):
        raise RlxTypeError(f"rlx.lax.map: f must be a function, got {type(f).__name__}")
    _, ys = scan(lambda carry, x: (carry, f(x)), None, xs)
    return ys


def dynamic_slice(operand: Any, start_indices: Any, slice_sizes: Sequence[int]) -> Any:
    """``jax.lax.dynamic_slice``: the block of ``slice_sizes`` of ``operand`` from
    ``start_indices``, each an int or a scalar int value of the graph (or one int vector of
    them), clamped as JAX clamps them into ``[0, size - slice_size]`` so that the block lies in
    ``operand``. A static start is a view; a start the graph computes is a gather (``take``),
    whose gradient adds into the block it read."""
    graph, result = _values_or_jitted("dynamic_slice", _dynamic_slice_on_arrays, (operand, start_indices, slice_sizes))
    if graph is None:
        return result
    value = as_value(graph, operand, "rlx.lax.dynamic_slice: operand")
    sizes = _slice_sizes("dynamic_slice", value, slice_sizes)
    for axis, (start, size) in enumerate(zip(_starts("dynamic_slice", value, start_indices), sizes, strict=True)):
        first = _clamped_start("dynamic_slice", value, axis, start, size)
        if isinstance(first, int):
            index: list[Any] = [slice(None)] * value.ndim
            index[axis] = slice(first, first + size)
            value = value[tuple(index)]
        else:
            value = graph.take(value, first + graph.constant(np.arange(size, dtype=np.int64)), axis)
    return value


def _dynamic_slice_on_arrays(operand: Any, start_indices: Any, slice_sizes: Any) -> Any:
    return dynamic_slice(operand, start_indices, slice_sizes)


def dynamic_update_slice(operand: Any, update: Any, start_indices: Any) -> Any:
    """``jax.lax.dynamic_update_slice``: ``operand`` with ``update`` written over the block of
    its shape from ``start_indices`` (ints or scalar int values of the graph, or one int vector
    of them), clamped into ``[0, size - update_size]`` as JAX clamps them. The gradient of the
    result goes to ``update`` from the block and to ``operand`` everywhere else."""
    graph, result = _values_or_jitted("dynamic_update_slice", _update_on_arrays, (operand, update, start_indices))
    if graph is None:
        return result
    value = as_value(graph, operand, "rlx.lax.dynamic_update_slice: operand")
    patch = as_value(graph, update, "rlx.lax.dynamic_update_slice: update")
    if patch.ndim != value.ndim or patch.dtype != value.dtype:
        raise RlxTypeError(
            f"rlx.lax.dynamic_update_slice: update {patch.type} must have operand {value.type}'s rank and dtype"
        )
    sizes = _slice_sizes("dynamic_update_slice", value, patch.shape)
    starts = [
        _clamped_start("dynamic_update_slice", value, axis, start, size)
        for axis, (start, size) in enumerate(
            zip(_starts("dynamic_update_slice", value, start_indices), sizes, strict=True)
        )
    ]
    if all(isinstance(start, int) for start in starts):
        return value.at[tuple(slice(start, start + size) for start, size in zip(starts, sizes, strict=True))].set(patch)
    # Each axis's positions as an index array shaped to broadcast against the others' (NumPy's
    # ix_), so that the block is one advanced index whose axes stay in place.
    grids = []
    for axis, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        shape = [1] * value.ndim
        shape[axis] = size
        positions = np.arange(size, dtype=np.int64).reshape(shape)
        grids.append(graph.constant(positions + start) if isinstance(start, int) else start + graph.constant(positions))
    return value.at[tuple(grids)].set(patch)


def _update_on_arrays(operand: Any, update: Any, start_indices: Any) -> Any:
    return dynamic_update_slice(operand, update, start_indices)


def dynamic_slice_in_dim(operand: Any, start_index: Any, slice_size: int, axis: int = 0) -> Any:
    """``jax.lax.dynamic_slice_in_dim``: :func:`dynamic_slice` along one axis."""
    ndim = _ndim("dynamic_slice_in_dim", operand)
    axis = normalize_axis("rlx.lax.dynamic_slice_in_dim", axis, ndim)
    shape = _shape(operand)
    starts = [start_index if a == axis else 0 for a in range(ndim)]
    return dynamic_slice(operand, starts, [slice_size if a == axis else shape[a] for a in range(ndim)])


def dynamic_index_in_dim(operand: Any, index: Any, axis: int = 0, keepdims: bool = True) -> Any:
    """``jax.lax.dynamic_index_in_dim``: the slice at ``index`` along ``axis`` (kept as size 1
    with ``keepdims``, as JAX's default)."""
    ndim = _ndim("dynamic_index_in_dim", operand)
    axis = normalize_axis("rlx.lax.dynamic_index_in_dim", axis, ndim)
    block = dynamic_slice_in_dim(operand, index, 1, axis)
    if keepdims:
        return block
    return block.squeeze(axis) if isinstance(block, Value) else np.squeeze(block, axis)


def dynamic_update_slice_in_dim(operand: Any, update: Any, start_index: Any, axis: int) -> Any:
    """``jax.lax.dynamic_update_slice_in_dim``: :func:`dynamic_update_slice` along one axis."""
    ndim = _ndim("dynamic_update_slice_in_dim", operand)
    axis = normalize_axis("rlx.lax.dynamic_update_slice_in_dim", axis, ndim)
    return dynamic_update_slice(operand, update, [start_index if a == axis else 0 for a in range(ndim)])


def _shape(x: Any) -> tuple[Any, ...]:
    return tuple(x.shape) if isinstance(x, Value) else np.shape(x)


def _ndim(what: str, x: Any) -> int:
    if not isinstance(x, (Value, np.ndarray)):
        raise RlxTypeError(f"rlx.lax.{what}: expected a value of the graph or an array, got {type(x).__name__}")
    return len(_shape(x))


def _slice_sizes(what: str, value: Value, sizes: Any) -> list[int]:
    """Static sizes, one per axis, each at most the axis's size (JAX's rule)."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or len(sizes) != value.ndim:
        raise RlxValueError(f"rlx.lax.{what}: give one size per axis of {value.type}, got {sizes!r}")
    result = []
    for axis, (size, dim) in enumerate(zip(sizes, value.shape, strict=True)):
        if isinstance(size, (Value, bool)) or not isinstance(size, (int, np.integer)):
            raise RlxTypeError(f"rlx.lax.{what}: slice size {axis} must be a Python int, got {size!r}")
        if not isinstance(dim, int):
            raise RlxValueError(f"rlx.lax.{what}: axis {axis} of {value.type} has a symbolic size; slice it statically")
        if not 0 <= int(size) <= dim:
            raise RlxValueError(f"rlx.lax.{what}: slice size {size} does not fit axis {axis} of {value.type}")
        result.append(int(size))
    return result


def _starts(what: str, value: Value, start_indices: Any) -> list[Any]:
    """One start per axis: ints, scalar int values, or the entries of one int vector value."""
    if isinstance(start_indices, Value):
        if start_indices.ndim != 1 or start_indices.shape[0] != value.ndim:
            raise RlxValueError(f"rlx.lax.{what}: start_indices {start_indices.type} must hold one start per axis")
        return [start_indices[axis] for axis in range(value.ndim)]
    if isinstance(start_indices, np.ndarray):
        start_indices = list(start_indices.reshape(-1)) if start_indices.ndim == 1 else start_indices
    if isinstance(start_indices, (str, bytes)) or not isinstance(start_indices, Sequence):
        raise RlxTypeError(
            f"rlx.lax.{what}: start_indices must be a sequence of starts, got {type(start_indices).__name__}"
        )
    if len(start_indices) != value.ndim:
        raise RlxValueError(f"rlx.lax.{what}: {len(start_indices)} start(s) for the {value.ndim} axes of {value.type}")
    return list(start_indices)


def _clamped_start(what: str, value: Value, axis: int, start: Any, size: int) -> int | Value:
    """``start`` clamped into ``[0, dim - size]``: an int, or an int64 scalar value."""
    dim = value.shape[axis]
    assert isinstance(dim, int)  # _slice_sizes refused symbolic sizes
    if isinstance(start, np.ndarray) and start.ndim == 0:
        start = start.item()
    if isinstance(start, Value):
        if start.ndim != 0 or start.dtype.kind != "i":
            raise RlxTypeError(f"rlx.lax.{what}: start {axis} must be a scalar int value, got {start.type}")
        return value.graph.clip(start.astype("int64"), 0, dim - size)
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
        raise RlxTypeError(f"rlx.lax.{what}: start {axis} must be an int or a scalar int value, got {start!r}")
    return min(max(int(start), 0), dim - size)
