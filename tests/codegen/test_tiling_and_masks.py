"""Query strips, key skipping and its full-range fallback, fully masked rows, -inf and NaN.

The kernel works in strips of ``block_q`` query rows and, for causal / sliding-window masks,
skips the key blocks a strip cannot see. Skipping is only exact while a hidden key's weight
``exp(neg - rowmax)`` vanishes; otherwise (a ``neg`` near the scores, or a row that sees no key)
the strip must be recomputed over all keys. These tests pin every one of those paths against
the reference, with block sizes that do not divide ``Sq``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from codegen_helpers import add_attention_nodes, case_inputs, check_against_reference, declare_inputs, multi_graph
from helpers import Case

import rlx
from rlx import Graph, Layout, MaskKind, RuntimeConfig, Wrt
from rlx.codegen import CodegenOptions, compile_graph

TILED_WRTS = (Wrt.VALUE, Wrt.ALL)  # the no-dP path and the full dP path
SEQ_Q = 37


def _tiled_graph(cases: dict[str, Case]) -> Graph:
    """Forward + V + ALL nodes for each case, inputs and outputs suffixed with the case label."""
    g = Graph("tiled")
    named = {}
    for label, case in cases.items():
        named.update(add_attention_nodes(g, case, declare_inputs(g, case, label), TILED_WRTS, suffix=label))
    g.output(**named)
    return g


def _tiled_inputs(cases: dict[str, Case], rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for label, case in cases.items():
        arrays.update(case_inputs(case, rng, label, scale))
    return arrays


CAUSAL_LIKE = [MaskKind.CAUSAL, MaskKind.sliding_window(0), MaskKind.sliding_window(3)]
STRIP_CASES = [(mask, block_q) for mask in CAUSAL_LIKE for block_q in (1, 5, 16)] + [
    (mask, 5) for mask in (MaskKind.NONE, MaskKind.CUSTOM, MaskKind.BIAS)
] + [
    (MaskKind.CAUSAL, 37),  # one strip of exactly Sq rows
    (MaskKind.sliding_window(3), 500),  # a block taller than Sq
    (MaskKind.sliding_window(100), 5),  # a window wider than Sk: the same as causal
]


@pytest.mark.parametrize(("mask", "block_q"), STRIP_CASES, ids=[f"{m}-{b}" for m, b in STRIP_CASES])
def test_strips_that_do_not_divide_sq(block_q: int, mask: MaskKind, rng: np.random.Generator) -> None:
    """Sq = 37 in strips of 1, 5 or 16 rows (a ragged last strip), with Sk above and below Sq.

    For causal-like masks Sq < Sk exercises key skipping (each strip sees a prefix / a band of the
    keys); Sq > Sk with a sliding window leaves rows ``i >= Sk + w`` with no visible key at all.
    """
    cases = {
        "_long": Case(SEQ_Q, 41, head_dim=8, batch=1, heads=2, mask=mask, layout=Layout.BSHD),
        "_short": Case(SEQ_Q, 19, head_dim=5, batch=2, heads=1, mask=mask, layout=Layout.BHSD),
    }
    check_against_reference(
        _tiled_graph(cases), _tiled_inputs(cases, rng), options=CodegenOptions(block_q=block_q),
        context=f"block_q={block_q} {mask}",
    )


NEAR_CASES = [
    (-2.0, MaskKind.CAUSAL, 5),
    (-2.0, MaskKind.sliding_window(3), 16),
    (-20.0, MaskKind.sliding_window(3), 5),
    (-55.0, MaskKind.CAUSAL, 16),
]


@pytest.mark.parametrize(("neg", "mask", "block_q"), NEAR_CASES, ids=[f"{n}-{m}-{b}" for n, m, b in NEAR_CASES])
def test_mask_value_near_the_scores_uses_every_key(
    neg: float, mask: MaskKind, block_q: int, rng: np.random.Generator
) -> None:
    """With ``attn_mask_neg_inf`` near the scores, hidden keys carry real weight: no key may be skipped.

    The inputs are scaled so that some rows' visible scores fall below ``neg``: a kernel that skipped
    the hidden blocks would drop most of those rows' probability mass.
    """
    config = RuntimeConfig(attn_mask_neg_inf=neg)
    cases = {"_a": Case(SEQ_Q, 42, head_dim=4, batch=1, heads=2, mask=mask)}
    g = _tiled_graph(cases)
    arrays = _tiled_inputs(cases, rng, scale=3.0)
    check_against_reference(g, arrays, config=config, options=CodegenOptions(block_q=block_q))
    if neg == -2.0:  # the test can fail: hidden keys change the answer a lot at this neg
        default = rlx.reference.run(g, **arrays)
        custom = rlx.reference.run(g, config=config, **arrays)
        assert np.max(np.abs(default["out_a"] - custom["out_a"])) > 0.1


def test_hidden_keys_outscoring_every_visible_key(rng: np.random.Generator) -> None:
    """Visible scores far below the default neg (-1e9): the hidden keys dominate each row, so the strip
    must fall back to all keys (the reference puts nearly all weight on hidden keys)."""
    case = Case(SEQ_Q, 40, head_dim=4, batch=1, heads=1, mask=MaskKind.sliding_window(2))
    g = multi_graph(case, wrts=(Wrt.ALL,))
    arrays = case_inputs(case, rng)
    direction = rng.standard_normal(4).astype(np.float32)
    arrays["q"][:] = 6e4 * direction  # every score is -(6e4)^2 |d|^2 / 2 < -1e9
    arrays["k"][:] = -6e4 * direction
    arrays["k"] += rng.standard_normal(arrays["k"].shape).astype(np.float32)
    got = check_against_reference(g, arrays, options=CodegenOptions(block_q=5), rtol=1e-3, atol=1e-4)
    assert np.all(np.isfinite(got["out"]))


@pytest.mark.parametrize("block_q", [None, 4])
def test_fully_masked_rows_with_default_neg_are_uniform(block_q: int | None, rng: np.random.Generator) -> None:
    """A row that sees no key gets a uniform P over all keys (out = mean of V) and a zero dQ row."""
    window = 2
    case = Case(12, 5, head_dim=3, batch=1, heads=2, mask=MaskKind.sliding_window(window))
    g = multi_graph(case, wrts=(Wrt.ALL, Wrt.QUERY))
    arrays = case_inputs(case, rng)
    got = check_against_reference(g, arrays, options=CodegenOptions(block_q=block_q))
    dead = slice(case.seq_k + window, case.seq_q)  # rows i >= Sk + w see no key
    mean_v = arrays["v"].astype(np.float64).mean(axis=1)  # [B, H, D]
    np.testing.assert_allclose(got["out"][:, dead], np.broadcast_to(mean_v[:, None], got["out"][:, dead].shape),
                               rtol=1e-5, atol=1e-6)
    assert np.all(got["qkv_dq"][:, dead] == 0.0)
    assert np.all(got["q_dq"][:, dead] == 0.0)
    assert np.any(got["qkv_dq"][:, : case.seq_k] != 0.0)


def test_fully_padded_batch_with_default_neg(rng: np.random.Generator) -> None:
    """CUSTOM mask, batch 1 entirely padded: uniform P there, zero dQ and dK for that batch."""
    case = Case(6, 7, head_dim=4, batch=2, heads=2, mask=MaskKind.CUSTOM)
    g = multi_graph(case, wrts=(Wrt.ALL,))
    arrays = case_inputs(case, rng)
    assert np.all(arrays["mask"][1] < 0.5)
    got = check_against_reference(g, arrays)
    mean_v = arrays["v"][1].astype(np.float64).mean(axis=0)  # [H, D]
    np.testing.assert_allclose(got["out"][1], np.broadcast_to(mean_v, got["out"][1].shape), rtol=1e-5, atol=1e-6)
    assert np.all(got["qkv_dq"][1] == 0.0)
    assert np.all(got["qkv_dk"][1] == 0.0)
    np.testing.assert_allclose(  # dV of a uniform row: every key gets the mean of dY
        got["qkv_dv"][1],
        np.broadcast_to(arrays["dy"][1].astype(np.float64).sum(axis=0) / case.seq_k, got["qkv_dv"][1].shape),
        rtol=1e-5, atol=1e-6,
    )


@pytest.mark.parametrize(
    "mask", [MaskKind.CAUSAL, MaskKind.sliding_window(0), MaskKind.sliding_window(2), MaskKind.CUSTOM], ids=str
)
@pytest.mark.parametrize("block_q", [None, 3])
def test_neg_inf_gives_zero_rows_and_no_nan(mask: MaskKind, block_q: int | None, rng: np.random.Generator) -> None:
    """``attn_mask_neg_inf=-inf``: a fully masked row has P = 0, out = 0, zero gradients, never NaN."""
    config = RuntimeConfig(attn_mask_neg_inf=-math.inf)
    case = Case(11, 6, head_dim=4, batch=2, heads=2, mask=mask)
    g = multi_graph(case, wrts=(Wrt.ALL, Wrt.VALUE))
    arrays = case_inputs(case, rng)
    got = check_against_reference(g, arrays, config=config, options=CodegenOptions(block_q=block_q))
    for name, value in got.items():
        assert not np.any(np.isnan(value)), name
    if mask == MaskKind.CUSTOM:
        dead = (1, slice(None))  # batch 1 is fully padded
        for name in got:
            assert np.all(got[name][dead] == 0.0), name
    elif mask.window is not None:
        dead = (slice(None), slice(case.seq_k + mask.window, None))  # rows with no visible key
        assert np.all(got["out"][dead] == 0.0)
        assert np.all(got["qkv_dq"][dead] == 0.0)


@pytest.mark.parametrize("mask", [MaskKind.NONE, MaskKind.BIAS, MaskKind.CUSTOM, MaskKind.CAUSAL], ids=str)
def test_neg_inf_partially_masked_matches_reference(mask: MaskKind, rng: np.random.Generator) -> None:
    """``-inf`` changes nothing for rows that see a key; the BIAS/NONE masks do not use neg at all."""
    config = RuntimeConfig(attn_mask_neg_inf=-math.inf)
    case = Case(5, 9, head_dim=4, batch=2, heads=2, mask=mask)
    g = multi_graph(case, wrts=(Wrt.ALL,))
    arrays = case_inputs(case, rng)
    if mask == MaskKind.CUSTOM:
        arrays["mask"][1] = arrays["mask"][0]  # no fully padded batch here
    got = check_against_reference(g, arrays, config=config)
    for name, value in got.items():
        assert np.all(np.isfinite(value)), name


def _nan_graph(mask: MaskKind) -> tuple[Case, Graph]:
    case = Case(5, 6, head_dim=4, batch=1, heads=2, mask=mask)
    return case, multi_graph(case, wrts=(Wrt.ALL,), name="nan")


def _assert_same_nan_pattern(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    for name, value in expected.items():
        assert np.array_equal(np.isnan(got[name]), np.isnan(value)), f"{name}: NaN positions differ"


NAN_MASKS = [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(1), MaskKind.CUSTOM, MaskKind.BIAS]


@pytest.mark.parametrize("mask", NAN_MASKS, ids=str)
def test_nan_in_q_propagates(mask: MaskKind, rng: np.random.Generator) -> None:
    """One NaN in q makes its whole score row NaN: that query's out and dQ rows must be NaN (as in the reference)."""
    case, g = _nan_graph(mask)
    arrays = case_inputs(case, rng)
    if mask == MaskKind.CUSTOM:
        arrays["mask"][:] = 1.0  # no padding: the row's every score is NaN
    arrays["q"][0, 3, 1, 2] = np.nan
    got = compile_graph(g, passes=[])(**arrays)
    expected = rlx.reference.run(g, **arrays)
    assert np.all(np.isnan(expected["out"][0, 3, 1]))
    assert np.all(np.isnan(got["out"][0, 3, 1]))
    assert np.all(np.isnan(got["qkv_dq"][0, 3, 1]))
    _assert_same_nan_pattern(got, expected)


