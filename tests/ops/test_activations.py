"""The activations of ``rlx.ops.activations`` against their textbook formulas in float64 (and
torch's functions in float64 where torch is installed), gradients against central differences,
and the rollback of a failing composite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import rlx
from rlx import Graph


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


FORMULAS: dict[str, tuple[Callable[[Graph, rlx.Value], rlx.Value], Callable[[np.ndarray], np.ndarray], Any]] = {
    "leaky_relu": (
        lambda g, x: g.leaky_relu(x, 0.2),
        lambda a: np.where(a > 0, a, 0.2 * a),
        lambda F, t: F.leaky_relu(t, 0.2),
    ),
    "elu": (lambda g, x: g.elu(x, 0.7), lambda a: np.where(a > 0, a, 0.7 * np.expm1(a)), lambda F, t: F.elu(t, 0.7)),
    "celu": (
        lambda g, x: g.celu(x, 1.5),
        lambda a: np.maximum(a, 0) + np.minimum(0, 1.5 * np.expm1(a / 1.5)),
        lambda F, t: F.celu(t, 1.5),
    ),
    "selu": (
        lambda g, x: g.selu(x),
        lambda a: 1.0507009873554805 * np.where(a > 0, a, 1.6732632423543772 * np.expm1(a)),
        lambda F, t: F.selu(t),
    ),
    "relu6": (lambda g, x: g.relu6(x), lambda a: np.minimum(np.maximum(a, 0), 6), lambda F, t: F.relu6(t)),
    "hard_tanh": (
        lambda g, x: g.hard_tanh(x, -0.5, 2.0),
        lambda a: np.clip(a, -0.5, 2.0),
        lambda F, t: F.hardtanh(t, -0.5, 2.0),
    ),
    "hard_sigmoid": (lambda g, x: g.hard_sigmoid(x), lambda a: np.clip(a + 3, 0, 6) / 6, lambda F, t: F.hardsigmoid(t)),
    "hard_swish": (lambda g, x: g.hard_swish(x), lambda a: a * np.clip(a + 3, 0, 6) / 6, lambda F, t: F.hardswish(t)),
    "mish": (lambda g, x: g.mish(x), lambda a: a * np.tanh(_softplus(a)), lambda F, t: F.mish(t)),
    "log_sigmoid": (lambda g, x: g.log_sigmoid(x), lambda a: -_softplus(-a), lambda F, t: F.logsigmoid(t)),
    "softsign": (lambda g, x: g.softsign(x), lambda a: a / (1 + np.abs(a)), lambda F, t: F.softsign(t)),
    "glu": (lambda g, x: g.glu(x, 1), lambda a: a[:, :3] / (1 + np.exp(-a[:, 3:])), lambda F, t: F.glu(t, 1)),
}


@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_activation_values_and_gradients(name: str) -> None:
    build, formula, torch_call = FORMULAS[name]
    rng = np.random.default_rng(len(name))
    array = (rng.standard_normal((4, 6)) * 4).astype(np.float32)  # both sides of every kink, 3 and 6 included
    array[0, :4] = [-3.0, 3.0, 6.5, -0.5]
    g = Graph(name)
    x = g.input("x", array.shape)
    y = build(g, x)
    w = g.input("w", y.shape)
    (grad,) = rlx.grad(g, g.sum(y * w), [x])
    g.output(y=y, grad=grad)
    weights = rng.standard_normal(y.shape).astype(np.float32)
    got = rlx.compile(g)(x=array, w=weights)
    wide = array.astype(np.float64)
    np.testing.assert_allclose(got["y"], formula(wide), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rlx.reference.run(g, x=array, w=weights)["y"], formula(wide), rtol=1e-6, atol=1e-7)
    want = np.zeros(array.shape)
    for index in np.ndindex(array.shape):
        up, down = wide.copy(), wide.copy()
        up[index] += 1e-6
        down[index] -= 1e-6
        want[index] = ((formula(up) - formula(down)) * weights).sum() / 2e-6
    kinks = np.isin(array, [-3.0, 3.0, -0.5, 0.0, 6.0, 2.0])  # one-sided there; checked against torch below
    np.testing.assert_allclose(got["grad"][~kinks], want[~kinks], rtol=1e-4, atol=1e-4)
    torch = pytest.importorskip("torch")
    t = torch.tensor(wide, requires_grad=True)
    expected = torch_call(torch.nn.functional, t)
    (expected * torch.tensor(weights, dtype=torch.float64)).sum().backward()
    np.testing.assert_allclose(got["y"], expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["grad"], t.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda g, x: g.leaky_relu(x, "0.1"), rlx.RlxTypeError, r"leaky_relu: negative_slope must be a number"),
        (lambda g, x: g.elu(x, float("nan")), rlx.RlxValueError, r"elu: alpha must be finite"),
        (lambda g, x: g.celu(x, 0.0), rlx.RlxValueError, r"celu: alpha must not be 0"),
        (lambda g, x: g.hard_tanh(x, 1.0, -1.0), rlx.RlxValueError, r"hard_tanh: min_val 1.0 is above max_val"),
        (lambda g, x: g.glu(x, 0), rlx.RlxValueError, r"glu: axis 0 of f32\[3,4\] has odd size 3"),
        (lambda g, x: g.mish(g.cast(x, "int32")), rlx.RlxTypeError, r"mish: x must be f32, got i32"),
    ],
)
def test_activation_errors(build: Callable[..., Any], error: type, match: str) -> None:
    g = Graph("bad")
    x = g.input("x", (3, 4))
    with pytest.raises(error, match=match):
        build(g, x)


def test_a_failing_composite_leaves_the_graph_as_it_was() -> None:
    """As an op builder: einsum takes a diagonal before it finds the sizes disagree."""
    g = Graph("rollback")
    a, b = g.input("a", (2, 2)), g.input("b", (3, 4))
    before = str(g)
    with pytest.raises(rlx.RlxValueError, match="subscript 'i' has size 2 in one operand and 3"):
        g.einsum("ii,ij->j", a, b)
    with pytest.raises(rlx.RlxValueError, match="pad: pad_width"):
        g.pad(b, ((1, 1), (2, -1)))
    assert str(g) == before
