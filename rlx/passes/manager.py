"""Run passes by name: verify after each, blame the pass in errors, print and time on request."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from rlx.errors import RlxError, RlxKeyError, RlxTypeError
from rlx.ir import Graph
from rlx.passes.base import PASSES, Pass

if TYPE_CHECKING:
    from collections.abc import MutableMapping


def resolve(names: Sequence[str]) -> list[Pass]:
    """The registered passes for ``names``; checks all of them before anything runs."""
    if not isinstance(names, (list, tuple)):
        hint = " (split a comma-separated string first)" if isinstance(names, str) else ""
        raise RlxTypeError(f"pass names must be a list or tuple of str, got {type(names).__name__}{hint}")
    passes = []
    for name in names:
        if not isinstance(name, str):
            raise RlxTypeError(f"pass names must be str, got {type(name).__name__} ({name!r})")
        if name not in PASSES:
            raise RlxKeyError(f"unknown pass {name!r}; known passes: {', '.join(sorted(PASSES))}")
        passes.append(PASSES[name])
    return passes


def run(
    graph: Graph,
    names: Sequence[str],
    *,
    verify: bool = True,
    print_after_all: bool | TextIO = False,
    timings: MutableMapping[str, float] | None = None,
) -> bool:
    """Apply the passes ``names`` to ``graph`` in place, in order; True if any changed it.

    With ``verify`` the graph is checked before the first pass and after each one. An
    ``RlxError`` from a pass or from the check after it is re-raised as the same class with
    ``"pass 'NAME': "`` in front. ``print_after_all`` (True for stdout, or a text stream) prints
    the IR after every pass that changed something. ``timings`` accumulates seconds per pass name.
    """
    if not isinstance(graph, Graph):
        raise RlxTypeError(f"run expects an rlx.Graph, got {type(graph).__name__}")
    passes = resolve(names)
    stream: TextIO | None = sys.stdout if print_after_all is True else (print_after_all or None)
    # Each check is skipped where nothing it checks changed since the last one that passed
    # (Graph._verify_unless_unchanged): a pass that changed nothing, or a graph just verified.
    if verify:
        graph._verify_unless_unchanged()  # a graph broken on entry is the caller's problem, not the first pass's
    changed_any = False
    for pass_ in passes:
        start = time.perf_counter()
        try:
            changed = pass_.apply(graph)
            elapsed = time.perf_counter() - start
            if verify:
                graph._verify_unless_unchanged()
        except RlxError as exc:
            raise type(exc)(f"pass '{pass_.name}': {exc}") from exc
        if timings is not None:
            timings[pass_.name] = timings.get(pass_.name, 0.0) + elapsed
        changed_any |= changed
        if changed and stream is not None:
            print(f"// ----- IR after {pass_.name} ----- //", file=stream)
            print(graph, file=stream)
    return changed_any
