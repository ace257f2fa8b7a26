"""rlx.torch: drop-in SDPA and flex_attention with autograd, and rlx graphs as torch functions.

Optional: skipped when torch is not installed. References are torch's own SDPA and eager
flex_attention, gradients against float64 torch autograd and a float32 finite-difference check.
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlx
from rlx import Graph

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
rt = pytest.importorskip("rlx.torch")
F = torch.nn.functional


def qkv(
    b: int = 2,
    h: int = 4,
    sq: int = 29,
    sk: int = 29,
    d: int = 16,
    hkv: int | None = None,
    dv: int | None = None,
    seed: int = 0,
) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, h, sq, d), (b, hkv or h, sk, d), (b, hkv or h, sk, dv or d)]
    return [torch.randn(s, generator=gen).requires_grad_(True) for s in shapes]


def grads_of(fn: Any, tensors: list[Any], dy: Any) -> tuple[Any, list[Any]]:
    out = fn(*tensors)
    return out.detach(), list(torch.autograd.grad(out, tensors, dy))


def double_reference(fn: Any, tensors: list[Any], dy: Any) -> tuple[Any, list[Any]]:
    doubles = [t.detach().double().requires_grad_(True) for t in tensors]
    out = fn(*doubles)
    return out.detach(), list(torch.autograd.grad(out, doubles, dy.double()))


def assert_close(got: Any, want: Any, tol: float = 2e-5) -> None:
    np.testing.assert_allclose(got.detach().double().numpy(), want.detach().double().numpy(), rtol=tol * 10, atol=tol)


SDPA_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.2},
    "bool-mask-2d": {"attn_mask": "bool2d"},
    "bool-mask-4d": {"attn_mask": "bool4d"},
    "float-mask": {"attn_mask": "float"},
    "causal-and-bool-mask": {"attn_mask": "bool2d", "is_causal": True},
    "causal-and-float-mask": {"attn_mask": "float", "is_causal": True},
}


def _explicit_causal(kwargs: dict[str, Any], sq: int, sk: int) -> dict[str, Any]:
    """torch's ``attn_mask`` with ``is_causal`` as one explicit mask: the mask, and top-left causal
    (what torch computes when given both), so the reference does not depend on torch's version."""
    if not (kwargs.get("is_causal") and isinstance(kwargs.get("attn_mask"), torch.Tensor)):
        return kwargs
    mask, visible = kwargs["attn_mask"], torch.ones(sq, sk, dtype=torch.bool).tril()
    combined = mask & visible if mask.dtype == torch.bool else mask.masked_fill(~visible, float("-inf"))
    return {**{k: v for k, v in kwargs.items() if k != "is_causal"}, "attn_mask": combined}


def _mask(kind: str, b: int, h: int, sq: int, sk: int) -> Any:
    gen = torch.Generator().manual_seed(3)
    if kind == "bool2d":
        mask = torch.rand(sq, sk, generator=gen) > 0.3
        mask[:, 0] = True  # keep every row attending somewhere (torch gives NaN for empty rows)
        return mask
    if kind == "bool4d":
        mask = torch.rand(b, 1, sq, sk, generator=gen) > 0.5
        mask[..., 0] = True
        return mask
    return torch.randn(1, h, sq, sk, generator=gen)


@pytest.mark.parametrize("name", list(SDPA_CASES))
@pytest.mark.parametrize(("sq", "sk"), [(29, 29), (7, 40)])
def test_sdpa_matches_torch(name: str, sq: int, sk: int) -> None:
    kwargs = dict(SDPA_CASES[name])
    if isinstance(kwargs.get("attn_mask"), str):
        kwargs["attn_mask"] = _mask(kwargs["attn_mask"], 2, 4, sq, sk)
    tensors = qkv(sq=sq, sk=sk)
    dy = torch.randn(2, 4, sq, 16)
    got, got_grads = grads_of(lambda q, k, v: rt.scaled_dot_product_attention(q, k, v, **kwargs), tensors, dy)
    ref_kwargs = {
        k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in _explicit_causal(kwargs, sq, sk).items()
    }
    want, want_grads = double_reference(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **ref_kwargs), tensors, dy
    )
    assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_close(g, w)


def test_sdpa_gqa_and_value_dim() -> None:
    tensors = qkv(h=4, hkv=2, dv=8)
    dy = torch.randn(2, 4, 29, 8)
    got, got_grads = grads_of(
        lambda q, k, v: rt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), tensors, dy
    )
    want, want_grads = double_reference(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), tensors, dy
    )
    assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_close(g, w)
    with pytest.raises(rlx.RlxValueError, match="enable_gqa"):
        rt.scaled_dot_product_attention(*tensors)


def _rand(*shape: int, seed: int = 0) -> Any:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "mask_shape"),
    [
        ((9, 8), (11, 8), (11, 6), None),  # no batch or head dims
        ((3, 9, 8), (3, 11, 8), (3, 11, 8), (9, 11)),  # [H, S, D]
        ((2, 3, 4, 9, 8), (2, 3, 4, 11, 8), (2, 3, 4, 11, 8), None),  # two batch dims
        ((2, 3, 4, 9, 8), (1, 3, 4, 11, 8), (3, 4, 11, 8), (2, 1, 1, 9, 11)),  # batch dims that broadcast
        ((3, 4, 9, 8), (1, 4, 11, 8), (1, 4, 11, 8), (3, 1, 9, 11)),  # a key batch of 1
        ((2, 4, 9, 8), (2, 1, 11, 8), (2, 1, 11, 8), None),  # a single key head broadcasts
    ],
)
def test_sdpa_takes_the_shapes_torch_takes(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...], mask_shape: tuple[int, ...] | None
) -> None:
    tensors = [_rand(*s, seed=i) for i, s in enumerate((q_shape, k_shape, v_shape))]
    kwargs: dict[str, Any] = {}
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(7)) > 0.4
        mask[..., 0] = True
        kwargs["attn_mask"] = mask
    out = rt.scaled_dot_product_attention(*tensors, **kwargs)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    got_grads = torch.autograd.grad(out, tensors, dy)
    want, want_grads = double_reference(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs), tensors, dy)
    assert out.shape == want.shape
    assert_close(out, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.shape == w.shape
        assert_close(g, w)


@pytest.mark.parametrize(("sq", "sk"), [(0, 5), (5, 0)])
def test_sdpa_with_no_queries_or_no_keys_is_torchs_result(sq: int, sk: int) -> None:
    q, k, v = _rand(2, 3, sq, 8), _rand(2, 3, sk, 8, seed=1), _rand(2, 3, sk, 4, seed=2)
    out = rt.scaled_dot_product_attention(q, k, v)
    want = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach())
    assert out.shape == want.shape == (2, 3, sq, 4)
    assert torch.equal(out.detach(), want)  # no keys: zeros, as torch
    grads = torch.autograd.grad(out.sum(), [q, k, v], allow_unused=True)
    assert all(g is None or not g.any() for g in grads)


def test_sdpa_masks_of_one_element_are_read_every_call() -> None:
    """A mask whose every dim is 1 applies one value to all scores. SDPA's traced plans are reused
    for every mask of a shape, so the value must be read per call, not baked into the trace."""
    q, k, v = (t.detach() for t in qkv(sq=5, sk=7))
    for value in (True, False, True):
        mask = torch.full((1, 1), value)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert_close(rt.scaled_dot_product_attention(q, k, v, attn_mask=mask), torch.nan_to_num(want))
    for value in (0.5, -3.0):
        mask = torch.full((1, 1, 1, 1), value)
        assert_close(
            rt.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        )


