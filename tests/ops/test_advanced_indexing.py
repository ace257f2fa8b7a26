"""``value[index]`` with NumPy's advanced indexing: int arrays, lists, int values of the graph and
constant bool arrays, mixed with ints, slices, ``None`` and ``...``.

Every case is checked against NumPy's own ``__getitem__`` on the same index: the compiled
values, the float64 reference, and the gradient against ``numpy.add.at`` (repeated entries add)
with the index given as constants and as inputs of the call.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph

SHAPE = (4, 5, 6)
ROWS = np.array([2, 0, -1, 2])  # repeats and counts from the end
PAIRS = np.array([[1, -5], [4, 0]])

CASES: list[tuple[str, tuple[Any, ...]]] = [
    ("rows", (ROWS,)),
    ("list", ([0, 3, 3],)),
    ("middle", (slice(None), ROWS)),
    ("last", (Ellipsis, np.array([5, 0, -6]))),
    ("two-adjacent", (slice(None), PAIRS, np.array([0, 5]))),  # broadcast to [2, 2], in place
    ("two-apart", (PAIRS % 4, slice(1, 4), np.array([[3], [-1]]))),  # not adjacent: index axes first
    ("int-beside-array", (1, slice(None), ROWS)),  # the int counts as an index: apart, so first
    ("int-adjacent", (slice(None), 2, [4, 1])),
    ("all-three", (ROWS, np.array([0, 1, 2, 3]), np.array([5]))),
    ("newaxis", (None, ROWS, None, slice(None, None, 2))),
    ("bool-mask", (np.array([True, False, True, True]),)),
    ("bool-2d", (np.arange(20).reshape(4, 5) % 3 == 0,)),
    ("bool-and-slice", (slice(1, 3), np.array([True, False, False, True, True]))),
    ("scalar-array", (np.array(3),)),
    ("reversed-with-array", (slice(None, None, -1), [1, 1])),
]


def _numpy_index(index: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(np.asarray(e) if isinstance(e, list) else e for e in index)


def _as_inputs(g: Graph, index: tuple[Any, ...], arrays: dict[str, np.ndarray]) -> tuple[Any, ...]:
    """The int arrays of ``index`` as inputs of the call (bool masks stay constants)."""
    entries = []
    for position, entry in enumerate(index):
        array = np.asarray(entry) if isinstance(entry, (list, np.ndarray)) else None
        if array is None or array.dtype == np.bool_:
            entries.append(entry)
            continue
        name = f"i{position}"
        dtype = "int32" if position % 2 else "int64"  # both index dtypes
        arrays[name] = array.astype(dtype)
        entries.append(g.input(name, array.shape, dtype=dtype))
    return tuple(entries)


def _check(index: tuple[Any, ...], as_inputs: bool, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    x_array = rng.standard_normal(SHAPE).astype(np.float32)
    expected = x_array.astype(np.float64)[_numpy_index(index)]
    g = Graph("advanced")
    x = g.input("x", SHAPE)
    arrays: dict[str, np.ndarray] = {"x": x_array}
    y = x[_as_inputs(g, index, arrays) if as_inputs else index]
    assert y.shape == expected.shape
    w = g.input("w", y.shape)
    arrays["w"] = rng.standard_normal(expected.shape).astype(np.float32)
    (dx,) = rlx.grad(g, g.sum(y * w), [x])
    g.output(y=y, dx=dx)
    expected_dx = np.zeros(SHAPE)
    np.add.at(expected_dx, _numpy_index(index), arrays["w"].astype(np.float64))
    out = rlx.compile(g)(**arrays)
    np.testing.assert_allclose(out["y"], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["dx"], expected_dx, rtol=1e-5, atol=1e-5)
    ref = rlx.reference.run(g, **arrays)
    np.testing.assert_allclose(ref["y"], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ref["dx"], expected_dx, rtol=1e-6, atol=1e-6)
    assert rlx.parse(str(g)).nodes is not None  # the IR round trip of the ops it is built from


@pytest.mark.parametrize("as_inputs", [False, True], ids=["constant", "input"])
@pytest.mark.parametrize(("name", "index"), CASES, ids=[c[0] for c in CASES])
def test_matches_numpy_values_and_gradients(name: str, index: tuple[Any, ...], as_inputs: bool) -> None:
    _check(index, as_inputs)


def test_an_index_of_the_call_outside_its_axis_is_an_error_of_the_call() -> None:
    g = Graph("bad_ids")
    x = g.input("x", (4, 5))
    i = g.input("i", (2,), dtype="int64")
    j = g.input("j", (2,), dtype="int64")
    g.output(rows=x[i], points=x[i, j])
    exe = rlx.compile(g)
    xa = np.arange(20, dtype=np.float32).reshape(4, 5)
    out = exe(x=xa, i=np.array([-4, 3]), j=np.array([-1, 4]))
    np.testing.assert_array_equal(out["rows"], xa[[-4, 3]])
    np.testing.assert_array_equal(out["points"], xa[[-4, 3], [-1, 4]])
    for i_bad, j_bad in [([4, 0], [0, 0]), ([-5, 0], [0, 0]), ([0, 0], [5, 0]), ([0, 0], [0, -6])]:
        with pytest.raises(rlx.RlxValueError, match="out of range"):
            exe(x=xa, i=np.array(i_bad), j=np.array(j_bad))


def test_symbolic_lengths_compile_once() -> None:
    g = Graph("symbolic_rows")
    x = g.input("x", ("N", 3))
    i = g.input("i", ("K",), dtype="int64")
    y = x[i]
    (dx,) = rlx.grad(g, g.sum(y * y), [x])
    g.output(y=y, dx=dx)
    exe = rlx.compile(g)
    for n, ids in [(5, [4, -1, 0]), (9, [-9, 8, 2, 2, 7])]:
        xa = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32)
        out = exe(x=xa, i=np.array(ids))
        np.testing.assert_allclose(out["y"], xa[ids])
        expected = np.zeros((n, 3))
        np.add.at(expected, np.array(ids), 2 * xa[ids].astype(np.float64))
        np.testing.assert_allclose(out["dx"], expected, rtol=1e-6)
    assert exe.compile_count == 1


def test_int_and_bool_values_are_indexed_too() -> None:
    g = Graph("int_table")
    table = g.input("t", (6, 2), dtype="int64")
    flags = g.input("f", (6,), dtype="bool")
    g.output(t=table[[5, 0]], f=flags[np.array([1, 1, 3])])
    ta = np.arange(12).reshape(6, 2)
    fa = np.array([True, False, True, True, False, False])
    out = rlx.compile(g)(t=ta, f=fa)
    np.testing.assert_array_equal(out["t"], ta[[5, 0]])
    np.testing.assert_array_equal(out["f"], fa[[1, 1, 3]])


_entries = st.one_of(
    st.just(slice(None)),
    st.builds(slice, st.integers(-3, 2), st.sampled_from([None, 4, -1])),
    st.integers(-4, 3),
    st.lists(st.integers(-4, 3), min_size=1, max_size=3),
    st.just(None),
)


@settings(max_examples=40, deadline=None)
@given(entries=st.lists(_entries, min_size=1, max_size=4), as_inputs=st.booleans(), ellipsis_at=st.integers(-1, 4))
def test_random_mixed_indices_match_numpy(entries: list[Any], as_inputs: bool, ellipsis_at: int) -> None:
    index = list(entries)
    if 0 <= ellipsis_at <= len(index):
        index.insert(ellipsis_at, Ellipsis)
    if sum(e is not None and e is not Ellipsis for e in index) > len(SHAPE):
        return
    numpy_index = _numpy_index(tuple(index))
    try:
        expected = np.zeros(SHAPE)[numpy_index]
    except IndexError:  # NumPy refuses it: so must rlx
        g = Graph("refused")
        with pytest.raises(rlx.RlxValueError):
            g.input("x", SHAPE)[tuple(index)]
        return
    if expected.size == 0:
        return  # rlx has no empty values
    if not any(isinstance(e, list) for e in index):
        return  # basic indexing: tests/ops/test_indexing.py
    _check(tuple(index), as_inputs)
