"""``g.einsum`` against ``numpy.einsum`` in float64: values compiled and in the reference,
gradients against central differences of NumPy's einsum, the printed IR's round trip, errors."""

from __future__ import annotations

import string

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph

CASES: list[tuple[str, list[tuple[int, ...]]]] = [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit output
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bqhd,bkhd->bhqk", [(2, 5, 3, 4), (2, 6, 3, 4)]),  # attention scores from BSHD heads
    ("bhqk,bkhd->bqhd", [(2, 3, 5, 6), (2, 6, 3, 4)]),
    ("i,i", [(5,), (5,)]),
    ("i,j->ij", [(3,), (4,)]),  # an outer product: no contraction
    ("ij->ji", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("ii", [(4, 4)]),  # trace
    ("ii->i", [(4, 4)]),  # diagonal
    ("iji->ij", [(3, 2, 3)]),
    ("...ij,...jk", [(5, 1, 2, 3), (4, 3, 6)]),  # broadcast batch axes
    ("i...->...", [(2, 3, 4)]),
    ("...i,...i->...", [(2, 3, 4), (3, 4)]),
    ("Ba,bA", [(2, 3), (4, 5)]),  # upper case sorts first in the implicit output
    ("ij,ij->ij", [(1, 3), (2, 3)]),  # a size-1 axis broadcasts
    (",i->i", [(), (2,)]),
    ("abc,cd,de->abe", [(2, 3, 4), (4, 5), (5, 6)]),
    ("ab,ab,ab->a", [(2, 3), (2, 3), (2, 3)]),
    ("bn,anm,bm->ba", [(2, 3), (4, 3, 5), (2, 5)]),  # a bilinear form
    ("ijk,jil->kl", [(2, 3, 4), (3, 2, 5)]),
    (" a b , b c -> a c ", [(2, 3), (3, 4)]),
    ("...", [(2, 3)]),
    ("ii,jj", [(3, 3), (2, 2)]),
]


def _check(equation: str, shapes: list[tuple[int, ...]], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    wide = [a.astype(np.float64) for a in arrays]
    want = np.einsum(equation, *wide)
    g = Graph("einsum")
    operands = [g.input(f"x{i}", shape) for i, shape in enumerate(shapes)]
    y = g.einsum(equation, *operands)
    assert y.shape == want.shape
    weights = g.input("w", y.shape)
    grads = rlx.grad(g, g.sum(y * weights), operands)
    g.output(y=y, **{f"g{i}": grad for i, grad in enumerate(grads)})
    feed = {f"x{i}": a for i, a in enumerate(arrays)} | {"w": rng.standard_normal(y.shape).astype(np.float32)}
    got, reference = rlx.compile(g)(**feed), rlx.reference.run(g, **feed)
    np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(reference["y"], want, rtol=1e-6, atol=1e-6)
    w = feed["w"].astype(np.float64)
    for i, array in enumerate(wide):  # d sum(einsum * w) / d x_i by central differences of NumPy's einsum
        want_grad = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            up, down = [a.copy() for a in wide], [a.copy() for a in wide]
            up[i][index] += 1e-6
            down[i][index] -= 1e-6
            want_grad[index] = ((np.einsum(equation, *up) - np.einsum(equation, *down)) * w).sum() / 2e-6
        np.testing.assert_allclose(got[f"g{i}"], want_grad, rtol=1e-4, atol=1e-4, err_msg=f"operand {i}")
    assert str(rlx.parse(str(g))) == str(g)


@pytest.mark.parametrize(("equation", "shapes"), CASES, ids=[c[0].strip() or "empty" for c in CASES])
def test_einsum_matches_numpy(equation: str, shapes: list[tuple[int, ...]]) -> None:
    _check(equation, shapes)


def test_einsum_with_symbolic_lengths_compiles_once() -> None:
    g = Graph("projection")
    x, w = g.input("x", (2, "S", 4)), g.input("w", (4, 3))
    y = g.einsum("bsd,de->bse", x, w)
    scores = g.einsum("bsd,btd->bst", x, x)
    gx, gw = rlx.grad(g, g.sum(y * y) + g.sum(scores), [x, w])
    g.output(y=y, scores=scores, gx=gx, gw=gw)
    exe = rlx.compile(g)
    rng = np.random.default_rng(1)
    for length in (1, 5, 9):
        feed = {"x": rng.standard_normal((2, length, 4)).astype(np.float32), "w": rng.random((4, 3), np.float32)}
        got, reference = exe(**feed), rlx.reference.run(g, **feed)
        np.testing.assert_allclose(got["y"], np.einsum("bsd,de->bse", feed["x"], feed["w"]), rtol=1e-5, atol=1e-6)
        for name in got:
            np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert exe.compile_count == 1


def test_einsum_takes_numpy_operands_and_a_list() -> None:
    g = Graph("mixed")
    x = g.input("x", (3, 4))
    w = np.arange(8, dtype=np.float32).reshape(4, 2)
    g.output(a=g.einsum("ij,jk->ik", x, w), b=g.einsum("ij,jk->ik", [x, w]))
    xa = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    got = rlx.compile(g)(x=xa)
    np.testing.assert_allclose(got["a"], xa @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["a"], got["b"])


@pytest.mark.parametrize(
    ("equation", "operands", "error", "match"),
    [
        ("ij,jk->ik", ["a"], rlx.RlxValueError, r"subscripts for 2 operands, got 1"),
        ("ij->ik", ["a"], rlx.RlxValueError, r"output subscript 'k' is in no operand"),
        ("ij->ii", ["a"], rlx.RlxValueError, r"output subscript 'i' appears more than once"),
        ("ijk", ["a"], rlx.RlxValueError, r"operand 0 is f32\[3,4\], rank 2, but its subscripts 'ijk' name 3"),
        ("ij,jk", ["a", "a"], rlx.RlxValueError, r"subscript 'j' has size 4 in one operand and 3 in operand 1"),
        ("i1", ["a"], rlx.RlxValueError, r"'1' is not a subscript"),
        ("......", ["a"], rlx.RlxValueError, r"more than one '...'"),
        ("ii", ["a"], rlx.RlxValueError, r"repeats subscript 'i' on axes of sizes 3 and 4"),
        ("ii", ["s"], rlx.RlxValueError, r"repeats subscript 'i' on a symbolic axis"),
        ("...i->i", ["c"], rlx.RlxValueError, r"the operands' '...' stand for 1 axes, which the output must keep"),
        ("...i,...i", ["c", "d"], rlx.RlxValueError, r"subscript of '...' has size 2 in one operand and 5"),
        ("i", ["ids"], rlx.RlxTypeError, r"operand 0 must be f32, got i64 \(i64\[3\]\)"),
        (3, ["a"], rlx.RlxTypeError, r"the equation must be a str"),
    ],
)
def test_einsum_errors_name_what_is_wrong(equation: object, operands: list[str], error: type, match: str) -> None:
    g = Graph("bad")
    values = {
        "a": g.input("a", (3, 4)),
        "s": g.input("s", ("S", "S")),
        "c": g.input("c", (2, 4)),
        "d": g.input("d", (5, 4)),
        "ids": g.input("ids", (3,), dtype="int64"),
    }
    with pytest.raises(error, match=r"einsum: .*" + match):
        g.einsum(equation, *(values[name] for name in operands))  # type: ignore[arg-type]


@st.composite
def _equations(draw: st.DrawFn) -> tuple[str, list[tuple[int, ...]]]:
    """Random equations of 1-3 operands over a few labels (shared, contracted, repeated, free),
    some with '...' axes that broadcast, explicit or implicit outputs."""
    letters = draw(st.lists(st.sampled_from(string.ascii_letters[:6]), min_size=1, max_size=5, unique=True))
    sizes = {c: draw(st.integers(1, 4)) for c in letters}
    count = draw(st.integers(1, 3))
    broadcast = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))  # the shapes '...' stands for
    terms, shapes = [], []
    for _ in range(count):
        term = draw(st.lists(st.sampled_from(letters), min_size=0, max_size=4))
        shape = [sizes[c] for c in term]
        if broadcast and draw(st.booleans()):
            kept = broadcast[len(broadcast) - draw(st.integers(0, len(broadcast))) :]
            shape = [draw(st.sampled_from([d, 1])) for d in kept] + shape
            term = ["...", *term]
        terms.append("".join(term))
        shapes.append(tuple(shape))
    used = sorted({c for t in terms for c in t.replace("...", "")})
    if draw(st.booleans()):
        output = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
        equation = ",".join(terms) + "->" + ("..." if any("..." in t for t in terms) else "") + output
    else:
        equation = ",".join(terms)
    return equation, shapes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_equations(), st.integers(0, 2**16))
def test_random_einsums_match_numpy(case: tuple[str, list[tuple[int, ...]]], seed: int) -> None:
    equation, shapes = case
    try:
        np.einsum(equation, *(np.ones(s) for s in shapes))
    except ValueError:  # NumPy refuses it: rlx must too, with its own error
        g = Graph("refused")
        with pytest.raises(rlx.RlxValueError, match="einsum: "):
            g.einsum(equation, *(g.input(f"x{i}", s) for i, s in enumerate(shapes)))
        return
    _check(equation, shapes, seed)
