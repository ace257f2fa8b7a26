"""Compiling many graphs in one process does not leak: dropped programs give their memory back.

Each compiled library is owned by an LLVM resource tracker that must be released when its last
executable and its compile-cache entry are gone. Run with ``pytest -m slow -s`` to see the RSS
figures.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import numpy as np
import pytest
from codegen_helpers import case_inputs, multi_graph
from helpers import Case

import rlx
from rlx import Layout, MaskKind, Wrt
from rlx.codegen import executable as executable_module

STATM = Path("/proc/self/statm")
GRAPHS = 200
WARM_UP = 30
ALLOWED_GROWTH_MB = 150.0
MASKS = [MaskKind.NONE, MaskKind.CAUSAL, MaskKind.sliding_window(2), MaskKind.CUSTOM, MaskKind.BIAS]


def rss_mb() -> float:
    """Resident set size now (not the peak), in MiB."""
    pages = int(STATM.read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def settle() -> float:
    """Drop every cached program, collect garbage, and return the RSS."""
    executable_module._cache.clear()
    gc.collect()
    return rss_mb()


def case_for(index: int) -> Case:
    return Case(
        seq_q=3 + index % 11,
        seq_k=2 + (index * 7) % 13,
        head_dim=2 + index % 5,
        batch=1 + index % 2,
        heads=1 + index % 3,
        mask=MASKS[index % len(MASKS)],
        layout=Layout.BSHD if index % 2 else Layout.BHSD,
    )


def test_dropped_programs_are_freed(rng: np.random.Generator) -> None:
    """Once its executables and its cache entry are gone, a program and its library are collected."""
    case = case_for(7)
    g = multi_graph(case, wrts=(Wrt.ALL,), name="freed")
    exe = rlx.compile(g)
    exe(**case_inputs(case, rng))
    program = weakref.ref(exe._program)
    library = weakref.ref(exe._program.library)
    del exe
    gc.collect()
    assert program() is not None, "the compile cache keeps the program for the next equal graph"
    for key, cached in list(executable_module._cache.items()):
        if cached is program():
            del executable_module._cache[key]
    del cached
    gc.collect()
    assert program() is None, f"still referenced by {[type(r).__name__ for r in gc.get_referrers(program())]}"
    assert library() is None


@pytest.mark.slow
@pytest.mark.skipif(not STATM.exists(), reason="needs /proc/self/statm")
def test_rss_stays_bounded_over_200_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 distinct graphs compiled, called once and dropped: RSS after warm-up grows < 150 MB."""
    monkeypatch.delenv("RLX_CACHE_DIR", raising=False)
    monkeypatch.delenv("RLX_DISK_CACHE", raising=False)
    start = settle()
    warm = start
    rng = np.random.default_rng(0)
    for index in range(GRAPHS):
        case = case_for(index)
        g = multi_graph(case, wrts=(Wrt.ALL, Wrt.VALUE), name=f"growth{index}")
        exe = rlx.compile(g)
        out = exe(**case_inputs(case, rng))
        assert all(np.all(np.isfinite(value)) for value in out.values())
        del exe, out, g
        if index + 1 == WARM_UP:
            warm = settle()
    final = settle()
    growth = final - warm
    print(
        f"\nRSS: start {start:.1f} MiB, after {WARM_UP} graphs {warm:.1f} MiB, after {GRAPHS} graphs "
        f"{final:.1f} MiB; growth after warm-up {growth:.1f} MiB "
        f"({1024 * growth / (GRAPHS - WARM_UP):.1f} KiB per graph)"
    )
    assert growth < ALLOWED_GROWTH_MB
