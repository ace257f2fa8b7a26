"""The vector exps against float64: within 1 ulp where the result is a normal float, 0 below the
underflow bound, NaN kept; the softmax exp (inputs <= 0) at vector and scalar width."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import pytest
from llvmlite import ir

from rlx.codegen.expf import define_expf, define_softmax_expf
from rlx.codegen.irutil import F32, I64, PTR, VOID, for_range, gep_f32
from rlx.codegen.jit import ENTRY, compile_ir


def _compiled(define: Callable[[ir.Module, int], ir.Function], width: int) -> Callable[[np.ndarray], np.ndarray]:
    """``y = exp(x)`` over an array whose length is a multiple of ``width``, through ``define``."""
    module = ir.Module("exp")
    exp = define(module, width)
    entry = ir.Function(module, ir.FunctionType(VOID, [PTR, PTR, I64]), name=ENTRY)
    b = ir.IRBuilder(entry.append_basic_block())
    source, target, count = entry.args
    ty = F32 if width == 1 else ir.VectorType(F32, width)
    with for_range(b, 0, count, "i", width) as i:
        value = b.load(gep_f32(b, source, i), typ=ty, align=4)
        b.store(b.call(exp, [value]), gep_f32(b, target, i), align=4)
    b.ret_void()
    library = compile_ir(str(module))
    function = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(library.entry_address)

    def run(x: np.ndarray) -> np.ndarray:
        assert x.dtype == np.float32 and x.size % width == 0
        y = np.empty_like(x)
        function(x.ctypes.data, y.ctypes.data, x.size)
        _ = library  # keep the code alive while it runs
        return y

    return run


def _inputs(upper: float) -> np.ndarray:
    x = np.concatenate(
        [
            -np.logspace(-9, 2.1, 40_000),
            np.linspace(-100.0, upper, 40_000),
            [0.0, -0.0, -87.33, -87.3365, -87.34, -88.0, -1e9, -np.inf, np.nan, -1e-30],
        ]
    ).astype(np.float32)
    return np.concatenate([x, np.zeros(-x.size % 16, np.float32)])


@pytest.mark.parametrize("width", [16, 1])
@pytest.mark.parametrize("kind", ["softmax", "general"])
def test_exp_matches_float64(width: int, kind: str) -> None:
    define = define_softmax_expf if kind == "softmax" else define_expf
    x = _inputs(0.0 if kind == "softmax" else 88.0)
    y = _compiled(define, width)(x)
    want = np.exp(x.astype(np.float64))
    normal = np.isfinite(want) & (want >= np.finfo(np.float32).tiny) & (want < np.finfo(np.float32).max)
    ulps = np.abs(y[normal] - want[normal]) / np.spacing(want[normal].astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.0
    assert np.all(y[x < -87.3366] == 0.0)  # -inf included
    assert np.isnan(y[np.isnan(x)]).all()
    assert np.all(y[x == 0.0] == 1.0)
