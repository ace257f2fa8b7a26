"""Dense linear algebra on stacks of matrices: ``cholesky``, ``solve_triangular``, ``solve``,
``slogdet``, ``qr``, ``eigh`` and ``svd`` as ops (LAPACK and BLAS from OpenBLAS do the work, one matrix
per work item), and ``det``, ``inv``, ``svdvals`` and ``matrix_norm`` built from them, as
``numpy.linalg`` / ``jax.numpy.linalg`` / ``torch.linalg`` define them.

Every operand is ``[..., n, n]`` (``svd``'s and ``qr``'s ``[..., m, n]``; a right-hand side ``[..., n, k]``,
or ``[n]`` beside a single matrix), float32, with the batch dimensions of the matrix; the
matrix sizes are known when the graph is built. Where LAPACK reports failure (a matrix that is
not positive definite for ``cholesky``, an exactly singular one for ``solve``, NaN in what it
reads) the matrix's results are NaN, as ``torch.linalg.cholesky_ex`` and JAX return them, never
an exception inside native code; ``slogdet`` of a singular matrix is ``(0, -inf)``, as NumPy's.
Eigenvectors and singular vectors, whose signs LAPACK leaves open, are signed so that each
(the left one of a singular pair) has its entry of largest magnitude positive, and ``qr``'s R
has a diagonal >= 0: one answer.

Gradients are the standard ones (Giles 2008; Murray 2016 for the Cholesky factor), written in
ops that have gradients themselves, so second derivatives work too:

- ``X = solve(A, B)``: ``dB = solve(A^T, dX)``, ``dA = -dB X^T``.
- ``X = solve_triangular(A, B)``: the same with the triangular solve, ``dA`` kept to the
  triangle that was read.
- ``L = cholesky(A)``: ``S = sym(L^-T Phi(L^T dL) L^-1)``, ``Phi`` the lower triangle with its
  diagonal halved, is the gradient w.r.t. the symmetric matrix; since only A's lower triangle is
  read, ``dA`` is ``2 S`` below the diagonal, ``S`` on it and 0 above (the exact derivative,
  which torch and JAX give as ``S`` for an input they take as symmetric).
- ``logabsdet``: ``dA = dlogabsdet * A^-T``; the sign has none.
- ``U, s, V^T = svd(A)``: Townsend's (2016), see :func:`_svd_grad`.
- ``Q, R = qr(A)``: ``(dQ + Q copyltu(R dR^T - dQ^T Q)) R^-T``, see :func:`_qr_grad`.
- ``w, V = eigh(A)``: ``V (diag(dw) + F * (V^T dV)) V^T``, ``F_ij = 1/(w_j - w_i)``, as for
  ``cholesky`` taken to the lower triangle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, register_op
from rlx.ir.types import TensorType
from rlx.ops._batching import batch_trailing
from rlx.ops._common import F32, as_value, op_kind, require_float
from rlx.ops.elementwise import NoAttrs

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value


@dataclass(frozen=True)
class TriangularAttrs:
    lower: bool = True  # which triangle of a is read
    transpose_a: bool = False  # solve a^T x = b
    unit_diagonal: bool = False  # a's diagonal taken as ones (not read)


def _square(what: str, label: str, ty: TensorType) -> int:
    """``n`` of a stack of square float matrices ``[..., n, n]`` (static)."""
    require_float(what, label, ty)
    if ty.rank < 2 or ty.shape[-1] != ty.shape[-2]:
        raise RlxValueError(f"{what}: {label} must be a stack of square matrices [..., n, n], got {ty}")
    n = ty.shape[-1]
    if not isinstance(n, int):
        raise RlxValueError(f"{what}: {label}'s matrix size must be known when the graph is built, got {ty}")
    _within_lapack(what, n, n)
    return n


def _within_lapack(what: str, m: int, n: int) -> None:
    """LAPACK here takes 32-bit sizes, and LAPACKE allocates a matrix's copy by them."""
    from rlx.codegen.blas import INT32_MAX  # codegen imports the ops: read it when building

    if m * n > INT32_MAX:
        raise RlxValueError(f"{what}: a {m}x{n} matrix exceeds the 32-bit LAPACK limit of {INT32_MAX} entries")


