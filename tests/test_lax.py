"""``rlx.lax``: JAX's control flow, unrolled while tracing, against NumPy loops, central
differences and the same computation written as a Python loop."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import central_differences

import rlx


def rnn_loss(params: dict[str, Any], xs: Any) -> Any:
    def step(h: Any, x: Any) -> tuple[Any, Any]:
        h = rlx.tanh(x @ params["wx"] + h @ params["wh"])
        return h, (h * h).sum()

    h, energies = rlx.lax.scan(step, params["h0"], xs)
    return (h * h).mean() + energies.mean()


def rnn_numpy(params: dict[str, np.ndarray], xs: np.ndarray) -> float:
    h, energies = params["h0"].astype(np.float64), []
    for x in xs:
        h = np.tanh(x @ params["wx"] + h @ params["wh"])
        energies.append((h * h).sum())
    return float((h * h).mean() + np.mean(energies))


def make_rnn(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray]:
    params = {
        "wx": (rng.standard_normal((3, 4)) * 0.5).astype(np.float32),
        "wh": (rng.standard_normal((4, 4)) * 0.5).astype(np.float32),
        "h0": (rng.standard_normal((2, 4)) * 0.5).astype(np.float32),
    }
    return params, rng.standard_normal((5, 2, 3)).astype(np.float32)


def test_scan_trains_an_rnn_with_numpys_values_and_central_differences(rng: np.random.Generator) -> None:
    params, xs = make_rnn(rng)
    value, grads = rlx.value_and_grad(rnn_loss)(params, xs)
    assert abs(float(value) - rnn_numpy(params, xs)) < 1e-5
    wide = {name: p.astype(np.float64) for name, p in params.items()}
    for name in params:
        want = central_differences(lambda: rnn_numpy(wide, xs.astype(np.float64)), wide[name])
        np.testing.assert_allclose(grads[name], want, rtol=1e-3, atol=1e-5, err_msg=name)


def test_scan_reverse_length_nests_and_arrays() -> None:
    xs = np.arange(12, dtype=np.float32).reshape(4, 3)

    def running(carry: Any, x: Any) -> tuple[Any, Any]:
        total = carry + x
        return total, {"total": total, "twice": 2.0 * x, "none": None}

    # Called on arrays: jitted, as JAX's lax functions run on arrays.
    carry, ys = rlx.lax.scan(running, np.zeros(3, np.float32), xs)
    np.testing.assert_allclose(carry, xs.sum(0))
    np.testing.assert_allclose(ys["total"], np.cumsum(xs, axis=0))
    np.testing.assert_allclose(ys["twice"], 2 * xs)
    assert ys["none"] is None
    carry, ys = rlx.lax.scan(running, np.zeros(3, np.float32), xs, reverse=True)
    np.testing.assert_allclose(ys["total"], np.cumsum(xs[::-1], axis=0)[::-1])

    @rlx.jit
    def powers(x: Any) -> Any:
        return rlx.lax.scan(lambda c, _: (c * x, c), x * 0.0 + 1.0, None, length=4)

    final, seen = powers(np.array([2.0, 3.0], np.float32))
    np.testing.assert_allclose(final, [16.0, 81.0])
    np.testing.assert_allclose(seen, [[1, 1], [2, 3], [4, 9], [8, 27]])


def test_fori_loop_and_while_loop_unroll_with_python_bounds() -> None:
    x = np.array([1.0, -2.0], np.float32)

    def doubled(x: Any) -> Any:
        return rlx.lax.fori_loop(0, 3, lambda i, v: v * 2.0 + i, x)

    want = x.copy()
    for i in range(3):
        want = want * 2 + i
    np.testing.assert_allclose(rlx.jit(doubled)(x), want)
    np.testing.assert_allclose(rlx.grad(lambda x: doubled(x).sum())(x), [8.0, 8.0])

    def halvings(x: Any) -> Any:
        count, _ = rlx.lax.while_loop(lambda s: s[0] < 5, lambda s: (s[0] + 1, s[1] * 0.5), (0, x))
        return count, rlx.lax.while_loop(lambda s: s[0] < 5, lambda s: (s[0] + 1, s[1] * 0.5), (0, x))[1]

    count, halved = rlx.jit(halvings)(x)
    assert count == 5
    np.testing.assert_allclose(halved, x / 32)


def test_cond_and_switch_select_on_values_and_pick_on_python_selectors() -> None:
    x = np.array([0.5, -1.5, 2.0], np.float32)

    def piecewise(x: Any, k: Any) -> Any:
        branches = [lambda v: v * v, lambda v: rlx.sin(v), lambda v: v + 1.0]
        return rlx.lax.switch(k, branches, x)

    for k, want in [(-1, x * x), (0, x * x), (1, np.sin(x)), (2, x + 1), (7, x + 1)]:
        by_value = rlx.jit(lambda x, k: piecewise(x, k))(x, np.array(k, np.int32))
        np.testing.assert_allclose(by_value, want, rtol=1e-6, err_msg=f"value index {k}")
        np.testing.assert_allclose(rlx.jit(piecewise)(x, k), want, rtol=1e-6, err_msg=f"Python index {k}")

    # On arrays, as JAX's run on concrete values: jitted, an array selector traced as a value.
    np.testing.assert_allclose(rlx.lax.switch(np.int32(1), [lambda v: v * v, lambda v: rlx.sin(v)], x), np.sin(x),
                               rtol=1e-6)  # fmt: skip
    np.testing.assert_allclose(rlx.lax.cond(False, lambda v: v, lambda v: rlx.exp(v), x), np.exp(x), rtol=1e-6)

    def relu_by_cond(v: Any) -> Any:
        return rlx.lax.cond(v > 0.0, lambda t: t * 3.0, lambda t: t * 0.0, v)

    # A scalar predicate per element through vmap: the gradient follows the branch taken.
    grads = rlx.grad(lambda x: rlx.vmap(relu_by_cond)(x).sum())(x)
    np.testing.assert_allclose(grads, np.where(x > 0, 3.0, 0.0))
    both = rlx.jit(lambda p, v: rlx.lax.cond(p, lambda t: (t, 1.0), lambda t: (-t, 2.0), v))
    out, number = both(np.array(True), x)
    np.testing.assert_allclose(out, x)
    assert float(number) == 1.0
    out, number = both(np.array(False), x)
    np.testing.assert_allclose(out, -x)
    assert float(number) == 2.0


def test_loops_and_branches_that_cannot_unroll_are_clear_errors() -> None:
    x = np.ones(3, np.float32)
    with pytest.raises(rlx.RlxTypeError, match="while_loop: cond_fun returned a value of the graph"):
        rlx.jit(lambda x: rlx.lax.while_loop(lambda v: v.sum() < 10.0, lambda v: v * 2.0, x))(x)
    with pytest.raises(rlx.RlxTypeError, match="fori_loop: upper is a value of the graph"):
        rlx.jit(lambda x: rlx.lax.fori_loop(0, x.sum(), lambda i, v: v, x))(x)
    with pytest.raises(rlx.RlxTypeError, match="carry leaf 0 entered the body as f32\\[3\\] and left it as f32\\[\\]"):
        rlx.jit(lambda x: rlx.lax.fori_loop(0, 2, lambda i, v: v.sum(), x))(x)
    with pytest.raises(rlx.RlxTypeError, match="f must return a pair"):
        rlx.jit(lambda x: rlx.lax.scan(lambda c, v: c, x, x))(np.ones((2, 3), np.float32))
    with pytest.raises(rlx.RlxValueError, match="xs and length disagree"):
        rlx.jit(lambda x: rlx.lax.scan(lambda c, v: (c, v), x[0], x, length=3))(np.ones((2, 3), np.float32))
    with pytest.raises(rlx.RlxTypeError, match="branches return results of different structures or types"):
        rlx.jit(lambda x: rlx.lax.cond(x.sum() > 0.0, lambda v: v, lambda v: v.sum(), x))(x)
    with pytest.raises(rlx.RlxValueError, match="selector must be a scalar"):
        rlx.jit(lambda x: rlx.lax.cond(x > 0.0, lambda v: v, lambda v: v, x))(x)


# ----------------------------------------------------------------------------- slices at run-time starts


def jax_dynamic_slice(x: np.ndarray, starts: list[int], sizes: list[int]) -> np.ndarray:
    """JAX's rule, written out: each start clamped into [0, dim - size]."""
    clamped = [min(max(int(s), 0), dim - size) for s, dim, size in zip(starts, x.shape, sizes, strict=True)]
    return x[tuple(slice(s, s + size) for s, size in zip(clamped, sizes, strict=True))]


