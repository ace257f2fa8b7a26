"""``cholesky``, ``solve_triangular``, ``solve``, ``slogdet``, ``det`` and ``inv`` at sizes and
batches beyond the generic samples (``tests/op_samples.py`` checks each op's gradient against
central differences and its compiled result against the reference): against NumPy and against
the defining identities (``L L^T = A``, ``A x = b``), with what LAPACK's failures give, a
symbolic batch, the thread count, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

import rlx
from rlx import Graph


def _conditioned(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    n = shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(n) + 2.0 * np.eye(n)).astype(np.float32)


@pytest.mark.parametrize("threads", [1, 2])
def test_against_numpy_and_the_identities(threads: int) -> None:
    rng = np.random.default_rng(0)
    n, k = 37, 5
    a = _conditioned(rng, (3, 2, n, n))
    b = rng.standard_normal((3, 2, n, k)).astype(np.float32)
    g = Graph("linalg")
    av, bv = g.input("a", a.shape), g.input("b", b.shape)
    spd = av @ av.mT
    sign, logabsdet = g.slogdet(av)
    g.output(
        low=g.cholesky(spd),
        spd=spd,
        x=g.solve(av, bv),
        lower=g.solve_triangular(av, bv),
        upper_t=g.solve_triangular(av, bv, lower=False, transpose_a=True),
        sign=sign,
        logabsdet=logabsdet,
        det=g.det(av),
        inv=g.inv(av),
    )
    got = rlx.compile(g, config=rlx.RuntimeConfig(num_threads=threads))(a=a, b=b)
    wide, rhs = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_allclose(got["low"] @ np.swapaxes(got["low"], -1, -2), got["spd"], rtol=1e-4, atol=1e-4)
    assert np.all(np.triu(got["low"], 1) == 0) and np.all(np.diagonal(got["low"], axis1=-2, axis2=-1) > 0)
    np.testing.assert_allclose(got["low"], np.linalg.cholesky(wide @ np.swapaxes(wide, -1, -2)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(wide @ got["x"], rhs, atol=1e-4)
    np.testing.assert_allclose(got["x"], np.linalg.solve(wide, rhs), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.tril(wide) @ got["lower"], rhs, atol=1e-4)
    np.testing.assert_allclose(np.swapaxes(np.triu(wide), -1, -2) @ got["upper_t"], rhs, atol=1e-4)
    want_sign, want_log = np.linalg.slogdet(wide)
    np.testing.assert_array_equal(got["sign"], want_sign)
    np.testing.assert_allclose(got["logabsdet"], want_log, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["det"], np.linalg.det(wide), rtol=1e-4)
    np.testing.assert_allclose(got["inv"], np.linalg.inv(wide), rtol=1e-4, atol=1e-4)


def test_eigh_against_numpy_with_one_sign_per_eigenvector() -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 24, 24)).astype(np.float32)
    a = (x + np.swapaxes(x, -1, -2)) / 2
    g = Graph("eigh")
    w, v = g.eigh(g.input("a", a.shape))
    g.output(w=w, v=v)
    got = rlx.compile(g)(a=a)
    want_w, want_v = np.linalg.eigh(a.astype(np.float64))
    np.testing.assert_allclose(got["w"], want_w, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(a @ got["v"], got["v"] * got["w"][..., None, :], atol=1e-4)  # A V = V diag(w)
    np.testing.assert_allclose(
        np.swapaxes(got["v"], -1, -2) @ got["v"], np.broadcast_to(np.eye(24), a.shape), atol=1e-5
    )
    largest = np.take_along_axis(got["v"], np.argmax(np.abs(got["v"]), axis=-2)[..., None, :], axis=-2)
    assert np.all(largest > 0)
    np.testing.assert_allclose(np.abs(got["v"]), np.abs(want_v), atol=1e-3)


@pytest.mark.parametrize("shape", [(3, 37, 20), (2, 12, 30), (16, 16)])
def test_svd_and_matrix_norms_against_numpy(shape: tuple[int, ...]) -> None:
    a = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    g = Graph("svd")
    av = g.input("a", shape)
    u, s, vh = g.svd(av, full_matrices=False)
    orders: list[object] = ["fro", "nuc", 2, -2, 1, -1, np.inf, -np.inf]
    g.output(u=u, s=s, vh=vh, **{f"norm_{i}": g.matrix_norm(av, o) for i, o in enumerate(orders)})
    got = rlx.compile(g)(a=a)
    wide = a.astype(np.float64)
    np.testing.assert_allclose(got["s"], np.linalg.svd(wide, compute_uv=False), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose((got["u"] * got["s"][..., None, :]) @ got["vh"], wide, atol=1e-4)
    k = min(shape[-2:])
    identity = np.broadcast_to(np.eye(k), (*shape[:-2], k, k))
    np.testing.assert_allclose(np.swapaxes(got["u"], -1, -2) @ got["u"], identity, atol=1e-5)
    largest = np.take_along_axis(got["u"], np.argmax(np.abs(got["u"]), axis=-2)[..., None, :], axis=-2)
    assert np.all(largest > 0)
    for i, order in enumerate(orders):
        want = np.linalg.norm(wide, order, axis=(-2, -1))  # type: ignore[call-overload]
        np.testing.assert_allclose(got[f"norm_{i}"], want, rtol=1e-5, atol=1e-5, err_msg=str(order))
    with pytest.raises(rlx.RlxValueError, match="full_matrices=False"):
        g.svd(av) if shape[-1] != shape[-2] else g.svd(g.input("wide", (3, 4)))


def test_failures_give_nan_and_singular_determinants_zero() -> None:
    g = Graph("failures")
    a = g.input("a", (3, 3, 3))
    b = g.input("b", (3, 3, 1))
    sign, logabsdet = g.slogdet(a)
    g.output(low=g.cholesky(a), x=g.solve(a, b), sign=sign, logabsdet=logabsdet, det=g.det(a))
    good = np.eye(3, dtype=np.float32) * 2.0
    singular = np.array([[1, 2, 3], [2, 4, 6], [0, 1, 1]], np.float32)  # not positive definite either
    with_nan = good.copy()
    with_nan[2, 1] = np.nan
    arrays = {"a": np.stack([good, singular, with_nan]), "b": np.ones((3, 3, 1), np.float32)}
    got = rlx.compile(g)(**arrays)
    want = rlx.reference.run(g, **arrays)
    np.testing.assert_allclose(got["low"][0], np.sqrt(2.0) * np.eye(3), rtol=1e-6)
    assert np.isnan(got["low"][1:]).all() and np.isnan(got["x"][1:]).all()
    np.testing.assert_array_equal(got["sign"], [1.0, 0.0, np.nan])
    np.testing.assert_array_equal(got["logabsdet"], [np.log(8.0).astype(np.float32), -np.inf, np.nan])
    np.testing.assert_array_equal(got["det"][1:], [0.0, np.nan])
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, equal_nan=True, err_msg=name)
    upper_nan = good.copy()
    upper_nan[0, 2] = np.nan  # above the diagonal: cholesky does not read it, as NumPy's
    arrays["a"] = np.stack([upper_nan, good, good])
    np.testing.assert_allclose(rlx.compile(g)(**arrays)["low"][0], np.sqrt(2.0) * np.eye(3), rtol=1e-6)


def test_cholesky_differentiates_the_lower_triangle_it_reads() -> None:
    """On a matrix that is not symmetric, the gradient is the exact derivative of what is
    computed: entries above the diagonal are not read, so they get 0."""
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((4, 4)) / 4 + 2 * np.eye(4)).astype(np.float32)
    weights = rng.standard_normal((4, 4))

    def np_loss(matrix: np.ndarray) -> float:
        return float(np.sum(np.linalg.cholesky(np.tril(matrix) + np.tril(matrix, -1).T) * weights))

    value, grad = rlx.value_and_grad(lambda m: (rlx.cholesky(m) * weights.astype(np.float32)).sum())(a)
    assert float(value) == pytest.approx(np_loss(a.astype(np.float64)), rel=1e-5)
    numeric = np.zeros((4, 4))
    for index in np.ndindex(4, 4):
        step = np.zeros((4, 4))
        step[index] = 1e-6
        numeric[index] = (np_loss(a + step) - np_loss(a - step)) / 2e-6
    np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-4)
    assert np.all(np.triu(grad, 1) == 0)


def test_a_symbolic_batch_compiles_once() -> None:
    g = Graph("batch")
    a = g.input("a", ("B", 4, 4))
    b = g.input("b", ("B", 4, 2))
    g.output(x=g.solve(a, b), det=g.det(a))
    exe = rlx.compile(g)
    rng = np.random.default_rng(3)
    for batch in (1, 5):
        arrays = {"a": _conditioned(rng, (batch, 4, 4)), "b": rng.standard_normal((batch, 4, 2)).astype(np.float32)}
        got = exe(**arrays)
        np.testing.assert_allclose(got["x"], np.linalg.solve(arrays["a"], arrays["b"]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got["det"], np.linalg.det(arrays["a"]), rtol=1e-4)
    assert exe.compile_count == 1


def test_a_gaussian_log_likelihood_trains_through_cholesky() -> None:
    """The negative log-likelihood of points under N(0, L L^T + eps I) as a function of L:
    its gradient (through cholesky, solve_triangular and the log-determinant) against central
    differences of NumPy's."""
    rng = np.random.default_rng(4)
    points = rng.standard_normal((20, 3)).astype(np.float32)

    def nll(factor: rlx.Value, x: rlx.Value) -> rlx.Value:
        cov = factor @ factor.mT + np.eye(3, dtype=np.float32) * 0.5
        low = rlx.cholesky(cov)
        z = rlx.solve_triangular(low, x.mT)
        log_det = 2.0 * rlx.log(rlx.abs(rlx.sum(low * np.eye(3, dtype=np.float32), axis=-1))).sum()
        return 0.5 * (z * z).sum() / 20.0 + 0.5 * log_det

    def np_nll(factor: np.ndarray) -> float:
        cov = factor @ factor.T + 0.5 * np.eye(3)
        _, log_det = np.linalg.slogdet(cov)
        return float(0.5 * np.einsum("ni,ij,nj->", points, np.linalg.inv(cov), points) / 20.0 + 0.5 * log_det)

    factor = rng.standard_normal((3, 3)).astype(np.float32)
    value, grad = rlx.value_and_grad(nll)(factor, points)
    assert float(value) == pytest.approx(np_nll(factor.astype(np.float64)), rel=1e-5)
    numeric = np.zeros((3, 3))
    for index in np.ndindex(3, 3):
        step = np.zeros((3, 3))
        step[index] = 1e-6
        numeric[index] = (np_nll(factor + step) - np_nll(factor - step)) / 2e-6
    np.testing.assert_allclose(grad, numeric, rtol=1e-3, atol=1e-4)


