"""The register-tiled products of the attention kernels (``rlx.codegen.tile_gemm``) against NumPy.

Each tile shape is compiled on its own (the AVX2 tile runs on an AVX-512 machine too), and the
products are checked against float64 over the cases that take different code: tails of rows
(every tile height) and of columns (masked lanes, in every vector), ``k`` past one block,
transposed A, leading dimensions wider than the matrices, beta 0 (C holds NaN and must not be
read), beta 1 and other alphas, ``k = 0``, and products taller than wide and wider than tall
(the two loop orders).
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlx.codegen.tile_gemm import (
    AVX2_TILE,
    AVX512_TILE,
    K_BLOCK,
    Band,
    TileShape,
    _row_bases,
    host_tile_shape,
    runtime_symbols,
    tile_shape_for,
)

_SIGNATURE = ctypes.CFUNCTYPE(
    None,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_float,
    ctypes.c_void_p,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
    ctypes.c_int64,
)

SHAPES = [AVX512_TILE, AVX2_TILE]


def _runs_here(shape: TileShape) -> bool:
    host = host_tile_shape()
    return host is not None and (host.width >= shape.width)


def _products(shape: TileShape) -> dict[bool, object]:
    """The product for A as stored and for A transposed, compiled for ``shape``."""
    addresses = runtime_symbols(shape)
    return {trans_a: _SIGNATURE(addresses[shape.product_name(trans_a)]) for trans_a in (False, True)}


def _check(
    shape: TileShape,
    m: int,
    n: int,
    k: int,
    trans_a: bool,
    alpha: float,
    beta: float,
    pad: tuple[int, int, int] = (0, 0, 0),
    seed: int = 0,
) -> None:
    rng = np.random.default_rng(seed)
    a_rows, a_cols = (k, m) if trans_a else (m, k)
    a = rng.standard_normal((a_rows, a_cols + pad[0]), dtype=np.float32)
    b = rng.standard_normal((k, n + pad[1]), dtype=np.float32)
    c = rng.standard_normal((m, n + pad[2]), dtype=np.float32)
    before = c.copy()
    if beta == 0.0:
        c[:, :n] = np.nan  # BLAS semantics: C is not read
    op_a = a[:, :a_cols].astype(np.float64)
    op_a = op_a.T if trans_a else op_a
    expected = alpha * (op_a @ b[:, :n].astype(np.float64))
    if beta != 0.0:
        expected += beta * before[:, :n]
    _products(shape)[trans_a](m, n, k, alpha, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], beta,
                              c.ctypes.data, c.shape[1], Band.NONE, 0, 0)  # fmt: skip
    tolerance = 1e-5 * (np.sqrt(max(k, 1)) * 4 + 1)
    np.testing.assert_allclose(c[:, :n], expected, rtol=tolerance, atol=tolerance)
    np.testing.assert_array_equal(c[:, n:], before[:, n:])  # padding beyond n untouched


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.rows}x{s.vectors}x{s.width}")
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 1, 1),
        (2, 3, 5),
        (14, 32, 64),  # one whole tile
        (15, 33, 7),  # a row and a column past it
        (32, 128, 64),  # a short strip: tiles of 14, 14 and 4 rows
        (19, 20, 33),  # tiles of 14, 4 and 1 row
        (64, 77, 64),  # a column tail in the second vector
        (100, 64, 129),  # taller than wide: rows outermost
        (29, 45, K_BLOCK + 3),  # k in two blocks, the second short
        (40, 16, 2 * K_BLOCK),  # k in two whole blocks
    ],
)
def test_matches_float64(shape: TileShape, trans_a: bool, m: int, n: int, k: int) -> None:
    if not _runs_here(shape):
        pytest.skip("this CPU has no vectors of this width")
    _check(shape, m, n, k, trans_a, 1.0, 0.0)
    _check(shape, m, n, k, trans_a, 0.125, 1.0, pad=(3, 5, 7), seed=1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.rows}x{s.vectors}x{s.width}")
def test_rows_left_to_short_tiles_match_float64(shape: TileShape) -> None:
    """Heights where the whole tiles stop one early and the 4-row tiles take the rest (a
    remainder of 2 or 3 rows), next to heights where they do not, with a column tail."""
    if not _runs_here(shape):
        pytest.skip("this CPU has no vectors of this width")
    for m in sorted({shape.rows + 2, shape.rows + 3, 2 * shape.rows + 2, 2, 3, shape.rows + 1, shape.rows + 4}):
        _check(shape, m, 2 * shape.columns + 3, 37, m % 2 == 1, 1.0, 0.0, seed=m)
        _check(shape, m, shape.columns, 37, m % 2 == 0, 0.5, 1.0, pad=(1, 2, 3), seed=m)


def test_whole_tiles_give_rows_back_where_short_tiles_are_faster() -> None:
    """A remainder of 2 or 3 rows runs as 4-row tiles at the FMA rate with one whole tile's rows,
    not as 1-row tiles bound by the FMA latency; 1 or 4 rows stay where they are."""
    assert [AVX2_TILE.rows_given_back(r) for r in range(6)] == [0, 0, 1, 1, 0, 0]
    assert AVX2_TILE.remainder_cycles(8) + AVX2_TILE.step_cycles(6) * 20 == 128
    assert AVX2_TILE.remainder_cycles(2) + AVX2_TILE.step_cycles(6) * 21 == 134
    assert AVX512_TILE.rows_given_back(2) and not AVX512_TILE.rows_given_back(1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.rows}x{s.vectors}x{s.width}")
def test_zero_terms_scale_c(shape: TileShape) -> None:
    """``k = 0`` leaves ``beta C``, as BLAS does (and zeros for beta 0, whatever C held)."""
    if not _runs_here(shape):
        pytest.skip("this CPU has no vectors of this width")
    _check(shape, 9, 40, 0, False, 1.0, 0.0)
    _check(shape, 9, 40, 0, True, 2.0, 1.0)


@pytest.mark.parametrize("trans_a", [False, True])
def test_nan_and_inf_propagate(trans_a: bool) -> None:
    shape = host_tile_shape()
    if shape is None:
        pytest.skip("no tiles on this CPU")
    m, n, k = 20, 40, 9
    a = np.ones((k, m) if trans_a else (m, k), dtype=np.float32)
    b = np.ones((k, n), dtype=np.float32)
    b[3, 5], b[4, 37] = np.nan, np.inf
    c = np.zeros((m, n), dtype=np.float32)
    _products(shape)[trans_a](m, n, k, 1.0, a.ctypes.data, a.shape[1], b.ctypes.data, n, 0.0, c.ctypes.data, n,
                              Band.NONE, 0, 0)  # fmt: skip
    assert np.isnan(c[:, 5]).all() and np.isposinf(c[:, 37]).all()
    assert np.isfinite(np.delete(c, [5, 37], axis=1)).all()


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 70),
    n=st.integers(1, 90),
    k=st.integers(0, 80),
    trans_a=st.booleans(),
    beta=st.sampled_from([0.0, 1.0, 0.5]),
    pad=st.tuples(st.integers(0, 4), st.integers(0, 20), st.integers(0, 4)),
)
def test_random_shapes(m: int, n: int, k: int, trans_a: bool, beta: float, pad: tuple[int, int, int]) -> None:
    shape = host_tile_shape()
    if shape is None:
        return
    _check(shape, m, n, k, trans_a, 0.75, beta, pad)


def test_tile_for_features() -> None:
    assert tile_shape_for("+avx512f,+avx2,+fma,-amx-tile") == AVX512_TILE
    assert tile_shape_for("+avx2,+fma,-avx512f") == AVX2_TILE
    assert tile_shape_for("+sse4.2,-avx2,-fma") is None
    assert AVX512_TILE.row_steps == (14, 4, 1)
    assert AVX2_TILE.row_steps == (6, 4, 1)


@pytest.mark.parametrize(
    ("layout", "seq", "heads", "kv_heads", "dim", "dim_v", "causal"),
    [
        ("bhsd", 512, 2, 2, 64, 64, False),
        ("bhsd", 520, 2, 1, 64, 48, True),  # GQA, Dv != D, a column tail in the tiles
        ("bshd", 600, 3, 3, 40, 72, False),
        ("bshd", 384, 4, 2, 96, 96, True),
        ("bshd", 1100, 2, 2, 64, 64, True),  # K's transposed copy a page a row: panels copied
        ("bhsd", 1030, 1, 1, 32, 40, False),
        ("bhsd", 1024, 2, 2, 64, 64, False),  # strips of 1024 keys: rows 1040 floats apart (strip_ld)
    ],
)
def test_attention_on_the_tiles_matches_the_reference(
    layout: str, seq: int, heads: int, kv_heads: int, dim: int, dim_v: int, causal: bool
) -> None:
    """Attention forward and backward at sizes whose strip products the kernels run on the tiles
    (above OpenBLAS's small-matrix path), against the float64 reference."""
    import rlx
    from rlx import Graph, Layout, MaskKind
    from rlx.codegen.blas import load_blas
    from rlx.codegen.lower_attention import tiles_take
    from rlx.codegen.strip_heights import choose_block_q
    from rlx.reference import run as reference

    if host_tile_shape() is None:
        pytest.skip("no tiles on this CPU")
    rows = choose_block_q(seq, seq, needs_dp=True, causal_like=causal, strided_rows=layout == "bshd",
                          head_dim=max(dim, dim_v), small_path=load_blas().has_small_path)  # fmt: skip
    assert tiles_take(rows, seq, dim, trans_a=False, trans_b=False)  # S = Q K^T of a whole strip
    lay = Layout.BHSD if layout == "bhsd" else Layout.BSHD

    def shape(h: int, d: int) -> tuple[int, ...]:
        return (1, h, seq, d) if lay is Layout.BHSD else (1, seq, h, d)

    g = Graph("tiled_attention")
    shapes = {"q": shape(heads, dim), "k": shape(kv_heads, dim), "v": shape(kv_heads, dim_v), "dy": shape(heads, dim_v)}
    q, k, v, dy = (g.input(name, shapes[name]) for name in ("q", "k", "v", "dy"))
    out = g.attention(q, k, v, mask=MaskKind.CAUSAL if causal else MaskKind.NONE, layout=lay)
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    rng = np.random.default_rng(seq)
    arrays = {name: rng.standard_normal(s, dtype=np.float32) for name, s in shapes.items()}
    got = rlx.compile(g)(**arrays)
    expected = reference(g, **arrays)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("height", range(1, 17))
def test_row_bases_address_every_row(height: int) -> None:
    """Every row of a tile is one of its bases plus 0, 1, 2, 4 or 8 rows, as x86 addresses it."""
    bases, placement = _row_bases(height)
    assert bases[0] == 0 and len(placement) == height
    for row, (index, multiple) in enumerate(placement):
        assert multiple in (0, 1, 2, 4, 8) and bases[index] + multiple == row


_GUARDED = """
import ctypes, mmap, sys
import numpy as np
from rlx.codegen.tile_gemm import host_tile_shape, runtime_symbols

m, n, k, trans_a = (int(arg) for arg in sys.argv[1:])
page = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def guarded(rows, cols):
    # a float32 array whose last element ends where an unreadable page begins
    size = rows * cols * 4
    pages = -(-size // page) + 1
    region = mmap.mmap(-1, pages * page)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert libc.mprotect(start + (pages - 1) * page, page, 0) == 0  # PROT_NONE
    offset = (pages - 1) * page - size
    return region, np.frombuffer(region, np.float32, rows * cols, offset).reshape(rows, cols)


shape = host_tile_shape()
product = ctypes.CFUNCTYPE(None, *([ctypes.c_int64] * 3), ctypes.c_float, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(
    runtime_symbols(shape)[shape.product_name(bool(trans_a))])
rng = np.random.default_rng(0)
keep_a, a = guarded(*((k, m) if trans_a else (m, k)))
keep_b, b = guarded(k, n)
keep_c, c = guarded(m, n)
a[:] = rng.standard_normal(a.shape)
b[:] = rng.standard_normal(b.shape)
product(m, n, k, 1.0, a.ctypes.data, a.shape[1], b.ctypes.data, n, 0.0, c.ctypes.data, n, 0, 0, 0)
expected = (a.T if trans_a else a).astype(np.float64) @ b.astype(np.float64)
np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-4)
"""


@pytest.mark.parametrize(
    ("m", "n", "k"), [(20, 45, 7), (3, 17, 5), pytest.param(45, 20, 7, marks=pytest.mark.slow), (14, 100, 33)]
)
@pytest.mark.thin("trans_a")
@pytest.mark.parametrize("trans_a", [False, True])
def test_reads_nothing_past_the_operands(m: int, n: int, k: int, trans_a: bool) -> None:
    """Operands that end where an unreadable page begins: the tiles read B's panels whole, so a
    last panel narrower than a tile must be a copy, never a read past B's last row (which would
    kill the process: so it runs in a child)."""
    import subprocess
    import sys

    if host_tile_shape() is None:
        pytest.skip("no tiles on this CPU")
    child = subprocess.run([sys.executable, "-c", _GUARDED, str(m), str(n), str(k), str(int(trans_a))],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]


def test_transposed_products_take_the_tiles_while_a_is_small() -> None:
    """``dV += P^T dY`` and ``dK += dS^T Q`` run on the tiles while A (keys x strip rows) is at
    most 512 KB, above OpenBLAS's small-matrix path where it has one; B read transposed never does."""
    from rlx.codegen.blas import load_blas
    from rlx.codegen.lower_attention import TILE_TN_MAX_A, tiles_take

    if host_tile_shape() is None:
        pytest.skip("no tiles on this CPU")
    assert TILE_TN_MAX_A * 4 == 512 * 1024
    assert tiles_take(512, 64, 256, trans_a=True, trans_b=False)
    assert tiles_take(2048, 64, 64, trans_a=True, trans_b=False)
    assert not tiles_take(1024, 64, 256, trans_a=True, trans_b=False)  # A is 1 MB
    assert tiles_take(128, 64, 64, trans_a=True, trans_b=False) != load_blas().has_small_path
    assert tiles_take(1024, 64, 256, trans_a=False, trans_b=False)  # A as stored: no such limit
    assert not tiles_take(256, 512, 64, trans_a=False, trans_b=True)


def test_products_with_a_as_stored_take_the_tiles_at_any_size() -> None:
    """Above OpenBLAS's small-matrix path, ``Q K^T`` over 16384 keys and ``dQ = dS K`` over as
    many terms run on the tiles; transposed products are limited by the size of A, and B read
    transposed never takes them."""
    from rlx.codegen.blas import load_blas
    from rlx.codegen.lower_attention import SMALL_PATH_MACS, tiles_take

    if host_tile_shape() is None:
        pytest.skip("no tiles on this CPU")
    assert tiles_take(256, 64, 16384, trans_a=False, trans_b=False)
    assert tiles_take(256, 16384, 64, trans_a=False, trans_b=False)
    assert tiles_take(256, 16384, 256, trans_a=False, trans_b=False)
    assert not tiles_take(16384, 64, 256, trans_a=True, trans_b=False)  # dK += dS^T Q: A is 16 MB
    assert not tiles_take(256, 64, 16384, trans_a=False, trans_b=True)
    small = tiles_take(SMALL_PATH_MACS // (64 * 64), 64, 64, trans_a=False, trans_b=False)
    assert small != load_blas().has_small_path


@pytest.mark.parametrize("core", ["skylakex", "haswell", "zen", ""])
def test_small_products_take_the_tiles_where_openblas_packs_them(core: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenBLAS's SkylakeX kernels (and the later Intel cores') run products of up to 10^6
    multiply-adds unpacked, and keep them; its other kernels pack every product, and the tiles
    take the small ones too. Products above the path take the tiles either way."""
    from rlx.codegen import blas
    from rlx.codegen.lower_attention import SMALL_PATH_MACS, tiles_take

    if host_tile_shape() is None:
        pytest.skip("no tiles on this CPU")
    import rlx.codegen.lower_attention as lower_attention

    found = dataclasses.replace(blas.load_blas(), corename=core)
    monkeypatch.setattr(lower_attention, "load_blas", lambda: found)
    packs = core not in ("skylakex",)
    assert tiles_take(16, 64, 64, trans_a=False, trans_b=False) == packs
    assert tiles_take(64, 64, 128, trans_a=True, trans_b=False) == packs
    assert tiles_take(SMALL_PATH_MACS // (64 * 64) + 1, 64, 64, trans_a=False, trans_b=False)


def test_openblas_names_its_kernels() -> None:
    from rlx.codegen.blas import SMALL_PATH_CORES, load_blas

    found = load_blas()
    assert found.corename == found.corename.lower() and found.corename.strip() == found.corename
    assert found.has_small_path == (found.corename in SMALL_PATH_CORES)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(64, 100, 40), (70, 2 * 32 + 5, K_BLOCK + 9), (63, 96, 20)])
def test_panels_of_far_rows_match_float64(trans_a: bool, m: int, n: int, k: int) -> None:
    """B's rows a page or more apart: from 64 rows of C the wide product copies its panels
    (``FAR_ROWS_LD``), with a last panel narrower than a tile; 63 rows read them in place."""
    from rlx.codegen.tile_gemm import FAR_COPY_MIN_ROWS, FAR_ROWS_LD

    shape = host_tile_shape()
    if shape is None:
        pytest.skip("no tiles on this CPU")
    assert FAR_COPY_MIN_ROWS == 64
    pad = (2, FAR_ROWS_LD - n + 7, 3)  # B's leading dimension just past FAR_ROWS_LD
    _check(shape, m, n, k, trans_a, 1.0, 0.0, pad=pad)
    _check(shape, m, n, k, trans_a, 0.5, 1.0, pad=pad, seed=2)


@pytest.mark.parametrize("trans_a", [False, True])
def test_long_products_match_float64(trans_a: bool) -> None:
    """A narrow product over more terms than a strip of 16384 keys has, in many blocks of k with
    a short last one: accumulation across blocks stays exact to float32 rounding."""
    shape = host_tile_shape()
    if shape is None:
        pytest.skip("no tiles on this CPU")
    _check(shape, 30, 64, 40 * K_BLOCK + 17, trans_a, 1.0, 0.0)
    _check(shape, 17, 72, 33 * K_BLOCK + 5, trans_a, 0.5, 1.0, pad=(1, 3, 2), seed=3)


def _banded(
    shape: TileShape, m: int, n: int, k: int, trans_a: bool, beta: float, band: int, diagonal: int, seed: int
) -> None:
    """A banded product against the whole one on the same operands: bitwise equal wherever the
    band says the caller reads C, and equal to float64. For K_UPPER/K_LOWER op(A) holds zeros
    where the band skips its terms (as a causal strip's P and dS do); for OUT_LOWER the entries
    above the diagonal are either left as they were or the whole product's."""
    rng = np.random.default_rng(seed)
    op_a = rng.standard_normal((m, k), dtype=np.float32)
    rows, steps = np.arange(m)[:, None], np.arange(k)[None, :]
    if band == Band.K_UPPER:
        op_a[steps > rows + diagonal] = 0.0
    elif band == Band.K_LOWER:
        op_a[steps < rows - diagonal] = 0.0
    a = np.ascontiguousarray(op_a.T) if trans_a else op_a
    b = rng.standard_normal((k, n + 3), dtype=np.float32)
    before = rng.standard_normal((m, n), dtype=np.float32)
    whole, banded = before.copy(), before.copy()
    product = _products(shape)[trans_a]
    for c, which in ((whole, Band.NONE), (banded, band)):
        product(m, n, k, 0.5, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], beta, c.ctypes.data, n, which,
                diagonal, 0)  # fmt: skip
    expected = 0.5 * (op_a.astype(np.float64) @ b[:, :n].astype(np.float64)) + beta * before
    if band == Band.OUT_LOWER:
        read = np.arange(n)[None, :] <= rows + diagonal
        np.testing.assert_array_equal(banded[read], whole[read])
        left = ~read
        assert np.all((banded[left] == before[left]) | (banded[left] == whole[left]))
    else:
        np.testing.assert_array_equal(banded, whole)
    tolerance = 1e-5 * (np.sqrt(max(k, 1)) * 4 + 1)
    np.testing.assert_allclose(whole, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("band", [Band.OUT_LOWER, Band.K_UPPER, Band.K_LOWER])
@pytest.mark.parametrize(("m", "n", "k"), [(32, 64, 32), (64, 128, 64), (7, 40, 19), (128, 64, K_BLOCK + 40)])
def test_bands_skip_only_what_the_caller_does_not_read(trans_a: bool, band: int, m: int, n: int, k: int) -> None:
    shape = host_tile_shape()
    if shape is None:
        pytest.skip("no tiles on this CPU")
    for diagonal in (-20, -1, 0, 5, 33, K_BLOCK + 7, 10**6):
        for beta in (0.0, 1.0):
            _banded(shape, m, n, k, trans_a, beta, band, diagonal, seed=diagonal % 97)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 70),
    n=st.integers(1, 90),
    k=st.integers(0, 80),
    trans_a=st.booleans(),
    beta=st.sampled_from([0.0, 1.0, 0.5]),
    band=st.sampled_from([Band.OUT_LOWER, Band.K_UPPER, Band.K_LOWER]),
    diagonal=st.integers(-80, 160),
)
def test_random_bands(m: int, n: int, k: int, trans_a: bool, beta: float, band: int, diagonal: int) -> None:
    shape = host_tile_shape()
    if shape is None:
        pytest.skip("no tiles on this CPU")
    _banded(shape, m, n, k, trans_a, beta, band, diagonal, seed=m * 131 + n)


def _packed(b: np.ndarray, columns: int, rows_apart: int) -> np.ndarray:
    """B in column panels (tile_gemm.PRODUCT_ARGS' b_panels): panel p holds columns p·columns ..,
    row after row, zeros past the last column; panels ``rows_apart · columns`` floats apart."""
    k, n = b.shape
    panels = -(-n // columns)
    out = np.full((panels, rows_apart, columns), np.nan, dtype=np.float32)  # padding rows: never read
    padded = np.zeros((k, panels * columns), dtype=np.float32)
    padded[:, :n] = b
    out[:, :k, :] = padded.reshape(k, panels, columns).transpose(1, 0, 2)
    return out


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(100, 64, 129), (7, 40, 19), (64, 16, K_BLOCK + 40), (13, 5, 3)])
@pytest.mark.parametrize("band", [Band.NONE, Band.K_UPPER, Band.K_LOWER])
def test_packed_b_is_bitwise_b_as_stored(trans_a: bool, m: int, n: int, k: int, band: int) -> None:
    """B packed in column panels gives the bits of B as stored, for every panel width and band."""
    shape = host_tile_shape()
    if shape is None:
        pytest.skip("no tiles on this CPU")
    rng = np.random.default_rng(m + n + k)
    op_a = rng.standard_normal((m, k), dtype=np.float32)
    a = np.ascontiguousarray(op_a.T) if trans_a else op_a
    b = rng.standard_normal((k, n), dtype=np.float32)
    packed = _packed(b, shape.columns, k + 5)
    stride = packed.shape[1] * shape.columns
    product = _products(shape)[trans_a]
    results = []
    for operand, ldb, panels in ((b, n, 0), (packed, 0, stride)):
        c = np.full((m, n), 3.0, dtype=np.float32)
        product(m, n, k, 0.5, a.ctypes.data, a.shape[1], operand.ctypes.data, ldb, 1.0, c.ctypes.data, n, band, 2,
                panels)  # fmt: skip
        results.append(c)
    np.testing.assert_array_equal(results[1], results[0])
    if band == Band.NONE:
        expected = 0.5 * (op_a.astype(np.float64) @ b.astype(np.float64)) + 3.0
        np.testing.assert_allclose(results[0], expected, rtol=1e-4, atol=1e-4)
