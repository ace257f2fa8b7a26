"""``rlx.compile``: passes -> memory plan -> LLVM IR -> machine code, cached; and the callable result.

An equal graph compiled twice with the same passes, config and thread count reuses the first
compilation from an in-process cache (keyed on the printed graph, which spells out every shape,
attribute and name). Calling the executable validates every input (``rlx.bind.InputBinder``: one
quick pass for arrays that need nothing, else ``bind_inputs``) before any pointer reaches native
code, then makes ONE native call that releases the GIL.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pickle
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from rlx.bind import InputBinder, check_index_inputs, check_short_dims, index_bounds, short_dims
from rlx.codegen.call_layout import LayoutFunction, layout_function
from rlx.codegen.gc_pause import collection_paused
from rlx.codegen.irutil import ELEMENT_TYPES
from rlx.codegen.jit import CompiledLibrary, cache_key, compile_ir
from rlx.codegen.lower import (
    UNREAD_MAP,
    CallData,
    CallMap,
    CodegenOptions,
    DynamicScratch,
    IndexFault,
    call_checks,
    lower_graph,
    scratch_bytes,
)
from rlx.codegen.memory_plan import MemoryPlan, plan_memory, random_topological_order
from rlx.codegen.output_pool import OutputPool
from rlx.codegen.schedule import Schedule, build_schedule, inline_values
from rlx.config import RuntimeConfig, resolve_config, resolve_num_threads
from rlx.errors import RlxTypeError, RlxValueError, allocation_failed
from rlx.ir.dims import dim_size
from rlx.ir.graph import Graph, Value
from rlx.ir.printer import value_names
from rlx.ir.types import Dim, TensorType, resolve_dims

_ENTRY_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_CACHE_SIZE = 64


@dataclass(frozen=True)
class KernelInfo:
    """One kernel a call runs: its name and the printed names of the values it computes."""

    name: str
    nodes: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.name}: {', '.join(self.nodes)}"


@dataclass
class Program:
    """What one compilation produced; shared by every Executable made from an equal graph."""

    graph: Graph
    plan: MemoryPlan
    kernels: tuple[KernelInfo, ...]
    llvm_ir: str
    library: CompiledLibrary
    entry: ctypes._CFuncPtr  # type: ignore[name-defined]
    compile_times: dict[str, float]
    config: RuntimeConfig
    threads: int
    output_types: dict[str, TensorType] = field(default_factory=dict)  # by buffer name: outputs and temps
    profile: int | None = None  # arena offset of the per-kernel timings in a profiling build
    index_bounds: list[tuple[Value, Dim, str]] = field(default_factory=list)  # (source, limit, what) per index operand
    call_data: tuple[CallData, ...] = ()  # per-call block maps, written into the arena
    call_data_offset: int = 0
    arena_bytes: int = 0  # arena proper plus call data (plus timings in a profiling build)
    source: str = ""  # the graph as given, for pickling
    pass_names: tuple[str, ...] | None = None
    options: CodegenOptions = field(default_factory=CodegenOptions)
    dynamic: DynamicScratch | None = None  # graphs with symbolic dimensions: the per-call sizes table
    binder: InputBinder | None = None  # checks a call's arrays and reads its symbol sizes
    call_buffers: dict[str, CallMap] = field(default_factory=dict)  # block maps made per call
    call_checks: list[Callable[[Mapping[str, int]], None]] = field(default_factory=list)  # need the call's sizes
    layouts: dict[tuple[tuple[str, int], ...], CallLayout] = field(default_factory=dict)  # by the call's sizes
    index_faults: tuple[IndexFault, ...] = ()  # where kernels report a bad id the graph computed

    @functools.cached_property
    def short_dims(self) -> list[tuple[str, str, bool]]:
        """The dimensions a call may make 0 or negative (``"S-1"``): see :func:`rlx.bind.short_dims`."""
        return short_dims(self.graph)

    def is_empty(self, sizes: Mapping[str, int]) -> bool:
        """A call with a size of 0 (a symbol, or a dimension such as ``"S-1"``) runs as an empty
        call; one that makes a dimension negative raises."""
        return 0 in sizes.values() or (bool(self.short_dims) and check_short_dims(self.short_dims, sizes))

    @functools.cached_property
    def results(self) -> tuple[tuple[str, int, bool], ...]:
        """``(name, slot, owned)`` per output: the same for every call's sizes."""
        plan = self.plan
        return tuple((name, slot, name in plan.owned_outputs) for name, slot in plan.output_slots.items())

    @functools.cached_property
    def direct_layout(self) -> LayoutFunction:
        """The layout of a call whose inputs (all of them) have these shapes, or None where a
        shape does not match: :func:`rlx.codegen.call_layout.layout_function` of this program."""
        assert self.binder is not None
        return layout_function(
            [shape for _, _, shape, _ in self.binder.expected],
            self.dynamic,
            [(name, shape, dtype) for name, shape, _, dtype in self.buffer_kinds],
            self.layout_for,
            lambda table, arena_bytes, buffers, unread=frozenset(): CallLayout(
                table, arena_bytes, buffers, self.results, unread
            ),
            self.threads,
            bool(self.call_checks) or bool(self.short_dims),
            self.call_buffers,
        )

    @functools.cached_property
    def pointers_format(self) -> str:
        """``struct`` format of the pointer table the entry takes: an address per buffer, then
        the call's thread cap."""
        return f"={len(self.plan.buffer_names) + 1}q"

    @functools.cached_property
    def direct_outputs(self) -> tuple[str | None, ...] | None:
        """For :meth:`Executable.run_direct`: per buffer after the inputs, the graph output it is
        (None: an intermediate, from the pool), or the name of a block map made per call (which a
        call whose kernel reads no map, :attr:`CallLayout.unread`, runs without); None where a
        call needs more than addresses (index checks, block maps in the call data, an output that
        is a copy of another)."""
        if self.index_bounds or self.call_data:
            return None
        if not all(owned for _, _, owned in self.results):
            return None
        first = len(self.graph.inputs)
        names = {slot: name for name, slot, _ in self.results}
        if len(names) != len(self.results) or min(names, default=first) < first:
            return None  # two outputs of one buffer, or an output that is an input
        for slot, name in enumerate(self.plan.buffer_names):
            if name in self.call_buffers:
                names[slot] = name
        return tuple(names.get(slot) for slot in range(first, len(self.plan.buffer_names)))

    @functools.cached_property
    def buffer_kinds(self) -> tuple[tuple[str, tuple[Dim, ...] | None, bool, np.dtype | None], ...]:
        """``(name, declared shape, is static, dtype)`` of each buffer after the inputs; shape
        and dtype None for one made per call (``call_buffers``)."""
        kinds = []
        for name in self.plan.buffer_names[len(self.graph.inputs) :]:
            if name in self.call_buffers:
                kinds.append((name, None, True, None))
            else:
                ty = self.output_types[name]
                kinds.append((name, ty.shape, ty.is_static, np.dtype(ty.dtype)))  # type: ignore[arg-type]
        return tuple(kinds)

    def layout_for(self, sizes: Mapping[str, int]) -> CallLayout | None:
        """What a call with these symbol sizes needs, after the checks that depend on them (which
        raise before any pointer reaches native code); kept for the next call of the same sizes
        (the checks read the sizes alone: sizes that passed once pass again). None for an empty
        call (:meth:`is_empty`), which no native code runs."""
        kept = self.layouts.get(tuple(sizes.items()))
        if kept is not None:
            return kept
        if self.is_empty(sizes):
            return None
        table, arena_bytes = b"", self.arena_bytes
        if self.dynamic is not None:  # symbolic dimensions: scratch sized for this call's sizes
            for check in self.call_checks:
                check(sizes)
            table, stride = self.dynamic.table(sizes)
            arena_bytes = self.dynamic.offset + stride * self.threads
            # The call writes the table with memmove: it must land inside the arena's call data.
            assert self.call_data_offset + len(table) <= self.dynamic.offset <= arena_bytes
        buffers = tuple(
            (name, shape if static or shape is None else resolve_dims(shape, sizes), dtype)
            for name, shape, static, dtype in self.buffer_kinds
        )
        unread = frozenset(name for name, fill in self.call_buffers.items() if fill.unread(sizes))
        layout = CallLayout(table, arena_bytes, buffers, self.results, unread)  # type: ignore[arg-type]  # static: ints
        if len(self.layouts) >= LAYOUTS_KEPT:  # a decode loop brings new sizes every step
            self.layouts.clear()
        self.layouts[tuple(sizes.items())] = layout
        return layout


