"""``stop_gradient``: the value itself, compiled and in the reference, with no gradient through it
(the other paths to the same input keep theirs), for floats and ints, fused into loop nests."""

from __future__ import annotations

import numpy as np

import rlx
from rlx import Graph


def test_values_pass_and_gradients_stop() -> None:
    g = Graph("stop")
    x = g.input("x", (3, 4))
    ids = g.input("ids", (3, 4), dtype="int64")
    held = g.stop_gradient(x * 2.0)
    y = x * held + g.exp(x) * g.stop_gradient(ids).astype("float32")
    (dx,) = rlx.grad(g, g.sum(y), [x])
    g.output(y=y, dx=dx, held=held)
    rng = np.random.default_rng(12)
    xv = rng.standard_normal((3, 4)).astype(np.float32)
    iv = rng.integers(0, 5, (3, 4))
    got = rlx.compile(g)(x=xv, ids=iv)
    np.testing.assert_allclose(got["y"], xv * 2 * xv + np.exp(xv) * iv, rtol=1e-6)
    np.testing.assert_allclose(got["held"], xv * 2.0)
    # d/dx of x * stop(2x) is stop(2x) = 2x (not 4x); of exp(x) * ids, exp(x) * ids.
    np.testing.assert_allclose(got["dx"], 2 * xv + np.exp(xv) * iv, rtol=1e-5)
    reference = rlx.reference.run(g, x=xv, ids=iv)
    np.testing.assert_allclose(reference["dx"], got["dx"], rtol=1e-5)
    assert len(rlx.compile(g).kernels) == 3  # one loop nest per output: the identity fuses into them
