"""Banded strips (``lower_attention.BANDS``): a causal-like kernel's strip products skip what lies
above each strip's diagonal, and its results are bitwise those of the whole products.

Each test compiles the same graph twice in one process, banded and not, with the same strip
height (the height changes the order in which dK and dV sum their strips), and compares the
outputs bit for bit: for finite inputs, where the band is taken; for NaN or Inf in an operand
and for rows whose hidden keys weigh (a finite ``neg`` near the scores), where the kernel
falls back to the whole products, so that NaN reaches exactly what it reached before. The
results are also checked against the float64 reference.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import rlx
import rlx.codegen.executable as executable
import rlx.codegen.lower_attention as lower_attention
import rlx.codegen.lower_flex as lower_flex
from rlx import Graph, Layout, MaskKind, RuntimeConfig
from rlx.codegen import CodegenOptions, compile_graph
from rlx.codegen.strip_heights import choose_block_q
from rlx.codegen.tile_gemm import host_tile_shape

pytestmark = pytest.mark.skipif(host_tile_shape() is None, reason="no register tiles on this CPU: nothing is banded")

MASKS = [MaskKind.CAUSAL, MaskKind.sliding_window(5), MaskKind.sliding_window(40)]


def build(
    mask: MaskKind, layout: Layout, b: int, sq: int | str, sk: int | str, h: int, hkv: int, d: int, dv: int
) -> Graph:
    g = Graph("banded")
    q = g.input("q", layout.join(b, sq, h, d))
    k = g.input("k", layout.join(b, sk, hkv, d))
    v = g.input("v", layout.join(b, sk, hkv, dv))
    out = g.attention(q, k, v, mask=mask, layout=layout)
    dy = g.input("dy", out.shape)
    dq, dk, dvv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dvv)
    return g


def arrays_for(layout: Layout, b: int, sq: int, sk: int, h: int, hkv: int, d: int, dv: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(sq * 7 + sk)
    shapes = {
        "q": layout.join(b, sq, h, d),
        "k": layout.join(b, sk, hkv, d),
        "v": layout.join(b, sk, hkv, dv),
        "dy": layout.join(b, sq, h, dv),
    }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


@pytest.fixture
def flags() -> Iterator[None]:
    """Restore BANDS and PANELS and drop executables compiled with them flipped."""
    saved = lower_attention.BANDS, lower_attention.PANELS
    yield
    lower_attention.BANDS, lower_attention.PANELS = saved
    executable._cache.clear()


def both(
    graph: Graph, block_q: int | None = None, config: RuntimeConfig | None = None, flag: str = "BANDS"
) -> dict[bool, executable.Executable]:
    """The graph compiled with ``lower_attention``'s ``flag`` off and on (whole products and
    banded, or heads read in place and packed), with strips of ``block_q`` rows if given."""
    compiled = {}
    for on in (False, True):
        setattr(lower_attention, flag, on)
        executable._cache.clear()
        compiled[on] = compile_graph(graph, config=config, options=CodegenOptions(block_q=block_q))
    return compiled


def assert_same_bits(whole: dict[str, np.ndarray], banded: dict[str, np.ndarray]) -> None:
    for name, value in whole.items():
        np.testing.assert_array_equal(banded[name], value, err_msg=name)
        assert np.array_equal(np.signbit(banded[name]), np.signbit(value)) or np.isnan(value).any(), name


SHAPES = [
    # (layout, b, sq, sk, h, hkv, d, dv, block_q)
    (Layout.BSHD, 2, 96, 96, 2, 2, 16, 16, 32),
    (Layout.BSHD, 1, 130, 130, 4, 2, 8, 12, 64),  # GQA, Dv != D, strips cut at the length
    (Layout.BHSD, 2, 77, 150, 2, 1, 16, 16, 40),  # Sq < Sk: the diagonal is offset; MQA
    (Layout.BHSD, 1, 200, 200, 1, 1, 32, 32, 200),  # one strip: its whole triangle
    (Layout.BSHD, 1, 150, 90, 2, 2, 16, 8, 64),  # Sq > Sk: the first rows see no key
]


@pytest.mark.thin("mask")
@pytest.mark.usefixtures("flags")
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[2]}x{s[3]}-h{s[4]}/{s[5]}-d{s[6]}/{s[7]}-q{s[8]}")
def test_banded_is_bitwise_the_whole_product(mask: MaskKind, shape: tuple) -> None:
    layout, b, sq, sk, h, hkv, d, dv, block_q = shape
    graph = build(mask, layout, b, sq, sk, h, hkv, d, dv)
    arrays = arrays_for(layout, b, sq, sk, h, hkv, d, dv)
    compiled = both(graph, block_q)
    whole, banded = compiled[False](**arrays), compiled[True](**arrays)
    assert_same_bits(whole, banded)
    expected = rlx.reference.run(graph, **arrays)
    for name, want in expected.items():
        np.testing.assert_allclose(banded[name], want, rtol=2e-4, atol=2e-4, err_msg=name)


@pytest.mark.thin("value")
@pytest.mark.usefixtures("flags")
@pytest.mark.parametrize("where", ["q", "k", "v", "dy"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_operands_take_the_whole_products(where: str, value: float) -> None:
    """A NaN or Inf in a key that a strip's first rows do not see still reaches them through
    0 · x, as in the whole product (and the reference): the kernel checks its operands."""
    layout, b, sq, sk, h, d = Layout.BSHD, 1, 128, 128, 2, 16
    graph = build(MaskKind.CAUSAL, layout, b, sq, sk, h, h, d, d)
    arrays = arrays_for(layout, b, sq, sk, h, h, d, d)
    arrays[where][0, 100, 1, 3] = value  # row/key 100, head 1: hidden from rows 64-99 of its strip
    compiled = both(graph, 64)
    whole, banded = compiled[False](**arrays), compiled[True](**arrays)
    assert any(np.isnan(x).any() for x in whole.values())
    assert_same_bits(whole, banded)


@pytest.mark.usefixtures("flags")
@pytest.mark.parametrize("layout", [Layout.BSHD, Layout.BHSD], ids=str)
def test_overflowing_scores_take_the_whole_products(layout: Layout) -> None:
    """Finite q and k whose score overflows (inf - inf: NaN) make a row's 1/sum NaN, and the
    zeros above its diagonal NaN once normalised, as in the whole products: not skipped."""
    b, sq, sk, h, d = 1, 100, 130, 2, 8
    graph = build(MaskKind.CAUSAL, layout, b, sq, sk, h, h, d, d)
    arrays = arrays_for(layout, b, sq, sk, h, h, d, d)
    query, key = ((0, 1, 70), (0, 1, 10)) if layout == Layout.BHSD else ((0, 70, 1), (0, 10, 1))
    arrays["q"][query][:2] = [1e30, 1e30]
    arrays["k"][key][:2] = [1e30, -1e30]
    compiled = both(graph, 32)
    whole, banded = compiled[False](**arrays), compiled[True](**arrays)
    assert np.isnan(whole["dv"]).any()
    assert_same_bits(whole, banded)


@pytest.mark.usefixtures("flags")
def test_rows_whose_hidden_keys_weigh_take_the_whole_products() -> None:
    """With ``neg`` within reach of the scores, hidden keys weigh exp(neg - max) > 0: P is not 0
    above the diagonal, and the strip's products must not skip it."""
    layout, b, sq, sk, h, d = Layout.BSHD, 1, 96, 96, 2, 16
    config = RuntimeConfig(attn_mask_neg_inf=-2.0)
    graph = build(MaskKind.CAUSAL, layout, b, sq, sk, h, h, d, d)
    arrays = arrays_for(layout, b, sq, sk, h, h, d, d)
    compiled = both(graph, 32, config)
    whole, banded = compiled[False](**arrays), compiled[True](**arrays)
    assert_same_bits(whole, banded)
    expected = rlx.reference.run(graph, config=config, **arrays)
    for name, want in expected.items():
        np.testing.assert_allclose(banded[name], want, rtol=2e-4, atol=2e-4, err_msg=name)


