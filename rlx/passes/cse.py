"""Common-subexpression elimination: nodes with the same op, attrs and operands become one.

Run before fusion so that a gradient built twice (or a forward built twice and used as dy)
lands in one sibling group. The oldest node of each class is kept.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from rlx.ir import OpKind
from rlx.passes.base import Pass, register

if TYPE_CHECKING:
    from rlx.ir import Graph, Node


def cse(graph: Graph) -> bool:
    """Merge identical nodes in place, to a fixpoint; True if anything was merged."""
    changed = False
    while _cse_once(graph):
        changed = True
    return changed


def _cse_once(graph: Graph) -> bool:
    # Topological order: a node's operands are already canonical when its key is taken, so one
    # sweep merges whole duplicated chains; the loop in ``cse`` is a cheap safety net.
    seen: dict[Hashable, Node] = {}
    changed = False
    for node in graph.nodes:
        if node.op is OpKind.INPUT:  # inputs are distinct by name: the graph's signature
            continue
        key = (node.op, node.attrs, node.inputs)
        kept = seen.setdefault(key, node)
        if kept is node:
            continue
        for old, new in zip(node.outputs, kept.outputs, strict=True):
            graph.replace_all_uses_with(old, new)
        graph.erase(node)
        changed = True
    return changed


CSE = register(Pass("cse", cse, "merge nodes with the same op, attrs and operands"))
