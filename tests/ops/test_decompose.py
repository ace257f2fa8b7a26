"""Each composite op's decomposition computes what the op's own reference computes."""

from __future__ import annotations

import numpy as np
import pytest
from op_samples import SAMPLES, Sample, sample_inputs

import rlx
from rlx import Graph
from rlx.reference import evaluate

COMPOSITE = [s for s in SAMPLES if rlx.ir.opdef.REGISTRY[s.op].decompose is not None]


def test_composites_are_the_expected_ones() -> None:
    names = {name for name, d in rlx.ir.opdef.REGISTRY.items() if d.decompose is not None}
    assert names == {
        "gelu",
        "silu",
        "softplus",
        "mean",
        "softmax",
        "log_softmax",
        "rms_norm",
        "layer_norm",
        "one_hot",
        "cross_entropy",
        "min",
        "argmax",
        "argmin",
        "conv",
        "custom_vjp",
        "custom_vjp_cotangent",
        "checkpoint_name",
    }


@pytest.mark.parametrize("sample", COMPOSITE, ids=lambda s: s.id)
def test_decomposition_matches_the_reference(sample: Sample) -> None:
    g = Graph(sample.op)
    built = sample.build(g)
    g.output(*(built if isinstance(built, tuple) else (built,)))
    arrays = sample_inputs(g, sample, np.random.default_rng(11))
    want = evaluate(g, arrays, exact=True)
    decomposed = g.copy()
    assert rlx.passes.decompose(decomposed)
    assert all(node.op.definition.decompose is None for node in decomposed.nodes)
    assert not rlx.passes.decompose(decomposed)
    got = evaluate(decomposed, arrays, exact=True)
    for name in want:
        # float32 constants (1/sqrt(2), eps, 1/n) carry float32 rounding into the float64 run.
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7)
