"""Graph -> one LLVM module with one entry function ``void rlx_entry(ptr buffers, ptr arena)``.

``buffers`` holds the graph inputs then the output arrays, in ``MemoryPlan.buffer_names`` order;
intermediates and per-thread scratch live in ``arena``. Each node becomes a per-item function run
by a native parallel-for over batch x heads. A new op adds one entry to ``LOWERINGS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from rlx.codegen.irutil import I8, PTR, VOID, alloca_entry, gep, i64
from rlx.codegen.jit import ENTRY
from rlx.codegen.lower_attention import AttentionKernelSpec, AttentionLowering, choose_block_q
from rlx.codegen.memory_plan import MemoryPlan
from rlx.codegen.parallel import emit_parallel_for
from rlx.config import RuntimeConfig
from rlx.errors import RlxValueError
from rlx.ir.graph import Graph, Node
from rlx.ir.ops import AttentionAttrs, AttentionBwdAttrs, OpKind, attention_dims
from rlx.ir.types import Wrt

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class CodegenOptions:
    """Code-shape knobs for tests and tuning; the defaults are what users get."""

    block_q: int | None = None  # query rows per strip; None: chosen from the shapes
    order_seed: int | None = None  # plan a random topological order (planner fuzzing)


def kernel_spec(node: Node, config: RuntimeConfig, options: CodegenOptions) -> AttentionKernelSpec:
    """The attention kernel shape of an ATTENTION / ATTENTION_BWD node."""
    attrs = node.attrs
    assert isinstance(attrs, (AttentionAttrs, AttentionBwdAttrs))
    types = [v.type for v in node.inputs]
    is_bwd = node.op is OpKind.ATTENTION_BWD
    mask_type = types[4 if is_bwd else 3] if attrs.mask.needs_tensor else None
    dims = attention_dims(f"node {node.id}", types[0], types[1], types[2], attrs.layout,
                          types[3] if is_bwd else None, attrs.mask, mask_type)
    grads = attrs.wrt if isinstance(attrs, AttentionBwdAttrs) else None
    needs_dp = grads is not None and bool(grads & (Wrt.QUERY | Wrt.KEY))
    block_q = options.block_q or choose_block_q(dims.seq_q, dims.seq_k, needs_dp, attrs.mask.is_causal_like)
    spec = AttentionKernelSpec(dims, attrs.layout, attrs.mask, config.attn_mask_neg_inf,
                               config.mask_binary_threshold, grads, max(1, min(block_q, dims.seq_q)))
    _check_blas_limits(node, spec)
    return spec


def _check_blas_limits(node: Node, spec: AttentionKernelSpec) -> None:
    dims = spec.dims
    biggest = max(dims.seq_q, dims.seq_k, dims.heads * dims.head_dim, spec.block_q * dims.seq_k)
    if biggest > _INT32_MAX:
        raise RlxValueError(
            f"node {node.id} ({node.op}): a matrix dimension of {biggest} exceeds the 32-bit BLAS limit"
        )


def scratch_bytes(node: Node, config: RuntimeConfig, options: CodegenOptions) -> int:
    """Bytes of per-thread scratch the node's kernel needs."""
    if node.op in (OpKind.ATTENTION, OpKind.ATTENTION_BWD):
        return kernel_spec(node, config, options).scratch_bytes()
    return 0


def work_items(node: Node) -> int:
    """Independent items of the node's parallel loop (batch x heads for attention)."""
    if node.op in (OpKind.ATTENTION, OpKind.ATTENTION_BWD):
        b, _, h, _ = node.attrs.layout.split(node.inputs[0].shape)  # type: ignore[union-attr]
        return b * h
    return 0


def _lower_attention(module: ir.Module, node: Node, config: RuntimeConfig, options: CodegenOptions,
                     threads: int) -> tuple[ir.Function, int]:
    spec = kernel_spec(node, config, options)
    item_fn = AttentionLowering(module, spec, f"{node.op}.{node.id}").emit()
    return emit_parallel_for(module, item_fn, threads), spec.work_items


Lowering = Callable[[ir.Module, Node, RuntimeConfig, CodegenOptions, int], tuple[ir.Function, int]]
LOWERINGS: dict[OpKind, Lowering] = {
    OpKind.ATTENTION: _lower_attention,
    OpKind.ATTENTION_BWD: _lower_attention,
}


def lower_graph(graph: Graph, plan: MemoryPlan, config: RuntimeConfig, options: CodegenOptions) -> str:
    """Render the whole graph as LLVM IR text."""
    module = ir.Module(name=f"rlx.{graph.name}")
    entry = ir.Function(module, ir.FunctionType(VOID, [PTR, PTR]), name=ENTRY)
    buffers, arena = entry.args
    buffers.name, arena.name = "buffers", "arena"
    b = ir.IRBuilder(entry.append_basic_block("entry"))
    scratch = gep(b, arena, [i64(plan.scratch_offset)], I8, "scratch")
    for node in plan.order:
        if node.op is OpKind.INPUT:
            continue
        parallel_for, items = LOWERINGS[node.op](module, node, config, options, plan.threads)
        values = list(node.inputs) + list(node.outputs)
        args = alloca_entry(b, PTR, f"args.{node.id}", len(values))
        for slot, value in enumerate(values):
            location = plan.locations[value]
            if location.kind == "arena":
                ptr = gep(b, arena, [i64(location.index)], I8, f"node{value.node.id}.{value.index}")
            else:
                name = plan.buffer_names[location.index]
                ptr = b.load(gep(b, buffers, [i64(location.index)], PTR, f"{name}.slot"), typ=PTR, name=name)
            b.store(ptr, gep(b, args, [i64(slot)], PTR, f"args.{node.id}.{slot}"))
        b.call(parallel_for, [args, i64(items), scratch, i64(plan.scratch_stride)])
    b.ret_void()
    return str(module)
