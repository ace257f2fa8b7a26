"""fuse-attention-bwd: sibling groups become one node with the union of their flags."""

from __future__ import annotations

from textwrap import dedent

import pytest
from passes_helpers import assert_same_numerics, qkv

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, Wrt
from rlx.passes import fuse_attention_bwd


def bwd_nodes(g: Graph) -> list[rlx.Node]:
    return [node for node in g.nodes if node.op is OpKind.ATTENTION_BWD]


def three_siblings(sq: int = 6, sk: int = 6, mask: MaskKind = MaskKind.CAUSAL) -> Graph:
    g = Graph("attn")
    q, k, v, dy = qkv(g, sq, sk)
    dq = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY, mask=mask)
    dk = g.attention_bwd(q, k, v, dy, wrt=Wrt.KEY, mask=mask)
    dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE, mask=mask)
    g.output(dq=dq, dk=dk, dv=dv)
    return g


def test_three_siblings_golden_ir_before_and_after() -> None:
    g = three_siblings()
    assert str(g) == dedent(
        """\
        graph @attn {
          %q = input "q" : f32[2,6,2,4]
          %k = input "k" : f32[2,6,2,4]
          %v = input "v" : f32[2,6,2,4]
          %dy = input "dy" : f32[2,6,2,4]
          %0 = attention_bwd %q, %k, %v, %dy {wrt = q, mask = causal, layout = bshd} : f32[2,6,2,4]
          %1 = attention_bwd %q, %k, %v, %dy {wrt = k, mask = causal, layout = bshd} : f32[2,6,2,4]
          %2 = attention_bwd %q, %k, %v, %dy {wrt = v, mask = causal, layout = bshd} : f32[2,6,2,4]
          output dq = %0, dk = %1, dv = %2
        }"""
    )
    assert fuse_attention_bwd(g) is True
    assert str(g) == dedent(
        """\
        graph @attn {
          %q = input "q" : f32[2,6,2,4]
          %k = input "k" : f32[2,6,2,4]
          %v = input "v" : f32[2,6,2,4]
          %dy = input "dy" : f32[2,6,2,4]
          %0, %1, %2 = attention_bwd %q, %k, %v, %dy {wrt = q|k|v, mask = causal, layout = bshd} \
: f32[2,6,2,4], f32[2,6,2,4], f32[2,6,2,4]
          output dq = %0, dk = %1, dv = %2
        }"""
    )


def test_outputs_keep_their_names_and_read_the_fused_node() -> None:
    g = three_siblings()
    fuse_attention_bwd(g)
    (fused,) = bwd_nodes(g)
    assert fused.attrs.wrt == Wrt.ALL
    assert fused.attrs.mask == MaskKind.CAUSAL
    assert dict(g.outputs) == {"dq": fused.outputs[0], "dk": fused.outputs[1], "dv": fused.outputs[2]}
    g.verify()


def test_idempotent_second_run_returns_false_and_changes_nothing() -> None:
    g = three_siblings()
    assert fuse_attention_bwd(g)
    text = str(g)
    assert fuse_attention_bwd(g) is False
    assert str(g) == text


def test_nothing_to_fuse_returns_false() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    g.output(dq=g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY), o=g.attention(q, k, v))
    text = str(g)
    assert fuse_attention_bwd(g) is False
    assert str(g) == text


@pytest.mark.parametrize(
    ("first", "second"),
    [(Wrt.QUERY, Wrt.KEY), (Wrt.KEY, Wrt.VALUE), (Wrt.QUERY, Wrt.VALUE), (Wrt.VALUE, Wrt.QUERY)],
    ids=["q+k", "k+v", "q+v", "v+q"],
)
def test_pairs_become_one_node_with_the_union(first: Wrt, second: Wrt) -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g, sq=3, sk=5)  # Sq != Sk: a mixed-up output would have the wrong type
    a = g.attention_bwd(q, k, v, dy, wrt=first, mask=MaskKind.sliding_window(2))
    b = g.attention_bwd(q, k, v, dy, wrt=second, mask=MaskKind.sliding_window(2))
    g.output(a=a, b=b)
    fused_g = assert_same_numerics(g, fuse_attention_bwd)
    (fused,) = bwd_nodes(fused_g)
    union = first | second
    assert fused.attrs.wrt == union
    assert len(fused.outputs) == 2
    position = {flag: i for i, flag in enumerate(union.members)}
    assert fused_g.outputs["a"] == fused.outputs[position[first]]
    assert fused_g.outputs["b"] == fused.outputs[position[second]]


