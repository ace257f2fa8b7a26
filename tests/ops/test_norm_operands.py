"""Norm weights and biases given as Python numbers: SPEC 3 accepts a number wherever a float
operand is, and ``* weight`` in the formula reads a number as scaling every feature.

Values and gradients (of x; and of a tensor weight beside a number bias) are checked against
NumPy written out here, compiled and in the reference; a tensor of the wrong shape is still an
error naming the op, so broadcasting a number does not loosen the shape rule.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph


def _rms(x: np.ndarray, w: float | np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _layer(x: np.ndarray, w: float | np.ndarray, b: float | np.ndarray, eps: float) -> np.ndarray:
    centred = x - x.mean(axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + eps) * w + b


def _check(g: Graph, arrays: dict[str, np.ndarray], want: np.ndarray) -> None:
    compiled = rlx.compile(g)(**arrays)["y"]
    reference = rlx.reference.run(g, **arrays)["y"]
    np.testing.assert_allclose(reference, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(compiled, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("weight", [2.5, 3, np.float32(-0.5)], ids=["float", "int", "np.float32"])
def test_rms_norm_takes_a_number_weight(weight: object) -> None:
    g = Graph()
    x = g.input("x", (3, 7))
    g.output(y=g.rms_norm(x, weight, eps=1e-5))
    xa = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
    _check(g, {"x": xa}, _rms(xa.astype(np.float64), float(weight), 1e-5))  # type: ignore[arg-type]


def test_layer_norm_takes_number_weight_and_bias_and_differentiates() -> None:
    g = Graph()
    x = g.input("x", (4, 6))
    w = g.input("w", (6,))
    y = g.layer_norm(x, w, 0.25)
    g.output(y=y)
    loss = g.sum(y * y * g.constant(np.arange(6, dtype=np.float32)))
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(dx=dx, dw=dw)
    rng = np.random.default_rng(1)
    xa = rng.standard_normal((4, 6)).astype(np.float32)
    wa = rng.standard_normal(6).astype(np.float32)
    got = rlx.compile(g)(x=xa, w=wa)
    np.testing.assert_allclose(got["y"], _layer(xa.astype(np.float64), wa, 0.25, 1e-5), rtol=2e-5, atol=2e-5)

    def loss_of(xv: np.ndarray, wv: np.ndarray) -> float:
        return float(np.sum(_layer(xv, wv, 0.25, 1e-5) ** 2 * np.arange(6)))

    step = 1e-6
    x64, w64 = xa.astype(np.float64), wa.astype(np.float64)
    for index in [(0, 0), (2, 3), (3, 5)]:
        up, down = x64.copy(), x64.copy()
        up[index] += step
        down[index] -= step
        fd = (loss_of(up, w64) - loss_of(down, w64)) / (2 * step)
        assert got["dx"][index] == pytest.approx(fd, rel=1e-3, abs=1e-3)
    for j in (0, 4):
        up, down = w64.copy(), w64.copy()
        up[j] += step
        down[j] -= step
        assert got["dw"][j] == pytest.approx((loss_of(x64, up) - loss_of(x64, down)) / (2 * step), rel=1e-3, abs=1e-3)


def test_number_operands_follow_a_symbolic_last_axis() -> None:
    g = Graph()
    x = g.input("x", (2, "E"))
    g.output(y=g.layer_norm(x, 2.0, -1.0))
    exe = rlx.compile(g)
    for features in (3, 10):
        xa = np.random.default_rng(features).standard_normal((2, features)).astype(np.float32)
        np.testing.assert_allclose(exe(x=xa)["y"], _layer(xa.astype(np.float64), 2.0, -1.0, 1e-5), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_a_tensor_weight_of_the_wrong_shape_is_still_refused(norm: str) -> None:
    g = Graph()
    x = g.input("x", (3, 7))
    with pytest.raises(rlx.RlxValueError, match=rf"{norm}.*weight must be f32\[7\]"):
        getattr(g, norm)(x, g.constant(np.ones((1,), np.float32)))
    with pytest.raises(rlx.RlxValueError, match=rf"{norm}.*weight must be f32\[7\]"):
        getattr(g, norm)(x, np.float32(2.0) * np.ones((7, 1), np.float32))
