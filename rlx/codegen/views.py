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

from rlx.ir.graph import Value

UNKNOWN_STRIDE = -1  # a stride across a symbolic dimension: known only per call


def dense_strides(shape: tuple[int | str, ...]) -> tuple[int, ...]:
    """Row-major strides; ``UNKNOWN_STRIDE`` outside a symbolic dimension (kernels that take
    symbolic shapes address their operands themselves, from the call's sizes)."""
    strides = []
    step: int | None = 1
    for size in reversed(shape):
        strides.append(UNKNOWN_STRIDE if step is None else step)
        step = None if step is None or isinstance(size, str) else step * size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class View:
    """``base`` is the materialised value whose buffer this views."""

    base: Value
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @staticmethod
    def dense(base: Value) -> View:
        # A symbolic shape only reaches kernels that address their operands from the call's sizes
        # (attention), which read a view's offset alone.
        return View(base, 0, cast(tuple[int, ...], base.shape), dense_strides(base.shape))

    @property
    def is_dense(self) -> bool:
        """Row-major contiguous (strides of size-1 dimensions do not matter)."""
        want = dense_strides(self.shape)
        return all(size == 1 or s == w for size, s, w in zip(self.shape, self.strides, want, strict=True))

    def transpose(self, perm: tuple[int, ...]) -> View:
        return replace(self, shape=tuple(self.shape[p] for p in perm), strides=tuple(self.strides[p] for p in perm))

    def broadcast_to(self, shape: tuple[int, ...]) -> View:
        lead = len(shape) - len(self.shape)
        strides = [0] * lead + [
            0 if size == 1 and shape[lead + i] != 1 else s
            for i, (size, s) in enumerate(zip(self.shape, self.strides, strict=True))
        ]
        return replace(self, shape=tuple(shape), strides=tuple(strides))

    def slice(self, axis: int, start: int, size: int) -> View:
        shape = list(self.shape)
        shape[axis] = size
        return replace(self, offset=self.offset + start * self.strides[axis], shape=tuple(shape))

    def reshape(self, shape: tuple[int, ...]) -> View | None:
        """The same elements in row-major order under a new shape, if strides can express it."""
        if self.is_dense:
            return replace(self, shape=tuple(shape), strides=dense_strides(tuple(shape)))
        strides = _nocopy_reshape(self.shape, self.strides, tuple(shape))
        return None if strides is None else replace(self, shape=tuple(shape), strides=strides)


def _nocopy_reshape(
    old_shape: tuple[int, ...], old_strides: tuple[int, ...], new_shape: tuple[int, ...]
) -> tuple[int, ...] | None:
    """NumPy's ``_attempt_nocopy_reshape``: strides for ``new_shape`` over the same memory, or None."""
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
