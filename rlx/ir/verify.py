"""Whole-graph verifier: structure, types and outputs. Errors end with the printed graph."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import networkx as nx

from rlx.errors import RlxError, RlxValueError
from rlx.ir.ops import InputAttrs, OpKind

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node


def verify(graph: Graph) -> None:
    """Raise ``RlxValueError`` naming the first problem found, followed by the printed graph."""
    problems = _problems(graph)
    if problems:
        try:
            printed = str(graph)
        except Exception as exc:  # a graph broken enough not to print still gets its message
            printed = f"<graph could not be printed: {exc}>"
        raise RlxValueError(f"graph {graph.name!r} failed verification:\n  " + "\n  ".join(problems) + "\n\n" + printed)


def _problems(graph: Graph) -> list[str]:
    store = graph._store
    stored, known = set(store.nodes), set(graph._nodes)
    if stored != known:
        return [
            f"the graph store holds nodes {sorted(stored)} but the graph has nodes {sorted(known)}"
            " (a node was added or removed behind the Graph API)"
        ]
    edge_problems = _edge_problems(graph)
    if edge_problems:
        return edge_problems  # the order of graph.nodes and the users lists are wrong until fixed
    if not nx.is_directed_acyclic_graph(store):
        cycle = nx.find_cycle(store)
        return [f"the graph has a cycle through nodes {[edge[0] for edge in cycle]}"]
    problems: list[str] = []
    input_names: set[str] = set()
    for node in graph.nodes:
        problems += _node_problems(graph, node)
        if node.op is OpKind.INPUT and isinstance(node.attrs, InputAttrs):
            if node.attrs.name in input_names:
                problems.append(f"two inputs are named {node.attrs.name!r}")
            input_names.add(node.attrs.name)
    for name, value in graph.outputs.items():
        if value not in graph:
            problems.append(f"output {name!r} reads node {value.node.id}, which is not in the graph")
        elif not 0 <= value.index < len(value.node.types):
            problems.append(f"output {name!r} reads output {value.index} of node {value.node.id}, which has none")
    return problems


def _edge_problems(graph: Graph) -> list[str]:
    """The store must hold exactly one edge ``producer -> consumer`` keyed by slot per operand.

    ``users``, ``uses`` and the topological order all read the store, so an operand changed
    without its edge (``node._inputs = ...`` instead of ``set_input``) silently breaks them.
    Operands that read a node outside the graph are left to :func:`_node_problems`.
    """
    expected: Counter[tuple[int, int, int]] = Counter()
    operand_slots: set[tuple[int, int]] = set()
    for node in graph._nodes.values():
        for slot, value in enumerate(node.inputs):
            operand_slots.add((node.id, slot))
            if value in graph:
                expected[(value.node.id, node.id, slot)] += 1
    actual: Counter[tuple[int, int, int]] = Counter(list(graph._store.edges(keys=True)))
    problems = []
    for producer, consumer, slot in sorted((expected - actual).elements()):
        stored = sorted(p for p, c, k in actual if c == consumer and k == slot)
        found = f"an edge from node {stored[0]}" if stored else "no edge"
        problems.append(
            f"node {consumer} ({graph._nodes[consumer].op}): operand {slot} reads node {producer}, but the graph "
            f"store has {found} for slot {slot} (operands changed behind the Graph API; use set_input)"
        )
    for producer, consumer, slot in sorted((actual - expected).elements()):
        if (consumer, slot) in operand_slots:
            continue  # reported above, or an operand outside the graph that _node_problems reports
        node = graph._nodes[consumer]
        problems.append(
            f"node {consumer} ({node.op}): the graph store has an edge from node {producer} for slot {slot}, "
            f"but the node has {len(node.inputs)} operand(s)"
        )
    return problems


# Result types by (op, operand types, attrs): a pipeline verifies the graph after every pass,
# and a pass changes few nodes, so most checks of a large graph (a convnet's training step:
# 2,400 nodes, eight checks) re-infer what an earlier check inferred. Shape rules are pure
# functions of those three, so a remembered result is the result; errors are not remembered.
_INFERRED: dict[tuple[object, ...], tuple[object, ...]] = {}
_INFERRED_LIMIT = 1 << 16


def _inferred(node: Node, where: str) -> tuple[object, ...]:
    types = tuple(v.type for v in node.inputs)
    try:
        key: tuple[object, ...] | None = (node.op, types, node.attrs)
        found = _INFERRED.get(key)  # type: ignore[arg-type]
    except TypeError:  # attrs that do not hash (a constant's array): inferred every time
        key, found = None, None
    if found is not None:
        return found
    result = tuple(node.op.definition.infer(where, list(types), node.attrs))
    if key is not None:
        if len(_INFERRED) >= _INFERRED_LIMIT:
            _INFERRED.clear()
        _INFERRED[key] = result
    return result


def _node_problems(graph: Graph, node: Node) -> list[str]:
    where = f"node {node.id} ({node.op})"
    if not isinstance(node.op, OpKind):
        return [f"{where}: op must be an OpKind, got {node.op!r}"]
    definition = node.op.definition
    if not isinstance(node.attrs, definition.attrs):
        return [f"{where}: attrs must be {definition.attrs.__name__}, got {type(node.attrs).__name__}"]
    for slot, value in enumerate(node.inputs):
        if value not in graph:
            return [f"{where}: operand {slot} reads node {value.node.id}, which is not in the graph"]
        if not 0 <= value.index < len(value.node.types):
            return [f"{where}: operand {slot} reads output {value.index} of node {value.node.id}, which has none"]
    if node.op is OpKind.INPUT:
        return [] if not node.inputs and len(node.types) == 1 else [f"{where}: an input has no operands, one result"]
    try:
        definition.check_arity(where, len(node.inputs))
        expected = _inferred(node, where)
    except RlxError as exc:
        return [str(exc)]
    except Exception as exc:  # e.g. an attrs field of the wrong type: report it, do not crash
        return [f"{where}: attrs {node.attrs!r} do not fit its operands ({type(exc).__name__}: {exc})"]
    if tuple(expected) != tuple(node.types):
        got = ", ".join(map(str, node.types))
        return [f"{where}: result types are {got}, but its operands give {', '.join(map(str, expected))}"]
    return []
