"""Graph API: order, use lists, rewiring, erasing, copying, verification, flags and masks."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, TensorType, Value, Wrt
from rlx.ir import AttentionAttrs, InputAttrs, parse

from .graphs import SK, SQ, B, D, H, spec_graph


def _qkv(g: Graph) -> tuple[Value, Value, Value, Value]:
    return g.inputs["q"], g.inputs["k"], g.inputs["v"], g.inputs["dy"]


def _assert_topological(g: Graph) -> None:
    seen: set[int] = set()
    for node in g.nodes:
        assert all(v.node.id in seen for v in node.inputs), f"node {node.id} printed before an operand"
        seen.add(node.id)


# ----------------------------------------------------------------------------- order and uses


def test_nodes_are_topological_after_rewiring_to_a_newer_input() -> None:
    """Creation order is no longer topological once a node reads a later input; g.nodes still is."""
    g = spec_graph()
    q = g.inputs["q"]
    o = g.outputs["o"]
    late_q = g.input("late_q", q.shape)
    g.set_input(o.node, 0, late_q)
    order = [n.id for n in g.nodes]
    assert order.index(late_q.node.id) < order.index(o.node.id)
    assert late_q.node.id > o.node.id
    _assert_topological(g)
    g.verify()
    assert str(parse(str(g))) == str(g)


def test_nodes_break_ties_by_creation_order() -> None:
    g = spec_graph()
    assert [n.id for n in g.nodes] == sorted(n.id for n in g.nodes)
    assert [n.op for n in g.nodes] == [OpKind.INPUT] * 4 + [OpKind.ATTENTION, OpKind.ATTENTION_BWD]


@pytest.mark.parametrize("seed", range(6))
def test_the_cached_order_grows_as_a_fresh_sort_would(seed: int) -> None:
    """A new node joins the cached order at its end, also after rewiring has made creation order
    differ from graph order: the list is the one a sort of the whole graph gives."""
    rng = np.random.default_rng(seed)
    g = Graph()
    values = [g.input(f"x{i}", (2,)) for i in range(2)]
    for step in range(40):
        _ = g.nodes  # keep the order cached, so the next node is appended to it
        if step % 7 == 6:  # rewire an older node to read a newer input (creation order stops being topological)
            late = g.input(f"late{step}", (2,))
            computed = [v.node for v in values if v.node.inputs]
            target = computed[int(rng.integers(0, len(computed)))]
            g.set_input(target, int(rng.integers(0, len(target.inputs))), late)
            values.append(late)
            continue
        a, b = (values[int(i)] for i in rng.integers(0, len(values), 2))
        values.append(a * b if rng.random() < 0.5 else rlx.tanh(a) + b)
        cached = [n.id for n in g.nodes]
        g._order = g._places = None
        assert cached == [n.id for n in g.nodes], step
        assert g._place() == {node_id: place for place, node_id in enumerate(cached)}


def test_users_are_distinct_and_oldest_first() -> None:
    g = Graph("u")
    x = g.input("x", (1, 3, 1, 2))
    a = g.attention(x, x, x)  # reads x three times
    b = g.attention_bwd(x, a, a, x, wrt=Wrt.KEY)
    assert x.node.users == [a.node, b.node]
    assert a.node.users == [b.node]
    assert b.node.users == []
    assert g.users(x.node) == x.node.users


def test_uses_lists_every_slot() -> None:
    g = Graph("u")
    x = g.input("x", (1, 3, 1, 2))
    a = g.attention(x, x, x)
    b = g.attention_bwd(x, a, a, x, wrt=Wrt.KEY)
    assert g.uses(x) == [(a.node, 0), (a.node, 1), (a.node, 2), (b.node, 0), (b.node, 3)]
    assert g.uses(a) == [(b.node, 1), (b.node, 2)]
    assert g.uses(b) == []


def test_uses_tell_outputs_of_one_node_apart() -> None:
    g = spec_graph()
    dq, dk, dv = (g.outputs[n] for n in ("dq", "dk", "dv"))
    reader = g.attention(g.inputs["q"], dk, dv)
    assert g.uses(dk) == [(reader.node, 1)]
    assert g.uses(dv) == [(reader.node, 2)]
    assert g.uses(dq) == []
    assert dk.node.users == [reader.node]


# ----------------------------------------------------------------------------- inputs mapping


def test_inputs_mapping_is_cached_and_read_only() -> None:
    """Executables read ``graph.inputs`` on every call: it must not be rebuilt each time."""
    g = spec_graph()
    first = g.inputs
    assert g.inputs is first
    assert list(first) == ["q", "k", "v", "dy"]
    with pytest.raises(TypeError):
        first["x"] = first["q"]  # type: ignore[index]
    g.attention(first["q"], first["k"], first["v"])  # new nodes that are not inputs keep the cache
    assert g.inputs is first


def test_inputs_mapping_follows_input_and_erase() -> None:
    g = spec_graph()
    before = g.inputs
    spare = g.input("spare", (3,))
    after = g.inputs
    assert after is not before and list(after) == ["q", "k", "v", "dy", "spare"]
    assert after["spare"] == spare
    assert "spare" not in before, "a mapping handed out earlier is a snapshot"
    g.erase(spare.node)
    assert list(g.inputs) == ["q", "k", "v", "dy"] and g.inputs is not after
    assert "spare" in after


def test_inputs_mapping_of_a_copy_reads_the_copy() -> None:
    g = spec_graph()
    original = g.inputs
    clone = g.copy()
    assert all(value.node.graph is clone for value in clone.inputs.values())
    assert list(clone.inputs) == list(original)
    clone.input("extra", (1,))
    assert "extra" in clone.inputs and "extra" not in g.inputs
    assert g.inputs is original
    parsed = parse(str(g))
    assert all(value.node.graph is parsed for value in parsed.inputs.values())


# ----------------------------------------------------------------------------- rewiring


def test_replace_all_uses_with_rewires_nodes_and_graph_outputs() -> None:
    g = spec_graph()
    q, k, v, _ = _qkv(g)
    old = g.outputs["o"]
    reader = g.attention(old, k, v)
    g.output(again=old)
    new = g.attention(q, k, v, mask=MaskKind.sliding_window(1))
    g.replace_all_uses_with(old, new)
    assert reader.node.inputs[0] == new
    assert g.outputs["o"] == new and g.outputs["again"] == new
    assert g.uses(old) == [] and old.node.users == []
    assert reader.node in new.node.users
    assert list(g.outputs) == ["o", "dq", "dk", "dv", "again"], "output names and order are kept"
    g.erase(old.node)
    g.verify()


def test_replace_all_uses_with_refuses_another_type() -> None:
    g = spec_graph()
    with pytest.raises(rlx.RlxValueError, match=r"f32\[2,5,2,4\] cannot be replaced by f32\[2,3,2,4\]"):
        g.replace_all_uses_with(g.outputs["dq"], g.outputs["dk"])
    assert g.outputs["dq"].index == 0


def test_replace_all_uses_with_refuses_a_value_of_another_graph() -> None:
    g, other = spec_graph(), spec_graph()
    with pytest.raises(rlx.RlxValueError, match="replace_all_uses_with: new belongs to graph"):
        g.replace_all_uses_with(g.outputs["o"], other.outputs["o"])


def test_set_input_refuses_a_cycle_and_leaves_the_graph_as_it_was() -> None:
    g = spec_graph()
    q, k, v, _ = _qkv(g)
    first = g.attention(q, k, v)
    second = g.attention(first, k, v)
    before = str(g)
    with pytest.raises(rlx.RlxValueError, match=r"set_input: reading node \d+ from node \d+ would make a cycle"):
        g.set_input(first.node, 0, second)
    with pytest.raises(rlx.RlxValueError, match="would make a cycle"):
        g.set_input(first.node, 0, first)  # reading its own output
    assert first.node.inputs[0] == q
    assert str(g) == before
    assert g.uses(second) == []
    g.verify()


def test_set_input_refuses_another_type() -> None:
    g = spec_graph()
    k = g.inputs["k"]
    with pytest.raises(rlx.RlxValueError, match=r"slot 0 of node \d+ has type f32\[2,5,2,4\], got f32\[2,3,2,4\]"):
        g.set_input(g.outputs["o"].node, 0, k)


def test_set_input_refuses_a_slot_out_of_range_and_names_node_and_slot_count() -> None:
    """Regression: an out-of-range slot raised a bare IndexError (and -1 rewired the last slot)."""
    g = spec_graph()
    q = g.inputs["q"]
    fwd = g.outputs["o"].node
    before = str(g)
    for slot in (3, 7, -1):
        with pytest.raises(rlx.RlxValueError) as info:
            g.set_input(fwd, slot, q)
        assert str(info.value) == f"set_input: node {fwd.id} (attention) has 3 inputs (slots 0 to 2), got slot {slot}"
    with pytest.raises(rlx.RlxValueError, match=rf"set_input: node {q.node.id} \(input\) has no inputs, got slot 0"):
        g.set_input(q.node, 0, q)
    assert str(g) == before
    g.verify()


@pytest.mark.parametrize("slot", ["0", 0.0, True, None])
def test_set_input_refuses_a_slot_that_is_not_an_int(slot: object) -> None:
    g = spec_graph()
    fwd = g.outputs["o"].node
    with pytest.raises(rlx.RlxTypeError, match=rf"set_input: slot of node {fwd.id} \(attention\) must be an int"):
        g.set_input(fwd, slot, g.inputs["q"])  # type: ignore[arg-type]
    assert fwd.inputs[0] == g.inputs["q"]


def test_set_input_accepts_a_numpy_int_slot() -> None:
    g = spec_graph()
    fwd = g.outputs["o"].node
    g.set_input(fwd, np.int64(0), g.inputs["dy"])  # dy has q's shape
    assert fwd.inputs[0] == g.inputs["dy"]
    g.verify()


# ----------------------------------------------------------------------------- outputs


def test_positional_outputs_take_the_lowest_free_names_after_remove_output() -> None:
    """Regression: names were ``out{len(outputs)}``, which clashed once an output was removed."""
    g = spec_graph()
    q, k, v, dy = _qkv(g)
    g.output(q, k)
    assert g.outputs["out0"] == q and g.outputs["out1"] == k
    g.remove_output("out0")
    g.output(v)
    assert g.outputs["out0"] == v and g.outputs["out1"] == k
    g.output(dy, q)
    assert [name for name in g.outputs if name.startswith("out")] == ["out1", "out0", "out2", "out3"]
    g.verify()


def test_positional_outputs_skip_keyword_names_like_out_n() -> None:
    g = spec_graph()
    q, k, v, dy = _qkv(g)
    g.output(out1=q)
    g.output(k, v)  # used to name them out1 (clash) and out2
    assert dict(g.outputs)["out0"] == k and dict(g.outputs)["out2"] == v
    g.output(dy, out3=q)  # a keyword of the same call is taken too
    assert g.outputs["out4"] == dy and g.outputs["out3"] == q
    assert str(parse(str(g))) == str(g)


def test_a_keyword_output_still_refuses_an_existing_name() -> None:
    g = spec_graph()
    g.output(g.inputs["q"])
    with pytest.raises(rlx.RlxValueError, match="graph 'attn' already has an output named 'out0'"):
        g.output(out0=g.inputs["k"])
    assert g.outputs["out0"] == g.inputs["q"]


def test_remove_output_of_an_unknown_name_is_an_rlx_key_error_listing_the_outputs() -> None:
    g = spec_graph()
    with pytest.raises(rlx.RlxKeyError) as info:
        g.remove_output("nope")
    assert isinstance(info.value, KeyError)
    assert str(info.value) == "graph 'attn' has no output named 'nope'; outputs: ['o', 'dq', 'dk', 'dv']"
    assert list(g.outputs) == ["o", "dq", "dk", "dv"]


# ----------------------------------------------------------------------------- erasing


def test_erase_refuses_while_users_remain_and_names_them() -> None:
    g = spec_graph()
    q = g.inputs["q"]
    fwd = g.outputs["o"].node
    bwd = g.outputs["dq"].node
    with pytest.raises(rlx.RlxValueError) as info:
        g.erase(q.node)
    message = str(info.value)
    assert f"cannot erase node {q.node.id} (input)" in message
    assert f"node {fwd.id} (attention)" in message and f"node {bwd.id} (attention_bwd)" in message
    assert q.node in g


def test_erase_refuses_graph_outputs_and_names_them() -> None:
    g = spec_graph()
    bwd = g.outputs["dq"].node
    expected = r"cannot erase node \d+ \(attention_bwd\): it is graph output dq, dk, dv"
    with pytest.raises(rlx.RlxValueError, match=expected):
        g.erase(bwd)
    for name in ("dq", "dk", "dv"):
        g.remove_output(name)
    g.erase(bwd)
    assert bwd not in g and len(g) == 5
    g.verify()


def test_erasing_an_input_removes_it_from_the_inputs() -> None:
    g = spec_graph()
    spare = g.input("spare", (3,))
    g.erase(spare.node)
    assert "spare" not in g.inputs
    assert g.input("spare", (4,)).shape == (4,), "the name is free again"


def test_erase_refuses_a_node_of_another_graph() -> None:
    g, other = spec_graph(), spec_graph()
    with pytest.raises(rlx.RlxValueError, match="does not belong to graph 'attn'"):
        g.erase(other.outputs["o"].node)


# ----------------------------------------------------------------------------- copying


def test_copy_is_independent_of_the_original() -> None:
    g = spec_graph()
    before = str(g)
    clone = g.copy()
    assert str(clone) == before
    assert [n.id for n in clone.nodes] == [n.id for n in g.nodes]
    assert all(c is not n and c.graph is clone for c, n in zip(clone.nodes, g.nodes, strict=True))

    q, k, v, _ = _qkv(clone)
    extra = clone.attention(q, k, v, mask=MaskKind.sliding_window(2))
    clone.replace_all_uses_with(clone.outputs["o"], extra)
    clone.erase(clone.node(g.outputs["o"].node.id))
    for name in ("dq", "dk", "dv"):
        clone.remove_output(name)
    clone.input("more", (1,))

    assert str(g) == before
    g.verify()
    clone.verify()
    assert g.outputs["o"].node.attrs.mask == MaskKind.CAUSAL
    assert g.outputs["o"] not in clone and extra not in g
    with pytest.raises(rlx.RlxValueError, match="belongs to graph"):
        g.attention(extra, k, v)


def test_copy_keeps_ids_so_new_nodes_do_not_collide() -> None:
    g = spec_graph()
    g.erase(g.input("gone", (1,)).node)
    clone = g.copy()
    fresh = clone.input("fresh", (1,))
    assert fresh.node.id not in {n.id for n in g.nodes}
    assert fresh.node.id == g.input("fresh", (1,)).node.id


# ----------------------------------------------------------------------------- verification


def _corrupt_types(g: Graph) -> None:
    node = g.outputs["o"].node
    node.types = (TensorType((B, SQ, H, D + 1)),)


def _corrupt_wrt(g: Graph) -> None:
    node = g.outputs["dq"].node
    node.attrs = dataclasses.replace(node.attrs, wrt=Wrt.QUERY)  # three results, one flag


def _corrupt_mask(g: Graph) -> None:
    node = g.outputs["o"].node
    node.attrs = dataclasses.replace(node.attrs, mask=MaskKind.BIAS)  # no bias tensor


def _corrupt_attrs_class(g: Graph) -> None:
    g.outputs["o"].node.attrs = InputAttrs("o")


def _corrupt_attrs_field(g: Graph) -> None:
    g.outputs["o"].node.attrs = AttentionAttrs(mask="causal", layout=Layout.BSHD)  # type: ignore[arg-type]


def _corrupt_layout(g: Graph) -> None:
    node = g.outputs["o"].node
    node.attrs = dataclasses.replace(node.attrs, layout=Layout.BHSD)


def _corrupt_input_type(g: Graph) -> None:
    g.inputs["k"].node.types = (TensorType((B, SK, H, D), np.dtype(np.float64)),)


def _corrupt_operand_behind_the_store(g: Graph) -> None:
    node = g.outputs["o"].node
    node._inputs = (g.inputs["dy"], *node.inputs[1:])  # dy has q's type, so only the edges disagree


def _corrupt_drop_an_operand(g: Graph) -> None:
    node = g.outputs["o"].node
    node._inputs = node.inputs[:2]


def _corrupt_store_edge(g: Graph) -> None:
    node = g.outputs["o"].node
    g._store.remove_edge(g.inputs["k"].node.id, node.id, key=1)


def _corrupt_store_extra_edge(g: Graph) -> None:
    node = g.outputs["dq"].node
    g._store.add_edge(g.outputs["o"].node.id, node.id, key=9)


CORRUPTIONS = [
    (_corrupt_types, r"node \d+ \(attention\): result types are f32\[2,5,2,5\], but its operands give f32\[2,5,2,4\]"),
    (_corrupt_wrt, r"node \d+ \(attention_bwd\): result types are .*, but its operands give f32\[2,5,2,4\]$"),
    (_corrupt_mask, r"node \d+ \(attention\): mask bias needs a mask_input tensor"),
    (_corrupt_attrs_class, r"node \d+ \(attention\): attrs must be AttentionAttrs, got InputAttrs"),
    (_corrupt_attrs_field, r"node \d+ \(attention\): attrs AttentionAttrs\(mask='causal'.* do not fit its operands"),
    (_corrupt_layout, r"node \d+ \(attention\): k must have batch 2, heads 5"),
    (_corrupt_input_type, r"node \d+ \(attention\): k must be f32, got f64"),
    (
        _corrupt_operand_behind_the_store,
        r"^  node 4 \(attention\): operand 0 reads node 3, but the graph store has an edge from node 0 for slot 0 "
        r"\(operands changed behind the Graph API; use set_input\)$",
    ),
    (
        _corrupt_drop_an_operand,
        r"^  node 4 \(attention\): the graph store has an edge from node 2 for slot 2, but the node has 2 operand",
    ),
    (_corrupt_store_edge, r"node 4 \(attention\): operand 1 reads node 1, but the graph store has no edge for slot 1"),
    (_corrupt_store_extra_edge, r"node 5 \(attention_bwd\): the graph store has an edge from node 4 for slot 9"),
]


@pytest.mark.parametrize(("corrupt", "problem"), CORRUPTIONS, ids=[c[0].__name__ for c in CORRUPTIONS])
def test_verify_catches_a_corrupted_graph_and_ends_with_the_printout(
    corrupt: Callable[[Graph], None], problem: str
) -> None:
    g = spec_graph()
    g.verify()
    corrupt(g)
    with pytest.raises(rlx.RlxValueError) as info:
        g.verify()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith("graph 'attn' failed verification:")
    assert any(re.search(problem, line) for line in message.splitlines()), message
    assert message.endswith("\n\n" + str(g))


def test_verify_catches_an_output_of_an_erased_node_and_still_prints_the_graph() -> None:
    """Regression: the printer raised KeyError on such an output, so the message ended with a placeholder."""
    g = spec_graph()
    q, k, v, _ = _qkv(g)
    stale = g.attention(q, k, v)
    g.erase(stale.node)
    g._outputs["stale"] = stale  # what a buggy pass could leave behind
    printed = str(g)
    assert (
        printed.splitlines()[-2]
        == f"  output o = %0, dq = %1, dk = %2, dv = %3, stale = %<erased node {stale.node.id}>"
    )
    with pytest.raises(rlx.RlxValueError) as info:
        g.verify()
    message = str(info.value)
    assert f"output 'stale' reads node {stale.node.id}, which is not in the graph" in message
    assert message.endswith("\n\n" + printed)


def test_verify_catches_an_operand_of_an_erased_node_and_still_prints_the_graph() -> None:
    g = spec_graph()
    q, k, v, _ = _qkv(g)
    stale = g.attention(q, k, v)
    g.erase(stale.node)
    fwd = g.outputs["o"].node
    fwd._inputs = (stale, k, v)
    printed = str(g)
    assert f"= attention %<erased node {stale.node.id}>, %k, %v {{" in printed
    with pytest.raises(rlx.RlxValueError) as info:
        g.verify()
    message = str(info.value)
    assert f"node {fwd.id} (attention): operand 0 reads node {stale.node.id}, which is not in the graph" in message
    assert "graph store" not in message, "the edge check leaves operands outside the graph to the operand check"
    assert message.endswith("\n\n" + printed)


def test_printer_names_values_of_another_graph_or_missing_outputs() -> None:
    g, other = spec_graph(), spec_graph()
    g._outputs["foreign"] = other.outputs["o"]
    g._outputs["past_end"] = Value(g.outputs["o"].node, 5)
    last = str(g).splitlines()[-2]
    assert last.endswith("foreign = %<node 4 of graph 'attn'>, past_end = %<node 4 has no output 5>")


def test_copy_of_a_graph_with_a_dangling_output_is_an_rlx_error() -> None:
    """rlx.compile copies first: a dangling output must not surface as a bare KeyError."""
    g = spec_graph()
    stale = g.attention(*_qkv(g)[:3])
    g.erase(stale.node)
    g._outputs["stale"] = stale
    with pytest.raises(
        rlx.RlxValueError, match=rf"cannot copy graph 'attn': output 'stale' reads node {stale.node.id}"
    ):
        g.copy()
    del g._outputs["stale"]
    g.outputs["o"].node._inputs = (stale, *g.outputs["o"].node.inputs[1:])
    with pytest.raises(rlx.RlxValueError, match=r"cannot copy graph 'attn': node 4 \(attention\) operand 0 reads"):
        g.copy()


def test_verify_reports_a_node_whose_op_is_not_an_op_kind() -> None:
    g = spec_graph()
    g.outputs["o"].node.op = "attention"  # type: ignore[assignment]
    with pytest.raises(rlx.RlxValueError, match=r"node 4 \(attention\): op must be an OpKind, got 'attention'"):
        g.verify()


def test_value_attributes_and_operators_a_numpy_user_reaches_for() -> None:
    g = Graph("t")
    x = g.input("x", (2, 3, 4))
    assert x.ndim == 3 and x.T.shape == (4, 3, 2) and +x is x
    flat = g.reshape(x, (6, 4))
    g.output(t=x.T, a=abs(x), m=flat.T @ flat)
    arrays = {"x": np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)}
    got = rlx.compile(g)(**arrays)
    np.testing.assert_array_equal(got["t"], arrays["x"].T)
    np.testing.assert_array_equal(got["a"], np.abs(arrays["x"]))
    np.testing.assert_allclose(got["m"], arrays["x"].reshape(6, 4).T @ arrays["x"].reshape(6, 4), rtol=1e-5, atol=1e-5)


def test_value_methods_as_an_ndarray_has_them() -> None:
    g = Graph("t")
    x = g.input("x", (2, 3, 4))
    built = {
        "sum": x.sum(),
        "sum_axes": x.sum(axis=(0, 2), keepdims=True),
        "mean": x.mean(-1),
        "max": x.max(axis=1),
        "flat": x.reshape(6, -1),
        "flat_tuple": x.reshape((4, 6)),
        "moved": x.transpose(1, 0, 2),
        "moved_tuple": x.transpose((2, 0, 1)),
        "reversed": x.transpose(),
    }
    g.output(**built)
    xa = np.random.default_rng(3).standard_normal((2, 3, 4)).astype(np.float32)
    got = rlx.compile(g)(x=xa)
    want = {
        "sum": xa.sum(),
        "sum_axes": xa.sum(axis=(0, 2), keepdims=True),
        "mean": xa.mean(-1),
        "max": xa.max(axis=1),
        "flat": xa.reshape(6, -1),
        "flat_tuple": xa.reshape((4, 6)),
        "moved": xa.transpose(1, 0, 2),
        "moved_tuple": xa.transpose((2, 0, 1)),
        "reversed": xa.transpose(),
    }
    for name, expected in want.items():
        assert got[name].shape == expected.shape, name
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5, err_msg=name)


def test_numpy_arrays_on_either_side_of_an_operator_become_constants() -> None:
    """As JAX treats a NumPy array met while tracing; NumPy on the left once built an object array."""
    g = Graph("t")
    x = g.input("x", (3, 4))
    m = g.input("m", (3, 4), dtype="bool")
    w = np.random.default_rng(1).standard_normal((4, 5))  # float64: baked in as float32
    eye = np.eye(3, 4, dtype=bool)
    built = {
        "left": np.arange(4.0) * x,
        "right": x - np.ones(4, np.float32),
        "matmul": x @ w,
        "rmatmul": w.T @ x.T,
        "mask": g.where(eye | m, x, 0.0),
        "rand": eye & m,
        "cmp": np.full((3, 4), 0.5) < x,
    }
    for value in built.values():
        assert isinstance(value, Value)
    g.output(**built)
    rng = np.random.default_rng(2)
    xa, ma = rng.standard_normal((3, 4)).astype(np.float32), rng.random((3, 4)) > 0.5
    got = rlx.compile(g)(x=xa, m=ma)
    want = {
        "left": np.arange(4.0) * xa,
        "right": xa - 1,
        "matmul": xa @ w,
        "rmatmul": w.T @ xa.T,
        "mask": np.where(eye | ma, xa, 0),
        "rand": eye & ma,
        "cmp": xa > 0.5,
    }
    for name, expected in want.items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5, err_msg=name)
        assert got[name].dtype == (np.bool_ if expected.dtype == np.bool_ else np.float32), name
    with pytest.raises(rlx.RlxTypeError, match=r"add \(node \d+\): a and b must have the same dtype, got i64"):
        np.ones((3, 4), np.int64) + x  # no silent conversion of an int array into a float operand


def test_python_ints_compare_with_int_values_in_their_dtype() -> None:
    """``ids != 0`` for a padding mask, as in NumPy and torch: the int becomes a constant of the
    value's dtype (a float is still no int operand, and arithmetic on ids is not offered)."""
    g = Graph("ints")
    ids = g.input("ids", (2, 3), dtype="int64")
    small = g.input("small", (2, 3), dtype="int32")
    x = g.input("x", (2, 3))
    g.output(
        pad=g.not_equal(ids, 0),
        big=ids > 2,
        flipped=g.less_equal(1, small),
        kept=g.where(x > 0.0, small, -1),
        loss_mask=g.where(g.equal(ids, 0), 0.0, x),
    )
    ia = np.array([[0, 1, 2], [3, 0, 5]])
    sa = ia.astype(np.int32)
    xa = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)
    got = rlx.compile(g)(ids=ia, small=sa, x=xa)
    np.testing.assert_array_equal(got["pad"], ia != 0)
    np.testing.assert_array_equal(got["big"], ia > 2)
    np.testing.assert_array_equal(got["flipped"], sa >= 1)
    np.testing.assert_array_equal(got["kept"], np.where(xa > 0, sa, -1))
    assert got["kept"].dtype == np.int32
    np.testing.assert_array_equal(got["loss_mask"], np.where(ia == 0, 0.0, xa))
    with pytest.raises(rlx.RlxTypeError, match=r"greater \(node \d+\): a and b must have the same dtype"):
        ids > 2.5  # noqa: B015
    with pytest.raises(rlx.RlxValueError, match=r"less: 4294967296 does not fit operand 1's dtype int32"):
        g.less(small, 2**32)


