"""Maxima in the generated loops: NaN anywhere in a reduced row gives NaN, -inf rows stay -inf.

The row maxima ignore NaN in their partial maxima and keep a mask of the lanes that met one,
so a NaN must surface whichever part of the loop saw it: the 4-way unrolled vectors, the
single vectors after them, or the scalar tail. Rows of 150 floats have all three (128 unrolled,
16 single, 6 scalar), and the NaN is put in each.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, MaskKind, RuntimeConfig

ROW = 150
POSITIONS = [0, 63, 127, 130, 143, 144, 149]  # unrolled part, single vectors, scalar tail


def _rows(rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((len(POSITIONS) + 3, ROW)).astype(np.float32)
    for row, position in enumerate(POSITIONS):
        x[row, position] = np.nan
    x[len(POSITIONS)] = -np.inf  # all -inf: max -inf
    x[len(POSITIONS) + 1, 5] = np.inf  # +inf wins
    return x  # the last row is plain


@pytest.mark.parametrize("keepdims", [False, True])
def test_max_over_the_last_axis_finds_nan_in_every_part_of_the_loop(keepdims: bool) -> None:
    x = _rows(np.random.default_rng(0))
    g = Graph("row_max")
    xv = g.input("x", x.shape)
    g.output(y=g.max(xv, axis=-1, keepdims=keepdims))
    got = rlx.compile(g)(x=x)["y"]
    np.testing.assert_array_equal(got, np.max(x, axis=-1, keepdims=keepdims))


def test_max_over_a_leading_axis_keeps_nan_per_lane() -> None:
    """Reducing axis 0 vectorises along the kept axis: each lane has its own NaN flag. 40 columns:
    two vectors of 16 lanes and a scalar tail of 8, NaNs at every depth of the reduced loop."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((ROW, 40)).astype(np.float32)
    for column, position in zip((0, 5, 17, 31, 33, 39), (0, 149, 64, 130, 7, 148), strict=True):
        x[position, column] = np.nan
    x[:, 20] = -np.inf
    x[3, 22] = np.inf
    g = Graph("column_max")
    xv = g.input("x", x.shape)
    g.output(y=g.max(xv, axis=0))
    got = rlx.compile(g)(x=x)["y"]
    np.testing.assert_array_equal(got, np.max(x, axis=0))


def test_max_of_a_fused_expression_and_over_several_axes() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5, 37)).astype(np.float32)
    x[1, 4, 36] = np.nan
    x[2] = -np.inf
    g = Graph("fused_max")
    xv = g.input("x", x.shape)
    g.output(a=g.max(xv * 2.0 + 1.0, axis=(1, 2)), b=g.max(xv, axis=(0, 2), keepdims=True))
    got = rlx.compile(g)(x=x)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(got["a"], np.max(x * 2.0 + 1.0, axis=(1, 2)))
    np.testing.assert_array_equal(got["b"], np.max(x, axis=(0, 2), keepdims=True))


def test_softmax_rows_with_nan_are_nan_and_others_exact() -> None:
    x = _rows(np.random.default_rng(3))
    x[-1] = -np.inf
    x[-1, 140] = np.nan  # the maximum of what is not NaN is -inf: the row must not become zeros
    g = Graph("softmax_nan")
    xv = g.input("x", x.shape)
    g.output(y=g.softmax(xv, axis=-1))
    got = rlx.compile(g)(x=x)["y"]
    want = rlx.reference.run(g, x=x)["y"]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-6, atol=1e-7)
    assert np.all(np.isnan(got[: len(POSITIONS)])) and np.all(np.isnan(got[-1]))


@pytest.mark.parametrize("neg", [None, -math.inf])
@pytest.mark.parametrize("mask", [MaskKind.NONE, MaskKind.CAUSAL])
@pytest.mark.parametrize("position", [0, 70, 140, 149])
def test_attention_score_row_with_a_nan_key_is_nan(mask: MaskKind, position: int, neg: float | None) -> None:
    """A NaN in one key's vector makes that key's score NaN in every row that sees it; with
    causal -inf masking, the first rows see nothing but NaN (the maximum of the rest is -inf)."""
    config = RuntimeConfig() if neg is None else RuntimeConfig(attn_mask_neg_inf=neg)
    rng = np.random.default_rng(4)
    shape = (1, 2, ROW, 16)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    k[0, 1, position, 3] = np.nan
    g = Graph("attn_nan")
    qv, kv, vv = (g.input(n, shape) for n in "qkv")
    g.output(out=g.attention(qv, kv, vv, mask=mask, layout=Layout.BHSD))
    got = rlx.compile(g, config=config)(q=q, k=k, v=v)["out"]
    want = rlx.reference.run(g, config=config, q=q, k=k, v=v)["out"]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want[0, 1, ROW - 1]).all() and not np.isnan(want[0, 0]).any()
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5)
