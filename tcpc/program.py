"""The Python API: compile a .moe program (or load an .mlir file), look at its IR at each level,
run it on the reference executor or simulate it on the machine model."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType, UnrankedTensorType
from xdsl.interpreter import Interpreter
from xdsl.printer import Printer

from target.target_spec import attach
from tcpc import syntax
from tcpc.arrays import arg_names, drawn_as, prepare_inputs
from tcpc.builder import AutoBlock, build_module, evaluate_dims
from tcpc.diagnostics import CompileError, Loc
from tcpc.host_memory import check_fits
from tcpc.parser import BOM, parse
from tcpc.pipelines import (AUTO_OPTIONS, COST_ONLY_PASSES, LEVELS, PassStep, apply_pipeline, is_auto, make_context,
                            parse_pipeline, pipeline_spec)

if TYPE_CHECKING:
    import networkx as nx

    from xdsl.passes import ModulePass

    from runtime_sim.perf.op_trace import Trace
    from runtime_sim.perf.report import BetterBlock, Choice, SimReport
    from runtime_sim.perf.routing_scenarios import Routing
    from runtime_sim.perf.scheduler import Schedule
    from runtime_sim.perf.simulate import SimResult
    from target.machine import Machine


def print_ir(module: ModuleOp, generic: bool = False, locations: bool = False) -> str:
    """The module's text; with `locations`, every op's and argument's `loc(...)` too
    (dialects/locations.py)."""
    out = io.StringIO()
    Printer(stream=out, print_generic_format=generic, print_debuginfo=locations).print_op(module)
    return out.getvalue() + "\n"


@dataclass
class RunResult:
    outputs: list[np.ndarray]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class SimulationResult:
    """What `Program.simulate` gives: the outputs (none in cost-only mode, where no value is
    computed), the inputs used, the report (cycles, per-op and per-engine records, roofline)
    and the scheduled dependency graph."""

    outputs: list[np.ndarray]
    inputs: dict[str, np.ndarray]
    report: SimReport
    schedule: Schedule
    pipeline: str
    """The passes the simulated IR went through (comma-separated)."""
    cost_only: bool = False
    routing: dict[str, Routing] = field(default_factory=dict)
    """Cost-only mode: routing argument name -> the scenario and [T, K] expert choices used."""
    module: ModuleOp | None = None
    """The simulated IR: the program after `pipeline`."""
    trace: Trace | None = None
    """The executed commands, each with the IR op that ran (a Chrome trace prints their IR)."""

    @property
    def graph(self) -> nx.DiGraph:
        """The scheduled dependency graph (built when first asked for)."""
        return self.schedule.graph


def function_in(module: ModuleOp, name: str, known: Sequence[str] = ()) -> func.FuncOp:
    for op in module.ops:
        if isinstance(op, func.FuncOp) and op.sym_name.data == name:
            return op
    raise CompileError(f"no graph named '{name}' (graphs: {', '.join(known)})")


def as_machine(machine: Machine | str | Path | None) -> Machine:
    """A Machine, a machine file's path, or None (the default RNGD machine)."""
    from target.machine import Machine, default_machine, load_machine

    if machine is None:
        return default_machine()
    if isinstance(machine, Machine):
        return machine
    return load_machine(machine)


def choice_routing(cost_only: bool, routing: str | Path) -> str | Path:
    """The routing scenario a simulation's `auto` choices are costed for: a cost-only run's
    own; with values the routing follows the data, unknown before the run, so balanced."""
    return routing if cost_only else "balanced"


