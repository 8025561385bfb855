"""tcpc: compile Mixture-of-Experts layers for the FuriosaAI TCP and simulate them."""

from tcpc.diagnostics import CompileError
from tcpc.program import Program, RunResult, compile_file, compile_source

__all__ = ["CompileError", "Program", "RunResult", "compile_file", "compile_source"]
