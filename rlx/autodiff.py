"""Reverse-mode autodiff on the graph IR: ``grad(g, y, xs, dy)`` adds the backward nodes to ``g``.

One gradient rule per op kind in :data:`GRAD_RULES`. ``attention`` emits one single-``wrt``
``attention_bwd`` node per operand that needs a gradient; ``rlx.passes.fuse_attention_bwd``
merges them afterwards, so the rules stay simple and the fusion stays in one place.

Limits, by design until the IR grows the ops they need:

- A value that would receive two cotangents (read twice on the way to ``y``, e.g. self-attention
  ``attention(x, x, x)``) raises ``RlxValueError``: summing them needs an add op.
- An ``x`` that ``y`` does not depend on raises ``RlxValueError`` (zeros need a constant op).
- Mask tensors get no gradient: asking for one raises ``RlxValueError``.

Every check runs before a node is added, so a failed ``grad`` leaves the graph unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir import AttentionAttrs, AttentionBwdAttrs, Graph, InputAttrs, Node, OpKind, Value, Wrt

GradRule = Callable[[Graph, Node, Sequence[Value | None], Sequence[bool]], list[Value | None]]
"""``rule(graph, node, output_cotangents, needs_grad_per_operand) -> cotangent per operand``."""

# Operand slots that never receive a gradient, per op kind (checked before any node is emitted).
NO_GRAD_SLOTS: dict[OpKind, frozenset[int]] = {OpKind.ATTENTION: frozenset({3})}

OPERAND_NAMES: dict[OpKind, tuple[str, ...]] = {
    OpKind.ATTENTION: ("q", "k", "v", "mask_input"),
    OpKind.ATTENTION_BWD: ("q", "k", "v", "dy", "mask_input"),
}


def _attention_grad(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """dQ, dK, dV as separate single-``wrt`` nodes sharing the forward's mask, layout and mask tensor."""
    attrs = node.attrs
    assert isinstance(attrs, AttentionAttrs)
    (dy,) = cotangents
    assert dy is not None
    q, k, v = node.inputs[:3]
    mask_input = node.inputs[3:]
    grads: list[Value | None] = [None] * len(node.inputs)
    for slot, flag in enumerate((Wrt.QUERY, Wrt.KEY, Wrt.VALUE)):
        if needed[slot]:
            bwd_attrs = AttentionBwdAttrs(wrt=flag, mask=attrs.mask, layout=attrs.layout)
            grads[slot] = graph.add_node(OpKind.ATTENTION_BWD, (q, k, v, dy, *mask_input), bwd_attrs).outputs[0]
    return grads


GRAD_RULES: dict[OpKind, GradRule] = {
    OpKind.ATTENTION: _attention_grad,
}


def grad(graph: Graph, y: Value, xs: Sequence[Value], dy: Value) -> list[Value]:
    """Gradient Values of ``y`` w.r.t. each of ``xs`` given the cotangent ``dy`` (same type as ``y``).

    The backward nodes are added to ``graph``; run ``rlx.passes`` afterwards to fuse them.
    """
    _check_arguments(graph, y, xs, dy)
    xs = list(xs)
    order = graph.nodes
    active = _active_values(order, y, set(xs))
    for x in xs:
        if x not in active:
            raise RlxValueError(
                f"grad: y ({_describe(graph, y)}) does not depend on x {_describe(graph, x)}; rlx has no zeros "
                "op to return for it, so leave it out of xs"
            )
    _check_differentiable(graph, order, active)

    cotangents: dict[Value, Value] = {y: dy}
    for node in reversed(order):
        outs = [cotangents.get(value) for value in node.outputs]
        if node.op is OpKind.INPUT or all(ct is None for ct in outs):
            continue
        needed = [value in active for value in node.inputs]
        if not any(needed):
            continue
        for value, contribution in zip(node.inputs, GRAD_RULES[node.op](graph, node, outs, needed), strict=True):
            if contribution is not None:
                cotangents[value] = contribution  # _check_differentiable ruled out a second contribution
    return [cotangents[x] for x in xs]


def _check_arguments(graph: Graph, y: Value, xs: Sequence[Value], dy: Value) -> None:
    if not isinstance(graph, Graph):
        raise RlxTypeError(f"grad: graph must be an rlx.Graph, got {type(graph).__name__}")
    if isinstance(xs, Value) or not isinstance(xs, Sequence) or isinstance(xs, str):
        raise RlxTypeError(f"grad: xs must be a list or tuple of Values, got {type(xs).__name__}")
    if not xs:
        raise RlxValueError("grad: xs is empty; name at least one Value to differentiate with respect to")
    for what, value in [("y", y), ("dy", dy)] + [(f"xs[{i}]", x) for i, x in enumerate(xs)]:
        if not isinstance(value, Value):
            raise RlxTypeError(f"grad: {what} must be an rlx Value, got {type(value).__name__}")
        if value not in graph:
            raise RlxValueError(f"grad: {what} is not a Value of graph {graph.name!r}")
    if dy.type != y.type:
        raise RlxValueError(f"grad: dy must have the type of y, expected {y.type}, got {dy.type}")


def _active_values(order: list[Node], y: Value, xs: set[Value]) -> set[Value]:
    """Values on a path from some x to y (xs and y included when connected)."""
    depends: set[Value] = set(xs)
    for node in order:
        if any(value in depends for value in node.inputs):
            depends.update(node.outputs)
    reaches: set[Value] = {y}
    for node in reversed(order):
        if any(value in reaches for value in node.outputs):
            reaches.update(node.inputs)
    return depends & reaches


def _check_differentiable(graph: Graph, order: list[Node], active: set[Value]) -> None:
    """Refuse, before emitting anything, what the rules cannot do: unknown ops, masks, fan-out."""
    readers: dict[Value, list[str]] = {}
    for node in order:
        slots = [slot for slot, value in enumerate(node.inputs) if value in active]
        if node.op is OpKind.INPUT or not slots or not any(value in active for value in node.outputs):
            continue
        if node.op not in GRAD_RULES:
            raise RlxValueError(f"grad: no gradient rule for {node.op} (node {node.id}) on the path from xs to y")
        for slot in slots:
            value = node.inputs[slot]
            names = OPERAND_NAMES.get(node.op, ())
            where = f"node {node.id} ({node.op}) operand {names[slot] if slot < len(names) else slot}"
            if slot in NO_GRAD_SLOTS.get(node.op, frozenset()):
                raise RlxValueError(
                    f"grad: mask tensors get no gradient, but {_describe(graph, value)} reaches y through {where}"
                )
            readers.setdefault(value, []).append(where)
    for value, places in readers.items():
        if len(places) > 1:
            raise RlxValueError(
                f"grad: {_describe(graph, value)} is read {len(places)} times on the way to y ({'; '.join(places)}); "
                "summing its gradient contributions needs an add op, which the IR does not have yet"
            )


def _describe(graph: Graph, value: Value) -> str:
    """``input 'q'`` or ``output 0 of node 5 (attention)``, for error messages."""
    node = value.node
    if node.op is OpKind.INPUT and isinstance(node.attrs, InputAttrs):
        return f"input {node.attrs.name!r}"
    return f"output {value.index} of node {node.id} ({node.op})"
