"""Compile caches: an equal graph compiles once per process; object files persist on disk.

The in-process cache is keyed on the printed graph, passes, config, thread count and codegen
options; the disk cache (``RLX_CACHE_DIR``) on the LLVM IR plus everything that changes the
machine code made from it (rlx and llvmlite versions, LLVM version, CPU name and features).
"""

from __future__ import annotations

import ctypes
import statistics
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from codegen_helpers import assert_outputs_close, case_inputs, multi_graph
from helpers import Case

import rlx
from rlx import Graph, Layout, MaskKind, RuntimeConfig, Wrt
from rlx.codegen import CodegenOptions, Executable, compile_graph, jit
from rlx.codegen import executable as executable_module

CASE = Case(9, 12, head_dim=4, batch=2, heads=2, mask=MaskKind.CAUSAL, layout=Layout.BSHD)


def build(name: str = "cache") -> Graph:
    """A fresh Graph object, equal (same printout) to every other one built with the same name."""
    return multi_graph(CASE, wrts=(Wrt.ALL, Wrt.QUERY), name=name)


def unique_name() -> str:
    """A graph name no earlier test (or earlier run with the same disk cache) has compiled."""
    return f"cache_{uuid.uuid4().hex[:12]}"


def is_cache_hit(exe: Executable) -> bool:
    return "cache_lookup" in exe.compile_times and "llvm_optimize" not in exe.compile_times


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests opt in to a disk cache in their own tmp_path; never read the user's one."""
    monkeypatch.delenv("RLX_CACHE_DIR", raising=False)
    monkeypatch.delenv("RLX_DISK_CACHE", raising=False)


# ---------------------------------------------------------------------------- in-process cache


def test_equal_graph_compiles_from_the_cache(rng: np.random.Generator) -> None:
    """A second compile of a separately built, equal graph takes < 5 ms and reuses the program."""
    name = unique_name()
    first = rlx.compile(build(name))
    assert not is_cache_hit(first)
    timings = []
    for _ in range(5):
        other = build(name)  # built outside the timed region
        start = time.perf_counter()
        again = rlx.compile(other)
        timings.append(time.perf_counter() - start)
        assert is_cache_hit(again)
        assert again._program is first._program
        assert again is not first
    assert statistics.median(timings) < 0.005, timings
    arrays = case_inputs(CASE, rng)
    assert_outputs_close(again(**arrays), rlx.reference.run(build(name), **arrays))


def test_cache_hit_reports_its_own_timings() -> None:
    name = unique_name()
    rlx.compile(build(name))
    hit = rlx.compile(build(name))
    assert set(hit.compile_times) == {"cache_lookup", "total"}
    assert hit.compile_times["total"] >= hit.compile_times["cache_lookup"] >= 0.0


def test_different_settings_are_different_programs(rng: np.random.Generator) -> None:
    """Config, passes, thread count, codegen options or any graph detail: never served stale code."""
    name = unique_name()
    base = rlx.compile(build(name), config=RuntimeConfig(num_threads=2))
    variants = {
        "config": lambda: rlx.compile(build(name), config=RuntimeConfig(attn_mask_neg_inf=-2.0, num_threads=2)),
        "passes": lambda: rlx.compile(build(name), passes=[], config=RuntimeConfig(num_threads=2)),
        "threads": lambda: rlx.compile(build(name), config=RuntimeConfig(num_threads=1)),
        "options": lambda: compile_graph(build(name), config=RuntimeConfig(num_threads=2),
                                         options=CodegenOptions(block_q=3)),
        "graph": lambda: rlx.compile(multi_graph(CASE, wrts=(Wrt.ALL, Wrt.KEY), name=name),
                                     config=RuntimeConfig(num_threads=2)),
    }
    programs = {id(base._program)}
    for what, make in variants.items():
        exe = make()
        assert not is_cache_hit(exe), what
        programs.add(id(exe._program))
    assert len(programs) == 1 + len(variants)

    # The config variant really computes with its own neg (a stale program would not).
    config = RuntimeConfig(attn_mask_neg_inf=-2.0, num_threads=2)
    arrays = case_inputs(CASE, rng)
    exe = rlx.compile(build(name), config=config)
    assert is_cache_hit(exe)
    assert_outputs_close(exe(**arrays), rlx.reference.run(build(name), config=config, **arrays))


def test_equal_config_objects_share_a_program() -> None:
    """Configs compare by value: two equal RuntimeConfig objects hit the same entry."""
    name = unique_name()
    first = rlx.compile(build(name), config=RuntimeConfig(attn_mask_neg_inf=-3.0))
    second = rlx.compile(build(name), config=RuntimeConfig(attn_mask_neg_inf=-3))
    assert is_cache_hit(second) and second._program is first._program


