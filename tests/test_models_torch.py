"""The transformer block's loss and gradients against the same block in torch (torch autograd).

Optional: skipped when torch is not installed. This is the independent implementation of the
block: torch's own RMS norm formula, SDPA and SiLU, differentiated by torch.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_models import block_graph, block_inputs

import rlx
from rlx.models import BLOCK_WEIGHTS

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch


def torch_block_loss(x, w, heads: int):  # type: ignore[no-untyped-def]
    def rms(t, weight):  # type: ignore[no-untyped-def]
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    batch, seq, embed = x.shape
    q, k, v = (rms(x, w["attn_norm"]) @ w["wqkv"]).split(embed, dim=-1)
    heads_view = [t.reshape(batch, seq, heads, embed // heads).transpose(1, 2) for t in (q, k, v)]
    att = torch.nn.functional.scaled_dot_product_attention(*heads_view, is_causal=True)
    h = x + att.transpose(1, 2).reshape(batch, seq, embed) @ w["wo"]
    n = rms(h, w["mlp_norm"])
    y = h + (torch.nn.functional.silu(n @ w["w1"]) * (n @ w["w3"])) @ w["w2"]
    return (y * y).mean()


@pytest.mark.parametrize(("batch", "seq", "embed", "heads"), [(2, 32, 64, 4), (1, 9, 48, 3)])
def test_block_matches_torch_autograd(batch: int, seq: int, embed: int, heads: int) -> None:
    g = block_graph(batch, seq, embed, heads)
    arrays = block_inputs(g, 5)
    got = rlx.compile(g)(**arrays)
    tensors = {name: torch.tensor(a, dtype=torch.float64, requires_grad=True) for name, a in arrays.items()}
    loss = torch_block_loss(tensors["x"], tensors, heads)
    loss.backward()
    assert float(got["loss"]) == pytest.approx(float(loss.detach()), rel=1e-5)
    for name in ["x", *BLOCK_WEIGHTS]:
        want = tensors[name].grad.numpy()
        np.testing.assert_allclose(got[f"d_{name}"], want, rtol=2e-4, atol=2e-5 * float(np.max(np.abs(want))),
                                   err_msg=name)