def test_float_mask_gets_its_gradient() -> None:
    q, k, v = qkv()
    bias = torch.randn(1, 4, 29, 29, requires_grad=True)
    out = rt.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    (grad,) = torch.autograd.grad(out.sum(), [bias])
    ref_bias = bias.detach().double().requires_grad_(True)
    ref = F.scaled_dot_product_attention(*(t.detach().double() for t in (q, k, v)), attn_mask=ref_bias)
    (want,) = torch.autograd.grad(ref.sum(), [ref_bias])
    assert_close(grad, want)


def test_flex_matches_torch_eager_flex_and_differentiates() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = qkv(h=4, hkv=2)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    doc = torch.tensor([[0] * 10 + [1] * 19, [0] * 29])

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return 20 * torch.tanh((score + slopes[h] * (kv_idx - q_idx)) / 20)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    out, lse = rt.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=True, return_lse=True)
    block_mask = create_block_mask(mask_mod, 2, None, 29, 29, device="cpu")
    with torch.no_grad():
        want, want_lse = flex_attention(
            q.detach(),
            k.detach(),
            v.detach(),
            score_mod=score_mod,
            block_mask=block_mask,
            enable_gqa=True,
            return_lse=True,
        )
    assert_close(out, want)
    assert_close(lse, want_lse)
    # The same through a BlockMask argument.
    assert_close(rt.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True), want)
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, [q, k, v, slopes], dy)
    # float64 reference with the mask and bias materialised (torch's CPU flex has no backward).
    i = torch.arange(29)
    visible = (i[:, None] >= i[None, :]) & (doc[:, :, None] == doc[:, None, :])
    doubles = [t.detach().double().requires_grad_(True) for t in (q, k, v, slopes)]
    qd, kd, vd, sd = doubles
    kd, vd = kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1)
    scores = qd @ kd.transpose(-1, -2) / 4.0 + sd[:, None, None] * (i[None, :] - i[:, None])
    scores = (20 * torch.tanh(scores / 20)).masked_fill(~visible[:, None], float("-inf"))
    ref = torch.softmax(scores, -1) @ vd
    want_grads = torch.autograd.grad(ref, doubles, dy.double())
    for g, w in zip(got, want_grads, strict=True):
        assert_close(g, w)


def test_flex_mods_with_powers_match_torch_flex() -> None:
    """``**``, ``torch.pow``, ``Tensor.pow`` and ``Tensor.log``/``sqrt`` inside mods, as torch traces them."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = (t.detach() for t in qkv())
    bias = torch.rand(4)

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        decay = torch.pow(2.0, -(h + 1.0)) * (q_idx - kv_idx) ** 2 * 0.01
        squashed = (score.abs() + 1).log() + torch.pow(score, 2) * 0.1 + (score.abs() + 1).sqrt()
        return squashed - decay + bias[h].pow(3)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return -q_idx <= -kv_idx

    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(mask_mod, None, None, 29, 29, device="cpu")
    want = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    assert_close(rt.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod), want)


def test_flex_takes_torchs_positional_block_mask_kernel_options_and_return_aux() -> None:
    from torch.nn.attention import flex_attention as torch_flex

    q, k, v = qkv()
    block_mask = torch_flex.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 29, 29, device="cpu")
    want, want_lse = rt.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    # torch's signature: (query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options)
    assert_close(rt.flex_attention(q, k, v, None, block_mask, None, False, False, {"BLOCK_M": 16}), want)
    if not hasattr(torch_flex, "AuxRequest"):
        return
    out, aux = rt.flex_attention(q, k, v, block_mask=block_mask, return_aux=torch_flex.AuxRequest(lse=True))
    assert isinstance(aux, torch_flex.AuxOutput) and aux.max_scores is None
    assert_close(out, want)
    assert_close(aux.lse, want_lse)
    (grad,) = torch.autograd.grad(aux.lse.sum(), [q])
    (want_grad,) = torch.autograd.grad(want_lse.sum(), [q])
    assert_close(grad, want_grad)
    with pytest.raises(rlx.RlxValueError, match="max_scores"):
        rt.flex_attention(q, k, v, return_aux=torch_flex.AuxRequest(lse=True, max_scores=True))


def test_lse_gradient_flows() -> None:
    q, k, v = qkv()
    out, lse = rt.flex_attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi >= ki, return_lse=True)
    got = torch.autograd.grad((lse * 0.3).sum() + out.sum(), [q, k])
    doubles = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    scores = doubles[0] @ doubles[1].transpose(-1, -2) / 4.0
    scores = scores.masked_fill(~torch.ones(29, 29, dtype=torch.bool).tril(), float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)
    ref_out = torch.softmax(scores, -1) @ doubles[2]
    want = torch.autograd.grad((ref_lse * 0.3).sum() + ref_out.sum(), doubles[:2])
    for g, w in zip(got, want, strict=True):
        assert_close(g, w)


def test_float32_finite_differences() -> None:
    """A gradcheck in float32: central differences with a step and tolerance sized for float32."""
    q, k, v = qkv(b=1, h=2, sq=6, sk=6, d=4, seed=5)
    weight = torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(9))

    def loss(q: Any, k: Any, v: Any) -> Any:
        return (rt.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.tanh(s)) * weight).sum()

    grads = torch.autograd.grad(loss(q, k, v), [q, k, v])
    eps = 1e-2
    for position, (tensor, grad) in enumerate(zip((q, k, v), grads, strict=True)):
        flat = tensor.detach().reshape(-1)
        for index in range(0, flat.numel(), 5):
            plus, minus = flat.clone(), flat.clone()
            plus[index] += eps
            minus[index] -= eps
            args = [t.detach() for t in (q, k, v)]
            args[position] = plus.reshape(tensor.shape)
            up = loss(*args).item()
            args[position] = minus.reshape(tensor.shape)
            down = loss(*args).item()
            numeric = (up - down) / (2 * eps)
            assert abs(numeric - grad.reshape(-1)[index].item()) < 5e-3 + 1e-2 * abs(numeric)


def test_half_precisions_come_back_in_their_dtype() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in qkv())
        out = rt.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.dtype == dtype
        out.float().sum().backward()
        assert q.grad is not None and q.grad.dtype == dtype
        want = F.scaled_dot_product_attention(*(t.detach().float() for t in (q, k, v)), is_causal=True)
        assert_close(out.float(), want, tol=2e-2)


def test_non_contiguous_inputs() -> None:
    base = [t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in qkv()]  # strided views
    assert not base[0].is_contiguous()
    got = rt.scaled_dot_product_attention(*base, is_causal=True)
    assert_close(got, F.scaled_dot_product_attention(*base, is_causal=True))


def test_contiguous_float32_output_is_not_copied() -> None:
    q, k, v = (t.detach() for t in qkv())
    out = rt.scaled_dot_product_attention(q, k, v)
    assert out.is_contiguous() and out.dtype == torch.float32
    assert out.numpy().base is not None  # a view of the array rlx wrote, not a copy of it


def test_float32_tensors_go_to_native_code_by_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct path (tensors' memory as it is, out a new tensor the kernel writes) gives what
    the NumPy path gives, and is the one float32 calls take, strided ones after torch copies
    them contiguous; half precisions take the NumPy path. A call of shapes seen before runs its
    plan's runner (``DirectRunner``), the same path."""
    from rlx.codegen.executable import DirectRunner, Executable

    taken: list[bool] = []
    direct, prepared = Executable.run_direct, DirectRunner.__call__

    def spy(self: Executable, *args: object, **kwargs: object) -> bool:
        taken.append(direct(self, *args, **kwargs))  # type: ignore[arg-type]
        return taken[-1]

    def spy_prepared(self: DirectRunner, *args: object, **kwargs: object) -> None:
        prepared(self, *args, **kwargs)  # type: ignore[arg-type]
        taken.append(True)

    monkeypatch.setattr(Executable, "run_direct", spy)
    monkeypatch.setattr(DirectRunner, "__call__", spy_prepared)
    for sk in (1, 7, 29):
        q, k, v = (t.detach() for t in qkv(sq=1 if sk == 1 else 29, sk=sk, seed=sk))
        strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
        for causal in (False, sk == 29):
            got = rt.scaled_dot_product_attention(q, k, v, is_causal=causal)
            assert taken.pop() is True
            copied = rt.scaled_dot_product_attention(*strided, is_causal=causal)
            assert taken.pop() is True and torch.equal(got, copied)
            half = rt.scaled_dot_product_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), is_causal=causal)
            assert not taken and half.dtype == torch.bfloat16  # the NumPy path, in float32
            via_numpy = rlx_run_numpy(q, k, v, causal)
            assert torch.equal(got, via_numpy)
            assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    assert any(not t.is_contiguous() for t in strided)


