"""``OpKind``: one member per registered op, built from the op registry.

The definitions live in :mod:`rlx.ops` (one :class:`~rlx.ir.opdef.OpDef` each); this module
imports them and makes the enum, so ``OpKind.MATMUL.definition`` is the matmul ``OpDef`` and a
new op needs no edit here. The attention attrs and checks are re-exported for older imports.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import rlx.ops  # noqa: F401  (registers every op before the enum is made)
from rlx.ir.opdef import REGISTRY, OpDef
from rlx.ops.attention import (
    AttentionAttrs,
    AttentionBwdAttrs,
    AttentionDims,
    attention_dims,
    check_layout,
    check_mask,
    check_wrt,
)
from rlx.ops.constant import ConstantAttrs, ConstantData, InputAttrs


class _OpKindBase(enum.Enum):
    """Behaviour shared by every ``OpKind`` member; the value is the op's name in textual IR."""

    def __str__(self) -> str:
        return str(self.value)

    @property
    def definition(self) -> OpDef:
        return REGISTRY[self.value]


if TYPE_CHECKING:  # members are made from the registry at import; type checkers see any name

    class _OpKindMeta(enum.EnumMeta):
        def __getattr__(cls, name: str) -> OpKind: ...

    class OpKind(_OpKindBase, metaclass=_OpKindMeta):
        """Every operation the IR knows; the value is the op's name in textual IR."""

else:
    _NAMES = ["input"] + [name for name in REGISTRY if name != "input"]
    OpKind = _OpKindBase("OpKind", [(name.upper(), name) for name in _NAMES])
    OpKind.__doc__ = "Every operation the IR knows; the value is the op's name in textual IR."
    OpKind.__module__ = __name__

__all__ = [
    "AttentionAttrs",
    "AttentionBwdAttrs",
    "AttentionDims",
    "ConstantAttrs",
    "ConstantData",
    "InputAttrs",
    "OpKind",
    "attention_dims",
    "check_layout",
    "check_mask",
    "check_wrt",
]
