"""Reverse-mode autodiff on the graph IR: ``grad(g, y, xs, dy)`` adds the backward nodes to ``g``.

Generic over the op registry: each op's gradient rule (``OpDef.grad``, beside the op in
:mod:`rlx.ops`) maps the cotangents of its results to cotangents of its operands, built from
other graph ops. A value read by several nodes gets the sum of their contributions, so
self-attention ``attention(x, x, x)`` differentiates. ``attention`` emits one single-``wrt``
``attention_bwd`` node per operand; ``rlx.passes.fuse_attention_bwd`` merges them afterwards.

- ``dy`` may be left out when ``y`` is a scalar: the seed is 1. It may also be a Python number
  or a NumPy array of ``y``'s shape (baked in as a constant, as ``y.backward(gradient=...)``).
- An ``x`` that ``y`` does not depend on gets zeros.
- Integer and bool ``xs`` are an ``RlxTypeError``; operands declared ``no_grad`` (mask tensors)
  on the path from xs to y are an ``RlxValueError``, as are ops that cannot be differentiated.

The checks run before a node is added, and a rule that fails midway has its nodes removed, so a
failed ``grad`` leaves the graph as it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir import Graph, Node, OpKind, Value
from rlx.ir.opdef import no_gradient, not_differentiable
from rlx.ops._common import zeros

F32 = np.dtype(np.float32)


def grad(graph: Graph, y: Value, xs: Sequence[Value], dy: Value | float | np.ndarray | None = None) -> list[Value]:
    """Gradient Values of ``y`` w.r.t. each of ``xs`` given the cotangent ``dy`` (same type as ``y``).

    The backward nodes are added to ``graph``; run ``rlx.passes`` afterwards to fuse them.
    """
    seed_array = _seed_array(y, dy) if dy is not None and not isinstance(dy, Value) else None
    _check_arguments(graph, y, xs, dy if isinstance(dy, Value) else None, seeded=seed_array is not None)
    xs = list(xs)
    order = _path(graph, y, xs)
    active = _active_values(order, y, set(xs))
    _check_differentiable(graph, order, active)
    first_new_id = graph._next_id
    try:
        seed = dy if isinstance(dy, Value) else graph.constant(1.0 if seed_array is None else seed_array)
        cotangents = _backward(graph, order, active, y, seed)
        return [cotangents[x] if x in cotangents else zeros(graph, x.shape) for x in xs]
    except Exception:
        _remove_nodes_since(graph, first_new_id)
        raise


def _backward(graph: Graph, order: list[Node], active: set[Value], y: Value, seed: Value) -> dict[Value, Value]:
    cotangents: dict[Value, Value] = {y: seed}
    for node in reversed(order):
        outs = [cotangents.get(value) for value in node.outputs]
        if node.op is OpKind.INPUT or all(ct is None for ct in outs):
            continue
        needed = [value in active and value.dtype == F32 for value in node.inputs]
        if not any(needed):
            continue
        contributions = node.op.definition.grad(graph, node, outs, needed)
        for value, wanted, contribution in zip(node.inputs, needed, contributions, strict=True):
            if not wanted or contribution is None:
                continue
            if contribution.type != value.type:
                raise RlxValueError(
                    f"grad: the rule of {node.op} (node {node.id}) gave a {contribution.type} cotangent "
                    f"for an operand of type {value.type}"
                )
            earlier = cotangents.get(value)
            cotangents[value] = contribution if earlier is None else graph.add(earlier, contribution)
    return cotangents


def _seed_array(y: Value, dy: object) -> np.ndarray:
    """``dy`` given as a number or an array: float32 of exactly ``y``'s shape (no broadcasting)."""
    if isinstance(dy, (bool, np.bool_)) or not isinstance(dy, (int, float, np.number, np.ndarray)):
        raise RlxTypeError(f"grad: dy must be an rlx Value, a number or a NumPy array, got {type(dy).__name__}")
    array = np.asarray(dy)
    if array.dtype.kind not in "fiu":
        raise RlxTypeError(f"grad: dy must hold real numbers, got dtype {array.dtype}")
    shape = y.shape if isinstance(y, Value) else None
    if shape is not None and array.shape != shape:
        raise RlxValueError(f"grad: dy must have the shape of y, expected {shape}, got {array.shape}")
    return array.astype(np.float32)


