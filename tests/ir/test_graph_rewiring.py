"""Random rewiring: ``set_input`` refuses exactly the edits that would make a cycle.

``set_input`` skips its search for a cycle when a rank that grows along every edge already
rules one out, and keeps those ranks valid across edits and new nodes. A wrong rank would let a
cycle in or refuse a valid edit; here every edit's outcome is compared with a plain search on a
copy of the edges taken before it.
"""

from __future__ import annotations

import networkx as nx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), edits=st.integers(5, 60))
def test_random_rewiring_refuses_exactly_the_cycles(seed: int, edits: int) -> None:
    rng = np.random.default_rng(seed)
    g = Graph("rewire")
    values = [g.input(f"x{i}", (3,)) for i in range(3)]
    for _ in range(6):
        a, b = rng.choice(len(values), 2)
        values.append(g.add(values[a], values[b]))
    refused = 0
    for _ in range(edits):
        if rng.random() < 0.2:  # new nodes between edits, ranked above their inputs
            a, b = rng.choice(len(values), 2)
            values.append(g.mul(values[a], values[b]))
            continue
        nodes = [v.node for v in values if v.node.inputs]
        node = nodes[rng.integers(len(nodes))]
        slot = int(rng.integers(len(node.inputs)))
        value = values[rng.integers(len(values))]
        edges = nx.DiGraph((v.node.id, n.id) for n in g.nodes for s, v in enumerate(n.inputs) if (n, s) != (node, slot))
        edges.add_nodes_from(n.id for n in g.nodes)
        cycle = value.node is node or nx.has_path(edges, node.id, value.node.id)
        try:
            g.set_input(node, slot, value)
        except rlx.RlxValueError as error:
            assert cycle, f"refused a valid edit: {error}"
            refused += 1
        else:
            assert not cycle, "let a cycle in"
        assert nx.is_directed_acyclic_graph(g._store)  # no verify() here: it would reset the ranks
    g.verify()
