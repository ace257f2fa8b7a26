"""A call's steps are data: the item functions, their argument slots and item counts are constant
tables that one loop in the entry function and one in the team read, so neither function grows
with the number of kernels (an unrolled loop or a deep model has thousands), while every kernel
still gets its own pointers: checked against NumPy over a chain of steps that each read the one
before, with views at offsets, inputs, constants and a symbolic item count."""

from __future__ import annotations

import numpy as np
from codegen_helpers import function_bodies

import rlx
from rlx import Graph


def _chain(steps: int, rows: int | str = 6) -> Graph:
    g = Graph("chain")
    xs, w = g.input("xs", (steps, rows, 8)), g.input("w", (8, 8))
    h = g.input("h0", (rows, 8))
    bias = g.constant(np.linspace(-1, 1, 8, dtype=np.float32))
    for step in range(steps):
        h = g.tanh(xs[step] @ w + h[:, ::-1][:, ::-1] * 0.5 + bias)  # a view at an offset: xs[step]
    g.output(h=h)
    return g


def _reference(xs: np.ndarray, w: np.ndarray, h: np.ndarray) -> np.ndarray:
    bias = np.linspace(-1, 1, 8, dtype=np.float32)
    for x in xs:
        h = np.tanh(x @ w + h * 0.5 + bias)
    return h


def _lines(exe: rlx.Executable, name: str) -> int:
    return function_bodies(exe.optimized_llvm_ir)[name][1].count("\n")


def test_entry_and_team_do_not_grow_with_the_kernels() -> None:
    short, long = rlx.compile(_chain(4)), rlx.compile(_chain(40))
    assert len(long.kernels) > 8 * len(short.kernels) // 2  # many more steps
    assert _lines(long, "team") == _lines(short, "team")
    assert _lines(long, "rlx_entry") <= _lines(short, "rlx_entry") + 10


def test_every_step_gets_its_own_pointers() -> None:
    rng = np.random.default_rng(0)
    xs, w, h0 = (rng.standard_normal(s).astype(np.float32) for s in ((40, 6, 8), (8, 8), (6, 8)))
    got = rlx.compile(_chain(40))(xs=xs, w=w * 0.3, h0=h0)["h"]
    np.testing.assert_allclose(got, _reference(xs, w * 0.3, h0), rtol=1e-5, atol=1e-5)


def test_item_counts_a_call_decides() -> None:
    exe = rlx.compile(_chain(12, rows="R"))
    rng = np.random.default_rng(1)
    for rows in (1, 5, 33):
        xs, w, h0 = (rng.standard_normal(s).astype(np.float32) for s in ((12, rows, 8), (8, 8), (rows, 8)))
        got = exe(xs=xs, w=w * 0.3, h0=h0)["h"]
        np.testing.assert_allclose(got, _reference(xs, w * 0.3, h0), rtol=1e-5, atol=1e-5)
    assert exe.compile_count == 1
