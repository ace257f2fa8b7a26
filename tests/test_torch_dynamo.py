"""``torch.compile(model, backend="rlx")``: TorchDynamo graphs translated to rlx and compiled.

Optional: skipped when torch is not installed. Each model runs compiled and eagerly on the same
inputs; values and gradients must agree, and the backend's counters say whether rlx compiled the
graph or left it to eager PyTorch (with a warning naming why).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rlx import RlxValueError

torch = pytest.importorskip("torch")
rt = pytest.importorskip("rlx.torch")
F = torch.nn.functional
dynamo_backend = pytest.importorskip("rlx.torch.dynamo")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    dynamo_backend.fallbacks.clear()
    dynamo_backend.stats.update(compiled=0, eager=0)


class Block(torch.nn.Module):
    """A pre-norm block of a character LM with its loss, written as torch users write it."""

    def __init__(self, vocab: int = 11, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.norm2 = torch.nn.RMSNorm(width, eps=1e-6)
        self.gate = torch.nn.Linear(width, 2 * width, bias=False)
        self.up = torch.nn.Linear(width, 2 * width, bias=False)
        self.down = torch.nn.Linear(2 * width, width, bias=False)
        self.head = torch.nn.Linear(width, vocab)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(y.transpose(1, 2).reshape(batch, length, width)))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def _batch(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (2, length), generator=gen), torch.randint(0, 11, (2, length), generator=gen)


def test_training_steps_match_eager() -> None:
    torch.manual_seed(0)
    eager = Block().eval()  # eval: dropout off, so the graph is rlx's
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="rlx")
    # SGD, not Adam: the key projection's bias has an exact zero gradient (softmax ignores a
    # constant per row), whose float32 rounding noise Adam would scale up to whole steps.
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled_model)]
    for step in range(3):
        ids, targets = _batch(9, step)
        losses = []
        for model, optimizer in zip((eager, compiled), optimizers, strict=True):
            optimizer.zero_grad()
            loss = model(ids, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    assert dynamo_backend.stats["compiled"] >= 1 and not dynamo_backend.fallbacks


def test_dynamic_lengths_compile_once_and_match() -> None:
    """TorchDynamo makes the length dynamic on the second length: rlx binds it per call."""
    torch.manual_seed(1)
    model = Block().eval()
    compiled = torch.compile(model, backend="rlx")
    for length in (5, 7, 12, 3):
        ids, targets = _batch(length, length)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, targets), model(ids, targets), rtol=1e-5, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 2, "eager": 0}, dynamo_backend.fallbacks


@pytest.mark.parametrize("case", ["bool-mask", "float-mask", "decode-causal", "scale", "gqa", "plain", "no-grad-mask"])
def test_attention_calls(case: str) -> None:
    gen = torch.Generator().manual_seed(2)
    sq = 1 if case == "decode-causal" else 6
    heads_kv = 2 if case == "gqa" else 4
    q = torch.randn(2, 4, sq, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, heads_kv, 6, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, heads_kv, 6, 8, generator=gen, requires_grad=True)
    bool_mask = torch.rand(sq, 6, generator=gen) > 0.3
    float_mask = torch.randn(2, 1, sq, 6, generator=gen)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if case in ("bool-mask", "no-grad-mask"):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
        if case == "float-mask":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)
        if case == "decode-causal":  # torch's causal mask is top-left aligned
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if case == "scale":
            return F.scaled_dot_product_attention(q, k, v, scale=0.3)
        if case == "gqa":
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v)

    want = attend(q, k, v)
    got = torch.compile(attend, backend="rlx")(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if case != "no-grad-mask":
        cotangent = torch.randn(want.shape, generator=gen)
        expected = torch.autograd.grad(want, (q, k, v), cotangent)
        actual = torch.autograd.grad(got, (q, k, v), cotangent)
        for name, a, e in zip("qkv", actual, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=name)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_what_rlx_cannot_take_runs_eagerly_with_a_warning() -> None:
    def bessel(x: torch.Tensor) -> torch.Tensor:
        return torch.special.i0(x) * 2.0

    x = torch.randn(5, 3)
    with pytest.warns(UserWarning, match="special_i0 has no rlx translation"):
        got = torch.compile(bessel, backend="rlx")(x)
    torch.testing.assert_close(got, bessel(x))
    assert dynamo_backend.stats == {"compiled": 0, "eager": 1}

    with pytest.warns(UserWarning, match="linalg_qr has no rlx translation"):
        factor = torch.compile(lambda t: torch.linalg.qr(t[:3])[1] + 1.0, backend="rlx")(x)
    torch.testing.assert_close(factor, torch.linalg.qr(x[:3])[1] + 1.0)
    with pytest.warns(UserWarning, match="float64"):
        doubled = torch.compile(lambda t: t * 2.0, backend="rlx")(torch.ones(3, dtype=torch.float64))
    assert doubled.dtype == torch.float64 and doubled.tolist() == [2.0, 2.0, 2.0]
    assert dynamo_backend.stats == {"compiled": 0, "eager": 3}, dynamo_backend.fallbacks


class ManualAttention(torch.nn.Module):
    """Attention as models wrote it before SDPA: a causal buffer, positions from ``arange``,
    ``unbind``, key heads repeated for GQA, ``masked_fill``, ``.mT``, ``F.normalize``."""

    def __init__(self, length: int = 8) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48, bias=False)
        self.positions = torch.nn.Embedding(length, 16)
        self.register_buffer("causal", torch.tril(torch.ones(length, length, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        x = x + self.positions(torch.arange(length))  # folded: arange runs once, at translation
        q, k, v = self.qkv(x).view(batch, length, 4, 3, 4).unbind(3)
        q = F.normalize(q.transpose(1, 2), dim=-1)
        k, v = (t[:, :, :2].transpose(1, 2).repeat_interleave(2, 1) for t in (k, v))
        scores = (q @ k.transpose(-2, -1)) / 2.0
        weights = scores.masked_fill(~self.causal[:length, :length], float("-inf")).softmax(-1)
        y = (weights @ v).transpose(1, 2).reshape(batch, length, -1)
        return y * torch.ones_like(y) + y.mT.sum(-1, keepdim=True).mT


def test_manual_attention_constructs_translate() -> None:
    torch.manual_seed(3)
    model = ManualAttention()
    x = torch.randn(2, 8, 16, requires_grad=True)
    got, want = torch.compile(model, backend="rlx")(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    cotangent = torch.randn(got.shape)
    for name, a, e in zip(
        ("x", "qkv", "positions"),
        torch.autograd.grad(got, (x, model.qkv.weight, model.positions.weight), cotangent),
        torch.autograd.grad(want, (x, model.qkv.weight, model.positions.weight), cotangent),
        strict=True,
    ):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=name)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


class ShiftedLoss(torch.nn.Module):
    """What transformers' causal-LM loss and GPT-2 do: positions from ``arange(S) + past``,
    ``torch.addmm`` projections, a legacy cache's empty ``torch.cat``, labels padded with -100
    and shifted, ``cross_entropy(..., ignore_index=-100)``."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(13, 8)
        self.positions = torch.nn.Embedding(32, 8)
        self.weight = torch.nn.Parameter(torch.randn(8, 13) * 0.3)
        self.bias = torch.nn.Parameter(torch.randn(13) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        x = self.tokens(ids) + self.positions(torch.arange(length) + 0)
        x = torch.cat([torch.tensor([]), x.reshape(batch * length, 8)], dim=0)
        logits = torch.addmm(self.bias, x, self.weight).view(batch, length, 13)
        labels = F.pad(ids, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.reshape(-1, 13), labels.reshape(-1), ignore_index=-100)


def test_causal_lm_loss_patterns_and_dynamic_positions() -> None:
    torch.manual_seed(4)
    model = ShiftedLoss()
    compiled = torch.compile(model, backend="rlx")
    for length in (6, 9, 4):  # the second length makes it dynamic: arange(S) is computed per call
        ids = torch.randint(0, 13, (3, length))
        got, want = compiled(ids), model(ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        grads = torch.autograd.grad(got, list(model.parameters()))
        expected = torch.autograd.grad(want, list(model.parameters()))
        for a, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 2, "eager": 0}, dynamo_backend.fallbacks


@pytest.mark.slow
def test_transformers_models_train_on_rlx() -> None:
    """GPT-2, Llama, Mistral and Qwen2 from transformers (when installed), their own loss, a
    padding mask, three lengths (TorchDynamo makes them dynamic), in training mode: GPT-2's
    dropouts draw the masks eager torch draws under the same seed, and every graph runs on rlx."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    small = {"vocab_size": 50}
    decoder = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    configs = [
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=32, **small),
        transformers.LlamaConfig(num_key_value_heads=2, max_position_embeddings=32, **decoder, **small),
        transformers.MistralConfig(num_key_value_heads=2, max_position_embeddings=32, **decoder, **small),
        transformers.Qwen2Config(num_key_value_heads=2, max_position_embeddings=32, **decoder, **small),
    ]
    for config in configs:
        eager = transformers.AutoModelForCausalLM.from_config(config).train()
        other = copy.deepcopy(eager)
        compiled = torch.compile(other, backend="rlx")
        for length in (8, 11, 6):
            ids = torch.randint(0, 50, (2, length))
            padding = torch.ones(2, length, dtype=torch.long)
            padding[1, :2] = 0  # the second sequence is padded on the left
            losses = []
            for model in (eager, compiled):
                torch.manual_seed(length)
                losses.append(model(ids, attention_mask=padding, labels=ids).loss)
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
            for loss in losses:
                loss.backward()
        for (name, a), b in zip(eager.named_parameters(), other.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


@pytest.mark.slow
def test_bert_trains_on_rlx() -> None:
    """BERT's masked-LM loss from transformers (when installed) with a right-padded attention mask,
    ignored labels and its dropouts, at three lengths: its token types are a buffer sliced to
    each call's length and gathered by positions, which rlx takes as ranges made per call."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    config = transformers.BertConfig(
        vocab_size=50, num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        max_position_embeddings=32,
    )  # fmt: skip
    eager = transformers.BertForMaskedLM(config).train()
    other = copy.deepcopy(eager)
    compiled = torch.compile(other, backend="rlx")
    for length in (8, 11, 6):
        ids = torch.randint(0, 50, (2, length))
        padding = torch.ones(2, length, dtype=torch.long)
        padding[1, -2:] = 0
        labels = ids.clone()
        labels[:, ::3] = -100
        losses = []
        for model in (eager, compiled):
            torch.manual_seed(length)
            losses.append(model(ids, attention_mask=padding, labels=labels).loss)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for loss in losses:
            loss.backward()
    for (name, a), b in zip(eager.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


def test_padding_rows_and_default_ignore_index() -> None:
    """``padding_idx``'s row gets no gradient, and targets of -100 count for nothing even when
    ``ignore_index`` is left at torch's default."""
    torch.manual_seed(6)
    table = torch.nn.Embedding(9, 4, padding_idx=0)
    head = torch.nn.Linear(4, 9)

    def loss(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(table(ids)).view(-1, 9), targets.view(-1))

    ids = torch.tensor([[0, 3, 5, 0], [2, 0, 8, 1]])
    targets = torch.tensor([[1, -100, 4, 2], [-100, 0, 3, 8]])
    got = torch.compile(loss, backend="rlx")(ids, targets)
    got_grads = torch.autograd.grad(got, [table.weight, head.weight])
    want = loss(ids, targets)
    want_grads = torch.autograd.grad(want, [table.weight, head.weight])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, e in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
    assert torch.count_nonzero(got_grads[0][0]) == 0  # the padding row
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks

    def computed(scale: torch.Tensor) -> torch.Tensor:  # a table that is no input, ids a constant
        return F.embedding(torch.tensor([[0, 2], [2, 1]]), table.weight * scale, padding_idx=2).square().sum()

    scale = torch.tensor(1.5, requires_grad=True)
    got, want = torch.compile(computed, backend="rlx")(scale), computed(scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, e in zip(
        torch.autograd.grad(got, [scale, table.weight]), torch.autograd.grad(want, [scale, table.weight]), strict=True
    ):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


EINSUMS = [
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
    ("bhqk,bhkd->bhqd", [(2, 3, 4, 6), (2, 3, 6, 5)]),
    ("ij->ji", [(3, 4)]),
    ("ij->", [(3, 4)]),
    ("i,j->ij", [(3,), (4,)]),
    ("abc,cd,de->abe", [(2, 3, 4), (4, 5), (5, 6)]),
    ("ij,ij->i", [(3, 4), (3, 4)]),
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit output
    ("ijk,jl->li", [(2, 3, 4), (3, 5)]),  # k summed out before the product
    ("ii->i", [(3, 3)]),  # a diagonal
    ("...ij,...jk", [(2, 1, 2, 3), (4, 3, 5)]),  # '...' broadcasts
]


@pytest.mark.parametrize(("equation", "shapes"), EINSUMS, ids=[e for e, _ in EINSUMS])
def test_einsum_values_and_gradients(equation: str, shapes: list[tuple[int, ...]]) -> None:
    gen = torch.Generator().manual_seed(7)
    operands = [torch.randn(shape, generator=gen, requires_grad=True) for shape in shapes]

    def contract(*xs: torch.Tensor) -> torch.Tensor:
        return torch.einsum(equation, *xs)

    got, want = torch.compile(contract, backend="rlx")(*operands), contract(*operands)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn(want.shape, generator=gen)
    for a, e in zip(
        torch.autograd.grad(got, operands, cotangent), torch.autograd.grad(want, operands, cotangent), strict=True
    ):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_torch_type_promotion_and_counts() -> None:
    """torch promotes bool and int tensors beside floats (and ``/`` of ints) to float, a bool
    beside an int to int; ``mask.sum()`` is an int64 count."""

    def mixed(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = x > 0
        y = x * m + i / 2 + i * 1.5 + torch.where(m, i, 0.5) + (m + 1) + (i.int() + i)
        return y, (x * m).sum() / m.sum(), m.sum(-1), i == 3

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(8))
    i = torch.randint(0, 5, (4, 6), generator=torch.Generator().manual_seed(9))
    got, want = torch.compile(mixed, backend="rlx")(x, i), mixed(x, i)
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_dropout_while_training_draws_torchs_masks() -> None:
    """Dropout's masks are drawn per call from torch's generator in the graph's order, as eager
    torch draws them: with the same seed the compiled model's outputs and gradients equal eager's,
    at every length."""
    torch.manual_seed(10)
    model = Block().train()
    compiled = torch.compile(model, backend="rlx")
    for length in (6, 9):
        ids, targets = _batch(length, length)
        torch.manual_seed(length)
        got = compiled(ids, targets)
        got_grads = torch.autograd.grad(got, list(model.parameters()))
        torch.manual_seed(length)
        want = model(ids, targets)
        want_grads = torch.autograd.grad(want, list(model.parameters()))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, e in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    torch.manual_seed(0)
    first = compiled(*_batch(6, 0))
    again = compiled(*_batch(6, 0))  # a new mask per call
    assert first.item() != again.item()
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


@pytest.mark.parametrize("case", ["plain", "causal", "bool-mask", "float-mask", "gqa"])
def test_attention_dropout_draws_torchs_masks(case: str) -> None:
    """SDPA with ``dropout_p`` runs torch's math path on rlx, its keep mask drawn as eager
    SDPA draws it: under one seed, values and gradients equal eager torch's."""
    gen = torch.Generator().manual_seed(11)
    kv_heads = 1 if case == "gqa" else 3
    q = torch.randn(2, 3, 5, 4, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 5, 4, generator=gen, requires_grad=True) for _ in range(2))
    mask = {"bool-mask": torch.rand(5, 5, generator=gen) > 0.2, "float-mask": torch.randn(2, 1, 5, 5, generator=gen)}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.get(case), dropout_p=0.25, is_causal=case == "causal", enable_gqa=case == "gqa"
        )

    torch.manual_seed(12)
    got = torch.compile(attend, backend="rlx")(q, k, v)
    torch.manual_seed(12)
    want = attend(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    cotangent = torch.randn(want.shape, generator=gen)
    for a, e in zip(
        torch.autograd.grad(got, (q, k, v), cotangent), torch.autograd.grad(want, (q, k, v), cotangent), strict=True
    ):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_masks_built_by_indexing_with_ranges() -> None:
    """transformers builds padding masks by advanced indexing with broadcast ranges
    (``mask[batch[:, None, None, None], keys[None, None, None, :]]``) and BERT gathers token
    types by positions: with constant ranges these are slices, transposes and broadcasts."""

    def build(padding: torch.Tensor, x: torch.Tensor, types: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = torch.arange(padding.shape[0])[:, None, None, None]
        keys = torch.arange(padding.shape[1])[None, None, None, :]
        queries = torch.arange(padding.shape[1])[None, None, :, None]
        mask = padding[batch, keys].bool() & (keys <= queries)
        window = x[torch.arange(3)[:, None], torch.arange(1, 5)[None, :]]
        row = x[torch.tensor(2), torch.arange(6)]
        kinds = torch.gather(types.expand(1, -1), 1, torch.arange(2, 7)[None, :])
        return mask, window * 2.0, row + 1.0, kinds

    padding = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]])
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(13))
    types = torch.arange(10)
    got, want = torch.compile(build, backend="rlx")(padding, x, types), build(padding, x, types)
    for a, e in zip(got, want, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        torch.testing.assert_close(a, e)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_rows_picked_by_index_tensors() -> None:
    """``table[ids]``, ``index_select`` and ``gather`` by index tensors (inputs), float and int
    tables, with the float table's gradient (repeated ids add)."""

    def pick(table: torch.Tensor, kinds: torch.Tensor, ids: torch.Tensor, row: torch.Tensor) -> tuple[Any, ...]:
        return (
            table[ids] * 2.0,
            torch.index_select(table, 1, ids[0]),
            kinds[ids],
            torch.gather(kinds[None, :], 1, row) + 1,
        )

    table = torch.randn(5, 4, generator=torch.Generator().manual_seed(14), requires_grad=True)
    kinds = torch.tensor([3, 1, 4, 1, 5])
    ids = torch.tensor([[0, 3, 3], [2, 1, 0]])
    row = torch.tensor([[4, 0, 2]])
    got, want = torch.compile(pick, backend="rlx")(table, kinds, ids, row), pick(table, kinds, ids, row)
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e)
    grads = [torch.autograd.grad(outs[0].sum() + outs[1].sum(), table)[0] for outs in (got, want)]
    torch.testing.assert_close(grads[0], grads[1])
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_precision_models_compute_in_float32(half: torch.dtype) -> None:
    """A bfloat16 or float16 model runs on rlx in float32 (as rlx.torch's SDPA does): outputs
    come back in the dtypes TorchDynamo traced, gradients reach the half parameters in their
    dtype, and both are as close to the float32 model's as one rounding to the half dtype."""
    torch.manual_seed(15)
    exact = Block().eval()
    model = copy.deepcopy(exact).to(half)
    ids, targets = _batch(7, 1)

    def logits_and_loss(m: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        loss = m(ids, targets)
        return m.embed(ids) * 2.0, loss

    got_embedded, got_loss = torch.compile(logits_and_loss, backend="rlx")(model)
    assert got_embedded.dtype == half
    want_embedded, want_loss = logits_and_loss(exact)
    torch.testing.assert_close(got_embedded.float(), want_embedded, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_loss.float(), want_loss, rtol=1e-2, atol=1e-2)
    got_loss.backward()
    want_loss.backward()
    for (name, a), b in zip(model.named_parameters(), exact.parameters(), strict=True):
        assert a.grad is not None and a.grad.dtype == half, name
        torch.testing.assert_close(a.grad.float(), b.grad, rtol=2e-2, atol=2e-3, msg=name)
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


def test_dynamic_true_pins_float_arguments_per_call() -> None:
    """Under ``dynamic=True`` TorchDynamo passes every Python float (a norm's eps) as a tensor
    input: rlx takes its value as a constant and checks it on every call; a call where it
    changed runs eagerly, so its result is still torch's."""
    torch.manual_seed(16)
    model = Block().eval()
    compiled = torch.compile(model, backend="rlx", dynamic=True)
    for length in (5, 9, 3):
        ids, targets = _batch(length, length)
        torch.testing.assert_close(compiled(ids, targets), model(ids, targets), rtol=1e-5, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks
    model.norm1.eps = 0.5  # the same graph, another float: this call runs eagerly
    ids, targets = _batch(6, 6)
    torch.testing.assert_close(compiled(ids, targets), model(ids, targets), rtol=1e-5, atol=1e-6)


def test_gathers_by_any_index_tensor() -> None:
    """``torch.gather`` by an index tensor (a hand-written loss picks each target's log-prob),
    ``index_select`` and ``table[ids]`` of ids computed in the graph, at three dynamic lengths:
    values and gradients as eager torch, every graph on rlx; an index out of range is an error
    of the call, as in torch."""

    def picked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, -1)
        return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean()

    def pieces(x: torch.Tensor, index: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, ...]:
        best = scores.argmax(-1)  # ids computed in the graph
        return (
            torch.gather(x, 0, index) * 2.0,
            torch.gather(x, 1, index[:, :2]),
            x.index_select(1, best),
            x[(best + 1) % x.shape[0]],
        )

    compiled_loss = torch.compile(picked_loss, backend="rlx")
    for length in (5, 7, 9):
        logits = torch.randn(3, length, 11, requires_grad=True)
        targets = torch.randint(0, 11, (3, length))
        got, want = compiled_loss(logits, targets), picked_loss(logits, targets)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.autograd.grad(got, logits)[0], torch.autograd.grad(want, logits)[0])
    compiled_pieces = torch.compile(pieces, backend="rlx")
    x = torch.randn(4, 6, requires_grad=True)
    index = torch.randint(0, 4, (3, 6))
    scores = torch.randn(5, 6)
    got_all, want_all = compiled_pieces(x, index, scores), pieces(x, index, scores)
    for got, want in zip(got_all, want_all, strict=True):
        torch.testing.assert_close(got, want)
    cotangents = [torch.randn_like(t) for t in want_all]
    for got, want in zip(
        torch.autograd.grad(got_all, x, cotangents), torch.autograd.grad(want_all, x, cotangents), strict=True
    ):
        torch.testing.assert_close(got, want)
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks
    with pytest.raises(RlxValueError, match="out of range"):
        compiled_pieces(x, torch.full((3, 6), 4), scores)


