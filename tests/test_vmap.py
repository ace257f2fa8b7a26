"""``rlx.vmap``: every op's batching rule against the op run example by example, and the
transform's contract (axes, nesting, composition with grad and jit, errors)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fuzz_graphs import assert_close_within_spread, graphs, rounding_spread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_samples import SAMPLES, Sample, sample_inputs

import rlx
from rlx import Graph, MaskKind, Value
from rlx.ops._batching import batch_by_unrolling, batch_elementwise
from rlx.reference import evaluate

EXAMPLES = 3


class _Bound:
    """A graph whose ``input`` hands out given values: a sample's build run on vmap's stand-ins."""

    def __init__(self, graph: Graph, values: dict[str, Value]) -> None:
        self._graph = graph
        self._values = values

    def input(self, name: str, shape: object, dtype: object = "float32") -> Value:
        return self._values[name]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._graph, attr)


def _patterns(names: list[str]) -> list[tuple[bool, ...]]:
    """All inputs mapped, and each one mapped alone (the others shared)."""
    patterns = [tuple(True for _ in names)]
    if len(names) > 1:
        patterns += [tuple(i == j for j in range(len(names))) for i in range(len(names))]
    return patterns


def _cases() -> list[Any]:
    cases = []
    for sample in SAMPLES:
        g = Graph(sample.op)
        sample.build(g)
        for pattern in _patterns(list(g.inputs)):
            label = "".join("m" if flag else "s" for flag in pattern)
            cases.append(pytest.param(sample, pattern, id=f"{sample.id}-{label}"))
    return cases


def _batched_graph(sample: Sample, pattern: tuple[bool, ...]) -> tuple[Graph, Graph, int]:
    """The sample's graph for one example, and the same under vmap with ``pattern``'s inputs mapped."""
    one = Graph(sample.op)
    results = sample.build(one)
    one.output(*(results if isinstance(results, tuple) else (results,)))
    names = list(one.inputs)
    many = Graph(f"{sample.op}_vmap")
    values = []
    for name, flag in zip(names, pattern, strict=True):
        value = one.inputs[name]
        shape = (EXAMPLES, *value.shape) if flag else value.shape
        values.append(many.input(name, shape, dtype=value.dtype))

    def per_example(*args: Value) -> Any:
        return sample.build(_Bound(many, dict(zip(names, args, strict=True))))

    in_axes = tuple(0 if flag else None for flag in pattern)
    batched = rlx.vmap(per_example, in_axes=in_axes)(*values)
    many.output(*(batched if isinstance(batched, tuple) else (batched,)))
    return one, many, len(names)


def _arrays(
    one: Graph, sample: Sample, pattern: tuple[bool, ...]
) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    examples = [sample_inputs(one, sample, rng) for _ in range(EXAMPLES)]
    shared = examples[0]
    for example in examples:  # shared inputs are the same for every example
        for name, flag in zip(one.inputs, pattern, strict=True):
            if not flag:
                example[name] = shared[name]
    stacked = {
        name: np.stack([e[name] for e in examples]) if flag else shared[name]
        for name, flag in zip(one.inputs, pattern, strict=True)
    }
    return examples, stacked


@pytest.mark.parametrize(("sample", "pattern"), _cases())
def test_batching_rule_matches_the_op_example_by_example(sample: Sample, pattern: tuple[bool, ...]) -> None:
    one, many, _ = _batched_graph(sample, pattern)
    many.verify()
    assert not [name for name in many.inputs if name.startswith("vmap_example")], "stand-ins left in the graph"
    examples, stacked = _arrays(one, sample, pattern)
    got = evaluate(many, stacked, exact=True)
    for i, example in enumerate(examples):
        want = evaluate(one, example, exact=True)
        for (name, value), array in zip(want.items(), got.values(), strict=True):
            np.testing.assert_allclose(array[i], value, rtol=1e-10, atol=1e-12, err_msg=f"{name}, example {i}")
    # The op is built once for all examples, unless its rule is to unroll.
    base = sum(node.op.value == sample.op for node in one.nodes)
    count = sum(node.op.value == sample.op for node in many.nodes)
    if rlx.ir.opdef.REGISTRY[sample.op].batch is batch_by_unrolling:
        assert count == EXAMPLES * base
    else:
        assert count <= base


def _compiled_cases() -> list[Any]:
    """Every sample but the programmable attention (which unrolls); the elementwise ops share one
    rule, so all but a few of them are slow cases (``-m slow``)."""
    cases = []
    for sample in SAMPLES:
        if sample.op in ("flex_attention", "flex_attention_bwd"):
            continue
        shared_rule = rlx.ir.opdef.REGISTRY[sample.op].batch is batch_elementwise
        slow = shared_rule and sample.op not in ("add", "where", "cast", "gelu", "matmul", "bitwise_xor")
        cases.append(pytest.param(sample, id=sample.id, marks=[pytest.mark.slow] if slow else []))
    return cases


@pytest.mark.parametrize("sample", _compiled_cases())
def test_batched_graph_compiles_to_the_reference(sample: Sample) -> None:
    one = Graph(sample.op)
    sample.build(one)
    pattern = tuple(True for _ in one.inputs)
    one, many, _ = _batched_graph(sample, pattern)
    _, stacked = _arrays(one, sample, pattern)
    arrays = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in stacked.items()}
    want = rlx.reference.run(many, **arrays)
    got = rlx.compile(many)(**arrays)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-4, err_msg=name)


def test_registry_names_a_batching_rule_for_every_op_with_operands() -> None:
    for name, definition in rlx.ir.opdef.REGISTRY.items():
        if definition.operands:
            assert definition.batch is not None, f"{name} has no batching rule"


# ----------------------------------------------------------------------------- the transform


RNG = np.random.default_rng(0)
XS = RNG.standard_normal((5, 3, 4)).astype(np.float32)
W = RNG.standard_normal((4, 6)).astype(np.float32)
YS = RNG.standard_normal((5, 3, 6)).astype(np.float32)


def _loss(w: Any, x: Any, y: Any) -> Any:
    return ((x @ w - y) ** 2).mean()


def _numpy_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return 2 * x.T @ (x @ w - y) / (x.shape[0] * w.shape[1])


def test_vmap_of_a_function_on_arrays_matches_a_loop() -> None:
    def f(x: Any, w: Any) -> Any:
        return rlx.softmax(rlx.tanh(x @ w), axis=-1).sum(axis=0) * 2.0

    def numpy_f(x: np.ndarray) -> np.ndarray:
        h = np.tanh(x @ W)
        return (np.exp(h) / np.exp(h).sum(-1, keepdims=True)).sum(0) * 2.0

    mapped = rlx.vmap(f, in_axes=(0, None))
    np.testing.assert_allclose(mapped(XS, W), np.stack([numpy_f(x) for x in XS]), rtol=1e-5, atol=1e-6)
    mapped(XS[:2], W)
    mapped(XS, W)
    assert mapped.__wrapped__ is f


def test_per_example_gradients() -> None:
    grads = rlx.vmap(rlx.grad(_loss), in_axes=(None, 0, 0))(W, XS, YS)
    want = np.stack([_numpy_grad(W, x, y) for x, y in zip(XS, YS, strict=True)])
    np.testing.assert_allclose(grads, want, rtol=1e-5, atol=1e-6)


def test_gradient_through_vmap_and_under_jit() -> None:
    def total(w: Any, xs: Any, ys: Any) -> Any:
        return rlx.vmap(_loss, in_axes=(None, 0, 0))(w, xs, ys).sum()

    want = sum(_numpy_grad(W, x, y) for x, y in zip(XS, YS, strict=True))
    np.testing.assert_allclose(rlx.grad(total)(W, XS, YS), want, rtol=1e-5, atol=1e-6)
    jitted = rlx.jit(lambda w, xs, ys: rlx.vmap(rlx.grad(_loss), in_axes=(None, 0, 0))(w, xs, ys))
    np.testing.assert_allclose(jitted(W, XS, YS), rlx.vmap(rlx.grad(_loss), in_axes=(None, 0, 0))(W, XS, YS), rtol=1e-6)


def test_in_axes_out_axes_and_nesting() -> None:
    a = RNG.standard_normal((4, 2)).astype(np.float32)  # mapped along axis 1
    b = RNG.standard_normal((2, 3)).astype(np.float32)

    def f(x: Any, y: Any) -> Any:
        return x * y + rlx.exp(x)

    inner = rlx.vmap(f, in_axes=(0, None))  # over x's entries, y shared
    outer = rlx.vmap(inner, in_axes=(1, 0), out_axes=-1)  # over a's columns and b's rows together
    got = outer(a, b)
    want = np.empty((4, 3, 2), np.float32)
    for i in range(4):
        for j in range(2):
            want[i, :, j] = a[i, j] * b[j] + np.exp(a[i, j])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_nested_results_dicts_and_shared_results() -> None:
    params = {"w": W, "b": RNG.standard_normal(6).astype(np.float32)}

    def f(p: Any, x: Any) -> Any:
        return {"y": x @ p["w"] + p["b"], "norm": (p["w"] ** 2).sum()}, x.sum()

    out, total = rlx.vmap(f, in_axes=({"w": None, "b": None}, 0), out_axes=({"y": 1, "norm": None}, 0))(params, XS)
    np.testing.assert_allclose(out["y"], np.moveaxis(XS @ W + params["b"], 0, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["norm"], (W**2).sum(), rtol=1e-5)
    np.testing.assert_allclose(total, XS.sum(axis=(1, 2)), rtol=1e-5, atol=1e-5)
    # A result the same for every example is broadcast to each (out_axes 0).
    shared = rlx.vmap(lambda x, w: (w * 2.0, x), in_axes=(0, None))(XS, W)
    np.testing.assert_allclose(shared[0], np.broadcast_to(W * 2.0, (5, 4, 6)))
    # None is an empty result, as in JAX; NumPy ints name axes.
    doubled, nothing = rlx.vmap(lambda x: (x * 2.0, None), in_axes=np.int64(1))(XS)
    np.testing.assert_allclose(doubled, np.moveaxis(XS, 1, 0) * 2.0)
    assert nothing is None


def test_attention_per_example_and_its_gradients() -> None:
    q, k, v = (RNG.standard_normal((3, 2, 5, 2, 4)).astype(np.float32) for _ in range(3))  # 3 examples of BSHD

    def attend(q: Any, k: Any, v: Any) -> Any:
        return rlx.attention(q, k, v, mask=MaskKind.CAUSAL)

    def loss(q: Any, k: Any, v: Any) -> Any:
        return (attend(q, k, v) ** 2).sum()

    got = rlx.vmap(attend)(q, k, v)
    want = np.stack([rlx.jit(attend)(q[i], k[i], v[i]) for i in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    grads = rlx.vmap(rlx.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for i in range(3):
        each = rlx.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i])
        for got_part, want_part in zip(grads, each, strict=True):
            np.testing.assert_allclose(got_part[i], want_part, rtol=1e-4, atol=1e-5)


def test_the_graph_holds_no_one_example_nodes() -> None:
    g = Graph()
    xs = g.input("xs", (5, 3, 4))
    w = g.input("w", (4, 6))
    before = len(g)
    y = rlx.vmap(lambda x: rlx.gelu(x @ w).sum(axis=-1), in_axes=0)(xs)
    g.output(y=y)
    assert y.shape == (5, 3)
    assert list(g.inputs) == ["xs", "w"]
    assert [node.op.value for node in g.nodes][before:] == ["matmul", "gelu", "sum"]


def test_errors() -> None:
    g = Graph()
    xs = g.input("xs", (5, 3))
    ys = g.input("ys", (4, 3))
    with pytest.raises(rlx.RlxValueError, match="different sizes"):
        rlx.vmap(lambda x, y: x + y)(xs, ys)
    with pytest.raises(rlx.RlxValueError, match="axis_size"):
        rlx.vmap(lambda x: x * 2.0, in_axes=None)(xs)
    with pytest.raises(rlx.RlxValueError, match="out of range"):
        rlx.vmap(lambda x: x, in_axes=2)(xs)
    with pytest.raises(rlx.RlxValueError, match="2 entries for 1"):
        rlx.vmap(lambda x: x, in_axes=(0, 0))(xs)
    with pytest.raises(rlx.RlxValueError, match="out_axes is None"):
        rlx.vmap(lambda x: x, out_axes=None)(xs)
    with pytest.raises(rlx.RlxTypeError, match="in_axes"):
        rlx.vmap(lambda x: x, in_axes="0")
    with pytest.raises(rlx.RlxTypeError, match="expected a function"):
        rlx.vmap(3)
    nodes = len(g)
    with pytest.raises(rlx.RlxValueError):  # an error inside fn leaves the graph as it was
        rlx.vmap(lambda x: x @ g.input("bad", (7, 2)))(xs)
    assert len(g) == nodes
    assert list(g.inputs) == ["xs", "ys"]
    # Nothing mapped: axis_size gives the count, and every example gets the same result.
    twice = rlx.vmap(lambda x: x * 2.0, in_axes=None, axis_size=2)(xs)
    assert twice.shape == (2, 5, 3)
    with pytest.raises(rlx.RlxValueError, match="no array"):
        rlx.vmap(lambda: 1.0, axis_size=3)()


def test_symbolic_batch_and_unrolled_ops_need_a_static_count() -> None:
    g = Graph()
    xs = g.input("xs", ("N", 3, 4))
    y = rlx.vmap(lambda x: rlx.softmax(x, axis=0).sum())(xs)
    assert y.shape == ("N",)
    g.output(y=y)
    arrays = {"xs": RNG.standard_normal((7, 3, 4)).astype(np.float32)}
    np.testing.assert_allclose(rlx.compile(g)(**arrays)["y"], np.full(7, 4.0), rtol=1e-5)
    # A programmable attention is batched one example at a time: it needs a static count.
    q = g.input("q", ("N", 1, 4, 2, 8))

    def attend(q: Any) -> Any:
        return rlx.attention(q, q, q, score_mod=lambda score, b, h, i, j: score * 0.5)

    with pytest.raises(rlx.RlxValueError, match="static number of examples"):
        rlx.vmap(attend)(q)
    assert "q" in g.inputs and len([n for n in g.nodes if n.op.value == "flex_attention"]) == 0
    tables = RNG.standard_normal((2, 1, 4, 2, 8)).astype(np.float32)
    want = np.stack([rlx.jit(attend)(t) for t in tables])
    np.testing.assert_allclose(rlx.vmap(attend)(tables), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- fuzzed graphs


def _replayed(one: Graph, graph: Graph) -> Any:
    """``one``'s nodes as a function of its inputs, building in ``graph``: any graph made a
    function that vmap can map (its gradient nodes included)."""

    def run(*args: Value) -> tuple[Value, ...]:
        env: dict[Value, Value] = dict(zip(one.inputs.values(), args, strict=True))
        for node in one.nodes:
            if node.op is rlx.OpKind.INPUT:
                continue
            made = graph.add_node(node.op, [env[v] for v in node.inputs], node.attrs).outputs
            env.update(zip(node.outputs, made, strict=True))
        return tuple(env[v] for v in one.outputs.values())

    return run


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(), st.data())
def test_fuzzed_graphs_and_their_gradients_under_vmap(case: tuple[Graph, int, int], data: st.DataObject) -> None:
    one, seed, _ = case
    names = list(one.inputs)
    pattern = data.draw(st.lists(st.booleans(), min_size=len(names), max_size=len(names)).filter(any))
    axes = [
        data.draw(st.integers(0, one.inputs[n].ndim)) if flag else None for n, flag in zip(names, pattern, strict=True)
    ]
    many = Graph("many")
    values = []
    for name, axis in zip(names, axes, strict=True):
        shape = list(one.inputs[name].shape)
        if axis is not None:
            shape.insert(axis, EXAMPLES)
        values.append(many.input(name, tuple(shape), dtype=one.inputs[name].dtype))
    results = rlx.vmap(_replayed(one, many), in_axes=tuple(axes))(*values)
    many.output(**dict(zip(one.outputs, results, strict=True)))
    many.verify()
    rng = np.random.default_rng(seed)
    stacked = {}
    for name, axis in zip(names, axes, strict=True):
        shape = list(one.inputs[name].shape)
        if axis is not None:
            shape.insert(axis, EXAMPLES)
        stacked[name] = rng.uniform(-1.0, 1.0, shape)
    got = evaluate(many, stacked, exact=True)
    for i in range(EXAMPLES):
        example = {
            name: np.take(array, i, axis=axis) if axis is not None else array
            for (name, array), axis in zip(stacked.items(), axes, strict=True)
        }
        want = evaluate(one, example, exact=True)
        for name, value in want.items():
            np.testing.assert_allclose(got[name][i], value, rtol=1e-9, atol=1e-9, err_msg=f"{name}, example {i}")
    # And the batched graph compiled, against its float32 reference.
    arrays = {name: array.astype(np.float32) for name, array in stacked.items()}
    rounded = rlx.reference.run(many, **arrays)
    compiled = rlx.compile(many)(**arrays)
    spread = rounding_spread(many, arrays, rounded)
    scale = max(1.0, *(float(np.max(np.abs(w))) for w in rounded.values() if w.size))
    for name, value in rounded.items():
        assert_close_within_spread(
            compiled[name], value, rtol=2e-4, atol=2e-5 * scale, spread=spread[name], err_msg=f"{name}\n{many}"
        )