@pytest.mark.usefixtures("flags")
def test_symbolic_lengths_band_per_call() -> None:
    """A kernel of symbolic lengths decides per call; a short call (fewer rows than the check
    pays for) takes the whole products."""
    layout, b, h, d = Layout.BSHD, 1, 2, 16
    graph = build(MaskKind.CAUSAL, layout, b, "S", "S", h, h, d, d)
    compiled = both(graph, 48)
    for length in (5, 31, 32, 100, 257):
        arrays = arrays_for(layout, b, length, length, h, h, d, d)
        assert_same_bits(compiled[False](**arrays), compiled[True](**arrays))


def test_banded_causal_strips_are_tall_without_a_small_path() -> None:
    """Banded causal strips hide nothing, so they take the tall heights (see strip_heights)."""
    rows = [choose_block_q(s, s, True, True, True, 64, small_path=False, banded=True) for s in (128, 512, 1024, 4096)]
    assert rows == [128, 128, 128, 256]
    assert choose_block_q(768, 768, True, True, True, 128, small_path=False, banded=True) == 256
    assert choose_block_q(512, 512, True, True, True, 64, small_path=False, banded=False) == 32
    assert choose_block_q(512, 512, True, True, True, 64, small_path=True, banded=True) == 32


@pytest.mark.thin("mask")
@pytest.mark.usefixtures("flags")
@pytest.mark.parametrize("mask", [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(3)], ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        (Layout.BSHD, 2, 70, 70, 2, 1, 16, 24, 32),
        (Layout.BHSD, 1, 40, 90, 2, 2, 8, 5, 16),  # Dv = 5: one panel, zeros past its fifth column
        (Layout.BSHD, 2, 11, 6, 2, 2, 4, 4, 3),  # fewer query rows than a call packs for
        (Layout.BSHD, 1, "S", "S", 2, 2, 16, 16, 24),  # symbolic: each call decides
    ],
    ids=lambda s: f"{s[0]}-{s[2]}x{s[3]}-d{s[6]}/{s[7]}",
)
def test_packed_panels_give_the_bits_of_the_heads_as_stored(mask: MaskKind, shape: tuple) -> None:
    """V (forward) and K (backward's dQ) packed in column panels once per head: the products add
    the same numbers in the same order as when they read the heads in place."""
    layout, b, sq, sk, h, hkv, d, dv, block_q = shape
    graph = build(mask, layout, b, sq, sk, h, hkv, d, dv)
    compiled = both(graph, block_q, flag="PANELS")
    lengths = [(sq, sk)] if isinstance(sq, int) else [(5, 5), (40, 40), (130, 130)]
    for length_q, length_k in lengths:
        arrays = arrays_for(layout, b, length_q, length_k, h, hkv, d, dv)
        assert_same_bits(compiled[False](**arrays), compiled[True](**arrays))


