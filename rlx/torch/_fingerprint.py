"""What a traced mod reads besides its arguments, as a key: ``flex_attention`` reuses a trace.

Tracing a mod builds a graph (and printing it made the compile cache's key): 0.5-0.7 ms a
call, more than the kernels of a small call (B16 H4 S64 D16: forward and backward 0.45 ms).
A trace is a function of the mods' code and of everything they read: their closure cells,
default arguments and the globals they name (and, through those, the functions they call).
Two calls whose mods read the same things trace to the same graph, so the second reuses the
first's trace.

What "the same" means follows what a trace keeps: numbers, strings and 0-dim tensors become
constants of the graph, so they match by value; a tensor indexed by the symbols becomes a
graph input read at call time, so it matches by identity (and shape and dtype), and writing
into it in place is seen by the next call, as it would be by a new trace; a NumPy array
becomes a constant, so it matches by its bytes; rlx's, torch's and the standard math modules
and their functions match by name. Anything else a mod reads (an object's attribute, a bound
method's instance, a module or class of the program's own, whose attributes may change, a
container too large to compare) has no key: such a call traces again, as every call did before.
"""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

_DEPTH = 6  # functions calling functions: deeper than this, no key
_MAX_ITEMS = 64  # a container of more items has no key
_MAX_ARRAY_BYTES = 1 << 20  # nor an array of more bytes (comparing it would cost what a trace does)
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_LIBRARIES = ("rlx", "torch", "math", "numpy", "operator", "functools", "builtins")
_BUILTINS = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
)


class _Same:
    """A tensor in a key, compared by identity through a weak reference: a kept key does not
    keep the tensor's memory alive, and once the tensor is gone the key matches nothing (not
    another tensor that took its id)."""

    __slots__ = ("hash", "ref")

    def __init__(self, value: torch.Tensor) -> None:
        self.ref = weakref.ref(value)
        self.hash = id(value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same):
            return False
        mine = self.ref()
        return mine is not None and mine is other.ref()

    def __hash__(self) -> int:
        return self.hash


class _NoKey(Exception):
    """Raised inside :func:`mod_key` for something whose key cannot be pinned down."""


def mod_key(mod: object) -> Hashable | None:
    """A hashable key of what tracing ``mod`` depends on, or None where it has none."""
    try:
        return _key(mod, _DEPTH, set())
    except _NoKey:
        return None


def _key(value: Any, depth: int, seen: set[int]) -> Hashable:
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:  # read by .item() while tracing: a constant of the graph
            return ("scalar tensor", value.dtype, value.item())
        return ("tensor", _Same(value), tuple(value.shape), value.dtype)
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.nbytes > _MAX_ARRAY_BYTES:
            raise _NoKey
        return ("array", value.shape, value.dtype.str, value.tobytes())
    if isinstance(value, types.ModuleType):  # a library's attributes are its own; a user module's may change
        if not _library_name(value.__name__):
            raise _NoKey
        return ("module", value.__name__)
    if isinstance(value, type):  # likewise a class's attributes
        if not _library_name(value.__module__):
            raise _NoKey
        return ("type", value.__module__, value.__qualname__)
    if isinstance(value, _BUILTINS):  # C functions and methods: fixed objects, unless bound to an instance
        bound = getattr(value, "__self__", None)
        if bound is not None and not isinstance(bound, (types.ModuleType, type)):
            raise _NoKey
        return ("builtin", id(value))
    if isinstance(value, (tuple, list)):
        if len(value) > _MAX_ITEMS:
            raise _NoKey
        return (type(value), tuple(_key(item, depth, seen) for item in value))
    if isinstance(value, dict):
        if len(value) > _MAX_ITEMS:
            raise _NoKey
        return ("dict", tuple((_key(k, depth, seen), _key(v, depth, seen)) for k, v in value.items()))
    if isinstance(value, functools.partial):
        keywords = tuple(sorted((name, _key(v, depth, seen)) for name, v in value.keywords.items()))
        return ("partial", _key(value.func, depth, seen), _key(value.args, depth, seen), keywords)
    if isinstance(value, types.FunctionType):
        if _is_library(value):  # rlx's and torch's own functions, as their modules define them
            return ("library", value.__module__, value.__qualname__)
        return _function_key(value, depth, seen)
    if _is_torch_callable(value):
        return ("torch", id(value))
    raise _NoKey


def _function_key(fn: types.FunctionType, depth: int, seen: set[int]) -> Hashable:
    """A function's code with what it reads: closure cells, defaults and the globals it names."""
    if id(fn) in seen:  # recursion: the function is already being keyed
        return ("recursive", id(fn.__code__))
    if depth == 0:
        raise _NoKey
    seen = seen | {id(fn)}
    code = fn.__code__
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_key(cell.cell_contents, depth - 1, seen))
        except ValueError:  # an empty cell (a variable not yet assigned)
            cells.append(("empty",))
    names = []
    for name in _names(code):  # global names (and attribute names, harmlessly) the code reads
        if name in fn.__globals__:
            names.append((name, _key(fn.__globals__[name], depth - 1, seen)))
    defaults = _key(fn.__defaults__ or (), depth - 1, seen)
    keyword_defaults = _key(fn.__kwdefaults__ or {}, depth - 1, seen)
    return ("function", code, tuple(cells), tuple(names), defaults, keyword_defaults)


def _names(code: types.CodeType) -> list[str]:
    """The names ``code`` reads, with those of the functions and comprehensions defined inside it
    (their code objects are constants of ``code``; their globals are the same)."""
    names = list(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names += _names(constant)
    return names


def _library_name(module: str | None) -> bool:
    """Whether ``module`` is part of a library whose functions and attributes stay as imported."""
    return (module or "").split(".")[0] in _LIBRARIES


def _is_library(fn: types.FunctionType) -> bool:
    """A function rlx or torch defines in a module, under its own name there (``rlx.mods.tanh``):
    the library's code and globals. Not what their factories return (``rlx.mods.softcap(30.0)``
    is keyed by its cells like any closure)."""
    if not _library_name(fn.__module__):
        return False
    return getattr(sys.modules.get(fn.__module__), fn.__name__, None) is fn


def _is_torch_callable(value: object) -> bool:
    """torch's functions and methods (``torch.where``, ``torch.Tensor.tanh``): fixed objects."""
    module = getattr(value, "__module__", None) or ""
    return callable(value) and (module == "torch" or module.startswith(("torch.", "torch._")))
