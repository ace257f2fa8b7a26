"""rlx from PyTorch (SPEC section 5): drop-in SDPA and flex_attention with a CPU backward, graphs as torch functions.

``import rlx.torch as rt``::

    o = rt.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False)
    o = rt.flex_attention(q, k, v, score_mod=None, mask_mod=None, scale=None, enable_gqa=False, return_lse=False)
    f = rt.compile(g)          # f(**tensors) -> dict of tensors, differentiable
    model = torch.compile(model, backend="rlx")   # or backend=rt.backend: TorchDynamo graphs on rlx

Tensors are torch's ``[B, H, S, D]`` (rlx's ``Layout.BHSD``), so nothing is re-laid out.
Contiguous float32 CPU tensors go in and come out without a copy (NumPy views of the same
memory); float16 and bfloat16 are computed in float32 and returned in the input dtype. Mods
written for torch's flex_attention run unchanged: ``torch.where``, ``torch.tanh``, comparisons
and captured tensors indexed by the symbols are traced into rlx regions (tensors they capture
become graph inputs, so a learnable bias gets its gradient). Compiled code is cached by shapes,
dtypes and the traced mods (``rlx.compile``'s cache, keyed by the printed graph): a second call
with the same shapes compiles nothing.

torch is an optional dependency (``pip install "rlx[torch]"``); ``import rlx`` never imports it.
"""

from __future__ import annotations

import os

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError('rlx.torch needs PyTorch: pip install "rlx[torch]"') from exc

from rlx.torch import _ops  # noqa: F401  (registers the custom ops SDPA dispatches to under torch.compile)
from rlx.torch.dynamo import backend
from rlx.torch.flex import flex_attention
from rlx.torch.graphs import CompiledGraph, compile
from rlx.torch.sdpa import scaled_dot_product_attention
from rlx.torch.threads import (
    SMALL_ATTENTION_FLOPS,
    SMALL_ATTENTION_FLOPS_OWN_WORKERS,
    share_torch_threads,
)

__all__ = [
    "SMALL_ATTENTION_FLOPS",
    "SMALL_ATTENTION_FLOPS_OWN_WORKERS",
    "CompiledGraph",
    "backend",
    "compile",
    "flex_attention",
    "scaled_dot_product_attention",
    "share_torch_threads",
]

share_torch_threads(os.environ.get("RLX_TORCH_OPENMP", "").strip() != "0")
