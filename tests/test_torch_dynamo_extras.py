"""The TorchDynamo backend's less common translations (:mod:`rlx.torch._fx_extras`): padding
modes, norms and distances, activations, tensor utilities. Each call is compiled alone and must
run on rlx (no fallback) with eager torch's values and gradients, at the edges where the plain
formula would differ (a zero distance, NaN, a sign at 0)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dynamo_backend = pytest.importorskip("rlx.torch.dynamo")
F = torch.nn.functional


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    dynamo_backend.fallbacks.clear()
    dynamo_backend.stats.update(compiled=0, eager=0)


def _inputs(kind: str) -> Any:
    generator = torch.Generator().manual_seed(7)
    shapes = {"matrix": (4, 6), "image": (2, 3, 8, 8), "vector": (5,), "row": (1, 4, 6)}
    if kind == "theta":  # an affine map near the identity (no sample lands on a pixel exactly)
        return torch.eye(2, 3).expand(2, 2, 3) + 0.2 * torch.randn(2, 2, 3, generator=generator)
    if kind == "grid":
        return GRID.clone()
    if kind == "square":  # a batch of well-conditioned matrices
        return torch.randn(2, 4, 4, generator=generator) / 2 + 2 * torch.eye(4)
    return torch.randn(*shapes[kind], generator=generator)


REFLECT, REPLICATE, PRELU = torch.nn.ReflectionPad2d(2), torch.nn.ReplicationPad2d((1, 0, 2, 3)), torch.nn.PReLU(3)
BILINEAR, RESPONSE_NORM = torch.nn.Bilinear(6, 6, 3), torch.nn.LocalResponseNorm(3, alpha=0.1)
SIGNS = torch.tensor([1, -1, 1, -1])
LABELS = torch.tensor([[1, -1, 1, 1, -1, 1]] * 4)
BAGS = torch.tensor([[0, 2], [1, 3]])
DESTINATIONS = torch.tensor([0, 2, 2, 1, 3, 0, 2])
SAMPLED = torch.randn(2, 3, 7, 9, generator=torch.Generator().manual_seed(10))
GRID = torch.rand(2, 5, 6, 2, generator=torch.Generator().manual_seed(11)) * 2.4 - 1.2  # some points outside

CASES: list[tuple[str, str, Callable[..., Any]]] = [
    ("pad reflect", "image", lambda a: F.pad(a, (1, 2, 2, 1), mode="reflect")),
    ("pad reflect 1d long", "row", lambda a: F.pad(a, (3, 5), mode="reflect")),
    ("pad replicate", "image", lambda a: F.pad(a, (1, 2, 3, 1), mode="replicate")),
    ("pad circular", "image", lambda a: F.pad(a, (1, 2, 8, 1), mode="circular")),
    ("pad negative crops", "image", lambda a: F.pad(a, (-1, 2, 1, -2))),
    ("ReflectionPad2d", "image", REFLECT),
    ("ReplicationPad2d", "image", REPLICATE),
    ("selu", "matrix", F.selu),
    ("celu", "matrix", lambda a: F.celu(a, 0.7)),
    ("softsign", "matrix", F.softsign),
    ("tanhshrink", "matrix", F.tanhshrink),
    ("hardshrink", "matrix", lambda a: F.hardshrink(a, 0.4)),
    ("softshrink", "matrix", lambda a: F.softshrink(a, 0.4)),
    ("threshold", "matrix", lambda a: F.threshold(a, 0.1, -2.0)),
    ("rrelu evaluating", "matrix", lambda a: F.rrelu(a, training=False)),
    ("prelu one weight", "matrix", lambda a: F.prelu(a, torch.tensor([0.25]))),
    ("PReLU per channel", "image", PRELU),
    ("sign", "matrix", lambda a: a * torch.sign(a) + a.sign()),
    ("frac", "matrix", lambda a: torch.frac(a * 3.0) + (a * 2.0).frac()),
    ("nan_to_num of log", "matrix", lambda a: torch.nan_to_num(torch.log(a))),
    ("lerp", "matrix", lambda a: torch.lerp(a, a.flip(0), 0.3) + a.lerp(a * 2, torch.full((6,), 0.7))),
    ("addcmul addcdiv", "matrix", lambda a: torch.addcmul(a, a, a.flip(0), value=0.5) + a.addcdiv(a, a.exp())),
    ("vector_norm", "matrix", lambda a: torch.linalg.vector_norm(a, ord=3, dim=1).sum() + torch.linalg.vector_norm(a)),
    ("vector_norm inf", "matrix", lambda a: torch.linalg.vector_norm(a, ord=float("inf"), dim=0)),
    (
        "linalg.norm",
        "matrix",
        lambda a: torch.linalg.norm(a, dim=1) + torch.linalg.norm(a) + torch.linalg.norm(a, 1, 1),
    ),
    ("torch.norm", "matrix", lambda a: torch.norm(a, dim=1) + a.norm(p=1)),
    ("cdist", "matrix", lambda a: torch.cdist(a, a.flip(0) * 2)),
    ("cdist of itself", "matrix", lambda a: torch.cdist(a, a)),  # zero distances: gradient 0
    ("cdist p=1 batched", "matrix", lambda a: torch.cdist(a[None], a[None] + 1, p=1)),
    ("pdist", "matrix", F.pdist),
    ("outer", "vector", lambda a: torch.outer(a, a * 2)),
    ("diag of a vector", "vector", lambda a: torch.diag(a) + torch.diag(a, 1)[1:, :-1]),
    ("diag of a matrix", "matrix", lambda a: torch.diag(a) + torch.diag(a, 2)[:2].sum() + a.diag(-1)[:1].sum()),
    ("narrow", "matrix", lambda a: a.narrow(1, 1, 3) + torch.narrow(a, 1, -4, 3)),
    ("repeat", "matrix", lambda a: a.repeat(2, 3)),
    ("repeat with new axes", "matrix", lambda a: a.repeat(2, 1, 1)),
    ("var_mean", "matrix", lambda a: torch.var_mean(a, dim=0)[0] + torch.var_mean(a, dim=0)[1]),
    ("std_mean", "matrix", lambda a: sum(torch.std_mean(a, 1, keepdim=True, correction=0))),
    ("channel_shuffle", "image", lambda a: F.channel_shuffle(a.repeat(1, 2, 1, 1), 2)),
    ("pairwise_distance", "matrix", lambda a: F.pairwise_distance(a, a.flip(0)) + F.pairwise_distance(a, a, p=1)),
    ("cosine_embedding_loss", "matrix", lambda a: F.cosine_embedding_loss(a, a.flip(0), SIGNS, margin=0.1)),
    ("cosine_embedding_loss none", "matrix", lambda a: F.cosine_embedding_loss(a, a.flip(0), SIGNS, reduction="none")),
    ("triplet_margin_loss", "matrix", lambda a: F.triplet_margin_loss(a, a.flip(0), a.roll(1, 0))),
    ("triplet swap p=1", "matrix", lambda a: F.triplet_margin_loss(a, a.flip(0), a.roll(1, 0), swap=True, p=1)),
    ("margin_ranking_loss", "matrix", lambda a: F.margin_ranking_loss(a[:, 0], a[:, 1], SIGNS.float(), margin=0.2)),
    ("hinge_embedding_loss", "matrix", lambda a: F.hinge_embedding_loss(a, LABELS)),
    ("soft_margin_loss", "matrix", lambda a: F.soft_margin_loss(a, LABELS.float())),
    ("multi_margin_loss", "matrix", lambda a: F.multi_margin_loss(a, torch.tensor([0, 1, 2, 5]))),
    ("multi_margin_loss p=2 weighted", "matrix",
     lambda a: F.multi_margin_loss(a, torch.tensor([0, 1, 2, 5]), p=2, margin=0.5, weight=torch.arange(1.0, 7.0))),
    ("Bilinear", "matrix", lambda a: BILINEAR(a, a.flip(0))),
    ("LocalResponseNorm", "image", RESPONSE_NORM),
    ("local_response_norm even", "image", lambda a: F.local_response_norm(a, 2)),
    ("embedding_bag mean", "matrix", lambda a: F.embedding_bag(BAGS, a, mode="mean")),
    ("embedding_bag max", "matrix", lambda a: F.embedding_bag(BAGS, a, mode="max")),
    ("embedding_bag weighted", "matrix",
     lambda a: F.embedding_bag(BAGS, a, mode="sum", per_sample_weights=torch.tensor([[1.0, 2], [3, 4]]))),
    ("fold", "image", lambda a: F.fold(a.reshape(2, 12, 16), (5, 5), 2)),
    ("fold strided", "image", lambda a: F.fold(a.reshape(2, 12, 16), (8, 8), 2, stride=2)),
    ("fold of unfold", "image", lambda a: F.fold(F.unfold(a, 3, padding=1, stride=2), (8, 8), 3, padding=1, stride=2)),
    ("Tensor.unfold overlapping windows", "matrix", lambda a: a.unfold(1, 3, 1) * a[:, :4, None]),
    ("Tensor.unfold with gaps", "vector", lambda a: a.unfold(0, 2, 3).exp()),
    ("Tensor.unfold patches (a ViT's patchify)", "image",
     lambda a: a.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(2, 4, 48)),
    ("Tensor.unfold of a computed value", "row", lambda a: torch.tanh(a).unfold(-1, 4, 2).sum(-1)),
    ("linalg.solve", "square", lambda a: torch.linalg.solve(a, a[..., :2] + 1.0)),
    ("linalg.solve vectors, batch broadcast", "square", lambda a: torch.linalg.solve(a, a[0, 0])),
    ("linalg.solve left=False", "square", lambda a: torch.linalg.solve(a, a[:, :3] * 2, left=False)),
    ("linalg.solve_triangular", "square", lambda a: torch.linalg.solve_triangular(a, a[..., :3], upper=True)),
    ("linalg.solve_triangular right unit", "square",
     lambda a: torch.linalg.solve_triangular(a, a[:, :2], upper=False, left=False, unitriangular=True)),
    ("linalg.cholesky upper", "square", lambda a: torch.linalg.cholesky(a @ a.mT, upper=True)),
    ("slogdet, logdet, det", "square",
     lambda a: torch.linalg.slogdet(a)[1] + torch.logdet(a @ a.mT) + torch.det(a) * a.slogdet()[0]),
    ("inv", "square", lambda a: torch.linalg.inv(a) + a.inverse() * 2),
    # Symmetric inputs, as eigh is for (on others torch's gradient takes the input as symmetric,
    # rlx's is the derivative of reading one triangle), and uses of the vectors free of their signs.
    ("eigh, sign-free uses", "square",
     lambda a: (lambda w, v: v * v * w.unsqueeze(-2) + (v * w.unsqueeze(-2)) @ v.mT)(*torch.linalg.eigh(a + a.mT))),
    ("svd, sign-free uses", "matrix",
     lambda a: (lambda u, s, vh: (u * s.unsqueeze(-2)) @ vh + (vh * vh).sum())(*torch.linalg.svd(a, False))),
    ("svdvals and matrix norms", "square",
     lambda a: torch.linalg.svdvals(a).sum(-1) + torch.linalg.matrix_norm(a, "nuc") + torch.linalg.norm(a, 2, (-1, -2))
     + torch.linalg.matrix_norm(a, -1, keepdim=True).squeeze()),
    ("eigvalsh upper", "square", lambda a: torch.linalg.eigvalsh(a @ a.mT + a + a.mT, UPLO="U")),
    ("advanced index: rows from the end", "matrix", lambda a: a[torch.tensor([-1, 0, -1])]),
    ("advanced index: points", "matrix", lambda a: a[torch.tensor([[0, 3], [2, 2]]), torch.tensor([5, -6])]),
    ("advanced index: apart", "image", lambda a: a[torch.tensor([1, 0]), :, torch.tensor([7, 2])]),
    ("advanced index: list and slice", "image", lambda a: a[:, [2, 0], 1:5]),
    ("index_add", "matrix", lambda a: torch.zeros(4, 6).index_add(0, torch.tensor([0, 2, 2, 1]), a)),
    ("index_add alpha axis 1", "matrix", lambda a: a.index_add(1, torch.tensor([5, 0, 5]), a[:, :3] * 2, alpha=0.5)),
    ("index_add_ messages", "matrix",  # a graph network's sum of messages at their destinations
     lambda a: torch.zeros(5, 6).index_add_(0, DESTINATIONS, a[DESTINATIONS % 4])),
    ("index_add axis 2", "image", lambda a: a.index_add(2, torch.tensor([1, 1, 7]), a[:, :, :3])),
    ("scatter_add_ of expanded ids", "matrix",
     lambda a: torch.zeros(5, 6).scatter_add_(0, DESTINATIONS.unsqueeze(-1).expand(7, 6), a[DESTINATIONS % 4])),
    ("scatter_add of a constant index", "matrix",
     lambda a: a.scatter_add(1, torch.tensor([5, 0, 5])[None].expand(4, 3), a[:, :3])),
    ("scatter_add by an index varying along two axes", "matrix",
     lambda a: a.scatter_add(1, torch.tensor([[5, 0, 5], [1, 2, 3], [0, 0, 0], [4, 4, 1]]), a[:, :3])),
    *[(f"affine_grid corners={corners}", "theta", lambda t, c=corners: F.affine_grid(t, (2, 3, 5, 6), align_corners=c))
      for corners in (False, True)],
    *[(f"grid_sample {mode} {padding} corners={corners} by {by}", by,
       lambda a, m=mode, p=padding, c=corners, by=by: F.grid_sample(
           a if by == "image" else SAMPLED, GRID if by == "image" else a, mode=m, padding_mode=p, align_corners=c))
      for mode in ("bilinear", "nearest") for padding in ("zeros", "border") for corners in (False, True)
      for by in ("image", "grid")],
    ("prod", "matrix", lambda a: torch.prod(a, 1) + a.prod(0, keepdim=True).sum() + torch.prod(a[:2, :3])),
    ("prod through a zero", "matrix", lambda a: torch.prod(torch.relu(a), 1)),
    ("any all isnan isinf isfinite as masks", "matrix", lambda a: torch.where(torch.isnan(torch.log(a)) | torch.isinf(1 / a.round()), 0.0, a) * torch.isfinite(a) + torch.any(a > 1, 1, keepdim=True) * a + a.all(0) * a),  # noqa: E501
    ("tensordot", "matrix", lambda a: torch.tensordot(a, a.flip(0), dims=([0], [0])) + torch.tensordot(a[:2], a[:2].T, dims=1).sum()),  # noqa: E501
    ("vector_norm of a row of zeros", "matrix", lambda a: torch.linalg.vector_norm(a * (a.sum(1, keepdim=True) > 0), dim=1)),  # noqa: E501
    ("bitwise ops and shifts on ints", "matrix",
     lambda a: a * ((((a * 100).int() << 3) ^ ((a * 7).int() >> 1)) & 255).float() + (~(a > 0)).float() * a
     + torch.bitwise_or((a * 10).long(), 1).float() + (~(a * 9).int()).float() * a + (torch.bitwise_not(a < 0) ^ (a > 1)) * a),  # noqa: E501
    ("spatial transformer", "theta", lambda t: F.grid_sample(SAMPLED, F.affine_grid(t, (2, 3, 7, 9), False), align_corners=False)),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize(("name", "kind", "function"), CASES, ids=[case[0] for case in CASES])
def test_translation_matches_eager(name: str, kind: str, function: Callable[..., Any]) -> None:
    x = _inputs(kind).requires_grad_()
    got, want = torch.compile(function, backend="rlx")(x), function(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    cotangent = torch.randn_like(want)
    torch.testing.assert_close(
        torch.autograd.grad(got, x, cotangent)[0], torch.autograd.grad(want, x, cotangent)[0], rtol=1e-3, atol=1e-4
    )
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


def test_what_rlx_leaves_falls_back() -> None:
    """A QR factorisation (rlx's R has a diagonal >= 0; torch's keeps LAPACK's signs) and a
    scatter of a tensor (whose result torch leaves undefined where indices repeat) run eagerly,
    with a warning naming why."""
    x = _inputs("matrix").requires_grad_()
    with pytest.warns(UserWarning, match="qr"):
        torch.testing.assert_close(torch.compile(lambda a: torch.linalg.qr(a)[1], backend="rlx")(x),
                                   torch.linalg.qr(x)[1])  # fmt: skip
    index = torch.tensor([[5, 0, 5], [1, 2, 3], [0, 0, 0], [4, 4, 1]])
    with pytest.warns(UserWarning, match="scatter of a tensor"):
        torch.testing.assert_close(torch.compile(lambda a: a.scatter(1, index, a[:, :3] * 2), backend="rlx")(x),
                                   x.scatter(1, index, x[:, :3] * 2))  # fmt: skip
    assert dynamo_backend.stats["eager"] == 2


def test_a_graph_convolutional_network_trains_on_rlx() -> None:
    """A two-layer GCN in plain torch (degrees by ``index_add_``, messages gathered at their
    sources and summed at their destinations by ``scatter_add_``): one graph on rlx, the loss
    and every gradient as eager torch's."""
    import copy

    generator = torch.Generator().manual_seed(8)
    nodes, edges, width = 30, 120, 8
    sources = torch.randint(0, nodes, (edges,), generator=generator)
    targets = torch.randint(0, nodes, (edges,), generator=generator)

    class GCN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(width, 16), torch.nn.Linear(16, 3)

        def layer(self, h: Any, linear: Any) -> Any:
            degree = torch.zeros(nodes).index_add_(0, targets, torch.ones(edges)) + 1.0
            scale = degree.rsqrt()
            features = linear(h)
            messages = features[sources] * (scale[sources] * scale[targets]).unsqueeze(-1)
            summed = torch.zeros(nodes, messages.shape[1]).scatter_add_(
                0, targets.unsqueeze(-1).expand_as(messages), messages
            )
            return summed + features / degree.unsqueeze(-1)

        def forward(self, x: Any, labels: Any) -> Any:
            return F.cross_entropy(self.layer(torch.relu(self.layer(x, self.first)), self.second), labels)

    torch.manual_seed(9)
    eager = GCN()
    other = copy.deepcopy(eager)
    x, labels = torch.randn(nodes, width, generator=generator), torch.randint(0, 3, (nodes,), generator=generator)
    got, want = torch.compile(other, backend="rlx")(x, labels), eager(x, labels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got.backward()
    want.backward()
    for (name, a), b in zip(eager.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


RANDOM_CALLS: list[tuple[str, Callable[..., Any]]] = [
    ("rand", lambda a: a * torch.rand(4, 6)),
    ("randn of a tuple", lambda a: a + torch.randn((4, 6))),
    ("randint low high", lambda a: a * torch.randint(0, 3, (4, 6))),
    ("randint high", lambda a: a * torch.randint(5, (4, 1))),
    ("rand_like randn_like", lambda a: a * torch.rand_like(a) + torch.randn_like(a)),
    ("between dropouts", lambda a: F.dropout(a, 0.3) * torch.rand(4, 6) + F.dropout(a * torch.randn(6), 0.5)),
    ("targets drawn in the graph", lambda a: F.binary_cross_entropy_with_logits(a, torch.rand(4, 6))),
]


@pytest.mark.parametrize(("name", "function"), RANDOM_CALLS, ids=[case[0] for case in RANDOM_CALLS])
def test_random_draws_in_the_graph_are_eagers(name: str, function: Callable[..., Any]) -> None:
    """``torch.rand``/``randn``/``randint`` inside a compiled function are inputs the wrapper draws
    per call from torch's generator, in the graph's order (dropout's masks among them): under one
    seed the values are eager torch's, and the next call draws new ones."""
    x = _inputs("matrix").requires_grad_()
    compiled = torch.compile(function, backend="rlx")
    torch.manual_seed(5)
    got = compiled(x)
    torch.manual_seed(5)
    want = function(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    cotangent = torch.randn_like(want)
    torch.manual_seed(6)
    got_grad = torch.autograd.grad(compiled(x), x, cotangent)[0]
    torch.manual_seed(6)
    torch.testing.assert_close(got_grad, torch.autograd.grad(function(x), x, cotangent)[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(compiled(x), compiled(x))  # fresh draws each call
    assert dynamo_backend.stats == {"compiled": 1, "eager": 0}, dynamo_backend.fallbacks


@pytest.mark.parametrize("masked", [False, True], ids=["score_mod", "block_mask"])
def test_flex_attention_in_a_compiled_function_runs_in_eager_torch(masked: bool) -> None:
    """torch's flex_attention builds its block mask with vmap, which TorchDynamo inlines into the
    graph. The backend leaves such a graph to eager PyTorch with a warning naming why; before, it
    folded the first vmap level into a constant, left torch's functorch interpreter stack pushed
    when a later node was refused, and TorchDynamo failed its own guard ("Guard failed on the
    same frame it was created")."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 8) for _ in range(3))

    def attend(q: Any, k: Any, v: Any) -> Any:
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 32, 32) if masked else None
        return flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0.5, block_mask=mask)

    with pytest.warns(UserWarning, match="runs in eager PyTorch: .*torch.func transform"):
        got = torch.compile(attend, backend="rlx")(q, k, v)
    torch.testing.assert_close(got, attend(q, k, v))
    assert torch._C._functorch.peek_interpreter_stack() is None
    assert dynamo_backend.stats["eager"] >= 1
