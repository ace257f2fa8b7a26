"""dce: dead nodes go, inputs stay, half-used attention_bwd nodes are narrowed."""

from __future__ import annotations

from textwrap import dedent

from passes_helpers import assert_same_numerics, qkv

import rlx
from rlx import Graph, MaskKind, OpKind, Wrt
from rlx.passes import dce


def test_dead_chain_goes_inputs_stay_golden() -> None:
    g = Graph("attn")
    q, k, v, _dy = qkv(g)
    dead = g.attention(q, k, v)
    g.attention(dead, k, v)  # reads the dead node: both go in one run
    live = g.attention(q, k, v, mask=MaskKind.CAUSAL)
    g.output(out=live)
    after = assert_same_numerics(g, dce)
    assert dce(g) is True
    assert str(g) == str(after)
    assert str(g) == dedent(
        """\
        graph @attn {
          %q = input "q" : f32[2,6,2,4]
          %k = input "k" : f32[2,6,2,4]
          %v = input "v" : f32[2,6,2,4]
          %dy = input "dy" : f32[2,6,2,4]
          %0 = attention %q, %k, %v {mask = causal, layout = bshd} : f32[2,6,2,4]
          output out = %0
        }"""
    )
    assert list(g.inputs) == ["q", "k", "v", "dy"]  # %dy is unused but is part of the signature
    assert dce(g) is False


def test_graph_without_outputs_keeps_only_inputs() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL)
    assert dce(g) is True
    assert [node.op for node in g.nodes] == [OpKind.INPUT] * 4


def test_nothing_dead_returns_false() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    dq, dk, dv = g.attention_bwd(q, k, v, dy)
    g.output(dq=dq, dk=dk, dv=dv)
    text = str(g)
    assert dce(g) is False
    assert str(g) == text


def test_partly_used_attention_bwd_is_narrowed() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g, sq=3, sk=5)
    _dq, _dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=MaskKind.CAUSAL)
    g.output(dv=dv)
    after = assert_same_numerics(g, dce)
    assert str(after) == dedent(
        """\
        graph @attn {
          %q = input "q" : f32[2,3,2,4]
          %k = input "k" : f32[2,5,2,4]
          %v = input "v" : f32[2,5,2,4]
          %dy = input "dy" : f32[2,3,2,4]
          %0 = attention_bwd %q, %k, %v, %dy {wrt = v, mask = causal, layout = bshd} : f32[2,5,2,4]
          output dv = %0
        }"""
    )
    assert dce(after) is False


def test_narrowing_keeps_a_user_node_and_the_q_k_order() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    dq, _dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL)
    g.output(o=g.attention(dq, k, v), dv=dv)
    after = assert_same_numerics(g, dce)
    (bwd,) = [node for node in after.nodes if node.op is OpKind.ATTENTION_BWD]
    assert bwd.attrs.wrt == Wrt.QUERY | Wrt.VALUE
    assert after.outputs["dv"] == bwd.outputs[1]
    assert after.outputs["o"].node.inputs[0] == bwd.outputs[0]


def test_fused_dead_sibling_is_narrowed_away_by_the_default_pipeline() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    dq = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY)
    g.attention_bwd(q, k, v, dy, wrt=Wrt.KEY)  # dead
    dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE)
    g.output(dq=dq, dv=dv)
    after = assert_same_numerics(g, lambda graph: rlx.passes.run(graph, list(rlx.passes.DEFAULT_PIPELINE)))
    (bwd,) = [node for node in after.nodes if node.op is OpKind.ATTENTION_BWD]
    assert bwd.attrs.wrt == Wrt.QUERY | Wrt.VALUE