def rlx_run_numpy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The fixed-mask forward through ``Executable.run`` (NumPy arrays in and out)."""
    from rlx.torch.sdpa import _fixed_plan

    plan = _fixed_plan(q, k, v, causal, None)
    assert plan is not None
    out = plan.executable("forward").run({"q": q.numpy(), "k": k.numpy(), "v": v.numpy()})["out"]
    return torch.from_numpy(out)


def test_inference_calls_match_the_general_path_and_record_nothing() -> None:
    """Calls without a gradient to record take the short path (rt.sdpa._inference_call); calls
    autograd records take the general one, with the same results."""
    q, k, v = qkv(sq=7, sk=300, hkv=2, seed=3)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3)
    recorded = rt.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3)
    assert recorded.grad_fn is not None
    with torch.no_grad():
        inferred = rt.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3)
    assert inferred.grad_fn is None and not inferred.requires_grad
    detached = rt.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), enable_gqa=True, scale=0.3)
    assert torch.equal(inferred, detached) and torch.equal(inferred, recorded.detach())
    assert_close(inferred, want)


@pytest.mark.parametrize("dim", [32, 96, 128])
def test_a_models_own_default_scale_is_the_default(dim: int) -> None:
    """transformers passes ``scale=head_dim**-0.5``, which times sqrt(D) misses 1.0 by an ulp of
    float64 at these head dims; in float32 it is 1.0, so the call is the default-scale call:
    the same plan (no product of q in its graph) and the same bits. Another scale is not."""
    from rlx.torch import sdpa

    q, k, v = (t.detach() for t in qkv(b=1, h=2, sq=3, sk=5, d=dim, seed=dim))
    assert dim**-0.5 * math.sqrt(dim) != 1.0
    assert sdpa._fixed_plan(q, k, v, False, dim**-0.5) is sdpa._fixed_plan(q, k, v, False, None)
    ops = {node.op for node in sdpa._fixed_plan(q, k, v, False, None).forward_graph.nodes}  # type: ignore[union-attr]
    assert rlx.OpKind.MUL not in ops
    with torch.no_grad():
        ours = rt.scaled_dot_product_attention(q, k, v, scale=dim**-0.5)
        assert torch.equal(ours, rt.scaled_dot_product_attention(q, k, v))
        assert_close(ours, F.scaled_dot_product_attention(q, k, v, scale=dim**-0.5))
        other = rt.scaled_dot_product_attention(q, k, v, scale=0.5 * dim**-0.5)
        assert_close(other, F.scaled_dot_product_attention(q, k, v, scale=0.5 * dim**-0.5))
    assert sdpa._fixed_plan(q, k, v, False, 0.5 * dim**-0.5) is not sdpa._fixed_plan(q, k, v, False, None)


def test_repeated_inference_calls_return_dense_outputs_whatever_the_querys_unit_strides() -> None:
    """A decode step's query may be contiguous with odd strides on its axes of size 1 (a
    permuted view); the output of the short path (made like the query when it has its shape)
    still has the standard strides, and torch's values."""
    _, k, v = (t.detach() for t in qkv(b=1, h=8, sq=1, sk=21, d=16, seed=11))
    q = torch.randn(8, 1, 1, 16).permute(1, 0, 2, 3)  # [1, 8, 1, 16], strides (16, 16, 16, 1)
    assert q.is_contiguous() and q.stride() != (128, 16, 16, 1)
    with torch.no_grad():
        for _ in range(2):  # the first call keeps the runner, the second takes it
            out = rt.scaled_dot_product_attention(q, k, v)
            assert out.stride() == (128, 16, 16, 1)
            assert_close(out, F.scaled_dot_product_attention(q, k, v))
        wide = torch.randn(1, 8, 21, 24)  # Dv != D: out is not shaped like q
        assert_close(rt.scaled_dot_product_attention(q, k, wide), F.scaled_dot_product_attention(q, k, wide))
        assert_close(rt.scaled_dot_product_attention(q, k, wide), F.scaled_dot_product_attention(q, k, wide))