def test_slices_with_a_dynamic_bound() -> None:
    """``self.positions[:, :length]`` (learned positions, a buffer of token types) at changing
    lengths: a range of the axis made per call, so one graph serves every length, gradients reach
    the sliced parameter, and a length past the table's is an error of the call."""

    class Positions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.positions = torch.nn.Parameter(torch.randn(1, 16, 8))
            self.register_buffer("types", torch.arange(16).remainder(3)[None])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            length = x.shape[1]
            kinds = self.types[:, :length].expand(x.shape[0], length)
            return (x + self.positions[:, :length]) * (kinds[..., None] + 1.0)

    torch.manual_seed(9)
    eager = Positions()
    other = copy.deepcopy(eager)
    compiled = torch.compile(other, backend="rlx")
    for length in (5, 11, 7, 16):
        x = torch.randn(2, length, 8)
        got, want = compiled(x), eager(x)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
    torch.testing.assert_close(other.positions.grad, eager.positions.grad)
    assert dynamo_backend.stats == {"compiled": 2, "eager": 0}, dynamo_backend.fallbacks


def test_floor_division_remainder_and_rounding() -> None:
    """``//``, ``%``, ``torch.div`` with each rounding mode, ``torch.remainder`` and the rounding
    functions, of float and int tensors and Python numbers: torch's values and dtypes."""

    def arithmetic(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            x // 0.7,
            x % 1.3,
            torch.remainder(x, -2.0),
            torch.div(x, 0.6, rounding_mode="trunc"),
            torch.div(x, 0.6, rounding_mode="floor"),
            i // 3,
            i % 4,
            torch.div(i, -3, rounding_mode="trunc"),
            i.remainder(5),
            torch.fmod(x, -1.3),
            i.fmod(4),
            torch.floor(x),
            torch.round(x),
            x.ceil(),
            x.trunc(),
            (i % 3).float() * x,
        )

    x = torch.randn(5, 7) * 4
    i = torch.randint(-20, 20, (5, 7))
    for got, want in zip(torch.compile(arithmetic, backend="rlx")(x, i), arithmetic(x, i), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_running_sums() -> None:
    """``cumsum`` as torch computes it: floats (with gradients), and bools and ints in int64, as
    transformers derives positions from a left-padded mask (``mask.long().cumsum(-1) - 1``)."""

    def sums(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        return (
            torch.cumsum(x, dim=1) * 2.0,
            x.cumsum(0),
            positions,
            mask.bool().cumsum(1),
            torch.cumsum(mask, 1, dtype=torch.float32),
        )

    x = torch.randn(3, 6, requires_grad=True)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0
    got, want = torch.compile(sums, backend="rlx")(x, mask), sums(x, mask)
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e)
    cotangents = [torch.randn_like(t) for t in want[:2]]
    torch.testing.assert_close(
        torch.autograd.grad(got[:2], x, cotangents)[0], torch.autograd.grad(want[:2], x, cotangents)[0]
    )
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_updates_in_place_and_assignments() -> None:
    """``x += y``, ``x[i] = v``, ``x[i] += v``, ``x.masked_fill_``, ``x[mask] = 0`` on tensors the
    graph made (T5 shifts its labels so): the updated values, gradients through them, every later
    read seeing the update. An input updated in place is updated in the caller's tensor; an
    update that another tensor sharing the memory would see stays eager."""

    def updates(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2.0
        y[:, 0] = 1.5
        y[1:, 2:4] = x[:-1, :2]
        y[..., -1] += 3.0
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 7
        shifted.masked_fill_(shifted == 3, 0)
        w = x.clone()
        w[w < 0] = 0.0
        w[torch.tensor([3, 0]), torch.tensor([-1, 2])] = x[0, :2] * 4.0  # by index tensors: a scatter
        w[:, [1, 4]] += 1.0
        y += w
        y.mul_(torch.full((4, 1), 0.5))
        return y, shifted

    x = torch.randn(4, 6, requires_grad=True)
    ids = torch.randint(0, 5, (4, 6))
    got, want = torch.compile(updates, backend="rlx")(x, ids), updates(x, ids)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e)
    torch.testing.assert_close(
        torch.autograd.grad(got[0].square().sum(), x)[0], torch.autograd.grad(want[0].square().sum(), x)[0]
    )
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks

    def update_input(t: torch.Tensor) -> torch.Tensor:
        t[:, 0] = 0.0
        return t * 2.0

    given = torch.randn(3, 3)
    copied = given.clone()
    result = torch.compile(update_input, backend="rlx")(given)
    torch.testing.assert_close(result, update_input(copied))
    torch.testing.assert_close(given, copied)  # the caller sees the update, as in eager torch
    assert dynamo_backend.stats == {"compiled": 2, "eager": 0}, dynamo_backend.fallbacks

    def update_shared(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = t * 2.0
        same = y.contiguous()  # the same tensor: it sees the update
        part = y[0]  # a view: it sees the update too
        y += 1.0
        return same * 1.0, part + 0.0

    with pytest.warns(UserWarning, match="iadd of a tensor sharing its memory"):
        shared = torch.compile(update_shared, backend="rlx")(given)
    for a, e in zip(shared, update_shared(given), strict=True):
        torch.testing.assert_close(a, e)


def test_minima_and_tensors_of_dynamic_sizes() -> None:
    """``torch.min`` in each form, ``amin``, ``argmin``, and ``torch.zeros``/``full`` of a dynamic
    length (T5's relative position buckets), over three lengths."""

    def buckets(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        length = x.shape[1]
        large = torch.full((length,), 5, dtype=torch.long) + torch.arange(length)
        capped = torch.min(large, torch.full_like(large, 7))
        values, positions = x.min(dim=-1)
        return capped, values, positions, torch.amin(x, dim=(0, 2)), x.argmin(-1), torch.zeros(2, length) + x[:, :, 0]

    compiled = torch.compile(buckets, backend="rlx")
    for length in (5, 8, 3):
        x = torch.randn(2, length, 4)
        for a, e in zip(compiled(x), buckets(x), strict=True):
            assert a.dtype == e.dtype
            torch.testing.assert_close(a, e)
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


@pytest.mark.slow
def test_more_transformers_models_train_on_rlx() -> None:
    """Eleven more families from transformers (when installed), training with a left-padded
    mask at three lengths against eager copies: encoders (RoBERTa, whose positions are a cumsum
    of the mask; DistilBERT; ELECTRA), an encoder-decoder (T5: labels shifted by assignment,
    relative position buckets), decoders (GPT-NeoX, Phi, Gemma, OPT, Falcon, GPT-Neo with local
    attention, GPT-BigCode), with no graph left to torch."""
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 64}
    width = {"hidden_size": 32, "num_attention_heads": 4}
    configs = {
        "roberta": transformers.RobertaConfig(
            **small, **width, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=40
        ),
        "distilbert": transformers.DistilBertConfig(
            **small, n_layers=2, dim=32, hidden_dim=64, n_heads=4, max_position_embeddings=40
        ),
        "electra": transformers.ElectraConfig(
            **small, **width, embedding_size=32, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=40
        ),
        "t5": transformers.T5Config(
            **small, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
        ),
        "gpt_neox": transformers.GPTNeoXConfig(
            **small, **width, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=40
        ),
        "phi": transformers.PhiConfig(**small, **width, num_hidden_layers=2, intermediate_size=64),
        "gemma": transformers.GemmaConfig(
            **small, **width, num_hidden_layers=2, num_key_value_heads=1, head_dim=8, intermediate_size=64
        ),
        "opt": transformers.OPTConfig(
            **small, **width, num_hidden_layers=2, ffn_dim=64, max_position_embeddings=40, word_embed_proj_dim=32
        ),
        "falcon": transformers.FalconConfig(**small, **width, num_hidden_layers=2),
        "gpt_neo": transformers.GPTNeoConfig(
            **small, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
            max_position_embeddings=40, window_size=4, bos_token_id=0, eos_token_id=0,
        ),
        "gpt_bigcode": transformers.GPTBigCodeConfig(**small, n_embd=32, n_layer=2, n_head=4, n_positions=40),
    }  # fmt: skip
    for name, config in configs.items():
        torch.manual_seed(7)
        if name in ("roberta", "distilbert", "electra"):
            eager = transformers.AutoModelForMaskedLM.from_config(config).train()
        elif name == "t5":
            eager = transformers.T5ForConditionalGeneration(config).train()
        else:
            eager = transformers.AutoModelForCausalLM.from_config(config).train()
        other = copy.deepcopy(eager)
        compiled = torch.compile(other, backend="rlx")
        for length in (8, 11, 6):
            ids = torch.randint(1, 64, (2, length))
            padding = torch.ones(2, length, dtype=torch.long)
            padding[1, :2] = 0
            labels = ids[:, :5].contiguous() if name == "t5" else ids
            losses = []
            for model in (eager, compiled):
                torch.manual_seed(length)
                losses.append(model(input_ids=ids, attention_mask=padding, labels=labels).loss)
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6, msg=name)
            for loss in losses:
                loss.backward()
        for (parameter, a), b in zip(eager.named_parameters(), other.parameters(), strict=True):
            if a.grad is not None:
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=f"{name} {parameter}")
        torch._dynamo.reset()
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


