"""Gradients of gradients through attention (the rules of ``attention_bwd`` and
``flex_attention_bwd``) and ``g.config_value``.

Every second-order result is checked twice, independently: the compiled graph against the
reference interpreter, and the reference's own second-order gradient against central
differences of the float64 first-order gradients (``exact=True``), which the reference computes
with SPEC 1's backward, not with the restatement under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, MaskKind, RuntimeConfig, Value
from rlx.codegen.executable import compile_count
from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.parser import parse
from rlx.models import BLOCK_WEIGHTS, transformer_block
from rlx.reference import evaluate

B, H, HKV, SQ, SK, D = 2, 4, 2, 5, 7, 8
# BSHD's second-order cases repeat BHSD's through other strides (first-order attention covers
# both layouts in the default run): they run with -m slow, to keep the default run short.
LAYOUTS = [pytest.param(Layout.BSHD, marks=pytest.mark.slow), Layout.BHSD]

MASKS = [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(2), MaskKind.CUSTOM, MaskKind.BIAS]


def heads_shape(layout: Layout, seq: int, heads: int) -> tuple[int, int, int, int]:
    return (B, seq, heads, D) if layout is Layout.BSHD else (B, heads, seq, D)


def penalty_graph(mask: MaskKind, layout: Layout, seq_q: int = SQ, seq_k: int = SK) -> tuple[Graph, list[Value]]:
    """A gradient penalty: z = |dq|^2 + <dk, dv> + sum(tanh(dv)) of y = sum(tanh(attention)),
    and z's gradients (outputs ``h0``.. in the order of the returned xs); GQA, Sq != Sk."""
    g = Graph("penalty")
    q = g.input("q", heads_shape(layout, seq_q, H))
    k, v = (g.input(name, heads_shape(layout, seq_k, HKV)) for name in "kv")
    mask_input = None
    if mask == MaskKind.CUSTOM:
        mask_input = g.input("m", (B, seq_k))
    elif mask == MaskKind.BIAS:
        mask_input = g.input("m", (B, H, seq_q, seq_k))
    out = g.attention(q, k, v, mask=mask, layout=layout, mask_input=mask_input)
    dq, dk, dv = rlx.grad(g, g.sum(g.tanh(out)), [q, k, v])
    z = g.sum(dq * dq) + g.sum(dk * dv) + g.sum(g.tanh(dv))
    xs = [q, k, v] + ([mask_input] if mask == MaskKind.BIAS else [])  # a bias gets second-order terms too
    g.output(z=z, **{f"h{i}": h for i, h in enumerate(rlx.grad(g, z, xs))})
    return g, xs


def inputs(g: Graph, seed: int, padding: np.ndarray | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in g.inputs.items()}
    if "m" in arrays and arrays["m"].ndim == 2:
        arrays["m"] = padding if padding is not None else (rng.random(arrays["m"].shape) > 0.4).astype(np.float32)
    return arrays


def assert_matches_central_differences(
    g: Graph, xs: list[Value], arrays: dict[str, np.ndarray], config: RuntimeConfig | None = None, entries: int = 5
) -> None:
    """The reference's ``h<i>`` at a few random entries of each x against d z / d x."""
    exact = evaluate(g, arrays, config=config, exact=True)
    rng = np.random.default_rng(0)
    eps = 1e-5
    for i, x in enumerate(xs):
        name = x.node.attrs.name
        base = arrays[name].astype(np.float64)
        for flat in rng.choice(base.size, size=min(entries, base.size), replace=False):
            index = np.unravel_index(flat, base.shape)
            values = []
            for step in (eps, -eps):
                moved = base.copy()
                moved[index] += step
                values.append(float(evaluate(g, {**arrays, name: moved}, config=config, exact=True)["z"]))
            numeric = (values[0] - values[1]) / (2 * eps)
            assert math.isclose(exact[f"h{i}"][index], numeric, rel_tol=1e-5, abs_tol=1e-6), (name, index)


def assert_compiled_matches_reference(g: Graph, arrays: dict[str, np.ndarray], config: RuntimeConfig | None = None):
    got = rlx.compile(g, config=config)(**arrays)
    want = rlx.reference.run(g, config=config, **arrays)
    for name, expected in want.items():
        assert np.all(np.isfinite(got[name])), name
        scale = max(float(np.max(np.abs(expected))), 1e-3)
        np.testing.assert_allclose(got[name], expected, rtol=0, atol=2e-4 * scale, err_msg=name)
    return got


