"""Attention mods (SPEC section 4): tracing Python ``score_mod`` / ``mask_mod`` functions, and a library.

A mod is called once, at build time, on symbolic scalars (:class:`Sym`); every operation on
them appends a step to a :class:`~rlx.ir.region.Region`. Graph values (and numpy arrays a mod
captured, which become constants) are read by indexing them with the symbols:
``bias[b, h, q_idx, kv_idx]``. A Python ``if`` on a symbol cannot be traced and is an
``RlxTypeError`` that points at :func:`rlx.where`.

Library mods: ``causal``, ``causal_lower_right``, ``sliding_window(left, right=0)``,
``prefix_lm(prefix_len)``, ``document(doc)``, ``key_lengths(lengths)`` (masks) and
``softcap(cap)``, ``alibi(slopes)``, ``bias(tensor)`` (score mods); ``and_``/``or_`` compose masks
and ``chain`` composes score mods.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.region import Ref, Region, RegionStep
from rlx.ir.types import MaskKind

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value

ScoreMod = Callable[..., Any]
MaskMod = Callable[..., Any]


@dataclass
class _Tracer:
    """The region being recorded and the tensors it captured (graph values, in first-read order)."""

    graph: Graph
    what: str
    steps: list[RegionStep] = field(default_factory=list)
    captured: list[Value] = field(default_factory=list)

    def emit(self, op: str, *args: Ref) -> Sym:
        self.steps.append(RegionStep(op, args))
        return Sym(self, ("t", len(self.steps) - 1))

    def capture(self, value: Value) -> int:
        for index, known in enumerate(self.captured):
            if known is value:
                return index
        self.captured.append(value)
        return len(self.captured) - 1


_active: list[_Tracer] = []


def tracing() -> bool:
    """Is a mod being traced (so that indexing a graph value reads it per score)?"""
    return bool(_active)


def _tracer(what: str) -> _Tracer:
    if not _active:
        raise RlxTypeError(f"{what} works on the symbolic scalars of a score_mod or mask_mod, inside g.attention")
    return _active[-1]


class Sym:
    """A symbolic scalar inside a traced mod: the score, an index, or a value computed from them."""

    __slots__ = ("_ref", "_tracer")
    __array_ufunc__ = None  # numpy defers to our reflected operators (np.float32(2) * sym)

    def __init__(self, tracer: _Tracer, ref: Ref) -> None:
        self._tracer = tracer
        self._ref = ref

    def _binary(self, op: str, other: object, reverse: bool = False) -> Sym:
        ref = _as_ref(self._tracer, other, op)
        return self._tracer.emit(op, ref, self._ref) if reverse else self._tracer.emit(op, self._ref, ref)

    def __add__(self, other: object) -> Sym:
        return self._binary("add", other)

    def __radd__(self, other: object) -> Sym:
        return self._binary("add", other, True)

    def __sub__(self, other: object) -> Sym:
        return self._binary("sub", other)

    def __rsub__(self, other: object) -> Sym:
        return self._binary("sub", other, True)

    def __mul__(self, other: object) -> Sym:
        return self._binary("mul", other)

    def __rmul__(self, other: object) -> Sym:
        return self._binary("mul", other, True)

    def __truediv__(self, other: object) -> Sym:
        return self._binary("div", other)

    def __rtruediv__(self, other: object) -> Sym:
        return self._binary("div", other, True)

    def __floordiv__(self, other: object) -> Sym:
        return self._binary("floordiv", other)

    def __rfloordiv__(self, other: object) -> Sym:
        return self._binary("floordiv", other, True)

    def __mod__(self, other: object) -> Sym:
        return self._binary("mod", other)

    def __rmod__(self, other: object) -> Sym:
        return self._binary("mod", other, True)

    def __pow__(self, other: object) -> Any:
        return power(self, other)

    def __rpow__(self, other: object) -> Any:
        return power(other, self)

    def __neg__(self) -> Sym:
        return self._tracer.emit("neg", self._ref)

    # Tensor-style methods, so mods written for torch (``score.tanh()``, ``score.pow(2)``) trace.
    def exp(self) -> Any:
        return exp(self)

    def log(self) -> Any:
        return log(self)

    def tanh(self) -> Any:
        return tanh(self)

    def sigmoid(self) -> Any:
        return sigmoid(self)

    def sqrt(self) -> Any:
        return sqrt(self)

    def clamp(self, min: object = None, max: object = None) -> Any:
        result: Any = self
        if min is not None:
            result = maximum(result, min)
        if max is not None:
            result = minimum(result, max)
        return result

    def __pos__(self) -> Sym:
        return self

    def __abs__(self) -> Sym:
        return self._tracer.emit("abs", self._ref)

    abs = __abs__  # (tensor-style spellings of the operators above)
    neg = __neg__
    pow = __pow__

    def __lt__(self, other: object) -> Sym:
        return self._binary("less", other)

    def __le__(self, other: object) -> Sym:
        return self._binary("less_equal", other)

    def __gt__(self, other: object) -> Sym:
        return self._binary("greater", other)

    def __ge__(self, other: object) -> Sym:
        return self._binary("greater_equal", other)

    def __eq__(self, other: object) -> Sym:  # type: ignore[override]
        return self._binary("equal", other)

    def __ne__(self, other: object) -> Sym:  # type: ignore[override]
        return self._binary("not_equal", other)

    def __and__(self, other: object) -> Sym:
        return self._binary("logical_and", other)

    def __rand__(self, other: object) -> Sym:
        return self._binary("logical_and", other, True)

    def __or__(self, other: object) -> Sym:
        return self._binary("logical_or", other)

    def __ror__(self, other: object) -> Sym:
        return self._binary("logical_or", other, True)

    def __invert__(self) -> Sym:
        return self._tracer.emit("logical_not", self._ref)

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        raise RlxTypeError(
            f"{self._tracer.what}: a Python `if`, `and`, `or` or `not` on a symbolic value cannot be traced "
            "(the mod runs once, on symbols, not per score); use rlx.where(cond, a, b) for a choice and "
            "& | ~ to combine conditions"
        )

    def __index__(self) -> int:
        raise RlxTypeError(
            f"{self._tracer.what}: a symbolic index cannot index a Python or numpy object; index graph "
            "values (g.input / g.constant) or numpy arrays the mod captures directly"
        )

    def __float__(self) -> float:
        raise RlxTypeError(
            f"{self._tracer.what}: a symbolic value has no float value at trace time; use rlx functions on it"
        )

    __int__ = __index__

    def __repr__(self) -> str:
        return f"<rlx symbolic scalar {self._ref}>"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Mods written for torch (``torch.where``, ``torch.tanh``, indexing captured tensors) trace
        through :mod:`rlx.torch`, which installs the translation; without it, torch refuses."""
        if TORCH_HANDLER is None:
            return NotImplemented
        return TORCH_HANDLER(func, args, kwargs or {})


