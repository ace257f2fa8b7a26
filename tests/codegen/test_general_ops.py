"""Every op compiled: forward and gradient graphs of each sample against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from op_samples import SAMPLES, Sample, sample_inputs

import rlx
from rlx import Graph, RuntimeConfig, Value
from rlx.ir.opdef import not_differentiable


def _f32(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {name: a.astype(np.float32) if a.dtype == np.float64 else a for name, a in arrays.items()}


def _assert_close(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float = 2e-5, atol: float = 2e-6
) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        if want[name].dtype == np.float32:
            np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.id)
@pytest.mark.parametrize("passes", [None, []], ids=["default", "as-built"])
def test_forward_compiles_to_the_reference(sample: Sample, passes: list[str] | None) -> None:
    g = Graph(sample.op)
    built = sample.build(g)
    g.output(*(built if isinstance(built, tuple) else (built,)))
    arrays = _f32(sample_inputs(g, sample, np.random.default_rng(5)))
    _assert_close(rlx.compile(g, passes=passes)(**arrays), rlx.reference.run(g, **arrays))


def _grad_graph(sample: Sample) -> Graph | None:
    g = Graph(sample.op)
    built = sample.build(g)
    results = [v for v in (built if isinstance(built, tuple) else (built,)) if v.dtype == np.float32]
    xs = [v for v in g.inputs.values() if v.dtype == np.float32]
    if not results or not xs or any(n.op.definition.grad is not_differentiable for n in g.nodes):
        return None
    rng = np.random.default_rng(1)
    loss: Value | None = None
    for value in results:
        term = g.sum(value * g.constant(rng.uniform(-1, 1, value.shape).astype(np.float32)))
        loss = term if loss is None else loss + term
    assert loss is not None
    grads = rlx.grad(g, loss, xs)
    g.output(loss=loss, **{f"d_{x.node.attrs.name}": d for x, d in zip(xs, grads, strict=True)})
    return g


GRAD_SAMPLES = [s for s in SAMPLES if _grad_graph(s) is not None]


@pytest.mark.parametrize("sample", GRAD_SAMPLES, ids=lambda s: s.id)
def test_gradient_graph_compiles_to_the_reference(sample: Sample) -> None:
    g = _grad_graph(sample)
    assert g is not None
    arrays = _f32(sample_inputs(g, sample, np.random.default_rng(6)))
    _assert_close(rlx.compile(g)(**arrays), rlx.reference.run(g, **arrays), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_results_are_bit_identical_for_any_thread_count(threads: int) -> None:
    g = Graph("norms")
    x = g.input("x", (6, 33, 70))
    w = g.input("w", (70,))
    y = g.softmax(g.rms_norm(x, w), axis=-1) * g.layer_norm(x, w)
    loss = g.mean(y * y)
    dx, dw = rlx.grad(g, loss, [x, w])
    g.output(loss=loss, dx=dx, dw=dw)
    rng = np.random.default_rng(2)
    arrays = {"x": rng.standard_normal((6, 33, 70), dtype=np.float32), "w": rng.standard_normal(70, dtype=np.float32)}
    got = rlx.compile(g, config=RuntimeConfig(num_threads=threads))(**arrays)
    base = rlx.compile(g, config=RuntimeConfig(num_threads=1))(**arrays)
    for name in got:
        np.testing.assert_array_equal(got[name], base[name])
    _assert_close(got, rlx.reference.run(g, **arrays), rtol=1e-4, atol=1e-6)


def test_bad_ids_are_refused_before_native_code() -> None:
    g = Graph("emb")
    table = g.input("table", (5, 4))
    ids = g.input("ids", (2, 3), "int64")
    g.output(y=g.embedding(table, ids))
    exe = rlx.compile(g)
    good = np.array([[0, 1, 4], [2, 3, 0]], dtype=np.int64)
    t = np.arange(20, dtype=np.float32).reshape(5, 4)
    np.testing.assert_array_equal(exe(table=t, ids=good)["y"], t[good])
    for bad in (5, -1, 2**40):
        ids_bad = good.copy()
        ids_bad[1, 2] = bad
        with pytest.raises(rlx.RlxValueError, match=r"input 'ids': .* out of range \[0, 5\)"):
            exe(table=t, ids=ids_bad)
        with pytest.raises(rlx.RlxValueError, match=r"input 'ids'"):
            rlx.reference.run(g, table=t, ids=ids_bad)


def test_views_cost_no_kernel() -> None:
    """reshape, transpose, split and broadcast_to of buffers feed BLAS and loop nests in place."""
    g = Graph("views")
    x = g.input("x", (2, 8, 12))
    w = g.input("w", (12, 6))
    q, k = g.split(x, 2, axis=-1)
    y = g.matmul(g.transpose(q, (0, 2, 1)), g.reshape(k, (2, 8, 6)))  # [2, 6, 6]
    z = g.matmul(x, w) + g.broadcast_to(g.constant(np.float32(1.0)), (2, 8, 6))
    g.output(y=y, z=z)
    exe = rlx.compile(g)
    assert [k.name for k in exe.kernels].count("matmul") == 2
    assert len(exe.kernels) == 3, str(exe)
    rng = np.random.default_rng(3)
    arrays = {
        "x": rng.standard_normal((2, 8, 12), dtype=np.float32),
        "w": rng.standard_normal((12, 6), dtype=np.float32),
    }
    _assert_close(exe(**arrays), rlx.reference.run(g, **arrays), rtol=1e-5, atol=1e-5)


def test_int_and_bool_values_move_through_views_and_come_out_with_their_dtype() -> None:
    g = Graph("ints")
    ids = g.input("ids", (2, 3), "int64")
    x = g.input("x", (2, 3))
    g.output(
        r=g.reshape(ids, (3, 2)),
        t=g.transpose(ids, (1, 0)),
        c=g.concat([ids, ids], axis=1),
        m=x > 0.5,
        w=g.where(x > 0.5, ids, g.transpose(g.transpose(ids, (1, 0)), (1, 0))),
        s=g.exp(g.sum(x)),
        k=g.constant(3.0),
        b=g.broadcast_to(g.constant(np.int32(7)), (2, 2)),
    )
    arrays = {
        "ids": np.arange(6, dtype=np.int64).reshape(2, 3),
        "x": np.random.default_rng(0).random((2, 3), np.float32),
    }
    got = rlx.compile(g)(**arrays)
    want = rlx.reference.run(g, **arrays)
    assert got["b"].dtype == np.int32 and got["m"].dtype == np.bool_ and got["r"].dtype == np.int64
    _assert_close(got, want)


@pytest.mark.parametrize("op", ["tanh", "erf", "exp", "sigmoid"])
def test_vectorised_math_is_within_a_few_ulp(op: str) -> None:
    """The lane formulas (no libm) against float64 NumPy/math over a wide range, specials kept."""
    import math

    g = Graph(op)
    x = g.input("x", (1 << 15,))
    g.output(y=getattr(g, op)(x))
    rng = np.random.default_rng(9)
    a = np.concatenate([np.linspace(-30, 30, 1 << 14), rng.standard_normal(1 << 14) * 0.7]).astype(np.float32)
    a[:4] = [np.nan, np.inf, -np.inf, -0.0]
    got = rlx.compile(g)(x=a)["y"]
    want = rlx.reference.run(g, x=a)["y"].astype(np.float64)
    exact = {"erf": np.vectorize(math.erf), "tanh": np.tanh, "exp": np.exp, "sigmoid": lambda v: 1 / (1 + np.exp(-v))}[
        op
    ](a.astype(np.float64))
    finite = np.isfinite(exact) & (np.abs(exact) > 1e-30)
    rel = np.abs(got[finite] - exact[finite]) / np.abs(exact[finite])
    assert rel.max() < 4e-7, (op, float(rel.max()), float(a[finite][rel.argmax()]))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


def test_split_of_a_split_of_row_indexed_values() -> None:
    """A split of a split shifts a row index twice (regression: the second shift was not folded)."""
    g = Graph("splits")
    x = g.input("x", (4, 6, 8))
    _, a = g.split(g.exp(x), [2, 4], axis=1)
    first, second = g.split(a, 2, axis=1)
    g.output(y=first * 2.0 + second)
    arrays = {"x": np.random.default_rng(4).standard_normal((4, 6, 8), dtype=np.float32)}
    _assert_close(rlx.compile(g)(**arrays), rlx.reference.run(g, **arrays))
