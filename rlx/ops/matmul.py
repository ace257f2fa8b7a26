"""``matmul``: ``numpy.matmul``, leading (batch) dims broadcast; vectors are views of matrices around the node."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import TensorType
from rlx.ops._batching import batch_elementwise
from rlx.ops._common import F32, as_value, broadcast_shapes, op_kind, require_float, sum_to_shape
from rlx.ops.elementwise import NoAttrs

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


def _infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    a, b = inputs
    require_float(what, "a", a)
    require_float(what, "b", b)
    if a.rank < 2 or b.rank < 2:
        raise RlxValueError(f"{what}: both operands need rank >= 2 (a matrix or a batch of them), got {a} and {b}")
    if a.shape[-1] != b.shape[-2]:
        raise RlxValueError(
            f"{what}: inner dimensions differ: a {a} has {a.shape[-1]} columns, b {b} has {b.shape[-2]} rows"
        )
    batch = broadcast_shapes(f"{what} (batch dims)", a.shape[:-2], b.shape[:-2])
    return (TensorType((*batch, a.shape[-2], b.shape[-1]), F32),)


def _reference(args: Sequence[np.ndarray], attrs: NoAttrs, ctx: EvalContext) -> np.ndarray:
    return np.matmul(args[0], args[1])


def swap_last(graph: Graph, x: Value) -> Value:
    """``x`` with its last two axes swapped (a view)."""
    perm = (*range(len(x.shape) - 2), len(x.shape) - 1, len(x.shape) - 2)
    return graph.transpose(x, perm)


def _flatten_rows(graph: Graph, x: Value) -> Value:
    """``[..., m, n] -> [prod(...) * m, n]`` (a view of a dense tensor)."""
    return graph.reshape(x, (-1, x.shape[-1]))


def _grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """``dA = dY B^T`` and ``dB = A^T dY``, summed over broadcast batch dims.

    A weight shared by a batch (``x [B, S, E] @ w [E, F]``) gets ``dW = X^T dY`` with the batch
    folded into the rows: one large GEMM instead of a batch of small ones and a reduction. (Not
    with a symbolic dimension among the rows: a shape names a symbol only as a whole dimension.)
    """
    dy = cts[0]
    assert dy is not None
    a, b = node.inputs
    da = db = None
    foldable = all(isinstance(d, int) for d in dy.shape[:-1])
    if needed[0]:
        if len(a.shape) == 2 and len(dy.shape) > 2 and all(isinstance(d, int) for d in (*dy.shape[:-2], dy.shape[-1])):
            rows_dy = _flatten_rows(graph, swap_last(graph, dy))  # [batch * N, M]
            da = graph.matmul(swap_last(graph, rows_dy), _flatten_rows(graph, swap_last(graph, b)))
        else:
            da = sum_to_shape(graph, graph.matmul(dy, swap_last(graph, b)), a.shape)
    if needed[1]:
        if len(b.shape) == 2 and len(dy.shape) > 2 and foldable:
            db = graph.matmul(swap_last(graph, _flatten_rows(graph, a)), _flatten_rows(graph, dy))
        else:
            db = sum_to_shape(graph, graph.matmul(swap_last(graph, a), dy), b.shape)
    return [da, db]


def matmul(graph: Graph, a: object, b: object) -> Value:
    """Batched matrix product as ``numpy.matmul``: leading dims broadcast, and a vector operand
    (rank 1) is a matrix of one row (``a``) or one column (``b``) whose axis the result drops,
    so ``v @ w`` of two vectors is a scalar. The node itself takes matrices: vectors become
    views around it (reshapes cost nothing), and their gradients come through those views."""
    x, y = as_value(graph, a, "matmul: a"), as_value(graph, b, "matmul: b")
    if x.ndim == 0 or y.ndim == 0:
        raise RlxValueError(f"matmul: operands need rank >= 1 (a scalar multiplies with *), got {x.type} and {y.type}")
    if x.ndim != 1 and y.ndim != 1:
        return graph.add_node(op_kind("matmul"), [x, y], NoAttrs()).outputs[0]
    inner_a, inner_b = x.shape[-1], y.shape[0] if y.ndim == 1 else y.shape[-2]
    if inner_a != inner_b:
        raise RlxValueError(
            f"matmul: inner dimensions differ: a {x.type} has {inner_a} columns, b {y.type} has {inner_b} rows"
        )
    rows = graph.reshape(x, (1, x.shape[0])) if x.ndim == 1 else x
    columns = graph.reshape(y, (y.shape[0], 1)) if y.ndim == 1 else y
    out = graph.add_node(op_kind("matmul"), [rows, columns], NoAttrs()).outputs[0]
    shape = list(out.shape)
    if y.ndim == 1:
        del shape[-1]
    if x.ndim == 1:
        del shape[-1 if y.ndim == 1 else -2]
    return graph.reshape(out, tuple(shape))


# A batched operand gets the result's rank (ones after the examples' axis), so it broadcasts
# against a shared one as each example's does: ``xs [n, M, K] @ w [K, N]`` is one node.
register_op(OpDef("matmul", ("a", "b"), NoAttrs, _infer, _reference, _grad, builder=matmul, batch=batch_elementwise))
