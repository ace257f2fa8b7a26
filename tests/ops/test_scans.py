"""``cumsum`` and ``cumprod``: running sums and products along an axis, as ``numpy.cumsum`` and
``numpy.cumprod`` (and ``jax.lax``'s ``reverse``), compiled against NumPy and the float64
reference, for floats (vectorised rows and a single column), ints (int32 and int64 in, int64
out), symbolic lengths and thread counts; the gradients against central differences, zeros in
a running product included; bad inputs as build errors."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph
from tests.helpers import central_differences


@pytest.mark.parametrize("threads", [1, 2])
def test_cumsum_matches_numpy(threads: int) -> None:
    rng = np.random.default_rng(4)
    g = Graph("scan")
    x = g.input("x", (3, 37, 21))
    counts = g.input("counts", (5, 9), dtype="int32")
    long = g.input("long", (70,), dtype="int64")
    g.output(
        middle=g.cumsum(x, axis=1),
        last_reversed=g.cumsum(x, axis=-1, reverse=True),
        first=g.cumsum(x * 2.0, axis=0),
        flat=g.cumsum(x),
        positions=counts.cumsum(-1) - 1,  # a padding mask's positions, as transformers computes them
        wide=g.cumsum(long, reverse=True),
    )
    xv = rng.standard_normal((3, 37, 21)).astype(np.float32)
    cv = rng.integers(0, 2, (5, 9)).astype(np.int32)
    lv = rng.integers(-(2**40), 2**40, 70)
    want = {
        "middle": np.cumsum(xv, axis=1, dtype=np.float64),
        "last_reversed": np.flip(np.cumsum(np.flip(xv, -1), axis=-1, dtype=np.float64), -1),
        "first": np.cumsum(xv * 2.0, axis=0, dtype=np.float64),
        "flat": np.cumsum(xv, dtype=np.float64),
        "positions": np.cumsum(cv, axis=-1) - 1,
        "wide": np.flip(np.cumsum(np.flip(lv))),
    }
    got = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=threads))(x=xv, counts=cv, long=lv)
    reference = rlx.reference.run(g, x=xv, counts=cv, long=lv)
    for name, expected in want.items():
        assert got[name].shape == expected.shape, name
        if expected.dtype.kind == "i":
            assert got[name].dtype == np.int64, name
            np.testing.assert_array_equal(got[name], expected, err_msg=name)
            np.testing.assert_array_equal(reference[name], expected, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=2e-5, err_msg=name)


def test_cumsum_over_a_symbolic_length() -> None:
    g = Graph("scan_symbolic")
    x = g.input("x", ("B", "S", 3))
    g.output(y=g.cumsum(x, axis=1), z=g.cumsum(x, axis=0, reverse=True))
    exe = rlx.compile(g)
    rng = np.random.default_rng(5)
    for batch, length in [(2, 5), (1, 1), (3, 17)]:
        xv = rng.standard_normal((batch, length, 3)).astype(np.float32)
        got = exe(x=xv)
        np.testing.assert_allclose(got["y"], np.cumsum(xv, axis=1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["z"], np.flip(np.cumsum(np.flip(xv, 0), axis=0), 0), rtol=1e-5, atol=1e-6)
    assert exe.compile_count == 1


def test_cumsum_gradient() -> None:
    """Each entry adds into every running sum from it on (from it back, reversed)."""
    g = Graph("scan_grad")
    x = g.input("x", (4, 6))
    weights = np.linspace(-1.0, 2.0, 24).reshape(4, 6)
    loss = g.sum(g.cumsum(x, axis=1) ** 2.0 * g.constant(weights.astype(np.float32))) + g.sum(
        g.cumsum(x, axis=0, reverse=True) * 3.0
    )
    (dx,) = rlx.grad(g, loss, [x])
    g.output(dx=dx)
    xv = np.random.default_rng(6).standard_normal((4, 6))
    got = rlx.compile(g)(x=xv.astype(np.float32))["dx"]

    def loss_of() -> float:
        reversed_sums = np.flip(np.cumsum(np.flip(xv, 0), axis=0), 0)
        return float(np.sum(np.cumsum(xv, axis=1) ** 2 * weights) + np.sum(reversed_sums * 3.0))

    np.testing.assert_allclose(got, central_differences(loss_of, xv), rtol=1e-4, atol=1e-4)


def test_cumsum_errors_name_the_op() -> None:
    g = Graph("scan_errors")
    with pytest.raises(rlx.RlxValueError, match="cumsum: axis 2 is out of range"):
        g.cumsum(g.input("x", (3, 4)), axis=2)
    message = r"cumsum \(node \d+\): x must be float32, int32 or int64, got bool.*astype"
    with pytest.raises(rlx.RlxTypeError, match=message):
        g.cumsum(g.input("y", (3,)) > 0.0)
    with pytest.raises(rlx.RlxTypeError, match="cumsum: reverse must be a bool"):
        g.cumsum(g.input("z", (3,)), reverse=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("threads", [1, 2])
def test_cumprod_matches_numpy(threads: int) -> None:
    rng = np.random.default_rng(7)
    g = Graph("products")
    x = g.input("x", (3, 37, 21))
    counts = g.input("counts", (5, 9), dtype="int32")
    g.output(
        middle=g.cumprod(x, axis=1),
        last_reversed=g.cumprod(x, axis=-1, reverse=True),
        flat=g.cumprod(x),
        survival=(1.0 - x * 0.1).cumprod(0),
        ints=g.cumprod(counts, axis=-1),
    )
    xv = rng.uniform(0.8, 1.25, (3, 37, 21)).astype(np.float32)
    cv = rng.integers(-3, 4, (5, 9)).astype(np.int32)
    want = {
        "middle": np.cumprod(xv, axis=1, dtype=np.float64),
        "last_reversed": np.flip(np.cumprod(np.flip(xv, -1), axis=-1, dtype=np.float64), -1),
        "flat": np.cumprod(xv, dtype=np.float64),
        "survival": np.cumprod(1.0 - xv.astype(np.float64) * 0.1, axis=0),
        "ints": np.cumprod(cv.astype(np.int64), axis=-1),
    }
    got = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=threads))(x=xv, counts=cv)
    reference = rlx.reference.run(g, x=xv, counts=cv)
    for name, expected in want.items():
        assert got[name].shape == expected.shape, name
        if expected.dtype.kind == "i":
            assert got[name].dtype == np.int64, name
            np.testing.assert_array_equal(got[name], expected, err_msg=name)
            np.testing.assert_array_equal(reference[name], expected, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], expected, rtol=2e-5, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(reference[name], expected, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_cumprod_gradient_with_zeros(axis: int, reverse: bool) -> None:
    """Rows with no zero, one zero, two zeros, a zero first and a zero last: the gradient at a
    row's first zero is the product of everything else up to each later position, past it 0."""
    xv = np.random.default_rng(8).uniform(0.5, 1.5, (5, 6))
    for index in [(1, 2), (2, 1), (2, 4), (3, 0), (4, 5), (0, 3), (0, 4)]:
        xv[index] = 0.0
    weights = np.random.default_rng(9).standard_normal((5, 6))
    g = Graph("products_grad")
    x = g.input("x", (5, 6))
    loss = g.sum(g.cumprod(x, axis=axis, reverse=reverse) * g.constant(weights.astype(np.float32)))
    (dx,) = rlx.grad(g, loss, [x])
    g.output(dx=dx)
    got = rlx.compile(g)(x=xv.astype(np.float32))["dx"]

    def loss_of() -> float:
        moved = np.flip(xv, axis) if reverse else xv
        products = np.cumprod(moved, axis=axis)
        return float(np.sum((np.flip(products, axis) if reverse else products) * weights))

    want = central_differences(loss_of, xv)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rlx.reference.run(g, x=xv.astype(np.float32))["dx"], want, rtol=1e-6, atol=1e-8)
    assert np.isfinite(got).all()