def test_pair_golden_k_plus_v() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g, sq=3, sk=5)
    dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE)
    dk = g.attention_bwd(q, k, v, dy, wrt=Wrt.KEY)
    g.output(dv=dv, dk=dk)
    assert fuse_attention_bwd(g)
    assert str(g) == dedent(
        """\
        graph @attn {
          %q = input "q" : f32[2,3,2,4]
          %k = input "k" : f32[2,5,2,4]
          %v = input "v" : f32[2,5,2,4]
          %dy = input "dy" : f32[2,3,2,4]
          %0, %1 = attention_bwd %q, %k, %v, %dy {wrt = k|v, mask = none, layout = bshd} : f32[2,5,2,4], f32[2,5,2,4]
          output dv = %1, dk = %0
        }"""
    )


def test_multi_flag_node_plus_single_becomes_all() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    dq, dk = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY | Wrt.KEY)
    dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE)
    g.output(dq=dq, dk=dk, dv=dv)
    fused_g = assert_same_numerics(g, fuse_attention_bwd)
    (fused,) = bwd_nodes(fused_g)
    assert fused.attrs.wrt == Wrt.ALL
    assert list(fused_g.outputs.values()) == list(fused.outputs)


def test_member_that_already_has_the_union_is_kept() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    dq_alone = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY)
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL)
    g.output(dq_alone=dq_alone, dq=dq, dk=dk, dv=dv)
    assert fuse_attention_bwd(g)
    assert bwd_nodes(g) == [dq.node]  # no new node: the ALL node absorbs the stray {Q}
    assert g.outputs["dq_alone"] == dq


def test_duplicate_flags_are_merged_too() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g)
    dq1 = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY)
    dq2 = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY)
    dk = g.attention_bwd(q, k, v, dy, wrt=Wrt.KEY)
    g.output(dq1=dq1, dq2=dq2, dk=dk)
    fused_g = assert_same_numerics(g, fuse_attention_bwd)
    (fused,) = bwd_nodes(fused_g)
    assert fused.attrs.wrt == Wrt.QUERY | Wrt.KEY
    assert fused_g.outputs["dq1"] == fused_g.outputs["dq2"] == fused.outputs[0]
    assert fused_g.outputs["dk"] == fused.outputs[1]


def _two_nodes_differing_in(what: str) -> Graph:
    g = Graph("attn")
    layout_b = Layout.BHSD if what == "layout" else Layout.BSHD
    # [2,4,4,4] reads as B=2, S=4, H=4, D=4 in both layouts, so one set of inputs serves both.
    q, k, v, dy, dy2 = (g.input(name, (2, 4, 4, 4)) for name in ("q", "k", "v", "dy", "dy2"))
    pad, pad2 = g.input("pad", (2, 4)), g.input("pad2", (2, 4))
    mask_a, mask_b = MaskKind.CAUSAL, MaskKind.CAUSAL
    extra_a: dict = {}
    extra_b: dict = {}
    if what == "mask kind":
        mask_b = MaskKind.NONE
    elif what == "window":
        mask_a, mask_b = MaskKind.sliding_window(1), MaskKind.sliding_window(2)
    elif what == "mask tensor":
        mask_a = mask_b = MaskKind.CUSTOM
        extra_a, extra_b = {"mask_input": pad}, {"mask_input": pad2}
    a = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY, mask=mask_a, **extra_a)
    b = g.attention_bwd(q, k, v, dy2 if what == "dy" else dy, wrt=Wrt.KEY, mask=mask_b, layout=layout_b, **extra_b)
    g.output(a=a, b=b)
    return g


@pytest.mark.parametrize("what", ["dy", "mask kind", "window", "mask tensor", "layout"])
def test_no_fusion_across_different(what: str) -> None:
    g = _two_nodes_differing_in(what)
    text = str(g)
    assert fuse_attention_bwd(g) is False
    assert str(g) == text


def test_two_groups_fuse_separately() -> None:
    g = Graph("attn")
    q, k, v, dy, dy2 = qkv(g, dy_names=("dy", "dy2"))
    outs = {
        "dq": g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY),
        "dq2": g.attention_bwd(q, k, v, dy2, wrt=Wrt.QUERY),
        "dv": g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE),
        "dv2": g.attention_bwd(q, k, v, dy2, wrt=Wrt.VALUE),
    }
    g.output(**outs)
    fused_g = assert_same_numerics(g, fuse_attention_bwd)
    nodes = bwd_nodes(fused_g)
    assert [node.attrs.wrt for node in nodes] == [Wrt.QUERY | Wrt.VALUE] * 2
    assert {node.inputs[3] for node in nodes} == {fused_g.inputs["dy"], fused_g.inputs["dy2"]}
    assert fused_g.outputs["dq"].node is fused_g.outputs["dv"].node is not fused_g.outputs["dq2"].node


