"""Block sparsity for programmable attention: which (query strip, key tile) tiles a mask_mod hides.

Each tile gets a state: ``EMPTY`` (the mask hides every entry: the kernels skip the tile's
GEMMs and softmax work), ``FULL`` (every entry visible: the mask is not evaluated) or
``PARTIAL``. States come from interval bounds of the traced mask over the tile's box of indices
(:meth:`rlx.ir.region.Region.bounds`), which are sound, so a tile is never skipped wrongly; they
are exact for the masks of ``rlx.mods`` (a comparison of affine index expressions, and
``doc[b, i] == doc[b, j]`` with documents packed in order).

A mask of indices alone gets its map at compile time. A mask that reads tensors gets it per
call, from the bound arrays: the bound of ``doc[b, q_idx]`` over a tile is the min and max of
``doc`` over the tile's rows, answered by a sparse table (O(1) per query).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlx.ir.region import Interval, Region

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class TileGrid:
    """The tiling of one attention node: strips of ``block_q`` queries, tiles of ``block_k`` keys."""

    batch: int | str  # a symbolic batch or length: resolve the grid per call (``dataclasses.replace``)
    heads: int
    seq_q: int | str
    seq_k: int | str
    block_q: int
    block_k: int
    by_batch: bool  # the mask depends on b: one map per batch
    by_head: bool  # the mask depends on h: one map per head

    @property
    def strips(self) -> int:
        return -(-int(self.seq_q) // self.block_q)

    @property
    def tiles(self) -> int:
        return -(-int(self.seq_k) // self.block_k)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (int(self.batch) if self.by_batch else 1, self.heads if self.by_head else 1, self.strips, self.tiles)

    @functools.cached_property
    def symbol_boxes(self) -> dict[str, Interval]:
        """Each index symbol's ``(lo, hi)`` per tile, broadcastable to :attr:`shape` (computed once)."""
        bm, hm, ns, nk = self.shape
        q_lo = np.arange(ns, dtype=np.float64) * self.block_q
        q_hi = np.minimum(q_lo + self.block_q, self.seq_q) - 1
        k_lo = np.arange(nk, dtype=np.float64) * self.block_k
        k_hi = np.minimum(k_lo + self.block_k, self.seq_k) - 1
        b = np.arange(bm, dtype=np.float64).reshape(-1, 1, 1, 1)
        h = np.arange(hm, dtype=np.float64).reshape(1, -1, 1, 1)
        # A map not by batch holds for every b: any batch, a symbolic one included.
        b_box = (b, b) if self.by_batch else (np.float64(0), np.float64(np.inf))
        h_box = (h, h) if self.by_head else (np.float64(0), np.float64(self.heads - 1))
        return {
            "b": b_box,
            "h": h_box,
            "q_idx": (q_lo.reshape(1, 1, -1, 1), q_hi.reshape(1, 1, -1, 1)),
            "kv_idx": (k_lo.reshape(1, 1, 1, -1), k_hi.reshape(1, 1, 1, -1)),
            "score": (np.float64(-np.inf), np.float64(np.inf)),
            "q_len": (np.float64(self.seq_q), np.float64(self.seq_q)),
            "kv_len": (np.float64(self.seq_k), np.float64(self.seq_k)),
        }


def tile_states(mask: Region, grid: TileGrid, tensors: Sequence[np.ndarray | None]) -> np.ndarray:
    """uint8 ``[Bm, Hm, strips, tiles]`` of EMPTY / PARTIAL / FULL; ``None`` tensors are unknown."""
    tables: dict[int, _RangeTable] = {}

    def read_bounds(step: int, tensor: int, index: list[Interval]) -> Interval:
        array = tensors[tensor]
        if array is None:
            return np.float64(-np.inf), np.float64(np.inf)
        if tensor not in tables:
            tables[tensor] = _RangeTable(np.asarray(array, dtype=np.float64))
        return tables[tensor].bounds(index)

    lo, hi = mask.bounds(grid.symbol_boxes, read_bounds)[-1]
    states = np.where(np.asarray(hi) == 0, EMPTY, np.where(np.asarray(lo) == 1, FULL, PARTIAL))
    return np.ascontiguousarray(np.broadcast_to(states, grid.shape), dtype=np.uint8)


