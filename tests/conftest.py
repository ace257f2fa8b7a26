"""Shared fixtures for the whole test tree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings

# `import helpers` works from every test directory through `pythonpath` in pyproject.toml.

# The default run draws the same examples every time (a fuzzer's examples follow from the test's
# name), so that it passes or fails for the code, not for the draw; `--hypothesis-profile=random`
# (with `--hypothesis-seed=N` to repeat one) explores new ones, as the long fuzzing runs do.
settings.register_profile("suite", derandomize=True, database=None)
settings.register_profile("random", derandomize=False)
settings.load_profile("suite")


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


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects: the marks added here count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``@pytest.mark.thin("name")`` on a test with several parameters: the default run takes
    each value of ``name`` with a share of the other parameters' combinations, not with all of
    them; the rest are slow cases (``-m slow``).

    A combination runs by default when the position of its ``name`` value equals the sum of the
    other parameters' positions modulo the number of ``name`` values: every value of ``name``
    still meets every value of each other parameter that has at least as many values, so
    ``name`` should be the parameter with the fewest. Meant for an axis, such as a layout, that
    the kernels treat alike for most of the other parameters.
    """
    groups: dict[object, list[pytest.Item]] = {}
    for item in items:
        marker = item.get_closest_marker("thin")
        if marker is not None and hasattr(item, "callspec"):
            groups.setdefault((getattr(item, "function", None), marker.args[0]), []).append(item)
    for (_, name), members in groups.items():
        # One parameter per parametrize decorator: names given together vary together.
        axes = [_argnames(marker)[0] for marker in members[0].iter_markers("parametrize")]
        seen: dict[str, list[object]] = {axis: [] for axis in axes}
        positions = [{axis: _position(seen[axis], member.callspec.params[axis]) for axis in axes} for member in members]  # type: ignore[attr-defined]
        count = len(seen[name])
        for member, position in zip(members, positions, strict=True):
            others = sum(index for axis, index in position.items() if axis != name)
            if position[name] != others % count:
                member.add_marker(pytest.mark.slow)


def _argnames(marker: pytest.Mark) -> list[str]:
    names = marker.args[0]
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


def _position(values: list[object], value: object) -> int:
    """``value``'s place among the values seen so far, added at the end if new (by identity or
    by type and repr: parameters may be arrays, whose ``==`` is elementwise)."""
    for i, seen in enumerate(values):
        if seen is value or (type(seen) is type(value) and repr(seen) == repr(value)):
            return i
    values.append(value)
    return len(values) - 1
