"""``numpy.einsum`` built from the registered ops: no op of its own.

An equation names each operand's axes by letters; ``...`` stands for leading axes that broadcast
as NumPy's do. The result is computed as NumPy's unoptimised einsum orders it, left to right: a
label repeated within one operand takes that operand's diagonal (a gather of its entries), labels
nothing later needs are summed out, and each pair of operands becomes one batched ``matmul``
(batch labels, the labels it contracts, each side's free labels), or a broadcasting ``mul`` where
it contracts nothing. So einsum's shape rule, reference, gradient and lowering are those ops',
and ``matmul`` reaches BLAS with transposes and strides, as a hand-written product would.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.dims import dim_text, product
from rlx.ir.types import Dim
from rlx.ops._common import as_value, require_float

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value

LETTERS = frozenset(string.ascii_letters)
_BROADCAST_LABELS = "".join(chr(0x100 + i) for i in range(64))
"""Private labels of the axes ``...`` stands for (never letters a user can write)."""


@dataclass(frozen=True)
class _Term:
    """One operand's subscripts: its letters, and where ``...`` stood among them (or None)."""

    letters: str
    ellipsis_at: int | None


def einsum(graph: Graph, equation: object, *operands: object) -> Value:
    """``numpy.einsum(equation, *operands)`` for float32 values (numbers and NumPy arrays become
    constants); see the module docstring. Errors name ``einsum`` and the subscript at fault."""
    if not isinstance(equation, str):
        raise RlxTypeError(f"einsum: the equation must be a str such as 'ij,jk->ik', got {type(equation).__name__}")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])  # torch.einsum(eq, [a, b]) as well as (eq, a, b)
    if not operands:
        raise RlxValueError("einsum: no operands")
    values = [as_value(graph, x, f"einsum: operand {i}") for i, x in enumerate(operands)]
    for index, value in enumerate(values):
        require_float("einsum", f"operand {index}", value.type)
    spec = "".join(equation.split())
    inputs, arrow, output = spec.partition("->")
    terms = [_parse_term(text, f"operand {i} subscripts {text!r}") for i, text in enumerate(inputs.split(","))]
    if len(terms) != len(values):
        raise RlxValueError(f"einsum: {equation!r} has subscripts for {len(terms)} operands, got {len(values)}")
    labels = [_expand(term, value, index) for index, (term, value) in enumerate(zip(terms, values, strict=True))]
    broadcast = max((len(_broadcast_of(lab)) for lab in labels), default=0)
    if arrow:
        result_term = _parse_term(output, f"output subscripts {output!r}")
        if result_term.ellipsis_at is None and broadcast:
            raise RlxValueError(
                f"einsum: {equation!r}: the operands' '...' stand for {broadcast} axes, which the output "
                "must keep: add '...' to the output subscripts"
            )
        result = _with_broadcast(result_term, _broadcast_labels(broadcast))
        repeated = sorted({c for c in result if result.count(c) > 1})
        if repeated:
            raise RlxValueError(f"einsum: {equation!r}: output subscript {repeated[0]!r} appears more than once")
        unknown = [c for c in result_term.letters if not any(c in lab for lab in labels)]
        if unknown:
            raise RlxValueError(f"einsum: {equation!r}: output subscript {unknown[0]!r} is in no operand's subscripts")
    else:  # NumPy's implicit output: the broadcast axes, then the letters used once, sorted
        letters = "".join(c for lab in labels for c in lab if c in LETTERS)
        result = _broadcast_labels(broadcast) + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    for index in range(len(values)):
        values[index], labels[index] = _diagonals(graph, values[index], labels[index], index)
    sizes = _label_sizes(equation, values, labels)
    value, current = values[0], labels[0]
    for index in range(1, len(values)):
        later = set(result) | {c for lab in labels[index + 1 :] for c in lab}
        value, current = _contract(graph, value, current, values[index], labels[index], later, sizes)
    value, current = _sum_out(graph, value, current, set(result))  # every output label is kept: a transpose is left
    return _permuted(graph, value, current, list(result))


def _parse_term(text: str, what: str) -> _Term:
    ellipsis_at = None
    if "..." in text:
        if text.count("...") > 1:
            raise RlxValueError(f"einsum: {what} has more than one '...'")
        ellipsis_at = text.index("...")
        text = text.replace("...", "")
    bad = [c for c in text if c not in LETTERS]
    if bad:
        raise RlxValueError(f"einsum: {what}: {bad[0]!r} is not a subscript (letters a-z, A-Z and '...')")
    return _Term(text, ellipsis_at)


def _with_broadcast(term: _Term, broadcast: str) -> str:
    """The term's labels with ``broadcast`` where its ``...`` stood."""
    if term.ellipsis_at is None:
        return term.letters
    return term.letters[: term.ellipsis_at] + broadcast + term.letters[term.ellipsis_at :]


def _broadcast_labels(count: int) -> str:
    """The labels of ``count`` axes that ``...`` stands for, right-aligned (the last axes of every
    operand's ``...`` share labels, as NumPy's broadcasting aligns shapes from the right)."""
    return _BROADCAST_LABELS[len(_BROADCAST_LABELS) - count :] if count else ""


def _broadcast_of(labels: str) -> str:
    return "".join(c for c in labels if c not in LETTERS)


