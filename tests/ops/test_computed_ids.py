"""Gathers by ids the graph computes (``embedding``/``take`` of an ``argmax``, of ``ids + 1``).

Ids that are graph inputs are checked before native code runs; computed ones exist only inside
the call, so the gather's kernel checks each one it reads memory with, reads row 0 instead of a
bad one, and the call raises ``RlxValueError`` naming the op and the id. These tests check the
values against the float64 reference and NumPy, the errors for ids just outside either end of the
range, on every code path that gathers (a row per loop iteration, rows varying across vector
lanes, the gradient's scatter-add, symbolic sizes, one and two threads), and that an executable
that raised runs good calls again.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph
from tests.helpers import central_differences

RNG_SEED = 7


def _argmax_rows(offset: int, rows: int = 10, width: int = 16) -> Graph:
    """``table[argmax(logits, -1) + offset]``: one row per loop iteration, the columns vectorised."""
    g = Graph("argmax_rows")
    table = g.input("table", (rows, width))
    logits = g.input("logits", (4, 7))
    g.output(rows=g.embedding(table, g.argmax(logits, axis=-1) + offset))
    return g


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_picked_by_a_computed_id_match_numpy(threads: int) -> None:
    rng = np.random.default_rng(RNG_SEED)
    g = _argmax_rows(3)
    exe = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=threads))
    table = rng.standard_normal((10, 16)).astype(np.float32)
    for _ in range(5):
        logits = rng.standard_normal((4, 7)).astype(np.float32)
        got = exe(table=table, logits=logits)["rows"]
        np.testing.assert_array_equal(got, table[logits.argmax(-1) + 3])
        np.testing.assert_array_equal(got, rlx.reference.run(g, table=table, logits=logits)["rows"])


@pytest.mark.parametrize(("offset", "good", "worst"), [(4, 0, 6), (-1, 6, 0), (-3, 4, 2), (3, 6, 6)])
def test_a_computed_id_out_of_range_is_an_error_of_the_call(offset: int, good: int, worst: int) -> None:
    """Row 2's argmax is ``worst``, so its id ``worst + offset`` falls just outside [0, 10)."""
    g = _argmax_rows(offset)
    exe = rlx.compile(g)
    table = np.arange(160, dtype=np.float32).reshape(10, 16)
    logits = np.zeros((4, 7), np.float32)
    logits[:, good] = 1.0
    np.testing.assert_array_equal(exe(table=table, logits=logits)["rows"], table[np.full(4, good + offset)])
    logits[2] = 0.0
    logits[2, worst] = 1.0
    bad = worst + offset
    if 0 <= bad < 10:
        np.testing.assert_array_equal(exe(table=table, logits=logits)["rows"][2], table[bad])
        return
    message = rf"token id of embedding \(node \d+\).*computed.*: {bad} is out of range \[0, 10\)"
    with pytest.raises(rlx.RlxValueError, match=message):
        exe(table=table, logits=logits)
    with pytest.raises(rlx.RlxValueError, match="out of range"):  # the reference agrees
        rlx.reference.run(g, table=table, logits=logits)
    logits[2] = 0.0
    logits[2, good] = 1.0
    np.testing.assert_array_equal(exe(table=table, logits=logits)["rows"], table[np.full(4, good + offset)])


def test_a_far_negative_computed_id_is_reported() -> None:
    g = Graph("far")
    table = g.input("table", (10, 16))
    logits = g.input("logits", (4, 7))
    g.output(rows=g.embedding(table, g.argmax(logits, axis=-1) * -1000))
    exe = rlx.compile(g)
    logits_value = np.zeros((4, 7), np.float32)
    logits_value[1, 3] = 1.0
    with pytest.raises(rlx.RlxValueError, match=r": -3000 is out of range"):
        exe(table=np.ones((10, 16), np.float32), logits=logits_value)


