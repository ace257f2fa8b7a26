"""Matmuls split into row and column blocks on rlx's team: every block lands where it belongs.

A product with few rows and no batch (a decode step's projection, an LM head on one position,
``x.T @ dy`` with few features) is split along its columns too, so that both cores work on it
while OpenBLAS stays on one thread. These cases check the offsets of those blocks for every
operand layout BLAS reads in place (b plain or transposed, a plain or transposed), tails that are
not a whole block, rows known only per call, and that the split does not change a single bit
with the thread count.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph, RuntimeConfig
from rlx.codegen.lower_gemm import MIN_BLOCK_COLS, MIN_BLOCK_ROWS, WHOLE_ROUNDS, GemmSpec, gemm_spec
from rlx.codegen.views import View, dense_strides


def _product(m: int, n: int, k: int, a_transposed: bool, b_transposed: bool) -> Graph:
    g = Graph("gemm")
    a = g.input("a", (k, m) if a_transposed else (m, k))
    b = g.input("b", (n, k) if b_transposed else (k, n))
    if a_transposed:
        a = g.transpose(a, (1, 0))
    if b_transposed:
        b = g.transpose(b, (1, 0))
    g.output(c=a @ b)
    return g


def _inputs(g: Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(v.shape).astype(np.float32) for name, v in g.inputs.items()}


def _want(arrays: dict[str, np.ndarray], a_transposed: bool, b_transposed: bool) -> np.ndarray:
    a = arrays["a"].astype(np.float64)
    b = arrays["b"].astype(np.float64)
    return (a.T if a_transposed else a) @ (b.T if b_transposed else b)


@pytest.mark.parametrize("a_transposed", [False, True], ids=["a", "aT"])
@pytest.mark.parametrize("b_transposed", [False, True], ids=["b", "bT"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1000, 64), (3, 517, 40), (16, 256, 33), (40, 200, 7), (300, 129, 16)])
def test_blocks_of_rows_and_columns_match_numpy(m: int, n: int, k: int, a_transposed: bool, b_transposed: bool) -> None:
    g = _product(m, n, k, a_transposed, b_transposed)
    arrays = _inputs(g, m * n + k)
    got = rlx.compile(g, config=RuntimeConfig(num_threads=2))(**arrays)["c"]
    np.testing.assert_allclose(got, _want(arrays, a_transposed, b_transposed), rtol=1e-4, atol=1e-4 * np.sqrt(k))


def _spec(m: int, n: int, k: int, cores: int, batch: int | None = None) -> GemmSpec:
    g = Graph("spec")
    a = g.input("a", (m, k) if batch is None else (batch, m, k))
    b = g.input("b", (k, n) if batch is None else (batch, k, n))
    out = (m, n) if batch is None else (batch, m, n)
    a_view, b_view = (View(v, 0, v.shape, dense_strides(v.shape)) for v in (a, b))
    return gemm_spec(a_view, b_view, out, cores)


def test_one_row_block_per_core_and_no_more() -> None:
    # Each sgemm call packs B again: as few blocks as share the work evenly.
    assert (_spec(1024, 704, 256, cores=2).row_blocks, _spec(1024, 704, 256, cores=2).column_blocks) == (2, 1)
    assert _spec(1024, 704, 256, cores=2).block_rows == 512
    assert _spec(1025, 64, 64, cores=2).block_rows == 513  # the last block takes the remainder
    assert _spec(1024, 1024, 64, cores=8).row_blocks == 8
    assert _spec(1024, 1024, 64, cores=1).items == 1


def test_a_batch_that_shares_out_evenly_is_not_split() -> None:
    assert _spec(512, 64, 64, cores=2, batch=4).items == 4
    assert _spec(512, 64, 64, cores=4, batch=WHOLE_ROUNDS * 4 + 1).items == WHOLE_ROUNDS * 4 + 1
    uneven = _spec(512, 64, 64, cores=2, batch=3)  # 3 items on 2 cores: split each in two
    assert (uneven.row_blocks, uneven.items) == (2, 6)
    assert _spec(512, 64, 64, cores=4, batch=2).row_blocks == 2


def test_few_rows_split_the_columns() -> None:
    few = _spec(4, 1024, 64, cores=8)
    assert few.row_blocks == 1 and few.column_blocks == 8 and few.items == 8
    assert few.block_cols == 1024 // 8
    some = _spec(2 * MIN_BLOCK_ROWS, 1024, 64, cores=8)  # two row blocks, then four column blocks each
    assert (some.row_blocks, some.column_blocks) == (2, 4)
    narrow = _spec(4, 3 * MIN_BLOCK_COLS + 5, 64, cores=8)
    assert narrow.column_blocks == 3  # no block narrower than MIN_BLOCK_COLS
    assert _spec(4, MIN_BLOCK_COLS - 1, 64, cores=8).column_blocks == 1


def _weight_gradient_spec(m: int, n: int, k: int, cores: int) -> GemmSpec:
    """``x^T @ dy`` with ``x [k, m]``, ``dy [k, n]``: the A operand read transposed."""
    g = Graph("spec")
    x = g.input("x", (k, m))
    dy = g.input("dy", (k, n))
    a_view = View(x, 0, (m, k), (1, m))
    b_view = View(dy, 0, (k, n), dense_strides((k, n)))
    return gemm_spec(a_view, b_view, (m, n), cores)


def test_a_transposed_product_splits_its_larger_side() -> None:
    # OpenBLAS ran half of 256 x 768 x 1024 (A transposed) faster as a column block than as a row block.
    wide = _weight_gradient_spec(256, 768, 1024, cores=2)
    assert (wide.row_blocks, wide.column_blocks) == (1, 2)
    tall = _weight_gradient_spec(704, 256, 1024, cores=2)
    assert (tall.row_blocks, tall.column_blocks) == (2, 1)
    square = _weight_gradient_spec(256, 256, 1024, cores=2)
    assert (square.row_blocks, square.column_blocks) == (2, 1)
    narrow = _weight_gradient_spec(64, MIN_BLOCK_COLS + 10, 512, cores=8)  # one column block: rows take the rest
    assert (narrow.row_blocks, narrow.column_blocks) == (4, 1)
    assert _spec(256, 768, 1024, cores=2).row_blocks == 2  # A as stored: rows first


@pytest.mark.parametrize("a_transposed", [False, True], ids=["a", "aT"])
@pytest.mark.parametrize(("m", "n"), [(64, 192), (40, 1000), (300, 129)])
def test_weight_gradient_blocks_match_numpy_and_any_thread_count(a_transposed: bool, m: int, n: int) -> None:
    g = _product(m, n, 257, a_transposed, b_transposed=False)
    arrays = _inputs(g, m + n)
    want = rlx.compile(g, config=RuntimeConfig(num_threads=1))(**arrays)["c"]
    np.testing.assert_allclose(want, _want(arrays, a_transposed, False), rtol=1e-4, atol=1e-3)
    for threads in (2, 3):
        got = rlx.compile(g, config=RuntimeConfig(num_threads=threads))(**arrays)["c"]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("m", "n"), [(5, 777), (301, 129)], ids=["columns", "rows"])
def test_blocks_are_bit_identical_for_any_thread_count(threads: int, m: int, n: int) -> None:
    g = _product(m, n, 96, a_transposed=True, b_transposed=True)
    arrays = _inputs(g, 3)
    want = rlx.compile(g, config=RuntimeConfig(num_threads=1))(**arrays)["c"]
    got = rlx.compile(g, config=RuntimeConfig(num_threads=threads))(**arrays)["c"]
    np.testing.assert_array_equal(got, want)


def test_rows_known_per_call_keep_whole_columns() -> None:
    g = Graph("rows")
    x = g.input("x", ("S", 48))
    w = g.input("w", (48, 300))
    g.output(y=x @ w)
    exe = rlx.compile(g, config=RuntimeConfig(num_threads=2))
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 300)).astype(np.float32)
    for rows in (1, 7, 64, 130):
        x_rows = rng.standard_normal((rows, 48)).astype(np.float32)
        got = exe(x=x_rows, w=weight)["y"]
        np.testing.assert_allclose(got, x_rows.astype(np.float64) @ weight, rtol=1e-4, atol=1e-4)
