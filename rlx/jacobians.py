"""``rlx.vjp``, ``rlx.jvp``, ``rlx.jacrev``, ``rlx.jacfwd`` and ``rlx.hessian``, as JAX's.

All of them are built from the two transforms rlx has, reverse-mode gradients
(:func:`rlx.autodiff.grad`, of any order) and :func:`rlx.vmap`:

- ``vjp``: the gradient with the cotangent as its seed.
- ``jvp``: a Jacobian-vector product as the gradient of a gradient. ``J^T u`` is linear in
  ``u``, so ``J v`` is the gradient of ``<J^T u, v>`` with respect to ``u`` (at ``u = 0``).
- ``jacrev``: ``vjp`` mapped over the rows of an identity, one per entry of the result.
- ``jacfwd``: ``jvp`` mapped over the columns of an identity, one per entry of the argument.
- ``hessian``: ``jacfwd(jacrev(fn))``.

Called on values (inside ``rlx.jit``, or on a graph's values) they build into that graph;
called on arrays, they are jitted, once per shapes.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.graph import Graph, Value
from rlx.ops._common import zeros
from rlx.tracing import (
    Jitted,
    OnArrays,
    _argnums,
    _as_array,
    _flatten,
    _is_array,
    _split_aux,
    _Tree,
    _unflatten,
    call_jitted,
    graph_of,
)

# ----------------------------------------------------------------------------- helpers


def _float_leaves(what: str, nest: Any, label: str) -> tuple[_Tree, list[Value]]:
    leaves: list[tuple[str, object]] = []
    tree = _flatten(nest, "", leaves)
    values = []
    for path, leaf in leaves:
        if not isinstance(leaf, Value) or leaf.dtype != np.float32:
            kind = leaf.type if isinstance(leaf, Value) else type(leaf).__name__
            raise RlxTypeError(f"{what}: {label}{path} is {kind}; only float arrays are differentiated")
        values.append(leaf)
    return tree, values


def _as_operand(graph: Graph, what: str, leaf: object, like: Value, label: str) -> Value:
    """A cotangent or tangent given as a value, an array or a number: a value of ``like``'s type."""
    if isinstance(leaf, Value):
        value = leaf
    elif _is_array(leaf) or isinstance(leaf, (int, float, np.number)):
        array = _as_array(np.asarray(leaf))
        value = graph.constant(array.astype(np.float32))
    else:
        raise RlxTypeError(f"{what}: {label} is a {type(leaf).__name__}, not an array")
    if value.shape != like.shape:
        if value.shape == ():
            return graph.broadcast_to(graph.cast(value, "float32"), like.shape)
        raise RlxValueError(f"{what}: {label} has shape {value.shape}, where {like.shape} is expected")
    return value if value.dtype == like.dtype else graph.cast(value, "float32")


def _matching(what: str, tree: _Tree, nest: Any, label: str) -> list[object]:
    leaves: list[tuple[str, object]] = []
    given = _flatten(nest, "", leaves)
    if given != tree:
        raise RlxValueError(f"{what}: {label} must have the structure of the values it goes with")
    return [leaf for _, leaf in leaves]


def _sum_of_products(graph: Graph, pairs: Sequence[tuple[Value, Value]]) -> Value:
    total: Value | None = None
    for a, b in pairs:
        term = graph.sum(a * b)
        total = term if total is None else total + term
    assert total is not None
    return total


def _graph_grad(graph: Graph, y: Value, xs: list[Value], dy: Value | None = None) -> list[Value]:
    from rlx.autodiff import grad

    return grad(graph, y, xs, dy)


_JITTED: weakref.WeakKeyDictionary[Callable[..., Any], dict[Any, Jitted]] = weakref.WeakKeyDictionary()


def _jitted_for(fn: Callable[..., Any], key: Any, make: Callable[[], Callable[..., Any]]) -> Jitted:
    """One jitted function per (``fn``, ``key``), kept while ``fn`` lives: calls on arrays of
    the same shapes compile once."""
    try:
        cache = _JITTED.setdefault(fn, {})
    except TypeError:  # not weakly referable: a fresh one each time
        return Jitted(make())
    if key not in cache:
        cache[key] = Jitted(make())
    return cache[key]


# ----------------------------------------------------------------------------- vjp, jvp


