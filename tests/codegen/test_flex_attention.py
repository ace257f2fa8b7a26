"""Programmable attention compiled: every library mod, compositions, custom mods, shapes and gradients.

Each case builds the forward (out, lse) and all gradients (q, k, v and the score_mod's float
tensors) in one graph, compiles it, and compares with the float64 reference, which materialises
the scores; the reference itself is checked against finite differences in tests/ops.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, RuntimeConfig
from rlx.codegen.lower import CodegenOptions

mods = rlx.mods


@dataclass
class Case:
    name: str
    score_mod: Callable[..., Any] | None = None
    mask_mod: Callable[..., Any] | None = None
    batch: int = 2
    seq_q: int = 37
    seq_k: int = 37
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 16
    value_dim: int = 16
    scale: float | None = None
    layout: Layout = Layout.BSHD
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # extra inputs the mods read


def _shape(layout: Layout, b: int, s: int, h: int, d: int) -> tuple[int, ...]:
    return layout.join(b, s, h, d)


def build(case: Case) -> tuple[Graph, dict[str, rlx.Value]]:
    g = Graph(case.name.replace("-", "_").replace("+", "_"))
    lay = case.layout
    q = g.input("q", _shape(lay, case.batch, case.seq_q, case.heads, case.head_dim))
    k = g.input("k", _shape(lay, case.batch, case.seq_k, case.kv_heads, case.head_dim))
    v = g.input("v", _shape(lay, case.batch, case.seq_k, case.kv_heads, case.value_dim))
    extra = {name: g.input(name, shape, dtype=dtype) for name, (shape, dtype) in case.tensors.items()}
    score_mod = case.score_mod(extra) if case.score_mod is not None else None
    mask_mod = case.mask_mod(extra) if case.mask_mod is not None else None
    out, lse = g.attention(
        q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=case.scale, layout=lay, return_lse=True
    )
    dy = g.input("dy", out.shape)
    floats = [x for x in extra.values() if x.dtype == np.float32]
    grads = rlx.grad(g, out, [q, k, v, *floats], dy)
    outputs = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    outputs.update(
        {
            f"d{name}": grad
            for name, grad in zip([n for n, x in extra.items() if x.dtype == np.float32], grads[3:], strict=True)
        }
    )
    g.output(**outputs)
    return g, extra


def inputs(g: Graph, case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for name, value in g.inputs.items():
        if value.dtype == np.float32:
            arrays[name] = rng.standard_normal(value.shape).astype(np.float32)
        elif name == "doc":
            arrays[name] = np.sort(rng.integers(0, 4, value.shape), axis=-1).astype(value.dtype)
        elif name == "lengths":
            arrays[name] = rng.integers(0, case.seq_k + 1, value.shape).astype(value.dtype)
        else:
            arrays[name] = rng.integers(0, 3, value.shape).astype(value.dtype)
    return arrays


def check(
    case: Case, config: RuntimeConfig | None = None, options: CodegenOptions | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    g, _ = build(case)
    arrays = inputs(g, case, seed)
    expected = rlx.reference.run(g, **arrays)
    from rlx.codegen.executable import compile_graph

    got = compile_graph(g, config=config, options=options)(**arrays)
    for name, want in expected.items():
        have = got[name]
        assert have.shape == want.shape, name
        assert not np.isnan(have).any(), f"{case.name}: NaN in {name}"
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(have), finite, err_msg=f"{case.name}: {name} infinities differ")
        np.testing.assert_allclose(have[finite], want[finite], rtol=2e-4, atol=2e-4, err_msg=f"{case.name}: {name}")
    return got


def _softcap(extra: dict[str, rlx.Value]) -> Callable[..., Any]:
    return mods.softcap(5.0)


CASES = [
    Case("none"),
    Case("causal", mask_mod=lambda e: mods.causal),
    Case("causal-lower-right", mask_mod=lambda e: mods.causal_lower_right(23, 70), seq_q=23, seq_k=70),
    Case("causal-lower-right-as-mask", mask_mod=lambda e: mods.causal_lower_right, seq_q=23, seq_k=70),
    Case("causal-lower-right-sq-gt-sk", mask_mod=lambda e: mods.causal_lower_right, seq_q=40, seq_k=25),
    Case("sliding-window", mask_mod=lambda e: mods.sliding_window(9), seq_q=150, seq_k=150),
    Case("two-sided-window", mask_mod=lambda e: mods.sliding_window(5, 7), seq_q=90, seq_k=90),
    Case("prefix-lm", mask_mod=lambda e: mods.prefix_lm(11)),
    Case(
        "document", mask_mod=lambda e: mods.document(e["doc"]), tensors={"doc": ((2, 70), "int64")}, seq_q=70, seq_k=70
    ),
    Case("document-int32", mask_mod=lambda e: mods.document(e["doc"]), tensors={"doc": ((2, 37), "int32")}),
    Case("key-lengths", mask_mod=lambda e: mods.key_lengths(e["lengths"]), tensors={"lengths": ((2,), "int64")}),
    Case("softcap", score_mod=_softcap),
    Case("softcap+causal", score_mod=_softcap, mask_mod=lambda e: mods.causal),
    Case("alibi", score_mod=lambda e: mods.alibi(e["slopes"]), tensors={"slopes": ((4,), "float32")}),
    Case("alibi-numpy", score_mod=lambda e: mods.alibi(np.array([0.5, 0.25, 0.125, 0.0625], np.float32))),
    Case("bias", score_mod=lambda e: mods.bias(e["bias"]), tensors={"bias": ((2, 4, 37, 37), "float32")}),
    Case(
        "alibi+softcap+document+causal",
        score_mod=lambda e: mods.chain(mods.alibi(e["slopes"]), mods.softcap(4.0)),
        mask_mod=lambda e: mods.and_(mods.causal, mods.document(e["doc"])),
        tensors={"slopes": ((4,), "float32"), "doc": ((2, 37), "int64")},
    ),
    Case("or-masks", mask_mod=lambda e: mods.or_(mods.sliding_window(3), mods.prefix_lm(4))),
    Case("gqa", kv_heads=2, mask_mod=lambda e: mods.causal),
    Case("mqa+dv", kv_heads=1, value_dim=24, score_mod=_softcap),
    Case("dv-smaller", value_dim=5, mask_mod=lambda e: mods.sliding_window(4)),
    Case("explicit-scale", scale=0.3, mask_mod=lambda e: mods.causal),
    Case("bhsd", layout=Layout.BHSD, kv_heads=2, value_dim=8, mask_mod=lambda e: mods.causal, score_mod=_softcap),
    Case("s1", seq_q=1, seq_k=1, mask_mod=lambda e: mods.causal),
    Case("decode", seq_q=1, seq_k=77, mask_mod=lambda e: mods.causal_lower_right(1, 77)),
    Case("sq-gt-sk", seq_q=50, seq_k=19, mask_mod=lambda e: mods.causal),
    Case("odd-dims", head_dim=7, value_dim=3, seq_q=13, seq_k=29, heads=3, kv_heads=1),
    Case(
        "custom-lambda",
        score_mod=lambda e: lambda s, b, h, q, kv: rlx.where(q - kv > 3, s * 0.5, s - 0.1 * (h + 1)) + rlx.sigmoid(s),
        mask_mod=lambda e: lambda b, h, q, kv: ((q + kv) % 3 != 0) | (kv == 0),
    ),
    Case(
        "custom-math",
        score_mod=lambda e: (
            lambda s, b, h, q, kv: rlx.maximum(s, -1.0) + rlx.minimum(s, 1.0) * rlx.abs(s) + rlx.exp(-rlx.abs(s))
        ),
        mask_mod=lambda e: lambda b, h, q, kv: ~(kv // 4 == q // 4 + 1),
    ),
    Case(
        "powers-and-negated-indices",
        score_mod=lambda e: (
            lambda s, b, h, q, kv: s**2 * 0.1 - (s / 4) ** 3 + rlx.abs(s) ** 1.5 * 2 ** (-(h + 1) * 0.5)
        ),
        mask_mod=lambda e: lambda b, h, q, kv: -q <= -kv + (q % 2) ** 2,
    ),
    Case(  # (kv - q) · 2^28 leaves 32-bit ints from |kv - q| = 8 on: vectors of both kinds of lanes
        "ints-beyond-32-bits",
        score_mod=lambda e: lambda s, b, h, q, kv: s + (kv * 268435456 - q * 268435456) * 2e-9,
        mask_mod=lambda e: mods.causal,
    ),
    Case(
        "gathered-bias",
        score_mod=lambda e: lambda s, b, h, q, kv: s + e["table"][h, (q - kv) % 5] * 2.0,
        tensors={"table": ((4, 5), "float32")},
    ),
    Case(  # indices that are entries of an int tensor, checked against the axis before each call
        "bias-by-document-pair",
        score_mod=lambda e: lambda s, b, h, q, kv: s + e["pair_bias"][e["doc"][b, q], e["doc"][b, kv]],
        tensors={"doc": ((2, 37), "int64"), "pair_bias": ((4, 4), "float32")},
        mask_mod=lambda e: mods.causal,
    ),
    Case(
        "distance-from-segment-start",
        score_mod=lambda e: lambda s, b, h, q, kv: s - 0.05 * (q - e["starts"][e["seg"][b, q]]) * (h + 1),
        mask_mod=lambda e: lambda b, h, q, kv: e["allowed"][e["seg"][b, q], e["seg"][b, kv]] | (q == kv),
        tensors={"seg": ((2, 37), "int32"), "starts": ((3,), "int64"), "allowed": ((3, 3), "bool")},
    ),
    Case(
        "bias-no-batch",
        score_mod=lambda e: lambda s, b, h, q, kv: s * e["per_head"][h, q, kv],
        tensors={"per_head": ((4, 37, 37), "float32")},
        mask_mod=lambda e: mods.causal,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_reference(case: Case) -> None:
    check(case)


def test_powers_inside_mods_have_torch_pow_values() -> None:
    """``**`` against NumPy's power on the float64 scores, independently of the reference's region."""
    heads, seq = 2, 6
    g = Graph("powers")
    q, k, v = (g.input(name, (1, seq, heads, 4)) for name in "qkv")

    def score_mod(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return s**2 * 0.25 + (s * 0.5) ** 3 - s**-2 * 0.01 + rlx.abs(s) ** 0.5 + rlx.abs(s) ** 1.5 + 2 ** (-(h + 1.0))

    g.output(o=g.attention(q, k, v, score_mod=score_mod, mask_mod=lambda b, h, i, j: (i - j) ** 2 <= 4))
    rng = np.random.default_rng(3)
    arrays = {name: rng.standard_normal((1, seq, heads, 4)).astype(np.float32) for name in "qkv"}
    scores = np.einsum("bqhd,bkhd->bhqk", arrays["q"].astype(np.float64), arrays["k"]) / 2.0
    h = np.arange(heads)[:, None, None]
    modded = scores**2 * 0.25 + (scores * 0.5) ** 3 - scores**-2.0 * 0.01 + np.abs(scores) ** 0.5
    modded += np.abs(scores) ** 1.5 + 2.0 ** (-(h + 1.0))
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    modded = np.where((i - j) ** 2 <= 4, modded, -np.inf)
    p = np.exp(modded - modded.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), arrays["v"])
    np.testing.assert_allclose(rlx.compile(g)(**arrays)["o"], want, rtol=1e-4, atol=1e-5)
    with pytest.raises(rlx.RlxTypeError, match="a symbolic exponent needs a positive number base"):
        g.attention(q, k, v, score_mod=lambda s, b, h, i, j: s**h)


@pytest.mark.parametrize("block_q", [1, 5, 64])
def test_strip_sizes(block_q: int) -> None:
    case = Case("strips", mask_mod=lambda e: mods.sliding_window(7), seq_q=100, seq_k=130, kv_heads=2)
    check(case, options=CodegenOptions(block_q=block_q))


def test_fully_masked_rows_give_zero_out_minus_inf_lse_and_zero_grads() -> None:
    case = Case(
        "empty-rows",
        mask_mod=lambda e: mods.key_lengths(e["lengths"]),
        tensors={"lengths": ((2,), "int64")},
        seq_q=9,
        seq_k=70,
        score_mod=_softcap,
    )
    g, _ = build(case)
    arrays = inputs(g, case)
    arrays["lengths"] = np.array([0, 5])
    got = rlx.compile(g)(**arrays)
    assert np.all(got["out"][0] == 0) and np.all(np.isneginf(got["lse"][0]))
    assert np.all(got["dq"][0] == 0) and np.all(got["dk"][0] == 0) and np.all(got["dv"][0] == 0)
    assert np.isfinite(got["lse"][1]).all()
    for name, array in got.items():
        assert not np.isnan(array).any(), name
    expected = rlx.reference.run(g, **arrays)
    np.testing.assert_allclose(got["dq"], expected["dq"], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("small_call_macs", [0, None])  # 0: every call works out its map; None: the default
def test_block_map_per_call_follows_the_documents(small_call_macs: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same executable with different document layouts: the per-call map must follow (or,
    for a call below ``SMALL_CALL_MACS``, as this one is by default, every tile is partial)."""
    import rlx.codegen.lower as lower

    if small_call_macs is not None:
        monkeypatch.setattr(lower, "SMALL_CALL_MACS", small_call_macs)
    case = Case(
        "doc-calls",
        mask_mod=lambda e: mods.document(e["doc"]),
        tensors={"doc": ((2, 200), "int64")},
        seq_q=200,
        seq_k=200,
    )
    g, _ = build(case)
    exe = rlx.compile(g)
    for seed in range(3):
        arrays = inputs(g, case, seed)
        if seed == 2:
            arrays["doc"] = np.random.default_rng(5).integers(0, 3, (2, 200))  # unsorted: many partial tiles
        expected = rlx.reference.run(g, **arrays)
        got = exe(**arrays)
        for name in ("out", "dq", "dk", "dv"):
            np.testing.assert_allclose(got[name], expected[name], rtol=2e-4, atol=2e-4, err_msg=f"seed {seed} {name}")