LAYOUTS_KEPT = 64


class CallLayout(NamedTuple):
    """The part of a call that depends on its symbol sizes only: the sizes table native code reads
    (empty for static shapes), the arena's size, ``(name, shape, dtype)`` of each buffer after the
    inputs (shape None: made per call by ``call_buffers``), ``(name, slot, owned)`` per output, and
    the block maps made per call that this call does not need (:meth:`rlx.codegen.lower.CallMap.unread`).

    A named tuple, not a frozen dataclass: a decode loop makes one per step (a new length each
    time), and a frozen dataclass's ``__init__`` took 0.9 us of a 20 us call, a tuple's 0.4."""

    table: bytes
    arena_bytes: int
    buffers: tuple[tuple[str, tuple[int, ...] | None, np.dtype | None], ...]
    results: tuple[tuple[str, int, bool], ...]
    unread: frozenset[str] = frozenset()  # block maps made per call that this call's kernels do not read


@dataclass(frozen=True)
class DirectRunner:
    """:meth:`Executable.run_direct` in two steps, for a caller that calls again and again (a
    decode loop, at a new length every step): ``layout(shapes)`` checks the inputs' shapes
    (declaration order) and returns the call's :class:`CallLayout`, or None where they do not
    match; ``runner(layout, addresses, threads)`` runs on the addresses of the inputs, then of
    the outputs in :attr:`outputs` order, whose shapes are ``layout.buffers``'. The caller
    vouches for the addresses as :meth:`Executable.run_direct` says, and for the dtypes: each
    input's is in :attr:`dtypes`. See :attr:`Executable.direct_runner`."""

    executable: Executable
    layout: LayoutFunction
    inputs: tuple[str, ...]
    dtypes: tuple[np.dtype, ...]  # each input's
    outputs: tuple[str, ...]
    maps: tuple[int, ...] = ()  # positions after the inputs of block maps made per call (unread)

    def output_shapes(self, layout: CallLayout) -> tuple[tuple[int, ...], ...]:
        """The shapes of :attr:`outputs`, in order, for a call of this layout."""
        shapes = [shape for index, (_, shape, _) in enumerate(layout.buffers) if index not in self.maps]
        return tuple(shapes)  # type: ignore[arg-type]

    def __call__(self, layout: CallLayout, addresses: list[int], threads: int | None = None) -> None:
        if self.maps:  # a layout from self.layout: no map is read, any address serves
            addresses, first = list(addresses), len(self.inputs)
            for index in self.maps:
                addresses.insert(first + index, _UNREAD_ADDRESS)
        self.executable._enter(layout, addresses, threads, None)


