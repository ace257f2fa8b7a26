"""Every op rlx knows, one definition each (see :mod:`rlx.ir.opdef`); importing this registers them.

The modules are grouped by kind: graph inputs and constants, elementwise math, reductions,
softmax and norms, matmul, element-moving views, integer-indexed ops, and attention.
"""

from rlx.ops import attention, constant, elementwise, index, matmul, movement, reduce, softmax

__all__ = ["attention", "constant", "elementwise", "index", "matmul", "movement", "reduce", "softmax"]
