"""Ops that read integer indices: ``embedding`` (and its scatter-add gradient), ``one_hot``, ``cross_entropy``.

Every index operand is declared in :attr:`OpDef.index_operands`, so the executable and the
reference check ids against their bound before anything reads memory with them (ids the graph
computes, which only the call knows, are checked by the gathers' kernels: see
:class:`rlx.ir.opdef.IndexOperand`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.dims import parse_dim
from rlx.ir.opdef import EvalContext, IndexOperand, OpDef, no_gradient, register_op
from rlx.ir.types import Dim, TensorType
from rlx.ops._batching import again, all_with_examples, batch_trailing
from rlx.ops._common import BOOL, F32, INT_DTYPES, as_value, op_kind, reciprocal_count, require_float, require_int
from rlx.ops.elementwise import NoAttrs

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class CountAttrs:
    count: int  # classes (one_hot)


@dataclass(frozen=True)
class RowsAttrs:
    count: Dim  # rows of the table embedding_grad makes: symbolic for a table of a call's size


def check_indices(what: str, ids: np.ndarray, limit: int, meaning: str) -> None:
    """``RlxValueError`` naming ``what`` unless every entry of ``ids`` is in ``[0, limit)``."""
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise RlxValueError(f"{what}: {meaning} {bad} is out of range [0, {limit})")


# ----------------------------------------------------------------------------- embedding


def _embedding_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    table, ids = inputs
    if table.dtype not in (F32, BOOL, *INT_DTYPES):
        require_float(what, "table", table)
    require_int(what, "ids", ids)
    if table.rank != 2:
        raise RlxValueError(f"{what}: table must be [V, E], got {table}")
    return (TensorType((*ids.shape, table.shape[1]), table.dtype),)


def _embedding_reference(args: Sequence[np.ndarray], attrs: NoAttrs, ctx: EvalContext) -> np.ndarray:
    table, ids = args
    check_indices("embedding", ids, table.shape[0], "token id")
    return table[ids]


def _embedding_grad(
    graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    dy = cts[0]
    assert dy is not None
    table, ids = node.inputs
    if table.dtype != F32:  # rows of an int or bool table: nothing to differentiate
        return [None, None]
    return [embedding_grad(graph, dy, ids, table.shape[0]), None]


def embedding(graph: Graph, table: object, ids: object) -> Value:
    """Rows of ``table [V, E]`` picked by integer ``ids [...]``: ``[..., E]``, in the table's
    dtype (float32, or int and bool tables, as ``numpy.take`` of rows; only float tables have
    gradients)."""
    operands = [as_value(graph, table, "embedding: table"), as_value(graph, ids, "embedding: ids")]
    return graph.add_node(op_kind("embedding"), operands, NoAttrs()).outputs[0]


def _embedding_grad_infer(what: str, inputs: Sequence[TensorType], attrs: RowsAttrs) -> tuple[TensorType, ...]:
    dy, ids = inputs
    require_float(what, "dy", dy)
    require_int(what, "ids", ids)
    if dy.shape[:-1] != ids.shape or dy.rank != ids.rank + 1:
        raise RlxValueError(f"{what}: dy must be [*ids.shape, E] for ids {ids}, got {dy}")
    if isinstance(attrs.count, str) and parse_dim(attrs.count) != attrs.count:
        raise RlxValueError(f"{what}: count must be an int or a symbolic dimension, got {attrs.count!r}")
    if isinstance(attrs.count, int) and attrs.count < 1:
        raise RlxValueError(f"{what}: count must be >= 1, got {attrs.count}")
    return (TensorType((attrs.count, dy.shape[-1]), F32),)


def _embedding_grad_reference(args: Sequence[np.ndarray], attrs: RowsAttrs, ctx: EvalContext) -> np.ndarray:
    dy, ids = args
    (rows,) = ctx.resolve((attrs.count,))
    check_indices("embedding_grad", ids, rows, "token id")
    out = np.zeros((rows, dy.shape[-1]))
    np.add.at(out, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))
    return out


def _embedding_grad_grad(
    graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    assert cts[0] is not None
    return [graph.embedding(cts[0], node.inputs[1]), None]


def embedding_grad(graph: Graph, dy: object, ids: object, num_embeddings: Dim) -> Value:
    """Scatter-add rows of ``dy [..., E]`` into ``[num_embeddings, E]`` at ``ids``: embedding's
    gradient (``num_embeddings`` an int, or a symbolic dimension such as ``"V"``)."""
    operands = [as_value(graph, dy, "embedding_grad: dy"), as_value(graph, ids, "embedding_grad: ids")]
    if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, (int, np.integer, str)):
        kind = type(num_embeddings).__name__
        raise RlxTypeError(f"embedding_grad: num_embeddings must be an int or a symbolic dimension, got {kind}")
    rows = num_embeddings if isinstance(num_embeddings, str) else int(num_embeddings)
    return graph.add_node(op_kind("embedding_grad"), operands, RowsAttrs(rows)).outputs[0]


# ----------------------------------------------------------------------------- one_hot


def _one_hot_infer(what: str, inputs: Sequence[TensorType], attrs: CountAttrs) -> tuple[TensorType, ...]:
    (ids,) = inputs
    require_int(what, "ids", ids)
    if attrs.count < 1:
        raise RlxValueError(f"{what}: num_classes must be >= 1, got {attrs.count}")
    return (TensorType((*ids.shape, attrs.count), F32),)


def _one_hot_reference(args: Sequence[np.ndarray], attrs: CountAttrs, ctx: EvalContext) -> np.ndarray:
    (ids,) = args
    check_indices("one_hot", ids, attrs.count, "class index")
    return (ids[..., None] == np.arange(attrs.count)).astype(np.float64)


def one_hot(graph: Graph, ids: object, num_classes: int) -> Value:
    """float32 ``[..., num_classes]`` with a 1 at each id, as ``torch.nn.functional.one_hot`` (but float)."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
        raise RlxTypeError(f"one_hot: num_classes must be an int, got {type(num_classes).__name__}")
    value = as_value(graph, ids, "one_hot: ids")
    return graph.add_node(op_kind("one_hot"), [value], CountAttrs(int(num_classes))).outputs[0]


