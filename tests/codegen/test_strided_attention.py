"""Attention reading q, k, v and dy through strided views, in place: no copy kernel before it.

A transformer's fused QKV projection splits into three views whose rows lie ``3·H·D`` floats
apart; a transpose of a BHSD tensor read as BSHD puts a head's rows ``D`` apart and its heads
``S·D`` apart. The fixed-mask and the programmable (score_mod / mask_mod) kernels take each
operand's own strides; masks, captured tensors and views whose strides BLAS cannot take still
get dense copies. Every case is checked against the float64 reference interpreter, forward and
backward, on several thread counts.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph, Layout, MaskKind, RuntimeConfig, Wrt
from rlx.ir.graph import Value

MASKS = [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(5), MaskKind.CUSTOM, MaskKind.BIAS]


def _heads(g: Graph, parts: Value, batch: int, seq: int, heads: int, width: int, layout: Layout) -> Value:
    """A [B, S, H*W] view as the layout's rank-4 operand (a transpose for BHSD)."""
    view = g.reshape(parts, (batch, seq, heads, width))
    return view if layout is Layout.BSHD else g.transpose(view, (0, 2, 1, 3))


def _graph(
    batch: int, seq: int, heads: int, kv_heads: int, dim: int, value_dim: int, layout: Layout, mask: MaskKind
) -> Graph:
    """q, k and v each a view of a split projection (q and k of one when their widths agree,
    as a fused projection makes them), dy a BHSD input transposed where the layout is BSHD:
    every tensor operand a strided view."""
    g = Graph("strided")
    if heads == kv_heads:
        q_part, k_part, _ = g.split(g.input("qk", (batch, seq, 3 * heads * dim)), 3, axis=-1)
    else:
        q_part, _ = g.split(g.input("qx", (batch, seq, 2 * heads * dim)), 2, axis=-1)
        _, k_part = g.split(g.input("kx", (batch, seq, 2 * kv_heads * dim)), 2, axis=-1)
    v_part, _ = g.split(g.input("vx", (batch, seq, 2 * kv_heads * value_dim)), 2, axis=-1)
    q = _heads(g, q_part, batch, seq, heads, dim, layout)
    k = _heads(g, k_part, batch, seq, kv_heads, dim, layout)
    v = _heads(g, v_part, batch, seq, kv_heads, value_dim, layout)
    dy_bhsd = g.input("dy", (batch, heads, seq, value_dim))
    dy = g.transpose(dy_bhsd, (0, 2, 1, 3)) if layout is Layout.BSHD else dy_bhsd * 1.0
    mask_input = None
    if mask == MaskKind.CUSTOM:
        mask_input = g.input("pad", (batch, seq))
    elif mask == MaskKind.BIAS:
        mask_input = g.input("bias", (batch, heads, seq, seq))
    out = g.attention(q, k, v, mask=mask, mask_input=mask_input, layout=layout)
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=mask, mask_input=mask_input, layout=layout)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    return g


def _inputs(graph: Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    arrays = {}
    for name, value in graph.inputs.items():
        shape = tuple(int(d) for d in value.shape)
        if name == "pad":
            arrays[name] = (rng.uniform(size=shape) > 0.3).astype(np.float32)
        else:
            arrays[name] = rng.standard_normal(shape).astype(np.float32)
    return arrays


def _check(graph: Graph, rng: np.random.Generator, threads: tuple[int, ...] = (1, 2, 3)) -> list[str]:
    arrays = _inputs(graph, rng)
    want = rlx.reference.run(graph, **arrays)
    kernels: list[str] = []
    first: dict[str, np.ndarray] | None = None
    for count in threads:
        exe = rlx.compile(graph, config=RuntimeConfig(num_threads=count))
        kernels = [kernel.name for kernel in exe.kernels]
        got = exe(**arrays)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-5, err_msg=f"{name}, {count} threads")
        if first is None:
            first = got
        else:  # the same code on any thread count: bit-identical
            for name, value in first.items():
                np.testing.assert_array_equal(got[name], value, err_msg=f"{name}, {count} threads")
    return kernels


