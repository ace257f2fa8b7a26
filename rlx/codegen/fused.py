"""One fused loop nest per materialised value: elementwise chains and reductions, no buffers between.

A kernel evaluates its root value at every index of its output view. Evaluation is recursive over
the graph, at an *index*: one entry per dimension of the value, each ``var + add`` where ``var``
is an open loop (or none) and ``add`` an integer. Broadcasting, transposes, splits and unit
reshapes only rewrite the index, so they are free; a value with a buffer is loaded through its
strided view; a reduction opens loops of its own over the reduced dimensions.

Loop-invariant code is hoisted by construction: a value is emitted in the innermost loop whose
variable its index uses, into that loop's *pre-chain* (a block before the loop that stays open
while the loop body is emitted). So a softmax over rows becomes: per row, a loop for the max,
a loop for the sum of exponentials (both hoisted out of the store loop because their index has
no column variable), then the store loop. The innermost loop of a nest runs 16 lanes at a time
with a scalar remainder, like the attention kernels' row loops (:mod:`rlx.codegen.vector`);
loads whose lanes are not contiguous gather lane by lane. Trailing axes that every read steps
through evenly run as one flat loop (:mod:`rlx.codegen.collapse`: a feature map's ``H*W``
rather than its short rows), and where a body computes enough, a row ends in one masked
vector step instead of scalar ones (:attr:`Loop.mask`).

The kernel body is run by the parallel-for over chunks of rows (or of columns when rows are
few); every output element is computed by one thread with the same code, so results do not
depend on the thread count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
from llvmlite import ir

from rlx.bind import checked_in_kernel
from rlx.codegen.blas import LIBM
from rlx.codegen.collapse import flat_columns, flat_reduced_axes
from rlx.codegen.expf import define_expf, define_softmax_expf
from rlx.codegen.irutil import (
    CONTRACT,
    F32,
    I1,
    I8,
    I32,
    I64,
    PTR,
    REDUCE,
    VOID,
    alloca_entry,
    clamp,
    declare,
    element_type,
    gep,
    i64,
    intrinsic,
    smin,
)
from rlx.codegen.schedule import (
    Kernel,
    Schedule,
    apply_view_op,
    inline_values,
    is_unit_reshape,
    reduces_last_axis,
    reduction_of,
    split_start,
)
from rlx.codegen.sizes import Size, SizeLike, ceil_div, emit_size, nominal
from rlx.codegen.vector import WIDTH, any_lane, fold_max_ignoring_nan, max_ignoring_nan, splat, sum_lanes
from rlx.codegen.views import View
from rlx.ir.dims import product, total
from rlx.ir.graph import Node, Value
from rlx.ir.types import Dim
from rlx.ops.fused import typed_scalar

MIN_ITEM_ELEMENTS = 1 << 14  # elements per parallel work item at least: thread overhead pays off
# How a row's last partial vector runs (FusedEmitter.vector_and_rest, plan_chunking).
SCALAR_REST, MASKED_REST, OVERLAPPED_REST = "scalar", "masked", "overlapped"
# -log(erfc(t)) on [0.875, 4] as a degree-8 polynomial in t (least squares in Chebyshev form, then
# converted): 1 - exp(-Q(t)) is erf(t) to about 1 ulp there.
_ERF_TAIL = (
    -0.00030515213365411853,
    1.1301768012411468,
    0.6319158840825048,
    0.11000188035577789,
    -0.02638020358959795,
    0.004746380109288451,
    -0.0005942299321998408,
    4.5780506464919223e-05,
    -1.6244719587601636e-06,
)


# ----------------------------------------------------------------------------- loops and indices


@dataclass(eq=False)
class Loop:
    """An open loop: its variable, whether it runs ``WIDTH`` lanes at once, and its pre-chain tail."""

    var: ir.Value
    level: int
    vector: bool
    tail: ir.Block  # the open end of the pre-chain: hoisted code goes here
    # A vector loop's last, partial step: the lanes inside the loop's range (<WIDTH x i1>).
    # Loads and stores of the others are masked, and lane-by-lane reads take lane 0's position,
    # so they compute on lane 0's data (no out-of-range read, no trap lane 0 would not meet).
    mask: ir.Value | None = None
    # A concat part's lanes (:meth:`FusedEmitter._concat_by_lanes`): the part's size along the
    # joined axis. Lane j is at ``var + j`` where that lies in ``[0, part)``; the other lanes are
    # not used, but read only positions inside the part all the same (see ``_load_part``).
    part: ir.Value | None = None


@dataclass(frozen=True, eq=False)
class Ix:
    """One dimension's index: ``loop.var + add`` (or just ``add``); ``add`` is an int or an i64 value."""

    loop: Loop | None
    add: ir.Value | int
    level: int  # the deepest loop this index depends on (0: the row)

    def key(self) -> tuple[object, ...]:
        # The objects themselves (a Loop hashes by identity), never id(): a finished loop's object
        # can be freed and its id reused by the next loop, and a memo keyed on ids would then hand
        # the vector loop's values to the scalar remainder loop. Holding them keeps them alive.
        return (self.loop, self.add)


ZERO = Ix(None, 0, 0)


def _shift(ix: Ix, amount: int) -> Ix:
    """``ix + amount`` (a split's offset); shifts of a shifted row index fold into one."""
    if isinstance(ix.add, int):
        return Ix(ix.loop, ix.add + amount, ix.level)
    if isinstance(ix.add, _AddLater):
        return Ix(ix.loop, _AddLater(ix.add.value, ix.add.amount + amount), ix.level)  # type: ignore[arg-type]
    return Ix(ix.loop, _AddLater(ix.add, amount), ix.level)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _AddLater:
    """``value + amount``, folded when the address is built."""

    value: ir.Value
    amount: int


@dataclass(frozen=True)
class Lane:
    """An emitted value: its IR value, lanes (1 or WIDTH) and kind ('f' float, 'b' bool, 'i' int64)."""

    value: ir.Value
    width: int
    kind: str


# ----------------------------------------------------------------------------- the emitter


