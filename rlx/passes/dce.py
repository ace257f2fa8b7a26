"""Dead-code elimination: drop what no graph output reads; narrow half-used attention_bwd nodes.

Graph inputs are the graph's signature and always stay. A multi-output ``attention_bwd`` whose
outputs are only partly read is rebuilt with just the used ``wrt`` flags (wrt=ALL of which only
dV is read becomes wrt=v), so fusing a dead sibling never costs GEMMs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlx.ir import AttentionBwdAttrs, OpKind, Wrt
from rlx.passes.base import Pass, register

if TYPE_CHECKING:
    from rlx.ir import Graph, Node, Value


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
        elif len(used) < len(node.outputs) and node.op is OpKind.ATTENTION_BWD:
            _narrow_attention_bwd(graph, node, used)
            changed = True
    return changed


def _is_used(graph: Graph, value: Value) -> bool:
    return bool(graph.uses(value)) or bool(graph.output_names_of(value))


def _narrow_attention_bwd(graph: Graph, node: Node, used: list[Value]) -> None:
    attrs = node.attrs
    assert isinstance(attrs, AttentionBwdAttrs)
    flags = attrs.wrt.members
    wrt = Wrt(0)
    for value in used:
        wrt |= flags[value.index]
    narrow = graph.add_node(
        OpKind.ATTENTION_BWD, node.inputs, AttentionBwdAttrs(wrt=wrt, mask=attrs.mask, layout=attrs.layout)
    )
    for value, new in zip(used, narrow.outputs, strict=True):
        graph.replace_all_uses_with(value, new)
    graph.erase(node)


DCE = register(Pass("dce", dce, "erase nodes no output reads; narrow attention_bwd to the gradients read"))