def test_nan_in_q_propagates_with_neg_inf_causal(rng: np.random.Generator) -> None:
    """neg = -inf must not turn a NaN query row into a zero row."""
    config = RuntimeConfig(attn_mask_neg_inf=-math.inf)
    case, g = _nan_graph(MaskKind.CAUSAL)
    arrays = case_inputs(case, rng)
    arrays["q"][0, 3, 1, 2] = np.nan
    got = compile_graph(g, passes=[], config=config)(**arrays)
    expected = rlx.reference.run(g, config=config, **arrays)
    assert np.all(np.isnan(expected["out"][0, 3, 1]))
    _assert_same_nan_pattern(got, expected)


@pytest.mark.parametrize("mask", NAN_MASKS, ids=str)
@pytest.mark.parametrize("where", ["k", "v", "dy"])
def test_nan_in_k_v_dy_propagates_like_the_reference(mask: MaskKind, where: str, rng: np.random.Generator) -> None:
    """NaN in k, v or dy reaches exactly the outputs it reaches in the reference; masked keys stop it."""
    case, g = _nan_graph(mask)
    arrays = case_inputs(case, rng)
    arrays[where][0, 4, 0, 1] = np.nan
    got = compile_graph(g, passes=[])(**arrays)
    expected = rlx.reference.run(g, **arrays)
    assert any(np.isnan(value).any() for value in expected.values())
    _assert_same_nan_pattern(got, expected)


