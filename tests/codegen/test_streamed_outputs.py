"""Attention kernels that stage their outputs in scratch and stream them out (non-temporal stores).

By default only outputs beyond the L2 caches stream, which no small test reaches, so these tests
force it (``CodegenOptions(stream_outputs=True)``) and check that nothing computed changes: the
same products run on the same numbers, only where they write differs, so streamed results are
bit-identical to in-place ones, and both match the float64 reference. Poisoned output arrays
(``conftest.poisoned_outputs``) catch a row the copy-out misses.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from llvmlite import binding as llvm

import rlx
from rlx import Graph, Layout, MaskKind, Wrt
from rlx.codegen import executable
from rlx.codegen.executable import compile_graph
from rlx.codegen.lower import CodegenOptions
from rlx.codegen.lower_attention import STAGE_KV_MAX_FLOATS

X86 = llvm.get_process_triple().startswith("x86_64")

# (mask, layout, b, sq, sk, h, hkv, d, dv, wrt, block_q)
CASES = [
    (MaskKind.NONE, Layout.BSHD, 2, 40, 40, 3, 3, 64, 64, Wrt.ALL, None),
    (MaskKind.CAUSAL, Layout.BSHD, 2, 70, 70, 4, 2, 32, 32, Wrt.ALL, 16),  # GQA, several strips, last first
    (MaskKind.CAUSAL, Layout.BHSD, 1, 33, 50, 2, 1, 24, 40, Wrt.ALL, 8),  # Sq < Sk, Dv != D, tails of 8
    (MaskKind.sliding_window(5), Layout.BSHD, 2, 48, 48, 2, 2, 16, 16, Wrt.ALL, 16),
    (MaskKind.CUSTOM, Layout.BHSD, 2, 20, 30, 2, 2, 16, 16, Wrt.KEY | Wrt.VALUE, None),
    (MaskKind.BIAS, Layout.BSHD, 1, 24, 18, 2, 2, 20, 20, Wrt.QUERY, None),
    (MaskKind.NONE, Layout.BSHD, 1, 17, 17, 2, 2, 64, 64, Wrt.VALUE, None),
    (MaskKind.CAUSAL, Layout.BSHD, 1, 64, 600, 2, 1, 64, 64, Wrt.ALL, 32),  # dK/dV too long to stage
]


def build(
    mask: MaskKind, layout: Layout, b: int, sq: int, sk: int, h: int, hkv: int, d: int, dv: int, wrt: Wrt
) -> Graph:
    g = Graph("streamed")
    q = g.input("q", layout.join(b, sq, h, d))
    k = g.input("k", layout.join(b, sk, hkv, d))
    v = g.input("v", layout.join(b, sk, hkv, dv))
    dy = g.input("dy", layout.join(b, sq, h, dv))
    mask_input = None
    if mask == MaskKind.CUSTOM:
        mask_input = g.input("pad", (b, sk))
    elif mask == MaskKind.BIAS:
        mask_input = g.input("bias", (b, h, sq, sk))
    grads = g.attention_bwd(q, k, v, dy, wrt=wrt, mask=mask, layout=layout, mask_input=mask_input)
    grads = grads if isinstance(grads, tuple) else (grads,)
    g.output(**{f"d{flag}": grad for flag, grad in zip(wrt.members, grads, strict=True)})
    return g


def arrays_for(g: Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {name: rng.standard_normal(x.shape).astype(np.float32) for name, x in g.inputs.items()}
    if "pad" in arrays:
        arrays["pad"] = (rng.random(arrays["pad"].shape) > 0.3).astype(np.float32)
        arrays["pad"][:, 0] = 1.0
    return arrays


@pytest.mark.skipif(not X86, reason="streaming stores are emitted for x86 hosts only")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-sq{c[3]}-sk{c[4]}-h{c[5]}/{c[6]}-d{c[7]}/{c[8]}")
@pytest.mark.thin("threads")
@pytest.mark.parametrize("threads", [1, 2])
def test_streamed_outputs_are_the_in_place_ones(case: tuple, threads: int) -> None:
    *shape, block_q = case
    g = build(*shape)
    arrays = arrays_for(g, seed=len(g.nodes) + threads)
    config = rlx.RuntimeConfig(num_threads=threads)
    streamed = compile_graph(g, config=config, options=CodegenOptions(block_q=block_q, stream_outputs=True))
    in_place = compile_graph(g, config=config, options=CodegenOptions(block_q=block_q, stream_outputs=False))
    assert "!nontemporal" in streamed.llvm_ir and "!nontemporal" not in in_place.llvm_ir
    got, want = streamed(**arrays), in_place(**arrays)
    ref = rlx.reference.run(g, **arrays)
    for name in ref:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        np.testing.assert_allclose(got[name], ref[name], rtol=2e-5, atol=2e-5, err_msg=name)
    again = streamed(**arrays)  # into recycled (poisoned) arrays: every row is written again
    for name in ref:
        np.testing.assert_array_equal(again[name], got[name], err_msg=name)


FORWARD_CASES = [
    (MaskKind.NONE, Layout.BSHD, 2, 40, 40, 3, 3, 64, 64, None),
    (MaskKind.CAUSAL, Layout.BHSD, 2, 70, 50, 4, 2, 24, 40, 16),  # GQA, Dv != D, several strips
    (MaskKind.CUSTOM, Layout.BSHD, 1, 33, 33, 2, 2, 20, 20, 8),
]


@pytest.mark.skipif(not X86, reason="streaming stores are emitted for x86 hosts only")
@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: f"{c[0]}-{c[1]}-sq{c[3]}-sk{c[4]}-d{c[7]}/{c[8]}")
def test_a_streamed_forward_is_the_in_place_one(case: tuple) -> None:
    """The forward scales its staged rows by 1/sum on the way out: the same multiply as in place."""
    mask, layout, b, sq, sk, h, hkv, d, dv, block_q = case
    g = Graph("streamed_forward")
    q = g.input("q", layout.join(b, sq, h, d))
    k = g.input("k", layout.join(b, sk, hkv, d))
    v = g.input("v", layout.join(b, sk, hkv, dv))
    pad = g.input("pad", (b, sk)) if mask == MaskKind.CUSTOM else None
    g.output(out=g.attention(q, k, v, mask=mask, layout=layout, mask_input=pad))
    arrays = arrays_for(g, seed=sq)
    streamed = compile_graph(g, options=CodegenOptions(block_q=block_q, stream_outputs=True))
    in_place = compile_graph(g, options=CodegenOptions(block_q=block_q, stream_outputs=False))
    assert "!nontemporal" in streamed.llvm_ir and "!nontemporal" not in in_place.llvm_ir
    got = streamed(**arrays)["out"]
    np.testing.assert_array_equal(got, in_place(**arrays)["out"])
    np.testing.assert_allclose(got, rlx.reference.run(g, **arrays)["out"], rtol=2e-5, atol=2e-5)


def test_the_long_case_stages_dq_only() -> None:
    """The last case's dK/dV (Sk x (D + Dv) floats) exceed what a thread stages."""
    *_, sk, _, _, d, dv, _, _ = CASES[-1]
    assert sk * (d + dv) > STAGE_KV_MAX_FLOATS


