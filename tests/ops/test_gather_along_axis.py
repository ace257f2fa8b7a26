"""``take_along_axis`` and ``scatter_add_along_axis`` against NumPy's ``take_along_axis`` and
``add.at``: every axis, broadcast operands, int ids of both widths, symbolic sizes, both thread
counts; gradients against central differences; ids out of range as errors of the call, whether
they come in as inputs or the graph computes them."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph
from tests.helpers import central_differences


def _scattered(updates: np.ndarray, ids: np.ndarray, axis: int, size: int) -> np.ndarray:
    shape = list(updates.shape)
    shape[axis] = size
    out = np.zeros(shape)
    where = list(np.indices(updates.shape, sparse=True))
    where[axis] = ids
    np.add.at(out, tuple(where), updates)
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_take_and_scatter_match_numpy(axis: int, threads: int) -> None:
    rng = np.random.default_rng(axis)
    shape = [4, 5, 19]  # the last axis runs vectors and a remainder
    picked = list(shape)
    picked[axis] = 7  # more ids than entries: repeats
    g = Graph("along")
    x = g.input("x", tuple(shape))
    ids = g.input("ids", tuple(picked), "int32")
    updates = g.input("updates", tuple(picked))
    g.output(
        taken=g.take_along_axis(x, ids, axis),
        scaled=g.take_along_axis(x * 2.0 + 1.0, ids, axis),  # an operand computed inline
        scattered=g.scatter_add_along_axis(updates, ids, axis, shape[axis]),
    )
    xv = rng.standard_normal(shape).astype(np.float32)
    iv = rng.integers(0, shape[axis], picked).astype(np.int32)
    uv = rng.standard_normal(picked).astype(np.float32)
    got = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=threads))(x=xv, ids=iv, updates=uv)
    np.testing.assert_array_equal(got["taken"], np.take_along_axis(xv, iv, axis))
    np.testing.assert_allclose(got["scaled"], np.take_along_axis(xv * 2.0 + 1.0, iv, axis), rtol=1e-6)
    np.testing.assert_allclose(got["scattered"], _scattered(uv, iv, axis, shape[axis]), rtol=1e-5, atol=1e-6)
    reference = rlx.reference.run(g, x=xv, ids=iv, updates=uv)
    np.testing.assert_allclose(reference["scattered"], _scattered(uv, iv, axis, shape[axis]), rtol=1e-6, atol=1e-7)


def test_take_along_axis_broadcasts_the_other_axes() -> None:
    """ids of one row for every batch entry, and a table of one row for every id row."""
    rng = np.random.default_rng(1)
    g = Graph("broadcast")
    x = g.input("x", (3, 6))
    ids = g.input("ids", (1, 4), "int64")
    column = g.input("column", (1, 6))
    many = g.input("many", (5, 2), "int64")
    g.output(rows=g.take_along_axis(x, ids, 1), shared=g.take_along_axis(column, many, 1))
    xv, cv = rng.standard_normal((3, 6)).astype(np.float32), rng.standard_normal((1, 6)).astype(np.float32)
    iv, mv = rng.integers(0, 6, (1, 4)), rng.integers(0, 6, (5, 2))
    got = rlx.compile(g)(x=xv, ids=iv, column=cv, many=mv)
    np.testing.assert_array_equal(got["rows"], np.take_along_axis(xv, np.broadcast_to(iv, (3, 4)), 1))
    np.testing.assert_array_equal(got["shared"], np.take_along_axis(np.broadcast_to(cv, (5, 6)), mv, 1))


def test_take_along_axis_of_ints_and_a_symbolic_batch() -> None:
    g = Graph("symbolic")
    x = g.input("x", ("B", 9), "int64")
    ids = g.input("ids", ("B", 3), "int64")
    g.output(y=g.take_along_axis(x, ids, 1))
    exe = rlx.compile(g)
    rng = np.random.default_rng(2)
    for batch in (1, 4, 11):
        xv, iv = rng.integers(-50, 50, (batch, 9)), rng.integers(0, 9, (batch, 3))
        np.testing.assert_array_equal(exe(x=xv, ids=iv)["y"], np.take_along_axis(xv, iv, 1))
    assert exe.compile_count == 1


def test_gradients_against_central_differences() -> None:
    """The gather's gradient adds up repeated ids (and sums over a broadcast table row); the
    scatter's reads its cotangent back at the ids."""
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((3, 5))
    rowv = rng.standard_normal((1, 5))
    iv = np.array([[0, 0, 4, 2], [1, 1, 1, 3], [4, 3, 2, 0]])
    weights = rng.standard_normal((3, 4))
    g = Graph("grads")
    x, row = g.input("x", (3, 5)), g.input("row", (1, 5))
    ids = g.constant(iv)
    w = g.constant(weights.astype(np.float32))
    taken = g.take_along_axis(x * row, ids, 1)
    scattered = g.scatter_add_along_axis(taken * w, ids, 1, 5)
    loss = g.sum(taken * taken * w) + g.sum(scattered * scattered)
    dx, drow = rlx.grad(g, loss, [x, row])
    g.output(dx=dx, drow=drow)
    got = rlx.compile(g)(x=xv.astype(np.float32), row=rowv.astype(np.float32))

    def loss_of() -> float:
        t = np.take_along_axis(xv * rowv, iv, 1)
        s = _scattered(t * weights, iv, 1, 5)
        return float(np.sum(t * t * weights) + np.sum(s * s))

    np.testing.assert_allclose(got["dx"], central_differences(loss_of, xv), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["drow"], central_differences(loss_of, rowv), rtol=1e-4, atol=1e-4)