@pytest.mark.parametrize("layout", LAYOUTS)
# NONE, SLIDING and BIAS are slow cases: CAUSAL and CUSTOM (a mask tensor) cover both kinds of mask.
@pytest.mark.parametrize(
    "mask", [m if m in (MaskKind.CAUSAL, MaskKind.CUSTOM) else pytest.param(m, marks=pytest.mark.slow) for m in MASKS],
    ids=str,
)
def test_second_order_gradients_through_attention(mask: MaskKind, layout: Layout) -> None:
    g, xs = penalty_graph(mask, layout)
    arrays = inputs(g, seed=1)
    assert_matches_central_differences(g, xs, arrays)
    assert_compiled_matches_reference(g, arrays)


@pytest.mark.parametrize(
    ("mask", "seq_q", "seq_k"),
    [(MaskKind.CUSTOM, SQ, SK), (MaskKind.sliding_window(1), 9, 4)],
    ids=["a-padded-batch", "queries-past-the-window"],
)
def test_fully_masked_rows_follow_the_configured_neg(mask: MaskKind, seq_q: int, seq_k: int) -> None:
    """A row with no visible key has a uniform P for a finite neg and a zero P for -inf (SPEC 1):
    the restated backward reads neg from the config the graph is compiled with, as the kernels do."""
    g, xs = penalty_graph(mask, Layout.BSHD, seq_q, seq_k)
    padding = np.ones((B, seq_k), np.float32)
    padding[0] = 0.0  # batch 0: every key padded
    arrays = inputs(g, seed=2, padding=padding)
    results = {}
    for neg in (-1e9, -math.inf):
        config = RuntimeConfig(attn_mask_neg_inf=neg)
        assert_matches_central_differences(g, xs, arrays, config)
        results[neg] = assert_compiled_matches_reference(g, arrays, config)
    assert not np.allclose(results[-1e9]["h2"], results[-math.inf]["h2"])  # the config reached the graph


def test_a_threshold_from_the_config_decides_the_padding() -> None:
    g, xs = penalty_graph(MaskKind.CUSTOM, Layout.BSHD)
    arrays = inputs(g, seed=3, padding=np.full((B, SK), 0.7, np.float32))
    config = RuntimeConfig(mask_binary_threshold=0.8)  # 0.7 < 0.8: every key padded
    got = assert_compiled_matches_reference(g, arrays, config)
    assert_matches_central_differences(g, xs, arrays, config, entries=3)
    assert not np.allclose(got["h0"], assert_compiled_matches_reference(g, arrays)["h0"])


def test_a_bias_differentiated_twice() -> None:
    """A BIAS tensor's first-order gradient comes from programmable backward nodes (recomputing
    the row statistics): their rule gives its second-order terms."""
    g = Graph("bias")
    q = g.input("q", (B, SQ, H, D))
    k, v = (g.input(name, (B, SK, H, D)) for name in "kv")
    bias = g.input("m", (B, H, SQ, SK))
    out = g.attention(q, k, v, mask=MaskKind.BIAS, mask_input=bias)
    grads = rlx.grad(g, g.sum(g.tanh(out)), [q, k, v, bias])
    z = g.sum(grads[0] * grads[0]) + g.sum(grads[3] * grads[3]) + g.sum(grads[1] * grads[2])
    g.output(z=z, **{f"h{i}": h for i, h in enumerate(rlx.grad(g, z, [q, k, v, bias]))})
    arrays = inputs(g, seed=6)
    assert_matches_central_differences(g, [q, k, v, bias], arrays)
    assert_compiled_matches_reference(g, arrays)


