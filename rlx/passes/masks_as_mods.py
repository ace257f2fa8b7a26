"""Rewrite fixed-mask attention into programmable attention: a MaskKind is a pair of mods.

``attention(mask=K)`` becomes ``flex_attention`` with K's mods (:func:`rlx.mods.from_mask_kind`)
and ``attention_bwd(wrt=W, mask=K)`` a ``flex_attention_bwd`` that recomputes the row
statistics from the scores (``recompute``), as the fixed-mask backward does, so it needs no
forward's ``out``/``lse`` and costs the same GEMMs. Results are the same to float32 rounding,
fully masked rows included. The mods carry the mask's ``neg`` and threshold, which come from the
``RuntimeConfig``; that is why this is a function of (graph, config) and not a named pass, and why
``rlx.compile`` runs it (``CodegenOptions(masks_as_mods=True)``) with the config it compiles for.

The default pipeline keeps the fixed-mask kernels because they are still faster: within noise
for causal masks (``benchmarks/masks_as_mods.py``), but 5-18% for bias, key padding and sliding
window masks in one interleaved run on the 2-core benchmark host. Block sparsity is not what is
lost: for a finite ``neg`` the mask is the score_mod ``where(hidden, neg, score)``, which codegen
skips tiles of as it does a mask_mod's (:func:`rlx.codegen.lower.map_mask`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlx.config import RuntimeConfig, resolve_config
from rlx.ir import OpKind
from rlx.ops.attention import mask_regions
from rlx.ops.flex_attention import FlexAttentionAttrs, FlexAttentionBwdAttrs

if TYPE_CHECKING:
    from rlx.ir import Graph, Node, Value


def masks_as_mods(graph: Graph, config: RuntimeConfig | None = None) -> bool:
    """Replace every ``attention`` / ``attention_bwd`` node of ``graph`` in place; True if any was."""
    config = resolve_config(config)
    nodes = [node for node in graph.nodes if node.op in (OpKind.ATTENTION, OpKind.ATTENTION_BWD)]
    for node in nodes:
        _rewrite(graph, node, config)
    return bool(nodes)


def _rewrite(graph: Graph, node: Node, config: RuntimeConfig) -> None:
    attrs = node.attrs
    backward = node.op is OpKind.ATTENTION_BWD
    fixed = 4 if backward else 3
    # A mask tensor (CUSTOM, BIAS) is what the regions read, as their captured tensor 0.
    captured: tuple[Value, ...] = tuple(node.inputs[fixed:])
    mask_type = captured[0].type if captured else None
    score_mod, mask_mod = mask_regions(attrs.mask, mask_type, config.attn_mask_neg_inf, config.mask_binary_threshold)
    if backward:
        bwd = FlexAttentionBwdAttrs(
            attrs.wrt, score_mod=score_mod, mask_mod=mask_mod, layout=attrs.layout, recompute=True
        )
        new = graph.add_node(OpKind.FLEX_ATTENTION_BWD, (*node.inputs[:4], *captured), bwd)
        results = new.outputs
    else:
        new = graph.add_node(
            OpKind.FLEX_ATTENTION,
            (*node.inputs[:3], *captured),
            FlexAttentionAttrs(score_mod, mask_mod, None, attrs.layout),
        )
        results = new.outputs[:1]  # out; the new lse output is unused
    for old, replacement in zip(node.outputs, results, strict=True):
        graph.replace_all_uses_with(old, replacement)
    graph.erase(node)
