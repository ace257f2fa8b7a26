"""What the generated code looks like: GEMMs per kernel, one exported symbol, vector softmax.

GEMM counts are SPEC's cost model (per head and strip): forward 2; backward V alone 2, Q or K
alone 3, any two 4, all three 5. They are counted as ``scipy_cblas_sgemm`` call sites reached from
each kernel function ``attention.<id>`` / ``attention_bwd.<id>`` of the unoptimised module (its own
and those of the shared ``scores_softmax`` function it calls once per strip), with OpenBLAS taken
to have its small-matrix path (:func:`products_on_blas`): the small products of these shapes then
stay on BLAS, one call site each, where otherwise the register tiles take some of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import llvmlite.binding as llvm
import pytest
from codegen_helpers import WRT_SUBSETS, function_bodies, multi_graph, sgemm_calls_reached
from helpers import Case

import rlx
from rlx import Graph, Layout, MaskKind, OpKind, Wrt
from rlx.codegen import Executable
from rlx.ir.ops import AttentionBwdAttrs

EXPECTED_GEMMS = {
    Wrt.VALUE: 2,
    Wrt.QUERY: 3,
    Wrt.KEY: 3,
    Wrt.QUERY | Wrt.KEY: 4,
    Wrt.QUERY | Wrt.VALUE: 4,
    Wrt.KEY | Wrt.VALUE: 4,
    Wrt.ALL: 5,
}
FORWARD_GEMMS = 2


@pytest.fixture()
def products_on_blas(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Compile as if OpenBLAS ran small products on its small-matrix path (its SkylakeX kernels),
    where every product of these small static shapes is one ``sgemm`` call site. Without the
    path, the tiles take those whose size is known at compile time, and call no sgemm."""
    import dataclasses

    import rlx.codegen.executable as executable
    import rlx.codegen.lower_attention as lower_attention
    from rlx.codegen.blas import load_blas

    found = dataclasses.replace(load_blas(), corename="skylakex")
    monkeypatch.setattr(lower_attention, "load_blas", lambda: found)
    executable._cache.clear()  # programs compiled under the host's rule
    yield
    executable._cache.clear()  # and none compiled under this one for later tests


def kernel_gemms(exe: Executable) -> dict[str, int]:
    """``{"forward" or str(wrt): sgemm call sites}`` for every attention kernel of ``exe``."""
    bodies = function_bodies(exe.llvm_ir)
    counts: dict[str, int] = {}
    for node in exe.graph.nodes:
        if node.op is OpKind.INPUT:
            continue
        name = f"{node.op}.{node.id}"
        assert name in bodies, f"no kernel function {name!r}; functions: {sorted(bodies)}"
        if node.op is OpKind.ATTENTION:
            key = "forward"
        else:
            assert isinstance(node.attrs, AttentionBwdAttrs)
            key = str(node.attrs.wrt)
        assert key not in counts
        counts[key] = sgemm_calls_reached(bodies, name)
    return counts


@pytest.mark.parametrize(
    ("mask", "layout"),
    [
        (MaskKind.NONE, Layout.BSHD),
        (MaskKind.CAUSAL, Layout.BHSD),
        (MaskKind.sliding_window(2), Layout.BSHD),
        (MaskKind.CUSTOM, Layout.BSHD),
        (MaskKind.BIAS, Layout.BHSD),
    ],
    ids=str,
)
@pytest.mark.usefixtures("products_on_blas")
def test_gemms_per_kernel(mask: MaskKind, layout: Layout) -> None:
    """Each wrt subset costs exactly its SPEC number of GEMMs, whatever the mask and layout."""
    exe = rlx.compile(multi_graph(Case(33, 40, mask=mask, layout=layout)), passes=[])
    expected = {"forward": FORWARD_GEMMS} | {str(w): EXPECTED_GEMMS[w] for w in WRT_SUBSETS}
    assert kernel_gemms(exe) == expected


@pytest.mark.usefixtures("products_on_blas")
def test_fusion_saves_gemms() -> None:
    """rlx.grad's three nodes cost 3 + 3 + 2 = 8 GEMMs; the fused node 5 (forward: 2 either way)."""
    g = Graph("grad")
    case = Case(16, 16, mask=MaskKind.CAUSAL)
    q, k, v, dy = (
        g.input(n, s)
        for n, s in [("q", case.q_shape), ("k", case.kv_shape), ("v", case.kv_shape), ("dy", case.q_shape)]
    )
    out = g.attention(q, k, v, mask=case.mask)
    dq, dk, dv = rlx.grad(g, out, [q, k, v], dy)
    g.output(out=out, dq=dq, dk=dk, dv=dv)
    unfused = kernel_gemms(rlx.compile(g, passes=[]))
    fused = kernel_gemms(rlx.compile(g))
    assert unfused == {"forward": 2, "q": 3, "k": 3, "v": 2}
    assert fused == {"forward": 2, "q|k|v": 5}
    assert sum(unfused.values()) - unfused["forward"] == 8


@pytest.fixture(scope="module")
def exe() -> Executable:
    """A causal forward + all-gradients executable at a size where the softmax rows are long."""
    return rlx.compile(multi_graph(Case(40, 48, head_dim=16, mask=MaskKind.CAUSAL), wrts=(Wrt.ALL,)))


def test_only_the_entry_is_exported(exe: Executable) -> None:
    """Every function but ``rlx_entry`` is internal: one externally visible ``define``."""
    heads = function_bodies(exe.llvm_ir)
    exported = [name for name, (head, _) in heads.items() if not re.search(r"\b(internal|private)\b", head)]
    assert exported == ["rlx_entry"]
    assert len(re.findall(r"^define ", exe.llvm_ir, re.M)) == len(heads)  # the parser saw every define
    assert re.search(r'^define void @"?rlx_entry"?\(ptr %"?buffers"?, ptr %"?arena"?\)', exe.llvm_ir, re.M)


def test_llvm_ir_is_a_valid_module(exe: Executable) -> None:
    """The generated text parses and verifies on its own."""
    module = llvm.parse_assembly(exe.llvm_ir)
    module.verify()
    assert module.get_function("rlx_entry") is not None


def test_asm_and_compile_times(exe: Executable) -> None:
    """``exe.asm`` is real assembly of the entry; ``compile_times`` breaks the build into stages."""
    asm = exe.asm
    assert "rlx_entry:" in asm
    assert re.search(r"^\s+(call|ret)q?\b", asm, re.M)
    assert re.search(r"^\s+\.(text|section)", asm, re.M)
    assert {"passes", "lowering", "llvm_optimize", "machine_code"} <= set(exe.compile_times)
    for stage in ("passes", "lowering", "llvm_optimize", "machine_code"):
        assert exe.compile_times[stage] >= 0.0


def test_softmax_exp_is_vectorised(exe: Executable) -> None:
    """No scalar libm exp survives optimisation; the exp polynomial runs on 8- or 16-float vectors."""
    optimized = exe.optimized_llvm_ir
    assert optimized != exe.llvm_ir
    assert not re.search(r"@\"?expf\"?\(", optimized)
    assert not re.search(r"@\"?llvm\.exp\.", optimized)
    assert re.search(r"<(16|8) x float>", optimized)
    # The exp's 2^n, built from exponent bits on a vector: the exp loop itself is vector code,
    # not just the GEMM glue.
    assert re.search(r"shl <(16|8) x i32>", optimized)
    # The row sum of the softmax is a vector reduction.
    assert re.search(r"@llvm\.vector\.reduce\.fadd\.v(16|8)f32\(", optimized)
