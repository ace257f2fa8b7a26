"""Lower ``flex_attention`` / ``flex_attention_bwd`` to per-work-item LLVM functions.

Forward, item = (batch, query head); backward, item = (batch, kv head), whose query heads run in
order inside it, so dK/dV of a GQA group are summed without races and in a fixed order. Queries
go in strips of ``block_q`` rows and keys in tiles of ``block_k``; the block map
(:mod:`rlx.codegen.block_map`) says per (strip, tile) whether the mask hides it all (skipped:
no GEMM columns, no exp), shows it all (the mask is not evaluated) or is partial. For a strip:

1. ``S[:, run] = scale · Q_strip K_run^T`` for each run of consecutive non-empty tiles (GEMM)
2. forward: per row, score_mod and mask inlined, max, ``exp``, sum: ``P``, ``lse = m + log(sum)``;
   ``out_strip = Σ_run P[:, run] V_run`` (GEMM)
3. backward (FlashAttention-2): ``P = exp(s - lse)``, ``D = rowsum(dY ∘ out)`` (minus dlse);
   ``dV_run += P^T dY``; ``dP = dY V_run^T``; ``dS = P ∘ (dP - D)``, times d s / d score from the
   differentiated region, and into the score_mod's tensors' partial gradients;
   ``dQ_strip = scale Σ dS K_run``; ``dK_run += scale dS^T Q_strip`` (GEMMs)

A mask_mod with a diagonal above which it hides every key (``Region.key_bounds``: causal,
lower-right causal, sliding windows, and any conjunction with one of them) bands the strip
products, as the fixed kernels band theirs (``tile_gemm.Band``): a strip's diagonal tile is
computed whole and masked per element otherwise. ``Q K^T`` and ``dY V^T`` leave the entries
above it unwritten (the mods write -inf there, and dS is 0 wherever P is, without reading
them); ``P V``, dV, dQ and dK skip the terms of the keys there, which are ``0 · x``, where the
operands they multiply are finite (checked once per head). Bitwise the whole products' results.

Scratch per thread: the score strip (``block_q × Sk``), plus in the backward the dP/dS strip
and, with a score_mod, the raw scores its derivative needs; then, from 16 query rows on, K (and
for dP, V) copied transposed once per item, so that each run's ``Q K^T`` and ``dY V^T`` are NN
products (``lower_attention.transposed_buffers``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from rlx.codegen.blas import NO_TRANS, TRANS
from rlx.codegen.block_map import EMPTY, FULL, PARTIAL, TileGrid
from rlx.codegen.irutil import (
    F32,
    F64,
    I1,
    I8,
    I64,
    PTR,
    VOID,
    alloca_entry,
    f32,
    for_range,
    gep,
    gep_f32,
    i64,
    intrinsic,
    smax,
    smin,
)
from rlx.codegen.kernel_clock import COUNTERS_BYTES, KernelClock
from rlx.codegen.lower_attention import (
    KEY_SIDE,
    OperandStrides,
    bands_products,
    declare_sgemm,
    emit_head_copies,
    emit_sgemm,
    emit_strip_floats,
    emit_view_head_offset,
    heads_finite,
    keys_operand,
    not_finite,
    panel_operands,
    panels_from,
    scale_row,
    scale_rows,
    slot_heads_and_width,
    strips_and_copies_bytes,
    transposed_buffers,
    view_row_stride,
    whole_lines,
    zero_rows,
)
from rlx.codegen.region_emit import LaneValue, RegionEmitter, Tensor, lane_indices
from rlx.codegen.sizes import SizeLike, ceil_div, emit_size, load_symbols, size_of
from rlx.codegen.tile_gemm import Band
from rlx.codegen.vector import Lanes, sum_lanes, vector_fill, vector_loop, vector_reduce, whole_vectors_end
from rlx.codegen.views import dense_strides
from rlx.ir.dims import product
from rlx.ir.region import GradientRegion, KeyBound, Region
from rlx.ir.types import Dim, Layout, TensorType, Wrt
from rlx.ops.flex_attention import FlexDims

NEG_INF = -math.inf


@dataclass(frozen=True)
class FlexKernelSpec:
    """Everything that shapes the code of one flex attention node."""

    dims: FlexDims
    layout: Layout
    scale: float
    score_mod: Region | None
    mask_mod: Region | None
    captured: tuple[TensorType, ...]
    grads: Wrt | None  # None: the forward
    tensor_grads: tuple[tuple[int, Dim, bool, bool], ...]  # (tensor, partials, by_batch, by_kv_head)
    lse_grad: bool
    grid: TileGrid
    map_kind: str  # "none" (no mask: all FULL), "all" (every tile PARTIAL), "static", "dynamic", "call"
    symbols: tuple[str, ...] = ()  # the graph's symbolic dimensions, in the order of the sizes table
    recompute: bool = False  # backward: row statistics from the scores, not from out and lse operands
    map_mask: Region | None = None  # what the tile map is built from (lower.map_mask)
    masked_value: float = -math.inf  # the score hidden tiles stand for; finite: checked per row
    profile: bool = False  # time products, softmax and dS into per-thread counters (static shapes)
    counters_at: int = 0  # byte offset of those counters in a thread's scratch (its last 64 bytes)
    strides: tuple[OperandStrides, ...] = ()  # q, k, v or dy read through strided views

    @functools.cached_property
    def identity_on_full_tiles(self) -> bool:
        """The score_mod is ``where(cond, value, score)``: on a tile the map shows wholly visible
        (cond holds throughout) it is the identity, with derivative 1, and is not evaluated.
        Cached: the emitters ask for every tile and lane width they generate."""
        mod = self.score_mod
        return mod is not None and mod.replaced_where() is not None and ("s", "score") in mod.steps[-1].args[1:]

    @functools.cached_property
    def key_bounds(self) -> tuple[KeyBound, ...]:
        """The diagonals above which the mask_mod hides every key (:meth:`Region.key_bounds`),
        where the kernels band their strip products (``lower_attention.BANDS``); empty where
        they do not: no mask_mod, hidden scores that stand for a finite value, or no register
        tiles."""
        if self.mask_mod is None or self.masked_value != NEG_INF or not bands_products():
            return ()
        return self.mask_mod.key_bounds()

    @property
    def retries(self) -> bool:
        """Whether a strip may need recomputing over every key: its skipped tiles stand for a
        finite score, negligible only while ``exp(masked_value - rowmax)`` vanishes."""
        return math.isfinite(self.masked_value) and self.map_kind not in ("none", "all")

    @property
    def is_static(self) -> bool:
        return isinstance(self.dims.seq_q, int) and isinstance(self.dims.seq_k, int)

    @property
    def per_call(self) -> bool:
        """Whether the kernel reads sizes from the call's table (lengths or captured shapes symbolic)."""
        return not self.is_static or not all(t.is_static for t in self.captured)

    @property
    def small_calls_read_no_map(self) -> bool:
        """Whether a call below ``lower.SMALL_CALL_MACS`` reads no block map (every tile
        PARTIAL): a map made per call from tensors, in a kernel that reads the call's sizes (the
        test needs the batch, which a kernel of static lengths does not load)."""
        mask = self.map_mask
        return self.map_kind == "call" and mask is not None and bool(mask.reads()) and self.per_call

    @property
    def backward(self) -> bool:
        return self.grads is not None

    def row_stride(self, slot: str) -> int:
        """Elements between consecutive rows of one head of ``slot``: the BLAS leading dimension."""
        return view_row_stride(self.layout, self.dims, self.strides, slot)

    @property
    def needs_dp(self) -> bool:
        if self.grads is None:
            return False
        return bool(self.grads & (Wrt.QUERY | Wrt.KEY)) or bool(self.tensor_grads)

    @property
    def keeps_raw(self) -> bool:
        """The backward keeps raw scores for the score_mod's derivative."""
        return self.needs_dp and self.score_mod is not None

    @property
    def work_items(self) -> SizeLike:
        """Forward: one item per (batch, head); backward: per (batch, kv head). A symbolic batch
        makes it a size of the call (the item code never needs the batch)."""
        d = self.dims
        return size_of(d.batch) * (d.kv_heads if self.backward else d.heads)

    def strip_floats(self, seq_k: int | None = None, seq_q: int | None = None) -> int:
        """Floats of one strip (``seq_k``: the call's, when it is symbolic; the strips' height is
        fixed, whatever ``seq_q``)."""
        length = self.dims.seq_k if seq_k is None else seq_k
        assert isinstance(length, int), "give the call's Sk"
        return whole_lines(self.grid.block_q * length)

    def scratch_bytes(self, seq_k: int | None = None, seq_q: int | None = None) -> int:
        """The strips, then (forward) one reciprocal row sum per strip row, then the transposed
        copies of K (and V) (``lower_attention.strips_and_copies_bytes``); in a profiling build,
        the counters of :mod:`rlx.codegen.kernel_clock` last. ``seq_q`` changes nothing."""
        counters = COUNTERS_BYTES if self.profile and self.is_static else 0
        return strips_and_copies_bytes(self, seq_k) + counters

    def panel_widths(self) -> dict[str, int]:
        """The head operands this kernel packs in column panels (``lower_attention.panel_operands``)."""
        return panel_operands(self.grads, self.dims)

    @property
    def strip_layout(self) -> tuple[int, int]:
        """``(strips, floats after them)`` at the start of a thread's scratch: the score strip, the
        dP/dS strip (backward with dP) and the raw scores (a score_mod's derivative), or in the
        forward the score strip and its rows' reciprocal sums."""
        strips = 1 + int(self.needs_dp) + int(self.keeps_raw)
        return strips, 0 if self.backward else whole_lines(self.grid.block_q)