def test_a_python_bool_operand_points_at_equal() -> None:
    """``ids == 0`` compares identity and gives a Python bool: refused, with the way to compare."""
    g = Graph("b")
    x = g.input("x", (2, 3))
    ids = g.input("ids", (2, 3), dtype="int64")
    with pytest.raises(rlx.RlxTypeError, match=r"where operand 0: got the Python bool False; .*g\.equal"):
        g.where(ids == 0, 0.0, x)
    with pytest.raises(rlx.RlxTypeError, match=r"logical_and operand 1: got the Python bool True"):
        g.logical_and(x > 0.0, True)
    with pytest.raises(rlx.RlxTypeError, match=r"output 'y' must be an rlx Value .*got bool \(== and != .*g\.equal"):
        g.output(y=ids == 0)


def test_value_repr_survives_hand_made_values() -> None:
    g = spec_graph()
    node = g.outputs["o"].node
    assert repr(Value(node, 0)) == "Value(node=4 attention, index=0, type=f32[2,5,2,4])"
    assert repr(Value(node, 3)) == "Value(node=4 attention, index=3, type=<no such output>)"
    assert repr(Value(None, 0)) == "Value(node=None, index=0)"  # type: ignore[arg-type]


def test_verify_catches_a_node_added_to_the_store_behind_the_api() -> None:
    g = spec_graph()
    g._store.add_node(99)
    with pytest.raises(rlx.RlxValueError, match=r"the graph store holds nodes \[0, 1, 2, 3, 4, 5, 99\] but the graph"):
        g.verify()