def test_a_small_calls_map_is_all_partial_and_a_large_calls_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-call maps from tensors: below ``SMALL_CALL_MACS`` every tile is PARTIAL (working out
    the map would cost more than the call); above, the tiles the documents hide are EMPTY."""
    import rlx.codegen.lower as lower
    from rlx.codegen.block_map import EMPTY, PARTIAL

    case = Case(
        "doc-map",
        mask_mod=lambda e: mods.document(e["doc"]),
        tensors={"doc": ((2, 512), "int64")},
        seq_q=512,
        seq_k=512,
    )
    g, _ = build(case)
    node = next(n for n in g.nodes if n.op.value == "flex_attention")
    spec = lower.flex_spec(node, lower.CodegenOptions())
    bound = {"doc": np.repeat(np.arange(4), 128)[None].repeat(2, 0)}  # four documents of 128 tokens
    macs = 2 * 4 * 512 * 512 * 32  # B H Sq Sk (D + Dv)
    for threshold, skips in ((macs + 1, False), (macs, True)):
        monkeypatch.setattr(lower, "SMALL_CALL_MACS", threshold)
        states = lower._per_call_states(spec, tuple(node.inputs[3:]), bound, spec.grid)
        assert states.shape == spec.grid.shape
        assert (states == EMPTY).mean() > 0.5 if skips else (states == PARTIAL).all()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_deterministic_across_thread_counts(threads: int) -> None:
    case = Case(
        "determinism",
        score_mod=lambda e: mods.chain(mods.alibi(e["slopes"]), mods.bias(e["bias"])),
        mask_mod=lambda e: mods.causal,
        tensors={"slopes": ((4,), "float32"), "bias": ((2, 4, 37, 37), "float32")},
        kv_heads=2,
    )
    baseline = check(case, config=RuntimeConfig(num_threads=1))
    got = check(case, config=RuntimeConfig(num_threads=threads))
    for name in baseline:
        np.testing.assert_array_equal(got[name], baseline[name], err_msg=name)


@pytest.mark.parametrize(
    "mask",
    [
        mods.causal,
        mods.sliding_window(64),
        mods.sliding_window(30, 50),
        mods.prefix_lm(100),
        mods.causal_lower_right(300, 512),
    ],
    ids=["causal", "window", "two-sided", "prefix", "lower-right"],
)
def test_block_states_are_exact_for_index_masks(mask: Callable[..., Any]) -> None:
    """Tile states equal the brute-force answer: EMPTY only if nothing is visible, FULL only if all is."""
    from rlx.codegen.block_map import EMPTY, FULL, PARTIAL, TileGrid, tile_states
    from rlx.mods import trace

    region = trace(Graph(), mask, "mask_mod", [])
    grid = TileGrid(1, 1, 300, 512, 48, 64, False, False)
    states = tile_states(region, grid, [])[0, 0]
    rows, cols = np.arange(300)[:, None], np.arange(512)[None, :]
    visible = np.broadcast_to(region.evaluate({"b": 0, "h": 0, "q_idx": rows, "kv_idx": cols}, []), (300, 512))
    for s in range(grid.strips):
        for t in range(grid.tiles):
            tile = visible[48 * s : 48 * s + 48, 64 * t : 64 * t + 64]
            want = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
            assert states[s, t] == want, (s, t)


def test_document_map_is_exact_for_packed_documents() -> None:
    from rlx.codegen.block_map import EMPTY, FULL, TileGrid, tile_states
    from rlx.mods import trace

    g = Graph()
    doc = g.input("doc", (1, 256), dtype="int64")
    captured: list[rlx.Value] = []
    region = trace(g, mods.document(doc), "mask_mod", captured)
    ids = np.repeat(np.arange(4), 64)[None]  # documents aligned with the 64-wide tiles
    states = tile_states(region, TileGrid(1, 1, 256, 256, 64, 64, True, False), [ids])[0, 0]
    np.testing.assert_array_equal(states, np.where(np.eye(4, dtype=bool), FULL, EMPTY))


def test_sliding_window_skips_most_work() -> None:
    """Block sparsity is real: a narrow window's compiled map leaves most tiles empty."""
    from rlx.codegen.lower import block_map_arrays

    g = Graph()
    q, k, v = (g.input(n, (1, 2048, 2, 16)) for n in "qkv")
    out = g.attention(q, k, v, mask_mod=mods.sliding_window(256))
    g.output(out=out)
    states = block_map_arrays(out.node, None)
    assert np.count_nonzero(states) / states.size < 0.25


