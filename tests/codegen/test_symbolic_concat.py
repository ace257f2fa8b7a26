"""Symbolic dimensions that add up: concat along a symbolic axis (a KV cache and the new token make
``P+1``), split at symbolic sizes (its gradient), and reshapes that carry such a sum.

Each graph compiles once and matches the float64 reference at several sizes, an empty cache
(``P = 0``) included; the textual IR prints and parses the sums."""

from __future__ import annotations

import re

import numpy as np
import pytest
from codegen_helpers import assert_close
from helpers import central_differences

import rlx
from rlx import Graph
from rlx.ir.dims import Size, dim_size, dim_text, exact_quotient, parse_dim, poly
from rlx.reference import evaluate

B, H, D = 2, 4, 16


def _decode_step() -> Graph:
    """One decode step: the cache's keys and values with the new token's appended, attention of
    the new query over all of them, and the gradients w.r.t. the query, the cache and the token."""
    g = Graph("decode")
    q = g.input("q", (B, 1, H, D))
    cache_k, cache_v = g.input("cache_k", (B, "P", H, D)), g.input("cache_v", (B, "P", H, D))
    new_k, new_v = g.input("new_k", (B, 1, H, D)), g.input("new_v", (B, 1, H, D))
    k = g.concat([cache_k, new_k], axis=1)
    v = g.concat([cache_v, new_v], axis=1)
    o = g.attention(q, k, v, mask=rlx.MaskKind.CAUSAL)
    loss = g.sum(o * o)
    grads = rlx.grad(g, loss, [q, cache_k, new_k, cache_v, new_v])
    g.output(o=o, k=k, loss=loss, **dict(zip(["dq", "dcache_k", "dnew_k", "dcache_v", "dnew_v"], grads, strict=True)))
    return g


def _decode_arrays(rng: np.random.Generator, cached: int) -> dict[str, np.ndarray]:
    shapes = {"q": 1, "cache_k": cached, "cache_v": cached, "new_k": 1, "new_v": 1}
    return {name: rng.standard_normal((B, rows, H, D), dtype=np.float32) for name, rows in shapes.items()}


def test_a_cache_and_a_new_token_concatenate_to_p_plus_1() -> None:
    g = _decode_step()
    assert str(g.outputs["k"].type) == f"f32[{B},P+1,{H},{D}]"
    assert g.outputs["dcache_k"].shape == (B, "P", H, D) and g.outputs["dnew_k"].shape == (B, 1, H, D)
    assert str(rlx.ir.parse(str(g))) == str(g)


@pytest.mark.parametrize("cached", [0, 1, 7, 64, 130])
def test_decode_step_over_a_symbolic_cache_matches_the_reference(cached: int) -> None:
    g = _decode_step()
    exe = rlx.compile(g)
    rng = np.random.default_rng(cached)
    arrays = _decode_arrays(rng, cached)
    got, want = exe(**arrays), rlx.reference.run(g, **arrays)
    for name, expected in want.items():
        assert got[name].shape == expected.shape, name
        assert_close(got[name], expected, f"{name} at P={cached}", rtol=2e-4, atol=2e-5)
    # the appended row is the new token's, and the gradient of the cache is the first P rows'
    np.testing.assert_array_equal(got["k"][:, cached:], arrays["new_k"])
    np.testing.assert_array_equal(got["k"][:, :cached], arrays["cache_k"])


def test_one_compilation_serves_every_cache_length() -> None:
    g = _decode_step()
    exe = rlx.compile(g)
    rng = np.random.default_rng(1)
    for cached in (3, 40, 0, 9):
        arrays = _decode_arrays(rng, cached)
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        assert_close(got["dcache_v"], want["dcache_v"], f"dcache_v at P={cached}", rtol=2e-4, atol=2e-5)
    assert exe.compile_count == 1