def vjp(fn: Callable[..., Any], *primals: Any, has_aux: bool = False) -> Any:
    """``(fn(*primals), vjp_fn)`` (and ``aux`` with ``has_aux``), as ``jax.vjp``: ``vjp_fn(ct)``,
    ``ct`` of the result's structure, gives a tuple with the cotangent of each primal."""
    if not callable(fn):
        raise RlxTypeError(f"rlx.vjp: expected a function, got {type(fn).__name__}")
    graph = graph_of("rlx.vjp", primals)
    if graph is None:
        return _vjp_of_arrays(fn, primals, has_aux)
    out, aux = _split_aux(fn(*primals), has_aux)
    out_tree, outs = _float_leaves("rlx.vjp", out, "the result")
    _, xs = _float_leaves("rlx.vjp", primals, "primal")
    primal_trees = [_flatten(p, "", []) for p in primals]

    def vjp_fn(ct: Any) -> tuple[Any, ...]:
        cts = [
            _as_operand(graph, "rlx.vjp", leaf, like, "the cotangent")
            for leaf, like in zip(_matching("rlx.vjp", out_tree, ct, "the cotangent"), outs, strict=True)
        ]
        if len(outs) == 1:
            grads = _graph_grad(graph, outs[0], xs, cts[0])
        else:
            grads = _graph_grad(graph, _sum_of_products(graph, list(zip(outs, cts, strict=True))), xs)
        it = iter(grads)
        return tuple(_unflatten(tree, it) for tree in primal_trees)

    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def _vjp_of_arrays(fn: Callable[..., Any], primals: tuple[Any, ...], has_aux: bool) -> Any:
    forward = _jitted_for(fn, ("vjp-forward", has_aux), lambda: fn)
    backward = _jitted_for(
        fn, ("vjp-backward", has_aux), lambda: lambda primals, ct: vjp(fn, *primals, has_aux=has_aux)[1](ct)
    )
    result = call_jitted(forward, "rlx.vjp", primals, {})
    out, aux = _split_aux(result, has_aux)

    def vjp_fn(ct: Any) -> tuple[Any, ...]:
        return call_jitted(backward, "rlx.vjp", (tuple(primals), ct), {})  # type: ignore[no-any-return]

    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def jvp(fn: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any], has_aux: bool = False) -> Any:
    """``(fn(*primals), J @ tangents)`` (and ``aux``), as ``jax.jvp``; ``primals`` and
    ``tangents`` are tuples or lists of the same structure."""
    if not callable(fn):
        raise RlxTypeError(f"rlx.jvp: expected a function, got {type(fn).__name__}")
    if not isinstance(primals, (tuple, list)) or not isinstance(tangents, (tuple, list)):
        raise RlxTypeError("rlx.jvp: primals and tangents must be tuples (or lists) of the function's arguments")
    if len(primals) != len(tangents):
        raise RlxValueError(f"rlx.jvp: {len(primals)} primals but {len(tangents)} tangents")
    graph = graph_of("rlx.jvp", primals, tangents)
    if graph is None:
        jitted = _jitted_for(fn, ("jvp", has_aux), lambda: lambda p, t: jvp(fn, p, t, has_aux))
        return call_jitted(jitted, "rlx.jvp", (tuple(primals), tuple(tangents)), {})
    out, aux = _split_aux(fn(*primals), has_aux)
    out_tree, outs = _float_leaves("rlx.jvp", out, "the result")
    primal_tree, xs = _float_leaves("rlx.jvp", tuple(primals), "primal")
    ts = [
        _as_operand(graph, "rlx.jvp", leaf, like, "a tangent")
        for leaf, like in zip(_matching("rlx.jvp", primal_tree, tuple(tangents), "tangents"), xs, strict=True)
    ]
    # J^T u for a u that stands for any cotangent (zeros: only its place in the graph matters),
    # then J t as the gradient of <J^T u, t> with respect to u.
    us = [zeros(graph, value.shape) for value in outs]
    transposed = _graph_grad(graph, _sum_of_products(graph, list(zip(outs, us, strict=True))), xs)
    tangent_out = _graph_grad(graph, _sum_of_products(graph, list(zip(transposed, ts, strict=True))), us)
    result = (out, _unflatten(out_tree, iter(tangent_out)))
    return (*result, aux) if has_aux else result


# ----------------------------------------------------------------------------- Jacobians


def _entries(shape: tuple[Any, ...], what: str) -> int:
    if not all(isinstance(d, int) for d in shape):
        raise RlxValueError(f"{what}: a Jacobian needs static shapes, got {shape}")
    return math.prod(shape)


