"""Gradients a torch model shapes itself, under ``torch.compile(backend="rlx")``.

A ``torch.autograd.Function``: TorchDynamo traces its forward and backward into two graphs,
which rlx translates into one ``rlx.custom_vjp``; the model runs on rlx (no fallback) with eager
torch's values and the gradients the Function's own backward gives, not autodiff's. And
``torch.utils.checkpoint``: TorchDynamo traces the checkpointed function into a graph, which
becomes an ``rlx.checkpoint``."""

from __future__ import annotations

from typing import Any

import pytest

import rlx

torch = pytest.importorskip("torch")
dynamo_backend = pytest.importorskip("rlx.torch.dynamo")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    dynamo_backend.fallbacks.clear()
    dynamo_backend.stats.update(compiled=0, eager=0)


class StableSoftplus(torch.autograd.Function):
    """log(1 + e^x) with the gradient sigmoid(x): autodiff of the formula gives NaN at x = 100."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        ctx.save_for_backward(x)
        return torch.log1p(torch.exp(x))

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        (x,) = ctx.saved_tensors
        return g * torch.sigmoid(x)


class RoundThrough(torch.autograd.Function):
    """Rounding with a straight-through gradient, as quantisation-aware training writes it."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return torch.round(x)

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return g


class ScaledPair(torch.autograd.Function):
    """Two results (one marked non-differentiable), a float argument kept on ctx, and a weight
    whose gradient the backward leaves broadcast (torch sums it to the weight's shape)."""

    @staticmethod
    def forward(ctx: Any, x: Any, w: Any, k: float) -> Any:
        ctx.save_for_backward(x, w)
        ctx.k = k
        scaled = x * w * k
        signs = torch.sign(x)
        ctx.mark_non_differentiable(signs)
        return scaled, signs

    @staticmethod
    def backward(ctx: Any, g: Any, g_signs: Any) -> Any:
        x, w = ctx.saved_tensors
        return g * w * ctx.k, g * x * ctx.k, None


def _compiled_matches_eager(function: Any, *inputs: Any) -> None:
    leaves = [t.detach().clone().requires_grad_(t.dtype.is_floating_point) for t in inputs]
    eager_leaves = [t.detach().clone().requires_grad_(t.dtype.is_floating_point) for t in inputs]
    got, want = torch.compile(function, backend="rlx")(*leaves), function(*eager_leaves)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.backward(torch.ones_like(got))
    want.backward(torch.ones_like(want))
    for mine, theirs in zip(leaves, eager_leaves, strict=True):
        if theirs.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_a_stable_softplus_runs_on_rlx_with_its_own_gradient() -> None:
    x = torch.tensor([[-30.0, -1.0, 0.0], [2.0, 50.0, 100.0]])
    w = torch.eye(3) + 0.1
    _compiled_matches_eager(lambda x, w: StableSoftplus.apply(x @ w).sum(dim=1), x, w)
    leaf = x.clone().requires_grad_()
    torch.compile(lambda x: StableSoftplus.apply(x).sum(), backend="rlx")(leaf).backward()
    assert torch.isfinite(leaf.grad).all()  # autodiff of log1p(exp(x)) would give NaN at 100
    torch.testing.assert_close(leaf.grad, torch.sigmoid(x))


def test_a_straight_through_estimator() -> None:
    x = torch.linspace(-2, 2, 12).reshape(3, 4)
    _compiled_matches_eager(lambda x: RoundThrough.apply(x * 1.7) * x, x)


def test_several_results_a_non_differentiable_one_and_a_broadcast_weight() -> None:
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    w = torch.randn(3, generator=torch.Generator().manual_seed(4))

    def model(x: Any, w: Any) -> Any:
        scaled, signs = ScaledPair.apply(x, w, 2.5)
        return torch.tanh(scaled) * signs + scaled

    _compiled_matches_eager(model, x, w)


