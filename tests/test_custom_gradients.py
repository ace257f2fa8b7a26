"""``rlx.custom_vjp``, ``rlx.custom_jvp`` and ``rlx.checkpoint``: gradients the user shapes, as
``jax.custom_vjp``, ``jax.custom_jvp`` and ``jax.checkpoint``.

Checked against closed forms, finite differences of the forward (where the written gradient is
the true one), and each transform rlx has: ``rlx.grad`` on graphs and functions, gradients of
gradients, ``rlx.vmap``, ``rlx.jit``, the textual IR and the compiler.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

import rlx
from rlx import Graph, OpKind


@rlx.custom_vjp
def softplus(x):  # type: ignore[no-untyped-def]
    return rlx.log(1.0 + rlx.exp(x))


def _softplus_fwd(x):  # type: ignore[no-untyped-def]
    return softplus(x), x  # fwd may call the function itself: that is its plain forward


def _softplus_bwd(x, g):  # type: ignore[no-untyped-def]
    return (g * rlx.sigmoid(x),)


softplus.defvjp(_softplus_fwd, _softplus_bwd)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def test_a_stable_gradient_where_autodiff_overflows() -> None:
    x = np.array([-30.0, -1.0, 0.0, 2.0, 100.0], np.float32)
    naive = rlx.grad(lambda x: rlx.log(1.0 + rlx.exp(x)).sum())(x)
    assert np.isnan(naive[-1])  # exp(100) overflows float32: inf / inf
    got = rlx.grad(lambda x: softplus(x).sum())(x)
    np.testing.assert_allclose(got, _sigmoid(x), rtol=1e-6)
    np.testing.assert_allclose(softplus(np.array([0.0, 1.0], np.float32)), np.log1p(np.exp([0.0, 1.0])), rtol=1e-6)


def test_the_graph_holds_the_traced_backward_and_prints_and_parses() -> None:
    g = Graph("custom")
    x = g.input("x", (2, 3))
    y = softplus(x)
    assert y.node.op is OpKind.CUSTOM_VJP
    assert any(node.op is OpKind.CUSTOM_VJP_COTANGENT for node in g.nodes)
    loss = g.sum(y * y)
    (dx,) = rlx.grad(g, loss, [x])
    g.output(loss=loss, dx=dx)
    text = str(g)
    assert "custom_vjp_cotangent" in text and "custom_vjp " in text
    assert str(rlx.parse(text)) == text
    xa = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    want = 2 * np.log1p(np.exp(xa.astype(np.float64))) * _sigmoid(xa)
    for run in (rlx.reference.run(g, x=xa), rlx.compile(g)(x=xa), rlx.compile(g, passes=[])(x=xa)):
        np.testing.assert_allclose(run["dx"], want, rtol=1e-5, atol=1e-7)


def test_compiled_forward_keeps_nothing_of_the_backward() -> None:
    def plain(x):  # type: ignore[no-untyped-def]
        return rlx.log(1.0 + rlx.exp(x)) * 2.0

    graphs = []
    for fn in (plain, lambda x: softplus(x) * 2.0):
        g = Graph()
        g.output(y=fn(g.input("x", (4, 8))))
        graphs.append(rlx.compile(g))
    plain_exe, custom_exe = graphs
    assert len(custom_exe.kernels) == len(plain_exe.kernels)
    assert not any(n.op in (OpKind.CUSTOM_VJP, OpKind.CUSTOM_VJP_COTANGENT) for n in custom_exe.graph.nodes)
    xa = np.linspace(-3, 3, 32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_allclose(custom_exe(x=xa)["y"], plain_exe(x=xa)["y"], rtol=1e-6)


def test_straight_through_estimator() -> None:
    @rlx.custom_vjp
    def ste_round(x):  # type: ignore[no-untyped-def]
        return rlx.round(x)

    ste_round.defvjp(lambda x: (ste_round(x), None), lambda _, g: (g,))
    x = np.array([0.4, 1.6, -2.2], np.float32)
    # d/dx [round(x) * x] with round's gradient taken as 1: round(x) + x
    np.testing.assert_allclose(rlx.grad(lambda x: (ste_round(x) * x).sum())(x), np.round(x) + x)
    # without the custom gradient, round's is zero
    np.testing.assert_allclose(rlx.grad(lambda x: (rlx.round(x) * x).sum())(x), np.round(x))


def _scaled_function():  # type: ignore[no-untyped-def]
    """k * a * b and a + b, k static (nondiff), a and b differentiated, a tuple result."""

    @partial(rlx.custom_vjp, nondiff_argnums=(0,))
    def scaled(k, a, b):  # type: ignore[no-untyped-def]
        return a * b * k, a + b

    def fwd(k, a, b):  # type: ignore[no-untyped-def]
        return scaled(k, a, b), (a, b)

    def bwd(k, residuals, g):  # type: ignore[no-untyped-def]
        a, b = residuals
        g_product, g_sum = g
        return g_product * b * k + g_sum, g_product * a * k + g_sum

    scaled.defvjp(fwd, bwd)
    return scaled


def test_several_arguments_and_results_and_a_static_argument() -> None:
    scaled = _scaled_function()

    def loss(a, b):  # type: ignore[no-untyped-def]
        p, s = scaled(3.0, a, b)
        return (p * p).sum() + (s * s * s).sum()

    a = np.array([1.0, 2.0, -0.5], np.float32)
    b = np.array([0.5, -1.0, 3.0], np.float32)
    da, db = rlx.grad(loss, argnums=(0, 1))(a, b)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_allclose(da, 18 * a64 * b64 * b64 + 3 * (a64 + b64) ** 2, rtol=1e-5)
    np.testing.assert_allclose(db, 18 * a64 * a64 * b64 + 3 * (a64 + b64) ** 2, rtol=1e-5)
    # only one result used: the other's cotangent is zeros
    only = rlx.grad(lambda a, b: scaled(2.0, a, b)[1].sum(), argnums=(0, 1))(a, b)
    for got in only:
        np.testing.assert_allclose(got, np.ones(3))


def test_nested_arguments_none_cotangents_and_int_arguments() -> None:
    @rlx.custom_vjp
    def lookup(params, ids):  # type: ignore[no-untyped-def]
        return rlx.embedding(params["table"], ids) * params["scale"]

    def fwd(params, ids):  # type: ignore[no-untyped-def]
        return lookup(params, ids), (params, ids)

    def bwd(residuals, g):  # type: ignore[no-untyped-def]
        params, ids = residuals
        rows = g.graph.embedding_grad(g * params["scale"], ids, params["table"].shape[0])
        return {"table": rows, "scale": None}, None  # no gradient for scale here, none for the ids

    lookup.defvjp(fwd, bwd)
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    params = {"table": table, "scale": np.float32(2.0)}
    ids = np.array([1, 3, 1], np.int64)
    grads = rlx.grad(lambda p, i: lookup(p, i).sum())(params, ids)
    want = np.zeros((4, 3))
    np.add.at(want, ids, 2.0)
    np.testing.assert_allclose(grads["table"], want)
    assert grads["scale"] == 0.0


def test_gradients_of_gradients_differentiate_the_written_backward() -> None:
    x = np.array([0.0, 1.0, -2.0], np.float32)
    hess = rlx.hessian(lambda x: softplus(x).sum())(x)
    s = _sigmoid(x)
    np.testing.assert_allclose(hess, np.diag(s * (1 - s)), rtol=1e-5, atol=1e-7)
    second = rlx.grad(rlx.grad(lambda x: softplus(x)))(np.float32(0.5))
    np.testing.assert_allclose(second, _sigmoid(np.float32(0.5)) * (1 - _sigmoid(np.float32(0.5))), rtol=1e-5)
    # jvp is the gradient of a gradient in rlx: it runs through the written backward too
    _, tangent = rlx.jvp(lambda x: softplus(x), (x,), (np.ones(3, np.float32),))
    np.testing.assert_allclose(tangent, s, rtol=1e-6)


def test_gradient_matches_finite_differences_of_the_forward() -> None:
    scaled = _scaled_function()
    rng = np.random.default_rng(5)
    g = Graph()
    a, b = g.input("a", (2, 3)), g.input("b", (3,))
    p, s = scaled(0.7, a, b)
    loss = g.sum(rlx.tanh(p) * s + softplus(s))
    da, db = rlx.grad(g, loss, [a, b])
    g.output(loss=loss, da=da, db=db)
    arrays = {"a": rng.standard_normal((2, 3)).astype(np.float32), "b": rng.standard_normal(3).astype(np.float32)}
    got = rlx.reference.evaluate(g, arrays, exact=True)
    compiled = rlx.compile(g)(**arrays)
    for name in ("a", "b"):
        numeric = np.zeros(arrays[name].shape)
        for index in np.ndindex(*numeric.shape):
            shifted = []
            for step in (1e-6, -1e-6):
                moved = {k: v.astype(np.float64) for k, v in arrays.items()}
                moved[name][index] += step
                shifted.append(rlx.reference.evaluate(g, moved, exact=True)["loss"])
            numeric[index] = (shifted[0] - shifted[1]) / 2e-6
        np.testing.assert_allclose(got[f"d{name}"], numeric, rtol=1e-5, atol=1e-8)
        np.testing.assert_allclose(compiled[f"d{name}"], numeric, rtol=1e-4, atol=1e-5)


def test_vmap_batches_the_backward_with_the_forward() -> None:
    @rlx.custom_vjp
    def layer(w, x):  # type: ignore[no-untyped-def]
        return rlx.tanh(x @ w)

    def fwd(w, x):  # type: ignore[no-untyped-def]
        y = layer(w, x)
        return y, (w, x, y)

    def bwd(residuals, g):  # type: ignore[no-untyped-def]
        w, x, y = residuals
        dz = g * (1.0 - y * y)
        return x[:, None] * dz, dz @ w.T

    layer.defvjp(fwd, bwd)
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    xs = rng.standard_normal((5, 4)).astype(np.float32)

    def loss(w, x):  # type: ignore[no-untyped-def]
        return (layer(w, x) ** 2).sum()

    per_example = rlx.vmap(rlx.grad(loss, argnums=(0, 1)), in_axes=(None, 0))(w, xs)
    summed = rlx.grad(lambda w, xs: rlx.vmap(loss, in_axes=(None, 0))(w, xs).sum(), argnums=(0, 1))(w, xs)
    dw_total = np.zeros((4, 3))
    for i, x in enumerate(xs.astype(np.float64)):
        y = np.tanh(x @ w)
        dz = 2 * y * (1 - y * y)
        np.testing.assert_allclose(per_example[0][i], np.outer(x, dz), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(per_example[1][i], dz @ w.T, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(summed[1][i], dz @ w.T, rtol=1e-5, atol=1e-6)
        dw_total += np.outer(x, dz)
    np.testing.assert_allclose(summed[0], dw_total, rtol=1e-5, atol=1e-6)


def test_every_use_adds_its_gradient() -> None:
    x = np.array([0.3, -0.7], np.float32)
    got = rlx.grad(lambda x: (softplus(x) + 3.0 * softplus(2.0 * x)).sum())(x)
    np.testing.assert_allclose(got, _sigmoid(x) + 6.0 * _sigmoid(2 * x), rtol=1e-6)
    scaled = _scaled_function()
    same = rlx.grad(lambda a: scaled(1.0, a, a)[0].sum())(x)  # a * a: 2a
    np.testing.assert_allclose(same, 2 * x, rtol=1e-6)


def test_values_read_without_being_arguments_get_no_gradient_through_it() -> None:
    g = Graph()
    x, w = g.input("x", (3,)), g.input("w", (3,))

    @rlx.custom_vjp
    def scale(x):  # type: ignore[no-untyped-def]
        return x * w

    scale.defvjp(lambda x: (x * w, None), lambda _, ct: (ct * w,))
    dx, dw = rlx.grad(g, g.sum(scale(x)), [x, w])
    g.output(dx=dx, dw=dw)
    out = rlx.reference.run(g, x=np.ones(3, np.float32), w=np.full(3, 2.0, np.float32))
    np.testing.assert_allclose(out["dx"], 2.0)
    np.testing.assert_allclose(out["dw"], 0.0)


def test_errors_are_clear() -> None:
    g = Graph()
    x = g.input("x", (3,))

    @rlx.custom_vjp
    def undefined(x):  # type: ignore[no-untyped-def]
        return x * 2.0

    with pytest.raises(rlx.RlxValueError, match=r"undefined\.defvjp"):
        undefined(x)

    def make(fwd, bwd):  # type: ignore[no-untyped-def]
        @rlx.custom_vjp
        def f(x):  # type: ignore[no-untyped-def]
            return x * 2.0

        f.defvjp(fwd, bwd)
        return f

    with pytest.raises(rlx.RlxTypeError, match="pair"):
        make(lambda x: x * 2.0, lambda r, g: (g,))(x)
    with pytest.raises(rlx.RlxTypeError, match="one cotangent per differentiated argument"):
        make(lambda x: (x * 2.0, None), lambda r, g: g)(x)
    with pytest.raises(rlx.RlxValueError, match=r"f32\[2\].*f32\[3\]"):
        make(lambda x: (x * 2.0, None), lambda r, g: (g[:2],))(x)
    with pytest.raises(rlx.RlxTypeError, match="structure"):
        make(lambda x: (x * 2.0, None), lambda r, g: ((g, g),))(x)
    with pytest.raises(rlx.RlxTypeError, match="float32"):
        make(lambda x: (x * 2.0, None), lambda r, g: (g.astype("int32"),))(x)
    with pytest.raises(rlx.RlxTypeError, match="nondiff_argnums"):
        rlx.custom_vjp(lambda x: x, nondiff_argnums=("0",))  # type: ignore[arg-type]
    with pytest.raises(rlx.RlxTypeError, match="expected a function"):
        rlx.custom_vjp(3)  # type: ignore[arg-type]
    with pytest.raises(rlx.RlxTypeError, match="defvjp's bwd"):
        softplus.defvjp(_softplus_fwd, None)  # type: ignore[arg-type]
    before = len(g.nodes)
    with pytest.raises(rlx.RlxValueError):
        g.custom_vjp([x], [x], [], [])  # the cotangent must be a stand-in
    assert len(g.nodes) == before


def test_keyword_arguments_are_placed_by_the_signature() -> None:
    scaled = _scaled_function()
    a = np.array([1.0, 2.0], np.float32)
    b = np.array([3.0, 4.0], np.float32)
    got = rlx.grad(lambda a, b: scaled(1.0, b=b, a=a)[0].sum())(a, b)
    np.testing.assert_allclose(got, b)


# ----------------------------------------------------------------------------- rlx.checkpoint


def _residual_mlp(params, x):  # type: ignore[no-untyped-def]
    return x + rlx.gelu(x @ params["a"]) @ params["b"]


def _stack(layer, depth: int = 4):  # type: ignore[no-untyped-def]
    """A loss over ``depth`` layers, each ``layer(params_i, h)``; weights are graph inputs."""

    def loss(params, x):  # type: ignore[no-untyped-def]
        h = x
        for i in range(depth):
            h = layer(params[i], h)
        return (h * h).mean()

    return loss


def _stack_inputs(depth: int = 4, rows: int = 64, width: int = 64, hidden: int = 256) -> tuple[object, np.ndarray]:
    rng = np.random.default_rng(1)
    params = [
        {
            "a": (rng.standard_normal((width, hidden)) / np.sqrt(width)).astype(np.float32),
            "b": (rng.standard_normal((hidden, width)) / np.sqrt(hidden)).astype(np.float32),
        }
        for _ in range(depth)
    ]
    return params, rng.standard_normal((rows, width)).astype(np.float32)


def test_checkpoint_gives_autodiffs_gradients_with_less_memory() -> None:
    params, x = _stack_inputs()
    plain = rlx.jit(rlx.value_and_grad(_stack(_residual_mlp), argnums=(0, 1)))
    saved = rlx.jit(rlx.value_and_grad(_stack(rlx.checkpoint(_residual_mlp)), argnums=(0, 1)))
    (want_loss, want), (got_loss, got) = plain(params, x), saved(params, x)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for mine, theirs in zip(got[0], want[0], strict=True):
        for name in ("a", "b"):
            np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-6)

    def arena_and_matmuls(loss):  # type: ignore[no-untyped-def]
        g = Graph()
        ps = [{k: g.input(f"{k}{i}", v.shape) for k, v in p.items()} for i, p in enumerate(params)]
        xv = g.input("x", x.shape)
        value, grads = rlx.value_and_grad(loss, argnums=(0, 1))(ps, xv)
        g.output(loss=value, dx=grads[1], **{f"d{k}{i}": d[k] for i, d in enumerate(grads[0]) for k in d})
        exe = rlx.compile(g)
        matmuls = sum(1 for node in exe.graph.nodes if node.op is OpKind.MATMUL)
        return exe._program.plan.arena_bytes, matmuls

    plain_bytes, plain_matmuls = arena_and_matmuls(_stack(_residual_mlp))
    saved_bytes, saved_matmuls = arena_and_matmuls(_stack(rlx.checkpoint(_residual_mlp)))
    assert saved_matmuls == plain_matmuls + 4  # each layer's first product computed again in the backward
    assert saved_bytes < 0.7 * plain_bytes, (saved_bytes, plain_bytes)


def test_checkpoint_differentiates_what_the_function_closes_over() -> None:
    params, x = _stack_inputs(depth=2, rows=5, width=4, hidden=6)

    def loss(params, x):  # type: ignore[no-untyped-def]
        h = x
        for p in params:
            h = rlx.checkpoint(lambda h, p=p: _residual_mlp(p, h))(h)  # the weights are closed over
        return (h * h).sum()

    got = rlx.grad(loss, argnums=(0, 1))(params, x)
    want = rlx.grad(_stack(_residual_mlp, depth=2), argnums=(0, 1))(params, x)
    for mine, theirs in zip(got[0], want[0], strict=True):
        np.testing.assert_allclose(mine["a"], theirs["a"] * x.size, rtol=1e-4, atol=1e-5)  # sum, not mean
    np.testing.assert_allclose(got[1], want[1] * x.size, rtol=1e-4, atol=1e-5)


def test_checkpoint_composes() -> None:
    x = np.array([0.3, -1.2, 2.0], np.float32)

    def f(x):  # type: ignore[no-untyped-def]
        return (rlx.tanh(x) * x).sum()

    np.testing.assert_allclose(rlx.hessian(rlx.checkpoint(f))(x), rlx.hessian(f)(x), rtol=1e-5, atol=1e-6)
    xs = np.random.default_rng(4).standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_allclose(rlx.vmap(rlx.grad(rlx.checkpoint(f)))(xs), rlx.vmap(rlx.grad(f))(xs), rtol=1e-6)
    np.testing.assert_allclose(rlx.checkpoint(f)(x), (np.tanh(x) * x).sum(), rtol=1e-6)  # on arrays: jitted
    g = Graph()
    v = g.input("x", (3,))
    y = rlx.checkpoint(f)(v)
    (dx,) = rlx.grad(g, y, [v])
    g.output(dx=dx)
    assert any(node.op is OpKind.BARRIER for node in g.nodes)
    assert str(rlx.parse(str(g))) == str(g)
    with pytest.raises(rlx.RlxTypeError, match="expected a function"):
        rlx.checkpoint(None)  # type: ignore[arg-type]


def test_checkpoint_of_layers_sharing_their_weights() -> None:
    """Regression: a weight read by two checkpointed layers reaches the second both directly and
    through the first; the second's recomputation copied the first layer too and took that
    path's gradient twice."""
    params, x = _stack_inputs(depth=1, rows=4, width=8, hidden=16)

    def shared(layer):  # type: ignore[no-untyped-def]
        def loss(p, x):  # type: ignore[no-untyped-def]
            for _ in range(3):
                x = layer(p, x)  # one weight value, read by every layer
            return (x * x).mean()

        return loss

    want = rlx.grad(shared(_residual_mlp), argnums=(0, 1))(params[0], x)
    got = rlx.grad(shared(rlx.checkpoint(_residual_mlp)), argnums=(0, 1))(params[0], x)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-6)
    for name in ("a", "b"):
        np.testing.assert_allclose(got[0][name], want[0][name], rtol=1e-4, atol=1e-6)