def test_python_if_on_a_symbol_is_a_type_error_suggesting_where() -> None:
    g = Graph()
    q, k, v = (g.input(n, (1, 4, 1, 8)) for n in "qkv")

    def bad(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if q_idx > kv_idx:
            return score
        return score * 2

    before = str(g)
    with pytest.raises(rlx.RlxTypeError, match=r"rlx\.where"):
        g.attention(q, k, v, score_mod=bad)
    assert str(g) == before


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"mask_mod": lambda b, h, q, kv: q + kv}, rlx.RlxTypeError, "must return a bool"),
        ({"score_mod": lambda s, b, h, q, kv: q > kv}, rlx.RlxTypeError, "must return a number"),
        ({"score_mod": lambda s, b: s}, rlx.RlxTypeError, "5 arguments"),
        ({"mask_mod": lambda b, h, q, kv: q < "x"}, rlx.RlxTypeError, "str"),
        ({"scale": float("nan")}, rlx.RlxValueError, "scale"),
        ({"mask": rlx.MaskKind.CAUSAL, "mask_mod": mods.causal}, rlx.RlxValueError, "cannot be combined"),
    ],
)
def test_bad_mods_are_clear_errors(kwargs: dict[str, Any], error: type[Exception], fragment: str) -> None:
    g = Graph()
    q, k, v = (g.input(n, (1, 4, 1, 8)) for n in "qkv")
    with pytest.raises(error, match=fragment):
        g.attention(q, k, v, **kwargs)


