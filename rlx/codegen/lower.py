"""Graph -> one LLVM module with one entry function ``void rlx_entry(ptr buffers, ptr arena)``.

``buffers`` holds the graph inputs then the output arrays, in ``MemoryPlan.buffer_names`` order,
then the call's own buffers (block maps), then the most threads the call may use (0: all);
intermediates and per-thread scratch live in ``arena``; constants are data in the module. The
schedule (:mod:`rlx.codegen.schedule`) lists the kernels of one call; each becomes an item
function run by a native parallel-for: fused loop nests (:mod:`rlx.codegen.fused`), BLAS
matmuls (:mod:`rlx.codegen.lower_gemm`), attention (:mod:`rlx.codegen.lower_attention`) and the
embedding scatter-add (:mod:`rlx.codegen.lower_scatter`).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir

from rlx.bind import checked_in_kernel
from rlx.codegen.blas import load_blas, refuse_beyond_blas
from rlx.codegen.fused import FusedEmitter, plan_chunking
from rlx.codegen.irutil import I8, I64, PTR, VOID, clock, declare, gep, i64
from rlx.codegen.jit import ENTRY
from rlx.codegen.kernel_clock import COUNTERS_BYTES
from rlx.codegen.lower_attention import (
    INPUT_SLOTS,
    AttentionKernelSpec,
    AttentionLowering,
    HeadDims,
    OperandStrides,
    bands_strips,
    rows_strided,
    slot_heads_and_width,
)
from rlx.codegen.lower_gemm import Operand, emit_gemm_item, gemm_spec
from rlx.codegen.lower_linalg import LINALG_OPS, emit_linalg_item, linalg_scratch_bytes
from rlx.codegen.lower_scan import SCAN_OPS, emit_scan_item
from rlx.codegen.lower_scatter import emit_scatter_along_axis_item, emit_scatter_item
from rlx.codegen.lower_sort import emit_sort_item
from rlx.codegen.memory_plan import MemoryPlan
from rlx.codegen.parallel import Arguments, Step, emit_team, forward_to, share_identical_items
from rlx.codegen.schedule import Kernel, Schedule, attention_batch_stride
from rlx.codegen.sizes import Size, SizeLike, emit_size, load_symbols
from rlx.codegen.strip_heights import choose_block_q, strip_heights
from rlx.codegen.views import View
from rlx.config import RuntimeConfig, l2_cache_bytes
from rlx.errors import RlxValueError
from rlx.ir.dims import product
from rlx.ir.graph import Graph, Node, Value
from rlx.ir.ops import AttentionAttrs, AttentionBwdAttrs, OpKind, attention_dims
from rlx.ir.region import Region
from rlx.ir.types import Dim, Layout, Wrt, resolve_dims
from rlx.ops.flex_attention import (
    FlexAttentionBwdAttrs,
    bwd_operands,
    dims_are_static,
    flex_dims,
    flex_slots,
    reads_in_range_by_construction,
    tensor_grad_layout,
)

if TYPE_CHECKING:
    from rlx.codegen.block_map import TileGrid
    from rlx.codegen.lower_flex import FlexKernelSpec

_Spec = TypeVar("_Spec", "AttentionKernelSpec", "FlexKernelSpec")  # the specs of both attention lowerings


@dataclass(frozen=True)
class CodegenOptions:
    """Code-shape knobs for tests and tuning; the defaults are what users get."""

    block_q: int | None = None  # query rows per strip; None: chosen from the shapes
    order_seed: int | None = None  # plan a random topological order (planner fuzzing)
    profile: bool = False  # time every kernel of a call (``Executable.profile``)
    masks_as_mods: bool = False  # fixed-mask attention through the programmable kernels (rlx.passes.masks_as_mods)
    stream_outputs: bool | None = None  # attention outputs streamed out; None: when a node's data exceed the L2 caches


def graph_symbols(graph: Graph) -> tuple[str, ...]:
    """The graph's symbolic dimensions, sorted: the order of the per-call sizes table."""
    return tuple(sorted({name for node in graph.nodes for ty in node.types for name in ty.symbols}))


def kernel_spec(
    node: Node,
    config: RuntimeConfig,
    options: CodegenOptions,
    symbols: tuple[str, ...] = (),
    views: Sequence[View | None] = (),
) -> AttentionKernelSpec:
    """The attention kernel shape of an ATTENTION / ATTENTION_BWD node (``symbols``: the graph's;
    ``views``: how the schedule reads its operands, where some are strided views)."""
    attrs = node.attrs
    assert isinstance(attrs, (AttentionAttrs, AttentionBwdAttrs))
    types = [v.type for v in node.inputs]
    is_bwd = node.op is OpKind.ATTENTION_BWD
    mask_type = types[4 if is_bwd else 3] if attrs.mask.needs_tensor else None
    dims = attention_dims(
        f"node {node.id}",
        types[0],
        types[1],
        types[2],
        attrs.layout,
        types[3] if is_bwd else None,
        attrs.mask,
        mask_type,
    )
    grads = attrs.wrt if isinstance(attrs, AttentionBwdAttrs) else None
    needs_dp = grads is not None and bool(grads & (Wrt.QUERY | Wrt.KEY))
    strides = operand_strides(attrs.layout, dims, views)
    width = max(dims.head_dim, dims.value_dim)
    strided = rows_strided(attrs.layout, dims, strides, grads is not None)
    causal_like, small_path = attrs.mask.is_causal_like, load_blas().has_small_path
    heights = strip_heights(needs_dp, causal_like, strided, width, small_path, bands_strips(attrs.mask))
    if isinstance(dims.seq_q, int) and isinstance(dims.seq_k, int):
        block_q = max(1, min(options.block_q or heights.rows(dims.seq_q, dims.seq_k), dims.seq_q))
    elif options.block_q:  # one strip height for every call (tests choose one)
        block_q = options.block_q
    else:  # each call picks its own by the same rules, in native code: block_q is the tallest
        block_q = heights.most_rows()
    spec = AttentionKernelSpec(
        dims,
        attrs.layout,
        attrs.mask,
        config.attn_mask_neg_inf,
        config.mask_binary_threshold,
        grads,
        block_q,
        symbols,
        options.profile,
        strides=strides,
        heights=None if options.block_q else heights,
        **streaming(node, options.stream_outputs),
    )
    if spec.is_static:
        check_blas_limits(f"node {node.id} ({node.op})", spec)
    return spec