class _RangeTable:
    """Min and max of an array over boxes that are points on every axis but at most one."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.flat_min = float(np.min(array)) if array.size else 0.0
        self.flat_max = float(np.max(array)) if array.size else 0.0
        self.sparse: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}

    def _table(self, axis: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if axis not in self.sparse:
            moved = np.moveaxis(self.array, axis, -1)
            mins, maxs = [moved], [moved]
            width = 1
            while 2 * width <= moved.shape[-1]:
                mins.append(np.minimum(mins[-1][..., :-width], mins[-1][..., width:]))
                maxs.append(np.maximum(maxs[-1][..., :-width], maxs[-1][..., width:]))
                width *= 2
            self.sparse[axis] = (mins, maxs)
        return self.sparse[axis]

    def bounds(self, index: list[Interval]) -> Interval:
        shape = np.broadcast_shapes(*(np.shape(lo) for lo, _ in index), *(np.shape(hi) for _, hi in index))
        los = [np.broadcast_to(lo, shape) for lo, _ in index]
        his = [np.broadcast_to(hi, shape) for _, hi in index]
        ranged = [axis for axis in range(len(index)) if np.any(los[axis] != his[axis])]
        finite = all(np.all(np.isfinite(x)) for x in los + his)
        if len(ranged) > 1 or not finite:
            return np.full(shape, self.flat_min), np.full(shape, self.flat_max)
        points = [lo.astype(np.int64) for lo in los]
        if not ranged:
            value = self.array[tuple(points)]
            return value, value
        axis = ranged[0]
        mins, maxs = self._table(axis)
        start, stop = los[axis].astype(np.int64), his[axis].astype(np.int64)
        level = np.floor(np.log2(np.maximum(stop - start + 1, 1))).astype(np.int64)
        others = tuple(p for i, p in enumerate(points) if i != axis)
        low = np.empty(shape)
        high = np.empty(shape)
        for k in np.unique(level):
            where = level == k
            width = 1 << int(k)
            sel = tuple(o[where] for o in others)
            a, c = start[where], stop[where] - width + 1
            low[where] = np.minimum(mins[k][(*sel, a)], mins[k][(*sel, c)])
            high[where] = np.maximum(maxs[k][(*sel, a)], maxs[k][(*sel, c)])
        return low, high


def choose_blocks(
    seq_q: int, seq_k: int, needs_dp: bool, masked: bool = False, small_path: bool = True
) -> tuple[int, int]:
    """Query rows per strip and keys per tile for the flex kernels (``masked``: a tile map may
    skip tiles; ``small_path``: OpenBLAS runs small products unpacked, ``Blas.has_small_path``).

    Strips of up to 128 rows keep the dK/dV rank updates efficient GEMMs while a sliding window
    or document mask still skips most tiles; 64-key tiles are the unit of skipping. Shorter
    strips skip more of a mask's hidden tiles, so masked strips take 64 rows up to Sk = 1024
    (causal, B·H = 16-96 on an Intel Xeon host: forward and backward 17-23% faster at S = 128
    than with 128 rows, 0-3% at 512; with the strip products on the register tiles, forward
    3-5% and backward 7-9% faster at 768 and 1024, the same at 2048); unmasked ones only up to
    Sk = 128, where the strip products fit OpenBLAS's small-matrix path (see ``choose_block_q``),
    and not at all on a host without that path.
    """
    block_k = 64
    buffers = 3 if needs_dp else 1
    budget = 48 << 20
    cap = 64 if seq_k <= (1024 if masked else 128 if small_path else 0) else 128
    target = max(16, min(cap, budget // (4 * max(seq_k, 1) * buffers)))
    strips = -(-seq_q // target)
    return max(1, -(-seq_q // strips)), max(1, min(block_k, seq_k))