def test_ids_out_of_range_are_errors() -> None:
    g = Graph("bad_ids")
    x = g.input("x", (2, 6))
    ids = g.input("ids", (2, 2), "int64")
    computed = g.argmax(x, axis=1, keepdims=True) + 3
    g.output(
        taken=g.take_along_axis(x, ids, 1),
        shifted=g.take_along_axis(x, computed, 1),
        scattered=g.scatter_add_along_axis(x[:, :1], computed, 1, 6),
    )
    exe = rlx.compile(g)
    low = np.arange(12, dtype=np.float32).reshape(2, 6)[:, ::-1].copy()  # argmax 0: computed ids 3
    exe(x=low, ids=np.array([[0, 5], [1, 1]]))
    with pytest.raises(rlx.RlxValueError, match=r"input 'ids': 6 is out of range \[0, 6\)"):
        exe(x=low, ids=np.array([[0, 6], [1, 1]]))
    with pytest.raises(rlx.RlxValueError, match=r"input 'ids': -1 is out of range"):
        exe(x=low, ids=np.array([[0, -1], [1, 1]]))
    high = np.arange(12, dtype=np.float32).reshape(2, 6)  # argmax 5: computed ids 8
    with pytest.raises(rlx.RlxValueError, match=r"sliced by the graph in this call: 8 is out of range \[0, 6\)"):
        exe(x=high, ids=np.array([[0, 5], [1, 1]]))
    exe(x=low, ids=np.array([[0, 5], [1, 1]]))  # the executable still works


def test_bad_operands_name_the_op() -> None:
    g = Graph("bad_operands")
    x = g.input("x", (3, 4))
    with pytest.raises(rlx.RlxValueError, match=r"take_along_axis.*ids must have x's rank 2"):
        g.take_along_axis(x, g.input("flat", (3,), "int64"), 1)
    with pytest.raises(rlx.RlxTypeError, match=r"take_along_axis.*ids must be int32 or int64"):
        g.take_along_axis(x, x, 1)
    with pytest.raises(rlx.RlxValueError, match=r"take_along_axis.*broadcast"):
        g.take_along_axis(x, g.input("wide", (2, 4), "int64"), 1)
    with pytest.raises(rlx.RlxValueError, match=r"scatter_add_along_axis.*ids must have the updates' shape"):
        g.scatter_add_along_axis(x, g.input("short", (3, 2), "int64"), 1, 5)
    with pytest.raises(rlx.RlxValueError, match=r"scatter_add_along_axis.*size must be >= 1"):
        g.scatter_add_along_axis(x, g.input("ids", (3, 4), "int64"), 1, 0)
    with pytest.raises(rlx.RlxValueError, match="axis 2 is out of range"):
        g.take_along_axis(x, g.input("ids2", (3, 4), "int64"), 2)
