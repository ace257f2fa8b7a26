"""``rlx.torch.compile``: a whole rlx graph as a torch function, its backward from ``rlx.grad``."""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import rlx
from rlx.codegen.executable import Executable
from rlx.errors import RlxError, RlxTypeError, RlxValueError
from rlx.ir.dims import is_symbol
from rlx.ir.graph import Graph, Value
from rlx.ir.ops import OpKind
from rlx.torch._autograd import _eager_under_torch_compile
from rlx.torch._tensors import _array, _check_tensor, _tensor

_COTANGENT = "rlx_cotangent_"  # names of the backward graph's extra inputs and outputs
_GRAD = "rlx_grad_"
_SAVED = "rlx_saved_"  # values the training forward hands to the backward


@dataclass(frozen=True)
class _Training:
    """The backward graph cut in two where it reads the forward's values, as autograd does.

    ``forward`` computes the graph's outputs plus every forward value the backward reads (named
    ``saved``, in order); ``backward`` takes those values as inputs instead of recomputing the
    forward. A value whose shape an input cannot declare (a product of symbols, like ``2*S``
    from a reshape) is not saved: the backward recomputes it from what it reads.
    """

    forward: Executable
    backward: Executable
    saved: tuple[str, ...]
    grad_names: dict[str, str]  # input name -> its gradient's output name in ``backward``


def _saved_values(joint: Graph, cotangents: Iterable[str]) -> list[Value]:
    """The values of ``joint`` computed without any cotangent (forward values) that a node
    depending on a cotangent reads: what the backward needs from the forward.

    A view the backward reads (a weight's transpose for a matmul's gradient, a reshape) is not
    saved: what it views is, and the backward views it again, for free. Saving the view made
    the forward copy it out (on the char-LM example 28 of 46 saved values were views).
    """
    backward_values = {joint.inputs[name] for name in cotangents}
    read: dict[Value, None] = {}
    for node in joint.nodes:
        if any(value in backward_values for value in node.inputs):
            backward_values.update(node.outputs)
            for value in node.inputs:
                if value not in backward_values:
                    read[value] = None
    saved: dict[Value, None] = {}
    pending = list(reversed(read))
    while pending:
        value = pending.pop()
        op = value.node.op
        if op in (OpKind.INPUT, OpKind.CONSTANT) or value in saved:
            continue
        if op.definition.view:  # save what it views, in order
            pending.extend(reversed(value.node.inputs))
            continue
        saved[value] = None
    recomputed = _recomputed_for_free(saved)
    return [v for v in saved if v not in recomputed and all(isinstance(d, int) or is_symbol(d) for d in v.shape)]


def _recomputed_for_free(saved: Mapping[Value, None]) -> set[Value]:
    """The saved elementwise values whose operands are all at hand in the backward anyway
    (saved themselves, inputs, constants, or views of those): the backward recomputes them in
    its fused loops instead of reading them, and the forward does not write them out. Only one
    level deep (an operand recomputed itself keeps its consumer saved), so no chain of
    recomputation grows with the model's depth."""

    def at_hand(value: Value) -> bool:
        node = value.node
        if node.op in (OpKind.INPUT, OpKind.CONSTANT) or value in saved:
            return True
        return node.op.definition.view and all(at_hand(operand) for operand in node.inputs)

    def operands(value: Value) -> set[Value]:
        """The saved values an elementwise value reads, through views."""
        found: set[Value] = set()
        pending = list(value.node.inputs)
        while pending:
            operand = pending.pop()
            if operand in saved:
                found.add(operand)
            elif operand.node.op.definition.view:
                pending.extend(operand.node.inputs)
        return found

    candidates = {
        value
        for value in saved
        if value.node.op.definition.scalar is not None and all(at_hand(x) for x in value.node.inputs)
    }
    return {value for value in candidates if not operands(value) & candidates}


def _fresh(name: str, taken: Mapping[str, object]) -> str:
    """``name``, or ``name`` with the first numeric suffix not in ``taken`` (a backward graph of a
    backward graph names its cotangents after outputs that already carry these prefixes)."""
    fresh, suffix = name, 1
    while fresh in taken:
        fresh, suffix = f"{name}_{suffix}", suffix + 1
    return fresh


