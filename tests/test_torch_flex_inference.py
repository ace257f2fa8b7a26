"""rlx.torch flex_attention calls that autograd does not record (inference, a decode loop) run
the kernel on the tensors' memory by address, without NumPy arrays or an autograd Function:
their results are the recorded path's, bit for bit, and whatever cannot go by address (half
precision, strided views, a captured tensor of another dtype) takes the general path."""

from __future__ import annotations

import math
from typing import Any

import pytest

import rlx

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
rt = pytest.importorskip("rlx.torch")
executable = pytest.importorskip("rlx.codegen.executable")

B, H, D = 2, 4, 16


@pytest.fixture()
def by_address(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls that went to native code by address (DirectRunner)."""
    count: list[int] = []
    call = executable.DirectRunner.__call__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        count.append(1)
        call(self, *args, **kwargs)

    monkeypatch.setattr(executable.DirectRunner, "__call__", counted)
    return count


def _tensors(seq_q: int, seq_k: int, kv_heads: int = H, value_dim: int = D, seed: int = 0) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, seq_q, D), (B, kv_heads, seq_k, D), (B, kv_heads, seq_k, value_dim)]
    return [torch.randn(shape, generator=gen) for shape in shapes]


def _softcap(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return 3.0 * torch.tanh(score / 3.0)


DOC = torch.tensor([[0] * 5 + [1] * 6, [0] * 2 + [1] * 9])  # int64 ids, read by a mask_mod


def _same_document(b: Any, h: Any, q: Any, kv: Any) -> Any:
    return DOC[b, q] == DOC[b, kv]


def _formula(q: Any, k: Any, v: Any, score_mod: Any, mask_mod: Any) -> tuple[Any, Any]:
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in scores.shape), indexing="ij")
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(b, h, i, j), -math.inf)
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


# mods, shapes, whether the call goes by address: a mask read from a tensor has its block map
# made per call from the tensor, but a call as small as these reads no map (every tile PARTIAL),
# so it goes by address too; a large one takes the general path, which makes the map
# (test_a_large_call_with_a_mask_tensor_takes_the_general_path).
CASES = {
    "plain": ({}, {}, True),
    "softcap": ({"score_mod": _softcap}, {}, True),
    "document": ({"mask_mod": _same_document}, {}, True),
    "gqa-and-value-width": ({"score_mod": _softcap}, {"kv_heads": 2, "value_dim": 24}, True),
}


@pytest.mark.parametrize("case", CASES)
def test_inference_calls_go_by_address_and_equal_the_recorded_path(case: str, by_address: list[int]) -> None:
    mods, shapes, addressed = CASES[case]
    gqa = shapes.get("kv_heads", H) != H
    q, k, v = _tensors(11, 11, **shapes)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    recorded, recorded_lse = rt.flex_attention(*leaves, **mods, enable_gqa=gqa, return_lse=True)
    assert recorded.grad_fn is not None and not by_address  # the recorded path: arrays and autograd
    with torch.no_grad():
        out, lse = rt.flex_attention(*leaves, **mods, enable_gqa=gqa, return_lse=True)
    plain = rt.flex_attention(q, k, v, **mods, enable_gqa=gqa)  # nothing requires grad
    assert len(by_address) == (2 if addressed else 0)
    assert out.grad_fn is None and not out.requires_grad and out.is_contiguous()
    assert torch.equal(out, recorded.detach()) and torch.equal(lse, recorded_lse.detach())
    assert torch.equal(plain, out)
    want, want_lse = _formula(q, k, v, mods.get("score_mod"), mods.get("mask_mod"))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=2e-6)


def test_a_large_call_with_a_mask_tensor_takes_the_general_path(
    by_address: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above the small-call threshold the kernel reads its block map, which only the general
    path makes from the tensor: such a call does not go by address, and skips the hidden tiles
    (here the threshold is lowered so that a call of this size counts as large)."""
    from rlx.codegen import lower

    monkeypatch.setattr(lower, "SMALL_CALL_MACS", 64)  # read when a kernel is emitted
    q, k, v = _tensors(11, 11, value_dim=8, seed=5)  # a graph no other test compiled
    with torch.no_grad():
        out, lse = rt.flex_attention(q, k, v, mask_mod=_same_document, return_lse=True)
    assert not by_address
    want, want_lse = _formula(q, k, v, None, _same_document)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=2e-6)