def operand_strides(layout: Layout, dims: HeadDims, views: Sequence[View | None]) -> tuple[OperandStrides, ...]:
    """The strides of the operands the schedule reads through strided views (q, k, v, dy in
    order; a dense view reads as the layout says). A dimension of size 1 is never stepped over,
    so its stride is whatever keeps BLAS content: a lone row's leading dimension is its width."""
    found = []
    for slot, view in zip(INPUT_SLOTS, views, strict=False):
        if view is None or view.is_dense:
            continue
        batch = attention_batch_stride(view, layout)
        _, row, head, _ = layout.split(view.strides)
        assert batch is not None and isinstance(row, int) and isinstance(head, int), "a view the schedule copies"
        heads, width = slot_heads_and_width(dims, slot)
        lone = layout.split(view.shape)[1] == 1
        found.append(OperandStrides(slot, batch[0], head if heads > 1 else 0, width if lone else row, batch[1]))
    return tuple(found)


def streaming(node: Node, wanted: bool | None = None) -> dict[str, Any]:
    """The :class:`AttentionKernelSpec` fields that say whether an attention node's kernel stages
    its outputs and streams them out: on x86 (the stores and their fence), and (``wanted`` None)
    when the node's operands and outputs together exceed the L2 caches. Then a call's outputs
    are no longer in cache when the kernel writes them, and writing in place would first read
    every line back from memory (``AttentionLowering._stream_out``). With symbolic shapes each
    call decides: ``stream_when`` holds the operands' and outputs' shapes and item sizes, whose
    bytes it weighs against ``stream_above`` (0 when ``wanted``: always). ``wanted`` True or
    False decides for tests."""
    if wanted is False or not llvm.get_process_triple().startswith("x86_64"):
        return {"stream": False}
    values = [*node.inputs, *node.outputs]
    if all(value.type.is_static for value in values):
        return {"stream": bool(wanted) or sum(value.type.nbytes for value in values) > l2_cache_bytes()}
    when = tuple((tuple(value.shape), value.type.dtype.itemsize) for value in values)
    return {"stream": True, "stream_when": when, "stream_above": 0 if wanted else l2_cache_bytes()}


def check_blas_limits(what: str, spec: AttentionKernelSpec) -> None:
    """BLAS takes 32-bit sizes: refuse shapes (at compile time, or per call for symbolic ones) beyond them."""
    dims = spec.dims
    assert isinstance(dims.seq_q, int) and isinstance(dims.seq_k, int)
    rows_apart = (given.row for given in spec.strides)
    refuse_beyond_blas(what, dims.seq_q, dims.seq_k, dims.heads * dims.head_dim, spec.block_q * dims.seq_k, *rows_apart)


FLEX_OPS = ("flex_attention", "flex_attention_bwd")


def flex_captured(node: Node) -> tuple[Value, ...]:
    """The captured tensors of a flex node (after q, k, v, and in the backward out, dy, lse, dlse)."""
    if node.op.value == "flex_attention":
        return node.inputs[3:]
    return node.inputs[bwd_operands(node.attrs) :]


SYMBOLIC_FLEX_BLOCK_Q = 64  # strip height of a flex kernel whose lengths are known per call


def flex_spec(
    node: Node, options: CodegenOptions, symbols: tuple[str, ...] = (), views: Sequence[View | None] = ()
) -> FlexKernelSpec:
    """The kernel shape of a flex_attention / flex_attention_bwd node (its block map kind
    included; ``views``: how the schedule reads its operands, where some are strided views)."""
    # The flex modules load on first use: graphs without programmable attention never pay for them.
    from rlx.codegen.block_map import TileGrid, choose_blocks
    from rlx.codegen.lower_flex import FlexKernelSpec

    attrs = node.attrs
    backward = isinstance(attrs, FlexAttentionBwdAttrs)
    q, k, v = (x.type for x in node.inputs[:3])
    dims = flex_dims(f"node {node.id}", q, k, v, attrs.layout)
    captured = tuple(x.type for x in flex_captured(node))
    grads = attrs.wrt if backward else None
    tensor_grads = tuple(tensor_grad_layout(attrs.score_mod, captured, dims)) if backward and attrs.tensor_grads else ()
    needs_dp = backward and (bool(attrs.wrt & (Wrt.QUERY | Wrt.KEY)) or bool(tensor_grads))
    static = dims_are_static(dims) and all(t.is_static for t in captured)
    # The tile map comes from the mask_mod and from a score_mod that replaces the scores outside
    # some index condition by a constant (a MaskKind with a finite neg): hidden tiles skipped.
    mask, masked_value = map_mask(attrs.score_mod, attrs.mask_mod)
    if isinstance(dims.seq_q, int) and isinstance(dims.seq_k, int):
        small_path = load_blas().has_small_path
        block_q, block_k = choose_blocks(dims.seq_q, dims.seq_k, needs_dp, mask is not None, small_path)
        if mask is None and attrs.score_mod is None:  # nothing to skip: as tall as the fixed kernels
            width = max(dims.head_dim, dims.value_dim)
            block_q = choose_block_q(dims.seq_q, dims.seq_k, needs_dp, False, head_dim=width, small_path=small_path)
        if options.block_q:
            block_q = max(1, min(options.block_q, dims.seq_q))
    else:  # one kernel for every length: tiles of a fixed size, the last ones cut at the length
        block_q, block_k = options.block_q or SYMBOLIC_FLEX_BLOCK_Q, 64
    deps = set().union(*mask.dependences()) if mask is not None else set()
    grid = TileGrid(dims.batch, dims.heads, dims.seq_q, dims.seq_k, block_q, block_k, "b" in deps, "h" in deps)
    if mask is None:
        kind = "none"
    elif not static:
        kind = "call"  # made for each call's lengths (and tensors), in a buffer of its own
    elif any(flex_captured(node)[t].node.op is OpKind.INPUT for _, t in mask.reads()):
        kind = "dynamic"
    else:
        kind = "static"
    scale = attrs.scale if attrs.scale is not None else 1.0 / math.sqrt(dims.head_dim)
    lse_grad = bool(getattr(attrs, "lse_grad", False))
    recompute = bool(getattr(attrs, "recompute", False))
    return FlexKernelSpec(
        dims,
        attrs.layout,
        scale,
        attrs.score_mod,
        attrs.mask_mod,
        captured,
        grads,
        tensor_grads,
        lse_grad,
        grid,
        kind,
        symbols,
        recompute,
        mask,
        masked_value,
        options.profile,
        strides=operand_strides(attrs.layout, dims, flex_input_views(node, views)) if views else (),
    )