TORCH_HANDLER: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None
"""Set by :mod:`rlx.torch`: turns a torch function called on symbols into region steps."""


def _as_ref(tracer: _Tracer, value: object, what: str) -> Ref:
    if isinstance(value, Sym):
        if value._tracer is not tracer:
            raise RlxTypeError(f"{tracer.what}: a symbolic value from another mod was used here")
        return value._ref
    if isinstance(value, (bool, np.bool_)):
        return ("k", bool(value))
    if isinstance(value, (int, np.integer)):
        return ("k", int(value))
    if isinstance(value, (float, np.floating)):
        return ("k", float(value))
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d numpy array or torch tensor
        return _as_ref(tracer, value.item(), what)
    raise RlxTypeError(
        f"{tracer.what}: {what} got a {type(value).__name__}; inside a mod use numbers, the symbolic "
        "arguments, and graph values indexed by them (bias[b, h, q_idx, kv_idx])"
    )


def read(value: object, index: object) -> Sym:
    """``value[index]`` for a graph value or captured array indexed by symbols (``Value.__getitem__``)."""
    from rlx.ir.graph import Value

    indices = index if isinstance(index, tuple) else (index,)
    syms = [i for i in indices if isinstance(i, Sym)]
    tracer = syms[0]._tracer if syms else _tracer("indexing a graph value")
    if isinstance(value, np.ndarray):
        value = _constant(tracer.graph, value)
    if not isinstance(value, Value):
        raise RlxTypeError(
            f"{tracer.what}: only graph values and numpy arrays can be indexed, got {type(value).__name__}"
        )
    if value.graph is not tracer.graph:
        raise RlxValueError(f"{tracer.what}: indexed a value of graph {value.graph.name!r}, not {tracer.graph.name!r}")
    if len(indices) != len(value.shape):
        raise RlxValueError(
            f"{tracer.what}: a value of shape {value.shape} indexed with {len(indices)} indices; give one per dimension"
        )
    refs = tuple(_as_ref(tracer, i, "an index") for i in indices)
    return tracer.emit("read", ("c", tracer.capture(value)), *refs)


