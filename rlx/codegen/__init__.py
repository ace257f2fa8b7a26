"""Lowering to LLVM IR (loop nests + BLAS sgemm calls), JIT compilation and the runtime."""

from rlx.codegen.executable import Executable, compile_graph, emit_llvm_ir
from rlx.codegen.lower import CodegenOptions

__all__ = ["CodegenOptions", "Executable", "compile_graph", "emit_llvm_ir"]
