"""rlx's programmable attention against torch's eager flex_attention (forward, out and LSE).

Optional: skipped when torch is not installed. torch's CPU flex_attention has no backward, so
the gradients are checked against SDPA with the mask materialised and against the reference
(tests/codegen/test_flex_attention.py) instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.torch

B, H, S, D = 2, 4, 40, 16
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
DOC = np.sort(np.random.default_rng(0).integers(0, 3, (B, S)), axis=1)


def torch_mods(name: str) -> tuple[Any, Any]:
    doc, table = torch.from_numpy(DOC), torch.from_numpy(SLOPES)
    masks = {
        "causal": lambda b, h, q, kv: q >= kv,
        "window": lambda b, h, q, kv: (q >= kv) & (kv >= q - 7),
        "document": lambda b, h, q, kv: doc[b, q] == doc[b, kv],
        "prefix": lambda b, h, q, kv: (kv < 5) | (q >= kv),
    }
    scores = {
        "softcap": lambda s, b, h, q, kv: 3.0 * torch.tanh(s / 3.0),
        "alibi": lambda s, b, h, q, kv: s + table[h] * (kv - q),
        "where": lambda s, b, h, q, kv: torch.where(q - kv > 4, s * 0.5, s),
    }
    mask_name, _, score_name = name.partition("+")
    return scores.get(score_name) or scores.get(mask_name), masks.get(mask_name)


def rlx_mods(name: str) -> dict[str, Any]:
    m = rlx.mods
    mask_name, _, score_name = name.partition("+")
    masks = {
        "causal": m.causal,
        "window": m.sliding_window(7),
        "document": m.document(DOC),
        "prefix": m.prefix_lm(5),
    }
    scores = {
        "softcap": m.softcap(3.0),
        "alibi": m.alibi(SLOPES),
        "where": lambda s, b, h, q, kv: rlx.where(q - kv > 4, s * 0.5, s),
    }
    found: dict[str, Any] = {}
    if mask_name in masks:
        found["mask_mod"] = masks[mask_name]
    score = scores.get(score_name) or scores.get(mask_name)
    if score is not None:
        found["score_mod"] = score
    return found


@pytest.mark.parametrize("name", ["causal", "window", "document", "prefix", "causal+softcap", "causal+alibi", "where"])
@pytest.mark.parametrize(("kv_heads", "value_dim"), [(4, 16), (2, 16), (1, 8)])
def test_forward_matches_torch_eager_flex(name: str, kv_heads: int, value_dim: int) -> None:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, H, S, D), dtype=np.float32)
    k = rng.standard_normal((B, kv_heads, S, D), dtype=np.float32)
    v = rng.standard_normal((B, kv_heads, S, value_dim), dtype=np.float32)
    score_mod, mask_mod = torch_mods(name)
    block_mask = None
    if mask_mod is not None:
        block_mask = flex.create_block_mask(mask_mod, B, H, S, S, device="cpu")
    want, want_lse = flex.flex_attention(
        *(torch.from_numpy(x) for x in (q, k, v)),
        score_mod=score_mod,
        block_mask=block_mask,
        enable_gqa=kv_heads != H,
        return_lse=True,
    )
    g = Graph()
    qi, ki, vi = g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape)
    out, lse = g.attention(qi, ki, vi, layout=Layout.BHSD, return_lse=True, **rlx_mods(name))
    g.output(out=out, lse=lse)
    got = rlx.compile(g)(q=q, k=k, v=v)
    np.testing.assert_allclose(got["out"], want.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["lse"], want_lse.numpy(), rtol=1e-4, atol=1e-5)


def test_gradients_match_sdpa_with_the_mask_materialised() -> None:
    rng = np.random.default_rng(2)
    arrays = {n: rng.standard_normal((B, H, S, D), dtype=np.float32) for n in ("q", "k", "v", "dy")}
    g = Graph()
    q, k, v, dy = (g.input(n, (B, H, S, D)) for n in ("q", "k", "v", "dy"))
    out = g.attention(q, k, v, layout=Layout.BHSD, mask_mod=rlx.mods.document(DOC))
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    got = rlx.compile(g)(**arrays)
    leaves = [torch.from_numpy(arrays[n]).double().requires_grad_(True) for n in "qkv"]
    mask = torch.from_numpy(DOC[:, :, None] == DOC[:, None, :])[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask)
    ref.backward(torch.from_numpy(arrays["dy"]).double())
    np.testing.assert_allclose(got["out"], ref.detach().numpy(), rtol=1e-4, atol=1e-5)
    for name, leaf in zip(("dq", "dk", "dv"), leaves, strict=True):
        np.testing.assert_allclose(got[name], leaf.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=name)
