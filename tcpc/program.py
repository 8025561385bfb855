"""The Python API: compile a .moe program, look at its IR at each level, run it."""

from __future__ import annotations

import io
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.printer import Printer

from tcpc.arrays import arg_names, prepare_inputs
from tcpc.builder import build_module, evaluate_dims
from tcpc.diagnostics import CompileError
from tcpc.parser import parse
from tcpc.pipelines import LOWERED_PIPELINE, apply_pipeline, parse_pipeline


def print_ir(module: ModuleOp, generic: bool = False) -> str:
    out = io.StringIO()
    Printer(stream=out, print_generic_format=generic).print_op(module)
    return out.getvalue() + "\n"


@dataclass
class RunResult:
    outputs: list[np.ndarray]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Program:
    """A compiled .moe file: its dims and its graph-level IR (one func.func per graph)."""

    filename: str
    source: str
    dims: dict[str, int]
    module: ModuleOp

    @property
    def graph_names(self) -> list[str]:
        return [op.sym_name.data for op in self.module.ops if isinstance(op, func.FuncOp)]

    def function(self, graph: str | None = None) -> func.FuncOp:
        name = graph or self.graph_names[0]
        for op in self.module.ops:
            if isinstance(op, func.FuncOp) and op.sym_name.data == name:
                return op
        raise CompileError(f"no graph named '{name}' (graphs: {', '.join(self.graph_names)})")

    def graph_ir(self, generic: bool = False) -> str:
        return print_ir(self.module, generic)

    def lower(self, pipeline: str | None = None) -> ModuleOp:
        """The IR after `pipeline` (a pass list such as `lower-topk`), or after the full lowering."""
        if pipeline is None:
            if not LOWERED_PIPELINE:
                raise CompileError("the lowering pipeline does not exist yet; run the graph-level IR")
            pipeline = ",".join(LOWERED_PIPELINE)
        try:
            passes = parse_pipeline(pipeline)
        except Exception as e:  # xDSL reports unknown passes and bad options with plain exceptions
            raise CompileError(f"pipeline '{pipeline}': {e}") from None
        return apply_pipeline(self.module, passes)

    def run(
        self,
        inputs: Mapping[str, np.ndarray] | None = None,
        *,
        seed: int = 0,
        graph: str | None = None,
        reference: bool = True,
        pipeline: str | None = None,
    ) -> RunResult:
        """Run one graph: the graph-level IR (`reference=True`), or the IR after `pipeline`."""
        from runtime_sim.executor import run_function  # xDSL's interpreters are slow to import

        fn = self.function(graph)
        args = prepare_inputs(fn, inputs or {}, seed)
        module = self.module if reference and pipeline is None else self.lower(pipeline)
        outputs = run_function(module, fn.sym_name.data, args)
        return RunResult(list(outputs), dict(zip(arg_names(fn), args)))


def compile_source(source: str, dims: Mapping[str, int] | None = None, filename: str = "<string>") -> Program:
    """Parse and build a .moe program; `dims` overrides dim definitions like `--set`."""
    # The AST transformer and the builder recurse a few frames per operator of an expression;
    # Python's default limit (1000) would stop a sum of ~200 terms.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        ast = parse(source)
        values = evaluate_dims(ast.dims, dims or {})
        return Program(filename, source, values, build_module(ast, values))
    except RecursionError:
        raise CompileError("expressions are nested too deeply; split them with assignments") from None
    finally:
        sys.setrecursionlimit(limit)


def compile_file(path: str | Path, dims: Mapping[str, int] | None = None) -> Program:
    path = Path(path)
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CompileError(f"not a UTF-8 text file (byte {e.start} is {e.object[e.start:e.start + 1]!r})") from None
    return compile_source(source, dims, str(path))
