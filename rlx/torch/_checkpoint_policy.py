"""torch's selective activation checkpointing as an ``rlx.checkpoint`` policy.

``torch.utils.checkpoint.checkpoint(fn, ..., context_fn=partial(create_selective_checkpoint_contexts,
policy))`` saves the results of the aten ops ``policy`` names (a list of ops, or a function of
a context and an op returning a ``CheckpointPolicy``) and recomputes the rest. rlx's nodes are
not aten ops, so each is asked about as the aten ops it stands for: a ``matmul`` as ``mm``,
``bmm``, ``addmm`` and ``matmul``; ``attention`` as the CPU SDPA kernels; an elementwise op as
the aten op of its name. A policy function is called with the context and the op only (rlx
has no tensors to give it at trace time); one that needs the op's arguments, or raises, keeps
nothing, and the checkpoint recomputes everything (the values and gradients are the same
either way). A ``context_fn`` that is not made by ``create_selective_checkpoint_contexts`` is
not followed, for the same reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from rlx.ir.graph import Node

_ATEN = torch.ops.aten
_STANDS_FOR: dict[str, tuple[Any, ...]] = {
    "matmul": (_ATEN.mm.default, _ATEN.bmm.default, _ATEN.addmm.default, _ATEN.matmul.default),
    "attention": (
        _ATEN._scaled_dot_product_flash_attention_for_cpu.default,
        _ATEN._scaled_dot_product_efficient_attention.default,
        _ATEN._scaled_dot_product_flash_attention.default,
        _ATEN.scaled_dot_product_attention.default,
    ),
    "conv": (_ATEN.convolution.default,),
}


def policy_of(context_fn: object) -> Callable[[Node], bool] | None:
    """The rlx policy for a checkpoint's ``context_fn`` (None: recompute everything)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if not (
        isinstance(context_fn, functools.partial)
        and context_fn.func is create_selective_checkpoint_contexts
        and context_fn.args
    ):
        return None
    chosen = context_fn.args[0]
    if isinstance(chosen, (list, tuple)):
        listed = set(chosen)
        saves: Callable[[Any], bool] = lambda op: op in listed  # noqa: E731
    elif callable(chosen):
        saves = functools.partial(_asks, chosen)
    else:
        return None
    return lambda node: any(saves(op) for op in _aten_ops(node.op.value))


def _asks(policy: Callable[..., Any], op: Any) -> bool:
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    try:
        answer = policy(SelectiveCheckpointContext(is_recompute=False), op)
    except Exception:  # it wanted the op's arguments: keep nothing of this op
        return False
    return answer in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


@functools.cache
def _aten_ops(name: str) -> tuple[Any, ...]:
    """The aten ops an rlx op named ``name`` is asked about as."""
    if name in _STANDS_FOR:
        return _STANDS_FOR[name]
    packet = getattr(_ATEN, name, None)
    default = getattr(packet, "default", None) if packet is not None else None
    return (default,) if default is not None else ()
