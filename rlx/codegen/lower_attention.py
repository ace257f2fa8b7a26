"""Lower one attention (forward or backward) node to a per-head LLVM function.

The function ``void @<node>(ptr args, i64 item, ptr scratch)`` computes head ``item`` (= b·H + h)
in query strips of ``block_q`` rows, so scratch is O(block_q · Sk) per thread whatever the
sequence length. For each strip:

1. ``S = scale · Q_strip K_vis^T``                      (GEMM, only keys the strip can see)
2. mask, then row softmax in place: ``S -> P``
3. forward:  ``out_strip = P V_vis``                    (GEMM)
   backward: ``dV_vis += P^T dY_strip``                 (GEMM, if dV wanted)
             ``dP = dY_strip V_vis^T``                  (GEMM, if dQ or dK wanted)
             ``dS = P ∘ (dP − rowsum(P ∘ dP))``, 0 where masked
             ``dQ_strip = scale · dS K_vis``            (GEMM, if dQ wanted)
             ``dK_vis += scale · dS^T Q_strip``         (GEMM, if dK wanted)

So V alone costs 2 GEMMs, Q or K alone 3, any two 4, all three 5. The visible keys of a strip
are ``[ks, ks + nk)``: all keys, except for causal and sliding-window masks, whose hidden blocks
are skipped. Skipping is exact only while a hidden key's weight ``exp(neg − rowmax)`` vanishes;
when a row says otherwise (a custom ``neg`` near the scores, or a row with no visible key) the
strip is recomputed over all keys, which is always exact. Within a strip the causal-like
kernels band their products (:data:`BANDS`, ``tile_gemm.Band``): the register tiles skip what
lies above the strip's diagonal, bitwise the whole product wherever it is read, so their strips
can be tall without computing the hidden triangle.

Both layouts are read in place: a head's rows are ``H·D`` floats apart in BSHD and ``D`` apart in
BHSD, and that stride is the BLAS leading dimension. An operand read through a strided view (a
split of a fused QKV projection: rows ``3·H·D`` floats apart) is read in place too, through its
own strides (:class:`OperandStrides`). The copies: from ``PACK_MIN_ROWS`` query
rows on, each item first copies its head's K (and, for dP, V) transposed into the thread's
scratch, so that ``Q K^T`` and ``dY V^T`` run as NN products, which OpenBLAS runs faster; and
where the register tiles run the products, it packs V (forward) or K (the backward's dQ) in
their column panels (:data:`PANELS`), which every strip's product would otherwise copy again.

A kernel whose operands and outputs exceed the L2 caches writes ``out`` or dQ (a strip at a
time) and, for heads short enough, dK and dV into the thread's scratch and streams them out with
non-temporal stores (:meth:`AttentionLowering._stream_out`): written in place, every line would
first be read. Over BSHD heads, each strip's rows of Q (and dY) are read from a dense copy
(:meth:`AttentionKernelSpec.dense_rows`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from llvmlite import ir

from rlx.codegen.blas import NO_TRANS, OMATCOPY, ROW_MAJOR, SGEMM, SGEMV, TRANS, load_blas
from rlx.codegen.irutil import (
    F32,
    I1,
    I8,
    I32,
    I64,
    PTR,
    VOID,
    alloca_entry,
    as_i64,
    clamp,
    declare,
    f32,
    for_range,
    gep,
    gep_f32,
    i32,
    i64,
    intrinsic,
    smax,
    smin,
)
from rlx.codegen.kernel_clock import COUNTERS_BYTES, KernelClock
from rlx.codegen.sizes import SizeLike, ceil_div, emit_size, load_symbols, size_of
from rlx.codegen.strip_heights import SMALL_PATH_MACS, StripHeights
from rlx.codegen.tile_gemm import Band, declare_tile_gemm, host_tile_shape
from rlx.codegen.vector import (
    WIDTH,
    Lanes,
    splat,
    sum_lanes,
    vector_fill,
    vector_loop,
    vector_reduce,
    whole_vectors_end,
)
from rlx.ir.ops import AttentionDims
from rlx.ir.types import Dim, Layout, MaskKind, Wrt

# A hidden key may be skipped when its softmax weight exp(neg - rowmax) is below e^-50: even
# summed over 10^7 keys that is far under float32 rounding of the row sum (which is >= 1).
SKIP_MARGIN = -50.0
SCRATCH_ALIGN = 64
# Queries from which a head's K (and, for dP, V) is first copied transposed, so that the strips'
# products S = Q K^T and dP = dY V^T run as NN products: OpenBLAS (SkylakeX kernels) ran 64 x 128
# x 64 at 128 GFLOP/s as NN and at 91 as NT, 128 x 512 x 64 at 138 against 131. A copy costs a
# pass over the head's K (4 us at S = 128, D = 64), which a single query row does not repay.
PACK_MIN_ROWS = 16
# Which strip products the register tiles take (:func:`emit_sgemm`), from one-core native-loop
# rates against OpenBLAS. Not those on OpenBLAS's small-matrix path (:data:`SMALL_PATH_MACS`):
# there both run the same FMA chain (bit-identical results) and OpenBLAS was 2-7% faster in
# the kernels. Above it, with A as stored, every size: from 32-row strips to 256-row strips
# over 16384 keys the tiles ran 1.0-1.5x OpenBLAS, once a wide product's panels of B whose rows
# lie a page or more apart are copied (``tile_gemm``; 256 x 16384 x 64: 155 GFLOP/s against
# OpenBLAS's 128 and MKL's 156; narrow ones, ``out = P V`` and ``dQ = dS K`` over 8192-16384
# keys: 161-182 against 144). With A transposed (``dV += P^T dY``, ``dK += dS^T Q``: a tile
# reads 14 adjacent floats of a row of P per step of k, the strip's rows ``Sk`` floats apart)
# they ran 1.07-1.20x while A (Sk keys x strip rows) took at most 512 KB (512 x 64 x 256, 1024
# x 64 x 128, 2048 x 64 x 64), and 0.96-1.01x beyond (1024 x 64 x 256, 2048 x 64 x 128, 768 x
# 128 x 256), where OpenBLAS's packing pays for itself: every column panel of C reads all of A
# again. Where OpenBLAS has no small-matrix path (its Haswell kernels, which it runs on AMD Zen
# too) it packs the small products as well, and the tiles take them: one core of an AMD EPYC,
# native loops, 16 x 64 x 64 at 79 GFLOP/s against 60, 64 x 64 x 128 77 against 70; in the
# kernels (both variants compiled in one process, calls interleaved) causal S512 backward
# 1.08x faster, forward S128 1.09x, B16 S32 backward 1.16x, the larger cases unchanged.
TILE_TN_MAX_A = 1 << 17  # elements of op(A) = P^T or dS^T: 512 KB
# A streaming backward (AttentionKernelSpec.stream) stages dK and dV whole in the thread's
# scratch while Sk x (D + Dv) is at most this many floats (256 KB); longer heads write them in
# place, where the time per key row is too large for the write misses to matter.
STAGE_KV_MAX_FLOATS = 1 << 16
# A kernel over BSHD heads copies each strip's rows of Q (and, backward, dY) dense, an odd
# number of lines apart, from this many keys on: as the A operand of Q K^T and dY V^T, rows H·D
# floats apart fell into a few sets of L1 (2 KB apart: two sets per column). Backward B4 H8
# S512, B2 H8 S1024 causal and B2 H6 S768 D128: 3-4% faster, the forward 0-6%; at S = 128 the
# copy costs what it saves.
DENSE_ROWS_MIN_KEYS = 256
# Causal-like kernels band their strip products (tile_gemm.Band): a product skips what lies
# above the strip's diagonal, where the mask hides the scores and P and dS are 0. Scores there
# are never read, so S = Q K^T always skips them. The other products skip terms that add 0 ·
# x, which is 0 only for finite x: they skip them where the kernel has checked that Q, K, V
# (and dY) hold no NaN or Inf and no row's hidden keys weigh, so that results are bitwise those
# of the whole products. The check (a pass over the operands) runs from this many query rows
# on; a decode step's few rows would pay more for it than the band saves.
BANDS = True
BAND_MIN_ROWS = 32
# The forward packs each head's V, the backward its K, in the tiles' column panels once per head
# (emit_panel_copy), for the products that read them strip after strip (P V, dQ = dS K).
PANELS = True


def bands_products() -> bool:
    """Whether attention kernels band their strip products on this machine (:data:`BANDS`): the
    CPU has the register tiles that skip the band. The programmable kernels ask too, for masks
    with a diagonal (``Region.key_bounds``)."""
    return BANDS and host_tile_shape() is not None


def bands_strips(mask: MaskKind) -> bool:
    """Whether a kernel of this fixed mask bands its strip products: causal-like masks."""
    return mask.is_causal_like and bands_products()


@dataclass(frozen=True)
class StripBand:
    """Whether a strip's products after its softmax may skip the terms above its ``diagonal``
    (``exact``, an i1 of the strip; see :data:`BANDS`), and that diagonal (row r of the strip
    sees its keys j <= r + diagonal)."""

    exact: ir.Value
    diagonal: ir.Value

    def mode(self, b: ir.IRBuilder, mode: int) -> ir.Value:
        """``mode`` where the strip is exact, else the whole product."""
        return b.select(self.exact, i64(mode), i64(Band.NONE), name="band")


INPUT_SLOTS = ("q", "k", "v", "dy")  # the tensor operands of attention (q, k, v) and its backward
KEY_SIDE = ("k", "v", "dk", "dv")  # operands and outputs with a row per key, in kv heads


@dataclass(frozen=True)
class OperandStrides:
    """Where an operand read through a strided view keeps its heads: element strides between
    batches, heads and rows (a row's elements are adjacent). The rows' stride is the BLAS
    leading dimension, so it is at least the row's width."""

    slot: str
    batch: int
    head: int
    row: int
    batch_per_position: int = 0  # more elements between batches per position of a symbolic length


def slot_heads_and_width(dims: HeadDims, slot: str) -> tuple[int, int]:
    """``(heads, row width)`` of an operand or output: q-side, k-side or v-side."""
    heads = dims.kv_heads if slot in KEY_SIDE else dims.heads
    width = dims.value_dim if slot in ("v", "dv", "dy", "out") else dims.head_dim
    return heads, width


def view_row_stride(layout: Layout, dims: HeadDims, strides: tuple[OperandStrides, ...], slot: str) -> int:
    """Elements between consecutive rows of one head of ``slot`` (the BLAS leading dimension):
    a strided view's, else the layout's."""
    given = next((view for view in strides if view.slot == slot), None)
    return given.row if given is not None else row_stride(layout, *slot_heads_and_width(dims, slot))


def emit_view_head_offset(
    b: ir.IRBuilder,
    layout: Layout,
    dims: HeadDims,
    strides: tuple[OperandStrides, ...],
    slot: str,
    batch: ir.Value,
    head: ir.Value,
    seq: int | ir.Value,
) -> ir.Value:
    """Element offset of row 0 of head (batch, head) of ``slot``, whose heads have ``seq`` rows:
    through a strided view's strides, else as the layout places it (:func:`head_offset`)."""
    given = next((view for view in strides if view.slot == slot), None)
    if given is None:
        return head_offset(b, layout, batch, head, seq, *slot_heads_and_width(dims, slot))
    between = i64(given.batch)
    if given.batch_per_position:
        length = as_i64(seq)
        between = b.add(between, b.mul(length, i64(given.batch_per_position)))
    return b.add(b.mul(batch, between), b.mul(head, i64(given.head)))


def rows_strided(layout: Layout, dims: AttentionDims, strides: tuple[OperandStrides, ...], backward: bool) -> bool:
    """Whether some operand's rows lie farther apart than their width (BSHD with several heads,
    or a strided view), which the strip heights and the dense strip copies weigh."""
    given = {view.slot: view.row for view in strides}
    for slot in INPUT_SLOTS if backward else INPUT_SLOTS[:3]:
        heads, width = slot_heads_and_width(dims, slot)
        if given.get(slot, row_stride(layout, heads, width)) != width:
            return True
    return False


@dataclass(frozen=True)
class AttentionKernelSpec:
    """Everything that shapes the generated code of one attention node."""

    dims: AttentionDims
    layout: Layout
    mask: MaskKind
    neg: float
    threshold: float
    grads: Wrt | None  # None: the forward op
    block_q: int
    symbols: tuple[str, ...] = ()  # the call's symbolic dimensions, in the order of the sizes table
    profile: bool = False  # time BLAS, softmax and dS into per-thread counters (static shapes)
    counters_at: int = 0  # byte offset of those counters in a thread's scratch (its last 64 bytes)
    stream: bool = False  # stage outputs in scratch, stream them out (AttentionLowering._stream_out)
    strides: tuple[OperandStrides, ...] = ()  # operands read through strided views
    heights: StripHeights | None = None  # symbolic lengths: each call's strip height (block_q the tallest)
    # Symbolic lengths with ``stream``: each call streams when its operands and outputs (shapes
    # and item sizes) exceed ``stream_above`` bytes (AttentionLowering._decide_streaming).
    stream_when: tuple[tuple[tuple[Dim, ...], int], ...] = ()
    stream_above: int = 0

    @property
    def is_static(self) -> bool:
        return isinstance(self.dims.seq_q, int) and isinstance(self.dims.seq_k, int)

    def dense_rows(self) -> dict[str, int]:
        """The strip operands a kernel copies dense per strip (:data:`DENSE_ROWS_MIN_KEYS`): Q,
        and dY in a backward that forms dP; with the leading dimension of the copy: whole
        lines, an odd number of them."""
        dims = self.dims
        if (
            not (self.is_static and self.strided_rows)
            or not isinstance(dims.seq_k, int)
            or dims.seq_k < DENSE_ROWS_MIN_KEYS
        ):
            return {}
        if self.grads is None:
            return {"q": packed_ld(dims.head_dim)}
        return {"q": packed_ld(dims.head_dim), "dy": packed_ld(dims.value_dim)} if self.needs_dp else {}

    def buffer_floats(self) -> dict[str, int]:
        """The buffers after the strips and the transposed copies in a thread's scratch, in
        order: staged outputs (by slot) and dense strip rows (``"q.rows"``, ``"dy.rows"``)."""
        dense = {f"{slot}.rows": whole_lines(self.block_q * ld) for slot, ld in self.dense_rows().items()}
        return self.staged_floats() | dense

    def buffer_offsets(self) -> dict[str, int]:
        """Where each of :meth:`buffer_floats` starts in a thread's scratch (floats; with symbolic
        lengths, from the end of the strips and copies, which each call places)."""
        buffers = self.buffer_floats()
        offset = self._strips_bytes(None) // 4 if buffers and self.is_static else 0
        offsets = {}
        for slot, floats in buffers.items():
            offsets[slot] = offset
            offset += floats
        return offsets

    def staged_floats(self) -> dict[str, int]:
        """Per output a streaming kernel stages, its floats in the thread's scratch: a strip of
        ``out`` (forward) or of dQ, and dK and dV whole when they fit (:data:`STAGE_KV_MAX_FLOATS`)."""
        if not self.stream:
            return {}
        dims = self.dims
        if self.grads is None:
            return {"out": whole_lines(self.block_q * dims.value_dim)}
        staged = {}
        if self.grads & Wrt.QUERY:
            staged["dq"] = whole_lines(self.block_q * dims.head_dim)
        widths = self.kv_grad_widths()
        total = sum(widths.values())
        if not isinstance(dims.seq_k, int):  # room for the Sk of any call that stages (stages_kv)
            staged |= {slot: whole_lines(STAGE_KV_MAX_FLOATS * w // total) for slot, w in widths.items() if w}
        elif 0 < dims.seq_k * total <= STAGE_KV_MAX_FLOATS:
            staged |= {slot: whole_lines(dims.seq_k * w) for slot, w in widths.items() if w}
        return staged

    def kv_grad_widths(self) -> dict[str, int]:
        """Floats a key row of dK and of dV takes, 0 for one the node does not compute."""
        grads = self.grads or Wrt(0)
        return {
            "dk": self.dims.head_dim if grads & Wrt.KEY else 0,
            "dv": self.dims.value_dim if grads & Wrt.VALUE else 0,
        }

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.dims.head_dim)

    def row_stride(self, slot: str) -> int:
        """Elements between consecutive rows of one head of ``slot``: the BLAS leading dimension."""
        return view_row_stride(self.layout, self.dims, self.strides, slot)

    @property
    def strided_rows(self) -> bool:
        """Whether some operand's rows lie farther apart than their width (:func:`rows_strided`)."""
        return rows_strided(self.layout, self.dims, self.strides, self.grads is not None)

    @property
    def needs_dp(self) -> bool:
        return self.grads is not None and bool(self.grads & (Wrt.QUERY | Wrt.KEY))

    @property
    def work_items(self) -> SizeLike:
        """Forward: one item per (batch, head); backward: per (batch, kv head), its group inside.
        A symbolic batch makes it a size of the call (the item code never needs the batch)."""
        return size_of(self.dims.batch) * (self.dims.heads if self.grads is None else self.dims.kv_heads)

    def strip_floats(self, seq_k: int | None = None, seq_q: int | None = None) -> int:
        """Floats in one scores strip, rounded up to keep every scratch buffer 64-byte aligned
        (``seq_k``, ``seq_q``: a call's lengths, for a spec whose lengths are symbolic: then the
        most that any call of up to those lengths takes, whose strip height the call decides)."""
        length = self.dims.seq_k if seq_k is None else seq_k
        assert isinstance(length, int), "give the call's Sk"
        if self.heights is not None and not self.is_static:
            # rows · Sk is at most most_floats, and a row's stride (strip_ld) at most 31 floats more
            most = self.heights.most_floats(length) + (STRIP_LD_SLACK * self.heights.most_rows())
            return whole_lines(most if seq_q is None else min(most, max(seq_q, 1) * strip_ld(length)))
        return whole_lines(self.block_q * strip_ld(length))

    def scratch_bytes(self, seq_k: int | None = None, seq_q: int | None = None) -> int:
        """Per-thread scratch: the P strip, plus the dP/dS strip when dQ or dK are wanted; the
        forward keeps one reciprocal row sum per strip row instead. A profiling build keeps its
        counters (:mod:`rlx.codegen.kernel_clock`) in the last 64 bytes of the thread's scratch."""
        buffers = 4 * sum(self.buffer_floats().values())
        if self.profile and self.is_static:
            return self._strips_bytes(seq_k) + buffers + COUNTERS_BYTES
        return self._strips_bytes(seq_k, seq_q) + buffers

    def panel_widths(self) -> dict[str, int]:
        """The head operands this kernel packs in column panels (:func:`panel_operands`)."""
        return panel_operands(self.grads, self.dims)

    @property
    def strip_layout(self) -> tuple[int, int]:
        """``(strips, floats after them)`` at the start of a thread's scratch: the P strip and the
        dP/dS strip (backward, dQ or dK wanted), or the P strip and its rows' reciprocal sums
        (forward). The transposed copies follow (:func:`transposed_buffers`)."""
        if self.grads is None:
            return 1, whole_lines(self.block_q)
        return (2 if self.needs_dp else 1), 0

    def _strips_bytes(self, seq_k: int | None, seq_q: int | None = None) -> int:
        return strips_and_copies_bytes(self, seq_k, seq_q)


def whole_lines(floats: int) -> int:
    """``floats`` rounded up to whole 64-byte lines: every scratch buffer starts on a line."""
    per_line = SCRATCH_ALIGN // 4
    return -(-floats // per_line) * per_line


def emit_whole_lines(b: ir.IRBuilder, floats: ir.Value, name: str) -> ir.Value:
    """:func:`whole_lines` of a count known per call."""
    per_line = SCRATCH_ALIGN // 4
    return b.mul(ceil_div(b, floats, per_line), i64(per_line), name=name)


def packed_ld(seq_k: int) -> int:
    """The leading dimension of a transposed copy of K or V (``width`` rows of ``Sk``): whole
    64-byte lines, and an odd number of them. Rows a power of two of lines apart (Sk = 512,
    1024) fall into the same few sets of L1, so the 64 rows of a product's column panel evicted
    each other; an odd stride spreads them over every set (128 x 512 x 64 on the register
    tiles: 156 GFLOP/s at ld 512, 175 at 528)."""
    return (-(-seq_k // 16) | 1) * 16


def emit_packed_ld(b: ir.IRBuilder, seq_k: ir.Value) -> ir.Value:
    """:func:`packed_ld` of a length known per call."""
    return b.mul(b.or_(ceil_div(b, seq_k, 16), i64(1)), i64(16), name="packed.ld")


def may_pack(seq_q: int | str) -> bool:
    """Whether calls may copy K (and V) transposed: a static query length of at least
    :data:`PACK_MIN_ROWS`, or a symbolic one (each call decides)."""
    return not isinstance(seq_q, int) or seq_q >= PACK_MIN_ROWS


class HeadDims(Protocol):
    @property
    def heads(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def seq_q(self) -> Dim: ...
    @property
    def seq_k(self) -> Dim: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def value_dim(self) -> int: ...


class StripScratch(Protocol):
    """What both attention kernels' specs say about the start of a thread's scratch."""

    @property
    def dims(self) -> HeadDims: ...
    @property
    def needs_dp(self) -> bool: ...
    @property
    def strip_layout(self) -> tuple[int, int]: ...
    def strip_floats(self, seq_k: int | None = None, seq_q: int | None = None) -> int: ...
    def panel_widths(self) -> dict[str, int]: ...


def _copied(spec: StripScratch) -> dict[str, int]:
    """The head operands a kernel copies transposed, with their row widths: K (the scores'
    product), and V where the backward forms dP = dY V^T."""
    dims = spec.dims
    return {"k": dims.head_dim, "v": dims.value_dim} if spec.needs_dp else {"k": dims.head_dim}


def strips_and_copies_bytes(spec: StripScratch, seq_k: int | None = None, seq_q: int | None = None) -> int:
    """Bytes of a thread's scratch: the strips and what follows them (``spec.strip_layout``),
    then the transposed copies of K (and V) where calls may make them (``seq_k``, ``seq_q``: a
    call's lengths, for symbolic ones)."""
    length = spec.dims.seq_k if seq_k is None else seq_k
    assert isinstance(length, int), "give the call's Sk"
    strips, tail = spec.strip_layout
    widths = [*_copied(spec).values(), *map(panel_width, spec.panel_widths().values())]
    copies = sum(width * packed_ld(length) for width in widths) if may_pack(spec.dims.seq_q) else 0
    return (spec.strip_floats(length, seq_q) * strips + tail + copies) * 4


def transposed_buffers(
    b: ir.IRBuilder, spec: StripScratch, scratch: ir.Value, strip_floats: ir.Value, seq_q: ir.Value, seq_k: ir.Value
) -> dict[str, ir.Value]:
    """Per copied operand (``"k"``, ``"v"``), its buffer in the thread's scratch after the strips
    (``width x Sk``, leading dimension :func:`packed_ld`): null where this call does not pack (fewer than
    :data:`PACK_MIN_ROWS` query rows: a decode step reads K in place), a constant null where no
    call of the kernel can. Then the operands packed in the tiles' column panels
    (``spec.panel_widths()``, keys ``"v.panels"``, ``"k.panels"``: :func:`emit_panel_copy`), each
    ``panel_width(width)`` x ``packed_ld(Sk)`` floats."""
    null = ir.Constant(PTR, None)
    copied = _copied(spec) | {f"{slot}.panels": panel_width(width) for slot, width in spec.panel_widths().items()}
    if not may_pack(spec.dims.seq_q):
        return dict.fromkeys(copied, null)
    strips, tail = spec.strip_layout
    offset = b.add(b.mul(strip_floats, i64(strips)), i64(tail), name="strips.floats")
    pack = b.icmp_signed(">=", seq_q, i64(PACK_MIN_ROWS), name="pack")
    buffers = {}
    for slot, width in copied.items():
        buffers[slot] = b.select(pack, gep_f32(b, scratch, offset, name=f"{slot}t"), null, name=f"{slot}t.or.null")
        offset = b.add(offset, b.mul(emit_packed_ld(b, seq_k), i64(width)), name="copies.end")
    return buffers


def panel_operands(grads: Wrt | None, dims: HeadDims) -> dict[str, int]:
    """The head operands an attention kernel packs in the tiles' column panels, once per head
    (:func:`emit_panel_copy`), with their row widths: V for the forward's ``P V`` and K for
    the backward's ``dQ = dS K``, where the CPU has the tiles (:data:`PANELS`)."""
    if not PANELS or host_tile_shape() is None:
        return {}
    if grads is None:
        return {"v": dims.value_dim}
    return {"k": dims.head_dim} if grads & Wrt.QUERY else {}


def panel_width(width: int) -> int:
    """Floats a row of ``width`` takes packed in the tiles' column panels (whole panels)."""
    shape = host_tile_shape()
    assert shape is not None, "panels are packed for the register tiles"
    return -(-width // shape.columns) * shape.columns


@dataclass(frozen=True)
class PackedPanels:
    """A head operand packed in the tiles' column panels (``base``, null where this call did not
    pack it), panel p + 1 ``stride`` floats after panel p (``tile_gemm.PRODUCT_ARGS``)."""

    base: ir.Value
    stride: ir.Value

    def rows_from(self, b: ir.IRBuilder, row: ir.Value) -> PackedPanels:
        """The same panels from row ``row`` on; null stays null (an offset from null is not)."""
        shape = host_tile_shape()
        assert shape is not None
        moved = gep_f32(b, self.base, b.mul(row, i64(shape.columns)), name="panels.from")
        null = ir.Constant(PTR, None)
        return PackedPanels(b.select(b.icmp_unsigned("==", self.base, null), null, moved), self.stride)


def emit_panel_copy(
    b: ir.IRBuilder, head: ir.Value, ld: int, seq_k: ir.Value, width: int, target: ir.Value
) -> PackedPanels:
    """Pack a head operand (``Sk`` rows of ``width``, ``ld`` apart) in the tiles' column panels
    into ``target`` where it is not null (nothing at all for a constant null): once per head,
    where the products of every strip would copy the panels of the rows they read again.

    In BSHD a head's rows are H·D floats apart, which the products read through a copied
    panel, and the forward's ``P V`` had its driver spend 6% of a causal S1024 forward copying
    V's panels, strip after strip (AMD EPYC, Zen 3)."""
    shape = host_tile_shape()
    assert shape is not None, "panels are packed for the register tiles"
    stride = b.mul(emit_packed_ld(b, seq_k), i64(shape.columns), name="panels.stride")
    packed = PackedPanels(target, stride)
    if isinstance(target, ir.Constant) and target.constant is None:
        return packed
    with b.if_then(b.icmp_unsigned("!=", target, ir.Constant(PTR, None))):
        b.call(_pack_panels_function(b.module), [head, i64(ld), seq_k, i64(width), target, stride])
    return packed


def _pack_panels_function(module: ir.Module) -> ir.Function:
    """``rlx_pack_panels(src, ld, rows, width, dst, stride)`` (:func:`emit_panel_copy`): row r of
    ``src`` goes to row r of every panel, zeros past the last column. One function per module."""
    existing = module.globals.get("rlx_pack_panels")
    if existing is not None:
        return existing  # type: ignore[return-value]
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, I64, I64, PTR, I64]), name="rlx_pack_panels")
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    src, ld, rows, width, dst, stride = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    shape = host_tile_shape()
    assert shape is not None
    columns = shape.columns
    vec = Lanes(module, WIDTH)
    whole = b.and_(width, i64(-WIDTH), name="whole")
    with for_range(b, 0, rows, "pack.row") as r:
        row = gep_f32(b, src, b.mul(r, ld))
        target = gep_f32(b, dst, b.mul(r, i64(columns)))  # row r of panel 0

        def at(column: ir.Value) -> ir.Value:  # where column c of row r goes
            panel, lane = b.sdiv(column, i64(columns)), b.srem(column, i64(columns))
            return gep_f32(b, target, b.add(b.mul(panel, stride), lane))

        with for_range(b, 0, whole, "pack.vector", WIDTH) as c:
            b.store(vec.load(b, row, c), at(c), align=4)
        with for_range(b, whole, width, "pack.tail") as c:
            b.store(b.load(gep_f32(b, row, c), typ=F32), at(c))
        with for_range(b, width, b.mul(ceil_div(b, width, columns), i64(columns)), "pack.zeros") as c:
            b.store(f32(0.0), at(c))
    b.ret_void()
    return fn


def emit_transposed_copy(
    b: ir.IRBuilder, head: ir.Value, ld: int, seq_k: ir.Value, width: int, target: ir.Value
) -> None:
    """Copy a head operand (``Sk`` rows of ``width``, ``ld`` apart) transposed into ``target``
    where it is not null, by OpenBLAS's ``somatcopy`` (nothing at all for a constant null)."""
    if isinstance(target, ir.Constant) and target.constant is None:
        return
    omatcopy = declare(b.module, OMATCOPY, VOID, [I32, I32, I32, I32, F32, PTR, I32, PTR, I32])
    sk = b.trunc(seq_k, I32)
    with b.if_then(b.icmp_unsigned("!=", target, ir.Constant(PTR, None))):
        ld_target = b.trunc(emit_packed_ld(b, seq_k), I32)
        b.call(omatcopy, [i32(ROW_MAJOR), i32(TRANS), sk, i32(width), f32(1.0), head, i32(ld), target, ld_target])


def emit_head_copies(
    b: ir.IRBuilder,
    clock: KernelClock,
    packed: dict[str, ir.Value],
    head: Callable[[str], ir.Value],
    geometry: Callable[[str], tuple[int, int]],
    seq_k: ir.Value,
) -> dict[str, PackedPanels]:
    """An item's copies of its head operands into the buffers of :func:`transposed_buffers`:
    K (and V) transposed, and those keyed ``"<slot>.panels"`` packed in column panels; returns
    the panels by slot. ``head(slot)``: the operand's row 0; ``geometry(slot)``: its leading
    dimension and row width. Timed as ``blas`` in a profiling build. Both kinds of attention
    kernel copy this way."""
    panels = {}
    for name, target in packed.items():
        slot = name.removesuffix(".panels")
        (ld, width), source = geometry(slot), head(slot)
        started = clock.start(b)
        if name.endswith(".panels"):
            panels[slot] = emit_panel_copy(b, source, ld, seq_k, width, target)
        else:
            emit_transposed_copy(b, source, ld, seq_k, width, target)
        clock.count(b, "blas", started)
    return panels


def panels_from(b: ir.IRBuilder, panels: dict[str, PackedPanels], slot: str, row: ir.Value) -> PackedPanels | None:
    """``slot``'s packed panels (:func:`emit_head_copies`) from row ``row`` on, if it was packed."""
    return panels[slot].rows_from(b, row) if slot in panels else None


def keys_operand(
    b: ir.IRBuilder, head: ir.Value, ld_head: int, packed: ir.Value, c0: ir.Value, seq_k: ir.Value
) -> tuple[ir.Value, ir.Value, ir.Value]:
    """``(operand, ld, trans_b)`` for ``A X[c0:]^T``, X a head operand (K or V): its transposed
    copy from column ``c0`` as an NN product where the call packed one (``packed`` not null;
    leading dimension :func:`packed_ld`), else X's rows from ``c0`` in place as an NT product."""
    is_packed = b.icmp_unsigned("!=", packed, ir.Constant(PTR, None), name="is.packed")
    columns = gep_f32(b, packed, c0, name="packed.from")
    rows = gep_f32(b, head, b.mul(c0, i64(ld_head)), name="head.from")
    operand = b.select(is_packed, columns, rows, name="keys.operand")
    ld = b.select(is_packed, emit_packed_ld(b, seq_k), i64(ld_head), name="keys.ld")
    return operand, ld, b.select(is_packed, i32(NO_TRANS), i32(TRANS), name="keys.trans")


STRIP_LD_SLACK = 31  # strip_ld(n) - n is at most this


def strip_ld(keys: int) -> int:
    """The row stride of a fixed-mask kernel's score strips (P, dP/dS) over ``keys`` keys: rows of
    an odd number of 64-byte lines (:func:`packed_ld`). At ``keys`` floats, rows a power of two
    of lines apart (every strip of 512 or 1024 keys, causal strips whose keys are a multiple of
    256) fell into a few sets of L1 and, a page or more apart, of L2: the transposed products
    that read the strips down their columns (``dV += P^T dY``, ``dK += dS^T Q``) fetched every
    line again for each tile. One core, native loops: 1024 x 64 x 256 at 70-72 GFLOP/s with
    rows 1024 floats apart, 77-79 at 1040; 4096 x 64 x 256 71 -> 81; 16384 x 64 x 256 (a long
    causal strip) 31-34 -> 61-74."""
    return packed_ld(keys)


def emit_strip_ld(b: ir.IRBuilder, keys: ir.Value) -> ir.Value:
    """:func:`strip_ld` of a count known per call (a strip's visible keys)."""
    return emit_packed_ld(b, keys)


def emit_strip_floats(b: ir.IRBuilder, block_q: int | ir.Value, seq_k: ir.Value) -> ir.Value:
    """Floats in one scores strip of ``block_q`` rows and ``seq_k`` keys known per call, rounded
    up to whole cache lines as the specs' ``strip_floats`` round them."""
    return emit_whole_lines(b, b.mul(seq_k, as_i64(block_q)), "strip.floats")


SizeT: TypeAlias = int | ir.Value  # a size known now, or one of the call


class AttentionLowering:
    """Emits the per-head function for one attention node; see the module docstring."""

    def __init__(self, module: ir.Module, spec: AttentionKernelSpec, name: str) -> None:
        self.module = module
        self.spec = spec
        self.name = name
        self.memset = intrinsic(module, "llvm.memset.p0.i64", VOID, [PTR, I8, I64, I1])
        self.memcpy = intrinsic(module, "llvm.memcpy.p0.p0.i64", VOID, [PTR, PTR, I64, I1])
        self.sgemm = declare_sgemm(module)
        self.neg = f32(spec.neg)
        self.clock = KernelClock(module, spec.profile and spec.is_static, spec.counters_at)
        self.staged: dict[str, ir.Value] = {}  # output -> its staging buffer (a streaming kernel)
        self.dense: dict[str, ir.Value] = {}  # q, dy -> the buffer a strip's rows are copied to
        self.banded = bands_strips(spec.mask)

    # ------------------------------------------------------------------ public

    def operand_slots(self) -> list[str]:
        """Names of the pointers in ``args``, in order: operands, results, then (with symbolic
        sequence lengths) the call's sizes table."""
        slots = ["q", "k", "v"]
        if self.spec.grads is not None:
            slots.append("dy")
        if self.spec.mask.needs_tensor:
            slots.append("mask")
        if self.spec.grads is None:
            slots.append("out")
        else:
            slots += [f"d{flag!s}" for flag in self.spec.grads.members]
        if not self.spec.is_static:
            slots.append("sizes")
        return slots

    def _load_seq(self, b: ir.IRBuilder, sizes: ir.Value | None) -> None:
        """``self.sq`` / ``self.sk``: the sequence lengths, constants or read from the sizes table."""
        symbols = load_symbols(b, sizes, self.spec.symbols) if sizes is not None else {}
        self.sq = emit_size(b, self.spec.dims.seq_q, symbols)
        self.sk = emit_size(b, self.spec.dims.seq_k, symbols)
        self._decide_streaming(b, symbols)
        heights = self.spec.heights
        if heights is not None and not self.spec.is_static:  # this call's strip height
            self.block_q: ir.Value = heights.emit_rows(b, self.sq, self.sk)
        else:
            self.block_q = i64(self.spec.block_q)

    def _decide_streaming(self, b: ir.IRBuilder, symbols: dict[str, ir.Value]) -> None:
        """``self.per_call``: whether this kernel decides per call to stream its outputs (symbolic
        lengths), and then ``self.streaming`` (this call's operands and outputs exceed the L2
        caches) and ``self.stages_kv`` (it also stages dK and dV whole: they fit)."""
        spec = self.spec
        self.per_call = spec.stream and not spec.is_static
        if not self.per_call:
            return
        total: ir.Value = i64(0)
        for shape, itemsize in spec.stream_when:
            count: ir.Value = i64(itemsize)
            for dim in shape:
                count = b.mul(count, emit_size(b, dim, symbols))
            total = b.add(total, count)
        self.streaming = b.icmp_signed(">", total, i64(spec.stream_above), name="streaming")
        widths = sum(spec.kv_grad_widths().values())
        fits = b.icmp_signed("<=", b.mul(self.sk, i64(widths)), i64(STAGE_KV_MAX_FLOATS))
        self.stages_kv = b.and_(self.streaming, fits, name="stages.kv")

    def _strip_floats(self, b: ir.IRBuilder) -> ir.Value:
        """Floats in one strip for this call: :meth:`AttentionKernelSpec.strip_floats`, or with
        symbolic lengths those of this call's strip height (at most what the scratch holds)."""
        if self.spec.is_static:
            return i64(self.spec.strip_floats())
        return emit_whole_lines(b, b.mul(emit_strip_ld(b, self.sk), as_i64(self.block_q)), "strip.floats")

    def emit(self) -> ir.Function:
        spec, dims = self.spec, self.spec.dims
        fn = ir.Function(self.module, ir.FunctionType(VOID, [PTR, I64, PTR]), name=self.name)
        fn.linkage = "internal"
        args, item, scratch = fn.args
        args.name, item.name, scratch.name = "args", "item", "scratch"
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        base = {
            slot: b.load(gep(b, args, [i64(i)], PTR), typ=PTR, name=f"{slot}.base")
            for i, slot in enumerate(self.operand_slots())
        }
        self._load_seq(b, base.pop("sizes", None))
        self.clock.point_at(b, scratch)
        started = self.clock.start(b)
        strip_s = scratch
        strip_dp = gep_f32(b, scratch, self._strip_floats(b), name="dp.strip") if spec.needs_dp else None
        packed = transposed_buffers(b, spec, scratch, self._strip_floats(b), self.sq, self.sk)
        if spec.grads is None:  # item = (batch, query head)
            batch = b.sdiv(item, i64(dims.heads), name="b")
            head = b.srem(item, i64(dims.heads), name="h")
            group = b.sdiv(head, i64(dims.group), name="g")
            heads = self._head_pointers(b, base, batch, head, group)
            self.heads_finite = self._heads_finite(b, heads, ("v",))
            self._pack(b, heads, packed)
            self._buffers(b, scratch)
            self._strips(b, heads, packed, base, batch, head, strip_s, strip_dp)
            self._stream_out(b, heads)
        else:  # item = (batch, kv head): its query heads in order, so dK/dV of a group sum without races
            batch = b.sdiv(item, i64(dims.kv_heads), name="b")
            group = b.srem(item, i64(dims.kv_heads), name="g")
            kv_heads = self._head_pointers(b, base, batch, group, group)
            self.heads_finite = self._heads_finite(b, kv_heads, ("k", "v"))
            self._pack(b, kv_heads, packed)  # K, V of kv head g
            self._buffers(b, scratch)
            with for_range(b, 0, dims.group, "member") as member:
                head = b.add(b.mul(group, i64(dims.group)), member, name="h")
                heads = self._head_pointers(b, base, batch, head, group)
                for slot in ("dk", "dv"):
                    if slot in self.staged:
                        staged = self.staged[slot]
                        heads[slot] = b.select(self.stages_kv, staged, heads[slot]) if self.per_call else staged
                first = b.icmp_signed("==", member, i64(0), name="first.member")
                self._strips(b, heads, packed, base, batch, head, strip_s, strip_dp, first)
            self._stream_out(b, kv_heads)
        self.clock.count(b, "kernel", started)
        b.ret_void()
        return fn

    # ------------------------------------------------------------------ streaming outputs

    def _buffers(self, b: ir.IRBuilder, scratch: ir.Value) -> None:
        """Point :attr:`staged` and :attr:`dense` at the buffers of
        :meth:`AttentionKernelSpec.buffer_floats` in this thread's scratch."""
        base = scratch if self.spec.is_static else gep_f32(b, scratch, self._strips_and_copies_floats(b))
        buffers = {slot: gep_f32(b, base, i64(offset)) for slot, offset in self.spec.buffer_offsets().items()}
        self.staged = {slot: ptr for slot, ptr in buffers.items() if not slot.endswith(".rows")}
        self.dense = {slot.removesuffix(".rows"): ptr for slot, ptr in buffers.items() if slot.endswith(".rows")}

    def _strips_and_copies_floats(self, b: ir.IRBuilder) -> ir.Value:
        """Floats of a thread's scratch before the buffers, for this call's lengths
        (``strips_and_copies_bytes``, which sized it, in native code)."""
        strips, tail = self.spec.strip_layout
        floats = b.add(b.mul(self._strip_floats(b), i64(strips)), i64(tail))
        if may_pack(self.spec.dims.seq_q):
            for width in [*_copied(self.spec).values(), *map(panel_width, self.spec.panel_widths().values())]:
                floats = b.add(floats, b.mul(emit_packed_ld(b, self.sk), i64(width)))
        return floats

    def _out_ld(self, b: ir.IRBuilder, slot: str) -> int | ir.Value:
        """Elements between rows of an output where the kernel writes it: staged rows are dense
        (with symbolic lengths, dK and dV where this call stages them)."""
        if slot not in self.staged:
            return self._ld(slot)
        width = self._geometry(slot)[2]
        if self.per_call:
            return b.select(self.stages_kv, i64(width), i64(self._ld(slot)), name=f"{slot}.ld")
        return width

    def _stream_out(self, b: ir.IRBuilder, kv_heads: dict[str, ir.Value]) -> None:
        """Copy the item's staged dK and dV to their heads (``out`` and dQ went out strip by
        strip), then fence the streamed stores.

        Why stage: a kernel whose operands and outputs exceed the L2 caches writes lines that
        are not in cache, and every ordinary store to such a line first reads it from memory (a
        read for ownership), strided in BSHD heads. The products write into dense buffers in the thread's
        scratch instead, and each row goes out in whole 64-byte lines with non-temporal stores,
        which need no read. B32 H12 S128 D64 BSHD backward on one thread: 121 -> 93 us a head
        (cache-resident B1: 75 either way); copying the staged rows with ordinary stores: 114.
        """
        for slot in ("dk", "dv"):
            if slot in self.staged:
                _, _, width = self._geometry(slot)
                with b.if_then(self.stages_kv) if self.per_call else contextlib.nullcontext():
                    stream_rows(b, self.staged[slot], width, kv_heads[slot], self._ld(slot), self.sk, width)
        if self.staged:  # the streamed stores are weakly ordered: done before the next kernel reads
            with b.if_then(self.streaming) if self.per_call else contextlib.nullcontext():
                b.call(intrinsic(self.module, "llvm.x86.sse.sfence", VOID, []), [])

    # ------------------------------------------------------------------ packing

    def _pack(self, b: ir.IRBuilder, heads: dict[str, ir.Value], packed: dict[str, ir.Value]) -> None:
        """Copy the head's K (and V) transposed into ``packed`` (where not null), and pack those
        of :meth:`AttentionKernelSpec.panel_widths` in column panels (:attr:`panels`)."""
        self.panels = emit_head_copies(
            b, self.clock, packed, heads.__getitem__, lambda slot: (self._ld(slot), self._geometry(slot)[2]), self.sk
        )

    def _head_pointers(
        self, b: ir.IRBuilder, base: dict[str, ir.Value], batch: ir.Value, head: ir.Value, group: ir.Value
    ) -> dict[str, ir.Value]:
        """Row 0 of every operand's head: query-side tensors at ``head``, key-side ones at ``group``."""
        heads = {}
        for slot, ptr in base.items():
            if slot != "mask":
                owner = head if self._geometry(slot)[1] == self.spec.dims.heads else group
                heads[slot] = gep_f32(b, ptr, self._head_offset(b, batch, owner, slot), name=f"{slot}.head")
        return heads

    def _strips(
        self,
        b: ir.IRBuilder,
        heads: dict[str, ir.Value],
        packed: dict[str, ir.Value],
        base: dict[str, ir.Value],
        batch: ir.Value,
        head: ir.Value,
        strip_s: ir.Value,
        strip_dp: ir.Value | None,
        first_member: ir.Value | None = None,
    ) -> None:
        """The query strips of one head; ``first_member`` (backward): this head is the first of its
        kv group, whose first strip writes dK/dV instead of adding to them.

        A causal-like backward takes its strips last first: the last strip of a causal mask sees
        every key, so its products store (beta = 0) every row of dK and dV and nothing is zeroed,
        where the first strip, taken first, zeroed the rows past its keys (all but ``block_q`` of
        them, strided rows a cache miss each) for the later strips to read back. A sliding
        window's strips see as many keys either way. The order is fixed, so results do not
        depend on the thread count.
        """
        spec = self.spec
        mask_base = self._mask_base(b, base.get("mask"), batch, head)
        block_q = self.block_q
        n_strips = b.sdiv(b.add(self.sq, b.sub(block_q, i64(1))), block_q, name="strips")
        last_first = spec.grads is not None and spec.mask.is_causal_like
        with for_range(b, 0, n_strips, "step") as step:
            strip = b.sub(b.sub(n_strips, i64(1)), step, name="strip") if last_first else step
            i0 = b.mul(strip, block_q, name="i0")
            rows = smin(b, block_q, b.sub(self.sq, i0), name="rows")
            forward = spec.grads is None
            # The forward leaves rows as exp(s - m) and scales out rows by 1/sum after P·V (Dv
            # floats a row instead of nk); the backward needs P itself.
            inverse = gep_f32(b, strip_s, self._strip_floats(b), name="inv.sums") if forward else ir.Constant(PTR, None)
            strips: dict[str, tuple[ir.Value, int]] = {
                slot: self._strip_rows(b, heads, slot, i0, rows) for slot in ("q", "dy") if slot in heads
            }
            q_strip, ldq = strips["q"]
            keys = b.call(
                self._softmax_function(),
                [q_strip, i64(ldq), heads["k"], packed["k"], mask_base, strip_s, i0, rows, inverse, self.sq, self.sk],
                name="keys",
            )
            ks, nk = b.extract_value(keys, 0, name="ks"), b.extract_value(keys, 1, name="nk")
            ldp = emit_strip_ld(b, nk)  # the strips' row stride, as the softmax function laid them out
            band = self._strip_band(b, strips, rows, b.extract_value(keys, 2, name="weighty"), i0, ks)
            if forward:
                self._forward_gemm(b, heads, i0, rows, ks, nk, ldp, strip_s, inverse, band)
            else:
                assert first_member is not None
                first = b.and_(first_member, b.icmp_signed("==", step, i64(0)), name="first.write")
                self._backward_gemms(
                    b, heads, strips, packed, i0, rows, ks, nk, ldp, strip_s, strip_dp, mask_base, first, band
                )

    # ------------------------------------------------------------------ bands

    def _heads_finite(self, b: ir.IRBuilder, heads: dict[str, ir.Value], slots: tuple[str, ...]) -> ir.Value:
        """Whether the item's heads of ``slots`` hold only finite numbers (false where the kernel
        does not band its products: see :data:`BANDS`)."""
        if not self.banded:
            return ir.Constant(I1, 0)
        return heads_finite(b, self.sq, [(heads[s], self.sk, self._ld(s), self._geometry(s)[2]) for s in slots])

    def _strip_band(
        self,
        b: ir.IRBuilder,
        strips: dict[str, tuple[ir.Value, int]],
        rows: ir.Value,
        weighty: ir.Value,
        i0: ir.Value,
        ks: ir.Value,
    ) -> StripBand:
        """Whether this strip's products after the softmax may skip the terms above its diagonal
        (:data:`BANDS`): the heads and the strip's rows of Q and dY are finite and no row's
        hidden keys weigh."""
        if not self.banded:
            return StripBand(ir.Constant(I1, 0), i64(0))
        flag = alloca_entry(b, I1, "strip.exact")
        b.store(ir.Constant(I1, 0), flag)
        with b.if_then(b.and_(self.heads_finite, b.not_(weighty)), likely=True):
            finite = ir.Constant(I1, 1)
            if self.spec.grads is not None:
                for slot, (strip, ld) in strips.items():
                    finite = b.and_(finite, finite_rows(b, strip, rows, ld, self._geometry(slot)[2]))
            b.store(finite, flag)
        return StripBand(b.load(flag, typ=I1, name="strip.exact"), self._strip_diagonal(b, i0, ks))

    def _strip_rows(
        self, b: ir.IRBuilder, heads: dict[str, ir.Value], slot: str, i0: ir.Value, rows: ir.Value
    ) -> tuple[ir.Value, int]:
        """A strip's rows of q or dy and their leading dimension: in place, or copied dense
        (:meth:`AttentionKernelSpec.dense_rows`)."""
        ld = self._ld(slot)
        in_place = gep_f32(b, heads[slot], b.mul(i0, i64(ld)), name=f"{slot}.strip")
        dense = self.dense.get(slot)
        if dense is None:
            return in_place, ld
        dense_ld, width = self.spec.dense_rows()[slot], self._geometry(slot)[2]
        with for_range(b, 0, rows, f"{slot}.dense") as row:
            source = gep_f32(b, in_place, b.mul(row, i64(ld)))
            b.call(
                self.memcpy, [gep_f32(b, dense, b.mul(row, i64(dense_ld))), source, i64(4 * width), ir.Constant(I1, 0)]
            )
        return dense, dense_ld

    # ------------------------------------------------------------------ addressing

    def _geometry(self, slot: str) -> tuple[ir.Value, int, int]:
        """``(rows per head, heads, row width)`` of an operand: q-side, k-side or v-side."""
        heads, width = slot_heads_and_width(self.spec.dims, slot)
        return (self.sk if slot in KEY_SIDE else self.sq), heads, width

    def _ld(self, slot: str) -> int:
        """Elements between consecutive rows of one head: the BLAS leading dimension."""
        return self.spec.row_stride(slot)

    def _head_offset(self, b: ir.IRBuilder, batch: ir.Value, head: ir.Value, slot: str) -> ir.Value:
        """Element offset of row 0 of head (batch, head) of operand ``slot``."""
        seq = self._geometry(slot)[0]
        return emit_view_head_offset(b, self.spec.layout, self.spec.dims, self.spec.strides, slot, batch, head, seq)

    def _mask_base(self, b: ir.IRBuilder, mask: ir.Value | None, batch: ir.Value, head: ir.Value) -> ir.Value:
        """Key-padding row ``mask[b, :]`` (custom), bias plane ``bias[b, h, :, :]`` (bias), else null."""
        dims = self.spec.dims
        if mask is None:
            return ir.Constant(PTR, None)
        if self.spec.mask == MaskKind.CUSTOM:
            return gep_f32(b, mask, b.mul(batch, self.sk), name="pad.row")
        plane = b.add(b.mul(batch, i64(dims.heads)), head)
        return gep_f32(b, mask, b.mul(plane, b.mul(self.sq, self.sk)), name="bias.plane")

    def _zero_rows(self, b: ir.IRBuilder, head: ir.Value, rows: ir.Value, slot: str) -> None:
        """Zero ``rows`` rows of a head from ``head`` on (rows no strip's keys reach get no write)."""
        zero_rows(b, self.memset, head, rows, self._out_ld(b, slot), self._geometry(slot)[2])

    # ------------------------------------------------------------------ masks

    def _strip_keys(self, b: ir.IRBuilder, i0: ir.Value, rows: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Keys ``[ks, ks + nk)`` that any row of the strip can see (all keys if none can)."""
        mask = self.spec.mask
        if not mask.is_causal_like:
            return i64(0), self.sk
        offset = self._diagonal_offset(b)
        end = smin(b, b.add(i0, b.add(rows, offset)), self.sk, name="ke")
        if mask.window is None:
            start = i64(0)
        else:
            start = smax(b, b.sub(b.add(i0, offset), i64(mask.window)), i64(0), name="ks.raw")
        empty = b.icmp_signed(">=", start, end)
        start = b.select(empty, i64(0), start, name="ks")
        end = b.select(empty, self.sk, end, name="ke.full")
        return start, b.sub(end, start, name="nk")

    def _row_keys(self, b: ir.IRBuilder, gi: ir.Value, ks: ir.Value, nk: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Causal-like masks: the columns ``[lo, hi)`` of the strip that query row ``gi`` sees."""
        mask = self.spec.mask
        diagonal = b.add(gi, self._diagonal_offset(b), name="diag")
        hi = clamp(b, b.sub(b.add(diagonal, i64(1)), ks), i64(0), nk, name="hi")
        if mask.window is None:
            return i64(0), hi
        lo = clamp(b, b.sub(b.sub(diagonal, i64(mask.window)), ks), i64(0), hi, name="lo")
        return lo, hi

    def _diagonal_offset(self, b: ir.IRBuilder) -> ir.Value:
        """``max(Sk - Sq, 0)``: causal masks align the last query with the last key."""
        return smax(b, b.sub(self.sk, self.sq), i64(0), name="diag.offset")

    def _key_padded(self, b: ir.IRBuilder, mask_base: ir.Value, gj: ir.Value, lanes: Lanes) -> ir.Value:
        """Custom mask: are keys ``gj ..`` hidden (``mask[b, gj] < threshold``)?"""
        value = lanes.load(b, mask_base, gj, name="pad")
        return b.fcmp_ordered("<", value, lanes.const(self.spec.threshold), name="padded")

    # ------------------------------------------------------------------ softmax

    def _softmax_function(self) -> ir.Function:
        """``{ks, nk} = scores_softmax(q_strip, ldq, k_head, ..., strip, i0, rows)``: GEMM 1, mask and
        softmax of one strip, returning the keys ``[ks, ks + nk)`` it used.

        Defined once per module for all nodes of the same shapes, layout and mask, so a forward
        node and its backward share one copy (less code to compile).
        """
        dims = self.spec.dims
        mask_name = str(self.spec.mask).replace("(", "").replace(")", "")
        shape = f"q{dims.seq_q}.k{dims.seq_k}.h{dims.heads}.kv{dims.kv_heads}.d{dims.head_dim}"
        strides = "".join(
            f".{given.slot}.b{given.batch}p{given.batch_per_position}h{given.head}r{given.row}"
            for given in self.spec.strides
        )
        name = f"scores_softmax.{mask_name}.{self.spec.layout}.{shape}{strides}"
        existing = self.module.globals.get(name)
        if existing is not None:
            return existing  # type: ignore[return-value]
        keys_type = ir.LiteralStructType([I64, I64, I1])
        signature = ir.FunctionType(keys_type, [PTR, I64, PTR, PTR, PTR, PTR, I64, I64, PTR, I64, I64])
        fn = ir.Function(self.module, signature, name=name)
        fn.linkage = "internal"
        q_strip, ldq, k_head, k_packed, mask_base, strip, i0, rows, inverse, sq, sk = fn.args
        names = ("q.strip", "ldq", "k.head", "k.packed", "mask.base", "strip", "i0", "rows", "inverse", "sq", "sk")
        for arg, arg_name in zip(fn.args, names, strict=True):
            arg.name = arg_name
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        caller = self.sq, self.sk, self.clock.counters
        self.sq, self.sk = sq, sk  # the lengths as this function sees them: its arguments
        self.clock.point_at(b, strip)  # the strip is the thread's scratch
        ks, nk, weighty = self._scores_and_softmax(
            b, q_strip, ldq, k_head, k_packed, mask_base, strip, i0, rows, inverse
        )
        self.sq, self.sk, self.clock.counters = caller
        keys = b.insert_value(ir.Constant(keys_type, ir.Undefined), ks, 0)
        keys = b.insert_value(keys, nk, 1)
        b.ret(b.insert_value(keys, weighty, 2))
        return fn

    def _scores_and_softmax(
        self,
        b: ir.IRBuilder,
        q_strip: ir.Value,
        ldq: ir.Value,
        k_head: ir.Value,
        k_packed: ir.Value,
        mask_base: ir.Value,
        strip: ir.Value,
        i0: ir.Value,
        rows: ir.Value,
        inverse: ir.Value | None = None,
    ) -> tuple[ir.Value, ir.Value, ir.Value]:
        """The strip's scores and softmax: its keys ``(ks, nk)``, and whether some row's hidden
        keys weigh (:meth:`_mask_softmax_rows`)."""
        spec, dims = self.spec, self.spec.dims
        ldk = self._ld("k")
        ks0, nk0 = self._strip_keys(b, i0, rows)
        before = b.block
        scores = b.append_basic_block("scores")
        retry = b.append_basic_block("scores.retry")
        after = b.append_basic_block("scores.done")
        b.branch(scores)
        b.position_at_end(scores)
        ks = b.phi(I64, name="ks")
        nk = b.phi(I64, name="nk")
        ks.add_incoming(ks0, before)
        nk.add_incoming(nk0, before)
        ks.add_incoming(i64(0), retry)
        nk.add_incoming(self.sk, retry)
        ldp = emit_strip_ld(b, nk)
        # The softmax reads no score above the diagonal (it writes the hidden ones): skip them.
        band = Band.OUT_LOWER if spec.mask.is_causal_like else Band.NONE
        self._product_with_transposed(
            b, rows, nk, dims.head_dim, spec.scale, q_strip, ldq, k_head, ldk, k_packed, ks, strip, ldp,
            band, self._strip_diagonal(b, i0, ks),
        )  # fmt: skip
        started = self.clock.start(b)
        needs_all_keys, weighty = self._mask_softmax_rows(b, strip, i0, rows, ks, nk, ldp, mask_base, inverse)
        self.clock.count(b, "softmax", started)
        partial = b.icmp_signed("<", nk, self.sk, name="partial")
        b.cbranch(b.and_(partial, needs_all_keys, name="redo"), retry, after)
        b.position_at_end(retry)
        b.branch(scores)
        b.position_at_end(after)
        return ks, nk, weighty

    def _strip_diagonal(self, b: ir.IRBuilder, i0: ir.Value, ks: ir.Value) -> ir.Value:
        """The strip's diagonal for :class:`Band`: row r of the strip sees its keys j <= r + d."""
        return b.sub(b.add(i0, self._diagonal_offset(b)), ks, name="strip.diagonal")

    def _mask_softmax_rows(
        self,
        b: ir.IRBuilder,
        strip: ir.Value,
        i0: ir.Value,
        rows: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
        ldp: ir.Value,
        mask_base: ir.Value,
        inverse: ir.Value | None,
    ) -> tuple[ir.Value, ir.Value]:
        """Mask and softmax every row of the strip (rows ``ldp`` apart) in place; returns whether
        a skipped key could matter, and whether some row's hidden keys weigh (a NaN row maximum,
        ``neg`` within reach of it, or a ``1/sum`` that is NaN or infinite: an overflowing score,
        ``inf - inf`` from finite q and k), so that P is not exactly 0 above the diagonal.

        With a non-null ``inverse`` (the forward), rows stay ``exp(s - m)`` and ``inverse[r]`` gets
        ``1/sum``; a null one (the backward, which needs P) normalises. One function serves both,
        so a forward and its backward compile one copy.
        """
        mask, neg = self.spec.mask, self.spec.neg
        flag = alloca_entry(b, I1, "needs.all.keys")
        b.store(ir.Constant(I1, 0), flag)
        weighty_rows = alloca_entry(b, I1, "weighty.rows")
        b.store(ir.Constant(I1, 0), weighty_rows)
        with for_range(b, 0, rows, "r") as r:
            gi = b.add(i0, r, name="gi")
            row = gep_f32(b, strip, b.mul(r, ldp), name="row")
            start, stop = i64(0), nk
            if mask.is_causal_like:
                lo, hi = self._row_keys(b, gi, ks, nk)
                visible_max = vector_reduce(b, lo, hi, "vis.max", "max", lambda b, j, lanes: lanes.load(b, row, j))
                hidden = b.or_(b.icmp_signed(">", lo, i64(0)), b.icmp_signed("<", hi, nk), name="has.hidden")
                m = b.select(hidden, Lanes(self.module, 1).maximum(b, visible_max, self.neg), visible_max, name="m")
                # The hidden keys' weights exp(neg - m): 0 for neg = -inf, below e^-50 of the row sum
                # unless neg is within 50 of the max (then the whole row is exponentiated, and the
                # keys the strip skipped matter too: needs_all_keys). Else they are stored as 0
                # and exp runs over the visible keys only: a strip of R rows over the keys to its
                # last row's diagonal hides about R^2/2 of its scores. A NaN max (a NaN query) takes
                # the whole row, whose hidden weights are NaN, as in the reference.
                weighty = b.fcmp_unordered("uno", m, m, name="nan.max")
                if math.isfinite(neg):
                    matters = b.fcmp_ordered(">", b.fsub(self.neg, m), f32(SKIP_MARGIN), name="hidden.matters")
                    b.store(b.or_(b.load(flag, typ=I1), matters), flag)
                    weighty = b.or_(weighty, matters, name="hidden.weighty")
                whole = b.and_(hidden, weighty, name="whole.row")
                b.store(b.or_(b.load(weighty_rows, typ=I1), weighty), weighty_rows)
                # Exp runs over whole vectors, [start, stop) around [lo, hi): the hidden scores in
                # it are -inf (weight 0), those outside it 0. Scalar tails of up to 15 exps a row
                # cost more than the hidden keys' vectors saved.
                start = b.select(whole, i64(0), b.and_(lo, i64(-WIDTH)), name="exp.start")
                stop = b.select(whole, nk, whole_vectors_end(b, start, hi, nk), name="exp.stop")
                fill = b.select(whole, self.neg, f32(-math.inf), name="hidden.fill")
                vector_fill(b, row, i64(0), start, 0.0, "zero.lo")
                vector_fill(b, row, start, lo, fill, "fill.lo")
                vector_fill(b, row, hi, stop, fill, "fill.hi")
                vector_fill(b, row, stop, nk, 0.0, "zero.hi")
            else:
                m = vector_reduce(
                    b,
                    i64(0),
                    nk,
                    "m",
                    "max",
                    lambda b, j, lanes: self._masked_score(b, row, gi, ks, j, lanes, mask_base),
                )
            inv = self._exp_normalise(b, row, (start, stop, nk), m, inverse, r)
            if mask.is_causal_like:  # a 1/sum that is not finite makes the zeros above the diagonal NaN
                b.store(b.or_(b.load(weighty_rows, typ=I1), not_finite(b, inv)), weighty_rows)
        return b.load(flag, typ=I1, name="needs.all"), b.load(weighty_rows, typ=I1, name="weighty.any")

    def _masked_score(
        self, b: ir.IRBuilder, row: ir.Value, gi: ir.Value, ks: ir.Value, j: ir.Value, lanes: Lanes, mask_base: ir.Value
    ) -> ir.Value:
        """Score ``row[j]`` after a custom or bias mask, stored back; returned for the row max."""
        mask = self.spec.mask
        score = lanes.load(b, row, j, name="s")
        gj = b.add(ks, j, name="gj")
        if mask == MaskKind.CUSTOM:
            score = b.select(
                self._key_padded(b, mask_base, gj, lanes), lanes.const(self.spec.neg), score, name="s.masked"
            )
            lanes.store(b, score, row, j)
        elif mask == MaskKind.BIAS:
            bias = lanes.load(b, mask_base, b.add(b.mul(gi, self.sk), gj), name="bias")
            score = b.fadd(score, bias, name="s.biased")
            lanes.store(b, score, row, j)
        return score

    def _exp_normalise(
        self,
        b: ir.IRBuilder,
        row: ir.Value,
        span: tuple[ir.Value, ir.Value, ir.Value],
        m: ir.Value,
        inverse: ir.Value | None,
        r: ir.Value,
    ) -> ir.Value:
        """``row[start:stop] = exp(row - m)`` for ``span = (start, stop, nk)``, then divided by its
        sum over the whole row (``row[:nk]``: zeros outside the span times a NaN ``1/sum`` are NaN,
        as in the reference), or with a non-null ``inverse`` kept and ``inverse[r] = 1/sum``; a
        row whose max is -inf (all hidden by -inf) becomes 0. Returns the row's ``1/sum`` (0 for
        that row)."""
        start, stop, nk = span
        row_inverse = alloca_entry(b, F32, "row.inverse")
        b.store(f32(0.0), row_inverse)
        deferred = (
            ir.Constant(I1, 0)
            if inverse is None
            else b.icmp_unsigned("!=", inverse, ir.Constant(PTR, None), name="deferred")
        )
        slot = gep_f32(b, inverse, r) if inverse is not None else None
        with b.if_else(b.fcmp_ordered("==", m, f32(-math.inf), name="all.hidden")) as (empty, normal):
            with empty:
                vector_fill(b, row, start, stop, 0.0, "zero.row")
                if slot is not None:
                    with b.if_then(deferred):
                        b.store(f32(0.0), slot)
            with normal:

                def exp_term(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> ir.Value:
                    e = lanes.softmax_exp(b, b.fsub(lanes.load(b, row, j), lanes.splat(b, m)), name="e")
                    lanes.store(b, e, row, j)
                    return e

                total = vector_reduce(b, start, stop, "row.sum", "add", exp_term)
                inv = b.fdiv(f32(1.0), total, name="inv.sum")
                b.store(inv, row_inverse)
                with b.if_else(deferred) as (later, now):
                    with later:
                        if slot is not None:
                            b.store(inv, slot)
                    with now:
                        scale_row(b, row, nk, inv)
        return b.load(row_inverse, typ=F32, name="row.inv")

    def _softmax_backward_rows(
        self,
        b: ir.IRBuilder,
        p: ir.Value,
        dp: ir.Value,
        i0: ir.Value,
        rows: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
        ldp: ir.Value,
        mask_base: ir.Value,
        exact: ir.Value,
    ) -> None:
        """``dS = P ∘ (dP − rowsum(P ∘ dP))`` into ``dp`` (rows ``ldp`` apart); exactly 0 where the
        mask hid the score. With a banded dP (``exact``), the row sum stops at the end of the
        vector holding the row's last visible key: its terms past it are 0 · (finite dP) and
        every vector it reads a panel of dP the product computed (panels are whole vectors)."""
        mask = self.spec.mask
        with for_range(b, 0, rows, "r.bwd") as r:
            offset = b.mul(r, ldp)
            p_row = gep_f32(b, p, offset, name="p.row")
            dp_row = gep_f32(b, dp, offset, name="dp.row")
            lo, hi = (i64(0), nk)
            dot_end = nk
            if mask.is_causal_like:
                lo, hi = self._row_keys(b, b.add(i0, r), ks, nk)
                dot_end = b.select(exact, whole_vectors_end(b, i64(0), hi, nk), nk, name="dot.end")
            dot = vector_reduce(
                b,
                i64(0),
                dot_end,
                "dot",
                "add",
                lambda b, j, lanes: b.fmul(lanes.load(b, p_row, j), lanes.load(b, dp_row, j)),
            )
            if mask.is_causal_like:
                vector_fill(b, dp_row, i64(0), lo, 0.0, "ds.lo")
                vector_fill(b, dp_row, hi, nk, 0.0, "ds.hi")

            def grad_term(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> None:
                centred = b.fsub(lanes.load(b, dp_row, j), lanes.splat(b, dot))
                ds = b.fmul(lanes.load(b, p_row, j), centred, name="ds")
                if mask == MaskKind.CUSTOM:
                    padded = self._key_padded(b, mask_base, b.add(ks, j), lanes)
                    ds = b.select(padded, lanes.const(0.0), ds, name="ds.masked")
                lanes.store(b, ds, dp_row, j)

            vector_loop(b, lo, hi, "ds", grad_term)

    # ------------------------------------------------------------------ GEMMs

    def _forward_gemm(
        self,
        b: ir.IRBuilder,
        heads: dict[str, ir.Value],
        i0: ir.Value,
        rows: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
        ldp: ir.Value,
        p: ir.Value,
        inverse: ir.Value,
        band: StripBand,
    ) -> None:
        """``out_strip = P V_vis``, then each row by its deferred ``1/sum`` (``inverse``), in place
        or, streaming, on the way from the staged strip to ``out``."""
        ldv, ldo, dv = self._ld("v"), self._ld("out"), self.spec.dims.value_dim
        v_vis = gep_f32(b, heads["v"], b.mul(ks, i64(ldv)), name="v.vis")
        out = gep_f32(b, heads["out"], b.mul(i0, i64(ldo)), name="out.strip")
        staged = self.staged.get("out")
        packed = panels_from(b, self.panels, "v", ks)
        upper = band.mode(b, Band.K_UPPER), band.diagonal, packed

        def in_place() -> None:
            self._sgemm(b, NO_TRANS, NO_TRANS, rows, i64(dv), nk, 1.0, p, ldp, v_vis, ldv, 0.0, out, ldo, *upper)
            scale_rows(b, out, rows, ldo, dv, inverse)

        def streamed(staged: ir.Value) -> None:  # fenced at the end of the item (_stream_out)
            self._sgemm(b, NO_TRANS, NO_TRANS, rows, i64(dv), nk, 1.0, p, ldp, v_vis, ldv, 0.0, staged, dv, *upper)
            stream_rows(b, staged, dv, out, ldo, rows, dv, inverse)

        self._either(b, staged, in_place, streamed)

    def _backward_gemms(
        self,
        b: ir.IRBuilder,
        heads: dict[str, ir.Value],
        strips: dict[str, tuple[ir.Value, int]],
        packed: dict[str, ir.Value],
        i0: ir.Value,
        rows: ir.Value,
        ks: ir.Value,
        nk: ir.Value,
        ldp: ir.Value,
        p: ir.Value,
        dp: ir.Value | None,
        mask_base: ir.Value,
        first: ir.Value,
        band: StripBand,
    ) -> None:
        """The strip's dV, dP, dS, dQ and dK. dK/dV sum over strips and over the kv group's heads;
        the ``first`` write of a group stores (beta = 0) and zeroes the rows outside its keys, so
        no pass zeroes the whole head beforehand (strided rows cost a cache miss each to zero)."""
        spec, width, dv_width = self.spec, self.spec.dims.head_dim, self.spec.dims.value_dim
        ldk, ldv = self._ld("k"), self._ld("v")
        (q_strip, ldq), (dy_strip, ldo) = strips["q"], strips["dy"]  # in place or dense (_strip_rows)
        grads = spec.grads
        assert grads is not None
        k_vis = gep_f32(b, heads["k"], b.mul(ks, i64(ldk)), name="k.vis")
        accumulate = b.select(first, f32(0.0), f32(1.0), name="beta.kv")
        lower, upper = (band.mode(b, mode) for mode in (Band.K_LOWER, Band.K_UPPER))
        out_lower, d = band.mode(b, Band.OUT_LOWER), band.diagonal
        with b.if_then(first):
            keys_end = b.add(ks, nk, name="keys.end")
            for slot in ("dk", "dv"):
                if slot in heads:
                    self._zero_rows(b, heads[slot], ks, slot)
                    after = gep_f32(b, heads[slot], b.mul(keys_end, as_i64(self._out_ld(b, slot))))
                    self._zero_rows(b, after, b.sub(self.sk, keys_end), slot)
        if grads & Wrt.VALUE:  # dV_vis += P^T dY_strip
            ld_dv = self._out_ld(b, "dv")
            dv = gep_f32(b, heads["dv"], b.mul(ks, as_i64(ld_dv)), name="dv.vis")
            self._sgemm(
                b, TRANS, NO_TRANS, nk, i64(dv_width), rows, 1.0, p, ldp, dy_strip, ldo, accumulate, dv, ld_dv, lower, d
            )
        if dp is None:
            return
        # dP = dY_strip V_vis^T, then dS in place
        v, v_packed = heads["v"], packed["v"]
        self._product_with_transposed(
            b, rows, nk, dv_width, 1.0, dy_strip, ldo, v, ldv, v_packed, ks, dp, ldp, out_lower, d
        )
        self.clock.timed(
            b,
            "softmax_backward",
            lambda: self._softmax_backward_rows(b, p, dp, i0, rows, ks, nk, ldp, mask_base, band.exact),
        )
        if grads & Wrt.QUERY:  # dQ_strip = scale · dS K_vis
            ld_dq = self._ld("dq")
            dq = gep_f32(b, heads["dq"], b.mul(i0, i64(ld_dq)), name="dq.strip")
            k_panels = panels_from(b, self.panels, "k", ks)

            def in_place() -> None:
                self._sgemm(
                    b, NO_TRANS, NO_TRANS, rows, i64(width), nk, spec.scale, dp, ldp, k_vis, ldk, 0.0, dq, ld_dq,
                    upper, d, k_panels,
                )  # fmt: skip

            def streamed(staged: ir.Value) -> None:  # fenced with dK/dV at the end of the item (_stream_out)
                self._sgemm(
                    b, NO_TRANS, NO_TRANS, rows, i64(width), nk, spec.scale, dp, ldp, k_vis, ldk, 0.0, staged, width,
                    upper, d, k_panels,
                )  # fmt: skip
                stream_rows(b, staged, width, dq, ld_dq, rows, width)

            self._either(b, self.staged.get("dq"), in_place, streamed)
        if grads & Wrt.KEY:  # dK_vis += scale · dS^T Q_strip
            ld_dk = self._out_ld(b, "dk")
            dk = gep_f32(b, heads["dk"], b.mul(ks, as_i64(ld_dk)), name="dk.vis")
            self._sgemm(
                b, TRANS, NO_TRANS, nk, i64(width), rows, spec.scale, dp, ldp, q_strip, ldq, accumulate, dk, ld_dk,
                lower, d,
            )  # fmt: skip

    def _either(
        self,
        b: ir.IRBuilder,
        staged: ir.Value | None,
        in_place: Callable[[], None],
        streamed: Callable[[ir.Value], None],
    ) -> None:
        """Write a strip's output in place, or through its staging buffer (``staged``): as the
        spec decided, or with symbolic lengths as this call decides (``self.streaming``)."""
        if staged is None:
            in_place()
        elif not self.per_call:
            streamed(staged)
        else:
            with b.if_else(self.streaming) as (stream, direct):
                with stream:
                    streamed(staged)
                with direct:
                    in_place()

    def _product_with_transposed(
        self,
        b: ir.IRBuilder,
        rows: ir.Value,
        nk: ir.Value,
        width: int,
        alpha: float,
        a: ir.Value,
        lda: int,
        head: ir.Value,
        ld_head: int,
        packed: ir.Value,
        ks: ir.Value,
        c: ir.Value,
        ldc: ir.Value,
        band: int | ir.Value = Band.NONE,
        diagonal: int | ir.Value = 0,
    ) -> None:
        """``C = alpha A X_vis^T`` for a head operand X (K or V) over the visible keys ``[ks, ks +
        nk)`` (see :func:`keys_operand`), the part ``band`` says (:class:`Band`)."""
        operand, ld, trans = keys_operand(b, head, ld_head, packed, ks, self.sk)
        self._sgemm(b, NO_TRANS, trans, rows, nk, i64(width), alpha, a, lda, operand, ld, 0.0, c, ldc, band, diagonal)

    def _sgemm(
        self,
        b: ir.IRBuilder,
        trans_a: int,
        trans_b: int | ir.Value,
        m: ir.Value,
        n: ir.Value,
        k: ir.Value,
        alpha: float,
        a: ir.Value,
        lda: int | ir.Value,
        b_mat: ir.Value,
        ldb: int | ir.Value,
        beta: float | ir.Value,
        c: ir.Value,
        ldc: int | ir.Value,
        band: int | ir.Value = Band.NONE,
        diagonal: int | ir.Value = 0,
        packed_b: PackedPanels | None = None,
    ) -> None:
        args = (trans_a, trans_b, m, n, k, alpha, a, lda, b_mat, ldb, beta, c, ldc, band, diagonal, packed_b)
        self.clock.timed(b, "blas", lambda: emit_sgemm(b, self.sgemm, *args))


def row_stride(layout: Layout, heads: int, width: int) -> int:
    """Elements between consecutive rows of one head (the BLAS leading dimension): a head's rows
    are ``H·W`` floats apart in BSHD and ``W`` apart in BHSD."""
    return heads * width if layout is Layout.BSHD else width


def head_offset(
    b: ir.IRBuilder, layout: Layout, batch: ir.Value, head: ir.Value, seq: int | ir.Value, heads: int, width: int
) -> ir.Value:
    """Element offset of row 0 of head (batch, head) in a tensor of ``heads`` heads of ``seq`` rows."""
    seq = as_i64(seq)
    if layout is Layout.BSHD:  # ((b*S + s)*H + h)*W
        return b.add(b.mul(batch, b.mul(seq, i64(heads * width))), b.mul(head, i64(width)))
    return b.mul(b.add(b.mul(batch, i64(heads)), head), b.mul(seq, i64(width)))  # ((b*H + h)*S + s)*W


def scale_rows(b: ir.IRBuilder, base: ir.Value, rows: ir.Value, stride: int, width: int, factors: ir.Value) -> None:
    """``base[r*stride : r*stride + width] *= factors[r]`` for ``r < rows`` (deferred softmax sums)."""
    with for_range(b, 0, rows, "scale") as r:
        row = gep_f32(b, base, b.mul(r, i64(stride)))
        scale_row(b, row, i64(width), b.load(gep_f32(b, factors, r), typ=F32, name="inv"))


def heads_finite(b: ir.IRBuilder, seq_q: ir.Value, heads: list[tuple[ir.Value, ir.Value, int, int]]) -> ir.Value:
    """Whether the heads ``(row 0, rows, ld, width)`` hold only finite numbers, so that a banded
    product may skip their terms above a strip's diagonal (``0 · x`` is 0 only for a finite
    ``x``); false on calls of fewer than :data:`BAND_MIN_ROWS` query rows, where the check
    would cost more than the band saves. Both kinds of attention kernel check this way."""
    flag = alloca_entry(b, I1, "heads.finite")
    b.store(ir.Constant(I1, 0), flag)
    with b.if_then(b.icmp_signed(">=", seq_q, i64(BAND_MIN_ROWS), name="bands.pay")):
        finite: ir.Value = ir.Constant(I1, 1)
        for base, rows, ld, width in heads:
            finite = b.and_(finite, finite_rows(b, base, rows, ld, width))
        b.store(finite, flag)
    return b.load(flag, typ=I1, name="heads.finite")


def not_finite(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """Whether the float ``x`` is infinite or NaN (an i1)."""
    magnitude = b.call(intrinsic(b.module, "llvm.fabs.f32", F32, [F32]), [x])
    return b.fcmp_unordered("==", magnitude, f32(math.inf), name="not.finite")


def finite_rows(b: ir.IRBuilder, base: ir.Value, rows: ir.Value, ld: int, width: int) -> ir.Value:
    """Whether ``rows`` rows of ``width`` floats, ``ld`` apart, hold no NaN or Inf (an i1)."""
    count = b.call(_finite_rows_function(b.module), [base, rows, i64(ld), i64(width)], name="non.finite")
    return b.icmp_signed("==", count, i64(0), name="finite")


def _finite_rows_function(module: ir.Module) -> ir.Function:
    """``rlx_non_finite(base, rows, ld, width)``: 0 if the rows hold only finite numbers, else
    not 0. One function per module, as :func:`stream_rows`: inlined at each of a kernel's four
    call sites, the loops cost the demo graph a tenth more compile time. It sums ``x · 0``,
    which is 0, or NaN if any ``x`` is not finite (no fast-math flag lets LLVM fold it), in a
    vector accumulator folded once at the end (a fold per row cost a causal S512 backward 3%)."""
    existing = module.globals.get("rlx_non_finite")
    if existing is not None:
        return existing  # type: ignore[return-value]
    fn = ir.Function(module, ir.FunctionType(I64, [PTR, I64, I64, I64]), name="rlx_non_finite")
    fn.linkage = "internal"
    fn.attributes.add("noinline")
    base, rows, ld, width = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    vec = Lanes(module, WIDTH)
    partial = alloca_entry(b, vec.type, "finite.v")
    b.store(vec.const(0.0), partial)
    scalar = alloca_entry(b, F32, "finite.s")
    b.store(f32(0.0), scalar)
    whole = b.and_(width, i64(-WIDTH), name="whole")
    with for_range(b, 0, rows, "finite.row") as r:
        row = gep_f32(b, base, b.mul(r, ld))
        with for_range(b, 0, whole, "finite.column", WIDTH) as j:
            zeros = b.fmul(vec.load(b, row, j), vec.const(0.0))
            b.store(b.fadd(b.load(partial, typ=vec.type), zeros), partial)
        with for_range(b, whole, width, "finite.tail") as j:
            zero = b.fmul(b.load(gep_f32(b, row, j), typ=F32), f32(0.0))
            b.store(b.fadd(b.load(scalar, typ=F32), zero), scalar)
    total = b.fadd(sum_lanes(b, b.load(partial, typ=vec.type)), b.load(scalar, typ=F32))
    b.ret(b.zext(b.fcmp_unordered("uno", total, total), I64))
    return fn


def scale_row(b: ir.IRBuilder, row: ir.Value, width: ir.Value, factor: ir.Value) -> None:
    """``row[:width] *= factor`` (a softmax row by 1/sum)."""

    def scale(b: ir.IRBuilder, j: ir.Value, lanes: Lanes) -> None:
        lanes.store(b, b.fmul(lanes.load(b, row, j), lanes.splat(b, factor)), row, j)

    vector_loop(b, i64(0), width, "scale.row", scale)


def stream_rows(
    b: ir.IRBuilder,
    src: ir.Value,
    src_ld: int,
    dst: ir.Value,
    dst_ld: int,
    rows: ir.Value,
    width: int,
    factors: ir.Value | None = None,
) -> None:
    """``dst[r*dst_ld : r*dst_ld + width] = src[r*src_ld : ...]`` (times ``factors[r]``, when
    given) for ``r < rows``, in whole vectors with non-temporal stores where a row starts on a
    64-byte line (ordinary stores elsewhere, and for a row's last ``width % 16`` floats). The
    caller fences (sfence) before anything else may read ``dst``. One function per module that
    every call site calls: inlined at each, the copies made the demo's compile 5 ms longer."""
    null = ir.Constant(PTR, None)
    args = [src, i64(src_ld), dst, i64(dst_ld), rows, i64(width), null if factors is None else factors]
    b.call(_stream_rows_function(b.module), args)


def _stream_rows_function(module: ir.Module) -> ir.Function:
    """``rlx_stream_rows(src, src_ld, dst, dst_ld, rows, width, factors)`` (:func:`stream_rows`;
    ``factors`` may be null: a factor of 1, which changes no value)."""
    existing = module.globals.get("rlx_stream_rows")
    if existing is not None:
        return existing  # type: ignore[return-value]
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR, I64, I64, I64, PTR]), name="rlx_stream_rows")
    fn.linkage = "internal"
    fn.attributes.add("noinline")  # called once per strip: one copy of its code per module
    src, src_ld, dst, dst_ld, rows, width, factors = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    vector = ir.VectorType(F32, WIDTH)
    streamed = module.add_metadata([ir.Constant(I32, 1)])
    whole = b.and_(width, i64(-WIDTH), name="whole")
    scaled = b.icmp_unsigned("!=", factors, ir.Constant(PTR, None), name="scaled")
    factor_slot = alloca_entry(b, F32, "factor")

    def copy(b: ir.IRBuilder, source: ir.Value, target: ir.Value, factor: ir.Value, nontemporal: bool) -> None:
        with for_range(b, 0, whole, "stream.nt" if nontemporal else "stream.plain", WIDTH) as column:
            value = b.fmul(b.load(gep_f32(b, source, column), typ=vector, align=4), splat(b, factor, WIDTH))
            store = b.store(value, gep_f32(b, target, column), align=64 if nontemporal else 4)
            if nontemporal:
                store.set_metadata("nontemporal", streamed)

    with for_range(b, 0, rows, "stream") as row:
        source = gep_f32(b, src, b.mul(row, src_ld), name="stream.src")
        target = gep_f32(b, dst, b.mul(row, dst_ld), name="stream.dst")
        b.store(f32(1.0), factor_slot)
        with b.if_then(scaled):
            b.store(b.load(gep_f32(b, factors, row), typ=F32), factor_slot)
        factor = b.load(factor_slot, typ=F32, name="stream.factor")
        on_line = b.icmp_unsigned("==", b.and_(b.ptrtoint(target, I64), i64(SCRATCH_ALIGN - 1)), i64(0))
        with b.if_else(on_line) as (aligned, unaligned):
            with aligned:
                copy(b, source, target, factor, True)
            with unaligned:
                copy(b, source, target, factor, False)
        with for_range(b, whole, width, "stream.tail") as column:
            value = b.fmul(b.load(gep_f32(b, source, column), typ=F32), factor)
            b.store(value, gep_f32(b, target, column))
    b.ret_void()
    return fn


def zero_rows(
    b: ir.IRBuilder, memset: ir.Function, base: ir.Value, rows: int | ir.Value, stride: int | ir.Value, width: int
) -> None:
    """``base[r*stride : r*stride + width] = 0`` for ``r < rows``: one memset when rows are
    contiguous (a stride known at compile time); ``stride`` may be one of the call."""
    if isinstance(stride, int) and stride == width:
        nbytes = i64(rows * width * 4) if isinstance(rows, int) else b.mul(rows, i64(width * 4))
        b.call(memset, [base, ir.Constant(I8, 0), nbytes, ir.Constant(I1, 0)])
        return
    with for_range(b, 0, rows, "zero") as row:
        ptr = gep_f32(b, base, b.mul(row, as_i64(stride)))
        b.call(memset, [ptr, ir.Constant(I8, 0), i64(width * 4), ir.Constant(I1, 0)])


def tile_limits(a_size: SizeT, macs: SizeT, trans_a: bool) -> list[tuple[SizeT, int, int | None]]:
    """``(value, smallest, largest)``, largest None for no upper limit: the sizes between which a
    product with B as stored runs on the register tiles (see :data:`TILE_TN_MAX_A`), for ints
    or values of the call: its multiply-adds ``macs`` and the elements ``a_size`` of its A (m·k)."""
    smallest = SMALL_PATH_MACS + 1 if load_blas().has_small_path else 0
    limits: list[tuple[SizeT, int, int | None]] = [(macs, smallest, None)]
    if trans_a:
        limits.append((a_size, 0, TILE_TN_MAX_A))
    return limits


def _within(value: int, smallest: int, largest: int | None) -> bool:
    """Whether a size known at compile time is within one of :func:`tile_limits`."""
    return smallest <= value and (largest is None or value <= largest)


def tiles_take(m: int, n: int, k: int, trans_a: bool, trans_b: bool) -> bool:
    """Whether the attention kernels run ``op(A) op(B)`` (m x n x k) on the register tiles on this
    machine, rather than on OpenBLAS (for benchmarks that time what the kernels call)."""
    if host_tile_shape() is None or trans_b or m == 1:
        return False
    limits = tile_limits(m * k, m * n * k, trans_a)
    return all(_within(value, smallest, largest) for value, smallest, largest in limits)


def declare_sgemm(module: ir.Module) -> ir.Function:
    return declare(module, SGEMM, VOID, [I32] * 6 + [F32, PTR, I32, PTR, I32, F32, PTR, I32])


def emit_sgemm(
    b: ir.IRBuilder,
    sgemm: ir.Function,
    trans_a: int,
    trans_b: int | ir.Value,
    m: int | ir.Value,
    n: int | ir.Value,
    k: int | ir.Value,
    alpha: float,
    a: ir.Value,
    lda: int | ir.Value,
    b_mat: ir.Value,
    ldb: int | ir.Value,
    beta: float | ir.Value,
    c: ir.Value,
    ldc: int | ir.Value,
    band: int | ir.Value = Band.NONE,
    diagonal: int | ir.Value = 0,
    packed_b: PackedPanels | None = None,
) -> None:
    """The one place an attention kernel emits a matrix product: row-major ``C = alpha op(A) op(B) + beta C``.

    ``band`` and ``diagonal`` say what part of the product a causal strip needs (:class:`Band`):
    the register tiles skip the rest; OpenBLAS and ``sgemv`` compute it all, which gives the
    same values wherever the caller reads them. ``packed_b``: B (as stored) also packed in the
    tiles' column panels, which the tiles read where it is not null (:func:`emit_panel_copy`).

    Strip products with B as stored run on the register tiles of :mod:`rlx.codegen.tile_gemm`
    where the CPU has FMA vectors and the shape is one they run faster (above OpenBLAS's
    small-matrix path; :data:`TILE_TN_MAX_A`); the rest, and those reading B transposed, on OpenBLAS.

    A product of one row (a decode step's single query, a strip's last row) is a matrix-vector
    product, which OpenBLAS's ``sgemv`` runs 2-2.5x faster than ``sgemm`` (no packing of B;
    measured for 1 x 64 by 64 x 1000 on the benchmark host); with ``m`` known only at run time,
    the choice is a branch. ``trans_b`` may be an i32 of the call (a head operand read in place
    or from its transposed copy): one call site either way.
    """

    def as_i32(value: int | ir.Value) -> ir.Value:
        return i32(value) if isinstance(value, int) else b.trunc(value, I32)

    beta_value = beta if isinstance(beta, ir.Value) else f32(beta)

    def blas(b: ir.IRBuilder) -> None:
        trans = i32(trans_b) if isinstance(trans_b, int) else trans_b
        args = [i32(ROW_MAJOR), i32(trans_a), trans, as_i32(m), as_i32(n), as_i32(k), f32(alpha), a]
        b.call(sgemm, [*args, as_i32(lda), b_mat, as_i32(ldb), beta_value, c, as_i32(ldc)])

    def tiles(b: ir.IRBuilder) -> None:
        assert shape is not None
        product = declare_tile_gemm(sgemm.module, trans_a != NO_TRANS, shape)
        operand, ld, panels = b_mat, as_i64(ldb), i64(0)
        if packed_b is not None:
            is_packed = b.icmp_unsigned("!=", packed_b.base, ir.Constant(PTR, None), name="b.is.packed")
            operand = b.select(is_packed, packed_b.base, b_mat, name="b.operand")
            panels = b.select(is_packed, packed_b.stride, i64(0), name="b.panels")
        sizes = [as_i64(m), as_i64(n), as_i64(k), f32(alpha), a, as_i64(lda), operand, ld]
        b.call(product, [*sizes, beta_value, c, as_i64(ldc), as_i64(band), as_i64(diagonal), panels])

    shape = host_tile_shape()

    def matrix(b: ir.IRBuilder) -> None:
        if shape is None or (isinstance(trans_b, int) and trans_b != NO_TRANS):  # the tiles read B as stored
            blas(b)
            return
        conditions = [] if isinstance(trans_b, int) else [b.icmp_signed("==", trans_b, i32(NO_TRANS), name="b.stored")]

        def times(x: SizeT, y: SizeT, name: str) -> SizeT:
            return x * y if isinstance(x, int) and isinstance(y, int) else b.mul(as_i64(x), as_i64(y), name=name)

        a_size = times(m, k, "a.size")
        for value, smallest, largest in tile_limits(a_size, times(a_size, n, "macs"), trans_a != NO_TRANS):
            if isinstance(value, int):
                if not _within(value, smallest, largest):
                    blas(b)
                    return
                continue
            if smallest > 0:
                conditions.append(b.icmp_signed(">=", value, i64(smallest), name="tile.large"))
            if largest is not None:
                conditions.append(b.icmp_signed("<=", value, i64(largest), name="tile.small"))
        if not conditions:
            tiles(b)
            return
        taken = conditions[0]
        for condition in conditions[1:]:
            taken = b.and_(taken, condition, name="tiles.take")
        with b.if_else(taken) as (tiled, packed):
            with tiled:
                tiles(b)
            with packed:
                blas(b)

    def vector(b: ir.IRBuilder) -> None:
        # C (1 x n) = alpha x^T op(B) + beta C, i.e. C^T = alpha op(B)^T x + beta C^T, where x is
        # op(A)'s one row: A's row (stride 1), or A's first column (stride lda) when A is transposed.
        gemv = declare(sgemm.module, SGEMV, VOID, [I32, I32, I32, I32, F32, PTR, I32, PTR, I32, F32, PTR, I32])
        incx = i32(1) if trans_a == NO_TRANS else as_i32(lda)
        # B is k x n (C^T = B^T x) or, transposed, n x k (C^T = B x).
        transposed: bool | ir.Value
        if isinstance(trans_b, int):
            transposed = trans_b != NO_TRANS
        else:
            transposed = b.icmp_signed("!=", trans_b, i32(NO_TRANS), name="b.transposed")

        def pick(if_transposed: ir.Value, otherwise: ir.Value) -> ir.Value:
            if isinstance(transposed, bool):
                return if_transposed if transposed else otherwise
            return b.select(transposed, if_transposed, otherwise)

        shape = [pick(i32(NO_TRANS), i32(TRANS)), pick(as_i32(n), as_i32(k)), pick(as_i32(k), as_i32(n))]
        b.call(gemv, [i32(ROW_MAJOR), *shape, f32(alpha), b_mat, as_i32(ldb), a, incx, beta_value, c, i32(1)])

    if isinstance(m, int):
        (vector if m == 1 else matrix)(b)
        return
    with b.if_else(b.icmp_signed("==", m, i64(1), name="one.row")) as (one_row, rows):
        with one_row:
            vector(b)
        with rows:
            matrix(b)
