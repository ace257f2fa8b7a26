"""Graphviz DOT rendering of a graph, for looking at it (``dot -Tsvg``), not for reading back.

Inputs are ellipses, ops are boxes labelled with the op and its attributes, graph outputs are
separate sink nodes; each edge carries the printed name and type of the value flowing along it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlx.ir.ops import InputAttrs, OpKind
from rlx.ir.printer import format_attr_value, value_names

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node


def quote(text: str) -> str:
    """A DOT double-quoted string; backslashes and quotes escaped, newlines as ``\\n``."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def node_label(node: Node) -> str:
    """The op (or input name) on the first line, then one ``key = value`` line per attribute."""
    if node.op is OpKind.INPUT and isinstance(node.attrs, InputAttrs):
        return f"input {node.attrs.name}\n{node.types[0]}"
    attrs = [f"{f.name} = {format_attr_value(getattr(node.attrs, f.name))}" for f in dataclasses.fields(node.attrs)]
    return "\n".join([str(node.op), *attrs])


def to_dot(graph: Graph) -> str:
    """The whole graph as DOT text: ``digraph "<name>" { ... }``."""
    names = value_names(graph)
    lines = [f"digraph {quote(graph.name)} {{", "  node [fontname=monospace];"]
    for node in graph.nodes:
        shape = "ellipse" if node.op is OpKind.INPUT else "box"
        lines.append(f"  n{node.id} [shape={shape}, label={quote(node_label(node))}];")
    for node in graph.nodes:
        for value in node.inputs:
            label = f"{names[value]} : {value.type}"
            lines.append(f"  n{value.node.id} -> n{node.id} [label={quote(label)}];")
    for index, (name, value) in enumerate(graph.outputs.items()):
        lines.append(f"  out{index} [shape=doubleoctagon, label={quote(f'output {name}')}];")
        label = f"{names[value]} : {value.type}"
        lines.append(f"  n{value.node.id} -> out{index} [label={quote(label)}];")
    lines.append("}")
    return "\n".join(lines)
