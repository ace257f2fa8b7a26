"""The showcase models: a transformer block and a tiny char LM, compiled against the reference.

The block's gradients are also checked against central finite differences of the float64
reference (independent of every gradient rule), and, when torch is installed, against the same
block written in torch with torch autograd (``tests/test_models_torch.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph
from rlx.models import BLOCK_WEIGHTS, LMConfig, block_training_graph, char_lm, init_params
from rlx.reference import evaluate

block_graph = block_training_graph


def block_inputs(g: Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {}
    for name, value in g.inputs.items():
        scale = 1.0 / np.sqrt(value.shape[0]) if len(value.shape) == 2 else 1.0
        arrays[name] = (scale * rng.standard_normal(value.shape)).astype(np.float32)
        if name.endswith("norm"):
            arrays[name] = (1.0 + 0.1 * rng.standard_normal(value.shape)).astype(np.float32)
    return arrays


@pytest.mark.parametrize(("batch", "seq", "embed", "heads"), [(2, 16, 64, 4), (1, 7, 24, 3)])
def test_block_forward_and_gradients_match_the_reference(batch: int, seq: int, embed: int, heads: int) -> None:
    g = block_graph(batch, seq, embed, heads)
    arrays = block_inputs(g, 0)
    exe = rlx.compile(g)
    got = exe(**arrays)
    want = rlx.reference.run(g, **arrays)
    for name in want:
        scale = float(np.max(np.abs(want[name])))
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    assert len(exe.kernels) < len(exe.graph) / 2, "elementwise chains and reductions should fuse"


def test_block_gradients_match_finite_differences() -> None:
    g = block_graph(1, 5, 16, 2)
    rng = np.random.default_rng(4)
    arrays = {name: a.astype(np.float64) for name, a in block_inputs(g, 1).items()}
    got = evaluate(g, arrays, exact=True)
    eps = 1e-6
    for name in ["x", *BLOCK_WEIGHTS]:
        for _ in range(3):
            index = tuple(int(rng.integers(s)) for s in arrays[name].shape)
            plus, minus = dict(arrays), dict(arrays)
            plus[name], minus[name] = arrays[name].copy(), arrays[name].copy()
            plus[name][index] += eps
            minus[name][index] -= eps
            fd = (evaluate(g, plus, exact=True)["loss"] - evaluate(g, minus, exact=True)["loss"]) / (2 * eps)
            assert got[f"d_{name}"][index] == pytest.approx(float(fd), rel=1e-5, abs=1e-9), (name, index)


def test_char_lm_loss_and_gradients_compile_to_the_reference() -> None:
    config = LMConfig(vocab=11, seq=8, batch=2, embed=32, heads=2, layers=2)
    g, loss, params = char_lm(config)
    grads = rlx.grad(g, loss, params)
    g.output(loss=loss, **{f"d_{p.node.attrs.name}": d for p, d in zip(params, grads, strict=True)})
    values = init_params(g, params, seed=3)
    rng = np.random.default_rng(3)
    values["tokens"] = rng.integers(0, config.vocab, (config.batch, config.seq)).astype(np.int32)
    values["targets"] = rng.integers(0, config.vocab, (config.batch, config.seq)).astype(np.int32)
    got = rlx.compile(g)(**values)
    want = rlx.reference.run(g, **values)
    assert abs(float(want["loss"]) - np.log(config.vocab)) < 0.5  # near uniform at the start
    for name in want:
        scale = float(np.max(np.abs(want[name])))
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5 * max(scale, 1e-3), err_msg=name)


def test_block_executable_is_safe_to_call_from_several_threads() -> None:
    """Concurrent calls (each with its own arena and thread team) give the serial results bit for bit."""
    import threading

    g = block_graph(2, 16, 32, 2)
    exe = rlx.compile(g)
    inputs = [block_inputs(g, seed) for seed in range(4)]
    expected = [exe(**arrays) for arrays in inputs]
    results: dict[int, dict[str, np.ndarray]] = {}

    def work(index: int) -> None:
        for _ in range(5):
            results[index] = exe(**inputs[index])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, want in enumerate(expected):
        for name in want:
            np.testing.assert_array_equal(results[index][name], want[name], err_msg=name)
