"""rlx.torch SDPA on the views a model's projections make, read in place.

A fused projection split into q, k and v (``qkv.split(E, dim=2)``, or ``qkv.view(B, S, 3, H,
D).unbind(2)``) and separate projections viewed as heads (``x.view(B, S, H, D).transpose(1,
2)``) give strided ``[B, H, S, D]`` views. The fixed-mask kernels read them in place (a
``"qkv"`` or ``"bshd"`` plan) and return ``out`` and the gradients as torch's own kernel does
for such inputs: transposes of ``[B, S, H, D]`` tensors. Every case is compared with torch's
SDPA, forward and backward; views the kernels cannot read in place are copied as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
rt = pytest.importorskip("rlx.torch")
sdpa = pytest.importorskip("rlx.torch.sdpa")
F = torch.nn.functional

B, S, H, D = 2, 37, 4, 16
Make = Callable[[], tuple[list[Any], Callable[..., list[Any]]]]


def _fused_split() -> tuple[list[Any], Callable[..., list[Any]]]:
    leaves = [torch.randn(B, S, 3 * H * D)]
    return leaves, lambda x: [p.view(B, S, H, D).transpose(1, 2) for p in x.split(H * D, dim=2)]


def _fused_unbind() -> tuple[list[Any], Callable[..., list[Any]]]:
    leaves = [torch.randn(B, S, 3, H, D)]
    return leaves, lambda x: [part.transpose(1, 2) for part in x.unbind(2)]


def _separate() -> tuple[list[Any], Callable[..., list[Any]]]:
    leaves = [torch.randn(B, S, H * D) for _ in range(3)]
    return leaves, lambda *xs: [x.view(B, S, H, D).transpose(1, 2) for x in xs]


def _swapped() -> tuple[list[Any], Callable[..., list[Any]]]:
    """A fused projection whose slices come in another order: not the pattern, so copied."""
    leaves = [torch.randn(B, S, 3 * H * D)]
    return leaves, lambda x: [p.view(B, S, H, D).transpose(1, 2) for p in reversed(x.split(H * D, dim=2))]


def _run(fn: Callable[..., Any], make: Make, is_causal: bool, scale: float | None) -> tuple[Any, Any, list[Any]]:
    torch.manual_seed(0)
    leaves, views = make()
    leaves = [leaf.requires_grad_(True) for leaf in leaves]
    q, k, v = views(*leaves)
    out = fn(q, k, v, is_causal=is_causal, scale=scale)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * grad).sum().backward()
    return out.detach(), out.stride(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize(
    ("make", "layout"), [(_fused_split, "qkv"), (_fused_unbind, "qkv"), (_separate, "bshd"), (_swapped, "bhsd")]
)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_projection_views_match_torch(make: Make, layout: str, is_causal: bool, scale: float | None) -> None:
    leaves, views = make()
    assert sdpa._strided_layout(*views(*leaves)) == layout
    got, got_stride, got_grads = _run(rt.scaled_dot_product_attention, make, is_causal, scale)
    want, want_stride, want_grads = _run(F.scaled_dot_product_attention, make, is_causal, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    for mine, theirs in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=2e-6)
    if layout != "bhsd":  # out strided as torch's kernel strides it: a transpose of [B, S, H, D]
        assert got_stride == want_stride


def test_the_fused_pattern_needs_one_storage_and_exact_offsets() -> None:
    """Slices that only look like a fused projection (other strides, other offsets, a copy)
    are copied as before."""
    x = torch.randn(B, S, 3 * H * D)
    q, k, v = (p.view(B, S, H, D).transpose(1, 2) for p in x.split(H * D, dim=2))
    assert sdpa._strided_layout(q, k, v) == "qkv"
    assert sdpa._strided_layout(q, k.clone(), v) == "bhsd"  # another storage, not BSHD-contiguous
    assert sdpa._strided_layout(q, v, k) == "bhsd"
    assert sdpa._strided_layout(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:]) == "bhsd"
    half = [t.half() for t in (q, k, v)]
    assert sdpa._strided_layout(*half) == "bhsd"
    contiguous = [t.contiguous() for t in (q, k, v)]
    assert sdpa._strided_layout(*contiguous) == "bhsd"
    torch.testing.assert_close(
        rt.scaled_dot_product_attention(q, k, v, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        rtol=1e-5,
        atol=2e-6,
    )


def test_the_inputs_are_read_in_place() -> None:
    """A ``"qkv"`` or ``"bshd"`` call copies none of q, k, v: torch's copy kernels never run."""
    for make in (_fused_split, _separate):
        leaves, views = make()
        q, k, v = views(*leaves)
        rt.scaled_dot_product_attention(q, k, v)  # compile first
        with torch.profiler.profile() as prof:
            rt.scaled_dot_product_attention(q, k, v)
        names = {event.name for event in prof.events()}
        assert not names & {"aten::contiguous", "aten::clone", "aten::copy_"}, names


def test_gqa_and_other_value_widths_still_work_from_bshd_views() -> None:
    """Separate projections with fewer key heads (GQA) and another value width: a "bshd" plan."""
    xq, xk, xv = torch.randn(B, S, 8 * D), torch.randn(B, S, 2 * D), torch.randn(B, S, 2 * 24)
    leaves = [t.requires_grad_(True) for t in (xq, xk, xv)]
    q = leaves[0].view(B, S, 8, D).transpose(1, 2)
    k = leaves[1].view(B, S, 2, D).transpose(1, 2)
    v = leaves[2].view(B, S, 2, 24).transpose(1, 2)
    assert sdpa._strided_layout(q, k, v) == "bshd"
    out = rt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)
    got = torch.autograd.grad(out.square().sum(), leaves)
    expected = torch.autograd.grad(want.square().sum(), leaves)
    for mine, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_the_fused_pattern_compiles_once_for_every_length() -> None:
    """The fused projection's plan has a symbolic batch and length, as the other SDPA plans do:
    after the first size, no call compiles anything."""
    from rlx.codegen.executable import compile_count

    compiled = None
    for batch, seq in ((2, 5), (3, 40), (1, 130)):
        x = torch.randn(batch, seq, 3 * H * D, requires_grad=True)
        q, k, v = (p.view(batch, seq, H, D).transpose(1, 2) for p in x.split(H * D, dim=2))
        assert sdpa._strided_layout(q, k, v) == "qkv"
        out = rt.scaled_dot_product_attention(q, k, v, is_causal=True)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        compiled = compile_count() if compiled is None else compiled
        assert compile_count() == compiled, (batch, seq)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (want_grad,) = torch.autograd.grad(want.square().sum(), x)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5)


def test_a_program_that_declines_addresses_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where an executable would not take memory by address, the strided plans hand it NumPy
    views of the same tensors (no copy either) and give the same results."""
    from rlx.codegen.executable import Executable

    for make in (_fused_split, _separate):
        want, want_stride, want_grads = _run(rt.scaled_dot_product_attention, make, True, None)
        with monkeypatch.context() as patched:
            patched.setattr(Executable, "run_direct", lambda *args, **kwargs: False)
            got, got_stride, got_grads = _run(rt.scaled_dot_product_attention, make, True, None)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got_stride == want_stride
        for mine, theirs in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