@pytest.mark.thin("layout")
@pytest.mark.parametrize("layout", [Layout.BSHD, Layout.BHSD])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_split_projection_views_are_read_in_place(layout: Layout, mask: MaskKind) -> None:
    rng = np.random.default_rng(3)
    graph = _graph(2, 37, 4, 4, 8, 8, layout, mask)
    kernels = _check(graph, rng)
    # dy is a transpose in BSHD and a product in BHSD: nothing but the kernels themselves
    expected = ["attention", "attention_bwd"] if layout is Layout.BSHD else ["fused.mul", "attention", "attention_bwd"]
    assert sorted(kernels) == sorted(expected), kernels


@pytest.mark.thin("layout")
@pytest.mark.parametrize("layout", [Layout.BSHD, Layout.BHSD])
@pytest.mark.parametrize(("seq", "heads", "kv_heads", "dim", "value_dim"), [
    (1, 2, 2, 8, 8),  # one row: its stride is no leading dimension
    (5, 1, 1, 16, 16),  # one head
    (70, 4, 2, 16, 8),  # GQA, Dv != D
    (300, 4, 4, 32, 32),  # long enough for packed keys and dense strip rows
    (129, 6, 3, 8, 24),
])  # fmt: skip
def test_views_of_every_shape(layout: Layout, seq: int, heads: int, kv_heads: int, dim: int, value_dim: int) -> None:
    rng = np.random.default_rng(seq + heads)
    for mask in (MaskKind.NONE, MaskKind.CAUSAL):
        _check(_graph(2, seq, heads, kv_heads, dim, value_dim, layout, mask), rng, threads=(1, 2))


@pytest.mark.parametrize("layout", [Layout.BSHD, Layout.BHSD])
def test_symbolic_lengths_read_in_place(layout: Layout) -> None:
    """With a symbolic batch and length the split projection's views are read in place too
    (their batch stride is a whole number of rows per position), for every size a call brings;
    a view broadcast along the sequence is no leading dimension for BLAS and is copied."""
    g = Graph("symbolic")
    x = g.input("x", ("B", "S", 3 * 32))
    q, k, v = (g.reshape(part, ("B", "S", 4, 8)) for part in g.split(x, 3, axis=-1))
    if layout is Layout.BHSD:
        q, k, v = (g.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
    out = g.attention(q, k, v, mask=MaskKind.CAUSAL, layout=layout)
    dy = g.input("dy", out.shape)
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    exe = rlx.compile(g)
    assert [kernel.name for kernel in exe.kernels] == ["attention", "attention_bwd"]
    rng = np.random.default_rng(0)
    for batch, seq in ((2, 1), (1, 9), (3, 130), (2, 300)):
        sizes = {"B": batch, "S": seq}
        arrays = {
            "x": rng.standard_normal((batch, seq, 96)).astype(np.float32),
            "dy": rng.standard_normal(tuple(sizes.get(d, d) for d in dy.shape)).astype(np.float32),
        }
        want = rlx.reference.run(g, **arrays)
        got = exe(**arrays)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-5, err_msg=f"{name}, {sizes}")

    flat = Graph("broadcast")
    row = flat.input("row", ("B", 1, 4, 8))
    keys = flat.broadcast_to(row, ("B", "S", 4, 8))
    query = flat.input("q", ("B", "S", 4, 8))
    flat.output(out=flat.attention(query, keys, keys))
    copied = rlx.compile(flat)
    assert len(copied.kernels) == 2  # the broadcast keys copied first
    arrays = {"row": rng.standard_normal((2, 1, 4, 8)).astype(np.float32)}
    arrays["q"] = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)
    np.testing.assert_allclose(copied(**arrays)["out"], rlx.reference.run(flat, **arrays)["out"], rtol=2e-4, atol=2e-5)


