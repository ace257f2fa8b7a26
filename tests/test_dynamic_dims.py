"""Symbolic dimensions (SPEC 6): one compilation runs every size, checked per call."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import rlx
from rlx.codegen.executable import compile_count
from rlx.ir.parser import parse

B, H, D = 2, 4, 16
MASKS = [
    rlx.MaskKind.NONE,
    rlx.MaskKind.CAUSAL,
    rlx.MaskKind.sliding_window(3),
    rlx.MaskKind.CUSTOM,
    rlx.MaskKind.BIAS,
]


def _attention_graph(
    mask: rlx.MaskKind, layout: rlx.Layout, kv_heads: int = H, dv: int = D, batch: int | str = B
) -> rlx.Graph:
    g = rlx.Graph()
    q = g.input("q", layout.join(batch, "Sq", H, D))
    k = g.input("k", layout.join(batch, "Sk", kv_heads, D))
    v = g.input("v", layout.join(batch, "Sk", kv_heads, dv))
    extra = {}
    if mask == rlx.MaskKind.CUSTOM:
        extra["mask_input"] = g.input("m", (batch, "Sk"))
    if mask == rlx.MaskKind.BIAS:
        extra["mask_input"] = g.input("m", (batch, H, "Sq", "Sk"))
    out = g.attention(q, k, v, mask=mask, layout=layout, **extra)
    dy = g.input("dy", out.shape)
    dq, dk, dv_ = rlx.grad(g, out, [q, k, v], dy)
    g.output(o=out, dq=dq, dk=dk, dv=dv_)
    return g


def _arrays(
    rng: np.random.Generator,
    mask: rlx.MaskKind,
    layout: rlx.Layout,
    sq: int,
    sk: int,
    kv_heads: int = H,
    dv: int = D,
    batch: int = B,
) -> dict[str, np.ndarray]:
    def normal(shape: tuple[int, ...]) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32)

    arrays = {
        "q": normal(layout.join(batch, sq, H, D)),
        "k": normal(layout.join(batch, sk, kv_heads, D)),
        "v": normal(layout.join(batch, sk, kv_heads, dv)),
        "dy": normal(layout.join(batch, sq, H, dv)),
    }
    if mask == rlx.MaskKind.CUSTOM:
        arrays["m"] = (rng.random((batch, sk)) > 0.3).astype(np.float32)
    if mask == rlx.MaskKind.BIAS:
        arrays["m"] = normal((batch, H, sq, sk))
    return arrays


def _check_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        scale = float(np.abs(want[name]).max()) + 1e-6
        assert float(np.abs(got[name] - want[name]).max()) <= 2e-5 * scale + 1e-6, name


@pytest.mark.parametrize(  # BSHD is a slow case: the symbolic lengths are the same code in both layouts
    "layout", [pytest.param(rlx.Layout.BSHD, marks=pytest.mark.slow), rlx.Layout.BHSD], ids=str
)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_attention_forward_and_backward_compile_once_for_every_length(mask: rlx.MaskKind, layout: rlx.Layout) -> None:
    g = _attention_graph(mask, layout)
    exe = rlx.compile(g)
    before = compile_count()
    rng = np.random.default_rng(0)
    for sq, sk in ((1, 1), (1, 9), (3, 5), (5, 3), (130, 70), (200, 513)):
        arrays = _arrays(rng, mask, layout, sq, sk)
        _check_close(exe(**arrays), rlx.reference.run(g, **arrays))
    assert compile_count() == before
    assert exe.compile_count == 1


def test_gqa_and_value_dim_with_one_symbol_for_both_lengths() -> None:
    g = rlx.Graph()
    q = g.input("q", (B, "S", 8, D))
    k = g.input("k", (B, "S", 2, D))
    v = g.input("v", (B, "S", 2, 24))
    out = g.attention(q, k, v, mask=rlx.MaskKind.CAUSAL)
    dy = g.input("dy", out.shape)
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(o=out, dq=dq, dk=dk, dv=dv)
    exe = rlx.compile(g)
    rng = np.random.default_rng(1)
    for s in (1, 17, 150):
        arrays = {
            "q": rng.standard_normal((B, s, 8, D), dtype=np.float32),
            "k": rng.standard_normal((B, s, 2, D), dtype=np.float32),
            "v": rng.standard_normal((B, s, 2, 24), dtype=np.float32),
            "dy": rng.standard_normal((B, s, 8, 24), dtype=np.float32),
        }
        _check_close(exe(**arrays), rlx.reference.run(g, **arrays))


def test_results_do_not_depend_on_the_thread_count() -> None:
    g = _attention_graph(rlx.MaskKind.CAUSAL, rlx.Layout.BSHD)
    arrays = _arrays(np.random.default_rng(2), rlx.MaskKind.CAUSAL, rlx.Layout.BSHD, 77, 300)
    one = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=1))(**arrays)
    three = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=3))(**arrays)
    for name in one:
        np.testing.assert_array_equal(one[name], three[name])


def test_inputs_that_disagree_on_a_symbol_name_both() -> None:
    g = _attention_graph(rlx.MaskKind.NONE, rlx.Layout.BSHD)
    exe = rlx.compile(g)
    arrays = _arrays(np.random.default_rng(3), rlx.MaskKind.NONE, rlx.Layout.BSHD, 4, 6)
    arrays["v"] = arrays["v"][:, :5]
    for run in (exe, lambda **a: rlx.reference.run(g, **a)):
        with pytest.raises(rlx.RlxValueError, match=r"'k' and 'v'.*'Sk'.*Sk=6.*Sk=5"):
            run(**arrays)


def test_a_static_dimension_still_has_to_match() -> None:
    g = _attention_graph(rlx.MaskKind.NONE, rlx.Layout.BSHD)
    arrays = _arrays(np.random.default_rng(4), rlx.MaskKind.NONE, rlx.Layout.BSHD, 4, 6)
    arrays["q"] = np.zeros((B, 4, H, D + 1), np.float32)
    with pytest.raises(rlx.RlxValueError, match="input 'q'"):
        rlx.compile(g)(**arrays)


def test_symbolic_types_print_and_parse() -> None:
    g = rlx.Graph()
    x = g.input("x", (2, "S", 8))
    y = g.reshape(x, (2, "S", 2, 4))
    z = g.reshape(y, (2, -1, 8))
    g.output(y=y, z=z, w=g.broadcast_to(g.constant(1.0), ("S", 1)))
    text = str(g)
    assert "f32[2,S,8]" in text and "shape = (2, S, 2, 4)" in text
    assert z.shape == (2, "S", 8)
    assert str(parse(text)) == text


def test_shape_rules_carry_symbols() -> None:
    g = rlx.Graph()
    x = g.input("x", (2, "S", 8))
    w = g.input("w", (8, 5))
    assert (x @ w).shape == (2, "S", 5)
    assert (x * 2.0 + x).shape == (2, "S", 8)
    assert g.sum(x, axis=1).shape == (2, 8)
    assert g.softmax(x, axis=1).shape == (2, "S", 8)
    assert g.transpose(x, (1, 0, 2)).shape == ("S", 2, 8)
    assert g.concat([x, x], axis=2).shape == (2, "S", 16)
    assert g.concat([x, x], axis=1).shape == (2, "2*S", 8)  # lengths add up: "S+S"
    assert g.concat([x, g.input("t", (2, 3, 8))], axis=1).shape == (2, "S+3", 8)
    assert g.matmul(x, g.transpose(x, (0, 2, 1))).shape == (2, "S", "S")


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda g, x: g.split(x, 2, axis=1), "size S, which 2 parts cannot share equally"),
        (lambda g, x: g.split(x, ["S", 1], axis=1), "add up to S"),
        (lambda g, x: g.reshape(x, (3, -1)), "cannot reshape"),
        (lambda g, x: g.input("z", (2, "2*T")), "no input declared before it"),
        (lambda g, x: g.reshape(x, (2, "S S", 8)), "identifier"),  # two names are not a product
        (lambda g, x: g.reshape(x, (2, "S-1", 8)), "cannot reshape"),
        (lambda g, x: g.reshape(x, (16, "S")), None),
        (lambda g, x: g.reshape(x, (2, "T", 8)), "cannot reshape"),
        (lambda g, x: x + g.input("y", (2, 3, 8)), "do not broadcast"),
        (lambda g, x: g.input("z", (2, "S-T")), "no input declared before it"),
        (lambda g, x: g.input("z", (2, "S--1")), "identifier"),
    ],
)
def test_what_symbols_cannot_do_is_a_clear_error(build, fragment) -> None:  # type: ignore[no-untyped-def]
    g = rlx.Graph()
    x = g.input("x", (2, "S", 8))
    if fragment is None:  # a legal reshape that keeps the symbol one dimension
        assert build(g, x).shape == (16, "S")
        return
    with pytest.raises(rlx.RlxError, match=fragment):
        build(g, x)


def test_reshape_merges_and_splits_symbolic_axes() -> None:
    """``logits.reshape(-1, V)`` as torch users write it: the merged axis is the product ``2*S``,
    which matmul, softmax, cross_entropy and the gradients carry, and the printer and parser
    write and read. One compilation serves every size."""
    g = rlx.Graph("flatten")
    x = g.input("x", (2, "S", 8))
    w = g.input("w", (8, 5))
    targets = g.input("t", (2, "S"), dtype="int64")
    flat = g.reshape(x, (-1, 8))
    assert flat.shape == ("2*S", 8)
    assert g.reshape(x, (-1,)).shape == ("16*S",)
    assert g.reshape(flat, (2, "S", 8)).shape == (2, "S", 8)
    assert g.reshape(g.matmul(g.transpose(x, (1, 0, 2)), g.transpose(x, (1, 2, 0))), (-1,)).shape == ("4*S",)
    logits = flat @ w
    loss = g.cross_entropy(logits, g.reshape(targets, (-1,)))
    unflat = g.reshape(g.softmax(logits), (2, "S", 5))
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(loss=loss, dx=dx, dw=dw, unflat=unflat)
    assert "f32[2*S,8]" in str(g) and "shape = (2*S, 8)" in str(g)
    assert str(rlx.ir.parse(str(g))) == str(g)
    exe = rlx.compile(g)
    for s in (1, 6, 40):
        rng = np.random.default_rng(s)
        arrays = {
            "x": rng.standard_normal((2, s, 8)).astype(np.float32),
            "w": rng.standard_normal((8, 5)).astype(np.float32),
            "t": rng.integers(0, 5, (2, s)),
        }
        got = exe(**arrays)
        logits64 = arrays["x"].reshape(-1, 8).astype(np.float64) @ arrays["w"]
        p = np.exp(logits64 - logits64.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        nll = -np.log(p[np.arange(2 * s), arrays["t"].reshape(-1)]).mean()
        np.testing.assert_allclose(got["loss"], nll, rtol=1e-5)
        np.testing.assert_allclose(got["unflat"], p.reshape(2, s, 5), rtol=1e-5, atol=1e-6)
        onehot = np.eye(5)[arrays["t"].reshape(-1)]
        dlogits = (p - onehot) / (2 * s)
        np.testing.assert_allclose(got["dw"], arrays["x"].reshape(-1, 8).T @ dlogits, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got["dx"], (dlogits @ arrays["w"].T).reshape(2, s, 8), rtol=1e-4, atol=1e-6)
    assert exe.compile_count == 1


def test_mean_over_a_symbolic_axis_divides_by_the_call_size() -> None:
    g = rlx.Graph()
    x = g.input("x", (2, "S", 8))
    m = g.mean(x, axis=1)
    (dx,) = rlx.grad(g, g.sum(m), [x])
    g.output(m=m, dx=dx)
    for s in (1, 5):
        data = np.random.default_rng(s).standard_normal((2, s, 8)).astype(np.float32)
        out = rlx.reference.run(g, x=data)
        np.testing.assert_allclose(out["m"], data.mean(axis=1), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(out["dx"], np.full((2, s, 8), 1.0 / s), rtol=1e-6)


def _compile_and_compare(g: rlx.Graph, make, sizes, threads=None) -> rlx.Executable:  # type: ignore[no-untyped-def]
    """Compile once, then every size against the reference, with no compilation in between."""
    config = rlx.RuntimeConfig(num_threads=threads) if threads else None
    exe = rlx.compile(g, config=config)
    before = compile_count()
    for size in sizes:
        arrays = make(size)
        _check_close(exe(**arrays), rlx.reference.run(g, **arrays))
    assert compile_count() == before
    return exe


def test_fused_loop_nests_take_their_sizes_per_call() -> None:
    rng = np.random.default_rng(6)
    g = rlx.Graph()
    x = g.input("x", (2, "S", 8))
    w = g.input("w", (8,))
    g.output(
        soft=g.softmax(x * 2.0 + w, axis=1),  # a reduction over the symbolic axis
        mean=g.mean(x, axis=1),
        rows=g.sum(x, axis=2),
        norm=g.layer_norm(x, w, w),
        back=g.transpose(g.exp(x), (1, 0, 2)),
    )

    def make(s: int) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal((2, s, 8), dtype=np.float32), "w": rng.standard_normal(8, dtype=np.float32)}

    _compile_and_compare(g, make, (1, 3, 17, 300))


def test_matmuls_take_their_sizes_per_call() -> None:
    rng = np.random.default_rng(7)
    g = rlx.Graph()
    x = g.input("x", (2, "S", 8))
    w = g.input("w", (8, 5))
    g.output(h=g.gelu(x @ w), gram=g.matmul(x, g.transpose(x, (0, 2, 1))), wide=g.transpose(x, (0, 2, 1)) @ x)

    def make(s: int) -> dict[str, np.ndarray]:
        return {
            "x": rng.standard_normal((2, s, 8), dtype=np.float32),
            "w": rng.standard_normal((8, 5), dtype=np.float32),
        }

    _compile_and_compare(g, make, (1, 2, 70, 301))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_transformer_block_trains_on_any_sequence_length(threads: int) -> None:
    from rlx.models import BLOCK_WEIGHTS, block_training_graph, init_params

    g = block_training_graph(2, "S", 32, 4)
    params = init_params(g, [g.inputs[name] for name in BLOCK_WEIGHTS])
    rng = np.random.default_rng(8)

    def make(s: int) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal((2, s, 32), dtype=np.float32), **params}

    _compile_and_compare(g, make, (1, 5, 64, 129), threads)


def test_a_transformer_block_trains_on_any_batch_and_length() -> None:
    """Batch and length both symbolic: projections, fused norms, causal attention and the MLP,
    forward and every gradient, on one compilation."""
    from rlx.models import BLOCK_WEIGHTS, block_training_graph, init_params

    g = block_training_graph("B", "S", 32, 4)
    params = init_params(g, [g.inputs[name] for name in BLOCK_WEIGHTS])
    rng = np.random.default_rng(12)

    def make(size: tuple[int, int]) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal((*size, 32), dtype=np.float32), **params}

    _compile_and_compare(g, make, ((1, 1), (3, 5), (2, 64), (5, 17)))


def test_embedding_and_cross_entropy_over_a_symbolic_length() -> None:
    rng = np.random.default_rng(9)
    g = rlx.Graph()
    tokens = g.input("tokens", (2, "S"), "int32")
    targets = g.input("targets", (2, "S"), "int32")
    table = g.input("embed", (11, 16))
    head = g.input("head", (16, 11))
    loss = g.cross_entropy(g.embedding(table, tokens) @ head, targets)
    d_table, d_head = rlx.grad(g, loss, [table, head])
    g.output(loss=loss, d_table=d_table, d_head=d_head)

    def make(s: int) -> dict[str, np.ndarray]:
        return {
            "tokens": rng.integers(0, 11, (2, s)).astype(np.int32),
            "targets": rng.integers(0, 11, (2, s)).astype(np.int32),
            "embed": rng.standard_normal((11, 16), dtype=np.float32),
            "head": rng.standard_normal((16, 11), dtype=np.float32),
        }

    exe = _compile_and_compare(g, make, (1, 4, 100))
    bad = make(3)
    bad["tokens"][0, 1] = 11
    with pytest.raises(rlx.RlxValueError, match="tokens"):
        exe(**bad)


def test_general_results_do_not_depend_on_the_thread_count() -> None:
    from rlx.models import BLOCK_WEIGHTS, block_training_graph, init_params

    g = block_training_graph(2, "S", 32, 4)
    arrays = init_params(g, [g.inputs[name] for name in BLOCK_WEIGHTS])
    arrays["x"] = np.random.default_rng(10).standard_normal((2, 77, 32), dtype=np.float32)
    one = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=1))(**arrays)
    three = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=3))(**arrays)
    for name in one:
        np.testing.assert_array_equal(one[name], three[name])


FLEX_MODS = [
    (None, None),
    (None, rlx.mods.causal),
    (None, rlx.mods.sliding_window(20, 0)),
    (rlx.mods.softcap(30.0), rlx.mods.causal),
    (lambda s, b, h, q, k: s - 0.1 * rlx.abs(q - k), None),  # integer index arithmetic in a mod
]


@pytest.mark.parametrize(("score_mod", "mask_mod"), FLEX_MODS)
def test_programmable_attention_compiles_once_for_every_length(score_mod, mask_mod) -> None:  # type: ignore[no-untyped-def]
    g = rlx.Graph()
    q = g.input("q", (2, "Sq", 4, 16))
    k = g.input("k", (2, "Sk", 2, 16))
    v = g.input("v", (2, "Sk", 2, 24))
    out, lse = g.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    dq, dk, dv = rlx.grad(g, out, [q, k, v], g.input("dy", out.shape))
    g.output(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    exe = rlx.compile(g)
    before = compile_count()
    rng = np.random.default_rng(11)
    for sq, sk in ((1, 1), (5, 3), (64, 64), (100, 130), (300, 257)):
        arrays = {
            "q": rng.standard_normal((2, sq, 4, 16), dtype=np.float32),
            "k": rng.standard_normal((2, sk, 2, 16), dtype=np.float32),
            "v": rng.standard_normal((2, sk, 2, 24), dtype=np.float32),
            "dy": rng.standard_normal((2, sq, 4, 24), dtype=np.float32),
        }
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name in want:
            finite = np.isfinite(want[name])  # lse is -inf on rows that see no key
            np.testing.assert_array_equal(np.isfinite(got[name]), finite)
            scale = float(np.abs(want[name][finite]).max(initial=0.0)) + 1.0
            assert float(np.abs(got[name][finite] - want[name][finite]).max(initial=0.0)) <= 2e-5 * scale, name
    assert compile_count() == before


@pytest.mark.parametrize("layout", [rlx.Layout.BSHD, rlx.Layout.BHSD], ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_attention_with_a_symbolic_batch_compiles_once(mask: rlx.MaskKind, layout: rlx.Layout) -> None:
    """The batch may be symbolic too (the last, smaller batch of an epoch): the kernels count
    their (batch, head) items per call. GQA and a value head dim of its own included."""
    g = _attention_graph(mask, layout, kv_heads=2, dv=24, batch="B")
    exe = rlx.compile(g)
    before = compile_count()
    rng = np.random.default_rng(11)
    for batch, sq, sk in ((1, 5, 5), (3, 17, 9), (2, 1, 40), (5, 33, 33)):
        arrays = _arrays(rng, mask, layout, sq, sk, kv_heads=2, dv=24, batch=batch)
        got = exe(**arrays)
        assert got["o"].shape == layout.join(batch, sq, H, 24)
        _check_close(got, rlx.reference.run(g, **arrays))
        _check_close(exe.run(arrays, threads=1), got)  # the same items, whatever the team
    assert compile_count() == before


def test_attention_heads_and_head_dims_must_be_static() -> None:
    g = rlx.Graph()
    for shape in (("B", 4, "H", 16), (2, 4, 8, "D")):
        x = g.input(f"x{len(g.inputs)}", shape)
        with pytest.raises(rlx.RlxValueError, match="only the batch and the sequence lengths"):
            g.attention(x, x, x)
        with pytest.raises(rlx.RlxValueError, match="only the batch and the sequence lengths"):
            g.attention(x, x, x, mask_mod=rlx.mods.causal)


def _flex_batch_mods(g: rlx.Graph, name: str, seq: int | str) -> dict[str, object]:
    if name == "document":  # a mask reading a tensor by b: its tile map is made per call
        return {"mask_mod": rlx.mods.document(g.input("doc", ("B", seq), dtype="int32"))}
    if name == "alibi":  # slopes[h] read without b: its gradient sums one partial per batch
        return {"score_mod": rlx.mods.alibi(g.input("slopes", (H,))), "mask_mod": rlx.mods.causal}
    if name == "key_lengths":
        return {"mask_mod": rlx.mods.key_lengths(g.input("lens", ("B",), dtype="int32"))}
    return {"mask_mod": rlx.mods.sliding_window(4)}  # indices alone


@pytest.mark.parametrize("seq", ["S", 33], ids=["symbolic-length", "static-length"])
@pytest.mark.parametrize("mods", ["document", "alibi", "key_lengths", "window"])
def test_programmable_attention_with_a_symbolic_batch_compiles_once(mods: str, seq: int | str) -> None:
    """Forward, lse and every gradient (the slopes' included) for batches of any size."""
    g = rlx.Graph()
    q = g.input("q", ("B", seq, H, D))
    k = g.input("k", ("B", seq, 2, D))
    v = g.input("v", ("B", seq, 2, 24))
    out, lse = g.attention(q, k, v, return_lse=True, **_flex_batch_mods(g, mods, seq))  # type: ignore[arg-type]
    xs = [q, k, v] + ([g.inputs["slopes"]] if "slopes" in g.inputs else [])
    grads = rlx.grad(g, g.sum(out * out) + g.sum(lse), xs)
    g.output(out=out, lse=lse, **{f"d{i}": d for i, d in enumerate(grads)})
    exe = rlx.compile(g)
    before = compile_count()
    rng = np.random.default_rng(13)
    for batch, length in ((1, 5), (3, 70), (2, 1), (4, 33)):
        length = length if seq == "S" else 33
        arrays = {
            "q": rng.standard_normal((batch, length, H, D), dtype=np.float32),
            "k": rng.standard_normal((batch, length, 2, D), dtype=np.float32),
            "v": rng.standard_normal((batch, length, 2, 24), dtype=np.float32),
        }
        extra = {
            "doc": np.sort(rng.integers(0, 3, (batch, length)), axis=1).astype(np.int32),
            "slopes": rng.random(H, dtype=np.float32),
            "lens": rng.integers(1, length + 1, batch).astype(np.int32),
        }
        arrays |= {name: array for name, array in extra.items() if name in g.inputs}
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name in want:
            finite = np.isfinite(want[name])  # lse is -inf on rows that see no key
            np.testing.assert_array_equal(np.isfinite(got[name]), finite)
            scale = float(np.abs(want[name][finite]).max(initial=0.0)) + 1.0
            assert float(np.abs(got[name][finite] - want[name][finite]).max(initial=0.0)) <= 2e-5 * scale, name
    assert compile_count() == before


def test_a_static_tensor_indexed_by_a_symbolic_batch_is_checked_per_call() -> None:
    g = rlx.Graph()
    q = g.input("q", ("B", 4, 16, 8))
    doc = g.input("doc", (2, 16), dtype="int32")
    g.output(o=g.attention(q, q, q, layout=rlx.Layout.BHSD, mask_mod=rlx.mods.document(doc)))
    exe = rlx.compile(g)
    docs = np.zeros((2, 16), np.int32)
    assert exe(q=np.ones((2, 4, 16, 8), np.float32), doc=docs)["o"].shape == (2, 4, 16, 8)
    with pytest.raises(rlx.RlxValueError, match="outside"):
        exe(q=np.ones((3, 4, 16, 8), np.float32), doc=docs)  # b = 2 would read past doc


def test_symbolic_executable_pickles() -> None:
    g = _attention_graph(rlx.MaskKind.CAUSAL, rlx.Layout.BSHD)
    exe = rlx.compile(g)
    loaded = pickle.loads(pickle.dumps(exe))
    arrays = _arrays(np.random.default_rng(5), rlx.MaskKind.CAUSAL, rlx.Layout.BSHD, 9, 33)
    want = exe(**arrays)
    got = loaded(**arrays)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_mods_reading_tensors_of_symbolic_shape() -> None:
    g = rlx.Graph()
    q, k, v = (g.input(name, (2, "S", 4, 16)) for name in "qkv")
    bias = g.input("bias", (2, 4, "S", "S"))
    doc = g.input("doc", (2, "S"), "int32")
    out, lse = g.attention(
        q,
        k,
        v,
        score_mod=lambda s, b, h, qi, ki: s + bias[b, h, qi, ki],
        mask_mod=rlx.mods.and_(rlx.mods.causal, lambda b, h, qi, ki: doc[b, qi] == doc[b, ki]),
        return_lse=True,
    )
    dq, dk, dv = rlx.grad(g, out, [q, k, v], g.input("dy", out.shape))
    g.output(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    rng = np.random.default_rng(12)

    def make(s: int) -> dict[str, np.ndarray]:
        arrays = {name: rng.standard_normal((2, s, 4, 16), dtype=np.float32) for name in ("q", "k", "v", "dy")}
        arrays["bias"] = rng.standard_normal((2, 4, s, s), dtype=np.float32)
        arrays["doc"] = np.sort(rng.integers(0, 4, (2, s)), axis=1).astype(np.int32)
        return arrays

    exe = rlx.compile(g)
    before = compile_count()
    for s in (1, 9, 100, 200):
        arrays = make(s)
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name in want:
            finite = np.isfinite(want[name])
            np.testing.assert_array_equal(np.isfinite(got[name]), finite)
            scale = float(np.abs(want[name][finite]).max(initial=0.0)) + 1.0
            assert float(np.abs(got[name][finite] - want[name][finite]).max(initial=0.0)) <= 2e-5 * scale, name
    assert compile_count() == before


def test_an_index_out_of_a_static_tensor_is_refused_per_call() -> None:
    g = rlx.Graph()
    x = g.input("x", (1, "S", 2, 8))
    bias = g.input("bias", (2, 64, 64))
    out, _ = g.attention(x, x, x, score_mod=lambda s, b, h, qi, ki: s + bias[h, qi, ki], return_lse=True)
    g.output(out=out)
    exe = rlx.compile(g)
    ok = {"x": np.zeros((1, 64, 2, 8), np.float32), "bias": np.zeros((2, 64, 64), np.float32)}
    exe(**ok)
    bad = {"x": np.zeros((1, 65, 2, 8), np.float32), "bias": ok["bias"]}
    for run in (exe, lambda **a: rlx.reference.run(g, **a)):
        with pytest.raises(rlx.RlxValueError, match="outside"):
            run(**bad)


def test_a_refused_size_stays_refused_between_good_calls_of_other_sizes() -> None:
    """An executable keeps per-size call data; a size that failed its checks must never be kept."""
    g = rlx.Graph()
    x = g.input("x", (1, "S", 2, 8))
    bias = g.input("bias", (2, 64, 64))
    out, _ = g.attention(x, x, x, score_mod=lambda s, b, h, qi, ki: s + bias[h, qi, ki], return_lse=True)
    g.output(out=out)
    exe = rlx.compile(g)
    rng = np.random.default_rng(0)
    table = rng.standard_normal((2, 64, 64)).astype(np.float32)
    for _ in range(2):
        for seq in (64, 65, 7, 65, 64):
            arrays = {"x": rng.standard_normal((1, seq, 2, 8)).astype(np.float32), "bias": table}
            if seq > 64:
                with pytest.raises(rlx.RlxValueError, match="outside"):
                    exe(**arrays)
                continue
            want = rlx.reference.run(g, **arrays)["out"]
            np.testing.assert_allclose(exe(**arrays)["out"], want, rtol=1e-4, atol=1e-5)


def test_a_loss_of_lse_alone_differentiates_at_symbolic_sizes() -> None:
    """Only lse reaches the loss: out's cotangent is a zero of out's symbolic shape."""
    g = rlx.Graph()
    q = g.input("q", ("B", "S", 2, 8))
    k = g.input("k", ("B", "S", 2, 8))
    _, lse = g.attention(q, k, k, mask_mod=rlx.mods.causal, return_lse=True)
    dq, dk = rlx.grad(g, g.sum(lse * lse), [q, k])
    g.output(dq=dq, dk=dk)
    exe = rlx.compile(g)
    rng = np.random.default_rng(14)
    for batch, length in ((2, 9), (1, 4)):
        arrays = {name: rng.standard_normal((batch, length, 2, 8), dtype=np.float32) for name in ("q", "k")}
        _check_close(exe(**arrays), rlx.reference.run(g, **arrays))
