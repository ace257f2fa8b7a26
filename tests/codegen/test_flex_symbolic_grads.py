"""Gradients of the tensors a score_mod reads when their shapes name symbols: a bias
``[B, H, S, S]`` and a per-key table ``[H, S]`` whose sizes each call binds, one compilation for
every length (0 included), against the float64 reference and central differences of it."""

from __future__ import annotations

import numpy as np
import pytest
from codegen_helpers import assert_close
from helpers import central_differences

import rlx
from rlx import Graph
from rlx.reference import evaluate

H, D = 2, 8


def _graph(batch: int | str) -> Graph:
    g = Graph("learnable_bias")
    q, k, v = (g.input(name, (batch, "S", H, D)) for name in "qkv")
    bias = g.input("bias", (batch, H, "S", "S"))
    per_key = g.input("per_key", (H, "S"))

    def score_mod(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score + bias[b, h, q_idx, kv_idx] + per_key[h, kv_idx]

    out = g.attention(q, k, v, score_mod=score_mod, mask_mod=rlx.mods.causal)
    loss = g.sum(out * out)
    dq, dbias, dkey = rlx.grad(g, loss, [q, bias, per_key])
    g.output(loss=loss, out=out, dq=dq, dbias=dbias, dkey=dkey)
    return g


def _arrays(rng: np.random.Generator, batch: int, length: int) -> dict[str, np.ndarray]:
    arrays = {name: rng.standard_normal((batch, length, H, D), dtype=np.float32) for name in "qkv"}
    arrays["bias"] = rng.standard_normal((batch, H, length, length), dtype=np.float32)
    arrays["per_key"] = rng.standard_normal((H, length), dtype=np.float32)
    return arrays


@pytest.mark.parametrize("batch", ["B", 2])
def test_score_mod_tensors_of_symbolic_shape_get_gradients(batch: int | str) -> None:
    g = _graph(batch)
    assert g.outputs["dbias"].shape == (batch, H, "S", "S") and g.outputs["dkey"].shape == (H, "S")
    exe = rlx.compile(g)
    rng = np.random.default_rng(3)
    for length in (5, 33, 1, 0, 70):
        arrays = _arrays(rng, 2, length)
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name, expected in want.items():
            assert got[name].shape == expected.shape, name
            assert_close(got[name], expected, f"{name} at S={length}", rtol=2e-4, atol=2e-5)
    assert exe.compile_count == 1


def test_symbolic_score_mod_gradients_against_central_differences() -> None:
    g = _graph("B")
    rng = np.random.default_rng(4)
    arrays = _arrays(rng, 1, 4)
    got = rlx.compile(g)(**arrays)
    for name, grad in (("bias", got["dbias"]), ("per_key", got["dkey"])):
        base = arrays[name].astype(np.float64)  # perturbed in place by central_differences
        numeric = central_differences(
            lambda name=name, base=base: float(evaluate(g, {**arrays, name: base}, exact=True)["loss"]), base, eps=1e-6
        )
        scale = max(1.0, float(np.abs(numeric).max()))
        np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-4 * scale, err_msg=name)
        if name == "bias":  # keys the causal mask hides get no gradient
            hidden = np.triu(np.ones((4, 4), bool), k=1)
            assert not grad[..., hidden].any()
