"""A gradient the user writes (``jax.custom_vjp``, ``torch.autograd.Function``), held in the IR.

``rlx.custom_vjp`` (:mod:`rlx.custom_gradients`) traces the user's backward function when the
function is called, not when it is differentiated: on a stand-in for the cotangent, a
``custom_vjp_cotangent`` node. The backward is then ordinary nodes of the graph that read the
stand-in, and one ``custom_vjp`` node ties it to the forward::

    %p  = ... the forward's result ...
    %ct = custom_vjp_cotangent %p, %x                       : f32[3,4]   (zeros; a stand-in)
    %gx = mul %ct, %s                                       : f32[3,4]   (the traced backward)
    %y  = custom_vjp %p, %ct, %x, %gx {outputs = 1, arguments = 1} : f32[3,4]

``custom_vjp``'s operands are its primal results, their stand-ins, the arguments it
differentiates, and their gradients as the backward computes them from the stand-ins. Its
results are the primal results themselves. Its gradient rule copies the backward's nodes that
read the stand-ins with the real cotangents in their place; nothing flows through the forward's
own nodes. So the IR holds no Python callable: it prints, parses, verifies and copies like any
graph, gradients of gradients differentiate the copied backward, and ``rlx.vmap`` batches the
backward with everything else. The stand-in reads the primal result and the arguments, so it is
batched whenever they are. Before code generation both ops decompose to what they stand for
(the primal results; zeros), and the unused backward is dead code that ``dce`` removes.

``barrier(x, after)`` is ``x``, computed once the scalar ``after`` is. ``rlx.checkpoint`` is a
``custom_vjp`` whose traced backward computes the forward again from inputs read through a
barrier on the cotangent: it cannot run before the cotangent exists, and ``cse`` cannot merge
it with the forward it copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import OpDef, no_gradient, register_op
from rlx.ir.types import TensorType
from rlx.ops._batching import batch_elementwise, with_examples
from rlx.ops._common import as_value, op_kind, sum_to_shape, zeros
from rlx.ops.elementwise import NoAttrs

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value
    from rlx.ir.types import Dim

F32 = np.dtype(np.float32)


# ----------------------------------------------------------------------------- the cotangent's stand-in


def _cotangent_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    primal = inputs[0]
    if primal.dtype != F32:
        raise RlxTypeError(f"{what}: the cotangent of a {primal} result: only float32 results have one")
    return (primal,)


def custom_vjp_cotangent(graph: Graph, primal: Value, arguments: Sequence[Value] = ()) -> Value:
    """A stand-in for the cotangent of ``primal`` (float32), on which ``rlx.custom_vjp`` traces
    the user's backward function. Its value is zeros; a ``custom_vjp`` node's gradient rule puts
    the real cotangent in its place. ``arguments`` (the custom function's inputs) are read only
    so that the stand-in varies wherever they do (``rlx.vmap`` batches it with them)."""
    from rlx.ir.graph import Value

    values = [primal, *arguments]
    for i, value in enumerate(values):
        if not isinstance(value, Value) or value.graph is not graph:
            where = "primal" if i == 0 else f"arguments[{i - 1}]"
            raise RlxTypeError(
                f"custom_vjp_cotangent: {where} must be a Value of this graph, got {type(value).__name__}"
            )
    return graph.add_node(op_kind("custom_vjp_cotangent"), values, NoAttrs()).outputs[0]


def _cotangent_batch(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> tuple[Value, ...]:
    primal = with_examples(graph, operands[0], batched[0], size)
    return graph.add_node(node.op, [primal, *operands[1:]], node.attrs).outputs


register_op(
    OpDef(
        "custom_vjp_cotangent",
        ("of*",),
        NoAttrs,
        _cotangent_infer,
        lambda args, attrs, ctx: np.zeros_like(args[0]),
        no_gradient,  # a stand-in: its value is zeros whatever it reads
        builder=custom_vjp_cotangent,
        decompose=lambda graph, node: (zeros(graph, node.outputs[0].shape),),
        batch=_cotangent_batch,
        summary="the stand-in for a custom_vjp result's cotangent",
    )
)


# ----------------------------------------------------------------------------- custom_vjp


@dataclass(frozen=True)
class CustomVjpAttrs:
    """How the operands divide: ``outputs`` primal results and as many stand-ins, then
    ``arguments`` differentiated inputs and as many gradients."""

    outputs: int
    arguments: int


@dataclass(frozen=True)
class _Parts:
    primals: Sequence[Value]
    cotangents: Sequence[Value]
    arguments: Sequence[Value]
    gradients: Sequence[Value]


def _parts(node: Node) -> _Parts:
    m, n = node.attrs.outputs, node.attrs.arguments
    inputs = node.inputs
    return _Parts(inputs[:m], inputs[m : 2 * m], inputs[2 * m : 2 * m + n], inputs[2 * m + n :])


def _custom_infer(what: str, inputs: Sequence[TensorType], attrs: CustomVjpAttrs) -> tuple[TensorType, ...]:
    m, n = attrs.outputs, attrs.arguments
    if isinstance(m, bool) or isinstance(n, bool) or not isinstance(m, int) or not isinstance(n, int):
        raise RlxTypeError(f"{what}: outputs and arguments must be ints, got {m!r} and {n!r}")
    if m < 1 or n < 0 or len(inputs) != 2 * (m + n):
        raise RlxValueError(
            f"{what}: {m} outputs and {n} arguments take {2 * (m + n)} operands (primals, their cotangents, "
            f"arguments, their gradients), got {len(inputs)}"
        )
    primals, cotangents = inputs[:m], inputs[m : 2 * m]
    arguments, gradients = inputs[2 * m : 2 * m + n], inputs[2 * m + n :]
    for i, (primal, cotangent) in enumerate(zip(primals, cotangents, strict=True)):
        if primal.dtype != F32:
            raise RlxTypeError(f"{what}: primal {i} is {primal}; only float32 results have a custom gradient")
        if cotangent != primal:
            raise RlxValueError(f"{what}: the cotangent of primal {i} ({primal}) is {cotangent}")
    for i, (argument, gradient) in enumerate(zip(arguments, gradients, strict=True)):
        if argument.dtype != F32:
            raise RlxTypeError(f"{what}: argument {i} is {argument}; only float32 arguments have a gradient")
        if gradient != argument:
            raise RlxValueError(f"{what}: the gradient of argument {i} ({argument}) is {gradient}")
    return tuple(primals)


def custom_vjp(
    graph: Graph,
    primals: Sequence[Value],
    cotangents: Sequence[Value],
    arguments: Sequence[Value],
    gradients: Sequence[Value],
) -> tuple[Value, ...]:
    """``primals`` (float32), whose gradient w.r.t. ``arguments`` is ``gradients``: values computed
    from ``cotangents``, one ``custom_vjp_cotangent`` stand-in per primal. Returns the primals
    as new values (use those); differentiating them copies the nodes between the stand-ins and
    the gradients with the real cotangents in the stand-ins' place. ``rlx.custom_vjp`` builds
    this from a user's forward and backward functions."""
    from rlx.ir.graph import Value

    groups = {"primals": primals, "cotangents": cotangents, "arguments": arguments, "gradients": gradients}
    for what, group in groups.items():
        if isinstance(group, Value) or not isinstance(group, Sequence):
            raise RlxTypeError(f"custom_vjp: {what} must be a list of Values, got {type(group).__name__}")
        for i, value in enumerate(group):
            if not isinstance(value, Value) or value.graph is not graph:
                raise RlxTypeError(f"custom_vjp: {what}[{i}] must be a Value of this graph, got {type(value).__name__}")
    for i, cotangent in enumerate(cotangents):
        if cotangent.node.op is not op_kind("custom_vjp_cotangent"):
            raise RlxValueError(f"custom_vjp: cotangents[{i}] must be a custom_vjp_cotangent stand-in, got {cotangent}")
    attrs = CustomVjpAttrs(len(primals), len(arguments))
    operands = [*primals, *cotangents, *arguments, *gradients]
    return tuple(graph.add_node(op_kind("custom_vjp"), operands, attrs).outputs)


def _custom_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    """The backward's nodes between the stand-ins and the wanted gradients, copied with each
    stand-in replaced by its result's cotangent (zeros where none flows)."""
    parts = _parts(node)
    m = len(parts.primals)
    offset = 2 * m
    wanted = [i for i in range(len(parts.arguments)) if needed[offset + i]]
    real = {
        stand_in: ct if ct is not None else zeros(graph, stand_in.shape)
        for stand_in, ct in zip(parts.cotangents, cts, strict=True)
    }
    copies = copy_with(graph, [parts.gradients[i] for i in wanted], real)
    result: list[Value | None] = [None] * len(node.inputs)
    for i, copy in zip(wanted, copies, strict=True):
        result[offset + i] = copy
    return result


def copy_with(
    graph: Graph,
    values: Sequence[Value],
    replaced: dict[Value, Value],
    among: Callable[[Node], bool] | None = None,
    copy_node: Callable[[Node, list[Value]], Sequence[Value]] | None = None,
) -> list[Value]:
    """``values`` computed again with each key of ``replaced`` read as its value: every node
    between them is copied (operands first; only nodes ``among`` accepts, if given), every node
    that reads none of the keys is kept. ``copy_node(node, operands)`` makes a copy's results
    (by default the same op on the new operands).

    The nodes are visited by a depth-first walk from ``values``, copied in its post-order (each
    after its operands): only their ancestors, never a sort of the whole graph, which a deep
    model's every custom gradient would otherwise pay for. The walk stops at a node ``among``
    refuses: it is kept as it is, so a copy of what it reads would be read by nothing. It also
    stops at a node ranked no higher than every key (ranks grow along every edge): it reads none
    of them, so it and all it reads are kept (a custom gradient's forward and all before it)."""
    mapping = dict(replaced)
    if not mapping:
        return list(values)
    rank = graph._ranks()
    floor = min(rank[key.node.id] for key in mapping)
    visited: set[int] = set()
    stack: list[tuple[Node, bool]] = [(value.node, False) for value in reversed(values)]
    while stack:
        node, operands_done = stack.pop()
        if node.id in visited:
            continue
        if rank[node.id] <= floor or (among is not None and not among(node)):
            visited.add(node.id)
            continue
        if not operands_done:
            stack.append((node, True))
            stack.extend((value.node, False) for value in reversed(node.inputs) if value.node.id not in visited)
            continue
        visited.add(node.id)
        if any(value in mapping for value in node.inputs):
            operands = [mapping.get(v, v) for v in node.inputs]
            if copy_node is None:
                copies: Sequence[Value] = graph.add_node(node.op, operands, node.attrs).outputs
            else:
                copies = copy_node(node, operands)
            mapping.update(zip(node.outputs, copies, strict=True))
    return [mapping.get(value, value) for value in values]


def _custom_batch(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> tuple[Value, ...]:
    """Every primal and stand-in gets the examples' axis; arguments stay as they are, and each
    gradient is made to match its argument: summed over the examples for a shared argument (the
    examples' gradients add up), broadcast for a batched argument whose gradient is shared."""
    m, n = node.attrs.outputs, node.attrs.arguments
    primals = [with_examples(graph, v, f, size) for v, f in zip(operands[:m], batched[:m], strict=True)]
    cotangents = list(operands[m : 2 * m])
    if not all(batched[m : 2 * m]):
        raise RlxValueError(
            f"rlx.vmap: custom_vjp (node {node.id}): its backward varies between examples, but its results and "
            "arguments do not (does the function read a mapped value it does not take as an argument? pass it in)"
        )
    arguments = list(operands[2 * m : 2 * m + n])
    gradients = []
    for argument, flag, gradient, gradient_flag in zip(
        arguments, batched[2 * m : 2 * m + n], operands[2 * m + n :], batched[2 * m + n :], strict=True
    ):
        if gradient_flag and not flag:
            gradient = sum_to_shape(graph, gradient, argument.shape)
        elif flag and not gradient_flag:
            gradient = with_examples(graph, gradient, False, size)
        gradients.append(gradient)
    return custom_vjp(graph, primals, cotangents, arguments, gradients)


register_op(
    OpDef(
        "custom_vjp",
        ("operands*",),
        CustomVjpAttrs,
        _custom_infer,
        lambda args, attrs, ctx: tuple(args[: attrs.outputs]),
        _custom_grad,
        builder=custom_vjp,
        decompose=lambda graph, node: tuple(node.inputs[: node.attrs.outputs]),
        batch=_custom_batch,
        summary="results whose gradient a traced backward gives (rlx.custom_vjp)",
    )
)


# ----------------------------------------------------------------------------- barrier


def _barrier_infer(what: str, inputs: Sequence[TensorType], attrs: NoAttrs) -> tuple[TensorType, ...]:
    x, after = inputs
    if after.shape != ():
        raise RlxValueError(f"{what}: after must be a scalar (a value's first element or sum), got {after}")
    return (x,)


def barrier(graph: Graph, x: object, after: Value) -> Value:
    """``x`` itself, computed only once the scalar ``after`` is: what ``rlx.checkpoint`` reads
    its inputs through when it computes a function's forward again in the backward. The copy
    cannot be merged with the forward by ``cse`` (it reads ``after`` too), nor run before the
    cotangent it waits for exists, so the forward's values are freed in between."""
    value = as_value(graph, x, "barrier: x")
    return graph.add_node(op_kind("barrier"), [value, as_value(graph, after, "barrier: after")], NoAttrs()).outputs[0]


def _barrier_grad(graph: Graph, node: Node, cts: Sequence[Value | None], needed: Sequence[bool]) -> list[Value | None]:
    return [cts[0], None]


def _barrier_batch(
    graph: Graph, node: Node, operands: Sequence[Value], batched: Sequence[bool], size: Dim
) -> tuple[Value, ...]:
    x = with_examples(graph, operands[0], batched[0], size)
    after = graph.sum(operands[1]) if batched[1] else operands[1]  # every example's, at once
    return graph.add_node(node.op, [x, after], node.attrs).outputs


register_op(
    OpDef(
        "barrier",
        ("x", "after"),
        NoAttrs,
        _barrier_infer,
        lambda args, attrs, ctx: args[0],
        _barrier_grad,
        scalar=lambda e, x, after, attrs: x,
        builder=barrier,
        batch=_barrier_batch,
        summary="x, computed once the scalar after is (a rematerialised forward's inputs)",
    )
)


# ----------------------------------------------------------------------------- checkpoint_name


@dataclass(frozen=True)
class CheckpointNameAttrs:
    name: str


def checkpoint_name(graph: Graph, x: object, name: str) -> Value:
    """``x`` itself, named for ``rlx.checkpoint``'s policies (``jax.ad_checkpoint.checkpoint_name``):
    ``rlx.checkpoint_policies.save_only_these_names("qkv")`` keeps what is named so from the
    forward. It is gone before code generation (the ``decompose`` pass)."""
    if not isinstance(name, str) or not name:
        raise RlxTypeError(f"checkpoint_name: the name must be a non-empty str, got {name!r}")
    value = as_value(graph, x, "checkpoint_name: x")
    return graph.add_node(op_kind("checkpoint_name"), [value], CheckpointNameAttrs(name)).outputs[0]


register_op(
    OpDef(
        "checkpoint_name",
        ("x",),
        CheckpointNameAttrs,
        lambda what, inputs, attrs: (inputs[0],),  # any dtype: the value itself
        lambda args, attrs, ctx: args[0],
        lambda graph, node, cts, needed: [cts[0]],
        builder=checkpoint_name,
        decompose=lambda graph, node: (node.inputs[0],),
        batch=batch_elementwise,
        summary="x, named for rlx.checkpoint's policies",
    )
)
