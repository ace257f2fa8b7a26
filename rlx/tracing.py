"""``rlx.jit``, ``rlx.grad(fn)`` and ``rlx.value_and_grad``: models written as plain Python
functions, as in JAX.

``rlx.jit(fn)`` traces ``fn`` once per set of argument shapes and dtypes: each array among its
arguments (nested in dicts, lists and tuples, as a model's parameters are) becomes a graph input
named by its place (``params.w1``), ``fn`` runs on those values (operators, array methods, and
``rlx.exp``, ``rlx.softmax``, ... which build nodes in the values' graph), and what it returns
(a value, or dicts, lists and tuples of them) become the graph's outputs. The graph is compiled
with :func:`rlx.compile` and cached: a later call with arrays of the same shapes and dtypes only
runs it. Python numbers, strings and other non-array arguments are baked into the graph and are
part of the cache key (JAX's ``static_argnums``, for every such argument).

``rlx.grad(fn, argnums=0)`` and ``rlx.value_and_grad(fn, argnums=0, has_aux=False)`` return
functions that differentiate ``fn``'s scalar result with :func:`rlx.grad` with respect to the
arguments ``argnums`` names (the arrays nested in them). Called on values, inside a traced
function, they build the gradient into that graph; called on arrays, they are jitted.
"""

from __future__ import annotations

import functools
import inspect
import keyword
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.graph import Graph, Value

# ----------------------------------------------------------------------------- trees


@dataclass(frozen=True)
class _Tree:
    """The structure of a nest of dicts, lists and tuples: ``kind`` and its children's trees
    (``None`` children: a leaf)."""

    kind: str  # "leaf", "dict", "list", "tuple"
    keys: tuple[Any, ...] = ()
    children: tuple[_Tree, ...] = ()


_LEAF = _Tree("leaf")


def _flatten(obj: object, path: str, leaves: list[tuple[str, object]]) -> _Tree:
    """Leaves of ``obj`` in order (dict keys sorted, as JAX orders them), with their paths."""
    if isinstance(obj, dict):
        keys = tuple(sorted(obj, key=repr))
        children = tuple(_flatten(obj[key], f"{path}.{key}", leaves) for key in keys)
        return _Tree("dict", keys, children)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        kind = "list" if isinstance(obj, list) else "tuple"
        children = tuple(_flatten(item, f"{path}.{i}", leaves) for i, item in enumerate(obj))
        return _Tree(kind, tuple(range(len(obj))), children)
    leaves.append((path, obj))
    return _LEAF


def _unflatten(tree: _Tree, leaves: Any) -> Any:
    """``tree`` rebuilt with leaves from the iterator ``leaves``."""
    if tree.kind == "leaf":
        return next(leaves)
    built = [_unflatten(child, leaves) for child in tree.children]
    if tree.kind == "dict":
        return dict(zip(tree.keys, built, strict=True))
    return built if tree.kind == "list" else tuple(built)


def _is_array(leaf: object) -> bool:
    """Arrays (and objects NumPy or DLPack reads as arrays) are traced; numbers and the rest are static."""
    if isinstance(leaf, Value):
        return False
    return isinstance(leaf, (np.ndarray, np.generic)) or hasattr(leaf, "__array__") or hasattr(leaf, "__dlpack__")


# ----------------------------------------------------------------------------- jit


@dataclass(frozen=True)
class _Traced:
    executable: Any
    output_tree: _Tree
    output_names: tuple[str | None, ...]  # None: a leaf that is not a value (returned as is)
    constants: tuple[object, ...]


@dataclass(frozen=True)
class _Static:
    """An argument named static (``static_argnums``/``static_argnames``): one leaf, passed to the
    function as it is and part of the cache key by its type, hash and equality (``2`` and ``2.0``
    trace apart: the function may tell them apart)."""

    value: object

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and type(other.value) is type(self.value) and other.value == self.value

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))


