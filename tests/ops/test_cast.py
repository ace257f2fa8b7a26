"""``g.cast`` / ``Value.astype``: dtype conversions, compiled against NumPy and the reference."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph

DTYPES = ("float32", "int32", "int64", "bool")
FLOATS = np.array(
    [0.0, -0.0, 1.5, -1.5, 2.7, -2.7, 0.49, -0.51, 7.0, 1e9, -1e9, 3e9, -3e9, 1e19, -1e19, np.inf, -np.inf, np.nan],
    np.float32,
)


def _source(dtype: str) -> np.ndarray:
    if dtype == "float32":
        return FLOATS
    if dtype == "bool":
        return np.arange(FLOATS.size) % 3 == 0
    values = np.array([0, 1, -1, 5, -7, 2**31 - 1, -(2**31), 3, 2, 0, 9, 1, 1, 4, 4, 6, 8, 10], np.int64)
    if dtype == "int64":
        values[:2] = (2**40 + 3, -(2**40))  # wrap to int32 as NumPy's astype does
    return values.astype(dtype)


def _expected(x: np.ndarray, dtype: str) -> np.ndarray:
    """NumPy's astype, except float to int (undefined in NumPy): toward zero, saturated, NaN to 0."""
    if x.dtype.kind == "f" and dtype.startswith("int"):
        info = np.iinfo(dtype)
        clipped = np.clip(np.nan_to_num(x.astype(np.float64), nan=0.0), info.min, info.max)
        return np.array([int(v) if abs(v) < 2**62 else (info.max if v > 0 else info.min) for v in clipped], dtype)
    return x.astype(dtype)


@pytest.mark.parametrize("target", DTYPES)
@pytest.mark.parametrize("source", DTYPES)
def test_every_conversion_matches_numpy(source: str, target: str) -> None:
    g = Graph("cast")
    x = g.input("x", (FLOATS.size,), dtype=source)
    y = x.astype(target)
    assert y.dtype == np.dtype(target) and (y is x) == (source == target)
    g.output(y=y, twice=g.reshape(y, (2, -1)))  # the cast read by two kernels
    array = _source(source)
    got = rlx.compile(g)(x=array)
    want = _expected(array, target)
    assert got["y"].dtype == want.dtype
    np.testing.assert_array_equal(got["y"], want)
    np.testing.assert_array_equal(got["twice"], want.reshape(2, -1))
    reference = rlx.reference.run(g, x=array)["y"]
    np.testing.assert_array_equal(reference.astype(target), want)


def test_casts_inside_fused_chains_and_gradients() -> None:
    """A padding mask to float weights for a masked mean (the common cast, fused into the loss's
    loop nest), ids compared after a float detour, and the gradient of the float path."""
    g = Graph("masked")
    x = g.input("x", (4, 6))
    ids = g.input("ids", (4, 6), dtype="int32")
    weights = g.not_equal(ids, 0).astype("float32")
    loss = g.sum(x * x * weights) / g.sum(weights)
    rounded = (x * 3.0).astype("int64")  # toward zero
    (dx,) = rlx.grad(g, loss, [x])
    g.output(loss=loss, dx=dx, rounded=rounded, odd=g.equal(ids.astype("float32") * 0.5, 1.5))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((4, 6)).astype(np.float32)
    id_values = rng.integers(0, 4, (4, 6)).astype(np.int32)
    exe = rlx.compile(g)
    got = exe(x=xs, ids=id_values)
    w = (id_values != 0).astype(np.float64)
    np.testing.assert_allclose(got["loss"], np.sum(xs.astype(np.float64) ** 2 * w) / w.sum(), rtol=1e-6)
    np.testing.assert_allclose(got["dx"], 2 * xs * w / w.sum(), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got["rounded"], np.trunc(xs * np.float32(3.0)).astype(np.int64))
    np.testing.assert_array_equal(got["odd"], id_values == 3)
    ref = rlx.reference.run(g, x=xs, ids=id_values)
    np.testing.assert_allclose(got["dx"], ref["dx"], rtol=1e-6, atol=1e-7)
    assert len(exe.kernels) < len(exe.graph.nodes)
    assert str(rlx.ir.parse(str(g))) == str(g)
    (none,) = rlx.grad(g, g.sum(ids.astype("float32")), [x])  # no float path from x: zeros
    assert none.shape == (4, 6)


def test_cast_errors_name_the_dtype() -> None:
    g = Graph("bad")
    x = g.input("x", (2,))
    with pytest.raises(rlx.RlxTypeError, match="float32, int32, int64 or bool, got float64"):
        x.astype("float64")
    with pytest.raises(rlx.RlxTypeError, match="not a dtype"):
        g.cast(x, "floaty")
    with pytest.raises(rlx.RlxTypeError, match="only float32 values have gradients"):
        rlx.grad(g, g.sum(x), [x.astype("int32")])
