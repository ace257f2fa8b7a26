"""GQA / MQA and a value head dim of its own in the fixed-mask API (``attention``, ``attention_bwd``).

Compiled against the float64 reference for every MaskKind and both layouts; the reference
itself against the flex reference (an independent GQA implementation) and finite differences.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, MaskKind, RuntimeConfig, Wrt
from rlx.reference import evaluate

MASKS = [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(5), MaskKind.CUSTOM, MaskKind.BIAS]


def build(mask: MaskKind, layout: Layout, b: int, sq: int, sk: int, h: int, hkv: int, d: int, dv: int) -> Graph:
    g = Graph("gqa")
    q = g.input("q", layout.join(b, sq, h, d))
    k = g.input("k", layout.join(b, sk, hkv, d))
    v = g.input("v", layout.join(b, sk, hkv, dv))
    mask_input = None
    if mask == MaskKind.CUSTOM:
        mask_input = g.input("pad", (b, sk))
    elif mask == MaskKind.BIAS:
        mask_input = g.input("bias", (b, h, sq, sk))
    out = g.attention(q, k, v, mask=mask, layout=layout, mask_input=mask_input)
    dy = g.input("dy", out.shape)
    dq, dk, dvv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dvv)
    return g


def arrays_for(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {name: rng.standard_normal(x.shape).astype(np.float32) for name, x in g.inputs.items()}
    if "pad" in arrays:
        arrays["pad"] = (rng.random(arrays["pad"].shape) > 0.3).astype(np.float32)
    return arrays


@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("layout", [pytest.param(Layout.BSHD, marks=pytest.mark.slow), Layout.BHSD], ids=str)
@pytest.mark.parametrize(("h", "hkv", "dv"), [(4, 2, 8), (4, 1, 5), (3, 3, 11)])
def test_compiled_matches_reference(mask: MaskKind, layout: Layout, h: int, hkv: int, dv: int) -> None:
    g = build(mask, layout, 2, 23, 31, h, hkv, 8, dv)
    arrays = arrays_for(g)
    expected = rlx.reference.run(g, **arrays)
    for threads in (1, 2):
        got = rlx.compile(g, config=RuntimeConfig(num_threads=threads))(**arrays)
        for name, want in expected.items():
            np.testing.assert_allclose(got[name], want, rtol=2e-4, atol=2e-4, err_msg=f"{name} threads={threads}")
    assert expected["out"].shape == layout.join(2, 23, h, dv)
    assert expected["dk"].shape == layout.join(2, 31, hkv, 8)


def test_reference_agrees_with_the_flex_reference() -> None:
    g = build(MaskKind.NONE, Layout.BSHD, 2, 9, 12, 6, 2, 4, 7)
    arrays = arrays_for(g)
    fixed = rlx.reference.run(g, **arrays)
    f = Graph()
    q, k, v, dy = (f.input(n, arrays[n].shape) for n in ("q", "k", "v", "dy"))
    out, _ = f.attention(q, k, v, return_lse=True)
    grads = rlx.grad(f, out, [q, k, v], dy)
    f.output(out=out, dq=grads[0], dk=grads[1], dv=grads[2])
    flex = rlx.reference.run(f, **{n: arrays[n] for n in ("q", "k", "v", "dy")})
    for name in fixed:
        np.testing.assert_allclose(fixed[name], flex[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_gqa_gradients_match_finite_differences() -> None:
    g = build(MaskKind.CAUSAL, Layout.BSHD, 1, 5, 6, 4, 2, 3, 2)
    rng = np.random.default_rng(4)
    arrays = {name: rng.standard_normal(x.shape) for name, x in g.inputs.items()}
    loss_graph = Graph("loss")
    q, k, v = (loss_graph.input(n, arrays[n].shape) for n in "qkv")
    w = loss_graph.input("w", g.outputs["out"].shape)
    loss = loss_graph.sum(loss_graph.attention(q, k, v, mask=MaskKind.CAUSAL) * w)
    loss_graph.output(loss=loss)
    base = {n: arrays[n] for n in "qkv"} | {"w": arrays["dy"]}
    got = evaluate(g, arrays, exact=True)
    for name, grad in (("k", "dk"), ("v", "dv")):
        for index in [(0, 0, 0, 0), (0, 3, 1, 1), (0, 5, 0, 1)]:
            if index[3] >= arrays[name].shape[3]:
                continue
            values = []
            for sign in (1, -1):
                moved = {n: a.copy() for n, a in base.items()}
                moved[name][index] += sign * 1e-6
                values.append(float(evaluate(loss_graph, moved, exact=True)["loss"]))
            numeric = (values[0] - values[1]) / 2e-6
            assert abs(numeric - got[grad][index]) < 1e-6, (name, index)


def test_attention_bwd_builder_takes_gqa_shapes() -> None:
    g = Graph()
    q, dy = g.input("q", (1, 7, 4, 8)), g.input("dy", (1, 7, 4, 3))
    k, v = g.input("k", (1, 9, 2, 8)), g.input("v", (1, 9, 2, 3))
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=MaskKind.CAUSAL)
    assert (dq.shape, dk.shape, dv.shape) == ((1, 7, 4, 8), (1, 9, 2, 8), (1, 9, 2, 3))
    with pytest.raises(rlx.RlxValueError, match="GQA"):
        g.attention(q, g.input("k3", (1, 9, 3, 8)), g.input("v3", (1, 9, 3, 3)))


WRITE_CASES = [
    (mask, sq, sk, block_q)
    for mask in (MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(2), MaskKind.CUSTOM)
    for sq, sk in ((11, 17), (17, 11))
    for block_q in (4, None)
]


@pytest.mark.parametrize(("mask", "sq", "sk", "block_q"), WRITE_CASES)
def test_key_gradients_overwrite_reused_outputs(mask: MaskKind, sq: int, sk: int, block_q: int | None) -> None:
    """dK and dV sum over strips and over a kv group's heads; their first write stores and the rows
    its keys miss are zeroed, so nothing of an earlier call survives in a reused output array. The
    first call fills every output with NaN (NaN inputs); the second, whose outputs reuse those
    arrays, must equal the reference exactly as a fresh call does."""
    from rlx.codegen import CodegenOptions, compile_graph

    g = build(mask, Layout.BSHD, 2, sq, sk, 4, 2, 3, 5)
    exe = compile_graph(g, options=CodegenOptions(block_q=block_q))
    arrays = arrays_for(g, seed=sq)
    poisoned = {name: np.full_like(a, np.nan) for name, a in arrays.items()}
    first = exe(**poisoned)
    assert all(np.isnan(first[name]).any() for name in ("dk", "dv"))
    addresses = {name: first[name].ctypes.data for name in first}
    del first
    got = exe(**arrays)
    assert any(got[name].ctypes.data == addresses[name] for name in got), "the test needs reused outputs"
    want = evaluate(g, arrays)
    for name in ("out", "dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=2e-5, err_msg=f"{name} {mask}")