def test_checkpoint_of_transformer_blocks_that_declare_their_weights() -> None:
    """Regression: weights a layer declares as it builds itself (``rlx.models.transformer_block``
    makes its inputs) got no gradient through the checkpoint. Causal attention recomputed too."""
    from rlx.models import transformer_block

    def build(checkpointed: bool) -> Graph:
        g = Graph()
        h = x = g.input("x", (2, 16, 32))
        for i in range(3):
            block = partial(lambda h, i: transformer_block(g, h, 4, prefix=f"l{i}."), i=i)
            h = rlx.checkpoint(block)(h) if checkpointed else block(h)
        loss = g.mean(h * h)
        xs = list(g.inputs.values())
        g.output(loss=loss, **{f"d_{v.node.attrs.name}": d for v, d in zip(xs, rlx.grad(g, loss, xs), strict=True)})
        assert x in xs
        return g

    plain, saved = build(False), build(True)
    rng = np.random.default_rng(3)
    arrays = {
        name: (rng.standard_normal(v.shape) / np.sqrt(v.shape[0])).astype(np.float32)
        for name, v in plain.inputs.items()
    }
    want, exe = rlx.compile(plain)(**arrays), rlx.compile(saved)
    got = exe(**arrays)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert sum(node.op is OpKind.ATTENTION for node in exe.graph.nodes) == 6  # 3 forward, 3 again in the backward
    assert exe._program.plan.arena_bytes < rlx.compile(plain)._program.plan.arena_bytes


