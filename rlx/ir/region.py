"""A traced attention mod: a straight-line program over one score and its indices.

A ``score_mod`` or ``mask_mod`` (SPEC section 4) is traced once into a :class:`Region`: steps
that each apply one op to earlier results, the symbols ``%score %b %h %q_idx %kv_idx`` (and
the lengths ``%q_len %kv_len``, constant over a call), literal numbers, and reads of the
attention node's captured tensors (``read(%c0, %b, %q_idx)``).
The last step is the result. Printed, a region is one quoted line::

    "div(%score, 30.0); tanh(%t0); mul(%t1, 30.0)"

Elementwise steps are the registered elementwise ops (their scalar formulas are what codegen
inlines, their references what :meth:`Region.evaluate` runs); ``floordiv``, ``mod``, ``read`` and
``id`` are the region's own. Everything derived from a region lives here, next to it:
dtypes, dependences, the float64 evaluation, interval bounds (block sparsity and index
checks) and the reverse-mode derivative (:meth:`Region.gradient`), so no mod's gradient is
written by hand.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SYMBOLS = ("score", "b", "h", "q_idx", "kv_idx", "q_len", "kv_len")
"""The region's free variables: the scaled score (float), its four indices and the attention's
query and key lengths (ints; the lengths may be symbolic dimensions, known per call)."""

# Result kind of each op from its operand kinds: "f" float, "i" int, "b" bool.
FLOAT_UNARY = ("exp", "log", "tanh", "sigmoid", "sqrt")
SAME_UNARY = ("neg", "abs", "id")
ARITHMETIC = ("add", "sub", "mul", "maximum", "minimum")
INT_ONLY = ("floordiv", "mod")
COMPARISONS = ("less", "less_equal", "greater", "greater_equal", "equal", "not_equal")
LOGICAL = ("logical_and", "logical_or")
OPS = (
    FLOAT_UNARY
    + SAME_UNARY
    + ARITHMETIC
    + INT_ONLY
    + COMPARISONS
    + LOGICAL
    + (
        "div",
        "logical_not",
        "where",
        "read",
    )
)

Ref = tuple[str, Any]
Interval = tuple[Any, Any]  # (lo, hi): float64 numbers or arrays that broadcast
"""An operand: ``("s", name)`` symbol, ``("t", n)`` step n, ``("c", n)`` captured tensor n,
``("k", number)`` literal (a Python ``bool``, ``int`` or ``float``)."""


@dataclass(frozen=True)
class RegionStep:
    op: str
    args: tuple[Ref, ...]


def format_ref(ref: Ref) -> str:
    kind, value = ref
    if kind == "s":
        return f"%{value}"
    if kind in ("t", "c"):
        return f"%{kind}{value}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)  # floats always show a '.', 'e', 'inf' or 'nan'; ints never do


_REF = re.compile(r"%(score|b|h|q_idx|kv_idx|q_len|kv_len)$|%([tc])(\d+)$")
_STEP = re.compile(r"^([a-z_]+)\((.*)\)$")


def parse_ref(text: str) -> Ref:
    match = _REF.match(text)
    if match is not None:
        if match.group(1):
            return ("s", match.group(1))
        return (match.group(2), int(match.group(3)))
    if text in ("true", "false"):
        return ("k", text == "true")
    if re.fullmatch(r"-?\d+", text):
        return ("k", int(text))
    try:
        return ("k", float(text))
    except ValueError:
        raise ValueError(
            f"bad region operand {text!r}; expected %score, %b, %h, %q_idx, %kv_idx, %q_len, %kv_len, %tN, %cN "
            "or a number"
        ) from None


@dataclass(frozen=True)
class KeyBound:
    """``kv_idx - q_idx <= constant + q_len·Sq + kv_len·Sk + Σ c·step`` wherever a mask attends
    (``Sq``, ``Sk`` the attention's lengths; ``steps``: ``(c, index)`` of the region's int steps
    that depend on the lengths alone, as ``max(Sk - Sq, 0)``): a diagonal above which it hides
    every key (:meth:`Region.key_bounds`)."""

    constant: int
    q_len: int = 0
    kv_len: int = 0
    steps: tuple[tuple[int, int], ...] = ()


# Comparisons as ``a - b <= offset`` (or ``b - a``, ``swap``), and what ``not`` makes of each.
_AT_MOST = {"less": (False, -1), "less_equal": (False, 0), "greater": (True, -1), "greater_equal": (True, 0)}
_NEGATION = {"less": "greater_equal", "less_equal": "greater", "greater": "less_equal", "greater_equal": "less"}
_LINEAR_SYMBOLS = ("q_idx", "kv_idx", "q_len", "kv_len")
# Integer coefficients of _LINEAR_SYMBOLS, "1" (the constant) and "t<n>": step n, an int of the
# lengths alone that is not linear in them (a constant of the call all the same).
Linear = dict[str, int]


@dataclass(frozen=True)
class Region:
    """The steps of one traced mod; the last step's value is the mod's result."""

    steps: tuple[RegionStep, ...]

    def __str__(self) -> str:
        return '"' + "; ".join(f"{s.op}({', '.join(format_ref(a) for a in s.args)})" for s in self.steps) + '"'

    @staticmethod
    def parse(text: str) -> Region:
        body = text[1:-1] if text.startswith('"') and text.endswith('"') else text
        steps = []
        for part in body.split(";"):
            match = _STEP.match(part.strip())
            if match is None:
                raise ValueError(f"bad region step {part.strip()!r}; expected like tanh(%t0)")
            args = tuple(parse_ref(arg.strip()) for arg in match.group(2).split(",")) if match.group(2).strip() else ()
            steps.append(RegionStep(match.group(1), args))
        region = Region(tuple(steps))
        region.check(None)
        return region

    # ------------------------------------------------------------------ structure

    def check(self, captured: Sequence[tuple[tuple[int | str, ...], str]] | None) -> list[str]:
        """Validate the steps and return each step's kind (``f``/``i``/``b``).

        ``captured`` gives each captured tensor's shape and kind; ``None`` checks only what
        needs no tensors (the parser, before the node's operands are known).
        """
        if not self.steps:
            raise ValueError("a region needs at least one step")
        kinds: list[str] = []
        for index, step in enumerate(self.steps):
            if step.op not in OPS:
                raise ValueError(f"step {index}: unknown region op {step.op!r}; expected one of {', '.join(OPS)}")
            arg_kinds = []
            for position, ref in enumerate(step.args):
                kind, value = ref
                if kind == "t" and not (isinstance(value, int) and 0 <= value < index):
                    raise ValueError(f"step {index} reads %t{value}, which does not exist there")
                if kind == "c":
                    if step.op != "read" or position != 0:
                        raise ValueError(
                            f"step {index}: a captured tensor %c{value} can only be read: read(%c{value}, ...)"
                        )
                    if captured is not None and not (isinstance(value, int) and 0 <= value < len(captured)):
                        raise ValueError(
                            f"step {index} reads %c{value}, but the node has {len(captured)} captured tensors"
                        )
                    arg_kinds.append("c")
                    continue
                arg_kinds.append(_ref_kind(ref, kinds))
            kinds.append(_result_kind(index, step, arg_kinds, captured))
        return kinds

    def result_kind(self, captured: Sequence[tuple[tuple[int | str, ...], str]] | None = None) -> str:
        return self.check(captured)[-1]

    def dependences(self) -> list[frozenset[str]]:
        """For each step, the symbols its value depends on (``"c"`` marks a tensor read)."""
        deps: list[frozenset[str]] = []
        for step in self.steps:
            found: set[str] = set()
            for kind, value in step.args:
                if kind == "s":
                    found.add(str(value))
                elif kind == "t":
                    found |= deps[int(value)]
            deps.append(frozenset(found))
        return deps

    def reads(self) -> list[tuple[int, int]]:
        """``(step, captured tensor)`` of every read, in step order."""
        return [(i, int(s.args[0][1])) for i, s in enumerate(self.steps) if s.op == "read"]

    # ------------------------------------------------------------------ float64 evaluation

    def evaluate(self, symbols: Mapping[str, np.ndarray], tensors: Sequence[np.ndarray]) -> np.ndarray:
        """The region over broadcasting arrays of its symbols, in float64 / int64 / bool."""
        return self.evaluate_all(symbols, tensors)[-1]

    def evaluate_all(self, symbols: Mapping[str, np.ndarray], tensors: Sequence[np.ndarray]) -> list[np.ndarray]:
        values: list[np.ndarray] = []

        def get(ref: Ref) -> np.ndarray:
            kind, value = ref
            if kind == "s":
                return symbols[str(value)]
            if kind == "t":
                return values[int(value)]
            return np.asarray(value, dtype=np.float64 if isinstance(value, float) else None)

        with np.errstate(all="ignore"):
            for step in self.steps:
                if step.op == "read":
                    tensor = np.asarray(tensors[int(step.args[0][1])])
                    index = tuple(np.asarray(get(ref), dtype=np.int64) for ref in step.args[1:])
                    result = tensor[index]
                    values.append(result.astype(np.float64) if tensor.dtype.kind == "f" else result)
                else:
                    values.append(np.asarray(NUMPY[step.op](*(get(ref) for ref in step.args))))
        return values

    # ------------------------------------------------------------------ intervals

    def bounds(
        self,
        symbols: Mapping[str, Interval],
        read_bounds: Callable[[int, int, list[Interval]], Interval],
    ) -> list[Interval]:
        """Sound ``(lo, hi)`` of every step, over boxes of symbol values (arrays broadcast).

        Bools are ``(certainly true, possibly true)`` as 0/1. ``read_bounds(step, tensor,
        index_bounds)`` bounds a tensor read. Used for block maps and for index range checks.
        """
        out: list[Interval] = []

        def get(ref: Ref) -> Interval:
            kind, value = ref
            if kind == "s":
                return symbols[str(value)]
            if kind == "t":
                return out[int(value)]
            number = np.float64(float(value))
            return number, number

        with np.errstate(all="ignore"):
            for index, step in enumerate(self.steps):
                if step.op == "read":
                    out.append(read_bounds(index, int(step.args[0][1]), [get(r) for r in step.args[1:]]))
                else:
                    lo, hi = INTERVAL[step.op](*(get(ref) for ref in step.args))
                    out.append((np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)))
        return out

    # ------------------------------------------------------------------ reverse mode

    def gradient(self, kinds: list[str]) -> GradientRegion:
        """A region whose steps compute this one's, then its derivatives.

        Its :attr:`outputs` are, in order: the result, d result / d score, and for every
        float ``read`` step (in step order) d result / d (the value read). Derivatives of int
        and bool steps are zero by construction. Built from one local rule per op
        (:data:`_ADJOINT`), so any traced mod differentiates.
        """
        steps = list(self.steps)
        adjoint: dict[Ref, Ref] = {}

        def emit(op: str, *args: Ref) -> Ref:
            steps.append(RegionStep(op, args))
            return ("t", len(steps) - 1)

        def accumulate(target: Ref, contribution: Ref) -> None:
            if target[0] == "k" or target[0] == "c":
                return
            if target[0] == "t" and kinds[int(target[1])] != "f":
                return
            if target[0] == "s" and target[1] != "score":
                return
            earlier = adjoint.get(target)
            adjoint[target] = contribution if earlier is None else emit("add", earlier, contribution)

        last = len(self.steps) - 1
        if kinds[last] == "f":
            adjoint[("t", last)] = ("k", 1.0)
        for index in range(last, -1, -1):
            ct = adjoint.get(("t", index))
            if ct is None:
                continue
            step = self.steps[index]
            if step.op == "read":
                continue
            _ADJOINT[step.op](emit, accumulate, ct, ("t", index), *step.args)
        zero: Ref = ("k", 0.0)
        outputs = [("t", last), adjoint.get(("s", "score"), zero)]
        outputs += [adjoint.get(("t", i), zero) for i, _ in self.float_reads(kinds)]
        return GradientRegion(tuple(steps), tuple(outputs))

    # ------------------------------------------------------------------ restructuring

    def cone(self, ref: Ref) -> Region:
        """A region of the steps that ``ref`` (a step of this one) depends on, ending in it."""
        if ref[0] != "t":
            return Region((RegionStep("id", (ref,)),))
        keep = sorted(self.needed_steps(int(ref[1])))
        renumber = {old: new for new, old in enumerate(keep)}

        def moved(arg: Ref) -> Ref:
            return ("t", renumber[int(arg[1])]) if arg[0] == "t" else arg

        return Region(tuple(RegionStep(self.steps[i].op, tuple(moved(a) for a in self.steps[i].args)) for i in keep))

    def needed_steps(self, index: int) -> set[int]:
        """Step ``index`` and every step its value depends on."""
        needed, pending = set(), [index]
        while pending:
            step = pending.pop()
            if step not in needed:
                needed.add(step)
                pending.extend(int(arg[1]) for arg in self.steps[step].args if arg[0] == "t")
        return needed

    def replaced_where(self) -> tuple[Region, float] | None:
        """``(visible, value)`` when this score_mod is ``where(cond, value, x)`` (or
        ``where(cond, x, value)``) with ``cond`` not reading the score and ``value`` a number:
        the mod replaces the scores ``visible`` excludes by a constant. Codegen makes such a
        mod block-sparse, as a mask_mod is (a MaskKind with a finite ``neg`` is one)."""
        last = self.steps[-1]
        if last.op != "where" or last.args[0][0] != "t":
            return None
        cond, a, b = last.args
        if "score" in self.dependences()[int(cond[1])]:
            return None
        for literal, hides_when in ((a, True), (b, False)):
            kind, value = literal
            if kind == "k" and not isinstance(value, bool):
                visible = self.cone(cond)
                if hides_when:
                    steps = (*visible.steps, RegionStep("logical_not", (("t", len(visible.steps) - 1),)))
                    visible = Region(steps)
                return visible, float(value)
        return None

    def key_bounds(self) -> tuple[KeyBound, ...]:
        """Diagonals a mask_mod never attends above: each term of the conjunction its result is
        (through ``&``, ``~`` and De Morgan's ``~(a | b)``) that compares integer-linear forms of
        ``kv_idx - q_idx`` with literals, the lengths and int steps of the lengths alone, as
        ``q_idx >= kv_idx`` (causal), ``q_idx + (kv_len - q_len) >= kv_idx``, ``kv_idx <= q_idx
        + right`` (a sliding window) and ``q_idx + max(kv_len - q_len, 0) >= kv_idx`` (the fixed
        causal mask as a mod) do. Empty where no term bounds the keys so: the mask is still
        exact, it just gives the attention kernels no band to skip (``tile_gemm.Band``)."""
        forms: dict[int, Linear | None] = {}
        lengths = {"q_len", "kv_len"}

        def of_lengths(index: int, deps: frozenset[str]) -> bool:
            """An int step of the lengths alone (its cone reads no tensor: no shapes needed)."""
            return bool(deps) and deps <= lengths and self.cone(("t", index)).result_kind() == "i"

        per_call = [of_lengths(index, deps) for index, deps in enumerate(self.dependences())]

        def linear(ref: Ref) -> Linear | None:
            kind, value = ref
            if kind == "s":
                return {str(value): 1} if value in _LINEAR_SYMBOLS else None
            if kind == "k":
                return {"1": value} if isinstance(value, int) and not isinstance(value, bool) else None
            if kind != "t":
                return None
            index = int(value)
            if index not in forms:
                form = self._linear_step(index, linear)
                forms[index] = {f"t{index}": 1} if form is None and per_call[index] else form
            return forms[index]

        def implied(ref: Ref, negated: bool) -> list[KeyBound]:
            if ref[0] != "t":
                return []
            step = self.steps[int(ref[1])]
            if step.op in ("logical_not", "id"):
                return implied(step.args[0], negated != (step.op == "logical_not"))
            if step.op == ("logical_or" if negated else "logical_and"):
                return implied(step.args[0], negated) + implied(step.args[1], negated)
            op = _NEGATION.get(step.op) if negated else step.op
            if op not in _AT_MOST:
                return []
            swap, offset = _AT_MOST[op]
            a, c = (linear(arg) for arg in (step.args[::-1] if swap else step.args))
            if a is None or c is None:
                return []
            form = {key: a.get(key, 0) - c.get(key, 0) for key in {*a, *c}}  # form <= offset
            if form.get("kv_idx", 0) != 1 or form.get("q_idx", 0) != -1:
                return []
            steps = tuple(sorted((-c, int(key[1:])) for key, c in form.items() if key.startswith("t") and c))
            return [KeyBound(offset - form.get("1", 0), -form.get("q_len", 0), -form.get("kv_len", 0), steps)]

        return tuple(implied(("t", len(self.steps) - 1), False))

    def _linear_step(self, index: int, linear: Callable[[Ref], Linear | None]) -> Linear | None:
        """Step ``index`` as an integer-linear form of :data:`_LINEAR_SYMBOLS`, or None."""
        step = self.steps[index]
        forms = [linear(arg) for arg in step.args]
        if any(form is None for form in forms):
            return None
        known = [form for form in forms if form is not None]
        if step.op == "id":
            return known[0]
        if step.op == "neg":
            return {key: -value for key, value in known[0].items()}
        if step.op in ("add", "sub"):
            sign = 1 if step.op == "add" else -1
            a, c = known
            return {key: a.get(key, 0) + sign * c.get(key, 0) for key in {*a, *c}}
        if step.op == "mul":
            a, c = known
            if set(c) <= {"1"}:
                a, c = c, a
            if set(a) <= {"1"}:
                factor = a.get("1", 0)
                return {key: factor * value for key, value in c.items()}
        return None

    def conjoin(self, other: Region) -> Region:
        """``self & other`` of two bool regions over the same captured tensors."""
        shift = len(self.steps)

        def moved(arg: Ref) -> Ref:
            return ("t", int(arg[1]) + shift) if arg[0] == "t" else arg

        steps = list(self.steps) + [RegionStep(s.op, tuple(moved(a) for a in s.args)) for s in other.steps]
        steps.append(RegionStep("logical_and", (("t", shift - 1), ("t", len(steps) - 1))))
        return Region(tuple(steps))

    def float_reads(self, kinds: list[str]) -> list[tuple[int, int]]:
        """``(step, tensor)`` of the reads that produce floats (the ones with gradients)."""
        return [(i, t) for i, t in self.reads() if kinds[i] == "f"]


@dataclass(frozen=True)
class GradientRegion(Region):
    """A region with several results (see :meth:`Region.gradient`); never printed in the IR."""

    outputs: tuple[Ref, ...] = ()


def _ref_kind(ref: Ref, kinds: list[str]) -> str:
    kind, value = ref
    if kind == "s":
        return "f" if value == "score" else "i"
    if kind == "t":
        return kinds[int(value)]
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int):
        return "i"
    return "f"


def _promote(*kinds: str) -> str:
    return "f" if "f" in kinds else "i"


def _result_kind(
    index: int, step: RegionStep, args: list[str], captured: Sequence[tuple[tuple[int | str, ...], str]] | None
) -> str:
    op = step.op
    arity = {"where": 3, "read": None, "logical_not": 1}.get(op, 1 if op in FLOAT_UNARY + SAME_UNARY else 2)
    if arity is not None and len(args) != arity:
        raise ValueError(f"step {index}: {op} takes {arity} operands, got {len(args)}")
    where = f"step {index} ({op})"
    if op == "read":
        if not args or args[0] != "c":
            raise ValueError(f"{where}: the first operand must be a captured tensor %cN")
        if any(kind != "i" for kind in args[1:]):
            raise ValueError(f"{where}: tensor indices must be integers (b, h, q_idx, kv_idx or int arithmetic)")
        if captured is None:
            return "f"
        shape, kind = captured[int(step.args[0][1])]
        if len(args) - 1 != len(shape):
            raise ValueError(f"{where}: the tensor has {len(shape)} dimensions, indexed with {len(args) - 1}")
        return kind
    if op in LOGICAL or op == "logical_not":
        if any(kind != "b" for kind in args):
            raise ValueError(f"{where}: operands must be bools (comparisons), got {'/'.join(args)}")
        return "b"
    if op in COMPARISONS:
        if "b" in args and set(args) != {"b"}:
            raise ValueError(f"{where}: cannot compare a bool with a number")
        return "b"
    if op == "where":
        if args[0] != "b":
            raise ValueError(f"{where}: the condition must be a bool")
        if "b" in args[1:]:
            return "b" if set(args[1:]) == {"b"} else _fail(where, "cannot mix bools and numbers")
        return _promote(*args[1:])
    if "b" in args and op != "id":
        raise ValueError(f"{where}: arithmetic on a bool; use rlx.where(cond, a, b)")
    if op in FLOAT_UNARY or op == "div":
        return "f"
    if op in INT_ONLY:
        if "f" in args:
            raise ValueError(f"{where}: // and % take integers")
        return "i"
    return _promote(*args) if op != "id" else args[0]


def _fail(where: str, message: str) -> str:
    raise ValueError(f"{where}: {message}")


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def _true_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.true_divide(np.asarray(a, dtype=np.float64), b)


NUMPY: dict[str, Callable[..., np.ndarray]] = {
    "exp": np.exp,
    "log": np.log,
    "tanh": np.tanh,
    "sigmoid": _sigmoid,
    "sqrt": np.sqrt,
    "neg": np.negative,
    "abs": np.abs,
    "id": lambda x: x,
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "div": _true_divide,
    "floordiv": np.floor_divide,
    "mod": np.mod,
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_not": np.logical_not,
    "where": np.where,
}

# ----------------------------------------------------------------------------- interval rules


def _monotone(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[Interval], Interval]:
    return lambda a: (fn(a[0]), fn(a[1]))


def _corners(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[Interval, Interval], Interval]:
    def rule(a: Interval, b: Interval) -> Interval:
        values = [fn(x, y) for x in a for y in b]
        values = [np.where(np.isnan(v), -np.inf, v) for v in values] + [
            np.where(np.isnan(v), np.inf, v) for v in values
        ]
        return np.minimum.reduce(values), np.maximum.reduce(values)

    return rule


def _div_bounds(a: Interval, b: Interval) -> Interval:
    spans_zero = (b[0] <= 0) & (b[1] >= 0)
    lo, hi = _corners(np.true_divide)(a, b)
    return np.where(spans_zero, -np.inf, lo), np.where(spans_zero, np.inf, hi)


def _floordiv_bounds(a: Interval, b: Interval) -> Interval:
    lo, hi = _div_bounds(a, b)
    return np.floor(lo), np.floor(hi)


def _mod_bounds(a: Interval, b: Interval) -> Interval:
    # Exact when the divisor is one positive number and a stays within one period; else [0, c).
    constant = (b[0] == b[1]) & (b[0] > 0)
    c = np.where(constant, b[0], 1.0)
    same_period = constant & (np.floor(a[0] / c) == np.floor(a[1] / c))
    lo = np.where(same_period, np.mod(a[0], c), np.where(constant, 0.0, -np.inf))
    hi = np.where(same_period, np.mod(a[1], c), np.where(constant, c - 1, np.inf))
    return lo, hi


def _abs_bounds(a: Interval) -> Interval:
    lo = np.where((a[0] <= 0) & (a[1] >= 0), 0.0, np.minimum(np.abs(a[0]), np.abs(a[1])))
    return lo, np.maximum(np.abs(a[0]), np.abs(a[1]))


def _truth(certain: np.ndarray, possible: np.ndarray) -> Interval:
    return np.asarray(certain, dtype=np.float64), np.asarray(possible, dtype=np.float64)


INTERVAL: dict[str, Callable[..., Interval]] = {
    "exp": _monotone(np.exp),
    "log": _monotone(np.log),
    "tanh": _monotone(np.tanh),
    "sigmoid": _monotone(_sigmoid),
    "sqrt": _monotone(np.sqrt),
    "neg": lambda a: (-a[1], -a[0]),
    "abs": _abs_bounds,
    "id": lambda a: a,
    "add": lambda a, b: (a[0] + b[0], a[1] + b[1]),
    "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
    "mul": _corners(np.multiply),
    "maximum": lambda a, b: (np.maximum(a[0], b[0]), np.maximum(a[1], b[1])),
    "minimum": lambda a, b: (np.minimum(a[0], b[0]), np.minimum(a[1], b[1])),
    "div": _div_bounds,
    "floordiv": _floordiv_bounds,
    "mod": _mod_bounds,
    "less": lambda a, b: _truth(a[1] < b[0], a[0] < b[1]),
    "less_equal": lambda a, b: _truth(a[1] <= b[0], a[0] <= b[1]),
    "greater": lambda a, b: _truth(a[0] > b[1], a[1] > b[0]),
    "greater_equal": lambda a, b: _truth(a[0] >= b[1], a[1] >= b[0]),
    "equal": lambda a, b: _truth((a[0] == a[1]) & (b[0] == b[1]) & (a[0] == b[0]), (a[0] <= b[1]) & (b[0] <= a[1])),
    "not_equal": lambda a, b: _truth(
        (a[1] < b[0]) | (b[1] < a[0]), ~((a[0] == a[1]) & (b[0] == b[1]) & (a[0] == b[0]))
    ),
    "logical_and": lambda a, b: (np.minimum(a[0], b[0]), np.minimum(a[1], b[1])),
    "logical_or": lambda a, b: (np.maximum(a[0], b[0]), np.maximum(a[1], b[1])),
    "logical_not": lambda a: (1.0 - a[1], 1.0 - a[0]),
    "where": lambda c, a, b: (
        np.where(c[0] == 1, a[0], np.where(c[1] == 0, b[0], np.minimum(a[0], b[0]))),
        np.where(c[0] == 1, a[1], np.where(c[1] == 0, b[1], np.maximum(a[1], b[1]))),
    ),
}

# ----------------------------------------------------------------------------- adjoint rules

Emit = Callable[..., Ref]
Accumulate = Callable[[Ref, Ref], None]
ONE: Ref = ("k", 1.0)
ZERO: Ref = ("k", 0.0)


def _adj_add(emit: Emit, acc: Accumulate, ct: Ref, y: Ref, a: Ref, b: Ref) -> None:
    acc(a, ct)
    acc(b, ct)


def _adj_sub(emit: Emit, acc: Accumulate, ct: Ref, y: Ref, a: Ref, b: Ref) -> None:
    acc(a, ct)
    acc(b, emit("neg", ct))


def _adj_mul(emit: Emit, acc: Accumulate, ct: Ref, y: Ref, a: Ref, b: Ref) -> None:
    acc(a, emit("mul", ct, b))
    acc(b, emit("mul", ct, a))


def _adj_div(emit: Emit, acc: Accumulate, ct: Ref, y: Ref, a: Ref, b: Ref) -> None:
    acc(a, emit("div", ct, b))
    acc(b, emit("neg", emit("div", emit("mul", ct, y), b)))


def _adj_unary(rule: Callable[[Emit, Ref, Ref, Ref], Ref]) -> Callable[..., None]:
    def adjoint(emit: Emit, acc: Accumulate, ct: Ref, y: Ref, a: Ref) -> None:
        acc(a, rule(emit, ct, y, a))

    return adjoint


def _adj_select(cond_op: str) -> Callable[..., None]:
    """maximum / minimum: the gradient goes to ``a`` where it won (ties included), else to ``b``."""

    def adjoint(emit: Emit, acc: Accumulate, ct: Ref, y: Ref, a: Ref, b: Ref) -> None:
        chose_a = emit(cond_op, a, b)
        acc(a, emit("where", chose_a, ct, ZERO))
        acc(b, emit("where", chose_a, ZERO, ct))

    return adjoint


def _adj_where(emit: Emit, acc: Accumulate, ct: Ref, y: Ref, c: Ref, a: Ref, b: Ref) -> None:
    acc(a, emit("where", c, ct, ZERO))
    acc(b, emit("where", c, ZERO, ct))


def _no_adjoint(emit: Emit, acc: Accumulate, ct: Ref, y: Ref, *args: Ref) -> None:
    """Int and bool results carry no gradient."""


def _sign(emit: Emit, a: Ref) -> Ref:
    return emit("where", emit("greater", a, ZERO), ONE, emit("where", emit("less", a, ZERO), ("k", -1.0), ZERO))


_ADJOINT: dict[str, Callable[..., None]] = {
    "add": _adj_add,
    "sub": _adj_sub,
    "mul": _adj_mul,
    "div": _adj_div,
    "neg": _adj_unary(lambda emit, ct, y, a: emit("neg", ct)),
    "id": _adj_unary(lambda emit, ct, y, a: ct),
    "exp": _adj_unary(lambda emit, ct, y, a: emit("mul", ct, y)),
    "log": _adj_unary(lambda emit, ct, y, a: emit("div", ct, a)),
    "tanh": _adj_unary(lambda emit, ct, y, a: emit("mul", ct, emit("sub", ONE, emit("mul", y, y)))),
    "sigmoid": _adj_unary(lambda emit, ct, y, a: emit("mul", ct, emit("mul", y, emit("sub", ONE, y)))),
    "sqrt": _adj_unary(lambda emit, ct, y, a: emit("div", emit("mul", ct, ("k", 0.5)), y)),
    "abs": _adj_unary(lambda emit, ct, y, a: emit("mul", ct, _sign(emit, a))),
    "maximum": _adj_select("greater_equal"),
    "minimum": _adj_select("less_equal"),
    "where": _adj_where,
}
for _op in INT_ONLY + COMPARISONS + LOGICAL + ("logical_not",):
    _ADJOINT[_op] = _no_adjoint
