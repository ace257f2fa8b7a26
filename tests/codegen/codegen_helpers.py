"""Builders and comparisons shared by the codegen tests (imported as ``codegen_helpers``).

Compiled results are always compared with ``rlx.reference`` on the same graph and inputs.
Graphs put several attention nodes side by side (forward plus several ``wrt`` subsets) so one
compilation covers many kernels; compile those with ``passes=[]`` so that CSE and fusion do not
merge the nodes under test.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
from helpers import Case

import rlx
from rlx import Graph, MaskKind, RuntimeConfig, Value, Wrt
from rlx.codegen import CodegenOptions, Executable, compile_graph

# Every subset of {dQ, dK, dV} an attention_bwd node can compute.
WRT_SUBSETS: tuple[Wrt, ...] = (
    Wrt.QUERY,
    Wrt.KEY,
    Wrt.VALUE,
    Wrt.QUERY | Wrt.KEY,
    Wrt.QUERY | Wrt.VALUE,
    Wrt.KEY | Wrt.VALUE,
    Wrt.ALL,
)
MASKS: tuple[MaskKind, ...] = (
    MaskKind.NONE,
    MaskKind.CAUSAL,
    MaskKind.sliding_window(0),
    MaskKind.sliding_window(3),
    MaskKind.CUSTOM,
    MaskKind.BIAS,
)
FLAG_NAMES = {Wrt.QUERY: "dq", Wrt.KEY: "dk", Wrt.VALUE: "dv"}

RTOL = 1e-4
ATOL = 1e-5


def wrt_tag(wrt: Wrt) -> str:
    """``Wrt.QUERY | Wrt.KEY`` -> ``"qk"`` (usable in output names)."""
    return str(wrt).replace("|", "")


def grad_output_name(wrt: Wrt, flag: Wrt) -> str:
    """Name of the ``flag`` gradient of the node with ``wrt``, e.g. ``qk_dq``."""
    return f"{wrt_tag(wrt)}_{FLAG_NAMES[flag]}"


def declare_inputs(g: Graph, case: Case, suffix: str = "") -> tuple[Value, Value, Value, Value, Value | None]:
    """Inputs q, k, v, dy and (for CUSTOM/BIAS) ``mask``, each name followed by ``suffix``."""
    q = g.input(f"q{suffix}", case.q_shape)
    k = g.input(f"k{suffix}", case.kv_shape)
    v = g.input(f"v{suffix}", case.kv_shape)
    dy = g.input(f"dy{suffix}", case.q_shape)
    mask = g.input(f"mask{suffix}", case.mask_shape) if case.mask_shape is not None else None
    return q, k, v, dy, mask


def add_attention_nodes(
    g: Graph,
    case: Case,
    inputs: tuple[Value, Value, Value, Value, Value | None],
    wrts: Iterable[Wrt] = WRT_SUBSETS,
    forward: bool = True,
    suffix: str = "",
) -> dict[str, Value]:
    """Add a forward node (output ``out``) and one backward node per ``wrt``; returns name -> value."""
    q, k, v, dy, mask = inputs
    named: dict[str, Value] = {}
    if forward:
        named[f"out{suffix}"] = g.attention(q, k, v, mask=case.mask, layout=case.layout, mask_input=mask)
    for wrt in wrts:
        grads = g.attention_bwd(q, k, v, dy, wrt=wrt, mask=case.mask, layout=case.layout, mask_input=mask)
        grads = grads if isinstance(grads, tuple) else (grads,)
        for flag, value in zip(wrt.members, grads, strict=True):
            named[grad_output_name(wrt, flag) + suffix] = value
    return named


def multi_graph(case: Case, wrts: Iterable[Wrt] = WRT_SUBSETS, forward: bool = True, name: str = "multi") -> Graph:
    """One graph: forward attention plus one attention_bwd node per ``wrt`` subset, all on q, k, v, dy."""
    g = Graph(name)
    g.output(**add_attention_nodes(g, case, declare_inputs(g, case), wrts, forward))
    return g


def key_padding(rng: np.random.Generator, batch: int, seq_k: int) -> np.ndarray:
    """A ``[B, Sk]`` key-padding mask: batch 0 has kept and padded keys, the last batch is all padded.

    Kept values sit on or above the 0.5 threshold (0.5 itself is kept), padded ones below it.
    """
    pad = rng.choice(np.array([0.5, 0.75, 1.0]), size=(batch, seq_k))
    padded = rng.random((batch, seq_k)) < 0.4
    pad = np.where(padded, rng.choice(np.array([0.0, 0.25, 0.49]), size=(batch, seq_k)), pad)
    if seq_k >= 2:
        pad[0, 0] = 0.0  # at least one padded key ...
        pad[0, -1] = 1.0  # ... and at least one kept key in batch 0
    if batch >= 2:
        pad[-1, :] = 0.0  # a batch whose every key is padded: all its rows are fully masked
    return pad.astype(np.float32)


def case_inputs(case: Case, rng: np.random.Generator, suffix: str = "", scale: float = 1.0) -> dict[str, np.ndarray]:
    """float32 inputs for :func:`declare_inputs`; custom masks come from :func:`key_padding`."""
    arrays = {
        f"q{suffix}": scale * rng.standard_normal(case.q_shape),
        f"k{suffix}": scale * rng.standard_normal(case.kv_shape),
        f"v{suffix}": rng.standard_normal(case.kv_shape),
        f"dy{suffix}": rng.standard_normal(case.q_shape),
    }
    if case.mask == MaskKind.CUSTOM:
        arrays[f"mask{suffix}"] = key_padding(rng, case.batch, case.seq_k)
    elif case.mask == MaskKind.BIAS:
        arrays[f"mask{suffix}"] = rng.standard_normal(case.mask_shape)
    return {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in arrays.items()}


def assert_close(
    actual: np.ndarray, expected: np.ndarray, name: str = "", rtol: float = RTOL, atol: float = ATOL
) -> None:
    """float32 agreement: ``atol`` scales with the largest expected magnitude; NaNs must coincide."""
    assert isinstance(actual, np.ndarray), f"{name}: {type(actual).__name__} is not an ndarray"
    assert actual.dtype == np.float32, f"{name}: dtype {actual.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    finite = np.isfinite(expected)
    magnitude = float(np.max(np.abs(expected[finite]), initial=0.0))
    np.testing.assert_allclose(
        actual, expected, rtol=rtol, atol=atol * max(1.0, magnitude), equal_nan=True, err_msg=name
    )


def assert_outputs_close(
    actual: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    rtol: float = RTOL,
    atol: float = ATOL,
    context: str = "",
) -> None:
    """Same output names, and every output close per :func:`assert_close`."""
    assert sorted(actual) == sorted(expected), f"{context}: outputs {sorted(actual)} != {sorted(expected)}"
    for name, value in expected.items():
        assert_close(actual[name], value, f"{context} {name}".strip(), rtol=rtol, atol=atol)


def compile_and_run(
    g: Graph,
    arrays: Mapping[str, np.ndarray],
    passes: Sequence[str] | None = (),
    config: RuntimeConfig | None = None,
    options: CodegenOptions | None = None,
) -> tuple[Executable, dict[str, np.ndarray]]:
    """Compile (default: exactly as built) and call once."""
    exe = compile_graph(g, passes=None if passes is None else list(passes), config=config, options=options)
    return exe, exe(**arrays)


def check_against_reference(
    g: Graph,
    arrays: Mapping[str, np.ndarray],
    passes: Sequence[str] | None = (),
    config: RuntimeConfig | None = None,
    options: CodegenOptions | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
    context: str = "",
) -> dict[str, np.ndarray]:
    """Compile ``g``, run it and the reference on ``arrays``, assert they agree; return compiled outputs."""
    _, got = compile_and_run(g, arrays, passes, config, options)
    expected = rlx.reference.run(g, config=config, **arrays)
    assert_outputs_close(got, expected, rtol=rtol, atol=atol, context=context)
    return got


_DEFINE = re.compile(r"^define (?P<head>[^@]*)@\"?(?P<name>[^\"(]+)\"?\(.*?\{$(?P<body>.*?)^\}$", re.M | re.S)
_SGEMM_CALL = re.compile(r"call void @\"?scipy_cblas_sgemm\"?\(")


def function_bodies(llvm_ir: str) -> dict[str, tuple[str, str]]:
    """``{function name: (linkage and attributes before the name, body)}`` of every ``define``."""
    return {m["name"]: (m["head"], m["body"]) for m in _DEFINE.finditer(llvm_ir)}


def sgemm_calls(body: str) -> int:
    """Number of ``scipy_cblas_sgemm`` call sites in one function body."""
    return len(_SGEMM_CALL.findall(body))


_CALL = re.compile(r'call [^@]*@"?([A-Za-z0-9_.]+)"?\(')


def sgemm_calls_reached(
    bodies: dict[str, tuple[str, str]], name: str, count: Callable[[str], int] | None = None
) -> int:
    """``scipy_cblas_sgemm`` call sites (or what ``count`` counts in a body) in function ``name``
    and, per call site, in the module's own functions it calls (a kernel calls the shared
    ``scores_softmax`` function once per strip)."""
    count = count or sgemm_calls
    body = bodies[name][1]
    callees = [callee for callee in _CALL.findall(body) if callee in bodies and callee != name]
    return count(body) + sum(sgemm_calls_reached(bodies, callee, count) for callee in callees)


_PRODUCT_CALL = re.compile(r'call [^@]*@"?(scipy_cblas_sgemm|rlx_tile_gemm_\w+)"?\(')


def product_calls_reached(bodies: dict[str, tuple[str, str]], name: str) -> int:
    """Matrix-product call sites reached from function ``name``: OpenBLAS's ``sgemm`` and the
    register tiles' products (``rlx.codegen.tile_gemm``), which take small products where
    OpenBLAS would pack them."""
    return sgemm_calls_reached(bodies, name, lambda body: len(_PRODUCT_CALL.findall(body)))