@pytest.mark.usefixtures("flags")
@pytest.mark.parametrize("mods", ["causal", "softcap+window", "none"])
def test_flex_kernels_packed_panels_give_the_same_bits(mods: str) -> None:
    """The programmable kernels pack V and K in column panels too: forward with LSE, and the
    backward's dQ over each run of visible tiles, bitwise as when they read the heads in place."""
    b, h, hkv, s, d, dv = 2, 4, 2, 150, 16, 24
    g = Graph("flex_panels")
    q = g.input("q", (b, h, s, d))
    k = g.input("k", (b, hkv, s, d))
    v = g.input("v", (b, hkv, s, dv))
    kwargs: dict = {}
    if mods == "causal":
        kwargs["mask_mod"] = rlx.mods.causal
    elif mods == "softcap+window":
        kwargs["mask_mod"] = rlx.mods.sliding_window(40)
        kwargs["score_mod"] = rlx.mods.softcap(20.0)
    out, lse = g.attention(q, k, v, layout=Layout.BHSD, return_lse=True, **kwargs)
    dy = g.input("dy", out.shape)
    dq, dk, dvv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, lse=lse, dq=dq, dk=dk, dv=dvv)
    rng = np.random.default_rng(3)
    arrays = {name: rng.standard_normal(x.shape).astype(np.float32) for name, x in g.inputs.items()}
    compiled = both(g, flag="PANELS")
    assert_same_bits(compiled[False](**arrays), compiled[True](**arrays))