def flex_input_views(node: Node, views: Sequence[View | None]) -> list[View | None]:
    """The views of a flex node's q, k, v and (backward) dy, in :data:`INPUT_SLOTS` order."""
    slots = flex_slots(node.attrs)
    return [views[slots.index(slot)] if slot in slots else None for slot in INPUT_SLOTS]


def map_mask(score_mod: Region | None, mask_mod: Region | None) -> tuple[Region | None, float]:
    """The region a node's tile map is built from, and the score its hidden tiles stand for.

    ``mask_mod`` hides scores as ``-inf``. A score_mod ``where(cond, value, x)`` with ``cond`` of
    indices (and tensors) replaces scores by ``value``: its tiles outside ``cond`` are skipped
    too, which is exact while ``exp(value - rowmax)`` vanishes; the kernels check that per row
    and recompute the strip over every key when it does not (``masked_value`` finite).
    """
    replaced = score_mod.replaced_where() if score_mod is not None else None
    if replaced is None:
        return mask_mod, -math.inf
    visible, value = replaced
    return (visible if mask_mod is None else mask_mod.conjoin(visible)), value


def block_map_arrays(
    node: Node, bound: Mapping[str, np.ndarray] | None, options: CodegenOptions | None = None
) -> np.ndarray:
    """The node's tile states: from constants (and, per call, ``bound`` inputs); unknown tensors are bounded loosely."""

    spec = flex_spec(node, options or CodegenOptions())
    return _tile_states(spec, flex_captured(node), bound)


# Below this many multiply-adds a call's kernel runs in well under a millisecond, less than
# working out which tiles its mask tensors hide takes in NumPy (~0.3-0.5 ms: a batched decode
# step with a padding mask took 0.6 ms a step against torch's 0.09). Such a call's tiles are
# all PARTIAL: the mask is evaluated per element, exact as ever, and no tile is skipped.
SMALL_CALL_MACS = 1 << 24


def small_call(batch: int, heads: int, seq_q: int, seq_k: int, head_dims: int, threshold: int | None = None) -> bool:
    """Whether a call's multiply-adds are below ``threshold`` (default :data:`SMALL_CALL_MACS`),
    as the kernels decide it in native code (``FlexLowering._map_unread``): a product of
    float64s, exact below 2^53 and never below the threshold when the sizes are above it."""
    limit = SMALL_CALL_MACS if threshold is None else threshold
    return float(batch) * float(heads) * float(seq_q) * float(seq_k) * float(head_dims) < limit


def _per_call_states(
    spec: FlexKernelSpec, captured: tuple[Value, ...], bound: Mapping[str, np.ndarray] | None, grid: TileGrid
) -> np.ndarray:
    """A call's tile states from its tensors (:func:`_tile_states`), or every tile PARTIAL for a
    small call (:data:`SMALL_CALL_MACS`); the choice depends on the sizes alone."""
    from rlx.codegen.block_map import PARTIAL

    dims = spec.dims
    if small_call(int(grid.batch), dims.heads, int(grid.seq_q), int(grid.seq_k), dims.head_dim + dims.value_dim):
        return np.full(grid.shape, PARTIAL, dtype=np.uint8)
    return _tile_states(spec, captured, bound, grid)


def _tile_states(
    spec: FlexKernelSpec,
    captured: tuple[Value, ...],
    bound: Mapping[str, np.ndarray] | None,
    grid: TileGrid | None = None,
) -> np.ndarray:
    """Tile states on ``grid`` (default: the spec's; a grid resolved to one call's lengths)."""
    from rlx.codegen.block_map import tile_states

    assert spec.map_mask is not None
    tensors: list[np.ndarray | None] = []
    for value in captured:
        source = value.node
        if source.op is OpKind.CONSTANT:
            tensors.append(source.attrs.value.array)
        elif source.op is OpKind.INPUT and bound is not None:
            tensors.append(np.asarray(bound[source.attrs.name]))
        else:
            tensors.append(None)
    return tile_states(spec.map_mask, spec.grid if grid is None else grid, tensors)


def scratch_bytes(node: Node, config: RuntimeConfig, options: CodegenOptions, schedule: Schedule | None = None) -> int:
    """Bytes of per-thread scratch the node's kernel needs (0 where that is only known per call);
    ``schedule``: how it reads its operands, as :func:`kernel_spec` takes them."""
    if node.op in (OpKind.ATTENTION, OpKind.ATTENTION_BWD):
        views = [schedule.view(v) for v in node.inputs] if schedule is not None else []
        spec = kernel_spec(node, config, options, views=views)
        return spec.scratch_bytes() if spec.is_static else 0
    if node.op.value in FLEX_OPS:
        flex = flex_spec(node, options)
        return flex.scratch_bytes() if flex.is_static else 0
    if node.op.value in LINALG_OPS:
        rows, columns = (int(d) for d in node.inputs[0].shape[-2:])
        return linalg_scratch_bytes(node.op.value, rows, columns)
    return 0


