"""Where every value lives at run time: a user input, a fresh output array, or the arena.

Intermediates share one arena, placed first-fit by liveness. A value is live from the step of
the node that makes it through the last step that reads it, *inclusive*: a node's inputs are
still live while its outputs are written, so an output can never take an input's bytes. (The
fused kernel writes dK/dV with beta = 1 while it still reads Q and dY; letting an output overlap
an input is the bug that keeps the original kernel's fused path off.) ``check_plan`` proves the
property for each plan, and the planner is fuzzed over random topological orders in the tests.

Per-thread scratch sits after the intermediates; nodes run one after another, so all nodes share
it, sized for the hungriest.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlx.errors import RlxError
from rlx.ir.graph import Graph, Node, Value
from rlx.ir.ops import OpKind

ALIGN = 64


@dataclass(frozen=True)
class Location:
    """``kind`` is ``"input"`` / ``"output"`` / ``"temp"`` (index into the entry's buffer list),
    ``"arena"`` (byte offset) or ``"constant"`` (data in the module; index is the constant's node id).

    A ``temp`` is an intermediate whose size is only known per call (a symbolic dimension): the
    executable allocates it for each call, like an output."""

    kind: str
    index: int


@dataclass
class MemoryPlan:
    order: list[Node]
    locations: dict[Value, Location]
    buffer_names: list[str]  # entry-function buffer list: graph inputs, then output slots
    arena_bytes: int
    scratch_offset: int
    scratch_stride: int
    threads: int
    live: dict[Value, tuple[int, int]] = field(default_factory=dict)
    # Every graph output name -> the buffer slot holding its value, and the names that own their
    # slot (the rest are copied: an input passed through, or a value under a second name). Slots,
    # not names: an output may share its name with an input.
    output_slots: dict[str, int] = field(default_factory=dict)
    owned_outputs: frozenset[str] = frozenset()
    # What each step writes and reads (a node's outputs and operands, or a kernel's): the
    # writes of a step never overlap its reads.
    accesses: list[tuple[Node, tuple[Value, ...], tuple[Value, ...]]] = field(default_factory=list)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def random_topological_order(graph: Graph, seed: int) -> list[Node]:
    """A uniformly shuffled valid order, for fuzzing the planner (as tinygrad fuzzes schedules)."""
    rng = random.Random(seed)
    store = graph._store
    indegree = {n: store.in_degree(n) for n in store.nodes}
    ready = [n for n, d in indegree.items() if d == 0]
    order: list[Node] = []
    while ready:
        node_id = ready.pop(rng.randrange(len(ready)))
        order.append(graph.node(node_id))
        for succ in set(store.successors(node_id)):
            indegree[succ] -= store.number_of_edges(node_id, succ)
            if indegree[succ] == 0:
                ready.append(succ)
    return order


def plan_memory(
    graph: Graph,
    scratch_per_thread: Callable[[Node], int],
    threads: int,
    order: Sequence[Node] | None = None,
    accesses: Sequence[tuple[Node, tuple[Value, ...], tuple[Value, ...]]] | None = None,
) -> MemoryPlan:
    """Assign every materialised value a location; ``order`` defaults to ``graph.nodes``.

    ``accesses`` lists, in run order, each step's node with the values it writes and reads
    (from the kernel schedule); by default every node writes its outputs and reads its operands.
    Only written values get memory, constants excepted (they live in the module).
    """
    order = list(graph.nodes if order is None else order)
    _check_order(graph, order)
    if accesses is None:
        accesses = [(node, node.outputs, node.inputs) for node in order if node.op is not OpKind.INPUT]
    accesses = list(accesses)
    locations: dict[Value, Location] = {}
    buffer_names: list[str] = []
    for name, value in graph.inputs.items():
        locations[value] = Location("input", len(buffer_names))
        buffer_names.append(name)
    output_slots: dict[str, int] = {}
    owned: set[str] = set()
    for name, value in graph.outputs.items():
        if value not in locations:  # else an input, or a value already written to an earlier output
            locations[value] = Location("output", len(buffer_names))
            buffer_names.append(name)
            owned.add(name)
        output_slots[name] = locations[value].index

    step = {node: i for i, node in enumerate(order)}
    live: dict[Value, tuple[int, int]] = {}
    for node, writes, _ in accesses:
        for value in writes:
            live[value] = (step[node], step[node])
    for node, _, reads in accesses:
        for value in reads:
            if value in live:
                first, last = live[value]
                live[value] = (first, max(last, step[node]))
    for node in order:
        if node.op is OpKind.CONSTANT and node.outputs[0] not in locations:
            locations[node.outputs[0]] = Location("constant", node.id)

    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    written = dict.fromkeys(value for _, writes, _ in accesses for value in writes)
    for value in written:
        if value not in locations and not value.type.is_static:
            locations[value] = Location("temp", len(buffer_names))
            buffer_names.append(f"%temp{len(buffer_names)}")
    intermediates = [v for v in written if v not in locations]
    intermediates.sort(key=lambda v: (-v.type.nbytes, live[v][0]))
    for value in intermediates:
        first, last = live[value]
        size = _align(value.type.nbytes)
        offset = 0
        for other_offset, other_end, other_first, other_last in sorted(placed):
            overlaps_in_time = not (last < other_first or other_last < first)
            if overlaps_in_time and offset < other_end and other_offset < offset + size:
                offset = _align(other_end)
        placed.append((offset, offset + size, first, last))
        locations[value] = Location("arena", offset)
    values_end = max((end for _, end, _, _ in placed), default=0)
    stride = _align(max((scratch_per_thread(n) for n in order if n.op is not OpKind.INPUT), default=0))
    plan = MemoryPlan(
        order=order,
        locations=locations,
        buffer_names=buffer_names,
        arena_bytes=values_end + stride * threads,
        scratch_offset=values_end,
        scratch_stride=stride,
        threads=threads,
        live=live,
        output_slots=output_slots,
        owned_outputs=frozenset(owned),
        accesses=accesses,
    )
    check_plan(plan)
    return plan


def check_plan(plan: MemoryPlan) -> None:
    """Raise if two arena values live at once overlap, or a node's output overlaps its input."""
    arena = [(v, loc.index, loc.index + v.type.nbytes) for v, loc in plan.locations.items() if loc.kind == "arena"]
    # A sweep in the order values come alive: each is checked against those still live then
    # (all pairs would be quadratic in a deep model's thousands of arena values).
    arena.sort(key=lambda entry: plan.live[entry[0]][0])
    live: list[tuple[Value, int, int, int]] = []
    for a, a_start, a_end in arena:
        if a_end > plan.scratch_offset:
            raise RlxError(f"memory plan bug: {a} runs into the scratch region")
        a_first, a_last = plan.live[a]
        live = [entry for entry in live if entry[3] >= a_first]
        for b, b_start, b_end, _ in live:
            if a_start < b_end and b_start < a_end:
                raise RlxError(f"memory plan bug: {a} and {b} are live together and overlap")
        live.append((a, a_start, a_end, a_last))
    for node, writes, reads in plan.accesses:
        for out in writes:
            for operand in reads:
                if out != operand and _overlap(plan, out, operand):
                    raise RlxError(f"memory plan bug: node {node.id} ({node.op}) writes {out} over its input {operand}")


def _overlap(plan: MemoryPlan, a: Value, b: Value) -> bool:
    la, lb = plan.locations[a], plan.locations[b]
    if la.kind != lb.kind:
        return False
    if la.kind != "arena":
        return la.index == lb.index
    return la.index < lb.index + b.type.nbytes and lb.index < la.index + a.type.nbytes


def _check_order(graph: Graph, order: Sequence[Node]) -> None:
    if {n.id for n in order} != {n.id for n in graph.nodes} or len(order) != len(graph):
        raise RlxError("memory plan: the order must list every node of the graph once")
    position = {n.id: i for i, n in enumerate(order)}
    for node in order:
        for value in node.inputs:
            if position[value.node.id] >= position[node.id]:
                raise RlxError(f"memory plan: node {node.id} comes before its operand node {value.node.id}")
