"""Strip heights: the rules a static kernel applies at compile time and a kernel of symbolic
lengths applies per call in native code give the same heights, and a thread's scratch holds
every call's strips."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llvmlite import ir

import rlx
from rlx import Graph, Layout, MaskKind, Wrt
from rlx.codegen.irutil import I64, PTR, VOID, for_range, gep
from rlx.codegen.jit import ENTRY, compile_ir
from rlx.codegen.lower import CodegenOptions, kernel_spec
from rlx.codegen.strip_heights import StripHeights, choose_block_q, strip_heights
from rlx.config import RuntimeConfig

KINDS = [
    (*kind, banded)
    for kind in itertools.product((False, True), (False, True), (False, True), (16, 64, 96, 128, 256), (False, True))
    for banded in ((False, True) if kind[1] else (False,))  # banded: causal-like kernels only
]
LENGTHS = [1, 2, 31, 32, 33, 63, 64, 100, 128, 129, 200, 255, 256, 257, 341, 342, 488, 511, 512, 513, 1024,
           1025, 2048, 2049, 4096, 16384, 100_000, 1_000_000]  # fmt: skip


def _native_rows(heights: StripHeights) -> ctypes._CFuncPtr:
    """``rows[i] = heights.emit_rows(sq[i], sk[i])`` compiled."""
    module = ir.Module("heights")
    entry = ir.Function(module, ir.FunctionType(VOID, [PTR, PTR, PTR, I64]), name=ENTRY)
    b = ir.IRBuilder(entry.append_basic_block())
    sq, sk, out, count = entry.args
    with for_range(b, 0, count, "i") as i:
        q = b.load(gep(b, sq, [i], I64), typ=I64)
        k = b.load(gep(b, sk, [i], I64), typ=I64)
        b.store(heights.emit_rows(b, q, k), gep(b, out, [i], I64))
    b.ret_void()
    library = compile_ir(str(module))
    function = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        library.entry_address
    )
    function.library = library  # type: ignore[attr-defined]  # keep the code alive with the function
    return function


@pytest.mark.parametrize(("needs_dp", "causal", "strided", "width", "small_path", "banded"), KINDS)
def test_native_heights_are_the_compile_time_ones(
    needs_dp: bool, causal: bool, strided: bool, width: int, small_path: bool, banded: bool
) -> None:
    heights = strip_heights(needs_dp, causal, strided, width, small_path, banded)
    pairs = np.array([(q, k) for q in LENGTHS for k in LENGTHS], dtype=np.int64)
    sq, sk = np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
    got = np.empty(len(pairs), np.int64)
    _native_rows(heights)(sq.ctypes.data, sk.ctypes.data, got.ctypes.data, len(pairs))
    want = [heights.rows(int(q), int(k)) for q, k in pairs]
    np.testing.assert_array_equal(got, want)
    for (q, k), rows in zip(pairs, want, strict=True):
        assert 1 <= rows <= q and rows <= heights.most_rows()
        assert rows * k <= heights.most_floats(int(k))  # a call's strips fit the scratch it gets
    bounds = [heights.most_floats(k) for k in LENGTHS]
    assert bounds == sorted(bounds), "scratch for a bucket of lengths is sized at its longest"


def test_rules_as_measured() -> None:
    """Spot checks of the measured rules (see strip_heights)."""
    assert choose_block_q(256, 256, needs_dp=True, causal_like=True, head_dim=64) == 32
    assert choose_block_q(1024, 1024, needs_dp=True, causal_like=True, head_dim=64) == 64
    assert choose_block_q(2048, 2048, needs_dp=True, causal_like=True, head_dim=64) == 128
    assert choose_block_q(128, 128, needs_dp=True, causal_like=False, head_dim=64) == 64
    assert choose_block_q(128, 128, needs_dp=True, causal_like=False, strided_rows=True, head_dim=64) == 128
    assert choose_block_q(256, 256, needs_dp=True, causal_like=False, head_dim=64) == 32
    assert choose_block_q(768, 768, needs_dp=True, causal_like=False, head_dim=128) == 256
    assert choose_block_q(300, 16384, needs_dp=True, causal_like=False, head_dim=64) == 150  # balanced: 2 strips
    assert choose_block_q(1000, 1 << 20, needs_dp=True, causal_like=False) == 32  # the budget's floor


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("needs_dp", [False, True])
def test_without_the_small_path_unmasked_strips_are_tall(needs_dp: bool, strided: bool) -> None:
    """Where OpenBLAS has no small-matrix path, no unmasked rule keeps products on it: short
    sequences take one strip, longer ones 256 rows; the causal rules do not change."""
    for seq in (64, 128, 200, 256):
        assert choose_block_q(seq, seq, needs_dp, False, strided, 64, small_path=False) == seq
    assert choose_block_q(256, 256, needs_dp, False, strided, 64, small_path=True) == (256 if strided else 32)
    assert choose_block_q(1024, 1024, needs_dp, False, strided, 64, small_path=False) == 256
    for seq in (256, 512, 1024, 2048):
        causal = [choose_block_q(seq, seq, needs_dp, True, strided, 64, small_path=path) for path in (False, True)]
        assert causal[0] == causal[1]


def test_flex_blocks_without_the_small_path() -> None:
    """The flex kernels' unmasked strips follow the same rule; masked ones keep 64 rows to 1024 keys."""
    from rlx.codegen.block_map import choose_blocks

    assert choose_blocks(128, 128, False, masked=False, small_path=True) == (64, 64)
    assert choose_blocks(128, 128, False, masked=False, small_path=False) == (128, 64)
    assert choose_blocks(1024, 1024, True, masked=True, small_path=False) == (64, 64)