def jax_dynamic_update_slice(x: np.ndarray, update: np.ndarray, starts: list[int]) -> np.ndarray:
    out = x.copy()
    clamped = [min(max(int(s), 0), dim - size) for s, dim, size in zip(starts, x.shape, update.shape, strict=True)]
    out[tuple(slice(s, s + size) for s, size in zip(clamped, update.shape, strict=True))] = update
    return out


@pytest.mark.parametrize("starts", [(1, 2), (-4, 9), (3, 0), (0, 5)])
def test_dynamic_slice_and_update_clamp_as_jax_with_static_and_computed_starts(starts: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(starts) + 10)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    update = rng.standard_normal((2, 3)).astype(np.float32)
    want = jax_dynamic_slice(x, list(starts), [2, 3])
    np.testing.assert_array_equal(rlx.lax.dynamic_slice(x, starts, (2, 3)), want)  # Python ints: views
    computed = [np.int32(s) for s in starts]  # arrays: inputs of the jitted call, so the starts are values
    np.testing.assert_array_equal(rlx.lax.dynamic_slice(x, computed, (2, 3)), want)
    np.testing.assert_array_equal(rlx.lax.dynamic_slice(x, [computed[0], starts[1]], (2, 3)), want)
    as_vector = np.asarray(starts, dtype=np.int64)
    np.testing.assert_array_equal(rlx.jit(lambda a, s: rlx.lax.dynamic_slice(a, s, (2, 3)))(x, as_vector), want)
    want_update = jax_dynamic_update_slice(x, update, list(starts))
    np.testing.assert_array_equal(rlx.lax.dynamic_update_slice(x, update, starts), want_update)
    np.testing.assert_array_equal(rlx.lax.dynamic_update_slice(x, update, computed), want_update)


