"""rlx.torch flex_attention on the views a model's projections make, read in place.

As for SDPA (tests/test_torch_strided_sdpa.py): q, k and v split from one fused projection, or
separate projections viewed as heads, run on graphs that take the projections' memory (a
``"qkv"`` or ``"bshd"`` layout) instead of copies, and ``out`` and the gradients come back as
transposes of ``[B, S, H, D]`` tensors. Results are compared with a float64 torch formula
(score_mod, mask as -inf, softmax, weighted values) through torch's autograd: torch's CPU
flex_attention has no backward. A score_mod's captured tensor gets its gradient too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
rt = pytest.importorskip("rlx.torch")
layouts = pytest.importorskip("rlx.torch._layouts")

B, S, H, D = 2, 37, 4, 16
Views = Callable[..., list[Any]]


def _fused(heads: int = H, kv_heads: int = H) -> tuple[list[Any], Views]:
    assert heads == kv_heads
    return [torch.randn(B, S, 3 * H * D)], lambda x: [p.view(B, S, H, D).transpose(1, 2) for p in x.split(H * D, 2)]


def _separate(heads: int = H, kv_heads: int = H) -> tuple[list[Any], Views]:
    leaves = [torch.randn(B, S, heads * D), torch.randn(B, S, kv_heads * D), torch.randn(B, S, kv_heads * 24)]

    def views(xq: Any, xk: Any, xv: Any) -> list[Any]:
        return [
            xq.view(B, S, heads, D).transpose(1, 2),
            xk.view(B, S, kv_heads, D).transpose(1, 2),
            xv.view(B, S, kv_heads, 24).transpose(1, 2),
        ]

    return leaves, views


def _formula(q: Any, k: Any, v: Any, score_mod: Any, mask_mod: Any, bias: Any) -> Any:
    """flex_attention in float64 torch ops: what rlx must compute (top-left indices, -inf
    where the mask is False, GQA by repeating the kv heads)."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in scores.shape), indexing="ij")
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j) + (0 if bias is None else bias.double()[b, h, i, j])
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(b, h, i, j), -math.inf)
    return torch.softmax(scores, -1) @ v


def _causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return q >= kv


def _window(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return (q >= kv) & (kv >= q - 5)


def _softcap(s: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return 4.0 * torch.tanh(s / 4.0)


@pytest.mark.parametrize(("make", "layout"), [(_fused, "qkv"), (_separate, "bshd")])
@pytest.mark.parametrize("mods", ["causal", "window+softcap", "softcap+bias"])
def test_projection_views_match_the_formula(make: Callable[..., Any], layout: str, mods: str) -> None:
    torch.manual_seed(0)
    leaves, views = make()
    leaves = [leaf.requires_grad_(True) for leaf in leaves]
    q, k, v = views(*leaves)
    assert layouts._strided_layout(q, k, v) == layout
    mask_mod = {"causal": _causal, "window+softcap": _window}.get(mods)
    bias = torch.randn(B, H, S, S, requires_grad=True) if "bias" in mods else None
    score_mod = _softcap if "softcap" in mods else None
    if bias is not None:
        score_mod = lambda s, b, h, q_idx, kv_idx: _softcap(s, b, h, q_idx, kv_idx) + bias[b, h, q_idx, kv_idx]  # noqa: E731
    out = rt.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    want = _formula(q, k, v, _softcap if "softcap" in mods else None, mask_mod, bias)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
    assert out.stride() == out.transpose(1, 2).contiguous().transpose(1, 2).stride()  # [B, S, H, Dv] memory
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    wrt = leaves + ([bias] if bias is not None else [])
    got = torch.autograd.grad((out * grad).sum(), wrt)
    expected = torch.autograd.grad((want * grad.double()).sum(), wrt)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_gqa_other_value_width_and_lse_from_bshd_views() -> None:
    torch.manual_seed(2)
    leaves, views = _separate(heads=8, kv_heads=2)
    leaves = [leaf.requires_grad_(True) for leaf in leaves]
    q, k, v = views(*leaves)
    assert layouts._strided_layout(q, k, v) == "bshd"
    out, lse = rt.flex_attention(q, k, v, mask_mod=_causal, enable_gqa=True, return_lse=True)
    want = _formula(q, k, v, None, _causal, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
    scores = q.double() @ k.double().repeat_interleave(4, 1).transpose(-1, -2) / math.sqrt(D)
    hidden = torch.ones(S, S, dtype=torch.bool).triu(1)
    want_lse = torch.logsumexp(scores.masked_fill(hidden, -math.inf), -1)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=2e-6)  # float32 lse
    got = torch.autograd.grad(out.square().sum() + lse.sum(), leaves)
    wanted_lse = torch.logsumexp(scores.masked_fill(hidden, -math.inf), -1)
    expected = torch.autograd.grad(want.square().sum() + wanted_lse.sum(), leaves)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_the_views_are_read_in_place_and_compile_once() -> None:
    """No copy kernel runs for a fused projection's views, and new lengths compile nothing."""
    from rlx.codegen.executable import compile_count

    compiled = None
    for batch, seq in ((2, 5), (3, 40), (1, 130)):
        x = torch.randn(batch, seq, 3 * H * D, requires_grad=True)
        q, k, v = (p.view(batch, seq, H, D).transpose(1, 2) for p in x.split(H * D, dim=2))
        out = rt.flex_attention(q, k, v, mask_mod=_causal)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        torch.testing.assert_close(
            grad,
            torch.autograd.grad(_formula(q, k, v, None, _causal, None).square().sum(), x)[0],
            rtol=1e-4,
            atol=1e-5,
        )
        compiled = compile_count() if compiled is None else compiled
        assert compile_count() == compiled, (batch, seq)
    with torch.profiler.profile() as prof:
        rt.flex_attention(q, k, v, mask_mod=_causal)
    names = {event.name for event in prof.events()}
    assert not names & {"aten::contiguous", "aten::clone", "aten::copy_"}, names
