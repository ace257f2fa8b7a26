"""One small graph per registered op, so that every op is checked the same generic ways.

``tests/ops/test_registry.py`` fails when a registered op has no sample here: a new op cannot
land without its gradient being checked against finite differences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import rlx
from rlx import Graph, MaskKind, OpKind, Value, Wrt
from rlx.ir.opdef import not_differentiable

Built = Value | tuple[Value, ...]


@dataclass(frozen=True)
class Sample:
    """``build(g)`` declares its inputs and returns the op's result(s)."""

    op: str
    build: Callable[[Graph], Built]
    label: str = ""
    int_high: dict[str, int] = field(default_factory=dict)  # int inputs: entries drawn from [0, high)
    positive: frozenset[str] = frozenset()  # float inputs drawn away from 0 and > 0 (log, sqrt, pow)
    domain: tuple[float, float] | None = None  # every float input drawn uniformly from here (asin, acosh)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.label}" if self.label else self.op


def _unary(op: str, positive: bool = False, domain: tuple[float, float] | None = None, **kwargs: object) -> Sample:
    def build(g: Graph) -> Built:
        return getattr(g, op)(g.input("x", (3, 4)), **kwargs)

    return Sample(
        op,
        build,
        label="-".join(f"{k}={v}" for k, v in kwargs.items()),
        positive=frozenset({"x"}) if positive else frozenset(),
        domain=domain,
    )


def _binary(op: str, positive_a: bool = False) -> Sample:
    def build(g: Graph) -> Built:
        return getattr(g, op)(g.input("a", (3, 4)), g.input("b", (4,)))  # b broadcasts over rows

    return Sample(op, build, positive=frozenset({"a"}) if positive_a else frozenset())


def _compare(op: str) -> Sample:
    return Sample(op, lambda g: getattr(g, op)(g.input("a", (3, 4)), g.input("b", (3, 1))))


def _attention(g: Graph) -> Built:
    q, k, v = (g.input(name, (1, 3, 2, 4)) for name in "qkv")
    return g.attention(q, k, v, mask=MaskKind.CAUSAL)


def _attention_bwd(g: Graph) -> Built:
    q, k, v, dy = (g.input(name, (1, 3, 2, 4)) for name in ("q", "k", "v", "dy"))
    return g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL)


def _flex_attention(g: Graph) -> Built:
    """GQA (4 query heads, 2 kv heads), Dv != D, a learnable ALiBi-like slope, softcap and a causal
    mask with a prefix: every piece of a traced region at once."""
    q = g.input("q", (2, 5, 4, 3))
    k = g.input("k", (2, 6, 2, 3))
    v = g.input("v", (2, 6, 2, 2))
    slopes = g.input("slopes", (4,))

    def score_mod(score: Value, b: Value, h: Value, q_idx: Value, kv_idx: Value) -> Value:
        return 4.0 * rlx.tanh((score + slopes[h] * (kv_idx - q_idx)) / 4.0)

    return g.attention(q, k, v, score_mod=score_mod, mask_mod=rlx.mods.prefix_lm(2), scale=0.7, return_lse=True)


def _flex_attention_bwd(g: Graph) -> Built:
    q, k, v = g.input("q", (1, 4, 2, 3)), g.input("k", (1, 5, 1, 3)), g.input("v", (1, 5, 1, 2))
    out, lse = g.attention(q, k, v, mask_mod=rlx.mods.causal_lower_right(4, 5), return_lse=True)
    dy = g.input("dy", (1, 4, 2, 2))
    return g.flex_attention_bwd(q, k, v, out, dy, lse, wrt=Wrt.ALL, mask_mod=out.node.attrs.mask_mod)


def _conv_flipped_and_cropped(g: Graph) -> Built:
    """A ``conv`` node as gradients make them: the kernel flipped, a pad negative (a crop)."""
    from rlx.ops.conv import ConvAttrs

    attrs = ConvAttrs((1, 2), (2, 1), (-1, 2), (1, -1), 1, True)
    return g.add_node(OpKind.CONV, [g.input("x", (2, 2, 7, 6)), g.input("w", (3, 2, 2, 3))], attrs).outputs[0]


def _dominant(a: Value) -> Value:
    """``a + 4 I`` (the identity's leading part for a matrix that is not square): far from
    singular for entries within 1.5 of 0."""
    return a + np.eye(*a.shape[-2:], dtype=np.float32) * 4.0


