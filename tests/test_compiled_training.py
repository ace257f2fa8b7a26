"""``rt.compile``'s training path: the forward hands the backward what it reads, as autograd does.

A call that autograd records runs a forward that also returns the values its backward reads;
the backward takes them as inputs instead of recomputing the forward. These tests check that the
backward really does not recompute it, that gradients match float64 torch (static and symbolic
shapes, a value whose shape is a product of symbols and so is recomputed, not saved), that the
saved values survive other calls before the backward, and that ``retain_graph`` and
``create_graph`` still work.
"""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph

torch = pytest.importorskip("torch")
rt = pytest.importorskip("rlx.torch")


def _mlp(rows: int | str) -> Graph:
    g = Graph("mlp")
    x = g.input("x", (rows, 8))
    w = g.input("w", (8, 8))
    h = g.tanh(x @ w)
    g.output(y=g.sum(g.rms_norm(h, 1.0) * h))
    return g


def _torch_mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)
    normed = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6)
    return (normed * h).sum()


def _grads_against_float64(f: rt.CompiledGraph, x: torch.Tensor, w: torch.Tensor) -> None:
    xt, wt = (t.clone().requires_grad_(True) for t in (x, w))
    f(x=xt, w=wt)["y"].backward()
    xd, wd = (t.double().requires_grad_(True) for t in (x, w))
    _torch_mlp(xd, wd).backward()
    torch.testing.assert_close(xt.grad, xd.grad.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(wt.grad, wd.grad.float(), rtol=1e-4, atol=1e-5)


def test_the_backward_reads_the_forward_values_instead_of_recomputing_them() -> None:
    f = rt.compile(_mlp(6))
    x, w = torch.randn(6, 8), torch.randn(8, 8)
    _grads_against_float64(f, x, w)
    training = f.training
    assert training is not None and training.saved
    ops = [node.op.value for node in training.backward.graph.nodes]
    # tanh(x @ w) comes from the forward: the backward has the two gradient products only.
    assert "tanh" not in ops
    assert ops.count("matmul") == 2
    assert all(name in training.forward.graph.outputs for name in training.saved)


def test_symbolic_rows_and_a_product_shape_that_is_recomputed() -> None:
    g = Graph("flat")
    x = g.input("x", (2, "S", 8))
    w = g.input("w", (8, 8))
    flat = g.reshape(g.tanh(x), (-1, 8))  # [2*S, 8]: no input can declare it, so it is not saved
    g.output(y=g.sum(g.sigmoid(flat @ w) * flat))
    f = rt.compile(g)
    for rows in (1, 5, 9):
        xt = torch.randn(2, rows, 8, requires_grad=True)
        wt = torch.randn(8, 8, requires_grad=True)
        f(x=xt, w=wt)["y"].backward()
        xd, wd = (t.detach().double().requires_grad_(True) for t in (xt, wt))
        flat_d = torch.tanh(xd).reshape(-1, 8)
        (torch.sigmoid(flat_d @ wd) * flat_d).sum().backward()
        torch.testing.assert_close(xt.grad, xd.grad.float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(wt.grad, wd.grad.float(), rtol=1e-4, atol=1e-5)
    training = f.training
    assert training is not None
    shapes = [training.forward.graph.outputs[name].shape for name in training.saved]
    assert all(isinstance(d, int) or rlx.ir.dims.is_symbol(d) for shape in shapes for d in shape)
    assert rlx.codegen.executable.compile_count() >= 1


def test_saved_values_survive_other_calls_before_the_backward() -> None:
    """Output arrays are recycled once nobody holds them: the saved ones are held until the
    backward runs, so interleaved forwards must not overwrite them."""
    f = rt.compile(_mlp(4))
    w = torch.randn(8, 8, requires_grad=True)
    xs = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    losses = [f(x=x, w=w)["y"] for x in xs]
    sum(losses).backward()
    wd = w.detach().double().requires_grad_(True)
    xds = [x.detach().double().requires_grad_(True) for x in xs]
    sum(_torch_mlp(xd, wd) for xd in xds).backward()
    torch.testing.assert_close(w.grad, wd.grad.float(), rtol=1e-4, atol=1e-5)
    for x, xd in zip(xs, xds, strict=True):
        torch.testing.assert_close(x.grad, xd.grad.float(), rtol=1e-4, atol=1e-5)


def test_retain_graph_and_create_graph() -> None:
    f = rt.compile(_mlp(3))
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, 8)
    y = f(x=x, w=w)["y"]
    (first,) = torch.autograd.grad(y, [x], retain_graph=True)
    (again,) = torch.autograd.grad(y, [x])
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    (with_graph,) = torch.autograd.grad(f(x=x, w=w)["y"], [x], create_graph=True)
    torch.testing.assert_close(with_graph, first, rtol=1e-5, atol=1e-6)
    xd = x.detach().double().requires_grad_(True)
    (gd,) = torch.autograd.grad(_torch_mlp(xd, w.double()), [xd], create_graph=True)
    (second,) = torch.autograd.grad(with_graph.pow(2).sum(), [x])
    (second_d,) = torch.autograd.grad(gd.pow(2).sum(), [xd])
    torch.testing.assert_close(second, second_d.float(), rtol=1e-3, atol=1e-4)


def test_without_grad_the_plain_forward_runs() -> None:
    f = rt.compile(_mlp(2))
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    with torch.no_grad():
        y = f(x=x.requires_grad_(True), w=w)["y"]
    assert not y.requires_grad
    np.testing.assert_allclose(y.numpy(), _torch_mlp(x.detach().double(), w.double()).numpy(), rtol=1e-5)
    assert "training" not in vars(f)  # nothing compiled for a backward that cannot come


def test_views_and_free_elementwise_values_are_not_saved() -> None:
    """The backward views what it reads again (a weight's transpose, a reshape) instead of the
    forward copying the view out, and recomputes an elementwise value whose operands it has
    anyway (saved, or inputs) instead of reading a saved copy."""
    g = Graph("views")
    x, w1, w2, gate = g.input("x", (6, 8)), g.input("w1", (8, 8)), g.input("w2", (8, 4)), g.input("gate", (6, 8))
    h = g.tanh(x @ w1)  # saved: tanh's gradient reads it
    z = h * gate  # h and gate at hand in the backward: recomputed, not saved
    g.output(y=g.sum(g.reshape(z @ w2, (24,)) ** 2))
    f = rt.compile(g)
    torch.manual_seed(0)
    leaves = [torch.randn(*shape, requires_grad=True) for shape in ((6, 8), (8, 8), (8, 4), (6, 8))]
    f(x=leaves[0], w1=leaves[1], w2=leaves[2], gate=leaves[3])["y"].backward()
    doubles = [t.detach().double().requires_grad_(True) for t in leaves]
    ((torch.tanh(doubles[0] @ doubles[1]) * doubles[3]) @ doubles[2]).reshape(24).pow(2).sum().backward()
    for mine, theirs in zip(leaves, doubles, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad.float(), rtol=1e-4, atol=1e-5)
    from rlx.torch.graphs import _saved_values

    saved = _saved_values(f.backward_graph, f.cotangent_names.values())  # node ids as in g
    assert not [value for value in saved if value.node.op.definition.view], saved
    ids = {value.node.id for value in saved}
    assert h.node.id in ids and z.node.id not in ids, saved
    training = f.training
    assert training is not None and len(training.saved) == len(saved)
