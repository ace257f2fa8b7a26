"""Which values get memory, and which kernels one call runs, in what order.

The rule is the one of inductor and tinygrad schedulers: a value is *materialised* (gets a
buffer) only where something needs memory: a graph input or output, a constant, the operands and
results of ops that call out of the loop nest (``matmul`` via BLAS, attention, scatter-adds,
``concat``). Everything else, elementwise ops, broadcasts, reductions, and the view ops over
them, is computed inline inside the loop nest of the materialised value that reads it
(:mod:`rlx.codegen.fused`), so its intermediates live in registers. View ops over a buffer
(reshape, transpose, split, broadcast_to, unfold) are strided views of it (:mod:`rlx.codegen.views`):
they cost nothing unless strides cannot express them, in which case the view is copied once.
An inline value that several kernels would each recompute at more cost than storing it once
(a residual stream read along a deep network) gets a buffer too.

One kernel per materialised value (or per node for the ops with their own lowering), in the
graph's topological order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlx.codegen.lower_gemm import blas_reads_in_place
from rlx.codegen.lower_linalg import LINALG_OPS
from rlx.codegen.sizes import SizeLike, size_of
from rlx.codegen.views import View
from rlx.errors import RlxValueError
from rlx.ir.dims import total
from rlx.ir.graph import Graph, Node, Value
from rlx.ir.ops import OpKind
from rlx.ir.types import Layout
from rlx.ops.flex_attention import flex_slots

# Ops lowered by a kernel of their own; their results and operands are buffers.
CALL_OUT_OPS = frozenset(
    {
        "matmul",
        "attention",
        "attention_bwd",
        "flex_attention",
        "flex_attention_bwd",
        "embedding_grad",
        "scatter_add_along_axis",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "logcumsumexp",
        "sort",
        *LINALG_OPS,
    }
)
VIEW_OPS = frozenset({"reshape", "transpose", "split", "broadcast_to", "unfold"})
REDUCE_OPS = frozenset({"sum", "max"})
LEAF_OPS = frozenset({"input", "constant"})
EXACT_COMPARISONS = frozenset({"equal", "not_equal"})
SHARED_EXPRESSION_COST = 3  # see _materialise_shared_expressions
WINDOWED_EXPRESSION_COST = 12  # see _materialise_windowed_expressions


@dataclass(frozen=True)
class Kernel:
    """One step of a call.

    A fused kernel evaluates ``root`` at every index of ``out`` (a view of a buffer: the root's
    own, or a slice of a ``concat``'s) as one loop nest. Otherwise (``root`` None) it is the
    node's own lowering (BLAS matmul, attention, scatter-add).
    """

    node: Node
    root: Value | None
    out: View | None
    reads: tuple[Value, ...]  # the materialised values whose buffers it reads

    @property
    def computes(self) -> tuple[Value, ...]:
        """The values this kernel writes (the memory plan's liveness starts here)."""
        if self.root is None:
            return self.node.outputs
        assert self.out is not None
        return (self.out.base,)


@dataclass
class Schedule:
    order: list[Node]
    materialised: set[Value]
    kernels: list[Kernel]
    views: dict[Value, View | None] = field(default_factory=dict)

    def view(self, value: Value) -> View | None:
        """The strided view of a buffer that holds ``value``, or None if it is computed inline."""
        if value in self.views:
            return self.views[value]
        node = value.node
        result: View | None
        if value in self.materialised or node.op.value in LEAF_OPS:
            result = View.dense(value)
        elif node.op.value in VIEW_OPS:
            source = self.view(node.inputs[0])
            result = None if source is None else apply_view_op(node, value.index, source)
        elif node.op.value == "barrier":
            # x once `after` is computed: where x has a buffer, that buffer (a checkpoint's
            # recomputation reads its input in place, not a copy of it). The kernels run in the
            # nodes' order, which puts every reader after `after`; an x computed inline is
            # computed by the barrier's own loop nest, which reads `after` too.
            result = self.view(node.inputs[0])
        else:
            result = None
        self.views[value] = result
        return result


def apply_view_op(node: Node, index: int, source: View) -> View | None:
    """The view ``node`` (a view op) makes of ``source``; None if strides cannot express it."""
    op, attrs = node.op.value, node.attrs
    if op == "transpose":
        return source.transpose(attrs.perm)
    if op == "broadcast_to":
        return source.broadcast_to(attrs.shape)
    if op == "split":
        return source.slice(attrs.axis, split_start(node, index), attrs.sizes[index])
    if op == "reshape":
        return source.reshape(attrs.shape)
    if op == "unfold":
        return source.unfold(attrs.axis, attrs.size, attrs.step)
    raise AssertionError(op)


def split_start(node: Node, index: int) -> SizeLike:
    """Where part ``index`` of a split starts along its axis (symbolic after a symbolic part)."""
    return total(node.attrs.sizes[:index])


def is_unit_reshape(node: Node) -> bool:
    """A reshape that only inserts or removes size-1 dimensions (index mapping without division)."""
    before = [d for d in node.inputs[0].shape if d != 1]
    after = [d for d in node.attrs.shape if d != 1]
    return before == after


def build_schedule(graph: Graph, order: Sequence[Node] | None = None) -> Schedule:
    """Decide the buffers and the kernels of ``graph`` (already decomposed into primitives)."""
    order = list(graph.nodes if order is None else order)
    for node in order:
        if node.op.definition.decompose is not None:
            raise RlxValueError(
                f"codegen: {node.op} (node {node.id}) must be decomposed first (run the decompose pass)"
            )
    schedule = Schedule(order, set(), [])
    materialised = schedule.materialised

    def materialise(value: Value) -> None:
        materialised.add(value)
        schedule.views.clear()  # views cached as None may now exist

    def needs_buffer(value: Value) -> None:
        """Make ``value`` readable as a strided view of some buffer."""
        if schedule.view(value) is not None:
            return
        node = value.node
        if node.op.value in VIEW_OPS:
            needs_buffer(node.inputs[0])
            schedule.views.clear()
            if schedule.view(value) is not None:
                return
        materialise(value)

    for value in graph.outputs.values():
        if value.node.op is not OpKind.INPUT:
            materialise(value)
    # A later decision can change an earlier one's view (a view op's operand that gets its own
    # buffer makes new strides), so decide to a fixpoint: each round only adds buffers.
    while True:
        before = len(materialised)
        _decide_buffers(schedule, order, materialise, needs_buffer)
        _materialise_row_statistics_of_column_reductions(schedule, materialise)
        _materialise_reductions_inside_loops_they_skip(schedule, order, materialise)
        if len(materialised) == before:
            _materialise_shared_expressions(schedule, order, materialise)
        if len(materialised) == before:
            break

    for node in order:
        op = node.op.value
        if op == "input":
            continue
        if op in CALL_OUT_OPS:
            reads = tuple(dict.fromkeys(_base(schedule, v) for v in node.inputs))
            schedule.kernels.append(Kernel(node, None, None, reads))
        elif op == "concat" and node.outputs[0] in materialised:
            whole = View.dense(node.outputs[0])
            start: SizeLike = 0
            for part in node.inputs:
                out = whole.slice(node.attrs.axis, start, part.shape[node.attrs.axis])
                start = start + size_of(part.shape[node.attrs.axis])
                schedule.kernels.append(Kernel(node, part, out, inline_reads(schedule, part)))
        else:
            for value in node.outputs:
                if value in materialised:
                    reads = inline_reads(schedule, value, own=True)
                    schedule.kernels.append(Kernel(node, value, View.dense(value), reads))
    return schedule


def _decide_buffers(schedule: Schedule, order: list[Node], materialise, needs_buffer) -> None:  # type: ignore[no-untyped-def]
    """One round of the buffer rules over every node (see the module docstring)."""
    for node in order:
        op = node.op.value
        if op in CALL_OUT_OPS:
            for value in node.outputs:
                if value not in schedule.materialised:
                    materialise(value)
            for index, operand in enumerate(node.inputs):
                needs_buffer(operand)
                view = schedule.view(operand)
                assert view is not None
                if not operand_fits(node, index, view):
                    materialise(operand)  # copied once into a dense buffer
        elif op == "concat" and node.attrs.axis == len(node.outputs[0].shape) - 1:
            # Joined along the last axis (the vector lanes' axis), a part changes within a
            # vector: written once by its parts' kernels. Along another axis a concat is read
            # inline, the part each index falls in (a slice's or a pad's gradient costs no copy).
            if node.outputs[0] not in schedule.materialised:
                materialise(node.outputs[0])
        elif op in ("embedding", "take_along_axis"):
            needs_buffer(node.inputs[0])  # table rows (entries) are loaded at ids computed inline
        elif op in EXACT_COMPARISONS:
            # ``x == max(x)`` (a max's gradient) holds only if both sides see the same bits of x:
            # x recomputed inline in two kernels may round differently (a reduction inside it),
            # so a float operand computed inline gets a buffer, computed once.
            for operand in node.inputs:
                if operand.type.dtype.kind == "f" and schedule.view(operand) is None:
                    needs_buffer(operand)
        elif op == "unfold":
            # Windows that overlap are strides over a buffer, not an index computed inline.
            needs_buffer(node.inputs[0])
        elif op == "reshape" and not is_unit_reshape(node):
            # A general reshape would divide indices: read it as a view of a buffer instead,
            # copying the operand densely first if strides cannot express the reshape.
            needs_buffer(node.inputs[0])
            source = schedule.view(node.inputs[0])
            if source is None or source.reshape(node.attrs.shape) is None:
                materialise(node.inputs[0])


def reduction_of(value: Value) -> Node | None:
    """The sum/max node ``value`` is (through unit reshapes), or None."""
    node = value.node
    while node.op.value == "reshape" and is_unit_reshape(node):
        node = node.inputs[0].node
    return node if node.op.value in REDUCE_OPS else None


def reduces_last_axis(node: Node) -> bool:
    """A sum/max node that reduces its operand's last axis (a row reduction)."""
    return len(node.inputs[0].shape) - 1 in node.attrs.axes


def _materialise_row_statistics_of_column_reductions(schedule: Schedule, materialise) -> None:  # type: ignore[no-untyped-def]
    """Give a buffer to each row reduction read inside a column reduction.

    A column reduction (a norm weight's gradient: a sum over every axis but the last) loops over
    rows inside each block of columns; a row statistic computed inline there would be recomputed
    for every block. Materialised once, it is a load.
    """
    for root in list(schedule.materialised):  # build_schedule repeats this until nothing changes
        outer = reduction_of(root)
        if outer is None or reduces_last_axis(outer) or root.node.op.value in LEAF_OPS:
            continue
        pending, seen = list(outer.inputs), set()
        while pending:
            value = pending.pop()
            if value in seen or schedule.view(value) is not None:
                continue
            seen.add(value)
            inner = reduction_of(value)
            if inner is not None and reduces_last_axis(inner):
                materialise(value)
                continue
            pending.extend(value.node.inputs)


def _materialise_reductions_inside_loops_they_skip(schedule: Schedule, order: list[Node], materialise) -> None:  # type: ignore[no-untyped-def]
    """Give a buffer to each reduction read inline whose result skips an outer axis.

    A loop nest runs over its output's axes in order and evaluates an inline value in the
    innermost loop its index uses, once per iteration of every loop outside that one. A row
    statistic (kept axes leading: a softmax's max, a norm's mean) uses every loop outside its
    own, so it is computed once per row. A reduction whose kept axes are not leading is not: a
    batch norm's per-channel sum read by the ``[N, C, H, W]`` gradient was recomputed for every
    ``n`` (16 times over in a ResNet's backward: 0.9 s instead of 50 ms), and a whole-tensor
    mean in ``x - mean(x)`` once per row. Stored once, each is a load.
    """
    for root in _kernel_roots(schedule, order):
        if all(d == 1 for d in root.shape):
            continue  # one element (a loss): nothing is computed twice
        for value in inline_values(schedule, root)[1:]:
            node = reduction_of(value)
            if node is None:
                continue
            rank = len(node.inputs[0].shape)
            kept = [axis for axis in range(rank) if axis not in node.attrs.axes]
            if not kept or kept != list(range(len(kept))):
                materialise(value)


def _kernel_roots(schedule: Schedule, order: list[Node]) -> list[Value]:
    """The values whose loop nests the kernels will run: each materialised value computed by a
    loop nest, and each part a materialised concat copies in."""
    roots: list[Value] = []
    for node in order:
        op = node.op.value
        if op in LEAF_OPS or op in CALL_OUT_OPS:
            continue
        if op == "concat" and node.outputs[0] in schedule.materialised:
            roots.extend(part for part in node.inputs if part not in schedule.materialised)
        else:
            roots.extend(value for value in node.outputs if value in schedule.materialised)
    return roots


def _materialise_shared_expressions(schedule: Schedule, order: list[Node], materialise) -> None:  # type: ignore[no-untyped-def]
    """Give a buffer to an inline value that several kernels would each recompute.

    An inline value is free where one kernel reads it; where several do, each recomputes it and
    reads every buffer it reads. Along a chain, a transformer's residual stream
    ``x_l = x_(l-1) + f_l``, every later kernel recomputed the whole chain: O(L^2) work, code and
    compile time in the depth L (16 layers of the char LM: kernels of 3,400 lines, 26 s to
    compile). Counting memory passes, a value read inline by ``c`` kernels that reads ``r``
    buffers of its own size costs ``c * r`` passes; stored once, ``r + c`` passes, a store and a
    kernel more. It is stored where ``(c - 1) * (r - 1) >= SHARED_EXPRESSION_COST``: a sum of
    four such buffers read by two kernels, or of two read by four. Smaller reads (weights, row
    statistics, constants) are cheap to repeat and do not count; views stay inline (their operand
    is the one to store).
    """
    kernels_computing: dict[Value, int] = {}
    for root in _kernel_roots(schedule, order):
        for value in inline_values(schedule, root)[1:]:
            kernels_computing[value] = kernels_computing.get(value, 0) + 1
    candidates = {
        value: count
        for value, count in kernels_computing.items()
        if count >= 2 and value.node.op.value not in VIEW_OPS and value.node.op.value not in LEAF_OPS
    }
    stored = False
    for value, count in candidates.items():
        if (count - 1) * (_full_size_reads(schedule, value) - 1) >= SHARED_EXPRESSION_COST:
            materialise(value)
            stored = True
    if not stored:
        _materialise_windowed_expressions(schedule, candidates, materialise)


def _materialise_windowed_expressions(schedule: Schedule, candidates: dict[Value, int], materialise) -> None:  # type: ignore[no-untyped-def]
    """Give a buffer to an inline value that reads many windows of one buffer and that several
    kernels recompute.

    The rule above counts buffers, so a sum of 49 shifted windows of one padded input (a 7x7
    depthwise convolution) counts once, and its gradient's 49 weight reductions each
    recomputed the whole convolution: 49 x 49 loads per element. Windows of one buffer mostly
    hit the same cache lines, so here each distinct view counts, at a higher bar
    (``WINDOWED_EXPRESSION_COST``), and only the outermost such value is stored in a round (the
    values inside it are then computed by its kernel alone; the next round looks again).
    """
    chosen = [
        value
        for value, count in candidates.items()
        if (count - 1) * (_full_size_views(schedule, value) - 1) >= WINDOWED_EXPRESSION_COST
    ]
    inside: set[Value] = set()
    for value in chosen:
        inside.update(inline_values(schedule, value)[1:])
    for value in chosen:
        if value not in inside:
            materialise(value)


def _full_size_views(schedule: Schedule, value: Value) -> int:
    """Distinct views of buffers at least as large as ``value`` that its inline expression loads."""
    count = 0
    for inner in inline_values(schedule, value):
        for operand in inner.node.inputs:
            view = schedule.view(operand)
            if view is not None and operand.node.op.value != "constant" and _as_large(view.base, value):
                count += 1
    return count


def _full_size_reads(schedule: Schedule, value: Value) -> int:
    """Buffers ``value``'s inline expression reads that are at least as large as ``value``
    (symbolic sizes count as large)."""
    if not value.type.is_static:
        return len(inline_reads(schedule, value))
    return sum(
        1 for base in inline_reads(schedule, value) if base.node.op.value != "constant" and _as_large(base, value)
    )


def _as_large(base: Value, value: Value) -> bool:
    """Whether buffer ``base`` holds at least as many elements as ``value`` (symbolic sizes count as large)."""
    if not value.type.is_static or not base.type.is_static:
        return True
    return math.prod(base.static_shape) >= math.prod(value.static_shape)


def _base(schedule: Schedule, value: Value) -> Value:
    view = schedule.view(value)
    assert view is not None, value
    return view.base


def operand_fits(node: Node, index: int, view: View) -> bool:
    """Whether the lowering of ``node`` reads its operand ``index`` through this view in place."""
    op = node.op.value
    if op == "matmul":
        return blas_reads_in_place(view)
    if op in ("attention", "attention_bwd") and index < (4 if op == "attention_bwd" else 3):
        return view.is_dense or attention_reads_in_place(view, node.attrs.layout)
    if op in ("flex_attention", "flex_attention_bwd"):
        slots = flex_slots(node.attrs)  # q, k, v and dy go through their strides; out, lse dense
        if index < len(slots) and slots[index] in ("q", "k", "v", "dy"):
            return view.is_dense or attention_reads_in_place(view, node.attrs.layout)
    return view.is_dense  # masks, captured tensors and scatter-add index dense rows


MAX_ROW_STRIDE = 2**31 - 1  # BLAS takes 32-bit leading dimensions


def attention_reads_in_place(view: View, layout: Layout) -> bool:
    """Whether the fixed attention kernels read a q, k, v or dy view in place: static heads,
    widths and offset, adjacent elements in a row, rows at least a row apart (BLAS's leading
    dimension), heads anywhere, batches anywhere or, with a symbolic length, a whole number of
    rows per position apart (:class:`~rlx.codegen.lower_attention.OperandStrides`)."""
    if len(view.shape) != 4 or not isinstance(view.offset, int) or view.offset < 0:
        return False
    _, seq, heads, width = layout.split(view.shape)
    _, row, head, unit = layout.split(view.strides)
    static = (heads, width, row, head, unit)
    numbers = [x for x in static if isinstance(x, int) and x >= 0]
    if len(numbers) != len(static) or attention_batch_stride(view, layout) is None:
        return False
    _, width, row, _, unit = numbers
    rows_apart = seq == 1 or width <= row <= MAX_ROW_STRIDE
    return (width == 1 or unit == 1) and rows_apart


def attention_batch_stride(view: View, layout: Layout) -> tuple[int, int] | None:
    """``(elements, elements per position)`` between an attention operand view's batches: the
    stride is ``elements + per_position * S`` for the view's length ``S`` (per_position is 0
    for a static stride; a symbolic one must be the rows of a position, ``row`` or ``H·row``,
    times ``S``); None for any other stride."""
    stride, row, _, _ = layout.split(view.strides)
    if isinstance(stride, int):
        return (stride, 0) if stride >= 0 else None
    _, seq, heads, _ = layout.split(view.shape)
    if not (isinstance(row, int) and isinstance(heads, int)):
        return None
    for per_position in (row, heads * row):
        if stride == size_of(seq) * per_position:
            return 0, per_position
    return None


def inline_reads(schedule: Schedule, root: Value, own: bool = False) -> tuple[Value, ...]:
    """The buffers the loop nest of ``root`` reads: the bases where its inline expression stops.

    ``own``: the kernel writes ``root``'s own buffer, so ``root`` itself is computed, not read.
    """
    found: list[Value] = []
    seen: set[Value] = set()
    pending = list(root.node.inputs) if own else [root]
    if own and root.node.op.value == "constant":
        found.append(root)  # a constant returned as an output is copied from its data
    while pending:
        value = pending.pop()
        if value in seen:
            continue
        seen.add(value)
        view = schedule.view(value)
        if view is not None:
            found.append(view.base)
            continue
        pending.extend(value.node.inputs)
    return tuple(dict.fromkeys(found))


def inline_values(schedule: Schedule, root: Value) -> list[Value]:
    """``root`` and every value its loop nest computes inline (those without a buffer to read)."""
    found: list[Value] = []
    seen: set[Value] = set()
    pending = [root]
    while pending:
        value = pending.pop()
        if value in seen or (value is not root and schedule.view(value) is not None):
            continue
        seen.add(value)
        found.append(value)
        pending.extend(value.node.inputs)
    return found
