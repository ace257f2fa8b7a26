"""Every registered op is complete: attrs, shape rule, reference, gradient, builder, sample."""

from __future__ import annotations

import dataclasses

import pytest
from op_samples import SAMPLES

from rlx import Graph, OpKind
from rlx.ir.opdef import REGISTRY, no_gradient, not_differentiable

OPS = sorted(REGISTRY)


def test_op_kind_has_one_member_per_registered_op() -> None:
    assert sorted(op.value for op in OpKind) == OPS
    assert next(iter(OpKind)) is OpKind.INPUT
    for op in OpKind:
        assert op.definition.name == op.value
        assert str(op) == op.value


@pytest.mark.parametrize("name", OPS)
def test_definition_is_complete(name: str) -> None:
    definition = REGISTRY[name]
    assert dataclasses.is_dataclass(definition.attrs) and definition.attrs.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert callable(definition.infer)
    assert callable(definition.reference)
    assert callable(definition.grad), f"{name} has no gradient rule (use no_gradient or not_differentiable)"
    operand_names = [operand.rstrip("?*") for operand in definition.operands]
    assert len(set(operand_names)) == len(operand_names)
    assert definition.no_grad <= set(operand_names)
    for index in definition.index_operands:
        assert index.operand in operand_names
    if name != "input":
        assert definition.builder is not None
        assert getattr(Graph, name).__wrapped_builder__ is definition.builder, f"g.{name} is not the registered builder"
        assert definition.builder.__doc__, f"the builder of {name} has no docstring"


@pytest.mark.parametrize("name", OPS)
def test_every_op_has_a_sample(name: str) -> None:
    assert any(sample.op == name for sample in SAMPLES), f"add a sample for {name} to tests/op_samples.py"


def test_gradient_sentinels_are_used_on_purpose() -> None:
    """Ops without gradients are those with non-float results, the piecewise constant ones (zero
    almost everywhere, as torch's), or the listed opaque ones."""
    opaque = {name for name, d in REGISTRY.items() if d.grad is not_differentiable}
    assert opaque == {"fused_elementwise"}
    silent = {name for name, d in REGISTRY.items() if d.grad is no_gradient}
    assert silent == {
        "input",
        "constant",
        "config_value",
        "sign",
        "stop_gradient",
        "custom_vjp_cotangent",
        "floor",
        "ceil",
        "trunc",
        "round",
        "floor_divide",
        "less",
        "less_equal",
        "greater",
        "greater_equal",
        "equal",
        "not_equal",
        "logical_and",
        "logical_or",
        "logical_not",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "bitwise_not",
        "left_shift",
        "right_shift",
        "one_hot",
        "argmax",
        "argmin",
    }
