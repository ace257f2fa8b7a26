"""Graph-to-graph transforms and the pass manager that runs them by name.

``run(g, ["cse", "fuse-attention-bwd", "dce"])`` applies passes in place, verifying after each.
Every transform lives in a file of its own and registers itself in :data:`PASSES`.
"""

from __future__ import annotations

from rlx.passes.base import PASSES, Pass, register
from rlx.passes.cse import cse
from rlx.passes.dce import dce
from rlx.passes.fuse_attention_bwd import fuse_attention_bwd
from rlx.passes.manager import resolve, run

DEFAULT_PIPELINE: tuple[str, ...] = ("cse", "fuse-attention-bwd", "dce")
"""What ``rlx.compile`` runs when ``passes`` is None: dedupe, fuse siblings, then drop the dead."""

__all__ = ["DEFAULT_PIPELINE", "PASSES", "Pass", "cse", "dce", "fuse_attention_bwd", "register", "resolve", "run"]