def test_cumprod_second_derivative() -> None:
    """The gradient is built from graph ops: differentiating it again matches central differences
    of the first gradient."""
    xv = np.random.default_rng(10).uniform(0.5, 1.5, (7,))
    g = Graph("products_hessian")
    x = g.input("x", (7,))
    (dx,) = rlx.grad(g, g.sum(g.cumprod(x)), [x])
    (ddx,) = rlx.grad(g, g.sum(dx * dx), [x])
    g.output(ddx=ddx)
    got = rlx.compile(g)(x=xv.astype(np.float32))["ddx"]

    def first_gradient_norm() -> float:
        gradient = np.array([sum(np.prod(np.delete(xv[: j + 1], i)) for j in range(i, 7)) for i in range(7)])
        return float(np.sum(gradient**2))

    np.testing.assert_allclose(got, central_differences(first_gradient_norm, xv), rtol=1e-3, atol=1e-3)


def test_cumprod_errors_name_the_op() -> None:
    g = Graph("products_errors")
    with pytest.raises(rlx.RlxValueError, match="cumprod: axis 2 is out of range"):
        g.cumprod(g.input("x", (3, 4)), axis=2)
    with pytest.raises(rlx.RlxTypeError, match=r"cumprod \(node \d+\): x must be float32, int32 or int64"):
        g.cumprod(g.input("y", (3,)) > 0.0)
