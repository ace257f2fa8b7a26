"""One definition per op: operands, attrs, shape rule, float64 reference and gradient, side by side.

Each op module in :mod:`rlx.ops` registers an :class:`OpDef`; everything generic (the builder
methods on ``Graph``, the verifier, the printer and parser, the reference interpreter, autodiff,
dce and cse) reads these definitions and never names an op. This is JAX's primitive table in
miniature: ``def_abstract_eval`` is :attr:`OpDef.infer`, ``def_impl`` is :attr:`OpDef.reference`,
the JVP/transpose pair is :attr:`OpDef.grad`, the batching rule is :attr:`OpDef.batch`. Lowerings
live in ``rlx.codegen`` (the IR stays free of LLVM), keyed by op name, except that an elementwise
op carries its scalar formula here (:attr:`OpDef.scalar`), written against an abstract scalar
emitter that codegen implements.
``tests/ops/test_registry.py`` fails if any registered op lacks a piece.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx.config import RuntimeConfig
from rlx.errors import RlxValueError
from rlx.ir.types import resolve_dims

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Node, Value
    from rlx.ir.types import Dim, TensorType

InferFn = Callable[[str, Sequence["TensorType"], Any], tuple["TensorType", ...]]
"""``infer(what, operand_types, attrs) -> result types``; raises naming ``what`` on bad input."""


@dataclass(frozen=True)
class EvalContext:
    """What a reference implementation may read besides its operands."""

    config: RuntimeConfig
    inputs: Mapping[str, np.ndarray]
    sizes: Mapping[str, int] = field(default_factory=dict)  # this call's symbolic dimensions

    def resolve(self, shape: tuple[int | str, ...]) -> tuple[int, ...]:
        """A shape attribute with its symbols replaced by this call's sizes."""
        return resolve_dims(shape, self.sizes)


ReferenceFn = Callable[[Sequence[np.ndarray], Any, EvalContext], "tuple[np.ndarray, ...] | np.ndarray"]
"""``reference(operands, attrs, ctx)``: float operands arrive as float64; results are rounded by the caller."""

GradFn = Callable[["Graph", "Node", Sequence["Value | None"], Sequence[bool]], Sequence["Value | None"]]
"""``grad(graph, node, output_cotangents, needed_per_operand) -> cotangent per operand (None: none)``."""

BatchFn = Callable[["Graph", "Node", Sequence["Value"], Sequence[bool], "Dim"], Sequence["Value"]]
"""``batch(graph, node, operands, batched, size) -> results``: ``node`` computed for ``size``
examples at once (``rlx.vmap``). A batched operand carries the examples on a new leading axis;
the others are ``node``'s own operands, shared by every example. Every result carries the
examples on its leading axis."""


def no_gradient(graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]) -> list[None]:
    """The gradient rule of ops whose results are not differentiable (bool or int results).

    Nothing flows back through them: an x read only through a comparison gets zeros, as in JAX.
    """
    return [None] * len(node.inputs)


def not_differentiable(
    graph: Graph, node: Node, cotangents: Sequence[Value | None], needed: Sequence[bool]
) -> list[None]:
    """The gradient rule of ops rlx cannot differentiate (yet): asking is an error naming the node."""
    raise RlxValueError(f"grad: {node.op} (node {node.id}) has no gradient rule; it cannot be on the path from xs to y")


@dataclass(frozen=True)
class IndexOperand:
    """An integer operand whose entries must lie in ``[0, limit)``; ``limit`` is read from the node
    (a dimension: symbolic where the table's rows are, resolved with each call's sizes).

    Ids that come from graph inputs or constants are checked before native code runs. Ids the
    graph computes (an ``argmax``, ``ids + 1``) are only known inside the call: ops whose kernels
    check every id they read memory with (``checked_in_kernel``: the row gathers) accept them and
    report the first bad one after the call; the others refuse them at compile time.
    """

    operand: str
    limit: Callable[[Node], Dim]
    meaning: str  # e.g. "token id" or "class index", for error messages
    checked_in_kernel: bool = False

    def describe(self, node: Node) -> str:
        """What these ids are, for error messages: ``token id of embedding (node 3) operand 'ids'``."""
        return f"{self.meaning} of {node.op} (node {node.id}) operand {self.operand!r}"


