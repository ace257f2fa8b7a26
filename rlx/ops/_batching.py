"""Batching rules for ``rlx.vmap``, shared by the op modules (each op names its rule in its
``OpDef``; see :data:`rlx.ir.opdef.BatchFn`).

A rule receives the node to batch, its operands (a batched one carries the examples on a new
leading axis of ``size``; the others are shared by every example) and returns the node's results
for all examples at once, each with the examples on its leading axis. Most ops need no more than
one of the rules below: broadcasting (elementwise ops), moving their axis attributes one place
on (reductions, scans, softmax, split and concat, ...), acting on their trailing axes as they
already do on a stack (linear algebra, sort), or folding the examples into an existing leading
batch axis (attention, convolution). An op for which none fits is batched by
:func:`batch_by_unrolling`: once per example, stacked. That is always right, and it is the only
rule that needs a static number of examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlx.errors import RlxValueError
from rlx.ir.dims import dim_text, exact_quotient, poly, product
from rlx.ir.opdef import BatchFn

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value
    from rlx.ir.types import Dim


def with_examples(graph: Graph, value: Value, batched: bool, size: Dim) -> Value:
    """``value`` with the examples on its leading axis: a shared operand is broadcast (a view)."""
    return value if batched else graph.broadcast_to(value, (size, *value.shape))


def all_with_examples(graph: Graph, operands: Sequence[Value], batched: Sequence[bool], size: Dim) -> list[Value]:
    return [with_examples(graph, value, flag, size) for value, flag in zip(operands, batched, strict=True)]


def again(graph: Graph, node: Node, operands: Sequence[Value], attrs: object = None) -> tuple[Value, ...]:
    """``node``'s op once more, on other operands (and, if given, other attrs)."""
    return graph.add_node(node.op, operands, node.attrs if attrs is None else attrs).outputs


def to_rank(graph: Graph, value: Value, rank: int) -> Value:
    """A batched ``value`` whose examples have ``rank`` axes: ones inserted after the examples' axis,
    so that it broadcasts against shared operands of that rank as each example would."""
    missing = rank - (value.ndim - 1)
    if missing <= 0:
        return value
    return graph.reshape(value, (value.shape[0], *(1,) * missing, *value.shape[1:]))


def batch_elementwise(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> tuple[Value, ...]:
    """Elementwise ops broadcast: batched operands get the result's rank, shared ones stay."""
    rank = node.outputs[0].ndim
    aligned = [to_rank(graph, value, rank) if flag else value for value, flag in zip(operands, batched, strict=True)]
    return again(graph, node, aligned)


def batch_trailing(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> tuple[Value, ...]:
    """Ops that act on their operands' trailing axes and map over any leading ones (a stack of
    matrices, the last axis of a sort): every operand gets the examples' axis in front."""
    return again(graph, node, all_with_examples(graph, operands, batched, size))


def batch_moving_axes(*fields: str) -> BatchFn:
    """Ops whose attrs name operand axes (non-negative, as builders store them) in ``fields``:
    every operand gets the examples' axis in front, and every named axis moves one place on."""

    def rule(
        graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
    ) -> Sequence[Value]:
        changes: dict[str, object] = {}
        for name in fields:
            axes = getattr(node.attrs, name)
            changes[name] = tuple(axis + 1 for axis in axes) if isinstance(axes, tuple) else axes + 1
        return again(
            graph, node, all_with_examples(graph, operands, batched, size), dataclasses.replace(node.attrs, **changes)
        )

    return rule


def merge_examples(graph: Graph, value: Value) -> Value:
    """A batched value with the examples' axis folded into the next one (``[n, b, ...] -> [n*b, ...]``)."""
    merged = dim_text(product(value.shape[:2]))
    return graph.reshape(value, (merged, *value.shape[2:]))


def split_examples(graph: Graph, value: Value, size: Dim) -> Value:
    """``merge_examples`` undone: ``[n*b, ...] -> [n, b, ...]``."""
    inner = exact_quotient(poly(value.shape[0]), poly(size))
    assert inner is not None
    return graph.reshape(value, (size, dim_text(inner), *value.shape[1:]))


def batch_into_leading(*slots: int) -> BatchFn:
    """Ops with a leading batch axis of their own on the operands in ``slots`` (all if none is
    named: attention's q, k, v, dy and mask; a convolution's images) and on every result: the
    examples are folded into it. The other operands (a convolution's weight) must be shared, else
    the op is unrolled."""

    def rule(
        graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
    ) -> Sequence[Value]:
        folded = slots or tuple(range(len(operands)))
        if any(flag for slot, flag in enumerate(batched) if slot not in folded):
            return batch_by_unrolling(graph, node, operands, batched, size)
        merged = [
            merge_examples(graph, with_examples(graph, value, flag, size)) if slot in folded else value
            for slot, (value, flag) in enumerate(zip(operands, batched, strict=True))
        ]
        return tuple(split_examples(graph, result, size) for result in again(graph, node, merged))

    return rule


def batch_by_unrolling(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> tuple[Value, ...]:
    """The op once per example, the results stacked: right for any op, and the rule of ops whose
    examples cannot share one node (a programmable attention, whose mods may read the batch
    index; a fused chain, made after tracing) or whose other rule needs a static count."""
    if not isinstance(size, int):
        raise RlxValueError(
            f"rlx.vmap: {node.op} (node {node.id}) is batched one example at a time, which needs a static number of "
            f"examples; got the symbolic {size!r}"
        )
    per_example: list[list[Value]] = [[] for _ in node.types]
    for i in range(size):
        sliced = [value[i] if flag else value for value, flag in zip(operands, batched, strict=True)]
        for results, result in zip(per_example, again(graph, node, sliced), strict=True):
            results.append(result)
    return tuple(graph.stack(results, axis=0) for results in per_example)