def _constant(graph: Graph, array: np.ndarray) -> Value:
    data = np.asarray(array)
    if data.dtype.kind == "f":
        data = data.astype(np.float32)
    elif data.dtype.kind in "iu":
        data = data.astype(np.int64)
    elif data.dtype.kind != "b":
        raise RlxTypeError(f"a mod captured an array of dtype {data.dtype}; use float, int or bool arrays")
    return graph.constant(data)


class CapturedArray:
    """A numpy array a mod captured: indexing it with symbols reads a constant of the graph."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = np.asarray(array)
        self._constants: list[tuple[Graph, Value]] = []  # one constant per graph, however often read

    def __getitem__(self, index: object) -> Sym:
        indices = index if isinstance(index, tuple) else (index,)
        tracer = next((i._tracer for i in indices if isinstance(i, Sym)), None) or _tracer("indexing an array")
        for graph, value in self._constants:
            if graph is tracer.graph:
                return read(value, index)
        value = _constant(tracer.graph, self.array)
        self._constants.append((tracer.graph, value))
        return read(value, index)


def _captured(x: Any) -> Any:
    """Library mods take graph values or numpy arrays; arrays are read as graph constants."""
    return CapturedArray(x) if isinstance(x, np.ndarray) else x


# ----------------------------------------------------------------------------- tracing


def _numpy_to_captured(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the numpy arrays it captures wrapped in :class:`CapturedArray`: those among its
    closure cells and the globals it names, and those a ``functools.partial`` binds (whose
    function is unwrapped the same way)."""
    if isinstance(fn, functools.partial):
        args = tuple(_captured(a) for a in fn.args)
        keywords = {name: _captured(a) for name, a in fn.keywords.items()}
        return functools.partial(_numpy_to_captured(fn.func), *args, **keywords)
    if not isinstance(fn, types.FunctionType):
        return fn
    closure = fn.__closure__
    cells = closure
    if closure and any(_holds_array(c) for c in closure):
        # Compared by identity below: a cell's == compares its contents, and an array's == is
        # elementwise, whose truth value numpy refuses.
        cells = tuple(types.CellType(CapturedArray(c.cell_contents)) if _holds_array(c) else c for c in closure)
    names = set(fn.__code__.co_names)
    arrays = {
        name: CapturedArray(value)
        for name, value in fn.__globals__.items()
        if name in names and isinstance(value, np.ndarray)
    }
    if not arrays and cells is closure:
        return fn
    scope = {**fn.__globals__, **arrays} if arrays else fn.__globals__
    clone = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, cells)
    clone.__kwdefaults__ = fn.__kwdefaults__
    return clone


