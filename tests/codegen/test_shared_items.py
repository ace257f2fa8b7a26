"""Kernels of repeated layers share one item function: the module holds one copy of each body."""

from __future__ import annotations

import re

import numpy as np

import rlx
from rlx import Graph
from rlx.models import LMConfig, char_lm, init_params
from rlx.reference import evaluate


def item_functions(llvm_ir: str) -> list[str]:
    """Names of the kernel item functions the module defines (fused loops, matmuls, attention)."""
    return re.findall(r'^define internal void @"((?:fused|matmul|attention|attention_bwd)\.\d+)"', llvm_ir, re.M)


def test_identical_kernels_share_a_function_and_others_do_not() -> None:
    g = Graph("layers")
    w = g.input("w", (8, 8))
    outputs = {}
    for name, rows in (("a", 4), ("b", 4), ("c", 5)):  # a and b: identical kernels; c: other sizes
        x = g.input(name, (rows, 8))
        outputs[f"y{name}"] = g.silu(x @ w) * 2.0
    g.output(**outputs)
    exe = rlx.compile(g)
    names = item_functions(exe.llvm_ir)
    kinds = [n.split(".")[0] for n in names]
    assert kinds.count("matmul") == 2 and kinds.count("fused") == 2, names  # one for a and b, one for c
    assert len(exe.kernels) == 6  # every kernel still runs
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in g.inputs.items()}
    got, want = exe(**arrays), evaluate(g, arrays)
    for name in outputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert not np.allclose(got["ya"], got["yb"])  # each kernel read its own operands


def test_a_deep_model_compiles_each_distinct_kernel_once() -> None:
    config = LMConfig(vocab=11, seq=8, batch=2, embed=16, heads=2, layers=4)
    g, loss, params = char_lm(config)
    grads = rlx.grad(g, loss, params)
    g.output(loss=loss, **{f"d{i}": grad for i, grad in enumerate(grads)})
    exe = rlx.compile(g)
    names = item_functions(exe.llvm_ir)
    assert len(names) * 2 < len(exe.kernels)  # four layers share their kernels' code
    arrays = init_params(g, params)
    rng = np.random.default_rng(1)
    for name in ("tokens", "targets"):
        arrays[name] = rng.integers(0, config.vocab, (config.batch, config.seq)).astype(np.int32)
    got, want = exe(**arrays), evaluate(g, arrays)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-5, err_msg=name)
