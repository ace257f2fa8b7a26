"""LLVM IR text -> optimised module -> object code -> linked, callable library.

render (``rlx.codegen.lower``) -> compile (this file: O3 for the host CPU, then machine code)
-> load (LLJIT links the object with BLAS and pthread symbols imported by address, so a missing
symbol raises instead of aborting). Each library is owned by a resource tracker: when the last
executable using it is gone, LLVM frees its code, so compiling many graphs does not grow memory
without bound.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llvmlite
import llvmlite.binding as llvm

from rlx.codegen.blas import LIBM, OMATCOPY, SGEMM, SGEMV, libc_symbol, load_blas
from rlx.errors import RlxError

ENTRY = "rlx_entry"
_IMPORTED_LIBC = ("pthread_create", "pthread_join", "sched_yield", "clock_gettime", "qsort_r", *LIBM.values())
_library_ids = itertools.count()
_lock = threading.RLock()
# LLVM's boolean options, on while rlx compiles any module (and only then: they are process-wide
# in LLVM, and other users of llvmlite in the process keep their own). Loop strength reduction
# rewrote the register tiles' few base pointers into A (tile_gemm._row_bases) back into a chain
# of an add per row on every step of k (3% slower products), and bought the other kernels
# nothing (attention forward and backward, a transformer block's step: within 1% either way,
# interleaved, AMD EPYC) while it took 14% of their machine code's time (11 ms of the demo graph's).
LLVM_FLAGS = ("disable-lsr",)


@dataclass
class JitState:
    """Process-wide LLVM objects, made once (target machine creation is slow)."""

    target_machine: llvm.TargetMachine
    quick_machine: llvm.TargetMachine  # LLVM's fast instruction selection: see link_runtime
    lljit: llvm.LLJIT
    cpu: str
    features: str


_state: JitState | None = None


def jit_state() -> JitState:
    """The process's LLVM objects, made on first use under the lock: two threads compiling at once
    must not make two LLJITs (the one not kept would free code that is still linked into it)."""
    global _state
    with _lock:
        if _state is None:
            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            load_blas()
            cpu = llvm.get_host_cpu_name()
            features = llvm.get_host_cpu_features().flatten()
            target = llvm.Target.from_triple(llvm.get_process_triple())
            machine = target.create_target_machine(cpu=cpu, features=features, opt=3, codemodel="jitdefault")
            quick = target.create_target_machine(cpu=cpu, features=features, opt=0, codemodel="jitdefault")
            _state = JitState(machine, quick, llvm.create_lljit_compiler(machine), cpu, features)
        return _state


@dataclass
class CompiledLibrary:
    """A loaded library: the entry address stays valid while ``tracker`` is referenced."""

    entry_address: int
    tracker: object
    llvm_ir: str
    object_code: bytes
    times: dict[str, float] = field(default_factory=dict)
    _optimized_ir: str | None = None

    @property
    def optimized_ir(self) -> str:
        """The IR after the pipeline; a disk-cache hit skipped it, so it is redone on demand."""
        if self._optimized_ir is None:
            with _lock:
                self._optimized_ir = str(_optimized_module(self.llvm_ir))
        return self._optimized_ir

    @functools.cached_property
    def asm(self) -> str:
        with _lock:
            return jit_state().target_machine.emit_assembly(llvm.parse_assembly(self.optimized_ir))


def optimize(module: llvm.ModuleRef, machine: llvm.TargetMachine) -> None:
    """A lean pipeline: drop unused internal functions, inline, promote allocas, simplify,
    value-number, clean up.

    The kernels are vectorised by hand and spend their time in BLAS, so LLVM's standard O1-O3
    pipelines bought no speed here but cost 100-140 ms (of a 200 ms budget) on the demo graph;
    this one takes ~20 ms. LLVM's vectorisers stay off in any case: the llvmlite wheels ship
    LLVM with assertions on, and the loop vectoriser's cost model asserts (aborting the
    process) on some loop shapes that user graphs can produce.
    """
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=2))
    passes = llvm.create_new_module_pass_manager()
    passes.add_global_dead_code_eliminate_pass()  # e.g. the names of kernels that share code
    passes.add_always_inliner_pass()
    passes.add_sroa_pass()
    passes.add_instruction_combine_pass()
    passes.add_simplify_cfg_pass()
    passes.add_sccp_pass()
    passes.add_new_gvn_pass()
    passes.add_instruction_combine_pass()
    passes.add_aggressive_dce_pass()
    passes.add_simplify_cfg_pass()
    passes.run(module, builder)


def cache_key(llvm_ir: str) -> str:
    """Key of an object file: the IR plus everything that changes the machine code made from it."""
    from rlx import __version__

    state = jit_state()
    parts = [
        llvm_ir,
        llvmlite.__version__,
        ".".join(map(str, llvm.llvm_version_info)),
        state.cpu,
        state.features,
        __version__,
        *LLVM_FLAGS,
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def disk_cache_dir() -> Path | None:
    """``RLX_CACHE_DIR``, or ``~/.cache/rlx`` when ``RLX_DISK_CACHE=1``; None: no disk cache."""
    explicit = os.environ.get("RLX_CACHE_DIR")
    if explicit:
        return Path(explicit)
    if os.environ.get("RLX_DISK_CACHE", "") not in ("", "0"):
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "rlx"
    return None


def _optimized_module(llvm_ir: str) -> llvm.ModuleRef:
    """Parse, target and optimise; the caller holds ``_lock``."""
    state = jit_state()
    module = llvm.parse_assembly(llvm_ir)
    module.triple = llvm.get_process_triple()
    module.data_layout = str(state.target_machine.target_data)
    module.verify()
    optimize(module, state.target_machine)
    return module


def compile_ir(llvm_ir: str, prebuilt: Mapping[str, bytes] | None = None) -> CompiledLibrary:
    """Optimise and compile ``llvm_ir`` for this CPU and link it; times each stage.

    ``prebuilt`` maps IR keys (:func:`cache_key`) to object code already made for them (an
    unpickled executable's); like a disk-cache hit, it is linked without compiling. So is the
    object of an IR this process compiled recently (:class:`_RecentObjects`).
    """
    key = cache_key(llvm_ir)
    cache_dir = disk_cache_dir()
    cached = prebuilt.get(key) if prebuilt else None
    recent = _recent_objects.get(key) if cached is None else None
    if cached is None:
        cached = recent if recent is not None else _read_cache(cache_dir, key)
    if cached is not None:  # a recent compile's object is not a disk-cache hit; a prebuilt one counts as one
        hit = {"llvm_optimize": 0.0, "machine_code": 0.0, "disk_cache_hit": float(recent is None)}
        try:
            return _load(cached, llvm_ir, None, hit)
        except RlxError:
            pass  # an entry that passed its checksum but does not link: compile afresh, overwrite it
    times: dict[str, float] = {"disk_cache_hit": 0.0}
    with _lock:  # llvmlite serialises compilation; keep module handling on one thread at a time
        start = time.perf_counter()
        module = _optimized_module(llvm_ir)
        times["llvm_optimize"] = time.perf_counter() - start
        optimized_ir = str(module)  # before code generation, which rewrites the module in place
        start = time.perf_counter()
        with _llvm_flags():
            object_code = jit_state().target_machine.emit_object(module)
        times["machine_code"] = time.perf_counter() - start
    library = _load(object_code, llvm_ir, optimized_ir, times)
    _write_cache(cache_dir, key, object_code)
    _recent_objects.put(key, object_code)
    return library


class _RecentObjects:
    """The object code of the last graphs compiled in this process, by IR key: graphs that differ
    (in names, in a config value their kernels never read) often lower to the same IR, and a hit
    links without LLVM, as a disk-cache hit does. Bounded in bytes, oldest out first."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._objects: dict[str, bytes] = {}
        self._bytes = 0

    def get(self, key: str) -> bytes | None:
        with _lock:
            found = self._objects.pop(key, None)
            if found is not None:
                self._objects[key] = found  # most recent last
            return found

    def clear(self) -> None:
        with _lock:
            self._objects.clear()
            self._bytes = 0

    def put(self, key: str, object_code: bytes) -> None:
        if len(object_code) > self.budget // 4:
            return
        with _lock:
            self._bytes -= len(self._objects.pop(key, b""))
            self._objects[key] = object_code
            self._bytes += len(object_code)
            while self._bytes > self.budget:
                oldest = next(iter(self._objects))
                self._bytes -= len(self._objects.pop(oldest))


_recent_objects = _RecentObjects(budget=16 << 20)


def _load(object_code: bytes, llvm_ir: str, optimized_ir: str | None, times: dict[str, float]) -> CompiledLibrary:
    """Link object code into the JIT with BLAS, pthread and thread-pool symbols imported by address."""
    from rlx.codegen.pool import pool_symbols
    from rlx.codegen.tile_gemm import tile_symbols

    start = time.perf_counter()
    blas = load_blas()
    imports = {SGEMM: blas.sgemm_address, SGEMV: blas.sgemv_address, OMATCOPY: blas.omatcopy_address}
    imports |= {name: libc_symbol(name) for name in _IMPORTED_LIBC}
    imports |= pool_symbols()
    imports |= tile_symbols(llvm_ir)
    tracker = _link(object_code, imports, (ENTRY,))
    times["link"] = time.perf_counter() - start
    return CompiledLibrary(tracker[ENTRY], tracker, llvm_ir, object_code, times, optimized_ir)


def _link(object_code: bytes, imports: Mapping[str, int], exports: tuple[str, ...]) -> Any:
    """Link one object into the process's JIT; its resource tracker (indexable by export name)."""
    library = llvm.JITLibraryBuilder().add_object_img(object_code).add_current_process()
    for name, address in imports.items():
        library.import_symbol(name, address)
    for name in exports:
        library.export_symbol(name)
    with _lock:
        try:
            return library.link(jit_state().lljit, f"rlx_lib_{next(_library_ids)}")
        except RuntimeError as exc:
            raise RlxError(f"linking the generated code failed: {exc}") from exc


_runtimes: list[object] = []  # runtime libraries: linked once, never freed


def link_runtime(llvm_ir: str, libc: tuple[str, ...], exports: tuple[str, ...], quick: bool = False) -> dict[str, int]:
    """Compile and link a module of the rlx runtime (its thread pool, the attention kernels'
    register tiles) for the life of the process: the addresses of its ``exports``. With a disk
    cache (:func:`disk_cache_dir`) its object file is kept there as a graph's is, so a process
    that finds it links without compiling. ``quick`` makes its machine code with LLVM's fast
    instruction selection and register allocation (codegen level 0, after rlx's own IR
    optimisation): for code whose speed is not in its instructions, a fifth of the compile time."""
    cache_dir = disk_cache_dir()
    # no hashing without a disk cache; quick changes the code, so it is part of the key (as the flags are)
    key = cache_key(llvm_ir + ("\n; quick" if quick else "")) if cache_dir is not None else ""
    imports = {name: libc_symbol(name) for name in libc}
    cached = _read_cache(cache_dir, key)
    tracker = None
    with _lock:
        if cached is not None:
            # An entry that passed its checksum but does not link: compile afresh, overwrite it.
            with contextlib.suppress(RlxError):
                tracker = _link(cached, imports, exports)
        if tracker is None:
            with _llvm_flags():
                state = jit_state()
                machine = state.quick_machine if quick else state.target_machine
                object_code = machine.emit_object(_optimized_module(llvm_ir))
            tracker = _link(object_code, imports, exports)
            _write_cache(cache_dir, key, object_code)
        _runtimes.append(tracker)
    return {name: int(tracker[name]) for name in exports}


@contextlib.contextmanager
def _llvm_flags() -> Iterator[None]:
    """:data:`LLVM_FLAGS` on, then off again; the caller holds ``_lock``, under which every rlx
    compile runs, so no other module is compiled with them."""
    for flag in LLVM_FLAGS:
        llvm.set_option("rlx", f"-{flag}")
    try:
        yield
    finally:
        for flag in LLVM_FLAGS:
            llvm.set_option("rlx", f"-{flag}=false")


_MAGIC = b"rlx-object-v1\n"


def _read_cache(cache_dir: Path | None, key: str) -> bytes | None:
    """The cached object, or None when absent or damaged (a damaged entry is removed)."""
    if cache_dir is None:
        return None
    path = cache_dir / f"{key}.o"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    header_end = len(_MAGIC) + 65  # magic, sha256 hex digest, newline
    payload = data[header_end:]
    digest = hashlib.sha256(payload).hexdigest().encode()
    if data[: len(_MAGIC)] != _MAGIC or data[len(_MAGIC) : header_end - 1] != digest:
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return payload


def _write_cache(cache_dir: Path | None, key: str, object_code: bytes) -> None:
    """Write atomically (temp file + rename) with a checksum, so a reader never trusts half a file."""
    if cache_dir is None:
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        temporary = cache_dir / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        digest = hashlib.sha256(object_code).hexdigest().encode()
        temporary.write_bytes(_MAGIC + digest + b"\n" + object_code)
        os.replace(temporary, cache_dir / f"{key}.o")
    except OSError:
        pass  # the disk cache is an optimisation; a read-only home must not break compilation
