"""Sizes known only per call: polynomials over a graph's symbolic dimensions.

A graph input may name a dimension (``g.input("k", (B, "Sk", H, D))``); everything codegen derives
from it (a stride ``Sk*H*D``, an element count ``B*Sk``) is then a :class:`Size`, a polynomial
with integer coefficients in the symbols. Code that works on static shapes keeps its ints: a
``Size`` only appears where a symbol is involved, and arithmetic between ints and ``Size`` stays
exact. Two equal polynomials compare equal (the form is canonical), which is what view and
GEMM planning need ("is this stride the row length?"). Native code evaluates a ``Size`` from the
call's sizes table (:func:`emit_size`).
"""

from __future__ import annotations

from collections.abc import Mapping

from llvmlite import ir

from rlx.codegen.irutil import I64, gep, i64
from rlx.ir.dims import Size, SizeLike, poly


def size_of(dim: int | str | Size) -> SizeLike:
    """A shape entry as a size: an int as is, a symbolic dimension (``"N"``, ``"2*N"``, ``"P+1"``)
    as its polynomial."""
    return poly(dim)


def at_least(a: int | str | Size, b: int | str | Size) -> bool:
    """``a >= b`` for every call, where that is provable: ``a - b`` is a polynomial whose symbol
    terms have positive coefficients, and which is >= 0 with every symbol at its least, 1."""
    difference = size_of(a) - size_of(b)
    if isinstance(difference, int):
        return difference >= 0
    if any(c < 0 for m, c in difference.terms if m):
        return False
    return sum(c for _, c in difference.terms) >= 0


def emit_size(b: ir.IRBuilder, value: int | str | Size, symbols: Mapping[str, ir.Value]) -> ir.Value:
    """``value`` as an i64 at ``b``: a constant, or computed from the call's symbol values."""
    value = size_of(value)
    if isinstance(value, int):
        return i64(value)
    total: ir.Value | None = None
    for monomial, coefficient in value.terms:
        term: ir.Value | None = None
        for name in monomial:
            term = symbols[name] if term is None else b.mul(term, symbols[name])
        if term is None or coefficient != 1:
            term = i64(coefficient) if term is None else b.mul(term, i64(coefficient))
        total = term if total is None else b.add(total, term)
    assert total is not None
    return total


def ceil_div(b: ir.IRBuilder, value: ir.Value, divisor: int) -> ir.Value:
    """``ceil(value / divisor)`` for a non-negative i64 ``value``."""
    if divisor == 1:
        return value
    return b.sdiv(b.add(value, i64(divisor - 1)), i64(divisor))


def nominal(value: int | str | Size, guess: int = 256) -> int:
    """A stand-in number for a size (every symbol ``guess``), for heuristics such as work per item."""
    value = size_of(value)
    if isinstance(value, int):
        return value
    return max(1, sum(c * guess ** len(m) for m, c in value.terms))


def load_symbols(b: ir.IRBuilder, sizes: ir.Value, symbols: tuple[str, ...]) -> dict[str, ir.Value]:
    """Each symbol's size this call, read from the sizes table at ``b``."""
    return {
        name: b.load(gep(b, sizes, [i64(slot)], I64), typ=I64, name=f"size.{name}") for slot, name in enumerate(symbols)
    }