class FlexLowering:
    """Emits the per-item function of one flex attention node; see the module docstring."""

    def __init__(self, module: ir.Module, spec: FlexKernelSpec, name: str) -> None:
        self.module = module
        self.spec = spec
        self.name = name
        self.sgemm = declare_sgemm(module)
        self.clock = KernelClock(module, spec.profile and spec.is_static, spec.counters_at)
        self.memset = intrinsic(module, "llvm.memset.p0.i64", VOID, [PTR, I8, I64, I1])
        self.logf = intrinsic(module, "llvm.log.f32", F32, [F32])
        score = spec.score_mod
        self.score_kinds = score.check([(t.shape, _kind(t)) for t in spec.captured]) if score is not None else []
        mask = spec.mask_mod
        self.mask_kinds = mask.check([(t.shape, _kind(t)) for t in spec.captured]) if mask is not None else []
        self.dense: ir.Value | None = None  # in a strip's attempts: whether this one covers every key
        self.needs: ir.Value | None = None  # i1 slot: the first attempt found a row that needs every key
        self.written: ir.Value = ir.Constant(PTR, None)  # backward: one i8 per key tile (_first_touch)
        self.gradient: GradientRegion | None = None
        self.gradient_kinds: list[str] = []
        # With a banded mask (FlexKernelSpec.key_bounds), whether the products that skip terms
        # above a strip's diagonal may: the forward's V, the backward's K (per item) and Q and dY
        # (per query head) hold finite numbers only.
        self.values_finite: ir.Value = ir.Constant(I1, 0)
        self.keys_finite: ir.Value = ir.Constant(I1, 0)
        self.queries_finite: ir.Value = ir.Constant(I1, 0)
        self.key_diagonal: ir.Value = i64(0)  # per item: see _key_diagonal
        if score is not None and spec.needs_dp:
            gradient = score.gradient(self.score_kinds)
            self.gradient_kinds = gradient.check([(t.shape, _kind(t)) for t in spec.captured])
            self.gradient = gradient

    # ------------------------------------------------------------------ operands

    def operand_slots(self) -> list[str]:
        spec = self.spec
        slots = ["q", "k", "v"]
        if spec.backward and spec.recompute:
            slots += ["dy"]
        elif spec.backward:
            slots += ["out", "dy", "lse"] + (["dlse"] if spec.lse_grad else [])
        slots += [f"c{i}" for i in range(len(spec.captured))]
        if spec.backward:
            assert spec.grads is not None
            slots += [f"d{flag!s}" for flag in spec.grads.members]
            slots += [f"p{tensor}" for tensor, _, _, _ in spec.tensor_grads]
        else:
            slots += ["out", "lse"]
        slots.append("map")
        if spec.per_call:
            slots.append("sizes")
        return slots

    def _load_lengths(self, b: ir.IRBuilder) -> None:
        """``sq``, ``sk`` and the strip and tile counts: constants, or from the call's sizes table."""
        self.symbols = load_symbols(b, self.base["sizes"], self.spec.symbols) if self.spec.per_call else {}
        self.sq = emit_size(b, self.spec.dims.seq_q, self.symbols)
        self.sk = emit_size(b, self.spec.dims.seq_k, self.symbols)
        grid = self.spec.grid
        self.strips = ceil_div(b, self.sq, grid.block_q)
        self.tiles = ceil_div(b, self.sk, grid.block_k)
        self.map_unread = self._map_unread(b)

    def _map_unread(self, b: ir.IRBuilder) -> ir.Value | None:
        """For a map made per call from tensors: whether this call is small (every tile PARTIAL,
        the map not read; the caller may pass any address, see ``lower.CallMap``), by the rule
        of :func:`rlx.codegen.lower.small_call`, a product of doubles. None: the map is read."""
        from rlx.codegen import lower  # read now: lower.CallMap takes the same value, for this kernel

        spec = self.spec
        if not spec.small_calls_read_no_map:
            return None
        dims = spec.dims
        factors = [emit_size(b, dims.batch, self.symbols), i64(dims.heads), self.sq, self.sk]
        factors.append(i64(dims.head_dim + dims.value_dim))
        product: ir.Value = ir.Constant(F64, 1.0)
        for factor in factors:
            product = b.fmul(product, b.sitofp(factor, F64))
        return b.fcmp_ordered("<", product, ir.Constant(F64, float(lower.SMALL_CALL_MACS)), name="map.unread")

    def _runtime_strides(self, b: ir.IRBuilder, ty: TensorType) -> tuple[ir.Value, ...]:
        """Row-major strides of a captured tensor whose shape names symbols, for this call."""
        return tuple(emit_size(b, stride, self.symbols) for stride in dense_strides(ty.shape))

    def _strip_floats(self, b: ir.IRBuilder) -> ir.Value:
        if self.spec.is_static:
            return i64(self.spec.strip_floats())
        return emit_strip_floats(b, self.spec.grid.block_q, self.sk)

    # ------------------------------------------------------------------ addressing

    def _row_stride(self, slot: str) -> int:
        return self.spec.row_stride(slot)

    def _head(self, b: ir.IRBuilder, slot: str, batch: ir.Value, head: ir.Value) -> ir.Value:
        """Row 0 of head ``head`` (a kv head for the key side) of batch ``batch`` of ``slot``."""
        spec = self.spec
        seq = self.sk if slot in KEY_SIDE else self.sq
        offset = emit_view_head_offset(b, spec.layout, spec.dims, spec.strides, slot, batch, head, seq)
        return gep_f32(b, self.base[slot], offset)

    # ------------------------------------------------------------------ function

    def emit(self) -> ir.Function:
        fn = ir.Function(self.module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=self.name)
        fn.linkage = "internal"
        args, item, scratch = fn.args
        args.name, item.name, scratch.name = "args", "item", "scratch"
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.base = {
            slot: b.load(gep(b, args, [i64(i)], PTR), typ=PTR, name=f"{slot}.base")
            for i, slot in enumerate(self.operand_slots())
        }
        self._load_lengths(b)
        self.clock.point_at(b, scratch)
        started = self.clock.start(b)
        self.tensors = [
            Tensor(self.base[f"c{i}"], t, None if t.is_static else self._runtime_strides(b, t))
            for i, t in enumerate(self.spec.captured)
        ]
        strip = scratch
        floats = self._strip_floats(b)
        second = gep_f32(b, scratch, floats, name="dp.strip")
        third = gep_f32(b, scratch, b.mul(floats, i64(2)), name="raw.strip")
        dims = self.spec.dims
        self.packed = transposed_buffers(b, self.spec, scratch, floats, self.sq, self.sk)
        if not self.spec.backward:
            batch = b.sdiv(item, i64(dims.heads), name="b")
            head = b.srem(item, i64(dims.heads), name="h")
            group = b.sdiv(head, i64(dims.group), name="g")
            self._pack(b, batch, group)
            self.values_finite = self._heads_finite(b, [("v", batch, group)])
            self._forward_head(b, batch, head, strip, second)
        else:
            batch = b.sdiv(item, i64(dims.kv_heads), name="b")
            group = b.srem(item, i64(dims.kv_heads), name="g")
            # which key tiles of this group's dK/dV hold a value yet (see _first_touch)
            self.written = b.alloca(I8, size=self.tiles, name="written")
            b.call(self.memset, [self.written, ir.Constant(I8, 0), self.tiles, ir.Constant(I1, 0)])
            self._pack(b, batch, group)
            self.keys_finite = self._heads_finite(b, [("k", batch, group)])
            with for_range(b, 0, dims.group, "member") as member:
                head = b.add(b.mul(group, i64(dims.group)), member, name="h")
                self.queries_finite = self._heads_finite(b, [("q", batch, head), ("dy", batch, head)])
                self._backward_head(b, batch, head, group, strip, second, third)
            self._zero_untouched(b, batch, group)
        self.clock.count(b, "kernel", started)
        b.ret_void()
        return fn

    # ------------------------------------------------------------------ packing

    def _pack(self, b: ir.IRBuilder, batch: ir.Value, group: ir.Value) -> None:
        """Copy kv head ``group``'s K (and V) transposed into this call's buffers, and pack those
        of ``spec.panel_widths()`` in column panels (:attr:`panels`)."""
        d = self.spec.dims

        def geometry(slot: str) -> tuple[int, int]:
            return self._row_stride(slot), d.head_dim if slot == "k" else d.value_dim

        self.panels = emit_head_copies(
            b, self.clock, self.packed, lambda slot: self._head(b, slot, batch, group), geometry, self.sk
        )

    # ------------------------------------------------------------------ bands

    def _heads_finite(self, b: ir.IRBuilder, heads: list[tuple[str, ir.Value, ir.Value]]) -> ir.Value:
        """Whether the ``(slot, batch, head)`` heads hold only finite numbers, so that a product
        may skip their terms above a strip's diagonal (``lower_attention.heads_finite``); false
        where the kernel does not band."""
        if not self.spec.key_bounds:
            return ir.Constant(I1, 0)
        checked = [
            (
                self._head(b, slot, batch, head),
                self.sk if slot in KEY_SIDE else self.sq,
                self._row_stride(slot),
                slot_heads_and_width(self.spec.dims, slot)[1],
            )
            for slot, batch, head in heads
        ]
        return heads_finite(b, self.sq, checked)

    def _key_diagonal(self, b: ir.IRBuilder) -> ir.Value:
        """``d``: the mask hides every key ``kv_idx > q_idx + d`` (the least of its key bounds),
        the mask's steps of the lengths alone (``max(Sk - Sq, 0)``) computed for this call."""
        mask = self.spec.mask_mod
        assert mask is not None
        lengths = {"q_len": LaneValue(self.sq, True), "kv_len": LaneValue(self.sk, True)}
        emitter = RegionEmitter(b, mask, self.mask_kinds, 1, lengths, self.tensors)
        diagonals = []
        for bound in self.spec.key_bounds:
            d: ir.Value = i64(bound.constant)
            for coefficient, length in ((bound.q_len, self.sq), (bound.kv_len, self.sk)):
                if coefficient:
                    d = b.add(d, b.mul(length, i64(coefficient)))
            for coefficient, index in bound.steps:
                emitter.emit(sorted(mask.needed_steps(index)))
                d = b.add(d, b.mul(emitter.get(("t", index), "i"), i64(coefficient)))
            diagonals.append(d)
        return functools.reduce(lambda x, y: smin(b, x, y), diagonals)

    def _row_limit(self, b: ir.IRBuilder, gi: ir.Value, ks: ir.Value, nk: ir.Value) -> ir.Value | None:
        """Where query ``gi``'s keys end for good (strip-relative, in ``[0, nk]``): its mask hides
        every key from ``gi + d + 1`` on (:meth:`_key_diagonal`); None without key bounds.

        A row's mods, exp and dS stop there, and what lies past it is filled in (``-inf`` scores,
        zero P and dS: :func:`computed_part`) instead of computed: a causal strip's diagonal tile
        is half hidden on average (causal B4 H8 S512: the softmax sections 0.91-0.93x the time,
        with and without a softcap, forward and backward; S1024 0.96x)."""
        if not self.spec.key_bounds:
            return None
        limit = b.sub(b.add(b.add(gi, self.key_diagonal), i64(1)), ks)
        return smin(b, smax(b, limit, i64(0)), nk, name="row.limit")

    def _run_band(
        self, b: ir.IRBuilder, mode: int, i0: ir.Value, c0: ir.Value, exact: ir.Value | None = None
    ) -> tuple[int | ir.Value, ir.Value]:
        """``(band, diagonal)`` of a strip product over the keys from ``c0`` (:class:`Band`): row
        r of the strip (query ``i0 + r``) sees its keys ``j <= r + diagonal``. ``Band.NONE``
        without key bounds, or where ``exact`` (an i1 of the call) is false."""
        if not self.spec.key_bounds:
            return Band.NONE, i64(0)
        band: int | ir.Value = mode
        if exact is not None:
            band = b.select(exact, i64(mode), i64(Band.NONE), name="run.band")
        return band, b.sub(b.add(i0, self.key_diagonal), c0, name="run.diagonal")

    # ------------------------------------------------------------------ tiles

    def _map_row(self, b: ir.IRBuilder, batch: ir.Value, head: ir.Value, strip: ir.Value) -> ir.Value:
        grid = self.spec.grid
        hm = grid.heads if grid.by_head else 1
        mb = batch if grid.by_batch else i64(0)
        mh = head if grid.by_head else i64(0)
        index = b.mul(b.add(b.mul(b.add(b.mul(mb, i64(hm)), mh), self.strips), strip), self.tiles)
        return gep(b, self.base["map"], [index], I8, name="map.row")

    def _state(self, b: ir.IRBuilder, map_row: ir.Value, tile: ir.Value) -> ir.Value:
        kind = self.spec.map_kind
        if kind == "none":
            return ir.Constant(I8, FULL)
        if kind == "all":
            return ir.Constant(I8, PARTIAL)
        if self.map_unread is not None:  # a small call reads no map: every tile PARTIAL
            slot = alloca_entry(b, I8, "state.slot")
            b.store(ir.Constant(I8, PARTIAL), slot)
            with b.if_then(b.not_(self.map_unread)):
                b.store(b.load(gep(b, map_row, [tile], I8), typ=I8), slot)
            state = b.load(slot, typ=I8, name="state")
        else:
            state = b.load(gep(b, map_row, [tile], I8), typ=I8, name="state")
        if self.dense is not None:  # a strip recomputed over every key: every tile evaluated
            state = b.select(self.dense, ir.Constant(I8, PARTIAL), state)
        return state

    def _visible_tiles(self, b: ir.IRBuilder, map_row: ir.Value) -> tuple[ir.Value, ir.Value]:
        """First and last non-empty tile of the strip (first > last: none)."""
        tiles = self.tiles
        if self.spec.map_kind in ("none", "all"):
            return i64(0), b.sub(tiles, i64(1))
        first = alloca_entry(b, I64, "first.tile")
        last = alloca_entry(b, I64, "last.tile")
        b.store(tiles, first)
        b.store(i64(-1), last)
        with for_range(b, 0, tiles, "scan") as t:
            visible = b.icmp_unsigned("!=", self._state(b, map_row, t), ir.Constant(I8, EMPTY))
            with b.if_then(visible):
                b.store(smin(b, b.load(first, typ=I64), t), first)
                b.store(t, last)
        first_tile, last_tile = b.load(first, typ=I64, name="first"), b.load(last, typ=I64, name="last")
        if self.dense is not None:
            first_tile = b.select(self.dense, i64(0), first_tile)
            last_tile = b.select(self.dense, b.sub(tiles, i64(1)), last_tile)
        return first_tile, last_tile

    def _for_runs(
        self,
        b: ir.IRBuilder,
        map_row: ir.Value,
        first: ir.Value,
        last: ir.Value,
        body: Callable[[ir.IRBuilder, ir.Value, ir.Value, ir.Value], None],
    ) -> None:
        """``body(b, c0, c1, is_first_run)`` for each run of consecutive non-empty tiles, as key columns."""
        grid = self.spec.grid
        if self.spec.map_kind in ("none", "all"):
            body(b, i64(0), self.sk, ir.Constant(I1, 1))
            return
        cursor = alloca_entry(b, I64, "run.cursor")
        started = alloca_entry(b, I1, "run.started")
        b.store(first, cursor)
        b.store(ir.Constant(I1, 0), started)
        check = b.append_basic_block("runs.check")
        scan = b.append_basic_block("runs.scan")
        done = b.append_basic_block("runs.done")
        b.branch(check)
        b.position_at_end(check)
        t = b.load(cursor, typ=I64, name="run.t")
        b.cbranch(b.icmp_signed("<=", t, last), scan, done)
        b.position_at_end(scan)
        with b.if_else(b.icmp_unsigned("==", self._state(b, map_row, t), ir.Constant(I8, EMPTY))) as (empty, visible):
            with empty:
                b.store(b.add(t, i64(1)), cursor)
            with visible:
                end = alloca_entry(b, I64, "run.end")
                b.store(b.add(t, i64(1)), end)
                grow = b.append_basic_block("run.grow")
                grow_body = b.append_basic_block("run.grow.body")
                grown = b.append_basic_block("run.grown")
                b.branch(grow)
                b.position_at_end(grow)
                u = b.load(end, typ=I64)
                more = b.icmp_signed("<=", u, last)
                b.cbranch(more, grow_body, grown)
                b.position_at_end(grow_body)
                next_visible = b.icmp_unsigned("!=", self._state(b, map_row, u), ir.Constant(I8, EMPTY))
                with b.if_then(next_visible):
                    b.store(b.add(u, i64(1)), end)
                b.cbranch(next_visible, grow, grown)
                b.position_at_end(grown)
                u_end = b.load(end, typ=I64)
                c0 = b.mul(t, i64(grid.block_k))
                c1 = smin(b, b.mul(u_end, i64(grid.block_k)), self.sk)
                is_first = b.not_(b.load(started, typ=I1))
                body(b, c0, c1, is_first)
                b.store(ir.Constant(I1, 1), started)
                b.store(u_end, cursor)
        b.branch(check)
        b.position_at_end(done)

    def _for_tiles(
        self,
        b: ir.IRBuilder,
        map_row: ir.Value,
        first: ir.Value,
        last: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
        on_tile: Callable[[ir.IRBuilder, ir.Value, ir.Value, int | None, ir.Value], None],
    ) -> None:
        """``on_tile(b, c0, c1, state, tile)`` per tile of ``[first, last]``, columns relative to ``ks``.

        ``state`` is a Python int when known at compile time (no map), else None: the callee
        branches on the loaded state itself (see :meth:`_by_state`).
        """
        grid = self.spec.grid
        with for_range(b, first, b.add(last, i64(1)), "tile") as t:
            c0 = b.sub(b.mul(t, i64(grid.block_k)), ks)
            c1 = smin(b, b.add(c0, i64(grid.block_k)), nk)
            known = {"none": FULL, "all": PARTIAL}.get(self.spec.map_kind)
            on_tile(b, c0, c1, known, t)

    # ------------------------------------------------------------------ region pieces

    def _symbols(self, b: ir.IRBuilder, batch: ir.Value, head: ir.Value, gi: ir.Value) -> dict[str, LaneValue]:
        return {
            "b": LaneValue(batch, True),
            "h": LaneValue(head, True),
            "q_idx": LaneValue(gi, True),
            "q_len": LaneValue(self.sq, True),
            "kv_len": LaneValue(self.sk, True),
        }

    def _element_symbols(
        self, b: ir.IRBuilder, row_symbols: dict[str, LaneValue], gj: ir.Value, width: int, score: ir.Value | None
    ) -> dict[str, LaneValue]:
        symbols = dict(row_symbols)
        symbols["kv_idx"] = LaneValue(lane_indices(b, gj, width), width == 1)
        symbols["kv_idx.lane0"] = LaneValue(gj, True)
        if score is not None:
            symbols["score"] = LaneValue(score, width == 1)
        return symbols

    def _hoisted(
        self, b: ir.IRBuilder, region: Region, kinds: list[str], row_symbols: dict[str, LaneValue]
    ) -> dict[int, LaneValue]:
        """Steps that depend on neither score nor key: once per query row."""
        emitter = RegionEmitter(b, region, kinds, 1, dict(row_symbols), self.tensors)
        steps = emitter.uniform_steps()
        emitter.emit(steps)
        return {i: emitter.values[i] for i in steps}

    def _apply_mods(
        self,
        b: ir.IRBuilder,
        lanes: Lanes,
        raw: ir.Value,
        gj: ir.Value,
        row_symbols: dict[str, LaneValue],
        score_hoisted: dict[int, LaneValue],
        mask_hoisted: dict[int, LaneValue],
        with_mask: bool,
    ) -> ir.Value:
        """``mask ? score_mod(raw) : -inf`` at this lane width (``with_mask`` False: a tile the map
        shows wholly visible)."""
        spec = self.spec
        value = raw
        if spec.score_mod is not None and (with_mask or not spec.identity_on_full_tiles):
            symbols = self._element_symbols(b, row_symbols, gj, lanes.width, raw)
            emitter = RegionEmitter(
                b, spec.score_mod, self.score_kinds, lanes.width, symbols, self.tensors, score_hoisted
            )
            emitter.emit(range(len(spec.score_mod.steps)))
            value = emitter.get(("t", len(spec.score_mod.steps) - 1), "f")
        if with_mask and spec.mask_mod is not None:
            symbols = self._element_symbols(b, row_symbols, gj, lanes.width, None)
            emitter = RegionEmitter(b, spec.mask_mod, self.mask_kinds, lanes.width, symbols, self.tensors, mask_hoisted)
            emitter.emit(range(len(spec.mask_mod.steps)))
            visible = emitter.get(("t", len(spec.mask_mod.steps) - 1), "b")
            value = b.select(visible, value, lanes.const(NEG_INF))
        return value

    def _by_state(
        self,
        b: ir.IRBuilder,
        state: int | None,
        loaded: Callable[[], ir.Value],
        on_empty: Callable[[], None],
        on_visible: Callable[[bool], None],
    ) -> None:
        """Branch to ``on_empty`` / ``on_visible(with_mask)`` by a tile's state."""
        if state is not None:
            if state == EMPTY:
                on_empty()
            else:
                on_visible(state == PARTIAL)
            return
        value = loaded()
        with b.if_else(b.icmp_unsigned("==", value, ir.Constant(I8, EMPTY))) as (empty, visible):
            with empty:
                on_empty()
            with visible:
                if self.spec.map_mask is None:
                    on_visible(False)
                else:
                    with b.if_else(b.icmp_unsigned("==", value, ir.Constant(I8, FULL))) as (full, partial):
                        with full:
                            on_visible(False)
                        with partial:
                            on_visible(True)

    # ------------------------------------------------------------------ forward

    def _strip_bounds(self, b: ir.IRBuilder, strip: ir.Value) -> tuple[ir.Value, ir.Value]:
        block_q = self.spec.grid.block_q
        i0 = b.mul(strip, i64(block_q), name="i0")
        return i0, smin(b, i64(block_q), b.sub(self.sq, i0), name="rows")

    def _scores(
        self,
        b: ir.IRBuilder,
        map_row: ir.Value,
        first: ir.Value,
        last: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
        q_strip: ir.Value,
        k_head: ir.Value,
        rows: ir.Value,
        out: ir.Value,
        i0: ir.Value,
    ) -> None:
        """``out[:, run] = scale · Q_strip K_run^T`` for every visible run (``ld = nk``).

        With key bounds, the scores above a strip's diagonal are left unwritten: the mask hides
        them, and the mods write ``-inf`` there without reading them."""
        d = self.spec.dims
        ldq, ldk = self._row_stride("q"), self._row_stride("k")

        def gemm(b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, is_first: ir.Value) -> None:
            k_run, ld_run, trans = keys_operand(b, k_head, ldk, self.packed["k"], c0, self.sk)
            target = gep_f32(b, out, b.sub(c0, ks))
            band, diagonal = self._run_band(b, Band.OUT_LOWER, i0, c0)
            self._sgemm(
                b,
                NO_TRANS,
                trans,
                rows,
                b.sub(c1, c0),
                d.head_dim,
                self.spec.scale,
                q_strip,
                ldq,
                k_run,
                ld_run,
                0.0,
                target,
                nk,
                band,
                diagonal,
            )

        self._for_runs(b, map_row, first, last, gemm)

    def _forward_head(
        self, b: ir.IRBuilder, batch: ir.Value, head: ir.Value, strip_buf: ir.Value, inverse_sums: ir.Value
    ) -> None:
        """Rows are left unnormalised, ``exp(s - m)``; ``out`` rows are scaled by 1/sum after the
        P·V GEMM, which touches ``Dv`` floats a row instead of the strip's ``nk``."""
        d, grid = self.spec.dims, self.spec.grid
        group = b.sdiv(head, i64(d.group), name="g")
        q_head = self._head(b, "q", batch, head)
        k_head = self._head(b, "k", batch, group)
        v_head = self._head(b, "v", batch, group)
        out_head = self._head(b, "out", batch, head)
        lse_row = gep_f32(b, self.base["lse"], b.mul(b.add(b.mul(batch, i64(d.heads)), head), self.sq))
        ldq = self._row_stride("q")
        ldo = self._row_stride("out")
        self.key_diagonal = self._key_diagonal(b) if self.spec.key_bounds else i64(0)
        with for_range(b, 0, self.strips, "strip") as strip:
            i0, rows = self._strip_bounds(b, strip)
            map_row = self._map_row(b, batch, head, strip)
            out_strip = gep_f32(b, out_head, b.mul(i0, i64(ldo)))

            def attempt(b: ir.IRBuilder) -> None:
                first, last = self._visible_tiles(b, map_row)
                with b.if_else(b.icmp_signed(">", first, last)) as (nothing, something):
                    with nothing:
                        self._needs_dense(b, None)
                        self._zero_rows(b, out_strip, rows, ldo, d.value_dim)
                        vector_fill(b, lse_row, i0, b.add(i0, rows), NEG_INF, "lse.none")
                    with something:
                        ks = b.mul(first, i64(grid.block_k), name="ks")
                        ke = smin(b, b.mul(b.add(last, i64(1)), i64(grid.block_k)), self.sk)
                        nk = b.sub(ke, ks, name="nk")
                        q_strip = gep_f32(b, q_head, b.mul(i0, i64(ldq)))
                        self._scores(b, map_row, first, last, ks, nk, q_strip, k_head, rows, strip_buf, i0)
                        mod_first, mod_last = self._mod_tiles(b, map_row, first, last)
                        started = self.clock.start(b)
                        with for_range(b, 0, rows, "r") as r:
                            gi = b.add(i0, r, name="gi")
                            row = gep_f32(b, strip_buf, b.mul(r, nk), name="row")
                            limit = self._row_limit(b, gi, ks, nk)
                            m = self._mod_rows(b, row, batch, head, gi, map_row, mod_first, mod_last, ks, nk, limit)
                            self._needs_dense(b, m)
                            lse = self._exp_row(b, row, nk, m, gep_f32(b, inverse_sums, r), limit)
                            b.store(lse, gep_f32(b, lse_row, gi))
                        self.clock.count(b, "softmax", started)
                        with b.if_then(self._exact(b)):
                            self._weighted_values(
                                b, map_row, first, last, ks, nk, rows, v_head, strip_buf, out_strip, i0
                            )
                            scale_rows(b, out_strip, rows, ldo, d.value_dim, inverse_sums)

            self._attempts(b, attempt)

    def _weighted_values(
        self,
        b: ir.IRBuilder,
        map_row: ir.Value,
        first: ir.Value,
        last: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
        rows: ir.Value,
        v_head: ir.Value,
        strip_buf: ir.Value,
        out_strip: ir.Value,
        i0: ir.Value,
    ) -> None:
        """``out_strip = Σ_run P[:, run] V_run`` (unnormalised P). With key bounds and a finite V,
        each row skips the keys above its diagonal, whose P is exactly 0 (``exp(-inf - m)``, or
        a row of zeros where every key is hidden)."""
        d = self.spec.dims
        ldv, ldo = self._row_stride("v"), self._row_stride("out")

        def pv(b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, is_first: ir.Value) -> None:
            beta = b.select(is_first, f32(0.0), f32(1.0))
            p_run = gep_f32(b, strip_buf, b.sub(c0, ks))
            v_run = gep_f32(b, v_head, b.mul(c0, i64(ldv)))
            band, diagonal = self._run_band(b, Band.K_UPPER, i0, c0, self.values_finite)
            self._sgemm(
                b,
                NO_TRANS,
                NO_TRANS,
                rows,
                d.value_dim,
                b.sub(c1, c0),
                1.0,
                p_run,
                nk,
                v_run,
                ldv,
                beta,
                out_strip,
                ldo,
                band,
                diagonal,
                panels_from(b, self.panels, "v", c0),
            )

        self._for_runs(b, map_row, first, last, pv)

    def _sgemm(self, b: ir.IRBuilder, *args: int | float | ir.Value) -> None:
        """One product (``lower_attention.emit_sgemm``'s arguments after the builder), timed as
        ``blas`` in a profiling build."""
        self.clock.timed(b, "blas", lambda: emit_sgemm(b, self.sgemm, *args))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ exactness of skipped tiles

    def _attempts(self, b: ir.IRBuilder, attempt: Callable[[ir.IRBuilder], None]) -> None:
        """Emit one strip's work; with :attr:`FlexKernelSpec.retries`, a second time over every key
        (``self.dense``) when the first attempt found a row whose skipped tiles are not negligible.
        The first attempt stops before anything accumulates (only rows it owns are written)."""
        if not self.spec.retries:
            attempt(b)
            return
        if self.needs is None:
            self.needs = alloca_entry(b, I1, "needs.dense")
        b.store(ir.Constant(I1, 0), self.needs)
        with for_range(b, 0, 2, "attempt") as index:
            dense = b.icmp_signed("==", index, i64(1), name="dense")
            with b.if_then(b.or_(b.not_(dense), b.load(self.needs, typ=I1))):
                self.dense = dense
                attempt(b)
                self.dense = None

    def _needs_dense(self, b: ir.IRBuilder, statistic: ir.Value | None) -> None:
        """Note a row whose statistic (max or lse; None: no visible key) leaves the skipped
        tiles' ``exp(masked_value - statistic)`` above e^-50 (fixed kernels' SKIP_MARGIN)."""
        if self.dense is None or self.needs is None:
            return
        if statistic is None:
            needed: ir.Value = ir.Constant(I1, 1)
        else:
            needed = b.fcmp_unordered("<", statistic, f32(self.spec.masked_value + 50.0))
        first_try = b.not_(self.dense)
        b.store(b.or_(b.load(self.needs, typ=I1), b.and_(needed, first_try)), self.needs)

    def _exact(self, b: ir.IRBuilder) -> ir.Value:
        """Whether this attempt's result stands (the first one, unless it needs every key)."""
        if self.dense is None or self.needs is None:
            return ir.Constant(I1, 1)
        return b.or_(self.dense, b.not_(b.load(self.needs, typ=I1)))

    def _mod_tiles(
        self, b: ir.IRBuilder, map_row: ir.Value, first: ir.Value, last: ir.Value
    ) -> tuple[ir.Value, ir.Value]:
        """The tiles of ``[first, last]`` that :meth:`_mod_rows` must visit, found once per strip:
        where wholly visible tiles need no mod, only the span from the first to the last tile
        that is not (a causal strip's diagonal), else all of them."""
        if not (self.spec.score_mod is None or self.spec.identity_on_full_tiles) or self.spec.map_kind in (
            "none",
            "all",
        ):
            return first, last
        low = alloca_entry(b, I64, "mod.first")
        high = alloca_entry(b, I64, "mod.last")
        b.store(b.add(last, i64(1)), low)  # no such tile: the empty span [last + 1, first - 1]
        b.store(b.sub(first, i64(1)), high)
        with for_range(b, first, b.add(last, i64(1)), "mod.scan") as t:
            special = b.icmp_unsigned("!=", self._state(b, map_row, t), ir.Constant(I8, FULL))
            b.store(b.select(special, smin(b, b.load(low, typ=I64), t), b.load(low, typ=I64)), low)
            b.store(b.select(special, t, b.load(high, typ=I64)), high)
        mod_first, mod_last = b.load(low, typ=I64, name="mod.first"), b.load(high, typ=I64, name="mod.last")
        return mod_first, mod_last

    def _mod_rows(
        self,
        b: ir.IRBuilder,
        row: ir.Value,
        batch: ir.Value,
        head: ir.Value,
        gi: ir.Value,
        map_row: ir.Value,
        first: ir.Value,
        last: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
        limit: ir.Value | None = None,
    ) -> ir.Value:
        """Apply the mods to one score row in place (``-inf`` where hidden); returns the row max.

        Tiles the map shows wholly visible need no mod (no score_mod, or one that is the identity
        there) and are left as they are, so the max is one loop over the row rather than one per
        tile: a row crosses up to Sk/64 tiles, and each loop ends in a horizontal reduction.
        With a ``limit`` (:meth:`_row_limit`) the keys from it on are ``-inf`` without a mod, and
        the max runs over the whole vectors up to it (:func:`vector_span_end`).
        """
        spec = self.spec
        row_symbols = self._symbols(b, batch, head, gi)
        score_hoisted = self._hoisted(b, spec.score_mod, self.score_kinds, row_symbols) if spec.score_mod else {}
        mask_hoisted = self._hoisted(b, spec.mask_mod, self.mask_kinds, row_symbols) if spec.mask_mod else {}
        untouched = spec.score_mod is None or spec.identity_on_full_tiles  # on wholly visible tiles

        def on_tile(b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, state: int | None, t: ir.Value) -> None:
            def empty() -> None:
                vector_fill(b, row, c0, c1, NEG_INF, "hidden")

            def visible(with_mask: bool) -> None:
                if not with_mask and untouched:
                    return  # wholly visible: before any row's limit
                end = computed_part(b, row, c0, c1, limit, NEG_INF, "past.limit")

                def apply(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> None:
                    raw = lanes.load(b, row, j)
                    value = self._apply_mods(
                        b, lanes, raw, b.add(ks, j), row_symbols, score_hoisted, mask_hoisted, with_mask
                    )
                    lanes.store(b, value, row, j)

                vector_loop(b, c0, end, "mods", apply)

            self._by_state(b, state, lambda: self._state(b, map_row, t), empty, visible)

        if not (self.spec.map_kind == "none" and untouched):
            self._for_tiles(b, map_row, first, last, ks, nk, on_tile)
        span = nk if limit is None else vector_span_end(b, limit, nk)
        return vector_reduce(b, i64(0), span, "row.max", "max", lambda b, j, lanes: lanes.load(b, row, j))

    def _exp_row(
        self, b: ir.IRBuilder, row: ir.Value, nk: ir.Value, m: ir.Value, inverse: ir.Value, limit: ir.Value | None
    ) -> ir.Value:
        """``row = exp(row - m)`` in place and ``*inverse = 1/sum``; returns ``lse = m + log(sum)``.

        A row with every key hidden (``m = -inf``) becomes 0 with ``lse = -inf``. With a ``limit``
        (:meth:`_row_limit`) the exp runs over the whole vectors up to it and the rest of the row
        is 0, what ``exp(-inf - m)`` gives (the sum adds the same terms in the same lanes), except
        in a row whose max is NaN, where it runs over the whole row as the reference does.
        """
        result = alloca_entry(b, F32, "lse.value")
        with b.if_else(b.fcmp_ordered("==", m, f32(NEG_INF))) as (empty, normal):
            with empty:
                vector_fill(b, row, i64(0), nk, 0.0, "row.zero")
                b.store(f32(NEG_INF), result)
                b.store(f32(0.0), inverse)
            with normal:

                def exp_term(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> ir.Value:
                    e = lanes.softmax_exp(b, b.fsub(lanes.load(b, row, j), lanes.splat(b, m)))
                    lanes.store(b, e, row, j)
                    return e

                span = nk
                if limit is not None:
                    nan_max = b.fcmp_unordered("uno", m, m, name="nan.max")
                    span = b.select(nan_max, nk, vector_span_end(b, limit, nk), name="exp.span")
                    vector_fill(b, row, span, nk, 0.0, "p.past.limit")
                total = vector_reduce(b, i64(0), span, "row.sum", "add", exp_term)
                b.store(b.fdiv(f32(1.0), total), inverse)
                b.store(b.fadd(m, b.call(self.logf, [total])), result)
        return b.load(result, typ=F32, name="lse")

    def _zero_rows(self, b: ir.IRBuilder, base: ir.Value, rows: ir.Value, stride: int, width: int) -> None:
        zero_rows(b, self.memset, base, rows, stride, width)

    # ------------------------------------------------------------------ backward

    # dK and dV sum over a group's strips. The first product to reach a key tile stores it
    # (beta = 0) instead of adding to rows zeroed beforehand: zeroing a group's dK/dV up front
    # (strided rows in BSHD, a cache miss each), rows the strips then read back, made a causal
    # or windowed forward and backward 3-5% slower. The backward takes its strips last first, so
    # a causal mask's first strip reaches every key tile and nothing is zeroed; a run that
    # reaches tiles both written and not zeroes the new ones and adds; tiles no strip reached
    # are zeroed at the end. (A dynamic alloca holds the flags: LLVM brackets it with a stack
    # save and restore wherever it inlines the item function into a loop.)

    def _kv_grad_slots(self, b: ir.IRBuilder, batch: ir.Value, group: ir.Value) -> list[tuple[ir.Value, int, int]]:
        """``(head, row stride, width)`` of dK and dV (those the node computes) for this group."""
        d = self.spec.dims
        slots = []
        for slot, width in (("dk", d.head_dim), ("dv", d.value_dim)):
            if slot in self.base:
                slots.append((self._head(b, slot, batch, group), self._row_stride(slot), width))
        return slots

    def _zero_tile(self, b: ir.IRBuilder, tile: ir.Value, slots: list[tuple[ir.Value, int, int]]) -> None:
        """Zero the rows of key tile ``tile`` in every slot."""
        block_k = self.spec.grid.block_k
        k0 = b.mul(tile, i64(block_k))
        rows = smin(b, i64(block_k), b.sub(self.sk, k0))
        for head, stride, width in slots:
            self._zero_rows(b, gep_f32(b, head, b.mul(k0, i64(stride))), rows, stride, width)

    def _tiles_of(self, b: ir.IRBuilder, c0: ir.Value, c1: ir.Value) -> tuple[ir.Value, ir.Value]:
        """The key tiles ``[t0, t1)`` a run of key columns ``[c0, c1)`` covers."""
        return b.sdiv(c0, i64(self.spec.grid.block_k)), ceil_div(b, c1, self.spec.grid.block_k)

    def _first_touch(self, b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, slot: tuple[ir.Value, int, int]) -> ir.Value:
        """The beta of a product into ``slot`` over key columns ``[c0, c1)``: 0 where no earlier
        product reached those tiles; 1 where all were, or after zeroing the ones not reached."""
        t0, t1 = self._tiles_of(b, c0, c1)
        reached = alloca_entry(b, I64, "tiles.reached")
        b.store(i64(0), reached)
        with for_range(b, t0, t1, "touch") as t:
            flag = b.zext(b.not_(self._untouched(b, t)), I64)
            b.store(b.add(b.load(reached, typ=I64), flag), reached)
        count = b.load(reached, typ=I64, name="reached")
        fresh = b.icmp_signed("==", count, i64(0), name="fresh")
        mixed = b.and_(b.not_(fresh), b.icmp_signed("!=", count, b.sub(t1, t0)), name="mixed")
        with b.if_then(mixed), for_range(b, t0, t1, "touch.zero") as t, b.if_then(self._untouched(b, t)):
            self._zero_tile(b, t, [slot])
        return b.select(fresh, f32(0.0), f32(1.0), name="beta.kv")

    def _mark_touched(self, b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, _: ir.Value) -> None:
        """Note that the products of a run of key columns ``[c0, c1)`` have reached its tiles."""
        t0, t1 = self._tiles_of(b, c0, c1)
        b.call(self.memset, [gep(b, self.written, [t0], I8), ir.Constant(I8, 1), b.sub(t1, t0), ir.Constant(I1, 0)])

    def _zero_untouched(self, b: ir.IRBuilder, batch: ir.Value, group: ir.Value) -> None:
        """Zero the key tiles of this group's dK/dV that no strip reached."""
        slots = self._kv_grad_slots(b, batch, group)
        if not slots:
            return
        with for_range(b, 0, self.tiles, "untouched") as t, b.if_then(self._untouched(b, t)):
            self._zero_tile(b, t, slots)

    def _untouched(self, b: ir.IRBuilder, tile: ir.Value) -> ir.Value:
        """Whether no product has reached key tile ``tile`` yet (i1)."""
        return b.icmp_unsigned("==", b.load(gep(b, self.written, [tile], I8), typ=I8), ir.Constant(I8, 0))

    def _partial_base(self, b: ir.IRBuilder, batch: ir.Value, group: ir.Value) -> dict[int, ir.Value]:
        """Where this item accumulates each score-mod tensor's gradient: its own partial slice."""
        d = self.spec.dims
        bases = {}
        for tensor, _, by_b, by_h in self.spec.tensor_grads:
            index: ir.Value = i64(0)
            if by_b:
                index = b.mul(batch, i64(d.kv_heads if by_h else 1))
            if by_h:
                index = b.add(index, group)
            numel = emit_size(b, product(self.spec.captured[tensor].shape), self.symbols)  # per call if symbolic
            bases[tensor] = gep_f32(b, self.base[f"p{tensor}"], b.mul(index, numel))
        return bases

    def _backward_head(
        self,
        b: ir.IRBuilder,
        batch: ir.Value,
        head: ir.Value,
        group: ir.Value,
        p_buf: ir.Value,
        dp_buf: ir.Value,
        raw_buf: ir.Value,
    ) -> None:
        spec, d, grid = self.spec, self.spec.dims, self.spec.grid
        grads = spec.grads
        assert grads is not None
        q_head = self._head(b, "q", batch, head)
        k_head = self._head(b, "k", batch, group)
        v_head = self._head(b, "v", batch, group)
        dy_head = self._head(b, "dy", batch, head)
        plane = b.mul(b.add(b.mul(batch, i64(d.heads)), head), self.sq)
        if not spec.recompute:
            out_head = self._head(b, "out", batch, head)
            lse_row = gep_f32(b, self.base["lse"], plane)
        dlse_row = gep_f32(b, self.base["dlse"], plane) if spec.lse_grad else None
        # Each operand and output has its own leading dimension: q, k, v and dy may be views.
        ldq, ldk, ldv, ld_dy, ld_out = (self._row_stride(slot) for slot in ("q", "k", "v", "dy", "out"))
        ld_dq, ld_dk, ld_dv = (self._row_stride(slot) for slot in ("dq", "dk", "dv"))
        partials = self._partial_base(b, batch, group)
        self.key_diagonal = self._key_diagonal(b) if self.spec.key_bounds else i64(0)
        nan_rows = alloca_entry(b, I1, "nan.rows")  # recomputing: a strip row P is NaN in (below)
        with for_range(b, 0, self.strips, "step") as step:
            strip = b.sub(b.sub(self.strips, i64(1)), step, name="strip")  # last first: see _first_touch
            i0, rows = self._strip_bounds(b, strip)
            map_row = self._map_row(b, batch, head, strip)
            q_strip = gep_f32(b, q_head, b.mul(i0, i64(ldq)))
            dy_strip = gep_f32(b, dy_head, b.mul(i0, i64(ld_dy)))
            dq_head = self._head(b, "dq", batch, head) if grads & Wrt.QUERY else None
            dq_strip = gep_f32(b, dq_head, b.mul(i0, i64(ld_dq))) if dq_head is not None else None

            def attempt(b: ir.IRBuilder) -> None:
                first, last = self._visible_tiles(b, map_row)
                with b.if_else(b.icmp_signed(">", first, last)) as (nothing, something):
                    with nothing:
                        self._needs_dense(b, None)
                        if dq_strip is not None:
                            self._zero_rows(b, dq_strip, rows, ld_dq, d.head_dim)
                    with something:
                        ks = b.mul(first, i64(grid.block_k), name="ks")
                        ke = smin(b, b.mul(b.add(last, i64(1)), i64(grid.block_k)), self.sk)
                        nk = b.sub(ke, ks, name="nk")
                        self._scores(b, map_row, first, last, ks, nk, q_strip, k_head, rows, p_buf, i0)
                        mod_first, mod_last = (
                            self._mod_tiles(b, map_row, first, last) if spec.recompute else (first, last)
                        )
                        started = self.clock.start(b)
                        b.store(ir.Constant(I1, 0), nan_rows)
                        with for_range(b, 0, rows, "r") as r:
                            gi = b.add(i0, r, name="gi")
                            row = gep_f32(b, p_buf, b.mul(r, nk))
                            raw_row = gep_f32(b, raw_buf, b.mul(r, nk)) if spec.keeps_raw else None
                            if spec.recompute:
                                m, inv = self._softmax_row(
                                    b, row, raw_row, batch, head, gi, map_row, mod_first, mod_last, ks, nk
                                )
                                self._needs_dense(b, m)
                                # P is not 0 above the diagonal where m is NaN, or 1/sum is
                                # not finite (0 · inf is NaN too)
                                nan = b.or_(b.fcmp_unordered("uno", m, m), not_finite(b, inv), name="nan.row")
                                b.store(b.or_(b.load(nan_rows, typ=I1), nan), nan_rows)
                            else:
                                lse = b.load(gep_f32(b, lse_row, gi), typ=F32, name="lse.i")
                                self._needs_dense(b, lse)
                                self._probability_row(
                                    b, row, raw_row, batch, head, gi, lse, map_row, first, last, ks, nk
                                )
                        self.clock.count(b, "softmax", started)
                        # The products that skip the terms above the diagonal need P and dS
                        # exactly 0 there (dS is 0 wherever P is), and finite factors for them
                        # (_heads_finite). P is, from an LSE even when NaN (_probability_row
                        # shifts it by +inf); not from recomputed statistics that are not finite.
                        finite = b.and_(self.keys_finite, self.queries_finite)
                        exact = b.and_(finite, b.not_(b.load(nan_rows, typ=I1)), name="strip.exact")
                        with b.if_then(self._exact(b)):
                            if grads & Wrt.VALUE:  # dV_run += P_run^T dY_strip
                                dv_head = self._head(b, "dv", batch, group)

                                def dv_gemm(b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, is_first: ir.Value) -> None:
                                    beta = self._first_touch(b, c0, c1, (dv_head, ld_dv, d.value_dim))
                                    self._sgemm(
                                        b,
                                        TRANS,
                                        NO_TRANS,
                                        b.sub(c1, c0),
                                        d.value_dim,
                                        rows,
                                        1.0,
                                        gep_f32(b, p_buf, b.sub(c0, ks)),
                                        nk,
                                        dy_strip,
                                        ld_dy,
                                        beta,
                                        gep_f32(b, dv_head, b.mul(c0, i64(ld_dv))),
                                        ld_dv,
                                        *self._run_band(b, Band.K_LOWER, i0, c0, exact),
                                    )

                                self._for_runs(b, map_row, first, last, dv_gemm)
                            if spec.needs_dp:

                                def dp_gemm(b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, is_first: ir.Value) -> None:
                                    v_run, ld_run, trans = keys_operand(b, v_head, ldv, self.packed["v"], c0, self.sk)
                                    self._sgemm(
                                        b,
                                        NO_TRANS,
                                        trans,
                                        rows,
                                        b.sub(c1, c0),
                                        d.value_dim,
                                        1.0,
                                        dy_strip,
                                        ld_dy,
                                        v_run,
                                        ld_run,
                                        0.0,
                                        gep_f32(b, dp_buf, b.sub(c0, ks)),
                                        nk,
                                        # dS (and a recomputing kernel's D, _row_dot) reads dP
                                        # only where P is not 0
                                        *self._run_band(b, Band.OUT_LOWER, i0, c0),
                                    )

                                self._for_runs(b, map_row, first, last, dp_gemm)
                                if not spec.recompute:
                                    out_strip = gep_f32(b, out_head, b.mul(i0, i64(ld_out)))
                                started = self.clock.start(b)
                                with for_range(b, 0, rows, "r.ds") as r:
                                    gi = b.add(i0, r, name="gi")
                                    offset = b.mul(r, nk)
                                    if spec.recompute:  # D = rowsum(P * dP); hidden keys (P = 0) add nothing
                                        delta = self._row_dot(
                                            b, gep_f32(b, p_buf, offset), gep_f32(b, dp_buf, offset), nk
                                        )
                                    else:  # D = rowsum(dY * out)
                                        delta = vector_reduce(
                                            b,
                                            i64(0),
                                            i64(d.value_dim),
                                            "delta",
                                            "add",
                                            lambda b, j, lanes: b.fmul(
                                                lanes.load(b, dy_strip, b.add(b.mul(r, i64(ld_dy)), j)),
                                                lanes.load(b, out_strip, b.add(b.mul(r, i64(ld_out)), j)),
                                            ),
                                        )
                                    if dlse_row is not None:
                                        delta = b.fsub(delta, b.load(gep_f32(b, dlse_row, gi), typ=F32))
                                    raw_row = gep_f32(b, raw_buf, offset) if spec.keeps_raw else None
                                    self._ds_row(
                                        b,
                                        gep_f32(b, p_buf, offset),
                                        gep_f32(b, dp_buf, offset),
                                        raw_row,
                                        delta,
                                        batch,
                                        head,
                                        gi,
                                        map_row,
                                        first,
                                        last,
                                        ks,
                                        nk,
                                        partials,
                                        exact,
                                    )
                                self.clock.count(b, "softmax_backward", started)
                                if dq_strip is not None:

                                    def dq_gemm(
                                        b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, is_first: ir.Value
                                    ) -> None:
                                        beta = b.select(is_first, f32(0.0), f32(1.0))
                                        self._sgemm(
                                            b,
                                            NO_TRANS,
                                            NO_TRANS,
                                            rows,
                                            d.head_dim,
                                            b.sub(c1, c0),
                                            spec.scale,
                                            gep_f32(b, dp_buf, b.sub(c0, ks)),
                                            nk,
                                            gep_f32(b, k_head, b.mul(c0, i64(ldk))),
                                            ldk,
                                            beta,
                                            dq_strip,
                                            ld_dq,
                                            *self._run_band(b, Band.K_UPPER, i0, c0, exact),
                                            panels_from(b, self.panels, "k", c0),
                                        )

                                    self._for_runs(b, map_row, first, last, dq_gemm)
                                if grads & Wrt.KEY:
                                    dk_head = self._head(b, "dk", batch, group)

                                    def dk_gemm(
                                        b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, is_first: ir.Value
                                    ) -> None:
                                        beta = self._first_touch(b, c0, c1, (dk_head, ld_dk, d.head_dim))
                                        self._sgemm(
                                            b,
                                            TRANS,
                                            NO_TRANS,
                                            b.sub(c1, c0),
                                            d.head_dim,
                                            rows,
                                            spec.scale,
                                            gep_f32(b, dp_buf, b.sub(c0, ks)),
                                            nk,
                                            q_strip,
                                            ldq,
                                            beta,
                                            gep_f32(b, dk_head, b.mul(c0, i64(ld_dk))),
                                            ld_dk,
                                            *self._run_band(b, Band.K_LOWER, i0, c0, exact),
                                        )

                                    self._for_runs(b, map_row, first, last, dk_gemm)
                            if grads & (Wrt.KEY | Wrt.VALUE):
                                self._for_runs(b, map_row, first, last, self._mark_touched)

            self._attempts(b, attempt)

    def _softmax_row(
        self,
        b: ir.IRBuilder,
        row: ir.Value,
        raw_row: ir.Value | None,
        batch: ir.Value,
        head: ir.Value,
        gi: ir.Value,
        map_row: ir.Value,
        first: ir.Value,
        last: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
    ) -> tuple[ir.Value, ir.Value]:
        """``row = softmax(mods(row))`` in place, its statistics from the row itself (recompute mode);
        raw scores kept if asked. Hidden keys get 0; a row with none visible is all 0. Returns the
        row max and the 1/sum that scaled the row."""
        if raw_row is not None:
            vector_loop(b, i64(0), nk, "raw", lambda b, j, lanes: lanes.store(b, lanes.load(b, row, j), raw_row, j))
        limit = self._row_limit(b, gi, ks, nk)
        m = self._mod_rows(b, row, batch, head, gi, map_row, first, last, ks, nk, limit)
        inverse = alloca_entry(b, F32, "inv.sum")
        self._exp_row(b, row, nk, m, inverse, limit)
        inv = b.load(inverse, typ=F32, name="inv")
        scale_row(b, row, nk, inv)
        return m, inv

    def _row_dot(self, b: ir.IRBuilder, p_row: ir.Value, dp_row: ir.Value, nk: ir.Value) -> ir.Value:
        """``sum(P * dP)`` over a row; where P is 0 (hidden, or a skipped tile whose dP was never
        computed) the term is 0."""

        def term(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> ir.Value:
            p = lanes.load(b, p_row, j)
            product = b.fmul(p, lanes.load(b, dp_row, j))
            return b.select(b.fcmp_ordered("==", p, lanes.const(0.0)), lanes.const(0.0), product)

        return vector_reduce(b, i64(0), nk, "delta", "add", term)

    def _probability_row(
        self,
        b: ir.IRBuilder,
        row: ir.Value,
        raw_row: ir.Value | None,
        batch: ir.Value,
        head: ir.Value,
        gi: ir.Value,
        lse: ir.Value,
        map_row: ir.Value,
        first: ir.Value,
        last: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
    ) -> None:
        """``row = exp(mods(row) - lse)`` in place (0 where hidden or lse = -inf); raw scores kept if
        asked. Past the row's limit (:meth:`_row_limit`) P is 0 without a mod or an exp: the mask
        hides those keys, and ``exp(-inf - shift)`` is 0 for every shift."""
        spec = self.spec
        limit = self._row_limit(b, gi, ks, nk)
        row_symbols = self._symbols(b, batch, head, gi)
        score_hoisted = self._hoisted(b, spec.score_mod, self.score_kinds, row_symbols) if spec.score_mod else {}
        mask_hoisted = self._hoisted(b, spec.mask_mod, self.mask_kinds, row_symbols) if spec.mask_mod else {}
        # lse = -inf (no visible key) would make exp(-inf - -inf) NaN: shift by +inf instead, giving 0.
        finite = b.fcmp_ordered("!=", lse, f32(NEG_INF))
        shift = b.select(finite, lse, f32(math.inf), name="lse.shift")

        def on_tile(b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, state: int | None, t: ir.Value) -> None:
            def empty() -> None:
                vector_fill(b, row, c0, c1, 0.0, "p.hidden")

            def visible(with_mask: bool) -> None:
                end = computed_part(b, row, c0, c1, limit, 0.0, "p.past.limit")

                def body(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> None:
                    raw = lanes.load(b, row, j)
                    if raw_row is not None:
                        lanes.store(b, raw, raw_row, j)
                    s = self._apply_mods(
                        b, lanes, raw, b.add(ks, j), row_symbols, score_hoisted, mask_hoisted, with_mask
                    )
                    lanes.store(b, lanes.exp(b, b.fsub(s, lanes.splat(b, shift))), row, j)

                vector_loop(b, c0, end, "p", body)

            self._by_state(b, state, lambda: self._state(b, map_row, t), empty, visible)

        self._for_tiles(b, map_row, first, last, ks, nk, on_tile)

    def _ds_row(
        self,
        b: ir.IRBuilder,
        p_row: ir.Value,
        dp_row: ir.Value,
        raw_row: ir.Value | None,
        delta: ir.Value,
        batch: ir.Value,
        head: ir.Value,
        gi: ir.Value,
        map_row: ir.Value,
        first: ir.Value,
        last: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
        partials: dict[int, ir.Value],
        exact: ir.Value,
    ) -> None:
        """``dp_row = P ∘ (dP - delta) ∘ ds/dscore`` (0 where P is 0); score-mod tensor grads
        accumulated. ``exact``: the strip's P is 0 past each row's limit (:meth:`_row_limit`)."""
        gradient = self.gradient
        row_symbols = self._symbols(b, batch, head, gi)
        hoisted = self._hoisted(b, gradient, self.gradient_kinds, row_symbols) if gradient is not None else {}
        # past the row's limit P is 0, and so is dS, where the strip is exact: a recomputed row
        # whose max is NaN has NaN there (as in the reference), which dK must see. Only a
        # score_mod's derivative makes dS dearer to compute than to fill in (a plain dS row, 0.86
        # against 0.92 ms of causal B4 H8 S512 without the limit).
        limit = self._row_limit(b, gi, ks, nk) if gradient is not None else None
        if limit is not None:
            limit = b.select(exact, limit, nk, name="ds.limit")

        def on_tile(b: ir.IRBuilder, c0: ir.Value, c1: ir.Value, state: int | None, t: ir.Value) -> None:
            def empty() -> None:
                vector_fill(b, dp_row, c0, c1, 0.0, "ds.hidden")

            def visible(with_mask: bool) -> None:
                end = computed_part(b, dp_row, c0, c1, limit, 0.0, "ds.past.limit")

                def body(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> None:
                    p = lanes.load(b, p_row, j)
                    ds = b.fmul(p, b.fsub(lanes.load(b, dp_row, j), lanes.splat(b, delta)))
                    zero = b.fcmp_ordered("==", p, lanes.const(0.0))
                    if gradient is not None and (with_mask or not self.spec.identity_on_full_tiles):
                        assert raw_row is not None
                        symbols = self._element_symbols(
                            b, row_symbols, b.add(ks, j), lanes.width, lanes.load(b, raw_row, j)
                        )
                        emitter = RegionEmitter(
                            b, gradient, self.gradient_kinds, lanes.width, symbols, self.tensors, hoisted
                        )
                        emitter.emit(range(len(gradient.steps)))
                        g_score = emitter.get(gradient.outputs[1], "f")
                        self._accumulate_tensor_grads(b, lanes, emitter, gradient, ds, zero, partials)
                        ds = b.fmul(ds, g_score)
                        # d s / d score = 0 (a replaced score) passes nothing, not even a NaN
                        zero = b.or_(zero, b.fcmp_ordered("==", g_score, lanes.const(0.0)))
                    lanes.store(b, b.select(zero, lanes.const(0.0), ds), dp_row, j)

                vector_loop(b, c0, end, "ds", body)

            self._by_state(b, state, lambda: self._state(b, map_row, t), empty, visible)

        self._for_tiles(b, map_row, first, last, ks, nk, on_tile)

    def _accumulate_tensor_grads(
        self,
        b: ir.IRBuilder,
        lanes: Lanes,
        emitter: RegionEmitter,
        gradient: GradientRegion,
        ds: ir.Value,
        zero: ir.Value,
        partials: dict[int, ir.Value],
    ) -> None:
        """``partial[t][index] += ds · d s / d read`` for every float read of the score_mod, in lane order."""
        if not partials:
            return
        region = self.spec.score_mod
        assert region is not None
        reads = region.float_reads(self.score_kinds)
        for (step, tensor), ref in zip(reads, gradient.outputs[2:], strict=True):
            contribution = b.select(zero, lanes.const(0.0), b.fmul(ds, emitter.get(ref, "f")))
            base = partials[tensor]
            if lanes.width > 1 and emitter.contiguous(step):
                first = emitter._lane_zero_offset(step)
                ptr = gep_f32(b, base, first)
                old = b.load(ptr, typ=lanes.type, align=4)
                b.store(b.fadd(old, contribution), ptr, align=4)
                continue
            offset = emitter.offset_of(step)
            if offset.uniform:
                total = sum_lanes(b, contribution) if lanes.width > 1 else contribution
                ptr = gep_f32(b, base, offset.value)
                b.store(b.fadd(b.load(ptr, typ=F32), total), ptr)
                continue
            for lane in range(lanes.width):
                position = b.extract_element(offset.value, ir.Constant(ir.IntType(32), lane))
                ptr = gep_f32(b, base, position)
                value = b.extract_element(contribution, ir.Constant(ir.IntType(32), lane))
                b.store(b.fadd(b.load(ptr, typ=F32), value), ptr)


def computed_part(
    b: ir.IRBuilder, row: ir.Value, c0: ir.Value, c1: ir.Value, limit: ir.Value | None, past: float, name: str
) -> ir.Value:
    """The end of a tile's keys ``[c0, c1)`` that a row computes, with ``row[end:c1] = past``:
    ``c1`` without a limit (:meth:`FlexLowering._row_limit`), else the limit rounded up to whole
    vectors from ``c0``, within ``[c0, c1]``. Stopping exactly at the limit left up to 15 keys
    a tile to scalar code, which made a softcap forward 3-9% slower (a scalar tanh each)."""
    if limit is None:
        return c1
    end = whole_vectors_end(b, c0, smax(b, limit, c0), c1, name="tile.end")
    vector_fill(b, row, end, c1, past, name)
    return end


def vector_span_end(b: ir.IRBuilder, limit: ir.Value, nk: ir.Value) -> ir.Value:
    """``limit`` rounded up to whole vectors of the row loops, at most ``nk``: a sum over ``[0,
    span)`` adds the same terms in the same lanes as one over ``[0, nk)`` whose terms past
    ``limit`` are zeros, and a max over it is the max of a row that is ``-inf`` past ``limit``
    (the same in any grouping), so their results are bitwise the same."""
    return whole_vectors_end(b, i64(0), limit, nk, name="span.end")


def _kind(ty: TensorType) -> str:
    kind = ty.dtype.kind
    return "f" if kind == "f" else "b" if kind == "b" else "i"


__all__ = ["FlexKernelSpec", "FlexLowering"]
