"""Random graphs (``fuzz_graphs.graphs``) compiled in random orders and thread counts match the reference.

Each graph is compiled with the default pipeline in a random topological order (the memory
planner's order fuzzing) and its forward values and gradients are compared with the float64
reference interpreter.
"""

from __future__ import annotations

import math

import numpy as np
from fuzz_graphs import assert_close_within_spread, graphs, rounding_spread
from hypothesis import HealthCheck, given, settings

import rlx
from rlx import Graph
from rlx.codegen import CodegenOptions, compile_graph


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(graphs())
def test_random_graphs_compile_to_the_reference(case: tuple[Graph, int, int]) -> None:
    g, seed, threads = case
    rng = np.random.default_rng(seed)
    arrays = {name: rng.uniform(-1.5, 1.5, v.shape).astype(np.float32) for name, v in g.inputs.items()}
    want = rlx.reference.run(g, **arrays)
    exe = compile_graph(g, config=rlx.RuntimeConfig(num_threads=threads), options=CodegenOptions(order_seed=seed))
    first = exe(**arrays)
    for array in first.values():  # the second call writes into these: every element must be rewritten
        array[...] = np.nan if array.dtype.kind == "f" else 1
    del array, first
    got = exe(**arrays)
    spread = rounding_spread(g, arrays, want)
    for name in want:
        # One scale for all outputs: a gradient that is analytically zero (a layer norm's input
        # shifted by a broadcast scalar) is the float32 rounding of sums of larger terms. On top of
        # it, each entry's own sensitivity to float32 rounding (ill-conditioned random graphs).
        scale = max(1.0, *(float(np.max(np.abs(w))) for w in want.values() if w.size))
        assert got[name].shape == want[name].shape, name
        assert_close_within_spread(
            got[name], want[name], rtol=2e-4, atol=2e-5 * scale, spread=spread[name], err_msg=f"{name}\n{g}"
        )
        assert math.isfinite(float(np.sum(got[name]))) == math.isfinite(float(np.sum(want[name])))