def test_rows_varying_across_vector_lanes() -> None:
    """``take`` along the last axis: the vector loop runs along the ids, a row per lane."""
    rng = np.random.default_rng(RNG_SEED)
    g = Graph("lanes")
    x = g.input("x", (5, 12))
    scores = g.input("scores", (19, 3))
    ids = g.argmax(scores, axis=-1) * 4  # 0, 4 or 8; one "bad" sample makes it 12
    g.output(picked=g.take(x, ids, axis=-1) * 2.0)
    exe = rlx.compile(g)
    x_value = rng.standard_normal((5, 12)).astype(np.float32)
    scores_value = rng.standard_normal((19, 3)).astype(np.float32)
    want = np.take(x_value, scores_value.argmax(-1) * 4, axis=-1) * 2.0
    np.testing.assert_array_equal(exe(x=x_value, scores=scores_value)["picked"], want)

    g_bad = Graph("lanes_bad")
    x = g_bad.input("x", (5, 12))
    scores = g_bad.input("scores", (19, 3))
    g_bad.output(picked=g_bad.take(x, g_bad.argmax(scores, axis=-1) * 4 + 1, axis=-1))
    exe_bad = rlx.compile(g_bad)
    scores_value[:] = 0.0
    scores_value[:, 1] = 1.0
    np.testing.assert_array_equal(exe_bad(x=x_value, scores=scores_value)["picked"], x_value[:, [5] * 19])
    scores_value[17] = [0.0, 0.0, 1.0]  # 9
    scores_value[11] = [0.0, 0.0, 1.0]
    np.testing.assert_array_equal(exe_bad(x=x_value, scores=scores_value)["picked"][:, 17], x_value[:, 9])
    g_worse = Graph("lanes_worse")
    x = g_worse.input("x", (5, 12))
    scores = g_worse.input("scores", (19, 3))
    g_worse.output(picked=g_worse.take(x, g_worse.argmax(scores, axis=-1) * 6, axis=-1))  # 12 is out
    exe_worse = rlx.compile(g_worse)
    with pytest.raises(rlx.RlxValueError, match=r"12 is out of range \[0, 12\)"):
        exe_worse(x=x_value, scores=scores_value)


def test_gradient_of_rows_picked_by_computed_ids() -> None:
    """The table's gradient scatters by the same computed ids; checked against central differences."""
    rng = np.random.default_rng(RNG_SEED)
    g = Graph("grad")
    table = g.input("table", (6, 5))
    ids_in = g.input("ids", (3, 4), dtype="int64")
    ids = g.maximum(ids_in - 1, 0)  # computed: a clamp of an input
    picked = g.embedding(table, ids)
    loss = g.sum(picked * picked * g.constant(np.linspace(0.5, 1.5, 5, dtype=np.float32)))
    (d_table,) = rlx.grad(g, loss, [table])
    g.output(loss=loss, d_table=d_table)
    exe = rlx.compile(g)
    table_value = rng.standard_normal((6, 5)).astype(np.float32)
    ids_value = rng.integers(0, 7, (3, 4))
    got = exe(table=table_value, ids=ids_value)
    reference = rlx.reference.run(g, table=table_value, ids=ids_value)
    np.testing.assert_allclose(got["d_table"], reference["d_table"], rtol=1e-5, atol=1e-6)
    table64 = table_value.astype(np.float64)

    def loss_of() -> float:
        rows = table64[np.maximum(ids_value - 1, 0)]
        return float(np.sum(rows * rows * np.linspace(0.5, 1.5, 5)))

    np.testing.assert_allclose(got["d_table"], central_differences(loss_of, table64), rtol=1e-4, atol=1e-4)
    with pytest.raises(rlx.RlxValueError, match="out of range"):  # 7 - 1 = 6 rows is one past the end
        exe(table=table_value, ids=np.full((3, 4), 7))


def test_scatter_add_by_computed_ids_reports_a_bad_one() -> None:
    """``embedding_grad`` built directly: its serial scatter checks computed ids too."""
    g = Graph("scatter")
    dy = g.input("dy", (4, 3))
    ids = g.input("ids", (4,), dtype="int32")
    g.output(table=g.embedding_grad(dy, ids + 2, 5))
    exe = rlx.compile(g)
    dy_value = np.arange(12, dtype=np.float32).reshape(4, 3)
    want = np.zeros((5, 3), np.float32)
    np.add.at(want, np.array([0, 2, 0, 1]) + 2, dy_value)
    np.testing.assert_array_equal(exe(dy=dy_value, ids=np.array([0, 2, 0, 1], np.int32))["table"], want)
    with pytest.raises(rlx.RlxValueError, match=r"embedding_grad.*: 5 is out of range \[0, 5\)"):
        exe(dy=dy_value, ids=np.array([0, 3, 0, 1], np.int32))
    with pytest.raises(rlx.RlxValueError, match=r"-1 is out of range"):
        exe(dy=dy_value, ids=np.array([0, 1, -3, 1], np.int32))


def test_computed_ids_with_symbolic_sizes() -> None:
    """Greedy decoding's pattern: the next token's embedding from the last position's argmax."""
    rng = np.random.default_rng(RNG_SEED)
    g = Graph("decode")
    table = g.input("table", (11, 8))
    logits = g.input("logits", ("B", "S", 11))
    g.output(next_rows=g.embedding(table, g.argmax(logits[:, -1], axis=-1)))
    exe = rlx.compile(g)
    table_value = rng.standard_normal((11, 8)).astype(np.float32)
    for batch, length in [(1, 3), (5, 9), (2, 1)]:
        logits_value = rng.standard_normal((batch, length, 11)).astype(np.float32)
        got = exe(table=table_value, logits=logits_value)["next_rows"]
        np.testing.assert_array_equal(got, table_value[logits_value[:, -1].argmax(-1)])


