"""Merge attention-backward siblings into one node so that S and P are recomputed once.

Siblings are ``attention_bwd`` nodes with the same operands (q, k, v, dy and mask tensor, as
Values), mask kind (window included) and layout. Each such group becomes ONE node whose ``wrt``
is the union of the group's flags: dQ+dK+dV costs 5 GEMMs per head instead of 8. Members that
repeat a flag compute the same tensor, so they are merged too (one node per group, always).
``flex_attention_bwd`` siblings (same operands, mods, scale and layout) merge the same way, and
the merged node also produces the score_mod tensors' gradients if any member did.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlx.ir import AttentionBwdAttrs, Layout, MaskKind, OpKind, Value, Wrt
from rlx.ops.flex_attention import FlexAttentionBwdAttrs
from rlx.passes.base import Pass, register

if TYPE_CHECKING:
    from rlx.ir import Graph, Node

SiblingKey = tuple[tuple[Value, ...], MaskKind, Layout]


def sibling_groups(graph: Graph) -> list[list[Node]]:
    """``attention_bwd`` nodes grouped by (operands, mask, layout), in topological order."""
    groups: dict[SiblingKey, list[Node]] = {}
    for node in graph.nodes:
        if node.op is OpKind.ATTENTION_BWD:
            attrs = node.attrs
            assert isinstance(attrs, AttentionBwdAttrs)
            groups.setdefault((node.inputs, attrs.mask, attrs.layout), []).append(node)
    return list(groups.values())


def flex_sibling_groups(graph: Graph) -> list[list[Node]]:
    """``flex_attention_bwd`` nodes grouped by operands and every attribute but the gradient set."""
    groups: dict[tuple[tuple[Value, ...], FlexAttentionBwdAttrs], list[Node]] = {}
    for node in graph.nodes:
        if node.op is OpKind.FLEX_ATTENTION_BWD:
            key = dataclasses.replace(node.attrs, wrt=Wrt(0), tensor_grads=False)
            groups.setdefault((node.inputs, key), []).append(node)
    return list(groups.values())


def fuse_attention_bwd(graph: Graph) -> bool:
    """Fuse every sibling group of ``graph`` in place; True if any group had two or more nodes."""
    changed = False
    for group in sibling_groups(graph):
        if len(group) > 1:
            _fuse_group(graph, group)
            changed = True
    for group in flex_sibling_groups(graph):
        if len(group) > 1:
            _fuse_flex_group(graph, group)
            changed = True
    return changed


def _fuse_flex_group(graph: Graph, group: list[Node]) -> None:
    union, tensors = Wrt(0), False
    for node in group:
        union |= node.attrs.wrt
        tensors |= node.attrs.tensor_grads
    attrs = dataclasses.replace(group[0].attrs, wrt=union, tensor_grads=tensors)
    fused = next((node for node in group if node.attrs == attrs), None)
    if fused is None:
        fused = graph.add_node(OpKind.FLEX_ATTENTION_BWD, group[0].inputs, attrs)
    position = {flag: i for i, flag in enumerate(union.members)}
    for node in group:
        if node is fused:
            continue
        flags = node.attrs.wrt.members
        for index, old in enumerate(node.outputs):
            new = position[flags[index]] if index < len(flags) else len(position) + index - len(flags)
            graph.replace_all_uses_with(old, fused.outputs[new])
        graph.erase(node)


def _fuse_group(graph: Graph, group: list[Node]) -> None:
    union = Wrt(0)
    for node in group:
        union |= _attrs(node).wrt
    # Reuse a member that already computes everything (e.g. wrt=ALL plus a stray {Q}); else build one.
    fused = next((node for node in group if _attrs(node).wrt == union), None)
    if fused is None:
        first = _attrs(group[0])
        fused = graph.add_node(
            OpKind.ATTENTION_BWD, group[0].inputs, AttentionBwdAttrs(wrt=union, mask=first.mask, layout=first.layout)
        )
    position = {flag: i for i, flag in enumerate(union.members)}
    for node in group:
        if node is fused:
            continue
        for flag, old in zip(_attrs(node).wrt.members, node.outputs, strict=True):
            graph.replace_all_uses_with(old, fused.outputs[position[flag]])
        graph.erase(node)


def _attrs(node: Node) -> AttentionBwdAttrs:
    assert isinstance(node.attrs, AttentionBwdAttrs)
    return node.attrs


FUSE_ATTENTION_BWD = register(
    Pass("fuse-attention-bwd", fuse_attention_bwd, "merge attention_bwd siblings into one node per group")
)
