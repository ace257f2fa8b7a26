"""Kernels of repeated layers share one item function: the module compiles one copy of each body.

Every kernel keeps a function of its own name (``matmul.12``) so the IR can be read kernel by
kernel; a kernel whose code another one holds has a one-line body that calls it, which LLVM drops
before making machine code.
"""

from __future__ import annotations

import re

import numpy as np
from codegen_helpers import function_bodies, product_calls_reached

import rlx
from rlx import Graph
from rlx.models import LMConfig, char_lm, init_params
from rlx.reference import evaluate

ITEM = re.compile(r"(?:fused|matmul|attention|attention_bwd)\.\d+")


def kernel_functions(llvm_ir: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(own, forwarding)``: item functions with code of their own, and those whose body only
    calls another item function (name -> the function called)."""
    own, forwarding = {}, {}
    for name, (_, body) in function_bodies(llvm_ir).items():
        if not ITEM.fullmatch(name):
            continue
        calls = re.findall(r'call [^@]*@"?([A-Za-z0-9_.]+)"?\(', body)
        if len(calls) == 1 and ITEM.fullmatch(calls[0]) and body.count("\n") <= 4:
            forwarding[name] = calls[0]
        else:
            own[name] = body
    return own, forwarding


def test_identical_kernels_share_a_function_and_others_do_not() -> None:
    g = Graph("layers")
    w = g.input("w", (8, 8))
    outputs = {}
    for name, rows in (("a", 4), ("b", 4), ("c", 5)):  # a and b: identical kernels; c: other sizes
        x = g.input(name, (rows, 8))
        outputs[f"y{name}"] = g.silu(x @ w) * 2.0
    g.output(**outputs)
    exe = rlx.compile(g)
    own, forwarding = kernel_functions(exe.llvm_ir)
    kinds = sorted(n.split(".")[0] for n in own)
    assert kinds == ["fused", "fused", "matmul", "matmul"], own.keys()  # one for a and b, one for c
    assert len(forwarding) == 2 and all(target in own for target in forwarding.values())
    assert len(exe.kernels) == 6  # every kernel still runs
    for node in exe.graph.nodes:  # and every matmul node has its function by name
        if node.op is rlx.OpKind.MATMUL:
            assert f"matmul.{node.id}" in own or f"matmul.{node.id}" in forwarding
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
    own, forwarding = kernel_functions(exe.llvm_ir)
    assert len(own) * 2 < len(exe.kernels) and len(forwarding) > len(own)  # four layers share code
    bodies = function_bodies(exe.llvm_ir)
    for node in exe.graph.nodes:  # each attention node's function reaches its products, shared or not
        if node.op in (rlx.OpKind.ATTENTION, rlx.OpKind.ATTENTION_BWD):
            assert product_calls_reached(bodies, f"{node.op}.{node.id}") >= 2
    arrays = init_params(g, params)
    rng = np.random.default_rng(1)
    for name in ("tokens", "targets"):
        arrays[name] = rng.integers(0, config.vocab, (config.batch, config.seq)).astype(np.int32)
    got, want = exe(**arrays), evaluate(g, arrays)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-5, err_msg=name)


def test_functions_that_only_name_a_kernel_are_not_compiled() -> None:
    g = Graph("twice")
    w = g.input("w", (16, 16))
    g.output(**{f"y{i}": g.input(f"x{i}", (4, 16)) @ w for i in range(3)})
    exe = rlx.compile(g)
    _, forwarding = kernel_functions(exe.llvm_ir)
    assert len(forwarding) == 2
    optimized = exe._program.library.optimized_ir
    assert optimized is not None
    for name in forwarding:
        assert f'@"{name}"' not in optimized


def test_matmuls_of_different_steps_of_one_array_share_a_function() -> None:
    """An unrolled loop's products each read their own step of the scanned array: the step's
    offset goes into the operand's pointer, not into the kernel's code."""
    g = Graph("steps")
    xs, w = g.input("xs", (5, 3, 4)), g.input("w", (4, 6))
    g.output(**{f"y{i}": xs[i] @ w for i in range(5)}, z=xs[1][:, :3] @ w[1:4])
    exe = rlx.compile(g)
    own, forwarding = kernel_functions(exe.llvm_ir)
    matmuls = [name for name in own if name.startswith("matmul")]
    assert len(matmuls) == 2, own.keys()  # the five steps' products, and the one with other sizes
    assert sum(name.startswith("matmul") for name in forwarding) == 4  # the other steps call the first's
    rng = np.random.default_rng(1)
    arrays = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in g.inputs.items()}
    got = exe(**arrays)
    for i in range(5):
        np.testing.assert_allclose(got[f"y{i}"], arrays["xs"][i] @ arrays["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["z"], arrays["xs"][1][:, :3] @ arrays["w"][1:4], rtol=1e-5, atol=1e-6)