def test_repeated_inference_calls_check_what_their_shapes_do_not_say() -> None:
    """An inference call whose heads, head dims and flags an earlier one had reuses its plan and
    runner; the rest is checked on every call: a call of the same shapes in another dtype,
    through a transpose, with a gradient to record, with dropout or another scale, and calls of
    other lengths and batches, or whose shapes disagree, each get what the general path gives."""
    from rlx.torch import sdpa

    q, k, v = (t.detach() for t in qkv(b=1, h=4, sq=1, sk=33, d=16, seed=5))
    with torch.no_grad():
        first = rt.scaled_dot_product_attention(q, k, v)
        assert (4, 16, 4, 16, False, None, False) in sdpa._inference_runners  # heads, head dims, flags
        again = rt.scaled_dot_product_attention(q, k, v)
        assert torch.equal(first, again) and again.data_ptr() != first.data_ptr()
        assert_close(again, F.scaled_dot_product_attention(q, k, v))
        q2, k2, v2 = (t.detach() for t in qkv(b=1, h=4, sq=1, sk=33, d=16, seed=6))  # new memory, same shapes
        assert_close(rt.scaled_dot_product_attention(q2, k2, v2), F.scaled_dot_product_attention(q2, k2, v2))
        with pytest.raises(rlx.RlxTypeError, match=r"query has dtype torch\.float64"):
            rt.scaled_dot_product_attention(q.double(), k.double(), v.double())
        halves = rt.scaled_dot_product_attention(q.half(), k.half(), v.half())
        assert halves.dtype == torch.float16
        assert_close(halves.float(), F.scaled_dot_product_attention(q.half(), k.half(), v.half()).float(), tol=2e-3)
        # the same shapes through a strided view of other memory
        k_strided = torch.randn(1, 33, 4, 16).transpose(1, 2)
        assert k_strided.shape == k.shape and not k_strided.is_contiguous()
        assert_close(rt.scaled_dot_product_attention(q, k_strided, v), F.scaled_dot_product_attention(q, k_strided, v))
        scaled = rt.scaled_dot_product_attention(q, k, v, scale=0.5)
        assert_close(scaled, F.scaled_dot_product_attention(q, k, v, scale=0.5))
        with pytest.raises(rlx.RlxValueError, match="no dropout"):
            rt.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        with pytest.raises(rlx.RlxTypeError, match=r"key has dtype torch\.float64"):
            rt.scaled_dot_product_attention(q, k.double(), v)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    recorded = rt.scaled_dot_product_attention(*leaves)
    assert recorded.grad_fn is not None
    recorded.sum().backward()
    assert all(leaf.grad is not None for leaf in leaves)
    with torch.no_grad():
        for batch, seq_q, seq_k in ((1, 1, 35), (3, 1, 2), (2, 5, 9), (1, 1, 1)):
            other = [t.detach() for t in qkv(b=batch, h=4, sq=seq_q, sk=seq_k, d=16, seed=seq_k)]
            assert_close(rt.scaled_dot_product_attention(*other), F.scaled_dot_product_attention(*other))
        causal = [t.detach() for t in qkv(b=1, h=4, sq=6, sk=6, d=16, seed=9)]
        assert_close(
            rt.scaled_dot_product_attention(*causal, is_causal=True),
            F.scaled_dot_product_attention(*causal, is_causal=True),
        )
        # Sq != Sk with is_causal: not the fixed kernels' mask (top-left), the programmable path
        short = [causal[0][:, :, :2], causal[1], causal[2]]
        assert_close(
            rt.scaled_dot_product_attention(*short, is_causal=True),
            F.scaled_dot_product_attention(*short, is_causal=True),
        )
        with pytest.raises(rlx.RlxError):  # key and value of different lengths: the general path's error
            rt.scaled_dot_product_attention(q, k, v[:, :, :5])
        two = torch.cat([q, q])  # batch 2 against 1: broadcast, as torch does, on the general path
        assert_close(rt.scaled_dot_product_attention(two, k, v), F.scaled_dot_product_attention(two, k, v))
        empty = rt.scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0])
        assert empty.shape == q.shape


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (lambda q, k, v: rt.scaled_dot_product_attention(q, k, v, dropout_p=0.1), rlx.RlxValueError, "no dropout"),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q.to("meta"), k, v),
            rlx.RlxTypeError,
            "query is on device meta",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q, k.double(), v),
            rlx.RlxTypeError,
            "key has dtype torch.float64",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q, k.half(), v),
            rlx.RlxTypeError,
            "same dtype, got torch.float32, torch.float16 and torch.float32",  # torch's SDPA refuses it too
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q, k, v.numpy()),
            rlx.RlxTypeError,
            "value must be a torch.Tensor",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q.to_sparse(), k, v),
            rlx.RlxTypeError,
            "query is a sparse_coo tensor; rlx takes dense",
        ),
        (
            lambda q, k, v: rt.flex_attention(q, k.to_mkldnn(), v),
            rlx.RlxTypeError,
            "key is a mkldnn tensor",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.ones(29, 29, dtype=torch.bool).to_sparse()
            ),
            rlx.RlxTypeError,
            "attn_mask is a sparse_coo tensor",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 3, dtype=torch.bool)),
            rlx.RlxValueError,
            "does not broadcast",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(29, 29, dtype=torch.int32)),
            rlx.RlxTypeError,
            "attn_mask must be bool or float",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q, k, v, scale="0.5"),
            rlx.RlxTypeError,
            "scale must be a number",
        ),
        (
            lambda q, k, v: rt.flex_attention(q, k, v, scale=[0.5]),
            rlx.RlxTypeError,
            "scale must be a number",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q, k[:1, :1], v),
            rlx.RlxValueError,
            "key has 1 heads and value 4",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q, torch.cat([k, k])[:3], v),
            rlx.RlxValueError,
            "do not broadcast",
        ),
        (  # one batch: the key's single head would broadcast, the value's four do not match it
            lambda q, k, v: rt.scaled_dot_product_attention(q, k[:, :1], v),
            rlx.RlxValueError,
            "key and value need the same heads and length",
        ),
        (
            lambda q, k, v: rt.scaled_dot_product_attention(q, k, v[:, :, :5]),
            rlx.RlxValueError,
            "key and value need the same heads and length",
        ),
        (
            lambda q, k, v: rt.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.cos(s)),
            rlx.RlxTypeError,
            "cos",
        ),
        (
            lambda q, k, v: rt.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s if qi > ki else 0.0),
            rlx.RlxTypeError,
            "where",
        ),
    ],
)
def test_bad_calls_are_clear_errors(make: Any, error: type[Exception], fragment: str) -> None:
    q, k, v = (t.detach() for t in qkv())
    with pytest.raises(error, match=fragment):
        make(q, k, v)


def test_second_call_with_the_same_shapes_compiles_nothing() -> None:
    from rlx.codegen import executable

    q, k, v = qkv(seed=8)
    rt.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5).sum().backward()
    before = dict(executable._cache)
    for seed in range(3):
        q, k, v = qkv(seed=seed)
        rt.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5).sum().backward()
    assert dict(executable._cache).keys() == before.keys()


def test_compile_graph_as_a_torch_function() -> None:
    g = Graph("mlp")
    x = g.input("x", (4, 8))
    w = g.input("w", (8, 3))
    ids = g.input("ids", (4,), dtype="int64")
    logits = g.gelu(x @ w)
    loss = g.cross_entropy(logits, ids)
    g.output(loss=loss, logits=logits)
    f = rt.compile(g)
    xt = torch.randn(4, 8, requires_grad=True)
    wt = torch.randn(8, 3, requires_grad=True)
    idt = torch.tensor([0, 2, 1, 2])
    result = f(x=xt, w=wt, ids=idt)
    (result["loss"] + result["logits"].pow(2).sum()).backward()
    xd, wd = (t.detach().double().requires_grad_(True) for t in (xt, wt))
    ref_logits = F.gelu(xd @ wd)
    (F.cross_entropy(ref_logits, idt) + ref_logits.pow(2).sum()).backward()
    assert_close(result["loss"], F.cross_entropy(ref_logits, idt))
    assert_close(xt.grad, xd.grad)
    assert_close(wt.grad, wd.grad)
    with pytest.raises(rlx.RlxTypeError, match="by name"):
        f(xt, wt, idt)
    with pytest.raises(rlx.RlxKeyError, match="missing"):
        f(x=xt)
    with pytest.raises(rlx.RlxTypeError, match="ids is a sparse_coo tensor"):
        f(x=xt, w=wt, ids=idt.to_sparse())


