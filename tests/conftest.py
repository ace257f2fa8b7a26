"""Shared fixtures for the whole test tree."""

from __future__ import annotations

import numpy as np
import pytest

# `import helpers` works from every test directory through `pythonpath` in pyproject.toml.


@pytest.fixture
def rng() -> np.random.Generator:
    """A freshly seeded generator per test, so every failure reproduces."""
    return np.random.default_rng(20251202)