def flex_penalty_graph(
    mods: str, layout: Layout, seq: tuple[int | str, int | str] = (SQ, SK)
) -> tuple[Graph, list[Value]]:
    """A gradient penalty of programmable attention: the mods of SPEC 4, learnable tensors read by
    the score_mod (their gradients come as partial sums), int tensors read by the mask_mod."""
    g = Graph("flex_" + mods.replace("-", "_"))
    seq_q, seq_k = seq
    q = g.input("q", heads_shape(layout, seq_q, H))  # type: ignore[arg-type]
    k, v = (g.input(name, heads_shape(layout, seq_k, HKV)) for name in "kv")  # type: ignore[arg-type]
    learned: list[Value] = []
    kwargs: dict[str, object] = {}
    if mods == "causal":
        kwargs["mask_mod"] = rlx.mods.causal
    elif mods == "softcap-window":
        kwargs.update(score_mod=rlx.mods.softcap(5.0), mask_mod=rlx.mods.sliding_window(2))
    elif mods == "alibi":
        slopes = g.input("slopes", (H,))
        learned.append(slopes)
        kwargs["score_mod"] = lambda s, b, h, i, j: s - slopes[h] * rlx.abs(i - j)
    elif mods == "bias-document":
        bias, doc = g.input("bias", (B, H, seq_q, seq_k)), g.input("doc", (B, seq_k), dtype="int64")
        learned.append(bias)
        kwargs.update(score_mod=rlx.mods.bias(bias), mask_mod=lambda b, h, i, j: doc[b, i % 3] == doc[b, j])
    elif mods == "table-lse":
        table = g.input("table", (3,))
        learned.append(table)
        kwargs.update(score_mod=lambda s, b, h, i, j: s * table[i % 3], mask_mod=rlx.mods.causal, scale=0.3)
        kwargs["return_lse"] = True
    result = g.attention(q, k, v, layout=layout, **kwargs)  # type: ignore[arg-type]
    out, lse = result if isinstance(result, tuple) else (result, None)
    y = g.sum(g.tanh(out))
    if lse is not None:  # the LSE's cotangent: a backward with dlse
        y = y + g.sum(g.where(g.greater(lse, -1e30), lse, 0.0)) * 0.3
    xs = [q, k, v, *learned]
    first = rlx.grad(g, y, xs)
    z = g.sum(first[0] * first[0]) + g.sum(first[1] * first[2])
    for tensor_grad in first[3:]:
        z = z + g.sum(tensor_grad * tensor_grad)
    g.output(z=z, **{f"h{i}": h for i, h in enumerate(rlx.grad(g, z, xs))})
    return g, xs


def flex_inputs(g: Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, value in g.inputs.items():
        if value.dtype == np.float32:
            arrays[name] = rng.standard_normal(value.shape).astype(np.float32)
        else:
            arrays[name] = rng.integers(0, 2, value.shape).astype(value.dtype)
    return arrays


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(  # by default one mod of each kind: a score mod with a mask, and one reading tensors
    "mods",
    [
        pytest.param("causal", marks=pytest.mark.slow),
        "softcap-window",
        pytest.param("alibi", marks=pytest.mark.slow),
        pytest.param("bias-document", marks=pytest.mark.slow),
        "table-lse",
    ],
)
def test_second_order_gradients_through_programmable_attention(mods: str, layout: Layout) -> None:
    g, xs = flex_penalty_graph(mods, layout)
    arrays = flex_inputs(g, seed=7)
    assert_matches_central_differences(g, xs, arrays)
    assert_compiled_matches_reference(g, arrays)


def test_programmable_attention_with_symbolic_lengths_compiles_once() -> None:
    g, xs = flex_penalty_graph("alibi", Layout.BSHD, seq=("S", "S"))
    exe = rlx.compile(g)
    before = compile_count()
    for seq in (4, 7):
        shapes = {"q": (B, seq, H, D), "k": (B, seq, HKV, D), "v": (B, seq, HKV, D), "slopes": (H,)}
        rng = np.random.default_rng(seq)
        arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2e-4 * np.max(np.abs(want[name])))
        assert_matches_central_differences(g, xs, arrays, entries=3)
    assert compile_count() == before


def test_self_attention_with_symbolic_lengths_compiles_once() -> None:
    """x is q, k and v at once: each operand slot gets its own partial derivative."""
    g = Graph("self")
    x, w = g.input("x", ("B", "S", 2, 4)), g.input("w", (4, 4))
    h = x @ w
    out = g.attention(h, h, x, mask=MaskKind.CAUSAL)
    dx, dw = rlx.grad(g, g.sum(out * out), [x, w])
    z = g.sum(dx * dx) + g.sum(dw)
    g.output(z=z, **{f"h{i}": d for i, d in enumerate(rlx.grad(g, z, [x, w]))})
    exe = rlx.compile(g)
    before = compile_count()
    rng = np.random.default_rng(4)
    for seq in (3, 6, 1):
        arrays = {"x": rng.standard_normal((2, seq, 2, 4)).astype(np.float32),
                  "w": rng.standard_normal((4, 4)).astype(np.float32)}  # fmt: skip
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4 * np.max(np.abs(want[name])))
        assert_matches_central_differences(g, [x, w], arrays, entries=3)
    assert compile_count() == before


