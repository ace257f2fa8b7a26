"""Fused loops that run trailing axes as one flat loop (rlx.codegen.collapse).

A feature map's width (48, 12, 6) is a short innermost axis: the fused loops ran most of it in
their scalar rest. Where every read steps evenly through memory along the trailing axes, the
column loop (and a reduction's innermost loop) runs over them as one. Each case below compares
the compiled result with the float64 reference, for reads that allow the flat loop and for reads
that must keep the separate loops (a broadcast along one of the axes only, a transposed or
sliced operand, a gather), and checks from the IR which loop bound was emitted.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import rlx
from rlx import Graph, RuntimeConfig
from rlx.ir.graph import Value

N, C, H, W = 3, 5, 6, 7


def _compiled_matches(g: Graph, threads: int = 2, **arrays: np.ndarray) -> str:
    exe = rlx.compile(g, config=RuntimeConfig(num_threads=threads))
    got = exe(**arrays)
    want = rlx.reference.run(g, **arrays)
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=2e-5, atol=2e-5, err_msg=name)
    return exe.llvm_ir


def _vector_bound(ir_text: str, columns: int) -> bool:
    """The IR has a 16-lane loop over ``columns`` positions: its bound ``columns - 15``, or, for
    a loop whose last step overlaps, its steps clamped to ``columns - 16``."""
    return f"sub i64 {columns}, 15" in ir_text or f"sub i64 {columns}, 16" in ir_text


def _random(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("threads", [1, 2])
def test_batch_norm_and_silu_run_height_and_width_as_one_loop(threads: int) -> None:
    g = Graph("bn")
    x = g.input("x", (N, C, H, W))
    scale, shift = g.input("scale", (1, C, 1, 1)), g.input("shift", (C, 1, 1))
    y = x * scale + shift
    g.output(y=y * g.sigmoid(y))
    arrays = {"x": _random(N, C, H, W), "scale": _random(1, C, 1, 1, seed=1), "shift": _random(C, 1, 1, seed=2)}
    ir_text = _compiled_matches(g, threads, **arrays)
    assert _vector_bound(ir_text, H * W)


def test_same_shape_operands_run_every_axis_as_one_loop() -> None:
    g = Graph("all")
    a, b = g.input("a", (N, C, H, W)), g.input("b", (N, C, H, W))
    g.output(y=g.tanh(a) * b + 1.0)
    _compiled_matches(g, a=_random(N, C, H, W), b=_random(N, C, H, W, seed=1))  # in column chunks
    ir_text = _compiled_matches(g, 1, a=_random(N, C, H, W), b=_random(N, C, H, W, seed=1))
    assert _vector_bound(ir_text, N * C * H * W)


@pytest.mark.parametrize(
    ("shape", "columns"),
    [((H, 1), W), ((1, W), W), ((C, H, 1), W), ((C, 1, W), W), ((N, C, 1, 1), H * W), ((1, 1), N * C * H * W)],
)
def test_operands_broadcast_along_some_of_the_axes(shape: tuple[int, ...], columns: int) -> None:
    g = Graph("partial")
    x, p = g.input("x", (N, C, H, W)), g.input("p", shape)
    g.output(y=x * p - p)
    ir_text = _compiled_matches(g, 1, x=_random(N, C, H, W), p=_random(*shape, seed=1))
    assert _vector_bound(ir_text, columns)
    if columns == W:
        assert not _vector_bound(ir_text, H * W)


def test_a_transposed_operand_keeps_the_separate_loops() -> None:
    g = Graph("transposed")
    x, t = g.input("x", (N, C, H, W)), g.input("t", (N, C, W, H))
    g.output(y=x + g.transpose(t, (0, 1, 3, 2)))
    ir_text = _compiled_matches(g, x=_random(N, C, H, W), t=_random(N, C, W, H, seed=1))
    assert not _vector_bound(ir_text, H * W)


def test_a_transpose_that_keeps_the_axes_in_order_runs_them_as_one() -> None:
    g = Graph("channels")
    x, t = g.input("x", (N, C, H, W)), g.input("t", (C, N, H, W))
    g.output(y=g.exp(x) * g.transpose(t, (1, 0, 2, 3)))
    ir_text = _compiled_matches(g, x=_random(N, C, H, W), t=_random(C, N, H, W, seed=1))
    assert _vector_bound(ir_text, H * W)


@pytest.mark.parametrize("axis", [1, 2, 3])
def test_slices_along_and_across_the_axes(axis: int) -> None:
    shape = [N, C, H, W]
    shape[axis] *= 2
    g = Graph("sliced")
    x = g.input("x", tuple(shape))
    first, second = g.split(x, 2, axis=axis)
    g.output(y=first * 2.0 + g.sigmoid(second))
    _compiled_matches(g, x=_random(*shape))


@pytest.mark.parametrize("axis", [1, 2, 3])
def test_concats_along_and_across_the_axes(axis: int) -> None:
    shape = [N, C, H, W]
    g = Graph("joined")
    a, b = g.input("a", tuple(shape)), g.input("b", tuple(shape))
    joined = g.concat([g.exp(a), b * 3.0], axis=axis)
    g.output(y=joined + 1.0)
    _compiled_matches(g, a=_random(*shape), b=_random(*shape, seed=1))


@pytest.mark.parametrize(
    ("axes", "keepdims"),
    [((0, 2, 3), True), ((0, 2, 3), False), ((2, 3), False), ((1, 3), True), ((1, 2, 3), False), ((3,), True)],
)
@pytest.mark.parametrize("kind", ["sum", "mean", "max"])
def test_reductions_over_trailing_and_scattered_axes(axes: tuple[int, ...], keepdims: bool, kind: str) -> None:
    g = Graph("stats")
    x, s = g.input("x", (N, C, H, W)), g.input("s", (1, C, 1, 1))
    reduce: Callable[..., Value] = getattr(g, kind)
    g.output(r=reduce(x * s + 0.5, axis=axes, keepdims=keepdims))
    data = _random(N, C, H, W)
    data[1, 2, 3, 4] = np.nan if kind == "max" else data[1, 2, 3, 4]
    _compiled_matches(g, x=data, s=_random(1, C, 1, 1, seed=1))


def test_a_reduction_over_a_transposed_operand() -> None:
    g = Graph("stats_t")
    t = g.input("t", (N, C, W, H))
    g.output(r=g.sum(g.transpose(t, (0, 1, 3, 2)) * 2.0, axis=(2, 3)))
    _compiled_matches(g, t=_random(N, C, W, H))


def test_batch_norm_in_training_forward_and_backward() -> None:
    """Statistics over (N, H, W), the normalised map and their gradients, against central
    differences-checked float64 reference gradients."""
    g = Graph("bn_train")
    x, w = g.input("x", (N, C, H, W)), g.input("w", (1, C, 1, 1))
    mean = g.mean(x, axis=(0, 2, 3), keepdims=True)
    centred = x - mean
    var = g.mean(centred * centred, axis=(0, 2, 3), keepdims=True)
    y = centred * g.rsqrt(var + 1e-5) * w
    loss = g.sum(y * g.sigmoid(y) * g.constant(_random(N, C, H, W, seed=3)))
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(loss=loss, dx=dx, dw=dw)
    _compiled_matches(g, x=_random(N, C, H, W), w=_random(1, C, 1, 1, seed=1))


def test_symbolic_batch_keeps_static_trailing_axes_flat() -> None:
    g = Graph("symbolic")
    x, s = g.input("x", ("n", C, H, W)), g.input("s", (1, C, 1, 1))
    g.output(y=g.silu(x * s), r=g.sum(x, axis=(0, 2, 3)))
    exe = rlx.compile(g)
    assert _vector_bound(exe.llvm_ir, H * W)
    for n in (1, 4):
        arrays = {"x": _random(n, C, H, W, seed=n), "s": _random(1, C, 1, 1)}
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-5)


def test_a_gather_keeps_its_loop() -> None:
    g = Graph("gather")
    x, ids = g.input("x", (N, C, H, W)), g.input("ids", (N, C, H, W), dtype="int64")
    g.output(y=g.take_along_axis(x, ids, axis=3) * 2.0 + x)
    idx = np.random.default_rng(1).integers(0, W, (N, C, H, W))
    _compiled_matches(g, x=_random(N, C, H, W), ids=idx)


def test_a_reshape_that_splits_the_axes_is_read_through_its_view() -> None:
    g = Graph("reshaped")
    x, y = g.input("x", (N, C, H * W)), g.input("y", (N, C, H, W))
    g.output(z=g.reshape(x, (N, C, H, W)) * y + g.reshape(g.exp(x), (N, C, H, W)))
    ir_text = _compiled_matches(g, 1, x=_random(N, C, H * W), y=_random(N, C, H, W, seed=1))
    assert _vector_bound(ir_text, N * C * H * W)


# ----------------------------------------------------------------------------- masked rests
# Where the rows stay short (a window of a padded map, a transposed read), a row's last partial
# vector runs as one masked step when the body computes enough to pay for the masks.


@pytest.mark.parametrize("width", [3, 12, 16, 24, 33])
@pytest.mark.parametrize("threads", [1, 2])
def test_short_rows_of_a_window_compute_in_a_masked_step(width: int, threads: int) -> None:
    g = Graph("window")
    x = g.input("x", (2, 3, 5, width + 2))
    window = x[:, :, 1:4, 1 : width + 1]
    g.output(y=g.silu(window) / (1.0 + g.exp(-window)), copy=window + 0.0)
    ir_text = _compiled_matches(g, threads, x=_random(2, 3, 5, width + 2))
    assert "llvm.masked.store" in ir_text  # the SiLU's kernel (the copy's keeps a scalar rest)


def test_masked_steps_of_ints_bools_and_gathers() -> None:
    """Lanes past a row compute on lane 0's data: no division by a zero they never held, and no
    gathered id reported out of range."""
    g = Graph("ints")
    a, b = g.input("a", (4, 7, 9), dtype="int64"), g.input("b", (4, 9, 7), dtype="int64")
    table = g.input("table", (4, 7, 5))
    quotient = g.floor_divide(a, g.transpose(b, (0, 2, 1)))  # rows of 9, read transposed
    ids = g.remainder(quotient, 5)
    gathered = g.take_along_axis(table, g.minimum(g.maximum(ids[..., :5], 0), 4), axis=2)
    g.output(q=quotient * 3 + 1, big=g.greater(g.exp(g.sigmoid(gathered)), 1.5), got=g.tanh(gathered) * 2.0)
    rng = np.random.default_rng(3)
    b_values = rng.integers(1, 6, (4, 9, 7)) * rng.choice([-1, 1], (4, 9, 7))
    _compiled_matches(g, a=rng.integers(-50, 50, (4, 7, 9)), b=b_values, table=_random(4, 7, 5))