def _matrix(what: str, ty: TensorType) -> tuple[int, int]:
    """``(m, n)`` of a stack of float matrices ``[..., m, n]`` (static)."""
    require_float(what, "a", ty)
    if ty.rank < 2 or not all(isinstance(d, int) for d in ty.shape[-2:]):
        raise RlxValueError(f"{what}: a must be a stack of matrices [..., m, n] of sizes known when built, got {ty}")
    m, n = int(ty.shape[-2]), int(ty.shape[-1])
    _within_lapack(what, m, n)
    return m, n


def _right_side(what: str, a: TensorType, b: TensorType) -> None:
    """``b [..., n, k]`` with ``a``'s batch dimensions."""
    require_float(what, "b", b)
    if b.rank != a.rank or b.shape[:-2] != a.shape[:-2] or b.shape[-2] != a.shape[-1]:
        raise RlxValueError(f"{what}: b must be [*a.shape[:-2], n, k] for a {a}, got {b}")
    if not isinstance(b.shape[-1], int):
        raise RlxValueError(f"{what}: b's columns must be known when the graph is built, got {b}")
    _within_lapack(what, int(b.shape[-2]), b.shape[-1])


def _batched(fn: object, *arrays: np.ndarray) -> np.ndarray:
    """``fn`` of each batch entry's matrices (float64), NaN where NumPy finds it singular or not
    positive definite, or where an operand holds NaN: the compiled kernels give NaN there (LAPACKE
    checks its operands for NaN)."""
    batch = arrays[0].shape[:-2]
    first = None
    results = []
    for index in np.ndindex(*batch):
        matrices = [a[index] for a in arrays]
        try:
            with np.errstate(all="ignore"):
                result = None if any(np.isnan(m).any() for m in matrices) else fn(*matrices)  # type: ignore[operator]
        except np.linalg.LinAlgError:
            result = None
        results.append(result)
        if result is not None and first is None:
            first = result
    shape: tuple[int, ...] = arrays[-1].shape[-2:] if first is None else np.shape(first)  # the result's
    out = np.empty((*batch, *shape))
    for index, result in zip(np.ndindex(*batch), results, strict=True):
        out[index] = np.nan if result is None else result
    return out


# ----------------------------------------------------------------------------- cholesky


def _cholesky_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    (a,) = inputs
    _square(what, "a", a)
    return (a,)


def _cholesky_reference(args: Sequence[np.ndarray], attrs: NoAttrs, ctx: EvalContext) -> np.ndarray:
    (a,) = args
    return _batched(np.linalg.cholesky, np.tril(np.asarray(a, np.float64)))  # only the lower triangle is read


def _cholesky_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    dl = cts[0]
    assert dl is not None
    low = node.outputs[0]
    n = int(low.shape[-1])
    halved = graph.constant((np.tril(np.ones((n, n))) - 0.5 * np.eye(n)).astype(np.float32))
    phi = graph.matmul(low.mT, dl) * halved
    left = solve_triangular(graph, low, phi, lower=True, transpose_a=True)  # L^-T Phi
    whole = solve_triangular(graph, low, left.mT, lower=True, transpose_a=True).mT  # L^-T Phi L^-1
    return [_lower_read(graph, (whole + whole.mT) * 0.5)]


def _lower_read(graph: Graph, symmetric: Value) -> Value:
    """The gradient w.r.t. a matrix of which only the lower triangle is read, from the symmetric
    gradient ``S`` w.r.t. the symmetric matrix it stands for: an entry below the diagonal stands
    for two (``2 S_ij``), the diagonal for itself, the upper triangle for nothing."""
    n = int(symmetric.shape[-1])
    weights = 2.0 * np.tril(np.ones((n, n)), -1) + np.eye(n)
    return symmetric * graph.constant(weights.astype(np.float32))


def cholesky(graph: Graph, a: object) -> Value:
    """The lower Cholesky factor ``L`` of symmetric positive definite matrices ``a [..., n, n]``
    (``a = L L^T``; only a's lower triangle is read), as ``numpy.linalg.cholesky``; NaN for a
    matrix that is not positive definite, as ``torch.linalg.cholesky_ex``."""
    return graph.add_node(op_kind("cholesky"), [as_value(graph, a, "cholesky: a")], NoAttrs()).outputs[0]


# ----------------------------------------------------------------------------- solve_triangular