# ---------------------------------------------------------------------------- disk cache


def _disk_hit(exe: Executable) -> bool:
    flag = exe._program.library.times["disk_cache_hit"]
    if "disk_cache_hit" in exe.compile_times:  # surfaced or not, it must agree
        assert exe.compile_times["disk_cache_hit"] == flag
    return flag == 1.0


def test_disk_cache_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> None:
    """First compile writes ``<key>.o``; after clearing the process cache the next compile loads it."""
    monkeypatch.setenv("RLX_CACHE_DIR", str(tmp_path))
    name = unique_name()
    first = rlx.compile(build(name))
    assert not _disk_hit(first)
    objects = list(tmp_path.glob("*.o"))
    assert len(objects) == 1
    assert objects[0].stem == jit.cache_key(first.llvm_ir)
    stored = objects[0].read_bytes()  # a checksummed header, then the object code itself
    assert stored.startswith(b"rlx-object-v1\n") and stored.endswith(first._program.library.object_code)
    assert not list(tmp_path.glob("*.tmp")), "temporary files must be renamed into place"

    executable_module._cache.clear()
    jit._recent_objects.clear()  # nor the object code of recent compiles: what is left is the disk
    second = rlx.compile(build(name))
    assert not is_cache_hit(second)  # not from the process cache ...
    assert _disk_hit(second)  # ... but from disk
    assert second.llvm_ir == first.llvm_ir
    arrays = case_inputs(CASE, rng)
    want = first(**arrays)
    got = second(**arrays)
    for key, value in want.items():
        assert np.array_equal(got[key], value), key
    assert_outputs_close(got, rlx.reference.run(build(name), **arrays))
    assert len(list(tmp_path.glob("*.o"))) == 1


def test_no_disk_cache_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jit.disk_cache_dir() is None
    assert not _disk_hit(rlx.compile(build(unique_name())))
    assert not list(tmp_path.rglob("*.o"))


def test_rlx_disk_cache_uses_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLX_DISK_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jit.disk_cache_dir() == tmp_path / "rlx"
    rlx.compile(build(unique_name()))
    assert len(list((tmp_path / "rlx").glob("*.o"))) == 1


def test_unwritable_cache_dir_does_not_break_compilation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """RLX_CACHE_DIR naming a regular file: the cache is skipped, the compile still works."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("RLX_CACHE_DIR", str(blocker))
    name = unique_name()
    exe = rlx.compile(build(name))
    arrays = case_inputs(CASE, rng)
    assert_outputs_close(exe(**arrays), rlx.reference.run(build(name), **arrays))


def test_corrupt_cache_entry_is_recompiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """The disk cache is an optimisation: a damaged entry must be ignored (and ideally replaced)."""
    monkeypatch.setenv("RLX_CACHE_DIR", str(tmp_path))
    name = unique_name()
    rlx.compile(build(name))
    (entry,) = tmp_path.glob("*.o")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    executable_module._cache.clear()
    jit._recent_objects.clear()  # nor the object code of recent compiles: what is left is the disk
    exe = rlx.compile(build(name))
    arrays = case_inputs(CASE, rng)
    assert_outputs_close(exe(**arrays), rlx.reference.run(build(name), **arrays))


def test_disk_hit_reports_the_optimised_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``optimized_llvm_ir`` and ``asm`` are the same whether the object came from LLVM or from disk."""
    monkeypatch.setenv("RLX_CACHE_DIR", str(tmp_path))
    name = unique_name()
    fresh = rlx.compile(build(name))
    executable_module._cache.clear()
    jit._recent_objects.clear()  # nor the object code of recent compiles: what is left is the disk
    loaded = rlx.compile(build(name))
    assert _disk_hit(loaded)
    assert loaded.optimized_llvm_ir == fresh.optimized_llvm_ir
    assert loaded.asm == fresh.asm


