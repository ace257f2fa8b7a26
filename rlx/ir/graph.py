"""The op graph: ``Graph`` owns ``Node``s; a ``Value`` is one output of one node.

networkx stores the use-def edges (producer -> consumer, one edge per input slot) behind this
API; passes call the methods here (``replace_all_uses_with``, ``erase``, ``users``) and never
touch networkx, so the store can change without touching a pass.
"""

from __future__ import annotations

import functools
import keyword
import math
import numbers
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import networkx as nx

from rlx.errors import RlxKeyError, RlxTypeError, RlxValueError
from rlx.ir.dims import canonical_dim, dim_symbols, is_symbol
from rlx.ir.opdef import REGISTRY
from rlx.ir.ops import InputAttrs, OpKind
from rlx.ir.types import Dim, TensorType, TooManyElements, as_dtype, check_shape

Attrs = Any

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def check_name(name: object, what: str) -> str:
    """Input and output names are identifiers (dots allowed) so that textual IR can carry them."""
    if not isinstance(name, str):
        raise RlxTypeError(f"{what} must be a str, got {type(name).__name__}")
    if not _NAME_RE.match(name) or keyword.iskeyword(name):
        raise RlxValueError(f"{what} must be an identifier (letters, digits, '_' or '.'), got {name!r}")
    return name


