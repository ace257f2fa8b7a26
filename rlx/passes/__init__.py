"""Graph-to-graph transforms and the pass manager that runs them by name.

``run(g, ["cse", "fuse-attention-bwd", "dce"])`` applies passes in place, verifying after each.
Every transform lives in a file of its own and registers itself in :data:`PASSES`.
"""

from __future__ import annotations

from rlx.passes.base import PASSES, Pass, register
from rlx.passes.cse import cse
from rlx.passes.dce import dce
from rlx.passes.decompose import decompose
from rlx.passes.fuse_attention_bwd import fuse_attention_bwd
from rlx.passes.fuse_elementwise import fuse_elementwise
from rlx.passes.manager import resolve, run
from rlx.passes.masks_as_mods import masks_as_mods

DEFAULT_PIPELINE: tuple[str, ...] = ("cse", "fuse-attention-bwd", "decompose", "cse", "fuse-elementwise", "dce")
"""What ``rlx.compile`` runs when ``passes`` is None: dedupe, fuse attention siblings, rebuild
composite ops from primitives (so a norm's forward and gradient share their row statistics),
dedupe again, merge elementwise chains into ``fused_elementwise`` nodes, then drop the dead.
Codegen puts each fused chain and the reductions and views around it into one loop nest."""

__all__ = [
    "DEFAULT_PIPELINE",
    "PASSES",
    "Pass",
    "cse",
    "dce",
    "decompose",
    "fuse_attention_bwd",
    "fuse_elementwise",
    "masks_as_mods",
    "register",
    "resolve",
    "run",
]
