"""``Executable.run_direct`` (memory handed over by address, as rlx.torch does) and the scratch
stride a graph with symbolic dimensions keeps per bucket of sizes."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx.codegen.blas import INT32_MAX
from rlx.codegen.executable import data_address
from rlx.codegen.lower import STRIDE_BUCKET
from rlx.codegen.strip_heights import SMALL_PATH_ROWS
from rlx.errors import RlxValueError

HEADS, DIM = 4, 16


def decode_graph(scaled: bool = False) -> rlx.Graph:
    """One query row per head against ``Sk`` keys (BHSD), as rlx.torch's SDPA builds it."""
    g = rlx.Graph("decode")
    q = g.input("q", ("B", HEADS, "Sq", DIM))
    k = g.input("k", ("B", HEADS, "Sk", DIM))
    v = g.input("v", ("B", HEADS, "Sk", DIM))
    g.output(out=g.attention(q * 0.5 if scaled else q, k, v, layout=rlx.Layout.BHSD))
    return g


def arrays(batch: int, seq_q: int, seq_k: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"q": (batch, HEADS, seq_q, DIM), "k": (batch, HEADS, seq_k, DIM), "v": (batch, HEADS, seq_k, DIM)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def addressed(a: dict[str, np.ndarray]) -> list[tuple[int, tuple[int, ...]]]:
    return [(data_address(a[name]), a[name].shape) for name in "qkv"]


@pytest.mark.parametrize("scaled", [False, True])  # scaled: an intermediate, from the pool
def test_direct_runs_match_run_and_the_reference_at_every_length(scaled: bool) -> None:
    g = decode_graph(scaled)
    exe = rlx.compile(g)
    for seq_k in (1, 2, 63, 64, 65, 127, 200):
        a = arrays(2, 1, seq_k, seed=seq_k)
        out = np.full((2, HEADS, 1, DIM), np.nan, dtype=np.float32)
        assert exe.run_direct(addressed(a), {"out": (data_address(out), out.shape)})
        np.testing.assert_array_equal(out, exe(**a)["out"])
        want = rlx.reference.run(g, **a)["out"]
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_direct_declines_what_does_not_match_and_runs_nothing() -> None:
    exe = rlx.compile(decode_graph())
    a = arrays(1, 1, 8)
    out = np.full((1, HEADS, 1, DIM), 7.0, dtype=np.float32)
    target = {"out": (data_address(out), out.shape)}
    inputs = addressed(a)
    wrong_heads = [inputs[0], (inputs[1][0], (1, HEADS + 1, 8, DIM)), inputs[2]]
    disagreeing = [inputs[0], inputs[1], (inputs[2][0], (1, HEADS, 9, DIM))]  # Sk 8 and 9
    assert not exe.run_direct(wrong_heads, target)
    assert not exe.run_direct(disagreeing, target)
    assert not exe.run_direct(inputs[:2], target)  # an input missing
    assert not exe.run_direct(inputs, {"out": (data_address(out), (1, HEADS, 2, DIM))})  # wrong output shape
    assert not exe.run_direct(inputs, {})  # no output given
    assert (out == 7.0).all()


def test_direct_declines_graphs_whose_calls_need_more_than_addresses() -> None:
    g = rlx.Graph("ids")
    table = g.input("table", (10, 4))
    ids = g.input("ids", ("N",), dtype="int64")
    g.output(rows=g.embedding(table, ids))  # the ids are checked against the table before a call
    exe = rlx.compile(g)
    table_a, ids_a = np.ones((10, 4), np.float32), np.array([0, 9], np.int64)
    rows = np.zeros((2, 4), np.float32)
    inputs = [(data_address(table_a), table_a.shape), (data_address(ids_a), ids_a.shape)]
    assert not exe.run_direct(inputs, {"rows": (data_address(rows), rows.shape)})

    g = rlx.Graph("alias")
    x = g.input("x", ("N", 4))
    g.output(y=x, z=x * 2.0)  # an output that is an input
    exe = rlx.compile(g)
    assert exe._program.direct_outputs is None


def test_a_direct_runner_runs_as_run_direct_at_every_length() -> None:
    """``direct_runner``'s layout checks a call's shapes and its call writes what
    ``run_direct`` writes, on any memory, at any lengths; the layout declines what
    ``run_direct`` declines. Graphs whose calls need an intermediate from the pool (the scaled
    one) have no runner."""
    exe = rlx.compile(decode_graph())
    runner = exe.direct_runner
    assert runner is not None and runner.outputs == ("out",) and runner.inputs == ("q", "k", "v")
    assert runner.dtypes == (np.dtype(np.float32),) * 3 and exe.direct_runner is runner  # made once
    for batch, seq_k in ((2, 37), (2, 37), (1, 1), (3, 200)):
        shapes = [(batch, HEADS, 1, DIM), (batch, HEADS, seq_k, DIM), (batch, HEADS, seq_k, DIM)]
        layout = runner.layout(shapes)
        assert layout is not None and [shape for _, shape, _ in layout.buffers] == [(batch, HEADS, 1, DIM)]
        a = arrays(batch, 1, seq_k, seed=seq_k)
        out = np.full((batch, HEADS, 1, DIM), np.nan, dtype=np.float32)
        runner(layout, [data_address(a[name]) for name in "qkv"] + [data_address(out)])
        np.testing.assert_array_equal(out, exe(**a)["out"])
    shapes = [(2, HEADS, 1, DIM), (2, HEADS, 37, DIM), (2, HEADS, 37, DIM)]
    assert runner.layout([shapes[0], shapes[1], (2, HEADS, 38, DIM)]) is None  # Sk 37 and 38
    assert runner.layout([(2, HEADS + 1, 1, DIM), shapes[1], shapes[2]]) is None
    assert runner.layout([(3, HEADS, 1, DIM), shapes[1], shapes[2]]) is None  # batches 3 and 2
    assert runner.layout([(2, HEADS, 1, DIM), (2, HEADS, 0, DIM), (2, HEADS, 0, DIM)]) is None
    assert runner.layout(shapes[:2]) is None
    assert rlx.compile(decode_graph(scaled=True)).direct_runner is None
    with pytest.raises(RlxValueError, match="32-bit BLAS limit"):  # refused by the layout, before native code
        runner.layout([(1, HEADS, 1, DIM), (1, HEADS, INT32_MAX, DIM), (1, HEADS, INT32_MAX, DIM)])


def test_a_size_beyond_the_limits_is_still_refused_before_native_code() -> None:
    exe = rlx.compile(decode_graph())
    huge = (1, HEADS, 1, DIM), (1, HEADS, INT32_MAX, DIM)
    inputs = [(0, huge[0]), (0, huge[1]), (0, huge[1])]  # null addresses: nothing may read them
    out = (0, (1, HEADS, 1, DIM))
    with pytest.raises(RlxValueError, match="32-bit BLAS limit"):
        exe.run_direct(inputs, {"out": out})


def test_a_bucket_stride_covers_every_size_in_it_and_matches_exact_limits() -> None:
    exe = rlx.compile(decode_graph())
    dynamic = exe._program.dynamic
    assert dynamic is not None
    for seq_k in [1, 2, 17, STRIDE_BUCKET - 1, STRIDE_BUCKET, STRIDE_BUCKET + 1, 1000, 4097, 70000]:
        sizes = {"B": 3, "Sq": 5, "Sk": seq_k}
        table, stride = dynamic.table(sizes)
        assert stride >= dynamic._stride(sizes)
        assert stride % 64 == 0
        assert np.frombuffer(table, dtype=np.int64).tolist() == [sizes[s] for s in dynamic.symbols] + [stride]
    # At the limit (the floats of the strip a call's scratch holds within 32 bits: the shortest
    # strips' rows times Sk) the call's own sizes decide, though its bucket is past it; one key
    # more is refused.
    seq_k = INT32_MAX // SMALL_PATH_ROWS
    heights = dynamic.specs[0][1].heights  # type: ignore[union-attr]
    assert heights.most_floats(seq_k) <= INT32_MAX < heights.most_floats(-(-seq_k // STRIDE_BUCKET) * STRIDE_BUCKET)
    sizes = {"B": 1, "Sq": 1, "Sk": seq_k}
    assert dynamic.stride(sizes) == dynamic._stride(sizes) >= 4 * seq_k  # one query: one row of scores
    with pytest.raises(RlxValueError, match="32-bit BLAS limit"):
        dynamic.stride({"B": 1, "Sq": 1, "Sk": seq_k + 1})


def _programs() -> dict[str, rlx.Executable]:
    """Graphs whose call layouts differ in kind: symbolic attention (GQA, Dv != D), a static
    graph, a reshape whose output has a product of symbols, and one symbol in several inputs."""
    gqa = rlx.Graph("gqa")
    q = gqa.input("q", ("B", 4, "Sq", 16))
    k = gqa.input("k", ("B", 2, "Sk", 16))
    v = gqa.input("v", ("B", 2, "Sk", 8))
    gqa.output(out=gqa.attention(q, k, v, layout=rlx.Layout.BHSD))
    static = rlx.Graph("static")
    x = static.input("x", (3, 5))
    static.output(y=static.exp(x), s=static.sum(x, axis=0))
    merged = rlx.Graph("merged")
    x = merged.input("x", ("B", "S", 6))
    merged.output(flat=merged.reshape(x * 2.0, (-1, 6)), t=merged.transpose(x, (2, 0, 1)) + 1.0)
    shared = rlx.Graph("shared")
    a = shared.input("a", ("N", 4))
    b = shared.input("b", (4, "N"))
    shared.output(c=a @ b, d=shared.sum(b, axis=0) + shared.sum(a, axis=1))
    return {g.name: rlx.compile(g) for g in (decode_graph(), decode_graph(scaled=True), gqa, static, merged, shared)}


@pytest.mark.parametrize("name", ["decode", "gqa", "static", "merged", "shared"])
def test_the_generated_call_layout_is_the_generic_one(name: str) -> None:
    """For shapes that match and many that do not: what the generated function says equals
    binding the shapes and the generic ``layout_for``."""
    program = _programs()[name]._program
    assert program.binder is not None
    declared = [shape for _, _, shape, _ in program.binder.expected]
    rng = np.random.default_rng(7)
    for trial in range(300):
        sizes = {symbol: int(rng.integers(1, 200)) for symbol in ("B", "Sq", "Sk", "S", "N")}
        shapes = [tuple(dim if isinstance(dim, int) else sizes[dim] for dim in shape) for shape in declared]
        if trial % 3 == 1:  # one dimension off by one, or a zero
            which = int(rng.integers(len(shapes)))
            if shapes[which]:
                axis = int(rng.integers(len(shapes[which])))
                dims = list(shapes[which])
                dims[axis] = 0 if trial % 2 else dims[axis] + 1
                shapes[which] = tuple(dims)
        elif trial % 3 == 2 and trial % 5 == 0:  # a rank off, or an input missing
            shapes = shapes[:-1] if trial % 2 else [*shapes[:-1], (*shapes[-1], 1)]
        generic_sizes = program.binder.sizes_of(shapes)
        want = None if generic_sizes is None else program.layout_for(generic_sizes)
        got = program.direct_layout(shapes)
        assert got == want, (shapes, got, want)


def test_sizes_in_a_known_bucket_need_no_generic_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    program = rlx.compile(decode_graph())._program
    calls: list[dict[str, int]] = []
    generic = type(program).layout_for

    def counted(self: object, sizes: dict[str, int]) -> object:
        calls.append(dict(sizes))
        return generic(self, sizes)  # type: ignore[arg-type]

    monkeypatch.setattr(type(program), "layout_for", counted)
    program.__dict__.pop("direct_layout", None)  # generated again, around the counted method
    assert program.dynamic is not None
    program.dynamic.bucket_strides.clear()  # the program is shared with other tests' calls
    program.layouts.clear()
    try:
        for seq_k in range(1, 2 * STRIDE_BUCKET + 1):  # a decode loop over two buckets of lengths
            layout = program.direct_layout([(1, HEADS, 1, DIM), (1, HEADS, seq_k, DIM), (1, HEADS, seq_k, DIM)])
            table = np.frombuffer(layout.table, dtype=np.int64)
            assert table[:-1].tolist() == [1, seq_k, 1]  # B, Sk, Sq: the symbols in sorted order
        assert [c["Sk"] for c in calls] == [1, STRIDE_BUCKET + 1]
    finally:
        program.__dict__.pop("direct_layout", None)  # the next use generates it around the real method


def padded_graph() -> rlx.Graph:
    """Symbolic lengths, a padding mask read from a bool tensor ``[B, Sk]``: its block map is made
    per call from the tensor (a call buffer), unless the call is small."""
    g = rlx.Graph("padded")
    q = g.input("q", ("B", HEADS, "Sq", DIM))
    k = g.input("k", ("B", HEADS, "Sk", DIM))
    v = g.input("v", ("B", HEADS, "Sk", DIM))
    keep = g.input("keep", ("B", "Sk"), dtype="bool")
    out, lse = g.attention(q, k, v, mask_mod=lambda b, h, qi, kv: keep[b, kv], layout=rlx.Layout.BHSD, return_lse=True)
    g.output(out=out, lse=lse)
    return g


def padded_arrays(batch: int, seq_q: int, seq_k: int, seed: int) -> dict[str, np.ndarray]:
    a = arrays(batch, seq_q, seq_k, seed)
    keep = np.ones((batch, seq_k), dtype=bool)
    keep[-1, : min(3, seq_k - 1)] = False  # the last sequence's first keys are padding
    return a | {"keep": keep}


def test_a_small_call_with_a_mask_tensor_runs_by_address_without_its_map() -> None:
    """A call below the small-call threshold reads no block map (every tile PARTIAL), so its
    runner needs only addresses; its results are ``run``'s and the reference's. A call above
    the threshold reads the map, which only ``run`` makes from the tensor: the runner's layout
    and ``run_direct`` decline it, and ``run`` is still right."""
    g = padded_graph()
    exe = rlx.compile(g)
    runner = exe.direct_runner
    assert runner is not None and runner.outputs == ("out", "lse") and len(runner.maps) == 1
    for batch, seq_q, seq_k in ((2, 1, 1), (2, 1, 37), (3, 1, 200), (2, 5, 64)):
        a = padded_arrays(batch, seq_q, seq_k, seed=seq_k)
        names = ("q", "k", "v", "keep")
        layout = runner.layout([a[name].shape for name in names])
        assert layout is not None
        out = np.full((batch, HEADS, seq_q, DIM), np.nan, dtype=np.float32)
        lse = np.full((batch, HEADS, seq_q), np.nan, dtype=np.float32)
        assert runner.output_shapes(layout) == (out.shape, lse.shape)
        runner(layout, [data_address(a[name]) for name in names] + [data_address(out), data_address(lse)])
        got = exe(**a)
        np.testing.assert_array_equal(out, got["out"])
        np.testing.assert_array_equal(lse, got["lse"])
        want = rlx.reference.run(g, **a)
        np.testing.assert_allclose(out, want["out"], rtol=1e-5, atol=1e-6)
        outputs = {"out": (data_address(out), out.shape), "lse": (data_address(lse), lse.shape)}
        assert exe.run_direct([(data_address(a[name]), a[name].shape) for name in names], outputs)
    large = padded_arrays(2, 512, 512, seed=1)  # 2·4·512·512·32 multiply-adds: above the threshold
    names = ("q", "k", "v", "keep")
    assert runner.layout([large[name].shape for name in names]) is None
    out, lse = np.zeros((2, HEADS, 512, DIM), np.float32), np.zeros((2, HEADS, 512), np.float32)
    outputs = {"out": (data_address(out), out.shape), "lse": (data_address(lse), lse.shape)}
    assert not exe.run_direct([(data_address(large[name]), large[name].shape) for name in names], outputs)
    assert (out == 0).all()
    np.testing.assert_allclose(exe(**large)["out"], rlx.reference.run(g, **large)["out"], rtol=1e-4, atol=1e-5)


def test_the_native_and_the_python_small_call_rules_agree_at_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel decides in native code whether it reads the map, the call's layout in Python
    whether to make one: both from the threshold the kernel was compiled with, so a call just
    below it goes by address and one at it makes its map, even after the threshold changes."""
    import rlx.codegen.lower as lower

    macs_at = 2 * HEADS * 1 * 40 * (2 * DIM)  # B2, one query, 40 keys
    monkeypatch.setattr(lower, "SMALL_CALL_MACS", macs_at)
    g = padded_graph()
    g.name = "padded_threshold"  # not the executable another test compiled with the default
    exe = rlx.compile(g)
    monkeypatch.setattr(lower, "SMALL_CALL_MACS", 1 << 40)  # later changes do not reach it
    runner = exe.direct_runner
    assert runner is not None
    names = ("q", "k", "v", "keep")
    for seq_k, addressed in ((39, True), (40, False), (41, False)):
        a = padded_arrays(2, 1, seq_k, seed=seq_k)
        layout = runner.layout([a[name].shape for name in names])
        assert (layout is not None) == addressed
        np.testing.assert_allclose(exe(**a)["out"], rlx.reference.run(g, **a)["out"], rtol=1e-5, atol=1e-6)


def test_a_masked_decode_loop_gets_its_layouts_without_the_generic_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph with a block map made per call (a padding mask) has its layout written out too:
    a decode loop over a known bucket of lengths takes no generic ``layout_for``, and each
    layout (the maps it leaves unread included) is the one the generic path makes, for small
    calls (map unread) and large ones (map read) alike."""
    g = padded_graph()
    g.name = "padded_layouts"  # a program of its own, whatever other tests called
    program = rlx.compile(g)._program
    generic = type(program).layout_for
    calls: list[dict[str, int]] = []

    def counted(self: object, sizes: dict[str, int]) -> object:
        calls.append(dict(sizes))
        return generic(self, sizes)  # type: ignore[arg-type]

    monkeypatch.setattr(type(program), "layout_for", counted)
    program.__dict__.pop("direct_layout", None)
    try:
        cases = [(2, 1, seq_k) for seq_k in range(1, STRIDE_BUCKET + 1)] + [(2, 512, 512), (2, 512, 500)]
        for batch, seq_q, seq_k in cases:
            keys = (batch, HEADS, seq_k, DIM)
            shapes = [(batch, HEADS, seq_q, DIM), keys, keys, (batch, seq_k)]
            made = program.direct_layout(shapes)
            program.layouts.clear()
            want = generic(program, {"B": batch, "Sk": seq_k, "Sq": seq_q})
            assert made == want
            assert bool(made.unread) == (seq_q == 1)  # one query: a small call, its map unread
        assert [c["Sk"] for c in calls] == [1, 512]  # one generic call per new bucket
    finally:
        program.__dict__.pop("direct_layout", None)


def test_a_layout_is_kept_for_the_same_sizes() -> None:
    """The generic path returns the layout it made for the same sizes (its checks read the sizes
    alone), so repeated calls of a graph that needs it do not redo it."""
    program = rlx.compile(padded_graph())._program
    sizes = {"B": 3, "Sk": 77, "Sq": 2}
    assert program.layout_for(dict(sizes)) is program.layout_for(dict(sizes))