def test_out_of_range_tensor_index_is_refused_at_build_time() -> None:
    g = Graph()
    q, k, v = (g.input(n, (1, 4, 2, 8)) for n in "qkv")
    table = g.input("table", (2, 4))
    with pytest.raises(rlx.RlxValueError, match="outside"):
        g.attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + table[h, qi + 1])


def test_region_prints_parses_and_roundtrips() -> None:
    g = Graph()
    q, k, v = (g.input(n, (1, 8, 2, 4)) for n in "qkv")
    doc = g.input("doc", (1, 8), dtype="int32")
    out, lse = g.attention(
        q,
        k,
        v,
        score_mod=mods.chain(mods.alibi(np.ones(2, np.float32)), mods.softcap(2.5)),
        mask_mod=mods.and_(mods.causal, mods.document(doc)),
        scale=0.25,
        return_lse=True,
    )
    g.output(out=out, lse=lse)
    text = str(g)
    assert "tanh(" in text and "read(%c1, %b, %q_idx)" in text and "scale = 0.25" in text
    again = rlx.ir.parse(text)
    assert str(again) == text
    arrays = {
        "q": np.ones((1, 8, 2, 4), np.float32),
        "k": np.ones((1, 8, 2, 4), np.float32),
        "v": np.arange(64, dtype=np.float32).reshape(1, 8, 2, 4),
        "doc": np.array([[0, 0, 0, 1, 1, 2, 2, 2]], np.int32),
    }
    np.testing.assert_allclose(rlx.compile(again)(**arrays)["out"], rlx.reference.run(g, **arrays)["out"], rtol=1e-5)


