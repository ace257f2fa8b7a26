"""The linear algebra ops (:mod:`rlx.ops.linalg`): one work item per matrix of the batch, each a
call into OpenBLAS's LAPACKE (row-major) or CBLAS.

Operands and results are dense; every item copies its operand into the result (or into the
thread's scratch) first, because LAPACK works in place, and fills its matrix's results with NaN
where LAPACK reports failure (``info != 0``: not positive definite, exactly singular, or NaN in
the input, which LAPACKE checks for).
"""

from __future__ import annotations

from llvmlite import ir

from rlx.codegen.blas import ROW_MAJOR
from rlx.codegen.irutil import (
    F32,
    I1,
    I8,
    I32,
    I64,
    PTR,
    VOID,
    alloca_entry,
    declare,
    f32,
    for_range,
    gep,
    i32,
    i64,
    intrinsic,
)

POTRF = "scipy_LAPACKE_spotrf"  # (layout, uplo, n, a, lda) -> info
GESV = "scipy_LAPACKE_sgesv"  # (layout, n, nrhs, a, lda, ipiv, b, ldb) -> info
GETRF = "scipy_LAPACKE_sgetrf"  # (layout, m, n, a, lda, ipiv) -> info
SYEVD = "scipy_LAPACKE_ssyevd"  # (layout, jobz, uplo, n, a, lda, w) -> info
GEQRF = "scipy_LAPACKE_sgeqrf"  # (layout, m, n, a, lda, tau) -> info
ORGQR = "scipy_LAPACKE_sorgqr"  # (layout, m, n, k, a, lda, tau) -> info
GESDD = "scipy_LAPACKE_sgesdd"  # (layout, jobz, m, n, a, lda, s, u, ldu, vt, ldvt) -> info
TRSM = "scipy_cblas_strsm"  # (layout, side, uplo, trans, diag, m, n, alpha, a, lda, b, ldb)
LINALG_OPS = frozenset({"cholesky", "solve_triangular", "solve", "slogdet", "eigh", "svd", "qr"})
LEFT, UPPER, LOWER, NO_TRANS, TRANS, NON_UNIT, UNIT = 141, 121, 122, 111, 112, 131, 132  # cblas.h


def linalg_scratch_bytes(op: str, m: int, n: int) -> int:
    """Per-thread scratch of an item (``[m, n]`` its matrix): a copy of the matrix, and its pivots
    (``solve``, ``slogdet``), where LAPACK would overwrite an operand."""
    if op in ("solve", "slogdet"):
        return 4 * (n * n + n)
    if op == "qr":
        return 4 * (m * n + min(m, n))  # the matrix and the reflectors' scales
    return 4 * m * n if op == "svd" else 0


