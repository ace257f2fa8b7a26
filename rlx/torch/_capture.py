"""Mods written for torch's flex_attention, traced into rlx regions: ``torch.where``, ``torch.tanh``,
comparisons and captured tensors indexed by the symbols become region steps and graph inputs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

import rlx.mods as _mods
from rlx.errors import RlxTypeError
from rlx.ir.graph import Graph, Value
from rlx.torch._tensors import _check_tensor, _rlx_dtype


class _Capture:
    """The torch tensors one trace captured, each a graph input named ``c0``, ``c1``, ..."""

    def __init__(self, graph: Graph, declared: dict[int, tuple[int | str, ...]] | None = None) -> None:
        self.graph = graph
        self.tensors: list[torch.Tensor] = []
        self.values: list[Value] = []
        self.declared = declared or {}  # id(tensor) -> the shape to declare (symbolic sequence dims)

    def value(self, tensor: torch.Tensor) -> Value:
        for known, value in zip(self.tensors, self.values, strict=True):
            if known is tensor:
                return value
        _check_tensor(tensor, f"a tensor captured by a mod (shape {tuple(tensor.shape)})", kinds="any")
        shape = self.declared.get(id(tensor), tuple(tensor.shape))
        value = self.graph.input(f"c{len(self.tensors)}", shape, dtype=_rlx_dtype(tensor))
        self.tensors.append(tensor)
        self.values.append(value)
        return value


_capturing = threading.local()

_TORCH_TO_RLX: dict[Any, Callable[..., Any]] = {
    torch.where: _mods.where,
    torch.tanh: _mods.tanh,
    torch.exp: _mods.exp,
    torch.log: _mods.log,
    torch.abs: _mods.abs,
    torch.sigmoid: _mods.sigmoid,
    torch.sqrt: _mods.sqrt,
    torch.minimum: _mods.minimum,
    torch.maximum: _mods.maximum,
    torch.Tensor.tanh: _mods.tanh,
    torch.Tensor.exp: _mods.exp,
    torch.Tensor.abs: _mods.abs,
    torch.Tensor.sigmoid: _mods.sigmoid,
    torch.Tensor.log: _mods.log,
    torch.Tensor.sqrt: _mods.sqrt,
    torch.pow: _mods.power,
    torch.Tensor.pow: _mods.power,
    torch.Tensor.__pow__: _mods.power,
    torch.Tensor.__rpow__: lambda exponent, base: _mods.power(base, exponent),
}
_BINARY = {
    torch.Tensor.add: "__add__",
    torch.Tensor.__add__: "__add__",
    torch.Tensor.__radd__: "__radd__",
    torch.Tensor.sub: "__sub__",
    torch.Tensor.__sub__: "__sub__",
    torch.Tensor.__rsub__: "__rsub__",
    torch.Tensor.mul: "__mul__",
    torch.Tensor.__mul__: "__mul__",
    torch.Tensor.__rmul__: "__rmul__",
    torch.Tensor.div: "__truediv__",
    torch.Tensor.__truediv__: "__truediv__",
    torch.Tensor.__rtruediv__: "__rtruediv__",
    torch.Tensor.__eq__: "__eq__",
    torch.Tensor.__ne__: "__ne__",
    torch.Tensor.__lt__: "__lt__",
    torch.Tensor.__le__: "__le__",
    torch.Tensor.__gt__: "__gt__",
    torch.Tensor.__ge__: "__ge__",
    torch.Tensor.__and__: "__and__",
    torch.Tensor.__or__: "__or__",
}


def _clamp(x: Any, min: Any = None, max: Any = None) -> Any:
    if min is not None:
        x = _mods.maximum(x, min)
    if max is not None:
        x = _mods.minimum(x, max)
    return x


def _torch_function(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A torch function called on symbols inside a traced mod, as rlx region steps."""
    if func is torch.Tensor.__getitem__:
        tensor, index = args
        capture: _Capture | None = getattr(_capturing, "current", None)
        if capture is None:
            raise RlxTypeError("a torch tensor indexed by symbols outside rlx.torch's tracing")
        return _mods.read(capture.value(tensor), index)
    if func in _TORCH_TO_RLX:
        return _TORCH_TO_RLX[func](*args, **kwargs)
    if func in (torch.clamp, torch.Tensor.clamp):
        return _clamp(*args, **kwargs)
    if func in _BINARY:
        tensor, other = args
        if isinstance(tensor, torch.Tensor):
            if tensor.ndim != 0:
                raise RlxTypeError(
                    "a mod combined a whole tensor with a symbol; index captured tensors by the symbols "
                    "(bias[b, h, q_idx, kv_idx])"
                )
            tensor = tensor.item()
        if isinstance(other, torch.Tensor) and other.ndim == 0:
            other = other.item()
        name = _BINARY[func]
        if isinstance(tensor, _mods.Sym):
            return getattr(tensor, name)(other)
        swapped = {"__add__": "__radd__", "__mul__": "__rmul__", "__sub__": "__rsub__", "__truediv__": "__rtruediv__"}
        mirrored = {"__lt__": "__gt__", "__le__": "__ge__", "__gt__": "__lt__", "__ge__": "__le__"}
        name = swapped.get(name, mirrored.get(name, name))
        return getattr(other, name)(tensor)
    name = getattr(func, "__name__", repr(func))
    raise RlxTypeError(
        f"torch.{name} cannot be traced inside an attention mod; use +, -, *, /, comparisons, &, |, ~, "
        "torch.where, torch.tanh, torch.exp, torch.log, torch.abs, torch.sigmoid, torch.sqrt, torch.pow, "
        "torch.minimum, torch.maximum, torch.clamp, and captured tensors indexed by the symbols"
    )


_mods.TORCH_HANDLER = _torch_function
