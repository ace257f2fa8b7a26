"""Whole models built with the public graph API: a pre-norm transformer block and a tiny char LM.

They are what ``rlx demo --lm`` trains and what ``benchmarks/block.py`` measures, and they show
the API at the size of a real model: every weight is a graph input, ``rlx.grad`` gives all the
gradients, and ``rlx.compile`` fuses the norms, the SwiGLU and the loss into loop nests around
the BLAS matmuls and the attention kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rlx.autodiff import grad
from rlx.ir.graph import Graph, Value
from rlx.ir.types import Dim, Layout, MaskKind

BLOCK_WEIGHTS = ("attn_norm", "wqkv", "wo", "mlp_norm", "w1", "w3", "w2")
"""The seven weights of a block, in the order :func:`block_weight_shapes` lists them."""


def mlp_hidden(embed: int) -> int:
    """SwiGLU hidden size: 8E/3 rounded up to a multiple of 64 (as Llama)."""
    return -(-(8 * embed // 3) // 64) * 64


def block_weight_shapes(embed: int, hidden: int | None = None) -> dict[str, tuple[int, ...]]:
    hidden = hidden or mlp_hidden(embed)
    return {
        "attn_norm": (embed,),
        "wqkv": (embed, 3 * embed),
        "wo": (embed, embed),
        "mlp_norm": (embed,),
        "w1": (embed, hidden),
        "w3": (embed, hidden),
        "w2": (hidden, embed),
    }


def transformer_block(g: Graph, x: Value, heads: int, prefix: str = "", hidden: int | None = None) -> Value:
    """``h = x + attn(rms_norm(x)) Wo``; ``y = h + (silu(n W1) * (n W3)) W2`` with ``n = rms_norm(h)``.

    ``x`` is ``[B, S, E]``; the weights are graph inputs named ``prefix + name`` for each name of
    :data:`BLOCK_WEIGHTS`. Attention is causal over ``heads`` heads of size ``E / heads``.
    """
    batch, seq, embed = x.shape
    if not isinstance(embed, int) or embed % heads:
        raise ValueError(f"transformer_block: embed {embed} is not a multiple of heads {heads}")
    w = {name: g.input(prefix + name, shape) for name, shape in block_weight_shapes(embed, hidden).items()}
    head_shape = (batch, seq, heads, embed // heads)
    q, k, v = g.split(g.rms_norm(x, w["attn_norm"]) @ w["wqkv"], 3, axis=-1)
    att = g.attention(*(g.reshape(t, head_shape) for t in (q, k, v)), mask=MaskKind.CAUSAL, layout=Layout.BSHD)
    h = x + g.reshape(att, (batch, seq, embed)) @ w["wo"]
    n = g.rms_norm(h, w["mlp_norm"])
    return h + (g.silu(n @ w["w1"]) * (n @ w["w3"])) @ w["w2"]


def block_training_graph(batch: Dim, seq: Dim, embed: int, heads: int) -> Graph:
    """The block on ``x [B, S, E]`` with loss ``mean(y*y)`` and its gradients w.r.t. x and the seven
    weights: outputs ``loss`` and ``d_<name>`` (what ``benchmarks/block.py`` measures)."""
    g = Graph("block")
    x = g.input("x", (batch, seq, embed))
    y = transformer_block(g, x, heads)
    loss = g.mean(y * y)
    names = ["x", *BLOCK_WEIGHTS]
    grads = grad(g, loss, [g.inputs[name] for name in names])
    g.output(loss=loss, **{f"d_{name}": d for name, d in zip(names, grads, strict=True)})
    return g


@dataclass(frozen=True)
class LMConfig:
    vocab: int
    seq: int
    batch: int
    embed: int = 64
    heads: int = 4
    layers: int = 2


def char_lm_logits(config: LMConfig, batch: int | None = None) -> tuple[Graph, Value]:
    """Embedding, ``layers`` blocks, final norm and LM head: ``(graph, logits [B, S, vocab])``.

    Inputs: ``tokens`` (int32 ``[B, S]``) and the parameters (float32), named as
    :func:`init_params` names them.
    """
    batch = config.batch if batch is None else batch
    g = Graph("char_lm")
    tokens = g.input("tokens", (batch, config.seq), "int32")
    table = g.input("embed", (config.vocab, config.embed))
    position = g.input("position", (config.seq, config.embed))
    x = g.embedding(table, tokens) + position
    for layer in range(config.layers):
        x = transformer_block(g, x, config.heads, prefix=f"l{layer}.")
    logits = g.rms_norm(x, g.input("final_norm", (config.embed,))) @ g.input("head", (config.embed, config.vocab))
    return g, logits


def char_lm(config: LMConfig) -> tuple[Graph, Value, list[Value]]:
    """The LM with its mean cross-entropy against ``targets`` (int32 ``[B, S]``): ``(graph, loss, params)``."""
    g, logits = char_lm_logits(config)
    targets = g.input("targets", (config.batch, config.seq), "int32")
    loss = g.cross_entropy(logits, targets)
    params = [value for name, value in g.inputs.items() if name not in ("tokens", "targets")]
    return g, loss, params


def init_params(graph: Graph, params: list[Value], seed: int = 0) -> dict[str, np.ndarray]:
    """Norm weights 1, matrices N(0, 1/fan_in) (embeddings N(0, 0.02)): a stable start for training."""
    rng = np.random.default_rng(seed)
    values = {}
    for value in params:
        name = value.node.attrs.name
        shape = value.static_shape
        if name.endswith("norm"):
            values[name] = np.ones(shape, np.float32)
        elif name in ("embed", "position"):
            values[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        else:
            scale = 1.0 / math.sqrt(shape[0])
            if name.endswith(("wo", "w2")):
                scale /= math.sqrt(2 * max(1, sum(1 for p in params if p.node.attrs.name.endswith("wo"))))
            values[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return values
