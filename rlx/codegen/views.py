"""Strided views: how reshape, transpose, split and broadcast_to cost nothing at run time.

A :class:`View` is a window on a materialised value's buffer: element offset, shape and strides
(in elements, 0 for a broadcast dimension), as NumPy's ndarray header. View ops map a view to a
view without touching memory; a reshape that strides cannot express (of a transposed view, say)
returns None and the caller materialises a copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import cast

from rlx.codegen.sizes import SizeLike, size_of
from rlx.ir.graph import Value
from rlx.ir.types import Dim


def dense_strides(shape: tuple[Dim, ...]) -> tuple[SizeLike, ...]:
    """Row-major strides (a :class:`~rlx.codegen.sizes.Size` outside a symbolic dimension)."""
    strides: list[SizeLike] = []
    step: SizeLike = 1
    for size in reversed(shape):
        strides.append(step)
        step = step * size_of(size)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class View:
    """``base`` is the materialised value whose buffer this views."""

    base: Value
    offset: SizeLike
    shape: tuple[Dim, ...]  # a symbolic dimension by name
    strides: tuple[SizeLike, ...]

    @staticmethod
    def dense(base: Value) -> View:
        return View(base, 0, base.shape, dense_strides(base.shape))

    @property
    def is_dense(self) -> bool:
        """Row-major contiguous (strides of size-1 dimensions do not matter)."""
        want = dense_strides(self.shape)
        return all(size == 1 or s == w for size, s, w in zip(self.shape, self.strides, want, strict=True))

    def transpose(self, perm: tuple[int, ...]) -> View:
        return replace(self, shape=tuple(self.shape[p] for p in perm), strides=tuple(self.strides[p] for p in perm))

    def broadcast_to(self, shape: tuple[Dim, ...]) -> View:
        lead = len(shape) - len(self.shape)
        strides = [0] * lead + [
            0 if size == 1 and shape[lead + i] != 1 else s
            for i, (size, s) in enumerate(zip(self.shape, self.strides, strict=True))
        ]
        return replace(self, shape=tuple(shape), strides=tuple(strides))

    def slice(self, axis: int, start: SizeLike, size: Dim) -> View:
        shape = list(self.shape)
        shape[axis] = size
        return replace(self, offset=self.offset + start * self.strides[axis], shape=tuple(shape))

    def unfold(self, axis: int, size: int, step: int) -> View:
        """Windows of ``size`` along ``axis``, ``step`` apart, as a new last axis (``unfold``): the
        windows step by ``step`` strides, a window's entries by one, so windows may overlap."""
        stride = self.strides[axis]
        shape, strides = list(self.shape), list(self.strides)
        shape[axis] = (cast(int, shape[axis]) - size) // step + 1
        strides[axis] = stride * step
        return replace(self, shape=(*shape, size), strides=(*strides, stride))

    def reshape(self, shape: tuple[Dim, ...]) -> View | None:
        """The same elements in row-major order under a new shape, if strides can express it."""
        if self.is_dense:
            return replace(self, shape=tuple(shape), strides=dense_strides(tuple(shape)))
        strides = _nocopy_reshape(self.shape, self.strides, tuple(shape))
        return None if strides is None else replace(self, shape=tuple(shape), strides=strides)


def _nocopy_reshape(
    old_shape: tuple[Dim, ...], old_strides: tuple[SizeLike, ...], new_shape: tuple[Dim, ...]
) -> tuple[SizeLike, ...] | None:
    """NumPy's ``_attempt_nocopy_reshape``: strides for ``new_shape`` over the same memory, or None
    (the caller then copies the view to a dense buffer first). With symbolic sizes, only a
    reshape that keeps the leading dimensions as they are and reshapes a static tail (a split
    projection's ``[B, S, H·D]`` part viewed as ``[B, S, H, D]``)."""
    if all(isinstance(x, int) for x in (*old_shape, *old_strides, *new_shape)):
        return _nocopy_reshape_static(
            cast(tuple[int, ...], old_shape), cast(tuple[int, ...], old_strides), cast(tuple[int, ...], new_shape)
        )
    kept = 0
    while kept < min(len(old_shape), len(new_shape)) and old_shape[kept] == new_shape[kept]:
        kept += 1
    old_tail, tail_strides, new_tail = old_shape[kept:], old_strides[kept:], new_shape[kept:]
    if not all(isinstance(x, int) for x in (*old_tail, *tail_strides, *new_tail)):
        return None
    strides = _nocopy_reshape_static(
        cast(tuple[int, ...], old_tail), cast(tuple[int, ...], tail_strides), cast(tuple[int, ...], new_tail)
    )
    return None if strides is None else (*old_strides[:kept], *strides)


def _nocopy_reshape_static(
    old_shape: tuple[int, ...], old_strides: tuple[int, ...], new_shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    old = [(size, stride) for size, stride in zip(old_shape, old_strides, strict=True) if size != 1]
    if math.prod(old_shape) != math.prod(new_shape):
        return None
    new_strides = [0] * len(new_shape)
    oi = ni = 0
    new_dims = [i for i, size in enumerate(new_shape) if size != 1]
    while oi < len(old) and ni < len(new_dims):
        oj, nj = oi + 1, ni + 1
        old_prod, new_prod = old[oi][0], new_shape[new_dims[ni]]
        while old_prod != new_prod:
            if old_prod < new_prod:
                old_prod *= old[oj][0]
                oj += 1
            else:
                new_prod *= new_shape[new_dims[nj]]
                nj += 1
        for k in range(oi, oj - 1):  # the old dims merged here must be contiguous with each other
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        stride = old[oj - 1][1]
        for k in range(nj - 1, ni - 1, -1):
            new_strides[new_dims[k]] = stride
            stride *= new_shape[new_dims[k]]
        oi, ni = oj, nj
    return tuple(new_strides)
