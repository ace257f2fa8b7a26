"""rlx.torch with dynamic sequence lengths: SDPA compiles once for every length (SPEC 5-6)."""

from __future__ import annotations

from typing import Any

import pytest

from rlx.codegen.executable import compile_count

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch
rt = pytest.importorskip("rlx.torch")
F = torch.nn.functional


def _tensors(shapes: list[tuple[int, ...]], seed: int) -> list[Any]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).float().requires_grad_(True) for s in shapes]


def _forward_backward(fn: Any, tensors: list[Any], dy: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
    for t in tensors:
        t.grad = None
    out = fn(*tensors, **kwargs)
    out.backward(dy)
    return out.detach(), [t.grad.clone() for t in tensors]


def _close(got: Any, want: Any, tol: float = 2e-5) -> None:
    scale = float(want.abs().max()) + 1e-6
    assert float((got - want).abs().max()) <= tol * scale, float((got - want).abs().max())


@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_runs_every_key_length_on_one_compilation(gqa: bool) -> None:
    heads, kv_heads = (4, 2) if gqa else (4, 4)
    q, k, v = _tensors([(2, heads, 1, 16), (2, kv_heads, 1, 16), (2, kv_heads, 1, 24)], seed=0)
    rt.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)  # the one compilation (forward)
    before = compile_count()
    for seq_k in (2, 7, 64, 300):
        q, k, v = _tensors([(2, heads, 1, 16), (2, kv_heads, seq_k, 16), (2, kv_heads, seq_k, 24)], seed=seq_k)
        got = rt.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        _close(got.detach(), F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).detach())
    assert compile_count() == before


