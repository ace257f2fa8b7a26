"""Merge chains of elementwise ops into one ``fused_elementwise`` node each.

A chain is an elementwise op (one with a scalar formula and default attrs) together with every
elementwise producer that feeds only it, transitively: such intermediates have no other reader,
so they need no value of their own. The chain becomes one node whose ``program`` lists the ops
in order (:mod:`rlx.ops.fused`); ``print(exe.graph)`` shows what the loop nests compute. The code
generator then computes each fused node, and the reductions and views around it, in one loop
nest (:mod:`rlx.codegen.fused`). Runs after ``decompose`` so that softmax and norm bodies fuse.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlx.ops.fused import Program, Step, fused_elementwise
from rlx.passes.base import Pass, register

if TYPE_CHECKING:
    from rlx.ir import Graph, Node, Value


def _fusable(node: Node) -> bool:
    definition = node.op.definition
    return (
        definition.scalar is not None
        and node.op.value != "fused_elementwise"
        and len(node.outputs) == 1
        and node.attrs == definition.attrs()
    )


def fuse_elementwise(graph: Graph) -> bool:
    """Fuse every chain of two or more elementwise ops in place; True if any was fused."""
    changed = False
    absorbed: set[int] = set()
    nodes = graph.nodes
    # Sorting the graph again per chain made the pass quadratic (3 s of a 16-layer LM's compile);
    # groups hold original nodes only, whose order this stays.
    order = {node.id: i for i, node in enumerate(nodes)}
    for root in reversed(nodes):
        if root.id in absorbed or not _fusable(root):
            continue
        group = _chain(graph, root, order)
        if len(group) < 2:
            continue
        absorbed.update(node.id for node in group)
        _replace(graph, root, group)
        changed = True
    return changed


def _chain(graph: Graph, root: Node, order: dict[int, int]) -> list[Node]:
    """``root`` and the elementwise producers that feed only the chain, in topological order
    (``order``: node id -> position in one)."""
    members = {root.id: root}
    pending = [root]
    while pending:
        node = pending.pop()
        for value in node.inputs:
            producer = value.node
            if producer.id in members or not _fusable(producer) or graph.output_names_of(value):
                continue
            readers = {consumer.id for consumer, _ in graph.uses(value)}
            if readers <= members.keys():
                members[producer.id] = producer
                pending.append(producer)
    return sorted(members.values(), key=lambda node: order[node.id])


def _replace(graph: Graph, root: Node, group: list[Node]) -> None:
    position = {node.id: i for i, node in enumerate(group)}
    inputs: list[Value] = []
    steps = []
    for node in group:
        operands = []
        for value in node.inputs:
            if value.node.id in position:
                operands.append(("t", position[value.node.id]))
            else:
                if value not in inputs:
                    inputs.append(value)
                operands.append(("i", inputs.index(value)))
        steps.append(Step(node.op.value, tuple(operands)))
    fused = fused_elementwise(graph, inputs, Program(tuple(steps)))
    graph.replace_all_uses_with(root.outputs[0], fused)
    for node in reversed(group):
        graph.erase(node)


FUSE_ELEMENTWISE = register(
    Pass("fuse-elementwise", fuse_elementwise, "merge chains of elementwise ops into fused_elementwise nodes")
)