def test_import_rlx_never_imports_torch() -> None:
    code = "import sys, rlx; import rlx.mods; g = rlx.Graph(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _random_sdpa_call(rng: np.random.Generator) -> tuple[list[Any], dict[str, Any]]:
    """Batch dims that broadcast, GQA or a shared key head, Dv != D, bool or float masks of any
    broadcastable shape (a float one maybe learnable), causal, scale: in float64."""
    lead = [int(rng.integers(1, 4)) for _ in range(int(rng.integers(0, 3)))]
    heads = int(rng.choice([1, 2, 4]))
    kv_heads = int(rng.choice([h for h in (1, 2, 4) if heads % h == 0]))
    sq, sk, d, dv = int(rng.integers(1, 10)), int(rng.integers(1, 10)), int(rng.choice([4, 8])), int(rng.choice([4, 6]))

    def shape(h: int, s: int, e: int) -> list[int]:
        return [size if rng.random() < 0.7 else 1 for size in lead] + [h, s, e]

    tensors = [
        torch.from_numpy(rng.standard_normal(shape(h, s, e))).requires_grad_(True)
        for h, s, e in ((heads, sq, d), (kv_heads, sk, d), (kv_heads, sk, dv))
    ]
    kwargs: dict[str, Any] = {}
    full = [*lead, heads, sq, sk]
    mask_shape = [int(rng.choice([1, size])) for size in full][-int(rng.integers(2, len(full) + 1)) :]
    kind = rng.random()
    if kind < 0.3:
        mask = torch.from_numpy(rng.random(mask_shape) > 0.3)
        mask[..., 0] = True
        kwargs["attn_mask"] = mask
    elif kind < 0.5:
        kwargs["attn_mask"] = torch.from_numpy(rng.standard_normal(mask_shape)).requires_grad_(bool(rng.random() < 0.5))
    if rng.random() < 0.3:
        kwargs["is_causal"] = True
    if rng.random() < 0.3:
        kwargs["scale"] = float(rng.uniform(0.1, 1.0))
    if kv_heads != heads and (kv_heads != 1 or rng.random() < 0.5):
        kwargs["enable_gqa"] = True
    return tensors, kwargs


@pytest.mark.parametrize("seed", range(30))
def test_sdpa_random_calls_match_torch(seed: int) -> None:
    """Random calls of every kind SDPA takes, output and gradients (learnable float masks
    included) against torch's SDPA in float64, with torch's semantics for rows it masks fully."""
    tensors, kwargs = _random_sdpa_call(np.random.default_rng(seed))
    # torch 2.13 takes attn_mask with is_causal on some paths and refuses it on others (GQA,
    # broadcast batches): the reference gets the mask and the causal triangle as one mask.
    reference_kwargs = _explicit_causal(kwargs, tensors[0].shape[-2], tensors[1].shape[-2])
    want = F.scaled_dot_product_attention(*tensors, **reference_kwargs)
    if torch.isnan(want).any():
        pytest.skip("torch itself gives NaN here")
    inputs = tensors + [m for m in [kwargs.get("attn_mask")] if m is not None and m.requires_grad]
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    want_grads = torch.autograd.grad(want, inputs, dy)
    ours = [t.detach().float().requires_grad_(True) for t in tensors]
    ours_kwargs = dict(kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        ours_kwargs["attn_mask"] = mask.detach().float().requires_grad_(mask.requires_grad)
    ours_inputs = ours + [m for m in [ours_kwargs.get("attn_mask")] if m is not None and m.requires_grad]
    got = rt.scaled_dot_product_attention(*ours, **ours_kwargs)
    assert got.shape == want.shape
    assert_close(got, want, tol=1e-4)
    for g, w in zip(torch.autograd.grad(got, ours_inputs, dy.float()), want_grads, strict=True):
        assert g.shape == w.shape
        assert_close(g, w, tol=1e-4)


@pytest.mark.parametrize("seed", range(12))
def test_flex_random_calls_match_float64_math(seed: int) -> None:
    """rt.flex_attention with random shapes (GQA, Dv != D, Sq != Sk), a random score_mod and
    mask_mod written with torch ops and captured tensors, and maybe a scale: out, lse and the
    gradients against the same mods applied to the whole score matrix in float64."""
    rng = np.random.default_rng(1000 + seed)
    b, h = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    hkv = int(rng.choice([n for n in (1, 2, 4) if h % n == 0]))
    sq, sk, d, dv = (
        int(rng.integers(1, 40)),
        int(rng.integers(1, 40)),
        int(rng.choice([8, 16])),
        int(rng.choice([8, 12])),
    )
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv)))
    slopes = torch.from_numpy(rng.random(h))
    bias = torch.from_numpy(rng.standard_normal((b, h, sq, sk)))
    doc_q, doc_k = (torch.from_numpy(np.sort(rng.integers(0, 3, (b, n)), axis=1)) for n in (sq, sk))
    score_mods = [
        None,
        lambda s, b, h, i, j: 20 * torch.tanh(s / 20),
        lambda s, b, h, i, j: s + slopes[h] * (j - i),
        lambda s, b, h, i, j: s + bias[b, h, i, j],
        lambda s, b, h, i, j: torch.where(i >= j, s, s - 1.0),
    ]
    mask_mods = [
        None,
        lambda b, h, i, j: i >= j,
        lambda b, h, i, j: (i - j <= 5) & (j - i <= 5),
        lambda b, h, i, j: doc_q[b, i] == doc_k[b, j],
        lambda b, h, i, j: (i >= j) | (j == 0),
    ]
    score_mod, mask_mod = score_mods[int(rng.integers(0, 5))], mask_mods[int(rng.integers(0, 5))]
    scale = float(rng.uniform(0.1, 1.0)) if rng.random() < 0.3 else None
    grid = (
        torch.arange(b).view(b, 1, 1, 1),
        torch.arange(h).view(1, h, 1, 1),
        torch.arange(sq).view(1, 1, sq, 1),
        torch.arange(sk).view(1, 1, 1, sk),
    )

    def reference(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
        s = q @ k.transpose(-1, -2) * (1 / np.sqrt(d) if scale is None else scale)
        if score_mod is not None:
            s = score_mod(s, *grid)
        if mask_mod is not None:
            s = s.masked_fill(~mask_mod(*grid).expand(b, h, sq, sk), float("-inf"))
        return torch.softmax(s, -1).nan_to_num(0.0) @ v, torch.logsumexp(s, -1)

    doubles = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want, want_lse = reference(*doubles)
    dy = torch.from_numpy(rng.standard_normal(want.shape))
    want_grads = torch.autograd.grad(want, doubles, dy)
    ours = [t.float().requires_grad_(True) for t in (q, k, v)]
    out, lse = rt.flex_attention(
        *ours, score_mod=score_mod, mask_mod=mask_mod, scale=scale, enable_gqa=hkv != h, return_lse=True
    )
    assert_close(out, want, tol=1e-4)
    visible = torch.isfinite(want_lse)
    assert_close(lse[visible], want_lse[visible], tol=1e-4)
    assert bool((lse[~visible] == float("-inf")).all())  # a row with no visible key: lse = -inf
    for g, w in zip(torch.autograd.grad(out, ours, dy.float()), want_grads, strict=True):
        assert_close(g, w, tol=1e-4)


@st.composite
def _forward_graphs(draw: st.DrawFn) -> tuple[Graph, int]:
    from fuzz_graphs import _build

    g, outputs = _build(draw)
    g.output(**{f"y{i}": value for i, value in enumerate(outputs)})
    return g, draw(st.integers(0, 2**31))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_forward_graphs())
