"""Dead-code elimination: drop what no graph output reads; narrow half-used multi-output nodes.

Graph inputs are the graph's signature and always stay. A multi-output node whose outputs are
only partly read is rebuilt by its op's ``narrow`` hook when it has one (an ``attention_bwd`` with
wrt=ALL of which only dV is read becomes wrt=v), so fusing a dead sibling never costs GEMMs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlx.ir import OpKind
from rlx.passes.base import Pass, register

if TYPE_CHECKING:
    from rlx.ir import Graph, Value


def dce(graph: Graph) -> bool:
    """Erase dead nodes and narrow partly used ones, in place; True if anything changed."""
    changed = False
    # Reverse topological order: every user of a node is settled (kept or erased) before the node.
    for node in reversed(graph.nodes):
        if node.op is OpKind.INPUT:
            continue
        used = [value for value in node.outputs if _is_used(graph, value)]
        if not used:
            graph.erase(node)
            changed = True
        elif len(used) < len(node.outputs) and node.op.definition.narrow is not None:
            node.op.definition.narrow(graph, node, used)
            changed = True
    return changed


def _is_used(graph: Graph, value: Value) -> bool:
    return bool(graph.uses(value)) or bool(graph.output_names_of(value))


DCE = register(Pass("dce", dce, "erase nodes no output reads; narrow multi-output nodes to the outputs read"))
