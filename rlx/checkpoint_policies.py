"""What ``rlx.checkpoint(fn, policy=...)`` keeps from the forward, as ``jax.checkpoint_policies``.

A policy is a function of a node of the checkpointed function: ``True`` keeps the node's results
from the forward (the backward reads them; memory), ``False`` computes them again in the
backward (compute). The default, :func:`nothing_saveable`, keeps nothing. The usual middle
ground is :func:`dots_saveable`: the matrix products (most of a layer's FLOPs) are kept, and the
cheap elementwise ops, norms and softmaxes around them are computed again::

    layer = rlx.checkpoint(block, policy=rlx.checkpoint_policies.dots_saveable)

Or name values in the function, ``h = rlx.checkpoint_name(h, "ffn_in")``, and keep those by name:
``policy=rlx.checkpoint_policies.save_only_these_names("ffn_in")``. A policy of your own reads
the node: ``lambda node: node.op.value in ("matmul", "attention")``.
The gradient is the same whatever the policy says: a kept node still passes its gradient to
the recomputed values it read.
"""

from __future__ import annotations

from collections.abc import Callable

from rlx.errors import RlxTypeError
from rlx.ir.graph import Node

Policy = Callable[[Node], bool]

_DOTS = ("matmul",)


def everything_saveable(node: Node) -> bool:
    """Keep every value: no recomputation (as if the function were not checkpointed)."""
    return True


def nothing_saveable(node: Node) -> bool:
    """Keep nothing: compute the whole function again in the backward (the default)."""
    return False


def dots_saveable(node: Node) -> bool:
    """Keep the results of matrix products (``matmul``, and ``@``, ``einsum`` and the layers
    built on it), as ``jax.checkpoint_policies.dots_saveable``."""
    return node.op.value in _DOTS


checkpoint_dots = dots_saveable


def dots_with_no_batch_dims_saveable(node: Node) -> bool:
    """Keep the products of a matrix (2-D or less) with anything: a layer's ``x @ W``, not the
    batched products inside attention (``q @ k^T`` per head)."""
    return dots_saveable(node) and min(len(value.shape) for value in node.inputs) <= 2


checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable


def _names(which: str, names: tuple[str, ...]) -> frozenset[str]:
    if not all(isinstance(name, str) for name in names):
        raise RlxTypeError(f"{which}: names must be strs (given to rlx.checkpoint_name), got {names!r}")
    return frozenset(names)


def _name_of(node: Node) -> str | None:
    """The name ``rlx.checkpoint_name`` gave the node's result, or None."""
    return node.attrs.name if node.op.value == "checkpoint_name" else None


def save_only_these_names(*names: str) -> Policy:
    """Keep the values named (``rlx.checkpoint_name(x, name)``) one of ``names``; nothing else."""
    wanted = _names("save_only_these_names", names)
    return lambda node: _name_of(node) in wanted


def save_any_names_but_these(*names: str) -> Policy:
    """Keep every named value except those named one of ``names``; nothing unnamed."""
    unwanted = _names("save_any_names_but_these", names)
    return lambda node: (name := _name_of(node)) is not None and name not in unwanted


def save_anything_except_these_names(*names: str) -> Policy:
    """Keep every value except those named one of ``names`` (and what only they need)."""
    unwanted = _names("save_anything_except_these_names", names)
    return lambda node: _name_of(node) not in unwanted


def save_from_both_policies(first: Policy, second: Policy) -> Policy:
    """Keep what either policy keeps."""
    for which, policy in (("first", first), ("second", second)):
        if not callable(policy):
            raise RlxTypeError(f"save_from_both_policies: the {which} policy must be a function of a node")

    def either(node: Node) -> bool:
        return bool(first(node)) or bool(second(node))

    return either


__all__ = [
    "Policy",
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "nothing_saveable",
    "save_any_names_but_these",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_only_these_names",
]