# ----------------------------------------------------------------------------- flags and masks


def test_wrt_flags_combine_to_all() -> None:
    assert Wrt.QUERY | Wrt.KEY | Wrt.VALUE == Wrt.ALL
    assert Wrt.ALL.members == (Wrt.QUERY, Wrt.KEY, Wrt.VALUE)
    assert (Wrt.VALUE | Wrt.QUERY).members == (Wrt.QUERY, Wrt.VALUE)
    assert str(Wrt.VALUE | Wrt.KEY) == "k|v"
    for bits in range(1, 8):
        assert Wrt.parse(str(Wrt(bits))) == Wrt(bits)


@pytest.mark.parametrize("layout", list(Layout))
def test_wrt_decides_the_results_in_q_k_v_order(layout: Layout) -> None:
    g = Graph("w")
    q = g.input("q", layout.join(B, SQ, H, D))
    k = g.input("k", layout.join(B, SK, H, D))
    v = g.input("v", layout.join(B, SK, H, D))
    dy = g.input("dy", layout.join(B, SQ, H, D))
    shape_of = {Wrt.QUERY: q.shape, Wrt.KEY: k.shape, Wrt.VALUE: v.shape}
    for flag in (Wrt.QUERY, Wrt.KEY, Wrt.VALUE):
        single = g.attention_bwd(q, k, v, dy, wrt=flag, layout=layout)
        assert isinstance(single, Value)
        assert single.shape == shape_of[flag] and single.node.attrs.wrt == flag
    pair = g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE | Wrt.QUERY, layout=layout)
    assert isinstance(pair, tuple) and [x.shape for x in pair] == [q.shape, v.shape]
    assert [x.index for x in pair] == [0, 1]
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, layout=layout)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.node is dk.node is dv.node and len(dq.node.outputs) == 3


