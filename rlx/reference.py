"""The reference interpreter: the SPEC as plain NumPy, the oracle every other test trusts.

Written for clarity, not speed. Each op's reference (``OpDef.reference``, beside the op in
:mod:`rlx.ops`) computes in float64 on float64 copies of its float operands; its results are
rounded to the node's declared dtype, so a graph evaluates as the compiled code should.
Integer index operands are checked against their bounds first (``check_index_inputs``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rlx.bind import bind_inputs, check_index_inputs, check_short_dims, short_dims, symbol_sizes
from rlx.config import RuntimeConfig, resolve_config
from rlx.errors import RlxTypeError, RlxValueError
from rlx.ir.graph import Graph, Node, Value
from rlx.ir.opdef import EvalContext
from rlx.ir.printer import format_node, value_names
from rlx.ops.attention import attention_backward, attention_forward, masked_positions, safe_softmax

__all__ = [
    "EvalContext",
    "attention_backward",
    "attention_forward",
    "evaluate",
    "masked_positions",
    "run",
    "safe_softmax",
]

# ---------------------------------------------------------------------------- attention math


# ---------------------------------------------------------------------------- interpreter


def run(graph: Graph, /, config: RuntimeConfig | None = None, **arrays: object) -> dict[str, np.ndarray]:
    """Evaluate ``graph`` on keyword arrays; returns ``{output name: new float32 array}``."""
    if isinstance(config, Mapping):  # run(g, arrays) puts the arrays in the config's place
        raise RlxTypeError(
            f"config must be an rlx.RuntimeConfig, got {type(config).__name__}; rlx.reference.run takes the "
            "arrays by name: run(g, **arrays) (or rlx.reference.evaluate(g, arrays))"
        )
    return evaluate(graph, arrays, config=config)


def evaluate(
    graph: Graph, inputs: Mapping[str, object], *, config: RuntimeConfig | None = None, exact: bool = False
) -> dict[str, np.ndarray]:
    """:func:`run` with the inputs as a mapping (for an input named ``config``, say).

    ``exact=True`` is for checking gradients by finite differences: float32 inputs may be given
    as float64 arrays, and no result is rounded to float32, so the whole graph runs in float64.
    """
    config = resolve_config(config)
    graph._verify_unless_unchanged()
    given = inputs
    wide: dict[str, np.ndarray] = {}
    if exact and isinstance(inputs, Mapping):
        wide = {  # a NumPy float64 scalar (what indexing a 1-d array gives) counts as a 0-d array
            name: np.asarray(a)
            for name, a in inputs.items()
            if isinstance(a, np.float64) or (isinstance(a, np.ndarray) and a.dtype == np.float64)
        }
        given = {name: wide[name].astype(np.float32) if name in wide else a for name, a in inputs.items()}
    bound = bind_inputs(graph, given)
    sizes = symbol_sizes(graph, bound)
    check_index_inputs(graph, bound, sizes=sizes)
    if exact:
        bound = {name: wide.get(name, array) for name, array in bound.items()}
    check_short_dims(short_dims(graph), sizes)  # an empty "S-1" computes as NumPy does; negative raises
    ctx = EvalContext(config, bound, sizes)
    env: dict[Value, np.ndarray] = {}
    for node in graph._ordered():
        results = _eval_node(graph, node, [_widen(env[value]) for value in node.inputs], ctx)
        for value, result in zip(node.outputs, results, strict=True):
            array = np.asarray(result)
            if exact and value.type.dtype.kind == "f":
                env[value] = array.astype(np.float64, copy=False)
                continue
            with np.errstate(over="ignore"):  # float64 beyond float32 range rounds to inf, as in f32 code
                env[value] = array.astype(value.type.dtype, copy=False)
    return {name: np.array(env[value], copy=True) for name, value in graph.outputs.items()}


def _eval_node(graph: Graph, node: Node, args: list[np.ndarray], ctx: EvalContext) -> tuple[np.ndarray, ...]:
    """Run one node; a failure is re-raised as the same kind of error naming the node's IR line."""
    try:
        with np.errstate(all="ignore"):  # NaN and Inf propagate by design, as in compiled code
            produced = node.op.definition.reference(args, node.attrs, ctx)
        results = produced if isinstance(produced, tuple) else (produced,)
        if len(results) != len(node.types):
            raise RlxValueError(f"reference {node.op} returned {len(results)} results for {len(node.types)} outputs")
        return results
    except Exception as exc:
        line = format_node(node, value_names(graph))
        message = f"{exc}\n  while evaluating node {node.id} of graph {graph.name!r}: {line}"
        try:
            wrapped = type(exc)(message)
        except Exception:  # an exception class with an unusual constructor: annotate in place
            exc.args = (message,)
            raise
        raise wrapped from exc


def _widen(array: np.ndarray) -> np.ndarray:
    """Float operands are computed on in float64; integer and bool ones are passed as they are."""
    return array.astype(np.float64) if array.dtype.kind == "f" else array