def test_small_outputs_do_not_stream_by_default() -> None:
    """Outputs that fit in the L2 caches stay in cache for whoever reads them next: no streaming."""
    g = build(MaskKind.CAUSAL, Layout.BSHD, 1, 16, 16, 2, 2, 16, 16, Wrt.ALL)
    assert "!nontemporal" not in rlx.compile(g).llvm_ir


@pytest.mark.skipif(not X86, reason="streaming stores are emitted for x86 hosts only")
def test_outputs_start_on_cache_lines() -> None:
    """Output arrays are 64-byte aligned, so rows of 16k floats are whole lines for the stores."""
    g = build(MaskKind.NONE, Layout.BSHD, 1, 8, 8, 2, 2, 16, 16, Wrt.ALL)
    exe = compile_graph(g, options=CodegenOptions(stream_outputs=True))
    for name, array in exe(**arrays_for(g, seed=1)).items():
        assert array.ctypes.data % 64 == 0, name


@pytest.mark.parametrize("wrt", [Wrt.ALL, Wrt.KEY, Wrt.QUERY | Wrt.VALUE])
@pytest.mark.parametrize("mask", [MaskKind.NONE, MaskKind.CAUSAL])
def test_dense_strip_rows_change_nothing_computed(monkeypatch: pytest.MonkeyPatch, wrt: Wrt, mask: MaskKind) -> None:
    """A BSHD backward over enough keys copies each strip's rows of Q and dY dense before its
    products read them as A; with the copies turned off the results are the same bits."""
    import rlx.codegen.lower_attention as lowering

    g = build(mask, Layout.BSHD, 1, 300, 300, 2, 1, 24, 40, wrt)
    arrays = arrays_for(g, seed=3)
    options = CodegenOptions(block_q=64)
    spec_dense = compile_graph(g, options=options)
    got = spec_dense(**arrays)
    monkeypatch.setattr(lowering, "DENSE_ROWS_MIN_KEYS", 1 << 30)
    monkeypatch.setattr(executable, "_cache", OrderedDict())  # compiled again, not found in the cache
    in_place = compile_graph(g, options=options)
    assert spec_dense.llvm_ir != in_place.llvm_ir  # the copies were there, and are gone
    want = in_place(**arrays)
    ref = rlx.reference.run(g, **arrays)
    for name in ref:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        np.testing.assert_allclose(got[name], ref[name], rtol=2e-5, atol=2e-5, err_msg=name)