def test_compiled_random_graphs_as_torch_functions(case: tuple[Graph, int]) -> None:
    """rt.compile of random graphs (the codegen fuzzer's): outputs, and the gradients torch's
    autograd gets for random cotangents, against the float64 reference of the graph and of
    rlx.grad of sum_i <y_i, dy_i> (built here independently of rt.compile's own)."""
    g, seed = case
    rng = np.random.default_rng(seed)
    arrays = {name: rng.uniform(-1.5, 1.5, v.shape).astype(np.float32) for name, v in g.inputs.items()}
    cotangents = {name: rng.uniform(-1, 1, v.shape).astype(np.float32) for name, v in g.outputs.items()}
    tensors = {name: torch.from_numpy(a.copy()).requires_grad_(True) for name, a in arrays.items()}
    got = rt.compile(g)(**tensors)
    torch.autograd.backward([got[n] for n in cotangents], [torch.from_numpy(c) for c in cotangents.values()])

    want = rlx.reference.run(g, **arrays)
    grad_graph = g.copy()
    dys = {name: grad_graph.input(f"dy_{name}", v.shape) for name, v in grad_graph.outputs.items()}
    total = None
    for name, value in grad_graph.outputs.items():
        term = grad_graph.sum(value * dys[name])
        total = term if total is None else total + term
    xs = list(grad_graph.inputs.values())[: len(arrays)]
    grads = rlx.grad(grad_graph, total, xs)
    for name in list(grad_graph.outputs):
        grad_graph.remove_output(name)
    grad_graph.output(**{f"d_{x.node.attrs.name}": d for x, d in zip(xs, grads, strict=True)})
    want_grads = rlx.reference.run(grad_graph, **arrays, **{f"dy_{n}": c for n, c in cotangents.items()})
    scale = max(1.0, *(float(np.max(np.abs(w))) for w in (*want.values(), *want_grads.values()) if w.size))
    # each entry's own sensitivity to float32 rounding widens its tolerance (ill-conditioned graphs)
    from fuzz_graphs import assert_close_within_spread, rounding_spread

    spread = rounding_spread(g, arrays, want)
    grad_inputs = {**arrays, **{f"dy_{n}": c for n, c in cotangents.items()}}
    grad_spread = rounding_spread(grad_graph, grad_inputs, want_grads)
    for name, value in want.items():
        assert_close_within_spread(
            got[name].detach().numpy(), value, rtol=2e-4, atol=2e-5 * scale, spread=spread[name], err_msg=name
        )
    for name, tensor in tensors.items():
        assert_close_within_spread(
            tensor.grad.numpy(), want_grads[f"d_{name}"], rtol=2e-4, atol=2e-5 * scale,
            spread=grad_spread[f"d_{name}"], err_msg=f"d_{name}\n{g}",
        )


def _math_attention(
    q: Any, k: Any, v: Any, bias: Any = None, causal: bool = False, softcap: float = 0.0, scale: float | None = None
) -> Any:
    """Attention in torch ops (torch's CPU SDPA kernels have no double backward), GQA by repeating."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if causal:
        hidden = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(hidden, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


SECOND_ORDER_CASES = {
    "sdpa-causal": (
        lambda q, k, v, bias: rt.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda q, k, v, bias: _math_attention(q, k, v, causal=True),
    ),
    "sdpa-causal-gqa-scale": (
        lambda q, k, v, bias: rt.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True),
        lambda q, k, v, bias: _math_attention(q, k, v, causal=True, scale=0.3),
    ),
    "sdpa-float-mask": (
        lambda q, k, v, bias: rt.scaled_dot_product_attention(q, k, v, attn_mask=bias),
        lambda q, k, v, bias: _math_attention(q, k, v, bias=bias),
    ),
    "flex-softcap-gqa": (
        lambda q, k, v, bias: rt.flex_attention(
            q, k, v, score_mod=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0), enable_gqa=True
        ),
        lambda q, k, v, bias: _math_attention(q, k, v, softcap=2.0),
    ),
    "flex-learnable-bias": (
        lambda q, k, v, bias: rt.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[b, h, i, j]),
        lambda q, k, v, bias: _math_attention(q, k, v, bias=bias),
    ),
}


@pytest.mark.parametrize("case", list(SECOND_ORDER_CASES))
def test_gradient_penalties_through_rlx_attention_match_torch(case: str) -> None:
    """create_graph=True: the first derivative is unchanged, and differentiating it again (a
    gradient penalty) gives torch autograd's second derivative of the same attention in float64."""
    rlx_attention, torch_attention = SECOND_ORDER_CASES[case]
    hkv = 2 if "gqa" in case else None
    q, k, v = qkv(sq=6, sk=6, d=4, hkv=hkv, seed=3)
    bias = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    leaves = [q, k, v] + ([bias] if "bias" in case else [])
    weights = torch.randn(2, 4, 6, 4, generator=torch.Generator().manual_seed(5))

    def penalty(attention: Any, tensors: list[Any]) -> list[Any]:
        q, k, v, bias = tensors if len(tensors) == 4 else (*tensors, None)
        loss = (attention(q, k, v, bias) * weights.to(q.dtype)).sum()
        first = torch.autograd.grad(loss, tensors, create_graph=True)
        return [*first, *torch.autograd.grad(sum((g**2).sum() for g in first), tensors)]

    doubles = [t.detach().double().requires_grad_(True) for t in leaves]
    constant_bias = bias.detach() if "float-mask" in case else None
    want = penalty(lambda q, k, v, b: torch_attention(q, k, v, b if b is not None else constant_bias), doubles)
    got = penalty(lambda q, k, v, b: rlx_attention(q, k, v, b if b is not None else constant_bias), leaves)
    plain = torch.autograd.grad((rlx_attention(q, k, v, bias) * weights).sum(), leaves)
    for first, again in zip(plain, got, strict=False):
        torch.testing.assert_close(first, again, rtol=0, atol=0)  # create_graph changes no first derivative
    for value, expected in zip(got, want, strict=True):
        torch.testing.assert_close(value.double(), expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_a_gradient_penalty_through_sdpa_on_a_projections_views() -> None:
    """Heads viewed out of a projection (the "bshd" plans): the penalty's gradient reaches x."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    w = torch.randn(8, 24, generator=gen)

    def penalty(x: Any, attention: Any) -> Any:
        q, k, v = (t.view(2, 5, 2, 4).transpose(1, 2) for t in (x @ w.to(x.dtype)).split(8, dim=-1))
        (gx,) = torch.autograd.grad(attention(q, k, v).sum(), [x], create_graph=True)
        (second,) = torch.autograd.grad((gx**2).sum(), [x])
        return second

    got = penalty(x, lambda q, k, v: rt.scaled_dot_product_attention(q, k, v, is_causal=True))
    x64 = x.detach().double().requires_grad_(True)
    want = penalty(x64, lambda q, k, v: _math_attention(q, k, v, causal=True))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_a_compiled_graph_differentiates_twice_like_torch() -> None:
    """create_graph=True through rt.compile: a gradient penalty's gradient, and a third
    derivative, against torch autograd of the same function in float64."""
    g = Graph("m")
    x, w = g.input("x", (3, 5)), g.input("w", (5, 4))
    z = x @ w
    g.output(y=g.sum(g.tanh(z) * g.tanh(z)), p=g.softmax(z))
    f = rt.compile(g)
    gen = torch.Generator().manual_seed(0)
    x64, w64 = (torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in ((3, 5), (5, 4)))
    x32, w32 = (t.detach().float().requires_grad_(True) for t in (x64, w64))

    def derivatives(x: Any, w: Any, run: Any) -> list[Any]:
        y, p = run(x, w)
        (gx,) = torch.autograd.grad(y + (p**3).sum(), [x], create_graph=True)
        dw, dx = torch.autograd.grad((gx**2).sum(), [w, x], create_graph=True)
        (third,) = torch.autograd.grad((dw**2).sum(), [x])
        return [gx, dw, dx, third]

    def torch_fn(x: Any, w: Any) -> tuple[Any, Any]:
        return (torch.tanh(x @ w) ** 2).sum(), torch.softmax(x @ w, -1)

    def rlx_fn(x: Any, w: Any) -> tuple[Any, Any]:
        out = f(x=x, w=w)
        return out["y"], out["p"]

    for got, want in zip(derivatives(x32, w32, rlx_fn), derivatives(x64, w64, torch_fn), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_a_compiled_graph_with_attention_differentiates_twice_like_torch() -> None:
    """A gradient penalty through attention in an rt.compile'd graph: rlx.grad differentiates the
    attention backward again (``rlx.ops.attention_second_order``), as torch's math SDPA does."""
    g = Graph("a")
    q = g.input("q", (1, 2, 4, 8))
    g.output(o=g.sum(g.tanh(g.attention(q, q, q, mask=rlx.MaskKind.CAUSAL, layout=rlx.Layout.BHSD))))
    gen = torch.Generator().manual_seed(1)
    q64 = torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    q32 = q64.detach().float().requires_grad_(True)

    def penalty_gradient(q: Any, o: Any) -> Any:
        (gq,) = torch.autograd.grad(o, [q], create_graph=True)
        (second,) = torch.autograd.grad((gq**2).sum(), [q])
        return second

    def attention(q: Any) -> Any:  # SPEC 1 in torch ops (torch's CPU SDPA has no double backward)
        scores = q @ q.transpose(-1, -2) / math.sqrt(q.shape[-1])
        hidden = torch.ones(4, 4, dtype=torch.bool).triu(1)
        return torch.softmax(scores.masked_fill(hidden, -math.inf), dim=-1) @ q

    want = penalty_gradient(q64, torch.tanh(attention(q64)).sum())
    got = penalty_gradient(q32, rt.compile(g)(q=q32)["o"])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_a_compiled_graph_with_mods_differentiates_twice_like_torch() -> None:
    """The same through programmable attention: a softcap score_mod and a causal mask_mod."""
    g = Graph("a")
    q = g.input("q", (1, 2, 4, 8))
    out = g.attention(q, q, q, score_mod=rlx.mods.softcap(2.0), mask_mod=rlx.mods.causal, layout=rlx.Layout.BHSD)
    g.output(o=g.sum(g.tanh(out)))
    gen = torch.Generator().manual_seed(2)
    q64 = torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    q32 = q64.detach().float().requires_grad_(True)

    def penalty_gradient(q: Any, o: Any) -> Any:
        (gq,) = torch.autograd.grad(o, [q], create_graph=True)
        (second,) = torch.autograd.grad((gq**2).sum(), [q])
        return second

    def attention(q: Any) -> Any:
        scores = 2.0 * torch.tanh(q @ q.transpose(-1, -2) / math.sqrt(q.shape[-1]) / 2.0)
        hidden = torch.ones(4, 4, dtype=torch.bool).triu(1)
        return torch.softmax(scores.masked_fill(hidden, -math.inf), dim=-1) @ q

    want = penalty_gradient(q64, torch.tanh(attention(q64)).sum())
    got = penalty_gradient(q32, rt.compile(g)(q=q32)["o"])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_rlx_attention_inside_torch_compile_is_one_quiet_graph_break() -> None:
    """A model compiled with torch.compile that calls rlx attention: same values and gradients
    as eager, and dynamo does not trace into rlx (it used to warn at every ctypes call)."""
    import warnings

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 32, 16, generator=gen, requires_grad=True)
    bias = torch.randn(32, 32, generator=gen)

    def loss(x: Any) -> Any:
        h = torch.tanh(x)
        a = rt.scaled_dot_product_attention(h, x, x, is_causal=True)
        b = rt.flex_attention(h, x, x, score_mod=lambda s, b, hh, i, j: s + bias[i, j])
        return (a * b).sum()

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (got,) = torch.autograd.grad(torch.compile(loss)(x), [x])
    (want,) = torch.autograd.grad(loss(x), [x])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    traced_into_rlx = [w for w in caught if "rlx" in str(w.message) or "/rlx/" in str(w.filename)]
    assert not traced_into_rlx, [str(w.message)[:200] for w in traced_into_rlx]