def _holds_array(cell: types.CellType) -> bool:
    try:
        return isinstance(cell.cell_contents, np.ndarray)
    except ValueError:  # an empty cell
        return False


def trace(graph: Graph, fn: Callable[..., Any], kind: str, captured: list[Value]) -> Region:
    """Trace ``fn`` (a score_mod if ``kind == "score_mod"``, else a mask_mod) into a region.

    ``captured`` is the node's list of captured values, shared by both mods; reads append to it.
    """
    what = f"attention {kind} {getattr(fn, '__name__', type(fn).__name__)!r}"
    if not callable(fn):
        raise RlxTypeError(f"attention: {kind} must be a function, got {type(fn).__name__}")
    tracer = _Tracer(graph, what, captured=captured)
    names = ("score", "b", "h", "q_idx", "kv_idx") if kind == "score_mod" else ("b", "h", "q_idx", "kv_idx")
    args = [Sym(tracer, ("s", name)) for name in names]
    _check_arity(fn, len(args), what)
    _active.append(tracer)
    try:
        result = _numpy_to_captured(fn)(*args)
    except (RlxTypeError, RlxValueError):
        raise
    except (TypeError, IndexError) as exc:
        hint = ""
        if isinstance(exc, IndexError):
            hint = "; an array indexed with symbols must be a graph value, or wrapped as rlx.mods.CapturedArray(array)"
        raise RlxTypeError(f"{what} could not be traced on symbolic scalars: {exc}{hint}") from exc
    finally:
        _active.pop()
    ref = _as_ref(tracer, result, "its result")
    if ref[0] != "t" or int(ref[1]) != len(tracer.steps) - 1:
        tracer.emit("id", ref)
    region = Region(tuple(tracer.steps))
    shapes = [(v.shape, v.dtype.kind if v.dtype.kind != "u" else "i") for v in captured]
    kinds = [("f" if k == "f" else "b" if k == "b" else "i") for _, k in shapes]
    try:
        result_kind = region.result_kind([(s, k) for (s, _), k in zip(shapes, kinds, strict=True)])
    except ValueError as exc:
        raise RlxTypeError(f"{what}: {exc}") from None
    if kind == "score_mod" and result_kind == "b":
        raise RlxTypeError(f"{what} must return a number (the new score), got a bool; use a mask_mod to mask")
    if kind == "mask_mod" and result_kind != "b":
        raise RlxTypeError(f"{what} must return a bool (True attends), e.g. q_idx >= kv_idx")
    return region


def _check_arity(fn: Callable[..., Any], count: int, what: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(count))
    except TypeError:
        expected = "(score, b, h, q_idx, kv_idx)" if count == 5 else "(b, h, q_idx, kv_idx)"
        raise RlxTypeError(f"{what} must take {count} arguments {expected}, got {signature}") from None


# ----------------------------------------------------------------------------- functions inside mods


def _sym_or_number(*values: object) -> _Tracer | None:
    for value in values:
        if isinstance(value, Sym):
            return value._tracer
    return None


def _unary(op: str, fn: Callable[[float], float]) -> Callable[[object], Any]:
    def apply(x: object) -> Any:
        tracer = _sym_or_number(x)
        if tracer is None:
            return fn(float(x))  # type: ignore[arg-type]
        return tracer.emit(op, _as_ref(tracer, x, f"rlx.{op}"))

    apply.__name__ = op
    apply.__doc__ = f"``{op}(x)`` on a symbolic scalar inside an attention mod (or on a number)."
    return apply


def _np1(fn: Callable[[Any], Any]) -> Callable[[float], float]:
    return lambda x: float(fn(np.float64(x)))


exp = _unary("exp", _np1(np.exp))
log = _unary("log", _np1(np.log))
tanh = _unary("tanh", _np1(np.tanh))
sqrt = _unary("sqrt", _np1(np.sqrt))
abs = _unary("abs", _np1(np.abs))
sigmoid = _unary("sigmoid", lambda x: float(1.0 / (1.0 + np.exp(-np.float64(x)))))


