"""Regression: a fused loop nest must never reuse a value emitted inside another loop.

The emitter memoised values by ``id(loop)``; once a vector loop's object was freed, the scalar
remainder loop could get the same id and be handed the vector loop's (non-dominating) value,
which LLVM's verifier refused ("Instruction does not dominate all uses"), depending on when
the garbage collector ran. Compiling the failing shape many times catches it.
"""

from __future__ import annotations

import numpy as np

import rlx
from rlx import Graph, RuntimeConfig
from rlx.codegen import executable


def test_sum_over_a_unit_leading_axis_compiles_every_time() -> None:
    g = Graph("partials")
    partial = g.input("partial", (1, 2, 4, 37, 37))
    g.output(total=g.sum(partial, axis=0))
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 37, 37)).astype(np.float32)
    for _ in range(40):
        executable._cache.clear()
        got = rlx.compile(g, config=RuntimeConfig(num_threads=3))(partial=x)["total"]
    np.testing.assert_array_equal(got, x[0])


def test_index_keys_hold_their_loop_not_its_id() -> None:
    """Two loops are never confused, even if one's address is reused: keys compare loops by identity."""
    from llvmlite import ir

    from rlx.codegen.fused import Ix, Loop

    block = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), []), "f").append_basic_block()
    first, second = (Loop(ir.Constant(ir.IntType(64), 0), 1, True, block) for _ in range(2))
    assert Ix(first, 0, 1).key()[0] is first
    assert Ix(first, 0, 1).key() != Ix(second, 0, 1).key()
