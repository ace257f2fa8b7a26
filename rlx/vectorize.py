"""``rlx.vmap``: a function of one example made a function of many, as ``jax.vmap``.

``rlx.vmap(fn, in_axes=0, out_axes=0)(*args)`` runs ``fn`` once for the whole batch: every
array whose ``in_axes`` entry is an int carries the examples along that axis, the others (an
entry of ``None``) are shared by every example, and each result carries the examples along its
``out_axes`` entry. It composes with the other transforms: ``rlx.vmap(rlx.grad(loss), in_axes=
(None, 0, 0))`` gives per-example gradients, ``rlx.grad`` of a function that calls ``rlx.vmap``
differentiates through it, and ``rlx.jit`` compiles either.

How it works: ``fn`` is traced on one example. The examples' values stand in as new graph
inputs of one example's shape, in the graph of the arguments, and every node that ``fn`` adds
and that reads them is then rebuilt for all examples at once by its op's batching rule
(:attr:`rlx.ir.opdef.OpDef.batch`, ``rlx/ops/_batching.py``). The one-example nodes and the
stand-ins are erased afterwards, so the graph ends up as if the batched function had been
written by hand; nodes of ``fn`` that read no example (a weight's transpose) are built once.
Called on arrays rather than values, the vmapped function is jitted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.graph import Graph, Node, Value, _all_or_nothing
from rlx.ir.ops import OpKind
from rlx.ir.types import Dim
from rlx.tracing import OnArrays, _as_array, _flatten, _is_array, _Tree, _unflatten, graph_of

Axes = Any  # an int, None, or a nest of them matching (a prefix of) the arguments' nest


def vmap(fn: Callable[..., Any], in_axes: Axes = 0, out_axes: Axes = 0, axis_size: int | None = None) -> Any:
    """``fn`` mapped over a leading (or ``in_axes``) axis of its arguments; see the module's docstring.

    ``in_axes``: an int or ``None`` for every positional argument, or a tuple or list with one
    entry per positional argument, each an int, ``None`` or a nest matching that argument's.
    Keyword arguments are mapped along their axis 0, as JAX maps them. ``out_axes``: the same
    for the results. ``axis_size``: the number of examples when no argument is mapped.
    """
    if not callable(fn):
        raise RlxTypeError(f"rlx.vmap: expected a function, got {type(fn).__name__}")
    _check_axes_spec(in_axes, "in_axes")
    _check_axes_spec(out_axes, "out_axes")
    if axis_size is not None and (isinstance(axis_size, bool) or not isinstance(axis_size, int) or axis_size < 1):
        raise RlxValueError(f"rlx.vmap: axis_size must be an int >= 1, got {axis_size!r}")
    on_arrays = OnArrays("rlx.vmap")

    @functools.wraps(fn)
    def mapped(*args: Any, **kwargs: Any) -> Any:
        graph = graph_of("rlx.vmap", args, kwargs)
        if graph is None:  # called on arrays: traced and compiled once per shapes
            return on_arrays(mapped, args, kwargs)
        # An error inside fn (or a rule) leaves the graph as it was.
        vectorized = _Vectorized(graph, fn, in_axes, out_axes, axis_size)
        return _all_or_nothing(lambda _: vectorized.call(args, kwargs))(graph)

    return mapped


def _check_axes_spec(spec: Axes, what: str) -> None:
    if spec is None or (isinstance(spec, (int, np.integer)) and not isinstance(spec, bool)):
        return
    if isinstance(spec, (list, tuple)):
        for entry in spec:
            _check_axes_spec(entry, what)
        return
    if isinstance(spec, dict):
        for entry in spec.values():
            _check_axes_spec(entry, what)
        return
    raise RlxTypeError(f"rlx.vmap: {what} must be an int, None, or a tuple, list or dict of them, got {spec!r}")


def _axes_per_leaf(spec: Axes, tree: _Tree, what: str, where: str = "") -> list[int | None]:
    """One axis (or None) per leaf of ``tree``: ``spec`` is an int or None for the whole subtree,
    or a nest of the same structure (JAX's prefix rule)."""
    if spec is None or isinstance(spec, (int, np.integer)):
        return [None if spec is None else int(spec)] * _leaf_count(tree)
    if tree.kind == "leaf":
        raise RlxValueError(f"rlx.vmap: {what}{where} is {spec!r} where the argument is a single array")
    if isinstance(spec, dict) != (tree.kind == "dict") or len(spec) != len(tree.children):
        raise RlxValueError(
            f"rlx.vmap: {what}{where} is {spec!r}, which does not match the structure of the argument "
            f"(a {tree.kind} of {len(tree.children)})"
        )
    entries = [spec[key] for key in tree.keys] if isinstance(spec, dict) else list(spec)
    axes: list[int | None] = []
    for key, entry, child in zip(tree.keys, entries, tree.children, strict=True):
        axes += _axes_per_leaf(entry, child, what, f"{where}[{key!r}]")
    return axes


def _leaf_count(tree: _Tree) -> int:
    return 1 if tree.kind == "leaf" else sum(_leaf_count(child) for child in tree.children)


def _normalized_axis(axis: int, rank: int, what: str) -> int:
    if not -rank <= axis < rank:
        raise RlxValueError(f"rlx.vmap: {what} is {axis}, out of range for rank {rank}")
    return axis % rank


class _Vectorized:
    """One call of a vmapped function on values of ``graph``."""

    def __init__(self, graph: Graph, fn: Callable[..., Any], in_axes: Axes, out_axes: Axes, axis_size: int | None):
        self.graph = graph
        self.fn = fn
        self.in_axes = in_axes
        self.out_axes = out_axes
        self.axis_size = axis_size
        self.name = getattr(fn, "__name__", "a function")

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        graph = self.graph
        first_id = graph._next_id  # every node made from here on is this call's
        arg_leaves: list[tuple[str, object]] = []
        arg_tree = _flatten(tuple(args), "", arg_leaves)
        kw_leaves: list[tuple[str, object]] = []
        kw_tree = _flatten(dict(kwargs), "", kw_leaves)
        spec = self.in_axes
        if isinstance(spec, dict):
            raise RlxTypeError(
                f"rlx.vmap of {self.name}: in_axes must be an int, None, or a tuple or list with an entry per "
                "positional argument (a dict may stand for a dict argument within it)"
            )
        if isinstance(spec, (tuple, list)) and len(spec) != len(args):
            raise RlxValueError(
                f"rlx.vmap of {self.name}: in_axes has {len(spec)} entries for {len(args)} positional arguments"
            )
        axes = _axes_per_leaf(spec, arg_tree, "in_axes") + [0] * len(kw_leaves)

        # The examples' axis of each mapped argument moved to the front, and their count.
        size: Dim | None = self.axis_size
        physical: list[object] = []
        mapped: list[bool] = []
        for (path, leaf), axis in zip(arg_leaves + kw_leaves, axes, strict=True):
            value = self._as_value(leaf)
            if axis is None or not isinstance(value, Value):
                physical.append(value)
                mapped.append(False)
                continue
            where = f"argument {path.lstrip('.') or '0'}"
            if value.ndim == 0:
                raise RlxValueError(f"rlx.vmap of {self.name}: {where} is a scalar, which has no axis {axis} to map")
            axis = _normalized_axis(axis, value.ndim, f"in_axes for {where}")
            if axis:
                value = graph.transpose(value, (axis, *(a for a in range(value.ndim) if a != axis)))
            if size is None:
                size = value.shape[0]
            elif value.shape[0] != size:
                raise RlxValueError(
                    f"rlx.vmap of {self.name}: mapped axes have different sizes: {where} has {value.shape[0]} "
                    f"examples, an earlier one (or axis_size) {size}"
                )
            physical.append(value)
            mapped.append(True)
        if size is None:
            raise RlxValueError(
                f"rlx.vmap of {self.name}: no argument is mapped (every in_axes entry is None): give axis_size"
            )

        # One example's stand-ins, traced through fn.
        stand_ins: dict[Value, Value] = {}
        traced_leaves: list[object] = []
        for value, flag in zip(physical, mapped, strict=True):
            if flag:
                assert isinstance(value, Value)
                stand_in = graph.input(self._fresh_name(), value.shape[1:], dtype=value.dtype)
                stand_ins[stand_in] = value
                traced_leaves.append(stand_in)
            else:
                traced_leaves.append(value)
        traced_args = _unflatten(arg_tree, iter(traced_leaves[: len(arg_leaves)]))
        traced_kwargs = _unflatten(kw_tree, iter(traced_leaves[len(arg_leaves) :]))
        result = self.fn(*traced_args, **traced_kwargs)

        # Every node that reads an example, rebuilt for all of them.
        batched = self._batch_nodes(first_id, stand_ins, size)
        out_leaves: list[tuple[str, object]] = []
        out_tree = _flatten(result, "", out_leaves)
        out_axes = _axes_per_leaf(self.out_axes, out_tree, "out_axes")
        returned = [
            self._output(path, leaf, axis, batched, size)
            for (path, leaf), axis in zip(out_leaves, out_axes, strict=True)
        ]
        self._erase_traced(first_id, set(batched), {v.node for v in returned if isinstance(v, Value)})
        return _unflatten(out_tree, iter(returned))

    def _as_value(self, leaf: object) -> object:
        """Arrays among the arguments become constants of the graph (as JAX takes NumPy arrays
        under a trace); values and everything else stay as they are."""
        if isinstance(leaf, Value):
            if leaf.graph is not self.graph:
                raise RlxValueError(f"rlx.vmap of {self.name}: the arguments are values of different graphs")
            return leaf
        if _is_array(leaf):
            return self.graph.constant(_as_array(leaf))
        return leaf

    def _fresh_name(self) -> str:
        taken = self.graph.inputs
        count = len(taken)
        while f"vmap_example_{count}" in taken:
            count += 1
        return f"vmap_example_{count}"

    def _batch_nodes(self, first_id: int, stand_ins: dict[Value, Value], size: Dim) -> dict[Value, Value]:
        """Each value of this trace that depends on an example, mapped to its batched value."""
        graph = self.graph
        batched: dict[Value, Value] = dict(stand_ins)
        traced = sorted((node for node in graph._nodes.values() if node.id >= first_id), key=lambda n: n.id)
        for node in traced:
            flags = [value in batched for value in node.inputs]
            if node.op is OpKind.INPUT or not any(flags):
                continue
            operands = [batched.get(value, value) for value in node.inputs]
            rule = node.op.definition.batch
            assert rule is not None, f"{node.op} has operands and no batching rule"  # the registry test's contract
            results = rule(graph, node, operands, flags, size)
            for one, many in zip(node.outputs, results, strict=True):
                want = (size, *one.shape)
                if many.shape != want or many.dtype != one.dtype:
                    raise RlxValueError(
                        f"rlx.vmap: the batching rule of {node.op} (node {node.id}) gave {many.type} for {size} "
                        f"examples of {one.type}; expected {one.dtype.name}{list(want)}"
                    )
                batched[one] = many
        return batched

    def _output(self, path: str, leaf: object, axis: int | None, batched: dict[Value, Value], size: Dim) -> object:
        graph = self.graph
        where = f"result {path.lstrip('.') or '0'}"
        if leaf is None:  # an empty subtree, as in JAX
            return None
        if not isinstance(leaf, Value):
            if not isinstance(leaf, (int, float, bool, np.ndarray, np.generic)):
                raise RlxTypeError(f"rlx.vmap of {self.name}: {where} is a {type(leaf).__name__}, not an array")
            leaf = graph.constant(leaf)
        elif leaf.graph is not graph:
            raise RlxValueError(f"rlx.vmap of {self.name}: {where} is a value of another graph")
        assert isinstance(leaf, Value)
        many = batched.get(leaf)
        if axis is None:
            if many is not None:
                raise RlxValueError(
                    f"rlx.vmap of {self.name}: out_axes is None for {where}, but it differs between examples"
                )
            return leaf
        if many is None:  # the same for every example
            many = graph.broadcast_to(leaf, (size, *leaf.shape))
        axis = _normalized_axis(axis, many.ndim, f"out_axes for {where}")
        if axis:
            order = list(range(1, many.ndim))
            order.insert(axis, 0)
            many = graph.transpose(many, tuple(order))
        return many

    def _erase_traced(self, first_id: int, batched: set[Value], kept: set[Node]) -> None:
        """The one-example nodes and stand-ins go; so do nodes of the trace that nothing reads."""
        graph = self.graph
        for node in sorted(graph._nodes.values(), key=lambda n: -n.id):
            if node.id < first_id or node in kept or graph.users(node):
                continue
            if any(graph.output_names_of(value) for value in node.outputs):
                continue
            if node.outputs[0] in batched or node.op is not OpKind.INPUT:
                graph.erase(node)
