"""``rlx.checkpoint`` (``rlx.remat``): a function whose values are computed again in the
backward instead of kept, as ``jax.checkpoint`` and ``torch.utils.checkpoint``; with a
``policy`` (:mod:`rlx.checkpoint_policies`) saying which values to keep after all.

Built on ``rlx.custom_vjp``'s node: the recomputation is its traced backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from rlx.checkpoint_policies import Policy, everything_saveable, nothing_saveable
from rlx.custom_gradients import F32, _is_float_value
from rlx.errors import RlxTypeError
from rlx.ir.graph import Graph, Node, Value, _all_or_nothing
from rlx.ir.opdef import no_gradient, not_differentiable
from rlx.ops._common import zeros
from rlx.tracing import Jitted, OnArrays, _flatten, _unflatten, graph_of

_NO_FUNCTION: Any = object()  # checkpoint(policy=...) without a function: a decorator


def checkpoint(
    fn: Callable[..., Any] = _NO_FUNCTION,
    *,
    prevent_cse: bool = True,
    policy: Policy | None = None,
    static_argnums: int | Sequence[int] = (),
) -> Any:
    """``fn`` whose values are not kept for the backward but computed again there, as
    ``jax.checkpoint`` (``jax.remat``) and ``torch.utils.checkpoint``: memory for compute.

    Called on values, ``fn`` runs as usual; differentiating its results copies the nodes it
    built and differentiates the copy. The copy reads the values ``fn`` read that were computed
    before it (its inputs, and values it closes over) through a ``barrier`` on the cotangent;
    graph inputs (a layer's weights) it reads in place. So it runs in the backward, once the
    cotangent exists, and ``cse`` cannot merge it with the forward; the forward's own values are
    freed after their last forward use. The gradient is the one autodiff gives ``fn``, to every
    float value it reads. It is a ``custom_vjp`` node in the graph (the recomputation is its
    traced backward), so it composes as one: ``rlx.grad``, gradients of gradients, ``rlx.vmap``,
    ``rlx.jit``. Called on arrays, ``fn`` is jitted.

    ``policy`` (a function of a node, see :mod:`rlx.checkpoint_policies`) keeps the results of
    the nodes it accepts: the backward reads them from the forward instead of computing them
    again, and computes again only the rest. ``rlx.checkpoint(policy=...)`` without ``fn`` is a
    decorator, as is ``functools.partial(rlx.checkpoint, policy=...)``.

    ``static_argnums`` names arguments that are Python values, as ``jax.checkpoint``'s: one that
    holds a value of a graph is an error, and on arrays they are static arguments of the jitted
    function (see ``rlx.jit``). ``prevent_cse`` is taken as JAX takes it, but rlx keeps the
    recomputation apart from the forward either way: the ``barrier`` that stops ``cse`` merging
    the two is also what makes the recomputation wait for the backward, where it saves memory.
    """
    if fn is _NO_FUNCTION:
        return functools.partial(checkpoint, prevent_cse=prevent_cse, policy=policy, static_argnums=static_argnums)
    if not callable(fn):
        raise RlxTypeError(f"rlx.checkpoint: expected a function, got {type(fn).__name__}")
    if not isinstance(prevent_cse, bool):
        raise RlxTypeError(f"rlx.checkpoint: prevent_cse must be a bool, got {type(prevent_cse).__name__}")
    if policy is not None and not callable(policy):
        raise RlxTypeError(
            f"rlx.checkpoint: policy must be a function of a node (see rlx.checkpoint_policies), got "
            f"{type(policy).__name__}"
        )
    keeps = None if policy is None or policy is nothing_saveable else policy
    what = f"rlx.checkpoint of {getattr(fn, '__name__', 'a function')}"
    on_arrays = OnArrays(what, static_argnums)
    # Checks static_argnums as rlx.jit does, and the static arguments of each call on values.
    static = Jitted(fn, static_argnums=static_argnums, what=what) if static_argnums != () else None

    @functools.wraps(fn)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        graph = graph_of(what, args, kwargs)
        if graph is None:
            return on_arrays(checkpointed, args, kwargs)
        if static is not None:
            static._flattened(args, kwargs)
        return _all_or_nothing(traced)(graph, args, kwargs)

    def traced(graph: Graph, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn`` run on values, its region behind a ``custom_vjp``; ``graph`` as it was if it raises."""
        if policy is everything_saveable:  # nothing computed again: the function as it is
            return fn(*args, **kwargs)
        first_id = graph._next_id
        out = fn(*args, **kwargs)
        leaves: list[tuple[str, object]] = []
        tree = _flatten(out, "", leaves)
        slots = [i for i, (_, leaf) in enumerate(leaves) if _is_float_value(leaf, graph)]
        if not slots:
            return out
        primals = [leaves[i][1] for i in slots]
        region = range(first_id, graph._next_id)
        new = _recomputed_in_backward(graph, region, primals, keeps)  # type: ignore[arg-type]
        replaced = dict(zip(slots, new, strict=True))
        return _unflatten(tree, iter(replaced.get(i, leaf) for i, (_, leaf) in enumerate(leaves)))

    return checkpointed


def _recomputed_in_backward(
    graph: Graph, region: range, primals: list[Value], keeps: Policy | None
) -> tuple[Value, ...]:
    """``primals`` (made by the nodes whose ids are in ``region``) behind a ``custom_vjp`` whose
    backward computes them again from what those nodes read, and differentiates that. Nodes
    ``keeps`` accepts are not computed again: see :func:`_kept`."""
    from rlx.autodiff import grad
    from rlx.ops.custom_vjp import copy_with

    first_id = region.start
    # What the call's nodes read (in order): float values from before the call, and graph inputs
    # (a layer may declare its weights as it builds itself).
    reads: dict[Value, None] = {}
    for node in (graph._nodes[i] for i in region if i in graph._nodes):
        for value in node.inputs:
            made_before = value.node.id < first_id or value.node.op.value == "input"
            if made_before and value.dtype == F32 and value.node.op.value not in _FIXED:
                reads[value] = None
    for primal in primals:  # a result that is an argument itself
        if primal.node.id < first_id and primal.node.op.value not in _FIXED:
            reads[primal] = None
    arguments = list(reads)
    cotangents = [graph.custom_vjp_cotangent(primal, arguments) for primal in primals]
    after = _first_entries(graph, cotangents)
    # Graph inputs stay alive through the call anyway: the copy reads them in place, unless
    # nothing else is read (then it would be merged with the forward, and run with it) or they
    # are upstream of another value it reads (a layer's weight used by an earlier layer too):
    # differentiated in place, they would also get the gradient that flows through that value.
    computed = [argument for argument in arguments if argument.node.op.value != "input"]
    upstream = _upstream_inputs(graph, arguments, computed, first_id)
    held = {
        argument: graph.barrier(argument, after)
        for argument in arguments
        if not computed or argument.node.op.value != "input" or argument in upstream
    }

    # Only the region is copied: a node before it that reads a held value (an earlier layer
    # reading a shared weight) is upstream of what the region reads, and stays as it is.
    backward = _in_traced_backwards(graph, region) if keeps is not None else set()

    def copy_node(node: Node, operands: list[Value]) -> Sequence[Value]:
        if keeps is not None and node.id not in backward and _keepable(node) and keeps(node):
            return _kept(graph, node, operands, after)
        return graph.add_node(node.op, operands, node.attrs).outputs

    again = copy_with(graph, primals, held, lambda node: node.id in region, copy_node)
    projected = None
    for value, cotangent in zip(again, cotangents, strict=True):
        term = graph.sum(value * cotangent)
        projected = term if projected is None else projected + term
    assert projected is not None
    gradients = grad(graph, projected, [held.get(argument, argument) for argument in arguments])
    return graph.custom_vjp(primals, cotangents, arguments, gradients)


def _upstream_inputs(graph: Graph, arguments: list[Value], computed: list[Value], first_id: int) -> set[Value]:
    """The graph inputs among ``arguments`` that some value of ``computed`` (all made before the
    region, which starts at node ``first_id``) is computed from.

    Searched forward from each input through the nodes made before the region only: a layer's
    own weights (read by the region alone) cost nothing, where a walk back from ``computed``
    would visit the whole model built so far, at every layer."""
    targets = {value.node.id for value in computed}
    return {
        argument
        for argument in arguments
        if argument.node.op.value == "input"
        and not targets.isdisjoint(graph._descendants({argument.node.id}, lambda node_id: node_id < first_id))
    }


_FIXED = ("constant", "config_value")  # values a recomputation reads as they are: nothing to free


def _first_entries(graph: Graph, values: Sequence[Value]) -> Value:
    """A scalar that depends on every value (the sum of their first entries; of all entries for
    one whose size is not a known positive number), for a ``barrier`` to wait on."""
    total = None
    for value in values:
        if all(isinstance(size, int) and size > 0 for size in value.shape):
            entry = graph.reshape(value, (-1,))[0] if value.shape else value
        else:
            entry = graph.sum(value)
        total = entry if total is None else total + entry
    assert total is not None
    return total


def _in_traced_backwards(graph: Graph, region: range) -> set[int]:
    """Ids of the region's nodes computed from a ``custom_vjp`` stand-in: the backward a custom
    gradient (or a checkpoint) inside the region traced. Their forward values were computed on
    the stand-in's zeros; only a copy on the real cotangent means anything, so none is kept."""
    nodes = graph._nodes
    stand_ins = {i for i in region if i in nodes and nodes[i].op.value == "custom_vjp_cotangent"}
    # Not through a custom_vjp node: it reads its stand-ins, but its results are its primals.
    return graph._descendants(stand_ins, lambda i: i in region and nodes[i].op.value != "custom_vjp")


def _keepable(node: Node) -> bool:
    """A node whose results a policy may keep: float results and a gradient rule to pass on."""
    grad = node.op.definition.grad
    return (
        grad is not no_gradient
        and grad is not not_differentiable
        and all(value.dtype == F32 for value in node.outputs)
        and any(value.dtype == F32 for value in node.inputs)
    )


class _Restated:
    """``node`` as its gradient rule sees it, reading ``inputs`` and giving ``outputs`` (the
    rules read only these fields)."""

    def __init__(self, node: Node, inputs: Sequence[Value], outputs: Sequence[Value]) -> None:
        self.id, self.op, self.attrs, self.types = node.id, node.op, node.attrs, node.types
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)