def jacrev(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """The Jacobian of ``fn`` by reverse mode, as ``jax.jacrev``: for a result of shape ``O``
    and an argument leaf of shape ``X``, an array ``O + X``; one ``vjp`` per entry of the
    result, mapped by ``rlx.vmap``. Results nest as the result's structure around the arguments'."""
    return _jacobian("rlx.jacrev", fn, argnums, has_aux, forward=False)


def jacfwd(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """The Jacobian of ``fn`` by forward mode, as ``jax.jacfwd``: as :func:`jacrev`, but one
    ``jvp`` per entry of the argument (fewer when arguments are smaller than results)."""
    return _jacobian("rlx.jacfwd", fn, argnums, has_aux, forward=True)


def hessian(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """``jacfwd(jacrev(fn))``, as ``jax.hessian``: for a scalar ``fn`` and an argument of shape
    ``X``, an array ``X + X``."""
    return jacfwd(jacrev(fn, argnums, has_aux), argnums, has_aux)


def _jacobian(
    what: str, fn: Callable[..., Any], argnums: int | Sequence[int], has_aux: bool, forward: bool
) -> Callable[..., Any]:
    if not callable(fn):
        raise RlxTypeError(f"{what}: expected a function, got {type(fn).__name__}")
    positions = _argnums(argnums)
    on_arrays = OnArrays(what)

    @functools.wraps(fn)
    def jacobian(*args: Any, **kwargs: Any) -> Any:
        graph = graph_of(what, args, kwargs)
        if graph is None:
            return on_arrays(jacobian, args, kwargs)
        for position in positions:
            if position >= len(args):
                raise RlxValueError(f"{what}: argnums {position}, but only {len(args)} positional arguments")

        def of_chosen(*chosen: Any) -> Any:
            full = list(args)
            for position, value in zip(positions, chosen, strict=True):
                full[position] = value
            return fn(*full, **kwargs)

        chosen = tuple(args[p] for p in positions)
        build = _forward_jacobian if forward else _reverse_jacobian
        jac, aux = build(graph, what, of_chosen, chosen, has_aux)
        # The one argument's nest for an int argnums, else a tuple over the arguments.
        jac = _map_out(jac, (lambda blocks: blocks[0]) if isinstance(argnums, int) else tuple)
        return (jac, aux) if has_aux else jac

    return jacobian


class _PerArg(tuple):  # type: ignore[type-arg]
    """The Jacobian blocks of one result leaf, one per chosen argument (told apart from the
    result's own tuples)."""


def _map_out(nest: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to each result leaf's blocks, through the result's structure."""
    if isinstance(nest, _PerArg):
        return fn(nest)
    if isinstance(nest, dict):
        return {k: _map_out(v, fn) for k, v in nest.items()}
    if isinstance(nest, (list, tuple)):
        return type(nest)(_map_out(v, fn) for v in nest)
    return fn(nest)


def _reverse_jacobian(
    graph: Graph, what: str, fn: Callable[..., Any], chosen: tuple[Any, ...], has_aux: bool
) -> tuple[Any, Any]:
    from rlx.vectorize import vmap

    out, vjp_fn, *rest = vjp(fn, *chosen, has_aux=has_aux)
    aux = rest[0] if has_aux else None
    out_leaves: list[tuple[str, object]] = []
    out_tree = _flatten(out, "", out_leaves)
    outs = [leaf for _, leaf in out_leaves if isinstance(leaf, Value)]
    if len(outs) != len(out_leaves):
        raise RlxTypeError(f"{what}: the function must return arrays (values of the graph)")
    blocks = []
    for k, o in enumerate(outs):
        n = _entries(o.shape, what)
        rows = graph.constant(np.eye(n, dtype=np.float32).reshape(n, *o.shape))

        def pull(row: Value, k: int = k) -> Any:
            cts = [row if j == k else zeros(graph, v.shape) for j, v in enumerate(outs)]
            return vjp_fn(_unflatten(out_tree, iter(cts)))

        per_arg = vmap(pull)(rows)  # a tuple over the chosen arguments of nests [n, *X]
        blocks.append(_PerArg(_reshape_nest(graph, arg, o.shape) for arg in per_arg))
    return _unflatten(out_tree, iter(blocks)), aux


def _forward_jacobian(
    graph: Graph, what: str, fn: Callable[..., Any], chosen: tuple[Any, ...], has_aux: bool
) -> tuple[Any, Any]:
    from rlx.vectorize import vmap

    primal_tree, xs = _float_leaves(what, chosen, "argument")
    out, aux = _split_aux(fn(*chosen), has_aux)  # the result's structure (nodes unused: dce drops them)
    out_leaves: list[tuple[str, object]] = []
    out_tree = _flatten(out, "", out_leaves)
    per_out: list[list[Value]] = [[] for _ in out_leaves]
    for i, x in enumerate(xs):
        n = _entries(x.shape, what)
        columns = graph.constant(np.eye(n, dtype=np.float32).reshape(n, *x.shape))

        def push(column: Value, i: int = i) -> Any:
            ts = [column if j == i else zeros(graph, v.shape) for j, v in enumerate(xs)]
            return jvp(lambda *c: _split_aux(fn(*c), has_aux)[0], chosen, _unflatten(primal_tree, iter(ts)))[1]

        tangents = vmap(push)(columns)  # the result's structure of [n, *O]
        leaves: list[tuple[str, object]] = []
        _flatten(tangents, "", leaves)
        for k, (_, leaf) in enumerate(leaves):
            assert isinstance(leaf, Value)
            moved = graph.transpose(leaf, (*range(1, leaf.ndim), 0))  # [*O, n]
            per_out[k].append(graph.reshape(moved, (*leaf.shape[1:], *x.shape)))
    arg_trees = [_flatten(c, "", []) for c in chosen]
    blocks = []
    for jacs in per_out:
        it = iter(jacs)
        blocks.append(_PerArg(_unflatten(tree, it) for tree in arg_trees))
    return _unflatten(out_tree, iter(blocks)), aux


def _reshape_nest(graph: Graph, nest: Any, out_shape: tuple[Any, ...]) -> Any:
    """Each ``[n, *X]`` leaf of ``nest`` as ``[*O, *X]``."""
    leaves: list[tuple[str, object]] = []
    tree = _flatten(nest, "", leaves)
    shaped = []
    for _, leaf in leaves:
        assert isinstance(leaf, Value)
        shaped.append(graph.reshape(leaf, (*out_shape, *leaf.shape[1:])))
    return _unflatten(tree, iter(shaped))