def _causal_graph(batch: int | str, seq: int | str) -> Graph:
    """Causal attention and its fused backward over BHSD heads of 2 x 16."""
    g = Graph("causal")
    q, k, v, dy = (g.input(name, (batch, 2, seq, 16)) for name in ("q", "k", "v", "dy"))
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=MaskKind.CAUSAL, layout=Layout.BHSD)
    g.output(out=g.attention(q, k, v, mask=MaskKind.CAUSAL, layout=Layout.BHSD), dq=dq, dk=dk, dv=dv)
    return g


def test_symbolic_kernels_take_each_calls_height() -> None:
    """A kernel of symbolic lengths gets the rules, not one height: every length computes as
    the reference does, and the static kernel of the same lengths gives the same bits (same
    strips, same products)."""
    sym = _causal_graph("B", "S")
    node = next(node for node in sym.nodes if node.op is rlx.OpKind.ATTENTION_BWD)
    spec = kernel_spec(node, RuntimeConfig(), CodegenOptions())
    assert spec.heights is not None and spec.block_q == spec.heights.most_rows()
    exe = rlx.compile(sym)
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 1), (2, 33), (1, 130), (2, 600), (1, 1100)):
        arrays = {name: rng.standard_normal((batch, 2, seq, 16)).astype(np.float32) for name in ("q", "k", "v", "dy")}
        got = exe(**arrays)
        want = rlx.reference.run(sym, **arrays)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-5, err_msg=f"{name} at S={seq}")
        fixed = rlx.compile(_causal_graph(batch, seq))(**arrays)
        for name, value in fixed.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{name} at S={seq}")