def test_sdpa_backward_with_varying_lengths_matches_torch_and_compiles_once() -> None:
    seen = None
    for step, (seq_q, seq_k) in enumerate(((5, 9), (1, 33), (40, 17), (128, 130))):
        tensors = _tensors([(2, 3, seq_q, 16), (2, 3, seq_k, 16), (2, 3, seq_k, 16)], seed=step)
        dy = torch.randn(2, 3, seq_q, 16, generator=torch.Generator().manual_seed(99))
        out, grads = _forward_backward(rt.scaled_dot_product_attention, tensors, dy)
        want_out, want_grads = _forward_backward(F.scaled_dot_product_attention, tensors, dy)
        _close(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            _close(got, want, 5e-5)
        if step == 0:
            seen = compile_count()  # forward and backward compiled by the first call
    assert compile_count() == seen


def test_lengths_on_both_sides_of_the_small_call_threshold_compile_once() -> None:
    # Small calls run on one thread, large ones on all: a cap per call on one build, so a decode
    # loop or a batch of a new length crossing the threshold compiles nothing.
    seen = None
    for step, seq in enumerate((3, 700, 5, 650)):
        assert 2.0 * 2 * 4 * seq * seq * 128 < rt.SMALL_ATTENTION_FLOPS_OWN_WORKERS or seq > 600
        tensors = _tensors([(2, 4, seq, 64)] * 3, seed=20 + step)
        dy = torch.randn(2, 4, seq, 64, generator=torch.Generator().manual_seed(step))
        out, grads = _forward_backward(rt.scaled_dot_product_attention, tensors, dy, is_causal=True)
        want_out, want_grads = _forward_backward(F.scaled_dot_product_attention, tensors, dy, is_causal=True)
        _close(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            _close(got, want, 5e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen


def test_causal_sdpa_over_training_batches_of_varying_length() -> None:
    seen = None
    for step, seq in enumerate((12, 31, 96, 5)):
        tensors = _tensors([(1, 2, seq, 8)] * 3, seed=10 + step)
        dy = torch.randn(1, 2, seq, 8, generator=torch.Generator().manual_seed(step))
        out, grads = _forward_backward(rt.scaled_dot_product_attention, tensors, dy, is_causal=True)
        want_out, want_grads = _forward_backward(F.scaled_dot_product_attention, tensors, dy, is_causal=True)
        _close(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            _close(got, want, 5e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_over_batches_of_varying_size_compiles_once(is_causal: bool) -> None:
    """A smaller last batch (or a decode batch that shrinks) runs on the same machine code:
    the fixed-mask kernels take the batch per call, GQA included."""
    seen = None
    for step, (batch, seq) in enumerate(((4, 12), (1, 12), (3, 31), (2, 2))):
        shapes = [(batch, 4, seq, 8), (batch, 2, seq, 8), (batch, 2, seq, 8)]
        tensors = _tensors(shapes, seed=30 + step)
        dy = torch.randn(batch, 4, seq, 8, generator=torch.Generator().manual_seed(step))
        kwargs = {"is_causal": is_causal, "enable_gqa": True}
        out, grads = _forward_backward(rt.scaled_dot_product_attention, tensors, dy, **kwargs)
        want_out, want_grads = _forward_backward(F.scaled_dot_product_attention, tensors, dy, **kwargs)
        _close(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            _close(got, want, 5e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen


def test_causal_with_more_keys_than_queries_keeps_torchs_top_left_alignment() -> None:
    q, k, v = _tensors([(1, 2, 3, 8), (1, 2, 7, 8), (1, 2, 7, 8)], seed=5)
    got = rt.scaled_dot_product_attention(q, k, v, is_causal=True)
    _close(got.detach(), F.scaled_dot_product_attention(q, k, v, is_causal=True).detach())


def test_a_scale_other_than_the_default_is_honoured() -> None:
    q, k, v = _tensors([(1, 2, 6, 8), (1, 2, 9, 8), (1, 2, 9, 8)], seed=6)
    got = rt.scaled_dot_product_attention(q, k, v, scale=0.7)
    _close(got.detach(), F.scaled_dot_product_attention(q, k, v, scale=0.7).detach())


def test_bfloat16_decode_step_returns_bfloat16() -> None:
    q, k, v = (t.detach().bfloat16() for t in _tensors([(1, 2, 1, 8), (1, 2, 11, 8), (1, 2, 11, 8)], seed=7))
    got = rt.scaled_dot_product_attention(q, k, v)
    assert got.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    _close(got.float(), want, 1e-2)


def test_scaled_sdpa_also_compiles_once() -> None:
    seen = None
    for step, seq in enumerate((4, 19, 50)):
        tensors = _tensors([(1, 2, seq, 8)] * 3, seed=20 + step)
        dy = torch.randn(1, 2, seq, 8, generator=torch.Generator().manual_seed(step))
        out, grads = _forward_backward(rt.scaled_dot_product_attention, tensors, dy, scale=0.3)
        want_out, want_grads = _forward_backward(F.scaled_dot_product_attention, tensors, dy, scale=0.3)
        _close(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            _close(got, want, 5e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen


def test_compiled_graph_with_a_symbolic_length_differentiates_every_length() -> None:
    import rlx

    g = rlx.Graph()
    x = g.input("x", (2, "S", 8))
    w = g.input("w", (8, 8))
    h = g.tanh(x @ w)
    g.output(y=g.sum(h * h, axis=1), h=h)
    f = rt.compile(g)
    seen = None
    for step, seq in enumerate((1, 6, 33)):
        xs, ws = _tensors([(2, seq, 8), (8, 8)], seed=30 + step)
        f(x=xs, w=ws)["y"].sum().backward()  # no cotangent reaches "h": zeros of this call's shape
        x2, w2 = (t.detach().double().requires_grad_(True) for t in (xs, ws))
        torch.tanh(x2 @ w2).pow(2).sum(dim=1).sum().backward()
        _close(xs.grad, x2.grad.float(), 1e-5)
        _close(ws.grad, w2.grad.float(), 1e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen


def test_flex_attention_with_index_mods_compiles_once_for_every_length() -> None:
    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return 20.0 * torch.tanh(score / 20.0)

    seen = None
    for step, seq in enumerate((16, 33, 100)):
        tensors = _tensors([(1, 2, seq, 8)] * 3, seed=40 + step)
        dy = torch.randn(1, 2, seq, 8, generator=torch.Generator().manual_seed(step))
        out, grads = _forward_backward(rt.flex_attention, tensors, dy, score_mod=softcap, mask_mod=causal)
        x2 = [t.detach().double().requires_grad_(True) for t in tensors]
        scores = (x2[0] @ x2[1].transpose(-1, -2)) / 8**0.5
        scores = 20.0 * torch.tanh(scores / 20.0)
        keep = torch.ones(seq, seq, dtype=torch.bool).tril()
        want = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ x2[2]
        want.backward(dy.double())
        _close(out, want.detach().float())
        for got, ref in zip(grads, x2, strict=True):
            _close(got, ref.grad.float(), 5e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen


@pytest.mark.parametrize("kind", ["bool", "float", "padding"])
def test_sdpa_with_a_mask_tensor_compiles_once_for_every_length(kind: str) -> None:
    seen = None
    for step, (seq_q, seq_k) in enumerate(((5, 9), (40, 40), (128, 130), (7, 300))):
        gen = torch.Generator().manual_seed(step)
        tensors = _tensors([(2, 3, seq_q, 16), (2, 3, seq_k, 16), (2, 3, seq_k, 16)], seed=50 + step)
        if kind == "bool":
            mask = torch.rand(2, 3, seq_q, seq_k, generator=gen) > 0.2
        elif kind == "float":
            mask = torch.randn(seq_q, seq_k, generator=gen)
        else:  # key padding, as a batch of variable-length sequences uses
            mask = (torch.arange(seq_k) < seq_k - 2).view(1, 1, 1, seq_k).expand(2, 1, 1, seq_k)
        dy = torch.randn(2, 3, seq_q, 16, generator=gen)
        out, grads = _forward_backward(rt.scaled_dot_product_attention, tensors, dy, attn_mask=mask)
        want_out, want_grads = _forward_backward(F.scaled_dot_product_attention, tensors, dy, attn_mask=mask)
        _close(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            _close(got, want, 5e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen


def test_flex_attention_with_a_learnable_bias_compiles_once_for_every_length() -> None:
    bias = torch.randn(2, 64, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + bias[h, q_idx, kv_idx]

    seen = None
    for step, seq in enumerate((16, 33, 64)):
        tensors = _tensors([(1, 2, seq, 8)] * 3, seed=60 + step)
        dy = torch.randn(1, 2, seq, 8, generator=torch.Generator().manual_seed(step))
        bias.grad = None
        out, grads = _forward_backward(rt.flex_attention, tensors, dy, score_mod=score_mod)
        x2 = [t.detach().double().requires_grad_(True) for t in tensors]
        b2 = bias.detach().double().requires_grad_(True)
        scores = (x2[0] @ x2[1].transpose(-1, -2)) / 8**0.5 + b2[:, :seq, :seq]
        want = torch.softmax(scores, dim=-1) @ x2[2]
        want.backward(dy.double())
        _close(out, want.detach().float())
        for got, ref in zip([*grads, bias.grad], [*x2, b2], strict=True):
            _close(got, ref.grad.float(), 5e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen
    too_long = _tensors([(1, 2, 65, 8)] * 3, seed=70)
    with pytest.raises(ValueError, match="outside"):  # the bias has 64 rows: refused before native code
        rt.flex_attention(*too_long, score_mod=score_mod)


def test_flex_mask_that_reads_the_lengths_compiles_once() -> None:
    """causal_lower_right uses Sq and Sk (region symbols %q_len/%kv_len): still one compile."""
    import rlx

    before = compile_count()
    for seq_q, seq_k in ((7, 12), (30, 31), (64, 90)):
        q, k, v = _tensors([(1, 2, seq_q, 16), (1, 2, seq_k, 16), (1, 2, seq_k, 16)], seq_q)
        dy = torch.randn(1, 2, seq_q, 16)
        bool_mask = torch.ones(seq_q, seq_k, dtype=torch.bool).tril(diagonal=seq_k - seq_q)
        got, got_grads = _forward_backward(rt.flex_attention, [q, k, v], dy, mask_mod=rlx.mods.causal_lower_right)
        want, want_grads = _forward_backward(F.scaled_dot_product_attention, [q, k, v], dy, attn_mask=bool_mask)
        _close(got, want)
        for g, w in zip(got_grads, want_grads, strict=True):
            _close(g, w)
    assert compile_count() - before <= 2  # the forward once, its backward once


def test_flex_attention_over_batches_of_varying_size_compiles_once() -> None:
    """Batch and lengths both vary; a learnable per-head slope (read without b) gets its gradient
    summed over the call's batch."""
    slopes = torch.rand(2, generator=torch.Generator().manual_seed(4), requires_grad=True)

    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - slopes[h] * (q_idx - kv_idx)

    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx >= kv_idx

    seen = None
    for step, (batch, seq) in enumerate(((3, 16), (1, 33), (4, 7), (2, 100))):
        tensors = _tensors([(batch, 2, seq, 8)] * 3, seed=80 + step)
        dy = torch.randn(batch, 2, seq, 8, generator=torch.Generator().manual_seed(step))
        slopes.grad = None
        out, grads = _forward_backward(rt.flex_attention, tensors, dy, score_mod=alibi, mask_mod=causal)
        x2 = [t.detach().double().requires_grad_(True) for t in tensors]
        s2 = slopes.detach().double().requires_grad_(True)
        distance = (torch.arange(seq)[:, None] - torch.arange(seq)[None, :]).double()
        scores = (x2[0] @ x2[1].transpose(-1, -2)) / 8**0.5 - s2[:, None, None] * distance
        keep = torch.ones(seq, seq, dtype=torch.bool).tril()
        want = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1) @ x2[2]
        want.backward(dy.double())
        _close(out, want.detach().float())
        for got, ref in zip([*grads, slopes.grad], [*x2, s2], strict=True):
            _close(got, ref.grad.float(), 5e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen


@pytest.mark.parametrize("kind", ["bool", "float", "padding"])
def test_sdpa_with_a_mask_tensor_over_batches_of_varying_size_compiles_once(kind: str) -> None:
    seen = None
    for step, (batch, seq_q, seq_k) in enumerate(((2, 5, 9), (3, 40, 40), (4, 7, 30), (3, 16, 17))):
        gen = torch.Generator().manual_seed(step)
        tensors = _tensors([(batch, 3, seq_q, 16), (batch, 3, seq_k, 16), (batch, 3, seq_k, 16)], seed=90 + step)
        if kind == "bool":
            mask = torch.rand(batch, 3, seq_q, seq_k, generator=gen) > 0.2
        elif kind == "float":
            mask = torch.randn(seq_q, seq_k, generator=gen)
        else:  # key padding: each sequence of the batch its own length
            lengths = torch.randint(1, seq_k + 1, (batch,), generator=gen)
            mask = (torch.arange(seq_k)[None, :] < lengths[:, None]).view(batch, 1, 1, seq_k)
        dy = torch.randn(batch, 3, seq_q, 16, generator=gen)
        out, grads = _forward_backward(rt.scaled_dot_product_attention, tensors, dy, attn_mask=mask)
        want_out, want_grads = _forward_backward(F.scaled_dot_product_attention, tensors, dy, attn_mask=mask)
        _close(out, want_out)
        for got, want in zip(grads, want_grads, strict=True):
            _close(got, want, 5e-5)
        if step == 0:
            seen = compile_count()
    assert compile_count() == seen