def emit_linalg_item(
    module: ir.Module, op: str, shape: tuple[int, int], k: int, attrs: object, name: str
) -> ir.Function:
    """``void item(ptr args, i64 item, ptr scratch)`` for matrix ``item`` of the batch; args are
    the node's operands then its results, dense; ``shape`` the matrix's, ``k`` the right-hand
    side's columns (0: none)."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=name)
    fn.linkage = "internal"
    args, item, scratch = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    slots = 4 if op == "svd" else 3  # operands then results
    pointers = [b.load(gep(b, args, [i64(slot)], PTR), typ=PTR) for slot in range(slots)]
    m, n = shape
    if op in ("svd", "qr"):  # [m, n] matrices
        (_svd if op == "svd" else _qr)(b, module, pointers, item, scratch, m, n)
        b.ret_void()
        return fn
    square = b.mul(item, i64(n * n), name="square")
    columns = b.mul(item, i64(n * k), name="columns")
    if op == "cholesky":
        _cholesky(b, module, gep(b, pointers[0], [square], F32), gep(b, pointers[1], [square], F32), n)
    elif op == "solve_triangular":
        a, rhs, out = gep(b, pointers[0], [square], F32), gep(b, pointers[1], [columns], F32), pointers[2]
        _triangular(b, module, a, rhs, gep(b, out, [columns], F32), n, k, attrs)
    elif op == "solve":
        a, rhs, out = gep(b, pointers[0], [square], F32), gep(b, pointers[1], [columns], F32), pointers[2]
        _solve(b, module, a, rhs, gep(b, out, [columns], F32), scratch, n, k)
    elif op == "eigh":
        a = gep(b, pointers[0], [square], F32)
        _eigh(b, module, a, gep(b, pointers[1], [b.mul(item, i64(n))], F32), gep(b, pointers[2], [square], F32), n)
    elif op == "slogdet":
        a = gep(b, pointers[0], [square], F32)
        _slogdet(b, module, a, gep(b, pointers[1], [item], F32), gep(b, pointers[2], [item], F32), scratch, n)
    else:
        raise AssertionError(op)
    b.ret_void()
    return fn


def _copy(b: ir.IRBuilder, module: ir.Module, target: ir.Value, source: ir.Value, count: int) -> None:
    memcpy = intrinsic(module, "llvm.memcpy.p0.p0.i64", VOID, [PTR, PTR, I64, I1])
    b.call(memcpy, [target, source, i64(4 * count), ir.Constant(I1, 0)])


def _fill_nan_if(b: ir.IRBuilder, info: ir.Value, *targets: tuple[ir.Value, int]) -> ir.Value:
    """Each ``(target, count)``: ``target[:count] = NaN`` where ``info != 0``; returns whether it did."""
    failed = b.icmp_signed("!=", info, i32(0), name="failed")
    with b.if_then(failed):
        for target, count in targets:
            with for_range(b, 0, count, "nan") as j:
                b.store(f32(float("nan")), gep(b, target, [j], F32))
    return failed


def _negate(b: ir.IRBuilder, base: ir.Value, count: int, stride: int, name: str) -> None:
    """``base[i * stride] = -base[i * stride]`` for ``i < count``: a row or a column flipped."""
    with for_range(b, 0, count, name) as i:
        at = gep(b, base, [b.mul(i, i64(stride))], F32)
        b.store(b.fneg(b.load(at, typ=F32)), at)


def _largest_is_negative(
    b: ir.IRBuilder, module: ir.Module, column: ir.Value, rows: int, stride: int, largest: ir.Value
) -> ir.Value:
    """Whether the entry of largest magnitude (the first of equal ones) among ``rows`` entries
    ``stride`` apart from ``column`` is negative; ``largest`` a float slot to keep it in."""
    fabs = intrinsic(module, "llvm.fabs.f32", F32, [F32])
    b.store(b.load(column, typ=F32), largest)
    with for_range(b, 1, rows, "row") as row:
        entry = b.load(gep(b, column, [b.mul(row, i64(stride))], F32), typ=F32)
        current = b.load(largest, typ=F32)
        larger = b.fcmp_ordered(">", b.call(fabs, [entry]), b.call(fabs, [current]))
        b.store(b.select(larger, entry, current), largest)
    return b.fcmp_ordered("<", b.load(largest, typ=F32), f32(0.0))


def _cholesky(b: ir.IRBuilder, module: ir.Module, a: ir.Value, out: ir.Value, n: int) -> None:
    """``out = L``: potrf on a copy of ``a``'s lower triangle, the strict upper triangle zeroed."""
    potrf = declare(module, POTRF, I32, [I32, I8, I32, PTR, I32])
    _copy(b, module, out, a, n * n)
    info = b.call(potrf, [i32(ROW_MAJOR), ir.Constant(I8, ord("L")), i32(n), out, i32(n)], name="info")
    failed = _fill_nan_if(b, info, (out, n * n))
    with b.if_then(b.not_(failed)), for_range(b, 0, n, "row") as row, for_range(b, b.add(row, i64(1)), n, "col") as col:
        b.store(f32(0.0), gep(b, out, [b.add(b.mul(row, i64(n)), col)], F32))


def _triangular(
    b: ir.IRBuilder, module: ir.Module, a: ir.Value, rhs: ir.Value, out: ir.Value, n: int, k: int, attrs: object
) -> None:
    """``out = op(a)^-1 rhs``: trsm in place on a copy of ``rhs``."""
    trsm = declare(module, TRSM, VOID, [I32, I32, I32, I32, I32, I32, I32, F32, PTR, I32, PTR, I32])
    _copy(b, module, out, rhs, n * k)
    uplo = LOWER if attrs.lower else UPPER  # type: ignore[attr-defined]
    trans = TRANS if attrs.transpose_a else NO_TRANS  # type: ignore[attr-defined]
    diag = UNIT if attrs.unit_diagonal else NON_UNIT  # type: ignore[attr-defined]
    flags = [i32(ROW_MAJOR), i32(LEFT), i32(uplo), i32(trans), i32(diag), i32(n), i32(k)]
    b.call(trsm, [*flags, f32(1.0), a, i32(n), out, i32(k)])


