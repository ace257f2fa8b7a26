"""LLVM IR text -> optimised module -> object code -> linked, callable library.

render (``rlx.codegen.lower``) -> compile (this file: O3 for the host CPU, then machine code)
-> load (LLJIT links the object with BLAS and pthread symbols imported by address, so a missing
symbol raises instead of aborting). Each library is owned by a resource tracker: when the last
executable using it is gone, LLVM frees its code, so compiling many graphs does not grow memory
without bound.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from rlx.codegen.blas import SGEMM, libc_symbol, load_blas
from rlx.errors import RlxError

ENTRY = "rlx_entry"
_IMPORTED_LIBC = ("pthread_create", "pthread_join")
_library_ids = itertools.count()
_lock = threading.Lock()


@dataclass
class JitState:
    """Process-wide LLVM objects, made once (target machine creation is slow)."""

    target_machine: llvm.TargetMachine
    lljit: llvm.LLJIT
    cpu: str
    features: str


@functools.cache
def jit_state() -> JitState:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    load_blas()
    cpu = llvm.get_host_cpu_name()
    features = llvm.get_host_cpu_features().flatten()
    target = llvm.Target.from_triple(llvm.get_process_triple())
    machine = target.create_target_machine(cpu=cpu, features=features, opt=3, codemodel="jitdefault")
    return JitState(machine, llvm.create_lljit_compiler(machine), cpu, features)


@dataclass
class CompiledLibrary:
    """A loaded library: the entry address stays valid while ``tracker`` is referenced."""

    entry_address: int
    tracker: object
    optimized_ir: str
    object_code: bytes
    times: dict[str, float] = field(default_factory=dict)

    @functools.cached_property
    def asm(self) -> str:
        module = llvm.parse_assembly(self.optimized_ir)
        return jit_state().target_machine.emit_assembly(module)


def optimize(module: llvm.ModuleRef, machine: llvm.TargetMachine) -> None:
    """A lean pipeline: inline, promote allocas, simplify, value-number, clean up.

    The kernels are vectorised by hand and spend their time in BLAS, so LLVM's standard O1-O3
    pipelines bought no speed here but cost 100-140 ms (of a 200 ms budget) on the demo graph;
    this one takes ~20 ms. LLVM's vectorisers stay off in any case: the llvmlite wheels ship
    LLVM with assertions on, and the loop vectoriser's cost model asserts (aborting the
    process) on some loop shapes that user graphs can produce.
    """
    builder = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=2))
    passes = llvm.create_new_module_pass_manager()
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
    parts = [llvm_ir, llvmlite.__version__, ".".join(map(str, llvm.llvm_version_info)), state.cpu, state.features,
             __version__]
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


def compile_ir(llvm_ir: str) -> CompiledLibrary:
    """Optimise and compile ``llvm_ir`` for this CPU and link it; times each stage."""
    state = jit_state()
    times: dict[str, float] = {}
    key = cache_key(llvm_ir)
    cache_dir = disk_cache_dir()
    cached = _read_cache(cache_dir, key)
    with _lock:  # llvmlite serialises compilation; keep module handling on one thread at a time
        start = time.perf_counter()
        module = llvm.parse_assembly(llvm_ir)
        module.triple = llvm.get_process_triple()
        module.data_layout = str(state.target_machine.target_data)
        module.verify()
        if cached is None:
            optimize(module, state.target_machine)
        times["llvm_optimize"] = time.perf_counter() - start
        start = time.perf_counter()
        optimized_ir = str(module)
        object_code = cached if cached is not None else state.target_machine.emit_object(module)
        times["machine_code"] = time.perf_counter() - start
        start = time.perf_counter()
        library = llvm.JITLibraryBuilder().add_object_img(object_code).add_current_process()
        library.import_symbol(SGEMM, load_blas().sgemm_address)
        for name in _IMPORTED_LIBC:
            library.import_symbol(name, libc_symbol(name))
        library.export_symbol(ENTRY)
        try:
            tracker = library.link(state.lljit, f"rlx_lib_{next(_library_ids)}")
        except RuntimeError as exc:
            raise RlxError(f"linking the generated code failed: {exc}") from exc
        times["link"] = time.perf_counter() - start
    if cached is None:
        _write_cache(cache_dir, key, object_code)
    times["disk_cache_hit"] = float(cached is not None)
    return CompiledLibrary(tracker[ENTRY], tracker, optimized_ir if cached is None else llvm_ir, object_code, times)


def _read_cache(cache_dir: Path | None, key: str) -> bytes | None:
    if cache_dir is None:
        return None
    try:
        return (cache_dir / f"{key}.o").read_bytes()
    except OSError:
        return None


def _write_cache(cache_dir: Path | None, key: str, object_code: bytes) -> None:
    """Write atomically (temp file + rename) so a concurrent reader never sees half a file."""
    if cache_dir is None:
        return
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        temporary = cache_dir / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        temporary.write_bytes(object_code)
        os.replace(temporary, cache_dir / f"{key}.o")
    except OSError:
        pass  # the disk cache is an optimisation; a read-only home must not break compilation