def test_a_model_with_a_function_trains_with_a_torch_optimizer() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 6)

    def loss_of(x: Any) -> Any:
        return (StableSoftplus.apply(layer(x)) ** 2).mean()

    compiled = torch.compile(loss_of, backend="rlx")
    optimiser = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    first = None
    for _ in range(20):
        optimiser.zero_grad()
        loss = compiled(x)
        loss.backward()
        optimiser.step()
        first = first if first is not None else loss.item()
    assert loss.item() < first
    assert dynamo_backend.stats["eager"] == 0, dynamo_backend.fallbacks


def test_activation_checkpointing_runs_on_rlx() -> None:
    """Two checkpointed residual blocks sharing their weights (so a weight reaches the second
    block both directly and through the first): loss and every gradient as eager torch's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def block(x: Any) -> Any:
        return x + second(torch.nn.functional.gelu(first(x)))

    def model(x: Any) -> Any:
        h = checkpoint(block, x, use_reentrant=False)
        return checkpoint(block, h, use_reentrant=False) * 0.5

    x = torch.randn(4, 8)
    parameters = [*first.parameters(), *second.parameters()]
    leaf = x.clone().requires_grad_()
    torch.compile(model, backend="rlx")(leaf).square().mean().backward()
    got = [leaf.grad, *(p.grad.clone() for p in parameters)]
    for p in parameters:
        p.grad = None
    eager = x.clone().requires_grad_()
    model(eager).square().mean().backward()
    for mine, theirs in zip(got, [eager.grad, *(p.grad for p in parameters)], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


@pytest.mark.parametrize("form", ["list", "function"])
def test_selective_checkpointing_saves_what_its_policy_names(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``context_fn=partial(create_selective_checkpoint_contexts, ...)``: the products it names
    (aten.mm) are kept, the rest computed again; gradients as eager torch's."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    import rlx.checkpointing

    aten = torch.ops.aten
    if form == "list":
        chosen: Any = [aten.mm.default]
    else:

        def chosen(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            return CheckpointPolicy.MUST_SAVE if op is aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, chosen)
    policies = []
    real = rlx.checkpointing.checkpoint

    def recording(fn: Any, *, policy: Any = None) -> Any:
        policies.append(policy)
        return real(fn, policy=policy)

    monkeypatch.setattr(rlx.checkpointing, "checkpoint", recording)
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def block(x: Any) -> Any:
        return x + second(torch.tanh(first(x)))

    def model(x: Any) -> Any:
        return checkpoint(block, x, use_reentrant=False, context_fn=context_fn)

    x = torch.randn(4, 8)
    parameters = [*first.parameters(), *second.parameters()]
    leaf = x.clone().requires_grad_()
    torch.compile(model, backend="rlx")(leaf).square().mean().backward()
    got = [leaf.grad, *(p.grad.clone() for p in parameters)]
    for p in parameters:
        p.grad = None
    eager = x.clone().requires_grad_()
    model(eager).square().mean().backward()
    for mine, theirs in zip(got, [eager.grad, *(p.grad for p in parameters)], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks
    (policy,) = policies
    g = rlx.Graph()
    a, b = g.input("a", (2, 3)), g.input("b", (3, 4))
    assert policy((a @ b).node) and not policy(rlx.tanh(a).node)
    assert not policy(g.custom_vjp_cotangent(a, [b]).node)  # no aten op of that name: recomputed


def test_a_context_fn_rlx_cannot_read_recomputes_everything() -> None:
    from rlx.torch._checkpoint_policy import policy_of

    assert policy_of(None) is None
    assert policy_of(lambda: None) is None

    def needs_arguments(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return args[0]  # IndexError: rlx has no tensors to give it

    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    policy = policy_of(functools.partial(create_selective_checkpoint_contexts, needs_arguments))
    g = rlx.Graph()
    a = g.input("a", (2, 2))
    assert policy is not None and not policy((a @ a).node)