def _check_arguments(graph: Graph, y: Value, xs: Sequence[Value], dy: Value | None, seeded: bool = False) -> None:
    if not isinstance(graph, Graph):
        raise RlxTypeError(f"grad: graph must be an rlx.Graph, got {type(graph).__name__}")
    if isinstance(xs, Value) or not isinstance(xs, Sequence) or isinstance(xs, str):
        raise RlxTypeError(f"grad: xs must be a list or tuple of Values, got {type(xs).__name__}")
    if not xs:
        raise RlxValueError("grad: xs is empty; name at least one Value to differentiate with respect to")
    named = [("y", y)] + ([("dy", dy)] if dy is not None else []) + [(f"xs[{i}]", x) for i, x in enumerate(xs)]
    for what, value in named:
        if not isinstance(value, Value):
            raise RlxTypeError(f"grad: {what} must be an rlx Value, got {type(value).__name__}")
        if value not in graph:
            raise RlxValueError(f"grad: {what} is not a Value of graph {graph.name!r}")
    if y.dtype != F32:
        raise RlxTypeError(f"grad: y must be a float32 value, got {_describe(graph, y)} of type {y.type}")
    for i, x in enumerate(xs):
        if x.dtype != F32:
            raise RlxTypeError(f"grad: xs[{i}] ({_describe(graph, x)}) is {x.type}; only float32 values have gradients")
    if dy is None and not seeded:
        if y.shape != ():
            raise RlxValueError(
                f"grad: y has shape {y.shape}, so dy is needed (it may be left out only for a scalar y)"
            )
    elif dy is not None and dy.type != y.type:
        raise RlxValueError(f"grad: dy must have the type of y, expected {y.type}, got {dy.type}")


def _path(graph: Graph, y: Value, xs: Sequence[Value]) -> list[Node]:
    """The nodes a gradient can flow through from ``y`` to some x, in the graph's order.

    Found from both ends, never by a walk of the whole graph: the nodes downstream of the xs,
    then among them the ones ``y`` reaches back through float operands of ops that pass a
    gradient. So the cost follows the path, not the graph: what a deep model's every
    ``rlx.checkpoint`` (an ``rlx.grad`` of its own region) would otherwise pay for each layer.
    Sorted by the graph's order, the path visits the nodes as a walk of the whole graph would,
    so the fan-out cotangents are summed in the same order.
    """
    downstream = graph._descendants({x.node.id for x in xs})
    found: set[int] = set()
    stack = [y.node] if y.node.id in downstream else []
    while stack:
        node = stack.pop()
        if node.id in found:
            continue
        found.add(node.id)
        stack.extend(v.node for v in _gradient_operands(node) if v.node.id in downstream)
    place = graph._place()
    return [graph._nodes[i] for i in sorted(found, key=place.__getitem__)]


def _active_values(path: list[Node], y: Value, xs: set[Value]) -> set[Value]:
    """Values on a path from some x to y (xs and y included when connected): the ones that
    depend on an x and that y reaches back through float operands of ops that pass gradients."""
    depends: set[Value] = set(xs)
    for node in path:
        if any(value in depends for value in node.inputs):
            depends.update(node.outputs)
    reaches: set[Value] = {y}
    for node in reversed(path):
        if any(value in reaches for value in node.outputs):
            reaches.update(_gradient_operands(node))
    return depends & reaches


def _gradient_operands(node: Node) -> list[Value]:
    """The operands a gradient can reach through ``node``: float ones, of an op that passes one."""
    if node.op.definition.grad is no_gradient:
        return []
    return [value for value in node.inputs if value.dtype == F32]


def _check_differentiable(graph: Graph, order: list[Node], active: set[Value]) -> None:
    """Refuse, before emitting anything, what the rules cannot do: no-grad operands, opaque ops."""
    for node in order:
        slots = [slot for slot, value in enumerate(node.inputs) if value in active and value.dtype == F32]
        if node.op is OpKind.INPUT or not slots or not any(value in active for value in node.outputs):
            continue
        definition = node.op.definition
        if definition.grad is not_differentiable:
            raise RlxValueError(f"grad: no gradient rule for {node.op} (node {node.id}) on the path from xs to y")
        for slot in slots:
            name = definition.operand_name(slot)
            if name in definition.no_grad:
                value = node.inputs[slot]
                raise RlxValueError(
                    f"grad: operand {name!r} of {node.op} gets no gradient (node {node.id}), but "
                    f"{_describe(graph, value)} reaches y through it"
                )


def _remove_nodes_since(graph: Graph, first_id: int) -> None:
    """Erase the nodes a failed ``grad`` added (ids from ``first_id`` on), users first."""
    for node in reversed(graph.nodes):
        if node.id >= first_id:
            graph.erase(node)


def _describe(graph: Graph, value: Value) -> str:
    """``input 'q'`` or ``output 0 of node 5 (attention)``, for error messages."""
    node = value.node
    if node.op is OpKind.INPUT:
        return f"input {node.attrs.name!r}"
    return f"output {value.index} of node {node.id} ({node.op})"
