"""``//`` and ``%`` (``floor_divide``, ``remainder``) and ``fmod`` on ints and floats, ``floor ceil trunc
round``: NumPy's results, edge cases included (division by zero, the divisor's sign, int overflow,
halves, infinities and NaN), compiled (vectorised and scalar loops, one and two threads) and in
the reference interpreter; ``remainder``'s gradient against central differences."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph
from tests.helpers import central_differences


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_integer_floor_division_and_remainder_match_numpy(dtype: str) -> None:
    info = np.iinfo(dtype)
    rng = np.random.default_rng(1)
    a = rng.integers(-50, 50, 67).astype(dtype)
    b = rng.integers(-6, 7, 67).astype(dtype)  # zeros included: NumPy gives 0 for both
    a[:4] = [info.min, info.min, info.max, info.min]
    b[:4] = [-1, 1, -1, 0]  # min // -1 wraps to min, as in NumPy
    g = Graph("ints")
    x, y = g.input("a", (67,), dtype=dtype), g.input("b", (67,), dtype=dtype)
    g.output(
        q=x // y, r=x % y, q3=x // 3, r3=x % -4, rq=100 // g.maximum(y, 1), rr=7 % g.minimum(y, -1), f=g.fmod(x, y)
    )
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        want = {
            "q": a // b,
            "r": a % b,
            "q3": a // np.asarray(3, dtype),
            "r3": a % np.asarray(-4, dtype),
            "rq": np.asarray(100, dtype) // np.maximum(b, 1),
            "rr": np.asarray(7, dtype) % np.minimum(b, -1),
            "f": np.fmod(a, b),
        }
    for threads in (1, 2):
        got = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=threads))(a=a, b=b)
        for name, expected in want.items():
            assert got[name].dtype == expected.dtype, name
            np.testing.assert_array_equal(got[name], expected, err_msg=name)
    reference = rlx.reference.run(g, a=a, b=b)
    for name, expected in want.items():
        np.testing.assert_array_equal(reference[name], expected, err_msg=name)


def test_float_floor_division_and_remainder_match_numpy() -> None:
    rng = np.random.default_rng(2)
    a = (rng.standard_normal(70) * 7).astype(np.float32)
    b = (rng.standard_normal(70) * 2).astype(np.float32)
    edge_a = [1.0, -1.0, 5.0, -5.0, 0.0, -0.0, 3.0, np.inf, np.nan, 6.0, 1.0, -7.5]
    edge_b = [0.1, 0.1, 0.0, 0.0, 2.0, -2.0, np.inf, 2.0, 1.0, -3.0, -np.inf, 2.5]
    a[: len(edge_a)], b[: len(edge_b)] = edge_a, edge_b
    g = Graph("floats")
    x, y = g.input("a", (70,)), g.input("b", (70,))
    g.output(q=x // y, r=x % y, q2=x // 0.75, r2=2.5 % y, f=g.fmod(x, y))
    with np.errstate(divide="ignore", invalid="ignore"):
        want = {"q": a // b, "r": a % b, "q2": a // np.float32(0.75), "r2": np.float32(2.5) % b, "f": np.fmod(a, b)}
    got = rlx.compile(g)(a=a, b=b)
    for name, expected in want.items():
        np.testing.assert_array_equal(got[name], expected, err_msg=name)  # the same float32 steps as NumPy's
        np.testing.assert_array_equal(np.signbit(got[name]), np.signbit(expected), err_msg=f"{name} signs")


def test_rounding_matches_numpy() -> None:
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -0.2, 0.7, 1e9 + 0.5, -np.inf, np.nan, -0.0] * 3, np.float32)
    g = Graph("rounding")
    v = g.input("x", x.shape)
    g.output(floor=g.floor(v), ceil=g.ceil(v), trunc=g.trunc(v), round=g.round(v))
    got = rlx.compile(g)(x=x)
    for name, fn in [("floor", np.floor), ("ceil", np.ceil), ("trunc", np.trunc), ("round", np.round)]:
        np.testing.assert_array_equal(got[name], fn(x), err_msg=name)
        np.testing.assert_array_equal(np.signbit(got[name]), np.signbit(fn(x)), err_msg=name)
        np.testing.assert_array_equal(rlx.reference.run(g, x=x)[name], fn(x.astype(np.float64)), err_msg=name)


def test_remainder_gradient_and_zero_gradients_of_steps() -> None:
    """d(a % b) = da - (a // b) db; floor, round and ``//`` pass no gradient (zero almost everywhere)."""
    g = Graph("grad")
    a, b = g.input("a", (3, 4)), g.input("b", (4,))
    loss = g.sum((a % b) * (a % b)) + g.sum(g.floor(a) * b) + g.sum(g.round(a * 3.0) + a // b)
    loss = loss + g.sum(g.fmod(a, b) * 2.0 * b)
    da, db = rlx.grad(g, loss, [a, b])
    g.output(loss=loss, da=da, db=db)
    rng = np.random.default_rng(3)
    av = rng.uniform(-4, 4, (3, 4))
    bv = rng.choice([-1.0, 1.0], 4) * rng.uniform(0.7, 1.6, 4)
    got = rlx.compile(g)(a=av.astype(np.float32), b=bv.astype(np.float32))

    def loss_of() -> float:
        r = np.remainder(av, bv)
        rounding = np.sum(np.round(av * 3.0) + av // bv) + np.sum(np.fmod(av, bv) * 2.0 * bv)
        return float(np.sum(r * r) + np.sum(np.floor(av) * bv) + rounding)

    np.testing.assert_allclose(got["da"], central_differences(loss_of, av), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(got["db"], central_differences(loss_of, bv), rtol=1e-3, atol=1e-3)


def test_mixing_dtypes_is_a_build_error() -> None:
    g = Graph("mixed")
    i = g.input("i", (3,), dtype="int64")
    with pytest.raises(rlx.RlxTypeError, match="floor_divide"):
        i // g.input("x", (3,))
    with pytest.raises(rlx.RlxTypeError, match="remainder"):
        g.input("j", (3,), dtype="int32") % i
    with pytest.raises(rlx.RlxTypeError, match="floor"):
        g.floor(i)