@dataclass
class Program:
    """A compiled .moe file: its dims and its graph-level IR (one func.func per graph); or an
    .mlir file's IR at whatever level it holds (`from_ir`, dims empty)."""

    filename: str
    source: str
    dims: dict[str, int]
    module: ModuleOp
    is_ir: bool = False
    """True when the module came from an .mlir file rather than a .moe program."""
    choices: list[Choice] = field(default_factory=list)
    """The block sizes the compiler chose by the cost model (`block=auto`, or a block that did
    not fit), with the cycles of every candidate (tcpc/autotune.py)."""
    blocks: dict[Loc, int] = field(default_factory=dict)
    """Those chosen blocks, by the location of their block= argument."""
    fixed: list[AutoBlock] = field(default_factory=list)
    """The scatters whose given block fits, used as written (see `better_blocks`)."""
    _resolved: dict[tuple[object, ...], tuple[list[ModulePass], list[Choice]]] = field(
        default_factory=dict, repr=False, compare=False)
    """`passes` memo: costing the strategies compiles and simulates the program twice."""

    @property
    def graph_names(self) -> list[str]:
        return [op.sym_name.data for op in self.module.ops if isinstance(op, func.FuncOp)]

    def function(self, graph: str | None = None) -> func.FuncOp:
        return function_in(self.module, graph or self.graph_names[0], self.graph_names)

    def graph_ir(self, generic: bool = False) -> str:
        return print_ir(self.module, generic)

    def full_pipeline(self, level: str = "scheduled") -> str:
        """The passes of the full lowering up to `level` (LEVELS; `scheduled`, what `tcpc run`
        simulates), lower-topk's strategy and the expert loop's order left to the cost model, and
        where block-scaled activations are quantized when the program quantizes dispatched
        tokens (the same for every machine: the passes read it from the module's target). An .mlir
        file's IR is taken as it is (no passes) unless a pipeline is given."""
        if level not in LEVELS:
            raise ValueError(f"level {level!r}: expected {' or '.join(LEVELS)}")
        if self.is_ir:
            return ""
        from passes.lowering.lower_dispatch import quantizes_dispatched_tokens
        from passes.schedule.schedule_shared import chooses_rows

        return pipeline_spec(LEVELS[level], expert_order="auto",
                             dispatch_quantize="auto" if quantizes_dispatched_tokens(self.module) else None,
                             shared_rows="auto" if chooses_rows(self.module) else None)

    def lower(self, pipeline: str | None = None, *, level: str = "scheduled", graph: str | None = None,
              machine: Machine | str | Path | None = None, routing: str | Path = "balanced", seed: int = 0,
              after_each: Callable[[PassStep], None] | None = None, verify: str = "each") -> ModuleOp:
        """The IR after `pipeline` (a pass list such as `lower-topk`), or after the full lowering
        up to `level`: what `tcpc compile --emit LEVEL` prints. Every `auto` is resolved first
        by the cost model (see `passes`); with `machine`, the IR is compiled for it. `after_each`
        watches the pipeline step by step (apply_pipeline), not the compiles that resolve an
        auto; `verify` says when the IR is verified (apply_pipeline's VERIFY_MODES)."""
        passes, _ = self.passes(pipeline, level=level, graph=graph, machine=machine, routing=routing, seed=seed)
        return apply_pipeline(self.module, passes, after_each, machine=None if machine is None else as_machine(machine),
                              verify=verify)

    def passes(self, pipeline: str | None = None, *, level: str = "scheduled", graph: str | None = None,
               machine: Machine | str | Path | None = None, routing: str | Path = "balanced",
               seed: int = 0) -> tuple[list[ModulePass], list[Choice]]:
        """The passes of `pipeline` (default: the full pipeline up to `level`), each
        `lower-topk{strategy=auto}` replaced by the strategy of fewer cycles for `graph`
        (default: every graph) on `machine` with the routing scenario `routing`, then each
        `schedule-experts{order=auto}` by the loop order of fewer cycles (tcpc/autotune.py);
        and every choice the cost model made for that IR: the program's block sizes (made when
        it was compiled), then the strategies and the orders.

        The one resolution of `auto` that `tcpc compile` (every level, `-p`), `tcpc run`,
        `tcpc sweep` and `simulate`/`planned`/`lower` share, so each prints and costs the
        same program for the same machine and routing."""
        spec = self.full_pipeline(level) if pipeline is None else pipeline
        passes = parse_pipeline(spec)  # PipelineError if malformed
        if not any(is_auto(p) for p in passes):
            return passes, list(self.choices)
        key = (spec, graph, repr(as_machine(machine)), str(routing), seed)
        if key not in self._resolved:
            from tcpc.autotune import resolve_autos

            functions = [self.function(graph).sym_name.data] if graph else self.graph_names
            self._resolved[key] = resolve_autos(self.module, passes, functions, as_machine(machine), routing, seed)
        resolved, choices = self._resolved[key]
        return list(resolved), [*self.choices, *choices]

    def better_blocks(self, *, graph: str | None = None, machine: Machine | str | Path | None = None,
                      routing: str | Path = "balanced", seed: int = 0) -> list[BetterBlock]:
        """The fixed blocks of `graph` (default: every graph) that the compiler's choice, by the
        search of block=auto on `machine` with the routing scenario `routing`, beats by more than
        autotune.BETTER_BLOCK_RATIO; a block search per fixed block, so a report asks, not every run."""
        fixed = [f for f in self.fixed if graph is None or f.graph == self.function(graph).sym_name.data]
        if not fixed:
            return []
        from tcpc.autotune import better_blocks

        target = as_machine(machine)
        with deep_recursion():
            ast = parse(self.source)
            return better_blocks(fixed, lambda blocks: _built(ast, self.dims, {**self.blocks, **blocks}, target,
                                                              self.filename),
                                 self.filename, target, routing, seed)

    def run(
        self,
        inputs: Mapping[str, np.ndarray] | None = None,
        *,
        seed: int = 0,
        graph: str | None = None,
        reference: bool = True,
        pipeline: str | None = None,
        listeners: Sequence[Interpreter.Listener] = (),
        after_each: Callable[[PassStep], None] | None = None,
    ) -> RunResult:
        """Run one graph: the graph-level IR (`reference=True`), or the IR after `pipeline`;
        `listeners` see every op as it runs, `after_each` every step of the pipeline (`lower`)."""
        from runtime_sim.semantics.executor import run_function  # xDSL's interpreters are slow to import

        name = self.function(graph).sym_name.data
        module = self.module if reference and pipeline is None else self.lower(pipeline, after_each=after_each)
        fn = function_in(module, name)  # after pin-routing it has one more argument
        check_fits(module, name, f"running graph '{name}'")
        args = prepare_inputs(fn, inputs or {}, seed, drawn_as(self.function(graph)))
        outputs = run_function(module, name, args, listeners=listeners)
        return RunResult(list(outputs), dict(zip(arg_names(fn), args)))

    def simulate(
        self,
        inputs: Mapping[str, np.ndarray] | None = None,
        *,
        seed: int = 0,
        graph: str | None = None,
        pipeline: str | None = None,
        machine: Machine | str | Path | None = None,
        sram_policy: str = "spill",
        uncosted: str = "error",
        cost_only: bool = False,
        routing: str | Path = "balanced",
        listeners: Sequence[Interpreter.Listener] = (),
        after_each: Callable[[PassStep], None] | None = None,
    ) -> SimulationResult:
        """Lower one graph (the full pipeline, or `pipeline`) and simulate it on `machine`
        (a Machine, a machine file, or None for RNGD).

        Inputs are read from `inputs` by argument name and drawn from `seed` otherwise, as
        `run` does. `uncosted="error"` refuses IR with ops that have no cost model, naming
        them (runtime_sim.perf.cost_model.NotLoweredError); `"free"` reports them as zero-cost.
        `sram_policy` is `spill` or `error` (runtime_sim.perf.memory_plan).

        `cost_only=True` needs no inputs and computes no values (runtime_sim.perf.cost_only):
        the pin-routing pass runs first, the routing comes from the scenario `routing`
        (`balanced`, `skewed`, `one-expert`, or an .npz / .npy of [T, K] expert indices;
        `seed` draws `skewed`), and the result has no outputs.

        `after_each` watches the pipeline step by step (apply_pipeline; cost-only, pin-routing is
        its first pass), not the compiles that resolve an auto.
        """
        module, spec, args, result = self._simulated(inputs, seed=seed, graph=graph, pipeline=pipeline,
                                                     machine=machine, sram_policy=sram_policy, uncosted=uncosted,
                                                     cost_only=cost_only, routing=routing, listeners=listeners,
                                                     after_each=after_each)
        if cost_only:
            return SimulationResult([], {}, result.report, result.schedule, spec, True, result.routing, module,
                                    result.trace)
        fn = function_in(module, self.function(graph).sym_name.data)
        return SimulationResult(list(result.outputs), dict(zip(arg_names(fn), args)), result.report, result.schedule, spec,
                                module=module, trace=result.trace)

    def planned(self, inputs: Mapping[str, np.ndarray] | None = None, *, seed: int = 0, graph: str | None = None,
                machine: Machine | str | Path | None = None, sram_policy: str = "spill",
                pipeline: str | None = None, cost_only: bool = False, routing: str | Path = "balanced") -> ModuleOp:
        """The lowered IR (the full pipeline, or `pipeline`), each op annotated with the slot the
        simulator scheduled it in (`tcpc.plan`: engine, unit, start and end cycle, bound) when
        run on `inputs` (drawn from `seed` where not given): guards skip blocks by the routing,
        so the plan follows the data. `cost_only=True` plans without values, for the routing
        scenario `routing`, as `simulate` does."""
        from runtime_sim.perf.simulate import annotate_plan

        module, _, _, result = self._simulated(inputs, seed=seed, graph=graph, pipeline=pipeline, machine=machine,
                                               sram_policy=sram_policy, cost_only=cost_only, routing=routing)
        annotate_plan(result)
        return module

    def _simulated(self, inputs: Mapping[str, np.ndarray] | None, *, seed: int, graph: str | None,
                   pipeline: str | None, machine: Machine | str | Path | None, sram_policy: str,
                   uncosted: str = "error", cost_only: bool = False, routing: str | Path = "balanced",
                   listeners: Sequence[Interpreter.Listener] = (),
                   after_each: Callable[[PassStep], None] | None = None) -> tuple[ModuleOp, str, list[np.ndarray], SimResult]:
        """The simulated IR (its ops are the trace's), the passes it went through, the
        arguments it ran on (none in cost-only mode) and the simulator's result."""
        from runtime_sim.perf.cost_only import simulate_cost_only
        from runtime_sim.perf.graph_work import graph_work
        from runtime_sim.perf.simulate import simulate

        from tcpc.schedule_summary import contraction_mappings, tile_loops

        name = self.function(graph).sym_name.data
        # The roofline's useful work, from the graph before lowering; with ops costed as free it
        # would exceed the commands', so those runs count the commands' FLOPs.
        work = graph_work(self.function(name)) if uncosted == "error" else None
        mach = as_machine(machine)
        spec = self.full_pipeline() if pipeline is None else pipeline
        if not cost_only:  # before any costing: a strategy=auto costs the lowered program
            check_fits(self.module, name, f"simulating graph '{name}' with values")
        passes, choices = self.passes(spec, graph=name, machine=mach, routing=choice_routing(cost_only, routing), seed=seed)
        for choice in choices:  # the pipeline as run, for the report's first line
            option = next((o for p, o in AUTO_OPTIONS.items() if choice.what == f"{p} {o}"), None)
            if option is not None:
                spec = spec.replace(f"{option}=auto", f"{option}={choice.chosen}", 1)
        if cost_only:
            if inputs:
                raise CompileError("cost-only simulation takes no inputs")
            spec = ",".join(p for p in (*COST_ONLY_PASSES, spec) if p)
            from runtime_sim.perf.cost_only import DEFAULT_SRAM_POLICY, LoopReplay
            from tcpc.autotune import take_compiled

            # The cost model's choices may have compiled and simulated this program already;
            # the run is taken when it ran as this one would and no listener must see its ops.
            module, run = take_compiled(self.module, passes, mach, (name, str(routing), seed), after_each)
            if run is not None and sram_policy == DEFAULT_SRAM_POLICY and uncosted == "error" \
                    and LoopReplay.allowed(listeners):
                result = run.result(mach, sram_policy, work)  # type: ignore[arg-type]
            else:
                result = simulate_cost_only(module, name, mach, routing=routing, seed=seed,
                                            sram_policy=sram_policy, uncosted=uncosted,  # type: ignore[arg-type]
                                            listeners=listeners, work=work)
            args: list[np.ndarray] = []
        else:
            module = apply_pipeline(self.module, passes, after_each, machine=mach)
            check_fits(module, name, f"simulating graph '{name}' with values")
            args = prepare_inputs(function_in(module, name), inputs or {}, seed, drawn_as(self.function(graph)))
            result = simulate(module, name, args, mach, sram_policy=sram_policy,  # type: ignore[arg-type]
                              uncosted=uncosted, listeners=listeners, work=work)  # type: ignore[arg-type]
        result.report.choices = choices
        result.report.loops = tile_loops(module, name)
        result.report.contractions = contraction_mappings(module, name)
        result.report.sources = self.source_lines(result.report)
        return module, spec, args, result

    def source_lines(self, report: SimReport) -> dict[str, list[str]]:
        """The lines of every source file the report's ops are located in, for its by-line
        table: the program's own text, and (for IR that names them) the files that can be read."""
        from runtime_sim.perf.report import file_line

        files = {file_line(place)[0] for places in {o.locations for o in report.ops} for place in places}
        lines: dict[str, list[str]] = {}
        for file in sorted(files):
            if file == self.filename and not self.is_ir:
                lines[file] = self.source.removeprefix(BOM).split("\n")
                continue
            try:
                lines[file] = read_source(Path(file)).split("\n")
            except (OSError, CompileError):
                continue  # the table shows the line numbers alone
        return lines