# ----------------------------------------------------------------------------- cross_entropy


def _cross_entropy_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    logits, targets = inputs
    require_float(what, "logits", logits)
    require_int(what, "targets", targets)
    if logits.rank < 1 or logits.shape[:-1] != targets.shape:
        raise RlxValueError(f"{what}: logits must be [*targets.shape, C] for targets {targets}, got {logits}")
    return (TensorType((), F32),)


def _cross_entropy_reference(args: Sequence[np.ndarray], attrs: NoAttrs, ctx: EvalContext) -> np.ndarray:
    logits, targets = args
    check_indices("cross_entropy", targets, logits.shape[-1], "class index")
    shifted = logits - np.max(logits, axis=-1, keepdims=True, initial=-np.inf)
    log_probs = shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
    picked = np.take_along_axis(log_probs, targets[..., None].astype(np.int64), axis=-1)
    return np.asarray(-np.mean(picked))


def _cross_entropy_grad(
    graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    """``(softmax(logits) - one_hot(targets)) * dy / N`` over the N targets."""
    dy = cts[0]
    assert dy is not None
    logits, targets = node.inputs
    diff = graph.softmax(logits, axis=-1) - graph.one_hot(targets, logits.shape[-1])
    return [diff * (dy * reciprocal_count(graph, targets, tuple(range(len(targets.shape))))), None]


def cross_entropy(graph: Graph, logits: object, targets: object) -> Value:
    """Mean cross-entropy of ``logits [..., C]`` against integer ``targets [...]``, as torch's."""
    operands = [as_value(graph, logits, "cross_entropy: logits"), as_value(graph, targets, "cross_entropy: targets")]
    return graph.add_node(op_kind("cross_entropy"), operands, NoAttrs()).outputs[0]


def _decompose_one_hot(graph: Graph, node: Node) -> tuple[Value, ...]:
    """``ids[..., None] == arange(C)``, as 1.0 / 0.0."""
    ids = node.inputs[0]
    classes = graph.constant(np.arange(node.attrs.count, dtype=ids.dtype))
    hit = graph.equal(graph.reshape(ids, (*ids.shape, 1)), classes)
    return (graph.where(hit, 1.0, 0.0),)


def _decompose_cross_entropy(graph: Graph, node: Node) -> tuple[Value, ...]:
    """``mean(logsumexp(logits) - logits[target])``, the target's logit picked with a one-hot mask."""
    logits, targets = node.inputs
    peak = graph.max(logits, axis=-1, keepdims=True)
    log_sum = graph.log(graph.sum(graph.exp(logits - peak), axis=-1, keepdims=True)) + peak
    picked = graph.sum(logits * graph.one_hot(targets, logits.shape[-1]), axis=-1, keepdims=True)
    return (graph.mean(log_sum - picked),)


def _batch_embedding(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> Sequence[Value]:
    """A shared table (a model's) gathers every example's ids at once; tables per example are
    one ``take_along_axis`` of every example's rows (``[n, V, E]`` at ids ``[n, N, E]``)."""
    if not batched[0]:
        return again(graph, node, operands)
    table, ids = all_with_examples(graph, operands, batched, size)
    picked = graph.take_along_axis(table, _rows_per_example(graph, ids, size, table.shape[-1]), axis=1)
    return (graph.reshape(picked, (*ids.shape, table.shape[-1])),)


def _rows_per_example(graph: Graph, ids: Value, size: Dim, width: Dim) -> Value:
    """Batched ids ``[n, ...]`` as ``[n, N, width]``: one row index per entry, repeated along a row."""
    flat = graph.reshape(ids, (size, -1)) if ids.ndim != 2 else ids
    return graph.broadcast_to(graph.expand_dims(flat, -1), (*flat.shape, width))


def _batch_embedding_grad(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> Sequence[Value]:
    """Each example's rows added into its own table: one scatter-add along the rows' axis."""
    dy, ids = all_with_examples(graph, operands, batched, size)
    rows = _rows_per_example(graph, ids, size, dy.shape[-1])
    updates = graph.reshape(dy, rows.shape)
    return (graph.scatter_add_along_axis(updates, rows, 1, node.attrs.count),)


def _batch_cross_entropy(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> Sequence[Value]:
    """Each example's mean over its own targets: the picked log-probabilities averaged over
    every axis but the examples'."""
    logits, targets = all_with_examples(graph, operands, batched, size)
    log_probs = graph.log_softmax(logits, axis=-1)
    picked = graph.take_along_axis(log_probs, graph.expand_dims(targets, -1), axis=-1)
    return (-graph.mean(picked, axis=tuple(range(1, picked.ndim))),)


def _rows(node: Node) -> Dim:
    return node.inputs[0].shape[0]


register_op(
    OpDef(
        "embedding",
        ("table", "ids"),
        NoAttrs,
        _embedding_infer,
        _embedding_reference,
        _embedding_grad,
        builder=embedding,
        batch=_batch_embedding,
        no_grad=frozenset({"ids"}),
        index_operands=(IndexOperand("ids", _rows, "token id", checked_in_kernel=True),),
    )
)
register_op(
    OpDef(
        "embedding_grad",
        ("dy", "ids"),
        RowsAttrs,
        _embedding_grad_infer,
        _embedding_grad_reference,
        _embedding_grad_grad,
        builder=embedding_grad,
        batch=_batch_embedding_grad,
        no_grad=frozenset({"ids"}),
        index_operands=(IndexOperand("ids", lambda node: node.attrs.count, "token id", checked_in_kernel=True),),
    )
)
register_op(
    OpDef(
        "one_hot",
        ("ids",),
        CountAttrs,
        _one_hot_infer,
        _one_hot_reference,
        no_gradient,
        builder=one_hot,
        batch=batch_trailing,
        decompose=_decompose_one_hot,
        no_grad=frozenset({"ids"}),
        index_operands=(IndexOperand("ids", lambda node: int(node.attrs.count), "class index"),),
    )
)
register_op(
    OpDef(
        "cross_entropy",
        ("logits", "targets"),
        NoAttrs,
        _cross_entropy_infer,
        _cross_entropy_reference,
        _cross_entropy_grad,
        builder=cross_entropy,
        batch=_batch_cross_entropy,
        decompose=_decompose_cross_entropy,
        no_grad=frozenset({"targets"}),
        index_operands=(IndexOperand("targets", lambda node: node.inputs[0].shape[-1], "class index"),),
    )
)