def test_hessian_vector_product_of_the_transformer_block() -> None:
    """d/dt grad(loss)(w + t u) at t = 0, against central differences of the first-order gradients."""
    g = Graph("hvp")
    x = g.input("x", (2, 4, 8))
    loss = g.mean(transformer_block(g, x, heads=2) ** 2)
    weights = [g.inputs[name] for name in BLOCK_WEIGHTS]
    grads = rlx.grad(g, loss, weights)
    directions = [g.input(f"u_{w.node.attrs.name}", w.shape) for w in weights]
    along = g.sum(g.concat([g.reshape(gw * u, (-1,)) for gw, u in zip(grads, directions, strict=True)], axis=0))
    hvp = rlx.grad(g, along, weights)
    g.output(**{f"g_{w.node.attrs.name}": d for w, d in zip(weights, grads, strict=True)})
    g.output(**{f"hvp_{w.node.attrs.name}": d for w, d in zip(weights, hvp, strict=True)})
    rng = np.random.default_rng(5)
    arrays = {name: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for name, v in g.inputs.items()}
    for name in BLOCK_WEIGHTS:
        if name.endswith("norm"):
            arrays[name] += 1.0
    got = rlx.compile(g)(**arrays)
    exact = evaluate(g, arrays, exact=True)
    eps = 1e-4
    moved = {}
    for sign in (1, -1):
        shifted = {**arrays, **{n: arrays[n] + sign * eps * arrays[f"u_{n}"].astype(np.float64) for n in BLOCK_WEIGHTS}}
        moved[sign] = evaluate(g, shifted, exact=True)
    for name in BLOCK_WEIGHTS:
        numeric = (moved[1][f"g_{name}"] - moved[-1][f"g_{name}"]) / (2 * eps)
        scale = np.max(np.abs(numeric))
        np.testing.assert_allclose(exact[f"hvp_{name}"], numeric, rtol=0, atol=1e-5 * scale, err_msg=name)
        np.testing.assert_allclose(got[f"hvp_{name}"], exact[f"hvp_{name}"], rtol=0, atol=1e-3 * scale, err_msg=name)


def test_config_values_follow_the_config_and_print() -> None:
    g = Graph("config")
    x = g.input("x", (3,))
    g.output(y=g.maximum(x, g.config_value("mask_binary_threshold")), neg=g.config_value("attn_mask_neg_inf") + 0.0)
    arrays = {"x": np.array([0.0, 1.0, 2.0], np.float32)}
    config = RuntimeConfig(mask_binary_threshold=1.5, attn_mask_neg_inf=-math.inf)
    for run in (rlx.compile(g, config=config), lambda **a: rlx.reference.run(g, config=config, **a)):
        got = run(**arrays)
        np.testing.assert_array_equal(got["y"], [1.5, 1.5, 2.0])
        assert got["neg"] == -math.inf
    np.testing.assert_array_equal(rlx.compile(g)(**arrays)["y"], [0.5, 1.0, 2.0])  # the default config's 0.5
    assert 'config_value {field = "mask_binary_threshold"}' in str(g)
    assert str(parse(str(g))) == str(g)
    assert all(node.op.value != "config_value" for node in rlx.compile(g).graph.nodes)  # constants by then


def test_config_value_errors() -> None:
    g = Graph()
    with pytest.raises(RlxValueError, match="field must be one of 'attn_mask_neg_inf', 'mask_binary_threshold'"):
        g.config_value("num_threads")
    with pytest.raises(RlxTypeError, match="field must be a str"):
        g.config_value(3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "score_mod",
    [lambda s, b, h, i, j: rlx.tanh(1.7 + 0.0 * 0.0), lambda s, b, h, i, j: (i - j) * 0.1],
    ids=["constant", "by-position"],
)
def test_a_score_mod_that_ignores_the_score(score_mod: object) -> None:
    """Its traced result is smaller than the scores (a scalar, a [Sq, Sk] grid): the restated
    forward broadcasts it to [B, H, Sq, Sk] before the softmax (found by a second-order fuzz run)."""
    g = Graph("ignores")
    q, k, v = (g.input(name, (B, H, "S", D)) for name in "qkv")
    out = g.attention(q, k, v, score_mod=score_mod, layout=Layout.BHSD)
    dq, dk, dv = rlx.grad(g, g.sum(out * out), [q, k, v])
    z = g.sum(dv * dv) + g.sum(dq * dk)
    g.output(z=z, **{f"h{i}": h for i, h in enumerate(rlx.grad(g, z, [q, k, v]))})
    rng = np.random.default_rng(8)
    arrays = {name: rng.standard_normal((B, H, 5, D)).astype(np.float32) for name in "qkv"}
    assert_matches_central_differences(g, [q, k, v], arrays, entries=3)
    assert_compiled_matches_reference(g, arrays)
