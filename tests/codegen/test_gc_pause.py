"""The collector pause around compiles (``rlx.codegen.gc_pause``) nests, is shared by threads,
and always leaves the collector as it found it."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import rlx
from rlx.codegen.gc_pause import collection_paused


@pytest.fixture(autouse=True)
def restore_collector() -> object:
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


def test_nested_pauses_restore_an_enabled_collector() -> None:
    gc.enable()
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    with collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_an_error_inside_still_restores() -> None:
    gc.enable()
    with pytest.raises(ValueError), collection_paused():
        raise ValueError("boom")
    assert gc.isenabled()


def test_overlapping_threads_restore_once_all_leave() -> None:
    gc.enable()
    entered, release = threading.Barrier(3), threading.Event()

    def hold() -> None:
        with collection_paused():
            entered.wait()
            release.wait()

    workers = [threading.Thread(target=hold) for _ in range(2)]
    for worker in workers:
        worker.start()
    entered.wait()
    assert not gc.isenabled()
    release.set()
    for worker in workers:
        worker.join()
    assert gc.isenabled()


def test_compiling_leaves_the_collector_enabled() -> None:
    gc.enable()
    g = rlx.Graph("gc_pause")
    x = g.input("x", (3, 5))
    g.output(y=g.softmax(x * 1.5 + 0.25))  # a graph no other test compiles: a real build
    exe = rlx.compile(g)
    assert gc.isenabled()
    value = np.arange(15, dtype=np.float32).reshape(3, 5)
    np.testing.assert_allclose(exe(x=value)["y"].sum(axis=-1), np.ones(3), rtol=1e-6)