def test_disk_key_depends_on_everything_that_shapes_machine_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same IR, same key; a different IR, rlx version, CPU name, CPU features, llvmlite version or
    LLVM options: a different key."""
    ir_text = rlx.compile(build(unique_name())).llvm_ir
    base = jit.cache_key(ir_text)
    assert jit.cache_key(ir_text) == base
    assert jit.cache_key(ir_text + "\n; another module\n") != base

    with monkeypatch.context() as patch:
        patch.setattr(rlx, "__version__", rlx.__version__ + ".post1")
        assert jit.cache_key(ir_text) != base
    assert jit.cache_key(ir_text) == base

    state = jit.jit_state()
    with monkeypatch.context() as patch:
        patch.setattr(state, "features", state.features + ",+imaginary-feature")
        assert jit.cache_key(ir_text) != base
    with monkeypatch.context() as patch:
        patch.setattr(state, "cpu", state.cpu + "-other")
        assert jit.cache_key(ir_text) != base
    with monkeypatch.context() as patch:
        patch.setattr(jit.llvmlite, "__version__", "0.0.0")
        assert jit.cache_key(ir_text) != base
    with monkeypatch.context() as patch:  # the LLVM options rlx compiles with
        patch.setattr(jit, "LLVM_FLAGS", ())
        assert jit.cache_key(ir_text) != base
    assert jit.cache_key(ir_text) == base


def test_version_change_misses_the_disk_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An object file written by another rlx version is never loaded."""
    monkeypatch.setenv("RLX_CACHE_DIR", str(tmp_path))
    name = unique_name()
    rlx.compile(build(name))
    executable_module._cache.clear()
    jit._recent_objects.clear()  # nor the object code of recent compiles: what is left is the disk
    monkeypatch.setattr(rlx, "__version__", rlx.__version__ + ".post1")
    exe = rlx.compile(build(name))
    assert not _disk_hit(exe)
    assert len(list(tmp_path.glob("*.o"))) == 2


def test_runtime_modules_use_the_disk_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime module (the thread pool, the register tiles) is compiled once and kept in the disk
    cache like a graph's object file: linking it again reads the object instead of compiling."""
    monkeypatch.setenv("RLX_CACHE_DIR", str(tmp_path))
    name = f"rlx_test_runtime_{uuid.uuid4().hex[:12]}"
    llvm_ir = f"define i64 @{name}(i64 %x) {{\n  %y = mul i64 %x, 3\n  ret i64 %y\n}}\n"
    first = jit.link_runtime(llvm_ir, (), (name,))
    assert len(list(tmp_path.glob("*.o"))) == 1

    def no_compiling(*_: object) -> None:
        raise AssertionError("compiled although the disk cache holds the object")

    monkeypatch.setattr(jit, "_optimized_module", no_compiling)
    second = jit.link_runtime(llvm_ir, (), (name,))
    for addresses in (first, second):
        assert ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(addresses[name])(14) == 42


def test_quick_runtime_modules_compute_the_same_and_are_cached_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime module made with the quick code generator (the thread pool's) computes what the
    optimising one's does, and its object file has a disk-cache key of its own."""
    monkeypatch.setenv("RLX_CACHE_DIR", str(tmp_path))
    name = f"rlx_test_quick_{uuid.uuid4().hex[:12]}"
    llvm_ir = (
        f"define i64 @{name}(i64 %n) {{\nentry:\n  br label %loop\nloop:\n"
        "  %i = phi i64 [ 0, %entry ], [ %next, %loop ]\n  %acc = phi i64 [ 0, %entry ], [ %sum, %loop ]\n"
        "  %sq = mul i64 %i, %i\n  %sum = add i64 %acc, %sq\n  %next = add i64 %i, 1\n"
        "  %done = icmp sge i64 %next, %n\n  br i1 %done, label %exit, label %loop\nexit:\n  ret i64 %sum\n}\n"
    )
    results = []
    for quick in (True, False):
        address = jit.link_runtime(llvm_ir, (), (name,), quick=quick)[name]
        results.append(ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(address)(100))
    assert results == [sum(i * i for i in range(100))] * 2
    assert len(list(tmp_path.glob("*.o"))) == 2


def test_recent_object_code_is_linked_again_without_llvm(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """A graph whose IR this process compiled recently links that object code again (no LLVM
    pipeline, no machine code), computes the same results, and is not called a disk hit."""
    monkeypatch.delenv("RLX_CACHE_DIR", raising=False)
    monkeypatch.delenv("RLX_DISK_CACHE", raising=False)
    name = unique_name()
    first = rlx.compile(build(name))
    executable_module._cache.clear()
    again = rlx.compile(build(name))
    assert not is_cache_hit(again) and again._program is not first._program
    assert again.compile_times["llvm_optimize"] == 0.0 and not _disk_hit(again)
    assert again.llvm_ir == first.llvm_ir
    arrays = case_inputs(CASE, rng)
    assert_outputs_close(again(**arrays), rlx.reference.run(build(name), **arrays))
    jit._recent_objects.clear()
    executable_module._cache.clear()
    assert rlx.compile(build(name)).compile_times["llvm_optimize"] > 0.0