@pytest.mark.parametrize("mask", NAN_MASKS, ids=str)
def test_inf_in_q_gives_the_reference_pattern(mask: MaskKind, rng: np.random.Generator) -> None:
    """+Inf in q propagates as in the reference (softmax of +-inf scores)."""
    case, g = _nan_graph(mask)
    arrays = case_inputs(case, rng)
    arrays["q"][0, 2, 0, 0] = np.inf
    got = compile_graph(g, passes=[])(**arrays)
    expected = rlx.reference.run(g, **arrays)
    _assert_same_nan_pattern(got, expected)


@pytest.mark.parametrize("mask", NAN_MASKS, ids=str)
def test_huge_scores_stay_finite(mask: MaskKind, rng: np.random.Generator) -> None:
    """Scores of magnitude ~1e4 (exp arguments far below -87) are finite and match the reference."""
    case = Case(7, 10, head_dim=4, batch=2, heads=1, mask=mask)
    g = multi_graph(case, wrts=(Wrt.ALL,))
    arrays = case_inputs(case, rng, scale=100.0)
    got = check_against_reference(g, arrays, rtol=1e-3, atol=1e-4)
    for name, value in got.items():
        assert np.all(np.isfinite(value)), name


@pytest.mark.parametrize("threshold", [0.8, -0.5, 0.0])
def test_custom_threshold_from_the_config(threshold: float, rng: np.random.Generator) -> None:
    """``mask_binary_threshold`` decides which keys are padded (``mask < threshold``), as in the reference."""
    config = RuntimeConfig(mask_binary_threshold=threshold)
    case = Case(6, 9, head_dim=4, batch=2, heads=2, mask=MaskKind.CUSTOM)
    g = multi_graph(case, wrts=(Wrt.ALL,))
    arrays = case_inputs(case, rng)
    arrays["mask"] = rng.uniform(-1.0, 1.0, size=case.mask_shape).astype(np.float32)
    check_against_reference(g, arrays, config=config)