def _triangular_infer(what: str, inputs: Sequence[TensorType], attrs: TriangularAttrs) -> tuple[TensorType, ...]:
    a, b = inputs
    _square(what, "a", a)
    _right_side(what, a, b)
    for name in ("lower", "transpose_a", "unit_diagonal"):
        if not isinstance(getattr(attrs, name), bool):
            raise RlxTypeError(f"{what}: {name} must be a bool, got {type(getattr(attrs, name)).__name__}")
    return (b,)


def _triangle(a: np.ndarray, attrs: TriangularAttrs) -> np.ndarray:
    """The matrix a triangular solve reads: one triangle, maybe with a unit diagonal, maybe transposed."""
    part = np.tril(a) if attrs.lower else np.triu(a)
    if attrs.unit_diagonal:
        n = a.shape[-1]
        part = part * (1 - np.eye(n)) + np.eye(n)
    return np.swapaxes(part, -1, -2) if attrs.transpose_a else part


def _triangular_reference(args: Sequence[np.ndarray], attrs: TriangularAttrs, ctx: EvalContext) -> np.ndarray:
    """Substitution, row by row, as BLAS ``strsm`` does it (so NaN and a zero on the diagonal
    spread the same way: along the columns of b they reach)."""
    a, b = (np.asarray(x, np.float64) for x in args)
    matrix = _triangle(a, attrs)
    forward = attrs.lower != attrs.transpose_a  # the matrix solved is lower triangular
    x = np.zeros_like(b)
    rows = range(b.shape[-2]) if forward else reversed(range(b.shape[-2]))
    with np.errstate(all="ignore"):
        for i in rows:
            done = slice(0, i) if forward else slice(i + 1, None)
            known = np.einsum("...j,...jk->...k", matrix[..., i, done], x[..., done, :])
            x[..., i, :] = (b[..., i, :] - known) / matrix[..., i, i, None]
    return x


def _triangular_grad(
    graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]
) -> list[Value | None]:
    dx = cts[0]
    assert dx is not None
    a = node.inputs[0]
    x = node.outputs[0]
    attrs: TriangularAttrs = node.attrs
    n = int(a.shape[-1])
    db = solve_triangular(
        graph, a, dx, lower=attrs.lower, transpose_a=not attrs.transpose_a, unit_diagonal=attrs.unit_diagonal
    )
    da = -(graph.matmul(x, db.mT) if attrs.transpose_a else graph.matmul(db, x.mT))
    kept = np.tril(np.ones((n, n)), -1 if attrs.unit_diagonal else 0)
    if not attrs.lower:
        kept = kept.T
    return [da * graph.constant(kept.astype(np.float32)), db]


def solve_triangular(
    graph: Graph,
    a: object,
    b: object,
    lower: bool = True,
    transpose_a: bool = False,
    unit_diagonal: bool = False,
) -> Value:
    """``x`` with ``op(a) x = b`` for triangular ``a [..., n, n]`` (its ``lower`` or upper
    triangle; ``op`` the transpose with ``transpose_a``; a unit diagonal, not read, with
    ``unit_diagonal``) and ``b [..., n, k]`` or ``[n]``, as ``jax.scipy.linalg.solve_triangular``
    (BLAS ``strsm``)."""
    attrs = TriangularAttrs(lower, transpose_a, unit_diagonal)
    return _with_vector(
        graph, a, b, "solve_triangular", lambda m, rhs: graph.add_node(op_kind("solve_triangular"), [m, rhs], attrs)
    )


def _with_vector(graph: Graph, a: object, b: object, what: str, build: object) -> Value:
    """The op on ``b``, a vector ``[n]`` beside one matrix taken as a column and returned as a vector."""
    matrix = as_value(graph, a, f"{what}: a")
    rhs = as_value(graph, b, f"{what}: b")
    vector = rhs.ndim == 1 and matrix.ndim == 2
    if vector:
        rhs = graph.reshape(rhs, (rhs.shape[0], 1))
    result: Value = build(matrix, rhs).outputs[0]  # type: ignore[operator]
    return graph.reshape(result, (result.shape[0],)) if vector else result


# ----------------------------------------------------------------------------- solve


def _solve_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    a, b = inputs
    _square(what, "a", a)
    _right_side(what, a, b)
    return (b,)


def _solve_reference(args: Sequence[np.ndarray], attrs: NoAttrs, ctx: EvalContext) -> np.ndarray:
    a, b = (np.asarray(x, np.float64) for x in args)
    return _batched(np.linalg.solve, a, b)


def _solve_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    dx = cts[0]
    assert dx is not None
    a = node.inputs[0]
    db = solve(graph, a.mT, dx)
    return [-graph.matmul(db, node.outputs[0].mT), db]