_cache: OrderedDict[tuple, Program] = OrderedDict()
_cache_lock = threading.Lock()
_statistics = {"compiles": 0}  # graphs compiled (cache misses) in this process
_prebuilt: dict[str, bytes] = {}  # machine code an unpickled executable brought along, by IR key
_prebuilt_lock = threading.Lock()


def compile_count() -> int:
    """How many graphs this process has compiled (in-process cache hits not counted)."""
    return _statistics["compiles"]


def default_pipeline() -> list[str]:
    from rlx.passes import DEFAULT_PIPELINE

    return list(DEFAULT_PIPELINE)


def _check_passes(passes: Sequence[str] | None) -> tuple[str, ...] | None:
    if passes is None:
        return None
    if isinstance(passes, str) or not all(isinstance(p, str) for p in passes):
        raise RlxTypeError(f"passes must be a list of pass names, got {passes!r}")
    return tuple(passes)


def compile_graph(
    graph: Graph,
    passes: Sequence[str] | None = None,
    config: RuntimeConfig | None = None,
    options: CodegenOptions | None = None,
) -> Executable:
    """Compile ``graph`` (never mutated). ``passes=None`` runs the default pipeline."""
    if not isinstance(graph, Graph):
        raise RlxTypeError(f"rlx.compile expects an rlx.Graph, got {type(graph).__name__}")
    config = resolve_config(config)
    pass_names = _check_passes(passes)
    options = options or CodegenOptions()
    if not isinstance(options, CodegenOptions):
        raise RlxTypeError(f"options must be a CodegenOptions, got {type(options).__name__}")
    threads = resolve_num_threads(config)
    start = time.perf_counter()
    key = (str(graph), pass_names, config, threads, options)
    with _cache_lock:
        program = _cache.get(key)
        if program is not None:
            _cache.move_to_end(key)
    if program is None:
        with collection_paused():  # see rlx.codegen.gc_pause
            program = _build(graph, pass_names, config, threads, options)
        with _cache_lock:
            _statistics["compiles"] += 1
        with _cache_lock:
            _cache[key] = program
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
        times = dict(program.compile_times)
    else:
        times = {"cache_lookup": time.perf_counter() - start}
    times["total"] = time.perf_counter() - start
    return Executable(program, times)


class _Lowered(NamedTuple):
    """What ``_lower`` made: everything of a program but its machine code."""

    graph: Graph
    plan: MemoryPlan
    schedule: Schedule
    llvm_ir: str
    index_bounds: list[tuple[Value, Dim, str]]
    call_data: tuple[CallData, ...]
    call_data_offset: int
    profile_offset: int
    dynamic: DynamicScratch | None
    call_buffers: dict[str, CallMap]
    index_faults: tuple[IndexFault, ...]