def test_sdpa_padding_masks_in_a_decode_loop_go_by_address(by_address: list[int]) -> None:
    """Batched generation's padding mask ``[B, 1, 1, Sk]``: each step's block map would be made
    from the mask, but a decode step is small, its kernel reads no map, and it runs by address;
    the results are torch's at every length."""
    gen = torch.Generator().manual_seed(7)
    steps = 0
    with torch.no_grad():
        for seq_k in range(2, 60, 7):
            q = torch.randn(B, H, 1, D, generator=gen)
            k, v = (torch.randn(B, H, seq_k, D, generator=gen) for _ in range(2))
            mask = torch.ones(B, 1, 1, seq_k, dtype=torch.bool)
            mask[1, :, :, : min(3, seq_k - 1)] = False
            out = rt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)
            steps += 1
    assert len(by_address) == steps


def test_a_decode_loop_goes_by_address_at_every_length(by_address: list[int]) -> None:
    with torch.no_grad():
        for seq_k in range(1, 40, 3):
            q, k, v = _tensors(1, seq_k, seed=seq_k)
            out = rt.flex_attention(q, k, v, score_mod=_softcap)
            torch.testing.assert_close(out.double(), _formula(q, k, v, _softcap, None)[0], rtol=1e-5, atol=2e-6)
    assert len(by_address) == 13


