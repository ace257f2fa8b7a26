"""Calls in which a symbolic dimension is 0: an empty batch, a KV cache with no keys yet.

What JAX gives (NumPy and torch agree where they compute it), checked against expectations
written out here (not the reference interpreter, which such calls run on): empty arrays stay
empty, a sum of nothing is 0, a mean NaN, a maximum -inf (NumPy and torch refuse), a product
over an empty inner dimension 0, attention over no keys 0 with LSE -inf and zero gradients; the
weights' gradients over an empty batch are 0. The same executable then serves non-empty calls
without compiling.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, MaskKind
from rlx.codegen.executable import compile_count

RNG = np.random.default_rng(7)


def normal(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_reductions_and_products_over_an_empty_batch() -> None:
    g = Graph()
    x, w = g.input("x", ("B", 4)), g.input("w", (4, 3))
    g.output(
        total=g.sum(x, axis=0),
        average=g.mean(x, axis=0, keepdims=True),
        peak=g.max(x, axis=0),
        projected=g.gelu(x @ w),
        weights=g.softmax(x, axis=0),
        rows=g.log_softmax(x, axis=-1),
        everything=g.sum(x @ w),
        gram=g.transpose(x, (1, 0)) @ x,  # the empty dimension is the product's inner one
    )
    exe = rlx.compile(g)
    got = exe(x=np.zeros((0, 4), np.float32), w=normal(4, 3))
    np.testing.assert_array_equal(got["total"], np.zeros(4, np.float32))
    assert got["average"].shape == (1, 4) and np.isnan(got["average"]).all()
    np.testing.assert_array_equal(got["peak"], np.full(4, -np.inf, np.float32))
    assert got["projected"].shape == (0, 3) and got["weights"].shape == (0, 4) and got["rows"].shape == (0, 4)
    assert got["everything"].shape == () and got["everything"] == 0.0
    np.testing.assert_array_equal(got["gram"], np.zeros((4, 4), np.float32))
    assert all(array.dtype == np.float32 for array in got.values())


def test_an_executable_serves_empty_and_non_empty_calls_alike() -> None:
    g = Graph()
    x, w = g.input("x", ("B", 4)), g.input("w", (4, 3))
    g.output(y=g.sum(x @ w, axis=0))
    exe = rlx.compile(g)
    before = compile_count()
    w_value = normal(4, 3)
    for rows in (3, 0, 5, 0, 1):
        x_value = normal(rows, 4)
        got = exe(x=x_value, w=w_value)["y"]
        want = (x_value.astype(np.float64) @ w_value).sum(axis=0)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert compile_count() == before


def test_index_ops_over_no_tokens() -> None:
    g = Graph()
    table, ids = g.input("table", (7, 5)), g.input("ids", ("B", "S"), dtype="int64")
    logits, targets = g.input("logits", ("N", 6)), g.input("targets", ("N",), dtype="int32")
    g.output(embedded=g.embedding(table, ids), loss=g.cross_entropy(logits, targets))
    exe = rlx.compile(g)
    got = exe(
        table=normal(7, 5),
        ids=np.zeros((2, 0), np.int64),
        logits=np.zeros((0, 6), np.float32),
        targets=np.zeros(0, np.int32),
    )
    assert got["embedded"].shape == (2, 0, 5)
    assert got["loss"].shape == () and np.isnan(got["loss"])  # torch: mean over no targets is NaN
    with pytest.raises(rlx.RlxValueError, match="targets"):  # ids are still checked with an empty batch
        exe(table=normal(7, 5), ids=np.zeros((0, 3), np.int64), logits=normal(2, 6), targets=np.array([1, 6], np.int32))


def test_gradients_over_an_empty_batch() -> None:
    """A training step on no rows: the loss is a mean of nothing (NaN, as torch's), and every
    weight's gradient is a sum over no rows, 0."""
    g = Graph()
    x = g.input("x", ("B", 8))
    w1, w2 = g.input("w1", (8, 16)), g.input("w2", (16, 8))
    h = g.rms_norm(x, g.constant(np.ones(8, np.float32)))
    y = g.silu(h @ w1) @ w2 + x
    loss = g.mean(y * y)
    dx, dw1, dw2 = rlx.grad(g, loss, [x, w1, w2])
    g.output(loss=loss, dx=dx, dw1=dw1, dw2=dw2)
    exe = rlx.compile(g)
    got = exe(x=np.zeros((0, 8), np.float32), w1=normal(8, 16), w2=normal(16, 8))
    assert np.isnan(got["loss"])
    assert got["dx"].shape == (0, 8)
    np.testing.assert_array_equal(got["dw1"], np.zeros((8, 16), np.float32))
    np.testing.assert_array_equal(got["dw2"], np.zeros((16, 8), np.float32))


def attention_graph(layout: Layout, mask: MaskKind, with_pad: bool) -> Graph:
    g = Graph()
    bshd = layout is Layout.BSHD

    def shape(length: str) -> tuple[object, ...]:
        return ("B", length, 2, 4) if bshd else ("B", 2, length, 4)

    lengths = {"q": "Sq", "k": "Sk", "v": "Sk", "dy": "Sq"}
    q, k, v, dy = (g.input(name, shape(length)) for name, length in lengths.items())
    pad = g.input("pad", ("B", "Sk")) if with_pad else None
    o = g.attention(q, k, v, mask=mask, layout=layout, mask_input=pad)
    dq, dk, dv = rlx.grad(g, o, [q, k, v], dy)
    g.output(o=o, dq=dq, dk=dk, dv=dv)
    return g


@pytest.mark.parametrize("layout", [Layout.BSHD, Layout.BHSD])
@pytest.mark.parametrize("mask", [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.CUSTOM, MaskKind.sliding_window(2)])
@pytest.mark.parametrize(("batch", "seq_q", "seq_k"), [(2, 3, 0), (2, 0, 5), (0, 3, 5), (1, 0, 0)])
def test_attention_with_an_empty_dimension(layout: Layout, mask: MaskKind, batch: int, seq_q: int, seq_k: int) -> None:
    """Forward and gradients: over no keys the output and dQ are 0; with no queries dK and dV
    are 0 (nothing attends to the keys); with no batch everything is empty."""
    custom = mask == MaskKind.CUSTOM
    exe = rlx.compile(attention_graph(layout, mask, custom))

    def heads(length: int) -> np.ndarray:
        return normal(batch, length, 2, 4) if layout is Layout.BSHD else normal(batch, 2, length, 4)

    arrays = {"q": heads(seq_q), "k": heads(seq_k), "v": heads(seq_k), "dy": heads(seq_q)}
    if custom:
        arrays["pad"] = np.ones((batch, seq_k), np.float32)
    got = exe(**arrays)
    for name, like in (("o", "q"), ("dq", "q"), ("dk", "k"), ("dv", "v")):
        assert got[name].shape == arrays[like].shape and got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], np.zeros_like(arrays[like]))


