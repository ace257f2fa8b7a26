"""Symbolic dimensions as polynomials: ``"Sk"``, ``"2*N"`` (a reshape's merge), ``"P+1"`` (a concat).

A graph input names a dimension (``g.input("k", (B, "Sk", H, D))``) whose size each call binds.
Shape rules derive dimensions from those names: a reshape that merges axes multiplies
(``"2*N"``), a concat along a symbolic axis adds (``"P+1"``: a KV cache and the new token), a
slice from a symbolic end subtracts (``"S-1"``: ``ids[:, 1:]``). All are polynomials with
integer coefficients in the symbols (a dimension with a negative term is checked per call,
``rlx.bind.short_dims``); :class:`Size` is one, with exact arithmetic and a canonical form, so
equal dimensions compare equal however they arose. In a type a dimension stays an ``int`` or
its canonical text (:func:`dim_text`), which is what prints, parses, hashes and compares;
:func:`poly` turns the text back into a :class:`Size`. Code generation computes the same
polynomials into strides and offsets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

Monomial = tuple[str, ...]  # sorted symbol names, a name repeated for its power
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def is_symbol(text: object) -> bool:
    """A symbolic dimension's name: an identifier like ``"Sk"``."""
    return isinstance(text, str) and _SYMBOL.match(text) is not None