def _binary(op: str, fn: Callable[[Any, Any], Any]) -> Callable[[object, object], Any]:
    def apply(a: object, b: object) -> Any:
        tracer = _sym_or_number(a, b)
        if tracer is None:
            return fn(a, b)
        return tracer.emit(op, _as_ref(tracer, a, f"rlx.{op}"), _as_ref(tracer, b, f"rlx.{op}"))

    apply.__name__ = op
    apply.__doc__ = f"``{op}(a, b)`` on symbolic scalars inside an attention mod (or on numbers)."
    return apply


maximum = _binary("maximum", max)
minimum = _binary("minimum", min)

_MAX_INTEGER_POWER = 64  # larger integer exponents go through exp/log like any other


def power(base: object, exponent: object) -> Any:
    """``base ** exponent`` inside a mod, with torch.pow's values, from the region's own steps.

    An integer exponent (``score ** 2``, ``i ** 3``) multiplies, so a negative base keeps its
    sign and the gradient is the product rule's; a negative one divides. ``0.5`` is ``sqrt``.
    Any other exponent, and a symbolic exponent of a positive number base (ALiBi's
    ``2 ** (-8 * h / H)``), is ``exp(exponent * log(base))``: NaN for a negative base, as torch.
    A symbolic exponent of a symbolic or non-positive base has no such formula: refused.
    """
    base, exponent = _scalar(base), _scalar(exponent)
    tracer = _sym_or_number(base, exponent)
    if tracer is None:
        return base**exponent  # type: ignore[operator]
    if isinstance(exponent, Sym):
        if isinstance(base, Sym) or not isinstance(base, (int, float, np.integer, np.floating)) or base <= 0:
            raise RlxTypeError(
                f"{tracer.what}: a symbolic exponent needs a positive number base (2 ** (h / 8)); "
                "write rlx.exp(e * rlx.log(b)) where the base is known to be positive"
            )
        if base == 1:
            return 1.0
        return exp(exponent * float(np.log(float(base))))
    if isinstance(exponent, (bool, np.bool_)) or not isinstance(exponent, (int, float, np.integer, np.floating)):
        raise RlxTypeError(f"{tracer.what}: ** got an exponent of type {type(exponent).__name__}; use a number")
    assert isinstance(base, Sym)
    value = float(exponent)
    if value.is_integer() and -_MAX_INTEGER_POWER <= value <= _MAX_INTEGER_POWER:
        return _integer_power(base, int(value), integral=isinstance(exponent, (int, np.integer)))
    if value == 0.5:
        return sqrt(base)
    return exp(log(base) * value)


def _scalar(x: object) -> object:
    """A 0-d numpy array or torch tensor as its Python number; anything else as is."""
    if not isinstance(x, Sym) and getattr(x, "ndim", None) == 0 and hasattr(x, "item"):
        return x.item()
    return x


def _integer_power(base: Sym, n: int, integral: bool) -> Any:
    """``base ** n`` by repeated squaring; ``n = 0`` is 1 (as torch: ``0 ** 0 == 1``)."""
    if n == 0:
        return 1 if integral else 1.0
    result: Any = None
    square: Any = base
    remaining = -n if n < 0 else n  # (this module's `abs` is the traced one)
    while remaining:
        if remaining & 1:
            result = square if result is None else result * square
        remaining >>= 1
        if remaining:
            square = square * square
    return 1.0 / result if n < 0 else result


def where(cond: object, a: object, b: object) -> Any:
    """``a`` where ``cond`` else ``b``: the traceable form of ``a if cond else b`` inside a mod."""
    tracer = _sym_or_number(cond, a, b)
    if tracer is None:
        return a if cond else b
    return tracer.emit("where", *(_as_ref(tracer, x, "rlx.where") for x in (cond, a, b)))