def test_split_at_a_symbolic_offset_inside_a_fused_loop() -> None:
    """The part after a symbolic one starts at a per-call offset, read inline by a fused loop nest
    (no buffer for the concatenation's elementwise producer)."""
    g = Graph("tail")
    x = g.input("x", (3, "S", 5))
    head = g.constant(np.linspace(-1, 1, 15, dtype=np.float32).reshape(3, 1, 5))
    grown = g.tanh(g.concat([head, x, head * 2.0], axis=1)) * 1.5  # (3, S+2, 5), computed inline
    first, middle, last = g.split(grown, [1, "S", 1], axis=1)
    y = g.sum(middle * last + first, axis=1)
    loss = g.sum(y * y)
    (dx,) = rlx.grad(g, loss, [x])
    g.output(y=y, middle=middle, dx=dx)
    exe = rlx.compile(g)
    rng = np.random.default_rng(2)
    for s in (1, 6, 37):
        arrays = {"x": rng.standard_normal((3, s, 5), dtype=np.float32)}
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name in want:
            assert_close(got[name], want[name], f"{name} at S={s}", rtol=2e-4, atol=2e-5)
    assert exe.compile_count == 1


def test_gradient_of_a_concat_along_a_symbolic_axis_against_finite_differences() -> None:
    g = Graph("cat")
    a, b = g.input("a", (2, "N")), g.input("b", (2, 3))
    c = g.concat([a, b, a], axis=1)  # (2, 2*N+3)
    loss = g.sum(g.softmax(c, axis=1) * g.constant(np.arange(1, 3, dtype=np.float32).reshape(2, 1)))
    da, db = rlx.grad(g, loss, [a, b])
    g.output(loss=loss, da=da, db=db)
    assert c.shape == (2, "2*N+3")
    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal((2, 4), dtype=np.float32), "b": rng.standard_normal((2, 3), dtype=np.float32)}
    got = rlx.compile(g)(**arrays)
    for name, grad in (("a", got["da"]), ("b", got["db"])):
        base = arrays[name].astype(np.float64)  # perturbed in place by central_differences
        numeric = central_differences(
            lambda name=name, base=base: float(evaluate(g, {**arrays, name: base}, exact=True)["loss"]), base, eps=1e-5
        )
        np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-4)


def test_reshape_carries_a_sum_through_and_divides_where_it_can() -> None:
    g = Graph("reshape")
    x = g.input("x", (2, "P", 4, 8))
    y = g.concat([x, g.input("t", (2, 1, 4, 8))], axis=1)  # (2, P+1, 4, 8)
    assert g.reshape(y, (2, "P+1", -1)).shape == (2, "P+1", 32)
    assert g.reshape(y, (-1, 32)).shape == ("2*P+2", 32)
    assert g.reshape(y, (2, " P + 1 ", 32)).shape == (2, "P+1", 32)  # written any way, kept canonical
    assert g.reshape(g.reshape(y, (-1,)), (2, -1, 4, 8)).shape == (2, "P+1", 4, 8)
    with pytest.raises(rlx.RlxValueError, match="reshape"):
        g.reshape(y, (2, "P", -1))  # (P+1)*32 has no factor P
    with pytest.raises(rlx.RlxValueError, match="reshape"):
        g.reshape(y, (2, "P+2", 32))
    g.output(z=g.reshape(y, (-1, 32)))
    exe = rlx.compile(g)
    rng = np.random.default_rng(4)
    for p in (0, 3):
        arrays = {"x": rng.standard_normal((2, p, 4, 8), dtype=np.float32), "t": np.ones((2, 1, 4, 8), np.float32)}
        np.testing.assert_array_equal(exe(**arrays)["z"], np.concatenate([arrays["x"], arrays["t"]], 1).reshape(-1, 32))


def test_splits_of_a_symbolic_axis_must_add_up_for_every_size() -> None:
    g = Graph("bad")
    x = g.concat([g.input("x", (2, "P")), g.input("y", (2, 3))], axis=1)  # (2, P+3)
    with pytest.raises(rlx.RlxValueError, match="cannot share equally"):
        g.split(x, 2, axis=1)
    with pytest.raises(rlx.RlxValueError, match="add up to P\\+3"):
        g.split(x, ["P", 2], axis=1)
    with pytest.raises(rlx.RlxValueError, match="add up to P\\+3"):
        g.split(x, ["P-S", 3], axis=1)
    assert [v.shape for v in g.split(x, ["P-1", 4], axis=1)] == [(2, "P-1"), (2, 4)]  # P >= 1 per call
    assert [v.shape for v in g.split(x, [1, "P", 2], axis=1)] == [(2, 1), (2, "P"), (2, 2)]
    doubled = g.concat([x, x], axis=1)  # (2, 2*P+6): two equal parts of P+3
    assert [v.shape for v in g.split(doubled, 2, axis=1)] == [(2, "P+3"), (2, "P+3")]


