"""The five MaskKinds are mods (SPEC 4): rlx.mods.from_mask_kind, the reference, and the compiler.

Every fixed-mask graph compiled through the programmable kernels
(``CodegenOptions(masks_as_mods=True)``) must equal the fixed-mask kernels, the float64 reference
(which itself runs the masks as mods) and SPEC 1's formula written out row by row
(``helpers.naive_attention``), forward and backward, finite and infinite ``neg``, fully masked rows
included.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import naive_attention

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, RuntimeConfig, Wrt
from rlx.codegen import CodegenOptions, compile_graph
from rlx.ir import parse

MASKS = [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(6), MaskKind.CUSTOM, MaskKind.BIAS]
AS_MODS = CodegenOptions(masks_as_mods=True)


def _graph(
    mask: MaskKind,
    layout: Layout,
    sizes: tuple[int | str, int | str],
    *,
    batch: int = 2,
    heads: int = 4,
    kv_heads: int = 4,
    dim: int = 8,
    value_dim: int = 8,
    wrt: Wrt = Wrt.ALL,
) -> Graph:
    seq_q, seq_k = sizes
    g = Graph("masks")
    q = g.input("q", layout.join(batch, seq_q, heads, dim))
    k = g.input("k", layout.join(batch, seq_k, kv_heads, dim))
    v = g.input("v", layout.join(batch, seq_k, kv_heads, value_dim))
    dy = g.input("dy", layout.join(batch, seq_q, heads, value_dim))
    mask_input = None
    if mask == MaskKind.CUSTOM:
        mask_input = g.input("mask", (batch, seq_k))
    elif mask == MaskKind.BIAS:
        mask_input = g.input("mask", (batch, heads, seq_q, seq_k))
    out = g.attention(q, k, v, mask=mask, layout=layout, mask_input=mask_input)
    grads = g.attention_bwd(q, k, v, dy, wrt=wrt, mask=mask, layout=layout, mask_input=mask_input)
    grads = grads if isinstance(grads, tuple) else (grads,)
    names = {Wrt.QUERY: "dq", Wrt.KEY: "dk", Wrt.VALUE: "dv"}
    g.output(out=out, **{names[flag]: grad for flag, grad in zip(wrt.members, grads, strict=True)})
    return g


def _arrays(
    mask: MaskKind,
    layout: Layout,
    seq_q: int,
    seq_k: int,
    rng: np.random.Generator,
    *,
    batch: int = 2,
    heads: int = 4,
    kv_heads: int = 4,
    dim: int = 8,
    value_dim: int = 8,
) -> dict[str, np.ndarray]:
    arrays = {
        "q": rng.standard_normal(layout.join(batch, seq_q, heads, dim)),
        "k": rng.standard_normal(layout.join(batch, seq_k, kv_heads, dim)),
        "v": rng.standard_normal(layout.join(batch, seq_k, kv_heads, value_dim)),
        "dy": rng.standard_normal(layout.join(batch, seq_q, heads, value_dim)),
    }
    if mask == MaskKind.CUSTOM:
        pad = rng.choice([0.0, 0.25, 0.5, 1.0], size=(batch, seq_k))
        pad[0] = 0.0  # batch 0: every key hidden, a fully masked row for every query
        arrays["mask"] = pad
    elif mask == MaskKind.BIAS:
        arrays["mask"] = rng.standard_normal((batch, heads, seq_q, seq_k))
    return {name: a.astype(np.float32) for name, a in arrays.items()}


def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    for name, value in want.items():
        # float32 sums of terms up to max|value| round to about 1e-6 of it, whatever the entry
        scale = max(1.0, float(np.max(np.abs(value[np.isfinite(value)]), initial=0.0)))
        np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-5 * scale, err_msg=f"{what}: {name}")


@pytest.mark.thin("neg")
@pytest.mark.parametrize(  # -1e9 is a slow case: -3 is the finite neg that differs most from -inf
    "neg", [pytest.param(-1e9, marks=pytest.mark.slow), -np.inf, -3.0], ids=["neg-1e9", "neg-inf", "neg-3"]
)
@pytest.mark.parametrize(  # BSHD is a slow case: the kernels read both layouts through the same strides
    "layout", [pytest.param(Layout.BSHD, marks=pytest.mark.slow), Layout.BHSD], ids=str
)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_fixed_masks_through_the_programmable_kernels(
    mask: MaskKind, layout: Layout, neg: float, rng: np.random.Generator
) -> None:
    """Sq > Sk with a window leaves the last rows no key at all: fully masked rows too."""
    config = RuntimeConfig(attn_mask_neg_inf=neg)
    for seq_q, seq_k in ((37, 50), (45, 20)):
        g = _graph(mask, layout, (seq_q, seq_k))
        arrays = _arrays(mask, layout, seq_q, seq_k, rng)
        reference = rlx.reference.run(g, config=config, **arrays)
        naive = naive_attention(
            *(arrays[n] for n in ("q", "k", "v", "dy")),
            mask=mask,
            layout=layout,
            mask_tensor=arrays.get("mask"),
            neg=neg,
        )
        _close(reference, naive, "reference vs SPEC 1 written out")
        fixed = compile_graph(g, config=config)(**arrays)
        as_mods = compile_graph(g, config=config, options=AS_MODS)(**arrays)
        _close(fixed, reference, "fixed-mask kernels")
        _close(as_mods, reference, "as mods")


@pytest.mark.parametrize("wrt", [Wrt.QUERY, Wrt.KEY, Wrt.VALUE, Wrt.QUERY | Wrt.VALUE], ids=str)
def test_gqa_value_dim_and_single_gradients(wrt: Wrt, rng: np.random.Generator) -> None:
    mask, layout = MaskKind.sliding_window(4), Layout.BHSD
    shape = dict(heads=6, kv_heads=2, dim=8, value_dim=5)
    g = _graph(mask, layout, (33, 33), wrt=wrt, **shape)
    arrays = _arrays(mask, layout, 33, 33, rng, **shape)
    _close(compile_graph(g, options=AS_MODS)(**arrays), rlx.reference.run(g, **arrays), "as mods")


def test_the_rewrite_leaves_programmable_nodes_that_print_and_parse() -> None:
    g = _graph(MaskKind.CUSTOM, Layout.BSHD, (9, 9))
    rewritten = g.copy()
    assert rlx.passes.masks_as_mods(rewritten)
    ops = [node.op for node in rewritten.nodes]
    assert OpKind.ATTENTION not in ops and OpKind.ATTENTION_BWD not in ops
    backward = next(node for node in rewritten.nodes if node.op is OpKind.FLEX_ATTENTION_BWD)
    assert backward.attrs.recompute and backward.attrs.wrt == Wrt.ALL
    assert len(backward.inputs) == 5  # q, k, v, dy and the key-padding tensor its score_mod reads
    assert str(parse(str(rewritten))) == str(rewritten)
    assert not rlx.passes.masks_as_mods(rewritten)  # nothing left to rewrite


def test_symbolic_lengths_compile_once(rng: np.random.Generator) -> None:
    """Bottom-right alignment reads the lengths per call (%q_len, %kv_len in the region)."""
    for mask in (MaskKind.CAUSAL, MaskKind.sliding_window(3), MaskKind.CUSTOM):
        g = _graph(mask, Layout.BSHD, ("Sq", "Sk"))
        exe = compile_graph(g, options=AS_MODS)
        for seq_q, seq_k in ((1, 1), (5, 17), (30, 12), (64, 64), (70, 131)):
            arrays = _arrays(mask, Layout.BSHD, seq_q, seq_k, rng)
            _close(exe(**arrays), rlx.reference.run(g, **arrays), f"{mask} at ({seq_q}, {seq_k})")
        assert exe.compile_count == 1


def test_fully_masked_rows_at_a_finite_neg_are_uniform_and_pass_no_qk_gradient(rng: np.random.Generator) -> None:
    g = _graph(MaskKind.CUSTOM, Layout.BHSD, (6, 5))
    arrays = _arrays(MaskKind.CUSTOM, Layout.BHSD, 6, 5, rng)
    got = compile_graph(g, options=AS_MODS)(**arrays)
    v, dy = arrays["v"].astype(np.float64), arrays["dy"].astype(np.float64)
    np.testing.assert_allclose(got["out"][0], np.broadcast_to(v[0].mean(axis=1, keepdims=True), (4, 6, 8)), rtol=1e-5)
    np.testing.assert_allclose(
        got["dv"][0], np.broadcast_to(dy[0].sum(axis=1, keepdims=True) / 5, (4, 5, 8)), rtol=1e-5
    )
    assert np.all(got["dq"][0] == 0.0) and np.all(got["dk"][0] == 0.0)


def test_nan_in_q_propagates_as_in_the_fixed_kernels(rng: np.random.Generator) -> None:
    g = _graph(MaskKind.CAUSAL, Layout.BSHD, (8, 8))
    arrays = _arrays(MaskKind.CAUSAL, Layout.BSHD, 8, 8, rng)
    arrays["q"][1, 3, 2, 0] = np.nan
    fixed = compile_graph(g)(**arrays)
    as_mods = compile_graph(g, options=AS_MODS)(**arrays)
    reference = rlx.reference.run(g, **arrays)
    for name in reference:
        assert np.array_equal(np.isnan(fixed[name]), np.isnan(reference[name])), name
        assert np.array_equal(np.isnan(as_mods[name]), np.isnan(reference[name])), name


@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_from_mask_kind_gives_mods_that_g_attention_takes(mask: MaskKind, rng: np.random.Generator) -> None:
    """The public mapping, used by hand: same result as the MaskKind at neg = -inf."""
    config = RuntimeConfig(attn_mask_neg_inf=-np.inf)
    arrays = _arrays(mask, Layout.BSHD, 20, 24, rng)
    fixed = _graph(mask, Layout.BSHD, (20, 24))
    g = Graph("by_hand")
    q, k, v = (g.input(n, arrays[n].shape) for n in ("q", "k", "v"))
    mask_input = g.input("mask", arrays["mask"].shape) if "mask" in arrays else None
    score_mod, mask_mod = rlx.mods.from_mask_kind(mask, mask_input, neg=-np.inf)
    g.output(out=g.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod))
    inputs = {n: a for n, a in arrays.items() if n != "dy"}
    got = compile_graph(g)(**inputs)["out"]
    np.testing.assert_allclose(got, rlx.reference.run(fixed, config=config, **arrays)["out"], rtol=2e-4, atol=2e-5)


def test_from_mask_kind_refuses_bad_arguments() -> None:
    with pytest.raises(rlx.RlxTypeError, match="MaskKind"):
        rlx.mods.from_mask_kind("causal")  # type: ignore[arg-type]
    with pytest.raises(rlx.RlxValueError, match="mask_input"):
        rlx.mods.from_mask_kind(MaskKind.BIAS)


@pytest.mark.parametrize("seq_q, seq_k", list(itertools.product((1, 7, 40), (1, 9, 40))))
def test_causal_lower_right_and_seq_lengths_serve_every_length(
    seq_q: int, seq_k: int, rng: np.random.Generator
) -> None:
    """A mod that uses the lengths compiles once for symbolic lengths (was static-only)."""

    def window_to_last_key(b: object, h: object, q_idx: object, kv_idx: object) -> object:
        sq, sk = rlx.mods.seq_lengths()
        return (kv_idx <= q_idx + sk - sq) & (kv_idx > q_idx + sk - sq - 4)  # type: ignore[operator]

    for mask_mod in (rlx.mods.causal_lower_right, window_to_last_key):
        g = Graph("lengths")
        q = g.input("q", (1, "Sq", 2, 8))
        k = g.input("k", (1, "Sk", 2, 8))
        v = g.input("v", (1, "Sk", 2, 8))
        g.output(out=g.attention(q, k, v, mask_mod=mask_mod))
        exe = compile_graph(g)
        arrays = {
            "q": rng.standard_normal((1, seq_q, 2, 8), dtype=np.float32),
            "k": rng.standard_normal((1, seq_k, 2, 8), dtype=np.float32),
            "v": rng.standard_normal((1, seq_k, 2, 8), dtype=np.float32),
        }
        np.testing.assert_allclose(exe(**arrays)["out"], rlx.reference.run(g, **arrays)["out"], rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("value", [-1e9, -2.0, 0.5], ids=["far", "near", "above"])
def test_a_score_mod_that_replaces_scores_is_block_sparse_and_exact(value: float, rng: np.random.Generator) -> None:
    """``where(hidden, value, score)`` skips hidden tiles like a mask; where a row's scores are not
    far above ``value`` (or it sees no key at all) the strip is redone over every key, forward and
    backward (from out and lse, through rlx.grad)."""

    def replace_outside_window(score: object, b: object, h: object, q_idx: object, kv_idx: object) -> object:
        return rlx.where((kv_idx > q_idx) | (kv_idx < q_idx - 70), value, score)  # type: ignore[operator]

    g = Graph("replaced")
    q, k, v = (g.input(n, (2, 300 if n == "q" else 200, 2, 16)) for n in ("q", "k", "v"))
    out, lse = g.attention(q, k, v, score_mod=replace_outside_window, return_lse=True)
    dq, dk, dv = rlx.grad(g, g.sum(out * out) + g.sum(lse), [q, k, v])
    g.output(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    arrays = {n: rng.standard_normal(g.inputs[n].shape, dtype=np.float32) for n in ("q", "k", "v")}
    arrays["q"] *= 3.0  # rows far above `value` and rows near it
    exe = compile_graph(g)
    node = next(n for n in exe.graph.nodes if n.op is OpKind.FLEX_ATTENTION)
    from rlx.codegen.lower import flex_spec

    spec = flex_spec(node, CodegenOptions())
    assert spec.map_kind == "static" and spec.retries and spec.identity_on_full_tiles
    _close(exe(**arrays), rlx.reference.run(g, **arrays), f"value {value}")
