"""A program's call layout from its inputs' shapes, as one straight-line Python function.

A call of a compiled graph needs its symbol sizes (read from the inputs' shapes, every shape
checked against its declaration) and what follows from them: the sizes table native code
reads, the arena's size and the shapes of the buffers it writes (a :class:`CallLayout`). The
generic path loops over declarations and dimensions and resolves each buffer's shape, a dozen
Python functions in all. On a decode step of a model those functions run after a projection
and the KV cache's ``torch.cat`` have pushed them out of the caches, where each cost
microseconds: together more than the kernel. So a graph's own function is generated once, as
``namedtuple`` and ``dataclasses`` generate theirs: its shapes, symbols and buffers written out
as constants and locals, one frame. It covers calls that give every input; anything it does not
write out (a buffer made per call, a shape whose dimension is a product of symbols, checks that
need the sizes) goes to the generic ``layout_for``, which is also where a new bucket of sizes
gets its scratch stride (:meth:`rlx.codegen.lower.DynamicScratch.stride`). A block map made per call
is written out too, as the set of maps the call's sizes leave unread (``CallMap.unread``): a
batched decode step with a padding mask brings a new length every step, and the generic path
cost it ~20 us a step (B2 H8 D64).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlx.codegen.lower import STRIDE_BUCKET, CallMap, DynamicScratch
from rlx.ir.dims import is_symbol, poly
from rlx.ir.types import Dim

LayoutFunction = Callable[[Sequence[tuple[int, ...]]], Any]
"""``f(shapes)``: the call layout for inputs of these shapes (declaration order), or None where
they do not match the declarations; raises what ``layout_for`` raises for sizes it refuses."""


def _expression(dim: str, names: Mapping[str, str]) -> str:
    """A symbolic dimension as Python arithmetic on the locals holding its symbols' sizes."""
    value = poly(dim)
    assert not isinstance(value, int)
    terms = ["*".join([str(c)] + [names[symbol] for symbol in monomial]) for monomial, c in value.terms]
    return "(" + " + ".join(terms) + ")"


def layout_function(
    inputs: Sequence[tuple[Dim, ...]],
    dynamic: DynamicScratch | None,
    buffers: Sequence[tuple[str, tuple[Dim, ...] | None, np.dtype | None]],
    layout_for: Callable[[Mapping[str, int]], Any],
    make_layout: Callable[..., Any],
    threads: int,
    checked: bool,
    call_maps: Mapping[str, CallMap] | None = None,
) -> LayoutFunction:
    """The layout function of a program whose inputs are declared with these shapes.

    ``buffers``: ``(name, declared shape, dtype)`` of each buffer after the inputs (shape None:
    made per call). ``make_layout(table, arena bytes, buffers, unread)`` builds a layout as
    ``layout_for`` would; ``checked``: the program has checks that need a call's sizes, so every
    new size goes through ``layout_for``; ``call_maps``: the buffers made per call, by name.
    """
    call_maps = call_maps or {}
    lines = ["def layout(shapes):", f"    if len(shapes) != {len(inputs)}:", "        return None"]
    names: dict[str, str] = {}  # symbol -> its local
    for index, shape in enumerate(inputs):
        dims = [f"d{axis}" for axis in range(len(shape))]
        lines += [f"    shape = shapes[{index}]", f"    if len(shape) != {len(shape)}:", "        return None"]
        if dims:
            lines.append(f"    {', '.join(dims)}{',' if len(dims) == 1 else ''} = shape")
        wrong = []
        for dim, local in zip(shape, dims, strict=True):
            if isinstance(dim, int):
                wrong.append(f"{local} != {dim}")
            elif dim in names:
                wrong.append(f"{local} != {names[dim]}")
            elif not is_symbol(dim):  # "P+1": its symbols are named by earlier axes (Graph.input checks)
                wrong.append(f"{local} != {_expression(dim, names)}")
            else:
                names[dim] = f"s{len(names)}"
                lines.append(f"    {names[dim]} = {local}")
                wrong.append(f"{local} < 1")
        if wrong:
            lines += [f"    if {' or '.join(wrong)}:", "        return None"]
    symbols = () if dynamic is None else dynamic.symbols
    sizes = "{" + ", ".join(f"{symbol!r}: {local}" for symbol, local in names.items()) + "}"
    namespace: dict[str, Any] = {"layout_for": layout_for}
    plain = all(
        name in call_maps if shape is None else all(isinstance(dim, int) or dim in names for dim in shape)
        for name, shape, _ in buffers
    )
    if not names:  # static shapes: one layout for every call
        lines.append("    return layout_for({})")
    elif checked or not plain or any(symbol not in names for symbol in symbols) or dynamic is None:
        lines.append(f"    return layout_for({sizes})")
    else:
        ordered = [names[symbol] for symbol in symbols]
        bucket = ", ".join(f"({local} + {STRIDE_BUCKET - 1}) // {STRIDE_BUCKET} * {STRIDE_BUCKET}" for local in ordered)

        def shape_of(shape: tuple[Dim, ...] | None) -> str:
            if shape is None:  # a block map made per call
                return "None"
            dims = [str(dim) if isinstance(dim, int) else names[dim] for dim in shape]
            return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"

        described = [f"({name!r}, {shape_of(shape)}, dtype{i})" for i, (name, shape, _) in enumerate(buffers)]
        namespace |= {f"dtype{i}": dtype for i, (_, _, dtype) in enumerate(buffers)}
        maps = [name for name, shape, _ in buffers if shape is None]
        namespace |= {f"map{i}": call_maps[name] for i, name in enumerate(maps)}
        unread = ", ".join(f"*(({name!r},) if map{i}.unread(sizes) else ())" for i, name in enumerate(maps))
        namespace |= {"strides": dynamic.bucket_strides, "pack": struct.Struct(f"={len(ordered) + 1}q").pack}
        namespace["make_layout"] = make_layout
        lines += [
            f"    stride = strides.get(({bucket},))",
            "    if stride is None:",
            f"        return layout_for({sizes})",
            f"    table = pack({', '.join(ordered)}, stride)",
        ]
        arguments = f"table, {dynamic.offset} + stride * {threads}, ({', '.join(described)},)"
        if maps:
            lines += [f"    sizes = {sizes}", f"    unread = frozenset(({unread},))"]
            arguments += ", unread"
        lines.append(f"    return make_layout({arguments})")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<rlx call layout>", "exec"), namespace)  # our own source, written above
    function: LayoutFunction = namespace["layout"]
    function.__doc__ = source  # what it does, for a reader in a debugger
    return function
