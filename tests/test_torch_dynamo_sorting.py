"""The TorchDynamo backend's sorts, order statistics, running products and extremes, gathers, scatters and
math functions (:mod:`rlx.torch._fx_sorting`): each call compiled alone must run on rlx (no
fallback) with eager torch's values, indices and gradients, ties, NaN and zeros included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dynamo_backend = pytest.importorskip("rlx.torch.dynamo")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    dynamo_backend.fallbacks.clear()
    dynamo_backend.stats.update(compiled=0, eager=0)


def _inputs(kind: str) -> Any:
    generator = torch.Generator().manual_seed(3)
    if kind == "distinct":  # no ties: every order (and so every gradient) is unique
        return (torch.randperm(42, generator=generator).reshape(6, 7).float() - 20.0) / 7.0
    if kind == "zeros":  # running products through zeros
        values = torch.rand(4, 7, generator=generator) + 0.5
        values[1, 2] = values[2, 0] = values[2, 5] = values[3, 6] = 0.0
        return values
    if kind == "unit":  # inside asin's, acos's and atanh's domain
        return torch.rand(4, 7, generator=generator) * 1.8 - 0.9
    return torch.randn(4, 7, generator=generator)


IDS = torch.tensor([[6, 0, 6], [1, 2, 3], [0, 0, 0], [4, 4, 1]])
ROWS = torch.tensor([3, 0, 3, 1])

CASES: list[tuple[str, str, Callable[..., Any]]] = [
    ("sort", "distinct", lambda a: torch.sort(a, dim=1)),
    ("sort descending dim 0", "distinct", lambda a: a.sort(0, descending=True)),
    ("sort stable with ties", "plain", lambda a: torch.sort((a * 2).round(), dim=1, stable=True)),
    ("argsort", "distinct", lambda a: torch.argsort(a, dim=0, descending=True) * 1.0 + a),
    ("msort", "distinct", torch.msort),
    ("topk", "distinct", lambda a: torch.topk(a, 3)),
    ("topk smallest dim 0", "distinct", lambda a: a.topk(2, dim=0, largest=False)),
    ("kthvalue", "distinct", lambda a: torch.kthvalue(a, 3, dim=1)),
    ("kthvalue keepdim", "distinct", lambda a: a.kthvalue(2, 0, keepdim=True)),
    ("median along a dim", "distinct", lambda a: torch.median(a, dim=1)),
    ("median of an even axis", "distinct", lambda a: a[:4].median(0)),
    ("median of everything", "distinct", torch.median),
    ("cumprod", "plain", lambda a: torch.cumprod(a, dim=1)),
    ("cumprod through zeros", "zeros", lambda a: a.cumprod(1) + torch.cumprod(a, 0)),
    ("cummax", "plain", lambda a: torch.cummax(a, dim=1)),
    ("cummin with ties", "plain", lambda a: (a * 2).round().cummin(0)),
    ("cummax of ints", "plain", lambda a: torch.cummax((a * 3).round().int(), 1).indices * 1.0 + a),
    ("logcumsumexp", "plain", lambda a: torch.logcumsumexp(a * 40.0, dim=1)),
    ("logcumsumexp dim 0", "plain", lambda a: a.logcumsumexp(0)),
    ("gather by any index", "plain", lambda a: torch.gather(a, 1, IDS)),
    ("gather of a corner", "plain", lambda a: a.gather(0, IDS[:2, :2] % 4)),
    ("scatter_add", "plain", lambda a: torch.zeros(4, 7).scatter_add(1, IDS, a[:, :3])),
    ("scatter of a number", "plain", lambda a: a.scatter(1, IDS, 2.5)),
    ("one-hot by scatter_", "plain", lambda a: torch.zeros(4, 7).scatter_(1, IDS[:, :1], 1.0) * a),
    ("index_put accumulating", "plain", lambda a: torch.zeros(5, 7).index_put((ROWS,), a, accumulate=True)),
    ("index_put of a number", "plain", lambda a: a.index_put((ROWS[:2],), torch.tensor(0.5))),
    ("atan2", "plain", lambda a: torch.atan2(a, a.flip(0)) + a.arctan2(torch.ones(7))),
    ("tan atan sinh cosh asinh", "plain", lambda a: torch.tan(a * 0.5) + a.atan() + torch.sinh(a) + a.cosh() + torch.asinh(a)),  # noqa: E501
    ("asin acos atanh", "unit", lambda a: torch.asin(a) + torch.arccos(a) + a.atanh() + torch.arcsinh(a)),
    ("acosh log2 log10 exp2", "plain", lambda a: torch.acosh(1.5 + a * a) + torch.log2(a.abs()) + a.abs().log10() + torch.exp2(a)),  # noqa: E501
]  # fmt: skip


def _floats(result: Any) -> list[Any]:
    parts = list(result) if isinstance(result, tuple) else [result]
    return [part for part in parts if part.is_floating_point()]


@pytest.mark.parametrize(("name", "kind", "function"), CASES, ids=[case[0] for case in CASES])
def test_translation_matches_eager(name: str, kind: str, function: Callable[..., Any]) -> None:
    x = _inputs(kind).requires_grad_()
    got, want = torch.compile(function, backend="rlx")(x), function(x)
    got_parts = list(got) if isinstance(got, tuple) else [got]
    want_parts = list(want) if isinstance(want, tuple) else [want]
    for mine, theirs in zip(got_parts, want_parts, strict=True):
        assert mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, equal_nan=True)
    cotangents = [torch.randn_like(part) for part in _floats(want)]
    got_grad = torch.autograd.grad(_floats(got), x, cotangents)[0]
    want_grad = torch.autograd.grad(_floats(want), x, cotangents)[0]
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-5)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_nan_sorts_as_torch_does() -> None:
    """NaN above every number: last ascending, first descending; a median of a row with NaN is
    NaN at a NaN's position."""
    x = torch.tensor([[0.5, float("nan"), -1.0, 2.0, float("nan")], [3.0, 1.0, 2.0, 0.0, -1.0]])

    def orders(a: Any) -> Any:
        return torch.sort(a, stable=True), torch.sort(a, descending=True, stable=True), torch.median(a, 1)

    got, want = torch.compile(orders, backend="rlx")(x), orders(x)
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine[0], theirs[0], equal_nan=True)
        torch.testing.assert_close(mine[1], theirs[1])
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_a_sampling_step_runs_on_rlx() -> None:
    """Top-k filtering and nucleus (top-p) filtering of logits, as text generation writes them:
    sort, cumsum of softmax, scatter back of the mask."""

    def filtered(logits: Any) -> Any:
        kth = torch.topk(logits, 5)[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
        ordered, order = torch.sort(logits, descending=True)
        cumulative = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1)
        remove = cumulative > 0.8
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        mask = remove.scatter(1, order, remove)
        return logits.masked_fill(mask, float("-inf"))

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    got = torch.compile(filtered, backend="rlx")(logits)
    torch.testing.assert_close(got, filtered(logits))