def test_infinite_bias_entries_like_the_reference(rng: np.random.Generator) -> None:
    """A bias row of all -inf gives zeros (as in the reference); -inf entries hide keys; +inf gives NaN."""
    case = Case(5, 6, head_dim=4, batch=1, heads=2, mask=MaskKind.BIAS)
    g = multi_graph(case, wrts=(Wrt.ALL,))
    arrays = case_inputs(case, rng)
    bias = arrays["mask"]
    bias[0, 0, 1, :] = -np.inf  # a row that sees nothing
    bias[0, 0, 2, ::2] = -np.inf  # a row that sees every other key
    bias[0, 1, 3, 4] = np.inf  # an infinitely preferred key: inf - inf in the softmax
    got = compile_graph(g, passes=[])(**arrays)
    expected = rlx.reference.run(g, **arrays)
    _assert_same_nan_pattern(got, expected)
    assert np.all(got["out"][0, 1, 0] == 0.0)
    finite = {name: np.where(np.isnan(value), 0.0, value) for name, value in expected.items()}
    for name, value in got.items():
        np.testing.assert_allclose(np.where(np.isnan(value), 0.0, value), finite[name], rtol=1e-4, atol=1e-5,
                                   err_msg=name)


@pytest.mark.parametrize("seq_k", [63, 64, 65, 130, 200])
def test_row_maxima_over_long_rows(seq_k: int, rng: np.random.Generator) -> None:
    """Rows of 64 keys and more take the row maximum over several partial maxima at once: each key
    position, NaN or the largest score, must count wherever it falls among them. The largest
    score, 800, sits at one position and a score of 700 sixteen keys on (in another partial
    maximum): unless 800 is the maximum subtracted, exp(800 - 700) overflows."""
    case = Case(5, seq_k, head_dim=4, batch=1, heads=2, mask=MaskKind.NONE)
    g = multi_graph(case, wrts=(Wrt.ALL,))
    arrays = case_inputs(case, rng)
    arrays["q"][0, :, 0, :] = 10.0
    for key in (0, 17, 33, 50, seq_k - 1):  # the largest score in each partial maximum, and last
        spiked = {name: value.copy() for name, value in arrays.items()}
        spiked["k"][0, key, 0, :] = 40.0
        spiked["k"][0, (key + 16) % seq_k, 0, :] = 35.0
        check_against_reference(g, spiked, options=CodegenOptions(block_q=2), rtol=1e-3, atol=1e-4)
        spiked["k"][0, key, 1, 2] = np.nan  # head 1: every one of its rows sees a NaN score
        got = compile_graph(g, options=CodegenOptions(block_q=2))(**spiked)
        assert np.isnan(got["out"][0, :, 1, :]).all() and not np.isnan(got["out"][0, :, 0, :]).any()


