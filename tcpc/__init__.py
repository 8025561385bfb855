"""tcpc: compile Mixture-of-Experts layers for the FuriosaAI TCP and simulate them."""

from tcpc.diagnostics import CompileError
from tcpc.program import Program, RunResult, SimulationResult, compile_file, compile_source, load_ir

__all__ = ["CompileError", "Program", "RunResult", "SimulationResult", "compile_file", "compile_source", "load_ir"]
