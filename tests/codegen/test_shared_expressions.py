"""A value several kernels would recompute inline gets a buffer once the recomputation costs more.

Residual streams are the case that matters: ``x_l = x_(l-1) + f_l(x_(l-1))`` read by the next
layer's kernels and by the backward's. Computed inline everywhere, every later kernel recomputed
the whole stream, so kernel size (and compile time) grew with the depth squared. These tests
build such a stream, check that no kernel's inline expression grows with the depth, and that the
results (forward and gradients) still match the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from codegen_helpers import assert_close

import rlx
from rlx import Graph


def _stream(depth: int) -> Graph:
    g = Graph(f"stream{depth}")
    x = g.input("x", (6, 16))
    weights = [g.input(f"w{i}", (16, 16)) for i in range(depth)]
    h = x
    for w in weights:
        norm = h * g.rsqrt(g.mean(h * h, axis=-1, keepdims=True) + 1e-6)
        h = h + g.tanh(norm @ w)
    loss = g.mean(h * h)
    g.output(loss=loss, **{f"d{i}": d for i, d in enumerate(rlx.grad(g, loss, [x, *weights]))})
    return g


def _inputs(g: Graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(len(g.inputs))
    return {name: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for name, v in g.inputs.items()}


@pytest.mark.parametrize("depth", [3, 12])
def test_a_residual_stream_matches_the_reference(depth: int) -> None:
    g = _stream(depth)
    arrays = _inputs(g)
    got, want = rlx.compile(g)(**arrays), rlx.reference.run(g, **arrays)
    for name in want:
        assert_close(got[name], want[name], name, rtol=1e-4, atol=1e-5)


def test_kernels_do_not_grow_with_the_depth() -> None:
    shallow = max(len(k.nodes) for k in rlx.compile(_stream(3)).kernels)
    deep = max(len(k.nodes) for k in rlx.compile(_stream(12)).kernels)
    assert deep <= shallow + 2, (shallow, deep)  # without shared buffers: 12 layers gave kernels 4x as large
