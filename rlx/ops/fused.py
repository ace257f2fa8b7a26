"""``fused_elementwise``: a chain of elementwise ops as one node, made by the ``fuse-elementwise`` pass.

The node's ``program`` lists the chain's ops in order; each step names an op and its operands,
``%iN`` for the node's N-th input and ``%tN`` for the result of step N; the last step is the
node's result. Shape rule, reference and scalar formula are those of the steps' own ops applied
in order, so a fused chain means exactly what the chain meant (broadcasting composes, so every
step can be evaluated at the fused result's index). It is made after autodiff and is not
differentiated again.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rlx.errors import RlxValueError
from rlx.ir.opdef import REGISTRY, EvalContext, OpDef, not_differentiable, register_op
from rlx.ir.types import TensorType
from rlx.ops._batching import batch_by_unrolling
from rlx.ops._common import op_kind

if TYPE_CHECKING:
    from rlx.ir.graph import Graph, Value

_STEP = re.compile(r"^([a-z_]+)\(((?:%[it]\d+)(?:, ?%[it]\d+)*)\)$")


@dataclass(frozen=True)
class Step:
    op: str
    operands: tuple[tuple[str, int], ...]  # ("i", n): input n; ("t", n): result of step n


@dataclass(frozen=True)
class Program:
    """The steps of a fused chain; printed as ``"mul(%i0, %i1); exp(%t0)"``."""

    steps: tuple[Step, ...]

    def __str__(self) -> str:
        return (
            '"' + "; ".join(f"{s.op}({', '.join(f'%{kind}{n}' for kind, n in s.operands)})" for s in self.steps) + '"'
        )

    @staticmethod
    def parse(text: str) -> Program:
        body = text[1:-1] if text.startswith('"') and text.endswith('"') else text
        steps = []
        for part in body.split(";"):
            match = _STEP.match(part.strip())
            if match is None:
                raise ValueError(f"bad fused step {part.strip()!r}; expected like mul(%i0, %t1)")
            refs = tuple((ref[1], int(ref[2:])) for ref in re.findall(r"%[it]\d+", match.group(2)))
            steps.append(Step(match.group(1), refs))
        return Program(tuple(steps))


@dataclass(frozen=True)
class FusedAttrs:
    program: Program


def _check(what: str, attrs: FusedAttrs, inputs: int) -> None:
    if not isinstance(attrs.program, Program) or not attrs.program.steps:
        raise RlxValueError(f"{what}: the program has no steps")
    for index, step in enumerate(attrs.program.steps):
        definition = REGISTRY.get(step.op)
        if definition is None or definition.scalar is None:
            raise RlxValueError(f"{what}: step {index} ({step.op}) is not an elementwise op with a scalar formula")
        for kind, n in step.operands:
            if (kind == "i" and not 0 <= n < inputs) or (kind == "t" and not 0 <= n < index):
                raise RlxValueError(f"{what}: step {index} reads %{kind}{n}, which does not exist there")


def _run(attrs: FusedAttrs, inputs: Sequence[Any], apply: Any) -> Any:
    results: list[Any] = []
    for step in attrs.program.steps:
        operands = [inputs[n] if kind == "i" else results[n] for kind, n in step.operands]
        results.append(apply(step, operands))
    return results[-1]


def _infer(what: str, inputs: Sequence[TensorType], attrs: FusedAttrs) -> tuple[TensorType, ...]:
    _check(what, attrs, len(inputs))

    def apply(step: Step, operands: list[TensorType]) -> TensorType:
        definition = REGISTRY[step.op]
        definition.check_arity(what, len(operands))
        return definition.infer(f"{what} step {step.op}", operands, _default_attrs(step.op))[0]

    return (_run(attrs, inputs, apply),)


def _reference(args: Sequence[np.ndarray], attrs: FusedAttrs, ctx: EvalContext) -> np.ndarray:
    def apply(step: Step, operands: list[np.ndarray]) -> np.ndarray:
        result = REGISTRY[step.op].reference(operands, _default_attrs(step.op), ctx)
        return np.asarray(result[0] if isinstance(result, tuple) else result)

    return _run(attrs, args, apply)


def _scalar(emitter: Any, *operands: Any) -> Any:
    *values, attrs = operands

    def apply(step: Step, ops: list[Any]) -> Any:
        formula = REGISTRY[step.op].scalar
        assert formula is not None  # _check admitted only ops with a scalar formula
        return formula(emitter, *ops, _default_attrs(step.op))

    return _run(attrs, values, apply)


def typed_scalar(
    emitter: Any, values: Sequence[Any], attrs: FusedAttrs, types: Sequence[TensorType], finish: Any
) -> Any:
    """The scalar formula with each step's result type known: ``finish(lanes, dtype)`` after
    every step (the code generator wraps int32 results there, which it computes in 64 bits)."""

    def apply(step: Step, ops: list[tuple[Any, TensorType]]) -> tuple[Any, TensorType]:
        definition = REGISTRY[step.op]
        attrs_ = _default_attrs(step.op)
        assert definition.scalar is not None
        ty = definition.infer(step.op, [t for _, t in ops], attrs_)[0]
        return finish(definition.scalar(emitter, *(v for v, _ in ops), attrs_), ty.dtype), ty

    return _run(attrs, list(zip(values, types, strict=True)), apply)[0]


def _default_attrs(op: str) -> Any:
    """The attrs of a step: only ops whose attrs are all defaulted can be fused (``NoAttrs``)."""
    return REGISTRY[op].attrs()


def fused_elementwise(graph: Graph, inputs: Sequence[Value], program: str | Program) -> Value:
    """A fused chain of elementwise ops over ``inputs`` (normally made by ``fuse-elementwise``)."""
    parsed = program if isinstance(program, Program) else Program.parse(program)
    return graph.add_node(op_kind("fused_elementwise"), list(inputs), FusedAttrs(parsed)).outputs[0]


register_op(
    OpDef(
        "fused_elementwise",
        ("inputs*",),
        FusedAttrs,
        _infer,
        _reference,
        not_differentiable,
        builder=fused_elementwise,
        batch=batch_by_unrolling,
        scalar=_scalar,
        summary="a chain of elementwise ops in one node",
    )
)
