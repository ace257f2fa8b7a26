"""Shared fixtures for the whole test tree."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# `import helpers` must work from every test directory, whatever pytest's import mode.
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def rng() -> np.random.Generator:
    """A freshly seeded generator per test, so every failure reproduces."""
    return np.random.default_rng(20251202)