def _spd(x: Value) -> Value:
    """``x x^T + 4 I``: symmetric positive definite."""
    return x @ x.mT + np.eye(x.shape[-1], dtype=np.float32) * 4.0


def _spread(x: Value) -> Value:
    """A symmetric matrix whose eigenvalues lie well apart (1, 5 and 9 moved by ``x``'s small
    symmetric part), so that finite differences never cross a repeated one."""
    n = x.shape[-1]
    return (x + x.mT) * 0.1 + np.diag(np.arange(n) * 4.0 + 1.0).astype(np.float32)


def _apart(x: Value) -> Value:
    """A matrix whose singular values lie well apart (9, 5, 1, moved by 0.1 ``x``)."""
    m, n = x.shape[-2:]
    diagonal = np.zeros((m, n), np.float32)
    for i, value in enumerate((9.0, 5.0, 1.0)[: min(m, n)]):
        diagonal[i, i] = value
    return x * 0.1 + diagonal


def _custom_vjp(g: Graph) -> Built:
    """w * softplus(x) with its gradient written out: traced on the stand-in, as rlx.custom_vjp
    builds it, and right, so that the generic finite-difference checks hold it to the truth."""
    x, w = g.input("x", (3, 4)), g.input("w", (4,))
    softplus = g.log(1.0 + g.exp(x))
    primal = softplus * w
    ct = g.custom_vjp_cotangent(primal, [x, w])
    gx = ct * g.sigmoid(x) * w
    gw = g.sum(ct * softplus, axis=0)
    (y,) = g.custom_vjp([primal], [ct], [x, w], [gx, gw])
    return y


def as_params(samples: list[Sample], slow: frozenset[str] = frozenset()) -> list[Any]:
    """``samples`` as pytest params with their ids, those whose id is in ``slow`` as slow cases."""
    return [pytest.param(s, id=s.id, marks=[pytest.mark.slow] if s.id in slow else []) for s in samples]