def _kept(graph: Graph, node: Node, operands: list[Value], after: Value) -> tuple[Value, ...]:
    """``node``'s results as the forward computed them (read once ``after`` is, so what reads
    them stays in the backward), with the gradient ``node``'s rule gives its recomputed
    ``operands``: a ``custom_vjp`` whose traced backward is that rule, applied with the kept
    results in the place of the node's own (a rule that reads them computes nothing again)."""
    kept = [graph.barrier(value, after) for value in node.outputs]
    definition = node.op.definition
    needed = [
        value.dtype == F32 and definition.operand_name(slot) not in definition.no_grad
        for slot, value in enumerate(operands)
    ]
    slots = [slot for slot, wanted in enumerate(needed) if wanted]
    if not slots:  # no gradient to pass on: the kept results are all there is
        return tuple(kept)
    arguments = [operands[slot] for slot in slots]
    stand_ins = [graph.custom_vjp_cotangent(value, arguments) for value in kept]
    rule = definition.grad
    contributions = rule(graph, _Restated(node, operands, kept), stand_ins, needed)  # type: ignore[arg-type]
    gradients = [
        contributions[slot] if contributions[slot] is not None else zeros(graph, operands[slot].shape) for slot in slots
    ]
    return graph.custom_vjp(kept, stand_ins, arguments, gradients)