# ----------------------------------------------------------------------------- rlx.custom_jvp


@rlx.custom_jvp
def log1pexp(x):  # type: ignore[no-untyped-def]
    return rlx.log(1.0 + rlx.exp(x))


@log1pexp.defjvp
def _log1pexp_jvp(primals, tangents):  # type: ignore[no-untyped-def]
    (x,), (t,) = primals, tangents
    return log1pexp(x), t * rlx.sigmoid(x)  # the rule may call the function: its plain forward


def test_custom_jvp_rule_is_used_in_reverse_and_forward_mode() -> None:
    x = np.array([0.0, 1.0, 100.0], np.float32)
    np.testing.assert_allclose(rlx.grad(lambda x: log1pexp(x).sum())(x), _sigmoid(x), rtol=1e-6)
    _, tangent = rlx.jvp(log1pexp, (x,), (np.array([1.0, 2.0, 3.0], np.float32),))
    np.testing.assert_allclose(tangent, _sigmoid(x) * [1, 2, 3], rtol=1e-6)
    s = _sigmoid(x[:2])
    np.testing.assert_allclose(rlx.hessian(lambda x: log1pexp(x).sum())(x[:2]), np.diag(s * (1 - s)), rtol=1e-5)
    np.testing.assert_allclose(log1pexp(x[:2]), np.log1p(np.exp(x[:2].astype(np.float64))), rtol=1e-6)
    per_example = rlx.vmap(rlx.grad(lambda x: log1pexp(x).sum()))(np.ones((2, 3), np.float32))
    np.testing.assert_allclose(per_example, np.full((2, 3), _sigmoid(np.float32(1.0))), rtol=1e-6)


