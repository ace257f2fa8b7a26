"""``logsumexp``, ``pad``, ``flip``, ``roll``, ``tril`` and ``triu`` against NumPy in float64:
values compiled, gradients against central differences of the NumPy function, symbolic lengths
compiled once, and the errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import rlx
from rlx import Graph


def _np_logsumexp(x: np.ndarray, axis: Any = None, keepdims: bool = False) -> np.ndarray:
    peak = np.max(x, axis=axis, keepdims=True)
    peak = np.where(np.isneginf(peak), 0.0, peak)
    total = np.log(np.sum(np.exp(x - peak), axis=axis, keepdims=True)) + peak
    return total if keepdims else np.squeeze(total, axis=axis)


CASES: list[tuple[str, tuple[int, ...], Callable[[Graph, rlx.Value], rlx.Value], Callable[[np.ndarray], Any]]] = [
    ("logsumexp-last", (3, 4, 5), lambda g, x: g.logsumexp(x, -1), lambda a: _np_logsumexp(a, -1)),
    ("logsumexp-axes", (3, 4, 5), lambda g, x: g.logsumexp(x, (0, 2), True), lambda a: _np_logsumexp(a, (0, 2), True)),
    ("logsumexp-all", (3, 4), lambda g, x: g.logsumexp(x), lambda a: _np_logsumexp(a)),
    ("pad-int", (3, 4), lambda g, x: g.pad(x, 2, 1.5), lambda a: np.pad(a, 2, constant_values=1.5)),
    ("pad-pair", (3, 4), lambda g, x: g.pad(x, (1, 2)), lambda a: np.pad(a, (1, 2))),
    (
        "pad-pairs",
        (3, 4, 2),
        lambda g, x: g.pad(x, ((1, 0), (0, 2), (3, 1))),
        lambda a: np.pad(a, ((1, 0), (0, 2), (3, 1))),
    ),
    ("flip-all", (3, 4), lambda g, x: g.flip(x), lambda a: np.flip(a)),
    ("flip-axis", (3, 4, 5), lambda g, x: g.flip(x, 1), lambda a: np.flip(a, 1)),
    ("roll-flat", (3, 4), lambda g, x: g.roll(x, 5), lambda a: np.roll(a, 5)),
    ("roll-axis", (3, 4), lambda g, x: g.roll(x, -1, 1), lambda a: np.roll(a, -1, 1)),
    ("roll-axes", (3, 4, 5), lambda g, x: g.roll(x, (1, 7), (0, 2)), lambda a: np.roll(a, (1, 7), (0, 2))),
    ("roll-one-shift-two-axes", (3, 4), lambda g, x: g.roll(x, 2, (0, 1)), lambda a: np.roll(a, 2, (0, 1))),
    ("tril", (2, 4, 5), lambda g, x: g.tril(x), lambda a: np.tril(a)),
    ("tril-below", (4, 5), lambda g, x: g.tril(x, -1), lambda a: np.tril(a, -1)),
    ("triu-above", (4, 5), lambda g, x: g.triu(x, 2), lambda a: np.triu(a, 2)),
]


@pytest.mark.parametrize(("name", "shape", "build", "numpy_fn"), CASES, ids=[c[0] for c in CASES])
def test_matches_numpy_with_gradients(
    name: str, shape: tuple[int, ...], build: Callable[..., rlx.Value], numpy_fn: Callable[[np.ndarray], Any]
) -> None:
    rng = np.random.default_rng(len(name))
    g = Graph(name.replace("-", "_"))
    x = g.input("x", shape)
    y = build(g, x)
    weights = g.input("w", y.shape)
    (grad,) = rlx.grad(g, g.sum(y * weights), [x])
    g.output(y=y, grad=grad)
    array = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(y.shape).astype(np.float32)
    got = rlx.compile(g)(x=array, w=w)
    np.testing.assert_allclose(got["y"], numpy_fn(array.astype(np.float64)), rtol=1e-5, atol=1e-6)
    want = np.zeros(shape)
    for index in np.ndindex(shape):
        up, down = array.astype(np.float64), array.astype(np.float64)
        up[index] += 1e-6
        down[index] -= 1e-6
        want[index] = ((numpy_fn(up) - numpy_fn(down)) * w).sum() / 2e-6
    np.testing.assert_allclose(got["grad"], want, rtol=1e-4, atol=1e-5)


def test_logsumexp_of_minus_infinity_is_minus_infinity_without_nan() -> None:
    g = Graph("lse")
    x = g.input("x", (2, 3))
    y = g.logsumexp(x, 1)
    (grad,) = rlx.grad(g, g.sum(g.where(g.equal(y, float("-inf")), 0.0, y)), [x])
    g.output(y=y, grad=grad)
    array = np.array([[-np.inf] * 3, [1000.0, 1000.0, -np.inf]], np.float32)
    got = rlx.compile(g)(x=array)
    assert got["y"][0] == -np.inf and got["y"][1] == pytest.approx(1000.0 + np.log(2.0))
    np.testing.assert_array_equal(got["grad"][1], [0.5, 0.5, 0.0])
    assert not np.isnan(got["grad"]).any()


def test_symbolic_lengths_compile_once() -> None:
    g = Graph("symbolic")
    x = g.input("x", (2, "S", "T"))
    references: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "flip": lambda a: np.flip(a, (1, 2)),
        "roll": lambda a: np.roll(a, 3, 1),
        "roll2": lambda a: np.roll(a, (-1, 2), (1, 2)),
        "tril": lambda a: np.tril(a, 1),
        "triu": lambda a: np.triu(a, -1),
        "lse": lambda a: _np_logsumexp(a, 1),
        "pad": lambda a: np.pad(a, ((0, 0), (1, 2), (0, 1)), constant_values=-1.0),
    }
    outputs = {
        "flip": g.flip(x, (1, 2)),
        "roll": g.roll(x, 3, 1),
        "roll2": g.roll(x, (-1, 2), (1, 2)),
        "tril": g.tril(x, 1),
        "triu": g.triu(x, -1),
        "lse": g.logsumexp(x, 1),
        "pad": g.pad(x, ((0, 0), (1, 2), (0, 1)), -1.0),
    }
    weights = {name: g.input(f"w_{name}", value.shape) for name, value in outputs.items()}
    loss = g.sum(g.stack([g.sum(value * weights[name]) for name, value in outputs.items()]))
    (grad,) = rlx.grad(g, loss, [x])
    g.output(grad=grad, **outputs)
    exe = rlx.compile(g)
    rng = np.random.default_rng(3)
    for rows, columns in ((1, 1), (2, 5), (7, 3)):
        array = rng.standard_normal((2, rows, columns)).astype(np.float32)
        feed = {"x": array}
        for name, fn in references.items():
            feed[f"w_{name}"] = rng.standard_normal(fn(array).shape).astype(np.float32)
        got, reference = exe(**feed), rlx.reference.run(g, **feed)
        for name, fn in references.items():
            np.testing.assert_allclose(got[name], fn(array.astype(np.float64)), rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got["grad"], reference["grad"], rtol=1e-5, atol=1e-5)
    assert exe.compile_count == 1


def test_int_and_bool_values_pad_flip_roll_and_triangles() -> None:
    g = Graph("ints")
    ids = g.input("ids", (3, 4), dtype="int64")
    flags = g.input("flags", (3, 4), dtype="bool")
    g.output(
        pad=g.pad(ids, 1, 7), flip=g.flip(ids, 0), roll=g.roll(flags, 1, 1), tril=g.tril(ids), triu=g.triu(flags, 1)
    )
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    f = a % 3 == 0
    got = rlx.compile(g)(ids=a, flags=f)
    np.testing.assert_array_equal(got["pad"], np.pad(a, 1, constant_values=7))
    np.testing.assert_array_equal(got["flip"], np.flip(a, 0))
    np.testing.assert_array_equal(got["roll"], np.roll(f, 1, 1))
    np.testing.assert_array_equal(got["tril"], np.tril(a))
    np.testing.assert_array_equal(got["triu"], np.triu(f, 1))


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda g, x: g.logsumexp(x, 3), rlx.RlxValueError, r"logsumexp: axis 3 is out of range"),
        (lambda g, x: g.pad(x, -1), rlx.RlxValueError, r"pad: pad_width must be .* non-negative"),
        (lambda g, x: g.pad(x, ((1, 1),) * 3), rlx.RlxValueError, r"pad: pad_width must be"),
        (lambda g, x: g.pad(x, ((1.5, 1),)), rlx.RlxValueError, r"pad: pad_width must be"),  # ints, as NumPy
        (lambda g, x: g.flip(x, 2), rlx.RlxValueError, r"flip: axis 2 is out of range"),
        (lambda g, x: g.roll(x, 1.5), rlx.RlxTypeError, r"roll: shift must be an int"),
        (lambda g, x: g.roll(x, (1, 2)), rlx.RlxValueError, r"roll: without an axis, shift must be one int"),
        (lambda g, x: g.roll(x, (1, 2, 3), (0, 1)), rlx.RlxValueError, r"roll: 3 shifts for 2 axes"),
        (lambda g, x: g.tril(g.sum(x, 0)), rlx.RlxValueError, r"tril: x must have rank >= 2"),
        (lambda g, x: g.triu(x, 0.5), rlx.RlxTypeError, r"triu: k must be an int"),
    ],
)
def test_errors_name_the_function(build: Callable[..., object], error: type, match: str) -> None:
    g = Graph("bad")
    x = g.input("x", (3, 4))
    with pytest.raises(error, match=match):
        build(g, x)


def test_predicates_and_truth_reductions_match_numpy() -> None:
    g = Graph("predicates")
    x = g.input("x", (3, 4, 5))
    flags = g.input("flags", (3, 4), dtype="bool")
    ids = g.input("ids", (3, 4), dtype="int64")
    g.output(
        nan=g.isnan(x),
        inf=g.isinf(x),
        finite=g.isfinite(x),
        ids_nan=g.isnan(ids),
        ids_finite=g.isfinite(ids),
        any_axis=g.any(x, 1),
        all_axes=g.all(x, (0, 2), True),
        any_flags=g.any(flags),
        all_flags=g.all(flags, 1),
        all_ids=g.all(ids, 0),
    )
    rng = np.random.default_rng(5)
    array = rng.standard_normal((3, 4, 5)).astype(np.float32)
    array[0, 0, 0], array[1, 1, 1], array[1, 2, 3], array[2, 2, :] = np.nan, np.inf, -np.inf, 0.0
    flag_array, id_array = rng.random((3, 4)) > 0.3, rng.integers(0, 2, (3, 4))
    got = rlx.compile(g)(x=array, flags=flag_array, ids=id_array)
    want = {
        "nan": np.isnan(array),
        "inf": np.isinf(array),
        "finite": np.isfinite(array),
        "ids_nan": np.isnan(id_array),
        "ids_finite": np.isfinite(id_array),
        "any_axis": np.any(array, 1),
        "all_axes": np.all(array, (0, 2), keepdims=True),
        "any_flags": np.any(flag_array),
        "all_flags": np.all(flag_array, 1),
        "all_ids": np.all(id_array, 0),
    }
    for name, expected in want.items():
        assert got[name].dtype == np.bool_, name
        np.testing.assert_array_equal(got[name], expected, err_msg=name)


NORMS: list[tuple[str, Callable[[Graph, rlx.Value], rlx.Value], Callable[[np.ndarray], Any]]] = [
    ("prod-axis", lambda g, x: g.prod(x, 1), lambda a: np.prod(a, 1)),
    ("prod-all", lambda g, x: g.prod(x), lambda a: np.prod(a)),
    ("prod-axes-keep", lambda g, x: g.prod(x, (0, 2), True), lambda a: np.prod(a, (0, 2), keepdims=True)),
    ("norm-2", lambda g, x: g.vector_norm(x, 2, -1), lambda a: np.linalg.norm(a, 2, -1)),
    ("norm-1-all", lambda g, x: g.vector_norm(x, 1), lambda a: np.abs(a).sum()),
    ("norm-inf", lambda g, x: g.vector_norm(x, float("inf"), 1), lambda a: np.abs(a).max(1)),
    (
        "norm-3",
        lambda g, x: g.vector_norm(x, 3, (0, 1), True),
        lambda a: (np.abs(a) ** 3).sum((0, 1), keepdims=True) ** (1 / 3),
    ),
    (
        "tensordot-2",
        lambda g, x: g.tensordot(x, np.ones((4, 5, 2), np.float32)),
        lambda a: np.tensordot(a, np.ones((4, 5, 2))),
    ),
    (
        "tensordot-pairs",
        lambda g, x: g.tensordot(x, np.arange(18, dtype=np.float32).reshape(3, 6), ([0], [0])),
        lambda a: np.tensordot(a, np.arange(18.0).reshape(3, 6), ([0], [0])),
    ),
]


@pytest.mark.parametrize(("name", "build", "numpy_fn"), NORMS, ids=[n[0] for n in NORMS])
def test_products_norms_and_tensordot_with_gradients(
    name: str, build: Callable[..., rlx.Value], numpy_fn: Callable[[np.ndarray], Any]
) -> None:
    """Against NumPy in float64; the products' inputs hold a zero (torch's exact gradient there)."""
    shape = (3, 4, 5)
    rng = np.random.default_rng(len(name))
    g = Graph(name.replace("-", "_"))
    x = g.input("x", shape)
    y = build(g, x)
    weights = g.input("w", y.shape)
    (grad,) = rlx.grad(g, g.sum(y * weights), [x])
    g.output(y=y, grad=grad)
    array = rng.uniform(0.5, 1.5, shape).astype(np.float32) * rng.choice([-1, 1], shape).astype(np.float32)
    array[1, 2, 3] = 0.0
    w = rng.standard_normal(y.shape).astype(np.float32)
    got = rlx.compile(g)(x=array, w=w)
    np.testing.assert_allclose(got["y"], numpy_fn(array.astype(np.float64)), rtol=1e-5, atol=1e-6)
    want = np.zeros(shape)
    for index in np.ndindex(shape):
        up, down = array.astype(np.float64), array.astype(np.float64)
        up[index] += 1e-6
        down[index] -= 1e-6
        want[index] = ((numpy_fn(up) - numpy_fn(down)) * w).sum() / 2e-6
    if name.startswith("norm-1") or name.startswith("norm-inf"):  # |x| has a kink at the zero entry
        want[1, 2, 3] = got["grad"][1, 2, 3]
    np.testing.assert_allclose(got["grad"], want, rtol=1e-4, atol=1e-4)


def test_norms_at_the_origin_have_zero_gradients_and_nan_stays_nan() -> None:
    g = Graph("origin")
    x = g.input("x", (3, 4))
    two, three = g.vector_norm(x, 2, 1), g.vector_norm(x, 3, 1)
    (grad,) = rlx.grad(g, g.sum(two) + g.sum(three), [x])
    g.output(two=two, three=three, grad=grad)
    array = np.array([[0, 0, 0, 0], [3, 4, 0, 0], [np.nan, 1, 1, 1]], np.float32)
    got = rlx.compile(g)(x=array)
    np.testing.assert_allclose(got["two"][:2], [0.0, 5.0])
    assert np.isnan(got["two"][2]) and np.isnan(got["three"][2])
    np.testing.assert_array_equal(got["grad"][0], 0.0)


def test_prod_over_a_symbolic_axis_including_length_zero() -> None:
    g = Graph("symbolic_prod")
    x = g.input("x", (2, "S"))
    y = g.prod(x, 1)
    (grad,) = rlx.grad(g, g.sum(y), [x])
    g.output(y=y, grad=grad, any=g.any(x, 1))
    exe = rlx.compile(g)
    for length in (0, 1, 4):
        array = np.arange(1, 2 * length + 1, dtype=np.float32).reshape(2, length)
        got = exe(x=array)
        np.testing.assert_allclose(got["y"], np.prod(array, 1), rtol=1e-6)
        np.testing.assert_array_equal(got["any"], np.any(array, 1))  # False over no entries
        if length:
            np.testing.assert_allclose(got["grad"], np.prod(array, 1, keepdims=True) / array, rtol=1e-5)
    assert exe.compile_count == 1


def test_prod_any_and_all_are_array_methods_too() -> None:
    g = Graph("methods")
    x = g.input("x", (3, 4))
    g.output(prod=x.prod(1), any=(x > 1.0).any(0, keepdims=True), all=x.all())
    array = np.random.default_rng(9).uniform(0.5, 1.5, (3, 4)).astype(np.float32)
    got = rlx.compile(g)(x=array)
    np.testing.assert_allclose(got["prod"], array.astype(np.float64).prod(1), rtol=1e-6)
    np.testing.assert_array_equal(got["any"], (array > 1.0).any(0, keepdims=True))
    assert got["all"] == array.all()


def test_ndarray_shape_methods_and_round() -> None:
    """``size``, ``mT``, ``swapaxes``, ``flatten``/``ravel`` and ``round(x, n)`` as an ndarray has them."""
    g = Graph("ndarray_methods")
    x = g.input("x", (2, 3, 4))
    assert x.size == 24
    assert g.input("s", ("S", 3)).shape == ("S", 3)
    with pytest.raises(rlx.RlxTypeError, match="per call"):
        _ = g.inputs["s"].size
    with pytest.raises(rlx.RlxValueError, match="at least two axes"):
        _ = g.input("v", (3,)).mT
    g.output(
        mT=x.mT,
        swapped=x.swapaxes(0, -1),
        flat=x.flatten(),
        ravel=x.ravel(),
        round0=round(x),
        round2=round(x, 2),
        round_tens=round(x * 100.0, -1),
    )
    array = np.random.default_rng(12).uniform(-3, 3, (2, 3, 4)).astype(np.float32)
    got = rlx.compile(g)(x=array, s=np.zeros((5, 3), np.float32), v=np.zeros(3, np.float32))
    np.testing.assert_array_equal(got["mT"], array.mT)
    np.testing.assert_array_equal(got["swapped"], array.swapaxes(0, -1))
    np.testing.assert_array_equal(got["flat"], array.flatten())
    np.testing.assert_array_equal(got["ravel"], array.ravel())
    np.testing.assert_array_equal(got["round0"], np.round(array))
    np.testing.assert_allclose(got["round2"], np.round(array, 2), atol=1e-6)
    np.testing.assert_allclose(got["round_tens"], np.round(array * np.float32(100.0), -1), atol=1e-4)


def test_concat_of_nothing_is_a_value_error() -> None:
    g = Graph("concat_nothing")
    with pytest.raises(rlx.RlxValueError, match="at least one part"):
        g.concat([], 0)
    with pytest.raises(rlx.RlxTypeError, match="list of Values"):
        g.concat(g.input("x", (2,)), 0)  # type: ignore[arg-type]
