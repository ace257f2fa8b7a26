"""``min``, ``argmax`` and ``argmin``, compiled, against NumPy (ties, NaN, axes, keepdims)."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph

AXES = [None, 0, 1, -1, 2]


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES)
def test_match_numpy_with_ties_and_nan(axis: int | None, keepdims: bool) -> None:
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, (3, 5, 6)).astype(np.float32)  # many ties: the first position wins
    x[1, 2, 3] = x[2, 4, 0] = np.nan  # NumPy: a NaN is the extremum, the first one found
    x[0, 1, 2] = -np.inf
    g = Graph("arg")
    v = g.input("x", (3, 5, 6))
    g.output(amax=v.argmax(axis, keepdims), amin=g.argmin(v, axis, keepdims), low=v.min(axis, keepdims))
    got = rlx.compile(g)(x=x)
    np.testing.assert_array_equal(got["amax"], np.argmax(x, axis=axis, keepdims=keepdims))
    np.testing.assert_array_equal(got["amin"], np.argmin(x, axis=axis, keepdims=keepdims))
    np.testing.assert_array_equal(got["low"], np.min(x, axis=axis, keepdims=keepdims))
    assert got["amax"].dtype == np.int64
    reference = rlx.reference.run(g, x=x)
    for name in got:
        np.testing.assert_array_equal(got[name], reference[name])


def test_greedy_decoding_over_a_symbolic_length() -> None:
    """The next token of each sequence from the last row of logits ``[B, S, V]``, ``S`` per call."""
    g = Graph("greedy")
    logits = g.input("logits", (2, "S", 50))
    g.output(next_token=logits[:, -1].argmax(-1), per_position=logits.argmax(axis=2))
    exe = rlx.compile(g)
    rng = np.random.default_rng(4)
    for length in (1, 9):
        array = rng.standard_normal((2, length, 50)).astype(np.float32)
        got = exe(logits=array)
        np.testing.assert_array_equal(got["next_token"], array[:, -1].argmax(-1))
        np.testing.assert_array_equal(got["per_position"], array.argmax(2))
    assert exe.compile_count == 1


def test_search_along_a_symbolic_axis() -> None:
    """The position along ``S`` itself (the best-scoring position of each sequence), and over
    all entries: ties to the first, a NaN found first, as NumPy, one compilation for every ``S``."""
    g = Graph("positions")
    scores = g.input("scores", (2, "S", 3))
    g.output(best=scores.argmax(axis=1), worst=g.argmin(scores, axis=1, keepdims=True), flat=scores.argmax())
    exe = rlx.compile(g)
    rng = np.random.default_rng(5)
    for length in (1, 6, 70):
        array = rng.integers(0, 3, (2, length, 3)).astype(np.float32)  # ties
        if length > 1:
            array[1, length - 1, 2] = np.nan
        got = exe(scores=array)
        np.testing.assert_array_equal(got["best"], np.argmax(array, axis=1))
        np.testing.assert_array_equal(got["worst"], np.argmin(array, axis=1, keepdims=True))
        np.testing.assert_array_equal(got["flat"], np.argmax(array))
    assert exe.compile_count == 1


def test_min_gradient_splits_ties_as_torch_amin() -> None:
    g = Graph("amin")
    x = g.input("x", (2, 4))
    (dx,) = rlx.grad(g, g.sum(g.min(x, axis=1) * g.constant(np.array([1.0, 2.0], np.float32))), [x])
    g.output(dx=dx)
    array = np.array([[3.0, 1.0, 1.0, 2.0], [0.5, 4.0, 5.0, 6.0]], np.float32)
    got = rlx.compile(g)(x=array)["dx"]
    np.testing.assert_array_equal(got, [[0.0, 0.5, 0.5, 0.0], [2.0, 0.0, 0.0, 0.0]])


def test_errors_name_the_op() -> None:
    g = Graph("bad")
    x = g.input("x", (2, 3))
    with pytest.raises(rlx.RlxValueError, match="argmax: axis 2 is out of range"):
        x.argmax(2)
    with pytest.raises(rlx.RlxTypeError, match="argmin: axis must be an int"):
        g.argmin(x, (0, 1))
    with pytest.raises(rlx.RlxTypeError, match=r"astype\('float32'\)"):
        g.argmax(g.input("ids", (3,), dtype="int64"))
    with pytest.raises(rlx.RlxTypeError, match="only float32 values have gradients"):
        rlx.grad(g, g.sum(x), [x.argmax(0)])