def test_an_input_may_declare_an_expression_of_symbols_bound_before_it() -> None:
    """A mask over the cache and the new token: ``(B, "P+1")`` after the cache's ``(B, "P", ...)``."""
    g = Graph("inputs")
    cache = g.input("cache", (2, "P", 4))
    new = g.input("new", (2, 1, 4))
    weights = g.input("weights", (2, " 1 + P "))  # written any way, kept canonical
    assert weights.shape == (2, "P+1")
    y = g.sum(g.concat([cache, new], axis=1), axis=2) * weights
    g.output(y=y)
    exe = rlx.compile(g)
    rng = np.random.default_rng(5)
    for p in (0, 1, 9):
        arrays = {
            "cache": rng.standard_normal((2, p, 4), dtype=np.float32),
            "new": rng.standard_normal((2, 1, 4), dtype=np.float32),
            "weights": rng.standard_normal((2, p + 1), dtype=np.float32),
        }
        assert_close(exe(**arrays)["y"], rlx.reference.run(g, **arrays)["y"], f"y at P={p}", rtol=1e-5, atol=1e-6)
        bad = {**arrays, "weights": np.ones((2, p + 2), np.float32)}
        for run in (exe, lambda **a: rlx.reference.run(g, **a)):
            with pytest.raises(
                rlx.RlxValueError, match=f"'weights': axis 1 is P\\+1 = {p + 1} \\(P={p} from input 'cache'\\)"
            ):
                run(**bad)
    assert exe.compile_count == 1
    assert str(rlx.ir.parse(str(g))) == str(g)


def test_an_input_expression_needs_its_symbols_named_first() -> None:
    g = Graph("inputs")
    with pytest.raises(rlx.RlxValueError, match="'Q'"):
        g.input("x", (2, "Q+1"))
    with pytest.raises(rlx.RlxValueError, match="'N'"):
        g.input("y", ("2*N", "N"))  # the name comes after the expression that needs it
    assert g.input("z", ("N", "2*N")).shape == ("N", "2*N")


def test_rlx_torch_differentiates_an_output_of_a_symbolic_sum() -> None:
    """``rt.compile``'s backward takes a cotangent shaped like the output, ``P+1`` included."""
    torch = pytest.importorskip("torch")
    import rlx.torch as rt

    g = Graph("grow")
    a, b, w = g.input("a", (2, "P", 8)), g.input("b", (2, 1, 8)), g.input("w", (8, 8))
    h = g.tanh(g.concat([a, b], axis=1) @ w)
    g.output(y=g.sum(h * h, axis=2))
    f = rt.compile(g)
    for p in (3, 6):
        ta, tb, tw = (torch.randn(*shape, requires_grad=True) for shape in ((2, p, 8), (2, 1, 8), (8, 8)))
        y = f(a=ta, b=tb, w=tw)["y"]
        expected = (torch.tanh(torch.cat([ta, tb], 1) @ tw) ** 2).sum(2)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        got = torch.autograd.grad(y.sum(), (ta, tb, tw))
        want = torch.autograd.grad(expected.sum(), (ta, tb, tw))
        for x, z in zip(got, want, strict=True):
            torch.testing.assert_close(x, z, rtol=1e-4, atol=1e-5)


def test_the_textual_ir_parses_sums_of_products() -> None:
    text = 'graph @t {\n  %x = input "x" : f32[2,N,3]\n  %0 = concat %x, %x {axis = 1} : f32[2,2*N,3]\n}'
    assert str(rlx.ir.parse(text)).splitlines()[2].endswith("f32[2,2*N,3]")
    g = Graph("t")
    a, b = g.input("a", ("N", 3)), g.input("b", ("S", 3))
    c = g.concat([a, b, a, g.input("c", (2, 3))], axis=0)
    parts = g.split(c, ["N", "S", "N+2"], axis=0)
    g.output(c=c, last=parts[2])
    assert c.shape == ("2*N+S+2", 3)
    assert str(rlx.ir.parse(str(g))) == str(g)