@dataclass(frozen=True)
class CallData:
    """Bytes the executable writes into the arena before each call (a per-call block map)."""

    offset: int  # from the start of the call data
    nbytes: int
    fill: Callable[[Mapping[str, np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class IndexFault:
    """Where the kernels that read memory with ids the graph computes (a gather of rows by an
    ``argmax``) report a bad one: a word of the call data, zeroed before each call, into which a
    kernel stores an id outside ``[0, limit)`` (never 0: 0 is in every range) and reads row 0
    instead. The executable raises on it after the call."""

    offset: int  # from the start of the call data
    what: str  # IndexOperand.describe of the node's ids
    limit: Dim


def _no_fault(bound: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.zeros(1, np.int64)


UNREAD_MAP = np.zeros(1, dtype=np.uint8)
"""What a call passes for a block map its kernel does not read (:meth:`CallMap.unread`)."""


STRIDE_BUCKET = 64  # symbol sizes that share a scratch stride (see DynamicScratch.stride)
STRIDES_KEPT = 256


@dataclass(frozen=True)
class DynamicScratch:
    """Per-thread scratch of a graph with symbolic dimensions: sized per call, after the arena's
    static part, its stride read by native code from the last entry of the sizes table."""

    symbols: tuple[str, ...]
    specs: tuple[tuple[str, AttentionKernelSpec | FlexKernelSpec], ...]  # (what, spec) per attention node
    static_stride: int  # what the kernels of static shape need
    offset: int  # arena offset of the scratch (after everything of static size)

    # per bucket of sizes (see stride), filled by calls; read by the generated layout functions
    bucket_strides: dict[tuple[int, ...], int] = field(default_factory=dict, compare=False, repr=False)

    def stride(self, sizes: Mapping[str, int]) -> int:
        """Bytes of scratch per thread for this call's sizes: enough for every size up to the
        next :data:`STRIDE_BUCKET`, kept by bucket, so that a decode loop (a new key length each
        step) works it out once per bucket instead of every step, when the spec objects it walks
        have left the caches (that walk was a sixth of a decode step). Scratch only grows with
        the sizes and the BLAS limits only fail above some size, so a bucket's stride serves
        every size in it and a bucket past a limit checks the call's own sizes."""
        bucket = tuple(-(-sizes.get(name, 1) // STRIDE_BUCKET) * STRIDE_BUCKET for name in self.symbols)
        stride = self.bucket_strides.get(bucket)
        if stride is None:
            try:
                stride = self._stride(dict(zip(self.symbols, bucket, strict=True)))
            except RlxValueError:
                return self._stride(sizes)
            if len(self.bucket_strides) >= STRIDES_KEPT:
                self.bucket_strides.clear()
            self.bucket_strides[bucket] = stride
        return stride

    def _stride(self, sizes: Mapping[str, int]) -> int:
        """Bytes of scratch per thread for exactly these sizes (BLAS limits checked on the way)."""
        most = self.static_stride
        for what, spec in self.specs:  # per call, so no new spec: the sizes go in directly
            seq_q, seq_k = resolve_dims((spec.dims.seq_q, spec.dims.seq_k), sizes)
            if not isinstance(spec, AttentionKernelSpec):
                strip = spec.grid.block_q * seq_k
            elif spec.heights is not None:  # the strip floats the scratch holds for these lengths
                strip = spec.heights.most_floats(seq_k)
            else:
                strip = spec.block_q * seq_k
            refuse_beyond_blas(what, seq_q, seq_k, strip)
            most = max(most, spec.scratch_bytes(seq_k, seq_q))
        return -(-most // 64) * 64

    def table(self, sizes: Mapping[str, int]) -> tuple[bytes, int]:
        """The sizes table native code reads (each symbol's size, then the scratch stride, as
        int64) and that stride."""
        # A symbol only an omitted input names (one no output needs) reaches no kernel: any size.
        stride = self.stride(sizes)
        return struct.pack(f"={len(self.symbols) + 1}q", *(sizes.get(name, 1) for name in self.symbols), stride), stride


@dataclass(frozen=True)
class LoweredModule:
    llvm_ir: str
    call_data: tuple[CallData, ...]
    call_data_offset: int  # arena offset of the call data
    profile_offset: int  # arena offset of the per-kernel timings (profiling builds)
    dynamic: DynamicScratch | None = None  # graphs with symbolic dimensions
    call_buffers: tuple[tuple[str, CallMap], ...] = ()  # block maps made per call
    index_faults: tuple[IndexFault, ...] = ()  # where kernels report bad computed ids


@dataclass
class _Lowering:
    """State while one graph is lowered: the module, the entry builder and where buffers are."""

    plan: MemoryPlan
    schedule: Schedule
    config: RuntimeConfig
    options: CodegenOptions
    threads: int
    module: ir.Module
    b: ir.IRBuilder
    buffers: ir.Value
    arena: ir.Value
    constants: dict[Value, ir.GlobalVariable]
    steps: list[Step] = field(default_factory=list)
    arguments: Arguments = field(default_factory=Arguments)  # every step's pointers
    _bases: dict[tuple[object, ...], ir.Value] = field(default_factory=dict)
    call_data: list[CallData] = field(default_factory=list)
    call_data_bytes: int = 0
    symbols: tuple[str, ...] = ()
    sizes: ir.Value | None = None  # the per-call sizes table (graphs with symbolic dimensions)
    attention_specs: list[tuple[str, AttentionKernelSpec | FlexKernelSpec]] = field(default_factory=list)
    call_buffers: list[tuple[str, CallMap]] = field(default_factory=list)
    index_faults: dict[Node, IndexFault] = field(default_factory=dict)
    _entry_symbols: dict[str, ir.Value] | None = None
    _items: dict[tuple[object, ...], ir.Function] = field(default_factory=dict)

    def item_function(self, key: tuple[object, ...], name: str, emit: Callable[[], ir.Function]) -> ir.Function:
        """The item function for ``key`` (a kernel's spec, which alone decides its code): emitted
        once, so the equal matmuls and attention nodes of repeated layers are not even emitted
        twice (identical fused loops are shared after emission: ``share_identical_items``). A
        later kernel of the same spec gets only a function ``name`` that calls the first."""
        fn = self._items.get(key)
        if fn is None:
            return self._items.setdefault(key, emit())
        forward_to(ir.Function(self.module, fn.function_type, name=name), fn)
        return fn

    def base_pointer(self, value: Value) -> ir.Value:
        """The address of a materialised value's first element, in the entry function."""
        b = self.b
        location = self.plan.locations.get(value)
        if value.node.op is OpKind.CONSTANT and (location is None or location.kind == "constant"):
            return self._base(("constant", value), lambda: opaque(b, self.constants[value]))
        assert location is not None, f"no location for {value}"
        if location.kind == "arena":
            return self.arguments.at(b, self.arena, location.index, f"v{value.node.id}.{value.index}")
        name = self.plan.buffer_names[location.index]
        slot = location.index
        return self._base(("buffer", slot), lambda: b.load(gep(b, self.buffers, [i64(slot)], PTR), typ=PTR, name=name))

    def _base(self, key: tuple[object, ...], make: Callable[[], ir.Value]) -> ir.Value:
        """A buffer's or a constant's address, made once in the entry function (which runs
        straight through), so that every step's pointer into it has the same base."""
        found = self._bases.get(key)
        if found is None:
            found = self._bases[key] = self.arguments.at(self.b, make())
        return found

    def fault_word(self, node: Node) -> ir.Value:
        """The address, in the entry function, of the word where kernels report a bad id of
        ``node``'s computed index operand (:class:`IndexFault`; one per node, zeroed per call)."""
        fault = self.index_faults.get(node)
        if fault is None:
            (index,) = node.op.definition.index_operands
            fault = IndexFault(self.call_data_bytes, index.describe(node), index.limit(node))
            self.index_faults[node] = fault
            self.call_data.append(CallData(fault.offset, 8, _no_fault))
            self.call_data_bytes += 64
        return self.arguments.at(self.b, self.arena, call_data_offset(self.plan) + fault.offset, f"fault.{node.id}")

    def view_pointer(self, value: Value) -> ir.Value:
        """The address of a value read through its view: base plus the view's offset."""
        view = self.schedule.view(value)
        assert view is not None
        return self.arguments.at(self.b, self.base_pointer(view.base), view.offset * view.base.dtype.itemsize)

    def call(self, item_fn: ir.Function, pointers: list[ir.Value], items: SizeLike | ir.Value, serial: bool) -> None:
        """Add a step to the call's parallel region: ``item_fn`` over ``items`` items (a count of
        the call's symbols, such as a symbolic batch's items, is computed in the entry function)."""
        if isinstance(items, Size):
            items = emit_size(self.b, items, self.entry_symbols())
        self.steps.append(Step(item_fn, self.arguments.add(pointers), items, serial))

    @property
    def table_symbols(self) -> tuple[str, ...]:
        """The symbols a kernel reads from the call's sizes table (none for static graphs)."""
        return self.symbols if self.sizes is not None else ()

    # ------------------------------------------------------------------ kernels

    def lower(self, index: int, kernel: Kernel) -> None:
        if kernel.root is not None:
            self.lower_fused(index, kernel)
            return
        node = kernel.node
        op = node.op.value
        if op in ("attention", "attention_bwd"):
            views = [self.schedule.view(v) for v in node.inputs]
            spec = self.counted(kernel_spec(node, self.config, self.options, self.symbols, views))
            name = f"{node.op}.{node.id}"
            item_fn = self.item_function(
                ("attention", spec), name, lambda: AttentionLowering(self.module, spec, name).emit()
            )
            pointers = [self.view_pointer(v) for v in node.inputs] + [self.base_pointer(v) for v in node.outputs]
            if not spec.is_static:
                assert self.sizes is not None
                pointers.append(self.sizes)
                self.attention_specs.append((f"node {node.id} ({node.op})", spec))
            self.call(item_fn, pointers, spec.work_items, False)
        elif op in FLEX_OPS:
            self.lower_flex(node)
        elif op == "matmul":
            a, bm = (self.schedule.view(v) for v in node.inputs)
            assert a is not None and bm is not None
            gemm = gemm_spec(a, bm, node.outputs[0].shape)
            # A static offset goes into the operand's pointer, so that the matmuls of an unrolled
            # loop (each reading its own step of the scanned array) share one function.
            operands = []
            for view, side in ((a, gemm.a), (bm, gemm.b)):
                offset = side.offset * view.base.dtype.itemsize if isinstance(side.offset, int) else 0
                operands.append(self.arguments.at(self.b, self.base_pointer(view.base), offset))
            gemm = replace(gemm, a=_without_static_offset(gemm.a), b=_without_static_offset(gemm.b))
            symbols = self.table_symbols
            name = f"matmul.{node.id}"
            item_fn = self.item_function(
                ("matmul", gemm, symbols), name, lambda: emit_gemm_item(self.module, gemm, name, symbols)
            )
            pointers = [*operands, self.base_pointer(node.outputs[0])]
            if self.sizes is not None:
                pointers.append(self.sizes)
            items = gemm.emit_items(self.b, self.entry_symbols())
            self.call(item_fn, pointers, items, False)
        elif op in SCAN_OPS:
            x = node.inputs[0]
            axis, reverse = node.attrs.axis, node.attrs.reverse
            symbols = self.table_symbols
            name = f"{op}.{node.id}"
            item_fn = self.item_function(
                (op, x.shape, axis, reverse, x.dtype.str, symbols),
                name,
                lambda: emit_scan_item(self.module, x.shape, axis, reverse, op, x.dtype, name, symbols),
            )
            pointers = [self.view_pointer(x), *(self.base_pointer(v) for v in node.outputs)]
            if self.sizes is not None:
                pointers.append(self.sizes)
            self.call(item_fn, pointers, product(x.shape[:axis]), False)
        elif op == "embedding_grad":
            dy, ids = (self.schedule.view(v) for v in node.inputs)
            assert dy is not None and ids is not None
            out = node.outputs[0]
            rows, width = out.shape
            symbols = self.table_symbols
            checked = checked_in_kernel(node.inputs[1])  # computed ids: checked as they are read
            item_fn = emit_scatter_item(
                self.module, dy, ids, (rows, width), ids.base.dtype.itemsize, f"embedding_grad.{node.id}", symbols,
                checked,
            )  # fmt: skip
            pointers = [self.base_pointer(dy.base), self.base_pointer(ids.base), self.base_pointer(out)]
            if self.sizes is not None:
                pointers.append(self.sizes)
            if checked:
                pointers.append(self.fault_word(node))
            self.call(item_fn, pointers, 1, True)
        elif op == "sort":
            x = node.inputs[0]
            symbols, descending = self.table_symbols, node.attrs.descending
            name = f"sort.{node.id}"
            item_fn = self.item_function(
                (op, x.shape, x.dtype.str, descending, symbols),
                name,
                lambda: emit_sort_item(self.module, x.shape, x.dtype, descending, name, symbols),
            )
            pointers = [self.view_pointer(x), *(self.base_pointer(v) for v in node.outputs)]
            if self.sizes is not None:
                pointers.append(self.sizes)
            self.call(item_fn, pointers, product(x.shape[:-1]), False)
        elif op in LINALG_OPS:
            matrix = node.inputs[0]
            rows, columns = (int(d) for d in matrix.shape[-2:])
            k = int(node.inputs[1].shape[-1]) if len(node.inputs) > 1 else 0
            name = f"{op}.{node.id}"
            item_fn = self.item_function(
                (op, rows, columns, k, node.attrs),
                name,
                lambda: emit_linalg_item(self.module, op, (rows, columns), k, node.attrs, name),
            )
            pointers = [self.view_pointer(v) for v in node.inputs] + [self.base_pointer(v) for v in node.outputs]
            self.call(item_fn, pointers, product(matrix.shape[:-2]), False)
        elif op == "scatter_add_along_axis":
            updates, indices = node.inputs
            axis, symbols = node.attrs.axis, self.table_symbols
            checked = checked_in_kernel(indices)  # computed ids: checked as they are read
            name = f"scatter_add_along_axis.{node.id}"
            item_fn = self.item_function(
                (op, updates.shape, axis, node.attrs.size, indices.dtype.itemsize, symbols, checked),
                name,
                lambda: emit_scatter_along_axis_item(
                    self.module, updates.shape, axis, node.attrs.size, indices.dtype.itemsize, name, symbols, checked
                ),
            )
            pointers = [self.view_pointer(updates), self.view_pointer(indices), self.base_pointer(node.outputs[0])]
            if self.sizes is not None:
                pointers.append(self.sizes)
            if checked:
                pointers.append(self.fault_word(node))
            self.call(item_fn, pointers, product(updates.shape[:axis]), False)
        else:
            raise AssertionError(f"no lowering for {op}")

    def counted(self, spec: _Spec) -> _Spec:
        """An attention spec of a profiling build pointed at the counters every attention node
        shares: the last bytes of the thread's scratch (:mod:`rlx.codegen.kernel_clock`)."""
        return replace(spec, counters_at=self.plan.scratch_stride - COUNTERS_BYTES) if spec.profile else spec

    def lower_flex(self, node: Node) -> None:
        from rlx.codegen.lower_flex import FlexLowering

        views = [self.schedule.view(v) for v in node.inputs]
        spec = self.counted(flex_spec(node, self.options, self.symbols, views))
        if spec.per_call:
            self.attention_specs.append((f"node {node.id} ({node.op})", spec))
        if spec.tensor_grads:  # partial gradient slices are accumulated into: zero them first
            partials = node.outputs[len(spec.grads.members) if spec.grads else 0 :]
            symbols = self.table_symbols
            zero = emit_zero_item(self.module, [product(v.shape) * 4 for v in partials], f"zero.{node.id}", symbols)
            pointers = [self.base_pointer(v) for v in partials] + ([self.sizes] if symbols else [])
            self.call(zero, pointers, 1, True)
        item_fn = FlexLowering(self.module, spec, f"{node.op}.{node.id}").emit()
        pointers = [self.view_pointer(v) for v in node.inputs] + [self.base_pointer(v) for v in node.outputs]
        pointers.append(self.block_map_pointer(node, spec))
        if spec.per_call:
            assert self.sizes is not None
            pointers.append(self.sizes)
        self.call(item_fn, pointers, spec.work_items, False)

    def block_map_pointer(self, node: Node, spec: FlexKernelSpec) -> ir.Value:
        """Where the kernel reads its tile states: module data (static), call data (dynamic), a
        buffer made for each call's lengths (call), or nowhere."""
        kind = spec.map_kind
        if kind == "call":
            name = f"%blockmap{node.id}"
            # The threshold the kernel was emitted with (FlexLowering read it too, just above).
            self.call_buffers.append((name, CallMap(spec, flex_captured(node), SMALL_CALL_MACS)))
            slot = len(self.plan.buffer_names)
            self.plan.buffer_names.append(name)
            return self.b.load(gep(self.b, self.buffers, [i64(slot)], PTR), typ=PTR, name=f"blockmap.{node.id}")
        if kind == "static":
            states = block_map_arrays(node, None, self.options)
            return opaque(self.b, _bytes_global(self.module, f"blockmap.{node.id}", states.tobytes()))
        if kind == "dynamic":
            nbytes = math.prod(flex_spec(node, self.options).grid.shape)
            offset = self.call_data_bytes
            spec = flex_spec(node, self.options)
            fill = functools.partial(_per_call_states, spec, flex_captured(node), grid=spec.grid)
            self.call_data.append(CallData(offset, nbytes, fill))
            self.call_data_bytes += -(-nbytes // 64) * 64
            return gep(self.b, self.arena, [i64(call_data_offset(self.plan) + offset)], I8, f"blockmap.{node.id}")
        return ir.Constant(PTR, None)

    def lower_fused(self, index: int, kernel: Kernel) -> None:
        assert kernel.out is not None
        # Constants are read from their data in the module; a buffer slot only for what is written.
        bases = list(dict.fromkeys([*(v for v in kernel.reads if v.node.op is not OpKind.CONSTANT), kernel.out.base]))
        chunking = plan_chunking(kernel, self.schedule, self.threads)
        fn = ir.Function(self.module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=f"fused.{index}")
        fn.linkage = "internal"
        args, item, _ = fn.args
        args.name, item.name = "args", "item"
        builder = ir.IRBuilder(fn.append_basic_block("entry"))
        pointers: dict[Value, ir.Value] = {}
        for slot, value in enumerate(bases):
            pointers[value] = builder.load(gep(builder, args, [i64(slot)], PTR), typ=PTR, name=f"buf{slot}")
        arguments = [self.base_pointer(v) for v in bases]
        symbols: dict[str, ir.Value] = {}
        if self.sizes is not None:  # the sizes table, after the buffers
            table = builder.load(gep(builder, args, [i64(len(bases))], PTR), typ=PTR, name="sizes")
            symbols = load_symbols(builder, table, self.symbols)
            arguments.append(self.sizes)

        def constant(value: Value) -> ir.Value:
            return opaque(builder, self.constants[value])

        fault_slots: dict[Node, int] = {}

        def fault_word(node: Node) -> ir.Value:
            """The fault word of a gather by computed ids, an argument after the others (loaded
            at the top of the item function, which dominates every use)."""
            slot = fault_slots.get(node)
            if slot is None:
                slot = fault_slots[node] = len(arguments)
                arguments.append(self.fault_word(node))
            top = ir.IRBuilder(fn.entry_basic_block)
            top.position_at_start(fn.entry_basic_block)
            return top.load(gep(top, args, [i64(slot)], PTR), typ=PTR, name=f"fault.{node.id}")

        emitter = FusedEmitter(
            self.module, builder, self.schedule, kernel, pointers.__getitem__, constant, symbols, fault_word
        )
        emitter.emit_item(item, chunking)
        builder.ret_void()
        items = chunking.emit_items(self.b, self.entry_symbols())
        self.call(fn, arguments, items, False)

    def entry_symbols(self) -> dict[str, ir.Value]:
        """The call's symbol values in the entry function (loaded once, in its first block)."""
        if self._entry_symbols is None:
            self._entry_symbols = {}
            if self.sizes is not None:
                self._entry_symbols = load_symbols(self.b, self.sizes, self.symbols)
        return self._entry_symbols


def emit_zero_item(module: ir.Module, sizes: list[SizeLike], name: str, symbols: tuple[str, ...] = ()) -> ir.Function:
    """An item function that zeroes ``len(sizes)`` buffers (argument slots) of the given byte
    sizes; sizes of the call's symbols read the sizes table, the argument after the buffers."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=name)
    fn.linkage = "internal"
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    memset = declare(module, "llvm.memset.p0.i64", VOID, [PTR, I8, I64, ir.IntType(1)])
    values: dict[str, ir.Value] = {}
    if symbols:
        table = b.load(gep(b, fn.args[0], [i64(len(sizes))], PTR), typ=PTR, name="sizes")
        values = load_symbols(b, table, symbols)
    for slot, size in enumerate(sizes):
        ptr = b.load(gep(b, fn.args[0], [i64(slot)], PTR), typ=PTR)
        b.call(memset, [ptr, ir.Constant(I8, 0), emit_size(b, size, values), ir.Constant(ir.IntType(1), 0)])
    b.ret_void()
    return fn


def _without_static_offset(operand: Operand) -> Operand:
    """``operand`` with its offset 0 where the offset is static (the caller moved it into the pointer)."""
    return replace(operand, offset=0) if isinstance(operand.offset, int) else operand


def call_data_offset(plan: MemoryPlan) -> int:
    return -(-plan.arena_bytes // 64) * 64


def lower_graph(
    graph: Graph, plan: MemoryPlan, schedule: Schedule, config: RuntimeConfig, options: CodegenOptions, threads: int
) -> LoweredModule:
    """Render the whole graph as LLVM IR text."""
    module = ir.Module(name=f"rlx.{graph.name}")
    entry = ir.Function(module, ir.FunctionType(VOID, [PTR, PTR]), name=ENTRY)
    buffers, arena = entry.args
    buffers.name, arena.name = "buffers", "arena"
    b = ir.IRBuilder(entry.append_basic_block("entry"))
    constants = {node.outputs[0]: _constant_global(module, node) for node in plan.order if node.op is OpKind.CONSTANT}
    state = _Lowering(plan, schedule, config, options, threads, module, b, buffers, arena, constants)
    state.symbols = graph_symbols(graph)
    dynamic = None
    if state.symbols:  # the sizes table comes first in the call data: [size of each symbol..., scratch stride]
        state.sizes = state.arguments.at(b, arena, call_data_offset(plan), "sizes")
        state.call_data_bytes = -(-(8 * (len(state.symbols) + 1)) // 64) * 64
    for index, kernel in enumerate(schedule.kernels):
        state.lower(index, kernel)
    timings = call_data_offset(plan) + state.call_data_bytes  # after the arena proper and the call data
    profile = gep(b, arena, [i64(timings)], I8, "profile") if options.profile else None
    now = clock(module) if options.profile else None
    stride: int | ir.Value = plan.scratch_stride
    scratch = gep(b, arena, [i64(plan.scratch_offset)], I8, "scratch")
    if state.symbols:
        assert state.sizes is not None
        end = -(-(timings + (8 * len(schedule.kernels) if options.profile else 0)) // 64) * 64
        dynamic = DynamicScratch(state.symbols, tuple(state.attention_specs), plan.scratch_stride, end)
        stride = b.load(gep(b, state.sizes, [i64(len(state.symbols))], I64), typ=I64, name="scratch.stride")
        scratch = gep(b, arena, [i64(end)], I8, "scratch")  # after everything of static size
    # After the buffers (inputs, outputs, then the per-call buffers lowering appended to the
    # plan's names): the most threads this call may use.
    cap_slot = len(plan.buffer_names)
    cap = b.ptrtoint(b.load(gep(b, buffers, [i64(cap_slot)], PTR), typ=PTR), I64, name="threads.cap")
    steps = share_identical_items(state.steps)
    emit_team(module, b, steps, state.arguments, threads, scratch, stride, profile, now, cap)
    b.ret_void()
    return LoweredModule(
        str(module),
        tuple(state.call_data),
        call_data_offset(plan),
        timings,
        dynamic,
        tuple(state.call_buffers),
        tuple(state.index_faults.values()),
    )


@functools.lru_cache(maxsize=256)
def _map_for_sizes(spec: FlexKernelSpec, batch: int, seq_q: int, seq_k: int) -> np.ndarray:
    return _tile_states(spec, (), None, replace(spec.grid, batch=batch, seq_q=seq_q, seq_k=seq_k))


@dataclass(frozen=True)
class CallMap:
    """The block map of a kernel of symbolic lengths, made for each call: ``fill(bound inputs,
    symbol sizes)``, the buffers a program makes per call.

    A mask reading tensors gives a small call (:func:`small_call`) every tile PARTIAL, and a
    kernel that reads the call's sizes then reads no map at all (``FlexKernelSpec.
    small_calls_read_no_map``): such a call needs nothing but addresses, so ``rlx.torch`` runs a
    batched decode step with a padding mask by address (:class:`rlx.codegen.executable.
    DirectRunner`), as it runs one without."""

    spec: FlexKernelSpec
    captured: tuple[Value, ...]
    threshold: int  # SMALL_CALL_MACS when the kernel was emitted: its native test and this one agree

    def _sizes(self, sizes: Mapping[str, int]) -> tuple[int, int, int]:
        dims = self.spec.dims
        return resolve_dims((dims.batch, dims.seq_q, dims.seq_k), sizes)  # type: ignore[return-value]

    def unread(self, sizes: Mapping[str, int]) -> bool:
        """Whether the kernel reads no map in a call of these sizes (:data:`UNREAD_MAP` serves)."""
        if not self.spec.small_calls_read_no_map:
            return False
        dims = self.spec.dims
        batch, seq_q, seq_k = self._sizes(sizes)
        return small_call(batch, dims.heads, seq_q, seq_k, dims.head_dim + dims.value_dim, self.threshold)

    def __call__(self, bound: Mapping[str, np.ndarray], sizes: Mapping[str, int]) -> np.ndarray:
        """The tile states at one call's batch and lengths: from its tensors when the mask reads
        any, else (a mask of indices alone) cached by the sizes."""
        assert self.spec.map_mask is not None
        if self.unread(sizes):
            return UNREAD_MAP
        batch, seq_q, seq_k = self._sizes(sizes)
        if not self.spec.map_mask.reads():
            return _map_for_sizes(self.spec, batch, seq_q, seq_k)
        grid = replace(self.spec.grid, batch=batch, seq_q=seq_q, seq_k=seq_k)
        return _per_call_states(self.spec, self.captured, bound, grid)


def call_checks(graph: Graph) -> list[Callable[[Mapping[str, int]], None]]:
    """Checks that need a call's sizes: the index ranges of mods reading tensors of symbolic shape.
    A node whose mods read no tensor, or read them only where the shapes keep every index in
    range (an SDPA mask), has none: its calls take the generated call layout alone
    (:mod:`rlx.codegen.call_layout`), where a check sent every call through the generic one and
    ran an interval evaluation at every new length (~0.1 ms a decode step)."""
    checks: list[Callable[[Mapping[str, int]], None]] = []
    for node in graph.nodes:
        if node.op.value not in FLEX_OPS:
            continue
        attrs, captured = node.attrs, [value.type for value in flex_captured(node)]
        operands = [value.type for value in node.inputs[:3]]
        if all(t.is_static for t in (*operands, *captured)):
            continue  # checked when the graph was built
        dims = flex_dims(f"node {node.id}", operands[0], operands[1], operands[2], attrs.layout)
        if not reads_in_range_by_construction(attrs.score_mod, attrs.mask_mod, dims, captured):
            checks.append(_IndexRangeCheck(node))
    return checks


class _IndexRangeCheck:
    """One flex node's index-range check at a call's sizes (each distinct sizes checked once)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.done: set[tuple[tuple[str, int], ...]] = set()

    def __call__(self, sizes: Mapping[str, int]) -> None:
        from rlx.ops.flex_attention import check_index_ranges_per_call

        key = tuple(sorted(sizes.items()))
        if key in self.done:
            return
        node, attrs = self.node, self.node.attrs
        what = f"node {node.id} ({node.op})"
        q, k, v = (x.type.resolve(sizes) for x in node.inputs[:3])
        captured = [x.type.resolve(sizes) for x in flex_captured(node)]
        dims = flex_dims(what, q, k, v, attrs.layout)
        check_index_ranges_per_call(what, attrs.score_mod, attrs.mask_mod, dims, captured)
        if len(self.done) < 256:
            self.done.add(key)


def opaque(b: ir.IRBuilder, variable: ir.GlobalVariable) -> ir.Value:
    """A global's address as an opaque pointer (llvmlite types globals, and ``gep`` would index by
    the array type; a no-op bitcast keeps that type). LLVM folds the round trip away."""
    return b.inttoptr(b.ptrtoint(variable, I64), PTR)


def _constant_global(module: ir.Module, node: Node) -> ir.GlobalVariable:
    data = np.ascontiguousarray(node.attrs.value.array)
    return _bytes_global(module, f"const.{node.id}", data.tobytes())


def _bytes_global(module: ir.Module, name: str, data: bytes) -> ir.GlobalVariable:
    raw = bytearray(data)
    ty = ir.ArrayType(I8, max(1, len(raw)))
    var = ir.GlobalVariable(module, ty, name=name)
    var.global_constant = True
    var.linkage = "internal"
    var.align = 64
    var.initializer = ir.Constant(ty, raw if raw else bytearray(1))
    return var