def test_a_convolutional_network_trains() -> None:
    """``nn.Conv2d`` (padding, stride, groups) and ``nn.Conv1d`` with ReLU, flatten, a linear head
    and cross-entropy: the loss and every parameter's gradient as eager torch's, all on rlx."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.second = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2)
            self.third = torch.nn.Conv1d(16, 4, 2)
            self.head = torch.nn.Linear(4 * 63, 10)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.second(torch.relu(self.first(x)))).flatten(2)
            return F.cross_entropy(self.head(self.third(h).flatten(1)), y)

    torch.manual_seed(0)
    eager = Net()
    other = copy.deepcopy(eager)
    x, y = torch.randn(5, 3, 16, 16), torch.randint(0, 10, (5,))
    got, want = torch.compile(other, backend="rlx")(x, y), eager(x, y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.backward()
    want.backward()
    for a, e in zip(other.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_a_convolutional_autoencoder_trains() -> None:
    """A depthwise ``nn.Conv2d`` and ``nn.ConvTranspose2d`` upsampling (stride 2, output padding,
    groups) and a ``ConvTranspose1d``: the loss and every gradient as eager torch's, all on rlx."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.down = torch.nn.Conv2d(4, 8, 3, stride=2, padding=1)
            self.depthwise = torch.nn.Conv2d(8, 8, 5, padding=2, groups=8)
            self.up = torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
            self.line = torch.nn.ConvTranspose1d(4, 2, 4, stride=1, padding=1, dilation=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.up(torch.relu(self.depthwise(torch.relu(self.down(x)))))
            return (self.line(h.flatten(2)) ** 2).mean() + ((h - x) ** 2).mean()

    torch.manual_seed(0)
    eager = Net()
    other = copy.deepcopy(eager)
    x = torch.randn(3, 4, 10, 10)
    got, want = torch.compile(other, backend="rlx")(x), eager(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.backward()
    want.backward()
    for a, e in zip(other.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_batch_norm_and_pooling_with_running_statistics() -> None:
    """``nn.BatchNorm2d`` in training (its running statistics and counter, buffers updated in
    place, copied back into the module after each call, as eager torch leaves them) and in
    evaluation, with max, average and adaptive pooling: a ResNet stem, against an eager copy."""

    class Stem(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
            self.norm = torch.nn.BatchNorm2d(8)
            self.pool = torch.nn.MaxPool2d(3, stride=2, padding=1)
            self.mean = torch.nn.AvgPool2d(2, count_include_pad=False, padding=1)
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.mean(self.pool(torch.relu(self.norm(self.conv(x)))))
            return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))

    torch.manual_seed(3)
    eager = Stem()
    other = copy.deepcopy(eager)
    compiled = torch.compile(other, backend="rlx")
    for step in range(2):
        x = torch.randn(4, 3, 16, 16) + step
        got, want = compiled(x), eager(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got.square().sum().backward()
        want.square().sum().backward()
    for (name, a), b in zip(eager.named_buffers(), other.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    for (name, a), b in zip(eager.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    eager.eval()
    other.eval()
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


def test_pooling_in_ceil_mode_and_adaptive_to_any_size() -> None:
    """Pooling as older image models write it: ``MaxPool2d(ceil_mode=True)`` (GoogLeNet,
    SqueezeNet), an average with ``divisor_override``, and adaptive pooling to sizes that do not
    divide the input (7x7 from 10x10, average and max): one graph, values and gradients as eager."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
            self.pool = torch.nn.MaxPool2d(3, stride=2, ceil_mode=True)
            self.mean = torch.nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, divisor_override=5)
            self.head = torch.nn.Linear(6 * 7 * 7 * 2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.conv(x))
            a = F.adaptive_avg_pool2d(self.pool(h), 7)
            b = F.adaptive_max_pool2d(self.mean(h) + h[:, :, ::2, ::2], (7, None))[..., :7]
            return self.head(torch.cat([a, b], dim=1).flatten(1))

    torch.manual_seed(4)
    eager = Net()
    other = copy.deepcopy(eager)
    x = torch.randn(2, 3, 21, 21)
    got, want = torch.compile(other, backend="rlx")(x), eager(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, a), b in zip(eager.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_splits_into_sections() -> None:
    """``torch.tensor_split`` into sections (the first ones longer) and at indices; ``chunk`` of a
    dynamic axis and a split into an empty part fall back with a warning naming why."""

    def sections(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, b, c = torch.tensor_split(x, 3, dim=1)
        d, e = x.tensor_split([2], dim=0)
        return a * 2.0, b + c.sum(), d - 1.0, e

    x = torch.randn(5, 7)
    for got, want in zip(torch.compile(sections, backend="rlx")(x), sections(x), strict=True):
        torch.testing.assert_close(got, want)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks
    with pytest.warns(UserWarning, match="empty part"):
        empty = torch.compile(lambda t: [p * 2.0 for p in t.tensor_split([0, 3], dim=1)], backend="rlx")(x)
    assert [tuple(p.shape) for p in empty] == [(5, 0), (5, 3), (5, 4)]


LOSSES: list[tuple[str, Any]] = [
    ("cross_entropy weights smoothing", lambda x, t, p: F.cross_entropy(x, t, weight=p[0].abs(), label_smoothing=0.1)),
    ("cross_entropy sum ignore", lambda x, t, p: F.cross_entropy(x, t, ignore_index=2, reduction="sum")),
    ("cross_entropy none", lambda x, t, p: F.cross_entropy(x, t, reduction="none") * p[1]),
    ("cross_entropy classes on axis 1", lambda x, t, p: F.cross_entropy(x.view(2, 3, 5).transpose(1, 2), t.view(2, 3))),
    ("nll_loss", lambda x, t, p: F.nll_loss(F.log_softmax(x, -1), t, weight=p[0].abs() + 0.5)),
    ("mse_loss", lambda x, t, p: F.mse_loss(x, p[2])),
    ("l1_loss sum", lambda x, t, p: F.l1_loss(x, p[2], reduction="sum")),
    ("smooth_l1_loss", lambda x, t, p: F.smooth_l1_loss(x, p[2] * 3.0, beta=0.5)),
    ("huber_loss", lambda x, t, p: F.huber_loss(x, p[2] * 3.0, delta=0.7)),
    ("bce with logits",
     lambda x, t, p: F.binary_cross_entropy_with_logits(x * 4.0, p[2].sigmoid(), pos_weight=p[0].abs())),
    ("bce", lambda x, t, p: F.binary_cross_entropy(x.sigmoid(), p[2].sigmoid(), reduction="sum")),
    ("kl_div batchmean", lambda x, t, p: F.kl_div(F.log_softmax(x, -1), F.softmax(p[2], -1), reduction="batchmean")),
    ("logsumexp", lambda x, t, p: torch.logsumexp(x, dim=-1).sum() + x.logsumexp((0, 1))),
    ("activations", lambda x, t, p: sum(
        f(x).square().sum() for f in (F.logsigmoid, F.leaky_relu, F.elu, F.relu6, F.hardtanh, F.mish, F.hardswish,
                                      F.hardsigmoid)
    )),
    ("glu and one_hot", lambda x, t, p: (F.glu(x[:, :4]) * F.one_hot(t, 5)[:, :2]).sum()),
]  # fmt: skip


@pytest.mark.parametrize(("name", "loss"), LOSSES, ids=[n for n, _ in LOSSES])
def test_losses_and_activations(name: str, loss: Any) -> None:
    """torch's losses (class weights, label smoothing, ignored targets, reductions, classes on
    axis 1) and activations: values and gradients as eager torch's, the graph on rlx."""
    torch.manual_seed(4)
    x = torch.randn(6, 5, requires_grad=True)
    targets = torch.tensor([0, 2, 4, 1, 2, 3])
    extras = [torch.randn(5), torch.randn(6), torch.randn(6, 5)]
    got, want = torch.compile(loss, backend="rlx")(x, targets, extras), loss(x, targets, extras)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cotangent = torch.randn_like(want)
    torch.testing.assert_close(
        torch.autograd.grad(got, x, cotangent)[0], torch.autograd.grad(want, x, cotangent)[0], rtol=1e-4, atol=1e-5
    )
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


def test_triangles_rolls_upsampling_and_cosines() -> None:
    """``tril``/``triu`` of values (at dynamic lengths too), ``roll`` (of static axes; along a
    dynamic one it is left to torch, whose shift wraps by each call's length), nearest
    ``interpolate`` by whole factors and ``cosine_similarity``: values and gradients as eager
    torch's."""

    def shapes(x: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        square = x @ x.transpose(-1, -2)
        return (
            torch.tril(square),
            square.triu(1),
            torch.roll(image, 2, dims=3),
            x.roll((1, -1), (0, 2)),
            torch.roll(image, 5),
            F.interpolate(image, scale_factor=2),
            F.interpolate(image, size=(6, 9)),
            F.cosine_similarity(x, x.detach() * 2.0 - 0.5, dim=-1),  # detach: no gradient that way
        )

    compiled = torch.compile(shapes, backend="rlx")
    for length in (4, 6, 5):
        x = torch.randn(2, length, 3, requires_grad=True)
        image = torch.randn(1, 2, 3, 3, requires_grad=True)
        got, want = compiled(x, image), shapes(x, image)
        for a, e in zip(got, want, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
        cotangents = [torch.randn_like(t) for t in want]
        for a, e in zip(
            torch.autograd.grad(got, (x, image), cotangents), torch.autograd.grad(want, (x, image), cotangents),
            strict=True,
        ):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


def test_detach_stops_gradients() -> None:
    """``x.detach()`` and ``torch.detach``: the values, with no gradient through them."""

    def held(x: torch.Tensor) -> torch.Tensor:
        target = (x * 2.0).detach()
        return ((x - target) ** 2).sum() + (x * torch.detach(x.exp())).sum()

    x = torch.randn(3, 4, requires_grad=True)
    got, want = torch.compile(held, backend="rlx")(x), held(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0])
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_norms_shuffles_flips_and_variances() -> None:
    """``F.group_norm``, ``F.instance_norm``, ``F.layer_norm`` over two axes, ``pixel_shuffle``
    and its inverse, ``torch.flip``, ``var``/``std`` in their spellings (``correction``,
    ``unbiased``, positional) and ``F.unfold``: values and gradients as eager torch's, all on rlx."""

    def pieces(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            F.group_norm(x, 2, w, b, eps=1e-4),
            F.group_norm(x, 4),
            F.instance_norm(x, weight=w, bias=b),
            F.layer_norm(x, x.shape[-2:], x[0, 0].detach() + 1.0, x[0, 1].detach()),
            F.pixel_shuffle(x, 2),
            F.pixel_unshuffle(F.pixel_shuffle(x, 2) * 2.0, 2),
            torch.flip(x, (1, 3)),
            x.flip(-1),
            x.var(),
            torch.var(x, dim=(2, 3), keepdim=True),
            x.std(1, unbiased=False),
            torch.std(x, dim=-1, correction=0),
            x.var(2, True, True),
            torch.std(x, False),
            F.unfold(x, (2, 3), padding=1, stride=(1, 2)),
            F.unfold(x, 3, dilation=2),
        )

    compiled = torch.compile(pieces, backend="rlx")
    torch.manual_seed(5)
    x = torch.randn(3, 4, 6, 5, requires_grad=True)
    w, b = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    got, want = compiled(x, w, b), pieces(x, w, b)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    cotangents = [torch.randn_like(t) for t in want]
    for a, e in zip(
        torch.autograd.grad(got, (x, w, b), cotangents), torch.autograd.grad(want, (x, w, b), cotangents), strict=True
    ):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


@pytest.mark.parametrize(
    ("mode", "corners", "shape"),
    [("nearest", None, (2, 3, 4, 5)), ("nearest-exact", None, (2, 3, 4, 5)), ("bilinear", False, (2, 3, 4, 5)),
     ("bilinear", True, (2, 3, 4, 5)), ("linear", False, (2, 3, 6)), ("trilinear", True, (1, 2, 3, 4, 3)),
     ("bicubic", False, (2, 3, 4, 5)), ("bicubic", True, (2, 3, 4, 5)), ("area", None, (2, 3, 4, 5)),
     ("area", None, (1, 2, 6)), ("area", None, (1, 2, 3, 4, 3))],
)  # fmt: skip
def test_interpolate_modes_sample_as_torch(mode: str, corners: bool | None, shape: tuple[int, ...]) -> None:
    """``F.interpolate`` by sizes and by factors (whole, fractional, below 1, recomputed): the
    sampled values and their gradients as eager torch's."""
    spatial = len(shape) - 2
    options = [
        {"scale_factor": 2},
        {"size": tuple([5, 7, 2][:spatial])},
        {"scale_factor": tuple([1.5, 0.5, 2.0][:spatial])},
        {"scale_factor": 2.3, "recompute_scale_factor": True},
        {"scale_factor": 0.7},
    ]
    for kwargs in options:
        if corners is not None:
            kwargs["align_corners"] = corners

        def sample(x: torch.Tensor, kwargs: dict = kwargs) -> torch.Tensor:
            return F.interpolate(x, mode=mode, **kwargs)

        torch._dynamo.reset()
        x = torch.randn(*shape, requires_grad=True)
        got, want = torch.compile(sample, backend="rlx")(x), sample(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(kwargs))
        cotangent = torch.randn_like(want)
        torch.testing.assert_close(
            torch.autograd.grad(got, x, cotangent)[0], torch.autograd.grad(want, x, cotangent)[0], rtol=1e-4, atol=1e-5
        )
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


@pytest.mark.parametrize("need_weights", [False, True])
def test_multi_head_attention_modules(need_weights: bool) -> None:
    """``nn.MultiheadAttention`` (batch first and not, separate key/value widths, a bool causal
    ``attn_mask``, a bool ``key_padding_mask``, a float mask per head, the averaged weights
    returned): outputs and gradients as eager torch's, all on rlx."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.MultiheadAttention(16, 4, batch_first=True)
            self.second = torch.nn.MultiheadAttention(16, 2, kdim=8, vdim=12)

        def forward(self, x: torch.Tensor, memory: torch.Tensor, values: torch.Tensor, pad: torch.Tensor) -> Any:
            length = x.shape[1]
            causal = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
            a, wa = self.first(x, x, x, attn_mask=causal, key_padding_mask=pad, need_weights=need_weights)
            keys = memory.shape[0]
            bias = torch.linspace(-1.0, 1.0, 2 * x.shape[0] * length * keys).view(-1, length, keys)
            b, wb = self.second(a.transpose(0, 1), memory, values, attn_mask=bias, need_weights=need_weights,
                                average_attn_weights=False)  # fmt: skip
            loss = (b**2).mean()
            return (loss, wa, wb) if need_weights else loss

    torch.manual_seed(6)
    eager = Net()
    other = copy.deepcopy(eager)
    x, memory, values = torch.randn(3, 5, 16), torch.randn(7, 3, 8), torch.randn(7, 3, 12)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True  # trailing padding: every query keeps a visible key
    got, want = torch.compile(other, backend="rlx")(x, memory, values, pad), eager(x, memory, values, pad)
    for a, e in zip(got if need_weights else (got,), want if need_weights else (want,), strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    (got[0] if need_weights else got).backward()
    (want[0] if need_weights else want).backward()
    for a, e in zip(other.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def _counting_compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the graphs rlx compiles from here on (wrapping ``rlx.compile``)."""
    import rlx

    compiled: list[str] = []
    original = rlx.compile

    def counting(graph: Any, *args: Any, **kwargs: Any) -> Any:
        compiled.append(sorted(graph.outputs))
        return original(graph, *args, **kwargs)

    monkeypatch.setattr(rlx, "compile", counting)
    return compiled


def test_a_training_step_compiles_the_training_pair_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that only trains never runs the plain forward: the backend compiles the forward
    that keeps what the backward reads and that backward, two graphs, and the steps after the
    first compile nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)
    compiled = _counting_compiles(monkeypatch)
    fast = torch.compile(model, backend="rlx")
    for _ in range(3):
        fast(x).sum().backward()
    assert dynamo_backend.stats["compiled"] == 1
    assert len(compiled) == 2
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for _ in range(3):
        model(x).sum().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_inference_compiles_the_forward_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1))
    x = torch.randn(4, 8)
    compiled = _counting_compiles(monkeypatch)
    fast = torch.compile(model, backend="rlx")
    with torch.no_grad():
        got = fast(x)
        want = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(compiled) == 1


def test_rlx_torch_compile_compiles_the_forward_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlx

    g = rlx.Graph()
    x = g.input("x", (3,))
    g.output(y=g.exp(x))
    compiled = _counting_compiles(monkeypatch)
    f = rt.compile(g)
    assert len(compiled) == 1
    torch.testing.assert_close(f(x=torch.zeros(3))["y"], torch.ones(3))
    assert len(compiled) == 1
