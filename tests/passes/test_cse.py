"""cse: identical nodes become one, so that fusion sees one sibling group."""

from __future__ import annotations

from textwrap import dedent

from passes_helpers import assert_same_numerics, qkv

import rlx
from rlx import Graph, MaskKind, OpKind, Wrt
from rlx.passes import cse, fuse_attention_bwd


def test_forward_built_twice_becomes_one_golden() -> None:
    g = Graph("attn")
    q, k, v, _dy = qkv(g)
    a = g.attention(q, k, v, mask=MaskKind.CAUSAL)
    b = g.attention(q, k, v, mask=MaskKind.CAUSAL)
    g.output(a=a, b=b)
    after = assert_same_numerics(g, cse)
    assert cse(g) is True
    assert str(g) == str(after)
    assert str(g) == dedent(
        """\
        graph @attn {
          %q = input "q" : f32[2,6,2,4]
          %k = input "k" : f32[2,6,2,4]
          %v = input "v" : f32[2,6,2,4]
          %dy = input "dy" : f32[2,6,2,4]
          %0 = attention %q, %k, %v {mask = causal, layout = bshd} : f32[2,6,2,4]
          output a = %0, b = %0
        }"""
    )
    assert g.outputs["a"].node is a.node  # the oldest is kept
    assert cse(g) is False


def test_different_attrs_or_operands_are_not_merged() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    g.output(
        a=g.attention(q, k, v, mask=MaskKind.CAUSAL),
        b=g.attention(q, k, v),
        c=g.attention(q, v, k, mask=MaskKind.CAUSAL),
        d=g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY),
        e=g.attention_bwd(q, k, v, dy, wrt=Wrt.KEY),
    )
    text = str(g)
    assert cse(g) is False
    assert str(g) == text


def test_inputs_with_the_same_type_are_never_merged() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)  # q and dy have the same type
    g.output(a=g.attention(q, k, v), b=g.attention(dy, k, v))
    assert cse(g) is False
    assert len(g.inputs) == 4


def test_duplicated_chain_merges_in_one_call() -> None:
    g = Graph("attn")
    q, k, v, _dy = qkv(g)
    top = [g.attention(g.attention(q, k, v), k, v) for _ in range(2)]
    g.output(a=top[0], b=top[1])
    assert cse(g) is True
    assert len([node for node in g.nodes if node.op is OpKind.ATTENTION]) == 2
    assert g.outputs["a"] == g.outputs["b"]


def test_cse_lets_fusion_see_one_group() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    # The same forward built twice feeds the backward as q: two different Values, same tensor.
    h1, h2 = g.attention(q, k, v), g.attention(q, k, v)
    g.output(dq=g.attention_bwd(h1, k, v, dy, wrt=Wrt.QUERY), dk=g.attention_bwd(h2, k, v, dy, wrt=Wrt.KEY))
    alone = g.copy()
    assert fuse_attention_bwd(alone) is False
    after = assert_same_numerics(g, lambda graph: (cse(graph), fuse_attention_bwd(graph)))
    bwd = [node for node in after.nodes if node.op is OpKind.ATTENTION_BWD]
    assert [node.attrs.wrt for node in bwd] == [Wrt.QUERY | Wrt.KEY]
    assert rlx.passes.PASSES["cse"].apply(g) is True
