"""Fusion changes cost, not results: fused and unfused compilations agree to float32 rounding.

Also: ``rlx.compile`` never mutates the user's graph; forward + ``rlx.grad`` graphs match the
reference and central finite differences of the float64 forward; a long causal sequence agrees
between the fused kernel, the unfused kernels and the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from codegen_helpers import assert_close, assert_outputs_close, case_inputs, declare_inputs
from helpers import Case

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, Wrt
from rlx.ir.ops import AttentionBwdAttrs
from rlx.reference import attention_forward

# Float32 rounding: the fused kernel computes the same products, maybe in other strip sizes.
ROUNDING = {"rtol": 1e-5, "atol": 2e-6}


def grad_graph(case: Case, name: str = "grad") -> Graph:
    """``out = attention(q, k, v)``; ``dq, dk, dv = rlx.grad(out)`` (three single-wrt nodes)."""
    g = Graph(name)
    q, k, v, dy, mask = declare_inputs(g, case)
    out = g.attention(q, k, v, mask=case.mask, layout=case.layout, mask_input=mask)
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    return g


def bwd_nodes(g: Graph) -> list[AttentionBwdAttrs]:
    attrs = [node.attrs for node in g.nodes if node.op is OpKind.ATTENTION_BWD]
    assert all(isinstance(a, AttentionBwdAttrs) for a in attrs)
    return attrs  # type: ignore[return-value]


FUSION_CASES = [
    Case(6, 6, mask=MaskKind.NONE, layout=Layout.BSHD),
    Case(5, 9, mask=MaskKind.CAUSAL, layout=Layout.BHSD),
    Case(9, 5, head_dim=3, mask=MaskKind.sliding_window(2), layout=Layout.BSHD),
    Case(7, 8, mask=MaskKind.CUSTOM, layout=Layout.BHSD),
    Case(6, 7, head_dim=5, heads=3, mask=MaskKind.BIAS, layout=Layout.BSHD),
]


@pytest.mark.parametrize("case", FUSION_CASES, ids=lambda c: f"{c.mask}-{c.layout}")
def test_fused_equals_unfused(case: Case, rng: np.random.Generator) -> None:
    """Default pipeline: one ATTENTION_BWD node with wrt ALL; ``passes=[]``: three; same numbers."""
    g = grad_graph(case)
    before = str(g)
    fused = rlx.compile(g)
    unfused = rlx.compile(g, passes=[])
    assert str(g) == before, "rlx.compile mutated the user's graph"
    assert [a.wrt for a in bwd_nodes(fused.graph)] == [Wrt.ALL]
    assert sorted(a.wrt.value for a in bwd_nodes(unfused.graph)) == [1, 2, 4]
    assert len(bwd_nodes(g)) == 3
    assert list(fused.graph.outputs) == list(g.outputs) == ["out", "dq", "dk", "dv"]

    arrays = case_inputs(case, rng)
    got_fused, got_unfused = fused(**arrays), unfused(**arrays)
    assert_outputs_close(got_fused, got_unfused, context="fused vs unfused", **ROUNDING)
    assert_outputs_close(got_fused, rlx.reference.run(g, **arrays), context="fused vs reference")


def test_two_siblings_fuse_into_one_node(rng: np.random.Generator) -> None:
    """attention_bwd Q and V on the same operands become one Q|V node; numbers unchanged."""
    case = Case(7, 5, mask=MaskKind.sliding_window(1), layout=Layout.BHSD)
    g = Graph("pair")
    q, k, v, dy, _ = declare_inputs(g, case)
    dq = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY, mask=case.mask, layout=case.layout)
    dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE, mask=case.mask, layout=case.layout)
    g.output(dq=dq, dv=dv)
    before = str(g)
    fused, unfused = rlx.compile(g), rlx.compile(g, passes=[])
    assert str(g) == before
    assert [a.wrt for a in bwd_nodes(fused.graph)] == [Wrt.QUERY | Wrt.VALUE]
    assert len(bwd_nodes(unfused.graph)) == 2
    arrays = case_inputs(case, rng)
    assert_outputs_close(fused(**arrays), unfused(**arrays), **ROUNDING)
    assert_outputs_close(fused(**arrays), rlx.reference.run(g, **arrays))


FD_CASES = [
    Case(5, 7, head_dim=4, batch=1, heads=2, mask=MaskKind.NONE, layout=Layout.BSHD),
    Case(6, 6, head_dim=3, batch=1, heads=2, mask=MaskKind.CAUSAL, layout=Layout.BHSD),
    Case(7, 5, head_dim=4, batch=1, heads=1, mask=MaskKind.sliding_window(1), layout=Layout.BSHD),
    Case(4, 6, head_dim=4, batch=2, heads=1, mask=MaskKind.CUSTOM, layout=Layout.BHSD),
    Case(5, 5, head_dim=4, batch=1, heads=2, mask=MaskKind.BIAS, layout=Layout.BSHD),
]


@pytest.mark.parametrize("case", FD_CASES, ids=lambda c: f"{c.mask}-{c.layout}")
def test_grad_graph_matches_reference_and_finite_differences(case: Case, rng: np.random.Generator) -> None:
    """Compiled dq/dk/dv of ``sum(out * dy)`` equal central differences of the float64 forward."""
    g = grad_graph(case)
    arrays = case_inputs(case, rng)
    got = rlx.compile(g)(**arrays)
    assert_outputs_close(got, rlx.reference.run(g, **arrays))

    wide = {name: array.astype(np.float64) for name, array in arrays.items()}
    mask_tensor = wide.get("mask")

    def loss() -> float:
        out = attention_forward(wide["q"], wide["k"], wide["v"], mask=case.mask, layout=case.layout,
                                mask_tensor=mask_tensor)
        return float(np.sum(out * wide["dy"]))

    eps = 1e-6
    for name, grad_name in (("q", "dq"), ("k", "dk"), ("v", "dv")):
        x = wide[name]
        flat = rng.choice(x.size, size=6, replace=False)
        for index in (np.unravel_index(i, x.shape) for i in flat):
            saved = x[index]
            x[index] = saved + eps
            up = loss()
            x[index] = saved - eps
            down = loss()
            x[index] = saved
            numeric = (up - down) / (2 * eps)
            assert abs(got[grad_name][index] - numeric) <= 1e-4 + 1e-3 * abs(numeric), (grad_name, index, numeric)


def _long_causal(batch: int, heads: int, seq: int, dim: int, rng: np.random.Generator) -> None:
    case = Case(seq, seq, head_dim=dim, batch=batch, heads=heads, mask=MaskKind.CAUSAL)
    g = grad_graph(case, "long")
    arrays = case_inputs(case, rng)
    fused, unfused = rlx.compile(g), rlx.compile(g, passes=[])
    assert [a.wrt for a in bwd_nodes(fused.graph)] == [Wrt.ALL]
    got_fused, got_unfused = fused(**arrays), unfused(**arrays)
    expected = rlx.reference.run(g, **arrays)
    for name, value in expected.items():
        assert np.all(np.isfinite(got_fused[name])), name
        assert_close(got_fused[name], got_unfused[name], f"{name} fused vs unfused", rtol=1e-4, atol=1e-5)
        assert_close(got_fused[name], value, f"{name} fused vs reference", rtol=1e-4, atol=2e-5)


def test_causal_512_fused_unfused_reference(rng: np.random.Generator) -> None:
    """(B, H, S, D) = (1, 2, 512, 64) causal: several strips, key skipping on; all three agree."""
    _long_causal(1, 2, 512, 64, rng)


@pytest.mark.slow
def test_causal_4096_fused_unfused_reference(rng: np.random.Generator) -> None:
    """(1, 1, 4096, 64) causal: long-sequence accumulation in dK/dV stays at float32 accuracy."""
    _long_causal(1, 1, 4096, 64, rng)


def test_max_gradient_sees_the_same_bits_as_the_max() -> None:
    """``x == max(x)`` picks the max's argument only if both sides read the same bits of x.

    Found by the graph fuzzer: a softmax recomputed inline in two kernels rounded differently
    (its sum is a reduction inside the loop nest), the equality missed, and the gradient of
    ``max(softmax(silu(x)), axis=0)`` went to the wrong entry with the wrong sign.
    """
    g = Graph("max_grad")
    x = g.input("x", (2, 2))
    weights = g.constant(np.array([0.27392337, -0.46042657], np.float32))
    loss = g.sum(g.max(g.softmax(g.silu(x), axis=0), axis=0) * weights)
    (dx,) = rlx.grad(g, loss, [x])
    g.output(loss=loss, dx=dx)
    arrays = {"x": np.random.default_rng(1).uniform(-1.5, 1.5, (2, 2)).astype(np.float32)}
    got = rlx.compile(g)(**arrays)
    want = rlx.reference.run(g, **arrays)
    np.testing.assert_allclose(got["dx"], want["dx"], rtol=1e-5, atol=1e-6)
