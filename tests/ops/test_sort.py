"""``sort``, ``argsort`` and ``topk`` against a definition written with Python's ``sorted`` (a
stable sort by a key that puts NaN above every number): floats with NaN, ties and signed zeros,
ints of both widths, every axis, a symbolic length, both thread counts, a row longer than a
page; the values' gradient against central differences; bad arguments as build errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

import rlx
from rlx import Graph
from tests.helpers import central_differences


def _order(row: np.ndarray, descending: bool) -> list[int]:
    """The stable order of one row, NaN above every number, by ``sorted`` (independent of NumPy's
    sorts and of the op's own reference)."""

    def key(position: int) -> tuple[int, float]:
        value = float(row[position])
        if math.isnan(value):
            return (1, 0.0) if not descending else (0, 0.0)
        return (0, value) if not descending else (1, -value)

    return sorted(range(len(row)), key=key)


def _definition(x: np.ndarray, axis: int, descending: bool) -> tuple[np.ndarray, np.ndarray]:
    moved = np.moveaxis(x, axis, -1)
    order = np.array([_order(row, descending) for row in moved.reshape(-1, moved.shape[-1])], dtype=np.int64)
    order = order.reshape(moved.shape)
    return np.moveaxis(np.take_along_axis(moved, order, -1), -1, axis), np.moveaxis(order, -1, axis)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_and_argsort_match_the_definition(descending: bool, threads: int) -> None:
    rng = np.random.default_rng(int(descending))
    xv = rng.integers(-4, 5, (4, 6, 23)).astype(np.float32)  # many ties
    xv[0, 1, [2, 9, 17]] = np.nan
    xv[1, :, 0] = np.nan
    xv[2, 3, :4] = [0.0, -0.0, 0.0, -0.0]
    xv[3] = rng.standard_normal((6, 23))
    iv = rng.integers(-(2**62), 2**62, (7, 11))
    small = rng.integers(-(2**31), 2**31 - 1, (11, 5)).astype(np.int32)
    g = Graph("sorts")
    x, ints, narrow = (
        g.input("x", xv.shape),
        g.input("ints", iv.shape, "int64"),
        g.input("narrow", small.shape, "int32"),
    )
    outputs = {}
    for axis in range(3):
        outputs[f"sorted{axis}"] = g.sort(x, axis=axis, descending=descending)
        outputs[f"order{axis}"] = g.argsort(x, axis=axis, descending=descending)
    outputs["ints"] = g.sort(ints, descending=descending)
    outputs["ints_order"] = g.argsort(ints, axis=0, descending=descending)
    outputs["narrow"] = g.sort(narrow, axis=0, descending=descending)
    g.output(**outputs)
    got = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=threads))(x=xv, ints=iv, narrow=small)
    for axis in range(3):
        values, order = _definition(xv, axis, descending)
        np.testing.assert_array_equal(got[f"sorted{axis}"], values)
        np.testing.assert_array_equal(got[f"order{axis}"], order)
        assert got[f"order{axis}"].dtype == np.int64
    np.testing.assert_array_equal(got["ints"], _definition(iv, 1, descending)[0])
    np.testing.assert_array_equal(got["ints_order"], _definition(iv, 0, descending)[1])
    assert got["narrow"].dtype == np.int32
    np.testing.assert_array_equal(got["narrow"], _definition(small, 0, descending)[0])
    reference = rlx.reference.run(g, x=xv, ints=iv, narrow=small)
    for name, value in got.items():
        np.testing.assert_array_equal(reference[name], value, err_msg=name)


def test_a_long_row_and_a_symbolic_length() -> None:
    g = Graph("long")
    x = g.input("x", ("B", "N"))
    g.output(order=g.argsort(x), top=g.topk(x, 3)[0])
    exe = rlx.compile(g)
    rng = np.random.default_rng(3)
    for batch, length in [(2, 70_000), (3, 5), (1, 3)]:
        xv = rng.standard_normal((batch, length)).astype(np.float32)
        got = exe(x=xv)
        np.testing.assert_array_equal(got["order"], np.argsort(xv, axis=-1, kind="stable"))
        np.testing.assert_array_equal(got["top"], -np.sort(-xv, axis=-1)[:, :3])
    assert exe.compile_count == 1
    with pytest.raises(rlx.RlxValueError, match="N-3 is -1 in this call"):  # fewer entries than k
        exe(x=np.zeros((1, 2), np.float32))


def test_topk_matches_the_definition() -> None:
    rng = np.random.default_rng(4)
    xv = rng.integers(0, 6, (5, 12)).astype(np.float32)
    xv[2, 4] = np.nan
    g = Graph("topk")
    x = g.input("x", xv.shape)
    largest, where_largest = g.topk(x, 4)
    smallest, where_smallest = g.topk(x, 3, axis=0, largest=False)
    g.output(largest=largest, where_largest=where_largest, smallest=smallest, where_smallest=where_smallest)
    got = rlx.compile(g)(x=xv)
    values, order = _definition(xv, 1, True)
    np.testing.assert_array_equal(got["largest"], values[:, :4])
    np.testing.assert_array_equal(got["where_largest"], order[:, :4])
    values, order = _definition(xv, 0, False)
    np.testing.assert_array_equal(got["smallest"], values[:3])
    np.testing.assert_array_equal(got["where_smallest"], order[:3])


def test_gradients_go_back_to_where_the_values_came_from() -> None:
    rng = np.random.default_rng(5)
    xv = rng.permutation(40).reshape(5, 8) / 7.0 - 2.0  # distinct: the order does not move under eps
    weights = rng.standard_normal((5, 8))
    g = Graph("sort_grad")
    x = g.input("x", (5, 8))
    w = g.constant(weights.astype(np.float32))
    top, _ = g.topk(x, 3, axis=0)
    loss = g.sum(g.sort(x, axis=1, descending=True) * w) + g.sum(top * top)
    (dx,) = rlx.grad(g, loss, [x])
    g.output(dx=dx)
    got = rlx.compile(g)(x=xv.astype(np.float32))["dx"]

    def loss_of() -> float:
        ordered = -np.sort(-xv, axis=1)
        best = -np.sort(-xv, axis=0)[:3]
        return float(np.sum(ordered * weights) + np.sum(best * best))

    np.testing.assert_allclose(got, central_differences(loss_of, xv), rtol=1e-4, atol=1e-4)


def test_bad_arguments_name_the_op() -> None:
    g = Graph("bad_sorts")
    x = g.input("x", (3, 4))
    with pytest.raises(rlx.RlxValueError, match=r"topk: k = 5 must be in \[0, 4\]"):
        g.topk(x, 5)
    with pytest.raises(rlx.RlxTypeError, match="topk: k must be an int"):
        g.topk(x, 2.0)  # type: ignore[arg-type]
    with pytest.raises(rlx.RlxTypeError, match=r"sort \(node \d+\): x must be float32, int32 or int64, got bool"):
        g.sort(x > 0.0)
    with pytest.raises(rlx.RlxTypeError, match="argsort: descending must be a bool"):
        g.argsort(x, descending=1)  # type: ignore[arg-type]
    with pytest.raises(rlx.RlxValueError, match="argsort: axis 2 is out of range"):
        g.argsort(x, axis=2)
    with pytest.raises(rlx.RlxValueError, match="sort: x must have at least one axis"):
        g.sort(g.sum(x))
