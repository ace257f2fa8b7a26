"""Test utilities: attention cases, random inputs, graph builders and an independent oracle.

:func:`naive_attention` is deliberately written unlike ``rlx.reference``: loops over batch,
head and query row, an explicit boolean mask matrix built from index comparisons, and the
softmax Jacobian ``diag(p) - p p^T`` instead of the ``rowsum`` shortcut. Agreement of the two is
evidence that both read SPEC section 1 the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rlx import Graph, Layout, MaskKind, Value, Wrt

GRAD_NAMES = {Wrt.QUERY: "dq", Wrt.KEY: "dk", Wrt.VALUE: "dv"}


@dataclass(frozen=True)
class Case:
    """One attention problem: sizes, mask and layout."""

    seq_q: int
    seq_k: int
    head_dim: int = 4
    batch: int = 2
    heads: int = 2
    mask: MaskKind = MaskKind.NONE
    layout: Layout = Layout.BSHD
    label: str = field(default="", compare=False)

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return self.layout.join(self.batch, self.seq_q, self.heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return self.layout.join(self.batch, self.seq_k, self.heads, self.head_dim)

    @property
    def mask_shape(self) -> tuple[int, ...] | None:
        if self.mask == MaskKind.CUSTOM:
            return (self.batch, self.seq_k)
        if self.mask == MaskKind.BIAS:
            return (self.batch, self.heads, self.seq_q, self.seq_k)
        return None


def make_inputs(case: Case, rng: np.random.Generator, dtype: type = np.float32) -> dict[str, np.ndarray]:
    """Random q, k, v, dy (and ``mask`` when the case needs a tensor), keyed by graph input name."""
    arrays = {
        "q": rng.standard_normal(case.q_shape),
        "k": rng.standard_normal(case.kv_shape),
        "v": rng.standard_normal(case.kv_shape),
        "dy": rng.standard_normal(case.q_shape),
    }
    if case.mask == MaskKind.CUSTOM:
        # Values on both sides of the 0.5 threshold, the threshold itself included (kept, not masked).
        arrays["mask"] = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=case.mask_shape)
    elif case.mask == MaskKind.BIAS:
        arrays["mask"] = rng.standard_normal(case.mask_shape)
    return {name: array.astype(dtype) for name, array in arrays.items()}


def build_graph(case: Case, wrt: Wrt = Wrt.ALL) -> Graph:
    """Inputs q, k, v, dy (+ mask); outputs ``out`` (forward) and one of dq/dk/dv per ``wrt`` flag."""
    g = Graph("case")
    q = g.input("q", case.q_shape)
    k = g.input("k", case.kv_shape)
    v = g.input("v", case.kv_shape)
    dy = g.input("dy", case.q_shape)
    mask_input = g.input("mask", case.mask_shape) if case.mask_shape is not None else None
    out = g.attention(q, k, v, mask=case.mask, layout=case.layout, mask_input=mask_input)
    grads = g.attention_bwd(q, k, v, dy, wrt=wrt, mask=case.mask, layout=case.layout, mask_input=mask_input)
    grads = grads if isinstance(grads, tuple) else (grads,)
    named: dict[str, Value] = {GRAD_NAMES[flag]: value for flag, value in zip(wrt.members, grads, strict=True)}
    g.output(out=out, **named)
    return g


# ---------------------------------------------------------------------------- independent oracle


def hidden_matrix(
    mask: MaskKind, pad: np.ndarray | None, b: int, seq_q: int, seq_k: int, threshold: float
) -> np.ndarray:
    """``hidden[i, j]`` is True where query ``i`` may not see key ``j`` (its score is replaced)."""
    hidden = np.zeros((seq_q, seq_k), dtype=bool)
    shift = max(seq_k - seq_q, 0)
    for i in range(seq_q):
        last_visible = i + shift  # causal masks align the last query with the last key
        for j in range(seq_k):
            if mask == MaskKind.CUSTOM:
                assert pad is not None
                hidden[i, j] = bool(pad[b, j] < threshold)
            elif mask == MaskKind.CAUSAL:
                hidden[i, j] = j > last_visible
            elif mask.window is not None:
                hidden[i, j] = not (last_visible - mask.window <= j <= last_visible)
    return hidden


def softmax_row(scores: np.ndarray) -> np.ndarray:
    """Softmax of one row; a row with no finite-or-larger entry (all -inf) has probability 0 everywhere."""
    top = scores.max()
    if top == -math.inf:
        return np.zeros_like(scores)
    weights = np.exp(scores - top)
    return weights / weights.sum()


def naive_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    dy: np.ndarray,
    *,
    mask: MaskKind = MaskKind.NONE,
    layout: Layout = Layout.BSHD,
    mask_tensor: np.ndarray | None = None,
    neg: float = -1e9,
    threshold: float = 0.5,
) -> dict[str, np.ndarray]:
    """``out``, ``dq``, ``dk``, ``dv`` in float64, one query row at a time."""
    q, k, v, dy = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dy))
    bias = None if mask != MaskKind.BIAS else np.asarray(mask_tensor, dtype=np.float64)
    result = {"out": np.zeros_like(q), "dq": np.zeros_like(q), "dk": np.zeros_like(k), "dv": np.zeros_like(v)}
    batch, seq_q, heads, dim = layout.split(q.shape)
    seq_k = layout.split(k.shape)[1]
    inv_sqrt_d = 1.0 / math.sqrt(dim)

    def head(x: np.ndarray, b: int, h: int) -> np.ndarray:
        return x[b, :, h, :] if layout is Layout.BSHD else x[b, h, :, :]  # a view: writes land in x

    with np.errstate(all="ignore"):
        for b in range(batch):
            hidden = hidden_matrix(mask, mask_tensor, b, seq_q, seq_k, threshold)
            for h in range(heads):
                Q, K, V, dY = head(q, b, h), head(k, b, h), head(v, b, h), head(dy, b, h)
                out, dQ, dK, dV = (head(result[n], b, h) for n in ("out", "dq", "dk", "dv"))
                for i in range(seq_q):
                    scores = np.array([np.dot(Q[i], K[j]) * inv_sqrt_d for j in range(seq_k)])
                    if bias is not None:
                        scores = scores + bias[b, h, i]
                    scores[hidden[i]] = neg
                    p = softmax_row(scores)
                    out[i] = p @ V
                    dV += np.outer(p, dY[i])
                    dp = V @ dY[i]
                    ds = (np.diag(p) - np.outer(p, p)) @ dp * inv_sqrt_d
                    ds[hidden[i]] = 0.0  # replaced scores are constants: no gradient through them
                    dQ[i] = ds @ K
                    dK += np.outer(ds, Q[i])
    return result


def naive_for(case: Case, arrays: dict[str, np.ndarray], neg: float = -1e9, threshold: float = 0.5) -> dict:
    """:func:`naive_attention` on the arrays of :func:`make_inputs` for ``case``."""
    return naive_attention(
        arrays["q"],
        arrays["k"],
        arrays["v"],
        arrays["dy"],
        mask=case.mask,
        layout=case.layout,
        mask_tensor=arrays.get("mask"),
        neg=neg,
        threshold=threshold,
    )


def central_differences(loss: Callable[[], float], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """d loss / d x by central differences, perturbing ``x`` in place entry by entry (float64)."""
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        saved = x[index]
        x[index] = saved + eps
        up = loss()
        x[index] = saved - eps
        down = loss()
        x[index] = saved
        grad[index] = (up - down) / (2 * eps)
    return grad
