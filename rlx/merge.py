"""``rlx.attention_merge``: combine attention over slices of the keys into attention over all of them.

Attention over keys ``K1 ∪ K2`` is the LSE-weighted mix of attention over each slice:
``lse = log(sum_i exp(lse_i))`` and ``out = sum_i exp(lse_i - lse) out_i``. This is what lets
keys be split across workers (ring attention) and the partial results merged exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.types import Layout


def attention_merge(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], layout: Layout | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Merge ``[(out_i, lse_i), ...]`` exactly; returns ``(out, lse)`` in float32.

    ``out_i`` is in the layout the forward returned (``[B, Sq, H, Dv]`` for BSHD, ``[B, H, Sq, Dv]``
    for BHSD; read from the shapes, or pass ``layout`` when H == Sq makes them ambiguous) and
    ``lse_i`` is ``[B, H, Sq]``. Rows whose parts all have ``lse = -inf`` give ``out = 0``,
    ``lse = -inf``.
    """
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
        raise RlxTypeError("attention_merge: parts must be a non-empty list of (out, lse) pairs")
    outs, lses = [], []
    for i, part in enumerate(parts):
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise RlxTypeError(f"attention_merge: parts[{i}] must be an (out, lse) pair")
        out, lse = (np.asarray(x) for x in part)
        if out.ndim != 4 or lse.ndim != 3:
            raise RlxValueError(
                f"attention_merge: parts[{i}] needs out of rank 4 and lse [B, H, Sq], got {out.shape} and {lse.shape}"
            )
        outs.append(out.astype(np.float64))
        lses.append(lse.astype(np.float64))
    if any(o.shape != outs[0].shape for o in outs) or any(x.shape != lses[0].shape for x in lses):
        raise RlxValueError("attention_merge: every part must have the same out and lse shapes")
    b, h, sq = lses[0].shape
    chosen = _layout(outs[0].shape, (b, h, sq), layout)
    if chosen is Layout.BSHD:  # weights [B, H, Sq] -> [B, Sq, H, 1]
        weights_view = [x.transpose(0, 2, 1)[..., None] for x in lses]
    else:
        weights_view = [x[..., None] for x in lses]
    with np.errstate(all="ignore"):
        stacked = np.stack(weights_view)
        top = np.max(stacked, axis=0)
        finite_top = np.where(np.isneginf(top), 0.0, top)
        weights = np.exp(stacked - finite_top)
        total = np.sum(weights, axis=0)
        mixed = sum(w * np.where(w > 0, o, 0.0) for w, o in zip(weights, outs, strict=True))
        out = mixed / np.where(total == 0.0, 1.0, total)
        lse = np.log(total) + finite_top
    lse = lse[..., 0]
    lse = lse.transpose(0, 2, 1) if chosen is Layout.BSHD else lse
    return out.astype(np.float32), np.ascontiguousarray(lse).astype(np.float32)


def _layout(shape: tuple[int, ...], bhs: tuple[int, int, int], layout: Layout | None) -> Layout:
    b, h, sq = bhs
    fits = {Layout.BSHD: shape[:3] == (b, sq, h), Layout.BHSD: shape[:3] == (b, h, sq)}
    if layout is not None:
        if not isinstance(layout, Layout):
            raise RlxTypeError(f"attention_merge: layout must be an rlx.Layout, got {type(layout).__name__}")
        if not fits[layout]:
            raise RlxValueError(
                f"attention_merge: out {shape} does not fit lse [B={b}, H={h}, Sq={sq}] in layout {layout}"
            )
        return layout
    matching = [lay for lay, ok in fits.items() if ok]
    if not matching:
        raise RlxValueError(
            f"attention_merge: out {shape} matches neither [B, Sq, H, Dv] nor [B, H, Sq, Dv] "
            f"for lse [B={b}, H={h}, Sq={sq}]"
        )
    return matching[0]  # both fit only when H == Sq, where BSHD (the default layout) is taken
