"""A hypothesis strategy for random well-typed graphs of the registered ops, with a loss and its gradients.

Random shapes with broadcasting, random fan-out (any earlier value may be reused), random views
(transpose, reshape, split, broadcast_to, concat), reductions over random axes, norms, matmuls,
gathers by computed ids, running sums, advanced indexing by constant ids, `x.at[...]` updates,
a function whose gradient is written out (``rlx.custom_vjp``); then a scalar loss and
``rlx.grad`` of it w.r.t. every float input. Used by the codegen fuzzer (compiled against the
reference), the text round-trip tests and the vmap fuzzer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

import rlx
from rlx import Graph, Value

UNARY = ["neg", "exp", "tanh", "sigmoid", "relu", "silu", "gelu", "abs", "erf", "sin", "cos", "expm1", "softplus"]
POSITIVE_UNARY = ["log", "sqrt", "rsqrt", "log1p"]
BINARY = ["add", "sub", "mul", "maximum", "minimum"]


@rlx.custom_vjp
def _tanh_times(a: Value, b: Value) -> Value:
    """tanh(a) * b with its gradient written out (rlx.custom_vjp): a and b broadcast, so the
    written gradients have the result's shape and are summed back to each argument's."""
    return rlx.tanh(a) * b


def _tanh_times_fwd(a: Value, b: Value) -> tuple[Value, tuple[Value, Value]]:
    t = rlx.tanh(a)
    return t * b, (t, b)


def _tanh_times_bwd(residuals: tuple[Value, Value], g: Value) -> tuple[Value, Value]:
    t, b = residuals
    return g * (1.0 - t * t) * b, g * t


_tanh_times.defvjp(_tanh_times_fwd, _tanh_times_bwd)


def _positive(g: Graph, v: Value) -> Value:
    return g.sigmoid(v) + 0.5


def _build(draw: st.DrawFn) -> tuple[Graph, list[Value]]:
    g = Graph("fuzz")
    values: list[Value] = []
    for i in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank)))
        values.append(g.input(f"x{i}", shape))
    counter = [len(values)]

    def new_input(shape: tuple[int, ...]) -> Value:
        counter[0] += 1
        return g.input(f"x{counter[0]}", shape)

    for _ in range(draw(st.integers(1, 7))):
        v = draw(st.sampled_from(values))
        kind = draw(
            st.sampled_from(
                [
                    "unary",
                    "positive",
                    "binary",
                    "div",
                    "reduce",
                    "softmax",
                    "view",
                    "norm",
                    "matmul",
                    "where",
                    "concat",
                    "split",
                    "gather",
                    "cumsum",
                    "advanced",
                    "update",
                    "custom",
                ]
            )
        )
        shape = v.shape
        if kind == "unary":
            values.append(getattr(g, draw(st.sampled_from(UNARY)))(v))
        elif kind == "positive":
            values.append(getattr(g, draw(st.sampled_from(POSITIVE_UNARY)))(_positive(g, v)))
        elif kind in ("binary", "div", "custom"):
            # A partner that broadcasts: an earlier value of a compatible shape, or a new input with
            # some dimensions set to 1 or dropped.
            others = [w for w in values if _broadcasts(w.shape, shape)]
            if others and draw(st.booleans()):
                w = draw(st.sampled_from(others))
            else:
                dims = [d if draw(st.booleans()) else 1 for d in shape]
                w = new_input(tuple(dims[draw(st.integers(0, len(dims) - 1)) :]) if dims else ())
            if kind == "div":
                values.append(v / (w * w + 1.0))
            elif kind == "custom":
                values.append(_tanh_times(v, w) if draw(st.booleans()) else _tanh_times(w, v))
            else:
                op = draw(st.sampled_from(BINARY))
                values.append(getattr(g, op)(v, w) if draw(st.booleans()) else getattr(g, op)(w, v))
        elif kind == "reduce" and shape:
            axes = tuple(sorted(set(draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape))))))
            op = draw(st.sampled_from(["sum", "mean", "max", "min"]))
            values.append(getattr(g, op)(v, axis=axes, keepdims=draw(st.booleans())))
        elif kind == "softmax" and shape:
            op = draw(st.sampled_from(["softmax", "log_softmax"]))
            values.append(getattr(g, op)(v, axis=draw(st.integers(-len(shape), len(shape) - 1))))
        elif kind == "view" and shape:
            choice = draw(st.sampled_from(["transpose", "reshape", "broadcast", "unsqueeze", "index"]))
            if choice == "transpose":
                values.append(g.transpose(v, tuple(draw(st.permutations(range(len(shape)))))))
            elif choice == "reshape":
                values.append(g.reshape(v, (-1,)) if len(shape) > 1 else g.reshape(v, (1, shape[0], 1)))
            elif choice == "broadcast":
                values.append(g.broadcast_to(v, (draw(st.integers(1, 3)), *shape)))
            elif choice == "index":  # basic indexing: an int or a slice per axis (any step), maybe a new axis
                index: list[object] = []
                for size in shape:
                    start = draw(st.integers(-size, size - 1))
                    if draw(st.booleans()):
                        index.append(start)
                    else:
                        begin = start % size
                        stop = draw(st.integers(begin + 1, size))
                        step = draw(st.sampled_from((1, 1, 2, 3, -1, -2)))
                        reverse = slice(stop - 1, begin - 1 if begin else None, step)
                        index.append(slice(begin, stop, step) if step > 0 else reverse)
                if draw(st.booleans()):
                    index.insert(draw(st.integers(0, len(index))), None)
                values.append(v[tuple(index)])
            else:
                values.append(g.reshape(v, (*shape, 1)))
        elif kind == "norm" and shape and shape[-1] >= 2:  # a norm over 1 feature divides 0 by sqrt(eps)
            weight = new_input((shape[-1],))
            values.append(
                g.rms_norm(v, weight) if draw(st.booleans()) else g.layer_norm(v, weight, new_input((shape[-1],)))
            )
        elif kind == "matmul" and len(shape) >= 2:
            w = new_input((shape[-1], draw(st.integers(1, 4))))
            values.append(
                v @ w
                if draw(st.booleans())
                else g.matmul(
                    g.transpose(w, (1, 0)), g.transpose(v, (*range(len(shape) - 2), len(shape) - 1, len(shape) - 2))
                )
            )
        elif kind == "where":
            w = draw(st.sampled_from([w for w in values if w.shape == shape]))
            if draw(st.booleans()):
                values.append(g.where(v > w, v, w * 2.0))
            else:  # a comparison cast to float weights (through int32 or straight)
                mask = (v > w).astype("int32") if draw(st.booleans()) else v > w
                values.append(mask.astype("float32") * v)
        elif kind == "concat" and shape:
            axis = draw(st.integers(0, len(shape) - 1))
            values.append(g.concat([v, g.exp(v)], axis=axis))
        elif kind == "gather" and shape:
            # Entries picked by ids the graph computes (an argmax of an input: float32 and float64
            # agree on it), checked by the gather's kernel; the gradient scatters by them.
            axis = draw(st.integers(0, len(shape) - 1))
            scores = new_input((draw(st.integers(1, 9)), shape[axis]))
            ids = g.argmax(scores, axis=-1)
            if draw(st.booleans()):
                ids = g.minimum(ids + 1, shape[axis] - 1)  # arithmetic on the ids too
            values.append(g.take(v, ids, axis=axis))
        elif kind == "cumsum" and shape:
            axis = draw(st.integers(-len(shape), len(shape) - 1))
            values.append(g.cumsum(v, axis=axis, reverse=draw(st.booleans())))
        elif kind == "advanced" and shape:
            # NumPy's advanced indexing: constant ids (repeats, from the end) on one axis, maybe a
            # second array broadcast against them on the next, slices around.
            values.append(v[_advanced_index(draw, shape)])
        elif kind == "update" and shape:
            # x.at[index].set/add/max: a block, or ids (distinct for max, which refuses repeats).
            how = draw(st.sampled_from(["set", "add", "max"]))
            if draw(st.booleans()):
                axis = draw(st.integers(0, len(shape) - 1))
                start = draw(st.integers(0, shape[axis] - 1))
                index: Any = (slice(None),) * axis + (slice(start, draw(st.integers(start + 1, shape[axis]))),)
            elif how == "max":
                axis = draw(st.integers(0, len(shape) - 1))
                ids = draw(st.lists(st.integers(0, shape[axis] - 1), min_size=1, max_size=shape[axis], unique=True))
                index = (slice(None),) * axis + (ids,)
            else:
                index = _advanced_index(draw, shape)
            part = v[index]
            values.append(getattr(v.at[index], how)(g.tanh(new_input(part.shape))))
        elif kind == "split" and shape and shape[-1] % 2 == 0:
            a, b = g.split(v, 2, axis=-1)
            values.append(a * b)
    outputs = draw(st.lists(st.sampled_from(values[-4:]), min_size=1, max_size=3, unique=True))
    return g, outputs


def _advanced_index(draw: st.DrawFn, shape: tuple[int, ...]) -> tuple[Any, ...]:
    axis = draw(st.integers(0, len(shape) - 1))
    size = shape[axis]
    index: list[Any] = [slice(None)] * axis + [draw(st.lists(st.integers(-size, size - 1), min_size=1, max_size=4))]
    if axis + 1 < len(shape) and draw(st.booleans()):
        index.append([draw(st.integers(0, shape[axis + 1] - 1))])  # broadcast against the first
    return tuple(index)


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) <= len(b) and all(x in (1, y) for x, y in zip(reversed(a), reversed(b), strict=False))


@st.composite
def graphs(draw: st.DrawFn) -> tuple[Graph, int, int]:
    g, outputs = _build(draw)
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    loss = None
    for value in outputs:
        term = g.sum(value * g.constant(rng.uniform(-1, 1, value.shape).astype(np.float32)))
        loss = term if loss is None else loss + term
    xs = list(g.inputs.values())
    grads = rlx.grad(g, loss, xs)
    g.output(
        loss=loss,
        **{f"y{i}": v for i, v in enumerate(outputs)},
        **{f"d_{x.node.attrs.name}": d for x, d in zip(xs, grads, strict=True)},
    )
    return g, draw(st.integers(0, 1000)), draw(st.integers(1, 3))


def rounding_spread(
    graph: Graph, arrays: dict[str, np.ndarray], rounded: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """How far float32 rounding alone moves each output entry: the reference (float64 arithmetic,
    each result stored in float32) against the same graph run wholly in float64.

    A random graph may be ill-conditioned: a layer norm over entries that differ in the third digit
    divides rounding errors by their tiny spread, and a one-ulp change of an input then moves a
    gradient by 5e-4. Compiled float32 code is off by as much, legitimately; a fixed tolerance would
    flag it. The spread is measured entry by entry, so a well-conditioned entry keeps the tight
    tolerance and a wrong kernel (errors of the entries' own size) still fails.
    """
    exact = rlx.reference.evaluate(graph, arrays, exact=True)
    spread = {}
    for name, want in rounded.items():
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(exact[name].astype(np.float64) - want.astype(np.float64)) if want.dtype.kind == "f" else None
        spread[name] = np.zeros(want.shape) if diff is None else np.nan_to_num(diff, nan=0.0, posinf=0.0)
    return spread


def assert_close_within_spread(
    got: np.ndarray, want: np.ndarray, *, rtol: float, atol: float, spread: np.ndarray, err_msg: str
) -> None:
    """``assert_allclose(got, want, rtol, atol)`` where each entry may also be off by 4x its
    :func:`rounding_spread`; entries beyond that are reported as ``assert_allclose`` reports them."""
    if want.dtype.kind != "f":
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
        return
    with np.errstate(invalid="ignore", over="ignore"):
        tolerated = np.abs(got.astype(np.float64) - want) <= atol + 4 * spread + rtol * np.abs(want.astype(np.float64))
    np.testing.assert_allclose(np.where(tolerated, want, got), want, rtol=rtol, atol=atol, err_msg=err_msg)
