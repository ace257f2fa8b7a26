"""Python's cyclic garbage collector paused while a graph compiles.

Lowering a graph and driving LLVM through llvmlite allocate tens of thousands of small objects.
Each time CPython's young generations fill, it may run a full collection, which walks every
object of the process: all of rlx, numpy and llvmlite, and torch's modules where ``rlx.torch``
is in use. Measured on a cold ``rlx demo`` (2-core Xeon): one full collection took 14 ms while
the register tiles' IR was built, and the demo's first compile took 187-200 ms with the
collector running against 172-187 ms without it. A compile's garbage is freed by reference
counting as it goes; the cycles it leaves (llvmlite's IR objects point at their parents) wait
for the first collection after it: compiling a 48-layer char LM with its gradients peaked at
520 MB of RSS against 466 with the collector running, and took 6.1 s against 7.0.

Why not ``gc.freeze()`` around the compile, which spares the old heap and keeps collecting the
new objects (483 MB, 6.5 s; the demo as fast): a program that freezes its own objects (before
forking workers, say) would find them unfrozen after rlx's compile.

The pause nests and is shared by threads that compile at once: the first to enter records
whether the collector was enabled, the last to leave restores that.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Run the body with the cyclic collector disabled, then restore its state."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