def test_a_forward_with_dense_query_rows_is_the_in_place_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlx.codegen.lower_attention as lowering

    g = Graph("dense_forward")
    q = g.input("q", (1, 300, 4, 24))
    k = g.input("k", (1, 280, 2, 24))
    v = g.input("v", (1, 280, 2, 40))
    g.output(out=g.attention(q, k, v, mask=MaskKind.CAUSAL))
    arrays = arrays_for(g, seed=5)
    options = CodegenOptions(block_q=64)
    dense = compile_graph(g, options=options)
    got = dense(**arrays)["out"]
    monkeypatch.setattr(lowering, "DENSE_ROWS_MIN_KEYS", 1 << 30)
    monkeypatch.setattr(executable, "_cache", OrderedDict())
    in_place = compile_graph(g, options=options)
    assert "q.dense" in dense.llvm_ir and "q.dense" not in in_place.llvm_ir
    np.testing.assert_array_equal(got, in_place(**arrays)["out"])
    np.testing.assert_allclose(got, rlx.reference.run(g, **arrays)["out"], rtol=2e-5, atol=2e-5)


def build_symbolic(mask: MaskKind, layout: Layout, h: int, hkv: int, d: int, dv: int, wrt: Wrt) -> Graph:
    """:func:`build` with a symbolic batch and lengths: one kernel for every call's sizes."""
    g = Graph("streamed_symbolic")
    q = g.input("q", layout.join("B", "Sq", h, d))
    k = g.input("k", layout.join("B", "Sk", hkv, d))
    v = g.input("v", layout.join("B", "Sk", hkv, dv))
    dy = g.input("dy", layout.join("B", "Sq", h, dv))
    mask_input = None
    if mask == MaskKind.CUSTOM:
        mask_input = g.input("pad", ("B", "Sk"))
    elif mask == MaskKind.BIAS:
        mask_input = g.input("bias", ("B", h, "Sq", "Sk"))
    grads = g.attention_bwd(q, k, v, dy, wrt=wrt, mask=mask, layout=layout, mask_input=mask_input)
    grads = grads if isinstance(grads, tuple) else (grads,)
    outputs = {f"d{flag}": grad for flag, grad in zip(wrt.members, grads, strict=True)}
    g.output(out=g.attention(q, k, v, mask=mask, layout=layout, mask_input=mask_input), **outputs)
    return g


