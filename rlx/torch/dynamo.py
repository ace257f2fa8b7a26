"""``torch.compile(model, backend="rlx")``: TorchDynamo graphs compiled by rlx.

TorchDynamo captures a model's forward as an FX graph of torch calls (``F.linear``,
``F.layer_norm``, ``x.view(...)``, ``F.scaled_dot_product_attention``, ``x + y``) and hands it
to a backend with example inputs. This backend translates the graph into an rlx graph, one
rlx op (or a few) per torch call, and compiles it with :func:`rlx.torch.compile`, whose
backward comes from ``rlx.grad``: parameters that require gradients get them through torch
autograd as usual, so a training loop with a torch optimizer runs unchanged.

Sizes TorchDynamo makes dynamic (the second length it sees) become rlx symbols, so one
compilation serves every length; ``torch.arange`` of such a size is an input the wrapper makes
per call. Calls on constants only (``torch.tril(torch.ones(S, S))``) are computed once, here.
The translation of each torch call lives in :mod:`rlx.torch._fx_calls`.

Dropout while training draws its keep masks in the wrapper, per call, from torch's generator
and in the graph's order, as eager torch draws them (SDPA with ``dropout_p`` runs torch's math
path on rlx to have a mask to draw). A graph rlx cannot express in full (an op it lacks, a dtype
it does not compute in) runs in eager PyTorch instead, with one warning that names the first
call rlx could not take: a model always runs, and correctly.
:data:`fallbacks` lists those reasons and :data:`stats` counts both kinds of graph.

The backend is registered with TorchDynamo by name (the ``torch_dynamo_backends`` entry point),
so ``backend="rlx"`` and ``backend=rlx.torch.backend`` are the same.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from rlx.errors import RlxError
from rlx.ir.dims import Size, poly
from rlx.ir.graph import Graph, Value
from rlx.ops.arrays import positions
from rlx.torch import _fx_extras, _fx_sorting
from rlx.torch._fx_calls import (
    DTYPES,
    EXPECTED_SHAPE,
    FUNCTIONS,
    HALF,
    MAKE_RANGE,
    METHODS,
    RANGES,
    SameSizes,
    Unsupported,
    check_kwargs,
    constant_of,
    rlx_dim,
    symbolic_size,
)
from rlx.torch.graphs import CompiledGraph

# Every call the translation knows, by target: the common ones, then the less common.
_FUNCTIONS = {**FUNCTIONS, **_fx_extras.FUNCTIONS, **_fx_sorting.FUNCTIONS}
_METHODS = {**METHODS, **_fx_extras.METHODS, **_fx_sorting.METHODS}

fallbacks: list[str] = []
"""Why each graph that ran in eager PyTorch did (first unsupported call), in order."""
stats = {"compiled": 0, "eager": 0}
"""Graphs the backend compiled with rlx, and graphs it left to eager PyTorch."""


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """A TorchDynamo backend: ``torch.compile(model, backend=rlx.torch.backend)``.

    Returns a function that runs the graph compiled by rlx, or ``gm.forward`` (eager PyTorch,
    with a warning naming why) where the graph holds something rlx does not express, or where
    its translation failed unforeseen (the warning names the exception: a model still runs).
    """
    merges: dict[str, str] = {}
    try:
        for _ in range(16):
            try:
                compiled = _Translation(gm, example_inputs, merges).compiled()
                break
            except SameSizes as same:
                merges[same.first] = same.second
        else:
            raise Unsupported(f"more dynamic sizes to merge than expected ({merges})")
        stats["compiled"] += 1
        return compiled
    except (Unsupported, RlxError) as why:
        reason = str(why)
    except Exception as why:  # a translation that failed in a way nobody foresaw: torch runs it
        reason = f"the translation failed ({type(why).__name__}: {why})"
    fallbacks.append(reason)
    stats["eager"] += 1
    warnings.warn(f"rlx backend: this graph runs in eager PyTorch: {reason}", stacklevel=2)
    return gm.forward  # type: ignore[no-any-return]


class _Translation:
    """One FX graph as an rlx graph: each FX node's value (an rlx Value or a Python value)."""

    def __init__(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], merges: dict[str, str] | None = None
    ) -> None:
        self.gm = gm
        self.example_inputs = example_inputs
        # Dynamic sizes taken as one (first -> second), checked equal on every call, and where
        # each original size is found in a call's arguments (for that check).
        self.merges = dict(merges or {})
        self.original_sources: dict[str, tuple[int, int | None]] = {}
        self.widened: set[int] = set()  # placeholders of half precision, passed as float32
        self.pinned: dict[int, float] = {}  # placeholders of float scalars, by the value assumed
        self.graph = Graph("dynamo")
        self.env: dict[torch.fx.Node, Any] = {}
        self.inputs: list[str | None] = []  # rlx input name per placeholder (None: a size)
        self.size_symbols: set[str] = set()  # symbols of the sizes TorchDynamo passes as inputs
        # Inputs the wrapper computes per call from the sizes (``torch.arange(S)`` of a dynamic S):
        # name -> (start, end, dtype) as polynomials in the symbols.
        self.ranges: dict[str, tuple[int | Size, int | Size, torch.dtype]] = {}
        self.range_starts: dict[Value, int | Size] = {}
        # Random inputs the wrapper draws per call with torch's generator, in the order the graph
        # draws them (as eager torch would): dropout's keep masks and torch.rand/randn/randint.
        # name -> (shape as polynomials, Draw).
        self.draws: dict[str, tuple[tuple[int | Size, ...], Draw]] = {}
        # Nodes that name one tensor updated in place (``x += y`` and x), bound to its last value.
        self.aliases: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        # Inputs updated in place (running statistics): placeholder by position; the wrapper
        # copies their final values into the caller's tensors after each call.
        self.mutated: dict[int, torch.fx.Node] = {}
        placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise Unsupported(f"{len(placeholders)} placeholders for {len(example_inputs)} example inputs")
        for node, example in zip(placeholders, example_inputs, strict=True):
            if isinstance(example, torch.Tensor) and example.dtype == torch.float64 and example.ndim == 0:
                # A Python float TorchDynamo passes as a tensor (dynamic=True makes every float a
                # graph input: a norm's eps): its value now, checked on every call.
                self.pinned[len(self.inputs)] = float(example)
                self.inputs.append(None)
                self.env[node] = float(example)
                continue
            self.env[node] = self._placeholder(node, node.meta.get("example_value", example))
        declared = {name for value in self.graph.inputs.values() for name in value.type.symbols}
        if self.size_symbols - declared:
            unbound = ", ".join(sorted(self.size_symbols - declared))
            raise Unsupported(f"the dynamic size {unbound} is no tensor input's dimension")
        token = RANGES.set(self.range_starts)
        maker = MAKE_RANGE.set(self._arange)
        try:
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "output":
                    self.results = self._load(node.args[0])
                    break
                self.env[node] = self._node(node)
        finally:
            RANGES.reset(token)
            MAKE_RANGE.reset(maker)

    def _placeholder(self, node: torch.fx.Node, example: Any) -> Any:
        """A tensor input, or a dynamic size (a symbol its tensors' shapes name, bound per call)."""
        if isinstance(example, torch.SymInt):
            size = symbolic_size(example)
            if not isinstance(size, Size) or len(size.symbols) != 1 or size != Size.symbol(size.symbols[0]):
                raise Unsupported(f"input {node.name} is the size {example}, not a plain symbol")
            self.original_sources.setdefault(size.symbols[0], (len(self.inputs), None))
            symbol = self._final(size.symbols[0])
            self.size_symbols.add(symbol)
            self.inputs.append(None)
            return Size.symbol(symbol)
        if not isinstance(example, torch.Tensor):
            raise Unsupported(f"input {node.name} is a {type(example).__name__}, not a tensor")
        half = example.dtype in HALF  # computed in float32: the wrapper converts it per call
        if half:
            self.widened.add(len(self.inputs))
        if example.device.type != "cpu" or (example.dtype not in DTYPES and not half):
            raise Unsupported(
                f"input {node.name} is {example.dtype} on {example.device}; rlx takes CPU float32/int/bool"
            )
        sizes = [symbolic_size(d) for d in example.shape]
        for axis, size in enumerate(sizes):
            if isinstance(size, Size) and len(size.terms) == 1 and size == Size.symbol(size.symbols[0]):
                self.original_sources.setdefault(size.symbols[0], (len(self.inputs), axis))
        shape = tuple(rlx_dim(self._merged(size)) for size in sizes)
        name = f"in{len(self.inputs)}"
        self.inputs.append(name)
        return self.graph.input(name, shape, dtype="float32" if half else DTYPES[example.dtype])

    def _output_nodes(self, count: int) -> list[torch.fx.Node | None]:
        """The FX nodes the graph returns (None where an output is not a node), in order."""
        output = next(node for node in self.gm.graph.nodes if node.op == "output")
        returned = output.args[0]
        nodes = list(returned) if isinstance(returned, (tuple, list)) else [returned]
        found = [n if isinstance(n, torch.fx.Node) else None for n in nodes]
        return found if len(found) == count else [None] * count

    def _merged(self, size: int | Size) -> int | Size:
        """``size`` with each merged symbol replaced by the one it was merged into."""
        if isinstance(size, int) or not set(size.symbols) & set(self.merges):
            return size
        terms: dict[tuple[str, ...], int] = {}
        for monomial, coefficient in size.terms:
            renamed = tuple(sorted(self._final(name) for name in monomial))
            terms[renamed] = terms.get(renamed, 0) + coefficient
        return Size.make(terms)

    def _final(self, name: str) -> str:
        while name in self.merges:
            name = self.merges[name]
        return name

    def _load(self, arg: Any) -> Any:
        """An FX argument with its nodes replaced by their values."""
        return torch.fx.node.map_arg(arg, lambda n: self.env[n])

    def _node(self, node: torch.fx.Node) -> Any:
        key = str(node.target) if node.op == "call_method" else node.target
        if node.op in ("call_function", "call_method") and key in _IN_PLACE:
            return self._in_place(node, _IN_PLACE[key])
        return self._call(node, node.target)

    def _in_place(self, node: torch.fx.Node, target: Any) -> Any:
        """An in-place call (``x += y``, ``x.masked_fill_(m, 0)``, ``x[..., 0] = v``) as the
        out-of-place one, its result bound to the updated tensor's node too, so every later read
        of it sees the new values (see :meth:`_check_update` for the updates left to torch)."""
        updated = node.args[0] if node.args else None
        if isinstance(updated, torch.fx.Node) and _augmented(updated):
            return self._call(node, target)  # ``x[i] += y``: the part's new value, which a setitem writes back
        group = self._check_update(node, updated)
        value = self._call(node, target)
        self._bind(node, group, value)
        return None if node.target is operator.setitem else value  # a setitem returns nothing

    def _check_update(self, node: torch.fx.Node, updated: Any) -> list[torch.fx.Node]:
        """The names of the tensor ``node`` updates in place, or ``Unsupported`` where the update
        could not be a new value: of a parameter that requires a gradient, of a view made in the
        graph (its base would have to see it), or of a tensor sharing its memory with another
        (a view, ``y.contiguous()`` or ``y.float()`` of it, or it of them) that is an input or a
        buffer, or that is read after the update. (One made after the update is made from the
        new value, as in torch.) A graph input updated (a batch norm's running statistics, a
        counter) becomes an output the wrapper copies into the caller's tensor."""
        name = getattr(node.target, "__name__", str(node.target))
        if not isinstance(updated, torch.fx.Node) or updated.op not in ("call_function", "call_method", "placeholder"):
            raise Unsupported(f"{name} of {updated!r}")
        example = updated.meta.get("example_value")
        if updated.op == "placeholder":
            position = [n for n in node.graph.nodes if n.op == "placeholder"].index(updated)
            if not isinstance(example, torch.Tensor) or example.requires_grad or self.inputs[position] is None:
                raise Unsupported(f"{name} of a graph input that requires a gradient")
            self.mutated[position] = updated
        elif not isinstance(example, torch.Tensor) or example._is_view():
            raise Unsupported(f"{name} of a view (the update would have to reach its base)")
        group = self.aliases.get(updated, [updated])
        storage = StorageWeakRef(example.untyped_storage())
        names = [*group, node]  # the tensor's names once this update is made
        order = {n: i for i, n in enumerate(node.graph.nodes)}
        for other in node.graph.nodes:
            if other in names or _augmented(other) or order[other] > order[node]:
                if _updates(other, names):  # a later update of the same tensor: a name of it too
                    names.append(other)
                continue
            shared = any(
                StorageWeakRef(t.untyped_storage()) == storage for t in _tensors(other.meta.get("example_value"))
            )
            outside = other.op in ("placeholder", "get_attr")
            if shared and (outside or any(order[user] > order[node] for user in other.users)):
                raise Unsupported(f"{name} of a tensor sharing its memory with another (which would see it)")
        return group

    def _bind(self, node: torch.fx.Node, group: list[torch.fx.Node], value: Any) -> None:
        """Every name of an updated tensor (and the updating node) now means ``value``."""
        group = [*group, node]
        for member in group:
            self.aliases[member] = group
            self.env[member] = value

    def _call(self, node: torch.fx.Node, target: Any) -> Any:
        """A call node translated by the handler of ``target`` (the node's own, or the
        out-of-place call an in-place one stands for)."""
        args, kwargs = self._load(node.args), self._load(node.kwargs)
        if node.op == "call_function":
            handler = _FUNCTIONS.get(target)
            what = getattr(node.target, "__name__", str(node.target))
        elif node.op == "call_method":
            handler = _METHODS.get(str(target))
            what = f"Tensor.{node.target}"
        elif node.op == "get_attr":
            attribute = _attribute(self.gm, str(node.target))
            if isinstance(attribute, torch.fx.GraphModule):  # an autograd.Function's forward or backward
                return attribute
            if not isinstance(attribute, torch.Tensor):
                raise Unsupported(f"attribute {node.target} is a {type(attribute).__name__}")
            if attribute.requires_grad:
                raise Unsupported(f"attribute {node.target} requires a gradient, which a constant would lose")
            return attribute.detach()  # folded with other constants, or a constant where an op reads it
        else:
            raise Unsupported(f"{node.op} {node.target}")
        if str(getattr(node.target, "__module__", "")).startswith("torch._functorch"):
            # vmap's levels (create_block_mask's mask is a vmap): folding one would leave the
            # interpreter stack pushed when a later node is refused, and TorchDynamo's guards fail.
            raise Unsupported(f"{what}: a torch.func transform (vmap) inside the graph")
        if node.target is _AUTOGRAD_FUNCTION_APPLY:
            return self._autograd_function(*args, **kwargs)
        if node.target is _ACTIVATION_CHECKPOINT:
            return self._checkpoint(*args, **kwargs)
        if _foldable(what, args, kwargs):
            return _fold(node, args, kwargs)
        if node.target is torch.arange:
            return self._arange(*args, **kwargs)
        if node.target in _DRAWS:
            return self._random(node.target, *args, **kwargs)
        if node.target is F.dropout:
            return self._dropout(*args, **kwargs)
        if node.target is F.batch_norm:
            return self._batch_norm(node, *args, **kwargs)
        if node.target in _SDPA and _attention_dropout_p(args, kwargs):
            return self._attention_with_dropout(*args, **kwargs)
        if handler is None:
            raise Unsupported(f"{what} has no rlx translation")
        # Constant tensors become graph constants where a call reads them; an empty one (a legacy
        # cache's ``torch.tensor([])`` that ``torch.cat`` skips) stays a tensor for the call to see.
        args, kwargs = _nested(
            (args, kwargs),
            lambda a: constant_of(self.graph, a) if isinstance(a, torch.Tensor) and a.numel() else a,
        )
        expected = node.meta.get("example_value")
        if isinstance(expected, torch.Tensor):  # the shape TorchDynamo traced (and guards)
            EXPECTED_SHAPE.set(tuple(rlx_dim(self._merged(symbolic_size(d))) for d in expected.shape))
        else:
            EXPECTED_SHAPE.set(None)
        try:
            return handler(self.graph, *args, **kwargs)
        except Unsupported as why:
            raise Unsupported(f"{what}: {why}") from None
        except RlxError as why:
            raise Unsupported(f"{what}: {why}") from None

    def _autograd_function(
        self, forward: Any, backward: Any, *args: Any, non_differentiable_idx: Sequence[int] = (), **kwargs: Any
    ) -> Any:
        """``torch.autograd.Function.apply`` as TorchDynamo captures it (its forward and backward
        traced into two graphs): an ``rlx.custom_vjp`` whose ``fwd`` and ``bwd`` are those graphs,
        translated into this one. The backward receives zeros for the results the Function
        marked non-differentiable, as torch's autograd passes them, and nothing flows into them."""
        from rlx.custom_gradients import custom_vjp

        if kwargs.get("dirty_idx"):
            raise Unsupported("an autograd.Function that marks an input dirty (updates it in place)")
        if set(kwargs) - {"dirty_idx", "saved_for_backward_idx"}:
            raise Unsupported(f"autograd_function_apply with {sorted(kwargs)}")
        args = _nested(args, lambda a: constant_of(self.graph, a) if isinstance(a, torch.Tensor) else a)
        if not any(isinstance(a, Value) for a in args):
            raise Unsupported("an autograd.Function of no tensor input")
        results: list[Any] = []

        def fwd(*inputs: Any) -> tuple[Any, Any]:
            out, saved = self._inline(forward, inputs)
            results[:] = list(out) if isinstance(out, (tuple, list)) else [out]
            return out, saved

        def bwd(saved: Any, g: Any) -> tuple[Any, ...]:
            cotangents = list(g) if isinstance(g, (tuple, list)) else [g]
            for i, result in enumerate(results):
                if isinstance(result, Value) and (cotangents[i] is None or i in non_differentiable_idx):
                    cotangents[i] = self.graph.broadcast_to(self.graph.constant(0.0).astype(result.dtype), result.shape)
            grads = self._inline(backward, [*cotangents, *saved])
            grads = list(grads) if isinstance(grads, (tuple, list)) else [grads]
            return tuple(grads[: len(args)]) + (None,) * (len(args) - len(grads))

        function = custom_vjp(lambda *inputs: fwd(*inputs)[0])
        function.defvjp(fwd, bwd)
        return function(*args)

    def _checkpoint(self, body: Any, *args: Any, **kwargs: Any) -> Any:
        """``torch.utils.checkpoint.checkpoint(fn, ...)`` as TorchDynamo captures it (``fn``
        traced into a graph): ``rlx.checkpoint`` of that graph, its forward computed again in
        the backward, but for what a selective policy (``context_fn``) saves: see
        :func:`rlx.torch._checkpoint_policy.policy_of`."""
        from rlx.checkpointing import checkpoint
        from rlx.torch._checkpoint_policy import policy_of

        args = _nested(args, lambda a: constant_of(self.graph, a) if isinstance(a, torch.Tensor) else a)
        if not any(isinstance(a, Value) for a in args):
            raise Unsupported("a checkpoint of no tensor input")
        policy = policy_of(getattr(body, "meta", {}).get("_checkpoint_context_fn"))
        return checkpoint(lambda *inputs: self._inline(body, inputs), policy=policy)(*args)

    def _inline(self, body: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
        """What the FX graph ``body`` returns for ``inputs``, its nodes translated into this graph."""
        if not isinstance(body, torch.fx.GraphModule):
            raise Unsupported(f"a body that is a {type(body).__name__}, not a GraphModule")
        placeholders = [node for node in body.graph.nodes if node.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise Unsupported(f"a body of {len(placeholders)} inputs called with {len(inputs)}")
        outer = self.gm, self.env
        self.gm, self.env = body, dict(zip(placeholders, inputs, strict=True))
        try:
            for node in body.graph.nodes:
                if node.op == "output":
                    return self._load(node.args[0])
                if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
                    self.env[node] = None  # the bodies run without grad in torch; rlx.grad decides here
                elif node.op != "placeholder":
                    self.env[node] = self._node(node)
            raise Unsupported("a body without an output")
        finally:
            self.gm, self.env = outer

    def _arange(self, *bounds: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> Value:
        """``torch.arange(S)`` or ``torch.arange(P, P + S)`` of dynamic sizes: an input of the rlx
        graph, ``[S]``, that the wrapper makes per call from the sizes bound then."""
        kwargs.pop("device", None)
        kwargs.pop("layout", None)
        kwargs.pop("pin_memory", None)
        check_kwargs(kwargs, requires_grad=False)
        if len(bounds) == 3 and bounds[2] == 1:
            bounds = bounds[:2]
        if not 1 <= len(bounds) <= 2 or not all(type(b) is int or isinstance(b, Size) for b in bounds):
            raise Unsupported(f"arange{tuple(bounds)} of dynamic sizes (only a step of 1)")
        start, end = (0, bounds[0]) if len(bounds) == 1 else bounds
        dtype = torch.int64 if dtype is None else dtype
        if dtype not in DTYPES:
            raise Unsupported(f"arange of {dtype}")
        name = f"range{len(self.ranges)}"
        self.ranges[name] = (start, end, dtype)
        value = self.graph.input(name, (rlx_dim(end - start),), dtype=DTYPES[dtype])
        if dtype in (torch.int32, torch.int64):
            self.range_starts[value] = start  # indexing by it is a slice (_fx_calls._as_range)
        return value

    def _dropout(self, x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> Any:
        """``F.dropout`` while training: a bool input the wrapper draws per call, as torch does
        (``bernoulli(1 - p)`` from torch's generator, so ``torch.manual_seed`` governs it), and
        ``where(keep, x / (1 - p), 0)``, whose gradient is the same mask's."""
        if not training or p == 0:
            return FUNCTIONS[F.dropout](self.graph, x, p, training, inplace)
        if not isinstance(x, Value) or x.dtype != np.float32:
            raise Unsupported("dropout of something other than a float tensor")
        if not 0 <= p <= 1:
            raise Unsupported(f"dropout probability {p}")
        if p == 1:
            return self.graph.broadcast_to(self.graph.constant(0.0), x.shape)
        keep = self._keep_mask(x.shape, p)
        return self.graph.where(keep, x * (1.0 / (1.0 - float(p))), 0.0)

    def _batch_norm(
        self,
        node: torch.fx.Node,
        x: Any,
        running_mean: Any,
        running_var: Any,
        weight: Any = None,
        bias: Any = None,
        training: bool = False,
        momentum: float | None = 0.1,
        eps: float = 1e-5,
    ) -> Value:
        """``F.batch_norm``: in training, each channel normalised by its batch mean and biased
        variance, and the running statistics (inputs) updated in place, as torch's kernel does:
        ``(1 - momentum) * running + momentum * batch``, the variance unbiased; in evaluation, by
        the running statistics."""
        g = self.graph
        if not isinstance(x, Value) or x.dtype != np.float32 or x.ndim < 2:
            raise Unsupported("batch_norm of other than a float tensor [N, C, ...]")
        channels = x.shape[1]
        axes = (0, *range(2, x.ndim))
        shape = (1, channels, *(1,) * (x.ndim - 2))
        if training:
            mean = g.mean(x, axis=axes, keepdims=True)
            centred = x - mean
            var = g.mean(centred * centred, axis=axes, keepdims=True)
            stats = [(1, "running_mean", running_mean, mean), (2, "running_var", running_var, var)]
            if any(isinstance(s, Value) for _, _, s, _ in stats):
                if momentum is None:
                    raise Unsupported("batch_norm with momentum=None (a cumulative average)")
                count = 1
                for axis in axes:
                    if not isinstance(x.shape[axis], int):
                        raise Unsupported("batch_norm's running variance over a dynamic size")
                    count *= int(x.shape[axis])
                for slot, keyword, running, batch in stats:
                    updated = node.args[slot] if len(node.args) > slot else node.kwargs.get(keyword)
                    if not isinstance(running, Value) or not isinstance(updated, torch.fx.Node):
                        raise Unsupported("batch_norm with one running statistic")
                    group = self._check_update(node, updated)
                    unbiased = count / (count - 1) if slot == 2 and count > 1 else 1.0
                    fresh = g.reshape(batch, (channels,)) * (float(momentum) * unbiased)
                    self._bind(updated, group, running * (1.0 - float(momentum)) + fresh)
        else:
            if not isinstance(running_mean, Value) or not isinstance(running_var, Value):
                raise Unsupported("batch_norm in evaluation without running statistics")
            mean, var = g.reshape(running_mean, shape), g.reshape(running_var, shape)
        y = (x - mean) * g.rsqrt(var + float(eps))
        if weight is not None:
            y = y * g.reshape(weight, shape)
        if bias is not None:
            y = y + g.reshape(bias, shape)
        return y

    def _keep_mask(self, shape: tuple[Any, ...], p: float) -> Value:
        """A bool input of ``shape`` the wrapper draws per call: True with probability 1 - p."""
        return self._drawn(shape, Draw("bernoulli", torch.bool, (1.0 - float(p),)))

    def _drawn(self, shape: tuple[Any, ...], draw: Draw) -> Value:
        """An input of ``shape`` the wrapper draws per call (see :class:`Draw`)."""
        name = f"draw{len(self.draws)}"
        self.draws[name] = (tuple(poly(d) for d in shape), draw)
        return self.graph.input(name, shape, dtype=DTYPES[draw.dtype])

    def _random(self, target: Any, *args: Any, **kwargs: Any) -> Value:
        """``torch.rand``/``randn``/``randint`` (and ``rand_like``/``randn_like``) inside the graph:
        an input the wrapper draws per call from torch's generator, in graph order, so under one
        seed the values are eager torch's. An explicit ``generator`` is left to torch."""
        for key in ("device", "layout", "pin_memory", "memory_format"):
            kwargs.pop(key, None)
        check_kwargs({k: v for k, v in kwargs.items() if k != "dtype"}, requires_grad=False, generator=None)
        name = target.__name__
        if name.endswith("_like"):
            (like,) = args
            if not isinstance(like, Value):
                raise Unsupported(f"{name} of a {type(like).__name__}")
            shape: tuple[Any, ...] = tuple(like.shape)
            bounds: tuple[Any, ...] = ()
        elif name == "randint":  # randint(high, size) or randint(low, high, size)
            *limits, size = args
            bounds = (0, *limits) if len(limits) == 1 else tuple(limits)
            shape = tuple(size)
        else:  # rand(*size) or rand(size)
            bounds = ()
            shape = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else tuple(args)
        if not all(type(b) is int for b in bounds) or len(bounds) not in (0, 2):
            raise Unsupported(f"{name} with bounds {bounds}")
        if not all(type(d) is int or isinstance(d, Size) for d in shape):
            raise Unsupported(f"{name} of the shape {shape}")
        kind = name.removesuffix("_like")
        dtype = kwargs.pop("dtype", None) or (torch.int64 if kind == "randint" else torch.float32)
        if dtype not in DTYPES or (kind != "randint" and dtype != torch.float32):
            raise Unsupported(f"{name} of {dtype}")
        return self._drawn(tuple(rlx_dim(d) for d in shape), Draw(kind, dtype, bounds))

    def _attention_with_dropout(
        self,
        q: Any,
        k: Any,
        v: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Value:
        """SDPA with attention dropout, which rlx's fused kernels do not have: torch's math path
        (scores, mask, softmax, dropout of the probabilities, product with v), with the keep
        mask ``[B, H, Sq, Sk]`` drawn per call as eager torch draws it. Memory grows with Sq x Sk
        here, as in torch's own math path."""
        g = self.graph
        if not all(isinstance(t, Value) and t.dtype == np.float32 and t.ndim == 4 for t in (q, k, v)):
            raise Unsupported("attention dropout of other than rank-4 float tensors")
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads != kv_heads:
            if not enable_gqa or not isinstance(heads, int) or not isinstance(kv_heads, int):
                raise Unsupported("attention dropout with fewer key heads than query heads")
            k, v = (FUNCTIONS[torch.repeat_interleave](g, t, heads // kv_heads, 1) for t in (k, v))
        factor = 1.0 / math.sqrt(float(q.shape[3])) if scale is None else float(scale)
        scores = g.matmul(q, g.transpose(k, (0, 1, 3, 2))) * factor
        if is_causal:
            rows = g.reshape(positions(g, q.shape[2]), (q.shape[2], 1))
            visible = g.less_equal(g.reshape(positions(g, k.shape[2]), (1, k.shape[2])), rows)
            scores = g.where(visible, scores, float("-inf"))
        if attn_mask is not None:
            mask = attn_mask if isinstance(attn_mask, Value) else constant_of(g, attn_mask)
            scores = g.where(mask, scores, float("-inf")) if mask.dtype == np.bool_ else scores + mask
        # torch's math path uses a safe softmax: a row whose keys are all masked gets zeros, not NaN
        seen = g.greater(g.max(scores, axis=-1, keepdims=True), float("-inf"))
        weights = g.where(seen, g.softmax(scores, axis=-1), 0.0)
        keep = self._keep_mask(weights.shape, dropout_p)
        dropped = g.where(keep, weights * (1.0 / (1.0 - float(dropout_p))), 0.0)
        return g.matmul(dropped, v)

    def _symbol_sources(self) -> dict[str, tuple[int, int | None]]:
        """Where each symbol's size is found in a call, (argument, axis) or (argument, None) for
        a size passed as an int: the first place of any symbol merged into it."""
        sources: dict[str, tuple[int, int | None]] = {}
        for symbol, source in self.original_sources.items():
            sources.setdefault(self._final(symbol), source)
        return sources

    def compiled(self) -> Callable[..., Any]:
        """The function TorchDynamo calls: binds the arguments, makes the per-call inputs (ranges,
        dropout masks), runs the rlx graph and returns what the FX graph returns
        (tensors, and sizes as ints)."""
        results = _nested(self.results, lambda a: constant_of(self.graph, a) if isinstance(a, torch.Tensor) else a)
        single = not isinstance(results, (tuple, list))
        values = [results] if single else list(results)
        if not all(isinstance(v, (Value, int, Size)) and not isinstance(v, bool) for v in values):
            kinds = sorted({type(v).__name__ for v in values if not isinstance(v, (Value, int, Size))})
            raise Unsupported(f"the graph returns {', '.join(kinds)}, not only tensors and sizes")
        names = [f"out{i}" if isinstance(v, Value) else None for i, v in enumerate(values)]
        # what TorchDynamo traced each output as: a half-precision one is narrowed back per call
        narrowed = [_traced_dtype(node) if node is not None else None for node in self._output_nodes(len(values))]
        self.graph.output(**{name: v for name, v in zip(names, values, strict=True) if name is not None})
        updates = {}  # inputs updated in place: their final values, copied into the caller's tensors
        for position, placeholder in self.mutated.items():
            final = self.env[placeholder]
            if not isinstance(final, Value):
                raise Unsupported(f"an input updated to a {type(final).__name__}")
            updates[position] = f"updated{position}"
            self.graph.output(**{updates[position]: final})
        function = CompiledGraph(self.graph)
        # What the calls will run (a training step: the training pair alone) is compiled here,
        # where a failure still falls back to eager torch.
        recording = torch.is_grad_enabled()
        function.prepare(
            {
                name
                for name, example in zip(self.inputs, self.example_inputs, strict=True)
                if name is not None and recording and isinstance(example, torch.Tensor) and example.requires_grad
            }
        )
        inputs, ranges, draws, widened = self.inputs, self.ranges, self.draws, self.widened
        pinned = self.pinned
        checks = [
            (self.original_sources[a], self.original_sources[b])
            for a, b in self.merges.items()
            if a in self.original_sources and b in self.original_sources
        ]
        if len(checks) != len(self.merges):
            raise Unsupported(f"merged sizes {self.merges} that the inputs do not all carry")
        eager = self.gm.forward
        size_outputs = [v for v in values if isinstance(v, Size)]
        sources = self._symbol_sources() if ranges or draws or size_outputs else {}
        needed = {symbol for start, end, _ in ranges.values() for symbol in poly_symbols(start, end)}
        needed |= {symbol for shape, _ in draws.values() for symbol in poly_symbols(*shape)}
        needed |= poly_symbols(*size_outputs)
        if needed - set(sources):
            raise Unsupported(f"sizes {sorted(needed - set(sources))} that no input carries")

        def run(*args: Any) -> Any:
            if any(_size_of(args, a) != _size_of(args, b) for a, b in checks):
                return eager(*args)  # sizes the rlx graph took as one differ in this call
            if any(float(args[position]) != value for position, value in pinned.items()):
                return eager(*args)  # a float the rlx graph took as a constant differs
            named = {name: arg for name, arg in zip(inputs, args, strict=True) if name is not None}
            for position in widened:
                named[inputs[position]] = args[position].float()  # type: ignore[index]
            sizes = {symbol: _size_of(args, source) for symbol, source in sources.items()}
            for name, (start, end, dtype) in ranges.items():
                named[name] = torch.arange(_evaluate(start, sizes), _evaluate(end, sizes), dtype=dtype)
            for name, (shape, draw) in draws.items():
                named[name] = draw.sample(tuple(_evaluate(d, sizes) for d in shape))
            for position in updates:  # a copy: autograd may keep the input, and it is updated below
                named[inputs[position]] = named[inputs[position]].clone()  # type: ignore[index]
            result = function(**named)
            if updates:
                with torch.no_grad():
                    for position, name in updates.items():
                        args[position].copy_(result[name])
            outs = [
                result[name] if name is not None else _evaluate(v, sizes) for name, v in zip(names, values, strict=True)
            ]
            outs = [
                o.to(half) if half is not None and isinstance(o, torch.Tensor) else o
                for o, half in zip(outs, narrowed, strict=True)
            ]
            return outs[0] if single else tuple(outs) if isinstance(results, tuple) else outs

        run.rlx_graph = self.graph  # type: ignore[attr-defined]
        return run


def _traced_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The half-precision dtype an FX node was traced with, else None."""
    traced = node.meta.get("example_value")
    return traced.dtype if isinstance(traced, torch.Tensor) and traced.dtype in HALF else None


def _size_of(args: Sequence[Any], source: tuple[int, int | None]) -> int:
    """A size in a call: an int argument, or an axis of a tensor argument."""
    position, axis = source
    return int(args[position]) if axis is None else int(args[position].shape[axis])


_AUTOGRAD_FUNCTION_APPLY = getattr(getattr(torch.ops, "higher_order", None), "autograd_function_apply", None)
_ACTIVATION_CHECKPOINT = getattr(getattr(torch.ops, "higher_order", None), "tag_activation_checkpoint", None)
_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)

_IN_PLACE: dict[Any, Any] = {
    operator.setitem: "setitem",  # FUNCTIONS["setitem"]: the tensor with the part replaced
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
    "add_": "add",
    "sub_": "sub",
    "mul_": "mul",
    "div_": "div",
    "masked_fill_": "masked_fill",
    "clamp_": "clamp",
    "index_add_": "index_add",
    "scatter_add_": "scatter_add",
    "scatter_": "scatter",
    "index_put_": "index_put",
}
"""In-place calls and the calls whose result they equal (``x += y`` is ``x + y`` bound to x)."""


def _attention_dropout_p(args: Any, kwargs: Any) -> float:
    """The ``dropout_p`` of an SDPA call's arguments (0 where not given)."""
    given = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return float(given) if isinstance(given, (int, float)) else 1.0


def _nested(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to every leaf of nested tuples, lists and dicts (an FX node's arguments)."""
    if isinstance(value, tuple):
        return tuple(_nested(v, fn) for v in value)
    if isinstance(value, list):
        return [_nested(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _nested(v, fn) for k, v in value.items()}
    return fn(value)


@dataclass(frozen=True)
class Draw:
    """How the wrapper draws one random input per call: ``bernoulli`` (a keep mask, ``args`` the
    probability of True), ``rand``, ``randn`` or ``randint`` (``args`` its low and high), as the
    torch call of that name would with the default generator."""

    kind: str
    dtype: torch.dtype
    args: tuple[Any, ...] = ()

    def sample(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.kind == "bernoulli":
            return torch.empty(shape).bernoulli_(self.args[0]).bool()
        if self.kind == "randint":
            return torch.randint(self.args[0], self.args[1], shape, dtype=self.dtype)
        return torch.rand(shape) if self.kind == "rand" else torch.randn(shape)


_DRAWS = (torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like)

_RANDOM = ("rand", "bernoulli", "dropout", "normal", "multinomial", "poisson", "exponential", "uniform")


def _foldable(what: str, args: Any, kwargs: Any) -> bool:
    """A call on constants only (``torch.arange(8)``, ``torch.tril(torch.ones(8, 8))``): torch
    computes it once, now, and its result is a constant of the graph. Random draws and in-place
    updates are not folded: they must happen on every call."""
    found: list[Any] = []
    _nested((args, kwargs), lambda a: found.append(a) if isinstance(a, (Value, Size)) else a)
    name = what.lower()
    return not found and not any(word in name for word in _RANDOM) and not name.endswith("_")


def _tensors(example: Any) -> list[torch.Tensor]:
    """The tensors of a node's example value (a tensor, or a tuple of them from ``split``)."""
    if isinstance(example, torch.Tensor):
        return [example]
    if isinstance(example, (tuple, list)):
        return [t for t in example if isinstance(t, torch.Tensor)]
    return []


def _updates(other: torch.fx.Node, group: list[torch.fx.Node]) -> bool:
    """Whether ``other`` updates in place a tensor of ``group`` (directly, or through the part an
    augmented assignment takes): its result is that tensor, bound to the group when it comes."""
    key = str(other.target) if other.op == "call_method" else other.target
    if key not in _IN_PLACE or not other.args or not isinstance(other.args[0], torch.fx.Node):
        return False
    updated = other.args[0]
    return updated in group or (_augmented(updated) and updated.args[0] in group)


def _augmented(view: torch.fx.Node) -> bool:
    """Whether ``view`` is the part an augmented assignment updates, ``x[i] += y``, which Python
    runs as ``part = x[i]; part += y; x[i] = part``: read only by one in-place call, whose
    result only a setitem of the same index of the same tensor reads. The setitem then makes the
    update that the in-place call made through the view."""
    if view.op != "call_function" or view.target is not operator.getitem or len(view.users) != 1:
        return False
    (update,) = view.users
    key = str(update.target) if update.op == "call_method" else update.target
    if key not in _IN_PLACE or key is operator.setitem or update.args[0] is not view or len(update.users) != 1:
        return False
    (store,) = update.users
    return store.target is operator.setitem and store.args == (view.args[0], view.args[1], update)


def _fold(node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
    key = str(node.target) if node.op == "call_method" else node.target
    if key in _IN_PLACE and isinstance(args[0], torch.Tensor):
        # An in-place update of a constant updates a copy (the constant may be a module's buffer).
        args = (args[0].clone(), *args[1:])
        with torch.no_grad():
            if node.op == "call_method":
                getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                node.target(*args, **kwargs)  # type: ignore[operator]
        return args[0]
    with torch.no_grad():
        if node.op == "call_method":
            subject = args[0]
            if isinstance(subject, float):  # a pinned float scalar: the 0-d tensor it came as
                subject = torch.tensor(subject, dtype=torch.float64)
            return getattr(subject, str(node.target))(*args[1:], **kwargs)
        return node.target(*args, **kwargs)  # type: ignore[operator]


def poly_symbols(*sizes: int | Size) -> set[str]:
    return {symbol for size in sizes if isinstance(size, Size) for symbol in size.symbols}


def _evaluate(size: int | Size, sizes: dict[str, int]) -> int:
    return size if isinstance(size, int) else size.evaluate(sizes)


def _attribute(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