def test_custom_jvp_per_argument_rules_and_static_arguments() -> None:
    @rlx.custom_jvp
    def f(x, y):  # type: ignore[no-untyped-def]
        return rlx.sin(x) * y

    f.defjvps(lambda tx, ans, x, y: rlx.cos(x) * tx * y, lambda ty, ans, x, y: rlx.sin(x) * ty)
    a = np.array([0.3, 1.0], np.float32)
    b = np.array([2.0, -1.0], np.float32)
    da, db = rlx.grad(lambda a, b: f(a, b).sum(), argnums=(0, 1))(a, b)
    np.testing.assert_allclose(da, np.cos(a) * b, rtol=1e-6)
    np.testing.assert_allclose(db, np.sin(a), rtol=1e-6)

    @partial(rlx.custom_jvp, nondiff_argnums=(0,))
    def scale_gradient(k, x):  # type: ignore[no-untyped-def]
        return x * 1.0

    @scale_gradient.defjvp
    def _(k, primals, tangents):  # type: ignore[no-untyped-def]
        return scale_gradient(k, *primals), tangents[0] * k

    np.testing.assert_allclose(rlx.grad(lambda x: scale_gradient(3.0, x).sum())(a), [3.0, 3.0])
    g = Graph()
    x = g.input("x", (2,))

    @rlx.custom_jvp
    def undefined(x):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(rlx.RlxValueError, match=r"undefined\.defjvp"):
        undefined(x)
    bad = rlx.custom_jvp(lambda x: x * 2.0)
    bad.defjvp(lambda primals, tangents: primals[0] * 2.0)
    with pytest.raises(rlx.RlxTypeError, match="pair"):
        bad(x)


