"""How rlx.torch's attention graphs take q, k and v: as given, or through the views a model makes.

A model's attention reads q, k and v as heads viewed out of its projections: ``x @ W`` viewed
``[B, S, H, D]`` and transposed to ``[B, H, S, D]``, or three slices of one fused projection
``[B, S, 3·H·D]``. Those tensors are not contiguous, and copying them contiguous (what a
``[B, H, S, D]`` graph needs) cost a tenth of a small call. The attention kernels read strided
views in place, so for such tensors the graphs take the memory the model made instead:

- ``"bhsd"``: contiguous ``[B, H, S, D]`` tensors (anything else copied contiguous);
- ``"bshd"``: each tensor the transpose of a contiguous ``[B, S, H, D]`` one; the graph takes
  those and attends in BSHD;
- ``"qkv"``: q, k and v the three slices of one ``[B, S, 3·H·D]`` tensor; the graph takes it,
  splits it and views the parts as heads (views the kernels read in place).

The last two return ``out`` and the gradients as torch's kernels do for such inputs:
transposes of ``[B, S, H, D]`` tensors.
"""

from __future__ import annotations

import torch

from rlx.ir.graph import Graph, Value
from rlx.ir.types import Dim
from rlx.torch._tensors import _direct


def _strided_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """How the kernels can read these float32 tensors without copying them: ``"bshd"``,
    ``"qkv"``, else ``"bhsd"`` (contiguous ones, or copies)."""
    if not (q.dtype == k.dtype == v.dtype == torch.float32) or q.is_contiguous():
        return "bhsd"
    if _direct(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)):
        return "bshd"
    return "qkv" if _fused_qkv(q, k, v) is not None else "bhsd"


def _fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The ``[B, S, 3·H·D]`` tensor whose three slices q, k and v are (a fused projection split
    and viewed as heads), or None."""
    batch, heads, seq, dim = q.shape
    width = heads * dim
    if not (q.shape == k.shape == v.shape and q.stride() == k.stride() == v.stride()):
        return None
    if q.stride() != (seq * 3 * width, dim, 3 * width, 1) or q.is_neg() or k.is_neg() or v.is_neg():
        return None
    start = q.data_ptr()
    if k.data_ptr() != start + 4 * width or v.data_ptr() != start + 8 * width or start % 4:
        return None
    if not (q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()):
        return None
    try:
        return torch.as_strided(q.detach(), (batch, seq, 3 * width), (seq * 3 * width, 3 * width, 1))
    except RuntimeError:  # the slices do not lie in one storage as a whole
        return None


def _layout_names(layout: str) -> list[str]:
    """The graph inputs that hold q, k and v in ``layout``."""
    return ["qkv"] if layout == "qkv" else ["q", "k", "v"]


def _layout_tensors(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """q, k and v as a ``layout`` graph takes them (:func:`_layout_names`): views, no copy."""
    if layout == "qkv":
        fused = _fused_qkv(q, k, v)
        assert fused is not None, "the layout was chosen for these tensors"
        return [fused]
    if layout == "bshd":
        return [t.detach().transpose(1, 2) for t in (q, k, v)]
    return [q, k, v]


def _layout_inputs(
    g: Graph, layout: str, q: tuple[Dim, ...], k: tuple[Dim, ...], v: tuple[Dim, ...]
) -> tuple[Value, Value, Value]:
    """Graph inputs holding q, k and v of torch shapes ``[B, H, S, D]`` (sizes or symbols) as
    ``layout`` takes them; returned as attention operands: BHSD for ``"bhsd"``, else BSHD."""
    if layout == "bhsd":
        return g.input("q", q), g.input("k", k), g.input("v", v)
    if layout == "bshd":
        return tuple(g.input(name, (b, s, h, d)) for name, (b, h, s, d) in zip("qkv", (q, k, v), strict=True))  # type: ignore[return-value]
    batch, heads, seq, dim = q
    assert isinstance(heads, int) and isinstance(dim, int), "static heads and head dim"
    fused = g.input("qkv", (batch, seq, 3 * heads * dim))
    parts = g.split(fused, 3, -1)
    return tuple(g.reshape(part, (batch, seq, heads, dim)) for part in parts)  # type: ignore[return-value]