def _distinct_bounds(bounds: list[tuple[Value, Dim, str]]) -> list[tuple[Value, Dim, str]]:
    """One check per (source, limit): a value read as indices by several nodes is scanned once."""
    seen: set[tuple[int, Dim]] = set()
    distinct = []
    for source, limit, what in bounds:
        key = (id(source.node), limit)
        if key not in seen:
            seen.add(key)
            distinct.append((source, limit, what))
    return distinct


def _check_computable_dtypes(graph: Graph) -> None:
    """``RlxTypeError`` naming the first input or node whose values compiled code cannot hold
    (:data:`rlx.codegen.irutil.ELEMENT_TYPES`), before anything is lowered. The IR also spells f64
    and f16 (a printed graph may declare them, and the reference interprets them), but no kernel
    reads them."""
    names = value_names(graph)
    for node in graph.nodes:
        for value in node.outputs:
            if str(value.dtype) not in ELEMENT_TYPES:
                name = getattr(node.attrs, "name", None) if node.op.value == "input" else None
                what = f"input {name!r}" if name is not None else f"{node.op.value} {names[value]}"
                raise RlxTypeError(
                    f"rlx.compile: {what} is {value.dtype}; compiled graphs hold float32, int32, int64 and "
                    "bool values (declare it float32 and pass arrays converted with .astype(np.float32))"
                )


def _lower(
    graph: Graph,
    pass_names: tuple[str, ...] | None,
    config: RuntimeConfig,
    threads: int,
    options: CodegenOptions,
    times: dict[str, float],
) -> _Lowered:
    """Copy the graph, run the passes, schedule, plan memory and render LLVM IR (no machine code yet)."""
    from rlx.ops.constant import resolve_config_values
    from rlx.passes import decompose, masks_as_mods
    from rlx.passes import run as run_passes

    start = time.perf_counter()
    working = graph.copy()
    working._verify_unless_unchanged()  # so that the passes' first check is not a second one
    _check_computable_dtypes(working)
    resolve_config_values(working, config)  # constants from here on, for every pass to fold
    if not working.outputs:
        raise RlxValueError(f"rlx.compile: graph {graph.name!r} has no outputs; mark some with g.output(...)")
    # Index operands of composite ops (cross_entropy's targets, one_hot's ids) are gone once the
    # pipeline makes them primitives (a one-hot is a comparison, which reads no memory with the
    # ids), but the call-time check is about what the graph means: collect them before and after.
    built_bounds = index_bounds(working)  # refuses index operands that cannot be checked before a call
    run_passes(working, list(pass_names) if pass_names is not None else default_pipeline())
    if options.masks_as_mods:
        masks_as_mods(working, config)
    decompose(working)  # codegen sees primitives only, whatever the passes were
    # A constant's ids against a static limit are known now: checked once here, not by every call.
    bounds: list[tuple[Value, Dim, str]] = []
    known: list[tuple[Value, Dim, str]] = []
    for bound in _distinct_bounds(built_bounds + index_bounds(working)):
        source, limit, _ = bound
        (known if source.node.op.value == "constant" and isinstance(limit, int) else bounds).append(bound)
    check_index_inputs(working, {}, known)
    times["passes"] = time.perf_counter() - start

    start = time.perf_counter()
    order = None if options.order_seed is None else random_topological_order(working, options.order_seed)
    schedule = build_schedule(working, order)
    accesses = [(kernel.node, kernel.computes, kernel.reads) for kernel in schedule.kernels]
    # Any member of the call's thread team may run an attention item, so each needs scratch.
    plan = plan_memory(
        working, lambda node: scratch_bytes(node, config, options, schedule), threads, schedule.order, accesses
    )
    lowered = lower_graph(working, plan, schedule, config, options, threads)
    times["lowering"] = time.perf_counter() - start
    return _Lowered(
        working,
        plan,
        schedule,
        lowered.llvm_ir,
        bounds,
        lowered.call_data,
        lowered.call_data_offset,
        lowered.profile_offset,
        lowered.dynamic,
        dict(lowered.call_buffers),
        lowered.index_faults,
    )


def _kernel_infos(graph: Graph, schedule: Schedule) -> tuple[KernelInfo, ...]:
    names = value_names(graph)
    infos = []
    for kernel in schedule.kernels:
        if kernel.root is None:
            infos.append(KernelInfo(str(kernel.node.op), tuple(names[v] for v in kernel.node.outputs)))
            continue
        inline = [names[value] for value in inline_values(schedule, kernel.root)]
        infos.append(KernelInfo(f"fused.{kernel.node.op}", tuple(reversed(inline))))
    return tuple(infos)