def symbolic_arrays(g: Graph, sizes: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, x in g.inputs.items():
        arrays[name] = rng.standard_normal(tuple(sizes.get(dim, dim) for dim in x.shape)).astype(np.float32)
    if "pad" in arrays:
        arrays["pad"] = (rng.random(arrays["pad"].shape) > 0.3).astype(np.float32)
        arrays["pad"][:, 0] = 1.0
    return arrays


@pytest.mark.skipif(not X86, reason="streaming stores are emitted for x86 hosts only")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-sq{c[3]}-sk{c[4]}-h{c[5]}/{c[6]}-d{c[7]}/{c[8]}")
def test_symbolic_kernels_stream_per_call_as_static_ones_do(case: tuple) -> None:
    """Kernels of symbolic lengths decide per call whether to stream (and whether dK and dV fit
    their staging buffers): forced on, every call streams, bit-identical to in place and close to
    the reference, at the case's sizes and at other ones (dK/dV staged at some, not at others)."""
    mask, layout, b, sq, sk, h, hkv, d, dv, wrt, _ = case
    g = build_symbolic(mask, layout, h, hkv, d, dv, wrt)
    streamed = compile_graph(g, options=CodegenOptions(stream_outputs=True))
    in_place = compile_graph(g, options=CodegenOptions(stream_outputs=False))
    default = rlx.compile(g)
    assert "!nontemporal" in streamed.llvm_ir and "!nontemporal" not in in_place.llvm_ir
    for sizes in ({"B": b, "Sq": sq, "Sk": sk}, {"B": 1, "Sq": 5, "Sk": 1100}, {"B": 3, "Sq": 1, "Sk": 9}):
        arrays = symbolic_arrays(g, sizes, seed=sq + sizes["Sk"])
        got, want = streamed(**arrays), in_place(**arrays)
        ref = rlx.reference.run(g, **arrays)
        for name in ref:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} {sizes}")
            np.testing.assert_allclose(got[name], ref[name], rtol=3e-5, atol=3e-5, err_msg=f"{name} {sizes}")
            np.testing.assert_array_equal(default(**arrays)[name], want[name], err_msg=f"{name} {sizes}")
        again = streamed(**arrays)  # into recycled (poisoned) arrays: every row is written again
        for name in ref:
            np.testing.assert_array_equal(again[name], got[name], err_msg=f"{name} {sizes}")


@pytest.mark.skipif(not X86, reason="streaming stores are emitted for x86 hosts only")
def test_a_symbolic_call_beyond_the_l2_caches_streams_by_default() -> None:
    """By default a symbolic kernel streams only the calls whose data exceed the L2 caches: the
    same kernel serves a small call in place and a large one streamed, each as in place."""
    from rlx.config import l2_cache_bytes

    g = build_symbolic(MaskKind.CAUSAL, Layout.BSHD, 4, 4, 64, 64, Wrt.ALL)
    default = rlx.compile(g)
    in_place = compile_graph(g, options=CodegenOptions(stream_outputs=False))
    assert "!nontemporal" in default.llvm_ir
    large = {"B": 2, "Sq": 400, "Sk": 400}
    assert 9 * large["B"] * large["Sq"] * 4 * 64 * 4 > l2_cache_bytes()  # q, k, v, dy, out, dq, dk, dv
    for sizes in ({"B": 1, "Sq": 20, "Sk": 20}, large):
        arrays = symbolic_arrays(g, sizes, seed=sizes["Sq"])
        got, want = default(**arrays), in_place(**arrays)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} {sizes}")