SAMPLES: list[Sample] = [
    Sample("input", lambda g: g.input("x", (2, 3))),
    Sample("constant", lambda g: g.input("x", (2, 3)) * g.constant(np.arange(6, dtype=np.float32).reshape(2, 3))),
    Sample("config_value", lambda g: g.input("x", (2, 3)) - g.config_value("mask_binary_threshold")),
    _unary("neg"),
    _unary("exp"),
    _unary("log", positive=True),
    _unary("sqrt", positive=True),
    _unary("rsqrt", positive=True),
    _unary("abs"),
    _unary("sign"),
    _unary("tanh"),
    _unary("sigmoid"),
    _unary("relu"),
    _unary("silu"),
    _unary("erf"),
    _unary("sin"),
    _unary("cos"),
    _unary("tan"),
    _unary("atan"),
    _unary("asin", domain=(-0.9, 0.9)),
    _unary("acos", domain=(-0.9, 0.9)),
    _unary("sinh"),
    _unary("cosh"),
    _unary("asinh"),
    _unary("acosh", domain=(1.2, 3.0)),
    _unary("atanh", domain=(-0.9, 0.9)),
    _unary("log2", positive=True),
    _unary("log10", positive=True),
    _unary("exp2"),
    _unary("log1p", positive=True),
    _unary("expm1"),
    _unary("softplus"),
    Sample(
        "stop_gradient",
        lambda g: g.stop_gradient(g.input("ids", (3, 4), "int64")).astype("float32") * g.input("x", (3, 4)),
        int_high={"ids": 7},
    ),
    Sample("custom_vjp", _custom_vjp),
    Sample("barrier", lambda g: g.exp(g.barrier(g.input("x", (3, 4)), g.sum(g.input("after", (2,)))))),
    Sample("checkpoint_name", lambda g: g.exp(g.checkpoint_name(g.input("x", (3, 4)), "h"))),
    Sample("custom_vjp_cotangent", lambda g: g.custom_vjp_cotangent(g.input("x", (3, 4)), [g.input("w", (4,))])),
    _unary("floor"),
    _unary("ceil"),
    _unary("trunc"),
    _unary("round"),
    _unary("gelu", approximate="none"),
    _unary("gelu", approximate="tanh"),
    _binary("add"),
    _binary("sub"),
    _binary("mul"),
    _binary("div"),
    _binary("pow", positive_a=True),
    _binary("maximum"),
    _binary("minimum"),
    _binary("floor_divide"),
    _binary("remainder"),
    _binary("fmod"),
    _binary("atan2"),
    *(_compare(op) for op in ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal")),
    Sample("logical_and", lambda g: g.logical_and(g.input("a", (3, 4)) > 0.0, g.input("b", (4,)) > 0.0)),
    Sample("logical_or", lambda g: g.logical_or(g.input("a", (3, 4)) > 0.0, g.input("b", (4,)) > 0.0)),
    Sample("logical_not", lambda g: g.logical_not(g.input("a", (3, 4)) > 0.0)),
    *(
        Sample(
            op, lambda g, op=op, dt=dt: getattr(g, op)(g.input("a", (3, 4), dt), g.input("b", (4,), dt)), int_high=hi
        )
        for op, dt, hi in (
            ("bitwise_and", "int32", {"a": 1000, "b": 1000}),
            ("bitwise_or", "int64", {"a": 1000, "b": 1000}),
            ("bitwise_xor", "int32", {"a": 2**31 - 1, "b": 1000}),
            ("left_shift", "int64", {"a": 1000, "b": 70}),  # shifts past 64: 0, as NumPy's
            ("right_shift", "int32", {"a": 2**31 - 1, "b": 40}),
        )
    ),
    Sample("bitwise_xor", lambda g: g.bitwise_xor(g.input("a", (3, 4)) > 0.0, g.input("b", (4,)) > 0.0), label="bool"),
    Sample("bitwise_not", lambda g: ~g.input("a", (3, 4), "int32"), int_high={"a": 2**31 - 1}),
    Sample("where", lambda g: g.where(g.input("c", (3, 1)) > 0.0, g.input("a", (3, 4)), g.input("b", (4,)))),
    Sample(
        "cast",
        lambda g: g.cast(g.input("ids", (3, 4), "int64"), "float32") * g.input("x", (3, 4)),
        int_high={"ids": 7},
    ),
    Sample(
        "embedding",
        lambda g: g.embedding(g.input("table", (5, 3)), g.input("ids", (2, 4), "int64")),
        int_high={"ids": 5},
    ),
    Sample(
        "embedding_grad",
        lambda g: g.embedding_grad(g.input("dy", (2, 4, 3)), g.input("ids", (2, 4), "int32"), 5),
        int_high={"ids": 5},
    ),
    Sample(
        "one_hot",
        lambda g: g.one_hot(g.input("ids", (2, 3), "int32"), 4) * g.input("x", (2, 3, 4)),
        int_high={"ids": 4},
    ),
    Sample(
        "cross_entropy",
        lambda g: g.cross_entropy(g.input("logits", (2, 3, 5)), g.input("t", (2, 3), "int64")),
        int_high={"t": 5},
    ),
    Sample("matmul", lambda g: g.matmul(g.input("a", (2, 3, 4)), g.input("b", (4, 5))), label="shared-weight"),
    Sample("matmul", lambda g: g.input("a", (3, 4)) @ g.input("b", (2, 4, 5)), label="shared-lhs"),
    Sample("matmul", lambda g: g.matmul(g.input("a", (2, 1, 3, 4)), g.input("b", (3, 4, 2))), label="broadcast"),
    Sample("matmul", lambda g: g.input("a", (4,)) @ g.input("b", (4,)), label="vector-vector"),
    Sample("matmul", lambda g: g.input("a", (4,)) @ g.input("b", (2, 4, 3)), label="vector-batch"),
    Sample("matmul", lambda g: g.matmul(g.input("a", (2, 3, 4)), g.input("b", (4,))), label="batch-vector"),
    Sample("reshape", lambda g: g.reshape(g.input("x", (2, 6)), (3, -1))),
    Sample("transpose", lambda g: g.transpose(g.input("x", (2, 3, 4)), (2, 0, 1))),
    Sample("split", lambda g: g.split(g.input("x", (2, 6)), 3, axis=-1)),
    Sample("unfold", lambda g: g.unfold(g.input("x", (2, 7, 3)), 1, 3, 2), label="step-2-overlapping"),
    Sample("unfold", lambda g: g.unfold(g.input("x", (3, 8)), -1, 2, 3), label="gaps-last-axis"),
    Sample("unfold", lambda g: g.unfold(g.input("x", (2, 5)), 1, 5) * 2.0, label="one-window-computed"),
    Sample("split", lambda g: g.split(g.input("x", (5, 2)), [1, 4], axis=0)[1], label="sizes-one-used"),
    Sample("concat", lambda g: g.concat([g.input("a", (2, 3)), g.input("b", (2, 2))], axis=1)),
    Sample("broadcast_to", lambda g: g.broadcast_to(g.input("x", (3, 1)), (2, 3, 4))),
    Sample("sum", lambda g: g.sum(g.input("x", (2, 3, 4)), axis=(0, 2))),
    Sample("sum", lambda g: g.sum(g.input("x", (2, 3)), keepdims=True), label="all-keepdims"),
    Sample("mean", lambda g: g.mean(g.input("x", (2, 3, 4)), axis=-1, keepdims=True)),
    Sample("max", lambda g: g.max(g.input("x", (2, 3, 4)), axis=1)),
    Sample("min", lambda g: g.min(g.input("x", (2, 3, 4)), axis=(0, 2), keepdims=True)),
    Sample("argmax", lambda g: g.argmax(g.input("x", (2, 3, 4)), axis=1)),
    Sample("argmin", lambda g: g.argmin(g.input("x", (2, 3, 4)), axis=None, keepdims=True)),
    Sample("cumsum", lambda g: g.cumsum(g.input("x", (2, 3, 4)), axis=1)),
    Sample("cumsum", lambda g: g.cumsum(g.input("x", (3, 5)), axis=-1, reverse=True), label="reverse"),
    Sample("cumprod", lambda g: g.cumprod(g.input("x", (2, 3, 4)), axis=1)),
    Sample("sort", lambda g: g.sort(g.input("x", (3, 5)), axis=0)),
    Sample("cummax", lambda g: g.cummax(g.input("x", (3, 6)), axis=1)),
    Sample("cummin", lambda g: g.cummin(g.input("x", (4, 3, 2)), axis=0)),
    Sample("logcumsumexp", lambda g: g.logcumsumexp(g.input("x", (2, 5, 3)), axis=1)),
    Sample("logcumsumexp", lambda g: g.logcumsumexp(g.input("x", (3, 6)), axis=-1, reverse=True), label="reverse"),
    Sample("sort", lambda g: g.topk(g.input("x", (2, 7)), 3)[0], label="topk"),
    # Linear algebra on well-conditioned matrices: 4 I added (entries are within 1.5 of 0).
    Sample("cholesky", lambda g: g.cholesky(_spd(g.input("x", (2, 3, 3))))),
    Sample("solve", lambda g: g.solve(_dominant(g.input("a", (2, 3, 3))), g.input("b", (2, 3, 2)))),
    Sample("solve", lambda g: g.solve(_dominant(g.input("a", (3, 3))), g.input("b", (3,))), label="vector"),
    Sample("solve", lambda g: g.inv(_dominant(g.input("a", (2, 3, 3)))), label="inv"),
    Sample(
        "solve_triangular",
        lambda g: g.solve_triangular(_dominant(g.input("a", (2, 4, 4))), g.input("b", (2, 4, 3))),
    ),
    Sample(
        "solve_triangular",
        lambda g: g.solve_triangular(
            _dominant(g.input("a", (3, 3))), g.input("b", (3, 2)), lower=False, transpose_a=True, unit_diagonal=True
        ),
        label="upper-transposed-unit",
    ),
    Sample("eigh", lambda g: g.eigh(_spread(g.input("x", (2, 3, 3))))),
    Sample("qr", lambda g: g.qr(_dominant(g.input("a", (2, 4, 3))))),
    Sample("qr", lambda g: g.qr(_dominant(g.input("a", (3, 3)))), label="square"),
    Sample("qr", lambda g: g.qr(_dominant(g.input("a", (2, 3, 5)))), label="wide"),
    Sample("svd", lambda g: g.svd(_apart(g.input("x", (2, 3, 3))))),
    Sample("svd", lambda g: g.svd(_apart(g.input("x", (3, 4))), full_matrices=False), label="wide"),
    Sample("svd", lambda g: g.svd(_apart(g.input("x", (2, 4, 3))), full_matrices=False), label="tall"),
    Sample("svd", lambda g: g.matrix_norm(_apart(g.input("x", (2, 4, 3))), "nuc"), label="nuclear-norm"),
    Sample("slogdet", lambda g: g.slogdet(_dominant(g.input("a", (2, 3, 3))) * -1.0)),
    Sample("slogdet", lambda g: g.det(_dominant(g.input("a", (3, 3)))), label="det"),
    Sample(
        "take_along_axis",
        lambda g: g.take_along_axis(g.input("x", (3, 4, 2)), g.input("ids", (3, 5, 1), "int64"), axis=1),
        int_high={"ids": 4},
    ),
    Sample(
        "scatter_add_along_axis",
        lambda g: g.scatter_add_along_axis(g.input("x", (3, 5)), g.input("ids", (3, 5), "int32"), axis=1, size=4),
        int_high={"ids": 4},
    ),
    Sample("cumprod", lambda g: g.cumprod(g.input("x", (3, 5)), axis=-1, reverse=True), label="reverse"),
    Sample("softmax", lambda g: g.softmax(g.input("x", (2, 3, 4)), axis=1)),
    Sample("log_softmax", lambda g: g.log_softmax(g.input("x", (2, 3, 4)))),
    Sample("rms_norm", lambda g: g.rms_norm(g.input("x", (2, 3, 4)), g.input("w", (4,)), eps=1e-6)),
    Sample("layer_norm", lambda g: g.layer_norm(g.input("x", (3, 5)), g.input("w", (5,)), g.input("b", (5,)))),
    Sample("layer_norm", lambda g: g.layer_norm(g.input("x", (3, 5)), g.input("w", (5,))), label="no-bias"),
    Sample(
        "fused_elementwise",
        lambda g: g.fused_elementwise(
            [g.input("a", (3, 4)), g.input("b", (4,))],
            "mul(%i0, %i1); exp(%t0); greater(%t1, %i0); where(%t2, %t1, %i1)",
        ),
    ),
    Sample("conv", lambda g: g.conv(g.input("x", (2, 4, 6, 5)), g.input("w", (3, 4, 3, 2)), stride=(2, 1), padding=1)),
    Sample(
        "conv",
        lambda g: g.conv(g.input("x", (2, 4, 7)), g.input("w", (4, 2, 3)), padding=[(2, 0)], groups=2),
        label="grouped",
    ),
    Sample(
        "conv",
        lambda g: g.conv(
            g.input("x", (2, 3, 5, 5)), g.input("w", (6, 1, 3, 3)), dilation=(1, 2), padding=((1, 1), (2, 2)), groups=3
        ),
        label="depthwise",
    ),
    Sample("conv", _conv_flipped_and_cropped, label="flipped-cropped"),
    Sample("attention", _attention),
    Sample("attention_bwd", _attention_bwd),
    Sample("flex_attention", _flex_attention),
    Sample("flex_attention_bwd", _flex_attention_bwd),
]


def sample_inputs(graph: Graph, sample: Sample, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """float64 arrays for float inputs (exact reference), ints in range for index inputs."""
    arrays: dict[str, np.ndarray] = {}
    for name, value in graph.inputs.items():
        if value.dtype.kind == "i":
            arrays[name] = rng.integers(0, sample.int_high[name], value.shape).astype(value.dtype)
        elif sample.domain is not None:
            arrays[name] = rng.uniform(*sample.domain, value.shape)
        elif name in sample.positive:
            arrays[name] = rng.uniform(0.5, 2.0, value.shape)
        else:
            # Away from 0 and from each other, so kinks (abs, relu, max ties) are never hit.
            arrays[name] = rng.choice([-1.0, 1.0], value.shape) * rng.uniform(0.2, 1.5, value.shape)
    return arrays


def scalar_loss(g: Graph, built: Value | tuple[Value, ...], rng: np.random.Generator) -> Value | None:
    """``sum(out * w)`` over every float result, fixed random ``w``: every element's cotangent used."""
    results = built if isinstance(built, tuple) else (built,)
    terms = []
    for value in results:
        if value.dtype == np.float32:
            weights = g.constant(rng.uniform(-1.0, 1.0, value.shape).astype(np.float32))
            terms.append(g.sum(value * weights))
    if not terms:
        return None
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def differentiable(sample: Sample) -> bool:
    """Whether every op of the sample has a gradient rule."""
    g = Graph()
    sample.build(g)
    return all(node.op.definition.grad is not not_differentiable for node in g.nodes)
