"""Transposed copies of K (and V): the strips' Q K^T and dY V^T as NN products.

A call with at least ``PACK_MIN_ROWS`` query rows copies each head's K (and, where the backward
forms dP, V) transposed into the thread's scratch once per item, and its products read that copy
(leading dimension Sk) from the strip's first visible key on; a call with fewer rows (a decode
step) reads K and V in place as NT products. These tests pin both paths, and the call-time choice
of a symbolic query length, against the float64 reference, for the fixed-mask and the
programmable kernels, with GQA, Dv != D, both layouts and masks that skip keys.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, MaskKind
from rlx.codegen.blas import OMATCOPY
from rlx.codegen.lower_attention import PACK_MIN_ROWS

RTOL, ATOL = 2e-4, 2e-5


def _shapes(layout: Layout, batch: int, seq_q: int | str, seq_k: int | str, heads: int, kv_heads: int,
            dim: int, dim_v: int) -> dict[str, tuple[int | str, ...]]:
    def shape(seq: int | str, h: int, d: int) -> tuple[int | str, ...]:
        return (batch, h, seq, d) if layout == Layout.BHSD else (batch, seq, h, d)

    return {"q": shape(seq_q, heads, dim), "k": shape(seq_k, kv_heads, dim), "v": shape(seq_k, kv_heads, dim_v),
            "dy": shape(seq_q, heads, dim_v)}


def _graph(shapes: dict[str, tuple[int | str, ...]], layout: Layout, **attention: object) -> Graph:
    g = Graph("packed")
    q, k, v, dy = (g.input(name, shapes[name]) for name in ("q", "k", "v", "dy"))
    out = g.attention(q, k, v, layout=layout, **attention)  # type: ignore[arg-type]
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    return g


def _inputs(shapes: dict[str, tuple[int | str, ...]], sizes: dict[str, int], rng: np.random.Generator) -> dict:
    def concrete(shape: tuple[int | str, ...]) -> tuple[int, ...]:
        return tuple(sizes[d] if isinstance(d, str) else d for d in shape)

    return {name: rng.standard_normal(concrete(shape), dtype=np.float32) for name, shape in shapes.items()}


def _check(exe: rlx.Executable, g: Graph, arrays: dict[str, np.ndarray], context: str) -> None:
    got = exe(**arrays)
    want = rlx.reference.run(g, **arrays)
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=RTOL, atol=ATOL, err_msg=f"{context}: {name}")


FIXED_CASES = [
    (Layout.BSHD, MaskKind.NONE, 4, 2, 16, 24),
    (Layout.BHSD, MaskKind.CAUSAL, 4, 4, 32, 16),
    (Layout.BSHD, MaskKind.sliding_window(5), 6, 2, 16, 16),
]


@pytest.mark.parametrize("seq_q", [PACK_MIN_ROWS - 1, PACK_MIN_ROWS, 70])
@pytest.mark.parametrize(("layout", "mask", "heads", "kv_heads", "dim", "dim_v"), FIXED_CASES, ids=str)
def test_fixed_mask_kernels_on_both_sides_of_the_threshold(
    seq_q: int, layout: Layout, mask: MaskKind, heads: int, kv_heads: int, dim: int, dim_v: int,
    rng: np.random.Generator,
) -> None:
    """Forward and all gradients at Sq just below, at and well above the threshold (several
    strips, keys skipped by the causal and window masks), against the reference; the copies are
    made exactly where the threshold says."""
    shapes = _shapes(layout, 2, seq_q, 45, heads, kv_heads, dim, dim_v)
    g = _graph(shapes, layout, mask=mask)
    exe = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=2))
    assert (OMATCOPY in exe.llvm_ir) == (seq_q >= PACK_MIN_ROWS)
    _check(exe, g, _inputs(shapes, {}, rng), f"Sq={seq_q} {layout} {mask}")


@pytest.mark.parametrize("layout", [Layout.BSHD, Layout.BHSD])
def test_a_symbolic_query_length_chooses_per_call(layout: Layout, rng: np.random.Generator) -> None:
    """One compilation serves calls below and above the threshold (a decode step, a prefill),
    with a symbolic key length too, against the reference and bit-identical to one thread."""
    shapes = _shapes(layout, 2, "Sq", "Sk", 4, 2, 16, 8)
    g = _graph(shapes, layout, mask=MaskKind.CAUSAL)
    exe = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=2))
    one = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=1))
    before = rlx.codegen.executable.compile_count()
    for seq_q, seq_k in [(1, 9), (PACK_MIN_ROWS - 1, 30), (PACK_MIN_ROWS, 16), (40, 77), (3, 120), (90, 90)]:
        arrays = _inputs(shapes, {"Sq": seq_q, "Sk": seq_k}, rng)
        _check(exe, g, arrays, f"Sq={seq_q} Sk={seq_k}")
        for name, value in exe(**arrays).items():
            np.testing.assert_array_equal(value, one(**arrays)[name], err_msg=f"{name} Sq={seq_q} Sk={seq_k}")
    assert rlx.codegen.executable.compile_count() == before


@pytest.mark.parametrize("seq_q", [PACK_MIN_ROWS - 1, 50])
def test_programmable_kernels_read_the_copies(seq_q: int, rng: np.random.Generator) -> None:
    """A score_mod with a learnable tensor and a mask_mod that skips tiles, GQA and Dv != D: the
    forward with LSE and every gradient (the tensor's too) against the reference."""
    shapes = _shapes(Layout.BHSD, 2, seq_q, 150, 4, 2, 16, 24)
    g = Graph("flex_packed")
    q, k, v, dy = (g.input(name, shapes[name]) for name in ("q", "k", "v", "dy"))
    slopes = g.input("slopes", (4,))

    def alibi(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return score - slopes[h] * (q_idx - kv_idx)

    out, lse = g.attention(
        q, k, v, layout=Layout.BHSD, score_mod=alibi, mask_mod=rlx.mods.sliding_window(70), return_lse=True
    )
    grads = rlx.grad(g, out, [q, k, v, slopes], dy)
    g.output(out=out, lse=lse, **dict(zip(("dq", "dk", "dv", "dslopes"), grads, strict=True)))
    exe = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=2))
    assert (OMATCOPY in exe.llvm_ir) == (seq_q >= PACK_MIN_ROWS)
    arrays = _inputs(shapes, {}, rng) | {"slopes": rng.uniform(0.0, 0.2, 4).astype(np.float32)}
    _check(exe, g, arrays, f"flex Sq={seq_q}")
