"""``rlx.vjp``, ``rlx.jvp``, ``rlx.jacrev``, ``rlx.jacfwd`` and ``rlx.hessian`` against central
differences and closed forms."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import rlx
from rlx import Graph, MaskKind

RNG = np.random.default_rng(5)
X = RNG.standard_normal(3).astype(np.float32)
W = RNG.standard_normal((4, 3)).astype(np.float32)


def _layer(x: Any, w: Any) -> Any:
    return rlx.tanh(w @ x)


def _numeric_jacobian(fn: Any, args: list[np.ndarray], position: int, eps: float = 1e-3) -> np.ndarray:
    """d fn / d args[position] by central differences in float64 NumPy: shape out + arg."""
    base = np.asarray(fn(*args))
    arg = args[position].astype(np.float64)
    jac = np.zeros(base.shape + arg.shape)
    for index in np.ndindex(*arg.shape):
        plus, minus = arg.copy(), arg.copy()
        plus[index] += eps
        minus[index] -= eps
        up = [*args[:position], plus, *args[position + 1 :]]
        down = [*args[:position], minus, *args[position + 1 :]]
        jac[(..., *index)] = (np.asarray(fn(*up)) - np.asarray(fn(*down))) / (2 * eps)
    return jac


def _numpy_layer(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.tanh(w @ x)


@pytest.mark.parametrize("transform", [rlx.jacrev, rlx.jacfwd])
def test_jacobians_match_central_differences(transform: Any) -> None:
    for position in (0, 1):
        got = transform(_layer, argnums=position)(X, W)
        want = _numeric_jacobian(_numpy_layer, [X, W], position)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    both = transform(_layer, argnums=(0, 1))(X, W)
    assert isinstance(both, tuple) and [b.shape for b in both] == [(4, 3), (4, 4, 3)]


@pytest.mark.parametrize("transform", [rlx.jacrev, rlx.jacfwd])
def test_jacobians_of_nested_results_and_arguments(transform: Any) -> None:
    params = {"w": W, "b": RNG.standard_normal(4).astype(np.float32)}

    def model(p: Any, x: Any) -> Any:
        h = p["w"] @ x + p["b"]
        return {"h": h, "energy": (h * h).sum()}, x.sum()

    jac = transform(model)(params, X)
    out, total = jac
    assert out["h"]["w"].shape == (4, 4, 3) and out["h"]["b"].shape == (4, 4)
    assert out["energy"]["w"].shape == (4, 3) and total["b"].shape == (4,)
    np.testing.assert_allclose(out["h"]["b"], np.eye(4), atol=1e-6)
    h = W @ X + params["b"]
    np.testing.assert_allclose(out["energy"]["w"], 2 * np.outer(h, X), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(total["w"], np.zeros((4, 3)), atol=0)


def test_hessian_closed_form_and_has_aux() -> None:
    def f(x: Any) -> Any:
        return (x**3).sum() + x[0] * x[1]

    want = np.diag(6 * X.astype(np.float64))
    want[0, 1] += 1
    want[1, 0] += 1
    np.testing.assert_allclose(rlx.hessian(f)(X), want, rtol=1e-5, atol=1e-5)

    def softmax_energy(x: Any, w: Any) -> Any:
        p = rlx.softmax(w @ x)
        return (p * p).sum(), p

    got, aux = rlx.hessian(softmax_energy, has_aux=True)(X, W)
    gradient = lambda x: rlx.grad(lambda x: softmax_energy(x, W)[0])(x.astype(np.float32))  # noqa: E731
    numeric = _numeric_jacobian(gradient, [X.astype(np.float64)], 0)
    np.testing.assert_allclose(got, numeric, rtol=2e-3, atol=2e-4)
    np.testing.assert_allclose(got, got.T, rtol=1e-4, atol=1e-6)  # a Hessian is symmetric
    assert aux.shape == (4,)


def test_jvp_and_vjp_agree_with_the_jacobian() -> None:
    jac = rlx.jacrev(_layer)(X, W)
    v = RNG.standard_normal(3).astype(np.float32)
    out, tangent = rlx.jvp(_layer, (X, W), (v, np.zeros_like(W)))
    np.testing.assert_allclose(out, _numpy_layer(X, W), rtol=1e-6)
    np.testing.assert_allclose(tangent, jac @ v, rtol=1e-5, atol=1e-6)
    u = RNG.standard_normal(4).astype(np.float32)
    out, pullback = rlx.vjp(_layer, X, W)
    dx, dw = pullback(u)
    np.testing.assert_allclose(dx, u @ jac, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, np.outer(u * (1 - np.tanh(W @ X) ** 2), X), rtol=1e-5, atol=1e-6)
    # The pullback of arrays runs one compiled function, whatever the cotangent.
    again, _ = pullback(2 * u)
    np.testing.assert_allclose(again, 2 * dx, rtol=1e-5)
    # With aux, and a scalar tangent broadcast to its primal (a number stands for an array).
    _, tangent, aux = rlx.jvp(lambda x: (rlx.exp(x), x.sum()), (X,), (1.0,), has_aux=True)
    np.testing.assert_allclose(tangent, np.exp(X), rtol=1e-6)
    np.testing.assert_allclose(aux, X.sum(), rtol=1e-6)


def test_inside_a_graph_and_under_jit() -> None:
    g = Graph()
    x = g.input("x", (3,))
    w = g.input("w", (4, 3))
    jac = rlx.jacfwd(_layer)(x, w)
    _, tangent = rlx.jvp(_layer, (x, w), (g.constant(np.ones(3, np.float32)), g.constant(np.zeros((4, 3), np.float32))))
    g.output(jac=jac, tangent=tangent)
    got = rlx.compile(g)(x=X, w=W)
    want = rlx.reference.run(g, x=X, w=W)
    np.testing.assert_allclose(got["jac"], want["jac"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["tangent"], got["jac"].sum(axis=1), rtol=1e-5, atol=1e-6)
    jitted = rlx.jit(lambda x, w: rlx.jacrev(_layer)(x, w) - rlx.jacfwd(_layer)(x, w))
    np.testing.assert_allclose(jitted(X, W), np.zeros((4, 3)), atol=1e-6)


def test_jacobian_through_attention() -> None:
    q = RNG.standard_normal((1, 3, 1, 2)).astype(np.float32)
    k = RNG.standard_normal((1, 3, 1, 2)).astype(np.float32)
    v = RNG.standard_normal((1, 3, 1, 2)).astype(np.float32)

    def attend(q: Any) -> Any:  # the attention builder takes values only: k and v as constants
        return rlx.attention(q, q.graph.constant(k), q.graph.constant(v), mask=MaskKind.CAUSAL)

    def numpy_attend(q: np.ndarray) -> np.ndarray:
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(2)
        s = np.where(np.tril(np.ones((3, 3), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.einsum("bhqk,bkhd->bqhd", p, v)

    want = _numeric_jacobian(numpy_attend, [q.astype(np.float64)], 0)
    for transform in (rlx.jacrev, rlx.jacfwd):
        np.testing.assert_allclose(transform(attend)(q), want, rtol=1e-3, atol=1e-4)


def test_errors() -> None:
    with pytest.raises(rlx.RlxTypeError, match="only float arrays"):
        rlx.jacrev(lambda i: i * 2)(np.arange(3, dtype=np.int32))
    with pytest.raises(rlx.RlxValueError, match="shape"):
        rlx.jvp(_layer, (X, W), (np.ones(4, np.float32), np.zeros_like(W)))
    with pytest.raises(rlx.RlxValueError, match="1 primals but 2 tangents"):
        rlx.jvp(rlx.exp, (X,), (X, X))
    with pytest.raises(rlx.RlxTypeError, match="tuples"):
        rlx.jvp(rlx.exp, X, X)
    _, pullback = rlx.vjp(lambda x: (rlx.exp(x), x), X)
    with pytest.raises(rlx.RlxValueError, match="structure"):
        pullback(np.ones(3, np.float32))
    with pytest.raises(rlx.RlxTypeError, match="expected a function"):
        rlx.jacfwd(3)
