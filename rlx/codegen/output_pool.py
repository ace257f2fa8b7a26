"""Output arrays handed out again once nobody holds them, so a call does not fault in fresh pages.

A fresh ``np.empty`` of a few MB is fresh pages from the operating system: the first write to
each 4 KiB page traps into the kernel, which zeroes it. Measured interleaved on the benchmark
host (a 2-core KVM guest, where a fault costs more than on bare metal), a B8 H12 S128 attention
backward took 1,350 faults a call; writing into recycled arrays took it to 0.69x the time, and
the S=512-1024 backwards to 0.89-0.95x. A training step's gradients are the same story.

Recycling is safe because of what a reference count means: an array whose only references are
this pool's is unreachable from any caller. Everything that can read an array's memory later
holds a reference to it or to the buffer under it (a memoryview or ``torch.from_numpy`` the
array, a view of it the buffer: NumPy makes a view of a view point at the first owner); weak
references are checked as well. So writing the next call's results into an array whose array
and buffer only the pool holds cannot change anything a caller can see. Two arrays per output:
in a loop ``out = exe(...)`` the previous result is still held while the next call runs.

The arrays start on 64-byte lines (:func:`aligned_empty`), each a view of a buffer of its own.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import numpy as np

from rlx.errors import allocation_failed

DEPTH = 2  # arrays kept per output name
ALIGNMENT = 64  # bytes: a cache line


@dataclass(frozen=True)
class _Held:
    """An output array and the buffer it views."""

    array: np.ndarray
    buffer: np.ndarray


def _references(held: list[_Held], index: int) -> tuple[int, int]:
    entry = held[index]
    return sys.getrefcount(entry.array), sys.getrefcount(entry.buffer)


def _calibrate() -> tuple[int, int]:
    """References :func:`_references` sees for an array and its buffer held by a pool list alone
    (it depends on the interpreter's calling convention, so it is measured rather than assumed)."""
    array, buffer = aligned_empty((1,), np.dtype(np.float32))
    held = [_Held(array, buffer)]
    del array, buffer
    return _references(held, 0)


class OutputPool:
    """The output arrays of one executable on one Python thread (pools are never shared)."""

    def __init__(self) -> None:
        self._held: dict[str, list[_Held]] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        """An uninitialised array for output ``name``: a recycled one nobody holds, else new."""
        held = self._held.setdefault(name, [])
        for index in range(len(held)):
            entry = held[index]
            free = entry.array.shape == shape and entry.array.dtype == dtype
            free = free and not weakref.getweakrefcount(entry.array) and not weakref.getweakrefcount(entry.buffer)
            del entry  # the check below must see the pool's references only
            if free and _references(held, index) == _UNHELD:
                recycled = held.pop(index)
                held.append(recycled)  # most recently handed out last
                return recycled.array
        try:
            fresh, buffer = aligned_empty(shape, np.dtype(dtype))
        except MemoryError:
            nbytes = int(np.prod(shape, dtype=np.float64)) * np.dtype(dtype).itemsize
            what = f"intermediate {name}" if name.startswith("%") else f"output {name!r}"  # "%temp3": symbolic
            raise allocation_failed(f"{what} of shape {shape}", nbytes) from None
        held.append(_Held(fresh, buffer))
        if len(held) > DEPTH:
            held.pop(0)
        return fresh


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``np.empty(shape, dtype)`` whose first element starts a 64-byte cache line, and the uint8
    buffer of its own it views (its ``base``). NumPy's large arrays start 16 bytes into a page,
    so every row of an attention output straddled lines, and the kernels' whole-line streaming
    stores (``lower_attention.stream_rows``) could not be used."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buffer = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -buffer.ctypes.data % ALIGNMENT
    array = buffer[start : start + nbytes].view(dtype).reshape(shape)
    assert array.base is buffer
    return array, buffer


_UNHELD = _calibrate()
