"""rlx.grad: single-wrt backward nodes, fusion afterwards, finite-difference numerics, errors."""

from __future__ import annotations

from collections.abc import Callable
from textwrap import dedent

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, RlxTypeError, RlxValueError, Value, Wrt
from rlx.ir.opdef import not_differentiable
from rlx.reference import attention_forward

B, H, D = 1, 2, 3


def build(
    sq: int = 4, sk: int = 4, mask: MaskKind = MaskKind.CAUSAL, layout: Layout = Layout.BSHD
) -> tuple[Graph, dict[str, Value], Value]:
    """Forward attention graph; returns (graph, inputs by name, out)."""
    g = Graph("fwd")
    ins = {
        "q": g.input("q", layout.join(B, sq, H, D)),
        "k": g.input("k", layout.join(B, sk, H, D)),
        "v": g.input("v", layout.join(B, sk, H, D)),
        "dy": g.input("dy", layout.join(B, sq, H, D)),
    }
    if mask == MaskKind.CUSTOM:
        ins["mask"] = g.input("mask", (B, sk))
    elif mask == MaskKind.BIAS:
        ins["mask"] = g.input("mask", (B, H, sq, sk))
    out = g.attention(ins["q"], ins["k"], ins["v"], mask=mask, layout=layout, mask_input=ins.get("mask"))
    return g, ins, out


def random_arrays(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in g.inputs.items()}
    if "mask" in arrays and arrays["mask"].ndim == 2:
        arrays["mask"] = (rng.random(arrays["mask"].shape) > 0.3).astype(np.float32)
        arrays["mask"][:, 0] = 1.0
    return arrays


def central_difference(loss: Callable[[dict[str, np.ndarray]], float], arrays: dict[str, np.ndarray], name: str):
    """d loss / d arrays[name], entry by entry, in float64."""
    base = {key: value.astype(np.float64) for key, value in arrays.items()}
    grad = np.zeros_like(base[name])
    eps = 1e-6
    for index in np.ndindex(grad.shape):
        plus = {**base, name: base[name].copy()}
        minus = {**base, name: base[name].copy()}
        plus[name][index] += eps
        minus[name][index] -= eps
        grad[index] = (loss(plus) - loss(minus)) / (2 * eps)
    return grad


def test_grad_emits_three_single_wrt_nodes_then_fusion_merges_them() -> None:
    g, ins, out = build(sq=3, sk=5, mask=MaskKind.CUSTOM)
    dq, dk, dv = rlx.grad(g, out, [ins["q"], ins["k"], ins["v"]], ins["dy"])
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    assert str(g) == dedent(
        """\
        graph @fwd {
          %q = input "q" : f32[1,3,2,3]
          %k = input "k" : f32[1,5,2,3]
          %v = input "v" : f32[1,5,2,3]
          %dy = input "dy" : f32[1,3,2,3]
          %mask = input "mask" : f32[1,5]
          %0 = attention %q, %k, %v, %mask {mask = custom, layout = bshd} : f32[1,3,2,3]
          %1 = attention_bwd %q, %k, %v, %dy, %mask {wrt = q, mask = custom, layout = bshd} : f32[1,3,2,3]
          %2 = attention_bwd %q, %k, %v, %dy, %mask {wrt = k, mask = custom, layout = bshd} : f32[1,5,2,3]
          %3 = attention_bwd %q, %k, %v, %dy, %mask {wrt = v, mask = custom, layout = bshd} : f32[1,5,2,3]
          output out = %0, dq = %1, dk = %2, dv = %3
        }"""
    )
    assert rlx.passes.fuse_attention_bwd(g) is True
    (fused,) = [node for node in g.nodes if node.op is OpKind.ATTENTION_BWD]
    assert fused.attrs == rlx.ir.AttentionBwdAttrs(Wrt.ALL, MaskKind.CUSTOM, Layout.BSHD)
    assert [g.outputs[name] for name in ("dq", "dk", "dv")] == list(fused.outputs)


