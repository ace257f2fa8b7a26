"""The arena planner: reuse memory, but never let a node write over a value still being read.

Graphs below tempt a careless planner: chains whose intermediates die one step later, backward
nodes that read intermediates, self-attention on an intermediate, values of different sizes,
and multi-output nodes whose unused outputs are still written (``passes=[]`` keeps them).
They are compiled with many random topological orders and must always equal the reference;
``plan_memory`` + ``check_plan`` are also checked directly against an independent checker.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from codegen_helpers import assert_outputs_close

import rlx
from rlx import Graph, MaskKind, RlxError, RuntimeConfig, Value, Wrt
from rlx.codegen import CodegenOptions, compile_graph
from rlx.codegen.lower import scratch_bytes
from rlx.codegen.memory_plan import ALIGN, Location, MemoryPlan, check_plan, plan_memory, random_topological_order
from rlx.ir.ops import OpKind

B, H, D = 1, 2, 8
SQ, SK = 12, 7
SEEDS = range(8)


def tempting_graph() -> Graph:
    """Intermediates of two sizes, read by forward and backward nodes, some outputs left unused."""
    g = Graph("tempting")
    q = g.input("q", (B, SQ, H, D))
    k = g.input("k", (B, SK, H, D))
    v = g.input("v", (B, SK, H, D))
    o1 = g.attention(q, k, v, mask=MaskKind.CAUSAL)  # [B, SQ, H, D]
    o2 = g.attention(o1, k, v)
    o3 = g.attention(o2, k, v, mask=MaskKind.sliding_window(2))
    _, dk1, _ = g.attention_bwd(o1, k, v, o2, wrt=Wrt.ALL)  # reads two intermediates; dQ, dV unused
    x = g.attention(k, o1, o1)  # [B, SK, H, D]: a smaller intermediate built from a bigger one
    s = g.attention(o1, o1, o1)  # self-attention on an intermediate
    y = g.attention(o3, x, x)
    dq2, dv2 = g.attention_bwd(s, x, x, o3, wrt=Wrt.QUERY | Wrt.VALUE)
    g.output(y=y, dk1=dk1, dq2=dq2, dv2=dv2, o2=o2)  # o2: an output that later nodes also read
    return g


def chain_graph(length: int, seq: int = 16) -> Graph:
    """``o_{i+1} = attention(o_i, k, v)``: each intermediate dies right after the next is made."""
    g = Graph(f"chain{length}")
    x = g.input("q", (B, seq, H, D))
    k = g.input("k", (B, seq, H, D))
    v = g.input("v", (B, seq, H, D))
    for _ in range(length):
        x = g.attention(x, k, v, mask=MaskKind.CAUSAL)
    g.output(out=x)
    return g


def inputs_for(g: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(value.shape).astype(np.float32) for name, value in g.inputs.items()}


# ---------------------------------------------------------------------------- compiled, random orders


@pytest.mark.parametrize("passes", [[], None], ids=["as_built", "default_pipeline"])
def test_random_orders_match_reference(passes: list[str] | None) -> None:
    """Every random topological order plans a correct program (unused bwd outputs kept or narrowed)."""
    g = tempting_graph()
    arrays = inputs_for(g)
    expected = rlx.reference.run(g, **arrays)
    orders = set()
    layouts = set()
    for seed in SEEDS if passes == [] else range(4):
        exe = compile_graph(g, passes=passes, options=CodegenOptions(order_seed=seed))
        plan = exe.memory_plan
        orders.add(tuple(node.id for node in plan.order))
        layouts.add(tuple(sorted((v.node.id, v.index, loc.index) for v, loc in plan.locations.items()
                                 if loc.kind == "arena")))
        assert_plan_sound(exe.graph, plan)
        assert_outputs_close(exe(**arrays), expected, context=f"order_seed={seed}")
    if passes == []:
        assert len(orders) > 5, "the seeds should produce many different orders"
        assert len(layouts) > 1, "the orders should produce different arena layouts"


def test_dce_narrows_unused_outputs() -> None:
    """With the default pipeline the half-used bwd node is narrowed to the gradient that is read."""
    wrts = sorted(str(n.attrs.wrt) for n in rlx.compile(tempting_graph()).graph.nodes
                  if n.op is OpKind.ATTENTION_BWD)
    assert wrts == ["k", "q|v"]
    kept = sorted(str(n.attrs.wrt) for n in rlx.compile(tempting_graph(), passes=[]).graph.nodes
                  if n.op is OpKind.ATTENTION_BWD)
    assert kept == ["q|k|v", "q|v"]


def test_long_chain_reuses_the_arena() -> None:
    """Ten chained nodes need two intermediate slots, not nine; results still match the reference."""
    g = chain_graph(10)
    arrays = inputs_for(g, 1)
    for seed in (None, 3):
        exe = compile_graph(g, passes=[], options=CodegenOptions(order_seed=seed))
        plan = exe.memory_plan
        size = -(-B * 16 * H * D * 4 // ALIGN) * ALIGN
        intermediates = [v for v, loc in plan.locations.items() if loc.kind == "arena"]
        assert len(intermediates) == 9
        assert plan.scratch_offset <= 2 * size
        assert plan.scratch_offset < sum(v.type.nbytes for v in intermediates)
        assert_outputs_close(exe(**arrays), rlx.reference.run(g, **arrays), rtol=2e-4)


def test_scratch_is_sized_for_every_thread() -> None:
    """The per-thread scratch sits after the values, one aligned stride per thread."""
    g = tempting_graph()
    arrays = inputs_for(g, 2)
    expected = rlx.reference.run(g, **arrays)
    for threads in (1, 3):
        config = RuntimeConfig(num_threads=threads)
        exe = rlx.compile(g, passes=[], config=config)
        plan = exe.memory_plan
        assert exe.threads == threads
        # Scratch for every thread a region can run: at most the thread count, at least as many
        # threads as the busiest node can keep busy (B x H = 2 items here).
        assert min(threads, B * H) <= plan.threads <= threads
        assert plan.scratch_offset % ALIGN == 0 and plan.scratch_stride % ALIGN == 0
        hungriest = max(scratch_bytes(n, config, CodegenOptions()) for n in exe.graph.nodes if n.op is not OpKind.INPUT)
        assert plan.scratch_stride >= hungriest > 0
        assert plan.arena_bytes == plan.scratch_offset + plan.threads * plan.scratch_stride
        assert_outputs_close(exe(**arrays), expected)


# ---------------------------------------------------------------------------- plan_memory directly


def assert_plan_sound(graph: Graph, plan: MemoryPlan) -> None:
    """An independent check of a plan: liveness recomputed from ``plan.order``, every pair compared."""
    step = {node.id: i for i, node in enumerate(plan.order)}
    assert sorted(step) == sorted(node.id for node in graph.nodes)
    for name, value in graph.inputs.items():
        assert plan.locations[value] == Location("input", plan.buffer_names.index(name))
    live: dict[Value, tuple[int, int]] = {}
    for node in plan.order:
        for value in node.outputs:
            readers = [step[user.id] for user, _ in graph.uses(value)]
            live[value] = (step[node.id], max(readers, default=step[node.id]))
    arena = {v: (loc.index, loc.index + v.type.nbytes) for v, loc in plan.locations.items() if loc.kind == "arena"}
    for value, (start, end) in arena.items():
        assert start % ALIGN == 0, f"{value} at unaligned offset {start}"
        assert end <= plan.scratch_offset, f"{value} runs into the scratch region"
    values = list(arena)
    for i, a in enumerate(values):
        for b in values[i + 1 :]:
            (a0, a1), (b0, b1) = live[a], live[b]
            if a0 <= b1 and b0 <= a1:  # live at a common step
                (sa, ea), (sb, eb) = arena[a], arena[b]
                assert ea <= sb or eb <= sa, f"{a} and {b} are live together and overlap"
    for node in plan.order:
        for out in node.outputs:
            for operand in node.inputs:
                lo, li = plan.locations[out], plan.locations[operand]
                if lo.kind == li.kind == "arena":
                    (so, eo), (si, ei) = arena[out], arena[operand]
                    assert eo <= si or ei <= so, f"node {node.id} writes {out} over its input {operand}"
                elif lo.kind == li.kind:
                    assert lo.index != li.index, f"node {node.id} writes {out} into its input's buffer"


def _plan(g: Graph, seed: int | None, threads: int = 2) -> MemoryPlan:
    order = None if seed is None else random_topological_order(g, seed)
    return plan_memory(g, lambda node: 0 if node.op is OpKind.INPUT else 1000, threads, order)


@pytest.mark.parametrize("builder", [tempting_graph, lambda: chain_graph(6)], ids=["tempting", "chain"])
def test_plans_for_random_orders_are_sound(builder: object) -> None:
    g = builder()  # type: ignore[operator]
    for seed in [None, *range(40)]:
        plan = _plan(g, seed)
        check_plan(plan)
        assert_plan_sound(g, plan)
        assert plan.scratch_stride == 1024  # 1000 rounded up to the alignment
        assert plan.arena_bytes == plan.scratch_offset + 2 * 1024


def test_random_orders_are_topological_and_varied() -> None:
    g = tempting_graph()
    seen = set()
    for seed in range(30):
        order = random_topological_order(g, seed)
        position = {node.id: i for i, node in enumerate(order)}
        assert len(order) == len(g)
        for node in order:
            assert all(position[value.node.id] < position[node.id] for value in node.inputs)
        seen.add(tuple(position))
    assert len(seen) > 10


def test_chain_plan_reuses_memory() -> None:
    """Without scratch the arena of a long chain is far smaller than all its intermediates."""
    g = chain_graph(12)
    plan = plan_memory(g, lambda node: 0, 1)
    total = sum(v.type.nbytes for v, loc in plan.locations.items() if loc.kind == "arena")
    assert plan.arena_bytes < total
    assert plan.arena_bytes <= 2 * total // 11


def _node_reading_arena(g: Graph, plan: MemoryPlan) -> tuple[Value, Value]:
    """An (output, input) pair of one node where both live in the arena."""
    for node in plan.order:
        for operand in node.inputs:
            if plan.locations[operand].kind == "arena" and plan.locations[node.outputs[0]].kind == "arena":
                return node.outputs[0], operand
    raise AssertionError("no node reads an arena value")


def _with_location(plan: MemoryPlan, value: Value, location: Location) -> MemoryPlan:
    return dataclasses.replace(plan, locations={**plan.locations, value: location})


def test_check_plan_catches_an_output_over_its_input() -> None:
    g = tempting_graph()
    plan = _plan(g, 5)
    check_plan(plan)  # the genuine plan passes
    out, operand = _node_reading_arena(g, plan)
    broken = _with_location(plan, out, plan.locations[operand])
    with pytest.raises(RlxError, match="memory plan bug"):
        check_plan(broken)
    with pytest.raises(AssertionError):
        assert_plan_sound(g, broken)


def test_check_plan_catches_a_partial_overlap() -> None:
    """Shifting an output so that it covers only the tail of its input is caught too."""
    g = chain_graph(4)
    plan = _plan(g, None)
    out, operand = _node_reading_arena(g, plan)
    shifted = Location("arena", plan.locations[operand].index + ALIGN)
    with pytest.raises(RlxError, match="memory plan bug"):
        check_plan(_with_location(plan, out, shifted))


def test_check_plan_catches_two_live_values_sharing_bytes() -> None:
    """Two values live at the same step (not producer/consumer of each other) may not share bytes."""
    g = tempting_graph()
    plan = _plan(g, None)
    arena = [v for v, loc in plan.locations.items() if loc.kind == "arena"]
    for i, a in enumerate(arena):
        for b in arena[i + 1 :]:
            (a0, a1), (b0, b1) = plan.live[a], plan.live[b]
            if a0 <= b1 and b0 <= a1 and a.node is not b.node:
                broken = _with_location(plan, b, plan.locations[a])
                with pytest.raises(RlxError, match="memory plan bug"):
                    check_plan(broken)
                return
    raise AssertionError("no two values are live together")


def test_check_plan_catches_an_output_written_into_an_input_buffer() -> None:
    g = chain_graph(2)
    plan = _plan(g, None)
    first = next(node for node in plan.order if node.op is OpKind.ATTENTION)
    broken = _with_location(plan, first.outputs[0], plan.locations[first.inputs[0]])
    with pytest.raises(RlxError, match="memory plan bug"):
        check_plan(broken)


def test_check_plan_catches_a_value_in_the_scratch_region() -> None:
    g = chain_graph(3)
    plan = _plan(g, None)
    value = next(v for v, loc in plan.locations.items() if loc.kind == "arena")
    with pytest.raises(RlxError, match="scratch"):
        check_plan(_with_location(plan, value, Location("arena", plan.scratch_offset)))


def test_plan_memory_rejects_bad_orders() -> None:
    g = chain_graph(3)
    order = list(g.nodes)
    with pytest.raises(RlxError, match="every node"):
        plan_memory(g, lambda node: 0, 1, order[:-1])
    with pytest.raises(RlxError, match="every node"):
        plan_memory(g, lambda node: 0, 1, [*order, order[-1]])
    with pytest.raises(RlxError, match="before its operand"):
        plan_memory(g, lambda node: 0, 1, list(reversed(order)))


def _pairwise_overlap(plan: MemoryPlan) -> bool:
    """The all-pairs form of check_plan's first test: two arena values live together share bytes."""
    arena = [(v, loc.index, loc.index + v.type.nbytes) for v, loc in plan.locations.items() if loc.kind == "arena"]
    for i, (a, a0, a1) in enumerate(arena):
        for b, b0, b1 in arena[i + 1 :]:
            (af, al), (bf, bl) = plan.live[a], plan.live[b]
            if a0 < b1 and b0 < a1 and not (al < bf or bl < af):
                return True
    return False


@pytest.mark.parametrize("seed", range(60))
def test_check_plan_sweep_agrees_with_all_pairs(seed: int) -> None:
    """check_plan sweeps values in the order they come alive; for random lifetimes and places in
    an arena, it must find an overlap exactly when comparing every pair does."""
    rng = random.Random(seed)
    g = tempting_graph()
    plan = _plan(g, None)
    arena = [v for v, loc in plan.locations.items() if loc.kind == "arena"]
    room = rng.choice([2, 4, 8]) * sum(v.type.nbytes for v in arena)
    steps = len(plan.order)
    live = dict(plan.live)
    locations = dict(plan.locations)
    for value in arena:
        first = rng.randrange(steps)
        live[value] = (first, rng.randrange(first, steps))
        locations[value] = Location("arena", ALIGN * rng.randrange(room // ALIGN))
    moved = dataclasses.replace(plan, live=live, locations=locations, accesses=[], scratch_offset=room + 4096)
    if _pairwise_overlap(moved):
        with pytest.raises(RlxError, match="live together and overlap"):
            check_plan(moved)
    else:
        check_plan(moved)
