"""Value types and the small enums attention nodes carry: layout, mask kind, gradient set."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.dims import dim_size, dim_symbols, is_dim_expression

# Short IR spelling <-> NumPy dtype. float32 is what every attention op computes in.
DTYPE_NAMES: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "f16": np.dtype(np.float16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "bool": np.dtype(np.bool_),
}
_NAME_OF_DTYPE = {dtype: name for name, dtype in DTYPE_NAMES.items()}

# The most elements a value may have: 8 bytes each (the widest dtype) still leave every byte
# offset, and every index the kernels compute, inside a signed 64-bit integer.
MAX_ELEMENTS = 2**60


class TooManyElements(RlxValueError):
    """A shape beyond :data:`MAX_ELEMENTS`; the graph re-raises it naming the op that made it."""

    def __init__(self, what: str, dims: tuple[Dim, ...], elements: int) -> None:
        self.dims, self.elements = dims, elements
        super().__init__(f"{what}: {self.detail}")

    @property
    def detail(self) -> str:
        return (
            f"shape {self.dims} has {self.elements:.3g} elements, more than any array can hold "
            "(at most 2**60, so that every byte offset fits a 64-bit integer)"
        )


def as_dtype(dtype: object) -> np.dtype:
    """Normalise a user dtype (``np.float32``, ``"float32"``, ``"f32"``) or raise RlxTypeError."""
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    if dtype is None:  # np.dtype(None) is float64: too surprising to accept silently
        raise RlxTypeError("not a dtype: None (leave the argument out for float32)")
    try:
        normalised = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise RlxTypeError(f"not a dtype: {dtype!r}") from None
    if normalised not in _NAME_OF_DTYPE:
        supported = ", ".join(str(d) for d in _NAME_OF_DTYPE)
        raise RlxTypeError(f"unsupported dtype {normalised}; rlx supports {supported}")
    return normalised


Dim = int | str  # a size, or a symbolic dimension in canonical text: "Sk", "2*N", "P+1" (see rlx.ir.dims)


@dataclass(frozen=True)
class TensorType:
    """Shape and dtype of a value; printed as ``f32[2,128,4,64]`` (``f32[2,Sk,4,64]`` with a symbol).

    A dimension is an int or a symbol (see :func:`is_symbol`): one name, one size per call.
    """

    shape: tuple[Dim, ...]
    dtype: np.dtype = np.dtype(np.float32)

    def __post_init__(self) -> None:
        # Normalise so that equal types compare and hash equal and always print: a tuple of
        # Python ints and one of the supported NumPy dtypes (``"float32"`` becomes ``np.float32``).
        object.__setattr__(self, "shape", check_shape(self.shape, "TensorType"))
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "_static", all(isinstance(d, int) for d in self.shape))  # not a field

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def dtype_name(self) -> str:
        return _NAME_OF_DTYPE[self.dtype]

    @property
    def symbols(self) -> tuple[str, ...]:
        """The symbolic dimensions, in order of first appearance."""
        return tuple(dict.fromkeys(name for d in self.shape if isinstance(d, str) for name in dim_symbols(d)))

    @property
    def is_static(self) -> bool:
        return self._static  # type: ignore[attr-defined, no-any-return]

    @property
    def nbytes(self) -> int:
        """Exact size in bytes (Python ints: ``np.prod`` in int64 wraps around for huge shapes)."""
        if not self.is_static:
            raise RlxValueError(f"{self} has symbolic dimensions {list(self.symbols)}: its size is known per call")
        return math.prod(self.static_shape) * self.dtype.itemsize

    @property
    def static_shape(self) -> tuple[int, ...]:
        """The shape, for code that needs sizes (it is not reached with symbolic dimensions)."""
        return static_shape(self.shape)

    def resolve(self, sizes: Mapping[str, int]) -> TensorType:
        """This type with every symbol replaced by its size in ``sizes``."""
        if self.is_static:
            return self
        return TensorType(resolve_dims(self.shape, sizes), self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype_name}[{','.join(str(d) for d in self.shape)}]"


def resolve_dims(dims: Sequence[Dim], sizes: Mapping[str, int]) -> tuple[int, ...]:
    """``dims`` with every symbol replaced by its size in ``sizes`` (one call's)."""
    return tuple(dim_size(d, sizes) for d in dims)


def static_shape(shape: tuple[Dim, ...]) -> tuple[int, ...]:
    """``shape`` as ints; ``RlxValueError`` if a dimension is symbolic (known only per call)."""
    if not all(isinstance(d, int) for d in shape):
        symbols = [d for d in shape if isinstance(d, str)]
        raise RlxValueError(f"shape {shape} has symbolic dimensions {symbols}: its sizes are known per call only")
    return shape  # type: ignore[return-value]


def check_shape(shape: object, what: str) -> tuple[Dim, ...]:
    """Validate a user shape: positive Python/NumPy ints and symbol names; returns a tuple."""
    if type(shape) is tuple and all(type(dim) is int and dim >= 1 for dim in shape):
        return _within_size(shape, what)  # the common case, already normal
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise RlxTypeError(f"{what}: shape must be a tuple of ints, got {type(shape).__name__}")
    try:
        entries = tuple(shape)  # type: ignore[arg-type]
    except TypeError:  # e.g. a 0-d array, which has __iter__ but cannot be iterated
        raise RlxTypeError(f"{what}: shape must be a tuple of ints, got {type(shape).__name__}") from None
    for dim in entries:
        if isinstance(dim, str):
            if not is_dim_expression(dim):
                raise RlxValueError(
                    f"{what}: a symbolic dimension must be an identifier like 'Sk' (or an expression of them "
                    f"such as 'P+1' or '2*S'), got {dim!r} in {entries}"
                )
        elif isinstance(dim, (bool, np.bool_)) or not isinstance(dim, (int, np.integer)):
            raise RlxTypeError(
                f"{what}: shape entries must be ints, got {dim!r} in {entries} "
                "(a symbolic dimension is a name like 'Sk')"
            )
    dims = tuple(dim if isinstance(dim, str) else int(dim) for dim in entries)
    if any(isinstance(dim, int) and dim < 1 for dim in dims):
        raise RlxValueError(f"{what}: every dimension must be >= 1, got shape {dims}")
    return _within_size(dims, what)


def _within_size(dims: tuple[Dim, ...], what: str) -> tuple[Dim, ...]:
    """``dims``, unless its static dimensions alone hold more than :data:`MAX_ELEMENTS` elements."""
    static = math.prod(dim for dim in dims if isinstance(dim, int))
    if static > MAX_ELEMENTS:
        raise TooManyElements(what, dims, static)
    return dims


_Axis = TypeVar("_Axis")  # what a rank-4 tuple holds per axis: sizes, or strides


class Layout(enum.Enum):
    """Where the head axis sits: BSHD ``[B, S, H, D]`` (default) or BHSD ``[B, H, S, D]``."""

    BSHD = "bshd"
    BHSD = "bhsd"

    def split(self, shape: tuple[_Axis, ...]) -> tuple[_Axis, _Axis, _Axis, _Axis]:
        """Return ``(B, S, H, D)`` from a rank-4 shape in this layout (or a view's strides)."""
        if len(shape) != 4:
            raise RlxValueError(f"layout {self} needs a rank-4 shape, got {tuple(shape)}")
        if self is Layout.BSHD:
            b, s, h, d = shape
        else:
            b, h, s, d = shape
        return b, s, h, d

    def join(self, b: Dim, s: Dim, h: Dim, d: Dim) -> tuple[Dim, Dim, Dim, Dim]:
        """Inverse of :meth:`split`."""
        return (b, s, h, d) if self is Layout.BSHD else (b, h, s, d)

    def __str__(self) -> str:
        return self.value


class Wrt(enum.Flag):
    """Which gradients an attention-backward node produces; outputs come in Q, K, V order."""

    QUERY = 1
    KEY = 2
    VALUE = 4
    ALL = QUERY | KEY | VALUE

    @property
    def members(self) -> tuple[Wrt, ...]:
        """The single flags set, in Q, K, V order."""
        return tuple(flag for flag in (Wrt.QUERY, Wrt.KEY, Wrt.VALUE) if flag & self)

    def __str__(self) -> str:
        return "|".join(_WRT_SHORT[flag] for flag in self.members) or "none"

    @staticmethod
    def parse(text: str) -> Wrt:
        """Read ``q``, ``k|v``, ... as printed by ``str(wrt)``."""
        if not isinstance(text, str):
            raise RlxTypeError(f"Wrt.parse: expected a str, got {type(text).__name__}")
        flags = Wrt(0)
        if text == "none":
            return flags
        for part in text.split("|"):
            if part not in _WRT_LONG:
                raise RlxValueError(f"unknown wrt {part!r}; expected q, k or v joined by '|'")
            flags |= _WRT_LONG[part]
        return flags


_WRT_SHORT = {Wrt.QUERY: "q", Wrt.KEY: "k", Wrt.VALUE: "v"}
_WRT_LONG = {short: flag for flag, short in _WRT_SHORT.items()}


@dataclass(frozen=True)
class MaskKind:
    """How scores are masked. Use the constants and :meth:`sliding_window`, not the constructor.

    ``NONE``; ``CAUSAL`` (bottom-right aligned); ``sliding_window(w)`` (causal and at most ``w``
    keys back); ``CUSTOM`` (key padding ``[B, Sk]`` tensor); ``BIAS`` (additive ``[B, H, Sq, Sk]``).
    Equal masks compare and hash equal.
    """

    kind: str
    window: int | None = None

    NONE: ClassVar[MaskKind]
    CAUSAL: ClassVar[MaskKind]
    CUSTOM: ClassVar[MaskKind]
    BIAS: ClassVar[MaskKind]

    _KINDS: ClassVar[tuple[str, ...]] = ("none", "causal", "sliding_window", "custom", "bias")

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str):
            raise RlxTypeError(f"MaskKind: kind must be a str, got {type(self.kind).__name__}")
        if self.kind not in self._KINDS:
            raise RlxValueError(f"unknown mask kind {self.kind!r}; expected one of {', '.join(self._KINDS)}")
        if self.kind != "sliding_window":
            if self.window is not None:
                raise RlxValueError(f"only a sliding_window mask carries a window; {self.kind} got {self.window!r}")
            return
        window = self.window
        if window is None:
            raise RlxValueError("sliding_window mask needs a window: MaskKind.sliding_window(w)")
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)):
            raise RlxTypeError(f"sliding_window: window must be an int, got {type(window).__name__}")
        if window < 0:
            raise RlxValueError(f"sliding_window: window must be >= 0, got {window}")
        object.__setattr__(self, "window", int(window))  # np.int64(3) and 3 must hash alike

    @staticmethod
    def sliding_window(window: int) -> MaskKind:
        """Causal mask that also hides keys more than ``window`` positions back (0: diagonal only)."""
        return MaskKind("sliding_window", window)

    @property
    def needs_tensor(self) -> bool:
        """CUSTOM and BIAS take a mask tensor input; the others do not."""
        return self.kind in ("custom", "bias")

    @property
    def is_causal_like(self) -> bool:
        return self.kind in ("causal", "sliding_window")

    def __str__(self) -> str:
        return f"sliding_window({self.window})" if self.kind == "sliding_window" else self.kind

    def __repr__(self) -> str:
        if self.kind == "sliding_window":
            return f"MaskKind.sliding_window({self.window})"
        return f"MaskKind.{self.kind.upper()}"

    @staticmethod
    def parse(text: str) -> MaskKind:
        """Read a mask as printed by ``str(mask)``: ``causal``, ``sliding_window(4)``, ..."""
        if not isinstance(text, str):
            raise RlxTypeError(f"MaskKind.parse: expected a str, got {type(text).__name__}")
        text = text.strip()
        if text.startswith("sliding_window(") and text.endswith(")"):
            inner = text[len("sliding_window(") : -1].strip()
            if not (inner.isascii() and inner.lstrip("-").isdigit()):  # "²".isdigit() but int("²") fails
                raise RlxValueError(f"bad sliding_window mask {text!r}")
            return MaskKind.sliding_window(int(inner))
        if text == "sliding_window":
            raise RlxValueError("sliding_window mask needs a window: sliding_window(w)")
        return MaskKind(text)


MaskKind.NONE = MaskKind("none")
MaskKind.CAUSAL = MaskKind("causal")
MaskKind.CUSTOM = MaskKind("custom")
MaskKind.BIAS = MaskKind("bias")