def _solve(
    b: ir.IRBuilder, module: ir.Module, a: ir.Value, rhs: ir.Value, out: ir.Value, scratch: ir.Value, n: int, k: int
) -> None:
    """``out = a^-1 rhs``: gesv on copies of ``a`` (the scratch, with the pivots after it) and ``rhs``."""
    gesv = declare(module, GESV, I32, [I32, I32, I32, PTR, I32, PTR, PTR, I32])
    _copy(b, module, scratch, a, n * n)
    _copy(b, module, out, rhs, n * k)
    pivots = gep(b, scratch, [i64(n * n)], F32)
    info = b.call(gesv, [i32(ROW_MAJOR), i32(n), i32(k), scratch, i32(n), pivots, out, i32(k)], name="info")
    _fill_nan_if(b, info, (out, n * k))


def _slogdet(
    b: ir.IRBuilder, module: ir.Module, a: ir.Value, sign: ir.Value, log: ir.Value, scratch: ir.Value, n: int
) -> None:
    """``sign, log = prod(sign(u_jj)) * (-1)^swaps, sum(log|u_jj|)`` of getrf on a copy of ``a``:
    an exactly singular matrix (``info > 0``, a zero on U's diagonal) gives ``0, -inf`` by the
    same sums; a failed call (``info < 0``: NaN in ``a``) gives NaN."""
    getrf = declare(module, GETRF, I32, [I32, I32, I32, PTR, I32, PTR])
    logf = declare(module, "logf", F32, [F32])
    fabs = intrinsic(module, "llvm.fabs.f32", F32, [F32])
    _copy(b, module, scratch, a, n * n)
    pivots = gep(b, scratch, [i64(n * n)], F32)
    info = b.call(getrf, [i32(ROW_MAJOR), i32(n), i32(n), scratch, i32(n), pivots], name="info")
    b.store(f32(1.0), sign)
    b.store(f32(0.0), log)
    with for_range(b, 0, n, "diag") as j:
        entry = b.load(gep(b, scratch, [b.mul(j, i64(n + 1))], F32), typ=F32)
        b.store(b.fadd(b.load(log, typ=F32), b.call(logf, [b.call(fabs, [entry])])), log)
        negative = b.fcmp_ordered("<", entry, f32(0.0))
        zero = b.fcmp_ordered("==", entry, f32(0.0))
        pivot = b.load(gep(b, pivots, [j], I32), typ=I32)
        swapped = b.icmp_signed("!=", b.sext(pivot, I64), b.add(j, i64(1)))  # LAPACK's pivots count from 1
        flip = b.xor(negative, swapped)
        current = b.load(sign, typ=F32)
        flipped = b.select(flip, b.fneg(current), current)
        b.store(b.select(zero, f32(0.0), flipped), sign)
    b.store(b.fadd(b.load(sign, typ=F32), f32(0.0)), sign)  # a sign flipped after a zero: +0, not -0
    failed = b.icmp_signed("<", info, i32(0))
    with b.if_then(failed):
        b.store(f32(float("nan")), sign)
        b.store(f32(float("nan")), log)


def _eigh(b: ir.IRBuilder, module: ir.Module, a: ir.Value, values: ir.Value, vectors: ir.Value, n: int) -> None:
    """``values, vectors``: syevd on a copy of ``a``'s lower triangle, each eigenvector (column)
    then flipped so that its entry of largest magnitude (the first of equal ones) is positive."""
    syevd = declare(module, SYEVD, I32, [I32, I8, I8, I32, PTR, I32, PTR])
    _copy(b, module, vectors, a, n * n)
    flags = [i32(ROW_MAJOR), ir.Constant(I8, ord("V")), ir.Constant(I8, ord("L")), i32(n)]
    info = b.call(syevd, [*flags, vectors, i32(n), values], name="info")
    failed = _fill_nan_if(b, info, (vectors, n * n), (values, n))
    largest = alloca_entry(b, F32, "largest")
    with b.if_then(b.not_(failed)), for_range(b, 0, n, "column") as col:
        column = gep(b, vectors, [col], F32)
        with b.if_then(_largest_is_negative(b, module, column, n, n, largest)):
            _negate(b, column, n, n, "flip")


