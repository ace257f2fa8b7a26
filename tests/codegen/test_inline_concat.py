"""A ``concat`` along any axis but the last is read inline by the loop nest that consumes it:
each index reads the part it falls in. Compared with NumPy where the joined axis is an outer
loop, the vector loop (through a transpose), symbolic, and where the parts are zeros (a pad)."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph


def _run(g: Graph, **arrays: np.ndarray) -> dict[str, np.ndarray]:
    exe = rlx.compile(g)
    assert not any(kernel.name == "fused.concat" for kernel in exe.kernels), exe  # no copy of the concat
    return exe(**arrays)


@pytest.mark.parametrize("threads", [1, 2])
def test_concat_along_an_outer_axis_and_along_the_vector_lanes(threads: int) -> None:
    g = Graph("inline_concat")
    a, b = g.input("a", (3, 10, 20)), g.input("b", (3, 13, 20))
    joined = g.concat([a, b * 2.0], axis=1)  # [3, 23, 20]
    g.output(outer=g.exp(joined), lanes=g.transpose(joined, (0, 2, 1)) + 1.0)  # the joined axis last: lanes
    rng = np.random.default_rng(0)
    av, bv = rng.standard_normal((3, 10, 20), dtype=np.float32), rng.standard_normal((3, 13, 20), dtype=np.float32)
    exe = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=threads))
    got = exe(a=av, b=bv)
    want = np.concatenate([av, bv * 2.0], axis=1)
    np.testing.assert_allclose(got["outer"], np.exp(want), rtol=1e-6)
    np.testing.assert_array_equal(got["lanes"], np.transpose(want, (0, 2, 1)) + 1.0)


def test_a_sum_of_pads_is_one_loop_nest() -> None:
    """The gradient of overlapping slices: each slice's cotangent padded back, summed."""
    g = Graph("pads")
    x = g.input("x", (4, 9, 33))
    loss = g.sum(x[:, 1:, :] * x[:, :-1, :]) + g.sum(x[:, 2:5, :] ** 2)
    (dx,) = rlx.grad(g, loss, [x])
    g.output(dx=dx)
    xv = np.random.default_rng(1).standard_normal((4, 9, 33)).astype(np.float32)
    got = _run(g, x=xv)["dx"]
    want = np.zeros_like(xv)
    want[:, 1:] += xv[:, :-1]
    want[:, :-1] += xv[:, 1:]
    want[:, 2:5] += 2 * xv[:, 2:5]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_concat_with_a_symbolic_part() -> None:
    g = Graph("symbolic_concat")
    cache, new = g.input("cache", (2, "P", 20)), g.input("new", (2, 1, 20))
    joined = g.concat([cache, new], axis=1)
    g.output(y=g.transpose(joined, (0, 2, 1)) * 3.0, z=joined - 1.0)
    exe = rlx.compile(g)
    rng = np.random.default_rng(2)
    for p in (1, 17, 40):
        cv, nv = rng.standard_normal((2, p, 20), dtype=np.float32), rng.standard_normal((2, 1, 20), dtype=np.float32)
        got = exe(cache=cv, new=nv)
        want = np.concatenate([cv, nv], axis=1)
        np.testing.assert_allclose(got["y"], np.transpose(want, (0, 2, 1)) * 3.0, rtol=1e-6)
        np.testing.assert_allclose(got["z"], want - 1.0, rtol=1e-6)
    assert exe.compile_count == 1


# ----------------------------------------------------------------------------- along the lanes
#
# Joined along the axis the vector lanes run (a transpose puts it last), a concat is read a
# vector at a time: each part over the window's positions, masked to the lanes inside it, and
# the lanes selected. These check every lane against NumPy where the parts are shorter and
# longer than a vector, start and end inside one, and rows end in a partial vector.


