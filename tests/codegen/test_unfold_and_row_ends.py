"""``unfold`` (torch's ``Tensor.unfold``) as a strided view, and rows that end in a vector step
overlapping the one before it.

Every case compares the compiled result with the float64 reference (and ``unfold`` with NumPy's
``sliding_window_view``, an independent definition), at one and two threads.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph, RuntimeConfig
from rlx.ir.graph import Value


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _compiled_matches(g: Graph, threads: int = 2, **arrays: np.ndarray) -> rlx.Executable:
    exe = rlx.compile(g, config=RuntimeConfig(num_threads=threads))
    got = exe(**arrays)
    want = rlx.reference.run(g, **arrays)
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=2e-5, atol=2e-5, err_msg=name)
    return exe


def _windows(x: np.ndarray, axis: int, size: int, step: int) -> np.ndarray:
    """``x.unfold(axis, size, step)`` by its definition: ``out[..., j, ..., i] = x[..., j*step + i, ...]``."""
    length = x.shape[axis]
    count = (length - size) // step + 1
    moved = np.moveaxis(x, axis, -1)
    out = np.stack([moved[..., j * step : j * step + size] for j in range(count)], axis=-2)
    return np.moveaxis(out, -2, axis)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("shape", "axis", "size", "step"),
    [((2, 9, 3), 1, 3, 1), ((2, 9, 3), 1, 3, 2), ((4, 10), -1, 2, 3), ((5, 40), 1, 17, 5), ((3, 7), 0, 3, 1),
     ((2, 6), 1, 6, 4)],
)  # fmt: skip
def test_unfold_is_torchs_windows(shape: tuple[int, ...], axis: int, size: int, step: int, threads: int) -> None:
    g = Graph("unfold")
    x = g.input("x", shape)
    g.output(y=g.unfold(x, axis, size, step))
    xv = _random(*shape)
    exe = _compiled_matches(g, threads, x=xv)
    np.testing.assert_array_equal(exe(x=xv)["y"], _windows(xv, axis % len(shape), size, step))


def test_unfold_read_inline_costs_no_copy() -> None:
    """Windows read by an elementwise consumer come straight from the input's buffer: one kernel."""
    g = Graph("read")
    x = g.input("x", (6, 20))
    g.output(y=g.exp(g.unfold(x, 1, 4, 2)) * 2.0)
    exe = _compiled_matches(g, x=_random(6, 20))
    assert len(exe.kernels) == 1, exe.kernels


def test_unfold_of_a_computed_value_and_of_an_unfold() -> None:
    """An operand computed inline gets a buffer (overlapping windows are strides over memory);
    unfolding twice gives 2-D patches (a ViT's patchify)."""
    g = Graph("patches")
    x = g.input("x", (2, 3, 8, 12))
    patches = g.unfold(g.unfold(g.tanh(x), 2, 4, 4), 3, 4, 2)  # [2, 3, 2, 5, 4, 4]
    g.output(y=g.transpose(patches, (0, 2, 3, 1, 4, 5)), s=g.sum(patches, axis=(-1, -2)))
    xv = _random(2, 3, 8, 12)
    exe = _compiled_matches(g, x=xv)
    want = _windows(_windows(np.tanh(xv), 2, 4, 4), 3, 4, 2)
    np.testing.assert_allclose(exe(x=xv)["y"], want.transpose(0, 2, 3, 1, 4, 5), rtol=1e-6, atol=1e-6)


def test_unfold_of_ints_and_bools() -> None:
    g = Graph("ints")
    ids, flags = g.input("ids", (3, 11), "int64"), g.input("flags", (11,), "bool")
    g.output(a=g.unfold(ids, 1, 5, 3), b=g.unfold(flags, 0, 2, 1))
    idv = np.arange(33, dtype=np.int64).reshape(3, 11)
    fv = np.arange(11) % 3 == 0
    got = rlx.compile(g)(ids=idv, flags=fv)
    np.testing.assert_array_equal(got["a"], _windows(idv, 1, 5, 3))
    np.testing.assert_array_equal(got["b"], _windows(fv, 0, 2, 1))


def test_unfold_gradient_adds_overlapping_windows_back() -> None:
    """Each input entry's gradient is the sum over the windows that hold it, against a float64
    formula written position by position."""
    g = Graph("grad")
    x, dy = g.input("x", (2, 11)), g.input("dy", (2, 4, 5))
    windows = g.unfold(x, 1, 5, 2)
    (dx,) = rlx.grad(g, g.sum(windows * dy), [x])
    g.output(dx=dx)
    xv, dyv = _random(2, 11), _random(2, 4, 5, seed=1)
    want = np.zeros((2, 11))
    for j in range(4):
        for i in range(5):
            want[:, j * 2 + i] += dyv[:, j, i]
    got = rlx.compile(g)(x=xv, dy=dyv)["dx"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"axis": 2, "size": 2, "step": 1}, "out of range"), ({"axis": 1, "size": 8, "step": 1}, "does not fit"),
     ({"axis": 1, "size": 0, "step": 1}, ">= 1"), ({"axis": 1, "size": 2, "step": 0}, ">= 1"),
     ({"axis": 1, "size": 2.0, "step": 1}, "must be an int")],
)  # fmt: skip
def test_bad_unfolds_name_what_is_wrong(kwargs: dict[str, object], message: str) -> None:
    g = Graph("bad")
    x = g.input("x", (2, 7))
    with pytest.raises(rlx.RlxError, match=message):
        g.unfold(x, **kwargs)