def test_dimension_polynomials() -> None:
    assert parse_dim("1 + P") == "P+1" and parse_dim("S*B + B") == "B*S+B" and parse_dim("3") is None
    assert parse_dim("P-1") == "P-1" and parse_dim("-2+P") == "P-2" and parse_dim("P-S") == "P-S"
    assert parse_dim("0*P") is None and parse_dim("P+") is None and parse_dim("P--1") is None
    assert parse_dim("1-P") == "-P+1" and parse_dim("S*S-2*S+1") == dim_text(poly("S-1") * poly("S-1"))
    assert dim_text(poly("N") * 2 + poly("S") + 1) == "2*N+S+1"
    assert dim_size("2*N+S+1", {"N": 3, "S": 5}) == 12 and dim_size("B*S+B", {"B": 2, "S": 0}) == 2
    assert exact_quotient(poly("4*P+8"), 4) == poly("P+2")
    assert exact_quotient(poly("4*P+8"), poly("P")) is None and exact_quotient(poly("B*S+B"), poly("B")) == poly("S+1")
    assert Size.symbol("P") + 1 == poly("P+1")


def _next_token_graph() -> Graph:
    """A language model's step over a symbolic length: inputs ``ids[:, :-1]``, targets
    ``ids[:, 1:]`` (both ``S-1`` long), the last position's logits and a slice from each end."""
    g = Graph("next_token")
    ids = g.input("ids", (2, "S"), dtype="int64")
    table, w = g.input("table", (11, 8)), g.input("w", (8, 11))
    logits = g.embedding(table, ids[:, :-1]) @ w
    loss = g.cross_entropy(logits, ids[:, 1:])
    dtable, dw = rlx.grad(g, loss, [table, w])
    g.output(loss=loss, last=logits[:, -1], first=logits[:, 0], middle=logits[:, 1:-1], dtable=dtable, dw=dw)
    return g


def test_slices_of_a_symbolic_axis_are_symbolic() -> None:
    g = _next_token_graph()
    shapes = {name: value.shape for name, value in g.outputs.items()}
    assert shapes["last"] == (2, 11) and shapes["first"] == (2, 11) and shapes["middle"] == (2, "S-3", 11)
    assert str(rlx.ir.parse(str(g))) == str(g)
    x = Graph("views").input("x", (3, "S", 4))
    assert x[:, 2:].shape == (3, "S-2", 4) and x[:, -5:].shape == (3, 5, 4) and x[:, 1:4].shape == (3, 3, 4)
    assert x[:, :].shape == (3, "S", 4) and x[:, -1, 1:].shape == (3, 3)
    with pytest.raises(rlx.RlxValueError, match="takes nothing"):
        x[:, 3:2]
    with pytest.raises(rlx.RlxValueError, match="shrinks as the axis grows"):
        x[:, -3:5]  # from S-3 to 5: 8-S long
    with pytest.raises(rlx.RlxValueError, match="step"):
        x[:, ::2]