def test_ops_that_cannot_check_computed_ids_refuse_them_at_compile_time() -> None:
    """A one-hot reads no memory with its ids, so nothing would notice a bad one: refused, naming both ops."""
    g = Graph("ce")
    logits = g.input("logits", (4, 5))
    ids = g.input("ids", (4,), dtype="int64")
    g.output(loss=g.cross_entropy(logits, ids + 1))
    with pytest.raises(rlx.RlxValueError, match=r"class index of cross_entropy.*come from add"):
        rlx.compile(g)


def test_rows_of_a_table_of_symbolic_size_and_their_gradient() -> None:
    """``take`` along a symbolic axis: the table has ``S`` rows, so its gradient's scatter-add makes
    ``[S, E]`` per call; the textual IR keeps the symbolic count."""
    rng = np.random.default_rng(RNG_SEED)
    g = Graph("symbolic_rows")
    x = g.input("x", (2, "S", 3))
    ids = g.input("ids", (4,), dtype="int64")
    picked = g.take(x, g.maximum(ids, 0), axis=1)  # computed ids: checked by the gather
    loss = g.sum(picked * picked)
    (dx,) = rlx.grad(g, loss, [x])
    g.output(loss=loss, dx=dx)
    assert str(rlx.parse(str(g))) == str(g)
    exe = rlx.compile(g)
    for length in (5, 2, 9):
        x_value = rng.standard_normal((2, length, 3)).astype(np.float32)
        ids_value = rng.integers(-2, length, 4)
        got = exe(x=x_value, ids=ids_value)
        want = rlx.reference.run(g, x=x_value, ids=ids_value)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["dx"], want["dx"], rtol=1e-5, atol=1e-6)
        expected = np.zeros_like(x_value)
        np.add.at(expected, (slice(None), np.maximum(ids_value, 0)), 2 * x_value[:, np.maximum(ids_value, 0)])
        np.testing.assert_allclose(got["dx"], expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(rlx.RlxValueError, match=r": 3 is out of range \[0, 3\)"):
        exe(x=np.ones((2, 3, 3), np.float32), ids=np.array([0, 1, 3, 2]))


def test_ids_sliced_out_of_an_input_are_checked_where_they_are_read() -> None:
    """``tokens[:, 1:]`` as ids, the first column a marker no table has a row for: only the slice
    is read, so only the slice must be in range (the kernel checks each id it reads); an id out
    of range inside the slice is an error of the call. Ops whose kernels do not check ids
    (``cross_entropy``) still check the whole input before the call."""
    g = Graph("sliced_ids")
    table = g.input("table", (6, 3))
    tokens = g.input("tokens", (2, 4), "int64")
    logits = g.input("logits", (2, 3, 6))
    g.output(rows=g.embedding(table, tokens[:, 1:]), loss=g.cross_entropy(logits, tokens[:, 1:]))
    exe = rlx.compile(g)
    rng = np.random.default_rng(12)
    tablev, logitsv = rng.standard_normal((6, 3)).astype(np.float32), rng.standard_normal((2, 3, 6)).astype(np.float32)
    marked = np.array([[99, 1, 2, 5], [99, 0, 4, 3]])
    g2 = Graph("sliced_rows")
    table2, tokens2 = g2.input("table", (6, 3)), g2.input("tokens", (2, 4), "int64")
    g2.output(rows=g2.embedding(table2, tokens2[:, 1:]))
    rows_only = rlx.compile(g2)
    np.testing.assert_array_equal(rows_only(table=tablev, tokens=marked)["rows"], tablev[marked[:, 1:]])
    with pytest.raises(rlx.RlxValueError, match=r"sliced by the graph in this call: 6 is out of range \[0, 6\)"):
        rows_only(table=tablev, tokens=np.array([[0, 1, 2, 6], [0, 0, 4, 3]]))
    with pytest.raises(rlx.RlxValueError, match=r"input 'tokens': 99 is out of range \[0, 6\)"):
        exe(table=tablev, tokens=marked, logits=logitsv)
    good = marked.copy()
    good[:, 0] = 0
    got = exe(table=tablev, tokens=good, logits=logitsv)
    np.testing.assert_array_equal(got["rows"], tablev[good[:, 1:]])