def test_a_calls_strips_fit_the_scratch_of_its_bucket() -> None:
    """The scratch stride is worked out once per bucket of lengths, at the bucket's largest
    sizes: every call in the bucket takes strips that fit it."""
    from rlx.codegen.lower import STRIDE_BUCKET
    from rlx.codegen.lower_attention import strip_ld, whole_lines

    for needs_dp, causal in itertools.product((False, True), (False, True)):
        graph = _causal_graph("B", "S") if causal else Graph("plain")
        if not causal:
            q, k, v, dy = (graph.input(name, ("B", 2, "S", 16)) for name in ("q", "k", "v", "dy"))
            graph.output(dq=graph.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY, layout=Layout.BHSD))
        op = rlx.OpKind.ATTENTION_BWD if needs_dp else rlx.OpKind.ATTENTION
        nodes = [node for node in graph.nodes if node.op is op]
        if not nodes:
            continue
        spec = kernel_spec(nodes[0], RuntimeConfig(), CodegenOptions())
        assert spec.heights is not None
        for seq in [*range(1, 300), 511, 512, 513, 1000, 1024, 1025, 2047, 2049, 5000]:
            bucket = -(-seq // STRIDE_BUCKET) * STRIDE_BUCKET
            used = whole_lines(spec.heights.rows(seq, seq) * strip_ld(seq))  # rows strip_ld apart
            assert used <= spec.strip_floats(bucket, bucket), (needs_dp, causal, seq)
            assert spec.strip_floats(seq, 1) == whole_lines(strip_ld(seq))  # one query row: one row of scores


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from([Layout.BSHD, Layout.BHSD]),
    mask=st.sampled_from([MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(5), MaskKind.CUSTOM]),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    dims=st.sampled_from([(8, 8), (16, 8), (8, 24)]),
    lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=2, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_symbolic_attention_matches_the_reference_at_every_length(
    layout: Layout, mask: MaskKind, kv_heads: int, group: int, dims: tuple[int, int],
    lengths: list[tuple[int, int]], seed: int,
) -> None:  # fmt: skip
    """One compile of symbolic lengths, forward and fused backward, at random lengths: each call's
    strip height, scratch and strips against the float64 reference."""
    heads, (dim, value_dim) = kv_heads * group, dims
    causal_like = mask in (MaskKind.CAUSAL, MaskKind.sliding_window(5))

    def shape(seq: str, count: int, width: int) -> tuple[int | str, ...]:
        return ("B", seq, count, width) if layout is Layout.BSHD else ("B", count, seq, width)

    g = Graph("symbolic_attention")
    sq = "S" if causal_like else "Sq"
    q, dy = g.input("q", shape(sq, heads, dim)), g.input("dy", shape(sq, heads, value_dim))
    k = g.input("k", shape("Sk" if sq == "Sq" else "S", kv_heads, dim))
    v = g.input("v", shape("Sk" if sq == "Sq" else "S", kv_heads, value_dim))
    pad = g.input("pad", ("B", "Sk" if sq == "Sq" else "S")) if mask == MaskKind.CUSTOM else None
    out = g.attention(q, k, v, mask=mask, mask_input=pad, layout=layout)
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=mask, mask_input=pad, layout=layout)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    exe = rlx.compile(g)
    rng = np.random.default_rng(seed)
    for seq_q, seq_k in lengths:
        seq_k = seq_q if causal_like else seq_k
        sizes = {"B": 2, "S": seq_q, "Sq": seq_q, "Sk": seq_k}
        arrays = {}
        for name, value in g.inputs.items():
            concrete = tuple(sizes.get(d, d) for d in value.shape)
            data = rng.standard_normal(concrete).astype(np.float32)
            arrays[name] = (data > -0.5).astype(np.float32) if name == "pad" else data
        want = rlx.reference.run(g, **arrays)
        got = exe(**arrays)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=3e-4, atol=3e-5, err_msg=f"{name} at {sizes}")
    assert exe.compile_count == 1


def test_strip_rows_are_an_odd_number_of_lines_apart() -> None:
    """A score strip's row stride: at least its keys, at most 31 floats more, whole 64-byte lines
    and an odd number of them, so no count of keys puts a strip's rows into a few cache sets;
    the native rule is the same."""
    from rlx.codegen.lower_attention import STRIP_LD_SLACK, emit_strip_ld, strip_ld

    counts = [1, 2, 15, 16, 17, 31, 32, 33, 255, 256, 512, 1000, 1024, 4096, 16384, 100_003]
    for keys in counts:
        ld = strip_ld(keys)
        assert keys <= ld <= keys + STRIP_LD_SLACK and ld % 16 == 0 and (ld // 16) % 2 == 1
    module = ir.Module("strip_ld")
    entry = ir.Function(module, ir.FunctionType(VOID, [PTR, PTR, I64]), name=ENTRY)
    b = ir.IRBuilder(entry.append_basic_block())
    keys_in, out, count = entry.args
    with for_range(b, 0, count, "i") as i:
        b.store(emit_strip_ld(b, b.load(gep(b, keys_in, [i], I64), typ=I64)), gep(b, out, [i], I64))
    b.ret_void()
    library = compile_ir(str(module))
    native = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(library.entry_address)
    keys = np.array(counts, dtype=np.int64)
    got = np.empty_like(keys)
    native(keys.ctypes.data, got.ctypes.data, len(keys))
    assert got.tolist() == [strip_ld(k) for k in counts]