def solve(graph: Graph, a: object, b: object) -> Value:
    """``x`` with ``a x = b`` for square ``a [..., n, n]`` and ``b [..., n, k]`` (or ``[n]``
    beside one matrix), as ``numpy.linalg.solve`` (LAPACK ``sgesv``: LU with partial pivoting);
    NaN for an exactly singular matrix, where NumPy raises."""
    return _with_vector(graph, a, b, "solve", lambda m, rhs: graph.add_node(op_kind("solve"), [m, rhs], NoAttrs()))


# ----------------------------------------------------------------------------- slogdet


def _slogdet_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    (a,) = inputs
    _square(what, "a", a)
    batch = TensorType(a.shape[:-2], F32)
    return (batch, batch)


def _slogdet_reference(args: Sequence[np.ndarray], attrs: NoAttrs, ctx: EvalContext) -> tuple[np.ndarray, ...]:
    a = np.asarray(args[0], np.float64)
    with np.errstate(all="ignore"):
        sign, logabsdet = np.linalg.slogdet(a)
    bad = np.isnan(a).any(axis=(-1, -2))
    return np.where(bad, np.nan, sign), np.where(bad, np.nan, logabsdet)


def _slogdet_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    dlog = cts[1]
    if dlog is None:
        return [None]  # the sign is piecewise constant
    a = node.inputs[0]
    n = int(a.shape[-1])
    identity = graph.broadcast_to(graph.constant(np.eye(n, dtype=np.float32)), a.shape)
    inverse_t = solve(graph, a.mT, identity)
    return [inverse_t * graph.reshape(dlog, (*dlog.shape, 1, 1))]


def slogdet(graph: Graph, a: object) -> tuple[Value, Value]:
    """``(sign, logabsdet)`` of square matrices ``a [..., n, n]``, each ``[...]``, as
    ``numpy.linalg.slogdet`` (LU with partial pivoting, LAPACK ``sgetrf``): ``det = sign *
    exp(logabsdet)`` without overflow; ``(0, -inf)`` for a singular matrix."""
    outputs = graph.add_node(op_kind("slogdet"), [as_value(graph, a, "slogdet: a")], NoAttrs()).outputs
    return outputs[0], outputs[1]


# ----------------------------------------------------------------------------- qr


def _qr_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    (a,) = inputs
    m, n = _matrix(what, a)
    k = min(m, n)
    return TensorType((*a.shape[:-2], m, k), F32), TensorType((*a.shape[:-2], k, n), F32)


def _qr_reference(args: Sequence[np.ndarray], attrs: NoAttrs, ctx: EvalContext) -> tuple[np.ndarray, ...]:
    a = np.asarray(args[0], np.float64)
    m, n = a.shape[-2:]
    k = min(m, n)
    q = np.full((*a.shape[:-2], m, k), np.nan)
    r = np.full((*a.shape[:-2], k, n), np.nan)
    for index in np.ndindex(*a.shape[:-2]):
        if not np.isnan(a[index]).any():
            q[index], r[index] = np.linalg.qr(a[index], mode="reduced")
    signs = np.where(np.diagonal(r, axis1=-2, axis2=-1) < 0, -1.0, 1.0)  # R's diagonal made >= 0
    return q * signs[..., None, :], r * signs[..., :, None]


def _copy_lower_up(graph: Graph, m: Value) -> Value:
    """The symmetric matrix of ``m``'s lower triangle: ``tril(m, -1) + tril(m, -1)^T + diag(m)``."""
    n = int(m.shape[-1])
    below = graph.constant(np.tril(np.ones((n, n)), -1).astype(np.float32))
    lower = m * below
    return lower + lower.mT + m * np.eye(n, dtype=np.float32)


def _qr_square_grad(graph: Graph, q: Value, r: Value, dq: Value | None, dr: Value | None) -> Value:
    """``(dQ + Q copyltu(M)) R^-T``, ``M = R dR^T - dQ^T Q``, for ``A = QR`` with ``m >= n``."""
    m_terms = []
    if dr is not None:
        m_terms.append(graph.matmul(r, dr.mT))
    if dq is not None:
        m_terms.append(-graph.matmul(dq.mT, q))
    middle = m_terms[0] if len(m_terms) == 1 else m_terms[0] + m_terms[1]
    b = graph.matmul(q, _copy_lower_up(graph, middle))
    if dq is not None:
        b = b + dq
    return solve_triangular(graph, r, b.mT, lower=False).mT  # b R^-T