def test_vmap_refuses_a_backward_that_varies_where_nothing_else_does() -> None:
    """A backward reading a mapped value the function does not take (its results and arguments
    the same for every example) has no batched cotangent to run on: a clear error, and the
    graph as it was."""
    g = Graph()
    x, ys = g.input("x", (3,)), g.input("ys", (4, 3))

    def per_example(x, y):  # type: ignore[no-untyped-def]
        @rlx.custom_vjp
        def double(x):  # type: ignore[no-untyped-def]
            return x * 2.0

        double.defvjp(lambda x: (double(x), None), lambda _, ct: (ct * y,))
        return double(x)

    with pytest.raises(rlx.RlxValueError, match="pass it in"):
        rlx.vmap(per_example, in_axes=(None, 0))(x, ys)
    assert len(g.nodes) == 2


def test_a_failed_call_leaves_the_graph_as_it_was() -> None:
    """Like a failed ``rlx.vmap`` or op builder: whatever ``fwd``, ``bwd``, a JVP rule or a
    checkpointed function built before it raised (or before its cotangents were refused) is
    taken out again, weights it declared included."""
    g = Graph()
    x = g.input("x", (3,))
    g.output(kept=x * 3.0)
    before = (str(g), list(g.inputs))

    def vjp_with(bwd):  # type: ignore[no-untyped-def]
        @rlx.custom_vjp
        def f(x):  # type: ignore[no-untyped-def]
            return rlx.tanh(x) * 2.0

        f.defvjp(lambda x: (f(x), rlx.exp(x)), bwd)
        return f

    def raising(*_):  # type: ignore[no-untyped-def]
        raise ZeroDivisionError("in the rule")

    with pytest.raises(rlx.RlxValueError, match=r"f32\[2\].*f32\[3\]"):
        vjp_with(lambda r, ct: (ct[:2] * r[:2],))(x)
    with pytest.raises(ZeroDivisionError):
        vjp_with(raising)(x)
    jvp = rlx.custom_jvp(lambda x: rlx.sin(x) + 1.0)
    jvp.defjvp(lambda primals, tangents: (jvp(*primals), rlx.cos(primals[0]) * tangents[0][:2]))
    with pytest.raises(rlx.RlxValueError):
        jvp(x)

    @rlx.checkpoint
    def layer(h):  # type: ignore[no-untyped-def]
        w = g.input("w_layer", (3, 3))
        return raising(rlx.tanh(h @ w))

    with pytest.raises(ZeroDivisionError):
        layer(x)
    assert (str(g), list(g.inputs)) == before
    # And the functions still work afterwards, on the same graph.
    y = vjp_with(lambda r, ct: (ct * r,))(x)
    assert rlx.grad(g, rlx.sum(y), [x])[0].type == x.type


