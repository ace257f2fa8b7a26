"""``rlx.jit``, ``rlx.grad(fn)``, ``rlx.value_and_grad`` and the ops as functions of values
(``rlx.exp(x)``): models as plain Python functions, checked against NumPy in float64 and
central differences, with the cache's behaviour and the errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import rlx


def _mlp_loss(params: dict[str, Any], x: Any, y: Any) -> Any:
    hidden = rlx.gelu(x @ params["w1"] + params["b1"], approximate="tanh")
    return ((hidden @ params["w2"] - y) ** 2).mean()


def _np_mlp_loss(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    z = x @ params["w1"] + params["b1"]
    hidden = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
    return float(((hidden @ params["w2"] - y) ** 2).mean())


def _params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "w1": (rng.standard_normal((6, 10)) / 3).astype(np.float32),
        "b1": (rng.standard_normal(10) / 3).astype(np.float32),
        "w2": (rng.standard_normal((10, 2)) / 3).astype(np.float32),
    }


def test_value_and_grad_of_a_model_matches_numpy_and_central_differences() -> None:
    rng = np.random.default_rng(0)
    params = _params(rng)
    x = rng.standard_normal((16, 6)).astype(np.float32)
    y = rng.standard_normal((16, 2)).astype(np.float32)
    step = rlx.jit(rlx.value_and_grad(_mlp_loss))
    loss, grads = step(params, x, y)
    wide = {k: v.astype(np.float64) for k, v in params.items()}
    assert float(loss) == pytest.approx(_np_mlp_loss(wide, x.astype(np.float64), y.astype(np.float64)), rel=1e-5)
    assert set(grads) == set(params) and all(grads[k].shape == params[k].shape for k in params)
    for name in params:
        direction = rng.standard_normal(params[name].shape)
        moved = [{**wide, name: wide[name] + sign * 1e-6 * direction} for sign in (1.0, -1.0)]
        numeric = (_np_mlp_loss(moved[0], x, y) - _np_mlp_loss(moved[1], x, y)) / 2e-6
        assert float(np.sum(grads[name] * direction)) == pytest.approx(numeric, rel=1e-3, abs=1e-5), name


def test_a_training_loop_compiles_once_and_learns() -> None:
    rng = np.random.default_rng(1)
    params = _params(rng)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1).astype(np.float32)

    @rlx.jit
    def sgd_step(params: dict[str, Any], x: Any, y: Any, lr: float) -> Any:
        loss, grads = rlx.value_and_grad(_mlp_loss)(params, x, y)
        return loss, {name: params[name] - lr * grads[name] for name in params}

    first = None
    for _ in range(60):
        loss, params = sgd_step(params, x, y, 0.1)
        first = float(loss) if first is None else first
    assert float(loss) < 0.5 * first
    assert sgd_step.compile_count == 1
    sgd_step(params, x, y, 0.05)  # a new static argument: a new graph
    sgd_step(params, x[:8], y[:8], 0.1)  # new shapes too
    assert sgd_step.compile_count == 3


def test_trees_static_arguments_and_nesting() -> None:
    @rlx.jit
    def inner(a: Any) -> Any:
        return rlx.softmax(a, axis=-1)

    @rlx.jit
    def outer(pair: tuple[Any, Any], scale: float = 2.0, *, names: tuple[str, ...] = ("s",)) -> Any:
        a, b = pair
        return {names[0]: inner(a) * scale, "list": [a.sum(), rlx.exp(b)], "tag": names}

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.linspace(-1, 1, 4)  # float64: taken as float32, as JAX takes it
    out = outer((a, b), 3.0, names=("p",))
    expected = np.exp(a - a.max(-1, keepdims=True))
    np.testing.assert_allclose(out["p"], 3.0 * expected / expected.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(out["list"][0], a.sum())
    assert out["list"][1].dtype == np.float32
    np.testing.assert_allclose(out["list"][1], np.exp(b), rtol=1e-6)
    assert out["tag"] == ("p",)
    graph = outer.graph((a, b), 3.0, names=("p",))
    assert set(graph.inputs) == {"pair.0", "pair.1"}


def test_static_argnums_and_argnames_as_jax_jit_takes_them() -> None:
    traced_with: list[object] = []

    def repeat(x: Any, n: Any) -> Any:
        traced_with.append(n)
        for _ in range(int(n)):  # Python control flow on n: it must be known when tracing
            x = x * 2.0
        return x

    x = np.ones(3, np.float32)
    by_number = rlx.jit(repeat, static_argnums=1)
    # A NumPy scalar is an array to jit; made static, the function gets it as it is.
    np.testing.assert_allclose(by_number(x, np.int64(3)), 8 * x)
    np.testing.assert_allclose(by_number(x, np.int64(3)), 8 * x)
    np.testing.assert_allclose(by_number(x, n=np.int64(2)), 4 * x)
    assert by_number.compile_count == 2
    assert traced_with == [3, 2] and all(isinstance(n, np.int64) for n in traced_with)
    for same in (rlx.jit(repeat, static_argnames="n"), rlx.jit(repeat, static_argnums=-1)):
        np.testing.assert_allclose(same(x, np.int64(1)), 2 * x)
    np.testing.assert_allclose(by_number(x, 3), 8 * x)  # an int is not the NumPy int of the same value
    assert by_number.compile_count == 3 and type(traced_with[-1]) is int
    with pytest.raises(rlx.RlxTypeError, match=r"static argument n \(ndarray\) is not hashable"):
        by_number(x, np.ones(2))
    with pytest.raises(rlx.RlxTypeError, match=r"argument n is static .* holds a value of a graph"):
        rlx.jit(lambda x: by_number(x, x.sum()))(x)
    with pytest.raises(rlx.RlxValueError, match="static_argnums 2 is out of range for repeat's 2 positional"):
        rlx.jit(repeat, static_argnums=(0, 2))
    with pytest.raises(rlx.RlxValueError, match=r"static_argnames \['m'\] are not parameters of repeat"):
        rlx.jit(repeat, static_argnames=("n", "m"))
    with pytest.raises(rlx.RlxTypeError, match="static_argnums must be an int or a sequence of ints"):
        rlx.jit(repeat, static_argnums="n")  # type: ignore[arg-type]


def test_grad_of_a_function_argnums_and_aux() -> None:
    def f(a: Any, b: Any, ids: Any) -> Any:
        picked = rlx.embedding(a, ids)
        return (picked * b).sum(), picked.max()

    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    b = np.array([1.0, -2.0, 0.5], np.float32)
    ids = np.array([3, 0, 3])
    (ga, gb), aux = rlx.grad(f, argnums=(0, 1), has_aux=True)(a, b, ids)
    expected_ga = np.zeros_like(a)
    np.add.at(expected_ga, ids, b)
    np.testing.assert_allclose(ga, expected_ga)
    np.testing.assert_allclose(gb, a[ids].sum(0))
    assert float(aux) == a[ids].max()
    value, gb_only = rlx.value_and_grad(lambda b: (b * b).sum())(b)
    np.testing.assert_allclose(gb_only, 2 * b)
    assert float(value) == pytest.approx(float((b * b).sum()))


def test_python_floats_are_differentiated_as_jax_grad_takes_them() -> None:
    a = np.ones((2, 3), np.float32)
    assert float(rlx.grad(lambda x: x * x)(3.0)) == 6.0
    assert float(rlx.grad(lambda x, n: x.sum() * n, argnums=1)(a, 2.0)) == 6.0
    value, grads = rlx.value_and_grad(lambda p: p["a"] * p["b"])({"a": 2.0, "b": np.float32(5.0)})
    assert (float(value), float(grads["a"]), float(grads["b"])) == (10.0, 5.0, 2.0)


def test_errors_are_clear() -> None:
    a = np.ones((2, 3), np.float32)
    with pytest.raises(rlx.RlxTypeError, match="scalar value"):
        rlx.grad(lambda x: x * 2.0)(a)
    with pytest.raises(rlx.RlxTypeError, match="only arrays have gradients"):
        rlx.grad(lambda x, n: x.sum() * n, argnums=1)(a, 2)
    with pytest.raises(rlx.RlxValueError, match="no array"):  # it used to wait on its own lock forever
        rlx.grad(lambda n: 2.0)(3)
    with pytest.raises(rlx.RlxValueError, match="argnums 3"):
        rlx.grad(lambda x: x.sum(), argnums=3)(a)
    with pytest.raises(rlx.RlxValueError, match="argnums must be"):
        rlx.grad(lambda x: x.sum(), argnums=-1)
    with pytest.raises(rlx.RlxTypeError, match="neither an array"):
        rlx.jit(lambda x, opts: x * 2.0)(a, _Unhashable())
    with pytest.raises(rlx.RlxTypeError, match="missing a required argument"):
        rlx.jit(lambda x, y: x + y)(a)
    with pytest.raises(rlx.RlxTypeError, match="none of its arguments is a value"):
        rlx.softmax(a)
    constant = rlx.jit(lambda x: (5, "five"))
    assert constant(a) == (5, "five")  # nothing of the graph returned: nothing compiled, nothing run
    with pytest.raises(rlx.RlxValueError, match="nothing was compiled"):
        constant.graph(a)
    with pytest.raises(rlx.RlxTypeError, match="expected a function"):
        rlx.jit(3)  # type: ignore[arg-type]
    assert rlx.where(True, 1.0, 2.0) == 1.0 and rlx.exp(0.0) == 1.0  # numbers: the mods' meaning


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


def test_op_functions_build_in_their_operands_graph() -> None:
    g = rlx.Graph("functions")
    x = g.input("x", (2, 3))
    y = rlx.concat([rlx.tanh(x), rlx.maximum(x, 0.5)], axis=0)
    g.output(y=y, p=rlx.power(x, 2.0))
    array = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    got = rlx.compile(g)(x=array)
    np.testing.assert_allclose(got["y"], np.concatenate([np.tanh(array), np.maximum(array, 0.5)]), rtol=1e-6)
    np.testing.assert_allclose(got["p"], array**2, rtol=1e-6)
    assert rlx.softmax is rlx.softmax  # one function per name
    with pytest.raises(AttributeError):
        _ = rlx.input  # graph management is not a function of values


def test_transforms_of_a_jitted_function() -> None:
    """Regression: a transform of a jitted function (``rlx.grad(rlx.jit(f))``, as JAX composes
    them) ran the inner function's compiled graph instead: functools.wraps copied the jitted
    function's cache into the transform's own jitted form."""
    f = rlx.jit(lambda x: (x * x).sum())
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_allclose(rlx.grad(f)(x), 2 * x)
    value, grads = rlx.value_and_grad(f)(x)
    assert value == 5.0
    np.testing.assert_allclose(grads, 2 * x)
    np.testing.assert_allclose(rlx.vmap(f)(np.ones((2, 3), np.float32)), [3.0, 3.0])
    np.testing.assert_allclose(rlx.jit(rlx.grad(f))(x), 2 * x)
    assert f(x) == 5.0
