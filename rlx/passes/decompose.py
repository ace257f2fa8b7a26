"""Rebuild composite ops (softmax, norms, cross-entropy, gelu, mean, ...) from primitives.

Each composite op carries its own rule (``OpDef.decompose``, beside the op in :mod:`rlx.ops`).
The fusing code generator sees only primitives and puts a softmax back together as one loop
nest over rows; running ``cse`` afterwards lets a norm's forward and its gradient share the
row statistics they both compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlx.passes.base import Pass, register

if TYPE_CHECKING:
    from rlx.ir import Graph


def decompose(graph: Graph) -> bool:
    """Replace every composite node by its decomposition, to a fixpoint; True if any was replaced."""
    changed = False
    while True:
        composites = [node for node in graph.nodes if node.op.definition.decompose is not None]
        if not composites:
            return changed
        for node in composites:
            rule = node.op.definition.decompose
            assert rule is not None
            replacements = rule(graph, node)
            for old, new in zip(node.outputs, replacements, strict=True):
                graph.replace_all_uses_with(old, new)
            graph.erase(node)
        changed = True


DECOMPOSE = register(Pass("decompose", decompose, "rebuild composite ops (softmax, norms, losses) from primitives"))
