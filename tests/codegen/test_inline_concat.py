"""A ``concat`` along any axis but the last is read inline by the loop nest that consumes it:
each index reads the part it falls in. Compared with NumPy where the joined axis is an outer
loop, the vector loop (through a transpose), symbolic, and where the parts are zeros (a pad)."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph


def _run(g: Graph, **arrays: np.ndarray) -> dict[str, np.ndarray]:
    exe = rlx.compile(g)
    assert not any(kernel.name == "fused.concat" for kernel in exe.kernels), exe  # no copy of the concat
    return exe(**arrays)


@pytest.mark.parametrize("threads", [1, 2])
def test_concat_along_an_outer_axis_and_along_the_vector_lanes(threads: int) -> None:
    g = Graph("inline_concat")
    a, b = g.input("a", (3, 10, 20)), g.input("b", (3, 13, 20))
    joined = g.concat([a, b * 2.0], axis=1)  # [3, 23, 20]
    g.output(outer=g.exp(joined), lanes=g.transpose(joined, (0, 2, 1)) + 1.0)  # the joined axis last: lanes
    rng = np.random.default_rng(0)
    av, bv = rng.standard_normal((3, 10, 20), dtype=np.float32), rng.standard_normal((3, 13, 20), dtype=np.float32)
    exe = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=threads))
    got = exe(a=av, b=bv)
    want = np.concatenate([av, bv * 2.0], axis=1)
    np.testing.assert_allclose(got["outer"], np.exp(want), rtol=1e-6)
    np.testing.assert_array_equal(got["lanes"], np.transpose(want, (0, 2, 1)) + 1.0)


def test_a_sum_of_pads_is_one_loop_nest() -> None:
    """The gradient of overlapping slices: each slice's cotangent padded back, summed."""
    g = Graph("pads")
    x = g.input("x", (4, 9, 33))
    loss = g.sum(x[:, 1:, :] * x[:, :-1, :]) + g.sum(x[:, 2:5, :] ** 2)
    (dx,) = rlx.grad(g, loss, [x])
    g.output(dx=dx)
    xv = np.random.default_rng(1).standard_normal((4, 9, 33)).astype(np.float32)
    got = _run(g, x=xv)["dx"]
    want = np.zeros_like(xv)
    want[:, 1:] += xv[:, :-1]
    want[:, :-1] += xv[:, 1:]
    want[:, 2:5] += 2 * xv[:, 2:5]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_concat_with_a_symbolic_part() -> None:
    g = Graph("symbolic_concat")
    cache, new = g.input("cache", (2, "P", 20)), g.input("new", (2, 1, 20))
    joined = g.concat([cache, new], axis=1)
    g.output(y=g.transpose(joined, (0, 2, 1)) * 3.0, z=joined - 1.0)
    exe = rlx.compile(g)
    rng = np.random.default_rng(2)
    for p in (1, 17, 40):
        cv, nv = rng.standard_normal((2, p, 20), dtype=np.float32), rng.standard_normal((2, 1, 20), dtype=np.float32)
        got = exe(cache=cv, new=nv)
        want = np.concatenate([cv, nv], axis=1)
        np.testing.assert_allclose(got["y"], np.transpose(want, (0, 2, 1)) * 3.0, rtol=1e-6)
        np.testing.assert_allclose(got["z"], want - 1.0, rtol=1e-6)
    assert exe.compile_count == 1