def _built(ast: syntax.Program, dims: Mapping[str, int], blocks: Mapping[Loc, int], target: Machine,
           filename: str) -> ModuleOp:
    """The program's module with the given blocks, targeting `target`, located in `filename`."""
    module = build_module(ast, dims, blocks, filename=filename)
    attach(module, target)
    return module


@contextmanager
def deep_recursion() -> Iterator[None]:
    """The AST transformer and the builder recurse a few frames per operator of an expression;
    Python's default limit (1000) would stop a sum of ~200 terms."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20000))
    try:
        yield
    except RecursionError:
        raise CompileError("expressions are nested too deeply; split them with assignments") from None
    finally:
        sys.setrecursionlimit(limit)


BlockCost = Callable[[ModuleOp, str, float], tuple[int, bool]]
"""The cycles of one graph of a candidate module, by which block=auto is chosen (the default:
one chip's, tcpc/autotune.py; a mesh's, tcpc/mesh_run.py), given the fewest cycles found so
far; and whether they are instead a lower bound above those (the candidate cannot win)."""


def compile_source(source: str, dims: Mapping[str, int | str] | None = None, filename: str = "<string>", *,
                   machine: Machine | str | Path | None = None, routing: str | Path = "balanced",
                   seed: int = 0, block_cost: BlockCost | None = None, cost_scope: str = "") -> Program:
    """Parse and build a .moe program; `dims` overrides dim definitions like `--set`. Block
    sizes left to the compiler (`block=auto` or a dim that is auto, or a block that cannot fit)
    are chosen by the cost model on `machine` with the routing scenario `routing`
    (tcpc/autotune.py), or by `block_cost` (what `cost_scope` names in the choice, such as a
    mesh). The module targets `machine` (target/target_spec.py): the passes tile it for that
    machine."""
    target = as_machine(machine)
    with deep_recursion():
        ast = parse(source)
        values = evaluate_dims(ast.dims, dims or {})
        autos: list[AutoBlock] = []
        fixed: list[AutoBlock] = []
        module = build_module(ast, values, autos=autos, fixed=fixed, filename=filename)
        attach(module, target)
        if not autos:
            return Program(filename, source, values, module, fixed=fixed)
        from tcpc.autotune import choose_blocks

        def build(blocks: Mapping[Loc, int]) -> ModuleOp:
            return _built(ast, values, blocks, target, filename)

        blocks, choices = choose_blocks(autos, build, filename, target, routing, seed, block_cost, cost_scope)
        return Program(filename, source, values, build(blocks), choices=choices, blocks=blocks, fixed=fixed)


def load_ir(source: str, filename: str = "<string>") -> Program:
    """A Program from MLIR text (what `tcpc compile` prints, at any level: graph-level,
    partly or fully lowered, or handwritten tcp/ve IR); parse and verify errors raise
    CompileError."""
    from xdsl.parser import Parser
    from xdsl.utils.exceptions import ParseError, VerifyException

    try:
        module = Parser(make_context(), source, filename).parse_module()
        module.verify()
    except ParseError as e:
        raise CompileError(f"cannot parse the IR: {e}") from None
    except VerifyException as e:
        raise CompileError(f"invalid IR: {e}") from None
    if not any(isinstance(op, func.FuncOp) for op in module.ops):
        raise CompileError("the IR holds no func.func to run")
    unsupported = unsupported_value(module)
    if unsupported is not None:
        raise CompileError(unsupported)
    return Program(filename, source, {}, module, is_ir=True)


def unsupported_value(module: ModuleOp) -> str | None:
    """Why tcpc cannot run this IR, for the first value it cannot hold (a tensor of unknown
    size, `tensor<?x8xf32>` or `tensor<*xf32>`; an element type without numpy storage such as
    f64), or None."""
    from runtime_sim.semantics.numerics import numpy_dtype

    for op in module.walk():
        blocks = [b for r in op.regions for b in r.blocks]
        arguments = [a for b in blocks for a in b.args]
        for v in [*op.results, *arguments]:
            t = v.type
            name = f"%{v.name_hint}" if v.name_hint else "a value"
            owner = f"an argument of {op.name}" if v in arguments else f"a result of {op.name}"
            if isinstance(t, UnrankedTensorType) or (isinstance(t, TensorType) and any(d < 0 for d in t.get_shape())):
                sizes = ["*"] if isinstance(t, UnrankedTensorType) else ["?" if d < 0 else str(d) for d in t.get_shape()]
                return (f"{name} ({owner}, tensor<{'x'.join(sizes)}x{t.get_element_type()}>) has a size that is not "
                        "static; tcpc needs every tensor size known at compile time")
            if isinstance(t, TensorType):
                try:
                    numpy_dtype(t.get_element_type())
                except ValueError:
                    return f"{name} ({owner}) has element type {t.get_element_type()}; tcpc runs bf16, f32, i32 and i1 tensors"
    return None


def read_source(path: Path) -> str:
    """A program's text, without a byte-order mark (for .mlir too); not UTF-8 is a CompileError."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise CompileError(f"not a UTF-8 text file (byte {e.start} is {e.object[e.start:e.start + 1]!r})") from None


def compile_file(path: str | Path, dims: Mapping[str, int | str] | None = None, *,
                 machine: Machine | str | Path | None = None, routing: str | Path = "balanced",
                 seed: int = 0) -> Program:
    """A .moe program, or an .mlir file's IR (no dims then); `machine`, `routing` and `seed`
    are those block=auto is chosen for (see compile_source)."""
    path = Path(path)
    source = read_source(path)
    if path.suffix == ".mlir":
        if dims:
            raise CompileError("--set / dims apply to .moe programs, not to IR")
        return load_ir(source, str(path))
    return compile_source(source, dims, str(path), machine=machine, routing=routing, seed=seed)