def _svd(
    b: ir.IRBuilder, module: ir.Module, pointers: list[ir.Value], item: ir.Value, scratch: ir.Value, m: int, n: int
) -> None:
    """``u, s, vt`` of the thin SVD by gesdd on a copy of the ``[m, n]`` matrix (the scratch);
    each pair of singular vectors then flipped so that ``u``'s column has its entry of largest
    magnitude (the first of equal ones) positive."""
    k = min(m, n)
    gesdd = declare(module, GESDD, I32, [I32, I8, I32, I32, PTR, I32, PTR, PTR, I32, PTR, I32])
    a = gep(b, pointers[0], [b.mul(item, i64(m * n))], F32)
    u = gep(b, pointers[1], [b.mul(item, i64(m * k))], F32)
    s = gep(b, pointers[2], [b.mul(item, i64(k))], F32)
    vt = gep(b, pointers[3], [b.mul(item, i64(k * n))], F32)
    _copy(b, module, scratch, a, m * n)
    flags = [i32(ROW_MAJOR), ir.Constant(I8, ord("S")), i32(m), i32(n), scratch, i32(n)]
    info = b.call(gesdd, [*flags, s, u, i32(k), vt, i32(n)], name="info")
    failed = _fill_nan_if(b, info, (u, m * k), (s, k), (vt, k * n))
    largest = alloca_entry(b, F32, "largest")
    with b.if_then(b.not_(failed)), for_range(b, 0, k, "pair") as pair:
        column = gep(b, u, [pair], F32)
        with b.if_then(_largest_is_negative(b, module, column, m, k, largest)):
            _negate(b, column, m, k, "flip.u")
            _negate(b, gep(b, vt, [b.mul(pair, i64(n))], F32), n, 1, "flip.v")


def _qr(
    b: ir.IRBuilder, module: ir.Module, pointers: list[ir.Value], item: ir.Value, scratch: ir.Value, m: int, n: int
) -> None:
    """``q, r`` of the ``[m, n]`` matrix: geqrf on a copy (the scratch, the reflectors' scales
    after it), ``r`` its upper triangle's first ``k`` rows, then orgqr forms ``q`` in the copy's
    first ``k`` columns; each pair then flipped so that ``r``'s diagonal is >= 0."""
    k = min(m, n)
    geqrf = declare(module, GEQRF, I32, [I32, I32, I32, PTR, I32, PTR])
    orgqr = declare(module, ORGQR, I32, [I32, I32, I32, I32, PTR, I32, PTR])
    a = gep(b, pointers[0], [b.mul(item, i64(m * n))], F32)
    q = gep(b, pointers[1], [b.mul(item, i64(m * k))], F32)
    r = gep(b, pointers[2], [b.mul(item, i64(k * n))], F32)
    tau = gep(b, scratch, [i64(m * n)], F32)
    _copy(b, module, scratch, a, m * n)
    info = b.call(geqrf, [i32(ROW_MAJOR), i32(m), i32(n), scratch, i32(n), tau], name="info")
    with for_range(b, 0, k, "r.row") as row, for_range(b, 0, n, "r.col") as col:
        kept = b.icmp_signed(">=", col, row)
        entry = b.load(gep(b, scratch, [b.add(b.mul(row, i64(n)), col)], F32), typ=F32)
        b.store(b.select(kept, entry, f32(0.0)), gep(b, r, [b.add(b.mul(row, i64(n)), col)], F32))
    formed = b.call(orgqr, [i32(ROW_MAJOR), i32(m), i32(k), i32(k), scratch, i32(n), tau], name="formed")
    with for_range(b, 0, m, "q.row") as row, for_range(b, 0, k, "q.col") as col:
        entry = b.load(gep(b, scratch, [b.add(b.mul(row, i64(n)), col)], F32), typ=F32)
        b.store(entry, gep(b, q, [b.add(b.mul(row, i64(k)), col)], F32))
    with for_range(b, 0, k, "sign") as pair:
        diagonal = b.load(gep(b, r, [b.add(b.mul(pair, i64(n)), pair)], F32), typ=F32)
        with b.if_then(b.fcmp_ordered("<", diagonal, f32(0.0))):
            _negate(b, gep(b, r, [b.mul(pair, i64(n))], F32), n, 1, "flip.r")
            _negate(b, gep(b, q, [pair], F32), m, k, "flip.q")
    _fill_nan_if(b, b.or_(info, formed), (q, m * k), (r, k * n))
