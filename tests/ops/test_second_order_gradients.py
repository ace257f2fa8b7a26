"""Each op's gradient rule differentiated again: the rules build their cotangents from ops that
have rules themselves, so ``rlx.grad`` of a graph holding gradients works for every op.

For each op sample: ``L = sum(out * w)``, its gradients ``g_x``, then ``z = sum_x sum(g_x * u_x)``
(a directional second derivative) and ``dz/dx`` from ``rlx.grad``, at random entries against
central differences of ``z`` as the float64 reference computes it (``exact=True``): the first-order rules, checked
on their own in ``test_gradients.py``, against the second-order ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from op_samples import SAMPLES, Sample, as_params, differentiable, sample_inputs, scalar_loss

import rlx
from rlx import Graph
from rlx.reference import evaluate

EPS = 1e-5
ENTRIES = 8  # random entries of each input checked by central differences


# The programmable attention samples are slow cases here: tests/test_second_order.py and the
# mods fuzzer differentiate flex attention twice in the default run.
@pytest.mark.parametrize(
    "sample",
    as_params([s for s in SAMPLES if differentiable(s)], slow=frozenset({"flex_attention", "flex_attention_bwd"})),
)
def test_second_order_gradient_matches_finite_differences(sample: Sample) -> None:
    rng = np.random.default_rng(11)
    g = Graph(sample.op)
    built = sample.build(g)
    loss = scalar_loss(g, built, rng)
    xs = [v for v in g.inputs.values() if v.dtype == np.float32]
    if loss is None or not xs:
        pytest.skip("no float result or no float input: nothing to differentiate")
    first = rlx.grad(g, loss, xs)
    directions = [g.constant(rng.uniform(-1.0, 1.0, x.shape).astype(np.float32)) for x in xs]
    terms = [g.sum(d * u) for d, u in zip(first, directions, strict=True)]
    z = terms[0]
    for term in terms[1:]:
        z = z + term
    second = rlx.grad(g, z, xs)
    g.output(z=z, **{f"h_{x.node.attrs.name}": h for x, h in zip(xs, second, strict=True)})
    arrays = sample_inputs(g, sample, rng)
    got = evaluate(g, arrays, exact=True)
    for x in xs:
        name = x.node.attrs.name
        size = int(np.prod(x.shape, dtype=np.int64))
        entries = [np.unravel_index(flat, x.shape) for flat in rng.choice(size, min(ENTRIES, size), replace=False)]
        numeric = np.zeros(len(entries))
        for slot, index in enumerate(entries):
            values = []
            for step in (EPS, -EPS):
                moved = arrays[name].copy()
                moved[index] += step
                values.append(float(evaluate(g, {**arrays, name: moved}, exact=True)["z"]))
            numeric[slot] = (values[0] - values[1]) / (2 * EPS)
        analytic = np.array([got[f"h_{name}"][index] for index in entries])
        scale = max(1.0, float(np.max(np.abs(numeric))))
        message = f"dz / d {name} at {entries}"
        np.testing.assert_allclose(analytic, numeric, rtol=1e-4, atol=1e-5 * scale, err_msg=message)