# ---------------------------------------------------------------------------- programmable kernels


def flex_graph(mods: str, b: int, h: int, hkv: int, sq: int | str, sk: int | str, d: int, dv: int) -> Graph:
    """Forward with LSE and the backward (which reads them) of a flex attention with ``mods``."""
    g = Graph("flex_banded")
    q = g.input("q", (b, h, sq, d))
    k = g.input("k", (b, hkv, sk, d))
    v = g.input("v", (b, hkv, sk, dv))
    doc = g.input("doc", (b, max(sq, sk) if isinstance(sq, int) and isinstance(sk, int) else sk), dtype="int32")
    masks = {
        "causal": rlx.mods.causal,
        "lower_right": rlx.mods.causal_lower_right,
        "window": rlx.mods.sliding_window(20, 5),
        "causal&document": rlx.mods.and_(rlx.mods.causal, rlx.mods.document(doc)),
        "softcap+causal": rlx.mods.causal,
    }
    score_mod = rlx.mods.softcap(5.0) if mods.startswith("softcap") else None
    out, lse = g.attention(q, k, v, layout=Layout.BHSD, mask_mod=masks[mods], score_mod=score_mod, return_lse=True)
    dy = g.input("dy", out.shape)
    dq, dk, dvv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, lse=lse, dq=dq, dk=dk, dv=dvv)
    return g


