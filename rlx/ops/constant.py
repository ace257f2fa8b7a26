"""Graph inputs and constants: the two ops without operands."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.opdef import EvalContext, OpDef, no_gradient, register_op
from rlx.ir.types import DTYPE_NAMES, TensorType, as_dtype
from rlx.ops._common import op_kind

if TYPE_CHECKING:
    from rlx.config import RuntimeConfig
    from rlx.ir.graph import Graph, Value


@dataclass(frozen=True)
class InputAttrs:
    """A graph input: its name (unique in the graph); shape and dtype are the node's type."""

    name: str


def _input_infer(what: str, inputs: Sequence[TensorType], attrs: InputAttrs) -> tuple[TensorType, ...]:
    raise RlxValueError(f"{what}: input nodes carry their own type; declare them with Graph.input(name, shape)")


def _input_reference(args: Sequence[np.ndarray], attrs: InputAttrs, ctx: EvalContext) -> np.ndarray:
    return ctx.inputs[attrs.name]


INPUT = register_op(
    OpDef("input", (), InputAttrs, _input_infer, _input_reference, no_gradient, summary="a named graph input")
)


@dataclass(frozen=True, eq=False)
class ConstantData:
    """An immutable array baked into the graph. Equal data compares and hashes equal.

    Printed as a plain float for a float32 scalar (``2.0``), else as ``"f32[2,3]:<base64>"``,
    which :meth:`parse` reads back bit for bit.
    """

    array: np.ndarray

    def __post_init__(self) -> None:
        array = np.array(self.array, copy=True, order="C")
        array.flags.writeable = False
        object.__setattr__(self, "array", array)

    @property
    def type(self) -> TensorType:
        return TensorType(self.array.shape, self.array.dtype)

    def _key(self) -> tuple[object, ...]:
        return (self.array.shape, self.array.dtype.str, self.array.tobytes())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConstantData) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        if self.array.shape == () and self.array.dtype == np.float32:
            return repr(float(self.array))
        data = base64.b64encode(self.array.tobytes()).decode("ascii")
        return f'"{self.type}:{data}"'

    def __repr__(self) -> str:
        return f"ConstantData({self})"

    @staticmethod
    def parse(text: str) -> ConstantData:
        """Read what ``str()`` printed: a float, or a quoted ``"<type>:<base64>"``."""
        if not (text.startswith('"') and text.endswith('"')):
            return ConstantData(np.array(float(text), dtype=np.float32))
        head, sep, data = text[1:-1].partition(":")
        dtype_name, _, dims = head.partition("[")
        if not sep or dtype_name not in DTYPE_NAMES or not dims.endswith("]"):
            raise ValueError(f'expected a constant like "f32[2,3]:<base64>", got {text[:40]}')
        shape = tuple(int(d) for d in dims[:-1].split(",") if d)
        try:
            raw = base64.b64decode(data, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"bad base64 in constant: {exc}") from None
        dtype = DTYPE_NAMES[dtype_name]
        if len(raw) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise ValueError(f"constant data holds {len(raw)} bytes, not the {head} its type says")
        return ConstantData(np.frombuffer(raw, dtype=dtype).reshape(shape))


@dataclass(frozen=True)
class ConstantAttrs:
    value: ConstantData


def _constant_infer(what: str, inputs: Sequence[TensorType], attrs: ConstantAttrs) -> tuple[TensorType, ...]:
    if not isinstance(attrs.value, ConstantData):
        raise RlxTypeError(f"{what}: value must be ConstantData, got {type(attrs.value).__name__}")
    return (attrs.value.type,)


def _constant_reference(args: Sequence[np.ndarray], attrs: ConstantAttrs, ctx: EvalContext) -> np.ndarray:
    return attrs.value.array


