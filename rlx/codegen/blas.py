"""The BLAS rlx calls: OpenBLAS from the ``scipy-openblas32`` wheel (CBLAS names prefixed ``scipy_``).

Loaded once per process and pinned to one thread: rlx parallelises every product itself (over
batch, row and column blocks, see ``lower_gemm``), and OpenBLAS's own workers would oversubscribe
the cores and busy-wait after each call.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

from rlx.errors import RlxValueError

SGEMM = "scipy_cblas_sgemm"
SGEMV = "scipy_cblas_sgemv"
OMATCOPY = "scipy_cblas_somatcopy"  # out-of-place scaled copy or transpose of a matrix
SET_THREADS = "scipy_openblas_set_num_threads"
CORENAME = "scipy_openblas_get_corename"
# OpenBLAS cores with a small-matrix path for sgemm (kernel/x86_64/KERNEL.SKYLAKEX, which the later
# Intel cores include): products of up to 10^6 multiply-adds run unpacked. Elsewhere (the Haswell
# and Zen kernels) the generic permit sends every product through packing.
SMALL_PATH_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})

INT32_MAX = 2**31 - 1  # BLAS (LP64 here) takes 32-bit sizes and leading dimensions

# CBLAS enum values (cblas.h).
ROW_MAJOR = 101
NO_TRANS = 111
TRANS = 112


@dataclass(frozen=True)
class Blas:
    path: str
    library: ctypes.CDLL
    sgemm_address: int
    sgemv_address: int
    omatcopy_address: int
    corename: str  # the kernels OpenBLAS chose for this CPU, lower case ("" if it cannot say)

    @property
    def has_small_path(self) -> bool:
        """Whether OpenBLAS runs small sgemm products on its unpacked small-matrix path."""
        return self.corename in SMALL_PATH_CORES


@functools.cache
def load_blas() -> Blas:
    """Load OpenBLAS, make its symbols visible to JIT code and pin it to one thread."""
    import scipy_openblas32

    path = os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so")
    library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    set_threads = getattr(library, SET_THREADS)
    set_threads.argtypes = [ctypes.c_int]
    set_threads(1)

    def address(name: str) -> int:
        found = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
        assert found, f"{name} not found in {path}"
        return int(found)

    corename = ""
    if hasattr(library, CORENAME):
        get_corename = getattr(library, CORENAME)
        get_corename.restype = ctypes.c_char_p
        corename = (get_corename() or b"").decode(errors="replace").strip().lower()
    return Blas(path, library, address(SGEMM), address(SGEMV), address(OMATCOPY), corename)


# The C math library's float functions that elementwise ops call lane by lane (off the hot
# paths: exp, tanh, erf and the like are computed inline), by the op's name.
LIBM = {
    name: f"{name}f"
    for name in (
        "log", "pow", "sin", "cos", "tan", "log1p", "expm1", "atan2", "atan", "asin", "acos",
        "sinh", "cosh", "asinh", "acosh", "atanh", "log2", "log10", "exp2",
    )
}  # fmt: skip


@functools.cache
def libc_symbol(name: str) -> int:
    """Address of a C library function (pthread_create, pthread_join) for the JIT to call."""
    address = ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value
    assert address, f"{name} not found in the C library"
    return int(address)


def refuse_beyond_blas(what: str, *sizes: int) -> None:
    """``RlxValueError`` if a matrix dimension passes the 32-bit sizes BLAS takes."""
    biggest = max(sizes, default=0)
    if biggest > INT32_MAX:
        raise RlxValueError(f"{what}: a matrix dimension of {biggest} exceeds the 32-bit BLAS limit")