@dataclass
class FusedEmitter:
    """Emits the loop nest of one fused kernel into ``fn`` (an item function of the parallel-for)."""

    module: ir.Module
    b: ir.IRBuilder
    schedule: Schedule
    kernel: Kernel
    pointer: Callable[[Value], ir.Value]  # base pointer of a materialised value's buffer
    constant: Callable[[Value], ir.Value]  # the data of a constant (even one that is also a graph output)
    symbols: Mapping[str, ir.Value] = field(default_factory=dict)  # this call's symbolic dimensions
    fault_word: Callable[[Node], ir.Value] | None = None  # where a gather reports a bad computed id
    stack: list[Loop] = field(default_factory=list)
    memo: dict[tuple[object, ...], Lane] = field(default_factory=dict)

    def size(self, value: Dim | Size) -> ir.Value:
        """A size or stride as an i64 here: a constant, or computed from the call's symbols."""
        return emit_size(self.b, value, self.symbols)

    def _shift_by(self, ix: Ix, amount: Size) -> Ix:
        """``ix + amount`` for a symbolic ``amount`` (a split's part after a symbolic one)."""
        shift = self.size(amount)
        if isinstance(ix.add, _AddLater):
            return Ix(ix.loop, _AddLater(self.b.add(ix.add.value, shift), ix.add.amount), ix.level)
        if isinstance(ix.add, int):
            return Ix(ix.loop, shift if ix.add == 0 else _AddLater(shift, ix.add), ix.level)
        return Ix(ix.loop, self.b.add(ix.add, shift), ix.level)

    # ------------------------------------------------------------------ loops

    @contextmanager
    def at_level(self, level: int) -> Iterator[None]:
        """Emit into the pre-chain of the open loop at ``level`` (so before that loop starts)."""
        if level >= len(self.stack):
            yield
            return
        target = self.stack[level]
        saved_block, saved_stack = self.b.block, self.stack
        self.stack = saved_stack[:level]
        self.b.position_at_end(target.tail)
        try:
            yield
        finally:
            target.tail = self.b.block
            self.stack = saved_stack
            self.b.position_at_end(saved_block)

    def loop(
        self,
        start: ir.Value,
        stop: ir.Value,
        name: str,
        vector: bool,
        body: Callable[[Loop], None],
        masked: bool = False,
        clamped: bool = False,
    ) -> None:
        """``for var in range(start, stop, WIDTH if vector else 1): body`` with an open pre-chain;
        ``masked``: vector steps up to ``stop`` itself, the lanes past it masked (:attr:`Loop.mask`);
        ``clamped``: vector steps up to ``stop`` itself, each at ``min(var, stop - WIDTH)``, so the
        last one overlaps the step before it (the range must hold ``WIDTH`` positions)."""
        b = self.b
        pre = b.append_basic_block(f"{name}.pre")
        b.branch(pre)
        cond = b.append_basic_block(f"{name}.cond")
        body_block = b.append_basic_block(f"{name}.body")
        end = b.append_basic_block(f"{name}.end")
        b.position_at_end(cond)
        var = b.phi(I64, name=name)
        step = WIDTH if vector else 1
        limit = b.sub(stop, i64(step - 1)) if vector and not (masked or clamped) else stop
        b.cbranch(b.icmp_signed("<", var, limit), body_block, end)
        b.position_at_end(body_block)
        position = smin(b, var, b.sub(stop, i64(WIDTH)), name=f"{name}.at") if clamped else var
        loop = Loop(position, len(self.stack) + 1, vector, pre)
        if masked:
            lanes = b.add(splat(b, var, WIDTH), ir.Constant(ir.VectorType(I64, WIDTH), list(range(WIDTH))))
            loop.mask = b.icmp_signed("<", lanes, splat(b, stop, WIDTH), name=f"{name}.mask")
        self.stack.append(loop)
        body(loop)
        self.stack.pop()
        var.add_incoming(b.add(var, i64(step), name=f"{name}.next"), b.block)
        b.branch(cond)
        b.position_at_end(loop.tail)
        b.branch(cond)
        var.add_incoming(start, loop.tail)
        b.position_at_end(end)

    def vector_and_rest(
        self, start: ir.Value, stop: ir.Value, name: str, body: Callable[[Loop], None], tail: str = SCALAR_REST
    ) -> None:
        """The vector loop over ``[start, stop)`` where no vector loop is open, then its rest
        (``tail``):

        - ``SCALAR_REST``: a scalar loop;
        - ``MASKED_REST``: one masked vector step (for a body that only stores what it computes
          per position: a reduction's body would add the masked lanes);
        - ``OVERLAPPED_REST``: where ``[start, stop)`` holds ``WIDTH`` positions, the vector loop's
          last step moves back to end at ``stop``, overlapping the step before it (else a scalar
          loop): no second copy of the body. For a body that stores a pure function of its
          position into memory none of its reads overlap (a step's writes never do:
          ``MemoryPlan.accesses``): the positions computed twice get the same values.
        """
        if any(loop.vector for loop in self.stack):
            self.loop(start, stop, name, False, body)
            return
        b = self.b
        if tail == OVERLAPPED_REST:  # one vector loop whose last step overlaps, else the scalar one
            # What either branch computes (hoisted to its own loop's pre-chain) stays in it.
            saved = self.memo
            with b.if_else(b.icmp_signed(">=", b.sub(stop, start), i64(WIDTH))) as (vectors, scalars):
                with vectors:
                    self.memo = dict(saved)
                    self.loop(start, stop, f"{name}.v", True, body, clamped=True)
                with scalars:
                    self.memo = dict(saved)
                    self.loop(start, stop, f"{name}.s", False, body)
            self.memo = saved
            return
        counter = alloca_entry(b, I64, f"{name}.at")
        b.store(start, counter)

        def vector_body(loop: Loop) -> None:
            body(loop)
            self.b.store(self.b.add(loop.var, i64(WIDTH)), counter)

        self.loop(start, stop, f"{name}.v", True, vector_body)
        middle = b.load(counter, typ=I64, name=f"{name}.rest")
        if tail == MASKED_REST:
            self.loop(middle, stop, f"{name}.m", True, body, masked=True)  # one step, or none
        else:
            self.loop(middle, stop, f"{name}.s", False, body)

    # ------------------------------------------------------------------ evaluation

    def eval(self, value: Value, idx: tuple[Ix, ...]) -> Lane:
        key = (value, tuple(ix.key() for ix in idx))
        found = self.memo.get(key)
        if found is not None:
            return found
        level = max((ix.level for ix in idx), default=0)
        with self.at_level(level):
            result = self._compute(value, idx)
        self.memo[key] = result
        return result

    def _compute(self, value: Value, idx: tuple[Ix, ...]) -> Lane:
        node = value.node
        op = node.op.value
        own = self.kernel.root is value and self.kernel.out is not None and self.kernel.out.base is value
        if op == "constant" and product(value.shape) == 1 and value.dtype.kind in "fib":
            return _scalar_constant(value)
        if op == "constant":
            view: View | None = View.dense(value)
        else:
            view = None if own else self.schedule.view(value)
        if view is not None:  # a constant's data, or a buffer this kernel reads
            return self.load(view, idx, value.dtype)
        if op == "broadcast_to":
            return self.eval(node.inputs[0], self._broadcast_index(idx, node.inputs[0].shape))
        if op == "transpose":
            inner = [ZERO] * len(idx)
            for out_dim, in_dim in enumerate(node.attrs.perm):
                inner[in_dim] = idx[out_dim]
            return self.eval(node.inputs[0], tuple(inner))
        if op == "split":
            axis, start = node.attrs.axis, split_start(node, value.index)
            shifted = list(idx)
            shifted[axis] = _shift(idx[axis], start) if isinstance(start, int) else self._shift_by(idx[axis], start)
            return self.eval(node.inputs[0], tuple(shifted))
        if op == "reshape":
            if is_unit_reshape(node):
                index = _unit_reshape_index(idx, value.shape, node.inputs[0].shape)
                return self.eval(node.inputs[0], index)
            source = self.schedule.view(node.inputs[0])  # the scheduler made sure this view exists
            assert source is not None
            reshaped = source.reshape(node.attrs.shape)
            assert reshaped is not None
            return self.load(reshaped, idx, value.dtype)
        if op == "unfold":  # its own root: the operand's windows, read through strides
            source = self.schedule.view(node.inputs[0])  # the scheduler gave it a buffer
            assert source is not None
            windows = apply_view_op(node, value.index, source)
            assert windows is not None
            return self.load(windows, idx, value.dtype)
        if op in ("sum", "max"):
            return self.reduce(value, idx)
        if op == "concat":
            return self.concat(value, idx)
        if op == "embedding":
            return self.embedding(value, idx)
        if op == "take_along_axis":
            return self.take_along_axis(value, idx)
        definition = node.op.definition
        assert definition.scalar is not None, f"no scalar formula for {op}"
        operands = [self.eval(v, self._broadcast_index(idx, v.shape)) for v in node.inputs]
        width = max(lane.width for lane in operands)
        math_ = LaneMath(self, width)
        args = [math_.widen(lane) for lane in operands]
        if op == "fused_elementwise":
            types = [v.type for v in node.inputs]
            result = typed_scalar(math_, args, node.attrs, types, math_.wrapped)
        else:
            result = math_.wrapped(definition.scalar(math_, *args, node.attrs), value.dtype)
        kind = "b" if value.dtype == np.bool_ else ("i" if value.dtype.kind == "i" else "f")
        return Lane(result, width, kind)

    @staticmethod
    def _broadcast_index(idx: tuple[Ix, ...], shape: tuple[Dim, ...]) -> tuple[Ix, ...]:
        """The index of an operand of ``shape`` that broadcasts to the current one (right-aligned)."""
        lead = len(idx) - len(shape)
        return tuple(ZERO if size == 1 else idx[lead + i] for i, size in enumerate(shape))

    def concat(self, value: Value, idx: tuple[Ix, ...]) -> Lane:
        """A ``concat`` read inline (the gradient of a slice or a pad: its parts and zeros): the
        part the index falls in. A static index picks it; otherwise every part is read at the
        index clamped into it and the right one selected (zeros cost nothing to read), lane by
        lane where the vector lanes run along the joined axis."""
        axis = value.node.attrs.axis
        ix = idx[axis]
        parts = value.node.inputs
        starts = _part_starts(value)
        if ix.loop is None and isinstance(ix.add, int) and all(isinstance(s, int) for s in starts):
            position = ix.add
            for part, start in reversed(list(zip(parts, starts, strict=True))):
                if position >= start:  # type: ignore[operator]
                    return self.eval(part, _replace(idx, axis, Ix(None, position - start, 0)))  # type: ignore[operator]
        if ix.loop is not None and ix.loop.vector:
            return self._concat_by_lanes(value, idx)
        return self._concat_at(value, idx)

    def _concat_by_lanes(self, value: Value, idx: tuple[Ix, ...]) -> Lane:
        """A concat whose joined axis the vector lanes run along (through a transpose: joined
        along the last axis a concat gets a buffer), a vector at a time: each part is read at
        the window's positions, as a vector loop of its own whose lanes outside the part are
        not used (:attr:`Loop.part`), and each lane selected from its part. (Read lane by lane, an
        average pool's gradient, a sum of nine pads of pads, was 38,000 lines of IR.)"""
        b = self.b
        axis = value.node.attrs.axis
        window = idx[axis]
        outer = window.loop
        assert outer is not None and outer.vector
        assert all(entry.loop is not outer for i, entry in enumerate(idx) if i != axis), "one axis per vector loop"
        first = self._scalar_position(window)  # the window's lane 0 along the joined axis
        result: ir.Value | None = None
        kind = ""
        for part, start in zip(value.node.inputs, _part_starts(value), strict=True):
            size = self.size(part.shape[axis])
            local = b.sub(first, self.size(start))  # the window's lane 0 in the part's positions
            lanes = Loop(local, outer.level, True, outer.tail, part=size)
            read = self.eval(part, _replace(idx, axis, Ix(lanes, 0, window.level)))
            kind = read.kind
            vector = LaneMath(self, WIDTH).widen(read)
            result = vector if result is None else b.select(_lanes_inside(b, local, size), vector, result)
        assert result is not None
        return Lane(result, WIDTH, kind)

    def _concat_at(self, value: Value, idx: tuple[Ix, ...]) -> Lane:
        """The concat at an index whose entry along the joined axis is one scalar. The positions
        are computed here (an index entry's value may have been computed here too), so the parts
        are read at an index of this depth."""
        b = self.b
        axis = value.node.attrs.axis
        position = self._scalar_position(idx[axis])
        here = len(self.stack)
        reads: list[tuple[Lane, ir.Value]] = []
        for part, first in zip(value.node.inputs, _part_starts(value), strict=True):
            start, size = self.size(first), self.size(part.shape[axis])
            clamped = clamp(b, b.sub(position, start), i64(0), b.sub(size, i64(1)))
            below = b.icmp_signed("<", position, b.add(start, size))
            reads.append((self.eval(part, _replace(idx, axis, Ix(None, clamped, here))), below))
        width = max(lane.width for lane, _ in reads)
        math_ = LaneMath(self, width)
        result = math_.widen(reads[-1][0])
        for lane, below in reversed(reads[:-1]):
            result = b.select(below, math_.widen(lane), result)
        return Lane(result, width, reads[0][0].kind)

    def _scalar_position(self, ix: Ix) -> ir.Value:
        """An index entry with no vector lanes as one i64 value."""
        add = ix.add
        if isinstance(add, _AddLater):
            term: ir.Value = self.b.add(add.value, i64(add.amount))
        elif isinstance(add, int):
            term = i64(add)
        else:
            term = add
        return term if ix.loop is None else self.b.add(ix.loop.var, term)

    def reduce(self, value: Value, idx: tuple[Ix, ...]) -> Lane:
        """``sum`` / ``max`` over the reduced axes: nested loops, the innermost one vectorised."""
        node = value.node
        operand, axes, keepdims = node.inputs[0], node.attrs.axes, node.attrs.keepdims
        kept = iter(idx)
        template: list[Ix | None] = []
        for dim in range(len(operand.shape)):
            if dim in axes:
                template.append(None)
                if keepdims:
                    next(kept)
            else:
                template.append(next(kept))
        kind = node.op.value
        identity = 0.0 if kind == "sum" else float("-inf")
        width = WIDTH if any(loop.vector for loop in self.stack) else 1
        outer_vector = width > 1
        acc_type = ir.VectorType(F32, WIDTH) if outer_vector else F32
        acc = alloca_entry(self.b, acc_type, f"{kind}.acc")
        self.b.store(LaneMath(self, width).const(identity), acc)
        lanes_acc = alloca_entry(self.b, ir.VectorType(F32, WIDTH), f"{kind}.vacc") if not outer_vector else None
        if lanes_acc is not None:
            self.b.store(LaneMath(self, WIDTH).const(identity), lanes_acc)
        # A maximum keeps NaN apart: partial maxima that ignore it (one maxps) and a mask of
        # the lanes that met one, as in rlx.codegen.vector's row maxima.
        nan_seen: dict[int, ir.Value] = {}
        if kind == "max":
            for lanes in {width, WIDTH}:
                mask_type = ir.VectorType(I1, lanes) if lanes > 1 else I1
                nan_seen[lanes] = alloca_entry(self.b, mask_type, f"max.nan{lanes}")
                self.b.store(ir.Constant(mask_type, None), nan_seen[lanes])

        def combine(math_: LaneMath, a: ir.Value, x: ir.Value) -> ir.Value:
            if kind == "sum":
                return math_.b.fadd(a, x, flags=REDUCE)
            seen = nan_seen[math_.width]
            is_nan = math_.b.fcmp_unordered("uno", x, x)
            math_.b.store(math_.b.or_(math_.b.load(seen, typ=seen.allocated_type), is_nan), seen)
            return max_ignoring_nan(math_.b, x, a)

        # The innermost reduced axes run as one flat loop where the operand allows it
        # (rlx.codegen.collapse): the flat position in the last one's entry, 0 in the others.
        reduced = [d for d in range(len(template)) if template[d] is None]
        flat = flat_reduced_axes(self.schedule, operand, reduced) if reduced else 1
        flat_size = product(operand.shape[d] for d in reduced[-flat:]) if flat > 1 else None
        if flat > 1:
            folded, reduced = reduced[-flat:-1], [*reduced[:-flat], reduced[-1]]
            template = [ZERO if d in folded else ix for d, ix in enumerate(template)]

        def nest(position: int, index: list[Ix | None], in_vector_body: bool) -> None:
            if position == len(reduced):
                full = tuple(ix for ix in index if ix is not None)
                term = self.eval(operand, full)
                if in_vector_body:  # this iteration covers WIDTH reduced elements, one per lane
                    assert lanes_acc is not None
                    math_ = LaneMath(self, WIDTH)
                    x = math_.widen(term)
                    self.b.store(combine(math_, self.b.load(lanes_acc, typ=lanes_acc.allocated_type), x), lanes_acc)
                else:
                    math_ = LaneMath(self, width)
                    x = math_.widen(term)
                    self.b.store(combine(math_, self.b.load(acc, typ=acc_type), x), acc)
                return
            dim = reduced[position]
            innermost = position == len(reduced) - 1

            def body(loop: Loop) -> None:
                nested = list(index)
                nested[dim] = Ix(loop, 0, loop.level)
                nest(position + 1, nested, loop.vector)

            size = self.size(flat_size if innermost and flat_size is not None else operand.shape[dim])
            if innermost:
                self.vector_and_rest(i64(0), size, f"{kind}.{dim}", body)
            else:
                self.loop(i64(0), size, f"{kind}.{dim}", False, body)

        nest(0, list(template), False)
        total = self.b.load(acc, typ=acc_type)
        if lanes_acc is not None:
            lanes_total = self.b.load(lanes_acc, typ=lanes_acc.allocated_type)
            if kind == "sum":
                total = combine(LaneMath(self, 1), sum_lanes(self.b, lanes_total), total)
            else:
                total = max_ignoring_nan(self.b, fold_max_ignoring_nan(self.b, lanes_total), total)
                lane_nan = any_lane(self.b, self.b.load(nan_seen[WIDTH], typ=nan_seen[WIDTH].allocated_type))
                seen = nan_seen[width]
                self.b.store(self.b.or_(self.b.load(seen, typ=seen.allocated_type), lane_nan), seen)
        if kind == "max":
            nan = LaneMath(self, width).const(float("nan"))
            seen = nan_seen[width]
            total = self.b.select(self.b.load(seen, typ=seen.allocated_type), nan, total, name="max")
        return Lane(total, width, "f")

    def embedding(self, value: Value, idx: tuple[Ix, ...]) -> Lane:
        table, ids = value.node.inputs
        view = self.schedule.view(table)
        assert view is not None
        level = max((ix.level for ix in idx[:-1]), default=0)

        def place(row: ir.Value, at: tuple[Ix, ...]) -> tuple[Ix, ...]:
            return (Ix(None, row, level), at[-1])

        return self._gather(value.node, self.eval(ids, idx[:-1]), view, view.shape[0], idx, place)

    def take_along_axis(self, value: Value, idx: tuple[Ix, ...]) -> Lane:
        """``x`` at the index with its ``axis`` entry replaced by the id there (broadcast axes of
        either operand read at 0)."""
        node = value.node
        x, ids = node.inputs
        axis = node.attrs.axis
        view = self.schedule.view(x)
        assert view is not None
        level = max((ix.level for ix in idx), default=0)

        def place(position: ir.Value, at: tuple[Ix, ...]) -> tuple[Ix, ...]:
            return tuple(
                Ix(None, position, level) if a == axis else (ZERO if size == 1 else ix)
                for a, (ix, size) in enumerate(zip(at, x.shape, strict=True))
            )

        positions = self.eval(ids, tuple(ZERO if size == 1 else ix for ix, size in zip(idx, ids.shape, strict=True)))
        return self._gather(node, positions, view, x.shape[axis], idx, place)

    def _gather(
        self,
        node: Node,
        ids: Lane,
        view: View,
        count: Dim,
        idx: tuple[Ix, ...],
        place: Callable[[ir.Value, tuple[Ix, ...]], tuple[Ix, ...]],
    ) -> Lane:
        """What ``node`` (an ``embedding`` or a ``take_along_axis``) reads of ``view`` at
        ``place(id, idx)``, for the ``ids`` it computed at ``idx``, each checked against the
        ``count`` entries of the axis it indexes (:meth:`_checked_rows`). Where the ids vary along
        the vector loop, lane by lane, with ``idx`` at each lane's position."""
        if ids.width == 1:
            (checked,) = self._checked_rows(node, [ids.value], count)
            return self.load(view, place(checked, idx), view.base.dtype)
        each = [self.b.extract_element(ids.value, ir.Constant(I32, lane)) for lane in range(WIDTH)]
        lanes = [
            self.load(view, place(checked, tuple(_lane_of(self.b, ix, lane) for ix in idx)), view.base.dtype)
            for lane, checked in enumerate(self._checked_rows(node, each, count))
        ]
        return _packed(self.b, lanes)

    def _checked_rows(self, node: Node, rows: list[ir.Value], count: Dim) -> list[ir.Value]:
        """``rows`` as they are, where the ids come from graph inputs or constants (checked before
        the call); else each one outside ``[0, count)`` replaced by row 0, and the last such id
        stored into the node's fault word (:class:`rlx.codegen.lower.IndexFault`). Branch-free:
        the store goes to a stack slot when every id is good."""
        if self.fault_word is None or not checked_in_kernel(node.inputs[1]):
            return rows
        b = self.b
        limit = self.size(count)
        checked = []
        any_bad: ir.Value = ir.Constant(I1, 0)
        bad: ir.Value = i64(0)
        for row in rows:
            good = b.icmp_unsigned("<", row, limit)  # a negative id is a huge unsigned one
            checked.append(b.select(good, row, i64(0)))
            bad = b.select(good, bad, row)
            any_bad = b.or_(any_bad, b.not_(good))
        sink = alloca_entry(b, I64, "fault.sink")
        target = b.select(any_bad, self.fault_word(node), sink)
        # Threads that report at once race to store (a race of stores is no undefined behaviour in
        # LLVM's memory model; a racing load would read undef, but only Python reads, after the join).
        b.store(bad, target)
        return checked

    # ------------------------------------------------------------------ memory

    def address(self, view: View, idx: tuple[Ix, ...]) -> tuple[ir.Value, SizeLike, Loop | None]:
        """Scalar element offset for lane 0, the lane stride, and the vector loop the lanes follow."""
        b = self.b
        offset: ir.Value = self.size(view.offset)
        vector_loop: Loop | None = None
        lane_stride: SizeLike = 0
        for ix, size, stride in zip(idx, view.shape, view.strides, strict=True):
            if stride == 0 or size == 1:
                continue
            add = ix.add
            if isinstance(add, _AddLater):
                term = b.add(add.value, i64(add.amount))
            elif isinstance(add, int):
                term = None if add == 0 else i64(add)
            else:
                term = add
            if ix.loop is not None:
                term = ix.loop.var if term is None else b.add(ix.loop.var, term)
                if ix.loop.vector:
                    vector_loop = ix.loop
                    lane_stride = lane_stride + stride
            if term is not None:
                offset = b.add(offset, b.mul(term, self.size(stride)))
        return offset, lane_stride, vector_loop

    def load(self, view: View, idx: tuple[Ix, ...], dtype: np.dtype) -> Lane:
        b = self.b
        element, kind = _element_type(dtype)
        base = self.constant(view.base) if view.base.node.op.value == "constant" else self.pointer(view.base)
        offset, lane_stride, vector_loop = self.address(view, idx)
        if vector_loop is None or lane_stride == 0:
            loaded = b.load(gep(b, base, [offset], element), typ=element)
            return Lane(_widen_scalar(b, loaded, kind), 1, kind)
        if vector_loop.part is not None and lane_stride != 1:
            # A concat part's lanes, strided: each position clamped into the part (_lane_of), so
            # the reads of several windows over one source are the same scalar loads.
            return _packed(
                b, [self.load(view, tuple(_lane_of(b, ix, lane) for ix in idx), dtype) for lane in range(WIDTH)]
            )
        if vector_loop.part is not None:
            return self._load_part(base, offset, element, kind, vector_loop)
        mask = vector_loop.mask
        if lane_stride == 1:
            vec = ir.VectorType(element, WIDTH)
            pointer = gep(b, base, [offset], element)
            if mask is None:
                loaded = b.load(pointer, typ=vec, align=_alignment(element))
            else:  # the lanes past the range take lane 0's entry
                loaded = self._masked_load(pointer, vec, mask, splat(b, b.load(pointer, typ=element), WIDTH))
        elif isinstance(lane_stride, int) and 1 < lane_stride <= MAX_SPAN_STRIDE:
            loaded = self._load_span(base, offset, lane_stride, element, mask)
        else:
            lanes = [
                b.load(gep(b, base, [self._lane_offset(offset, lane, lane_stride, mask)], element), typ=element)
                for lane in range(WIDTH)
            ]
            loaded = _pack(b, lanes, element)
        return Lane(_widen_vector(b, loaded, kind), WIDTH, kind)

    def _load_span(
        self, base: ir.Value, offset: ir.Value, stride: int, element: ir.Type, mask: ir.Value | None
    ) -> ir.Value:
        """Lanes ``stride`` elements apart (a stride-2 window of a convolution or a pool) from the
        contiguous span that holds them: a few vector loads and one shuffle, where lane by lane
        they were 16 loads and 16 inserts. Only the span from the first to the last lane used is
        read (the last vector's loads masked past it; with a masked loop's ``mask``, past its
        last lane on), and lanes past the mask take lane 0's entry, as :meth:`load`'s do."""
        b = self.b
        vectors = -(-((WIDTH - 1) * stride + 1) // WIDTH)
        vec = ir.VectorType(element, WIDTH)
        parts = []
        for k in range(vectors):
            # Element e of the span is read if the lane at or after it is: ceil(e / stride).
            lanes = [-(-e // stride) if e <= (WIDTH - 1) * stride else None for e in range(WIDTH * k, WIDTH * (k + 1))]
            if mask is None:
                on: ir.Value = ir.Constant(I1_LANES, [lane is not None for lane in lanes])
            else:
                off = ir.Constant(I1_LANES, [False] * WIDTH)
                picks = ir.Constant(ir.VectorType(I32, WIDTH), [WIDTH if lane is None else lane for lane in lanes])
                on = b.shuffle_vector(mask, off, picks)
            # Not ``inbounds``: a vector whose lanes are all masked off may start past the buffer.
            pointer = gep(b, base, [b.add(offset, i64(WIDTH * k))], element, inbounds=False)
            parts.append(self._masked_load(pointer, vec, on, ir.Constant(vec, None)))
        while len(parts) & (len(parts) - 1) or len(parts) == 1:  # a power of two of at least two, to join in pairs
            parts.append(ir.Constant(vec, None))
        while len(parts) > 1:
            joined = ir.Constant(ir.VectorType(I32, 2 * parts[0].type.count), list(range(2 * parts[0].type.count)))
            parts = [b.shuffle_vector(parts[i], parts[i + 1], joined) for i in range(0, len(parts), 2)]
        picks = ir.Constant(ir.VectorType(I32, WIDTH), [j * stride for j in range(WIDTH)])
        loaded = b.shuffle_vector(parts[0], ir.Constant(parts[0].type, None), picks)
        if mask is None:
            return loaded
        first = b.shuffle_vector(loaded, ir.Constant(vec, None), ir.Constant(ir.VectorType(I32, WIDTH), [0] * WIDTH))
        return b.select(mask, loaded, first)

    def _load_part(self, base: ir.Value, offset: ir.Value, element: ir.Type, kind: str, lanes: Loop) -> Lane:
        """A contiguous load along a concat part's lanes (:attr:`Loop.part`) that reads nothing
        outside the part: one load masked to the lanes inside it (a masked-off lane is not read,
        so it cannot fault; away from the part's ends every lane is on). An unused lane of ints
        holds an entry of the part (a gather may take it as an id), never a value the part does
        not hold; of floats and bools, 0. (Strided reads clamp each lane into the part:
        :meth:`load`, :func:`_lane_of`.)"""
        b = self.b
        assert lanes.part is not None
        vec = ir.VectorType(element, WIDTH)
        if kind == "i":  # lane 0's position clamped into the part, for the unused lanes
            inside = b.sub(clamp(b, lanes.var, i64(0), b.sub(lanes.part, i64(1))), lanes.var)
            unused = splat(b, b.load(gep(b, base, [b.add(offset, inside)], element), typ=element), WIDTH)
        else:
            unused = ir.Constant(vec, None)
        # Not ``inbounds``: at a part's edge lane 0's address lies outside it.
        pointer = gep(b, base, [offset], element, inbounds=False)
        loaded = self._masked_load(pointer, vec, _lanes_inside(b, lanes.var, lanes.part), unused)
        return Lane(_widen_vector(b, loaded, kind), WIDTH, kind)

    def _masked_load(self, pointer: ir.Value, vec: ir.VectorType, mask: ir.Value, passthrough: ir.Value) -> ir.Value:
        """``llvm.masked.load``: the lanes of ``mask`` read from ``pointer`` (the others are not
        read, so they cannot fault), the others ``passthrough``'s."""
        load = intrinsic(self.module, f"llvm.masked.load.{_mangled(vec)}.p0", vec, [PTR, I32, I1_LANES, vec])
        return self.b.call(load, [pointer, ir.Constant(I32, _alignment(vec.element)), mask, passthrough])

    def store(self, view: View, idx: tuple[Ix, ...], lane: Lane, dtype: np.dtype) -> None:
        b = self.b
        element, kind = _element_type(dtype)
        base = self.pointer(view.base)
        offset, lane_stride, vector_loop = self.address(view, idx)
        if lane.width == 1 and vector_loop is not None and lane_stride != 0:
            lane = Lane(LaneMath(self, WIDTH).widen(lane), WIDTH, lane.kind)  # one value for every lane
        value = _narrow(b, lane.value, element, kind)
        mask = None if vector_loop is None else vector_loop.mask
        if vector_loop is None or lane.width == 1:
            b.store(value, gep(b, base, [offset], element))
        elif lane_stride == 1:
            align = 4 if element == F32 else 1
            if mask is None:
                b.store(value, gep(b, base, [offset], element), align=align)
            else:
                vec = value.type
                masked_store = intrinsic(
                    self.module, f"llvm.masked.store.{_mangled(vec)}.p0", VOID, [vec, PTR, I32, mask.type]
                )
                b.call(masked_store, [value, gep(b, base, [offset], element), ir.Constant(I32, align), mask])
        else:
            first = b.extract_element(value, ir.Constant(I32, 0))
            for i in range(WIDTH):
                scalar = b.extract_element(value, ir.Constant(I32, i))
                if mask is not None and i:  # a lane past the range stores lane 0's value again
                    scalar = b.select(b.extract_element(mask, ir.Constant(I32, i)), scalar, first)
                b.store(scalar, gep(b, base, [self._lane_offset(offset, i, lane_stride, mask)], element))

    def _lane_offset(self, offset: ir.Value, lane: int, lane_stride: SizeLike, mask: ir.Value | None) -> ir.Value:
        """Lane ``lane``'s element offset where lane 0's is ``offset``; lane 0's past a mask."""
        b = self.b
        if not lane:
            return offset
        at = b.add(offset, self.size(lane * lane_stride))
        return at if mask is None else b.select(b.extract_element(mask, ir.Constant(I32, lane)), at, offset)

    # ------------------------------------------------------------------ the kernel

    def emit_item(self, item: ir.Value, chunking: Chunking) -> None:
        """The body of one work item: its rows (and column range), evaluating and storing the root."""
        kernel, b = self.kernel, self.b
        assert kernel.root is not None and kernel.out is not None
        shape = kernel.out.shape
        flat = chunking.flat
        row_dims = shape if chunking.row_mode else shape[:-flat]
        columns = self.size(1 if chunking.row_mode else product(shape[-flat:]))
        if chunking.column_chunk:
            width = product(shape[-flat:])
            assert isinstance(width, int), "column chunks are planned for static rows only"
            per_row = -(-width // chunking.column_chunk)
            row = b.sdiv(item, i64(per_row), name="row")
            chunk = b.srem(item, i64(per_row))
            col0 = b.mul(chunk, i64(chunking.column_chunk), name="col0")
            col1 = smin(b, b.add(col0, i64(chunking.column_chunk)), columns)
            self.emit_row(row, row_dims, col0, col1, chunking.rest)
            return
        first = b.mul(item, i64(chunking.rows_per_item), name="row0")
        last = smin(b, b.add(first, i64(chunking.rows_per_item)), self.size(chunking.rows))

        def row_body(loop: Loop) -> None:
            self.stack.remove(loop)  # rows are not part of the nest the expressions see
            saved = self.memo
            self.memo = {}
            self.emit_row(loop.var, row_dims, i64(0), columns, chunking.rest)
            self.memo = saved
            self.stack.append(loop)

        self.loop(first, last, "row", False, row_body)

    def emit_row(
        self, row: ir.Value, row_dims: tuple[Dim, ...], col0: ir.Value, col1: ir.Value, tail: str = SCALAR_REST
    ) -> None:
        kernel, b = self.kernel, self.b
        assert kernel.root is not None and kernel.out is not None
        indices: list[Ix] = []
        rest = row
        for size in reversed(row_dims):
            indices.append(Ix(None, b.srem(rest, self.size(size)) if size != 1 else 0, 0))
            rest = b.sdiv(rest, self.size(size)) if size != 1 else rest
        row_idx = tuple(reversed(indices))
        out_dtype = kernel.out.base.dtype
        if len(row_dims) == len(kernel.out.shape):  # row mode: one element per row
            self.store(kernel.out, row_idx, self.eval(kernel.root, row_idx), out_dtype)
            return

        root, out = kernel.root, kernel.out

        # Trailing axes run as one flat loop (rlx.codegen.collapse): its position is the last
        # axis's entry, the others' are 0, and every address is the separate loops' one.
        folded = (ZERO,) * (len(kernel.out.shape) - len(row_dims) - 1)

        def body(loop: Loop) -> None:
            idx = (*row_idx, *folded, Ix(loop, 0, loop.level))
            self.store(out, idx, self.eval(root, idx), out_dtype)

        self.vector_and_rest(col0, col1, "col", body, tail)


@dataclass(frozen=True)
class Chunking:
    """How a fused kernel's index space is split into parallel work items."""

    row_mode: bool  # one output element per row (reductions over the last axis)
    rows: SizeLike  # rows of the index space (column-chunk mode: (row, chunk) pairs); a Size if symbolic
    rows_per_item: int
    column_chunk: int  # 0: whole rows per item
    flat: int = 1  # trailing axes the column loop runs as one (rlx.codegen.collapse)
    rest: str = SCALAR_REST  # how a row's last partial vector runs (see plan_chunking)

    @property
    def items(self) -> int | None:
        """Work items, or None when only a call knows (see :meth:`emit_items`)."""
        if not isinstance(self.rows, int):
            return None
        return -(-self.rows // self.rows_per_item)

    def emit_items(self, b: ir.IRBuilder, symbols: Mapping[str, ir.Value]) -> int | ir.Value:
        """The item count: an int, or computed at ``b`` from the call's symbols."""
        items = self.items
        if items is not None:
            return items
        return ceil_div(b, emit_size(b, self.rows, symbols), self.rows_per_item)


def plan_chunking(kernel: Kernel, schedule: Schedule, threads: int) -> Chunking:
    assert kernel.root is not None and kernel.out is not None
    shape = kernel.out.shape
    reduction = reduction_of(kernel.root)
    row_mode = not shape or shape[-1] == 1 or (reduction is not None and reduces_last_axis(reduction))
    flat = 1 if row_mode else flat_columns(schedule, kernel.root, kernel.out)
    rows = product(shape if row_mode else shape[:-flat])
    columns = product([] if row_mode else shape[-flat:])
    work = max(1, _work_per_element(kernel, schedule) * nominal(columns))
    # A row's last partial vector runs as one masked step where the scalar steps it replaces
    # cost more than the masks: measured on a Zen 3 core pair, a SiLU of rows of 24 and 12
    # floats 1.6x and 3.2x faster, a copy of rows of 24 1.15x slower (masked stores are slow
    # there), so only bodies that compute enough (:func:`_arithmetic`) take it. The others
    # end in one vector step that overlaps the last (where the row holds a vector): the 8
    # scalar steps after a row of 24 floats' vector step, each a load after the row's stores,
    # ran at a third of the vector steps' speed or worse; a copy of [16, 32, 3, 3, 24] rows of
    # 24 floats 3.0x faster, an im2col's window copies 1.3x, a convnet's training step 7%.
    if row_mode:
        rest = SCALAR_REST
    else:
        rest = MASKED_REST if _arithmetic(kernel, schedule) >= MASKED_REST_WORK else OVERLAPPED_REST
    if not isinstance(rows, int) or not isinstance(columns, int):  # sizes known per call: a fixed grain
        return Chunking(row_mode, rows, max(1, MIN_ITEM_ELEMENTS // work), 0, flat, rest)
    if not row_mode and rows < 2 * threads and columns >= 4 * WIDTH and threads > 1:
        chunk = max(WIDTH, -(-columns // (4 * threads)) // WIDTH * WIDTH)
        return Chunking(row_mode, rows * -(-columns // chunk), 1, chunk, flat, rest)
    rows_per_item = max(1, min(rows, max(MIN_ITEM_ELEMENTS // work, -(-rows // (8 * max(threads, 1))))))
    return Chunking(row_mode, rows, rows_per_item, 0, flat, rest)


MASKED_REST_WORK = 6  # see plan_chunking
MAX_SPAN_STRIDE = 4  # lanes 2 to this many elements apart load as a span (FusedEmitter._load_span)
I1_LANES = ir.VectorType(I1, WIDTH)
# Ops whose scalar formula calls the exp or the C math library, and the few dear ones.
_DEAR_OPS = {"div": 3, "sqrt": 3, "rsqrt": 3, "floor_divide": 3, "remainder": 3, "fmod": 3}
_TRANSCENDENTAL = frozenset(
    {"exp", "log", "log1p", "expm1", "sigmoid", "tanh", "silu", "gelu", "erf", "softplus", "pow", "sin", "cos"}
    | set(LIBM)
)


def _arithmetic(kernel: Kernel, schedule: Schedule) -> int:
    """A rough cost of one element of the kernel's body in scalar operations: transcendental
    functions 8, divisions and square roots 3, the rest 1, views and loads nothing."""
    assert kernel.root is not None

    def cost(op: str) -> int:
        return 8 if op in _TRANSCENDENTAL else _DEAR_OPS.get(op, 1)

    total = 0
    for value in inline_values(schedule, kernel.root):
        node = value.node
        op = node.op.value
        if op == "fused_elementwise":
            total += sum(cost(step.op) for step in node.attrs.program.steps)
        elif node.op.definition.scalar is not None:
            total += cost(op)
    return total


def _work_per_element(kernel: Kernel, schedule: Schedule) -> int:
    """A rough count of loop iterations per output element: 4, plus what inline reductions loop over."""
    assert kernel.root is not None
    work = 4
    for value in inline_values(schedule, kernel.root):
        node = value.node
        if node.op.value in ("sum", "max"):
            work += nominal(product(node.inputs[0].shape[a] for a in node.attrs.axes))
    return work


def _unit_reshape_index(idx: tuple[Ix, ...], shape: tuple[Dim, ...], source: tuple[Dim, ...]) -> tuple[Ix, ...]:
    """Map an index through a reshape that only adds or drops size-1 dimensions."""
    entries = [ix for ix, size in zip(idx, shape, strict=True) if size != 1]
    it = iter(entries)
    return tuple(ZERO if size == 1 else next(it) for size in source)


# ----------------------------------------------------------------------------- lane arithmetic


class LaneMath:
    """The emitter the ops' scalar formulas are written against (``OpDef.scalar``)."""

    def __init__(self, emitter: FusedEmitter, width: int) -> None:
        self.b = emitter.b
        self.module = emitter.module
        self.width = width

    def _ty(self, element: ir.Type) -> ir.Type:
        return element if self.width == 1 else ir.VectorType(element, self.width)

    def widen(self, lane: Lane) -> ir.Value:
        if lane.width == self.width:
            return lane.value
        return splat(self.b, lane.value, self.width)

    def const(self, x: float, like: ir.Value | None = None) -> ir.Constant:
        element = F32 if like is None else _scalar_type(like.type)
        value = float(x) if element == F32 else int(x)
        return ir.Constant(self._ty(element), value if self.width == 1 else [value] * self.width)

    def _suffix(self) -> str:
        return "f32" if self.width == 1 else f"v{self.width}f32"

    def _intrinsic(self, name: str, arity: int = 1) -> ir.Function:
        ty = self._ty(F32)
        return intrinsic(self.module, f"llvm.{name}.{self._suffix()}", ty, [ty] * arity)

    def add(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.fadd(a, b, flags=CONTRACT) if _is_float(a) else self.b.add(a, b)

    def sub(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.fsub(a, b, flags=CONTRACT) if _is_float(a) else self.b.sub(a, b)

    def mul(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.fmul(a, b, flags=CONTRACT) if _is_float(a) else self.b.mul(a, b)

    def div(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.fdiv(a, b)

    def neg(self, x: ir.Value) -> ir.Value:
        if _is_float(x):
            return self.b.fneg(x)
        return self.b.sub(ir.Constant(x.type, None), x)  # an integer (index arithmetic in a mod)

    def exp(self, x: ir.Value) -> ir.Value:
        return self.b.call(define_expf(self.module, self.width), [x])

    def sqrt(self, x: ir.Value) -> ir.Value:
        return self.b.call(self._intrinsic("sqrt"), [x])

    def abs(self, x: ir.Value) -> ir.Value:
        if _is_float(x):
            return self.b.call(self._intrinsic("fabs"), [x])
        zero = ir.Constant(x.type, None)  # an integer (index arithmetic in a mod): |x| by a select
        return self.b.select(self.b.icmp_signed("<", x, zero), self.b.sub(zero, x), x)

    def maximum(self, a: ir.Value, b: ir.Value) -> ir.Value:
        if _is_float(a):
            return self.b.call(self._intrinsic("maximum", 2), [a, b])
        return self.b.select(self.b.icmp_signed(">", a, b), a, b)

    def minimum(self, a: ir.Value, b: ir.Value) -> ir.Value:
        if _is_float(a):
            return self.b.call(self._intrinsic("minimum", 2), [a, b])
        return self.b.select(self.b.icmp_signed("<", a, b), a, b)

    def compare(self, predicate: str, a: ir.Value, b: ir.Value) -> ir.Value:
        if _is_float(a):
            if predicate == "!=":
                return self.b.fcmp_unordered("!=", a, b)  # NaN != NaN, as in NumPy
            return self.b.fcmp_ordered(predicate, a, b)
        if _scalar_type(a.type) == I1:
            return self.b.icmp_unsigned(predicate, a, b)
        return self.b.icmp_signed(predicate, a, b)

    def logical(self, kind: str, a: ir.Value, b: ir.Value | None = None) -> ir.Value:
        """``and``, ``or``, ``xor`` and ``not`` of bools (i1 lanes) or, bit by bit, of ints."""
        if kind == "not":
            ones = 1 if _scalar_type(a.type) == I1 else -1
            return self.b.xor(a, ir.Constant(a.type, ones if self.width == 1 else [ones] * self.width))
        assert b is not None
        if kind == "xor":
            return self.b.xor(a, b)
        return self.b.and_(a, b) if kind == "and" else self.b.or_(a, b)

    def shift(self, kind: str, a: ir.Value, b: ir.Value) -> ir.Value:
        """NumPy's ``<<`` and ``>>`` (arithmetic) on int lanes (64-bit; an int32 result wraps
        after, which also makes shifts by 32 to 63 right for int32). Amounts outside [0, 64)
        give 0 to the left and the sign's fill to the right, as NumPy's do, never LLVM's poison."""
        bld = self.b
        bits = self.const(64, a)
        inside = bld.icmp_unsigned("<", b, bits)
        if kind == "left":
            return bld.select(inside, bld.shl(a, bld.select(inside, b, self.const(0, a))), self.const(0, a))
        return bld.ashr(a, bld.select(inside, b, self.const(63, a)))

    def select(self, cond: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.select(cond, a, b)

    def wrapped(self, x: ir.Value, dtype: np.dtype) -> ir.Value:
        """An op's result as ``dtype`` holds it: int32 lanes are computed in i64, so an int32
        result wraps to 32 bits here, as NumPy's int32 arithmetic does, before the next op
        reads it (``x * 65536 * 65536`` is 0, not ``2**32 * x``)."""
        if dtype != np.int32 or _scalar_type(x.type) != I64:
            return x
        return self.b.sext(self.b.trunc(x, self._ty(I32)), self._ty(I64))

    def rounded(self, mode: str, x: ir.Value) -> ir.Value:
        """``floor``, ``ceil``, ``trunc`` or ``roundeven`` (NumPy's ``round``: halves to even)."""
        return self.b.call(self._intrinsic(mode), [x])

    def floor_divide(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self._divmod(a, b)[0]

    def remainder(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self._divmod(a, b)[1]

    def fmod(self, a: ir.Value, b: ir.Value) -> ir.Value:
        """C's ``fmod``: the remainder of the quotient rounded toward 0, the dividend's sign (ints:
        0 where the divisor is 0, as NumPy; no trap for ``min % -1``)."""
        bld = self.b
        if _is_float(a):
            return bld.frem(a, b)
        zero = ir.Constant(a.type, None)
        unsafe = bld.or_(bld.icmp_signed("==", b, zero), bld.icmp_signed("==", b, self.const(-1, a)))
        return bld.select(unsafe, zero, bld.srem(a, bld.select(unsafe, self.const(1, a), b)))

    def _divmod(self, a: ir.Value, b: ir.Value) -> tuple[ir.Value, ir.Value]:
        """Python's and NumPy's ``divmod``: the quotient rounded toward -inf, the remainder with
        the divisor's sign. Floats as NumPy's ``npy_divmod`` (from ``fmod``, so ``1 // 0.1`` is 9);
        ints as NumPy's, where division by 0 gives 0 and ``min // -1`` wraps (no trap: the
        hardware divides by neither)."""
        bld = self.b
        zero = ir.Constant(a.type, None)
        if not _is_float(a):
            one, minus_one = self.const(1, a), self.const(-1, a)
            by_zero, by_minus_one = bld.icmp_signed("==", b, zero), bld.icmp_signed("==", b, minus_one)
            safe = bld.select(bld.or_(by_zero, by_minus_one), one, b)
            quotient, rest = bld.sdiv(a, safe), bld.srem(a, safe)
            flip = bld.and_(
                bld.icmp_signed("!=", rest, zero),
                bld.xor(bld.icmp_signed("<", rest, zero), bld.icmp_signed("<", b, zero)),
            )
            quotient = bld.select(flip, bld.sub(quotient, one), quotient)
            rest = bld.select(flip, bld.add(rest, b), rest)
            quotient = bld.select(by_minus_one, bld.sub(zero, a), quotient)
            return bld.select(by_zero, zero, quotient), rest
        one = self.const(1.0)
        rest = bld.frem(a, b)
        quotient = bld.fdiv(bld.fsub(a, rest), b)
        flip = bld.and_(
            bld.fcmp_ordered("!=", rest, zero),
            bld.xor(bld.fcmp_ordered("<", b, zero), bld.fcmp_ordered("<", rest, zero)),
        )
        rest = bld.select(flip, bld.fadd(rest, b), rest)
        quotient = bld.select(flip, bld.fsub(quotient, one), quotient)
        copysign = self._intrinsic("copysign", 2)
        rest = bld.select(bld.fcmp_ordered("==", rest, zero), bld.call(copysign, [zero, b]), rest)
        whole = self.rounded("floor", quotient)
        whole = bld.select(
            bld.fcmp_ordered(">", bld.fsub(quotient, whole), self.const(0.5)), bld.fadd(whole, one), whole
        )
        whole = bld.select(bld.fcmp_ordered("==", quotient, zero), bld.call(copysign, [zero, bld.fdiv(a, b)]), whole)
        return bld.select(bld.fcmp_ordered("==", b, zero), bld.fdiv(a, b), whole), rest

    def convert(self, x: ir.Value, dtype: np.dtype) -> ir.Value:
        """``x`` (lanes of f32, i1 or i64) as lanes of ``dtype``'s kind: f32, i1 (bool) or i64
        (int32 and int64 alike, an int32 wrapped or saturated to its range first)."""
        b, source = self.b, _scalar_type(x.type)
        if dtype == np.bool_:
            if source == F32:
                return b.fcmp_unordered("!=", x, self.const(0.0))  # NaN is True, as in NumPy
            return x if source == I1 else b.icmp_signed("!=", x, ir.Constant(x.type, None))
        if dtype == np.float32:
            return b.uitofp(x, self._ty(F32)) if source == I1 else b.sitofp(x, self._ty(F32))
        element = I32 if dtype == np.int32 else I64
        if source == I1:
            return b.zext(x, self._ty(I64))
        if source == F32:  # toward zero, saturating, NaN to 0 (the reference's rule)
            width = "" if self.width == 1 else f"v{self.width}"
            fn = intrinsic(
                self.module,
                f"llvm.fptosi.sat.{width}{'i32' if element == I32 else 'i64'}.{self._suffix()}",
                self._ty(element),
                [self._ty(F32)],
            )
            narrow = b.call(fn, [x])
        else:
            narrow = x if element == I64 else b.trunc(x, self._ty(I32))  # int64 to int32 wraps
        return narrow if element == I64 else b.sext(narrow, self._ty(I64))

    def tanh(self, x: ir.Value) -> ir.Value:
        """Vectorised tanh: an odd Taylor polynomial below |x| = 0.25 (no cancellation there), else
        ``sign(x) (1 - e) / (1 + e)`` with ``e = exp(-2|x|)``; within a few ulp of tanhf, NaN kept."""
        b = self.b
        ax = self.abs(x)
        x2 = b.fmul(x, x)
        poly = self.const(62.0 / 2835.0)
        for coefficient in (-17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0, 1.0):
            poly = b.fadd(b.fmul(poly, x2, flags=CONTRACT), self.const(coefficient), flags=CONTRACT)
        small = b.fmul(x, poly)
        # -2|x| <= 0 (or NaN): the exp without overflow handling, half the operations
        e = b.call(define_softmax_expf(self.module, self.width), [b.fmul(ax, self.const(-2.0))])
        large = b.fdiv(b.fsub(self.const(1.0), e), b.fadd(self.const(1.0), e))
        copysign = intrinsic(self.module, f"llvm.copysign.{self._suffix()}", self._ty(F32), [self._ty(F32)] * 2)
        large = b.call(copysign, [large, x])
        return b.select(b.fcmp_unordered("<", ax, self.const(0.25)), small, large)

    def erf(self, x: ir.Value) -> ir.Value:
        """Vectorised erf: ``x + x P(x²)`` below |x| = 0.875 (a minimax polynomial, no cancellation),
        else ``sign(x) (1 - exp(-Q(|x|)))`` with Q fitted to ``-log erfc`` on [0.875, 4] (erf is 1
        in float32 beyond 4). Within a few ulp of erff; NaN kept."""
        b = self.b
        ax = self.abs(x)
        s = b.fmul(x, x)
        poly = self.const(-5.96761703e-4)
        for coefficient in (4.99119423e-3, -2.67681349e-2, 1.12819925e-1, -3.76125336e-1, 1.28379166e-1):
            poly = b.fadd(b.fmul(poly, s, flags=CONTRACT), self.const(coefficient), flags=CONTRACT)
        small = b.fadd(b.fmul(poly, x, flags=CONTRACT), x, flags=CONTRACT)
        t = self.minimum(ax, self.const(4.0))
        q = self.const(_ERF_TAIL[-1])
        for coefficient in reversed(_ERF_TAIL[:-1]):
            q = b.fadd(b.fmul(q, t, flags=CONTRACT), self.const(coefficient), flags=CONTRACT)
        large = b.fsub(self.const(1.0), self.exp(self.neg(q)))
        copysign = intrinsic(self.module, f"llvm.copysign.{self._suffix()}", self._ty(F32), [self._ty(F32)] * 2)
        large = b.call(copysign, [large, x])
        return b.select(b.fcmp_ordered("<", ax, self.const(0.875)), small, large)

    def call(self, name: str, *args: ir.Value) -> ir.Value:
        """A C math library function, lane by lane (log and pow are off the hot paths)."""
        fn = declare(self.module, LIBM[name], F32, [F32] * len(args))
        if self.width == 1:
            return self.b.call(fn, list(args))
        lanes = []
        for i in range(self.width):
            lane = ir.Constant(I32, i)
            lanes.append(self.b.call(fn, [self.b.extract_element(a, lane) for a in args]))
        return _pack(self.b, lanes, F32)


# ----------------------------------------------------------------------------- helpers


def _mangled(vector: ir.Type) -> str:
    """An LLVM intrinsic's name suffix for a vector type: ``v16f32``, ``v16i64``."""
    element = vector.element  # type: ignore[attr-defined]
    return f"v{vector.count}{'f32' if element == F32 else f'i{element.width}'}"  # type: ignore[attr-defined]


def _is_float(value: ir.Value) -> bool:
    return _scalar_type(value.type) == F32


def _scalar_type(ty: ir.Type) -> ir.Type:
    return ty.element if isinstance(ty, ir.VectorType) else ty


def _element_type(dtype: np.dtype) -> tuple[ir.Type, str]:
    """The stored type of ``dtype`` and the kind of lane it loads as."""
    return element_type(dtype), np.dtype(dtype).kind  # "f", "b" or "i"


def _scalar_constant(value: Value) -> Lane:
    """A one-element constant as an immediate, as a load would widen it: LLVM folds it into the
    instructions that use it (a shift by 13 becomes one with an immediate count, ``x * 0.5`` a
    multiply by a constant), where a load from the constant's data, through the address
    arithmetic, stayed a load and a broadcast per use: the 20 rounds of a Threefry hash took 387
    broadcasts and 0.6 s of machine code."""
    kind = value.dtype.kind
    scalar = value.node.attrs.value.array.reshape(-1)[0]
    if kind == "f":
        return Lane(ir.Constant(F32, float(scalar)), 1, kind)
    return Lane(ir.Constant(I1 if kind == "b" else I64, int(scalar)), 1, kind)


def _widen_scalar(b: ir.IRBuilder, loaded: ir.Value, kind: str) -> ir.Value:
    if kind == "b":
        return b.icmp_unsigned("!=", loaded, ir.Constant(I8, 0))
    if kind == "i" and loaded.type != I64:
        return b.sext(loaded, I64)
    return loaded


def _widen_vector(b: ir.IRBuilder, loaded: ir.Value, kind: str) -> ir.Value:
    if kind == "b":
        return b.icmp_unsigned("!=", loaded, ir.Constant(loaded.type, [0] * WIDTH))
    if kind == "i" and loaded.type.element != I64:
        return b.sext(loaded, ir.VectorType(I64, WIDTH))
    return loaded


def _narrow(b: ir.IRBuilder, value: ir.Value, element: ir.Type, kind: str) -> ir.Value:
    if kind == "f":
        return value
    vector = isinstance(value.type, ir.VectorType)
    target = ir.VectorType(element, WIDTH) if vector else element
    if kind == "b":
        return b.zext(value, target)
    return value if value.type == target else b.trunc(value, target)


def _pack(b: ir.IRBuilder, lanes: list[ir.Value], element: ir.Type) -> ir.Value:
    vector: ir.Value = ir.Constant(ir.VectorType(element, len(lanes)), ir.Undefined)
    for i, lane in enumerate(lanes):
        vector = b.insert_element(vector, lane, ir.Constant(I32, i))
    return vector


def _alignment(element: ir.Type) -> int:
    """The alignment a load or store of ``element`` lanes may assume: its own size (f32 4, an
    int its bytes, bools 1)."""
    return 4 if element == F32 else max(1, element.width // 8)


def _lanes_inside(b: ir.IRBuilder, first: ir.Value, size: ir.Value) -> ir.Value:
    """The lanes ``j`` of a vector whose lane 0 is at position ``first`` (an i64) that lie in
    ``[0, size)``, as a ``<WIDTH x i1>``. Compared in 32-bit lanes (half the vector registers of
    64-bit ones), the bounds clamped to ``[0, WIDTH]`` first."""
    numbers = ir.Constant(ir.VectorType(I32, WIDTH), list(range(WIDTH)))
    low = b.trunc(clamp(b, b.neg(first), i64(0), i64(WIDTH)), I32)
    stop = b.trunc(clamp(b, b.sub(size, first), i64(0), i64(WIDTH)), I32)
    after_low = b.icmp_signed(">=", numbers, splat(b, low, WIDTH))
    return b.and_(after_low, b.icmp_signed("<", numbers, splat(b, stop, WIDTH)))


def _packed(b: ir.IRBuilder, lanes: list[Lane]) -> Lane:
    """Scalar reads (one a lane: f32, or an int or bool table's i64 / i1) as one vector."""
    values = [lane.value for lane in lanes]
    return Lane(_pack(b, values, values[0].type), WIDTH, lanes[0].kind)


def _replace(idx: tuple[Ix, ...], axis: int, entry: Ix) -> tuple[Ix, ...]:
    return (*idx[:axis], entry, *idx[axis + 1 :])


def _part_starts(value: Value) -> list[SizeLike]:
    """Where each part of a concat starts along its axis (symbolic after a symbolic part)."""
    axis = value.node.attrs.axis
    parts = value.node.inputs
    return [total([part.shape[axis] for part in parts[:i]]) for i in range(len(parts))]


def _lane_of(b: ir.IRBuilder, ix: Ix, lane: int) -> Ix:
    """One lane of a vector index as a scalar index (the loop variable is lane 0's position)."""
    if ix.loop is None or not ix.loop.vector:
        return ix
    position = b.add(ix.loop.var, i64(lane))
    if ix.loop.mask is not None and lane:  # past the range: lane 0's position
        position = b.select(b.extract_element(ix.loop.mask, ir.Constant(I32, lane)), position, ix.loop.var)
    if ix.loop.part is not None:  # a concat part's lanes: its positions (the others are unused)
        position = clamp(b, position, i64(0), b.sub(ix.loop.part, i64(1)))
    if isinstance(ix.add, _AddLater):
        position = b.add(position, b.add(ix.add.value, i64(ix.add.amount)))
    elif isinstance(ix.add, int):
        position = b.add(position, i64(ix.add))
    else:
        position = b.add(position, ix.add)
    return Ix(None, position, ix.level)


__all__ = ["Chunking", "FusedEmitter", "LaneMath", "plan_chunking"]