def _build(
    graph: Graph, pass_names: tuple[str, ...] | None, config: RuntimeConfig, threads: int, options: CodegenOptions
) -> Program:
    times: dict[str, float] = {}
    lowered = _lower(graph, pass_names, config, threads, options, times)
    working, plan, schedule, llvm_ir, bounds = lowered[:5]
    library = compile_ir(llvm_ir, _prebuilt)
    times["llvm_optimize"] = library.times["llvm_optimize"]
    times["machine_code"] = library.times["machine_code"] + library.times["link"]
    times["disk_cache_hit"] = library.times["disk_cache_hit"]
    entry = _ENTRY_TYPE(library.entry_address)
    output_types = {name: v.type for name, v in working.outputs.items()}
    output_types |= {plan.buffer_names[loc.index]: v.type for v, loc in plan.locations.items() if loc.kind == "temp"}
    kernels = _kernel_infos(working, schedule)
    profile = lowered.profile_offset if options.profile else None
    arena_bytes = lowered.profile_offset + (8 * len(kernels) if options.profile else 0)
    return Program(
        working,
        plan,
        kernels,
        llvm_ir,
        library,
        entry,
        times,
        config,
        threads,
        output_types,
        profile,
        bounds,
        lowered.call_data,
        lowered.call_data_offset,
        arena_bytes,
        str(graph),
        pass_names,
        options,
        lowered.dynamic,
        InputBinder(working, _unused_inputs(working)),  # inputs no output needs are optional
        lowered.call_buffers,
        call_checks(working),
        index_faults=lowered.index_faults,
    )