def test_the_transformer_block_reads_its_qkv_split_in_place() -> None:
    """The block's QKV projection feeds attention without the three copies it needed."""
    from rlx.models import block_training_graph

    graph = block_training_graph(2, 16, 32, 2)
    exe = rlx.compile(graph)
    names = [kernel.name for kernel in exe.kernels]
    assert "attention" in names and "attention_bwd" in names
    assert not [name for name in names if name.startswith("fused.reshape")], names
    rng = np.random.default_rng(1)
    arrays = {name: (rng.standard_normal(tuple(int(d) for d in value.shape)) * 0.3).astype(np.float32)
              for name, value in graph.inputs.items()}  # fmt: skip
    want = rlx.reference.run(graph, **arrays)
    got = exe(**arrays)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=5e-4, atol=5e-5, err_msg=name)


def _operand(g: Graph, name: str, kind: str, dims: tuple[int, int, int, int], layout: Layout, part: int) -> Value:
    """A [B, S, H, W] (BSHD) or [B, H, S, W] (BHSD) operand built as ``kind`` says: a dense
    input, one of three parts of a wider projection, the transpose of the other layout's
    input, or a broadcast over the batch."""
    batch, seq, heads, width = dims
    bshd = (batch, seq, heads, width)
    if kind == "dense":
        return g.input(name, bshd if layout is Layout.BSHD else (batch, heads, seq, width))
    if kind == "split":
        view = g.reshape(g.split(g.input(name, (batch, seq, 3 * heads * width)), 3, axis=-1)[part], bshd)
        return view if layout is Layout.BSHD else g.transpose(view, (0, 2, 1, 3))
    if kind == "transpose":  # the other layout's tensor, read through a transpose
        other = g.input(name, (batch, heads, seq, width) if layout is Layout.BSHD else bshd)
        return g.transpose(other, (0, 2, 1, 3))
    one = g.input(name, (1, seq, heads, width) if layout is Layout.BSHD else (1, heads, seq, width))
    return g.broadcast_to(one, bshd if layout is Layout.BSHD else (batch, heads, seq, width))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 70),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    dim=st.sampled_from([4, 8, 16]),
    value_dim=st.sampled_from([4, 8, 12]),
    layout=st.sampled_from([Layout.BSHD, Layout.BHSD]),
    mask=st.sampled_from([MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(3)]),
    kinds=st.lists(st.sampled_from(["dense", "split", "transpose", "broadcast"]), min_size=4, max_size=4),
    part=st.integers(0, 2),
)
def test_random_operand_views(
    batch: int, seq: int, kv_heads: int, group: int, dim: int, value_dim: int, layout: Layout,
    mask: MaskKind, kinds: list[str], part: int,
) -> None:  # fmt: skip
    """Operands from random view constructions, forward and backward, against the reference."""
    heads = kv_heads * group
    g = Graph("random_views")
    q = _operand(g, "q", kinds[0], (batch, seq, heads, dim), layout, part)
    k = _operand(g, "k", kinds[1], (batch, seq, kv_heads, dim), layout, (part + 1) % 3)
    v = _operand(g, "v", kinds[2], (batch, seq, kv_heads, value_dim), layout, (part + 2) % 3)
    dy = _operand(g, "dy", kinds[3], (batch, seq, heads, value_dim), layout, part)
    out = g.attention(q, k, v, mask=mask, layout=layout)
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=mask, layout=layout)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    _check(g, np.random.default_rng(seq), threads=(1, 2))