@pytest.mark.parametrize(
    ("xs", "flags"),
    [(["v"], [Wrt.VALUE]), (["k", "q"], [Wrt.QUERY, Wrt.KEY]), (["q", "q"], [Wrt.QUERY])],
)
def test_only_operands_that_need_a_gradient_get_a_node(xs: list[str], flags: list[Wrt]) -> None:
    g, ins, out = build(layout=Layout.BHSD, mask=MaskKind.sliding_window(1))
    grads = rlx.grad(g, out, [ins[name] for name in xs], ins["dy"])
    bwd = [node for node in g.nodes if node.op is OpKind.ATTENTION_BWD]
    assert [node.attrs.wrt for node in bwd] == flags
    assert all(node.attrs.mask == MaskKind.sliding_window(1) and node.attrs.layout is Layout.BHSD for node in bwd)
    assert all(node.inputs[3] == ins["dy"] for node in bwd)
    assert [grad.node.attrs.wrt for grad in grads] == [{"q": Wrt.QUERY, "k": Wrt.KEY, "v": Wrt.VALUE}[n] for n in xs]


def test_gradient_of_y_itself_is_dy() -> None:
    g, ins, out = build()
    assert rlx.grad(g, out, [out], ins["dy"]) == [ins["dy"]]
    assert len(g) == 5


@pytest.mark.parametrize(
    ("mask", "layout", "sq", "sk"),
    [
        (MaskKind.NONE, Layout.BSHD, 4, 4),
        (MaskKind.CAUSAL, Layout.BSHD, 3, 5),
        (MaskKind.CAUSAL, Layout.BHSD, 5, 3),
        (MaskKind.sliding_window(1), Layout.BSHD, 4, 4),
        (MaskKind.CUSTOM, Layout.BHSD, 3, 4),
        (MaskKind.BIAS, Layout.BSHD, 4, 3),
    ],
)
def test_gradients_match_central_differences(mask: MaskKind, layout: Layout, sq: int, sk: int) -> None:
    g, ins, out = build(sq, sk, mask, layout)
    dq, dk, dv = rlx.grad(g, out, [ins["q"], ins["k"], ins["v"]], ins["dy"])
    g.output(dq=dq, dk=dk, dv=dv)
    rlx.passes.run(g, list(rlx.passes.DEFAULT_PIPELINE))
    arrays = random_arrays(g, seed=sq * 10 + sk)
    got = rlx.reference.run(g, **arrays)

    def loss(a: dict[str, np.ndarray]) -> float:
        y = attention_forward(a["q"], a["k"], a["v"], mask=mask, layout=layout, mask_tensor=a.get("mask"))
        return float(np.sum(y * a["dy"]))

    for name in ("q", "k", "v"):
        expected = central_difference(loss, arrays, name)
        assert np.abs(expected).max() > 1e-3  # the check compares something
        np.testing.assert_allclose(got["d" + name], expected, rtol=1e-4, atol=1e-5, err_msg=name)


def test_chain_through_two_attention_layers_matches_central_differences() -> None:
    g, ins, out = build(mask=MaskKind.CAUSAL)
    top = g.attention(out, ins["k"], ins["v"])  # k, v are read twice, but need no gradient
    (dq,) = rlx.grad(g, top, [ins["q"]], ins["dy"])
    g.output(dq=dq)
    arrays = random_arrays(g, seed=3)
    got = rlx.reference.run(g, **arrays)["dq"]

    def loss(a: dict[str, np.ndarray]) -> float:
        hidden = attention_forward(a["q"], a["k"], a["v"], mask=MaskKind.CAUSAL)
        return float(np.sum(attention_forward(hidden, a["k"], a["v"]) * a["dy"]))

    np.testing.assert_allclose(got, central_difference(loss, arrays, "q"), rtol=1e-4, atol=1e-5)


def test_attention_and_both_backward_ops_have_rules() -> None:
    for op in (OpKind.ATTENTION, OpKind.ATTENTION_BWD, OpKind.FLEX_ATTENTION, OpKind.FLEX_ATTENTION_BWD):
        assert op.definition.grad is not not_differentiable, op  # second order: tests/test_second_order.py


