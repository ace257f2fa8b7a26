"""``x.at[index].set/add/multiply/min/max/get``: JAX's functional index updates, against NumPy's
in-place updates on a copy (``ufunc.at`` where entries repeat), compiled and in the float64
reference, with gradients of ``x`` and of the values against central differences of the
reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import rlx
from rlx import Graph

SHAPE = (4, 5, 3)


def _numpy_update(how: str, x: np.ndarray, index: Any, values: Any) -> np.ndarray:
    out = x.copy()
    if how == "set":
        out[index] = values
        return out
    ufunc = {"add": np.add, "multiply": np.multiply, "min": np.minimum, "max": np.maximum}[how]
    ufunc.at(out, index, values)
    return out


def _np_index(index: Any) -> Any:
    entries = index if isinstance(index, tuple) else (index,)
    return tuple(np.asarray(e) if isinstance(e, list) else e for e in entries)


CASES: list[tuple[str, Any, tuple[int, ...] | None]] = [  # (name, index, shape of the values; None: a number)
    ("block", (slice(1, 3), 2), (2, 3)),
    ("block-broadcast-row", (slice(None), slice(0, 2)), (3,)),
    ("block-number", (Ellipsis, 1), None),
    ("int-from-end", (-1,), (5, 3)),
    ("newaxis", (None, 1, slice(2, None)), (1, 3, 3)),
    ("step", (slice(None, None, 2),), (2, 5, 3)),
    ("rows", ([2, 0],), (2, 5, 3)),
    ("points", ([0, 3, 1], slice(None), [2, 0, 1]), (3, 5)),
    ("rows-number", (np.array([3, -4]),), None),
    ("bool-mask", (slice(None), np.array([True, False, True, False, True])), (4, 3, 3)),
]
HOWS = ["set", "add", "multiply", "min", "max"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize(("name", "index", "values_shape"), CASES, ids=[c[0] for c in CASES])
def test_matches_numpy_with_gradients(name: str, index: Any, values_shape: tuple[int, ...] | None, how: str) -> None:
    rng = np.random.default_rng(len(name) + 7 * HOWS.index(how))
    x_array = rng.standard_normal(SHAPE).astype(np.float32)
    g = Graph("at")
    x = g.input("x", SHAPE)
    arrays = {"x": x_array}
    if values_shape is None:
        values: Any = 0.75
        expected = _numpy_update(how, x_array.astype(np.float64), _np_index(index), 0.75)
        update = getattr(x.at[index], how)(values)
        wrt = [x]
    else:
        arrays["v"] = rng.standard_normal(values_shape).astype(np.float32)
        values = g.input("v", values_shape)
        expected = _numpy_update(how, x_array.astype(np.float64), _np_index(index), arrays["v"].astype(np.float64))
        update = getattr(x.at[index], how)(values)
        wrt = [x, values]
    assert update.shape == SHAPE and update.dtype == np.float32
    weights = g.input("w", SHAPE)
    arrays["w"] = rng.standard_normal(SHAPE).astype(np.float32)
    grads = rlx.grad(g, g.sum(update * weights), wrt)
    g.output(y=update, **{f"d{i}": d for i, d in enumerate(grads)})
    got = rlx.compile(g)(**arrays)
    np.testing.assert_allclose(got["y"], expected, rtol=1e-6, atol=1e-6)
    ref = rlx.reference.run(g, **arrays)
    np.testing.assert_allclose(ref["y"], expected, rtol=1e-6, atol=1e-6)
    # Central differences of NumPy's update in float64, along random directions.
    base = {k: a.astype(np.float64) for k, a in arrays.items()}
    step = 1e-6
    for i, name_of in enumerate(["x", "v"][: len(wrt)]):
        direction = rng.standard_normal(base[name_of].shape)

        def loss(sign: float, which: str = name_of, d: np.ndarray = direction) -> float:
            moved = dict(base)
            moved[which] = base[which] + sign * step * d
            changed = _numpy_update(how, moved["x"], _np_index(index), moved.get("v", 0.75))
            return float(np.sum(changed * base["w"]))

        numeric = (loss(1.0) - loss(-1.0)) / (2 * step)
        analytic = float(np.sum(got[f"d{i}"].astype(np.float64) * direction))
        assert numeric == pytest.approx(analytic, rel=1e-4, abs=1e-4), (name_of, numeric, analytic)


def test_repeated_entries_add_up_and_set_writes_a_number_exactly() -> None:
    g = Graph("repeats")
    x = g.input("x", (5,))
    ids = g.input("ids", (4,), dtype="int64")
    rows = g.input("rows", (4,))
    g.output(
        added=x.at[ids].add(rows),
        constant_added=x.at[[1, 1, 4]].add(2.0),
        filled=x.at[ids].set(-np.inf),
        written=x.at[[3, 0]].set(rows[:2]),
        mean=x.at[ids].set(rows),
    )
    xa = np.arange(5, dtype=np.float32)
    ra = np.array([0.5, 1.5, 2.5, 3.5], np.float32)
    got = rlx.compile(g)(x=xa, ids=np.array([1, -1, 1, 2]), rows=ra)
    added = xa.copy()
    np.add.at(added, [1, -1, 1, 2], ra)
    np.testing.assert_array_equal(got["added"], added)
    np.testing.assert_array_equal(got["constant_added"], [0, 5, 2, 3, 6])
    np.testing.assert_array_equal(got["filled"], [0, -np.inf, -np.inf, 3, -np.inf])
    np.testing.assert_array_equal(got["written"], [1.5, 1, 2, 0.5, 4])
    np.testing.assert_array_equal(got["mean"], [0, 1.5, 3.5, 3, 1.5])  # entry 1 written twice: their mean


def test_int_and_bool_blocks_and_what_is_refused() -> None:
    g = Graph("int_blocks")
    ids = g.input("ids", (2, 4), dtype="int64")
    flags = g.input("flags", (4,), dtype="bool")
    x = g.input("x", (4,))
    g.output(
        ids=ids.at[:, 1:3].set(7),
        shifted=ids.at[0].add(10),
        flags=flags.at[-1].set(True),
        empty=x.at[2:2].set(5.0),
    )
    got = rlx.compile(g)(ids=np.arange(8).reshape(2, 4), flags=np.zeros(4, bool), x=np.ones(4, np.float32))
    np.testing.assert_array_equal(got["ids"], [[0, 7, 7, 3], [4, 7, 7, 7]])
    np.testing.assert_array_equal(got["shifted"], [[10, 11, 12, 13], [4, 5, 6, 7]])
    np.testing.assert_array_equal(got["flags"], [False, False, False, True])
    np.testing.assert_array_equal(got["empty"], np.ones(4))
    first_row = ids[0]
    before = len(g)
    refused: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: ids.at[[0, 1]].set(3), rlx.RlxTypeError, "float32 values only"),
        (lambda: x.at[first_row].multiply(2.0), rlx.RlxValueError, "more than once"),
        (lambda: x.at[[1, 1]].max(2.0), rlx.RlxValueError, "more than once"),
        (lambda: x.at[7].set(1.0), rlx.RlxValueError, "out of bounds"),
        (lambda: x.at[:2].set(np.ones(3, np.float32)), rlx.RlxValueError, "broadcast"),
    ]
    for build, error, match in refused:
        with pytest.raises(error, match=match):
            build()
    assert len(g) == before
    assert x.at[1:3].get().shape == (2,)
    assert x.at[[1, 2]].min(0.0).shape == (4,)  # distinct constant entries combine once each