@pytest.mark.parametrize("neg", [-10.0, -40.0, -92.0, -math.inf])
@pytest.mark.parametrize("mask", [MaskKind.CAUSAL, MaskKind.sliding_window(5)], ids=str)
@pytest.mark.parametrize(("seq_q", "seq_k"), [(70, 70), (40, 70)])
def test_hidden_keys_weigh_what_the_mask_value_says(neg: float, mask: MaskKind, seq_q: int, seq_k: int) -> None:
    """Visible scores near -32 against a finite mask value: above them (-10: the hidden keys take
    the weight), 8 below (their weight, e^-8 each, still counts), 60 below (negligible: a causal
    row exponentiates its visible keys only) and -inf. Forward and every gradient against the
    reference, over several strips."""
    case = Case(seq_q, seq_k, head_dim=4, batch=1, heads=2, mask=mask)
    arrays = case_inputs(case, np.random.default_rng(seq_q))
    arrays["q"][..., 0] = 8.0  # every score shifted by -8 * 8 * scale = -32
    arrays["k"][..., 0] = -8.0
    config = RuntimeConfig(attn_mask_neg_inf=neg)
    got = check_against_reference(multi_graph(case, wrts=(Wrt.ALL,)), arrays, config=config)
    for name, value in got.items():
        assert np.all(np.isfinite(value)), name