# ----------------------------------------------------------------------------- errors


def assert_refused(g: Graph, error: type[Exception], match: str, *args: object) -> None:
    """``rlx.grad(g, *args)`` raises and leaves the graph exactly as it was."""
    before = str(g)
    with pytest.raises(error, match=match):
        rlx.grad(g, *args)  # type: ignore[arg-type]
    assert str(g) == before


def test_unrelated_x_gets_zeros() -> None:
    g, ins, out = build()
    dq, ddy = rlx.grad(g, out, [ins["q"], ins["dy"]], ins["dy"])
    g.output(dq=dq, ddy=ddy)
    arrays = random_arrays(g, seed=5)
    got = rlx.reference.run(g, **arrays)
    assert got["ddy"].shape == ins["dy"].shape
    assert not np.any(got["ddy"])
    assert np.any(got["dq"])


@pytest.mark.parametrize("layout", [Layout.BSHD, Layout.BHSD])
def test_an_additive_bias_gets_its_gradient(layout: Layout) -> None:
    """A BIAS mask is added to the scores, so it is differentiable (as torch's float attn_mask):
    its gradient and dQ, dK, dV against central differences of the float64 forward, and the
    compiled graph against the reference, in one fused backward kernel."""
    g, ins, out = build(4, 3, MaskKind.BIAS, layout)
    grads = rlx.grad(g, out, [ins["q"], ins["k"], ins["v"], ins["mask"]], ins["dy"])
    g.output(**dict(zip(("dq", "dk", "dv", "dmask"), grads, strict=True)))
    arrays = random_arrays(g, seed=11)
    got = rlx.reference.run(g, **arrays)

    def loss(a: dict[str, np.ndarray]) -> float:
        y = attention_forward(a["q"], a["k"], a["v"], mask=MaskKind.BIAS, layout=layout, mask_tensor=a["mask"])
        return float(np.sum(y * a["dy"]))

    for name in ("q", "k", "v", "mask"):
        expected = central_difference(loss, arrays, name)
        assert np.abs(expected).max() > 1e-3  # the check compares something
        np.testing.assert_allclose(got["d" + name], expected, rtol=1e-4, atol=1e-5, err_msg=name)
    exe = rlx.compile(g)
    compiled = exe(**arrays)
    for name in got:
        np.testing.assert_allclose(compiled[name], got[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert [kernel.name for kernel in exe.kernels].count("flex_attention_bwd") == 1


def test_a_bias_alone_needs_no_query_key_or_value_gradient() -> None:
    g, ins, out = build(3, 5, MaskKind.BIAS)
    (dmask,) = rlx.grad(g, out, [ins["mask"]], ins["dy"])
    g.output(dmask=dmask)
    arrays = random_arrays(g, seed=12)

    def loss(a: dict[str, np.ndarray]) -> float:
        return float(
            np.sum(attention_forward(a["q"], a["k"], a["v"], mask=MaskKind.BIAS, mask_tensor=a["mask"]) * a["dy"])
        )

    expected = central_difference(loss, arrays, "mask")
    np.testing.assert_allclose(rlx.compile(g)(**arrays)["dmask"], expected, rtol=1e-4, atol=1e-5)


def test_key_padding_gets_a_zero_gradient() -> None:
    """CUSTOM padding only picks, by a comparison with the threshold, which scores are replaced:
    piecewise constant, zero gradient, as through any comparison."""
    g, ins, out = build(mask=MaskKind.CUSTOM)
    dq, dmask = rlx.grad(g, out, [ins["q"], ins["mask"]], ins["dy"])
    g.output(dq=dq, dmask=dmask)
    arrays = random_arrays(g, seed=13)
    for got in (rlx.reference.run(g, **arrays), rlx.compile(g)(**arrays)):
        assert got["dmask"].shape == ins["mask"].shape
        assert not np.any(got["dmask"])
        assert np.any(got["dq"])


def test_value_read_twice_gets_the_sum_of_its_gradients() -> None:
    """Self-attention: x is q, k and v at once, so dx = dq + dk + dv (checked by finite differences)."""
    g = Graph("self")
    x = g.input("x", (B, 4, H, D))
    dy = g.input("dy", (B, 4, H, D))
    out = g.attention(x, x, x)
    (dx,) = rlx.grad(g, out, [x], dy)
    g.output(dx=dx)
    arrays = random_arrays(g, seed=7)
    got = rlx.reference.run(g, **arrays)["dx"]

    def loss(a: dict[str, np.ndarray]) -> float:
        return float(np.sum(attention_forward(a["x"], a["x"], a["x"]) * a["dy"]))

    np.testing.assert_allclose(got, central_difference(loss, arrays, "x"), rtol=1e-4, atol=1e-5)


def test_partial_tensor_gradients_read_otherwise_than_summed_have_no_second_order_rule() -> None:
    """A flex backward's tensor gradients come as partial sums that rlx.grad adds over axis 0;
    only that sum has a second-order rule (the restatement spreads the whole over the partials)."""
    g = Graph("partials")
    q, k, v = (g.input(name, (B, 4, H, D)) for name in "qkv")
    bias = g.input("bias", (B, H, 4, 4))
    out, lse = g.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[b, 0, i, j] * 0.5, return_lse=True)
    dy = g.input("dy", out.shape)
    score_mod = out.node.attrs.score_mod
    partials = g.flex_attention_bwd(q, k, v, out, dy, lse, bias, wrt=Wrt(0), tensor_grads=True, score_mod=score_mod)
    penalty = g.sum(partials * partials)
    assert_refused(g, RlxValueError, "read otherwise than summed over their first axis", penalty, [q])


def test_argument_checks() -> None:
    g, ins, out = build(sq=3, sk=5)
    _, other_ins, _ = build()
    with pytest.raises(RlxTypeError, match=r"graph must be an rlx\.Graph"):
        rlx.grad("g", out, [ins["q"]], ins["dy"])  # type: ignore[arg-type]
    assert_refused(g, RlxTypeError, "xs must be a list or tuple", out, ins["q"], ins["dy"])
    assert_refused(g, RlxValueError, "xs is empty", out, [], ins["dy"])
    assert_refused(g, RlxTypeError, r"xs\[1\] must be an rlx Value", out, [ins["q"], "k"], ins["dy"])
    assert_refused(g, RlxTypeError, "y must be an rlx Value", "out", [ins["q"]], ins["dy"])
    assert_refused(g, RlxValueError, "dy is not a Value of graph 'fwd'", out, [ins["q"]], other_ins["dy"])
    assert_refused(g, RlxValueError, r"expected f32\[1,3,2,3\], got f32\[1,5,2,3\]", out, [ins["q"]], ins["k"])


def test_dy_may_be_a_number_or_an_array_of_the_shape_of_y() -> None:
    """As ``y.backward(gradient=...)``: the seed baked in as a constant; no broadcasting."""
    g = Graph("seed")
    x = g.input("x", (3,))
    s = g.sum(x * x)
    (gs,) = rlx.grad(g, s, [x], 2.0)
    (gv,) = rlx.grad(g, g.tanh(x), [x], np.arange(3.0))
    g.output(gs=gs, gv=gv)
    xa = np.array([0.5, -1.0, 2.0], np.float32)
    got = rlx.compile(g)(x=xa)
    np.testing.assert_allclose(got["gs"], 4 * xa, rtol=1e-6)
    np.testing.assert_allclose(got["gv"], np.arange(3.0) * (1 - np.tanh(xa) ** 2), rtol=1e-5, atol=1e-6)
    assert_refused(g, RlxValueError, r"dy must have the shape of y, expected \(3,\), got \(\)", x * 2.0, [x], 1.0)
    assert_refused(g, RlxTypeError, "dy must hold real numbers", s, [x], np.array(True))
    assert_refused(g, RlxTypeError, "dy must be an rlx Value, a number or a NumPy array, got str", s, [x], "1")
