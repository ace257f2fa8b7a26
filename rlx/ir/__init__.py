"""The op-graph IR: graph, nodes, values, op kinds, types, printer, parser and verifier."""

from rlx.ir.graph import Graph, Node, Value
from rlx.ir.ops import AttentionAttrs, AttentionBwdAttrs, InputAttrs, OpKind
from rlx.ir.types import Layout, MaskKind, TensorType, Wrt


def parse(text: str) -> Graph:
    """Read textual IR (as ``str(graph)`` prints it) back into a Graph."""
    from rlx.ir.parser import parse as _parse

    return _parse(text)


__all__ = [
    "AttentionAttrs",
    "AttentionBwdAttrs",
    "Graph",
    "InputAttrs",
    "Layout",
    "MaskKind",
    "Node",
    "OpKind",
    "TensorType",
    "Value",
    "Wrt",
    "parse",
]
