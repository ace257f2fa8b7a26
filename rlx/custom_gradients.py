"""``rlx.custom_vjp``: a function whose gradient you write, as ``jax.custom_vjp``; and
``rlx.custom_jvp`` (at the end), built on it. ``rlx.checkpoint`` (:mod:`rlx.checkpointing`) is too.

::

    @rlx.custom_vjp
    def softplus(x):
        return rlx.log(1.0 + rlx.exp(x))

    def softplus_fwd(x):
        return softplus(x), x                      # the result, and what the backward needs

    def softplus_bwd(x, g):                        # residuals, then the result's cotangent
        return (g * rlx.sigmoid(x),)               # one cotangent per argument

    softplus.defvjp(softplus_fwd, softplus_bwd)

For: a numerically stable gradient (this softplus's, written naively, overflows), a
straight-through estimator (``bwd`` passes ``g`` through a rounding), gradient clipping, or a
cheaper gradient than the one autodiff derives.

When the function is called on values, ``fwd`` runs and ``bwd`` is traced at once, on a
stand-in for each result's cotangent (:mod:`rlx.ops.custom_vjp` says how the graph holds it).
So everything rlx does with graphs works on it: ``rlx.grad`` (and gradients of gradients,
through the traced backward), ``rlx.vmap``, ``rlx.jit``, printing and parsing. Called on
arrays, the function is jitted and returns ``fwd``'s result.

As in JAX: ``bwd(*nondiff_args, residuals, g)`` returns a tuple with one entry per argument
not in ``nondiff_argnums``, each shaped as that argument (``None`` for zeros, in place of a whole
argument or of one array in it; as torch's autograd takes a Function's gradients, one the
argument broadcasts to is summed back to its shape); ``g`` has the structure of the result, with
``None`` where a result is not float32. Integer arguments get no gradient (what ``bwd`` returns
for them is not used). Values the function reads without taking them as arguments get no
gradient through it: pass them as arguments.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.graph import Graph, Value, _all_or_nothing
from rlx.ir.types import Dim
from rlx.ops._common import as_value, sum_to_shape, zeros
from rlx.tracing import OnArrays, _flatten, _Tree, _unflatten, graph_of

F32 = np.dtype(np.float32)


class custom_vjp:  # named as jax.custom_vjp, and a decorator like it
    """``fun`` with the gradient that :meth:`defvjp`'s ``fwd`` and ``bwd`` give (see the module)."""

    def __init__(self, fun: Callable[..., Any], nondiff_argnums: Sequence[int] = ()) -> None:
        if not callable(fun):
            raise RlxTypeError(f"rlx.custom_vjp: expected a function, got {type(fun).__name__}")
        if isinstance(nondiff_argnums, int) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in nondiff_argnums
        ):
            raise RlxTypeError(
                f"rlx.custom_vjp: nondiff_argnums must be a tuple of non-negative ints, got {nondiff_argnums!r}"
            )
        functools.update_wrapper(self, fun, updated=())  # name and docstring, not a Jitted's fields
        self.fun = fun
        self.nondiff_argnums = tuple(sorted(set(nondiff_argnums)))
        self.fwd: Callable[..., Any] | None = None
        self.bwd: Callable[..., Any] | None = None
        self._name = getattr(fun, "__name__", "a function")
        self._on_arrays = OnArrays(f"rlx.custom_vjp of {self._name}")
        self._running = threading.local()  # whether this thread is inside fwd or bwd

    def defvjp(self, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
        """``fwd(*args) -> (result, residuals)``; ``bwd(*nondiff_args, residuals, g) -> tuple``."""
        for what, f in (("fwd", fwd), ("bwd", bwd)):
            if not callable(f):
                raise RlxTypeError(f"rlx.custom_vjp of {self._name}: defvjp's {what} must be a function")
        self.fwd, self.bwd = fwd, bwd

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = self._positional(args, kwargs)
        graph = graph_of(f"rlx.custom_vjp of {self._name}", args)
        if graph is None:  # called on arrays: jitted, traced once per shapes
            return self._on_arrays(self, args, {})
        if self.fwd is None or self.bwd is None:
            raise RlxValueError(
                f"rlx.custom_vjp of {self._name}: no gradient defined; call {self._name}.defvjp(fwd, bwd) first"
            )
        for position in self.nondiff_argnums:
            if position >= len(args):
                raise RlxValueError(
                    f"rlx.custom_vjp of {self._name}: nondiff_argnums has {position}, "
                    f"but it was called with {len(args)} arguments"
                )
        if getattr(self._running, "rules", False):  # fwd (or bwd) calls the function itself, as JAX's rules do
            return self.fun(*args)
        self._running.rules = True
        try:
            return _all_or_nothing(self._traced)(graph, args)
        finally:
            self._running.rules = False

    def _traced(self, graph: Graph, args: tuple[Any, ...]) -> Any:
        """``fwd`` run and ``bwd`` traced on ``graph`` (which is left as it was if either raises)."""
        out, residuals = _run_fwd(self, args)
        return _Call(self, graph, args).result(out, residuals)

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """Keyword arguments in their places, as JAX resolves them against ``fun``'s signature."""
        if not kwargs:
            return args
        try:
            bound = inspect.signature(self.fun).bind(*args, **kwargs)
        except (TypeError, ValueError) as error:
            raise RlxTypeError(f"rlx.custom_vjp of {self._name}: {error}") from None
        bound.apply_defaults()
        if bound.kwargs:
            raise RlxTypeError(
                f"rlx.custom_vjp of {self._name}: keyword-only arguments ({', '.join(bound.kwargs)}) are not "
                "supported; make them positional"
            )
        return tuple(bound.args)


class _Call:
    """One call of a custom_vjp function on values: ``fwd`` run, ``bwd`` traced, one node."""

    def __init__(self, function: custom_vjp, graph: Graph, args: tuple[Any, ...]) -> None:
        self.function, self.graph, self.args = function, graph, args
        self.what = f"rlx.custom_vjp of {function._name}"
        self.diff_positions = [i for i in range(len(args)) if i not in function.nondiff_argnums]

    def result(self, out: Any, residuals: Any) -> Any:
        graph, function = self.graph, self.function
        assert function.bwd is not None
        out_leaves: list[tuple[str, object]] = []
        out_tree = _flatten(out, "", out_leaves)
        primal_slots = [i for i, (_, leaf) in enumerate(out_leaves) if _is_float_value(leaf, graph)]
        if not primal_slots:  # nothing to differentiate: an int result, or constants
            return out
        arguments, arg_trees = self._arguments()
        stand_ins = {slot: graph.custom_vjp_cotangent(out_leaves[slot][1], arguments) for slot in primal_slots}
        g = _unflatten(out_tree, iter(stand_ins.get(i) for i in range(len(out_leaves))))
        nondiff = [self.args[i] for i in function.nondiff_argnums]
        gradients = self._gradients(function.bwd(*nondiff, residuals, g), arg_trees)
        primals = [out_leaves[slot][1] for slot in primal_slots]
        new = graph.custom_vjp(primals, list(stand_ins.values()), arguments, gradients)
        replaced = dict(zip(primal_slots, new, strict=True))
        return _unflatten(out_tree, iter(replaced.get(i, leaf) for i, (_, leaf) in enumerate(out_leaves)))

    def _arguments(self) -> tuple[list[Value], list[tuple[_Tree, list[tuple[str, object]]]]]:
        """The float32 values among the differentiated arguments, and each argument's tree."""
        values: list[Value] = []
        trees = []
        for position in self.diff_positions:
            leaves: list[tuple[str, object]] = []
            tree = _flatten(self.args[position], "", leaves)
            trees.append((tree, leaves))
            values.extend(leaf for _, leaf in leaves if _is_float_value(leaf, self.graph))  # type: ignore[misc]
        return values, trees

    def _gradients(self, returned: object, arg_trees: list[tuple[_Tree, list[tuple[str, object]]]]) -> list[Value]:
        """``bwd``'s cotangents, checked against the arguments, for their float32 values."""
        count = len(self.diff_positions)
        if not isinstance(returned, (tuple, list)) or len(returned) != count:
            raise RlxTypeError(
                f"{self.what}: bwd must return a tuple with one cotangent per differentiated argument ({count}), "
                f"got {_kind(returned)}"
            )
        gradients: list[Value] = []
        for position, entry, (tree, leaves) in zip(self.diff_positions, returned, arg_trees, strict=True):
            if entry is None:
                entries: list[object] = [None] * len(leaves)
            else:
                got: list[tuple[str, object]] = []
                if _flatten(entry, "", got) != tree:
                    raise RlxTypeError(
                        f"{self.what}: bwd's cotangent for argument {position} has another structure than the argument"
                    )
                entries = [leaf for _, leaf in got]
            for (path, leaf), grad in zip(leaves, entries, strict=True):
                if _is_float_value(leaf, self.graph):
                    assert isinstance(leaf, Value)
                    gradients.append(self._gradient(leaf, grad, f"argument {position}{path}"))
        return gradients

    def _gradient(self, argument: Value, grad: object, where: str) -> Value:
        if grad is None:
            return zeros(self.graph, argument.shape)
        if isinstance(grad, Value) and grad.graph is not self.graph:
            raise RlxValueError(f"{self.what}: bwd's cotangent for {where} is a value of another graph")
        value = as_value(self.graph, grad, f"{self.what}: bwd's cotangent for {where}")
        if value.dtype != F32:
            raise RlxTypeError(f"{self.what}: bwd's cotangent for {where} is {value.type}, expected float32")
        if value.shape == argument.shape:
            return value
        # As torch's autograd takes a Function's gradients: one the argument broadcast to is summed
        # back to its shape, and one that broadcasts to the argument is broadcast.
        if _broadcasts(argument.shape, value.shape):
            return sum_to_shape(self.graph, value, argument.shape)
        if _broadcasts(value.shape, argument.shape):
            return self.graph.broadcast_to(value, argument.shape)
        raise RlxValueError(
            f"{self.what}: bwd's cotangent for {where} is {value.type}, but the argument is {argument.type}"
        )


def _run_fwd(function: custom_vjp, args: tuple[Any, ...]) -> tuple[Any, Any]:
    assert function.fwd is not None
    returned = function.fwd(*args)
    if not isinstance(returned, tuple) or len(returned) != 2:
        raise RlxTypeError(
            f"rlx.custom_vjp of {function._name}: fwd must return a pair (result, residuals), got {_kind(returned)}"
        )
    return returned


def _broadcasts(shape: tuple[Dim, ...], to: tuple[Dim, ...]) -> bool:
    """Whether NumPy broadcasting takes ``shape`` to ``to``."""
    if len(shape) > len(to):
        return False
    return all(size in (1, target) for size, target in zip(shape, to[len(to) - len(shape) :], strict=True))


def _is_float_value(leaf: object, graph: Graph) -> bool:
    return isinstance(leaf, Value) and leaf.graph is graph and leaf.dtype == F32


def _kind(obj: object) -> str:
    return f"a {type(obj).__name__} of {len(obj)}" if isinstance(obj, (tuple, list)) else f"a {type(obj).__name__}"


class custom_jvp:  # named as jax.custom_jvp, and a decorator like it
    """``fun`` with the derivative a JVP rule gives, as ``jax.custom_jvp``::

        @rlx.custom_jvp
        def log1pexp(x):
            return rlx.log(1.0 + rlx.exp(x))

        @log1pexp.defjvp
        def log1pexp_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return log1pexp(x), t * rlx.sigmoid(x)

    rlx differentiates in reverse, so the rule is used transposed: the cotangent of an argument is
    the gradient of ``<rule's tangent out, g>`` with respect to the argument's tangent, which the
    rule makes linear. That is a ``custom_vjp`` (see the module) whose backward is traced once, at
    the call: forward-mode results come, as every ``rlx.jvp`` does, from differentiating it again.
    ``defjvps(*rules)`` gives one rule per argument, ``rule(t, result, *args)``, as in JAX.
    Integer arguments get ``None`` tangents.
    """

    def __init__(self, fun: Callable[..., Any], nondiff_argnums: Sequence[int] = ()) -> None:
        self._vjp = custom_vjp(fun, nondiff_argnums)
        functools.update_wrapper(self, fun, updated=())
        self.fun = fun
        self.nondiff_argnums = self._vjp.nondiff_argnums
        self.jvp: Callable[..., Any] | None = None

    def defjvp(self, jvp: Callable[..., Any]) -> Callable[..., Any]:
        """``jvp(primals, tangents) -> (result, tangent_out)`` (with ``nondiff_argnums``,
        ``jvp(*nondiff_args, primals, tangents)``); returned, so it can decorate the rule."""
        if not callable(jvp):
            raise RlxTypeError(f"rlx.custom_jvp of {self._vjp._name}: defjvp takes a function")
        self.jvp = jvp
        self._vjp.defvjp(self._fwd, self._bwd)
        return jvp

    def defjvps(self, *rules: Callable[..., Any] | None) -> None:
        """One rule per differentiated argument, ``rule(tangent, result, *args)`` (``None``:
        no dependence), their tangents summed, as ``jax.custom_jvp.defjvps``."""
        fun = self.fun

        def jvp(*given: Any) -> tuple[Any, Any]:
            primals, tangents = given[-2], given[-1]
            result = fun(*given[:-2], *primals)
            total = None
            for rule, tangent in zip(rules, tangents, strict=False):
                if rule is None or tangent is None:
                    continue
                term = rule(tangent, result, *primals)
                total = term if total is None else total + term
            return result, total if total is not None else zeros_like_tree(result)

        self.defjvp(jvp)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.jvp is None:
            name = self._vjp._name
            raise RlxValueError(f"rlx.custom_jvp of {name}: no derivative defined; call {name}.defjvp(rule) first")
        return self._vjp(*args, **kwargs)

    def _fwd(self, *args: Any) -> tuple[Any, Any]:
        return self.fun(*args), args

    def _bwd(self, *given: Any) -> tuple[Any, ...]:
        """The rule transposed: per differentiated argument, the gradient of ``<tangent_out, g>``
        with respect to a stand-in for its tangent (zeros; the rule is linear in it)."""
        from rlx.autodiff import grad

        assert self.jvp is not None
        nondiff, args, g = given[:-2], given[-2], given[-1]
        positions = [i for i in range(len(args)) if i not in self.nondiff_argnums]
        primals = [args[i] for i in positions]
        stand_ins: list[Value] = []
        tangents = []
        for primal in primals:
            leaves: list[tuple[str, object]] = []
            tree = _flatten(primal, "", leaves)
            made = []
            for _, leaf in leaves:
                if isinstance(leaf, Value) and leaf.dtype == F32:
                    made.append(leaf.graph.custom_vjp_cotangent(leaf))  # zeros, a value of its own
                    stand_ins.append(made[-1])
                else:
                    made.append(None)
            tangents.append(_unflatten(tree, iter(made)))
        returned = self.jvp(*nondiff, tuple(primals), tuple(tangents))
        if not isinstance(returned, tuple) or len(returned) != 2:
            raise RlxTypeError(
                f"rlx.custom_jvp of {self._vjp._name}: the JVP rule must return a pair (result, tangent_out), "
                f"got {_kind(returned)}"
            )
        out_leaves: list[tuple[str, object]] = []
        _flatten(returned[1], "", out_leaves)
        g_leaves: list[tuple[str, object]] = []
        _flatten(g, "", g_leaves)
        if len(out_leaves) != len(g_leaves):
            raise RlxTypeError(
                f"rlx.custom_jvp of {self._vjp._name}: the rule's tangent_out has another structure than the result"
            )
        projected = None
        for (_, tangent), (_, cotangent) in zip(out_leaves, g_leaves, strict=True):
            if cotangent is None or tangent is None:
                continue
            if not isinstance(tangent, Value):
                raise RlxTypeError(f"rlx.custom_jvp of {self._vjp._name}: a tangent_out is a {type(tangent).__name__}")
            term = tangent.graph.sum(tangent * cotangent)
            projected = term if projected is None else projected + term
        if projected is None:
            return tuple(None for _ in positions)
        found = iter(grad(projected.graph, projected, stand_ins))
        cotangents = []
        for tangent_tree in tangents:
            leaves = []
            tree = _flatten(tangent_tree, "", leaves)
            cotangents.append(_unflatten(tree, (next(found) if leaf is not None else None for _, leaf in leaves)))
        return tuple(cotangents)


def zeros_like_tree(tree: Any) -> Any:
    """``tree`` with each float value replaced by zeros of its shape (a tangent that is zero)."""
    leaves: list[tuple[str, object]] = []
    structure = _flatten(tree, "", leaves)
    return _unflatten(
        structure, (zeros(leaf.graph, leaf.shape) if isinstance(leaf, Value) else None for _, leaf in leaves)
    )