def test_unfold_refuses_a_symbolic_axis() -> None:
    g = Graph("symbolic")
    x = g.input("x", ("B", 7))
    g.unfold(x, 1, 3, 1)  # a static axis of a symbolic-batch value
    with pytest.raises(rlx.RlxError, match="static size"):
        g.unfold(x, 0, 1, 1)


# ----------------------------------------------------------------------------- overlapped row ends


def _copy_graph(width: int, rows: int, op: str) -> Graph:
    """A kernel over rows of ``width`` whose body is cheap (no masked step): a transposed copy,
    an add, or a cast."""
    g = Graph("rows")
    x = g.input("x", (width, rows))
    read = g.transpose(x, (1, 0))  # rows of `width` read down the columns: no flat loop
    y = {"copy": read, "add": read + 1.5, "cast": g.cast(read, "int32")}[op]
    g.output(y=y)
    return g


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("width", [5, 15, 16, 17, 24, 31, 33, 48])
@pytest.mark.parametrize("op", ["copy", "add", "cast"])
def test_rows_end_in_an_overlapping_vector_step(width: int, op: str, threads: int) -> None:
    rows = 13
    xv = _random(width, rows) * 4
    exe = _compiled_matches(_copy_graph(width, rows, op), threads, x=xv)
    optimized = exe.optimized_llvm_ir
    # Rows that end in a partial vector and hold a whole one clamp the vector loop's last step
    # (``col.v.at``) and have no scalar loop; rows shorter than a vector run the scalar loop
    # only (the sizes are static, so the other branch folds away).
    if width > 16 and width % 16:
        assert "col.v.at" in optimized and "col.s" not in optimized, width
    if width < 16:
        assert "col.v" not in optimized and "col.s" in optimized, width


def test_a_long_row_split_into_column_chunks_ends_within_its_chunk() -> None:
    """One row of 1000 floats split over the threads in chunks of whole vectors: the last chunk
    (40 floats) ends overlapped within itself; a last chunk shorter than a vector would take the
    scalar steps (checked at run time), never reaching into another thread's chunk."""
    for width in (1000, 1032 + 5):
        g = Graph("chunks")
        x = g.input("x", (width,))
        g.output(y=g.reshape(x, (1, width)) * 3.0 - 1.0)
        _compiled_matches(g, 2, x=_random(width))


def test_an_overlapped_step_writes_only_its_concat_slice() -> None:
    """A concat's parts each write their columns of the joined rows: a part's overlapping step
    stays inside its own columns (the neighbour's entries keep their values)."""
    g = Graph("parts")
    a, b = g.input("a", (9, 20)), g.input("b", (9, 35))
    g.output(y=g.concat([g.transpose(g.transpose(a, (1, 0)), (1, 0)) + 1.0, b * 2.0, -a], axis=1))
    _compiled_matches(g, 2, a=_random(9, 20), b=_random(9, 35, seed=3))


def _silu(g: Graph, x: Value) -> Value:
    return x * g.sigmoid(x)


def test_dear_bodies_keep_their_masked_step() -> None:
    g = Graph("dear")
    x = g.input("x", (24, 7))
    g.output(y=_silu(g, g.transpose(x, (1, 0))))
    exe = _compiled_matches(g, 2, x=_random(24, 7))
    assert "col.v.at" not in exe.optimized_llvm_ir and "col.m" in exe.optimized_llvm_ir


def test_ids_read_through_windows_are_checked_where_read() -> None:
    """Token ids read through windows with gaps (``step > size``): an entry no window holds may
    be anything (a marker), one a window holds is checked and refused with a clear error."""
    g = Graph("ids")
    tokens, table = g.input("tokens", (2, 8), "int64"), g.input("table", (5, 3))
    g.output(y=g.embedding(table, g.unfold(tokens, 1, 2, 3)))  # windows at 0-1, 3-4, 6-7
    exe = rlx.compile(g)
    tv = _random(5, 3)
    ok = np.array([[0, 1, -7, 2, 3, 99, 4, 0], [1, 1, 1000, 1, 1, -1, 2, 2]])
    got = exe(tokens=ok, table=tv)["y"]
    np.testing.assert_array_equal(got, tv[_windows(ok, 1, 2, 3)])
    bad = ok.copy()
    bad[1, 4] = 5
    with pytest.raises(rlx.RlxValueError, match="5 is out of range"):
        exe(tokens=bad, table=tv)
