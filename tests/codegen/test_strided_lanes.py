"""Lanes a few elements apart (a stride-2 window, every third entry) load as the contiguous
span that holds them and one shuffle. Checked against NumPy for every stride the span takes
and one it does not (and flips, which gather), in rows that end in a partial vector: a cheap
body (whose row ends overlap the vector before) and a dear one (whose row ends are one masked
step), every dtype, and reads that end at the last element of their buffer."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph

STRIDES = [-4, -3, -2, -1, 2, 3, 4, 5]


def _strided(x: np.ndarray, stride: int) -> np.ndarray:
    return x[:, ::stride]


@pytest.mark.parametrize("stride", STRIDES)
@pytest.mark.parametrize("dear", [False, True])
def test_strided_rows_against_numpy(stride: int, dear: bool) -> None:
    columns = 4 * 37 + 1  # every stride leaves rows of a partial vector at the end
    g = Graph("strided")
    x = g.input("x", (3, columns))
    picked = x[:, ::stride]
    g.output(y=g.tanh(picked) * 2.0 if dear else picked + 1.0)
    xv = np.random.default_rng(abs(stride)).standard_normal((3, columns)).astype(np.float32)
    got = rlx.compile(g)(x=xv)["y"]
    want = np.tanh(_strided(xv, stride)) * 2.0 if dear else _strided(xv, stride) + 1.0
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", ["int32", "int64", "bool"])
@pytest.mark.parametrize("stride", [-1, 2, 3])
def test_strided_rows_of_every_dtype(dtype: str, stride: int) -> None:
    g = Graph("strided_ints")
    x = g.input("x", (2, 70), dtype=dtype)
    picked = x[:, ::stride]
    g.output(y=g.where(picked, 1, 0) if dtype == "bool" else picked * 3)
    rng = np.random.default_rng(7)
    xv = rng.integers(0, 2, (2, 70)).astype(dtype) if dtype == "bool" else rng.integers(-99, 99, (2, 70)).astype(dtype)
    got = rlx.compile(g)(x=xv)["y"]
    sliced = _strided(xv, stride)
    np.testing.assert_array_equal(got, np.where(sliced, 1, 0) if dtype == "bool" else sliced * 3)


def test_a_stride_two_convolution_and_its_gradient() -> None:
    """The windows of a stride-2 convolution read every second entry of the padded input."""
    g = Graph("conv")
    x, w = g.input("x", (2, 3, 19, 21)), g.input("w", (4, 3, 3, 3))
    y = g.conv(x, w, stride=2, padding=1)
    loss = g.sum(y * y)
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(y=y, dx=dx, dw=dw)
    rng = np.random.default_rng(8)
    arrays = {
        "x": rng.standard_normal((2, 3, 19, 21)).astype(np.float32),
        "w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
    }
    got = rlx.compile(g)(**arrays)
    want = rlx.reference.evaluate(g, arrays)
    for name in ("y", "dx", "dw"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4)
