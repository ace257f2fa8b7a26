"""Every op prints and parses back: the block, the char LM, one sample per op and fuzzed graphs."""

from __future__ import annotations

import numpy as np
import pytest
from fuzz_graphs import graphs
from hypothesis import HealthCheck, given, settings
from op_samples import SAMPLES, Sample

import rlx
from rlx import Graph
from rlx.ir import parse
from rlx.models import LMConfig, char_lm, transformer_block


def assert_round_trip(g: Graph) -> None:
    text = str(g)
    parsed = parse(text)
    assert str(parsed) == text
    assert [n.attrs for n in parsed.nodes] == [n.attrs for n in g.nodes]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.id)
def test_every_op_round_trips(sample: Sample) -> None:
    g = Graph(sample.op)
    built = sample.build(g)
    g.output(*(built if isinstance(built, tuple) else (built,)))
    assert_round_trip(g)


def test_block_and_its_gradient_round_trip() -> None:
    g = Graph("block")
    x = g.input("x", (2, 8, 32))
    loss = g.mean(transformer_block(g, x, 4) ** 2.0)
    g.output(loss=loss, dx=rlx.grad(g, loss, [x])[0])
    assert_round_trip(g)
    decomposed = g.copy()
    rlx.passes.run(decomposed, list(rlx.passes.DEFAULT_PIPELINE))
    assert_round_trip(decomposed)


def test_char_lm_round_trips() -> None:
    g, loss, params = char_lm(LMConfig(vocab=7, seq=4, batch=2, embed=8, heads=2, layers=1))
    g.output(loss=loss, **{f"d.{p.node.attrs.name}": d for p, d in zip(params, rlx.grad(g, loss, params), strict=True)})
    assert_round_trip(g)


def test_constants_round_trip_bit_for_bit() -> None:
    g = Graph("c")
    values = [
        np.float32(0.1),
        np.array([np.nan, -np.inf, 1e-38, -0.0], np.float32),
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.array([True, False]),
    ]
    g.output(*(g.constant(v) for v in values))
    parsed = parse(str(g))
    for node, want in zip(parsed.nodes, values, strict=True):
        got = node.attrs.value.array
        assert got.dtype == np.asarray(want).dtype or np.asarray(want).dtype == np.float64
        np.testing.assert_array_equal(
            np.atleast_1d(got).view(np.uint8), np.atleast_1d(np.asarray(want, got.dtype)).view(np.uint8)
        )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(graphs())
def test_fuzzed_graphs_round_trip(case: tuple[Graph, int, int]) -> None:
    assert_round_trip(case[0])
