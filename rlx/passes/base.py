"""What a pass is, and the registry that names passes for ``rlx.passes.run`` and ``rlx opt -p``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlx.errors import RlxTypeError, RlxValueError

if TYPE_CHECKING:
    from rlx.ir import Graph


@dataclass(frozen=True)
class Pass:
    """A named in-place graph transform; ``apply`` returns True when it changed the graph.

    Passes see only the ``Graph``/``Node`` API, so the graph store can change under them.
    """

    name: str
    transform: Callable[[Graph], bool] = field(repr=False)
    summary: str = ""

    def apply(self, graph: Graph) -> bool:
        return bool(self.transform(graph))


PASSES: dict[str, Pass] = {}


def register(pass_: Pass) -> Pass:
    """Add ``pass_`` to :data:`PASSES` under its name; a different pass with the same name is refused."""
    if not isinstance(pass_, Pass):
        raise RlxTypeError(f"register expects an rlx.passes.Pass, got {type(pass_).__name__}")
    existing = PASSES.get(pass_.name)
    if existing is not None and existing != pass_:
        raise RlxValueError(f"a different pass is already registered as {pass_.name!r}")
    PASSES[pass_.name] = pass_
    return pass_