def test_mask_kinds_compare_and_hash_by_value() -> None:
    assert MaskKind.sliding_window(3) == MaskKind.sliding_window(3)
    assert hash(MaskKind.sliding_window(3)) == hash(MaskKind.sliding_window(3))
    assert MaskKind.sliding_window(3) != MaskKind.sliding_window(4)
    assert MaskKind.sliding_window(0) != MaskKind.CAUSAL
    assert MaskKind.CUSTOM != MaskKind.BIAS
    assert len({MaskKind.sliding_window(3), MaskKind.sliding_window(3), MaskKind.CAUSAL, MaskKind.NONE}) == 3
    assert MaskKind.parse("causal") is not MaskKind.CAUSAL and MaskKind.parse("causal") == MaskKind.CAUSAL


def test_mask_kind_text_round_trips() -> None:
    masks = [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.CUSTOM, MaskKind.BIAS, MaskKind.sliding_window(0)]
    for mask in [*masks, MaskKind.sliding_window(128)]:
        assert MaskKind.parse(str(mask)) == mask
    assert repr(MaskKind.sliding_window(5)) == "MaskKind.sliding_window(5)"
    assert [m.needs_tensor for m in masks] == [False, False, True, True, False]


def test_equal_attrs_make_equal_nodes_attrs() -> None:
    """Passes (CSE, fusion) compare attrs with ==: equal masks built separately must match."""
    g = spec_graph()
    q, k, v, _ = _qkv(g)
    a = g.attention(q, k, v, mask=MaskKind.sliding_window(2))
    b = g.attention(q, k, v, mask=MaskKind.sliding_window(2))
    c = g.attention(q, k, v, mask=MaskKind.sliding_window(2), layout=Layout.BSHD)
    assert a.node.attrs == b.node.attrs == c.node.attrs
    assert hash(a.node.attrs) == hash(b.node.attrs)