def constant(graph: Graph, value: object, dtype: object = None) -> Value:
    """A constant baked into the graph: a Python number (float32 scalar) or an array.

    Arrays and NumPy scalars keep their dtype unless ``dtype`` is given; float64 and float16
    become float32 (rlx computes in float32), as ``torch.tensor`` makes float64 data float32.
    """
    if isinstance(value, (bool, np.bool_)) and dtype is None:
        array = np.array(value, dtype=np.bool_)
    elif isinstance(value, (int, float)) and dtype is None:  # a Python number is a float32 operand
        array = np.array(value, dtype=np.float32)
    else:
        try:
            array = np.asarray(value)
        except Exception as exc:
            raise RlxTypeError(f"constant: cannot make an array of {type(value).__name__}: {exc}") from None
        if array.dtype == object:
            raise RlxTypeError(f"constant: expected numbers or an array, got {type(value).__name__}")
        if dtype is not None:
            array = array.astype(as_dtype(dtype))
        elif array.dtype in (np.float64, np.float16):
            array = array.astype(np.float32)
        as_dtype(array.dtype)  # refuse complex, strings, ...
    if 0 in array.shape:
        raise RlxValueError(f"constant: every dimension must be >= 1, got shape {array.shape}")
    return graph.add_node(op_kind("constant"), (), ConstantAttrs(ConstantData(array))).outputs[0]


CONSTANT = register_op(
    OpDef(
        "constant",
        (),
        ConstantAttrs,
        _constant_infer,
        _constant_reference,
        no_gradient,
        builder=constant,
        summary="an array baked into the graph",
    )
)


# ----------------------------------------------------------------------------- config values

CONFIG_FIELDS = ("attn_mask_neg_inf", "mask_binary_threshold")
"""The :class:`rlx.RuntimeConfig` fields a graph may read as values: those of SPEC 1's masks."""


@dataclass(frozen=True)
class ConfigValueAttrs:
    """A float field of the :class:`rlx.RuntimeConfig` the graph is compiled (or run) with."""

    field: str


def _config_value_infer(what: str, inputs: Sequence[TensorType], attrs: ConfigValueAttrs) -> tuple[TensorType, ...]:
    if attrs.field not in CONFIG_FIELDS:
        names = ", ".join(repr(name) for name in CONFIG_FIELDS)
        raise RlxValueError(f"{what}: field must be one of {names}, got {attrs.field!r}")
    return (TensorType((), np.dtype(np.float32)),)


def _config_value_reference(args: Sequence[np.ndarray], attrs: ConfigValueAttrs, ctx: EvalContext) -> np.ndarray:
    return np.array(getattr(ctx.config, attrs.field), dtype=np.float64)


def config_value(graph: Graph, field: str) -> Value:
    """A float32 scalar: the ``field`` of the ``RuntimeConfig`` the graph is compiled with (or run
    with, by ``rlx.reference.run``), such as ``"attn_mask_neg_inf"``: what a fixed mask writes
    into the scores it hides. Graphs that restate attention in other ops (its second-order
    gradients) read the mask's constants here, so they follow the config as the attention
    kernels do; ``rlx.compile`` makes it a constant before any pass runs."""
    if not isinstance(field, str):
        raise RlxTypeError(f"config_value: field must be a str, got {type(field).__name__}")
    return graph.add_node(op_kind("config_value"), (), ConfigValueAttrs(field)).outputs[0]


def resolve_config_values(graph: Graph, config: RuntimeConfig) -> bool:
    """Replace every ``config_value`` node of ``graph`` by a constant of ``config``'s value, in
    place (what ``rlx.compile`` does first); True if any was."""
    nodes = [node for node in graph.nodes if node.op.value == "config_value"]
    for node in nodes:
        value = constant(graph, float(getattr(config, node.attrs.field)))
        graph.replace_all_uses_with(node.outputs[0], value)
        graph.erase(node)
    return bool(nodes)


CONFIG_VALUE = register_op(
    OpDef(
        "config_value",
        (),
        ConfigValueAttrs,
        _config_value_infer,
        _config_value_reference,
        no_gradient,
        builder=config_value,
        summary="a float field of the RuntimeConfig, resolved when the graph compiles",
    )
)