def test_deep_checkpointed_models_build_in_time_linear_in_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each checkpointed layer differentiates its own region. That must cost the region, not
    the model built so far: no sort of the whole graph per layer (once for the outer ``grad``),
    and the nodes each layer's inner ``grad`` and copy visit stay the same from layer to layer."""
    import networkx as nx

    from rlx.models import transformer_block

    sorts = []
    real_sort = nx.lexicographical_topological_sort
    monkeypatch.setattr(nx, "lexicographical_topological_sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    added_per_layer = []
    g = Graph()
    h = g.input("x", (2, 8, 16))
    for i in range(6):
        before = len(g)
        h = rlx.checkpoint(partial(transformer_block, g, heads=2, prefix=f"b{i}."))(h)
        added_per_layer.append(len(g) - before)
    loss = rlx.mean(h * h)
    grads = rlx.grad(g, loss, list(g.inputs.values()))
    assert len(sorts) <= 1
    # The same nodes per layer after the first (which reads the graph input x in place): nothing of
    # the earlier layers is copied again.
    assert len(set(added_per_layer[1:])) == 1
    assert all(gr.type == x.type for gr, x in zip(grads, g.inputs.values(), strict=True))


def test_a_barrier_reads_its_operand_in_place() -> None:
    """A ``barrier`` over a value that has a buffer is that buffer: a product reading it (a
    checkpoint's recomputed layer reading its input) gets no copy first. Over a value computed
    inline, the barrier's own loop nest computes it."""

    def compiled(barrier: bool, inline: bool):  # type: ignore[no-untyped-def]
        g = Graph()
        x, w, a = g.input("x", (4, 4)), g.input("w", (4, 4)), g.input("a", (3,))
        y = x @ w
        held = g.barrier(y, g.sum(a)) if barrier else y
        outputs = {"z": held @ w, "y": rlx.exp(held)}
        if inline:
            outputs["u"] = g.barrier(rlx.exp(x), g.sum(a)) @ w
        g.output(**outputs)
        return g, rlx.compile(g)

    assert len(compiled(True, False)[1].kernels) == len(compiled(False, False)[1].kernels) == 3
    g, exe = compiled(True, True)
    names = [k.name for k in exe.kernels]
    assert names.count("matmul") == 3 and len(names) == 6, names  # + exp(held), sum(a), the inline copy
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(v.shape).astype(np.float32) for name, v in g.inputs.items()}
    got, want = exe(**arrays), rlx.reference.run(g, **arrays)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