def _expand(term: _Term, value: Value, index: int) -> str:
    """An operand's label per axis, its ``...`` axes labelled right-aligned as NumPy broadcasts."""
    extra = value.ndim - len(term.letters)
    if term.ellipsis_at is None and extra:
        raise RlxValueError(
            f"einsum: operand {index} is {value.type}, rank {value.ndim}, but its subscripts "
            f"{term.letters!r} name {len(term.letters)} axes"
        )
    if extra < 0:
        raise RlxValueError(
            f"einsum: operand {index} is {value.type}, rank {value.ndim}, fewer axes than its subscripts "
            f"{term.letters!r} name"
        )
    if extra > len(_BROADCAST_LABELS):
        raise RlxValueError(f"einsum: operand {index}: '...' stands for more than {len(_BROADCAST_LABELS)} axes")
    return _with_broadcast(term, _broadcast_labels(extra))


def _diagonals(graph: Graph, value: Value, labels: str, index: int) -> tuple[Value, str]:
    """``value`` with each label that repeats within ``labels`` taken once: the entries where
    those axes agree (``'ii->i'``), gathered at flat positions ``k * (n + 1)``."""
    while len(set(labels)) != len(labels):
        label = next(c for c in labels if labels.count(c) > 1)
        first, second = labels.index(label), labels.index(label, labels.index(label) + 1)
        size, other = value.shape[first], value.shape[second]
        if size != other:
            raise RlxValueError(
                f"einsum: operand {index} repeats subscript {label!r} on axes of sizes {size} and {other}, "
                f"which differ ({value.type})"
            )
        if not isinstance(size, int):
            raise RlxValueError(f"einsum: operand {index} repeats subscript {label!r} on a symbolic axis ({size})")
        rest = [a for a in range(value.ndim) if a not in (first, second)]
        perm = (first, second, *rest)  # by position: the label repeats, so it cannot name the axis
        front = graph.transpose(value, perm) if perm != tuple(range(value.ndim)) else value
        flat = graph.reshape(front, (size * size, *front.shape[2:]))
        value = graph.take(flat, np.arange(size, dtype=np.int64) * (size + 1), axis=0)
        labels = label + "".join(labels[a] for a in rest)
    return value, labels


def _label_sizes(equation: str, values: list[Value], labels: list[str]) -> dict[str, Dim]:
    """Each label's size: equal wherever it appears, or 1 (NumPy broadcasts a size-1 axis)."""
    sizes: dict[str, Dim] = {}
    for index, (value, lab) in enumerate(zip(values, labels, strict=True)):
        for label, size in zip(lab, value.shape, strict=True):
            known = sizes.get(label)
            if known is None or known == 1:
                sizes[label] = size
            elif size != 1 and size != known:
                shown = repr(label) if label in LETTERS else "of '...'"
                raise RlxValueError(
                    f"einsum: {equation!r}: subscript {shown} has size {known} in one operand and {size} "
                    f"in operand {index}, which do not broadcast"
                )
    return sizes


def _sum_out(graph: Graph, value: Value, labels: str, keep: set[str]) -> tuple[Value, str]:
    gone = tuple(i for i, c in enumerate(labels) if c not in keep)
    if not gone:
        return value, labels
    return graph.sum(value, axis=gone), "".join(c for c in labels if c in keep)


def _merged(sizes: dict[str, Dim], labels: list[str]) -> int | str:
    return dim_text(product(sizes[c] for c in labels))


def _full(graph: Graph, value: Value, labels: str, sizes: dict[str, Dim]) -> Value:
    """``value`` with its size-1 axes broadcast to their labels' sizes (a view)."""
    shape = tuple(sizes[c] for c in labels)
    return graph.broadcast_to(value, shape) if tuple(value.shape) != shape else value


def _contract(
    graph: Graph, a: Value, la: str, b: Value, lb: str, later: set[str], sizes: dict[str, Dim]
) -> tuple[Value, str]:
    """``a`` and ``b`` contracted over the labels they share that nothing later needs."""
    a, la = _sum_out(graph, a, la, set(lb) | later)
    b, lb = _sum_out(graph, b, lb, set(la) | later)
    a, b = _full(graph, a, la, sizes), _full(graph, b, lb, sizes)
    batch = [c for c in la if c in lb and c in later]
    inner = [c for c in la if c in lb and c not in later]
    left = [c for c in la if c not in lb]
    right = [c for c in lb if c not in la]
    labels = "".join(batch + left + right)
    if not inner:  # nothing to sum over: an elementwise product that broadcasts
        a_view, b_view = _permuted(graph, a, la, batch + left), _permuted(graph, b, lb, batch + right)
        a_shape = tuple(sizes[c] for c in batch + left) + (1,) * len(right)
        b_shape = tuple(sizes[c] for c in batch) + (1,) * len(left) + tuple(sizes[c] for c in right)
        return graph.mul(_reshaped(graph, a_view, a_shape), _reshaped(graph, b_view, b_shape)), labels
    a3 = _reshaped(
        graph,
        _permuted(graph, a, la, batch + left + inner),
        (*(sizes[c] for c in batch), _merged(sizes, left), _merged(sizes, inner)),
    )
    b3 = _reshaped(
        graph,
        _permuted(graph, b, lb, batch + inner + right),
        (*(sizes[c] for c in batch), _merged(sizes, inner), _merged(sizes, right)),
    )
    return _reshaped(graph, graph.matmul(a3, b3), tuple(sizes[c] for c in labels)), labels


def _permuted(graph: Graph, value: Value, labels: str, order: list[str]) -> Value:
    """``value`` (axes labelled ``labels``) with its axes in ``order`` (itself if they are)."""
    perm = tuple(labels.index(c) for c in order)
    return graph.transpose(value, perm) if perm != tuple(range(len(perm))) else value


def _reshaped(graph: Graph, value: Value, shape: tuple[Dim, ...]) -> Value:
    return graph.reshape(value, shape) if tuple(value.shape) != shape else value
