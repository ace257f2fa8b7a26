"""Textual IR: one line per node, stable order, every value's type spelled out.

```
graph @attn {
  %q = input "q" : f32[2,128,4,64]
  %0 = attention %q, %k, %v {mask = causal, layout = bshd} : f32[2,128,4,64]
  %1, %2, %3 = attention_bwd %q, %k, %v, %dy {wrt = q|k|v, mask = causal, layout = bshd} : f32[...], ...
  output dq = %1, dk = %2, dv = %3
}
```

Inputs are named after the graph input; other values are numbered in print order, so the text
does not depend on node ids and survives passes that renumber nothing. String attribute values
are JSON-quoted, so any text stays on its line. ``rlx.ir.parse`` reads it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import TYPE_CHECKING

from rlx.ir.ops import InputAttrs, OpKind

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


class ValueNames(dict):  # type: ignore[type-arg]
    """``value -> printed name``; a value the graph does not hold gets a placeholder, not a KeyError.

    A graph damaged by a buggy pass (an output or operand that reads an erased node) must still
    print, because ``verify`` ends its error message with the printed graph.
    """

    def __init__(self, graph: Graph) -> None:
        super().__init__()
        self.graph = graph

    def __missing__(self, value: Value) -> str:
        node = value.node
        if node.graph is not self.graph:
            return f"%<node {node.id} of graph {node.graph.name!r}>"
        if value not in self.graph:
            return f"%<erased node {node.id}>"
        return f"%<node {node.id} has no output {value.index}>"


def value_names(graph: Graph) -> dict[Value, str]:
    """The printed name of every value: ``%<input name>`` or ``%<n>`` in print order.

    Looking up a value that is not in the graph gives a placeholder such as ``%<erased node 7>``.
    """
    names = ValueNames(graph)
    counter = 0
    for node in graph.nodes:
        if node.op is OpKind.INPUT and isinstance(node.attrs, InputAttrs):
            names[node.outputs[0]] = f"%{node.attrs.name}"
            continue
        for value in node.outputs:
            names[value] = f"%{counter}"
            counter += 1
    return names


def quote(text: str) -> str:
    """A double-quoted string with JSON escaping (``\\"``, ``\\\\``, ``\\n``, ``\\uXXXX``): one ASCII line."""
    return json.dumps(text)


def format_attr_value(value: object) -> str:
    """An attribute value as the parser reads it back: strings quoted, a shape's symbolic dimensions
    bare (``(2, Sk, 64)``, as in types), everything else ``str()``."""
    if isinstance(value, tuple) and any(isinstance(v, str) for v in value):
        return "(" + ", ".join(str(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return quote(value) if isinstance(value, str) and not isinstance(value, enum.Enum) else str(value)


def format_attrs(node: Node) -> str:
    fields = [f"{f.name} = {format_attr_value(getattr(node.attrs, f.name))}" for f in dataclasses.fields(node.attrs)]
    return "{" + ", ".join(fields) + "}"


def format_node(node: Node, names: dict[Value, str]) -> str:
    """One node as one line (without indentation)."""
    types = ", ".join(str(t) for t in node.types)
    if node.op is OpKind.INPUT and isinstance(node.attrs, InputAttrs):
        return f"{names[node.outputs[0]]} = input {quote(node.attrs.name)} : {types}"
    results = ", ".join(names[v] for v in node.outputs)
    parts = [f"{results} = {node.op}"]
    if node.inputs:
        parts.append(", ".join(names[v] for v in node.inputs))
    if dataclasses.fields(node.attrs):  # ops without attributes print none
        parts.append(format_attrs(node))
    return f"{' '.join(parts)} : {types}"


def format_graph(graph: Graph) -> str:
    names = value_names(graph)
    lines = [f"graph @{graph.name} {{"]
    lines += [f"  {format_node(node, names)}" for node in graph.nodes]
    if graph.outputs:
        lines.append("  output " + ", ".join(f"{name} = {names[v]}" for name, v in graph.outputs.items()))
    lines.append("}")
    return "\n".join(lines)
