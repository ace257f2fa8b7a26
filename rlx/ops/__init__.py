"""Every op rlx knows, one definition each (see :mod:`rlx.ir.opdef`); importing this registers them.

The modules are grouped by kind: graph inputs and constants, elementwise math, reductions,
softmax and norms, matmul, linear algebra (LAPACK), element-moving views, integer-indexed ops
and gathers, attention, and the fused elementwise chains the ``fuse-elementwise`` pass makes.
"""

from rlx.ops import (
    attention,
    constant,
    conv,
    custom_vjp,
    elementwise,
    flex_attention,
    fused,
    gather,
    index,
    linalg,
    matmul,
    movement,
    reduce,
    scan,
    softmax,
    sort,
)

__all__ = [
    "attention",
    "constant",
    "conv",
    "custom_vjp",
    "elementwise",
    "flex_attention",
    "fused",
    "gather",
    "index",
    "linalg",
    "matmul",
    "movement",
    "reduce",
    "scan",
    "softmax",
    "sort",
]
