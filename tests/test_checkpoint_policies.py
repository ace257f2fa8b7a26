"""``rlx.checkpoint(fn, policy=...)``: which values the backward reads from the forward and
which it computes again, as ``jax.checkpoint``'s policies. Whatever the policy, the values and
gradients are the function's own; what changes is which ops run again and the memory.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import numpy as np
import pytest
from fuzz_graphs import assert_close_within_spread, graphs, rounding_spread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph
from rlx.models import transformer_block

P = rlx.checkpoint_policies


def _blocks(wrap, depth: int = 2):  # type: ignore[no-untyped-def]
    """``depth`` transformer blocks, each through ``wrap``, with the loss and every gradient."""
    g = Graph()
    h = g.input("x", (2, 16, 32))
    for i in range(depth):
        h = wrap(partial(transformer_block, g, heads=4, prefix=f"b{i}."))(h)
    loss = rlx.mean(h * h)
    xs = list(g.inputs.values())
    grads = rlx.grad(g, loss, xs)
    g.output(loss=loss, **{f"d_{x.node.attrs.name}": d for x, d in zip(xs, grads, strict=True)})
    return g


def _compiled(g: Graph) -> tuple[Counter[str], int, rlx.codegen.Executable]:
    exe = rlx.compile(g)
    return Counter(node.op.value for node in exe.graph.nodes), exe._program.plan.arena_bytes, exe


@pytest.fixture(scope="module")
def plain() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Counter[str], int]:
    g = _blocks(lambda f: f)
    rng = np.random.default_rng(0)
    arrays = {name: (rng.standard_normal(v.shape) * 0.3).astype(np.float32) for name, v in g.inputs.items()}
    ops, arena, exe = _compiled(g)
    return arrays, exe(**arrays), ops, arena


@pytest.mark.parametrize(
    ("policy", "products_again", "attention_again"),
    [
        (None, True, True),
        pytest.param(P.nothing_saveable, True, True, marks=pytest.mark.slow),  # the default itself
        (P.dots_saveable, False, True),
        pytest.param(P.checkpoint_dots, False, True, marks=pytest.mark.slow),  # dots_saveable by another name
        (P.dots_with_no_batch_dims_saveable, False, True),
        (lambda node: node.op.value == "attention", True, False),
        (P.save_from_both_policies(P.dots_saveable, lambda node: node.op.value == "attention"), False, False),
        (lambda node: True, False, False),
        (P.everything_saveable, False, False),
    ],
    ids=["default", "nothing", "dots", "checkpoint_dots", "no_batch_dims", "attention", "both", "all", "everything"],
)
def test_a_policy_decides_what_runs_again_and_nothing_else(
    plain: tuple[dict[str, np.ndarray], dict[str, np.ndarray], Counter[str], int],
    policy: object,
    products_again: bool,
    attention_again: bool,
) -> None:
    arrays, want, plain_ops, plain_arena = plain
    g = _blocks(partial(rlx.checkpoint, policy=policy))
    ops, arena, exe = _compiled(g)
    got = exe(**arrays)
    for name, value in want.items():  # the same ops on the same values: the same bits
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # Each block has four products of a weight (qkv, out, w1 and w3 side by side or not, w2):
    # with products computed again, the backward runs those of the forward once more.
    assert (ops["matmul"] > plain_ops["matmul"]) == products_again, (ops, plain_ops)
    assert ops["attention"] == plain_ops["attention"] * (2 if attention_again else 1), (ops, plain_ops)
    if products_again or attention_again:
        assert arena < plain_arena, (arena, plain_arena)


def test_a_policy_holds_through_vmap_and_second_order_gradients() -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((4, 4)) / 2).astype(np.float32)
    xs = rng.standard_normal((3, 4)).astype(np.float32)

    def f(x, w):  # type: ignore[no-untyped-def]
        return (rlx.tanh(x @ w) * x).sum()

    kept = rlx.checkpoint(f, policy=P.dots_saveable)
    np.testing.assert_allclose(rlx.hessian(kept)(xs[0], w), rlx.hessian(f)(xs[0], w), rtol=1e-5, atol=1e-6)
    per_example = rlx.vmap(rlx.grad(kept, argnums=(0, 1)), in_axes=(0, None))(xs, w)
    want = rlx.vmap(rlx.grad(f, argnums=(0, 1)), in_axes=(0, None))(xs, w)
    for mine, theirs in zip(per_example, want, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    # Against central differences of the float64 forward, too.
    eps, x = 1e-3, xs[0].astype(np.float64)
    grad_x = rlx.grad(kept)(xs[0], w)
    numeric = [
        (np.sum(np.tanh((x + eps * e) @ w) * (x + eps * e)) - np.sum(np.tanh((x - eps * e) @ w) * (x - eps * e)))
        / (2 * eps)
        for e in np.eye(4)
    ]
    np.testing.assert_allclose(grad_x, numeric, rtol=1e-3, atol=1e-4)


def test_policy_decorator_forms_and_errors() -> None:
    def f(x):  # type: ignore[no-untyped-def]
        return rlx.sin(x @ x)

    x = np.eye(3, dtype=np.float32) * 0.5
    by_partial = partial(rlx.checkpoint, policy=P.dots_saveable)(f)
    by_keyword = rlx.checkpoint(policy=P.dots_saveable)(f)
    want = rlx.grad(lambda x: f(x).sum())(x)
    for wrapped in (by_partial, by_keyword, rlx.remat(f)):
        np.testing.assert_allclose(rlx.grad(lambda x, w=wrapped: w(x).sum())(x), want, rtol=1e-6)
    for policy in (None, P.dots_saveable, P.everything_saveable):  # called on arrays: jitted
        np.testing.assert_allclose(rlx.checkpoint(f, policy=policy)(x), np.sin(x @ x), rtol=1e-6)
    assert P.checkpoint_dots is P.dots_saveable  # JAX's older names
    assert P.checkpoint_dots_with_no_batch_dims is P.dots_with_no_batch_dims_saveable
    with pytest.raises(rlx.RlxTypeError, match="policy must be a function of a node"):
        rlx.checkpoint(f, policy="dots")  # type: ignore[arg-type]
    with pytest.raises(rlx.RlxTypeError, match="second policy"):
        P.save_from_both_policies(P.dots_saveable, None)  # type: ignore[arg-type]
    with pytest.raises(rlx.RlxTypeError, match="expected a function"):
        rlx.checkpoint(None)  # type: ignore[arg-type]


def test_checkpoint_takes_static_argnums_and_prevent_cse_as_jax_does() -> None:
    def layer(x, n):  # type: ignore[no-untyped-def]
        for _ in range(n):
            x = rlx.tanh(x)
        return x

    x = np.linspace(-1, 1, 5, dtype=np.float32)
    checkpointed = rlx.checkpoint(layer, static_argnums=(1,), prevent_cse=False)
    y = np.tanh(np.tanh(x))
    want = 2 * y * (1 - y**2) * (1 - np.tanh(x) ** 2)
    np.testing.assert_allclose(rlx.grad(lambda x: (checkpointed(x, 2) ** 2).sum())(x), want, rtol=1e-5)
    np.testing.assert_allclose(checkpointed(x, 2), y, rtol=1e-6)  # on arrays: jitted, n static
    np.testing.assert_allclose(rlx.checkpoint(static_argnums=1)(layer)(x, 1), np.tanh(x), rtol=1e-6)
    with pytest.raises(rlx.RlxTypeError, match=r"argument n is static .* holds a value of a graph"):
        rlx.grad(lambda x: checkpointed(x, x.sum()).sum())(x)
    with pytest.raises(rlx.RlxValueError, match="static_argnums 4 is out of range"):
        rlx.checkpoint(layer, static_argnums=4)
    with pytest.raises(rlx.RlxTypeError, match="prevent_cse must be a bool"):
        rlx.checkpoint(layer, prevent_cse=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("policy", "products_again"),
    [
        (None, 2),
        (P.save_only_these_names("h"), 1),
        (P.save_only_these_names("h", "z"), 0),
        (P.save_any_names_but_these("z"), 1),
        (P.save_any_names_but_these(), 0),
        (P.save_anything_except_these_names("h"), 0),  # h's product is kept, as in JAX
        (P.save_from_both_policies(P.save_only_these_names("z"), P.dots_with_no_batch_dims_saveable), 0),
    ],
    ids=["default", "h", "h-z", "but-z", "any", "except-h", "both"],
)
def test_named_values_are_kept_by_name(policy: object, products_again: int) -> None:
    def f(x, w1, w2):  # type: ignore[no-untyped-def]
        h = rlx.checkpoint_name(x @ w1, "h")
        z = rlx.checkpoint_name(rlx.tanh(h) @ w2, "z")
        return rlx.sin(z).sum()

    rng = np.random.default_rng(5)
    arrays = {
        "x": rng.standard_normal((6, 5)).astype(np.float32),
        "w1": (rng.standard_normal((5, 7)) / 2).astype(np.float32),
        "w2": (rng.standard_normal((7, 3)) / 2).astype(np.float32),
    }

    def compiled(fn):  # type: ignore[no-untyped-def]
        g = Graph()
        values = [g.input(name, a.shape) for name, a in arrays.items()]
        loss, grads = rlx.value_and_grad(fn, argnums=(0, 1, 2))(*values)
        g.output(loss=loss, **{f"d{name}": d for name, d in zip(arrays, grads, strict=True)})
        exe = rlx.compile(g)
        return exe, sum(1 for node in exe.graph.nodes if node.op.value == "matmul")

    plain, plain_products = compiled(f)
    kept, products = compiled(rlx.checkpoint(f, policy=policy))
    assert products - plain_products == products_again
    want, got = plain(**arrays), kept(**arrays)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert "checkpoint_name" not in {node.op.value for node in kept.graph.nodes}  # gone before codegen


def test_checkpoint_name_checks_its_name_and_is_the_value_itself() -> None:
    g = Graph()
    x = g.input("x", (3,))
    named = rlx.checkpoint_name(x * 2.0, "doubled")
    assert named.type == x.type and named.node.attrs.name == "doubled"
    (dx,) = rlx.grad(g, rlx.sum(named * named), [x])
    g.output(y=named, dx=dx)
    got = rlx.compile(g)(x=np.array([1.0, -2.0, 0.5], np.float32))
    np.testing.assert_array_equal(got["y"], [2.0, -4.0, 1.0])
    np.testing.assert_array_equal(got["dx"], [8.0, -16.0, 4.0])
    assert str(rlx.parse(str(g))) == str(g)
    for bad in ("", 3, None):
        with pytest.raises(rlx.RlxTypeError, match="non-empty str"):
            rlx.checkpoint_name(x, bad)  # type: ignore[arg-type]
    with pytest.raises(rlx.RlxTypeError, match="names must be strs"):
        P.save_only_these_names("a", 1)  # type: ignore[arg-type]


def _forward_of(one: Graph):  # type: ignore[no-untyped-def]
    """The fuzzed graph's forward (what its loss and ``y`` outputs need) as a function of its
    inputs, replayed on whatever graph the arguments belong to."""
    wanted = [v for name, v in one.outputs.items() if not name.startswith("d_")]
    needed: set[int] = set()
    stack = [v.node for v in wanted]
    while stack:
        node = stack.pop()
        if node.id not in needed:
            needed.add(node.id)
            stack.extend(v.node for v in node.inputs)

    def forward(*args):  # type: ignore[no-untyped-def]
        graph = args[0].graph
        env = dict(zip(one.inputs.values(), args, strict=True))
        for node in one.nodes:
            if node.id in needed and node.op is not rlx.OpKind.INPUT:
                made = graph.add_node(node.op, [env[v] for v in node.inputs], node.attrs).outputs
                env.update(zip(node.outputs, made, strict=True))
        return tuple(env[v] for v in wanted)

    return forward, [name for name in one.outputs if not name.startswith("d_")]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(graphs(), st.integers(0, 2**31))
def test_random_graphs_checkpointed_under_random_policies(case: tuple[Graph, int, int], choice: int) -> None:
    """A fuzzed graph's forward checkpointed, keeping a random subset of its nodes (every op's
    gradient rule then runs on the recomputed operands and the kept results): the float64
    reference gives its gradients exactly as it gives the graph's own."""
    one, _, _ = case
    forward, names = _forward_of(one)
    rng = np.random.default_rng(choice)
    kinds = sorted({node.op.value for node in one.nodes})
    kept_kinds = {kind for kind in kinds if rng.random() < 0.5}
    g = Graph("checkpointed")
    args = [g.input(name, v.shape, dtype=v.dtype) for name, v in one.inputs.items()]
    results = rlx.checkpoint(forward, policy=lambda node: node.op.value in kept_kinds)(*args)
    outputs = dict(zip(names, results, strict=True))
    xs = [x for x in args if x.dtype == np.float32]
    grads = rlx.grad(g, outputs["loss"], xs)
    g.output(**outputs, **{f"d_{x.node.attrs.name}": d for x, d in zip(xs, grads, strict=True)})
    g.verify()
    arrays = {
        name: rng.uniform(-1.0, 1.0, v.shape) if v.dtype == np.float32 else rng.integers(0, 2, v.shape)
        for name, v in one.inputs.items()
    }
    arrays = {name: a.astype(one.inputs[name].dtype) if a.dtype.kind != "f" else a for name, a in arrays.items()}
    want = rlx.reference.evaluate(one, arrays, exact=True)
    got = rlx.reference.evaluate(g, arrays, exact=True)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=f"{name}, keeping {kept_kinds}")
    # And compiled, against its own float32 reference.
    f32 = {name: a.astype(np.float32) if a.dtype == np.float64 else a for name, a in arrays.items()}
    rounded, compiled = rlx.reference.run(g, **f32), rlx.compile(g)(**f32)
    spread = rounding_spread(g, f32, rounded)
    for name, value in rounded.items():
        assert_close_within_spread(compiled[name], value, rtol=2e-4, atol=2e-5, spread=spread[name], err_msg=name)
