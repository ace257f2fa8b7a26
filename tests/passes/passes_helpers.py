"""Builders and a numeric check shared by the pass tests (imported as `passes_helpers`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import rlx
from rlx import Graph, Layout, Value

B, H, D = 2, 2, 4


def qkv(
    g: Graph, sq: int = 6, sk: int = 6, layout: Layout = Layout.BSHD, dy_names: tuple[str, ...] = ("dy",)
) -> tuple[Value, ...]:
    """Inputs q, k, v and one dy per name, shaped for ``layout``."""
    q = g.input("q", layout.join(B, sq, H, D))
    k = g.input("k", layout.join(B, sk, H, D))
    v = g.input("v", layout.join(B, sk, H, D))
    return (q, k, v) + tuple(g.input(name, layout.join(B, sq, H, D)) for name in dy_names)


def random_inputs(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 arrays for every input; rank-2 inputs are 0/1 key-padding masks."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, value in g.inputs.items():
        if len(value.shape) == 2:
            arrays[name] = (rng.random(value.shape) > 0.3).astype(np.float32)
        else:
            arrays[name] = rng.standard_normal(value.shape).astype(np.float32)
    return arrays


def assert_same_numerics(g: Graph, transform: Callable[[Graph], object], seed: int = 0) -> Graph:
    """Run ``transform`` on a copy of ``g``; both graphs must give the same outputs. Returns the copy."""
    after = g.copy()
    transform(after)
    arrays = random_inputs(g, seed)
    before_out = rlx.reference.run(g, **arrays)
    after_out = rlx.reference.run(after, **arrays)
    assert list(before_out) == list(after_out)
    for name, expected in before_out.items():
        assert np.all(np.isfinite(expected)), name
        np.testing.assert_allclose(after_out[name], expected, rtol=1e-6, atol=1e-6, err_msg=name)
    return after