class Jitted:
    """``rlx.jit(fn)``: call it as ``fn``; see the module's docstring."""

    def __init__(
        self,
        fn: Callable[..., Any],
        passes: Sequence[str] | None = None,
        config: Any = None,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        what: str = "rlx.jit",
    ) -> None:
        if not callable(fn):
            raise RlxTypeError(f"{what}: expected a function, got {type(fn).__name__}")
        self._fn = fn
        self._passes = passes
        self._config = config
        self._signature = _signature_of(fn)
        self._static = _static_parameters(what, fn, self._signature, static_argnums, static_argnames)
        self._what = what
        self._cache: dict[Any, _Traced] = {}
        self._lock = threading.Lock()
        # Name and docstring only: fn's __dict__ may hold another Jitted's fields (functools.wraps
        # of a jitted function copies them), which must not replace this one's cache.
        functools.update_wrapper(self, fn, updated=())  # type: ignore[arg-type]

    @property
    def compile_count(self) -> int:
        """How many graphs were traced and compiled (one per set of shapes, dtypes and static arguments)."""
        return len(self._cache)

    def graph(self, *args: Any, **kwargs: Any) -> Graph:
        """The compiled graph for these arguments (``exe.graph``: after the pipeline)."""
        traced, _ = self._traced(*self._flattened(args, kwargs))
        if traced.executable is None:
            raise RlxValueError(f"rlx.jit: {_graph_name(self._fn)} returns no value of its graph: nothing was compiled")
        return traced.executable.graph  # type: ignore[no-any-return]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tree, leaves = self._flattened(args, kwargs)
        if any(isinstance(leaf, Value) for _, leaf in leaves):  # inside another trace: inlined, as JAX does
            return self._fn(*args, **kwargs)
        traced, arrays = self._traced(tree, leaves)
        results = traced.executable(**arrays) if traced.executable is not None else {}
        out = iter(results[name] if name is not None else constant for name, constant in _outputs(traced))
        return _unflatten(traced.output_tree, out)

    def _flattened(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Tree, list[tuple[str, object]]]:
        """The arguments by parameter name as a tree, and its leaves with their paths."""
        leaves: list[tuple[str, object]] = []
        arguments = _bind(self._signature, self._fn, args, kwargs)
        for name in self._static.intersection(arguments):
            if graph_of(self._what, arguments[name]) is not None:
                raise RlxTypeError(
                    f"{self._what}: argument {name} is static (static_argnums/static_argnames) but holds a "
                    "value of a graph: a static argument is a Python value, known when tracing"
                )
            arguments[name] = _Static(arguments[name])
        return _flatten(arguments, "", leaves), leaves

    def _traced(self, tree: _Tree, leaves: list[tuple[str, object]]) -> tuple[_Traced, dict[str, object]]:
        names = _input_names([path for path, _ in leaves])
        key_parts: list[object] = [tree]
        arrays: dict[str, object] = {}
        for name, (path, leaf) in zip(names, leaves, strict=True):
            if _is_array(leaf):
                array = _as_array(leaf)
                arrays[name] = array
                key_parts.append(("array", array.shape, array.dtype.str))
            else:
                key_parts.append(("static", type(leaf), _hashable(path, leaf)))
        key = tuple(key_parts)
        with self._lock:
            traced = self._cache.get(key)
            if traced is None:
                traced = self._trace(
                    tree, names, [arrays.get(name, leaf) for name, (_, leaf) in zip(names, leaves, strict=True)]
                )
                self._cache[key] = traced
        return traced, arrays

    def _trace(self, tree: _Tree, names: list[str], leaves: list[object]) -> _Traced:
        import rlx

        graph = Graph(_graph_name(self._fn))
        traced_leaves = [
            graph.input(name, leaf.shape, dtype=str(leaf.dtype))
            if isinstance(leaf, np.ndarray)
            else leaf.value
            if isinstance(leaf, _Static)
            else leaf
            for name, leaf in zip(names, leaves, strict=True)
        ]
        result = _call(self._signature, self._fn, _unflatten(tree, iter(traced_leaves)))
        out_leaves: list[tuple[str, object]] = []
        output_tree = _flatten(result, "out", out_leaves)
        output_names: list[str | None] = []
        constants: list[object] = []
        for i, (_, leaf) in enumerate(out_leaves):
            if isinstance(leaf, Value):
                if leaf.graph is not graph:
                    raise RlxValueError(f"rlx.jit: {_graph_name(self._fn)} returned a value of another graph")
                graph.output(**{f"out{i}": leaf})
            output_names.append(f"out{i}" if isinstance(leaf, Value) else None)
            constants.append(None if isinstance(leaf, Value) else leaf)
        executable = rlx.compile(graph, passes=self._passes, config=self._config) if graph.outputs else None
        return _Traced(executable, output_tree, tuple(output_names), tuple(constants))


def _as_array(leaf: object) -> np.ndarray:
    """An argument array as the graph takes it: float64 becomes float32, as JAX takes NumPy's
    default floats (rlx computes in float32); every other dtype is kept."""
    array = leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf)
    return array.astype(np.float32) if array.dtype == np.float64 else array


def _outputs(traced: _Traced) -> Any:
    return zip(traced.output_names, traced.constants, strict=True)


