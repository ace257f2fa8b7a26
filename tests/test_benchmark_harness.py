"""The benchmarks' own arithmetic: the products they time against torch's BLAS must be the ones rlx
runs, or the table's "torch BLAS speed-up" would explain a gap with the wrong numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import rlx

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _harness as h  # noqa: E402
import block  # noqa: E402


@pytest.mark.parametrize("seq", [96, 128, 513, 3000])
def test_attention_products_cover_every_score_once(seq: int) -> None:
    batch, heads, dim = 2, 3, 64
    full = 2.0 * batch * heads * seq * seq * dim
    assert sum(p.flops for p in h.attention_products(batch, heads, seq, dim, False, backward=False)) == 2 * full
    assert sum(p.flops for p in h.attention_products(batch, heads, seq, dim, False, backward=True)) == 5 * full
    causal = sum(p.flops for p in h.attention_products(batch, heads, seq, dim, True, backward=True))
    # Strips see the keys up to their last row: at least the lower triangle, less than everything.
    assert 5 * full / 2 <= causal < 5 * full or (seq <= 128 and causal == 5 * full)


def test_block_matmul_products_are_the_blocks_flops() -> None:
    """Counted from the compiled graph's matmul nodes, independently of ``block_flops``'s formula."""
    shape = (2, 32, 64, 2)
    exe = rlx.compile(block.build_block(*shape))
    products = block.matmul_products(exe.graph)
    assert sum(p.flops for p in products) == block.block_flops(*shape)["matmul"]
    # Weights applied to every token are one product over all the rows, as rlx and torch run them.
    assert any(p.m == shape[0] * shape[1] and p.count == 1 for p in products)
    assert any(p.trans_a or p.trans_b for p in products)


def test_compare_blas_times_both_libraries() -> None:
    pytest.importorskip("torch")
    import torch

    threads = torch.get_num_threads()
    blas = h.RlxOpenBlas()
    before = blas.threads()
    products = [h.Product(64, 48, 32, trans_a=True, count=3), h.Product(40, 64, 32, trans_b=True)]
    result = h.compare_blas(blas, products, burst=0.002, rounds=1, tiles=True)
    assert result.openblas_s > 0 and result.torch_s > 0 and result.rlx_s > 0
    assert result.flops == sum(p.flops for p in products)
    assert [row[0] for row in result.per_product] == ["64x48x32 TN", "40x64x32 NT"]
    assert np.isfinite(result.torch_speedup)
    assert torch.get_num_threads() == threads and blas.threads() == before  # both restored


def test_bursts_time_the_first_call_after_the_gap_and_the_warm_ones_apart() -> None:
    """Each implementation's burst: a setup before every call, the gap before the first only, the
    first call's time cold and the rest warm; the rotation still alternates implementations."""
    log: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def setup(self) -> None:
            log.append(f"setup {self.name}")

        def run(self) -> object:
            log.append(f"run {self.name}")
            return None

    bursts = h.time_bursts({"a": Fake("a"), "b": Fake("b")}, repeat=3, gap=0.0, warm=2)
    assert {name: len(times) for name, times in bursts.cold.items()} == {"a": 3, "b": 3}
    assert {name: len(times) for name, times in bursts.warm.items()} == {"a": 6, "b": 6}
    runs = [entry.split()[1] for entry in log if entry.startswith("run")]
    assert runs == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3 + ["a"] * 3 + ["b"] * 3
    assert all(log[i].startswith("setup") and log[i + 1].startswith("run") for i in range(0, len(log), 2))
    assert [len(times) for times in h.time_interleaved({"a": Fake("a")}, repeat=2, gap=0.0).values()] == [2]


def test_attention_products_read_their_operands_as_the_kernel_lays_them_out() -> None:
    """Strips and transposed copies an odd number of lines apart, BSHD heads H·D apart: a product
    timed with rows a power of two of lines apart runs slower than the kernel's own."""
    from rlx.codegen.lower_attention import packed_ld, strip_ld

    batch, heads, seq, dim = 1, 4, 512, 64
    products = h.attention_products(batch, heads, seq, dim, False, backward=True, strided_rows=True)
    scores = [p for p in products if p.n == seq and not p.trans_a]
    assert scores and all(p.ldb == packed_ld(seq) and p.ldc == strip_ld(seq) for p in scores)
    assert all((p.ldb // 16) % 2 == 1 for p in scores)  # an odd number of 64-byte lines
    transposed = [p for p in products if p.trans_a]
    assert transposed and all(p.lda == strip_ld(seq) and p.ldb == heads * dim for p in transposed)
    contiguous = h.Product(8, 24, 16, trans_a=True)
    assert contiguous.leading() == (8, 24, 24)


def test_strided_products_are_timed_and_checked_like_contiguous_ones() -> None:
    pytest.importorskip("torch")
    blas = h.RlxOpenBlas()
    products = [h.Product(48, 80, 64, lda=80, ldb=112, ldc=96), h.Product(80, 64, 48, trans_a=True, lda=112, ldb=80)]
    result = h.compare_blas(blas, products, burst=0.002, rounds=1, tiles=True)
    assert result.openblas_s > 0 and result.torch_s > 0 and result.rlx_s > 0


def test_the_same_size_sgemm_has_the_cases_flops_and_restores_the_thread_count() -> None:
    blas = h.RlxOpenBlas()
    before = blas.threads()
    flops = 4.0 * 2 * 3 * 128 * 128 * 64
    sgemm = h.SameSizeSgemm(blas, flops, threads=2)
    assert abs(sgemm.flops / flops - 1) < 0.01
    sgemm.setup()
    assert blas.threads() == 2
    sgemm.run()
    assert blas.threads() == before
    sgemm.check()
    sgemm.c[0, 0] += 1.0  # a wrong product is refused
    with pytest.raises(RuntimeError, match="wrong product"):
        sgemm.check()
