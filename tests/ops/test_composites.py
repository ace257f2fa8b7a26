"""NumPy conveniences (``stack``, ``expand_dims``, ``squeeze``, ``clip``, ``var``, ``std``):
values against NumPy, gradients against central differences of the float64 reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import central_differences

import rlx
from rlx import Graph
from rlx.reference import evaluate

CASES: list[tuple[str, Callable[[Graph, Any, Any], Any], Callable[[np.ndarray, np.ndarray], np.ndarray]]] = [
    ("stack", lambda g, a, b: g.stack([a, b, a * 2.0], axis=1), lambda a, b: np.stack([a, b, a * 2], 1)),
    ("stack-last", lambda g, a, b: g.stack([a, b], axis=-1), lambda a, b: np.stack([a, b], -1)),
    ("expand_dims", lambda g, a, b: g.expand_dims(a, (0, -1)), lambda a, b: np.expand_dims(a, (0, -1))),
    ("squeeze", lambda g, a, b: g.expand_dims(a, (0, 2)).squeeze(), lambda a, b: a),
    ("squeeze-axis", lambda g, a, b: g.squeeze(g.expand_dims(a, 1), 1), lambda a, b: a),
    ("clip", lambda g, a, b: a.clip(-0.5, 0.7), lambda a, b: np.clip(a, -0.5, 0.7)),
    ("clip-tensor-hi", lambda g, a, b: g.clip(a, hi=b), lambda a, b: np.minimum(a, b)),
    ("clip-lo", lambda g, a, b: g.clip(a, lo=0.1), lambda a, b: np.maximum(a, 0.1)),
    ("var", lambda g, a, b: a.var(), lambda a, b: np.var(a)),
    ("var-axis-ddof", lambda g, a, b: g.var(a, axis=1, ddof=1), lambda a, b: np.var(a, axis=1, ddof=1)),
    ("std", lambda g, a, b: a.std(axis=0, keepdims=True), lambda a, b: np.std(a, axis=0, keepdims=True)),
]


@pytest.mark.parametrize(("name", "build", "numpy"), CASES, ids=[c[0] for c in CASES])
def test_values_and_gradients(
    name: str, build: Callable[[Graph, Any, Any], Any], numpy: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> None:
    g = Graph("composite")
    a, b = g.input("a", (3, 4)), g.input("b", (3, 4))
    y = build(g, a, b)
    w = g.input("w", y.shape)
    loss = g.sum(y * w)
    da, db = rlx.grad(g, loss, [a, b])
    g.output(y=y, loss=loss, da=da, db=db)
    rng = np.random.default_rng(5)
    arrays = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in g.inputs.items()}
    got = rlx.compile(g)(**arrays)
    np.testing.assert_allclose(got["y"], numpy(arrays["a"], arrays["b"]), rtol=1e-5, atol=1e-6)
    exact = {n: v.astype(np.float64) for n, v in arrays.items()}
    for wrt in ("a", "b"):
        want = central_differences(lambda: float(evaluate(g, exact, exact=True)["loss"]), exact[wrt])
        np.testing.assert_allclose(got[f"d{wrt}"], want, rtol=1e-4, atol=1e-5, err_msg=wrt)


def test_clip_gradient_is_torchs_at_the_bounds() -> None:
    """1 where lo <= x <= hi (a bound included), 0 outside; a NaN stays NaN."""
    g = Graph("clamp")
    x = g.input("x", (6,))
    y = x.clip(-1.0, 1.0)
    (dx,) = rlx.grad(g, g.sum(y), [x])
    g.output(y=y, dx=dx)
    got = rlx.compile(g)(x=np.array([-2.0, -1.0, 0.0, 1.0, 3.0, np.nan], np.float32))
    np.testing.assert_array_equal(got["y"], [-1.0, -1.0, 0.0, 1.0, 1.0, np.nan])
    np.testing.assert_array_equal(got["dx"][:5], [0.0, 1.0, 1.0, 1.0, 0.0])


def test_errors() -> None:
    g = Graph("bad")
    x = g.input("x", (2, 3))
    with pytest.raises(rlx.RlxValueError, match="one shape"):
        g.stack([x, g.input("y", (3, 2))])
    with pytest.raises(rlx.RlxValueError, match="axis 1 of f32\\[2,3\\] has size 3, not 1"):
        x.squeeze(1)
    with pytest.raises(rlx.RlxValueError, match="give lo, hi or both"):
        x.clip()
    one = g.input("one", (1,))
    before = len(g)
    with pytest.raises(rlx.RlxValueError, match="no degrees of freedom"):
        g.var(one, ddof=1)
    assert len(g) == before
    with pytest.raises(rlx.RlxTypeError, match="non-empty list"):
        g.stack([])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_take_matches_numpy_for_every_dtype(axis: int) -> None:
    """``g.take`` (``numpy.take``) of float, int and bool values along any axis by ids of any
    shape; the float one's gradient scatters back (repeated ids add)."""
    rng = np.random.default_rng(9)
    ids = np.array([[2, 0], [1, 2], [2, 2]], np.int64)
    for dtype in ("float32", "int64", "int32", "bool"):
        g = Graph("take")
        x = g.input("x", (3, 4, 3), dtype=dtype)
        i = g.input("i", ids.shape, dtype="int64")
        y = g.take(x, i, axis)
        g.output(y=y)
        if dtype == "float32":
            w = g.input("w", y.shape)
            (dx,) = rlx.grad(g, g.sum(y * w), [x])
            g.output(dx=dx)
        data = (rng.standard_normal((3, 4, 3)) * 4).astype(dtype)
        arrays = {"x": data, "i": ids}
        if dtype == "float32":
            arrays["w"] = rng.standard_normal(y.shape).astype(np.float32)
        got = rlx.compile(g)(**arrays)
        np.testing.assert_array_equal(got["y"], np.take(data, ids, axis=axis))
        assert got["y"].dtype == np.dtype(dtype)
        if dtype == "float32":
            want = np.zeros_like(data)
            np.add.at(np.moveaxis(want, axis, 0), ids, np.moveaxis(arrays["w"], range(axis % 3, axis % 3 + 2), (0, 1)))
            np.testing.assert_allclose(got["dx"], want, rtol=1e-6, atol=1e-6)