class CompiledGraph:
    """An rlx graph as a differentiable torch function: ``f(**tensors) -> {output name: tensor}``.

    The backward graph comes from ``rlx.grad`` of ``sum_i <output_i, d output_i>`` with respect to
    every float input. A call autograd records runs the training pair (:attr:`training`, compiled
    on the first such call): a forward that also returns the values the backward reads, and a
    backward that takes them instead of computing the forward again (:func:`_saved_values` says
    which values). Under ``create_graph=True`` the whole
    backward graph runs as a torch function of its own, so gradients differentiate again, to any
    order the graph's ops allow (attention's backward has no gradient of its own: an
    ``RlxError`` says so).
    """

    def __init__(self, graph: Graph) -> None:
        if not isinstance(graph, Graph):
            raise RlxTypeError(f"rlx.torch.compile expects an rlx.Graph, got {type(graph).__name__}")
        self.graph = graph.copy()
        self._backward: Executable | None = None
        self._backward_function: CompiledGraph | None = None
        # The backward graph's names: a cotangent input per float output, a gradient per input.
        self.cotangent_names: dict[str, str] = {}
        self.grad_names: dict[str, str] = {}
        self._trainings: dict[tuple[str, ...], _Training | None] = {}  # by the inputs given gradients
        self.names = list(self.graph.inputs)
        self.outputs = list(self.graph.outputs)

    @functools.cached_property
    def forward(self) -> Executable:
        """The graph alone, compiled on first use: a call autograd records runs the training
        pair instead, so a model that only trains never compiles it (a third of a convnet's
        first step)."""
        return rlx.compile(self.graph)

    def prepare(self, requiring_grad: Collection[str]) -> None:
        """Compile now what a call whose inputs ``requiring_grad`` require a gradient will run:
        the training pair for them (where the graph has one), else the forward. So a compile
        error is raised here, where a caller can still choose another way to run the graph."""
        wanted = tuple(name for name in self.float_inputs if name in requiring_grad)
        if self.training_for(wanted) is None:
            self.forward  # noqa: B018 (compiles it)

    @functools.cached_property
    def differentiable(self) -> bool:
        """Whether any float output depends on float inputs: there is a backward to compute."""
        graph = self.graph
        float_inputs = any(graph.inputs[name].dtype == np.float32 for name in self.names)
        return float_inputs and any(value.dtype == np.float32 for value in graph.outputs.values())

    def backward_executable(self) -> Executable:
        if self._backward is None:
            self._backward = rlx.compile(self.backward_graph)
        return self._backward

    def backward_function(self) -> CompiledGraph:
        """The backward graph as a torch function of its own, for ``create_graph=True``: its
        backward is ``rlx.grad`` of the backward graph, so gradients differentiate to any order."""
        if self._backward_function is None:
            self._backward_function = CompiledGraph(self.backward_graph)
        return self._backward_function

    @property
    def training(self) -> _Training | None:
        """:meth:`training_for` every float input."""
        return self.training_for(self.float_inputs)

    @property
    def float_inputs(self) -> tuple[str, ...]:
        return tuple(name for name in self.names if self.graph.inputs[name].dtype == np.float32)

    def training_for(self, wanted: tuple[str, ...]) -> _Training | None:
        """The forward that also returns what the backward reads, and that backward, for the
        gradients of the float inputs ``wanted`` (those that require one: a model's data and
        frozen weights get none, so their gradients are neither built nor computed). A training
        step computes the forward once (the backward graph alone recomputes it). None where the
        graph has no backward (no float output or input), or one ``rlx.grad`` cannot build (a
        backward graph with attention's backward in it, differentiated again): its error is
        raised when a backward runs, as before, not by the forward."""
        if wanted in self._trainings:
            return self._trainings[wanted]
        training = None
        if self.differentiable and wanted:
            try:
                joint, grad_names = self._backward_graph(wanted)
            except RlxError:
                joint = None
            if joint is not None:
                training = self._split(joint, grad_names)
        self._trainings[wanted] = training
        return training

    def _split(self, joint: Graph, grad_names: dict[str, str]) -> _Training:
        saved = _saved_values(joint, self.cotangent_names.values())
        names: list[str] = []
        forward = joint.copy()
        for name in list(forward.outputs):
            forward.remove_output(name)
        for name, value in self.graph.outputs.items():
            forward.output(**{name: Value(forward.node(value.node.id), value.index)})
        backward = joint.copy()
        for value in saved:
            name = _fresh(f"{_SAVED}{len(names)}", {**forward.outputs, **backward.inputs})
            names.append(name)
            forward.output(**{name: Value(forward.node(value.node.id), value.index)})
            original = Value(backward.node(value.node.id), value.index)
            backward.replace_all_uses_with(original, backward.input(name, value.shape, value.dtype))
        return _Training(rlx.compile(forward), rlx.compile(backward), tuple(names), grad_names)

    @functools.cached_property
    def backward_graph(self) -> Graph:
        """The graph's inputs, a cotangent input per float output, and a gradient output per
        float input (the forward's outputs are not outputs here: a backward graph of this graph,
        for a second derivative, names its cotangents after them)."""
        graph, grad_names = self._backward_graph(self.float_inputs)
        self.grad_names.update(grad_names)
        return graph

    def _backward_graph(self, wanted: tuple[str, ...]) -> tuple[Graph, dict[str, str]]:
        """The backward graph with gradients of the inputs ``wanted`` only, and their names."""
        g = self.graph.copy()
        total: Value | None = None
        for name, value in list(g.outputs.items()):
            g.remove_output(name)
            if value.dtype == np.float32:
                cotangent = self.cotangent_names[name] = _fresh(_COTANGENT + name, g.inputs)
                term = g.sum(value * g.input(cotangent, value.shape))
                total = term if total is None else total + term
        xs = [g.inputs[name] for name in wanted]
        if total is None or not xs:
            raise RlxValueError("rlx.torch.compile: nothing to differentiate (no float outputs or no float inputs)")
        grad_names = {}
        for x, grad in zip(xs, rlx.grad(g, total, xs), strict=True):
            name = grad_names[x.node.attrs.name] = _fresh(_GRAD + x.node.attrs.name, g.outputs)
            g.output(**{name: grad})
        return g, grad_names

    @_eager_under_torch_compile
    def __call__(self, *args: Any, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        if args:
            raise RlxTypeError(f"pass the inputs by name: f({', '.join(f'{n}=...' for n in self.names)})")
        missing = [n for n in self.names if n not in tensors]
        unknown = [n for n in tensors if n not in self.names]
        if missing or unknown:
            raise rlx.RlxKeyError(f"expected inputs {self.names}; missing {missing}, unknown {unknown}")
        ordered = []
        for name in self.names:
            declared = self.graph.inputs[name].dtype
            tensor = _check_tensor(tensors[name], name, kinds="float" if declared == np.float32 else "any")
            ordered.append(tensor if declared == np.float32 else _index_tensor(tensor, declared, name))
        recorded = torch.is_grad_enabled() and any(t.requires_grad for t in ordered)  # a backward may come
        results = _GraphFunction.apply(self, recorded, *ordered)
        return dict(zip(self.outputs, results, strict=True))


_INDEX_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def _index_tensor(tensor: torch.Tensor, declared: np.dtype, name: str) -> torch.Tensor:
    """An integer tensor in the integer dtype its input declares: torch makes int64 indices by
    default, and a graph may declare int32 ones. Converted only when every value fits, so an id
    past the int32 range is an error here, never a wrapped-around valid id."""
    want = _INDEX_DTYPES.get(np.dtype(declared))
    if want is None or tensor.dtype == want or tensor.is_floating_point() or tensor.dtype == torch.bool:
        return tensor  # (bool inputs, and floats where ints are declared: the binder names the mismatch)
    info = torch.iinfo(want)
    if tensor.numel() and (int(tensor.min()) < info.min or int(tensor.max()) > info.max):
        raise RlxValueError(
            f"input {name!r}: values {int(tensor.min())}..{int(tensor.max())} do not fit the declared {want}"
        )
    return tensor.to(want)


class _GraphFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, compiled: CompiledGraph, recorded: bool, *tensors: torch.Tensor) -> Any:
        arrays = {name: _array(t) for name, t in zip(compiled.names, tensors, strict=True)}
        ctx.saved_arrays, ctx.backward_exe, ctx.grad_names = {}, None, None
        wanted = tuple(
            name
            for name, t in zip(compiled.names, tensors, strict=True)
            if t.requires_grad and compiled.graph.inputs[name].dtype == np.float32
        )
        training = compiled.training_for(wanted) if recorded else None
        if training is not None:
            # Training: the forward also returns what the backward reads, held until it runs.
            result = training.forward(**arrays)
            ctx.saved_arrays = {name: result.pop(name) for name in training.saved}
            ctx.backward_exe, ctx.grad_names = training.backward, training.grad_names
        else:
            result = compiled.forward(**arrays)
        ctx.compiled = compiled
        # Saved as tensors, so torch refuses a backward after any of them was modified in place.
        ctx.save_for_backward(*tensors)
        ctx.shapes = {name: array.shape for name, array in result.items()}  # symbolic dims resolved
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.set_materialize_grads(False)
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)
        outs = []
        for name in compiled.outputs:
            array = result[name]
            outs.append(_tensor(array, dtype) if array.dtype == np.float32 else torch.from_numpy(array))
        non_float = [o for o in outs if not o.is_floating_point()]
        if non_float:
            ctx.mark_non_differentiable(*non_float)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor | None) -> Any:
        compiled: CompiledGraph = ctx.compiled
        inputs = _backward_inputs(compiled, ctx, cotangents)
        dtypes = dict(zip(compiled.names, ctx.dtypes, strict=True))
        wanted = [name for name, needed in zip(compiled.names, ctx.needs_input_grad[2:], strict=True) if needed]
        if torch.is_grad_enabled():  # create_graph=True: the backward graph runs as a torch function
            function = compiled.backward_function()
            grads = function(**{name: inputs[name] for name in function.names})
            found = {name: grads[compiled.grad_names[name]].to(dtypes[name]) for name in wanted}
        else:
            # From the values the training forward saved, else the backward graph that recomputes them.
            exe, grad_names = ctx.backward_exe, ctx.grad_names
            if exe is None or not set(wanted) <= set(grad_names):
                exe, grad_names = compiled.backward_executable(), compiled.grad_names
            arrays = {name: _array(tensor) for name, tensor in inputs.items()} | ctx.saved_arrays
            results = exe(**{name: arrays[name] for name in exe.graph.inputs})
            found = {name: _tensor(results[grad_names[name]], dtypes[name]) for name in wanted}
        return (None, None, *(found.get(name) for name in compiled.names))


def _backward_inputs(
    compiled: CompiledGraph, ctx: Any, cotangents: tuple[torch.Tensor | None, ...]
) -> dict[str, torch.Tensor]:
    """What backward graphs read: the forward's inputs, and a cotangent per float output (zeros
    for one autograd left undefined); each backward takes the ones it declares."""
    if not compiled.cotangent_names:
        compiled.backward_graph  # noqa: B018  (built on first use, naming the cotangents)
    inputs = dict(zip(compiled.names, ctx.saved_tensors, strict=True))
    for name, ct in zip(compiled.outputs, cotangents, strict=True):
        if name in compiled.cotangent_names:
            if ct is None:  # float32 whatever torch's default dtype
                ct = torch.zeros(ctx.shapes[name], dtype=torch.float32, device="cpu")
            inputs[compiled.cotangent_names[name]] = ct
    return inputs


def compile(graph: Graph) -> CompiledGraph:
    """Any rlx graph as a differentiable torch function (inputs by name, dict of tensors out).
    Its forward is compiled here (a graph that does not compile fails here, not at a call)."""
    compiled = CompiledGraph(graph)
    compiled.prepare(())
    return compiled