@dataclass(frozen=True, eq=True)
class Value:
    """Output ``index`` of ``node``. Hashable; two Values are equal when they name the same output."""

    node: Node
    index: int

    @property
    def type(self) -> TensorType:
        return self.node.types[self.index]

    @property
    def shape(self) -> tuple[Dim, ...]:
        return self.type.shape

    @property
    def static_shape(self) -> tuple[int, ...]:
        """The shape as ints, where sizes are needed (``RlxValueError`` if a dimension is symbolic)."""
        return self.type.static_shape

    @property
    def dtype(self):
        return self.type.dtype

    @property
    def ndim(self) -> int:
        return len(self.type.shape)

    @property
    def T(self) -> Value:
        """The axes reversed, as ``ndarray.T`` (``transpose``'s default): a view once compiled."""
        return self.graph.transpose(self)

    @property
    def graph(self) -> Graph:
        return self.node.graph

    # NumPy's array methods, as an ndarray (or a jax.Array) has them: each calls the Graph method.
    def sum(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Value:
        return self.graph.sum(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Value:
        return self.graph.mean(self, axis=axis, keepdims=keepdims)

    def max(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Value:
        return self.graph.max(self, axis=axis, keepdims=keepdims)

    def astype(self, dtype: object) -> Value:
        """``mask.astype("float32")``, as ``ndarray.astype``: see ``Graph.cast``."""
        return self.graph.cast(self, dtype)

    def min(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Value:
        return self.graph.min(self, axis=axis, keepdims=keepdims)

    def var(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, ddof: int = 0) -> Value:
        return self.graph.var(self, axis=axis, keepdims=keepdims, ddof=ddof)

    def std(self, axis: int | Sequence[int] | None = None, keepdims: bool = False, ddof: int = 0) -> Value:
        return self.graph.std(self, axis=axis, keepdims=keepdims, ddof=ddof)

    def clip(self, lo: object = None, hi: object = None) -> Value:
        return self.graph.clip(self, lo, hi)

    def squeeze(self, axis: int | Sequence[int] | None = None) -> Value:
        return self.graph.squeeze(self, axis)

    def cumsum(self, axis: int | None = None) -> Value:
        return self.graph.cumsum(self, axis)

    def cumprod(self, axis: int | None = None) -> Value:
        return self.graph.cumprod(self, axis)

    def prod(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Value:
        return self.graph.prod(self, axis=axis, keepdims=keepdims)

    def any(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Value:
        return self.graph.any(self, axis=axis, keepdims=keepdims)

    def all(self, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Value:
        return self.graph.all(self, axis=axis, keepdims=keepdims)

    def argmax(self, axis: int | None = None, keepdims: bool = False) -> Value:
        return self.graph.argmax(self, axis=axis, keepdims=keepdims)

    def argmin(self, axis: int | None = None, keepdims: bool = False) -> Value:
        return self.graph.argmin(self, axis=axis, keepdims=keepdims)

    def reshape(self, *shape: Any) -> Value:
        """``x.reshape(2, -1)`` or ``x.reshape((2, -1))``, as ``ndarray.reshape``."""
        one = len(shape) == 1 and isinstance(shape[0], (tuple, list))
        return self.graph.reshape(self, tuple(shape[0]) if one else shape)

    def transpose(self, *axes: Any) -> Value:
        """``x.transpose(1, 0, 2)``, ``x.transpose((1, 0, 2))`` or ``x.transpose()`` (axes
        reversed), as ``ndarray.transpose``."""
        if not axes or (len(axes) == 1 and axes[0] is None):
            return self.graph.transpose(self)
        one = len(axes) == 1 and isinstance(axes[0], (tuple, list))
        return self.graph.transpose(self, tuple(axes[0]) if one else axes)

    @property
    def at(self) -> Any:
        """JAX's functional index updates: ``x.at[1:3].set(0.0)``, ``x.at[ids].add(rows)``,
        ``.multiply``, ``.min``, ``.max``, ``.get`` (see :mod:`rlx.ops.index_update`)."""
        from rlx.ops.index_update import IndexUpdateHelper

        return IndexUpdateHelper(self)

    @property
    def size(self) -> int:
        """The number of elements, as ``ndarray.size`` (an error for a symbolic shape: that is per call)."""
        if not all(isinstance(d, int) for d in self.shape):
            raise RlxTypeError(f"size of {self.type}: its symbolic dimensions are per call")
        return math.prod(self.shape)  # type: ignore[arg-type]

    @property
    def mT(self) -> Value:
        """The last two axes swapped, as ``ndarray.mT`` (a batch of matrices transposed)."""
        if self.ndim < 2:
            raise RlxValueError(f"mT of {self.type}: needs at least two axes")
        return self.swapaxes(-2, -1)

    def swapaxes(self, axis1: int, axis2: int) -> Value:
        """Two axes swapped, as ``ndarray.swapaxes``: a view once compiled."""
        from rlx.ops._common import normalize_axis

        first, second = (normalize_axis("swapaxes", a, self.ndim) for a in (axis1, axis2))
        perm = list(range(self.ndim))
        perm[first], perm[second] = second, first
        return self.graph.transpose(self, tuple(perm))

    def flatten(self) -> Value:
        """All elements in one axis, row-major, as ``ndarray.flatten`` (a view where the strides allow)."""
        return self.graph.reshape(self, (-1,))

    ravel = flatten

    def __round__(self, ndigits: int | None = None) -> Value:
        """``round(x)`` or ``round(x, 2)``: halves to even, as ``numpy.round``."""
        if ndigits is None or ndigits == 0:
            return self.graph.round(self)
        if ndigits > 0:
            return self.graph.round(self * 10.0**ndigits) / 10.0**ndigits
        return self.graph.round(self / 10.0**-ndigits) * 10.0**-ndigits

    # Operators build nodes in the Value's graph; Python numbers and NumPy arrays on either side
    # become constants. Without this, ``np_array + value`` would let NumPy broadcast the Value as
    # an opaque object into an object array of one node per element; ``None`` makes NumPy defer
    # to the reflected operators below.
    __array_ufunc__ = None

    def __add__(self, other: object) -> Value:
        return self.graph.add(self, other)

    def __radd__(self, other: object) -> Value:
        return self.graph.add(other, self)

    def __sub__(self, other: object) -> Value:
        return self.graph.sub(self, other)

    def __rsub__(self, other: object) -> Value:
        return self.graph.sub(other, self)

    def __mul__(self, other: object) -> Value:
        return self.graph.mul(self, other)

    def __rmul__(self, other: object) -> Value:
        return self.graph.mul(other, self)

    def __truediv__(self, other: object) -> Value:
        return self.graph.div(self, other)

    def __rtruediv__(self, other: object) -> Value:
        return self.graph.div(other, self)

    def __floordiv__(self, other: object) -> Value:
        return self.graph.floor_divide(self, other)

    def __rfloordiv__(self, other: object) -> Value:
        return self.graph.floor_divide(other, self)

    def __mod__(self, other: object) -> Value:
        return self.graph.remainder(self, other)

    def __rmod__(self, other: object) -> Value:
        return self.graph.remainder(other, self)

    def __pow__(self, other: object) -> Value:
        return self.graph.pow(self, other)

    def __rpow__(self, other: object) -> Value:
        return self.graph.pow(other, self)

    def __matmul__(self, other: object) -> Value:
        return self.graph.matmul(self, other)

    def __rmatmul__(self, other: object) -> Value:
        return self.graph.matmul(other, self)

    def __getitem__(self, index: object) -> Any:
        """``value[2:5, -1]``: NumPy's basic indexing (ints, slices, ``...``, ``None``), a view once
        compiled. Inside an attention mod, ``value[b, h, q_idx, kv_idx]`` reads this value at
        symbolic indices instead."""
        from rlx import mods

        entries = index if isinstance(index, tuple) else (index,)
        if mods.tracing() or any(isinstance(entry, mods.Sym) for entry in entries):
            return mods.read(self, index)
        from rlx.ops.movement import getitem

        return _all_or_nothing(getitem)(self.graph, self, index)

    def __iter__(self) -> Iterator[Value]:
        """The parts along the first axis, as iterating an array gives (``a, b = pair``)."""
        if not self.shape:
            raise RlxTypeError(f"iteration over a 0-d value ({self.type})")
        length = self.shape[0]
        if not isinstance(length, int):
            raise RlxTypeError(f"cannot iterate over the symbolic first axis of {self.type}: its length is per call")
        return (self[i] for i in range(length))

    def __len__(self) -> int:
        """The first axis's size, as ``len`` of an array."""
        if not self.shape:
            raise RlxTypeError(f"len() of a 0-d value ({self.type})")
        length = self.shape[0]
        if not isinstance(length, int):
            raise RlxTypeError(f"len() of the symbolic first axis of {self.type}: its length is per call")
        return length

    def __array__(self, dtype: object = None, copy: object = None) -> Any:
        """Refused, as JAX refuses converting a tracer: without it NumPy would read a Value as a
        nested sequence (``len`` and indexing), adding a node per entry to the graph."""
        raise RlxTypeError(
            f"{self!r} has no entries while the graph is built, so NumPy cannot convert it; "
            "run the compiled graph (or rlx.reference.run) to get arrays"
        )

    def __bool__(self) -> bool:
        """Refused, as JAX refuses it on a tracer: a Value has no entries while the graph is built,
        so ``if x > 0:`` would take one branch for every input. ``g.where`` chooses per entry."""
        raise RlxTypeError(
            f"the truth value of {self!r} is not known while the graph is built (it holds no entries "
            "yet); use g.where(cond, a, b) to choose per entry, and `is None` to test an optional value"
        )

    def __neg__(self) -> Value:
        return self.graph.neg(self)

    def __pos__(self) -> Value:
        return self

    def __abs__(self) -> Value:
        return self.graph.abs(self)

    # Ordering comparisons build bool values, as on torch tensors. ``==`` stays identity (Values
    # are dict keys); use ``g.equal`` for the elementwise comparison.
    def __lt__(self, other: object) -> Value:
        return self.graph.less(self, other)

    def __le__(self, other: object) -> Value:
        return self.graph.less_equal(self, other)

    def __gt__(self, other: object) -> Value:
        return self.graph.greater(self, other)

    def __ge__(self, other: object) -> Value:
        return self.graph.greater_equal(self, other)

    # & | ^ ~ are logical on bools and bitwise on ints, as NumPy's; << and >> shift ints.
    def __and__(self, other: object) -> Value:
        return self._bits("logical_and", "bitwise_and", self, other)

    def __rand__(self, other: object) -> Value:
        return self._bits("logical_and", "bitwise_and", other, self)

    def __or__(self, other: object) -> Value:
        return self._bits("logical_or", "bitwise_or", self, other)

    def __ror__(self, other: object) -> Value:
        return self._bits("logical_or", "bitwise_or", other, self)

    def __xor__(self, other: object) -> Value:
        return self.graph.bitwise_xor(self, other)

    def __rxor__(self, other: object) -> Value:
        return self.graph.bitwise_xor(other, self)

    def __invert__(self) -> Value:
        return self.graph.logical_not(self) if self.dtype.kind == "b" else self.graph.bitwise_not(self)

    def __lshift__(self, other: object) -> Value:
        return self.graph.left_shift(self, other)

    def __rlshift__(self, other: object) -> Value:
        return self.graph.left_shift(other, self)

    def __rshift__(self, other: object) -> Value:
        return self.graph.right_shift(self, other)

    def __rrshift__(self, other: object) -> Value:
        return self.graph.right_shift(other, self)

    def _bits(self, logical: str, bitwise: str, a: object, b: object) -> Value:
        return getattr(self.graph, bitwise if self.dtype.kind == "i" else logical)(a, b)

    def __repr__(self) -> str:
        if not isinstance(self.node, Node):  # a hand-made Value must still show in error messages
            return f"Value(node={self.node!r}, index={self.index!r})"
        try:
            ty = str(self.type)
        except (IndexError, TypeError):
            ty = "<no such output>"
        return f"Value(node={self.node.id} {self.node.op}, index={self.index!r}, type={ty})"


class Node:
    """One operation. ``inputs`` are Values of earlier nodes; ``types`` one per output."""

    __slots__ = ("_inputs", "_outputs", "attrs", "graph", "id", "op", "types")
    attrs: Any  # the op's attrs dataclass (``op.definition.attrs``)

    def __init__(
        self,
        graph: Graph,
        node_id: int,
        op: OpKind,
        attrs: Attrs,
        inputs: tuple[Value, ...],
        types: tuple[TensorType, ...],
    ) -> None:
        self.graph = graph
        self.id = node_id
        self.op = op
        self.attrs = attrs
        self._inputs = inputs
        self.types = types
        self._outputs: tuple[Value, ...] = ()

    @property
    def inputs(self) -> tuple[Value, ...]:
        return self._inputs

    @property
    def outputs(self) -> tuple[Value, ...]:
        # Made once (the interpreter and the code generator ask for them in every loop); made
        # again if ``types`` was replaced by one of another length.
        if len(self._outputs) != len(self.types):
            self._outputs = tuple(Value(self, i) for i in range(len(self.types)))
        return self._outputs

    @property
    def users(self) -> list[Node]:
        """Nodes that read any output of this node (graph outputs are not nodes)."""
        return self.graph.users(self)

    def __repr__(self) -> str:
        return f"Node({self.id}, {self.op}, {self.attrs})"


class Graph:
    """A dataflow graph of ops with named inputs and named outputs.

    Build it with :meth:`input`, one method per registered op (``g.matmul``, ``g.softmax``,
    ``g.attention``, ...: see :mod:`rlx.ops`) and :meth:`output`. ``print(g)`` shows one line
    per node; :meth:`verify` checks the whole graph.
    """

    if TYPE_CHECKING:  # the op builders are attached from the registry below the class

        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, name: str = "graph") -> None:
        self.name = check_name(name, "graph name")
        self._store = nx.MultiDiGraph()
        self._nodes: dict[int, Node] = {}
        self._next_id = 0
        self._inputs: dict[str, Node] = {}
        self._inputs_view: Mapping[str, Value] | None = None  # cache of `inputs`; reset when _inputs changes
        self._outputs: dict[str, Value] = {}
        # The cached topological order, and each node id's place in it. A new node (the largest
        # id, its operands already in the graph) joins the order at its end; other edits reset it.
        self._order: list[Node] | None = None
        self._places: dict[int, int] | None = None
        # A rank per node id that grows along every edge (not unique, gaps between): what lets
        # set_input skip the search for a cycle. Kept across edits while it stays valid.
        self._rank: dict[int, int] | None = None
        # What the last verify that passed saw (see _verify_unless_unchanged).
        self._verified: tuple[list[object], tuple[object, ...]] | None = None

    # ----------------------------------------------------------------- queries

    @property
    def nodes(self) -> list[Node]:
        """All nodes in a topological order; ties go to the node created first."""
        return list(self._ordered())

    def _descendants(self, node_ids: set[int], within: Callable[[int], bool] | None = None) -> set[int]:
        """Ids of the nodes that read, directly or not, an output of a node in ``node_ids``; with
        ``within``, only those reached through node ids it accepts."""
        found: set[int] = set()
        successors = self._store.succ
        stack = [user for node_id in node_ids for user in successors[node_id]]
        while stack:
            node_id = stack.pop()
            if node_id not in found and (within is None or within(node_id)):
                found.add(node_id)
                stack.extend(successors[node_id])
        return found

    def _ordered(self) -> list[Node]:
        """:attr:`nodes` without the copy (callers must not change the list)."""
        if self._order is None:
            order = nx.lexicographical_topological_sort(self._store, key=lambda node_id: node_id)
            self._order = [self._nodes[node_id] for node_id in order]
            self._places = None
        return self._order

    def _place(self) -> dict[int, int]:
        """Each node id's position in :attr:`nodes`: sorting a subset by it keeps the graph's order."""
        order = self._ordered()
        if self._places is None:
            self._places = {node.id: place for place, node in enumerate(order)}
        return self._places

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, item: object) -> bool:
        if isinstance(item, Value):
            item = item.node
        return isinstance(item, Node) and self._nodes.get(item.id) is item

    @property
    def inputs(self) -> Mapping[str, Value]:
        """Graph inputs by name, in declaration order (a read-only snapshot).

        Cached: executables read it on every call. Methods that change the inputs reset the cache
        (:meth:`_inputs_changed`), so a mapping handed out earlier never changes under its holder.
        """
        if self._inputs_view is None:
            self._inputs_view = MappingProxyType({name: Value(node, 0) for name, node in self._inputs.items()})
        return self._inputs_view

    @property
    def outputs(self) -> Mapping[str, Value]:
        """Graph outputs by name, in the order they were declared."""
        return MappingProxyType(dict(self._outputs))

    def node(self, node_id: int) -> Node:
        """The node with id ``node_id`` (ids are stable; a copy keeps them)."""
        if isinstance(node_id, bool) or not isinstance(node_id, numbers.Integral):
            raise RlxTypeError(f"graph {self.name!r}: a node id is an int, got {type(node_id).__name__}")
        if node_id not in self._nodes:
            raise RlxKeyError(f"graph {self.name!r} has no node {node_id!r}")
        return self._nodes[node_id]

    def users(self, node: Node) -> list[Node]:
        """Distinct consumers of ``node``'s outputs, oldest first."""
        self._check_owned(node)
        return sorted({self._nodes[c] for c in self._store.successors(node.id)}, key=lambda n: n.id)

    def uses(self, value: Value) -> list[tuple[Node, int]]:
        """Every ``(consumer, input slot)`` that reads ``value``."""
        self._check_value(value, "uses: value")
        found = []
        for consumer_id in sorted(set(self._store.successors(value.node.id))):
            consumer = self._nodes[consumer_id]
            found += [(consumer, slot) for slot, v in enumerate(consumer.inputs) if v == value]
        return found

    def output_names_of(self, value: Value) -> list[str]:
        return [name for name, v in self._outputs.items() if v == value]

    # ----------------------------------------------------------------- builders

    def input(self, name: str, shape: Sequence[int | str], dtype: object = "float32") -> Value:
        """Declare a graph input ``name`` of ``shape`` and ``dtype`` (default float32).

        A dimension is an int, or a name (``"Sk"``) whose size each call binds from the arrays it
        is given, or an expression of names bound before it (``"P+1"`` after an input with an
        axis ``"P"``): that axis is checked to have the size the expression gives.
        """
        check_name(name, "input name")
        if name in self._inputs:
            raise RlxValueError(f"graph {self.name!r} already has an input named {name!r}")
        entries: object = shape
        if isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)):
            entries = tuple(canonical_dim(d) for d in shape)
        ty = TensorType(check_shape(entries, f"input {name!r}"), as_dtype(dtype))
        expressions = any(isinstance(dim, str) and not is_symbol(dim) for dim in ty.shape)
        bound = {  # only an expression needs them: a model declaring hundreds of weights pays nothing
            symbol
            for node in (self._inputs.values() if expressions else ())
            for symbol in node.outputs[0].type.shape
            if is_symbol(symbol)
        }
        for dim in ty.shape:
            if is_symbol(dim):
                bound.add(dim)  # type: ignore[arg-type]
            elif isinstance(dim, str) and not set(dim_symbols(dim)) <= bound:
                raise RlxValueError(
                    f"input {name!r}: the dimension {dim!r} uses {sorted(set(dim_symbols(dim)) - bound)}, which no "
                    "input declared before it (nor an earlier axis) names as a dimension of its own; a call binds a "
                    "symbol from an axis that is just that name"
                )
        node = self._add(OpKind.INPUT, InputAttrs(name), (), (ty,))
        self._inputs[name] = node
        self._inputs_changed()
        return node.outputs[0]

    def output(self, *values: Value, **named: Value) -> None:
        """Mark graph outputs. Keywords name them; positional ones get the lowest free ``out0``, ``out1``…

        "Free" means neither an existing output nor a keyword of this call, so removing an output or
        naming one ``out0`` never makes a positional output clash.
        """
        pairs = list(zip(self._free_output_names(len(values), set(named)), values, strict=True)) + list(named.items())
        seen: set[str] = set()
        for name, value in pairs:
            check_name(name, "output name")
            if name in self._outputs or name in seen:
                raise RlxValueError(f"graph {self.name!r} already has an output named {name!r}")
            seen.add(name)
            self._check_value(value, f"output {name!r}")
        for name, value in pairs:
            self._outputs[name] = value

    def add_node(self, op: OpKind, inputs: Sequence[Value], attrs: Attrs) -> Node:
        """Add a node, inferring and checking its output types with the op's shape rule."""
        if not isinstance(op, OpKind):
            raise RlxTypeError(f"add_node: op must be an rlx.OpKind, got {type(op).__name__}")
        what = f"{op} (node {self._next_id})"
        if op is OpKind.INPUT:
            raise RlxValueError(f"add_node: {what}: declare graph inputs with Graph.input(name, shape, dtype)")
        definition = op.definition
        if not isinstance(attrs, definition.attrs):
            raise RlxTypeError(
                f"add_node: {what}: attrs must be {definition.attrs.__name__}, got {type(attrs).__name__}"
            )
        if isinstance(inputs, (Value, str, bytes)) or not isinstance(inputs, (Sequence, Iterator)):
            raise RlxTypeError(f"add_node: {what}: inputs must be a sequence of Values, got {type(inputs).__name__}")
        inputs = tuple(inputs)
        for slot, value in enumerate(inputs):
            self._check_value(value, f"{what} operand {slot}")
        definition.check_arity(what, len(inputs))
        operand_types = [v.type for v in inputs]
        try:
            types = definition.infer(what, operand_types, attrs)
        except TooManyElements as exc:  # raised where the result type is made, which knows no op
            raise RlxValueError(f"{what}: the result's {exc.detail}") from None
        except TypeError as exc:  # a rule doing arithmetic on a symbolic dimension
            symbolic = [str(t) for t in operand_types if not t.is_static]
            if not symbolic:
                raise
            raise RlxValueError(
                f"{what}: {op} does not support symbolic dimensions in this position (operands {', '.join(symbolic)}); "
                f"declare the input with a static size ({exc})"
            ) from None
        return self._add(op, attrs, inputs, tuple(types))

    # ----------------------------------------------------------------- mutation

    def replace_all_uses_with(self, old: Value, new: Value) -> None:
        """Make every reader of ``old`` (node inputs and graph outputs) read ``new`` instead."""
        self._check_value(old, "replace_all_uses_with: old")
        self._check_value(new, "replace_all_uses_with: new")
        if old.type != new.type:
            raise RlxValueError(f"replace_all_uses_with: {old.type} cannot be replaced by {new.type}")
        if old == new:
            return
        for consumer, slot in self.uses(old):
            self.set_input(consumer, slot, new)
        for name, value in self._outputs.items():
            if value == old:
                self._outputs[name] = new

    def set_input(self, node: Node, slot: int, value: Value) -> None:
        """Rewire one input slot of ``node``; the new value must have the same type."""
        self._check_owned(node)
        if isinstance(slot, bool) or not isinstance(slot, numbers.Integral):
            raise RlxTypeError(
                f"set_input: slot of node {node.id} ({node.op}) must be an int, got {type(slot).__name__}"
            )
        slot = int(slot)
        if not 0 <= slot < len(node.inputs):
            raise RlxValueError(
                f"set_input: node {node.id} ({node.op}) has {len(node.inputs)} inputs "
                f"(slots 0 to {len(node.inputs) - 1}), got slot {slot}"
                if node.inputs
                else f"set_input: node {node.id} ({node.op}) has no inputs, got slot {slot}"
            )
        self._check_value(value, f"set_input of node {node.id}")
        old = node.inputs[slot]
        if old.type != value.type:
            raise RlxValueError(f"set_input: slot {slot} of node {node.id} has type {old.type}, got {value.type}")
        self._order = self._places = None
        rank = self._ranks()
        self._store.remove_edge(old.node.id, node.id, key=slot)
        # A value ranked below the node cannot be reached from it: no cycle, and the ranks still
        # grow along every edge after the edit. Otherwise search, then raise the node's rank (and
        # its readers', as far as needed) above the value's.
        if rank[value.node.id] >= rank[node.id]:
            if nx.has_path(self._store, node.id, value.node.id):
                self._store.add_edge(old.node.id, node.id, key=slot)
                raise RlxValueError(f"set_input: reading node {value.node.id} from node {node.id} would make a cycle")
            self._raise_rank(node.id, rank[value.node.id] + 1)
        self._store.add_edge(value.node.id, node.id, key=slot)
        node._inputs = node.inputs[:slot] + (value,) + node.inputs[slot + 1 :]

    def erase(self, node: Node) -> None:
        """Remove a node that nothing reads; refuses, naming the readers, otherwise."""
        self._check_owned(node)
        users = self.users(node)
        if users:
            names = ", ".join(f"node {u.id} ({u.op})" for u in users)
            raise RlxValueError(f"cannot erase node {node.id} ({node.op}): still used by {names}")
        outs = [name for name, v in self._outputs.items() if v.node is node]
        if outs:
            raise RlxValueError(f"cannot erase node {node.id} ({node.op}): it is graph output {', '.join(outs)}")
        self._order = self._places = None
        self._store.remove_node(node.id)
        del self._nodes[node.id]
        if node.op is OpKind.INPUT:
            self._inputs = {name: n for name, n in self._inputs.items() if n is not node}
            self._inputs_changed()

    def remove_output(self, name: str) -> None:
        """Stop returning graph output ``name`` (the value itself stays in the graph)."""
        if not isinstance(name, str):
            raise RlxTypeError(f"remove_output: the output name must be a str, got {type(name).__name__}")
        if name not in self._outputs:
            raise RlxKeyError(f"graph {self.name!r} has no output named {name!r}; outputs: {list(self._outputs)}")
        del self._outputs[name]

    # ----------------------------------------------------------------- whole-graph

    def verify(self) -> None:
        """Check the whole graph; raises ``RlxValueError`` ending with the printed graph."""
        from rlx.ir.verify import verify

        self._order = self._places = None  # the store may have been changed behind the API: recompute
        self._rank = None
        verify(self)

    def _verify_unless_unchanged(self) -> None:
        """:meth:`verify`, unless nothing it checks has changed since the last one that passed:
        every node with its op, attrs, operands and types (the objects themselves, so that one
        replaced behind the API counts as a change), the inputs, the outputs and the store's
        size. The float64 interpreter runs a graph once per entry when it checks gradients by
        finite differences, and verifying it each time was half of that time."""
        nodes: list[object] = []
        for node in self._nodes.values():
            nodes.extend((node, node.op, node.attrs, node._inputs, node.types))
        nodes.extend(self._inputs.values())
        rest = (tuple(self._outputs.items()), len(self._store), self._store.number_of_edges())
        last = self._verified
        same = last is not None and len(last[0]) == len(nodes) and last[1] == rest
        if same and all(a is b for a, b in zip(last[0], nodes, strict=True)):  # type: ignore[index]
            return
        self._verified = None
        self.verify()
        self._verified = (nodes, rest)

    @staticmethod
    def parse(text: str) -> Graph:
        """Read textual IR (as ``str(graph)`` prints it) back into a Graph (also ``rlx.parse``)."""
        from rlx.ir.parser import parse as _parse

        return _parse(text)

    # NumPy conveniences built from the ops (rlx.ops.composite): no op of their own.
    def stack(self, values: Sequence[object], axis: int = 0) -> Value:
        """``numpy.stack``: values of one shape joined along a new axis."""
        from rlx.ops.composite import stack

        return stack(self, values, axis)

    def expand_dims(self, x: object, axis: int | Sequence[int]) -> Value:
        """``numpy.expand_dims``: new axes of size 1 at ``axis``."""
        from rlx.ops.composite import expand_dims

        return expand_dims(self, x, axis)

    def squeeze(self, x: object, axis: int | Sequence[int] | None = None) -> Value:
        """``numpy.squeeze``: drop axes of size 1 (all, or those named)."""
        from rlx.ops.composite import squeeze

        return squeeze(self, x, axis)

    def einsum(self, equation: str, *operands: object) -> Value:
        """``numpy.einsum``: ``g.einsum("bqhd,bkhd->bhqk", q, k)``; ``...`` broadcasts, a repeated
        subscript takes a diagonal. Built from matmul, mul, sum and views: see :mod:`rlx.ops.einsum`."""
        from rlx.ops.einsum import einsum

        return einsum(self, equation, *operands)

    def logsumexp(self, x: object, axis: object = None, keepdims: bool = False) -> Value:
        """``jax.nn.logsumexp``: ``log(sum(exp(x)))`` over ``axis`` without overflow (an all
        ``-inf`` slice gives ``-inf``); see :mod:`rlx.ops.arrays`."""
        from rlx.ops.arrays import logsumexp

        return logsumexp(self, x, axis, keepdims)

    def det(self, a: object) -> Value:
        """``numpy.linalg.det`` of square matrices ``[..., n, n]``: see :mod:`rlx.ops.linalg`."""
        from rlx.ops.linalg import det

        return det(self, a)

    def inv(self, a: object) -> Value:
        """``numpy.linalg.inv`` of square matrices ``[..., n, n]``: see :mod:`rlx.ops.linalg`."""
        from rlx.ops.linalg import inv

        return inv(self, a)

    def svdvals(self, a: object) -> Value:
        """The singular values of matrices ``[..., m, n]``, descending: see :mod:`rlx.ops.linalg`."""
        from rlx.ops.linalg import svdvals

        return svdvals(self, a)

    def matrix_norm(self, a: object, ord: object = "fro", keepdims: bool = False) -> Value:
        """``torch.linalg.matrix_norm`` (``"fro"``, ``"nuc"``, ``2``, ``1``, ``inf`` and their negatives):
        see :mod:`rlx.ops.linalg`."""
        from rlx.ops.linalg import matrix_norm

        return matrix_norm(self, a, ord, keepdims)

    def pad(self, x: object, pad_width: object, value: float | int | bool = 0) -> Value:
        """``numpy.pad`` with ``constant_values=value``: ``pad_width`` an int, a pair, or a pair per axis."""
        from rlx.ops.arrays import pad

        return pad(self, x, pad_width, value)

    def flip(self, x: object, axis: object = None) -> Value:
        """``numpy.flip``: the named axes (all for None) in reverse order."""
        from rlx.ops.arrays import flip

        return flip(self, x, axis)

    def roll(self, x: object, shift: object, axis: object = None) -> Value:
        """``numpy.roll``: entries moved ``shift`` places along ``axis`` (the flattened value for
        None), wrapping around."""
        from rlx.ops.arrays import roll

        return roll(self, x, shift, axis)

    def tril(self, x: object, k: int = 0) -> Value:
        """``numpy.tril``: zeros above the ``k``-th diagonal of the last two axes."""
        from rlx.ops.arrays import tril

        return tril(self, x, k)

    def triu(self, x: object, k: int = 0) -> Value:
        """``numpy.triu``: zeros below the ``k``-th diagonal of the last two axes."""
        from rlx.ops.arrays import triu

        return triu(self, x, k)

    def isnan(self, x: object) -> Value:
        """``numpy.isnan`` (bool)."""
        from rlx.ops.arrays import isnan

        return isnan(self, x)

    def isinf(self, x: object) -> Value:
        """``numpy.isinf`` (bool)."""
        from rlx.ops.arrays import isinf

        return isinf(self, x)

    def isfinite(self, x: object) -> Value:
        """``numpy.isfinite`` (bool)."""
        from rlx.ops.arrays import isfinite

        return isfinite(self, x)

    def any(self, x: object, axis: object = None, keepdims: bool = False) -> Value:
        """``numpy.any``: whether some entry over ``axis`` is nonzero (bool)."""
        from rlx.ops.arrays import any_of

        return any_of(self, x, axis, keepdims)

    def all(self, x: object, axis: object = None, keepdims: bool = False) -> Value:
        """``numpy.all``: whether every entry over ``axis`` is nonzero (bool)."""
        from rlx.ops.arrays import all_of

        return all_of(self, x, axis, keepdims)

    def prod(self, x: object, axis: object = None, keepdims: bool = False) -> Value:
        """``numpy.prod`` over ``axis``, with torch's gradient through zeros."""
        from rlx.ops.arrays import prod

        return prod(self, x, axis, keepdims)

    def vector_norm(self, x: object, ord: object = 2, axis: object = None, keepdims: bool = False) -> Value:
        """``torch.linalg.vector_norm``: the ``ord``-norm over ``axis`` (all axes for None)."""
        from rlx.ops.arrays import vector_norm

        return vector_norm(self, x, ord, axis, keepdims)

    def tensordot(self, a: object, b: object, axes: object = 2) -> Value:
        """``numpy.tensordot``: an einsum over the paired axes."""
        from rlx.ops.arrays import tensordot

        return tensordot(self, a, b, axes)

    def take(self, x: object, ids: object, axis: int = 0) -> Value:
        """``numpy.take``: entries at integer ``ids`` along ``axis`` (ids computed by the graph too)."""
        from rlx.ops.composite import take

        return take(self, x, ids, axis)

    def argsort(self, x: object, axis: int = -1, descending: bool = False) -> Value:
        """``numpy.argsort(kind="stable")``: the int64 positions that sort ``x`` along ``axis``."""
        from rlx.ops.sort import argsort

        return argsort(self, x, axis, descending)

    def topk(self, x: object, k: int, axis: int = -1, largest: bool = True) -> tuple[Value, Value]:
        """``torch.topk``: the ``k`` largest (smallest) entries along ``axis`` and their positions."""
        from rlx.ops.sort import topk

        return topk(self, x, k, axis, largest)

    def conv_transpose(
        self,
        x: object,
        weight: object,
        bias: object = None,
        stride: int | Sequence[int] = 1,
        padding: int | Sequence[int] = 0,
        output_padding: int | Sequence[int] = 0,
        groups: int = 1,
        dilation: int | Sequence[int] = 1,
    ) -> Value:
        """Transposed convolution as ``torch.nn.functional.conv_transpose1d/2d/3d`` (``x [N, C,
        *spatial]``, ``weight [C, O/groups, *kernel]``): see :func:`rlx.ops.conv.conv_transpose`."""
        from rlx.ops.conv import conv_transpose

        return conv_transpose(self, x, weight, bias, stride, padding, output_padding, groups, dilation)

    def max_pool(
        self,
        x: object,
        window: int | Sequence[int],
        stride: int | Sequence[int] | None = None,
        padding: int | Sequence[int] = 0,
        dilation: int | Sequence[int] = 1,
        ceil_mode: bool = False,
    ) -> Value:
        """Max pooling as ``torch.nn.functional.max_pool1d/2d/3d``: see :func:`rlx.ops.conv.pool`."""
        from rlx.ops.conv import pool

        return pool(self, x, "max", window, stride, padding, dilation, ceil_mode=ceil_mode)

    def avg_pool(
        self,
        x: object,
        window: int | Sequence[int],
        stride: int | Sequence[int] | None = None,
        padding: int | Sequence[int] = 0,
        count_include_pad: bool = True,
        ceil_mode: bool = False,
        divisor_override: int | None = None,
    ) -> Value:
        """Average pooling as ``torch.nn.functional.avg_pool1d/2d/3d``: see :func:`rlx.ops.conv.pool`."""
        from rlx.ops.conv import pool

        return pool(self, x, "avg", window, stride, padding, 1, count_include_pad, ceil_mode, divisor_override)

    def adaptive_max_pool(self, x: object, output_size: int | Sequence[int | None]) -> Value:
        """Adaptive max pooling as ``torch.nn.functional.adaptive_max_pool1d/2d/3d``: see
        :func:`rlx.ops.conv.adaptive_pool`."""
        from rlx.ops.conv import adaptive_pool

        return adaptive_pool(self, x, "max", output_size)

    def adaptive_avg_pool(self, x: object, output_size: int | Sequence[int | None]) -> Value:
        """Adaptive average pooling as ``torch.nn.functional.adaptive_avg_pool1d/2d/3d``: see
        :func:`rlx.ops.conv.adaptive_pool`."""
        from rlx.ops.conv import adaptive_pool

        return adaptive_pool(self, x, "avg", output_size)

    def clip(self, x: object, lo: object = None, hi: object = None) -> Value:
        """``numpy.clip`` / ``torch.clamp`` with torch's gradient (1 within the bounds)."""
        from rlx.ops.composite import clip

        return clip(self, x, lo, hi)

    def var(self, x: object, axis: object = None, keepdims: bool = False, ddof: int = 0) -> Value:
        """``numpy.var`` (``ddof=1``: torch's unbiased default)."""
        from rlx.ops.composite import var

        return var(self, x, axis, keepdims, ddof)

    def std(self, x: object, axis: object = None, keepdims: bool = False, ddof: int = 0) -> Value:
        """``numpy.std``."""
        from rlx.ops.composite import std

        return std(self, x, axis, keepdims, ddof)

    def copy(self) -> Graph:
        """A deep copy with the same node ids, input and output names."""
        clone = Graph(self.name)
        clone._next_id = self._next_id
        mapping: dict[int, Node] = {}

        def copied_value(value: Value, what: str) -> Value:
            if value not in self or value.node.id not in mapping:
                raise RlxValueError(
                    f"cannot copy graph {self.name!r}: {what} reads node {value.node.id}, which is not in the graph"
                )
            return Value(mapping[value.node.id], value.index)

        for node in self.nodes:
            where = f"node {node.id} ({node.op})"
            inputs = tuple(copied_value(v, f"{where} operand {slot}") for slot, v in enumerate(node.inputs))
            copied = Node(clone, node.id, node.op, node.attrs, inputs, node.types)
            clone._insert(copied)
            mapping[node.id] = copied
        clone._inputs = {name: mapping[node.id] for name, node in self._inputs.items()}
        clone._inputs_changed()
        clone._outputs = {name: copied_value(v, f"output {name!r}") for name, v in self._outputs.items()}
        return clone

    def __str__(self) -> str:
        from rlx.ir.printer import format_graph

        return format_graph(self)

    def __repr__(self) -> str:
        return f"<rlx.Graph {self.name!r}: {len(self._nodes)} nodes, outputs {list(self._outputs)}>"

    def to_dot(self) -> str:
        """Graphviz DOT text of the graph."""
        from rlx.ir.dot import to_dot

        return to_dot(self)

    # ----------------------------------------------------------------- internals

    def _add(self, op: OpKind, attrs: Attrs, inputs: tuple[Value, ...], types: tuple[TensorType, ...]) -> Node:
        node = Node(self, self._next_id, op, attrs, inputs, types)
        self._next_id += 1
        order, places = self._order, self._places
        self._insert(node)
        if order is not None:
            # Every earlier choice of the lexicographic sort (ready, and a smaller id) stays
            # available and first, so the order grows by the new node at its end.
            order.append(node)
            self._order = order
            if places is not None:
                places[node.id] = len(order) - 1
                self._places = places
        return node

    def _insert(self, node: Node) -> None:
        self._nodes[node.id] = node
        self._order = self._places = None
        if self._rank is not None:  # nothing reads a new node yet: above its inputs is enough
            self._rank[node.id] = 1 + max((self._rank[value.node.id] for value in node.inputs), default=0)
        self._store.add_node(node.id)
        for slot, value in enumerate(node.inputs):
            self._store.add_edge(value.node.id, node.id, key=slot)

    def _raise_rank(self, node_id: int, at_least: int) -> None:
        """Give ``node_id`` a rank of at least ``at_least`` and its readers ranks above it, where
        theirs are not already (a walk forward that stops where ranks are high enough)."""
        rank = self._ranks()
        pending = [(node_id, at_least)]
        while pending:
            current, low = pending.pop()
            if rank[current] >= low:
                continue
            rank[current] = low
            pending.extend((reader, low + 1) for reader in self._store.successors(current))

    def _ranks(self) -> dict[int, int]:
        """:attr:`_rank`, computed from a topological order (1024 apart, so that nodes added
        later fit between) when an edit has made it stale."""
        if self._rank is None:
            self._rank = {node_id: 1024 * (i + 1) for i, node_id in enumerate(nx.topological_sort(self._store))}
        return self._rank

    def _inputs_changed(self) -> None:
        self._inputs_view = None

    def _free_output_names(self, count: int, taken: set[str]) -> list[str]:
        names: list[str] = []
        index = 0
        while len(names) < count:
            name = f"out{index}"
            if name not in self._outputs and name not in taken:
                names.append(name)
            index += 1
        return names

    def _check_owned(self, node: Node) -> None:
        if not isinstance(node, Node):
            raise RlxTypeError(f"expected an rlx Node, got {type(node).__name__}")
        if self._nodes.get(node.id) is not node:
            raise RlxValueError(f"node {node.id} ({node.op}) does not belong to graph {self.name!r}")

    def _check_value(self, value: object, what: str) -> None:
        if not isinstance(value, Value) or not isinstance(value.node, Node):
            identity = isinstance(value, bool)  # most likely ``a == b``, which compares identity
            hint = " (== and != on Values compare identity; use g.equal or g.not_equal)" if identity else ""
            raise RlxTypeError(
                f"{what} must be an rlx Value (from this graph's builder), got {type(value).__name__}{hint}"
            )
        if isinstance(value.index, bool) or not isinstance(value.index, numbers.Integral):
            raise RlxTypeError(f"{what}: a Value's index must be an int, got {type(value.index).__name__}")
        if self._nodes.get(value.node.id) is not value.node:
            raise RlxValueError(
                f"{what} belongs to graph {value.node.graph.name!r}, not to graph {self.name!r}"
                if value.node.graph.name != self.name
                else f"{what} belongs to graph {self.name!r}, but to another graph of that name than this one "
                "(a g.copy() of it, for instance: values of a copy cannot be used in the original; look them "
                "up in the graph you build, e.g. g.inputs[name])"
                if value.node.graph is not self
                else f"{what} is an output of node {value.node.id}, which was erased"
            )
        if not 0 <= value.index < len(value.node.types):
            raise RlxValueError(f"{what}: node {value.node.id} has no output {value.index}")


def _install_builders() -> None:
    """Attach each registered op's builder as a ``Graph`` method (``g.matmul(a, b)``)."""
    for definition in REGISTRY.values():
        if definition.builder is not None:
            setattr(Graph, definition.name, _all_or_nothing(definition.builder))


def _all_or_nothing(builder: Any) -> Any:
    """A builder that leaves the graph as it was when it raises (no stray constants of its arguments)."""

    @functools.wraps(builder)
    def build(graph: Graph, *args: Any, **kwargs: Any) -> Any:
        first = graph._next_id
        try:
            return builder(graph, *args, **kwargs)
        except Exception:
            for node in reversed(graph.nodes):
                if node.id >= first and not graph.users(node) and not graph.output_names_of(node.outputs[0]):
                    graph.erase(node)
            raise

    build.__wrapped_builder__ = builder  # type: ignore[attr-defined]
    return build


COMPOSITE_METHODS = (
    "det",
    "inv",
    "svdvals",
    "matrix_norm",
    "stack",
    "expand_dims",
    "squeeze",
    "take",
    "clip",
    "var",
    "std",
    "einsum",
    "logsumexp",
    "pad",
    "flip",
    "roll",
    "tril",
    "triu",
    "isnan",
    "isinf",
    "isfinite",
    "any",
    "all",
    "prod",
    "vector_norm",
    "tensordot",
)
"""The NumPy conveniences defined as methods above (built from ops, no op of their own)."""


def _install_composites() -> None:
    """The activations of :mod:`rlx.ops.activations` as methods of their names, and they and the
    conveniences above made all-or-nothing, as op builders are: an error leaves no stray nodes."""
    from rlx.ops.activations import ACTIVATIONS

    for function in ACTIVATIONS:
        setattr(Graph, function.__name__, _all_or_nothing(function))
    for name in COMPOSITE_METHODS:
        setattr(Graph, name, _all_or_nothing(getattr(Graph, name)))


_install_builders()
_install_composites()