# ----------------------------------------------------------------------------- library: masks


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Query ``i`` sees keys ``j <= i`` (top-left aligned, as FlexAttention's causal mask)."""
    return q_idx >= kv_idx


def seq_lengths() -> tuple[Sym, Sym]:
    """Inside a mod: the attention's query and key lengths ``(Sq, Sk)`` as symbolic ints.

    They are the node's own lengths, constant over a call, so a mod built on them (say a mask
    aligned to the last key) serves every length when the lengths are symbolic dimensions.
    """
    tracer = _tracer("rlx.mods.seq_lengths")
    return Sym(tracer, ("s", "q_len")), Sym(tracer, ("s", "kv_len"))


def causal_lower_right(*args: Any) -> Any:
    """Causal aligned bottom-right: the last query sees the last key (``j <= i + Sk - Sq``).

    Use it as a mask directly (``mask_mod=rlx.mods.causal_lower_right``: Sq and Sk are the
    attention's own, read per call when symbolic), or make one for given sizes with
    ``causal_lower_right(Sq, Sk)``.
    """
    if len(args) == 4:  # called as a mask_mod on the symbols
        _, _, q_idx, kv_idx = args
        seq_q, seq_k = seq_lengths()
        return q_idx + (seq_k - seq_q) >= kv_idx
    if len(args) != 2:
        raise RlxTypeError("causal_lower_right: use it as a mask_mod, or call causal_lower_right(Sq, Sk)")
    offset = int(args[1]) - int(args[0])

    def causal_lower_right(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx + offset >= kv_idx

    return causal_lower_right


def sliding_window(left: int, right: int = 0) -> MaskMod:
    """Query ``i`` sees keys ``i - left <= j <= i + right``."""
    if int(left) < 0 or int(right) < 0:
        raise RlxValueError(f"sliding_window: left and right must be >= 0, got {left}, {right}")
    left, right = int(left), int(right)

    def sliding_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)

    return sliding_window


def prefix_lm(prefix_len: int) -> MaskMod:
    """Every query sees the first ``prefix_len`` keys, and causally after them."""
    prefix = int(prefix_len)

    def prefix_lm(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    return prefix_lm


def document(doc: Any) -> MaskMod:
    """Packed sequences: attend only within one document; ``doc`` is an int ``[B, S]`` of ids."""
    doc = _captured(doc)

    def document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return doc[b, q_idx] == doc[b, kv_idx]

    return document


def key_lengths(lengths: Any) -> MaskMod:
    """Varlen keys: batch ``b`` attends to its first ``lengths[b]`` keys; ``lengths`` is an int ``[B]``."""
    lengths = _captured(lengths)

    def key_lengths(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < lengths[b]

    return key_lengths


def and_(*masks: MaskMod) -> MaskMod:
    """Attend where every mask attends."""

    def and_(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = masks[0](b, h, q_idx, kv_idx)
        for mask in masks[1:]:
            result = result & mask(b, h, q_idx, kv_idx)
        return result

    return and_


def or_(*masks: MaskMod) -> MaskMod:
    """Attend where any mask attends."""

    def or_(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        result = masks[0](b, h, q_idx, kv_idx)
        for mask in masks[1:]:
            result = result | mask(b, h, q_idx, kv_idx)
        return result

    return or_


# ----------------------------------------------------------------------------- library: score mods


def softcap(cap: float) -> ScoreMod:
    """Logit soft-capping (Gemma 2): ``cap * tanh(score / cap)``."""
    cap = float(cap)
    if not cap > 0:
        raise RlxValueError(f"softcap: cap must be > 0, got {cap}")

    def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * tanh(score / cap)

    return softcap


def alibi(slopes: Any) -> ScoreMod:
    """ALiBi: ``score + slopes[h] * (kv_idx - q_idx)``; ``slopes`` a float ``[H]`` (value or array)."""
    slopes = _captured(slopes)

    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi


def bias(tensor: Any) -> ScoreMod:
    """An additive bias ``tensor[b, h, q_idx, kv_idx]`` (a float ``[B, H, Sq, Sk]`` value or array)."""
    tensor = _captured(tensor)

    def bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + tensor[b, h, q_idx, kv_idx]

    return bias


def chain(*score_mods: ScoreMod) -> ScoreMod:
    """Apply score mods in order: ``chain(alibi(s), softcap(30))`` soft-caps the biased score."""

    def chain(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        for mod in score_mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    return chain


# ----------------------------------------------------------------------------- the MaskKinds as mods


def from_mask_kind(
    mask: MaskKind, mask_input: Any = None, *, neg: float = -1e9, threshold: float = 0.5
) -> tuple[ScoreMod | None, MaskMod | None]:
    """The ``(score_mod, mask_mod)`` that mean what ``mask`` means in SPEC section 1.

    This is what a ``MaskKind`` is: attention's reference runs it as these mods, and
    ``rlx.passes.masks_as_mods`` rewrites fixed-mask nodes into programmable ones with them.
    Causal and sliding-window masks align the last query with the last key (``off = max(Sk -
    Sq, 0)``, read from the lengths, so symbolic lengths work); ``CUSTOM`` hides keys whose
    ``mask_input[b, j] < threshold``; ``BIAS`` adds ``mask_input[b, h, i, j]``. A hidden score is
    *replaced* by ``neg``: with ``neg = -inf`` that is a mask_mod (hidden tiles are skipped);
    with a finite ``neg`` it is ``where(hidden, neg, score)``, a score_mod whose derivative is 0
    where it hides, so no gradient flows through replaced scores and a fully hidden row gets a
    uniform softmax, exactly as the fixed kernels do. ``neg`` and ``threshold`` are rounded to
    float32 first, as the kernels compare and write them.
    """
    if not isinstance(mask, MaskKind):
        raise RlxTypeError(f"from_mask_kind: mask must be an rlx.MaskKind, got {type(mask).__name__}")
    if mask.needs_tensor and mask_input is None:
        raise RlxValueError(f"from_mask_kind: mask {mask} needs its mask_input tensor")
    with np.errstate(over="ignore"):
        neg32, threshold32 = float(np.float32(neg)), float(np.float32(threshold))
    tensor = _captured(mask_input) if mask.needs_tensor else None
    window = mask.window
    name = str(mask).replace("(", "_").replace(")", "")  # what traced mods are called in messages

    def hidden(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if mask == MaskKind.CUSTOM:
            assert tensor is not None
            return tensor[b, kv_idx] < threshold32
        seq_q, seq_k = seq_lengths()
        diagonal = q_idx + maximum(seq_k - seq_q, 0)
        if window is None:
            return kv_idx > diagonal
        return (kv_idx > diagonal) | (kv_idx < diagonal - window)

    if mask == MaskKind.NONE:
        return None, None
    if mask == MaskKind.BIAS:
        assert tensor is not None
        return bias(tensor), None
    if neg32 == -np.inf:

        def visible(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return ~hidden(b, h, q_idx, kv_idx)

        visible.__name__ = name
        return None, visible

    def replaced(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return where(hidden(b, h, q_idx, kv_idx), neg32, score)

    replaced.__name__ = name
    return replaced, None


__all__ = [
    "CapturedArray",
    "Sym",
    "alibi",
    "and_",
    "bias",
    "causal",
    "causal_lower_right",
    "chain",
    "document",
    "exp",
    "from_mask_kind",
    "key_lengths",
    "log",
    "maximum",
    "minimum",
    "or_",
    "prefix_lm",
    "seq_lengths",
    "sigmoid",
    "sliding_window",
    "softcap",
    "sqrt",
    "tanh",
    "trace",
    "where",
]
