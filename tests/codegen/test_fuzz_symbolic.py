"""Property: random chains of ops over a symbolic axis, including reshapes that merge it with
static axes and split it out again, and concats that grow it by static rows (``S+3``) and splits
that take them off, compile once and match the reference at several sizes, forward and
gradients."""

from __future__ import annotations

import numpy as np
import pytest
from codegen_helpers import assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph, Value
from rlx.ir.dims import Size, SizeLike, dim_text, poly
from rlx.ir.types import resolve_dims


def _elements(shape: tuple[int | str, ...]) -> SizeLike:
    total: SizeLike = 1
    for d in shape:
        total = total * poly(d)
    return total


@st.composite
def chains(draw: st.DrawFn) -> Graph:
    g = Graph("symbolic")
    lead, tail = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4, 6]))
    x = g.input("x", (lead, "S", tail))
    w = g.input("w", (tail, tail))
    v: Value = x
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(
            st.sampled_from(
                ["merge", "flatten", "restore", "unary", "matmul", "softmax", "transpose", "sum", "grow", "shrink"]
            )
        )
        symbolic = [a for a, d in enumerate(v.shape) if isinstance(d, str)]
        if kind == "merge" and v.ndim >= 2:  # (..., a, b) with a symbolic somewhere: (-1, b)
            v = g.reshape(v, (-1, v.shape[-1]))
        elif kind == "flatten":
            v = g.reshape(v, (-1,))
        elif kind == "restore" and _elements(v.shape) == lead * tail * Size.symbol("S"):
            v = g.reshape(v, (lead, "S", tail))
        elif kind == "unary":
            v = g.tanh(v) * 1.5 + v
        elif kind == "matmul" and v.shape[-1] == tail and v.ndim >= 2:
            v = v @ w
        elif kind == "softmax":
            v = g.softmax(v, axis=draw(st.integers(0, v.ndim - 1)))
        elif kind == "transpose" and v.ndim >= 2:
            v = g.transpose(v)
        elif kind == "sum" and v.ndim >= 2:
            v = g.sum(v, axis=draw(st.integers(0, v.ndim - 1)), keepdims=draw(st.booleans()))
        elif kind == "grow" and len(symbolic) == 1:  # (.., S, ..) -> (.., S+k, ..): k rows of a constant
            axis, rows = symbolic[0], draw(st.integers(1, 3))
            shape = [rows if a == axis else d for a, d in enumerate(v.shape)]
            v = g.concat(
                [v, g.constant(np.full(shape, 0.25, np.float32))]
                if draw(st.booleans())
                else [g.constant(np.full(shape, -0.5, np.float32)), v],
                axis=axis,
            )
        elif kind == "shrink" and symbolic:  # take the static rows off again: a split at a symbolic size
            axis = symbolic[0]
            static = next((c for m, c in poly(v.shape[axis]).terms if not m), 0)  # type: ignore[union-attr]
            if static:
                rest = dim_text(poly(v.shape[axis]) - static)
                first = draw(st.booleans())
                v = g.split(v, [rest, static] if first else [static, rest], axis=axis)[0 if first else 1]
    loss = g.sum(v * v)
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(y=v, loss=loss, dx=dx, dw=dw)
    return g


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=chains(), sizes=st.lists(st.integers(1, 40), min_size=2, max_size=3), seed=st.integers(0, 2**16))
def test_symbolic_chains_compile_once_and_match_the_reference(g: Graph, sizes: list[int], seed: int) -> None:
    assert str(rlx.ir.parse(str(g))) == str(g)
    exe = rlx.compile(g)
    rng = np.random.default_rng(seed)
    lead, _, tail = g.inputs["x"].shape
    for s in sizes:
        arrays = {
            "x": rng.standard_normal((lead, s, tail)).astype(np.float32),
            "w": (rng.standard_normal((tail, tail)) / tail).astype(np.float32),
        }
        got = exe(**arrays)
        expected = rlx.reference.run(g, **arrays)
        for name, want in expected.items():
            # a gradient through a softmax cancels: P * (g - sum(g * P)) with g up to the number of
            # rows summed (3 * (S + 3) at most), so its absolute error scales with g, not with it
            atol = 5e-5 if name.startswith("d") else 2e-5
            assert_close(got[name], want, f"{name} at S={s}", rtol=2e-4, atol=atol)
    # S = 0: every output has its declared shape at that size and the reference's values: products
    # whose inner dimension is empty and sums over no rows give 0, but not every gradient is 0 (a
    # softmax over a size-1 axis turns the empty sum's 0 into 1, which then meets w).
    empty_arrays = {"x": np.zeros((lead, 0, tail), np.float32), "w": np.ones((tail, tail), np.float32)}
    empty = exe(**empty_arrays)
    for name, value in g.outputs.items():
        assert empty[name].shape == resolve_dims(value.type.shape, {"S": 0}), name
    assert np.isfinite(empty["loss"])
    for name, want in rlx.reference.run(g, **empty_arrays).items():
        assert_close(empty[name], want, f"{name} at S=0", rtol=2e-4, atol=2e-5)
    assert exe.compile_count == 1


def test_an_empty_axis_summed_then_softmaxed_over_one_entry_still_meets_w() -> None:
    """The fuzzer's case where S = 0 leaves a nonzero gradient: sum over no rows is 0, a softmax over
    one entry makes it 1, and w's gradient is then 2 (the reference's value, not 0)."""
    g = Graph("empty_softmax")
    x, w = g.input("x", (1, "S", 1)), g.input("w", (1, 1))
    y = g.softmax(g.transpose(g.sum(x, axis=1)) @ w, axis=0) @ w
    loss = g.sum(y * y)
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(loss=loss, dx=dx, dw=dw)
    exe = rlx.compile(g)
    arrays = {"x": np.zeros((1, 0, 1), np.float32), "w": np.ones((1, 1), np.float32)}
    got = exe(**arrays)
    np.testing.assert_allclose(got["dw"], [[2.0]], rtol=1e-6)
    for name, want in rlx.reference.run(g, **arrays).items():
        assert_close(got[name], want, name, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("rows", [40, "S"])
def test_a_concat_part_that_reduces_a_size_1_axis_reads_lane_by_lane(rows: int | str) -> None:
    """Found by CI's fuzzer run: ``concat([c, softmax(x, axis=1)], axis=0)`` of ``x [S, 1]``, read
    flat along the joined axis, reads each part lane by lane at a scalar index, where a reduction
    still made WIDTH (equal) lanes, which the concat refused (an assertion)."""
    g = Graph("concat_of_a_reduction")
    x = g.input("x", (rows, 1))
    joined = g.concat(
        [g.constant(np.full((1, 1), -0.5, np.float32)), g.softmax(x, axis=1), g.max(x, axis=1, keepdims=True)], axis=0
    )
    loss = g.sum(joined * joined)
    (dx,) = rlx.grad(g, loss, [x])
    g.output(y=g.reshape(joined, (-1,)) * 2.0, dx=dx)
    exe = rlx.compile(g)
    for size in (40,) if rows == 40 else (1, 17, 40):
        arrays = {"x": np.random.default_rng(size).standard_normal((size, 1)).astype(np.float32)}
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name in want:
            assert_close(got[name], want[name], name, rtol=2e-4, atol=2e-5)