@pytest.mark.parametrize("length", [4, 3, 17])
def test_next_token_slices_match_the_reference(length: int) -> None:
    g = _next_token_graph()
    exe = rlx.compile(g)
    rng = np.random.default_rng(length)
    arrays = {
        "ids": rng.integers(0, 11, (2, length)),
        "table": rng.standard_normal((11, 8), dtype=np.float32),
        "w": rng.standard_normal((8, 11), dtype=np.float32),
    }
    got, want = exe(**arrays), rlx.reference.run(g, **arrays)
    for name, expected in want.items():
        assert got[name].shape == expected.shape, name
        assert_close(got[name], expected, f"{name} at S={length}", rtol=2e-4, atol=2e-5)
    logits = arrays["table"][arrays["ids"][:, :-1]] @ arrays["w"]  # independent of the reference
    assert_close(got["last"], logits[:, -1], "last", rtol=1e-5, atol=1e-6)
    assert_close(got["middle"], logits[:, 1:-1], "middle", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length", [2, 1, 0])
def test_an_axis_too_short_for_its_slices_is_an_error_naming_the_value(length: int) -> None:
    """``logits[:, 1:-1]`` needs ``S >= 3`` here; NumPy would clamp a slice past the end, rlx
    refuses the call before anything runs (compiled or reference alike)."""
    g = _next_token_graph()
    arrays = {
        "ids": np.zeros((2, length), np.int64),
        "table": np.ones((11, 8), np.float32),
        "w": np.ones((8, 11), np.float32),
    }
    for run in (rlx.compile(g), lambda **a: rlx.reference.run(g, **a)):
        with pytest.raises(rlx.RlxValueError, match=f"is -1 in this call \\(S={length}\\); an index or a slice"):
            run(**arrays)


def test_a_slice_that_leaves_an_empty_piece_runs() -> None:
    """``x[:, -1]`` at S = 1 leaves nothing before the last row: that call has a 0 in its shapes
    and runs as an empty call does, with the values NumPy gives."""
    g = Graph("last")
    x = g.input("x", (2, "S", 3))
    g.output(last=x[:, -1] * 2.0, rest=g.sum(x[:, :-1], axis=1))
    exe = rlx.compile(g)
    for length in (1, 5):
        array = np.random.default_rng(length).standard_normal((2, length, 3), dtype=np.float32)
        got = exe(x=array)
        np.testing.assert_array_equal(got["last"], array[:, -1] * 2.0)
        np.testing.assert_allclose(got["rest"], array[:, :-1].sum(axis=1), rtol=1e-6, atol=1e-6)


def test_an_input_declared_shorter_than_a_symbol_is_checked_on_every_path() -> None:
    """``m`` is ``(2, "S-1")``: the quick binding of plain arrays, the generic one and rlx.torch's
    direct path all refuse an ``m`` of any other length before native code reads it."""
    g = Graph("shorter")
    x = g.input("x", (2, "S", 3))
    m = g.input("m", (2, "S-1"))
    g.output(y=g.sum(x[:, 1:], axis=2) * m)
    exe = rlx.compile(g)
    for length in (4, 2):
        got = exe(x=np.ones((2, length, 3), np.float32), m=np.full((2, length - 1), 2.0, np.float32))
        np.testing.assert_array_equal(got["y"], np.full((2, length - 1), 6.0, np.float32))
    for wrong in (np.ones((2, 4), np.float32), np.ones((2, 4), np.float32)[:, ::1].copy(order="F")):
        with pytest.raises(rlx.RlxValueError, match=re.escape("'m': axis 1 is S-1 = 3 (S=4 from input 'x'), got 4")):
            exe(x=np.ones((2, 4, 3), np.float32), m=wrong)
    torch = pytest.importorskip("torch")
    import rlx.torch as rt

    f = rt.compile(g)
    assert f(x=torch.ones(2, 5, 3), m=torch.ones(2, 4))["y"].shape == (2, 4)
    with pytest.raises(rlx.RlxValueError, match="S-1"):
        f(x=torch.ones(2, 5, 3), m=torch.ones(2, 5))


def test_the_unread_piece_before_a_last_row_does_not_make_a_call_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``x[:, -1]`` splits off a piece of ``S-1`` rows that nothing reads: at S = 1 that piece is
    empty, and the call still runs compiled (only a value that is read and empty makes a call
    run on the reference interpreter)."""
    g = Graph("last_row")
    x = g.input("x", (2, "S", 3))
    w = g.input("w", (3, 4))
    g.output(y=g.tanh(x[:, -1] @ w))
    exe = rlx.compile(g)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ran as an empty call")

    monkeypatch.setattr(type(exe), "_run_empty", refuse)
    rng = np.random.default_rng(6)
    weights = rng.standard_normal((3, 4), dtype=np.float32)
    for length in (1, 2, 9):
        array = rng.standard_normal((2, length, 3), dtype=np.float32)
        np.testing.assert_allclose(exe(x=array, w=weights)["y"], np.tanh(array[:, -1] @ weights), rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    with pytest.raises(rlx.RlxValueError, match="is -1 in this call"):
        exe(x=np.ones((2, 0, 3), np.float32), w=weights)  # S = 0: no last row (the piece before it is -1)
