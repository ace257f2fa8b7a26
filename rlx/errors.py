"""One error hierarchy for everything rlx raises on bad user input.

Each concrete error is both an ``RlxError`` and the builtin a Python user would expect
(``ValueError`` for shapes and values, ``TypeError`` for dtypes and argument types, ``KeyError``
for unknown or missing input names), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class RlxError(Exception):
    """Base class of every error rlx raises for bad input."""


class RlxValueError(RlxError, ValueError):
    """A shape, size or value is wrong (also a graph that fails verification)."""


class RlxTypeError(RlxError, TypeError):
    """A dtype or an argument type is wrong."""


class RlxMemoryError(RlxError, MemoryError):
    """A call's inputs, outputs or scratch need more memory than the process can allocate."""


def allocation_failed(what: str, nbytes: int) -> RlxMemoryError:
    """The error for an allocation of ``nbytes`` for ``what`` that NumPy could not make."""
    size, unit = float(nbytes), "bytes"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return RlxMemoryError(f"{what} needs {size:.3g} {unit}, more than this process could allocate")


class RlxKeyError(RlxError, KeyError):
    """An input name is missing or unknown."""

    def __str__(self) -> str:
        # KeyError.__str__ quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""
