"""The reference interpreter against an independent formula, finite differences and edge cases."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from helpers import Case, build_graph, central_differences, make_inputs, naive_attention, naive_for

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, RuntimeConfig, Wrt
from rlx.ir.opdef import REGISTRY
from rlx.reference import attention_backward, attention_forward, evaluate, run

NEG_INF = RuntimeConfig(attn_mask_neg_inf=float("-inf"))
OUTPUTS = ("out", "dq", "dk", "dv")

MASKS = [
    MaskKind.NONE,
    MaskKind.CAUSAL,
    MaskKind.sliding_window(0),
    MaskKind.sliding_window(1),
    MaskKind.sliding_window(3),
    MaskKind.CUSTOM,
    MaskKind.BIAS,
]
# (seq_q, seq_k, head_dim): equal, fewer queries (decode-like), more queries, single token, odd D.
SIZES = {
    "sq=sk": (5, 5, 4),
    "sq<sk": (3, 6, 4),
    "decode": (1, 5, 4),
    "sq>sk": (6, 3, 4),
    "s=1": (1, 1, 4),
    "odd-d": (4, 4, 3),
}


MATRIX = [
    pytest.param(Case(sq, sk, d, mask=mask, layout=layout), id=f"{mask}-{layout}-{size_id}")
    for mask, layout, (size_id, (sq, sk, d)) in itertools.product(MASKS, Layout, SIZES.items())
]


def _qkv(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (arrays["q"], arrays["k"], arrays["v"])


def _kwargs(case: Case, arrays: dict[str, np.ndarray], config: RuntimeConfig | None = None) -> dict:
    return {"mask": case.mask, "layout": case.layout, "mask_tensor": arrays.get("mask"), "config": config}


# ---------------------------------------------------------------------------- against the naive formula


@pytest.mark.parametrize("case", MATRIX)
def test_graph_matches_naive_formula(case: Case, rng: np.random.Generator) -> None:
    arrays = make_inputs(case, rng)
    got = run(build_graph(case), **arrays)
    want = naive_for(case, arrays)
    assert set(got) == set(OUTPUTS)
    for name in OUTPUTS:
        assert got[name].dtype == np.float32
        assert got[name].shape == want[name].shape
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("layout", Layout, ids=str)
def test_float64_functions_match_naive_with_neg_inf(mask: MaskKind, layout: Layout, rng: np.random.Generator) -> None:
    case = Case(6, 4, 3, mask=mask, layout=layout)  # sq > sk: sliding windows leave rows empty
    arrays = make_inputs(case, rng, dtype=np.float64)
    out = attention_forward(*_qkv(arrays), **_kwargs(case, arrays, NEG_INF))
    grads = attention_backward(*_qkv(arrays), arrays["dy"], wrt=Wrt.ALL, **_kwargs(case, arrays, NEG_INF))
    want = naive_for(case, arrays, neg=float("-inf"))
    for name, value in zip(OUTPUTS, (out, *grads), strict=True):
        assert value.dtype == np.float64
        np.testing.assert_allclose(value, want[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_custom_threshold_comes_from_config(rng: np.random.Generator) -> None:
    case = Case(3, 5, mask=MaskKind.CUSTOM)
    arrays = make_inputs(case, rng)
    arrays["mask"] = np.array([[0.1, 0.3, 0.3, 0.9, 0.2], [0.3, 0.0, 0.5, 0.3, 1.0]], np.float32)
    config = RuntimeConfig(mask_binary_threshold=0.3)  # 0.3 itself is kept: the test is `mask < thr`
    got = run(build_graph(case), config=config, **arrays)
    want = naive_for(case, arrays, threshold=0.3)
    default = naive_for(case, arrays)
    assert not np.allclose(want["out"], default["out"])  # the threshold matters for these inputs
    for name in OUTPUTS:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------- finite differences

FD_CASES = [
    pytest.param(Case(4, 5, 3), None, id="none"),
    pytest.param(Case(4, 5, 3, mask=MaskKind.CAUSAL, layout=Layout.BHSD), None, id="causal-bhsd"),
    pytest.param(Case(5, 3, 3, mask=MaskKind.sliding_window(0)), None, id="window0-sq>sk-empty-rows"),
    pytest.param(Case(5, 3, 3, mask=MaskKind.sliding_window(1)), NEG_INF, id="window1-sq>sk-neg-inf"),
    pytest.param(Case(3, 4, 3, mask=MaskKind.CUSTOM), None, id="custom-padded-batch"),
    pytest.param(Case(3, 4, 3, mask=MaskKind.CUSTOM), NEG_INF, id="custom-padded-batch-neg-inf"),
    pytest.param(Case(3, 4, 3, mask=MaskKind.BIAS, layout=Layout.BHSD), None, id="bias-with-inf"),
]


@pytest.mark.parametrize(("case", "config"), FD_CASES)
def test_gradients_match_finite_differences(case: Case, config: RuntimeConfig | None, rng: np.random.Generator) -> None:
    arrays = make_inputs(case, rng, dtype=np.float64)
    if case.mask == MaskKind.CUSTOM:
        arrays["mask"][0] = 0.0  # batch 0: every key padded, every row fully masked
    if case.mask == MaskKind.BIAS:
        arrays["mask"][0, 1, 2, :] = -np.inf  # one row sees nothing
        arrays["mask"][1, 0, :, 1] = -np.inf  # one key hidden from a whole head
    q, k, v, dy = (arrays[n] for n in ("q", "k", "v", "dy"))
    kwargs = _kwargs(case, arrays, config)

    def loss() -> float:
        return float(np.sum(attention_forward(q, k, v, **kwargs) * dy))

    analytic = attention_backward(q, k, v, dy, wrt=Wrt.ALL, **kwargs)
    for name, x, grad in zip(("dq", "dk", "dv"), (q, k, v), analytic, strict=True):
        assert np.all(np.isfinite(grad)), name
        np.testing.assert_allclose(grad, central_differences(loss, x), rtol=1e-6, atol=1e-8, err_msg=name)


# ---------------------------------------------------------------------------- fully masked rows


def _padded_batch_case(rng: np.random.Generator, layout: Layout) -> tuple[Case, dict[str, np.ndarray]]:
    case = Case(3, 4, 3, mask=MaskKind.CUSTOM, layout=layout)
    arrays = make_inputs(case, rng, dtype=np.float64)
    arrays["mask"][0] = 0.0
    arrays["mask"][1] = [1.0, 0.0, 1.0, 0.0]  # batch 1: keys 1 and 3 padded
    return case, arrays


def _per_head(x: np.ndarray, layout: Layout) -> np.ndarray:
    """``[B, H, S, D]`` whatever the layout, for simple indexing in assertions."""
    return x if layout is Layout.BHSD else x.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("layout", Layout, ids=str)
def test_padded_batch_default_neg_uniform_p_and_no_qk_gradient(layout: Layout, rng: np.random.Generator) -> None:
    case, arrays = _padded_batch_case(rng, layout)
    out = attention_forward(*_qkv(arrays), **_kwargs(case, arrays))
    dq, dk, dv = attention_backward(*_qkv(arrays), arrays["dy"], **_kwargs(case, arrays))
    out, dq, dk, dv, v, dy = (_per_head(x, layout) for x in (out, dq, dk, dv, arrays["v"], arrays["dy"]))
    # Batch 0 sees every key with the same score -1e9: P is uniform over the Sk keys.
    np.testing.assert_allclose(out[0], np.broadcast_to(v[0].mean(axis=1, keepdims=True), out[0].shape), rtol=1e-12)
    np.testing.assert_allclose(dv[0], np.broadcast_to(dy[0].sum(axis=1, keepdims=True) / 4, dv[0].shape), rtol=1e-12)
    # ... but the replaced scores are constants: exactly zero gradient into q and k.
    assert np.all(dq[0] == 0.0)
    assert np.all(dk[0] == 0.0)
    # Batch 1: padded keys get no gradient at all (P = 0 there, dS = 0 there).
    assert np.all(dk[1][:, [1, 3]] == 0.0)
    assert np.all(dv[1][:, [1, 3]] == 0.0)
    assert np.any(dk[1][:, [0, 2]] != 0.0)


@pytest.mark.parametrize("layout", Layout, ids=str)
def test_padded_batch_neg_inf_gives_zeros_and_same_visible_rows(layout: Layout, rng: np.random.Generator) -> None:
    case, arrays = _padded_batch_case(rng, layout)
    args = (*_qkv(arrays), arrays["dy"])
    finite = attention_backward(*args, **_kwargs(case, arrays))
    outs = [attention_forward(*_qkv(arrays), **_kwargs(case, arrays, NEG_INF))]
    outs += attention_backward(*args, **_kwargs(case, arrays, NEG_INF))
    for value in outs:
        assert not np.any(np.isnan(value))
        assert np.all(_per_head(value, layout)[0] == 0.0)  # out = 0 and zero gradients, never NaN
    for got, want in zip(outs[1:], finite, strict=True):  # batch 1 has visible keys: neg does not matter
        np.testing.assert_allclose(_per_head(got, layout)[1], _per_head(want, layout)[1], rtol=1e-12)


@pytest.mark.parametrize("config", [None, NEG_INF], ids=["neg-default", "neg-inf"])
def test_empty_sliding_window_rows_send_no_gradient_to_q_and_k(
    config: RuntimeConfig | None, rng: np.random.Generator
) -> None:
    # Sq=6 > Sk=3 with w=1: query i sees keys [i-1, i], so rows 4 and 5 see nothing.
    case = Case(6, 3, 3, mask=MaskKind.sliding_window(1), layout=Layout.BHSD)
    arrays = make_inputs(case, rng, dtype=np.float64)
    kwargs = _kwargs(case, arrays, config)
    base = attention_backward(*_qkv(arrays), arrays["dy"], **kwargs)
    out = attention_forward(*_qkv(arrays), **kwargs)
    changed_q, changed_dy = arrays["q"].copy(), arrays["dy"].copy()
    changed_q[:, :, 4:] = rng.standard_normal(changed_q[:, :, 4:].shape)
    delta = rng.standard_normal(changed_dy[:, :, 4:].shape)
    changed_dy[:, :, 4:] += delta
    dq, dk, dv = attention_backward(changed_q, arrays["k"], arrays["v"], changed_dy, **kwargs)
    assert np.all(base[0][:, :, 4:] == 0.0)
    np.testing.assert_allclose(dq[:, :, :4], base[0][:, :, :4], rtol=1e-12)
    np.testing.assert_allclose(dk, base[1], rtol=1e-12)  # empty rows contribute nothing to dK
    if config is None:
        # Uniform P over the 3 keys: out is the mean of V, and dV gains delta/3 on every key.
        mean_v = arrays["v"].mean(axis=2, keepdims=True)
        np.testing.assert_allclose(out[:, :, 4:], np.broadcast_to(mean_v, out[:, :, 4:].shape), rtol=1e-12)
        want_dv = base[2] + delta.sum(axis=2, keepdims=True) / 3
        np.testing.assert_allclose(dv, want_dv, rtol=1e-12, atol=1e-12)
    else:
        assert np.all(out[:, :, 4:] == 0.0)
        np.testing.assert_allclose(dv, base[2], rtol=1e-12)


@pytest.mark.parametrize("config", [None, NEG_INF], ids=["neg-default", "neg-inf"])
def test_bias_row_of_minus_inf_gives_zero_row(config: RuntimeConfig | None, rng: np.random.Generator) -> None:
    case = Case(3, 4, 3, mask=MaskKind.BIAS, layout=Layout.BHSD)
    arrays = make_inputs(case, rng)
    arrays["mask"][1, 0, 2, :] = -np.inf
    arrays["mask"][0, 1, :, 0] = -np.inf
    got = run(build_graph(case), config=config, **arrays)
    for name in OUTPUTS:
        assert not np.any(np.isnan(got[name])), name
    assert np.all(got["out"][1, 0, 2] == 0.0)
    assert np.all(got["dq"][1, 0, 2] == 0.0)
    assert np.all(got["dv"][0, 1, 0] == 0.0)  # key 0 of (b=0, h=1) has P = 0 in every row
    want = naive_for(case, arrays)
    for name in OUTPUTS:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------- NaN and Inf


@pytest.mark.parametrize("mask", [MaskKind.NONE, MaskKind.CAUSAL], ids=str)
def test_nan_in_q_propagates(mask: MaskKind, rng: np.random.Generator) -> None:
    case = Case(4, 4, 3, mask=mask)
    arrays = make_inputs(case, rng)
    arrays["q"][1, 3, 0, 2] = np.nan  # b=1, query 3 (sees every key under both masks), h=0
    got = run(build_graph(case), **arrays)
    assert np.all(np.isnan(got["out"][1, 3, 0]))
    assert np.all(np.isnan(got["dq"][1, 3, 0]))
    assert np.any(np.isnan(got["dk"][1, :, 0]))
    for name in OUTPUTS:  # other batches and heads are untouched
        assert np.all(np.isfinite(got[name][0])), name
        assert np.all(np.isfinite(got[name][:, :, 1])), name


@pytest.mark.parametrize(("name", "outputs"), [("v", ["out", "dq", "dk"]), ("dy", ["dq", "dk", "dv"])])
def test_nan_in_v_or_dy_propagates(name: str, outputs: list[str], rng: np.random.Generator) -> None:
    case = Case(3, 3, 3)
    arrays = make_inputs(case, rng)
    arrays[name][0, 1, 1, 0] = np.nan
    got = run(build_graph(case), **arrays)
    for output in outputs:
        assert np.any(np.isnan(got[output][0, :, 1])), output


def test_inf_in_k_propagates(rng: np.random.Generator) -> None:
    case = Case(3, 3, 3)
    arrays = make_inputs(case, rng)
    arrays["k"][0, 2, 0, 1] = np.inf
    got = run(build_graph(case), **arrays)
    assert not np.all(np.isfinite(got["out"][0, :, 0]))


@pytest.mark.parametrize("config", [None, NEG_INF], ids=["neg-default", "neg-inf"])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_masking_alone_never_creates_nan(
    mask: MaskKind, config: RuntimeConfig | None, rng: np.random.Generator
) -> None:
    case = Case(6, 3, 3, mask=mask)  # sq > sk: windowed rows are empty
    arrays = make_inputs(case, rng)
    arrays["q"] *= 30.0  # large scores: the max subtraction must keep exp finite
    if mask == MaskKind.CUSTOM:
        arrays["mask"][0] = 0.0
    if mask == MaskKind.BIAS:
        arrays["mask"][0, 0] = -np.inf
        arrays["mask"][1, 1, :, 1] = -1e30
    got = run(build_graph(case), config=config, **arrays)
    for name in OUTPUTS:
        assert np.all(np.isfinite(got[name])), name


# ---------------------------------------------------------------------------- the interpreter


def test_every_op_kind_has_a_reference_impl() -> None:
    assert {op.value for op in OpKind} == set(REGISTRY)
    assert all(callable(op.definition.reference) for op in OpKind)


def test_run_returns_new_float32_arrays_and_leaves_inputs_alone(rng: np.random.Generator) -> None:
    g = Graph("echo")
    q = g.input("q", (1, 2, 1, 3))
    out = g.attention(q, q, q)
    g.output(same=q, out=out)
    qa = rng.standard_normal((1, 2, 1, 3)).astype(np.float32)
    before = qa.copy()
    got = run(g, q=qa)
    assert list(got) == ["same", "out"]
    assert not np.shares_memory(got["same"], qa)
    np.testing.assert_array_equal(got["same"], qa)
    np.testing.assert_array_equal(qa, before)
    want = attention_forward(qa, qa, qa).astype(np.float32)
    np.testing.assert_array_equal(got["out"], want)  # float64 math rounded once to float32


def test_evaluate_takes_a_mapping_so_any_input_name_works(rng: np.random.Generator) -> None:
    g = Graph()
    x = g.input("config", (1, 2, 1, 2))
    g.output(y=g.attention(x, x, x))
    xa = rng.standard_normal((1, 2, 1, 2)).astype(np.float32)
    got = evaluate(g, {"config": xa}, config=NEG_INF)
    np.testing.assert_allclose(got["y"], attention_forward(xa, xa, xa), rtol=1e-6)


def test_exact_takes_float64_scalars_as_zero_d_arrays() -> None:
    """Indexing a 1-d float64 array gives a NumPy scalar, not an array; exact mode reads it in float64."""
    g = Graph()
    x = g.input("x", ())
    w = g.input("w", (2,))
    g.output(y=x * w)
    row = np.array([0.1, 0.7])
    got = evaluate(g, {"x": row[1], "w": row}, exact=True)
    assert got["y"].dtype == np.float64
    np.testing.assert_array_equal(got["y"], row * 0.7)


@pytest.mark.parametrize("wrt", [Wrt.QUERY, Wrt.KEY, Wrt.VALUE, Wrt.QUERY | Wrt.VALUE, Wrt.KEY | Wrt.VALUE], ids=str)
def test_subsets_of_wrt_equal_the_full_backward_in_qkv_order(wrt: Wrt, rng: np.random.Generator) -> None:
    case = Case(4, 5, 3, mask=MaskKind.sliding_window(2), layout=Layout.BHSD)
    arrays = make_inputs(case, rng)
    full = run(build_graph(case), **arrays)
    part = run(build_graph(case, wrt), **arrays)
    assert list(part) == ["out"] + [{Wrt.QUERY: "dq", Wrt.KEY: "dk", Wrt.VALUE: "dv"}[f] for f in wrt.members]
    for name in part:
        np.testing.assert_array_equal(part[name], full[name])


def test_failing_node_is_reraised_with_its_ir_line(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    case = Case(2, 2, 2, mask=MaskKind.CAUSAL)
    g = build_graph(case)

    def boom(args, attrs, ctx):
        raise rlx.RlxValueError("boom")

    monkeypatch.setitem(REGISTRY, "attention_bwd", dataclasses.replace(REGISTRY["attention_bwd"], reference=boom))
    with pytest.raises(rlx.RlxValueError) as info:
        run(g, **make_inputs(case, rng))
    message = str(info.value)
    assert "boom" in message
    assert "attention_bwd %q, %k, %v, %dy {wrt = q|k|v, mask = causal, layout = bshd}" in message
    assert isinstance(info.value.__cause__, rlx.RlxValueError)


def test_builtin_error_keeps_its_kind(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    case = Case(2, 2, 2)
    monkeypatch.setitem(
        REGISTRY, "attention", dataclasses.replace(REGISTRY["attention"], reference=lambda a, b, c: 1 / 0)
    )
    with pytest.raises(ZeroDivisionError, match=r"= attention %q, %k, %v"):
        run(build_graph(case), **make_inputs(case, rng))


def test_run_checks_config_and_inputs(rng: np.random.Generator) -> None:
    case = Case(2, 2, 2)
    arrays = make_inputs(case, rng)
    with pytest.raises(rlx.RlxTypeError, match="RuntimeConfig"):
        run(build_graph(case), config={"attn_mask_neg_inf": 0.0}, **arrays)
    with pytest.raises(rlx.RlxTypeError, match=r"RuntimeConfig.*run\(g, \*\*arrays\)"):
        run(build_graph(case), arrays)  # type: ignore[arg-type]  # the arrays given positionally
    del arrays["dy"]
    with pytest.raises(rlx.RlxKeyError, match="'dy'"):
        run(build_graph(case), **arrays)
    arrays["dy"] = arrays["q"].astype(np.float64)
    with pytest.raises(rlx.RlxTypeError, match="'dy'"):
        run(build_graph(case), **arrays)


def test_direct_functions_check_shapes(rng: np.random.Generator) -> None:
    q = rng.standard_normal((1, 3, 2, 4))
    with pytest.raises(rlx.RlxValueError, match="k must have"):
        attention_forward(q, q[..., :3], q)  # head dims differ (fewer kv heads would be GQA)
    with pytest.raises(rlx.RlxValueError, match="mask_input"):
        attention_forward(q, q, q, mask=MaskKind.CUSTOM)
    with pytest.raises(rlx.RlxValueError, match="dy"):
        attention_backward(q, q, q, q[:, :2])


def test_reference_is_reached_from_the_package(rng: np.random.Generator) -> None:
    case = Case(2, 3, 2)
    arrays = make_inputs(case, rng)
    got = rlx.reference.run(build_graph(case), **arrays)
    want = naive_attention(arrays["q"], arrays["k"], arrays["v"], arrays["dy"])
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)


def test_repeated_evaluation_still_sees_every_change_to_the_graph() -> None:
    """The interpreter verifies a graph only when it changed since the last verify that passed
    (finite differences run it once per entry): edits through the API and replacements behind
    it both count as changes."""
    g = Graph("edits")
    x = g.input("x", (3,))
    y = g.exp(x)
    g.output(y=y)
    ones = {"x": np.ones(3, np.float32)}
    np.testing.assert_allclose(run(g, **ones)["y"], np.e, rtol=1e-6)
    np.testing.assert_allclose(run(g, **ones)["y"], np.e, rtol=1e-6)  # unchanged: not verified again
    z = g.neg(x)
    g.replace_all_uses_with(y, z)
    np.testing.assert_allclose(run(g, **ones)["y"], -1.0)
    z.node.types = (rlx.TensorType((4,)),)  # behind the API: a type its shape rule does not give
    with pytest.raises(rlx.RlxValueError, match="neg"):
        run(g, **ones)
    z.node.types = (rlx.TensorType((3,)),)
    np.testing.assert_allclose(run(g, **ones)["y"], -1.0)
    z.node.attrs = object()  # neg takes no attrs object of another kind
    with pytest.raises(rlx.RlxValueError):
        run(g, **ones)