def test_errors_name_the_op() -> None:
    g = Graph("errors")
    square = g.input("square", (2, 3, 3))
    before = len(g)
    cases = [
        (lambda: g.cholesky(g.input("wide", (3, 4))), rlx.RlxValueError, "square matrices"),
        (
            lambda: g.solve(square, g.input("rhs", (2, 4, 1))),
            rlx.RlxValueError,
            r"b must be \[\*a.shape\[:-2\], n, k\]",
        ),
        (lambda: g.solve(square, g.input("other_batch", (3, 3, 1))), rlx.RlxValueError, "b must be"),
        (lambda: g.slogdet(g.input("symbolic", (2, "N", "N"))), rlx.RlxValueError, "known when the graph is built"),
        (lambda: g.inv(g.input("ints", (3, 3), dtype="int32")), rlx.RlxTypeError, "must be f32"),
        (lambda: g.solve_triangular(square, square, lower=1), rlx.RlxTypeError, "lower must be a bool"),  # type: ignore[arg-type]
    ]
    for build, error, match in cases:
        with pytest.raises(error, match=match):
            build()
    assert len(g) - before == 5  # only the inputs the cases declared
    with pytest.raises(rlx.RlxValueError, match="32-bit LAPACK limit"):
        g.cholesky(g.input("huge", (50_000, 50_000)))