def test_compiled_graphs_take_torchs_default_int64_ids_for_int32_inputs() -> None:
    g = Graph("m")
    table, ids = g.input("t", (5, 2)), g.input("i", (3,), dtype="int32")
    g.output(z=g.sum(g.embedding(table, ids) * 2.0))
    f = rt.compile(g)
    t = torch.randn(5, 2, requires_grad=True)
    f(t=t, i=torch.tensor([0, 4, 4]))["z"].backward()  # int64, torch's default
    torch.testing.assert_close(t.grad, torch.tensor([[2.0, 2.0], [0, 0], [0, 0], [0, 0], [4.0, 4.0]]))
    with pytest.raises(rlx.RlxValueError, match="do not fit"):  # never wrapped around into a valid id
        f(t=t, i=torch.tensor([2**32 + 1, 0, 0]))
    with pytest.raises(rlx.RlxValueError, match="out of range"):
        f(t=t, i=torch.tensor([5, 0, 0]))


def test_sdpa_compiles_into_a_fullgraph_torch_compile_with_its_backward() -> None:
    """Without a mask, rlx SDPA is the custom op rlx::sdpa under torch.compile: fullgraph=True
    compiles, and values and gradients equal eager rlx (causal and GQA through the same op)."""
    gen = torch.Generator().manual_seed(0)

    def model(x: Any, w: Any, causal: bool, kv_heads: int) -> Any:
        b, s, e = x.shape
        q, k, v = torch.tanh(x @ w).split([e, e // 4 * kv_heads, e // 4 * kv_heads], dim=-1)
        q = q.reshape(b, s, 4, e // 4).transpose(1, 2)  # transposed views, as a model makes them
        k, v = (t.reshape(b, s, kv_heads, e // 4).transpose(1, 2) for t in (k, v))
        return rt.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != 4).sum()

    for causal, kv_heads in ((True, 4), (False, 2)):
        x = torch.randn(2, 16, 32, generator=gen, requires_grad=True)
        w = torch.randn(32, 32 + 2 * 8 * kv_heads, generator=gen, requires_grad=True)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, w: model(x, w, causal, kv_heads), fullgraph=True)  # noqa: B023
        got = torch.autograd.grad(compiled(x, w), [x, w])
        want = torch.autograd.grad(model(x, w, causal, kv_heads), [x, w])
        for g_, w_ in zip(got, want, strict=True):
            torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5)


def test_masked_sdpa_compiles_into_a_fullgraph_torch_compile_with_its_backward() -> None:
    """A bool or float mask (no gradient into it), with or without is_causal, padding-style masks
    broadcast over heads and queries: the custom op rlx::sdpa_masked under fullgraph=True, with
    values and gradients equal to eager rlx and to torch's own SDPA."""
    gen = torch.Generator().manual_seed(1)
    b, s, e, heads = 2, 12, 32, 4
    keep = torch.rand(b, 1, 1, s, generator=gen) > 0.3
    keep[..., 0] = True  # every row sees a key
    masks = {
        "bool-padding": keep,
        "float-bias": torch.randn(1, heads, s, s, generator=gen),
        "bool-2d": torch.rand(s, s, generator=gen) > 0.5,
    }

    def model(x: Any, w: Any, mask: Any, causal: bool, attend: Any) -> Any:
        q, k, v = torch.tanh(x @ w).split(e, dim=-1)
        q, k, v = (t.reshape(b, s, heads, e // heads).transpose(1, 2) for t in (q, k, v))
        return (attend(q, k, v, attn_mask=mask, is_causal=causal) ** 2).sum()

    for name, mask in masks.items():
        for causal in (False, True):
            x = torch.randn(b, s, e, generator=gen, requires_grad=True)
            w = torch.randn(e, 3 * e, generator=gen, requires_grad=True)
            torch._dynamo.reset()
            compiled = torch.compile(
                lambda x, w: model(x, w, mask, causal, rt.scaled_dot_product_attention),  # noqa: B023
                fullgraph=True,
            )
            got = torch.autograd.grad(compiled(x, w), [x, w])
            eager = torch.autograd.grad(model(x, w, mask, causal, rt.scaled_dot_product_attention), [x, w])
            reference = torch.autograd.grad(model(x, w, mask, causal, F.scaled_dot_product_attention), [x, w])
            for g_, e_, r_ in zip(got, eager, reference, strict=True):
                torch.testing.assert_close(g_, e_, rtol=1e-5, atol=1e-5, msg=f"{name} causal={causal}")
                torch.testing.assert_close(g_, r_, rtol=1e-4, atol=1e-4, msg=f"{name} causal={causal}")


def test_the_masked_sdpa_custom_ops_pass_torchs_opcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 4, 8, generator=gen).transpose(1, 2).requires_grad_(True)  # strided
    k, v = (torch.randn(2, 2, 16, 8, generator=gen).requires_grad_(True) for _ in range(2))
    for mask, is_causal, scale in ((torch.rand(2, 1, 1, 16) > 0.2, False, None), (torch.randn(16, 16), True, 0.3)):
        torch.library.opcheck(torch.ops.rlx.sdpa_masked.default, (q, k, v, mask, is_causal, scale))
        out, lse = torch.ops.rlx.sdpa_masked.default(q.detach(), k.detach(), v.detach(), mask, is_causal, scale)
        grad = torch.randn(2, 4, 16, 8, generator=gen)
        inputs = (grad, q.detach(), k.detach(), v.detach(), mask, out, lse, is_causal, scale)
        torch.library.opcheck(torch.ops.rlx.sdpa_masked_backward.default, inputs)


def test_the_sdpa_custom_ops_pass_torchs_opcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 16, 4, 8, generator=gen).transpose(1, 2).requires_grad_(True)  # strided
    k, v = (torch.randn(2, 2, 16, 8, generator=gen).requires_grad_(True) for _ in range(2))
    for is_causal, scale in ((False, None), (True, 0.3)):
        torch.library.opcheck(torch.ops.rlx.sdpa.default, (q, k, v, is_causal, scale))
        grad = torch.randn(2, 4, 16, 8, generator=gen)
        inputs = (grad, q.detach(), k.detach(), v.detach(), is_causal, scale)
        torch.library.opcheck(torch.ops.rlx.sdpa_backward.default, inputs)


def test_torchs_default_dtype_does_not_reach_the_buffers_rlx_writes() -> None:
    """The float32 buffers native code writes (outputs, gradients, cotangents of an rlx graph)
    are made float32 whatever torch's default dtype: scientific code sets float64, under which
    the outputs were float64 tensors holding float32 bit patterns."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        q, k, v = (torch.randn(2, 4, 5, 16, dtype=torch.float32) for _ in range(3))
        mask = torch.rand(2, 1, 5, 5) > 0.3
        mask[..., 0] = True
        with torch.no_grad():
            for _ in range(2):  # the general path, then the inference runners
                for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}):
                    out = rt.scaled_dot_product_attention(q, k, v, **kwargs)
                    assert out.dtype == torch.float32
                    assert_close(out, F.scaled_dot_product_attention(q, k, v, **kwargs))
                out = rt.flex_attention(q, k, v)
                assert out.dtype == torch.float32
                assert_close(out, F.scaled_dot_product_attention(q, k, v))
        ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
        theirs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        rt.scaled_dot_product_attention(*ours, is_causal=True).sum().backward()
        F.scaled_dot_product_attention(*theirs, is_causal=True).sum().backward()
        for mine, want in zip(ours, theirs, strict=True):
            assert mine.grad is not None and mine.grad.dtype == torch.float32
            assert_close(mine.grad, want.grad, tol=1e-4)
        g = rlx.Graph("two_outputs")
        x = g.input("x", (3, 4))
        g.output(y=g.exp(x), z=g.mul(x, x))
        compiled = rt.compile(g)
        leaf = torch.randn(3, 4, dtype=torch.float32, requires_grad=True)
        compiled(x=leaf)["y"].sum().backward()  # z's cotangent: zeros rlx makes
        assert leaf.grad is not None and leaf.grad.dtype == torch.float32
        assert_close(leaf.grad, leaf.detach().exp())
    finally:
        torch.set_default_dtype(previous)


_DEFAULT_DEVICE_SCRIPT = """
import torch
import torch.nn.functional as F
import rlx
import rlx.torch as rt

q, k, v = (torch.randn(2, 4, 5, 16, device="cpu") for _ in range(3))
mask = torch.rand(2, 1, 5, 5, device="cpu") > 0.3
mask[..., 0] = True
g = rlx.Graph("two_outputs")
x = g.input("x", (3, 4))
g.output(y=g.exp(x), z=g.mul(x, x))
compiled = rt.compile(g)
torch.set_default_device("meta")  # as accelerate's init_empty_weights() does while a model is built
with torch.no_grad():
    for _ in range(2):
        for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}):
            out = rt.scaled_dot_product_attention(q, k, v, **kwargs)
            assert out.device.type == "cpu"
            torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, **kwargs))
        torch.testing.assert_close(rt.flex_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
rt.scaled_dot_product_attention(*ours, is_causal=True).sum().backward()
assert all(t.grad is not None and t.grad.device.type == "cpu" for t in ours)
leaf = torch.randn(3, 4, device="cpu", requires_grad=True)
compiled(x=leaf)["y"].sum().backward()
torch.testing.assert_close(leaf.grad, leaf.detach().exp())
print("ok")
"""


def test_torchs_default_device_does_not_reach_the_buffers_rlx_writes() -> None:
    """Under ``torch.set_default_device("meta")`` (accelerate sets it while it builds a model on
    no memory) the buffers native code writes were meta tensors, whose address is 0: the first
    SDPA call crashed the process. They are CPU tensors whatever the default device; run in a
    child process, so that a crash fails this test rather than the suite."""
    done = subprocess.run([sys.executable, "-c", _DEFAULT_DEVICE_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


def test_a_torch_mod_indexing_a_table_by_document_ids_differentiates() -> None:
    """``pair[doc[b, q], doc[b, kv]]``: a captured tensor indexed by the entries of another, its
    gradient included, against the scores materialised in torch; a bad id is a clear error."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 8, requires_grad=True) for _ in range(3))
    doc = torch.sort(torch.randint(0, 3, (2, 24)), dim=-1).values
    pair = torch.randn(3, 3, requires_grad=True)

    def pair_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + pair[doc[b, q_idx], doc[b, kv_idx]]

    out = rt.flex_attention(q, k, v, score_mod=pair_bias)
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, pair), dy)
    scores = q @ k.transpose(-1, -2) / 8**0.5 + pair[doc[:, :, None], doc[:, None, :]][:, None]
    want_out = torch.softmax(scores, -1) @ v
    want = torch.autograd.grad(want_out, (q, k, v, pair), dy)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    for have, expected in zip(got, want, strict=True):
        torch.testing.assert_close(have, expected, rtol=1e-4, atol=1e-5)
    doc[1, 3] = 3
    with pytest.raises(rlx.RlxValueError, match="3 is out of range"):
        rt.flex_attention(q, k, v, score_mod=pair_bias)