def test_dynamic_slicing_in_one_dim() -> None:
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(rlx.lax.dynamic_slice_in_dim(x, np.int32(2), 2, axis=2), x[:, :, 2:4])
    np.testing.assert_array_equal(rlx.lax.dynamic_index_in_dim(x, np.int32(1), axis=1), x[:, 1:2])
    np.testing.assert_array_equal(rlx.lax.dynamic_index_in_dim(x, 7, axis=-1, keepdims=False), x[..., 3])
    patch = -np.ones((2, 3, 1), np.float32)
    want = x.copy()
    want[:, :, 0:1] = patch
    np.testing.assert_array_equal(rlx.lax.dynamic_update_slice_in_dim(x, patch, np.int32(-2), axis=2), want)


def test_gradients_through_slices_at_computed_starts_match_central_differences() -> None:
    """The start comes from the data (an argmax), so it is a value of the graph; the gradient of
    the slice adds into the block it read, the update's goes to the update, the rest to x."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    update = rng.standard_normal((3, 2)).astype(np.float32)
    w = rng.standard_normal((3, 2)).astype(np.float32)

    def loss(x: Any, update: Any, mask: Any) -> Any:
        row = rlx.argmax(mask)  # int64, from data that carries no gradient
        block = rlx.lax.dynamic_slice(x, (row, 1), (3, 2))
        written = rlx.lax.dynamic_update_slice(x, update * block, (row - 1, 2))
        return (block * w).sum() + (written * written).sum()

    def loss_numpy(x: np.ndarray, update: np.ndarray, mask: np.ndarray) -> float:
        row = int(np.argmax(mask))
        block = jax_dynamic_slice(x, [row, 1], [3, 2])
        written = jax_dynamic_update_slice(x, update * block, [row - 1, 2])
        return float((block * w).sum() + (written * written).sum())

    for hot in (0, 2, 5):  # a block inside, and starts clamped at either end
        mask = np.zeros(6, np.float32)
        mask[hot] = 1.0
        value, grads = rlx.value_and_grad(loss, argnums=(0, 1))(x, update, mask)
        wide_x, wide_update = x.astype(np.float64), update.astype(np.float64)
        assert abs(float(value) - loss_numpy(wide_x, wide_update, mask)) < 1e-4
        for got, wide in zip(grads, (wide_x, wide_update), strict=True):
            want = central_differences(lambda: loss_numpy(wide_x, wide_update, mask), wide)  # noqa: B023
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


def test_map_is_a_scan_without_a_carry() -> None:
    xs = np.arange(12, dtype=np.float32).reshape(3, 2, 2)
    np.testing.assert_array_equal(rlx.lax.map(lambda m: m @ m, xs), np.stack([m @ m for m in xs]))
    ys = rlx.lax.map(lambda pair: {"sum": pair[0] + pair[1], "first": pair[0]}, (xs, xs * 2))
    np.testing.assert_array_equal(ys["sum"], xs * 3)
    np.testing.assert_array_equal(ys["first"], xs)


def test_bad_slices_are_clear_errors() -> None:
    x = np.zeros((4, 5), np.float32)
    with pytest.raises(rlx.RlxValueError, match="one size per axis"):
        rlx.lax.dynamic_slice(x, (0, 0), (2,))
    with pytest.raises(rlx.RlxValueError, match="does not fit axis 1"):
        rlx.lax.dynamic_slice(x, (0, 0), (2, 6))
    with pytest.raises(rlx.RlxValueError, match="1 start"):
        rlx.lax.dynamic_slice(x, (0,), (2, 2))
    with pytest.raises(rlx.RlxTypeError, match="start 1 must be"):
        rlx.lax.dynamic_slice(x, (0, 1.5), (2, 2))
    with pytest.raises(rlx.RlxTypeError, match="scalar int value"):
        rlx.lax.dynamic_slice(x, (np.float32(1.0), 0), (2, 2))
    with pytest.raises(rlx.RlxTypeError, match="rank and dtype"):
        rlx.lax.dynamic_update_slice(x, np.zeros((2,), np.float32), (0, 0))
    with pytest.raises(rlx.RlxValueError, match="does not fit"):
        rlx.lax.dynamic_update_slice(x, np.zeros((5, 1), np.float32), (0, 0))
    with pytest.raises(rlx.RlxValueError, match="axis 2 is out of range"):
        rlx.lax.dynamic_slice_in_dim(x, 0, 1, axis=2)


def test_dynamic_slices_under_vmap_take_each_examples_start() -> None:
    xs = np.arange(2 * 5 * 4, dtype=np.float32).reshape(2, 5, 4)
    starts = np.array([1, 7], dtype=np.int32)  # the second clamps to 3
    got = rlx.vmap(lambda x, s: rlx.lax.dynamic_slice(x, (s, 0), (2, 3)))(xs, starts)
    np.testing.assert_array_equal(got, np.stack([xs[0, 1:3, 0:3], xs[1, 3:5, 0:3]]))
    patch = np.ones((2, 3), np.float32)
    got = rlx.vmap(lambda x, s: rlx.lax.dynamic_update_slice(x, patch, (s, 1)))(xs, starts)
    want = xs.copy()
    want[0, 1:3, 1:4] = 1.0
    want[1, 3:5, 1:4] = 1.0
    np.testing.assert_array_equal(got, want)
