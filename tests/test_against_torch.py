"""Compiled rlx gradients against PyTorch's SDPA backward: an oracle written by someone else.

Optional: skipped when torch is not installed (CI does not install it). torch's ``is_causal`` is
top-left aligned when Sq != Sk, so masks are passed to torch as explicit boolean / additive
``attn_mask`` tensors built from SPEC's bottom-right rule.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph, Layout, MaskKind, Wrt

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

B, H, D = 2, 3, 16


def visible(mask: MaskKind, sq: int, sk: int, pad: np.ndarray | None) -> np.ndarray:
    """``[B, 1, Sq, Sk]`` True where a query may attend a key (SPEC section 1)."""
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    offset = max(sk - sq, 0)
    keep = np.ones((sq, sk), dtype=bool)
    if mask.is_causal_like:
        keep &= j <= offset + i
    if mask.window is not None:
        keep &= j >= offset + i - mask.window
    keep = np.broadcast_to(keep, (B, 1, sq, sk))
    if pad is not None:
        keep = keep & (pad >= 0.5)[:, None, None, :]
    return np.ascontiguousarray(keep)


@pytest.mark.parametrize("layout", list(Layout), ids=str)
@pytest.mark.parametrize(("sq", "sk"), [(24, 24), (9, 30), (30, 9)])
@pytest.mark.parametrize(
    "mask", [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(4), MaskKind.CUSTOM, MaskKind.BIAS], ids=str
)
def test_fused_gradients_match_torch(mask: MaskKind, sq: int, sk: int, layout: Layout) -> None:
    rng = np.random.default_rng(sq * 100 + sk)
    g = Graph("vs_torch")
    q, dy = (g.input(name, layout.join(B, sq, H, D)) for name in ("q", "dy"))
    k, v = (g.input(name, layout.join(B, sk, H, D)) for name in ("k", "v"))
    arrays = {name: rng.standard_normal(value.shape, dtype=np.float32) for name, value in g.inputs.items()}
    mask_input, pad, bias = None, None, None
    if mask == MaskKind.CUSTOM:
        mask_input = g.input("pad", (B, sk))
        pad = (rng.random((B, sk)) > 0.3).astype(np.float32)
        pad[:, 0] = 1.0  # torch gives NaN for rows with no visible key; SPEC does not
        arrays["pad"] = pad
    elif mask == MaskKind.BIAS:
        mask_input = g.input("bias", (B, H, sq, sk))
        bias = rng.standard_normal((B, H, sq, sk), dtype=np.float32)
        arrays["bias"] = bias
    if mask.window is not None and sq > sk + mask.window:
        pytest.skip("rows with no visible key: torch gives NaN, SPEC a uniform row")
    out = g.attention(q, k, v, mask=mask, layout=layout, mask_input=mask_input)
    dq, dk, dv = g.attention_bwd(q, k, v, dy, wrt=Wrt.ALL, mask=mask, layout=layout, mask_input=mask_input)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    got = rlx.compile(g)(**arrays)

    def to_bhsd(name: str) -> torch.Tensor:
        tensor = torch.from_numpy(arrays[name].astype(np.float64))
        return tensor.transpose(1, 2) if layout is Layout.BSHD else tensor

    tq, tk, tv = (to_bhsd(name).requires_grad_() for name in ("q", "k", "v"))
    if mask == MaskKind.BIAS:
        attn_mask = torch.from_numpy(bias.astype(np.float64))
    elif mask != MaskKind.NONE:
        attn_mask = torch.from_numpy(visible(mask, sq, sk, pad))
    else:
        attn_mask = None
    t_out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=attn_mask)
    t_out.backward(to_bhsd("dy"))
    expected = {"out": t_out.detach(), "dq": tq.grad, "dk": tk.grad, "dv": tv.grad}
    for name, tensor in expected.items():
        reference = tensor.transpose(1, 2) if layout is Layout.BSHD else tensor
        np.testing.assert_allclose(got[name], reference.numpy(), rtol=1e-4, atol=2e-5, err_msg=name)
