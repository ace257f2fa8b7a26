"""Mods that index a tensor with the entries of another (``bias[doc[b, q_idx], doc[b, kv_idx]]``).

The interval check cannot bound such an index, so the int tensor's entries are checked against
the axis they index before each call (as ``embedding``'s ids are), by the executable and by the
reference alike; entries the graph computes cannot be checked before native code reads with them
and are refused at compile time; arithmetic on an entry is refused when the mod is traced.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph

B, S, H, D = 2, 19, 2, 8
RNG = np.random.default_rng(11)


def _normal(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _pair_bias_graph(seq: int | str = S) -> Graph:
    g = Graph("pair_bias")
    q, k, v, dy = (g.input(name, (B, seq, H, D)) for name in ("q", "k", "v", "dy"))
    doc = g.input("doc", (B, seq), dtype="int64")
    pair = g.input("pair", (3, 3))
    out = g.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + pair[doc[b, i], doc[b, j]] * (h + 1))
    dq, dk, dv, dpair = rlx.grad(g, out, [q, k, v, pair], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv, dpair=dpair)
    return g


def _pair_bias_inputs(seq: int = S) -> dict[str, np.ndarray]:
    return {
        **{name: _normal(B, seq, H, D) for name in ("q", "k", "v", "dy")},
        "doc": np.sort(RNG.integers(0, 3, (B, seq)), axis=-1),
        "pair": _normal(3, 3),
    }


def test_out_of_range_entries_are_refused_before_the_call_and_the_executable_keeps_working() -> None:
    g = _pair_bias_graph()
    exe = rlx.compile(g)
    arrays = _pair_bias_inputs()
    good = exe(**arrays)
    for bad in (3, -1):
        broken = dict(arrays, doc=arrays["doc"].copy())
        broken["doc"][1, 5] = bad
        pattern = rf"input 'doc': {bad} is out of range \[0, 3\) for the score_mod index into axis \d of captured"
        with pytest.raises(rlx.RlxValueError, match=pattern):
            exe(**broken)
        with pytest.raises(rlx.RlxValueError, match=pattern):
            rlx.reference.run(g, **broken)
    again = exe(**arrays)
    for name, want in good.items():
        np.testing.assert_array_equal(again[name], want, err_msg=name)


def test_the_gradient_of_a_table_read_at_entries_matches_central_differences() -> None:
    g = _pair_bias_graph()
    arrays = _pair_bias_inputs()
    arrays["doc"] = np.array([[0] * 10 + [1] * 9, [1] * 5 + [2] * 14])  # no batch pairs documents 0 and 2
    got = rlx.compile(g)(**arrays)
    forward = Graph("pair_loss")
    q, k, v, dy = (forward.input(name, (B, S, H, D)) for name in ("q", "k", "v", "dy"))
    doc, pair = forward.input("doc", (B, S), dtype="int64"), forward.input("pair", (3, 3))
    out = forward.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + pair[doc[b, i], doc[b, j]] * (h + 1))
    forward.output(loss=forward.sum(out * dy))
    wide = {name: a.astype(np.float64) if a.dtype == np.float32 else a for name, a in arrays.items()}
    step = 1e-6
    numeric = np.zeros((3, 3))
    for index in np.ndindex(3, 3):
        plus, minus = dict(wide, pair=wide["pair"].copy()), dict(wide, pair=wide["pair"].copy())
        plus["pair"][index] += step
        minus["pair"][index] -= step
        up = rlx.reference.evaluate(forward, plus, exact=True)["loss"]
        down = rlx.reference.evaluate(forward, minus, exact=True)["loss"]
        numeric[index] = (up - down) / (2 * step)
    assert numeric[0, 2] == numeric[2, 0] == got["dpair"][0, 2] == got["dpair"][2, 0] == 0
    np.testing.assert_allclose(got["dpair"], numeric, rtol=1e-3, atol=1e-4)


def test_entries_the_graph_computes_are_refused_at_compile_time() -> None:
    g = Graph("computed_ids")
    q, k, v = (g.input(name, (B, S, H, D)) for name in "qkv")
    doc = g.argmax(g.input("scores", (B, S, 3)), axis=-1)
    pair = g.input("pair", (3, 3))
    g.output(out=g.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + pair[doc[b, i], doc[b, j]]))
    with pytest.raises(rlx.RlxValueError, match=r"score_mod index .* come from argmax \(node \d+\)"):
        rlx.compile(g)


def test_arithmetic_on_an_entry_is_refused_when_traced() -> None:
    g = Graph("shifted_ids")
    q, k, v = (g.input(name, (B, S, H, D)) for name in "qkv")
    doc, pair = g.input("doc", (B, S), dtype="int64"), g.input("pair", (4, 4))
    with pytest.raises(rlx.RlxValueError, match=r"in \[-inf, inf\].*must be the entry itself"):
        g.attention(q, k, v, score_mod=lambda s, b, h, i, j: s + pair[doc[b, i] + 1, doc[b, j]])


def test_symbolic_lengths_compile_once_and_check_each_calls_entries() -> None:
    g = _pair_bias_graph("S")
    exe = rlx.compile(g)
    for seq in (5, 33):
        arrays = _pair_bias_inputs(seq)
        got, want = exe(**arrays), rlx.reference.run(g, **arrays)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=2e-4, err_msg=f"{name} at S={seq}")
        arrays["doc"][0, -1] = 7
        with pytest.raises(rlx.RlxValueError, match="input 'doc': 7 is out of range"):
            exe(**arrays)
    assert exe.compile_count == 1


def test_a_mask_read_at_entries_skips_the_tiles_it_hides() -> None:
    """A block-diagonal mask written as a lookup: the kernel agrees with the reference."""
    g = Graph("lookup_mask")
    q, k, v = (g.input(name, (B, 70, H, D)) for name in "qkv")
    seg, allowed = g.input("seg", (B, 70), dtype="int32"), g.input("allowed", (4, 4), dtype="bool")
    g.output(out=g.attention(q, k, v, mask_mod=lambda b, h, i, j: allowed[seg[b, i], seg[b, j]]))
    arrays = {
        **{name: _normal(B, 70, H, D) for name in "qkv"},
        "seg": np.repeat(np.arange(4, dtype=np.int32), [20, 30, 10, 10])[None].repeat(B, 0),
        "allowed": np.eye(4, dtype=bool),
    }
    got, want = rlx.compile(g)(**arrays), rlx.reference.run(g, **arrays)
    np.testing.assert_allclose(got["out"], want["out"], rtol=2e-4, atol=2e-5)

