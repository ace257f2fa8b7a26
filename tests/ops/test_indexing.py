"""``value[...]``: NumPy's basic indexing on graph values (views from split and reshape)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import rlx
from rlx import Graph

INDEXERS: list[tuple[str, Callable[[Any], Any]]] = [
    ("int", lambda v: v[1]),
    ("last", lambda v: v[:, -1]),
    ("slices", lambda v: v[1:3, :, 2:]),
    ("ellipsis", lambda v: v[..., 0]),
    ("newaxis", lambda v: v[None, 2, ..., None]),
    ("negative", lambda v: v[-3:-1, 1:4, -2]),
    ("clamped", lambda v: v[:100, -100:]),
    ("scalar", lambda v: v[2, 3, 4]),
    ("whole", lambda v: v[:]),
    ("numpy-int", lambda v: v[np.int64(1), np.int32(-1)]),
]


@pytest.mark.parametrize(("name", "index"), INDEXERS, ids=[n for n, _ in INDEXERS])
def test_indexing_matches_numpy_and_differentiates(name: str, index: Callable[[Any], Any]) -> None:
    g = Graph("index")
    x = g.input("x", (4, 5, 6))
    y = index(x)
    weights = g.input("w", y.shape) if y.shape else None
    loss = g.sum(y * weights) if weights is not None else y * 3.0
    (dx,) = rlx.grad(g, loss, [x])
    g.output(y=y, dx=dx)
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((4, 5, 6)).astype(np.float32)}
    if weights is not None:
        arrays["w"] = rng.standard_normal(y.shape).astype(np.float32)
    got = rlx.compile(g)(**arrays)
    np.testing.assert_array_equal(got["y"], index(arrays["x"]))
    want = np.zeros(4 * 5 * 6, np.float32)  # the cotangent lands on exactly the elements taken
    taken = np.asarray(index(np.arange(want.size).reshape(4, 5, 6))).ravel()
    want[taken] = arrays["w"].ravel() if weights is not None else 3.0
    want = want.reshape(4, 5, 6)
    np.testing.assert_array_equal(got["dx"], want)
    assert str(rlx.ir.parse(str(g))) == str(g)


def test_indexing_errors_are_clear_and_build_nothing() -> None:
    g = Graph("index")
    x = g.input("x", (4, 5, 6))
    s = g.input("s", (2, "S", 3))
    before = len(g)
    cases = [
        (lambda: x[4], rlx.RlxValueError, "index 4 is out of bounds for axis 0 of size 4"),
        (lambda: x[::2], rlx.RlxValueError, "step"),
        (lambda: x[[0, 1]], rlx.RlxTypeError, "gather rows with g.embedding"),
        (lambda: x[1.5], rlx.RlxTypeError, "got float"),
        (lambda: x[1, 2, 3, 4], rlx.RlxValueError, "too many indices"),
        (lambda: x[3:1], rlx.RlxValueError, "takes nothing"),
        (lambda: x[..., ...], rlx.RlxValueError, "single ellipsis"),
        (lambda: x[True], rlx.RlxTypeError, "got bool"),
        (lambda: s[:, -3:5], rlx.RlxValueError, "shrinks as the axis grows"),
        (lambda: s[:, 4:4], rlx.RlxValueError, "takes nothing"),
    ]
    for build, error, match in cases:
        with pytest.raises(error, match=match):
            build()
    assert len(g) == before
    assert s[:, :, 1].shape == (2, "S") and s[1].shape == ("S", 3)
    assert s[:, -1].shape == (2, 3) and s[:, 1:].shape == (2, "S-1", 3)  # counted from the symbolic end


def test_values_unpack_along_their_first_axis() -> None:
    g = Graph("unpack")
    pair = g.input("pair", (2, 3))
    first, second = pair
    g.output(d=first - second)
    arrays = {"pair": np.arange(6, dtype=np.float32).reshape(2, 3)}
    np.testing.assert_array_equal(rlx.compile(g)(**arrays)["d"], [-3.0, -3.0, -3.0])
    with pytest.raises(rlx.RlxTypeError, match="0-d"):
        iter(g.sum(pair))
    with pytest.raises(rlx.RlxTypeError, match="symbolic first axis"):
        iter(g.input("s", ("S", 3)))
