"""Graphviz export: every node, edge and output appears, and labels are safely quoted."""

from __future__ import annotations

import re

from rlx import Graph
from rlx.ir.dot import quote

from .graphs import bhsd_masks_graph, spec_graph

_QUOTED = r'"(?:[^"\\]|\\.)*"'
_NODE_LINE = re.compile(rf"^  (\w+) \[shape=(\w+), label=({_QUOTED})\];$")
_EDGE_LINE = re.compile(rf"^  (\w+) -> (\w+) \[label=({_QUOTED})\];$")


def _parse_dot(text: str) -> tuple[dict[str, tuple[str, str]], list[tuple[str, str, str]]]:
    """A strict reader for what to_dot writes: every body line is a node, an edge or the style."""
    lines = text.splitlines()
    assert re.fullmatch(rf"digraph {_QUOTED} \{{", lines[0]) and lines[-1] == "}"
    nodes: dict[str, tuple[str, str]] = {}
    edges: list[tuple[str, str, str]] = []
    for line in lines[1:-1]:
        if node := _NODE_LINE.match(line):
            assert node[1] not in nodes, f"node {node[1]} declared twice"
            nodes[node[1]] = (node[2], node[3])
        elif edge := _EDGE_LINE.match(line):
            edges.append((edge[1], edge[2], edge[3]))
        else:
            assert line == "  node [fontname=monospace];", line
    return nodes, edges


def test_dot_has_every_node_edge_and_output() -> None:
    g = spec_graph()
    nodes, edges = _parse_dot(g.to_dot())
    for node in g.nodes:
        shape, label = nodes[f"n{node.id}"]
        assert shape == ("ellipse" if node.op.value == "input" else "box")
        assert label.startswith(f'"{"input" if node.op.value == "input" else node.op}')
    sinks = {name: shape for name, (shape, label) in nodes.items() if label.startswith('"output ')}
    assert len(sinks) == len(g.outputs) == 4
    assert set(sinks.values()) == {"doubleoctagon"}
    assert len(nodes) == len(g) + len(g.outputs)
    assert len(edges) == sum(len(n.inputs) for n in g.nodes) + len(g.outputs)
    assert all(src in nodes and dst in nodes for src, dst, _ in edges)


def test_dot_labels_carry_attrs_and_edge_types() -> None:
    g = bhsd_masks_graph()
    text = g.to_dot()
    assert text.startswith('digraph "bhsd.masks" {')
    bwd = g.outputs["dk"].node
    assert f'n{bwd.id} [shape=box, label="attention_bwd\\nwrt = k|v\\nmask = bias\\nlayout = bhsd"];' in text
    pad = g.inputs["pad"].node
    assert f'n{pad.id} [shape=ellipse, label="input pad\\nf32[2,3]"];' in text
    assert f'n{pad.id} -> n{g.outputs["out0"].node.id} [label="%pad : f32[2,3]"];' in text
    assert f'n{bwd.id} -> out3 [label="%3 : f32[2,2,3,4]"];' in text
    assert 'out3 [shape=doubleoctagon, label="output dv"];' in text


def test_empty_graph_is_valid_dot() -> None:
    assert _parse_dot(Graph("empty").to_dot()) == ({}, [])


def test_quote_escapes_quotes_backslashes_and_newlines() -> None:
    assert quote('say "hi"') == '"say \\"hi\\""'
    assert quote("a\\b") == '"a\\\\b"'
    assert quote("two\nlines") == '"two\\nlines"'
    assert quote('\\"') == '"\\\\\\""'
    assert re.fullmatch(_QUOTED, quote('x"\\\n"y'))
