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
    # Steps: whole groups from the start (a view), groups ending at each element (a view), neither
    # (the last element concatenated), and negative steps (a gather), mixed with the rest.
    ("even", lambda v: v[..., ::2]),
    ("odd", lambda v: v[..., 1::2]),
    ("step-last-column", lambda v: v[:, 2::2]),
    ("step-concat", lambda v: v[:, ::3, 1::4]),
    ("step-one-element", lambda v: v[1::5, 3::9]),
    ("step-with-int", lambda v: v[::2, 1, ::3]),
    ("reverse", lambda v: v[::-1]),
    ("reverse-step", lambda v: v[1, 4:0:-3, ::-2]),
    ("reverse-newaxis", lambda v: v[None, ..., 5::-4]),
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
    positive = x > 0
    before = len(g)
    cases = [
        (lambda: x[4], rlx.RlxValueError, "index 4 is out of bounds for axis 0 of size 4"),
        (lambda: x[::0], rlx.RlxValueError, "slice step cannot be zero"),
        (lambda: x[::2.0], rlx.RlxTypeError, "got float"),
        (lambda: s[:, ::2], rlx.RlxValueError, "only steps of 1 slice a symbolic axis"),
        (lambda: x[3:1:2], rlx.RlxValueError, "takes nothing"),
        (lambda: x[[0, 5]], rlx.RlxValueError, "index 5 is out of bounds for axis 0 of size 4"),
        (lambda: x[[-5]], rlx.RlxValueError, "index -5 is out of bounds for axis 0 of size 4"),
        (lambda: x[x], rlx.RlxTypeError, "must be int32 or int64"),
        (lambda: x[positive], rlx.RlxTypeError, "g.where"),
        (lambda: x[[0.5]], rlx.RlxTypeError, "must hold ints"),
        (lambda: x[[[0, 1], [2]]], rlx.RlxValueError, "rectangular"),
        (lambda: x[[0], [1], [2], [3]], rlx.RlxValueError, "too many indices"),
        (lambda: x[np.zeros(4, bool)], rlx.RlxValueError, "selects nothing"),
        (lambda: x[:, [1, 2], 7], rlx.RlxValueError, "index 7 is out of bounds for axis 2 of size 6"),
        (lambda: s[[0], [1]], rlx.RlxValueError, "lengths known when the graph is built"),
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
    assert s[..., ::2].shape == (2, "S", 2) and s[::-1].shape == (2, "S", 3)  # steps on static axes
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


def test_steps_on_symbolic_values_and_int_values() -> None:
    """Interleaved rotary halves (``x[..., ::2]``, ``x[..., 1::2]``) of a value whose sequence
    axis is symbolic, on one compilation at two lengths; int and bool values take positive steps
    (views) and negative ones (gathers), as float values do."""
    g = Graph("rope")
    x = g.input("x", (2, "S", 3, 8))
    cos, sin = g.input("cos", ("S", 1, 4)), g.input("sin", ("S", 1, 4))
    even, odd = x[..., ::2], x[..., 1::2]
    y = g.concat([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    (dx,) = rlx.grad(g, g.sum(y * y), [x])
    g.output(y=y, dx=dx)
    exe = rlx.compile(g)
    rng = np.random.default_rng(1)
    for length in (1, 13):
        arrays = {
            "x": rng.standard_normal((2, length, 3, 8)).astype(np.float32),
            "cos": rng.standard_normal((length, 1, 4)).astype(np.float32),
            "sin": rng.standard_normal((length, 1, 4)).astype(np.float32),
        }
        got = exe(**arrays)
        a, b = arrays["x"][..., ::2].astype(np.float64), arrays["x"][..., 1::2].astype(np.float64)
        c, s = arrays["cos"].astype(np.float64), arrays["sin"].astype(np.float64)
        want = np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
        np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)
        ya, yb = 2 * want[..., :4], 2 * want[..., 4:]  # d sum(y*y) / dy, chained by hand
        dx_want = np.empty_like(want)
        dx_want[..., ::2], dx_want[..., 1::2] = ya * c + yb * s, -ya * s + yb * c
        np.testing.assert_allclose(got["dx"], dx_want, rtol=1e-4, atol=1e-4)
    assert exe.compile_count == 1

    h = Graph("ids")
    ids = h.input("ids", (3, 7), dtype="int64")
    flags = h.input("flags", (3, 7), dtype="bool")
    h.output(even=ids[:, ::2], odd=ids[:, 1::3], backwards=ids[:, ::-1], flipped=flags[::-2, 5::-3])
    values = np.arange(21, dtype=np.int64).reshape(3, 7)
    flag_values = values % 3 == 0
    got = rlx.compile(h)(ids=values, flags=flag_values)
    np.testing.assert_array_equal(got["even"], values[:, ::2])
    np.testing.assert_array_equal(got["odd"], values[:, 1::3])
    np.testing.assert_array_equal(got["backwards"], values[:, ::-1])
    np.testing.assert_array_equal(got["flipped"], flag_values[::-2, 5::-3])