@dataclass(frozen=True)
class OpDef:
    """Everything rlx knows about one op. Register with :func:`register_op`.

    ``operands`` names the operands in slot order; a trailing ``?`` marks an optional operand
    (given or not; only trailing ones may be optional) and a ``*`` a variadic list (``concat``).
    ``no_grad`` names operands that never receive a gradient (mask tensors, indices).

    How an op is compiled is one of three things: an elementwise op has a ``scalar`` formula
    (``scalar(emitter, *operands, attrs)``, the emitter being codegen's lane arithmetic); a
    composite op has a ``decompose`` rule that rebuilds it from other ops (softmax from exp, max
    and sum), which the ``decompose`` pass applies so that the fusing codegen sees primitives and
    puts them back into one loop nest; every other op has a lowering in ``rlx.codegen``.
    """

    name: str
    operands: tuple[str, ...]
    attrs: type
    infer: InferFn
    reference: ReferenceFn
    grad: GradFn
    builder: Callable[..., Any] | None = None
    no_grad: frozenset[str] = frozenset()
    narrow: Callable[[Graph, Node, list[Value]], None] | None = None
    scalar: Callable[..., Any] | None = None
    decompose: Callable[[Graph, Node], tuple[Value, ...]] | None = None
    # How ``rlx.vmap`` batches the op (``rlx/ops/_batching.py``). None only for ops without
    # operands, which nothing batches.
    batch: BatchFn | None = None
    index_operands: tuple[IndexOperand, ...] = ()
    # Index operands that a node's attrs decide, not the op's signature: ``(slot, limit, meaning)``
    # for each (a programmable attention mod reading a tensor at a position another tensor holds).
    # Checked as ``index_operands`` are: inputs and constants before the call, computed ones refused.
    node_index_operands: Callable[[Node], Sequence[tuple[int, Dim, str]]] | None = None
    view: bool = False  # results only rearrange operand elements (reshape, transpose, ...)
    summary: str = field(default="", repr=False)

    @property
    def variadic(self) -> bool:
        return len(self.operands) == 1 and self.operands[0].endswith("*")

    def operand_name(self, slot: int) -> str:
        """The name of operand ``slot`` (``parts[2]`` for a variadic op)."""
        if self.variadic:
            return f"{self.operands[0].rstrip('*')}[{slot}]"
        if slot < len(self.operands):
            return self.operands[slot].rstrip("?")
        return f"operand {slot}"

    def slot_of(self, name: str) -> int:
        """The slot of the operand called ``name``."""
        names = [operand.rstrip("?*") for operand in self.operands]
        return names.index(name)

    def check_arity(self, what: str, count: int) -> None:
        """Raise ``RlxValueError`` if ``count`` operands do not fit the declared operands."""
        if self.variadic:
            if count < 1:
                raise RlxValueError(f"{what}: {self.name} takes at least one operand, got none")
            return
        required = sum(not operand.endswith("?") for operand in self.operands)
        if not required <= count <= len(self.operands):
            names = ", ".join(self.operands)
            raise RlxValueError(f"{what}: {self.name} takes operands ({names}), got {count}")


REGISTRY: dict[str, OpDef] = {}
"""Every op by name, in registration order. Populated when :mod:`rlx.ops` is imported."""


def register_op(definition: OpDef) -> OpDef:
    """Add ``definition`` to :data:`REGISTRY`; registering another op under the same name is refused."""
    existing = REGISTRY.get(definition.name)
    if existing is not None and existing is not definition:
        raise RlxValueError(f"an op named {definition.name!r} is already registered")
    REGISTRY[definition.name] = definition
    return definition


def op_def(name: str) -> OpDef:
    """The definition of op ``name`` (an ``OpKind``'s value)."""
    return REGISTRY[name]