def test_mask_kind_constructor_normalises_the_window() -> None:
    """A NumPy int window is stored as a Python int, so the two spellings compare and hash equal."""
    mask = MaskKind("sliding_window", np.int64(3))
    assert type(mask.window) is int
    assert mask == MaskKind.sliding_window(3) and hash(mask) == hash(MaskKind.sliding_window(3))
    assert str(mask) == "sliding_window(3)"


def test_tensor_type_normalises_shape_and_dtype() -> None:
    """Regression: a str dtype was stored as given and printing the type raised KeyError."""
    ty = TensorType((2, 3), "float64")
    assert ty.dtype == np.dtype(np.float64) and isinstance(ty.dtype, np.dtype)
    assert str(ty) == "f64[2,3]"
    assert TensorType([np.int64(2), 3], "f64") == ty and hash(TensorType([2, 3], np.float64)) == hash(ty)
    assert type(TensorType([np.int64(2)]).shape[0]) is int
    assert TensorType(()).dtype == np.dtype(np.float32) and str(TensorType(())) == "f32[]"


def test_tensor_type_nbytes_is_exact_for_huge_shapes() -> None:
    """Regression: np.prod in int64 wrapped to 0 for 2**40 x 2**40. Such shapes are now refused (more
    elements than 64-bit byte offsets address); the largest allowed one's size is exact."""
    assert TensorType((2, 3)).nbytes == 24 and TensorType(()).nbytes == 4
    assert TensorType((2**30, 2**30), "f64").nbytes == 2**63
    for huge in ((2**40, 2**40), (10**30,)):
        with pytest.raises(rlx.RlxValueError, match="more than any array can hold"):
            TensorType(huge, "f16")


