"""Each op's gradient rule against central finite differences of the float64 reference.

The loss is ``sum(out * w)`` over every float result with fixed random ``w``, so every element of
every result's cotangent is exercised; the graph runs in float64 throughout (``exact=True``).
"""

from __future__ import annotations

import numpy as np
import pytest
from op_samples import SAMPLES, Sample, as_params, differentiable, sample_inputs, scalar_loss

import rlx
from rlx import Graph
from rlx.reference import evaluate

EPS = 1e-6


# Two of the conv samples are slow cases here: tests/ops/test_conv.py checks every route of the
# conv gradient rule against central differences in the default run.
@pytest.mark.parametrize(
    "sample",
    as_params([s for s in SAMPLES if differentiable(s)], slow=frozenset({"conv-depthwise", "conv-flipped-cropped"})),
)
def test_gradient_matches_finite_differences(sample: Sample) -> None:
    rng = np.random.default_rng(7)
    g = Graph(sample.op)
    built = sample.build(g)
    loss = scalar_loss(g, built, rng)
    xs = [v for v in g.inputs.values() if v.dtype == np.float32]
    if loss is None or not xs:
        pytest.skip("no float result or no float input: nothing to differentiate")
    grads = rlx.grad(g, loss, xs)
    g.output(loss=loss)
    for x, grad in zip(xs, grads, strict=True):
        g.output(**{f"d_{x.node.attrs.name}": grad})
    arrays = sample_inputs(g, sample, rng)
    got = evaluate(g, arrays, exact=True)
    for x in xs:
        name = x.node.attrs.name
        numeric = np.zeros(x.shape)
        for index in np.ndindex(*x.shape):
            plus, minus = dict(arrays), dict(arrays)
            plus[name] = arrays[name].copy()
            minus[name] = arrays[name].copy()
            plus[name][index] += EPS
            minus[name][index] -= EPS
            f_plus = evaluate(g, plus, exact=True)["loss"]
            f_minus = evaluate(g, minus, exact=True)["loss"]
            numeric[index] = (f_plus - f_minus) / (2 * EPS)
        np.testing.assert_allclose(got[f"d_{name}"], numeric, rtol=1e-5, atol=1e-7, err_msg=f"d loss / d {name}")


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.id)
def test_reference_rounds_to_the_declared_types(sample: Sample) -> None:
    rng = np.random.default_rng(3)
    g = Graph(sample.op)
    built = sample.build(g)
    results = built if isinstance(built, tuple) else (built,)
    g.output(*results)
    arrays = {
        name: a.astype(np.float32) if a.dtype == np.float64 else a for name, a in sample_inputs(g, sample, rng).items()
    }
    got = rlx.reference.run(g, **arrays)
    for value, array in zip(results, got.values(), strict=True):
        assert array.shape == value.shape
        assert array.dtype == value.dtype