def test_backward_takes_out_and_lse_and_fuses() -> None:
    g = Graph()
    q, k, v, dy = (g.input(n, (1, 8, 2, 4)) for n in ("q", "k", "v", "dy"))
    out = g.attention(q, k, v, mask_mod=mods.causal)
    grads = rlx.grad(g, out, [q, k, v], dy)
    bwd = [n for n in g.nodes if n.op.value == "flex_attention_bwd"]
    assert len(bwd) == 3
    forward = out.node
    for node in bwd:
        assert node.inputs[3] == forward.outputs[0] and node.inputs[5] == forward.outputs[1]
    g.output(dq=grads[0], dk=grads[1], dv=grads[2])
    assert rlx.passes.fuse_attention_bwd(g)
    bwd = [n for n in g.nodes if n.op.value == "flex_attention_bwd"]
    assert len(bwd) == 1 and bwd[0].attrs.wrt == rlx.Wrt.ALL


def test_attention_merge_equals_attention_over_all_keys() -> None:
    rng = np.random.default_rng(3)
    b, sq, h, d = 2, 5, 3, 8
    parts_k = [6, 1, 9]
    total = sum(parts_k)
    q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
    k = rng.standard_normal((b, total, h, d)).astype(np.float32)
    v = rng.standard_normal((b, total, h, d)).astype(np.float32)

    def run(kk: np.ndarray, vv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g = Graph()
        qi, ki, vi = g.input("q", q.shape), g.input("k", kk.shape), g.input("v", vv.shape)
        out, lse = g.attention(qi, ki, vi, return_lse=True)
        g.output(out=out, lse=lse)
        result = rlx.compile(g)(q=q, k=np.ascontiguousarray(kk), v=np.ascontiguousarray(vv))
        return result["out"], result["lse"]

    whole = run(k, v)
    bounds = np.cumsum([0, *parts_k])
    parts = [run(k[:, s:e], v[:, s:e]) for s, e in itertools.pairwise(bounds)]
    out, lse = rlx.attention_merge(parts)
    np.testing.assert_allclose(out, whole[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-5, atol=1e-6)


def test_attention_merge_of_empty_rows() -> None:
    out = np.ones((1, 2, 1, 3), np.float32)
    lse = np.full((1, 1, 2), -np.inf, np.float32)
    merged, merged_lse = rlx.attention_merge([(out, lse), (out * 2, lse)])
    assert np.all(merged == 0) and np.all(np.isneginf(merged_lse))
    with pytest.raises(rlx.RlxValueError):
        rlx.attention_merge([(out, np.zeros((1, 1, 3)))])


def test_nan_in_the_inputs_propagates_as_in_the_reference() -> None:
    case = Case("nan", score_mod=_softcap, mask_mod=lambda e: mods.causal, seq_q=8, seq_k=8, heads=2, kv_heads=2)
    g, _ = build(case)
    arrays = inputs(g, case)
    arrays["q"][0, 3, 1, 2] = np.nan
    expected = rlx.reference.run(g, **arrays)
    got = rlx.compile(g)(**arrays)
    for name, want in expected.items():
        np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(want), err_msg=name)
        finite = ~np.isnan(want)
        np.testing.assert_allclose(got[name][finite], want[finite], rtol=2e-4, atol=2e-4, err_msg=name)
    assert np.isnan(got["out"]).any()  # the row that read the NaN


MANY_TILES = [
    Case("window-many-tiles", mask_mod=lambda e: mods.sliding_window(40), seq_q=300, seq_k=300, batch=1),
    Case("two-sided-many-tiles", mask_mod=lambda e: mods.sliding_window(30, 50), seq_q=260, seq_k=260, batch=1),
    Case("causal-gqa-many-tiles", mask_mod=lambda e: mods.causal, seq_q=270, seq_k=270, heads=4, kv_heads=2),
    Case("causal-sq-lt-sk", mask_mod=lambda e: mods.causal, seq_q=90, seq_k=300, batch=1),
    Case(
        "key-lengths-many-tiles",
        mask_mod=lambda e: mods.key_lengths(e["lengths"]),
        tensors={"lengths": ((2,), "int64")},
        seq_q=200,
        seq_k=300,
    ),
    Case(
        "document-many-tiles",
        mask_mod=lambda e: mods.document(e["doc"]),
        tensors={"doc": ((2, 280), "int64")},
        seq_q=280,
        seq_k=280,
    ),
    Case(
        "window-bhsd-dv",
        mask_mod=lambda e: mods.sliding_window(64),
        seq_q=330,
        seq_k=330,
        layout=Layout.BHSD,
        kv_heads=1,
        value_dim=24,
        batch=1,
    ),
]


@pytest.mark.parametrize("case", MANY_TILES, ids=lambda c: c.name)
def test_key_gradients_over_many_tiles(case: Case) -> None:
    """dK and dV over many key tiles and strips: the first product to reach a tile stores it, a
    run over tiles both reached and not zeroes the new ones, tiles no strip reaches are zeroed at
    the end (outputs start as NaN here, so a row left unwritten fails)."""
    check(case)


_GLOBAL_TABLE = np.linspace(-1.0, 1.0, 11).astype(np.float32)


def _table_bias(table: np.ndarray) -> Callable[..., Any]:
    return lambda s, b, h, i, j: s + table[i] * 0.5  # the array is a closure cell


def _doc_mask(doc: np.ndarray, b: Any, h: Any, i: Any, j: Any) -> Any:
    return doc[b, i] == doc[b, j]


def _read_global(s: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
    return s - _GLOBAL_TABLE[j]


@pytest.mark.parametrize("capture", ["closure", "global", "partial"])
def test_numpy_arrays_a_mod_captures_become_constants(capture: str) -> None:
    """A numpy array read by a user's mod, however Python hands it over (a closure cell, a module
    global, an argument bound by ``functools.partial``), is a constant of the graph; checked
    against the attention written in numpy."""
    import functools

    seq, heads = 11, 2
    rng = np.random.default_rng(5)
    table = rng.standard_normal(seq).astype(np.float32)
    doc = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]], np.int64)
    score_mod: Callable[..., Any] | None
    mask_mod: Callable[..., Any] | None = None
    if capture == "closure":
        score_mod, bias = _table_bias(table), 0.5 * table.astype(np.float64)[:, None]
    elif capture == "global":
        score_mod, bias = _read_global, -_GLOBAL_TABLE.astype(np.float64)[None, :]
    else:
        score_mod, bias = None, np.zeros((1, 1))
        mask_mod = functools.partial(_doc_mask, doc)
    g = Graph("captures")
    q, k, v = (g.input(name, (1, seq, heads, 4)) for name in "qkv")
    g.output(o=g.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod))
    arrays = {name: rng.standard_normal((1, seq, heads, 4)).astype(np.float32) for name in "qkv"}
    scores = np.einsum("bqhd,bkhd->bhqk", arrays["q"].astype(np.float64), arrays["k"]) / 2.0 + bias
    if mask_mod is not None:
        scores = np.where(doc[0][:, None] == doc[0][None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), arrays["v"])
    np.testing.assert_allclose(rlx.compile(g)(**arrays)["o"], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(rlx.reference.run(g, **arrays)["o"], want, rtol=1e-6, atol=1e-7)
