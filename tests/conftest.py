"""Shared fixtures for the whole test tree."""

from __future__ import annotations

import numpy as np
import pytest

# `import helpers` works from every test directory through `pythonpath` in pyproject.toml.


@pytest.fixture
def rng() -> np.random.Generator:
    """A freshly seeded generator per test, so every failure reproduces."""
    return np.random.default_rng(20251202)


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every output array a compiled call writes into starts as garbage (NaN, or a large int), as a
    recycled one may (``rlx.codegen.output_pool``): a kernel that leaves an element unwritten,
    relying on fresh pages being zero, fails every test that reads that element."""
    from rlx.codegen.output_pool import OutputPool

    take = OutputPool.take

    def poisoned(self: OutputPool, name: str, shape: tuple[int, ...], dtype: np.dtype | str) -> np.ndarray:
        array = take(self, name, shape, dtype)
        kind = np.dtype(dtype).kind
        array.fill(np.nan if kind == "f" else True if kind == "b" else np.iinfo(array.dtype).max)
        return array

    monkeypatch.setattr(OutputPool, "take", poisoned)