def _qr_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """``A = QR``: for ``m >= n`` the square formula; for ``m < n``, ``A = [X | Y]`` with ``X``
    square, ``R = [U | V]``, ``V = Q^T Y``: ``dY = Q dV`` and ``dX`` the square formula with
    ``dQ + Y dV^T`` and ``dU``."""
    dq, dr = cts
    q, r = node.outputs
    m, n = (int(d) for d in node.inputs[0].shape[-2:])
    if m >= n:
        return [_qr_square_grad(graph, q, r, dq, dr)]
    _, y = graph.split(node.inputs[0], [m, n - m], axis=-1)
    u, _ = graph.split(r, [m, n - m], axis=-1)
    du, dv = graph.split(dr, [m, n - m], axis=-1) if dr is not None else (None, None)
    if dv is not None:
        moved = graph.matmul(y, dv.mT)
        dq = moved if dq is None else dq + moved
    dx = _qr_square_grad(graph, q, u, dq, du)
    dy = (
        graph.matmul(q, dv) if dv is not None else graph.broadcast_to(graph.constant(np.zeros((), np.float32)), y.shape)
    )
    return [graph.concat([dx, dy], axis=-1)]


def qr(graph: Graph, a: object, mode: str = "reduced") -> tuple[Value, Value]:
    """``(q, r)`` with ``a = q @ r`` for matrices ``a [..., m, n]``: ``q [..., m, k]`` with
    orthonormal columns and ``r [..., k, n]`` upper triangular with a diagonal >= 0, ``k =
    min(m, n)``, as ``numpy.linalg.qr(mode="reduced")`` (LAPACK ``sgeqrf`` and ``sorgqr``)."""
    if mode != "reduced":
        raise RlxValueError(f"qr: only mode='reduced' is supported, got {mode!r}")
    outputs = graph.add_node(op_kind("qr"), [as_value(graph, a, "qr: a")], NoAttrs()).outputs
    return outputs[0], outputs[1]


# ----------------------------------------------------------------------------- eigh


def _eigh_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    (a,) = inputs
    _square(what, "a", a)
    return (TensorType(a.shape[:-1], F32), a)


def canonical_signs(vectors: np.ndarray) -> np.ndarray:
    """Eigenvectors (columns) each flipped so that its entry of largest magnitude (the first of
    equal ones) is positive: one answer where LAPACK may give either sign."""
    largest = np.argmax(np.abs(vectors), axis=-2)[..., None, :]
    signs = np.where(np.take_along_axis(vectors, largest, axis=-2) < 0, -1.0, 1.0)
    return vectors * signs


def _eigh_reference(args: Sequence[np.ndarray], attrs: NoAttrs, ctx: EvalContext) -> tuple[np.ndarray, ...]:
    a = np.tril(np.asarray(args[0], np.float64))  # only the lower triangle is read
    values = np.full(a.shape[:-1], np.nan)
    vectors = np.full(a.shape, np.nan)
    for index in np.ndindex(*a.shape[:-2]):
        if not np.isnan(a[index]).any():
            values[index], vectors[index] = np.linalg.eigh(a[index], UPLO="L")
    return values, canonical_signs(vectors)


def _eigh_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """``S = V (diag(dw) + F * (V^T dV)) V^T`` symmetrized, ``F_ij = 1 / (w_j - w_i)`` off the
    diagonal (infinite for repeated eigenvalues, as torch's and JAX's), then the lower triangle's
    share of it."""
    dw, dv = cts
    w, v = node.outputs
    n = int(v.shape[-1])
    eye = np.eye(n, dtype=np.float32)
    inner: Value | None = None
    if dw is not None:
        inner = graph.expand_dims(dw, -2) * eye
    if dv is not None:
        gaps = graph.expand_dims(w, -2) - graph.expand_dims(w, -1) + eye  # w_j - w_i, 1 on the diagonal
        rotation = graph.matmul(v.mT, dv) * ((1.0 - eye) / gaps)
        inner = rotation if inner is None else inner + rotation
    assert inner is not None
    whole = graph.matmul(graph.matmul(v, inner), v.mT)
    return [_lower_read(graph, (whole + whole.mT) * 0.5)]