class Executable:
    """A compiled graph. Call it with keyword arrays; get a dict of new float32 arrays back."""

    def __init__(self, program: Program, compile_times: dict[str, float]) -> None:
        self._program = program
        self.compile_times = compile_times
        self._arenas = threading.local()

    @property
    def graph(self) -> Graph:
        """The graph after the pipeline (do not mutate: it is shared with the compile cache)."""
        return self._program.graph

    @property
    def llvm_ir(self) -> str:
        """The LLVM IR module as generated, before optimisation."""
        return self._program.llvm_ir

    @property
    def optimized_llvm_ir(self) -> str:
        return self._program.library.optimized_ir

    @property
    def asm(self) -> str:
        """Assembly of the machine code."""
        return self._program.library.asm

    @property
    def threads(self) -> int:
        return self._program.threads

    @property
    def compile_count(self) -> int:
        """Native compilations behind this executable: 1, however many sizes its symbolic
        dimensions take in calls (calls never compile; see also :func:`compile_count`)."""
        return 1

    @property
    def memory_plan(self) -> MemoryPlan:
        return self._program.plan

    @property
    def kernels(self) -> list[KernelInfo]:
        """The kernels one call runs, in order; each has ``.name`` and ``.nodes`` (values it computes)."""
        return list(self._program.kernels)

    def profile(self, **arrays: object) -> list[tuple[KernelInfo, float]]:
        """Run one call and return each kernel with its seconds (compile with ``CodegenOptions(profile=True)``)."""
        program = self._program
        if program.profile is None:
            raise RlxValueError("this executable was not compiled for profiling: pass CodegenOptions(profile=True)")
        self(**arrays)
        arena = self._arenas.buffer
        offset = self._arenas.offset + program.profile
        nanoseconds = np.frombuffer(arena, dtype=np.int64, count=len(program.kernels), offset=offset)
        return [(info, float(ns) * 1e-9) for info, ns in zip(program.kernels, nanoseconds, strict=True)]

    def attention_breakdown(self, **arrays: object) -> dict[str, float]:
        """Run one call and return where its attention kernels spent their time, in CPU seconds
        summed over threads: ``blas`` (sgemm calls), ``softmax`` (mask, max, exp and row sums),
        ``softmax_backward`` (dS) and ``kernel`` (the whole items; the rest is addressing, zeroing
        dK/dV and the forward's row scaling). Compile with ``CodegenOptions(profile=True)``."""
        from rlx.codegen.kernel_clock import BREAKDOWN

        program = self._program
        if program.profile is None:
            raise RlxValueError("this executable was not compiled for profiling: pass CodegenOptions(profile=True)")
        plan = program.plan
        if plan.scratch_stride < 64:
            raise RlxValueError("this executable runs no attention kernel of static shape to profile")
        arena, _ = self._arena(program.arena_bytes)
        starts = [plan.scratch_offset + t * plan.scratch_stride + plan.scratch_stride - 64 for t in range(plan.threads)]
        for start in starts:  # the counters start from zero each call
            arena[start : start + 64] = 0
        self(**arrays)
        arena, _ = self._arena(program.arena_bytes)
        totals = np.zeros(len(BREAKDOWN), dtype=np.int64)
        for start in starts:
            totals += np.frombuffer(arena[start : start + 8 * len(BREAKDOWN)].tobytes(), dtype=np.int64)
        return {name: float(ns) * 1e-9 for name, ns in zip(BREAKDOWN, totals, strict=True)}

    def __call__(self, *args: object, **arrays: object) -> dict[str, np.ndarray]:
        if args:
            names = ", ".join(f"{name}=..." for name in self._program.graph.inputs)
            raise RlxTypeError(
                f"{len(args)} positional argument(s): pass the inputs by name, exe({names}) (or exe(**arrays))"
            )
        return self.run(arrays)

    def run(self, arrays: Mapping[str, object], threads: int | None = None) -> dict[str, np.ndarray]:
        """``exe(**arrays)`` on at most ``threads`` of the executable's threads (None: all).

        For a caller that knows a call is too small to pay for starting a team (a decode step):
        the same machine code runs on fewer threads, so nothing is compiled again, and the
        results are bit-identical for any thread count.
        """
        program = self._program
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise RlxValueError(f"threads must be a positive int or None, got {threads!r}")
        assert program.binder is not None
        bound, sizes = program.binder(arrays)
        check_index_inputs(program.graph, bound, program.index_bounds, sizes)  # before native code reads with ids
        if program.is_empty(sizes):
            return self._run_empty(bound, sizes)
        layout = program.layouts.get(tuple(sizes.items()))
        if layout is None:
            layout = program.layout_for(sizes)  # the size checks run here, before native code
            assert layout is not None  # not empty: checked above
        # Buffer slots in entry order: the inputs (declaration order; one no output needs and that
        # was left out gets a placeholder nothing reads), then an output array per output slot.
        buffers = [bound.get(name, _PLACEHOLDER) for name in program.graph.inputs]
        outputs = self._outputs()
        for name, shape, dtype in layout.buffers:
            if shape is None or dtype is None:  # made per call, e.g. a block map for this call's lengths
                buffers.append(program.call_buffers[name](bound, sizes))
            else:
                buffers.append(outputs.take(name, shape, dtype))
        self._enter(layout, list(map(data_address, buffers)), threads, bound)
        if program.index_faults:  # a call with faults has call data, so only this path runs it
            self._raise_index_fault(sizes)
        return {name: buffers[slot] if owned else buffers[slot].copy() for name, slot, owned in layout.results}

    def _run_empty(self, bound: Mapping[str, np.ndarray], sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        """A call in which a symbolic dimension is 0 (an empty batch, a KV cache with no keys yet),
        or a dimension made from one (``x[:, :-1]`` when ``S`` is 1).

        Its values are JAX's (NumPy's and torch's where they compute them: both refuse a maximum
        of nothing): empty arrays, sums of nothing 0, means NaN, maxima -inf, attention over no
        keys 0 (its LSE -inf), products over an empty inner dimension 0. There is no arithmetic
        worth native code in it, so the float64
        reference interpreter evaluates the graph and its results are rounded to the declared
        dtypes, as every compiled result is checked against; the kernels, whose loop nests and
        strip plans are written for sizes >= 1, never see a zero size.
        """
        from rlx.reference import evaluate

        program = self._program
        inputs = dict(bound)
        for name, value in program.graph.inputs.items():
            if name not in inputs:  # optional (no output reads it): any array of its type serves
                known = {dim: sizes.get(dim, 1) for dim in value.type.symbols}
                inputs[name] = np.zeros(resolve_dims(value.type.shape, known), value.type.dtype)
        return evaluate(program.graph, inputs, config=program.config)

    def run_direct(
        self,
        inputs: Sequence[tuple[int, tuple[int, ...]]],
        outputs: Mapping[str, tuple[int, tuple[int, ...]]],
        threads: int | None = None,
    ) -> bool:
        """Run on memory the caller provides: ``(address, shape)`` of every input in declaration
        order and of every output by name. False, with nothing run, where the call does not
        match the graph (a shape, the symbols' sizes) or needs more than addresses
        (:attr:`Program.direct_outputs`): :meth:`run` then takes it, and raises what it raises.

        For ``rlx.torch``, which hands over tensors' memory without making NumPy arrays of it
        (on a decode step, the arrays in and out cost a fifth of the call). The caller vouches
        for what a shape cannot say: each address holds C-contiguous, aligned elements of the
        declared dtype, valid for the whole shape, and outputs overlap nothing.
        """
        program = self._program
        direct = program.direct_outputs
        # The size checks run here, before native code.
        layout = None if direct is None else program.direct_layout([shape for _, shape in inputs])
        if layout is None or direct is None:
            return False
        addresses = [address for address, _ in inputs]
        pool = None
        for (name, shape, dtype), output in zip(layout.buffers, direct, strict=True):
            if output is None:  # an intermediate
                pool = self._outputs() if pool is None else pool
                addresses.append(data_address(pool.take(name, shape, dtype)))  # type: ignore[arg-type]
                continue
            if output in program.call_buffers:  # a block map made per call
                if output not in layout.unread:
                    return False
                addresses.append(_UNREAD_ADDRESS)
                continue
            given = outputs.get(output)
            if given is None or given[1] != shape:
                return False
            addresses.append(given[0])
        self._enter(layout, addresses, threads, None)
        return True

    @functools.cached_property
    def direct_runner(self) -> DirectRunner | None:
        """A :class:`DirectRunner` of this executable (made once), or None where a call needs
        more than the addresses of its inputs and outputs (an intermediate buffer, per-call data:
        :attr:`Program.direct_outputs`): :meth:`run` then takes it. Its ``layout`` runs the size
        checks, before native code."""
        program = self._program
        direct = program.direct_outputs
        if direct is None or None in direct:
            return None
        inputs = program.graph.inputs
        dtypes = tuple(value.dtype for value in inputs.values())
        maps = tuple(slot for slot, name in enumerate(direct) if name in program.call_buffers)
        outputs = tuple(name for name in direct if name not in program.call_buffers)
        layout = program.direct_layout
        if maps:
            names = frozenset(program.call_buffers)

            def layout_without_maps(shapes: Sequence[tuple[int, ...]]) -> CallLayout | None:
                found = program.direct_layout(shapes)
                return found if found is not None and names <= found.unread else None

            layout = layout_without_maps
        return DirectRunner(self, layout, tuple(inputs), dtypes, outputs, maps)  # type: ignore[arg-type]

    def _enter(
        self, layout: CallLayout, addresses: list[int], threads: int | None, bound: Mapping[str, np.ndarray] | None
    ) -> None:
        """Call the machine code on these buffer addresses (entry order), with this call's sizes
        table and block maps (made from ``bound``) written into the arena first."""
        program, local = self._program, self._arenas
        # The pointer table (each buffer's address, then the thread cap) is this thread's, reused:
        # filled by one struct.pack_into (which also checks the count), not a new ctypes array.
        pointers = getattr(local, "pointers", None)
        if pointers is None:
            pointers = local.pointers = (ctypes.c_int64 * (len(program.plan.buffer_names) + 1))()
            local.pointers_address = ctypes.addressof(pointers)
        struct.pack_into(program.pointers_format, pointers, 0, *addresses, threads or 0)
        if program.call_data:
            arena, arena_address = self._arena(layout.arena_bytes)
            for data in program.call_data:  # per-call block maps, from the validated inputs
                assert bound is not None
                start = program.call_data_offset + data.offset
                arena[start : start + data.nbytes] = data.fill(bound).reshape(-1).view(np.uint8)
        else:
            arena_address = self._arena_address(layout.arena_bytes)
        if layout.table:
            ctypes.memmove(arena_address + program.call_data_offset, layout.table, len(layout.table))
        program.entry(local.pointers_address, arena_address)

    def _raise_index_fault(self, sizes: Mapping[str, int]) -> None:
        """``RlxValueError`` if a kernel reported an id outside its range (one the graph computed,
        or sliced out of an input; the kernel read row 0 instead, so the call's results are not
        returned)."""
        program, local = self._program, self._arenas
        start = local.offset + program.call_data_offset
        for fault in program.index_faults:
            bad = int(local.buffer[start + fault.offset : start + fault.offset + 8].view(np.int64)[0])
            if bad:
                limit = dim_size(fault.limit, sizes)
                raise RlxValueError(
                    f"{fault.what}, computed or sliced by the graph in this call: {bad} is out of range [0, {limit})"
                )

    def _outputs(self) -> OutputPool:
        """This Python thread's output arrays (concurrent calls never share one)."""
        pool = getattr(self._arenas, "outputs", None)
        if pool is None:
            pool = self._arenas.outputs = OutputPool()
        return pool

    def _arena(self, nbytes: int) -> tuple[np.ndarray, int]:
        """A per-Python-thread arena, reused across calls (concurrent calls never share one): its
        first ``nbytes`` bytes, 64-byte aligned, and their address (:meth:`_arena_address`)."""
        address = self._arena_address(nbytes)
        offset = self._arenas.offset
        return self._arenas.buffer[offset : offset + max(nbytes, 1)], address

    def _arena_address(self, nbytes: int) -> int:
        """The address of this Python thread's arena, 64-byte aligned, grown first to hold
        ``nbytes`` where it is smaller (a call that writes nothing into it needs no view)."""
        held = getattr(self._arenas, "buffer", None)
        if held is None or held.nbytes < nbytes + 64:
            # Grown by half again at least: a decode loop's scratch grows a little every step.
            grown = nbytes if held is None else max(nbytes, held.nbytes * 3 // 2)
            try:
                held = np.empty(max(grown, 64) + 64, dtype=np.uint8)
            except MemoryError:
                try:  # the minimum, when half again more does not fit
                    held = np.empty(max(nbytes, 64) + 64, dtype=np.uint8)
                except MemoryError:
                    raise allocation_failed(f"{self.graph.name!r}: the call's scratch arena", nbytes) from None
            address = data_address(held)
            self._arenas.buffer = held
            self._arenas.offset = (-address) % 64
            self._arenas.address = address + self._arenas.offset
        return self._arenas.address  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Pickles as the graph, its passes and config, and the machine code: loading links that
        code again (if this CPU made it) instead of compiling."""
        program = self._program
        library = program.library
        return (
            _restore,
            (program.source, program.pass_names, program.config, program.options, cache_key(library.llvm_ir),
             library.object_code),
        )  # fmt: skip

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write this executable to ``path``; ``rlx.load(path)`` reads it back in any process."""
        with open(path, "wb") as file:
            pickle.dump(self, file, protocol=pickle.HIGHEST_PROTOCOL)

    def __repr__(self) -> str:
        outputs = ", ".join(self._program.graph.outputs)
        return f"<rlx.Executable {self._program.graph.name!r} -> {outputs}; {self.threads} threads>"

    def __str__(self) -> str:
        lines = [f"{self!r}", f"  {len(self._program.kernels)} kernels for {len(self.graph)} nodes:"]
        lines += [f"  {i:3d}  {info}" for i, info in enumerate(self._program.kernels)]
        return "\n".join(lines)


_PLACEHOLDER = np.zeros(16, dtype=np.float32)  # the buffer of an input no output reads


def data_address(array: np.ndarray) -> int:
    """The address of a C-contiguous array's first element.

    Through the buffer protocol (``ctypes`` over the array's memory), which costs 0.5 µs where
    ``array.ctypes.data`` costs 2.5: a call hands native code one address per input and output,
    and on a decode step that was a fifth of the call. Read-only memory cannot be exported that
    way, so it takes ``array.ctypes.data``.
    """
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):  # read-only, or empty
        return int(array.ctypes.data)


def _unused_inputs(graph: Graph) -> frozenset[str]:
    """Inputs of the compiled graph that nothing reads and no output is."""
    outputs = set(graph.outputs.values())
    return frozenset(
        name for name, value in graph.inputs.items() if not graph.users(value.node) and value not in outputs
    )


def _restore(
    source: str,
    pass_names: tuple[str, ...] | None,
    config: RuntimeConfig,
    options: CodegenOptions,
    key: str,
    object_code: bytes,
) -> Executable:
    """Unpickle: parse, lower, and link the saved machine code when it was made for this IR and CPU."""
    from rlx.ir.parser import parse

    graph = parse(source)
    with _prebuilt_lock:
        _prebuilt[key] = object_code
        try:
            return compile_graph(graph, passes=pass_names, config=config, options=options)
        finally:
            _prebuilt.pop(key, None)


def load(path: str | os.PathLike[str]) -> Executable:
    """Read an executable written by ``exe.save(path)`` (or pickled): no recompilation on the same CPU."""
    with open(path, "rb") as file:
        loaded = pickle.load(file)
    if not isinstance(loaded, Executable):
        raise RlxTypeError(f"{path} holds a {type(loaded).__name__}, not an rlx executable")
    return loaded


def emit_llvm_ir(graph: Graph, passes: Sequence[str] | None = None, config: RuntimeConfig | None = None) -> str:
    """The LLVM IR ``rlx.compile`` would generate for ``graph``, without making machine code."""
    if not isinstance(graph, Graph):
        raise RlxTypeError(f"emit_llvm_ir expects an rlx.Graph, got {type(graph).__name__}")
    config = resolve_config(config)
    return _lower(graph, _check_passes(passes), config, resolve_num_threads(config), CodegenOptions(), {}).llvm_ir


_UNREAD_ADDRESS = data_address(UNREAD_MAP)  # what a call passes for a block map its kernels do not read