def _softcap(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return 5.0 * rlx.tanh(score / 5.0)


FLEX_MODS = {
    "causal": {"mask_mod": rlx.mods.causal},
    "window+softcap": {"mask_mod": rlx.mods.sliding_window(4), "score_mod": _softcap},
    "softcap": {"score_mod": _softcap},
}


def _flex_graph(
    dims: tuple[int, int, int, int, int, int], layout: Layout, kinds: list[str], part: int, mods: str
) -> Graph:
    """Flex attention (``score_mod`` / ``mask_mod``) and ``rlx.grad``'s backward over operands
    built as ``kinds`` say (:func:`_operand`)."""
    batch, seq, heads, kv_heads, dim, value_dim = dims
    g = Graph("flex_views")
    q = _operand(g, "q", kinds[0], (batch, seq, heads, dim), layout, part)
    k = _operand(g, "k", kinds[1], (batch, seq, kv_heads, dim), layout, (part + 1) % 3)
    v = _operand(g, "v", kinds[2], (batch, seq, kv_heads, value_dim), layout, (part + 2) % 3)
    dy = _operand(g, "dy", kinds[3], (batch, seq, heads, value_dim), layout, part)
    out = g.attention(q, k, v, layout=layout, **FLEX_MODS[mods])  # type: ignore[arg-type]
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    return g


@pytest.mark.thin("layout")
@pytest.mark.parametrize("layout", [Layout.BSHD, Layout.BHSD])
@pytest.mark.parametrize("mods", sorted(FLEX_MODS))
def test_flex_kernels_read_views_in_place(layout: Layout, mods: str) -> None:
    """The programmable kernels read split-projection views and a transposed dy with no copy
    kernel before them, forward and backward."""
    kinds = ["split", "split", "split", "transpose"]
    graph = _flex_graph((2, 37, 4, 4, 8, 8), layout, kinds, 0, mods)
    kernels = _check(graph, np.random.default_rng(5))
    assert sorted(kernels) == ["flex_attention", "flex_attention_bwd"], kernels


@pytest.mark.thin("layout")
@pytest.mark.parametrize("layout", [Layout.BSHD, Layout.BHSD])
@pytest.mark.parametrize(("seq", "heads", "kv_heads", "dim", "value_dim"), [
    (1, 2, 2, 8, 8),  # one row
    (70, 4, 2, 16, 8),  # GQA, Dv != D
    (300, 4, 4, 32, 32),  # long enough for packed keys
])  # fmt: skip
def test_flex_views_of_every_shape(
    layout: Layout, seq: int, heads: int, kv_heads: int, dim: int, value_dim: int
) -> None:
    rng = np.random.default_rng(seq + heads)
    for mods in ("causal", "window+softcap"):
        graph = _flex_graph((2, seq, heads, kv_heads, dim, value_dim), layout, ["split"] * 3 + ["transpose"], 1, mods)
        _check(graph, rng, threads=(1, 2))


def test_flex_symbolic_lengths_read_in_place() -> None:
    """A symbolic batch and length: the split projection's views are read in place by the
    programmable kernels too, for every size a call brings."""
    g = Graph("flex_symbolic")
    x = g.input("x", ("B", "S", 3 * 32))
    q, k, v = (g.reshape(part, ("B", "S", 4, 8)) for part in g.split(x, 3, axis=-1))
    out = g.attention(q, k, v, mask_mod=rlx.mods.causal, score_mod=_softcap, layout=Layout.BSHD)
    dy = g.input("dy", out.shape)
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    exe = rlx.compile(g)
    assert sorted(kernel.name for kernel in exe.kernels) == ["flex_attention", "flex_attention_bwd"]
    rng = np.random.default_rng(0)
    for batch, seq in ((2, 1), (1, 9), (3, 130)):
        sizes = {"B": batch, "S": seq}
        arrays = {
            "x": rng.standard_normal((batch, seq, 96)).astype(np.float32),
            "dy": rng.standard_normal(tuple(sizes.get(d, d) for d in dy.shape)).astype(np.float32),
        }
        want = rlx.reference.run(g, **arrays)
        got = exe(**arrays)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-5, err_msg=f"{name}, {sizes}")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=st.integers(1, 3),
    seq=st.integers(1, 70),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    dim=st.sampled_from([4, 8, 16]),
    value_dim=st.sampled_from([4, 8, 12]),
    layout=st.sampled_from([Layout.BSHD, Layout.BHSD]),
    mods=st.sampled_from(sorted(FLEX_MODS)),
    kinds=st.lists(st.sampled_from(["dense", "split", "transpose", "broadcast"]), min_size=4, max_size=4),
    part=st.integers(0, 2),
)
def test_flex_random_operand_views(
    batch: int, seq: int, kv_heads: int, group: int, dim: int, value_dim: int, layout: Layout,
    mods: str, kinds: list[str], part: int,
) -> None:  # fmt: skip
    """The programmable kernels over operands from random view constructions, against the reference."""
    graph = _flex_graph((batch, seq, kv_heads * group, kv_heads, dim, value_dim), layout, kinds, part, mods)
    _check(graph, np.random.default_rng(seq), threads=(1, 2))