def test_what_cannot_go_by_address_takes_the_general_path(by_address: list[int]) -> None:
    q, k, v = _tensors(9, 9)
    bias = torch.randn(H, 9, 9, dtype=torch.float64)  # read as float32 by the graph: copied

    def add_bias(score: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return score + bias[h, i, j]

    with torch.no_grad():
        half = rt.flex_attention(q.half(), k.half(), v.half(), score_mod=_softcap)
        assert half.dtype == torch.float16
        strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # [B, S, H, D] memory
        from_views = rt.flex_attention(*strided, score_mod=_softcap)
        biased = rt.flex_attention(q, k, v, score_mod=add_bias)
    assert not by_address
    want = _formula(q, k, v, _softcap, None)[0]
    torch.testing.assert_close(half.double(), want, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(from_views.double(), want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(biased.double(), _formula(q, k, v, add_bias, None)[0], rtol=1e-5, atol=2e-6)


def test_an_index_out_of_range_is_refused_before_native_code() -> None:
    """A mod indexing a captured tensor by the lengths is checked at every call's sizes, on the
    inference path too: a longer call than the tensor covers is a clear error."""
    bias = torch.randn(H, 9, 9)

    def add_bias(score: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        return score + bias[h, i, j]

    with torch.no_grad():
        rt.flex_attention(*_tensors(9, 9), score_mod=add_bias)
        with pytest.raises(rlx.RlxValueError, match="outside"):
            rt.flex_attention(*_tensors(12, 12), score_mod=add_bias)


def test_masks_whose_shape_keeps_every_index_in_range_need_no_check_per_call() -> None:
    """An SDPA mask ``[B|1, 1, Sq|1, Sk]`` is read by ``b``, ``0`` and ``kv_idx`` on axes of the
    batch's, one and Sk's size: in range at any sizes, so its graph has no per-call check (which
    ran at every new length of a decode loop); a tensor of its own static shape read by the
    lengths keeps the check."""
    from rlx.codegen.lower import call_checks
    from rlx.torch import flex, sdpa

    q, k, v = _tensors(1, 7)
    for mask in (torch.ones(B, 1, 1, 7, dtype=torch.bool), torch.zeros(1, 1, 1, 7), torch.ones(B, H, 1, 7) > 0):
        plan = sdpa._masked_plan(q, k, v, mask, False, None)
        assert not plan.graph.inputs["q"].type.is_static
        assert call_checks(plan.graph) == []
    bias = torch.randn(H, 9, 9)
    plan = flex._plan(q, k, v, lambda score, b, h, i, j: score + bias[h, i, j], None, None)
    assert len(call_checks(plan.graph)) == 1
    with torch.no_grad():  # masked decode steps, each against torch
        for seq_k in (3, 8, 20):
            q, k, v = _tensors(1, seq_k, seed=seq_k)
            mask = torch.rand(B, 1, 1, seq_k, generator=torch.Generator().manual_seed(seq_k)) > 0.3
            mask[..., 0] = True
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.testing.assert_close(rt.scaled_dot_product_attention(q, k, v, attn_mask=mask), want)


def test_a_padding_mask_decode_loop_compiles_once_from_its_first_key() -> None:
    """A mask axis of size 1 that equals its dimension (one key, one query, a batch of one) is
    that dimension, not a broadcast: the loop's first step (one key) and the rest share a plan,
    and so do a prefill's ``[B, 1, S, S]`` mask and the decode steps' ``[B, 1, 1, S + t]``; the
    plan traced at one key reads the mask at every key of the later steps (it read key 0 once)."""
    sdpa = pytest.importorskip("rlx.torch.sdpa")
    gen = torch.Generator().manual_seed(11)
    heads, dim = 3, 8
    executables = set()
    with torch.no_grad():
        for seq_k in (1, 2, 3, 9):
            q = torch.randn(B, heads, 1, dim, generator=gen)
            k, v = (torch.randn(B, heads, seq_k, dim, generator=gen) for _ in range(2))
            mask = torch.ones(B, 1, 1, seq_k, dtype=torch.bool)
            mask[1, :, :, : min(2, seq_k - 1)] = False  # the second sequence's first keys are padding
            out = rt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=2e-6)
            executables.add(id(sdpa._masked_plan(q, k, v, mask, False, None).forward))
        assert len(executables) == 1
        q, k, v = (torch.randn(B, heads, 6, dim, generator=gen) for _ in range(3))
        mask = torch.rand(B, 1, 6, 6, generator=gen) > 0.3
        mask[..., 0] = True  # every query sees a key
        out = rt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        executables.add(id(sdpa._masked_plan(q, k, v, mask, False, None).forward))
        assert len(executables) == 1  # the prefill's mask has the decode steps' plan
        broadcast = torch.ones(1, 1, 1, 6, dtype=torch.bool)  # one mask row for every sequence and query
        out = rt.scaled_dot_product_attention(q, k, v, attn_mask=broadcast)
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))
        assert id(sdpa._masked_plan(q, k, v, broadcast, False, None).forward) not in executables


def test_masked_inference_calls_after_the_first_skip_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a masked inference call of some heads, head dims, flags and mask pattern ran by
    address, later calls like it run by its runner without the general path, with the general
    path's results bit for bit; whatever the runner does not take (a gradient to record, another
    mask pattern, a mask that does not fit, a strided mask, a call large enough to read its block
    map) takes the general path, with its results or its error."""
    import rlx.codegen.lower as lower

    sdpa = pytest.importorskip("rlx.torch.sdpa")
    heads, dim = 5, 24  # shapes no other test uses: this test's plan and runner are its own
    macs_limit = 2 * heads * 1 * 300 * (2 * dim)  # calls of B2, one query and fewer than 300 keys are small
    monkeypatch.setattr(lower, "SMALL_CALL_MACS", macs_limit)
    general: list[int] = []
    eager = sdpa._sdpa_eager

    def counted(*args: Any, **kwargs: Any) -> Any:
        general.append(1)
        return eager(*args, **kwargs)

    monkeypatch.setattr(sdpa, "_sdpa_eager", counted)
    gen = torch.Generator().manual_seed(21)

    def step(seq_q: int, seq_k: int) -> tuple[Any, Any, Any, Any]:
        q = torch.randn(B, heads, seq_q, dim, generator=gen)
        k, v = (torch.randn(B, heads, seq_k, dim, generator=gen) for _ in range(2))
        mask = torch.ones(B, 1, seq_q, seq_k, dtype=torch.bool)
        mask[1, ..., : min(3, seq_k - 1)] = False
        return q, k, v, mask

    sdpa_torch = torch.nn.functional.scaled_dot_product_attention

    def ours(q: Any, k: Any, v: Any, mask: Any) -> Any:
        return rt.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    with torch.no_grad():
        first = step(1, 7)
        ours(*first)  # the general path, once
        assert len(general) == 1
        for seq_k in (8, 40, 299):
            q, k, v, mask = step(1, seq_k)
            out = rt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            assert torch.equal(out, eager(q, k, v, mask, 0.0, False, None, False))  # the general path's result
            torch.testing.assert_close(out, sdpa_torch(q, k, v, attn_mask=mask), rtol=1e-5, atol=2e-6)
        assert len(general) == 1  # (the eager calls above are the original function, not counted)
        general.clear()
        q, k, v, mask = step(1, 300)  # at the threshold: the kernel reads its map, which only the general path makes
        torch.testing.assert_close(ours(q, k, v, mask), sdpa_torch(q, k, v, attn_mask=mask))
        assert len(general) == 1
        q, k, v, mask = step(3, 20)  # [B, 1, Sq, Sk], a prefill's: the decode steps' plan, so their runner
        torch.testing.assert_close(ours(q, k, v, mask), sdpa_torch(q, k, v, attn_mask=mask))
        assert len(general) == 1
        shared = torch.ones(1, 1, 1, 20, dtype=torch.bool)  # another pattern: one row for the whole batch
        shared[..., :4] = False
        torch.testing.assert_close(
            rt.scaled_dot_product_attention(q, k, v, attn_mask=shared), sdpa_torch(q, k, v, attn_mask=shared)
        )
        assert len(general) == 2
        q, k, v, mask = step(1, 20)
        strided = torch.ones(B, 1, 40, 1, dtype=torch.bool)[:, :, ::2].transpose(2, 3)  # [B, 1, 1, 20], not contiguous
        strided[1, ..., :2] = False
        assert strided.shape == (B, 1, 1, 20) and not strided.is_contiguous()
        out = rt.scaled_dot_product_attention(q, k, v, attn_mask=strided)
        torch.testing.assert_close(out, sdpa_torch(q, k, v, attn_mask=strided), rtol=1e-5, atol=2e-6)
        assert len(general) == 3
        with pytest.raises(rlx.RlxValueError):  # 21 mask keys for 20 keys: the general path's error
            rt.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(B, 1, 1, 21, dtype=torch.bool))
        additive = torch.zeros(B, 1, 1, 20).masked_fill(~mask, float("-inf"))  # a float mask: its own plan
        out = rt.scaled_dot_product_attention(q, k, v, attn_mask=additive)
        torch.testing.assert_close(out, sdpa_torch(q, k, v, attn_mask=additive), rtol=1e-5, atol=2e-6)
        for dtype in (torch.float16, torch.float64):  # masks the kernel reads as float32 copies, twice each
            for _ in range(2):
                other = torch.randn(B, 1, 1, 20, generator=gen).to(dtype)
                out = rt.scaled_dot_product_attention(q, k, v, attn_mask=other)
                torch.testing.assert_close(out, sdpa_torch(q, k, v, attn_mask=other.float()), rtol=1e-5, atol=2e-6)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = rt.scaled_dot_product_attention(*leaves, attn_mask=mask)  # a gradient to record
    out.sum().backward()
    want = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    sdpa_torch(*want, attn_mask=mask).sum().backward()
    for ours, theirs in zip(leaves, want, strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)