def _signature_of(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: positional only
        return None


def _bind(
    signature: inspect.Signature | None, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The arguments by parameter name (``*args`` a tuple, ``**kwargs`` a dict), as ``fn`` receives them."""
    if signature is None:
        return {"args": tuple(args), "kwargs": dict(kwargs)}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise RlxTypeError(f"rlx.jit: {_graph_name(fn)}: {error}") from None
    return dict(bound.arguments)


def _call(signature: inspect.Signature | None, fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    if signature is None:
        return fn(*arguments["args"], **arguments["kwargs"])
    bound = inspect.BoundArguments(signature, dict(arguments))  # type: ignore[arg-type]
    return fn(*bound.args, **bound.kwargs)


def _static_parameters(
    what: str,
    fn: Callable[..., Any],
    signature: inspect.Signature | None,
    static_argnums: int | Sequence[int],
    static_argnames: str | Sequence[str],
) -> frozenset[str]:
    """The names of the parameters ``static_argnums`` and ``static_argnames`` make static, as
    ``jax.jit`` reads them: a position counts from the end when negative, names and positions
    name the same parameters, and one that ``fn`` lacks is an error."""
    numbers = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    if any(isinstance(n, bool) or not isinstance(n, int) for n in numbers):
        raise RlxTypeError(f"{what}: static_argnums must be an int or a sequence of ints, got {static_argnums!r}")
    if any(not isinstance(n, str) for n in names):
        raise RlxTypeError(f"{what}: static_argnames must be a str or a sequence of strs, got {static_argnames!r}")
    if not numbers and not names:
        return frozenset()
    if signature is None:
        raise RlxTypeError(f"{what}: {_graph_name(fn)} has no signature to read static arguments from")
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in signature.parameters.values() if p.kind in kinds]
    static = set(names)
    for number in numbers:
        if not -len(positional) <= number < len(positional):
            raise RlxValueError(
                f"{what}: static_argnums {number} is out of range for {_graph_name(fn)}'s "
                f"{len(positional)} positional parameters"
            )
        static.add(positional[number])
    unknown = sorted(static.difference(signature.parameters))
    if unknown:
        raise RlxValueError(f"{what}: static_argnames {unknown} are not parameters of {_graph_name(fn)}")
    return frozenset(static)


def _hashable(path: str, leaf: object) -> object:
    try:
        hash(leaf)
    except TypeError:
        if isinstance(leaf, _Static):
            raise RlxTypeError(
                f"rlx.jit: static argument {path.lstrip('.')} ({type(leaf.value).__name__}) is not hashable: a "
                "static argument is part of the cache key (pass an array as a traced argument)"
            ) from None
        raise RlxTypeError(
            f"rlx.jit: argument {path.lstrip('.')} is a {type(leaf).__name__}, neither an array (traced) nor "
            "hashable (a static argument, part of the cache key)"
        ) from None
    return leaf


_IDENTIFIER = re.compile(r"[^0-9A-Za-z_]")


def _input_names(paths: list[str]) -> list[str]:
    """Graph input names from argument paths (``.params.w1``: the argument ``params``'s ``w1``;
    ``.layers.0``: the first of ``layers``): identifiers joined by dots, unique."""
    names: list[str] = []
    for path in paths:
        name = ".".join(_IDENTIFIER.sub("_", p) for p in path.split(".") if p) or "arg"
        name = name if not name[0].isdigit() and not keyword.iskeyword(name) else f"_{name}"
        while name in names:
            name += "_"
        names.append(name)
    return names


def _graph_name(fn: Callable[..., Any]) -> str:
    name = _IDENTIFIER.sub("_", getattr(fn, "__name__", "jit"))
    return name if name and not name[0].isdigit() and name != "_lambda_" else "jit"


def jit(
    fn: Callable[..., Any] | None = None,
    *,
    passes: Sequence[str] | None = None,
    config: Any = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
) -> Any:
    """``@rlx.jit`` or ``rlx.jit(fn, passes=..., config=...)``: see the module's docstring.

    ``static_argnums`` and ``static_argnames`` name arguments that are static whatever they hold,
    as ``jax.jit``'s: the function receives them as they are (a NumPy scalar stays one, a tuple
    of arrays is not traced) and they are part of the cache key, so they must be hashable. Every
    argument that is not an array is static already without them.
    """
    if fn is None:
        return lambda f: Jitted(f, passes, config, static_argnums, static_argnames)
    return Jitted(fn, passes, config, static_argnums, static_argnames)


# ----------------------------------------------------------------------------- gradients of functions


def value_and_grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """``fn``'s value and its gradient w.r.t. the arguments ``argnums`` (each a nest of arrays):
    ``(value, grads)``, or ``((value, aux), grads)`` with ``has_aux``, as ``jax.value_and_grad``."""
    if not callable(fn):
        raise RlxTypeError(f"rlx.value_and_grad: expected a function, got {type(fn).__name__}")
    positions = _argnums(argnums)
    on_arrays = OnArrays("rlx.value_and_grad")

    @functools.wraps(fn)
    def differentiated(*args: Any, **kwargs: Any) -> Any:
        graph = graph_of("rlx.value_and_grad", args, kwargs)
        if graph is None:  # called on arrays: traced and compiled once per shapes
            # Python floats among the differentiated arguments are arrays, as jax.grad takes them.
            args = tuple(_floats_as_arrays(arg) if i in positions else arg for i, arg in enumerate(args))
            return on_arrays(differentiated, args, kwargs)
        for position in positions:
            if position >= len(args):
                raise RlxValueError(
                    f"rlx.value_and_grad: argnums {position}, but only {len(args)} positional arguments"
                )
        result = fn(*args, **kwargs)
        value, aux = _split_aux(result, has_aux)
        if not isinstance(value, Value) or value.shape != ():
            raise RlxTypeError(
                f"rlx.grad of {getattr(fn, '__name__', 'a function')}: it must return a scalar value (shape ()), "
                f"got {value.type if isinstance(value, Value) else type(value).__name__}"
            )
        grads = []
        for position in positions:
            wrt: list[tuple[str, object]] = []
            tree = _flatten(args[position], "", wrt)
            for path, leaf in wrt:
                if not isinstance(leaf, Value):
                    raise RlxTypeError(
                        f"rlx.grad: argument {position}{path} is a {type(leaf).__name__}, not an array: "
                        "only arrays have gradients"
                    )
            from rlx.autodiff import grad as graph_grad

            grads.append(_unflatten(tree, iter(graph_grad(graph, value, [leaf for _, leaf in wrt]))))  # type: ignore[misc]
        grad_tree = grads[0] if isinstance(argnums, int) else tuple(grads)
        return ((value, aux) if has_aux else value), grad_tree

    return differentiated


def graph_of(what: str, *nests: Any) -> Graph | None:
    """The graph of the values among ``nests``; None when they hold none (a call on arrays)."""
    leaves: list[tuple[str, object]] = []
    _flatten(nests, "", leaves)
    graphs = {leaf.graph for _, leaf in leaves if isinstance(leaf, Value)}
    if len(graphs) > 1:
        raise RlxValueError(f"{what}: the arguments are values of different graphs")
    return next(iter(graphs), None)


def call_jitted(jitted: Jitted, what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A transform called on arrays runs jitted: its trace calls it again on values. Without an
    array among the arguments the trace would have no values either, and call it forever."""
    leaves: list[tuple[str, object]] = []
    _flatten((args, kwargs), "", leaves)
    if not any(_is_array(leaf) for _, leaf in leaves):
        raise RlxValueError(f"{what}: the arguments hold no array (nor value of a graph): there is nothing to trace")
    return jitted(*args, **kwargs)


class OnArrays:
    """The jitted form of a transformed function, made at its first call on arrays and kept:
    ``on_arrays(transformed, args, kwargs)`` traces ``transformed`` once per shapes."""

    def __init__(
        self, what: str, static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = ()
    ) -> None:
        self.what = what
        self._static = (static_argnums, static_argnames)
        self._jitted: Jitted | None = None

    def __call__(self, transformed: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._jitted is None:
            self._jitted = Jitted(transformed, None, None, *self._static, what=self.what)
        return call_jitted(self._jitted, self.what, args, kwargs)


def _floats_as_arrays(obj: Any) -> Any:
    """``obj`` with its Python (and NumPy scalar) floats as float32 arrays."""
    leaves: list[tuple[str, object]] = []
    tree = _flatten(obj, "", leaves)
    return _unflatten(tree, (np.float32(x) if isinstance(x, (float, np.floating)) else x for _, x in leaves))


def grad_of_function(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """``rlx.grad(fn)``: the gradient alone (with ``aux`` beside it when ``has_aux``), as ``jax.grad``."""
    both = value_and_grad(fn, argnums, has_aux)

    @functools.wraps(fn)
    def gradient(*args: Any, **kwargs: Any) -> Any:
        (value, grads) = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return gradient


def _argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    items = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not items or any(isinstance(a, bool) or not isinstance(a, int) or a < 0 for a in items):
        raise RlxValueError(f"rlx.grad: argnums must be a non-negative int or a sequence of them, got {argnums!r}")
    return items


def _split_aux(result: Any, has_aux: bool) -> tuple[Any, Any]:
    if not has_aux:
        return result, None
    if not isinstance(result, tuple) or len(result) != 2:
        raise RlxTypeError("rlx.value_and_grad(has_aux=True): the function must return a pair (value, aux)")
    return result
