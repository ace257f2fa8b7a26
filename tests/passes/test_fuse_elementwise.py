"""``fuse-elementwise``: changed flag, printed IR, and equal numerics before and after."""

from __future__ import annotations

import numpy as np

import rlx
from rlx import Graph, OpKind


def _graph() -> Graph:
    g = Graph("chains")
    x = g.input("x", (3, 8))
    w = g.input("w", (8,))
    h = g.tanh(x * w + 1.0)
    g.output(y=g.softmax(h, axis=-1), h2=h * 2.0)  # h is read twice: it ends its chain
    return g


def test_chains_become_fused_nodes_with_the_same_numerics() -> None:
    g = _graph()
    rlx.passes.decompose(g)
    before = g.copy()
    assert rlx.passes.fuse_elementwise(g)
    fused = [n for n in g.nodes if n.op is OpKind.FUSED_ELEMENTWISE]
    programs = sorted(str(n.attrs.program) for n in fused)
    assert '"mul(%i0, %i1); add(%t0, %i2); tanh(%t1)"' in programs
    assert not rlx.passes.fuse_elementwise(g), "a second run finds nothing to fuse"
    g.verify()
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((3, 8), dtype=np.float32), "w": rng.standard_normal(8, dtype=np.float32)}
    want = rlx.reference.run(before, **arrays)
    got = rlx.reference.run(g, **arrays)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)
    compiled = rlx.compile(g, passes=[])(**arrays)
    for name in want:
        np.testing.assert_allclose(compiled[name], want[name], rtol=1e-5, atol=1e-6)


def test_values_with_other_readers_or_outputs_are_not_absorbed() -> None:
    g = Graph("keep")
    x = g.input("x", (4,))
    a = g.exp(x)
    b = g.neg(a)
    g.output(a=a, c=b * 3.0)
    rlx.passes.fuse_elementwise(g)
    text = str(g)
    assert "%0 = exp %x" in text, text  # a is an output: it keeps its own node
    assert 'program = "neg(%i0); mul(%t0, %i1)"' in text


def test_fused_nodes_print_and_parse() -> None:
    g = _graph()
    rlx.passes.run(g, list(rlx.passes.DEFAULT_PIPELINE))
    assert any(n.op is OpKind.FUSED_ELEMENTWISE for n in g.nodes)
    assert str(rlx.ir.parse(str(g))) == str(g)