@dataclass(frozen=True)
class Size:
    """``sum(coefficient * product(symbols))`` in a canonical order; build with :meth:`make`."""

    terms: tuple[tuple[Monomial, int], ...]

    @staticmethod
    def make(terms: Mapping[Monomial, int]) -> int | Size:
        """The canonical value of ``terms``: an int when no symbol is left."""
        kept = tuple(sorted((m, c) for m, c in terms.items() if c != 0))
        if not kept:
            return 0
        if len(kept) == 1 and kept[0][0] == ():
            return kept[0][1]
        return Size(kept)

    @staticmethod
    def symbol(name: str) -> Size:
        return Size((((name,), 1),))

    def _terms(self) -> dict[Monomial, int]:
        return dict(self.terms)

    def __add__(self, other: int | Size) -> int | Size:
        terms = self._terms()
        for monomial, coefficient in terms_of(other).items():
            terms[monomial] = terms.get(monomial, 0) + coefficient
        return Size.make(terms)

    __radd__ = __add__

    def __sub__(self, other: int | Size) -> int | Size:
        return self + (-1) * other

    def __rsub__(self, other: int | Size) -> int | Size:
        return other + (-1) * self

    def __mul__(self, other: int | Size) -> int | Size:
        terms: dict[Monomial, int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in terms_of(other).items():
                monomial = tuple(sorted(m1 + m2))
                terms[monomial] = terms.get(monomial, 0) + c1 * c2
        return Size.make(terms)

    __rmul__ = __mul__

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbol names, each once, sorted."""
        return tuple(sorted({name for monomial, _ in self.terms for name in monomial}))

    def evaluate(self, sizes: Mapping[str, int]) -> int:
        return sum(c * math.prod(sizes[name] for name in m) for m, c in self.terms)

    def __str__(self) -> str:
        """The canonical text: terms of higher degree first, then by name, the constant last;
        each ``coefficient*name*name`` with a coefficient of 1 left out (``"2*N+S+1"``)."""
        parts = []
        for monomial, coefficient in sorted(self.terms, key=lambda term: (-len(term[0]), term[0])):
            if coefficient < 0:
                parts.append(f"-{_term_text(monomial, -coefficient)}")
            else:
                parts.append(("+" if parts else "") + _term_text(monomial, coefficient))
        return "".join(parts)


def _term_text(monomial: Monomial, coefficient: int) -> str:
    return "*".join(([str(coefficient)] if coefficient != 1 or not monomial else []) + list(monomial))


SizeLike = int | Size


def product(dims: Iterable[int | str | Size]) -> SizeLike:
    """The product of dimensions: an element count (an int when they are all static)."""
    total: SizeLike = 1
    for dim in dims:
        total = total * poly(dim)
    return total


def total(dims: Iterable[int | str | Size]) -> SizeLike:
    """The sum of dimensions: the length of parts laid end to end (a concat, a split)."""
    result: SizeLike = 0
    for dim in dims:
        result = result + poly(dim)
    return result


def terms_of(value: SizeLike) -> dict[Monomial, int]:
    return value._terms() if isinstance(value, Size) else {(): value}


def poly(dim: int | str | Size) -> SizeLike:
    """A dimension as a polynomial: an int as is, ``"Sk"`` or ``"2*N+1"`` as a :class:`Size`."""
    if isinstance(dim, str):
        return _parse_cached(dim)
    return dim


@lru_cache(maxsize=4096)
def _parse_cached(text: str) -> SizeLike:
    value = parse_poly(text)
    if value is None:
        raise ValueError(f"not a dimension: {text!r}")
    return value


def parse_poly(text: str) -> SizeLike | None:
    """``"N"``, ``"2*N"``, ``"P + 1"``, ``"B*S+B"``, ``"S-1"``: sums and differences of products of
    positive ints and symbol names (a leading ``-`` allowed); spaces allowed around the
    operators; None for anything else."""
    pieces = _SIGNS.split(text)  # term, sign, term, sign, ...: "S-1" is ["S", "-", "1"]
    if not pieces[0].strip() and len(pieces) > 1 and pieces[1] == "-":
        pieces = ["0", *pieces[1:]]  # "-1+S"
    total: SizeLike = 0
    for position in range(0, len(pieces), 2):
        term = _product(pieces[position])
        if term is None:
            return None
        total = total - term if position and pieces[position - 1] == "-" else total + term
    return total


_SIGNS = re.compile(r"([+-])")


def _product(text: str) -> SizeLike | None:
    """``"2*N*S"``: positive ints and symbol names joined by ``*`` (``"0"`` only as a placeholder)."""
    if text.strip() == "0":
        return 0
    total: SizeLike = 1
    for factor in (f.strip() for f in text.split("*")):
        if factor.isascii() and factor.isdigit() and int(factor) >= 1:
            total = total * int(factor)
        elif is_symbol(factor):
            total = total * Size.symbol(factor)
        else:
            return None
    return total


def dim_text(value: SizeLike) -> int | str:
    """A polynomial as a type's dimension: an int, or its canonical text."""
    return value if isinstance(value, int) else str(value)


def parse_dim(text: str) -> int | str | None:
    """A dimension written by a user or in the textual IR, in canonical form (see :func:`parse_poly`);
    None if it is not one, or if its symbols cancel to a number (``"2*3"`` is not symbolic)."""
    value = parse_poly(text)
    return None if value is None or isinstance(value, int) else str(value)


def is_dim_expression(dim: object) -> bool:
    """A symbolic dimension in canonical form: a name, or a polynomial as :func:`dim_text` writes it."""
    return isinstance(dim, str) and parse_dim(dim) == dim


def dim_symbols(dim: int | str) -> tuple[str, ...]:
    """The symbol names a dimension is made of, each once, sorted."""
    value = poly(dim)
    return () if isinstance(value, int) else value.symbols


def dim_size(dim: int | str, sizes: Mapping[str, int]) -> int:
    """A dimension's size in one call, from the sizes of its symbols."""
    if isinstance(dim, int):
        return dim
    size = sizes.get(dim)  # a plain symbol (per call on every call: kept cheap)
    if size is not None:
        return size
    value = poly(dim)
    return value if isinstance(value, int) else value.evaluate(sizes)


def exact_quotient(dividend: SizeLike, divisor: SizeLike) -> SizeLike | None:
    """``dividend / divisor`` where ``divisor`` is a monomial (``4``, ``"2*N"``) that divides every
    term of ``dividend`` exactly; None otherwise."""
    divisor_terms = terms_of(divisor)
    if len(divisor_terms) != 1:
        return None
    ((names, coefficient),) = divisor_terms.items()
    if coefficient <= 0:
        return None
    quotient: dict[Monomial, int] = {}
    for monomial, c in terms_of(dividend).items():
        rest = list(monomial)
        for name in names:
            if name not in rest:
                return None
            rest.remove(name)
        if c % coefficient:
            return None
        quotient[tuple(rest)] = c // coefficient
    return Size.make(quotient)


def canonical_dim(dim: object) -> object:
    """A user's dimension with a symbolic one in canonical form (``"1 + P"`` is ``"P+1"``); anything
    else as it is, for the shape check to judge."""
    if isinstance(dim, str):
        parsed = parse_dim(dim)
        return dim if parsed is None else parsed
    return dim