@pytest.mark.parametrize("sizes", [(1, 30, 2), (3, 1, 5, 17), (20, 40), (2, 16, 2), (7,)])
@pytest.mark.parametrize("rows", [5, 37])
def test_parts_of_every_length_along_the_lanes(sizes: tuple[int, ...], rows: int) -> None:
    g = Graph("lanes")
    parts = [g.input(f"p{i}", (2, size, rows)) for i, size in enumerate(sizes)]
    joined = g.concat([p * float(i + 1) for i, p in enumerate(parts)], axis=1)
    g.output(y=g.transpose(joined, (0, 2, 1)) - 0.5)
    rng = np.random.default_rng(len(sizes) * rows)
    arrays = {f"p{i}": rng.standard_normal((2, size, rows)).astype(np.float32) for i, size in enumerate(sizes)}
    got = _run(g, **arrays)["y"]
    want = np.concatenate([arrays[f"p{i}"] * (i + 1) for i in range(len(sizes))], axis=1)
    np.testing.assert_array_equal(got, np.transpose(want, (0, 2, 1)) - 0.5)


def test_pads_of_pads_along_the_lanes_are_one_loop_nest_that_compiles_fast() -> None:
    """A stride-1 average pool's gradient: nine shifted pads of a channels-last cotangent,
    summed and transposed back. Read lane by lane this took seconds to compile."""
    g = Graph("pool_grad")
    x = g.input("x", (2, 8, 20, 21))
    y = g.avg_pool(x, 3, stride=1, padding=1)
    loss = g.sum(y * y)
    (dx,) = rlx.grad(g, loss, [x])
    g.output(dx=dx)
    exe = rlx.compile(g)
    assert exe.compile_times["total"] < 3.0, exe.compile_times  # 7 s read lane by lane on a fast host
    xv = np.random.default_rng(3).standard_normal((2, 8, 20, 21)).astype(np.float32)
    want = rlx.reference.evaluate(g, {"x": xv})["dx"]
    np.testing.assert_allclose(exe(x=xv)["dx"], want, rtol=1e-5, atol=1e-5)


def test_strided_parts_along_the_lanes() -> None:
    """Parts read with a stride along the joined axis (rows of buffers, joined and transposed):
    lane by lane, each position clamped into its part."""
    g = Graph("strided")
    a, b = g.input("a", (21, 3)), g.input("b", (2, 3))
    joined = g.concat([a, b * 2.0, a[:4]], axis=0)  # [27, 3]
    g.output(y=g.transpose(joined, (1, 0)) + 0.0)
    rng = np.random.default_rng(4)
    av, bv = rng.standard_normal((21, 3)).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)
    got = _run(g, a=av, b=bv)["y"]
    np.testing.assert_array_equal(got, np.concatenate([av, bv * 2.0, av[:4]], axis=0).T)


def test_gathers_inside_parts_along_the_lanes_take_only_the_parts_ids() -> None:
    """A gather inside each part, at ids computed from an int input: a lane outside its part
    must hold one of the part's ids (a 0 there would make ``4 - 0`` an id out of range)."""
    g = Graph("ids")
    table = g.input("table", (4, 3))
    a, b = g.input("a", (3, 2), dtype="int32"), g.input("b", (3, 19), dtype="int32")
    parts = [g.take_along_axis(table, 4 - g.transpose(ids, (1, 0)), axis=0) for ids in (a, b)]  # [n, 3] each
    g.output(y=g.transpose(g.concat(parts, axis=0), (1, 0)))  # [3, 21]: the joined axis along the lanes
    rng = np.random.default_rng(5)
    tv = rng.standard_normal((4, 3)).astype(np.float32)
    av, bv = rng.integers(1, 5, (3, 2)).astype(np.int32), rng.integers(1, 5, (3, 19)).astype(np.int32)
    got = rlx.compile(g)(table=tv, a=av, b=bv)["y"]
    want = [np.take_along_axis(tv, 4 - ids.T.astype(np.int64), axis=0) for ids in (av, bv)]
    np.testing.assert_array_equal(got, np.concatenate(want, axis=0).T)


def test_bool_parts_along_the_lanes() -> None:
    g = Graph("bools")
    x = g.input("x", (4, 18))
    keep = g.concat([x[:, :3] > 0.0, x[:, 3:] < 0.5], axis=1)  # [4, 18] along the lanes via a transpose
    g.output(y=g.transpose(g.where(g.transpose(keep, (1, 0)), g.transpose(x, (1, 0)), -1.0), (1, 0)))
    xv = np.random.default_rng(6).standard_normal((4, 18)).astype(np.float32)
    got = rlx.compile(g)(x=xv)["y"]
    want = np.where(np.concatenate([xv[:, :3] > 0, xv[:, 3:] < 0.5], axis=1), xv, -1.0)
    np.testing.assert_array_equal(got, want)
