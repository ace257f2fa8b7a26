"""Integer ``add sub mul maximum minimum neg abs``: NumPy's arithmetic in the operands' dtype
(int32 wraps as NumPy's does), Python ints beside int values as constants of their dtype."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph


def test_integer_arithmetic_matches_numpy() -> None:
    g = Graph("ints")
    i = g.input("i", (7,), dtype="int64")
    j = g.input("j", (2, 7), dtype="int32")
    x = g.input("x", (7,))
    g.output(
        shifted=i + 3,
        poly=2 * i - i * i,
        negated=-i,
        distance=abs(i - 4),
        floor=g.maximum(i, 2),
        ceiling=g.minimum(j, 300000),
        wrapped=j * j + 1,  # int32 overflow wraps, as in NumPy
        positions=(i + 1).astype("float32") * x,
        broadcast=j - g.reshape(i, (1, 7)).astype("int32"),
    )
    iv = np.arange(-2, 5, dtype=np.int64)
    jv = (np.arange(14, dtype=np.int32).reshape(2, 7) * 100000).astype(np.int32)
    xv = np.linspace(-1, 1, 7, dtype=np.float32)
    got = rlx.compile(g)(i=iv, j=jv, x=xv)
    with np.errstate(over="ignore"):
        want = {
            "shifted": iv + 3,
            "poly": 2 * iv - iv * iv,
            "negated": -iv,
            "distance": np.abs(iv - 4),
            "floor": np.maximum(iv, 2),
            "ceiling": np.minimum(jv, np.int32(300000)),
            "wrapped": jv * jv + np.int32(1),
            "positions": (iv + 1).astype(np.float32) * xv,
            "broadcast": jv - iv.astype(np.int32).reshape(1, 7),
        }
    for name, expected in want.items():
        assert got[name].dtype == expected.dtype, name
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
    reference = rlx.reference.run(g, i=iv, j=jv, x=xv)
    for name in ("shifted", "poly", "wrapped", "broadcast"):
        np.testing.assert_array_equal(reference[name], want[name], err_msg=name)


def test_mixed_dtypes_are_build_errors_and_gradients_skip_ints() -> None:
    g = Graph("mixed")
    i = g.input("i", (3,), dtype="int64")
    x = g.input("x", (3,))
    with pytest.raises(rlx.RlxTypeError, match=r"same dtype, got i64 .* and i32"):
        g.add(i, g.input("j", (3,), dtype="int32"))
    with pytest.raises(rlx.RlxTypeError, match="same dtype"):
        i + 1.5
    with pytest.raises(rlx.RlxTypeError, match="must be f32"):
        g.div(i, i)
    loss = g.sum(x * (i * 2).astype("float32"))
    (dx,) = rlx.grad(g, loss, [x])
    g.output(dx=dx)
    got = rlx.compile(g)(i=np.array([1, 2, 3]), x=np.ones(3, np.float32), j=np.zeros(3, np.int32))
    np.testing.assert_array_equal(got["dx"], [2.0, 4.0, 6.0])


def test_int32_wraps_between_the_ops_of_one_loop() -> None:
    """int32 lanes are computed in 64 bits: each op's result wraps to 32 bits before the next
    reads it, fused or not (``x * 65536 * 65536`` is 0 in int32, so ``// 7 + x`` is ``x``)."""
    g = Graph("wrap")
    x = g.input("x", (9,), dtype="int32")
    g.output(z=(x * 65536) * 65536 // 7 + x, w=(x * 40000) * 40000 - (x * 3), m=g.maximum(x * 2000000000, x))
    xv = np.arange(-4, 5, dtype=np.int32)
    with np.errstate(over="ignore"):
        want = {
            "z": (xv * np.int32(65536)) * np.int32(65536) // np.int32(7) + xv,
            "w": (xv * np.int32(40000)) * np.int32(40000) - xv * np.int32(3),
            "m": np.maximum(xv * np.int32(2000000000), xv),
        }
    for exe in (rlx.compile(g), rlx.compile(g, passes=[])):
        got = exe(x=xv)
        for name, expected in want.items():
            np.testing.assert_array_equal(got[name], expected, err_msg=name)
    reference = rlx.reference.run(g, x=xv)
    for name, expected in want.items():
        np.testing.assert_array_equal(reference[name], expected, err_msg=name)


def test_bitwise_operators_are_numpys() -> None:
    """``& | ^ ~`` are bitwise on ints and logical on bools; ``<< >>`` shift, by amounts past the
    width too (0 to the left, the sign's fill to the right, as NumPy's)."""
    g = Graph("bits")
    a = g.input("a", (6,), dtype="int32")
    b = g.input("b", (6,), dtype="int32")
    m = g.input("m", (6,), dtype="bool")
    g.output(
        both=a & b, either=a | 3, one=a ^ b, flipped=~a, left=a << b, right=a >> b, lit=3 >> b, mask=~m ^ (a > b),
        mask_and=m & (a > 0),
    )  # fmt: skip
    av = np.array([1, -8, 5, 123456, -1, 2**31 - 1], np.int32)
    bv = np.array([0, 3, 31, 32, 64, -1], np.int32)
    mv = np.array([True, False, True, False, True, False])
    with np.errstate(over="ignore"):
        want = {
            "both": av & bv, "either": av | np.int32(3), "one": av ^ bv, "flipped": ~av,
            "left": np.left_shift(av, bv), "right": np.right_shift(av, bv), "lit": np.right_shift(np.int32(3), bv),
            "mask": ~mv ^ (av > bv), "mask_and": mv & (av > 0),
        }  # fmt: skip
    assert [n.op.value for n in g.nodes if n.op.value.startswith(("logical", "bitwise"))].count("logical_and") == 1
    got = rlx.compile(g)(a=av, b=bv, m=mv)
    reference = rlx.reference.run(g, a=av, b=bv, m=mv)
    for name, expected in want.items():
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
        np.testing.assert_array_equal(reference[name], expected, err_msg=name)
    with pytest.raises(rlx.RlxTypeError, match="int32 or int64"):
        g.left_shift(m, m)
    with pytest.raises(rlx.RlxTypeError, match="one dtype"):
        g.bitwise_and(a, g.input("x", (6,)))
