"""Running extremes and log-sum-exps: ``cummax``, ``cummin`` (with positions) and
``logcumsumexp``, compiled, against definitions written here entry by entry (torch's rule for
ties and NaN) and NumPy's ``logaddexp.accumulate`` in float64."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph, RlxTypeError, RlxValueError, RuntimeConfig


def _running_extreme(row: list[float], largest: bool) -> tuple[list[float], list[int]]:
    """torch's cummax/cummin of one row: an entry takes over where it is NaN, or where neither it
    nor the running value is NaN and it is at least as large (small)."""
    values: list[float] = []
    positions: list[int] = []
    for i, entry in enumerate(row):
        if i == 0:
            values.append(entry)
            positions.append(0)
            continue
        held = values[-1]
        at_least = entry >= held if largest else entry <= held
        takes = bool(np.isnan(entry)) or (not np.isnan(held) and at_least)
        values.append(entry if takes else held)
        positions.append(i if takes else positions[-1])
    return values, positions


def _along(x: np.ndarray, axis: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    moved = np.moveaxis(x, axis, -1)
    values, positions = np.empty_like(moved), np.zeros(moved.shape, np.int64)
    for index in np.ndindex(*moved.shape[:-1]):
        v, p = _running_extreme(list(moved[index]), largest)
        values[index], positions[index] = v, p
    return np.moveaxis(values, -1, axis), np.moveaxis(positions, -1, axis)


def _floats_with_ties_and_nan() -> np.ndarray:
    x = np.round(np.random.default_rng(0).standard_normal((4, 9, 5)) * 2).astype(np.float32)
    x[0, 3, 1] = x[2, 0, 4] = x[3, 7, 0] = np.nan
    x[1, :, 2] = -np.inf
    x[1, 4, 3] = np.inf
    return x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("dtype", ["float32", "int32", "int64"])
def test_running_extremes_follow_torch_rule(axis: int, dtype: str, threads: int) -> None:
    x = _floats_with_ties_and_nan()
    if dtype != "float32":
        x = np.nan_to_num(x, nan=7, posinf=9, neginf=-9).astype(dtype)
    g = Graph("extremes")
    xv = g.input("x", x.shape, dtype=dtype)
    high, high_at = g.cummax(xv, axis=axis)
    low, low_at = g.cummin(xv, axis=axis)
    g.output(high=high, high_at=high_at, low=low, low_at=low_at)
    got = rlx.compile(g, config=RuntimeConfig(num_threads=threads))(x=x)
    for name, largest in (("high", True), ("low", False)):
        values, positions = _along(x, axis, largest)
        assert got[name].dtype == x.dtype and got[f"{name}_at"].dtype == np.int64
        np.testing.assert_array_equal(got[name], values)
        np.testing.assert_array_equal(got[f"{name}_at"], positions)


def test_running_extremes_of_a_transposed_operand_and_their_gradient() -> None:
    """The cotangent of each running extreme goes to the entry it holds (ties: the latest)."""
    x = np.array([[1.0, 3.0, 3.0, 2.0, 5.0, 5.0], [4.0, 4.0, 1.0, 0.0, 4.0, -1.0]], np.float32)
    g = Graph("extreme_grad")
    xv = g.input("x", (6, 2))
    values, _ = g.cummax(g.transpose(xv, (1, 0)), axis=1)
    weights = g.constant(np.arange(1, 13, dtype=np.float32).reshape(2, 6))
    loss = g.sum(values * weights)
    (dx,) = rlx.grad(g, loss, [xv])
    g.output(dx=dx)
    got = rlx.compile(g)(x=x.T.copy())["dx"]
    want = np.zeros((2, 6), np.float32)
    for row in range(2):
        _, positions = _running_extreme(list(x[row]), largest=True)
        for j, p in enumerate(positions):
            want[row, p] += float(j + 1 + 6 * row)
    np.testing.assert_array_equal(got, want.T)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_logcumsumexp_matches_logaddexp_accumulate(axis: int, reverse: bool) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 8, 4)) * 30).astype(np.float32)  # exp of most entries overflows
    x[0, :, 0] = -np.inf  # a run with nothing in it: -inf throughout
    x[1, 2, 1] = -np.inf
    x[2, 5, 2] = np.inf
    g = Graph("lcse")
    g.output(y=g.logcumsumexp(g.input("x", x.shape), axis=axis, reverse=reverse))
    got = rlx.compile(g)(x=x)["y"]
    wide = np.flip(x, axis) if reverse else x
    want = np.logaddexp.accumulate(wide.astype(np.float64), axis=axis)
    want = np.flip(want, axis) if reverse else want
    assert np.isfinite(got[np.isfinite(want)]).all()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-5)


def test_logcumsumexp_propagates_nan() -> None:
    x = np.array([[0.0, np.nan, 1.0, 2.0], [1.0, 2.0, 3.0, np.nan]], np.float32)
    g = Graph("lcse_nan")
    g.output(y=g.logcumsumexp(g.input("x", x.shape), axis=1))
    got = rlx.compile(g)(x=x)["y"]
    assert np.isnan(got[0, 1:]).all() and np.isnan(got[1, 3])
    np.testing.assert_allclose(got[1, :3], np.logaddexp.accumulate(x[1, :3].astype(np.float64)), rtol=1e-6)


def test_logcumsumexp_gradient_of_large_scores_stays_finite() -> None:
    """``dx[i] = sum over j >= i of dy[j] exp(x[i] - y[j])`` in float64, for scores whose
    exponentials overflow float32 and cotangents of both signs."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3, 10)) * 60).astype(np.float32)
    dy = rng.standard_normal((3, 10)).astype(np.float32)
    g = Graph("lcse_grad")
    xv, dyv = g.input("x", x.shape), g.input("dy", dy.shape)
    y = g.logcumsumexp(xv, axis=1)
    (dx,) = rlx.grad(g, y, [xv], dyv)
    g.output(dx=dx)
    got = rlx.compile(g)(x=x, dy=dy)["dx"]
    wide = x.astype(np.float64)
    ys = np.logaddexp.accumulate(wide, axis=1)
    want = np.zeros_like(wide)
    for i in range(10):
        want[:, i] = (dy[:, i:] * np.exp(wide[:, i : i + 1] - ys[:, i:])).sum(axis=1)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_symbolic_length_compiles_once() -> None:
    g = Graph("symbolic")
    xv = g.input("x", ("n", 3))
    values, positions = g.cummax(xv, axis=0)
    g.output(values=values, positions=positions, lse=g.logcumsumexp(xv, axis=0))
    exe = rlx.compile(g)
    for n in (1, 5, 33):
        x = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32)
        got = exe(x=x)
        v, p = _along(x, 0, largest=True)
        np.testing.assert_array_equal(got["values"], v)
        np.testing.assert_array_equal(got["positions"], p)
        np.testing.assert_allclose(got["lse"], np.logaddexp.accumulate(x.astype(np.float64), axis=0), rtol=1e-6)
    assert exe.compile_count == 1


def test_bad_operands_are_named() -> None:
    g = Graph("bad")
    ints, flags = g.input("ids", (3, 4), dtype="int64"), g.input("flags", (3, 4), dtype="bool")
    with pytest.raises(RlxTypeError, match="logcumsumexp"):
        g.logcumsumexp(ints, axis=0)
    with pytest.raises(RlxTypeError, match="cummax"):
        g.cummax(flags, axis=0)
    with pytest.raises(RlxValueError, match="cummin"):
        g.cummin(g.input("x", (3, 4)), axis=2)