def test_cross_attention_golden() -> None:
    g = three_siblings(sq=3, sk=5)
    assert fuse_attention_bwd(g)
    assert str(g) == dedent(
        """\
        graph @attn {
          %q = input "q" : f32[2,3,2,4]
          %k = input "k" : f32[2,5,2,4]
          %v = input "v" : f32[2,5,2,4]
          %dy = input "dy" : f32[2,3,2,4]
          %0, %1, %2 = attention_bwd %q, %k, %v, %dy {wrt = q|k|v, mask = causal, layout = bshd} \
: f32[2,3,2,4], f32[2,5,2,4], f32[2,5,2,4]
          output dq = %0, dk = %1, dv = %2
        }"""
    )


@pytest.mark.parametrize(
    ("mask", "layout", "sq", "sk"),
    [
        (MaskKind.NONE, Layout.BSHD, 6, 6),
        (MaskKind.CAUSAL, Layout.BSHD, 3, 5),
        (MaskKind.CAUSAL, Layout.BHSD, 5, 3),
        (MaskKind.sliding_window(1), Layout.BHSD, 6, 6),
        (MaskKind.CUSTOM, Layout.BSHD, 3, 5),
        (MaskKind.BIAS, Layout.BHSD, 4, 6),
    ],
)
def test_numerics_equal_before_and_after(mask: MaskKind, layout: Layout, sq: int, sk: int) -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g, sq, sk, layout)
    extra = {}
    if mask == MaskKind.CUSTOM:
        extra["mask_input"] = g.input("pad", (2, sk))
    elif mask == MaskKind.BIAS:
        extra["mask_input"] = g.input("bias", (2, 2, sq, sk))
    for name, flag in (("dq", Wrt.QUERY), ("dk", Wrt.KEY), ("dv", Wrt.VALUE)):
        g.output(**{name: g.attention_bwd(q, k, v, dy, wrt=flag, mask=mask, layout=layout, **extra)})
    fused_g = assert_same_numerics(g, fuse_attention_bwd)
    (fused,) = bwd_nodes(fused_g)
    assert fused.attrs == rlx.ir.AttentionBwdAttrs(Wrt.ALL, mask, layout)
    assert fused.inputs == tuple(fused_g.inputs.values())  # q, k, v, dy and the mask tensor, if any


def test_user_that_is_an_attention_node_is_rewired_and_ordered_after() -> None:
    g = Graph("attn")
    q, k, v, dy = qkv(g, sq=3, sk=5)
    dq = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY, mask=MaskKind.CAUSAL)
    o2 = g.attention(dq, k, v)  # created before dk/dv: the fused node is newer than this user
    dk = g.attention_bwd(q, k, v, dy, wrt=Wrt.KEY, mask=MaskKind.CAUSAL)
    dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.VALUE, mask=MaskKind.CAUSAL)
    g.output(o2=o2, dk=dk, dv=dv, dq=dq)
    fused_g = assert_same_numerics(g, fuse_attention_bwd)
    assert str(fused_g) == dedent(
        """\
        graph @attn {
          %q = input "q" : f32[2,3,2,4]
          %k = input "k" : f32[2,5,2,4]
          %v = input "v" : f32[2,5,2,4]
          %dy = input "dy" : f32[2,3,2,4]
          %0, %1, %2 = attention_bwd %q, %k, %v, %dy {wrt = q|k|v, mask = causal, layout = bshd} \
: f32[2,3,2,4], f32[2,5,2,4], f32[2,5,2,4]
          %3 = attention %0, %k, %v {mask = none, layout = bshd} : f32[2,3,2,4]
          output o2 = %3, dk = %1, dv = %2, dq = %0
        }"""
    )
    (fused,) = bwd_nodes(fused_g)
    assert fused_g.users(fused) == [fused_g.outputs["o2"].node]


def test_registered_under_its_name() -> None:
    g = three_siblings()
    assert rlx.passes.PASSES["fuse-attention-bwd"].apply(g) is True
    assert len(bwd_nodes(g)) == 1