def flex_arrays(graph: Graph, sq: int, sk: int, seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, x in graph.inputs.items():
        shape = tuple(sq if dim == "Sq" else sk if dim == "Sk" else dim for dim in x.shape)
        if name == "doc":
            arrays[name] = np.sort(rng.integers(0, 3, shape), axis=-1).astype(np.int32)  # documents in runs
        else:
            arrays[name] = rng.standard_normal(shape).astype(np.float32)
    return arrays


FLEX_SHAPES = [
    # (b, h, hkv, sq, sk, d, dv, block_q)
    (2, 4, 2, 150, 150, 16, 24, None),  # GQA, Dv != D, the kernel's own strips
    (1, 2, 1, 70, 130, 8, 8, 32),  # Sq < Sk: a lower-right diagonal is offset; MQA
    (1, 2, 2, 130, 60, 16, 16, 64),  # Sq > Sk: a lower-right mask's first rows see no key
]


@pytest.mark.usefixtures("flags")
@pytest.mark.parametrize(  # a window and a document mask are slow cases: their bands are causal's and lower-right's
    "mods",
    [
        "causal",
        "lower_right",
        pytest.param("window", marks=pytest.mark.slow),
        pytest.param("causal&document", marks=pytest.mark.slow),
        "softcap+causal",
    ],
)
@pytest.mark.parametrize("shape", FLEX_SHAPES, ids=lambda s: f"{s[3]}x{s[4]}-h{s[1]}/{s[2]}-d{s[5]}/{s[6]}")
def test_flex_kernels_band_their_mask_diagonal(mods: str, shape: tuple) -> None:
    """A mask_mod with a diagonal (``Region.key_bounds``): ``Q K^T`` (and the backward's ``dY
    V^T``) leave the entries above each strip's diagonal unwritten, and ``P V``, dV, dQ and dK
    skip the terms of the keys there, bitwise as the whole products give, LSE included."""
    b, h, hkv, sq, sk, d, dv, block_q = shape
    graph = flex_graph(mods, b, h, hkv, sq, sk, d, dv)
    arrays = flex_arrays(graph, sq, sk)
    compiled = both(graph, block_q)
    whole, banded = compiled[False](**arrays), compiled[True](**arrays)
    assert "run.diagonal" in compiled[True].llvm_ir and "run.diagonal" not in compiled[False].llvm_ir
    assert_same_bits(whole, banded)
    expected = rlx.reference.run(graph, **arrays)
    for name, want in expected.items():
        np.testing.assert_allclose(banded[name], want, rtol=2e-4, atol=2e-4, err_msg=name)


@pytest.mark.thin("value")
@pytest.mark.usefixtures("flags")
@pytest.mark.parametrize("where", ["q", "k", "v", "dy"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_flex_with_non_finite_operands_keeps_the_bits(where: str, value: float) -> None:
    """A NaN or Inf reaches the rows that do not see its key through ``0 · x`` in the whole
    products (V in ``P V``; dY, Q and K in dV, dK and dQ; a NaN statistic makes P NaN above
    the diagonal): the kernels check their operands and take the whole products."""
    graph = flex_graph("causal", 1, 2, 2, 128, 128, 16, 16)
    arrays = flex_arrays(graph, 128, 128)
    arrays[where][0, 1, 100, 3] = value  # key (or query) 100 of head 1
    compiled = both(graph, 64)
    whole, banded = compiled[False](**arrays), compiled[True](**arrays)
    assert any(np.isnan(x).any() for x in whole.values())
    assert_same_bits(whole, banded)


@pytest.mark.usefixtures("flags")
def test_flex_kernels_band_per_call_with_symbolic_lengths() -> None:
    """Lengths known per call: the diagonal of a lower-right mask moves with them; calls too
    short for the checks of the operands take the whole products that need them (the scores
    are banded all the same)."""
    graph = flex_graph("lower_right", 1, 2, 1, "Sq", "Sk", 16, 16)
    compiled = both(graph)
    for sq, sk in ((5, 9), (31, 31), (40, 100), (130, 70), (200, 200)):
        arrays = flex_arrays(graph, sq, sk, seed=sq + sk)
        assert_same_bits(compiled[False](**arrays), compiled[True](**arrays))


@pytest.mark.usefixtures("flags")
def test_flex_rows_whose_lse_is_nan_keep_the_bits() -> None:
    """A score_mod that makes NaN from finite operands (a log of -1 on one row) makes that row's
    LSE NaN; P stays 0 above its diagonal (the backward shifts a NaN LSE by +inf), so the
    banded products still give the bits of the whole ones."""
    b, h, s, d = 1, 2, 96, 8
    g = Graph("flex_nan_rows")
    q = g.input("q", (b, h, s, d))
    k = g.input("k", (b, h, s, d))
    v = g.input("v", (b, h, s, d))
    out, lse = g.attention(
        q,
        k,
        v,
        layout=Layout.BHSD,
        mask_mod=rlx.mods.causal,
        score_mod=lambda x, b, h, i, j: x + rlx.log(rlx.where(i == 70, -1.0, 1.0)),
        return_lse=True,
    )
    dy = g.input("dy", out.shape)
    dq, dk, dvv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, lse=lse, dq=dq, dk=dk, dv=dvv)
    rng = np.random.default_rng(11)
    arrays = {name: rng.standard_normal(x.shape).astype(np.float32) for name, x in g.inputs.items()}
    compiled = both(g, 32)
    whole, banded = compiled[False](**arrays), compiled[True](**arrays)
    assert np.isnan(whole["lse"][:, :, 70]).all() and not np.isnan(whole["lse"][:, :, :70]).any()
    assert_same_bits(whole, banded)


@pytest.mark.usefixtures("flags")
@pytest.mark.parametrize("mask", [MaskKind.CAUSAL, MaskKind.sliding_window(20)], ids=str)
def test_fixed_masks_as_mods_band_in_the_recomputing_kernels(mask: MaskKind) -> None:
    """Fixed masks compiled through the programmable kernels (``masks_as_mods``, ``neg = -inf``)
    are mask_mods whose diagonal reads ``max(Sk - Sq, 0)``: a step of the lengths alone, which
    the kernels compute per call. Their backward recomputes the row statistics, where a NaN row
    max (an overflowing score, inf - inf, from finite q and k) makes P NaN above the diagonal:
    that strip takes the whole products."""
    b, h, sq, sk, d = 1, 2, 100, 130, 8
    graph = build(mask, Layout.BHSD, b, sq, sk, h, h, d, d)
    config = RuntimeConfig(attn_mask_neg_inf=-np.inf)
    arrays = arrays_for(Layout.BHSD, b, sq, sk, h, h, d, d)
    compiled = {}
    for on in (False, True):
        lower_attention.BANDS = on
        executable._cache.clear()
        options = CodegenOptions(masks_as_mods=True, block_q=32)
        compiled[on] = compile_graph(graph, config=config, options=options)
    assert "run.diagonal" in compiled[True].llvm_ir
    assert_same_bits(compiled[False](**arrays), compiled[True](**arrays))
    arrays["q"][0, 1, 70, :2] = [1e30, 1e30]  # query 70 ...
    arrays["k"][0, 1, 90, :2] = [1e30, -1e30]  # ... and key 90, which it sees: a NaN score
    whole, banded = compiled[False](**arrays), compiled[True](**arrays)
    assert np.isnan(whole["dq"]).any()
    assert_same_bits(whole, banded)


def compile_limited(
    graph: Graph, monkeypatch: pytest.MonkeyPatch, options: CodegenOptions, config: RuntimeConfig | None = None
) -> dict[bool, executable.Executable]:
    """The graph compiled with the programmable kernels' row limits off and on."""
    compiled = {}
    for limited in (False, True):
        if limited:
            monkeypatch.undo()
        else:
            monkeypatch.setattr(lower_flex.FlexLowering, "_row_limit", lambda self, b, gi, ks, nk: None)
        executable._cache.clear()
        compiled[limited] = compile_graph(graph, config=config, options=options)
    assert "row.limit" in compiled[True].llvm_ir and "row.limit" not in compiled[False].llvm_ir
    return compiled


@pytest.mark.thin("lengths")
@pytest.mark.usefixtures("flags")
@pytest.mark.parametrize("mods", ["causal", "lower_right", "causal&document", "softcap+causal"])
@pytest.mark.parametrize("lengths", [(150, 150), (130, 60)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize(  # a NaN query and an inf value are slow cases: the NaN key takes the same path
    "poison",
    [
        None,
        pytest.param(("q", np.nan), marks=pytest.mark.slow),
        ("k", np.nan),
        pytest.param(("v", np.inf), marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_flex_rows_stop_at_their_limit_with_the_same_bits(
    mods: str, lengths: tuple[int, int], poison: tuple[str, float] | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past a row's limit (the mask's diagonal, ``FlexLowering._row_limit``) the programmable
    kernels fill in ``-inf`` scores and zero P and dS instead of running the mods, the exp and
    dS there: bitwise what computing them gives, rows that see no key (a lower-right mask with
    Sq > Sk) and non-finite operands (the whole products read P past the limit) included."""
    sq, sk = lengths
    graph = flex_graph(mods, 1, 2, 1, sq, sk, 16, 16)
    arrays = flex_arrays(graph, sq, sk)
    if poison is not None:
        where, value = poison
        arrays[where][0, 0, 50, 2] = value
    compiled = compile_limited(graph, monkeypatch, CodegenOptions(block_q=64))
    assert_same_bits(compiled[False](**arrays), compiled[True](**arrays))


@pytest.mark.usefixtures("flags")
def test_recomputed_rows_stop_at_their_limit_with_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recomputing backward (fixed masks through the programmable kernels) stops its rows'
    mods and exp at their limits too: a row whose max is NaN (an overflowing score) keeps NaN P
    past its limit, which dK must see, as the whole products give."""
    b, h, sq, sk, d = 1, 2, 100, 130, 8
    graph = build(MaskKind.CAUSAL, Layout.BHSD, b, sq, sk, h, h, d, d)
    arrays = arrays_for(Layout.BHSD, b, sq, sk, h, h, d, d)
    arrays["q"][0, 1, 70, :2] = [1e30, 1e30]
    arrays["k"][0, 1, 90, :2] = [1e30, -1e30]
    options, config = CodegenOptions(masks_as_mods=True, block_q=32), RuntimeConfig(attn_mask_neg_inf=-np.inf)
    compiled = compile_limited(graph, monkeypatch, options, config)
    whole, limited = compiled[False](**arrays), compiled[True](**arrays)
    assert np.isnan(whole["dk"]).any()
    assert_same_bits(whole, limited)