@pytest.mark.parametrize(("seq_q", "seq_k"), [(3, 0), (0, 5)])
def test_programmable_attention_with_an_empty_dimension(seq_q: int, seq_k: int) -> None:
    """A score_mod reading a learnable bias, GQA and Dv != D, with the LSE: over no keys out 0 and
    LSE -inf; every gradient (the bias's too) 0."""
    g = Graph()
    q, dy = g.input("q", (1, 4, "Sq", 8)), g.input("dy", (1, 4, "Sq", 6))
    k, v = g.input("k", (1, 2, "Sk", 8)), g.input("v", (1, 2, "Sk", 6))
    slopes = g.input("slopes", (4,))

    def alibi(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + slopes[h] * (kv_idx - q_idx)

    o, lse = g.attention(q, k, v, score_mod=alibi, mask_mod=rlx.mods.causal_lower_right, layout=Layout.BHSD,
                         return_lse=True)  # fmt: skip
    dq, dk, dv, dslopes = rlx.grad(g, o, [q, k, v, slopes], dy)
    g.output(o=o, lse=lse, dq=dq, dk=dk, dv=dv, dslopes=dslopes)
    exe = rlx.compile(g)
    got = exe(
        q=normal(1, 4, seq_q, 8), k=normal(1, 2, seq_k, 8), v=normal(1, 2, seq_k, 6), dy=normal(1, 4, seq_q, 6),
        slopes=normal(4),
    )  # fmt: skip
    assert got["o"].shape == (1, 4, seq_q, 6) and not got["o"].any()
    assert got["lse"].shape == (1, 4, seq_q) and np.isneginf(got["lse"]).all()
    assert got["dq"].shape == (1, 4, seq_q, 8) and not got["dq"].any()
    assert got["dk"].shape == (1, 2, seq_k, 8) and not got["dk"].any()
    assert got["dv"].shape == (1, 2, seq_k, 6) and not got["dv"].any()
    np.testing.assert_array_equal(got["dslopes"], np.zeros(4, np.float32))


def test_attention_merge_of_parts_over_no_keys() -> None:
    """A part over no keys (its LSE -inf) drops out of a merge: ring attention's empty shard."""
    g = Graph()
    q, k, v = g.input("q", (1, 3, 2, 4)), g.input("k", (1, "Sk", 2, 4)), g.input("v", (1, "Sk", 2, 4))
    o, lse = g.attention(q, k, v, return_lse=True)
    g.output(o=o, lse=lse)
    exe = rlx.compile(g)
    qv, kv, vv = normal(1, 3, 2, 4), normal(1, 5, 2, 4), normal(1, 5, 2, 4)
    full = exe(q=qv, k=kv, v=vv)
    empty = exe(q=qv, k=kv[:, :0], v=vv[:, :0])
    out, lse_merged = rlx.attention_merge([(empty["o"], empty["lse"]), (full["o"], full["lse"])])
    np.testing.assert_allclose(out, full["o"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse_merged, full["lse"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("batch", "length"), [(2, 0), (0, 4)])
def test_document_mask_over_an_empty_sequence(batch: int, length: int) -> None:
    """A mask_mod that indexes a captured int tensor of the call's lengths: nothing is indexed."""
    g = Graph()
    q, k, v = (g.input(name, ("B", "S", 2, 4)) for name in ("q", "k", "v"))
    doc = g.input("doc", ("B", "S"), dtype="int32")
    o = g.attention(q, k, v, mask_mod=rlx.mods.and_(rlx.mods.causal, rlx.mods.document(doc)))
    dq, dk, dv = rlx.grad(g, g.sum(o * o), [q, k, v])
    g.output(o=o, dq=dq, dk=dk, dv=dv)
    exe = rlx.compile(g)
    heads = {name: normal(batch, length, 2, 4) for name in ("q", "k", "v")}
    got = exe(**heads, doc=np.zeros((batch, length), np.int32))
    for name in ("o", "dq", "dk", "dv"):
        assert got[name].shape == (batch, length, 2, 4)
    full = exe(**{name: normal(2, 5, 2, 4) for name in ("q", "k", "v")}, doc=np.zeros((2, 5), np.int32))
    assert np.isfinite(full["o"]).all() and full["o"].any()  # the same executable, then a real call


def test_rlx_torch_with_an_empty_dimension() -> None:
    """Through rlx.torch: flex_attention over no keys (torch's eager flex_attention refuses
    it), and a compiled graph's autograd over an empty batch."""
    torch = pytest.importorskip("torch")
    import rlx.torch as rt

    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    k = torch.randn(1, 2, 0, 4, requires_grad=True)
    v = torch.randn(1, 2, 0, 4, requires_grad=True)
    out, lse = rt.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 2.0, return_lse=True)
    assert out.shape == (1, 2, 3, 4) and not out.any() and torch.isneginf(lse).all()
    out.sum().backward()
    assert q.grad is not None and not q.grad.any() and k.grad is not None and k.grad.shape == (1, 2, 0, 4)

    g = Graph()
    x, w = g.input("x", ("B", 4)), g.input("w", (4, 3))
    g.output(loss=g.sum(g.tanh(x @ w)))
    f = rt.compile(g)
    weight = torch.randn(4, 3, requires_grad=True)
    loss = f(x=torch.zeros(0, 4), w=weight)["loss"]
    assert loss.item() == 0.0
    loss.backward()
    assert weight.grad is not None and not weight.grad.any()
