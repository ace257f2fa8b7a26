"""Axes a fused loop may run as one: a column loop over ``H*W`` where it would run over ``W``.

A fused kernel's innermost loop runs along one axis, 16 lanes at a time with a scalar rest. Where
that axis is short (a feature map's width: 48, 12, 6) most of the work lands in the scalar rest
and in the loop's overhead: a batch norm and SiLU over ``[16, 64, 12, 12]`` ran every element
through the scalar rest. Trailing axes can run as one flat loop wherever every read of the loop
nest steps evenly through memory along them, as NumPy's iterator coalesces dimensions:

- each buffer read (and the one written) has strides over the axes that chain,
  ``stride[i] == stride[i + 1] * size[i + 1]``, or that are all 0 (a broadcast over all of them);
- every op between the root and those reads passes the axes through whole: elementwise ops and
  broadcasts (an operand has all of the axes or none), transposes that keep them in order,
  splits, concats and reductions along other axes, reshapes that only add or drop size-1 axes.

The index then carries the flat position in the last axis's entry and 0 in the others, and every
address is the one the separate loops would compute. Gathers, which read their ids per position,
take no part: a kernel with one keeps its loop.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from rlx.codegen.schedule import Schedule, apply_view_op, is_unit_reshape
from rlx.codegen.views import View
from rlx.ir.graph import Value
from rlx.ir.types import Dim

# Where the group of flat axes sits in a value: its positions, one per axis of the group and in
# order (size-1 axes may lie between them), or None where the value has none of them (size 1
# there: a broadcast operand, which no position of the flat loop moves).
Group = tuple[int, ...] | None


class FlatAxes:
    """Whether a fused loop nest may run the axes of ``sizes`` as one flat loop."""

    def __init__(self, schedule: Schedule, sizes: Sequence[int]) -> None:
        self.schedule = schedule
        self.sizes = tuple(sizes)
        self._memo: dict[tuple[Value, Group], bool] = {}

    def view_ok(self, view: View, group: Group) -> bool:
        """A buffer read over the group steps through memory evenly along it."""
        if group is None:
            return True
        strides = [view.strides[p] for p in group]
        if not all(isinstance(s, int) for s in strides):
            return False
        if all(s == 0 for s in strides):
            return True
        return all(strides[i] == strides[i + 1] * self.sizes[i + 1] for i in range(len(strides) - 1))  # type: ignore[operator]

    def value_ok(self, value: Value, group: Group, own: bool = False) -> bool:
        """Whether ``value``, indexed with the group at ``group``, computes correctly from a flat
        index (``own``: the kernel's root, computed here rather than read from its buffer)."""
        key = (value, group)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = group is None or self._check(value, group, own)
        return found

    def _check(self, value: Value, group: tuple[int, ...], own: bool) -> bool:
        if not _in_order(value.shape, group):
            return False
        node = value.node
        op = node.op.value
        if op == "constant":
            return self.view_ok(View.dense(value), group)
        view = None if own else self.schedule.view(value)
        if view is not None:
            return self.view_ok(view, group)
        source = node.inputs[0] if node.inputs else None
        if op == "transpose":
            assert source is not None
            return self.value_ok(source, tuple(node.attrs.perm[p] for p in group))
        if op in ("split", "concat"):
            return node.attrs.axis not in group and all(self.value_ok(v, group) for v in node.inputs)
        if op == "reshape":
            assert source is not None
            if not is_unit_reshape(node):
                reshaped = self.schedule.view(source)
                reshaped = None if reshaped is None else reshaped.reshape(node.attrs.shape)
                return reshaped is not None and self.view_ok(reshaped, group)
            return self.value_ok(source, _through_unit_reshape(value.shape, source.shape, group))
        if op == "unfold":
            assert source is not None
            windows = self.schedule.view(source)
            unfolded = None if windows is None else apply_view_op(node, value.index, windows)
            return unfolded is not None and self.view_ok(unfolded, group)
        if op in ("sum", "max"):
            assert source is not None
            inner = _through_reduction(node.attrs.axes, node.attrs.keepdims, len(source.shape), group)
            return self.value_ok(source, inner)
        if op == "broadcast_to" or node.op.definition.scalar is not None:
            return all(self._operand_ok(v, value.shape, group) for v in node.inputs)
        return False  # a gather (its ids are read per position) or an op with a loop of its own

    def _operand_ok(self, operand: Value, shape: tuple[Dim, ...], group: tuple[int, ...]) -> bool:
        """An operand broadcast to ``shape`` (right-aligned) has all of the group or none of it."""
        lead = len(shape) - len(operand.shape)
        positions = [p - lead for p in group]
        present = [p >= 0 and operand.shape[p] != 1 for p in positions]
        if not any(present):
            return True
        if not all(present) or any(operand.shape[p] != size for p, size in zip(positions, self.sizes, strict=True)):
            return False
        return self.value_ok(operand, tuple(positions))


def _in_order(shape: tuple[Dim, ...], group: tuple[int, ...]) -> bool:
    """The group's positions increase and only size-1 axes lie between them."""
    return all(a < b and all(shape[p] == 1 for p in range(a + 1, b)) for a, b in itertools.pairwise(group))


def _through_unit_reshape(shape: tuple[Dim, ...], source: tuple[Dim, ...], group: tuple[int, ...]) -> tuple[int, ...]:
    """The group's positions in the source of a reshape that only adds or drops size-1 axes (the
    group's axes are larger than 1, so they are among the axes both shapes share, in order)."""
    kept_out = [p for p, size in enumerate(shape) if size != 1]
    kept_in = [p for p, size in enumerate(source) if size != 1]
    return tuple(kept_in[kept_out.index(p)] for p in group)


def _through_reduction(axes: Sequence[int], keepdims: bool, rank: int, group: tuple[int, ...]) -> tuple[int, ...]:
    """The group's positions in a reduction's operand (the group's axes are kept axes)."""
    if keepdims:
        return group
    kept = [p for p in range(rank) if p not in axes]
    return tuple(kept[p] for p in group)


def flat_columns(schedule: Schedule, root: Value, out: View) -> int:
    """How many trailing axes of a fused kernel's output its column loop may run as one (1: its
    last axis alone). Only static axes larger than 1 join."""
    shape = out.shape
    best = 1
    for count in range(2, len(shape) + 1):
        sizes = shape[-count:]
        if not all(isinstance(size, int) and size > 1 for size in sizes):
            break
        checker = FlatAxes(schedule, sizes)  # type: ignore[arg-type]
        group = tuple(range(len(shape) - count, len(shape)))
        if not (checker.view_ok(out, group) and checker.value_ok(root, group, own=out.base is root)):
            break
        best = count
    return best


def flat_reduced_axes(schedule: Schedule, operand: Value, reduced: Sequence[int]) -> int:
    """How many of a reduction's innermost axes (``reduced``: its operand's reduced axes, in
    order) its innermost loop may run as one: consecutive static axes larger than 1."""
    shape = operand.shape
    best = 1
    for count in range(2, len(reduced) + 1):
        group = tuple(reduced[-count:])
        sizes = [shape[p] for p in group]
        if group[-1] - group[0] != count - 1 or not all(isinstance(size, int) and size > 1 for size in sizes):
            break
        if not FlatAxes(schedule, sizes).value_ok(operand, group):  # type: ignore[arg-type]
            break
        best = count
    return best


__all__ = ["FlatAxes", "flat_columns", "flat_reduced_axes"]
