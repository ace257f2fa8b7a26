"""Hand-written graphs shared by the IR tests: small shapes, every mask kind and both layouts."""

from __future__ import annotations

from collections.abc import Callable

from rlx import Graph, Layout, MaskKind, Wrt

B, SQ, SK, H, D = 2, 5, 3, 2, 4


def spec_graph() -> Graph:
    """The SPEC section 2 example: causal forward plus one fused backward, BSHD."""
    g = Graph("attn")
    q = g.input("q", (B, SQ, H, D))
    k = g.input("k", (B, SK, H, D))
    v = g.input("v", (B, SK, H, D))
    dy = g.input("dy", (B, SQ, H, D))
    o = g.attention(q, k, v, mask=MaskKind.CAUSAL)
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=MaskKind.CAUSAL)
    g.output(o=o, dq=dq, dk=dk, dv=dv)
    return g


def bhsd_masks_graph() -> Graph:
    """BHSD with custom, bias and sliding-window masks, single and paired wrt, positional outputs."""
    g = Graph("bhsd.masks")
    q = g.input("q", (B, H, SQ, D))
    k = g.input("k", (B, H, SK, D))
    v = g.input("v", (B, H, SK, D))
    dy = g.input("dy", (B, H, SQ, D))
    pad = g.input("pad", (B, SK))
    bias = g.input("bias", (B, H, SQ, SK))
    bhsd = Layout.BHSD
    o = g.attention(q, k, v, mask=MaskKind.CUSTOM, layout=bhsd, mask_input=pad)
    dq = g.attention_bwd(q, k, v, dy, wrt=Wrt.QUERY, mask=MaskKind.sliding_window(2), layout=bhsd)
    dk, dv = g.attention_bwd(q, k, v, o, wrt=Wrt.KEY | Wrt.VALUE, mask=MaskKind.BIAS, layout=bhsd, mask_input=bias)
    g.output(o, dq)
    g.output(dk=dk, dv=dv)
    return g


def chained_graph() -> Graph:
    """Self-attention whose output feeds the next layer's q, k and v; no-mask and window-0 masks."""
    g = Graph("chain")
    x = g.input("x", (1, 4, 1, 8))
    dy = g.input("dy", (1, 4, 1, 8))
    h1 = g.attention(x, x, x)
    h2 = g.attention(h1, h1, h1, mask=MaskKind.sliding_window(0))
    dv = g.attention_bwd(h1, h1, h1, dy, wrt=Wrt.VALUE, mask=MaskKind.NONE)
    g.output(h2=h2, dv=dv, x=x)
    return g


def odd_inputs_graph() -> Graph:
    """Inputs of other dtypes and a scalar, dotted names, no nodes but inputs and no outputs."""
    g = Graph("inputs_only")
    g.input("scale", ())
    g.input("ids.i32", (7,), dtype="int32")
    g.input("w64", (2, 3), dtype="float64")
    g.input("keep", (1,), dtype="bool")
    return g


def empty_graph() -> Graph:
    return Graph("empty")


HAND_WRITTEN: dict[str, Callable[[], Graph]] = {
    "spec": spec_graph,
    "bhsd_masks": bhsd_masks_graph,
    "chained": chained_graph,
    "odd_inputs": odd_inputs_graph,
    "empty": empty_graph,
}