def eigh(graph: Graph, a: object) -> tuple[Value, Value]:
    """``(w, v)``: the eigenvalues ``[..., n]`` (ascending) and eigenvectors (the columns of
    ``[..., n, n]``) of symmetric matrices ``a [..., n, n]``, of which the lower triangle is read,
    as ``numpy.linalg.eigh`` (LAPACK ``ssyevd``). Each eigenvector's largest entry is positive."""
    outputs = graph.add_node(op_kind("eigh"), [as_value(graph, a, "eigh: a")], NoAttrs()).outputs
    return outputs[0], outputs[1]


# ----------------------------------------------------------------------------- svd


def _svd_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    (a,) = inputs
    m, n = _matrix(what, a)
    k = min(m, n)
    batch = a.shape[:-2]
    return TensorType((*batch, m, k), F32), TensorType((*batch, k), F32), TensorType((*batch, k, n), F32)


def _svd_signs(u: np.ndarray, vh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each singular pair flipped so that the left vector's largest entry is positive."""
    largest = np.argmax(np.abs(u), axis=-2)[..., None, :]
    signs = np.where(np.take_along_axis(u, largest, axis=-2) < 0, -1.0, 1.0)
    return u * signs, vh * np.swapaxes(signs, -1, -2)


def _svd_reference(args: Sequence[np.ndarray], attrs: NoAttrs, ctx: EvalContext) -> tuple[np.ndarray, ...]:
    a = np.asarray(args[0], np.float64)
    m, n = a.shape[-2:]
    k = min(m, n)
    u = np.full((*a.shape[:-2], m, k), np.nan)
    s = np.full((*a.shape[:-2], k), np.nan)
    vh = np.full((*a.shape[:-2], k, n), np.nan)
    for index in np.ndindex(*a.shape[:-2]):
        if not np.isnan(a[index]).any():
            u[index], s[index], vh[index] = np.linalg.svd(a[index], full_matrices=False)
    u, vh = _svd_signs(u, vh)
    return u, s, vh


def _svd_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """Townsend's (2016) gradient of the thin SVD ``A = U diag(s) V^T``, ``F_ij = 1/(s_j^2 -
    s_i^2)`` off the diagonal (infinite for repeated singular values, as torch's and JAX's):
    ``U [F*(U^T dU - dU^T U) S + diag(ds) + S F*(V^T dV - dV^T V)] V^T``, plus, for a matrix that
    is not square, ``(I - U U^T) dU S^-1 V^T + U S^-1 dV^T (I - V V^T)``."""
    du, ds, dvh = cts
    u, s, vh = node.outputs
    m, n = (int(d) for d in node.inputs[0].shape[-2:])
    k = min(m, n)
    eye = np.eye(k, dtype=np.float32)
    v = vh.mT
    dv = dvh.mT if dvh is not None else None
    row = graph.expand_dims(s, -2)  # s_j along the last axis
    column = graph.expand_dims(s, -1)  # s_i
    inner: Value | None = graph.expand_dims(ds, -2) * eye if ds is not None else None
    gaps = (row * row - column * column) + eye
    f = (1.0 - eye) / gaps
    if du is not None:
        ut_du = graph.matmul(u.mT, du)
        term = (f * (ut_du - ut_du.mT)) * row
        inner = term if inner is None else inner + term
    if dv is not None:
        vt_dv = graph.matmul(v.mT, dv)
        term = column * (f * (vt_dv - vt_dv.mT))
        inner = term if inner is None else inner + term
    assert inner is not None
    da = graph.matmul(graph.matmul(u, inner), vh)
    if du is not None and m > k:
        projected = du - graph.matmul(u, graph.matmul(u.mT, du))
        da = da + graph.matmul(projected / row, vh)
    if dv is not None and n > k:
        projected = dv - graph.matmul(v, graph.matmul(v.mT, dv))
        da = da + graph.matmul(u / row, projected.mT)
    return [da]


def svd(graph: Graph, a: object, full_matrices: bool = True) -> tuple[Value, Value, Value]:
    """``(u, s, vh)`` with ``a = u @ diag(s) @ vh`` for matrices ``a [..., m, n]``: singular
    values descending, as ``numpy.linalg.svd`` (LAPACK ``sgesdd``). The thin factors
    (``full_matrices=False``; for square matrices they are the full ones). Each pair of singular
    vectors is signed so that the left one's largest entry is positive."""
    value = as_value(graph, a, "svd: a")
    if not isinstance(full_matrices, bool):
        raise RlxTypeError(f"svd: full_matrices must be a bool, got {type(full_matrices).__name__}")
    shape = value.shape[-2:]
    if full_matrices and value.ndim >= 2 and shape[0] != shape[1]:
        raise RlxValueError(
            f"svd: full_matrices=True of the non-square {value.type} is not supported (its extra singular vectors "
            "have no gradient); pass full_matrices=False"
        )
    outputs = graph.add_node(op_kind("svd"), [value], NoAttrs()).outputs
    return outputs[0], outputs[1], outputs[2]


def svdvals(graph: Graph, a: object) -> Value:
    """The singular values ``[..., min(m, n)]`` of matrices ``a [..., m, n]``, descending."""
    return svd(graph, a, full_matrices=False)[1]


def matrix_norm(graph: Graph, a: object, ord: object = "fro", keepdims: bool = False) -> Value:
    """``numpy.linalg.norm`` / ``torch.linalg.matrix_norm`` over the last two axes: ``"fro"``,
    ``"nuc"`` (the sum of singular values), ``2`` / ``-2`` (the largest / smallest), ``1`` / ``-1``
    (the largest / smallest column sum of magnitudes), ``inf`` / ``-inf`` (row sums)."""
    value = as_value(graph, a, "matrix_norm: a")
    _matrix("matrix_norm", value.type)
    if ord == "fro":
        result = graph.vector_norm(value, 2, (-2, -1))
    elif ord == "nuc":
        result = graph.sum(svdvals(graph, value), axis=-1)
    elif ord in (2, -2):
        values = svdvals(graph, value)
        result = graph.max(values, axis=-1) if ord == 2 else graph.min(values, axis=-1)
    elif ord in (1, -1, np.inf, -np.inf):
        sums = graph.sum(graph.abs(value), axis=-2 if ord in (1, -1) else -1)
        result = graph.max(sums, axis=-1) if ord in (1, np.inf) else graph.min(sums, axis=-1)
    else:
        raise RlxValueError(f"matrix_norm: ord must be 'fro', 'nuc', 2, -2, 1, -1, inf or -inf, got {ord!r}")
    return graph.expand_dims(graph.expand_dims(result, -1), -1) if keepdims else result


# ----------------------------------------------------------------------------- compositions


def det(graph: Graph, a: object) -> Value:
    """The determinants of square matrices ``a [..., n, n]``: ``sign * exp(logabsdet)`` of
    :func:`slogdet`, as ``numpy.linalg.det``."""
    sign, logabsdet = slogdet(graph, a)
    return sign * graph.exp(logabsdet)


def inv(graph: Graph, a: object) -> Value:
    """The inverses of square matrices ``a [..., n, n]``: ``solve(a, I)``, as ``numpy.linalg.inv``."""
    matrix = as_value(graph, a, "inv: a")
    _square("inv", "a", matrix.type)
    identity = graph.constant(np.eye(int(matrix.shape[-1]), dtype=np.float32))
    return solve(graph, matrix, graph.broadcast_to(identity, matrix.shape) if matrix.ndim > 2 else identity)


_T = batch_trailing  # every op here maps over a stack of matrices
register_op(
    OpDef("cholesky", ("a",), NoAttrs, _cholesky_infer, _cholesky_reference, _cholesky_grad, builder=cholesky, batch=_T)
)
register_op(
    OpDef(
        "solve_triangular",
        ("a", "b"),
        TriangularAttrs,
        _triangular_infer,
        _triangular_reference,
        _triangular_grad,
        builder=solve_triangular,
        batch=_T,
    )
)
register_op(OpDef("solve", ("a", "b"), NoAttrs, _solve_infer, _solve_reference, _solve_grad, builder=solve, batch=_T))
register_op(OpDef("qr", ("a",), NoAttrs, _qr_infer, _qr_reference, _qr_grad, builder=qr, batch=_T))
register_op(OpDef("svd", ("a",), NoAttrs, _svd_infer, _svd_reference, _svd_grad, builder=svd, batch=_T))
register_op(OpDef("eigh", ("a",), NoAttrs, _eigh_infer, _eigh_reference, _eigh_grad, builder=eigh, batch=_T))
register_op(
    OpDef("slogdet", ("a",), NoAttrs, _slogdet_infer, _slogdet_reference, _slogdet_grad, builder=slogdet, batch=_T)
)
