"""The torch calls of a TorchDynamo graph, one rlx translation each (:mod:`rlx.torch.dynamo`).

A handler takes the rlx graph and the call's arguments, with FX nodes already replaced by what
they became (rlx Values, Python numbers, sizes as :class:`rlx.ir.dims.Size` polynomials) and
returns the call's value. It raises :class:`Unsupported` where rlx would compute something else
than torch (a keyword it does not honour, a dtype it does not hold): the graph then runs eagerly.
:data:`FUNCTIONS` maps ``call_function`` targets, :data:`METHODS` tensor method names.
"""

from __future__ import annotations

import contextvars
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import rlx.mods as mods
from rlx.ir.dims import Size, dim_text, exact_quotient, parse_dim, poly
from rlx.ir.graph import Graph, Value
from rlx.ir.types import Dim, Layout, MaskKind

DTYPES = {torch.float32: "float32", torch.int32: "int32", torch.int64: "int64", torch.bool: "bool"}


class SameSizes(Exception):
    """A translation that needs two dynamic sizes to be one (a padding mask's length indexed by
    a range over the ids' length): rlx.torch.dynamo translates again with them merged, and
    checks on every call that they are equal (else that call runs eagerly)."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__(f"{first} == {second}")
        self.first, self.second = first, second


class Unsupported(Exception):
    """A call in the FX graph that rlx does not translate; the graph runs eagerly."""


def symbolic_size(size: Any) -> int | Size:
    """A torch size (an int or a SymInt of TorchDynamo's dynamic shapes) as an rlx polynomial."""
    if isinstance(size, int):
        return size
    if not isinstance(size, torch.SymInt):
        raise Unsupported(f"a size of type {type(size).__name__}")
    text = str(size.node.expr).replace(" ", "")
    if text.lstrip("-").isdigit():  # a size TorchDynamo specialised to a number
        return int(text)
    parsed = parse_dim(text)
    if parsed is None:
        raise Unsupported(f"the dynamic size {text}")
    return poly(parsed)


def rlx_dim(size: Any) -> int | str:
    """An rlx dimension (an int or a polynomial's text) from an int or a polynomial."""
    if type(size) is int:
        return size
    if isinstance(size, Size):
        return dim_text(size)
    raise Unsupported(f"a size of type {type(size).__name__}")


HALF = (torch.bfloat16, torch.float16)
"""Half-precision dtypes, which the backend computes in float32 (as rlx.torch's SDPA does)."""


def constant_of(g: Graph, tensor: torch.Tensor) -> Value:
    if tensor.dtype in HALF:
        tensor = tensor.float()
    if tensor.dtype not in DTYPES or tensor.device.type != "cpu":
        raise Unsupported(f"a constant tensor of {tensor.dtype} on {tensor.device}")
    if tensor.requires_grad:
        raise Unsupported("a constant tensor that requires a gradient")
    return g.constant(tensor.detach().numpy().copy())


# ----------------------------------------------------------------------------- helpers


def _value(g: Graph, x: Any) -> Any:
    """A Value, or a Python number kept as one (the ops take numbers)."""
    if isinstance(x, Value) or (isinstance(x, (int, float)) and not isinstance(x, bool)):
        return x
    if isinstance(x, torch.Tensor):
        return constant_of(g, x)
    raise Unsupported(f"an operand of type {type(x).__name__}")


def _dims(shape: Sequence[Any]) -> tuple[int | str, ...]:
    """``view(2, -1)`` or ``view((2, -1))`` as rlx dimensions (sizes may be polynomials)."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    return tuple(rlx_dim(d) for d in shape)


def check_kwargs(kwargs: dict[str, Any], **defaults: Any) -> None:
    """Refuse keyword arguments other than their defaults (rlx would compute something else)."""
    for key, value in kwargs.items():
        if key not in defaults:
            raise Unsupported(f"keyword {key}")
        if value is not defaults[key] and value != defaults[key]:
            raise Unsupported(f"{key}={value!r}")


def _item(g: Graph, x: Any) -> Any:
    """``x.item()``: of a number (a float rlx.torch.dynamo pinned), the number; of a 0-d value,
    the value itself, which broadcasts wherever the number was used."""
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, Value) and x.ndim == 0:
        return x
    raise Unsupported("item() of a value with several elements")


def _float(x: Any) -> Value:
    if not isinstance(x, Value):
        raise Unsupported(f"expected a tensor, got {type(x).__name__}")
    return x


def _binary(name: str) -> Callable[..., Any]:
    def handler(g: Graph, a: Any, b: Any, *rest: Any, **kwargs: Any) -> Any:
        alpha = kwargs.pop("alpha", rest[0] if rest else 1)
        check_kwargs(kwargs, out=None)
        if not isinstance(a, Value) and not isinstance(b, Value):
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                return getattr(g, name)(_value(g, a), _value(g, b))
            if name == "div" and (isinstance(a, Size) or isinstance(b, Size)):
                raise Unsupported("a dynamic size divided")
            return {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}[name](a, b)
        if alpha != 1:
            b = _value(g, b) * alpha
        identity = {"add": 0, "sub": 0, "mul": 1, "div": 1}[name]
        same_kind = isinstance(a, Value) and (type(b) is int or (type(b) is float and a.dtype == np.float32))
        if same_kind and b == identity:
            return a  # ``positions + 0`` stays the arange an embedding may index with
        a, b = _promoted(g, _value(g, a), _value(g, b), true_division=name == "div")
        return getattr(g, name)(a, b)

    return handler


_RANK = {np.dtype(np.bool_): 0, np.dtype(np.int32): 1, np.dtype(np.int64): 2, np.dtype(np.float32): 3}


def _promoted(g: Graph, a: Any, b: Any, true_division: bool = False) -> tuple[Any, Any]:
    """Operands brought to one dtype by torch's promotion, which rlx's ops leave to the user: a
    bool or int tensor beside a float one (or a Python float) is float, a bool beside an int is
    that int, int32 beside int64 is int64; ``/`` of ints is float (true division). Python ints
    stay numbers (rlx makes them constants of their neighbour's dtype)."""

    def kind(x: Any) -> np.dtype | None:
        if isinstance(x, Value):
            return np.dtype(x.dtype)
        return np.dtype(np.float32) if isinstance(x, float) else None

    kinds = [k for k in (kind(a), kind(b)) if k is not None]
    target = max(kinds, key=_RANK.__getitem__) if kinds else None
    if true_division or (target is not None and target == np.bool_ and any(type(x) is int for x in (a, b))):
        target = np.dtype(np.float32) if true_division else np.dtype(np.int64)
    if target is None:
        return a, b
    name = {0: "bool", 1: "int32", 2: "int64", 3: "float32"}[_RANK[target]]
    return tuple(x.astype(name) if isinstance(x, Value) and np.dtype(x.dtype) != target else x for x in (a, b))  # type: ignore[return-value]


def _compare(name: str) -> Callable[..., Any]:
    def handler(g: Graph, a: Any, b: Any) -> Any:
        return getattr(g, name)(*_promoted(g, _value(g, a), _value(g, b)))

    return handler


_COMPARISONS = {
    "eq": "equal",
    "ne": "not_equal",
    "lt": "less",
    "le": "less_equal",
    "gt": "greater",
    "ge": "greater_equal",
}
"""torch's comparison functions and methods by name, and rlx's op of each."""


def _atan2(g: Graph, a: Any, b: Any, **kwargs: Any) -> Any:
    """``torch.atan2(a, b)``: the angle of the point ``(b, a)``, float for ints as torch's."""
    check_kwargs(kwargs, out=None)
    return g.atan2(*_promoted(g, _value(g, a), _value(g, b), true_division=True))


def _unary(name: str) -> Callable[..., Any]:
    def handler(g: Graph, x: Any, **kwargs: Any) -> Any:
        check_kwargs(kwargs, inplace=False)
        return getattr(g, name)(_float(x))

    return handler


def _axis_args(dim: Any) -> Any:
    if dim is None or type(dim) is int:
        return dim
    if isinstance(dim, (tuple, list)) and all(type(d) is int for d in dim):
        return tuple(dim)
    raise Unsupported(f"dim={dim!r}")


_EXACT_COUNT = 1 << 24  # float32 adds 0s and 1s exactly up to this many


def _reduce(name: str) -> Callable[..., Any]:
    def handler(g: Graph, x: Any, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
        dim = kwargs.pop("axis", dim)
        check_kwargs(kwargs, dtype=None)
        x = _float(x)
        if name == "sum" and np.dtype(x.dtype) == np.bool_:
            return _count(g, x, _axis_args(dim), bool(keepdim))
        return getattr(g, name)(x, axis=_axis_args(dim), keepdims=bool(keepdim))

    return handler


def _count(g: Graph, mask: Value, dim: Any, keepdim: bool) -> Value:
    """``mask.sum()`` of a bool tensor: torch's int64 count, summed in float32 (exact: a sum of
    0s and 1s is, below 2^24 of them, which the reduced axes' static sizes must promise)."""
    axes = range(mask.ndim) if dim is None else [dim] if type(dim) is int else dim
    counted = 1
    for axis in axes:
        size = mask.shape[axis]
        if not isinstance(size, int):
            raise Unsupported("a count over a dynamic axis (exact in float32 only below 2^24 elements)")
        counted *= size
    if counted >= _EXACT_COUNT:
        raise Unsupported(f"a count over {counted} elements (exact in float32 only below 2^24)")
    return g.sum(mask.astype("float32"), axis=dim, keepdims=keepdim).astype("int64")


def _einsum(g: Graph, equation: str, *operands: Any) -> Any:
    """``torch.einsum`` (operands listed or in one list): ``g.einsum``, whose errors become
    fallbacks to eager torch."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    return g.einsum(equation, *(_float(v) for v in operands))


def _extremum(kind: str) -> Callable[..., Any]:
    """``torch.max(x)``, ``x.max(dim)`` (values and indices) or ``torch.max(a, b)``; ``min`` alike."""
    reduce, arg, pairwise = getattr(Graph, kind), getattr(Graph, f"arg{kind}"), getattr(Graph, f"{kind}imum")

    def handler(g: Graph, x: Any, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
        check_kwargs(kwargs)
        if isinstance(dim, (Value, torch.Tensor)):
            return pairwise(g, *_promoted(g, _value(g, x), _value(g, dim)))
        if dim is None:
            return reduce(g, _float(x))
        return (reduce(g, _float(x), axis=dim, keepdims=keepdim), arg(g, _float(x), axis=dim, keepdims=keepdim))

    return handler


def _reduce_extremum(kind: str) -> Callable[..., Any]:
    """``torch.amax`` / ``torch.amin``: the values alone, over any axes."""

    def handler(g: Graph, x: Any, dim: Any = (), keepdim: bool = False) -> Any:
        return getattr(g, kind)(_float(x), axis=None if dim in ((), []) else _axis_args(dim), keepdims=keepdim)

    return handler


def _softmax(name: str) -> Callable[..., Any]:
    def handler(g: Graph, x: Any, dim: Any = None, *rest: Any, **kwargs: Any) -> Any:
        dim = kwargs.pop("dim", dim)
        kwargs.pop("_stacklevel", None)
        if kwargs.get("dtype") in (torch.float32, *HALF):  # rlx computes in float32 anyway
            kwargs.pop("dtype")
        check_kwargs(kwargs, dtype=None)
        if type(dim) is not int:
            raise Unsupported("softmax without an int dim")
        return getattr(g, name)(_float(x), axis=dim)

    return handler


def _view(g: Graph, x: Any, *shape: Any) -> Any:
    if len(shape) == 1 and (isinstance(shape[0], torch.dtype)):
        raise Unsupported("view as another dtype")
    return g.reshape(_float(x), _dims(shape))


def _reshape(g: Graph, x: Any, *shape: Any, **kwargs: Any) -> Any:
    shape = kwargs.pop("shape", shape)
    check_kwargs(kwargs)
    return g.reshape(_float(x), _dims(shape if isinstance(shape, tuple) else (shape,)))


def _permute(g: Graph, x: Any, *dims: Any, **kwargs: Any) -> Any:
    dims = kwargs.pop("dims", dims)
    check_kwargs(kwargs)
    return g.transpose(_float(x), _dims(dims if isinstance(dims, tuple) else (dims,)))


def _transpose(g: Graph, x: Any, dim0: int, dim1: int) -> Any:
    x = _float(x)
    axes = list(range(x.ndim))
    axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
    return g.transpose(x, tuple(axes))


def _t(g: Graph, x: Any) -> Any:
    x = _float(x)
    return x if x.ndim < 2 else g.transpose(x, (1, 0))


def _unsqueeze(g: Graph, x: Any, dim: int) -> Any:
    return g.expand_dims(_float(x), dim)


def _squeeze(g: Graph, x: Any, dim: Any = None) -> Any:
    x = _float(x)
    if dim is None:
        return g.squeeze(x)
    axes = [dim] if type(dim) is int else list(dim)
    keep = [a % x.ndim for a in axes if x.shape[a] == 1]  # torch ignores axes that are not 1
    return g.squeeze(x, tuple(keep)) if keep else x


def _flatten(g: Graph, x: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
    x = _float(x)
    if x.ndim == 0:
        return g.reshape(x, (1,))
    start, end = start_dim % x.ndim, end_dim % x.ndim
    shape = (*x.shape[:start], -1, *x.shape[end + 1 :])
    return g.reshape(x, shape)


def _expand(g: Graph, x: Any, *sizes: Any) -> Any:
    x = _float(x)
    target = list(_dims(sizes))
    offset = len(target) - x.ndim
    for i, size in enumerate(target):
        if size == -1:
            target[i] = x.shape[i - offset]
    return g.broadcast_to(x, tuple(target))


def _unbind(g: Graph, x: Any, dim: int = 0) -> Any:
    x = _float(x)
    length = x.shape[dim]
    if not isinstance(length, int):
        raise Unsupported("unbind along a dynamic axis")
    parts = g.split(x, [1] * length, axis=dim) if length > 1 else (x,)
    return tuple(g.squeeze(part, dim) for part in parts)


def _repeat_interleave(g: Graph, x: Any, repeats: Any, dim: Any = None, **kwargs: Any) -> Any:
    """``x.repeat_interleave(n, dim)`` with an int ``n`` (a manual GQA's key heads): a broadcast
    along a new axis after ``dim``, merged into it."""
    x = _float(x)
    if type(repeats) is not int or dim is None:
        raise Unsupported("repeat_interleave other than an int count along one dim")
    axis = dim % x.ndim
    wide = g.broadcast_to(g.expand_dims(x, axis + 1), (*x.shape[: axis + 1], repeats, *x.shape[axis + 1 :]))
    merged = rlx_dim(poly(x.shape[axis]) * repeats)
    return g.reshape(wide, (*x.shape[:axis], merged, *x.shape[axis + 1 :]))


def _like(fill: float | None) -> Callable[..., Any]:
    """``torch.zeros_like(x)`` and kin: a broadcast scalar of ``x``'s shape (no buffer)."""

    def handler(g: Graph, x: Any, *rest: Any, **kwargs: Any) -> Any:
        x = _float(x)
        value = rest[0] if fill is None else fill
        dtype = kwargs.pop("dtype", None)
        kwargs.pop("device", None)
        kwargs.pop("layout", None)
        kwargs.pop("pin_memory", None)
        check_kwargs(kwargs, requires_grad=False, memory_format=torch.preserve_format)
        target = np.dtype(x.dtype) if dtype is None else _numpy_dtype(dtype)
        return g.broadcast_to(g.constant(np.array(value, dtype=target)), x.shape)

    return handler


def _new(fill: float | None) -> Callable[..., Any]:
    """``x.new_ones(size)`` and kin: a broadcast scalar of ``size`` (ints or dynamic sizes) in
    ``dtype`` or ``x``'s (``new_empty`` is zeros: its content is anyone's)."""

    def handler(g: Graph, x: Any, *args: Any, **kwargs: Any) -> Any:
        return _filled_with(g, np.dtype(_float(x).dtype), fill, args, kwargs)

    return handler


def _factory(fill: float | None) -> Callable[..., Any]:
    """``torch.zeros(size)``, ``ones``, ``empty`` (zeros) and ``full(size, value)`` of a size with
    dynamic entries (of ints alone they are folded into constants): float32 unless ``dtype``
    says, ``full`` in its value's kind, as torch."""

    def handler(g: Graph, *args: Any, **kwargs: Any) -> Any:
        value = fill if fill is not None else kwargs.get("fill_value", args[-1] if args else 0.0)
        default = np.dtype(np.bool_ if type(value) is bool else np.int64 if type(value) is int else np.float32)
        return _filled_with(g, default, fill, args, kwargs)

    return handler


def _filled_with(g: Graph, default: np.dtype, fill: float | None, args: Any, kwargs: dict[str, Any]) -> Value:
    """A scalar broadcast to the size in ``args`` (``(2, S)`` or ``2, S``; after it the fill value
    where ``fill`` is None), in ``kwargs``' dtype or ``default``."""
    if fill is None:  # full(size, fill_value)
        *sizes, value = (*args, kwargs.pop("fill_value")) if "fill_value" in kwargs else args
    else:
        sizes, value = list(args), fill
    if "size" in kwargs:
        sizes = [kwargs.pop("size")]
    one = len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size))
    size = tuple(sizes[0]) if one else tuple(sizes)
    dtype = kwargs.pop("dtype", None)
    for ignored in ("device", "layout", "pin_memory", "memory_format"):
        kwargs.pop(ignored, None)
    check_kwargs(kwargs, requires_grad=False)
    target = default if dtype is None else _numpy_dtype(dtype)
    return g.broadcast_to(g.constant(np.array(value, dtype=target)), _dims(tuple(size)))


def _getattr(g: Graph, x: Any, name: str) -> Any:
    if not isinstance(x, Value):
        raise Unsupported(f"getattr of a {type(x).__name__}")
    if name == "T":
        return g.transpose(x)
    if name == "mT":
        return _transpose(g, x, -2, -1)
    if name == "shape":
        return _size(g, x)
    raise Unsupported(f"the attribute {name}")


def _normalize(g: Graph, x: Any, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: Any = None) -> Any:
    if p != 2.0 or out is not None:
        raise Unsupported("normalize other than the 2-norm")
    x = _float(x)
    norm = g.sqrt(g.sum(x * x, axis=dim, keepdims=True))
    return x / g.maximum(norm, eps)


def _contiguous(g: Graph, x: Any, *args: Any, **kwargs: Any) -> Any:
    return _float(x)


def _to(g: Graph, x: Any, *args: Any, **kwargs: Any) -> Any:
    """``x.to(dtype)``, ``x.float()``-like casts and moves to the CPU (nothing)."""
    dtype = kwargs.pop("dtype", None)
    kwargs.pop("copy", None)
    kwargs.pop("non_blocking", None)
    device = kwargs.pop("device", None)
    check_kwargs(kwargs, memory_format=torch.preserve_format)
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, (str, torch.device)):
            device = arg
        elif isinstance(arg, Value):
            dtype = {np.dtype(v): k for k, v in _NUMPY.items()}[np.dtype(arg.dtype)]
        elif isinstance(arg, torch.Tensor):  # ``x.to(other)`` of a constant tensor: its dtype
            dtype = arg.dtype
        else:
            raise Unsupported(f"to({arg!r})")
    if device is not None and torch.device(device).type != "cpu":
        raise Unsupported(f"a move to {device}")
    return x if dtype is None else _cast(g, x, dtype)


_NUMPY = {torch.float32: np.float32, torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype rlx holds a torch dtype in (halves in float32)."""
    if dtype in HALF:
        return np.dtype(np.float32)
    if dtype not in _NUMPY:
        raise Unsupported(f"values of {dtype}")
    return np.dtype(_NUMPY[dtype])


def _cast(g: Graph, x: Any, dtype: torch.dtype) -> Any:
    """A cast; to bfloat16 or float16 it is to float32 (the backend computes halves in float32)."""
    if dtype in HALF:
        dtype = torch.float32
    if dtype not in DTYPES:
        raise Unsupported(f"a cast to {dtype}")
    return g.cast(_float(x), DTYPES[dtype])


def _baddbmm(g: Graph, x: Any, batch1: Any, batch2: Any, *, beta: float = 1.0, alpha: float = 1.0) -> Any:
    """``beta * x + alpha * (batch1 @ batch2)`` (BLOOM's ALiBi scores); ``beta`` 0 ignores ``x``."""
    product = g.matmul(_float(batch1), _float(batch2))
    product = product * alpha if alpha != 1 else product
    if beta == 0:
        return product
    return (_value(g, x) * beta if beta != 1 else _value(g, x)) + product


def _conv(
    g: Graph,
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> Any:
    """``F.conv1d/2d/3d``: rlx's ``conv`` (im2col in graph ops, one BLAS product)."""
    return g.conv(_float(x), _float(weight), bias, stride=stride, padding=padding, dilation=dilation, groups=groups)


def _conv_transpose(
    g: Graph,
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    output_padding: Any = 0,
    groups: int = 1,
    dilation: Any = 1,
) -> Any:
    """``F.conv_transpose1d/2d/3d``: rlx's ``conv_transpose`` (a convolution's input gradient)."""
    return g.conv_transpose(_float(x), _float(weight), bias, stride, padding, output_padding, groups, dilation)


def _max_pool(
    g: Graph,
    x: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Any:
    """``F.max_pool1d/2d/3d`` (no indices)."""
    if return_indices:
        raise Unsupported("max pooling with return_indices")
    return g.max_pool(_float(x), kernel_size, stride or None, padding, dilation, ceil_mode)


def _avg_pool(
    g: Graph,
    x: Any,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: Any = None,
) -> Any:
    """``F.avg_pool1d/2d/3d``."""
    return g.avg_pool(_float(x), kernel_size, stride or None, padding, count_include_pad, ceil_mode, divisor_override)


def _adaptive(kind: str) -> Callable[..., Any]:
    """``F.adaptive_avg_pool*d`` / ``adaptive_max_pool*d`` (no indices): :func:`rlx.ops.conv.adaptive_pool`."""

    def handler(g: Graph, x: Any, output_size: Any, return_indices: bool = False) -> Any:
        if return_indices:
            raise Unsupported("adaptive pooling with return_indices")
        x = _float(x)
        return g.adaptive_max_pool(x, output_size) if kind == "max" else g.adaptive_avg_pool(x, output_size)

    return handler


def _running(name: str) -> Callable[..., Any]:
    """``torch.cumsum``, ``torch.cumprod`` and (from :mod:`rlx.torch._fx_sorting`) ``torch.cummax``
    and ``torch.cummin``: bools run in int64 (ints too in the sums and products), as torch's;
    ``dtype`` converts first."""

    def handler(g: Graph, x: Any, dim: int, *, dtype: torch.dtype | None = None, out: Any = None) -> Any:
        check_kwargs({"out": out}, out=None)
        x = _float(x) if dtype is None else _cast(g, x, dtype)
        if x.dtype == np.bool_:
            x = x.astype("int64")
        return getattr(g, name)(x, axis=dim)

    return handler


def _method_cast(dtype: torch.dtype) -> Callable[..., Any]:
    return lambda g, x, *a, **k: _cast(g, x, dtype)


def _type_as(g: Graph, x: Any, other: Any) -> Any:
    return _to(g, x, other)


def _getitem(g: Graph, x: Any, index: Any) -> Any:
    if isinstance(x, (tuple, list, torch.Size)):
        return x[index]
    if isinstance(x, Value):
        entries = index if isinstance(index, tuple) else (index,)
        if any(isinstance(e, (Value, torch.Tensor, list)) for e in entries):
            if any(isinstance(e, torch.Tensor) for e in entries):
                raise Unsupported("indexing by an empty tensor")
            try:
                return _gather_by_ranges(g, x, entries)  # views where the indices are ranges
            except Unsupported:
                return x[entries]  # NumPy's advanced indexing, which is torch's: a gather
        return _sliced(g, x, _clamped(x, entries))
    raise Unsupported(f"indexing a {type(x).__name__}")


def _sliced(g: Graph, x: Value, entries: tuple[Any, ...]) -> Value:
    """``x[entries]`` where a slice may have a dynamic size for a bound (``buffer[:, :S]``, BERT's
    token types): each such slice takes the range ``arange(start, stop)`` of the axis (an input
    made per call, whose ids are checked against the axis before native code runs, so a length
    past the end is an error of the call), the rest is rlx's basic indexing."""
    if not any(isinstance(e, slice) and not _int_bounds(e) for e in entries):
        return x[entries]
    spread = sum(e is not None and e is not Ellipsis for e in entries)
    plain: list[Any] = []
    taken: list[tuple[int, int | Size, int | Size]] = []
    axis = 0
    for entry in entries:
        if entry is Ellipsis:
            axis += x.ndim - spread
        elif isinstance(entry, slice) and not _int_bounds(entry):
            if entry.step not in (None, 1):
                raise Unsupported(f"a slice with a step and a dynamic bound ({entry})")
            start = 0 if entry.start is None else entry.start
            stop = poly(x.shape[axis]) if entry.stop is None else entry.stop
            if any(isinstance(b, int) and b < 0 for b in (start, stop)):
                raise Unsupported(f"a slice with a dynamic bound and one counted from the end ({entry})")
            if not (start == 0 and poly(stop) == poly(x.shape[axis])):  # else the whole axis
                taken.append((axis, start, stop))
            entry = slice(None)
        if entry is not None and entry is not Ellipsis:
            axis += 1
        plain.append(entry)
    for at, start, stop in taken:
        x = g.take(x, MAKE_RANGE.get()(start, stop), at)
    return x[tuple(plain)]


def _int_bounds(entry: slice) -> bool:
    return all(b is None or isinstance(b, int) for b in (entry.start, entry.stop))


def _setitem(g: Graph, x: Any, index: Any, value: Any) -> Value:
    """``x[index] = value`` as a new value (rlx.torch.dynamo binds it to x's node): rlx's
    ``x.at[index].set(value)`` (the value converted to x's dtype and broadcast to the part, as
    torch does; a block of ints and slices is views around it, any other index a scatter, a bool
    mask of x's leading axes with a number a ``where``)."""
    x = _float(x)
    entries = index if isinstance(index, tuple) else (index,)
    if any(isinstance(e, slice) and not _int_bounds(e) for e in entries):
        raise Unsupported(f"assigning by the index {index!r} with a dynamic bound")
    if not isinstance(value, (Value, int, float, bool)):
        raise Unsupported(f"assigning a {type(value).__name__}")
    return x.at[index].set(value)


def _clamped(x: Value, entries: tuple[Any, ...]) -> tuple[Any, ...]:
    """``entries`` with each slice of a dynamic axis that TorchDynamo traced as the whole axis
    made whole: ``keys[:, :, -4095:]`` (a sliding window's cache) is the whole axis while the
    length is at most 4095, which TorchDynamo guards, where rlx's own slicing counts 4095 back
    from the end and refuses shorter axes (NumPy would clamp)."""
    expected = EXPECTED_SHAPE.get()
    if expected is None:
        return entries
    spread = sum(e is not None and e is not Ellipsis for e in entries)
    out: list[Any] = []
    axis = position = 0
    for entry in entries:
        if entry is Ellipsis:
            out.append(entry)
            skipped = x.ndim - spread
            axis, position = axis + skipped, position + skipped
        elif entry is None:
            out.append(entry)
            position += 1
        elif isinstance(entry, slice):
            length = x.shape[axis] if axis < x.ndim else None
            whole = isinstance(length, str) and position < len(expected) and expected[position] == length
            out.append(slice(None) if whole and entry.step in (None, 1) else entry)
            axis, position = axis + 1, position + 1
        else:
            out.append(entry)
            axis += 1
    return tuple(out)


def _constant_array(value: Any) -> np.ndarray | None:
    """The data of a graph constant (what a folded torch tensor became), else None."""
    if isinstance(value, Value) and value.node.op.value == "constant":
        return np.asarray(value.node.attrs.value.array)
    return None


EXPECTED_SHAPE: contextvars.ContextVar[tuple[Dim, ...] | None] = contextvars.ContextVar(
    "rlx_fx_expected_shape", default=None
)
"""The shape TorchDynamo traced for the call being translated (its guards hold it), if any."""

RANGES: contextvars.ContextVar[dict[Value, int | Size]] = contextvars.ContextVar("rlx_fx_ranges")
"""The graph inputs that hold ``arange(start, start + n)`` of a dynamic ``n`` (made per call by
rlx.torch.dynamo's wrapper), by their start: the translation in progress sets it."""

MAKE_RANGE: contextvars.ContextVar[Callable[[int | Size, int | Size], Value]] = contextvars.ContextVar("rlx_fx_range")
"""``arange(start, stop)`` (int64) of sizes that may be dynamic, as a graph input the wrapper makes
per call: the translation in progress sets it."""


@dataclass(frozen=True)
class _Range:
    """An index tensor known to hold ``start + position`` along one axis (``axis``) and to be
    the same along the others (size 1 there), or one number everywhere (``axis`` None)."""

    shape: tuple[Dim, ...]
    axis: int | None
    start: int | Size


def _as_range(entry: Any) -> _Range | None:
    """What an index tensor is, if a range: a constant array, or a range input reshaped."""
    array = _constant_array(entry)
    if array is not None:
        if array.dtype.kind not in "iu" or not array.size:
            return None
        first = int(array.flat[0])
        varying = [r for r in range(array.ndim) if array.shape[r] > 1]
        if (array == first).all():
            return _Range(array.shape, None, first)
        if len(varying) != 1:
            return None
        line = np.moveaxis(array, varying[0], 0).reshape(array.shape[varying[0]], -1)
        if (line != line[:, :1]).any() or not np.array_equal(line[:, 0], first + np.arange(line.shape[0])):
            return None
        return _Range(array.shape, varying[0], first)
    value = entry
    while isinstance(value, Value) and value.node.op.value == "reshape":
        value = value.node.inputs[0]
    starts = RANGES.get({})
    if not isinstance(entry, Value) or value not in starts:
        return None
    wide = [r for r, d in enumerate(entry.shape) if d != 1]
    return _Range(entry.shape, wide[0], starts[value]) if len(wide) == 1 else None


def _gather_by_ranges(g: Graph, x: Value, entries: tuple[Any, ...]) -> Value:
    """``x[i0, i1, ...]`` with integer index tensors that are ranges broadcast along distinct
    result axes (or single numbers), as masks are built (``mask[batch[:, None, None, None],
    keys[None, None, None, :]]``), constant or of a dynamic length: NumPy's advanced indexing
    of such tensors is slices, a transpose, a reshape and a broadcast, all views. Other tensor
    indices are not translated."""
    ranges = [_as_range(e) for e in entries]
    known = [r for r in ranges if r is not None]
    if len(known) != len(ranges) or len(known) > x.ndim:
        raise Unsupported("indexing by a tensor other than ranges")
    rank = max(len(r.shape) for r in known)
    result: list[Dim] = [1] * rank
    for r in known:
        for i, d in enumerate(r.shape, start=rank - len(r.shape)):
            if d != 1:
                if result[i] not in (1, d):
                    raise Unsupported("index tensors that do not broadcast")
                result[i] = d
    placed: dict[int, int] = {}  # result axis -> x's axis
    y = x
    for axis, r in enumerate(known):
        length = x.shape[axis]
        if r.axis is None:
            if not isinstance(length, int) or not isinstance(r.start, int) or not -length <= r.start < length:
                raise Unsupported("indexing by a number outside the axis")
            first = r.start % length
            y = y[(slice(None),) * axis + (slice(first, first + 1),)]
            continue
        at = r.axis + rank - len(r.shape)
        if at in placed:
            raise Unsupported("index tensors that vary along the same axis")
        placed[at] = axis
        size = result[at]
        if r.start == 0 and size == length:
            continue
        plain = isinstance(size, str) and isinstance(length, str) and size.isidentifier() and length.isidentifier()
        if r.start == 0 and plain:
            raise SameSizes(str(size), str(length))
        if not (isinstance(length, int) and isinstance(size, int) and isinstance(r.start, int)):
            raise Unsupported(f"a range over part of a dynamic axis ({r.start}+{size} of {length})")
        if not (r.start >= 0 and r.start + size <= length):
            raise Unsupported("a range past the end of the axis")
        y = y[(slice(None),) * axis + (slice(r.start, r.start + size),)]
    count = len(known)
    rest = tuple(y.shape[count:])
    order = [placed[r] for r in sorted(placed)]
    kept = g.transpose(y, (*order, *(a for a in range(count) if a not in order), *range(count, y.ndim)))
    laid = tuple(result[r] if r in placed else 1 for r in range(rank))
    shaped = g.reshape(kept, laid + rest)
    return g.broadcast_to(shaped, tuple(result) + rest) if laid != tuple(result) else shaped


def _gather(g: Graph, x: Any, dim: int, index: Any, *, sparse_grad: bool = False) -> Any:
    """``torch.gather(x, dim, index)``: ``out[i][j][k] = x[i][index[i][j][k]][k]`` (``dim`` 1).

    A constant index that is one range along ``dim``, the same at every other position, is a
    slice; any other is a gather of single elements (:func:`_gather_elements`)."""
    x = _float(x)
    if not isinstance(x, Value) or not isinstance(index, Value) or index.ndim != x.ndim or not x.ndim:
        raise Unsupported("gather of something other than tensors of one rank")
    axis = dim % x.ndim
    array = _constant_array(index)
    if array is not None:
        sliced = _gathered_range(x, axis, array)
        if sliced is not None:
            return sliced
    return _gather_elements(g, x, axis, index)


def _gathered_range(x: Value, axis: int, array: np.ndarray) -> Value | None:
    """``x``'s slice a constant gather index takes where it is one range along ``axis``, the
    same at every other position, and inside ``x``; else None."""
    line = np.moveaxis(array, axis, -1).reshape(-1, array.shape[axis])
    length = x.shape[axis]
    if not isinstance(length, int) or not line.size or (line != line[0]).any():
        return None
    start = int(line[0, 0])
    if not np.array_equal(line[0], start + np.arange(line.shape[1])) or start < 0 or start + line.shape[1] > length:
        return None
    bounds = []
    for a, size in enumerate(array.shape):
        if a == axis:
            bounds.append(slice(start, start + size))
        elif not isinstance(x.shape[a], int) or size > x.shape[a]:
            return None
        else:
            bounds.append(slice(0, size))
    return x[tuple(bounds)]


def _gather_elements(g: Graph, x: Value, axis: int, index: Value) -> Value:
    """``torch.gather`` by any index: ``take_along_axis`` of ``x`` with its other axes cut to the
    index's (torch reads only that corner). An index outside ``[0, L)`` is an error of the call,
    as torch raises one."""
    cut = []
    for a in range(x.ndim):
        want, have = index.shape[a], x.shape[a]
        if a == axis or want == have:
            cut.append(slice(None))
        elif isinstance(want, int) and isinstance(have, int) and want < have:
            cut.append(slice(0, want))
        elif isinstance(want, str) and isinstance(have, str) and want.isidentifier() and have.isidentifier():
            raise SameSizes(want, have)  # an index as long as the input, in every call torch runs
        else:
            raise Unsupported(f"gather by an index of shape {index.shape} from {x.shape} (axis {a})")
    part = x[tuple(cut)] if any(c != slice(None) for c in cut) else x
    return g.take_along_axis(part, index, axis)


def _index_select(g: Graph, x: Any, dim: int, index: Any) -> Any:
    """``torch.index_select(x, dim, index)``: ``take`` by a 1-D index tensor."""
    index = _float(index)
    if index.ndim != 1:
        raise Unsupported("index_select by other than a 1-D index")
    return g.take(_float(x), index, dim)


def _size(g: Graph, x: Any, dim: Any = None) -> Any:
    """``x.size()``: ints, and polynomials for dynamic dimensions."""
    shape = tuple(poly(d) for d in _float(x).shape)
    return shape if dim is None else shape[dim]


def _floordiv(g: Graph, a: Any, b: Any) -> Any:
    """``a // b`` (``torch.floor_divide``): of tensors, rounded toward -inf, in their promoted
    dtype; of dynamic sizes, where the quotient is exact."""
    if isinstance(a, (Value, torch.Tensor)) or isinstance(b, (Value, torch.Tensor)):
        return g.floor_divide(*_promoted(g, _value(g, a), _value(g, b)))
    if isinstance(a, Size) or isinstance(b, Size):
        quotient = exact_quotient(a, b)
        if quotient is None:
            raise Unsupported(f"the dynamic size {a} // {b}")
        return quotient
    return a // b


def _remainder(g: Graph, a: Any, b: Any) -> Any:
    """``a % b`` (``torch.remainder``): the divisor's sign, as Python."""
    if isinstance(a, (Value, torch.Tensor)) or isinstance(b, (Value, torch.Tensor)):
        return g.remainder(*_promoted(g, _value(g, a), _value(g, b)))
    if isinstance(a, Size) or isinstance(b, Size):
        raise Unsupported(f"the dynamic size {a} % {b}")
    return a % b


def _divide(g: Graph, a: Any, b: Any, *, rounding_mode: str | None = None, out: Any = None) -> Any:
    """``torch.div``: true division, or ``rounding_mode`` "floor" (``//``) or "trunc" (toward 0)."""
    check_kwargs({"out": out}, out=None)
    if rounding_mode is None:
        return _binary("div")(g, a, b)
    if rounding_mode == "floor":
        return _floordiv(g, a, b)
    if rounding_mode != "trunc":
        raise Unsupported(f"rounding_mode={rounding_mode!r}")
    if not (isinstance(a, (Value, torch.Tensor)) or isinstance(b, (Value, torch.Tensor))):
        if isinstance(a, Size) or isinstance(b, Size):
            raise Unsupported(f"the dynamic size {a} / {b} rounded toward 0")
        return int(a / b) if type(a) is int and type(b) is int else float(math.trunc(a / b))
    a, b = _promoted(g, _value(g, a), _value(g, b))
    if a.dtype == np.float32:
        return g.trunc(a / b)
    quotient = g.floor_divide(a, b)  # toward -inf: one less than toward 0 where inexact with mixed signs
    inexact = g.logical_and(g.not_equal(g.remainder(a, b), 0), g.not_equal(g.less(a, 0), g.less(b, 0)))
    return g.where(inexact, quotient + 1, quotient)


def _static_length(x: Value, dim: int, what: str) -> int:
    length = x.shape[dim]
    if not isinstance(length, int):
        raise Unsupported(f"{what} along the dynamic axis {dim} ({length})")
    return length


def _split(g: Graph, x: Any, split_size: Any, dim: int = 0) -> Any:
    x = _float(x)
    length = _static_length(x, dim, "split")
    if type(split_size) is int:
        sizes = [min(split_size, length - start) for start in range(0, length, split_size)]
    else:
        sizes = list(split_size)
    return g.split(x, sizes, axis=dim) if len(sizes) > 1 else (x,)


def _chunk(g: Graph, x: Any, chunks: int, dim: int = 0) -> Any:
    x = _float(x)
    length = _static_length(x, dim, "chunk")
    return _split(g, x, -(-length // chunks), dim)


def _tensor_split(g: Graph, x: Any, indices_or_sections: Any, dim: int = 0) -> Any:
    """``torch.tensor_split``: ``n`` sections (the first ``length % n`` one longer) or the parts
    between the given indices."""
    x = _float(x)
    length = _static_length(x, dim, "tensor_split")
    if type(indices_or_sections) is int:
        count = indices_or_sections
        sizes = [length // count + (1 if part < length % count else 0) for part in range(count)]
    else:
        bounds = [0, *(min(max(int(i), 0), length) for i in indices_or_sections), length]
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
    if any(size <= 0 for size in sizes):
        raise Unsupported(f"tensor_split into an empty part ({sizes}): rlx has no empty values")
    return g.split(x, sizes, axis=dim) if len(sizes) > 1 else (x,)


def _cat(g: Graph, tensors: Sequence[Any], dim: int = 0, **kwargs: Any) -> Any:
    """``torch.cat``; empty 1-D tensors are skipped, as torch skips them."""
    dim = kwargs.pop("axis", dim)
    check_kwargs(kwargs)
    parts = [t for t in tensors if not (isinstance(t, torch.Tensor) and t.numel() == 0 and t.ndim == 1)]
    if not parts:
        raise Unsupported("a concatenation of empty tensors")
    return g.concat([_float(t) for t in parts], axis=dim) if len(parts) > 1 else _float(parts[0])


def _pad(g: Graph, x: Any, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Any:
    """``F.pad`` with a constant: blocks of ``value`` concatenated before and after each axis
    named, from the last axis backwards (``(left, right, top, bottom, ...)``), as torch pairs them;
    a negative pad crops. The modes ``reflect``, ``replicate`` and ``circular``:
    :func:`rlx.torch._fx_extras.padded`."""
    x = _float(x)
    if mode in ("reflect", "replicate", "circular"):
        from rlx.torch._fx_extras import padded

        return padded(g, x, pad, mode)
    if mode != "constant" or len(pad) % 2 or not all(type(p) is int for p in pad):
        raise Unsupported(f"pad {tuple(pad)} in mode {mode!r}")
    if any(p < 0 for p in pad):  # crop first, then pad what is positive
        index: list[object] = [slice(None)] * x.ndim
        for pair in range(len(pad) // 2):
            before, after = pad[2 * pair], pad[2 * pair + 1]
            length = _static_length(x, x.ndim - 1 - pair, "pad")
            index[x.ndim - 1 - pair] = slice(max(-before, 0), length - max(-after, 0))
        x = x[tuple(index)]
        pad = [max(p, 0) for p in pad]
    widths = [(0, 0)] * x.ndim
    for pair in range(len(pad) // 2):
        widths[x.ndim - 1 - pair] = (pad[2 * pair], pad[2 * pair + 1])
    return g.pad(x, widths, 0 if value is None else value)


def _addmm(g: Graph, bias: Any, a: Any, b: Any, *, beta: float = 1, alpha: float = 1) -> Any:
    """``torch.addmm(bias, a, b)``: ``beta * bias + alpha * a @ b`` (GPT-2's Conv1D)."""
    product = g.matmul(_float(a), _float(b))
    product = product if alpha == 1 else product * float(alpha)
    return product + (_value(g, bias) if beta == 1 else _value(g, bias) * float(beta))


def _stack(g: Graph, tensors: Sequence[Any], dim: int = 0) -> Any:
    return g.stack([_float(t) for t in tensors], axis=dim)


def _where(g: Graph, cond: Any, a: Any = None, b: Any = None) -> Any:
    if a is None:
        raise Unsupported("torch.where(cond) (indices)")
    return g.where(_float(cond), *_promoted(g, _value(g, a), _value(g, b)))


def _masked_fill(g: Graph, x: Any, mask: Any, value: Any) -> Any:
    return g.where(_float(mask), _value(g, value), _float(x))


def _clamp(g: Graph, x: Any, min: Any = None, max: Any = None) -> Any:
    return g.clip(_float(x), None if min is None else _value(g, min), None if max is None else _value(g, max))


def _pow(g: Graph, a: Any, b: Any) -> Any:
    if isinstance(a, Value) and b == 2:
        return a * a
    return g.pow(_value(g, a), _value(g, b))


def _rsub(g: Graph, a: Any, b: Any) -> Any:
    return g.sub(_value(g, b), _value(g, a))


def _matmul(g: Graph, a: Any, b: Any) -> Any:
    return g.matmul(_float(a), _float(b))


def _linear(g: Graph, x: Any, weight: Any, bias: Any = None) -> Any:
    y = g.matmul(_float(x), g.transpose(_float(weight), (1, 0)))
    return y if bias is None else y + _float(bias)


def _layer_norm(g: Graph, x: Any, shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    """``F.layer_norm`` over the last ``len(normalized_shape)`` axes: over several, those axes
    are flattened into one (a view), and the weight and bias with them."""
    x = _float(x)
    count = len(tuple(shape))
    if count == 1:
        return g.layer_norm(x, weight if weight is not None else 1.0, bias, eps=eps)
    trailing = x.shape[x.ndim - count :]
    if not all(isinstance(d, int) for d in trailing):
        raise Unsupported("layer_norm over several axes of dynamic size")
    size = math.prod(trailing)  # type: ignore[arg-type]
    flat = g.reshape(x, (*x.shape[: x.ndim - count], size))
    w = g.reshape(_float(weight), (size,)) if weight is not None else 1.0
    b = g.reshape(_float(bias), (size,)) if bias is not None else None
    return g.reshape(g.layer_norm(flat, w, b, eps=eps), tuple(x.shape))


def _rms_norm(g: Graph, x: Any, shape: Any, weight: Any = None, eps: float | None = None) -> Any:
    x = _float(x)
    if len(tuple(shape)) != 1:
        raise Unsupported("rms_norm over more than the last axis")
    if eps is None:
        eps = float(torch.finfo(torch.float32).eps)  # torch's default
    return g.rms_norm(x, weight if weight is not None else 1.0, eps=eps)


def _gelu(g: Graph, x: Any, approximate: str = "none") -> Any:
    return g.gelu(_float(x), approximate=approximate)


def _dropout(g: Graph, x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
    """Dropout off (evaluation, or ``p = 0``) is ``x``; while training, rlx.torch.dynamo draws
    the mask (it needs torch's random numbers, per call)."""
    if training and p > 0:
        raise Unsupported("dropout while training of a value the backend cannot mask")
    return _float(x)


def _embedding(g: Graph, ids: Any, weight: Any, padding_idx: Any = None, max_norm: Any = None, *rest: Any) -> Any:
    if max_norm is not None:
        raise Unsupported("embedding with max_norm")
    if rest and len(rest) >= 2 and (rest[1] or (len(rest) > 2 and rest[2])):
        raise Unsupported("embedding with scale_grad_by_freq or sparse")
    table = _float(weight)
    if padding_idx is not None:  # that row gets no gradient (its value is read as it is)
        rows = table.shape[0]
        if not isinstance(rows, int):
            raise Unsupported("embedding with padding_idx of a table of dynamic rows")
        mask = np.zeros((rows, 1), np.bool_)
        mask[int(padding_idx) % rows] = True
        table = g.where(g.constant(mask), g.stop_gradient(table), table)
    return g.embedding(table, _float(ids))


_LOSS_OPTIONS = ("size_average", "ignore_index", "reduce", "reduction", "label_smoothing")


def _cross_entropy(g: Graph, logits: Any, target: Any, weight: Any = None, *rest: Any, **kwargs: Any) -> Any:
    """``F.cross_entropy`` with class indices: :func:`_negative_log_likelihood` of ``log_softmax``."""
    options = dict(zip(_LOSS_OPTIONS, rest, strict=False)) | kwargs
    logits = _classes_last(g, _float(logits), "cross_entropy")
    return _negative_log_likelihood(g, g.log_softmax(logits, axis=-1), _float(target), weight, options)


def _nll_loss(g: Graph, log_probs: Any, target: Any, weight: Any = None, *rest: Any, **kwargs: Any) -> Any:
    """``F.nll_loss``: :func:`_negative_log_likelihood` of the given log-probabilities."""
    options = dict(zip(_LOSS_OPTIONS[:4], rest, strict=False)) | kwargs
    if "label_smoothing" in options:
        raise Unsupported("nll_loss takes no label_smoothing")
    return _negative_log_likelihood(g, _classes_last(g, _float(log_probs), "nll_loss"), _float(target), weight, options)


def _classes_last(g: Graph, x: Value, what: str) -> Value:
    """torch puts the classes of a ``[N, C, d1, ...]`` input on axis 1: moved last."""
    if x.ndim <= 2:
        return x
    return g.transpose(x, (0, *range(2, x.ndim), 1))


def _negative_log_likelihood(g: Graph, log_probs: Value, target: Value, weight: Any, options: dict[str, Any]) -> Any:
    """torch's NLL of class indices: ``-w[t] * log_probs[t]`` per target, with ``label_smoothing``
    mixing in ``-sum_c w[c] * log_probs[c] / C``; a target equal to ``ignore_index`` (-100 unless
    given) counts for nothing (0 under ``reduction="none"``), and the mean divides by the weights
    of the counted targets (NaN when there are none, as torch's). Not rlx's cross_entropy op,
    which refuses such targets: each target is compared with every class (an ignored one
    matches none). A counted target outside [0, C), which torch refuses, makes the loss NaN,
    never unseen."""
    if options.get("size_average") is not None or options.get("reduce") is not None:
        raise Unsupported("a loss with the legacy size_average or reduce arguments")
    reduction = options.get("reduction", "mean")
    smoothing = float(options.get("label_smoothing", 0.0))
    ignore = int(options.get("ignore_index", -100))
    if reduction not in ("mean", "sum", "none"):
        raise Unsupported(f"reduction={reduction!r}")
    classes = log_probs.shape[-1]
    if not isinstance(classes, int):
        raise Unsupported("a loss over a dynamic number of classes")
    picked = _class_matches(g, target, classes).astype("float32")
    class_weights = None if weight is None else _value(g, weight)
    row_weight = 1.0 if class_weights is None else g.sum(picked * class_weights, axis=-1)
    loss = -g.sum(log_probs * picked, axis=-1) * row_weight
    if smoothing:
        spread = log_probs if class_weights is None else log_probs * class_weights
        loss = loss * (1.0 - smoothing) - g.sum(spread, axis=-1) * (smoothing / classes)
    counted = g.not_equal(target, ignore)
    loss = g.where(counted, loss, 0.0)
    outside = g.logical_and(counted, g.logical_or(g.less(target, 0), g.greater_equal(target, classes)))
    poison = g.where(g.greater(g.sum(outside.astype("float32")), 0.0), float("nan"), 0.0)
    if reduction == "none":
        return loss + poison
    if reduction == "sum":
        return g.sum(loss) + poison
    total_weight = g.sum(counted.astype("float32") * row_weight)
    return g.sum(loss) / total_weight + poison


def _reduced(g: Graph, loss: Value, reduction: str, size_average: Any = None, reduce: Any = None) -> Value:
    """A pointwise loss under torch's ``reduction``."""
    if size_average is not None or reduce is not None:
        raise Unsupported("a loss with the legacy size_average or reduce arguments")
    if reduction == "mean":
        return g.mean(loss)
    if reduction == "sum":
        return g.sum(loss)
    if reduction == "none":
        return loss
    raise Unsupported(f"reduction={reduction!r}")


def _pointwise_loss(kind: str) -> Callable[..., Any]:
    """``F.mse_loss``, ``l1_loss``, ``smooth_l1_loss`` (``beta``) and ``huber_loss`` (``delta``)."""

    def handler(
        g: Graph,
        x: Any,
        target: Any,
        size_average: Any = None,
        reduce: Any = None,
        reduction: str = "mean",
        beta: float = 1.0,
        *,
        delta: float = 1.0,
        weight: Any = None,
    ) -> Any:
        if weight is not None:
            raise Unsupported(f"{kind} with weights")
        x, target = _promoted(g, _value(g, x), _value(g, target))
        diff = x - target
        if kind == "mse":
            loss = diff * diff
        else:
            distance = g.abs(diff)
            if kind == "l1" or (kind == "smooth_l1" and beta == 0):
                loss = distance
            elif kind == "smooth_l1":
                loss = g.where(g.less(distance, beta), 0.5 * distance * distance / beta, distance - 0.5 * beta)
            else:
                loss = g.where(g.less(distance, delta), 0.5 * distance * distance, delta * (distance - 0.5 * delta))
        return _reduced(g, loss, reduction, size_average, reduce)

    return handler


def _binary_cross_entropy(with_logits: bool) -> Callable[..., Any]:
    """``F.binary_cross_entropy_with_logits`` (``pos_weight``, stable in the logits) and
    ``F.binary_cross_entropy`` (of probabilities, each log clamped at -100 as torch's)."""

    def handler(
        g: Graph,
        x: Any,
        target: Any,
        weight: Any = None,
        size_average: Any = None,
        reduce: Any = None,
        reduction: str = "mean",
        pos_weight: Any = None,
    ) -> Any:
        x, target = _float(x), _value(g, target)
        if with_logits:
            # (1 - t) x + (1 + (p - 1) t) (log1p(exp(-|x|)) + max(-x, 0)), torch's formula.
            softplus = g.log1p(g.exp(-g.abs(x))) + g.maximum(-x, 0.0)
            scale = 1.0 if pos_weight is None else 1.0 + (_value(g, pos_weight) - 1.0) * target
            loss = (1.0 - target) * x + scale * softplus
        else:
            if pos_weight is not None:
                raise Unsupported("binary_cross_entropy takes no pos_weight")
            log_p, log_q = g.maximum(g.log(x), -100.0), g.maximum(g.log(1.0 - x), -100.0)
            loss = -(target * log_p + (1.0 - target) * log_q)
        if weight is not None:
            loss = loss * _value(g, weight)
        return _reduced(g, loss, reduction, size_average, reduce)

    return handler


def _kl_div(
    g: Graph,
    x: Any,
    target: Any,
    size_average: Any = None,
    reduce: Any = None,
    reduction: str = "mean",
    log_target: bool = False,
) -> Any:
    """``F.kl_div``: ``target * (log(target) - x)`` (0 where the target is 0), or with
    ``log_target`` ``exp(target) * (target - x)``; ``"batchmean"`` divides the sum by the batch."""
    x, target = _float(x), _value(g, target)
    if log_target:
        loss = g.exp(target) * (target - x)
    else:
        positive = g.greater(target, 0.0)
        loss = g.where(positive, target * (g.log(g.where(positive, target, 1.0)) - x), 0.0)
    if reduction == "batchmean":
        if size_average is not None or reduce is not None:
            raise Unsupported("a loss with the legacy size_average or reduce arguments")
        return g.sum(loss) / float(x.shape[0]) if x.ndim and isinstance(x.shape[0], int) else g.sum(loss)
    return _reduced(g, loss, reduction, size_average, reduce)


def _logsumexp(g: Graph, x: Any, dim: Any, keepdim: bool = False) -> Any:
    """``torch.logsumexp``: ``g.logsumexp`` (a row of -inf gives -inf, not NaN)."""
    return g.logsumexp(_float(x), _axis_args(dim), keepdim)


def _triangle(lower: bool) -> Callable[..., Any]:
    """``torch.tril`` / ``triu``: ``g.tril`` / ``g.triu`` (positions of per-call lengths as well)."""

    def handler(g: Graph, x: Any, diagonal: int = 0) -> Any:
        return (g.tril if lower else g.triu)(_float(x), diagonal)

    return handler


def _roll(g: Graph, x: Any, shifts: Any, dims: Any = None) -> Any:
    """``torch.roll``: ``g.roll`` (without ``dims``, of the flattened value, as NumPy's)."""
    shift_list = [shifts] if type(shifts) is int else list(shifts)
    if dims is None:
        if len(shift_list) != 1:
            raise Unsupported("roll with several shifts and no dims")
        return g.roll(_float(x), shift_list[0])
    dim_list = [dims] if type(dims) is int else list(dims)
    if len(shift_list) != len(dim_list):
        raise Unsupported("roll with as many shifts as dims")
    return g.roll(_float(x), shift_list, dim_list)


def _interpolate(
    g: Graph,
    x: Any,
    size: Any = None,
    scale_factor: Any = None,
    mode: str = "nearest",
    align_corners: Any = None,
    recompute_scale_factor: Any = None,
    antialias: bool = False,
) -> Any:
    """``F.interpolate`` of static spatial sizes in the modes ``nearest``, ``nearest-exact``,
    ``linear``, ``bilinear``, ``trilinear``, ``bicubic`` (``align_corners`` either way) and
    ``area``, as torch samples: nearest by whole factors repeats each entry (a broadcast and a
    reshape, views); otherwise each axis in turn gathers the source entries its positions read
    (two, weighted, in the linear modes; four, with torch's cubic convolution weights and the
    border entries repeated, in bicubic). ``area`` is adaptive average pooling to the new size,
    as torch's. Antialiasing is left to torch."""
    x = _float(x)
    spatial = x.ndim - 2
    linear = {"linear": 1, "bilinear": 2, "trilinear": 3, "bicubic": 2}
    if antialias or spatial < 1 or (mode not in ("nearest", "nearest-exact", "area") and linear.get(mode) != spatial):
        raise Unsupported(f"interpolate in mode {mode!r} of {spatial} spatial axes")
    sizes = [x.shape[2 + a] for a in range(spatial)]
    if not all(isinstance(s, int) for s in sizes):
        raise Unsupported("interpolate of dynamic spatial sizes")
    if size is not None:
        wanted = [int(size)] * spatial if not isinstance(size, (tuple, list)) else [int(v) for v in size]
        scales = [float(s) / w for s, w in zip(sizes, wanted, strict=True)]  # source step per output entry
    else:
        factors = [scale_factor] * spatial if not isinstance(scale_factor, (tuple, list)) else list(scale_factor)
        wanted = [math.floor(s * float(f)) for s, f in zip(sizes, factors, strict=True)]
        scales = (
            [float(s) / w for s, w in zip(sizes, wanted, strict=True)]
            if recompute_scale_factor
            else [1.0 / float(f) for f in factors]
        )
    if min(wanted) < 1:
        raise Unsupported("interpolate to an empty size")
    if mode == "area":
        return g.adaptive_avg_pool(x, wanted)
    if (
        mode == "nearest"
        and all(w % s == 0 for w, s in zip(wanted, sizes, strict=True))
        and all(abs(scale * (w // s) - 1.0) < 1e-12 for scale, w, s in zip(scales, wanted, sizes, strict=True))
    ):
        factors = [w // s for w, s in zip(wanted, sizes, strict=True)]
        lead = tuple(x.shape[:2])
        spread = g.reshape(x, (*lead, *(d for s in sizes for d in (s, 1))))
        repeated = g.broadcast_to(spread, (*lead, *(d for s, f in zip(sizes, factors, strict=True) for d in (s, f))))
        return g.reshape(repeated, (*lead, *(s * f for s, f in zip(sizes, factors, strict=True))))
    out = x
    for axis, (n, w, scale) in enumerate(zip(sizes, wanted, scales, strict=True), start=2):
        positions = np.arange(w, dtype=np.float64)
        if mode in ("nearest", "nearest-exact"):  # the source entry at (or, exact, nearest to) each position
            shifted = positions + 0.5 if mode == "nearest-exact" else positions
            picked = np.minimum(np.floor(shifted * np.float32(scale)), n - 1).astype(np.int64)
            out = g.take(out, g.constant(picked), axis)
            continue
        if mode == "bicubic":
            out = _cubic_axis(g, out, axis, n, w, scale, bool(align_corners))
            continue
        if align_corners:
            source = positions * ((n - 1) / (w - 1) if w > 1 else 0.0)
        else:
            source = np.maximum((positions + 0.5) * np.float32(scale) - 0.5, 0.0)
        low = np.minimum(np.floor(source), n - 1).astype(np.int64)
        high = np.minimum(low + 1, n - 1)
        weight = (source - low).astype(np.float32).reshape(w, *(1,) * (x.ndim - axis - 1))
        first, second = g.take(out, g.constant(low), axis), g.take(out, g.constant(high), axis)
        out = first + (second - first) * g.constant(weight)
    return out


CUBIC_A = -0.75  # torch's cubic convolution constant (upsample_bicubic2d)


def _cubic_axis(g: Graph, x: Any, axis: int, n: int, w: int, scale: float, align_corners: bool) -> Any:
    """One axis of bicubic interpolation as torch's ``upsample_bicubic2d``: the source position of
    each output (float32 arithmetic, unclamped without ``align_corners``), its four neighbours
    ``floor - 1 .. floor + 2`` clamped into the axis, weighted by Keys' cubic convolution."""
    positions = np.arange(w, dtype=np.float32)
    if align_corners:
        source = positions * np.float32((n - 1) / (w - 1) if w > 1 else 0.0)
    else:
        source = (positions + np.float32(0.5)) * np.float32(scale) - np.float32(0.5)
    floor = np.floor(source)
    t = (source - floor).astype(np.float64)
    a = CUBIC_A

    def near(d: np.ndarray) -> np.ndarray:  # |d| <= 1
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d: np.ndarray) -> np.ndarray:  # 1 < |d| < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    weights = [far(t + 1), near(t), near(1 - t), far(2 - t)]
    shape = (w, *(1,) * (x.ndim - axis - 1))
    out = None
    for offset, weight in zip((-1, 0, 1, 2), weights, strict=True):
        index = np.clip(floor.astype(np.int64) + offset, 0, n - 1)
        term = g.take(x, g.constant(index), axis) * g.constant(weight.astype(np.float32).reshape(shape))
        out = term if out is None else out + term
    return out


def _multi_head_attention(
    g: Graph,
    query: Any,
    key: Any,
    value: Any,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Any,
    in_proj_bias: Any,
    bias_k: Any,
    bias_v: Any,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Any,
    out_proj_bias: Any,
    training: bool = True,
    key_padding_mask: Any = None,
    need_weights: bool = True,
    attn_mask: Any = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Any = None,
    k_proj_weight: Any = None,
    v_proj_weight: Any = None,
    static_k: Any = None,
    static_v: Any = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> Any:
    """``F.multi_head_attention_forward`` (``nn.MultiheadAttention``; ``[L, N, E]`` tensors):
    the projections, attention (SDPA's kernels, or, when the weights are asked for, the softmax
    written out so they can be returned, averaged over heads as torch does) and the output
    projection. Masks as torch's: a bool ``attn_mask`` or ``key_padding_mask`` is True where a
    query may NOT attend; float ones are added."""
    if bias_k is not None or bias_v is not None or add_zero_attn or static_k is not None or static_v is not None:
        raise Unsupported("multi-head attention with bias_k/bias_v, add_zero_attn or static keys")
    if dropout_p and training:
        raise Unsupported("attention dropout")
    q_in, k_in, v_in = _float(query), _float(key), _float(value)
    if q_in.ndim != 3:
        raise Unsupported("unbatched multi-head attention")
    heads, width = int(num_heads), int(embed_dim_to_check)
    if use_separate_proj_weight:
        weights = [_float(q_proj_weight), _float(k_proj_weight), _float(v_proj_weight)]
    else:
        weights = list(g.split(_float(in_proj_weight), 3, axis=0))
    biases = list(g.split(_float(in_proj_bias), 3, axis=0)) if in_proj_bias is not None else [None] * 3

    def heads_first(x: Value, w: Value, b: Value | None) -> Value:
        projected = _linear(g, x, w, b)  # [L, N, E]
        split = g.reshape(projected, (x.shape[0], x.shape[1], heads, width // heads))
        return g.transpose(split, (1, 2, 0, 3))  # [N, H, L, Dh]

    q, k, v = (heads_first(x, w, b) for x, w, b in zip((q_in, k_in, v_in), weights, biases, strict=True))
    batch, length, keys = q.shape[0], q.shape[2], k.shape[2]
    added: Value | None = None
    for mask, shape in ((attn_mask, None), (key_padding_mask, (batch, 1, 1, keys))):
        if mask is None:
            continue
        m = _value(g, mask)
        if not isinstance(m, Value):
            raise Unsupported("a number as an attention mask")
        term = g.where(m, float("-inf"), 0.0) if np.dtype(m.dtype) == np.bool_ else m
        if shape is not None:
            term = g.reshape(term, shape)
        elif term.ndim == 3:  # [N * H, L, S]
            term = g.reshape(term, (batch, heads, length, keys))
        added = term if added is None else added + term
    if not need_weights:
        out = _sdpa(g, q, k, v, attn_mask=added, is_causal=bool(is_causal) and added is None)
        attention_weights = None
    else:
        scores = g.matmul(q, g.transpose(k, (0, 1, 3, 2))) * (1.0 / math.sqrt(width // heads))
        if added is not None:
            scores = scores + added
        probabilities = g.softmax(scores, axis=-1)
        out = g.matmul(probabilities, v)
        attention_weights = g.mean(probabilities, axis=1) if average_attn_weights else probabilities
    merged = g.reshape(g.transpose(out, (2, 0, 1, 3)), (length, batch, width))  # [L, N, E]
    return _linear(g, merged, out_proj_weight, out_proj_bias), attention_weights


def _variance(root: bool) -> Callable[..., Any]:
    """``torch.var``/``torch.std`` and their methods (see :func:`variance_arguments`)."""

    def handler(g: Graph, x: Any, *args: Any, **kwargs: Any) -> Any:
        dim, ddof, keepdim = variance_arguments(args, kwargs)
        value = g.var(_float(x), axis=dim, keepdims=keepdim, ddof=ddof)
        return g.sqrt(value) if root else value

    return handler


def variance_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int, bool]:
    """``(dim, ddof, keepdim)`` of a ``var``/``std`` call: ``dim``, ``correction`` (``unbiased``
    in the older spelling, positional too) and ``keepdim``, as torch's (a correction of 1 by
    default: ``n - 1`` in the denominator)."""
    dim, correction, keepdim = None, 1, False
    if args and type(args[0]) is bool:  # var(unbiased)
        correction, args = int(args[0]), args[1:]
    elif args:
        dim, args = args[0], args[1:]
        if args and type(args[0]) is bool:  # var(dim, unbiased, keepdim)
            correction, args = int(args[0]), args[1:]
        if args:
            keepdim, args = args[0], args[1:]
    if args:
        raise Unsupported("var/std with more positional arguments")
    kwargs = dict(kwargs)
    dim = kwargs.pop("dim", dim)
    if "unbiased" in kwargs:
        correction = int(bool(kwargs.pop("unbiased")))
    correction = kwargs.pop("correction", correction)
    keepdim = kwargs.pop("keepdim", keepdim)
    check_kwargs(kwargs)
    ddof = 1 if correction is None else correction
    if not (type(ddof) is int or (isinstance(ddof, float) and ddof.is_integer())):
        raise Unsupported(f"var/std with correction={correction!r}")
    return _axis_args(dim), int(ddof), bool(keepdim)


def _tensor_unfold(g: Graph, x: Any, dimension: int, size: int, step: int) -> Any:
    """``Tensor.unfold``: the windows of ``size`` along ``dimension``, ``step`` apart, as a last
    axis (a strided view in compiled code, as torch's)."""
    value = _float(x)
    _static_length(value, int(dimension) % max(value.ndim, 1), "unfold")
    return g.unfold(value, int(dimension), int(size), int(step))


def _flip(g: Graph, x: Any, *dims: Any) -> Any:
    """``torch.flip``: ``g.flip`` of the named axes."""
    axes = dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims
    return g.flip(_float(x), tuple(int(a) for a in axes))


def _unfold(g: Graph, x: Any, kernel_size: Any, dilation: Any = 1, padding: Any = 0, stride: Any = 1) -> Any:
    """``F.unfold`` (im2col): ``[N, C, H, W] -> [N, C * kh * kw, L]``, channel-major as torch's,
    the windows strided slices of the zero-padded input stacked along a new axis."""
    x = _float(x)
    if x.ndim != 4 or not all(isinstance(d, int) for d in x.shape[1:]):
        raise Unsupported("unfold of other than a [N, C, H, W] tensor of static channels and sizes")

    def pair(v: Any) -> tuple[int, int]:
        return (int(v), int(v)) if not isinstance(v, (tuple, list)) else (int(v[0]), int(v[1]))

    taps, dilations, pads, strides = pair(kernel_size), pair(dilation), pair(padding), pair(stride)
    padded = x
    for axis, p in zip((2, 3), pads, strict=True):
        if p:
            shape = list(padded.shape)
            shape[axis] = p
            zeros = g.broadcast_to(g.constant(0.0), tuple(shape))
            padded = g.concat([zeros, padded, zeros], axis=axis)
    outs = [
        (n + 2 * p - d * (t - 1) - 1) // s + 1
        for n, p, d, t, s in zip(x.shape[2:], pads, dilations, taps, strides, strict=True)
    ]
    if min(outs) < 1:
        raise Unsupported("unfold with a kernel larger than the padded input")
    windows = [
        padded[:, :, i * dilations[0] : i * dilations[0] + (outs[0] - 1) * strides[0] + 1 : strides[0],
               j * dilations[1] : j * dilations[1] + (outs[1] - 1) * strides[1] + 1 : strides[1]]
        for i in range(taps[0])
        for j in range(taps[1])
    ]  # fmt: skip
    stacked = g.stack(windows, axis=2)  # [N, C, kh * kw, oh, ow]
    return g.reshape(stacked, (x.shape[0], x.shape[1] * taps[0] * taps[1], outs[0] * outs[1]))


def _pixel_shuffle(g: Graph, x: Any, upscale_factor: int) -> Any:
    """``F.pixel_shuffle``: ``[*, C*r*r, H, W] -> [*, C, H*r, W*r]``, a reshape, a transpose and
    a reshape."""
    x = _float(x)
    r = int(upscale_factor)
    *lead, channels, height, width = x.shape
    if not isinstance(channels, int) or channels % (r * r):
        raise Unsupported("pixel_shuffle of a channel count not divisible by the factor squared")
    split = g.reshape(x, (*lead, channels // (r * r), r, r, height, width))
    n = len(lead)
    moved = g.transpose(split, (*range(n), n, n + 3, n + 1, n + 4, n + 2))
    return g.reshape(moved, (*lead, channels // (r * r), height * r, width * r))


def _pixel_unshuffle(g: Graph, x: Any, downscale_factor: int) -> Any:
    """``F.pixel_unshuffle``: ``[*, C, H*r, W*r] -> [*, C*r*r, H, W]`` (the inverse)."""
    x = _float(x)
    r = int(downscale_factor)
    *lead, channels, height, width = x.shape
    if not (isinstance(height, int) and isinstance(width, int)) or height % r or width % r:
        raise Unsupported("pixel_unshuffle of sizes not divisible by the factor")
    split = g.reshape(x, (*lead, channels, height // r, r, width // r, r))
    n = len(lead)
    moved = g.transpose(split, (*range(n), n, n + 2, n + 4, n + 1, n + 3))
    return g.reshape(moved, (*lead, channels * r * r, height // r, width // r))


def _group_norm(g: Graph, x: Any, num_groups: int, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
    """``F.group_norm``: each sample's channels in ``num_groups`` groups, each group normalised
    over its channels and spatial entries (biased variance), then a per-channel scale and shift."""
    x = _float(x)
    if x.ndim < 2:
        raise Unsupported("group_norm of a tensor without channels")
    batch, channels, *spatial = x.shape
    groups = int(num_groups)
    if not all(isinstance(d, int) for d in (channels, *spatial)) or channels % groups:
        raise Unsupported("group_norm with dynamic channels or spatial sizes, or channels not divisible by groups")
    flat = g.reshape(x, (batch, groups, -1))
    normed = g.reshape(g.layer_norm(flat, 1.0, None, eps=float(eps)), tuple(x.shape))
    per_channel = (channels, *(1,) * len(spatial))
    if weight is not None:
        normed = normed * g.reshape(_float(weight), per_channel)
    if bias is not None:
        normed = normed + g.reshape(_float(bias), per_channel)
    return normed


def _instance_norm(
    g: Graph,
    x: Any,
    running_mean: Any = None,
    running_var: Any = None,
    weight: Any = None,
    bias: Any = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Any:
    """``F.instance_norm`` with the input's own statistics (``nn.InstanceNorm*d`` without
    running statistics): a group norm with one channel per group."""
    if running_mean is not None or running_var is not None or not use_input_stats:
        raise Unsupported("instance_norm with running statistics")
    channels = _float(x).shape[1]
    if not isinstance(channels, int):
        raise Unsupported("instance_norm of a dynamic channel count")
    return _group_norm(g, x, channels, weight, bias, eps)


def _cosine_similarity(g: Graph, a: Any, b: Any, dim: int = 1, eps: float = 1e-8) -> Any:
    """``F.cosine_similarity``: each side divided by its norm (at least ``eps``), then summed
    products, as torch computes it."""
    a, b = _promoted(g, _value(g, a), _value(g, b))
    unit_a = a / g.maximum(g.sqrt(g.sum(a * a, axis=dim, keepdims=True)), eps)
    unit_b = b / g.maximum(g.sqrt(g.sum(b * b, axis=dim, keepdims=True)), eps)
    return g.sum(unit_a * unit_b, axis=dim)


def _glu(g: Graph, x: Any, dim: int = -1) -> Any:
    return g.glu(_float(x), dim)


def _one_hot(g: Graph, ids: Any, num_classes: int = -1) -> Any:
    """``F.one_hot`` (int64, as torch's); the class count must be given (it is data otherwise)."""
    if num_classes < 0:
        raise Unsupported("one_hot without num_classes (the count would be read from the data)")
    return _class_matches(g, _float(ids), num_classes).astype("int64")


def _class_matches(g: Graph, ids: Value, classes: int) -> Value:
    """``ids[..., None] == arange(classes)``: a one-hot by comparison, which reads no memory with
    the ids (so they may be computed, and one outside the classes matches none)."""
    return g.equal(g.expand_dims(ids, -1), g.constant(np.arange(classes, dtype=np.dtype(ids.dtype))))


_ACTIVATIONS: dict[Any, Callable[..., Any]] = {  # rlx.ops.activations, torch's names and arguments
    F.logsigmoid: lambda g, x: g.log_sigmoid(_float(x)),
    F.leaky_relu: lambda g, x, negative_slope=0.01, inplace=False: g.leaky_relu(_float(x), negative_slope),
    F.elu: lambda g, x, alpha=1.0, inplace=False: g.elu(_float(x), alpha),
    F.relu6: lambda g, x, inplace=False: g.relu6(_float(x)),
    F.hardtanh: lambda g, x, min_val=-1.0, max_val=1.0, inplace=False: g.hard_tanh(_float(x), min_val, max_val),
    F.mish: lambda g, x, inplace=False: g.mish(_float(x)),
    F.hardswish: lambda g, x, inplace=False: g.hard_swish(_float(x)),
    F.hardsigmoid: lambda g, x, inplace=False: g.hard_sigmoid(_float(x)),
}


def _sdpa(
    g: Graph,
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """torch's SDPA ([B, H, S, D]): the fixed-mask kernels where they apply, else mods."""
    q, k, v = _float(q), _float(k), _float(v)
    if dropout_p:
        raise Unsupported("attention dropout")
    if q.ndim != 4:
        raise Unsupported(f"attention on rank-{q.ndim} tensors")
    if k.shape[1] != q.shape[1] and not enable_gqa:
        raise Unsupported("k and v with fewer heads than q without enable_gqa")
    default_scale = scale is None or math.isclose(scale, 1.0 / math.sqrt(float(q.shape[3])), rel_tol=1e-12)
    if attn_mask is None and default_scale and k.shape[1] == q.shape[1] and q.shape[3] == v.shape[3]:
        if not is_causal:
            return g.attention(q, k, v, layout=Layout.BHSD)
        if q.shape[2] == k.shape[2]:  # top-left and bottom-right alignments agree
            return g.attention(q, k, v, mask=MaskKind.CAUSAL, layout=Layout.BHSD)
    score_mod: Callable[..., Any] | None = None
    mask_mod: Callable[..., Any] | None = None
    if attn_mask is not None:
        mask = _value(g, attn_mask)
        if not isinstance(mask, Value):
            raise Unsupported("a number as attn_mask")
        full = g.reshape(mask, (1,) * (4 - mask.ndim) + tuple(mask.shape))

        def at(b: Any, h: Any, i: Any, j: Any) -> Any:
            return full[tuple(0 if full.shape[a] == 1 else ix for a, ix in enumerate((b, h, i, j)))]

        if np.dtype(mask.dtype) == np.bool_:
            mask_mod = at
        else:

            def add_mask(score: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
                return score + at(b, h, i, j)

            score_mod = add_mask
    if is_causal:
        mask_mod = mods.causal if mask_mod is None else mods.and_(mask_mod, mods.causal)
    return g.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=scale, layout=Layout.BHSD)


_ELEMENTWISE = [
    *("exp", "log", "sqrt", "rsqrt", "abs", "tanh", "sigmoid", "relu", "sin", "cos", "log1p", "expm1", "erf"),
    *("floor", "ceil", "trunc", "round"),
    *("tan", "atan", "asin", "acos", "sinh", "cosh", "asinh", "acosh", "atanh", "log2", "log10", "exp2"),
]
# torch's NumPy-style names of the same functions (``torch.arcsin``, ``x.arctan2(y)``)
_ARC_ALIASES = {f"arc{name[1:]}": name for name in ("asin", "acos", "atan", "asinh", "acosh", "atanh")}


def _truth(kind: str) -> Callable[..., Any]:
    """``torch.any`` / ``torch.all`` (and the methods): ``g.any`` / ``g.all`` over ``dim``."""

    def handler(g: Graph, x: Any, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
        check_kwargs(kwargs, out=None)
        return getattr(g, kind)(_float(x), _axis_args(dim), keepdim)

    return handler


def _prod(g: Graph, x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Any:
    """``torch.prod`` of float values: ``g.prod`` (an int product stays in eager torch)."""
    if dtype not in (None, torch.float32):
        raise Unsupported(f"prod with dtype {dtype}")
    return g.prod(_float(x), _axis_args(dim), keepdim)


def _bitwise(op: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """``& | ^ << >>``: logical on bools, bit by bit on ints (the Value operators decide, as
    torch's do); a Python int beside a tensor is a constant of its dtype."""

    def handler(g: Graph, a: Any, b: Any, **kwargs: Any) -> Any:
        check_kwargs(kwargs, out=None)
        if not isinstance(a, Value) and not isinstance(b, Value):
            raise Unsupported(f"{op.__name__} of two constants")
        return op(*(_value(g, x) if isinstance(x, torch.Tensor) else x for x in (a, b)))

    return handler


def _invert(g: Graph, x: Any) -> Any:
    """``~``: logical on bools, bit by bit on ints."""
    return ~_float(x)


def _tensordot(g: Graph, a: Any, b: Any, dims: Any = 2, **kwargs: Any) -> Any:
    """``torch.tensordot``: ``g.tensordot`` (dims an int or two lists of axes)."""
    check_kwargs(kwargs, out=None)
    if isinstance(dims, torch.Tensor):
        raise Unsupported("tensordot with dims given as a tensor")
    return g.tensordot(_float(a), _float(b), dims)


FUNCTIONS: dict[Any, Callable[..., Any]] = {
    operator.add: _binary("add"),
    operator.sub: _binary("sub"),
    operator.mul: _binary("mul"),
    operator.truediv: _binary("div"),
    operator.neg: lambda g, x: -_float(x),
    operator.pos: lambda g, x: x,
    operator.matmul: _matmul,
    operator.floordiv: _floordiv,
    operator.mod: _remainder,
    operator.pow: _pow,
    operator.getitem: _getitem,
    operator.lt: _compare("less"),
    operator.le: _compare("less_equal"),
    operator.gt: _compare("greater"),
    operator.ge: _compare("greater_equal"),
    operator.invert: _invert,
    **{op: _bitwise(op) for op in (operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift)},
    torch.bitwise_and: _bitwise(operator.and_),
    torch.bitwise_or: _bitwise(operator.or_),
    torch.bitwise_xor: _bitwise(operator.xor),
    torch.bitwise_left_shift: _bitwise(operator.lshift),
    torch.bitwise_right_shift: _bitwise(operator.rshift),
    torch.bitwise_not: _invert,
    torch.add: _binary("add"),
    torch.sub: _binary("sub"),
    torch.mul: _binary("mul"),
    torch.div: _divide,
    torch.divide: _divide,
    torch.floor_divide: _floordiv,
    torch.remainder: _remainder,
    torch.fmod: lambda g, a, b: g.fmod(*_promoted(g, _value(g, a), _value(g, b))),
    torch.rsub: _rsub,
    torch.neg: lambda g, x: -_float(x),
    torch.matmul: _matmul,
    torch.bmm: _matmul,
    torch.mm: _matmul,
    torch.pow: _pow,
    torch.maximum: _compare("maximum"),
    torch.minimum: _compare("minimum"),
    operator.eq: _compare("equal"),
    operator.ne: _compare("not_equal"),
    **{getattr(torch, name): _compare(op) for name, op in _COMPARISONS.items()},
    torch.where: _where,
    torch.cat: _cat,
    torch.concat: _cat,
    torch.stack: _stack,
    torch.split: _split,
    torch.chunk: _chunk,
    torch.tensor_split: _tensor_split,
    torch.reshape: _reshape,
    torch.permute: _permute,
    torch.transpose: _transpose,
    torch.t: _t,
    torch.unsqueeze: _unsqueeze,
    torch.squeeze: _squeeze,
    torch.flatten: _flatten,
    torch.sum: _reduce("sum"),
    torch.mean: _reduce("mean"),
    torch.amax: _reduce_extremum("max"),
    torch.amin: _reduce_extremum("min"),
    torch.max: _extremum("max"),
    torch.min: _extremum("min"),
    torch.argmax: lambda g, x, dim=None, keepdim=False: g.argmax(_float(x), axis=dim, keepdims=keepdim),
    torch.argmin: lambda g, x, dim=None, keepdim=False: g.argmin(_float(x), axis=dim, keepdims=keepdim),
    torch.softmax: _softmax("softmax"),
    torch.log_softmax: _softmax("log_softmax"),
    torch.clamp: _clamp,
    torch.clip: _clamp,
    torch.masked_fill: _masked_fill,
    torch.nn.functional.linear: _linear,
    torch._C._nn.linear: _linear,
    F.layer_norm: _layer_norm,
    F.group_norm: _group_norm,
    F.multi_head_attention_forward: _multi_head_attention,
    F.instance_norm: _instance_norm,
    F.pixel_shuffle: _pixel_shuffle,
    F.unfold: _unfold,
    F.pixel_unshuffle: _pixel_unshuffle,
    torch.flip: _flip,
    torch.var: _variance(root=False),
    torch.std: _variance(root=True),
    F.gelu: _gelu,
    torch._C._nn.gelu: _gelu,
    F.silu: _unary("silu"),
    F.relu: _unary("relu"),
    F.softplus: lambda g, x, beta=1.0, threshold=20.0: (
        g.softplus(_float(x)) if beta == 1.0 else g.softplus(_float(x) * beta) / beta
    ),
    F.softmax: _softmax("softmax"),
    F.log_softmax: _softmax("log_softmax"),
    F.dropout: _dropout,
    F.embedding: _embedding,
    F.cross_entropy: _cross_entropy,
    F.nll_loss: _nll_loss,
    F.mse_loss: _pointwise_loss("mse"),
    F.l1_loss: _pointwise_loss("l1"),
    F.smooth_l1_loss: _pointwise_loss("smooth_l1"),
    F.huber_loss: lambda g, x, target, reduction="mean", delta=1.0, weight=None: _pointwise_loss("huber")(
        g, x, target, reduction=reduction, delta=delta, weight=weight
    ),
    F.binary_cross_entropy_with_logits: _binary_cross_entropy(True),
    F.binary_cross_entropy: _binary_cross_entropy(False),
    F.kl_div: _kl_div,
    torch.logsumexp: _logsumexp,
    F.glu: _glu,
    torch.tril: _triangle(lower=True),
    torch.triu: _triangle(lower=False),
    torch.roll: _roll,
    F.interpolate: _interpolate,
    F.cosine_similarity: _cosine_similarity,
    F.one_hot: _one_hot,
    torch.square: lambda g, x: _float(x) * x,
    **_ACTIVATIONS,
    F.scaled_dot_product_attention: _sdpa,
    torch._C._nn.scaled_dot_product_attention: _sdpa,
    **{getattr(torch, name): _unary(name) for name in _ELEMENTWISE},
    **{getattr(torch, alias): _unary(name) for alias, name in _ARC_ALIASES.items()},
    torch.atan2: _atan2,
    torch.arctan2: _atan2,
    torch.nn.functional.sigmoid: _unary("sigmoid"),
    torch.unbind: _unbind,
    torch.einsum: _einsum,
    torch.gather: _gather,
    "setitem": _setitem,  # rlx.torch.dynamo's translation of operator.setitem
    torch.clone: lambda g, x, memory_format=None: _float(x),
    torch.detach: lambda g, x: g.stop_gradient(_float(x)),
    torch.baddbmm: _baddbmm,
    torch.cumsum: _running("cumsum"),
    torch.isnan: lambda g, x: g.isnan(_float(x)),
    torch.isinf: lambda g, x: g.isinf(_float(x)),
    torch.isfinite: lambda g, x: g.isfinite(_float(x)),
    torch.any: _truth("any"),
    torch.all: _truth("all"),
    torch.prod: _prod,
    torch.tensordot: _tensordot,
    torch.cumprod: _running("cumprod"),
    **{getattr(F, f"max_pool{n}d"): _max_pool for n in (1, 2, 3)},
    **{getattr(F, f"avg_pool{n}d"): _avg_pool for n in (1, 2, 3)},
    **{getattr(F, f"adaptive_avg_pool{n}d"): _adaptive("avg") for n in (1, 2, 3)},
    **{getattr(F, f"adaptive_max_pool{n}d"): _adaptive("max") for n in (1, 2, 3)},
    **{getattr(torch, f"max_pool{n}d"): _max_pool for n in (1, 2, 3)},
    **{getattr(torch, f"avg_pool{n}d"): _avg_pool for n in (1,)},
    F.conv1d: _conv,
    F.conv2d: _conv,
    F.conv3d: _conv,
    F.conv_transpose1d: _conv_transpose,
    F.conv_transpose2d: _conv_transpose,
    F.conv_transpose3d: _conv_transpose,
    torch.index_select: _index_select,
    torch.Size: lambda g, dims=(): tuple(dims),  # a shape with dynamic sizes: a tuple of them
    torch.addmm: _addmm,
    F.pad: _pad,
    torch._C._nn.pad: _pad,
    torch.repeat_interleave: _repeat_interleave,
    torch.zeros: _factory(0.0),
    torch.ones: _factory(1.0),
    torch.empty: _factory(0.0),
    torch.full: _factory(None),
    torch.zeros_like: _like(0.0),
    torch.ones_like: _like(1.0),
    torch.full_like: _like(None),
    getattr: _getattr,
    F.normalize: _normalize,
    torch.nn.functional.tanh: _unary("tanh"),
}
for _rms in (getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)):
    if _rms is not None:
        FUNCTIONS[_rms] = _rms_norm
FUNCTIONS[torch.layer_norm] = _layer_norm

METHODS: dict[str, Callable[..., Any]] = {
    "add": _binary("add"),
    "sub": _binary("sub"),
    "mul": _binary("mul"),
    "div": _divide,
    "divide": _divide,
    "floor_divide": _floordiv,
    "remainder": _remainder,
    "fmod": lambda g, a, b: g.fmod(*_promoted(g, _value(g, a), _value(g, b))),
    "neg": lambda g, x: -_float(x),
    "matmul": _matmul,
    "pow": _pow,
    "view": _view,
    "reshape": _reshape,
    "permute": _permute,
    "transpose": _transpose,
    "t": _t,
    "contiguous": _contiguous,
    "clone": lambda g, x, memory_format=None: _float(x),  # values are never updated in place
    "detach": lambda g, x: g.stop_gradient(_float(x)),
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
    "flatten": _flatten,
    "expand": _expand,
    "size": _size,
    "split": _split,
    "chunk": _chunk,
    "tensor_split": _tensor_split,
    "sum": _reduce("sum"),
    "mean": _reduce("mean"),
    "amax": _reduce_extremum("max"),
    "amin": _reduce_extremum("min"),
    "max": _extremum("max"),
    "min": _extremum("min"),
    "argmax": lambda g, x, dim=None, keepdim=False: g.argmax(_float(x), axis=dim, keepdims=keepdim),
    "argmin": lambda g, x, dim=None, keepdim=False: g.argmin(_float(x), axis=dim, keepdims=keepdim),
    "softmax": _softmax("softmax"),
    "log_softmax": _softmax("log_softmax"),
    "masked_fill": _masked_fill,
    "clamp": _clamp,
    "clip": _clamp,
    "unbind": _unbind,
    "gather": _gather,
    "cumsum": _running("cumsum"),
    "isnan": lambda g, x: g.isnan(_float(x)),
    "isinf": lambda g, x: g.isinf(_float(x)),
    "isfinite": lambda g, x: g.isfinite(_float(x)),
    "any": _truth("any"),
    "all": _truth("all"),
    "prod": _prod,
    "cumprod": _running("cumprod"),
    "logsumexp": _logsumexp,
    "tril": _triangle(lower=True),
    "triu": _triangle(lower=False),
    "roll": _roll,
    "flip": _flip,
    "unfold": _tensor_unfold,
    "var": _variance(root=False),
    "std": _variance(root=True),
    "square": lambda g, x: _float(x) * x,
    "baddbmm": _baddbmm,
    **{name: _compare(op) for name, op in _COMPARISONS.items()},
    "index_select": _index_select,
    "item": _item,
    "new_ones": _new(1.0),
    "new_zeros": _new(0.0),
    "new_empty": _new(0.0),
    "new_full": _new(None),
    "repeat_interleave": _repeat_interleave,
    "view_as": lambda g, x, other: g.reshape(_float(x), _float(other).shape),
    "reshape_as": lambda g, x, other: g.reshape(_float(x), _float(other).shape),
    "expand_as": lambda g, x, other: g.broadcast_to(_float(x), _float(other).shape),
    "to": _to,
    "type_as": _type_as,
    "float": _method_cast(torch.float32),
    "int": _method_cast(torch.int32),
    "long": _method_cast(torch.int64),
    "bool": _method_cast(torch.bool),
    **{name: _unary(name) for name in _ELEMENTWISE},
    **{alias: _unary(name) for alias, name in _ARC_ALIASES.items()},
    "atan2": _atan2,
    "arctan2": _atan2,
}