def test_tensor_type_with_a_str_dtype_verifies_and_prints() -> None:
    g = spec_graph()
    g.inputs["k"].node.types = (TensorType((B, SK, H, D), "float64"),)
    with pytest.raises(rlx.RlxValueError, match=r"k must be f32, got f64") as info:
        g.verify()
    assert str(info.value).endswith("\n\n" + str(g))


def test_bad_mask_and_wrt_text_raise_rlx_errors() -> None:
    for text in ("bogus", "sliding_window", "sliding_window(x)", "sliding_window(\u00b2)", "sliding_window(-1)"):
        with pytest.raises(rlx.RlxValueError):
            MaskKind.parse(text)
    for text in ("", "x", "q|", "q,k"):
        with pytest.raises(rlx.RlxValueError, match=r"expected q, k or v joined by '\|'"):
            Wrt.parse(text)


def test_a_value_has_no_truth_value_while_the_graph_is_built() -> None:
    """As JAX refuses ``bool`` of a tracer: ``if x > 0:`` on a Value would take one branch for
    every input; the error points at ``g.where`` and at ``is None``."""
    g = Graph("t")
    x = g.input("x", (3, 4))
    for value in (x, x > 0, g.sum(x)):
        with pytest.raises(rlx.RlxTypeError, match=r"truth value .* g\.where\(cond, a, b\) .* `is None`"):
            bool(value)
    with pytest.raises(TypeError):
        if x > 0:  # the same, as a user writes it
            pass
    assert x is not None and [x][0] is x  # identity, membership and containers need no truth value
    assert x in {x: 1} and x in [x]


def test_len_of_a_value_is_its_first_axis() -> None:
    g = Graph("t")
    x = g.input("x", (3, 4))
    assert len(x) == 3 and len(x[0]) == 4 and len(list(x)) == 3
    with pytest.raises(rlx.RlxTypeError, match="len\\(\\) of a 0-d value"):
        len(g.sum(x))
    with pytest.raises(rlx.RlxTypeError, match="symbolic first axis"):
        len(g.input("s", ("S", 2)))


def test_numpy_does_not_convert_a_value() -> None:
    """``np.asarray(value)`` is a clear error (JAX's for a tracer), not a nested sequence read
    entry by entry into new nodes; NumPy operands on either side of an operator still work."""
    g = Graph("t")
    x = g.input("x", (3, 4))
    nodes = len(g.nodes)
    for convert in (lambda: np.asarray(x), lambda: np.array([x, x]), lambda: g.constant(x)):
        with pytest.raises(rlx.RlxTypeError, match="no entries while the graph is built"):
            convert()
    assert len(g.nodes) == nodes
    assert (np.ones(4, np.float32) * x).shape == (3, 4)
