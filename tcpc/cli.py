"""The `tcpc` command: compile a .moe file and print its IR, or run it: simulated on the
machine model (the default), on the reference executor (`--reference`), or costed without
values (`--cost-only`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from xdsl.utils.exceptions import InterpretationError, PassFailedException

from dialects.ccl import MeshSpecError
from dialects.tensor_types import format_type
from runtime_sim.perf.machine import MachineError
from runtime_sim.perf.routing_scenarios import SCENARIOS, RoutingError
from runtime_sim.semantics.tolerance import ULPS, compare_outputs
from tcpc.arrays import InputError, load_npz, save_outputs
from tcpc.diagnostics import CompileError
from tcpc.mesh_run import MeshSpec, simulate_on_mesh
from tcpc.pipelines import FULL_PIPELINE, LOWERED_PIPELINE, apply_pipeline, parse_pipeline
from tcpc.program import Program, SimulationResult, as_machine, compile_file, print_ir
from tcpc.progress import Progress

if TYPE_CHECKING:
    from runtime_sim.perf.report import SimReport


class UsageError(Exception):
    """A command-line mistake that is not in the program text."""


def parse_set(items: Sequence[str]) -> dict[str, int]:
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--set {item}: expected NAME=VALUE")
        try:
            dims[name.strip()] = int(value)
        except ValueError:
            raise UsageError(f"--set {item}: {value!r} is not an integer") from None
    return dims


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help=".moe program (or .mlir IR)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a dim")
    p.add_argument("-p", "--pipeline", default=None, help="passes to apply, e.g. 'lower-topk{strategy=rounds}'")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tcpc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile and print the IR")
    add_common(c)
    c.add_argument("--emit", choices=("graph", "lowered", "scheduled", "planned"), default=None,
                   help="which level to print (default: graph, or the IR after -p): lowered is the "
                        "engine ops on whole tensors, scheduled adds the schedule level (loops, tiles, "
                        "buffers, DMA), planned is the scheduled IR with each op's simulated engine slot")
    c.add_argument("--seed", type=int, default=0, help="--emit planned: seed for the inputs (default 0)")
    c.add_argument("--machine", default=None, help="--emit planned: machine file (default: RNGD)")
    c.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass")
    c.add_argument("--generic", action="store_true", help="print the generic op format")
    c.add_argument("-o", "--output", default=None, help="write the IR here instead of stdout")
    c.add_argument("--mesh", default=None, metavar="SPEC",
                   help="shard over a mesh first: ep=8, dp=2,ep=4, optionally strategy=a2a|allgather")

    r = sub.add_parser("run", help="simulate a graph (or run its reference) and print its outputs")
    add_common(r)
    r.add_argument("--graph", default=None, help="which graph to run (default: the first)")
    r.add_argument("--inputs", default=None, help=".npz with inputs by argument name")
    r.add_argument("--seed", type=int, default=0, help="seed for inputs not given (default 0)")
    r.add_argument("--out", default=None, help="write outputs to this .npz as out0, out1, ...")
    r.add_argument("--reference", action="store_true",
                   help="run on the reference executor, without simulating: the graph-level IR, or the IR after -p")
    r.add_argument("--check", action="store_true",
                   help=f"also run the reference and compare (integers identical, floats within {ULPS} ulps)")
    r.add_argument("--report", action="store_true", help="print the simulation report (per op and per engine)")
    r.add_argument("--report-json", default=None, metavar="FILE", help="write the report as JSON")
    r.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace (open it in Perfetto)")
    r.add_argument("--machine", default=None, metavar="FILE", help="machine file (TOML; default: RNGD)")
    r.add_argument("--sram-policy", choices=("spill", "error"), default="spill",  # memory_plan.SRAM_POLICIES
                   help="when SRAM is full: spill to HBM, and stream ops too large for SRAM through it (default), or stop with an error")
    r.add_argument("--cost-only", action="store_true",
                   help="cycles without inputs or values (real model sizes); the routing comes from --routing")
    r.add_argument("--mesh", default=None, metavar="SPEC",
                   help="shard over a mesh of chips and simulate every chip: ep=8, dp=2,ep=4, optionally strategy=a2a|allgather")
    r.add_argument("--mesh-machine", default=None, metavar="FILE",
                   help="--mesh: mesh file (TOML: chip machine, mesh shape, links; default RNGD cards over PCIe)")
    r.add_argument("--routing", default=None, metavar="SCENARIO",
                   help=f"cost-only routing: {', '.join(SCENARIOS)} (default balanced) or an .npz of [T, K] expert indices")
    return parser


def passes_for(args: argparse.Namespace, emit: str | None) -> str | None:
    if args.pipeline is not None:
        return args.pipeline
    if emit == "lowered":
        return ",".join(LOWERED_PIPELINE)
    if emit in ("scheduled", "planned"):
        return ",".join(FULL_PIPELINE)
    return None


def cmd_compile(args: argparse.Namespace) -> int:
    program = compile_file(args.file, parse_set(args.set))
    spec = passes_for(args, args.emit)
    if args.mesh is not None:
        if args.emit == "planned" or args.pipeline is not None:
            raise UsageError("--mesh prints the sharded graph, or with --emit lowered its lowering; not with -p or --emit planned")
        spec = MeshSpec.parse(args.mesh).pipeline(lowered=args.emit == "lowered")
    chunks: list[str] = []
    if args.emit == "planned" and args.pipeline is None:
        chunks.append(f"// planned: the full pipeline, each op with the slot the simulator scheduled it in\n"
                      f"// (tcpc.plan), for the inputs drawn from seed {args.seed}\n")
        chunks.append(print_ir(program.planned(seed=args.seed, machine=as_machine(args.machine)), args.generic))
    elif spec is None:
        chunks.append(print_ir(program.module, args.generic))
    else:
        try:
            passes = parse_pipeline(spec)
        except Exception as e:
            raise UsageError(f"-p {spec}: {e}") from None
        if args.print_ir_after_all:
            chunks.append(f"// -----// IR after parsing //----- //\n{print_ir(program.module, args.generic)}")
        def after(p, module):
            if args.print_ir_after_all:
                chunks.append(f"// -----// IR after {p.name} //----- //\n{print_ir(module, args.generic)}")
        lowered = apply_pipeline(program.module, passes, after)
        if not args.print_ir_after_all:
            chunks.append(print_ir(lowered, args.generic))
    text = "".join(chunks)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def describe(name: str, value: np.ndarray) -> str:
    v = value.astype(np.float64) if value.dtype.kind in "fV" or value.dtype.name == "bfloat16" else value
    head = np.array2string(np.asarray(v).reshape(-1)[:6], precision=4, separator=", ")
    stats = ""
    if value.size and v.dtype.kind == "f":
        stats = f"  mean {np.nanmean(v):.4g}  abs max {np.nanmax(np.abs(v)):.4g}"
        if np.isnan(v).any():
            stats += f"  NaN x{int(np.isnan(v).sum())}"
    return f"{name}: {list(value.shape)} {value.dtype.name}  first {head}{stats}"


SIMULATION_FLAGS = ("report", "report_json", "trace", "machine", "cost_only", "routing")


def check_flags(args: argparse.Namespace) -> None:
    def given(flag: str) -> bool:
        value = getattr(args, flag)
        return value not in (None, False)

    def name(flag: str) -> str:
        return "--" + flag.replace("_", "-")

    if args.reference:
        for flag in SIMULATION_FLAGS:
            if given(flag):
                raise UsageError(f"{name(flag)} needs a simulation; --reference runs the IR without one")
        if args.sram_policy != "spill":
            raise UsageError("--sram-policy needs a simulation; --reference runs the IR without one")
    if args.cost_only:
        for flag in ("inputs", "out", "check"):
            if given(flag):
                raise UsageError(f"{name(flag)} does not apply to --cost-only, which computes no values")
    elif args.routing is not None:
        raise UsageError("--routing sets the routing of a cost-only run; add --cost-only")


def cycle_summary(r: SimReport) -> str:
    """One line: total cycles and time, and how far above the roofline."""
    roof = r.roofline.cycles
    ratio = f"{r.total_cycles / roof:.2f}x the roofline" if roof > 0 else "no roofline (no FLOPs or HBM bytes)"
    return (f"cycles: {r.total_cycles:,} = {r.microseconds:,.3f} us at {r.clock_hz / 1e9:g} GHz on {r.machine.name}; "
            f"roofline {roof:,.0f} cycles ({r.roofline.bound}), {ratio}")


def simulate_with_progress(program: Program, fn_name: str, args: argparse.Namespace,
                           given: dict[str, np.ndarray]) -> SimulationResult:
    machine = as_machine(args.machine)
    progress = Progress()
    try:
        return program.simulate(given, seed=args.seed, graph=fn_name, pipeline=args.pipeline, machine=machine,
                                sram_policy=args.sram_policy, cost_only=args.cost_only,
                                routing=args.routing or "balanced", listeners=[progress])
    finally:
        progress.close()


def partly_lowered(program: Program, args: argparse.Namespace) -> str:
    """Why the IR after `-p` cannot be simulated (the ops left without a cost), or "" when it
    can, or when the user asked for something only a simulation gives."""
    wants_cycles = args.report or args.report_json or args.trace or args.cost_only
    if args.pipeline is None or wants_cycles:
        return ""
    from runtime_sim.perf.simulate import uncosted_ops  # the simulator registers every cost model

    left = uncosted_ops(program.lower(args.pipeline).ops)
    return f"{', '.join(sorted(left))} have no cost; the full pipeline lowers them" if left else ""


def write_json(path: str, data: object) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def cmd_run(args: argparse.Namespace) -> int:
    check_flags(args)
    if args.mesh is not None:
        return cmd_run_mesh(args)
    if args.mesh_machine is not None:
        raise UsageError("--mesh-machine describes the chips of a --mesh run; add --mesh")
    if Path(args.file).suffix == ".mlir" and args.set:
        raise UsageError("--set applies to .moe programs, not to .mlir IR")
    program: Program = compile_file(args.file, parse_set(args.set))
    given = load_npz(args.inputs) if args.inputs else {}
    fn = program.function(args.graph)
    name = fn.sym_name.data
    # The IR after a partial pipeline may still hold graph-level ops, which have no cost: it
    # runs on the interpreter then (translation validation), saying why there are no cycles.
    why = "" if args.reference else partly_lowered(program, args)
    not_simulated = f"not simulated: {why}" if why else ""
    if args.reference or not_simulated:  # the interpreter: the graph-level IR, or the IR after -p
        result = program.run(given, seed=args.seed, graph=name, reference=True, pipeline=args.pipeline)
        if args.pipeline is not None:
            level = f"after {args.pipeline}, {not_simulated or 'not simulated'}"
        else:
            level = "the IR as given, not simulated" if program.is_ir else "reference (graph-level IR)"
        print(f"graph {name} from {args.file}, {level}, seed {args.seed}")
        outputs, report = result.outputs, None
    else:
        if args.pipeline is None and not LOWERED_PIPELINE and not program.is_ir:
            raise UsageError("running the lowered program needs the lowering passes, which do not exist yet; "
                             "use --reference (graph level) or -p PASSES")
        sim = simulate_with_progress(program, name, args, given)
        report = sim.report
        level = f"after {sim.pipeline}" if sim.pipeline else "as given"
        if sim.cost_only:
            print(f"graph {name} from {args.file}, {level}, cost-only on {report.machine.name} (no values computed)")
            for arg, routing in sim.routing.items():
                print(f"  routing %{arg}: {routing.describe()}")
            if not sim.routing:
                print("  no routing arguments: no cost depends on routing")
            for i, t in enumerate(fn.function_type.outputs.data):
                print(f"  out{i} {format_type(t)}: not computed (cost-only)")
        else:
            print(f"graph {name} from {args.file}, {level}, simulated on {report.machine.name}, seed {args.seed}")
        outputs = sim.outputs
    for i, (value, t) in enumerate(zip(outputs, fn.function_type.outputs.data)):
        print("  " + describe(f"out{i} {format_type(t)}", value))
    if report is not None:
        if args.report:
            print()
            sys.stdout.write(report.to_text())
        print(cycle_summary(report))
        if args.report_json:
            write_json(args.report_json, report.to_json())
            print(f"wrote {args.report_json}")
        if args.trace:
            write_json(args.trace, report.chrome_trace())
            print(f"wrote {args.trace}")
    if args.out:
        save_outputs(args.out, outputs)
        print(f"wrote {args.out}")
    if args.check:
        ref = program.run(given, seed=args.seed, graph=name, reference=True)
        results = compare_outputs(outputs, ref.outputs)
        for c in results:
            print(f"check: {c.message}")
        if not all(c.ok for c in results):
            return 1
        print("check: outputs agree with the reference" if any(not c.identical for c in results)
              else "check: outputs equal the reference")
    return 0


def cmd_run_mesh(args: argparse.Namespace) -> int:
    """`tcpc run --mesh`: every chip simulated, the outputs put back together and checked."""
    why = {"reference": "a mesh run simulates every chip; --check compares with the reference",
           "pipeline": "the mesh runs shard-experts and then the full pipeline",
           "machine": "the mesh file names the chip machine: --mesh-machine"}
    for flag, reason in why.items():
        if getattr(args, flag) not in (None, False):
            raise UsageError(f"--{flag} does not apply to --mesh ({reason})")
    spec = MeshSpec.parse(args.mesh)
    program: Program = compile_file(args.file, parse_set(args.set))
    given = load_npz(args.inputs) if args.inputs else {}
    fn = program.function(args.graph)
    name = fn.sym_name.data
    sim = simulate_on_mesh(program, spec, given, seed=args.seed, graph=name, machine=args.mesh_machine,
                           sram_policy=args.sram_policy, cost_only=args.cost_only, routing=args.routing or "balanced")
    report = sim.report
    how = f"{spec.mesh} ({spec.strategy}), {len(report.chips)} chips of {report.machine.chip.name} on {report.machine.name}"
    if sim.cost_only:
        print(f"graph {name} from {args.file}, sharded over {how}, cost-only (no values computed)")
        for arg, routing in sim.routing.items():
            print(f"  routing %{arg}: {routing.describe()}")
    else:
        print(f"graph {name} from {args.file}, sharded over {how}, seed {args.seed}")
    for i, (value, t) in enumerate(zip(sim.outputs, fn.function_type.outputs.data)):
        print("  " + describe(f"out{i} {format_type(t)}", value))
    if args.report:
        print()
        sys.stdout.write(report.to_text())
    comm = report.communication_cycles
    print(f"cycles: {report.total_cycles:,} = {report.microseconds:,.3f} us on the slowest of {len(report.chips)} chips; "
          f"{comm:,} in collectives ({comm / report.total_cycles:.0%})" if report.total_cycles else "cycles: 0")
    if args.report_json:
        write_json(args.report_json, report.to_json())
        print(f"wrote {args.report_json}")
    if args.trace:
        write_json(args.trace, report.chrome_trace())
        print(f"wrote {args.trace}")
    if args.out:
        save_outputs(args.out, sim.outputs)
        print(f"wrote {args.out}")
    if args.check:
        ref = program.run(given, seed=args.seed, graph=name, reference=True)
        results = compare_outputs(sim.outputs, ref.outputs)
        for c in results:
            print(f"check: {c.message}")
        if not all(c.ok for c in results):
            return 1
        print("check: outputs agree with the reference" if any(not c.identical for c in results)
              else "check: outputs equal the reference")
    return 0


def simulation_error(e: Exception) -> str | None:
    """The message of a simulator error that is the user's to fix, or None. (Imported here,
    not at the top: the simulator's modules are slow to import and `tcpc compile` needs none.)"""
    from runtime_sim.perf.cost_model import NotLoweredError
    from runtime_sim.perf.cost_only import CostOnlyError
    from runtime_sim.perf.memory_plan import SramOverflowError
    from runtime_sim.perf.mesh_simulate import MeshError

    if isinstance(e, NotLoweredError):
        return f"{e} (--reference runs it without simulating)"
    if isinstance(e, (CostOnlyError, SramOverflowError, MeshError)):
        return str(e)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        code = cmd_compile(args) if args.command == "compile" else cmd_run(args)
    except CompileError as e:
        source = ""
        try:
            source = Path(args.file).read_text(encoding="utf-8", errors="replace")
        except OSError:
            pass
        print(e.render(args.file, source), file=sys.stderr)
        return 1
    except (UsageError, InputError, MachineError, RoutingError, MeshSpecError) as e:
        print(f"tcpc: error: {e}", file=sys.stderr)
        return 1
    except InterpretationError as e:
        print(f"tcpc: error while running: {e}", file=sys.stderr)
        return 1
    except PassFailedException as e:  # a pass that cannot run on this IR, e.g. out of order
        print(f"tcpc: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the .moe file, -o, --out
        print(f"tcpc: error: {e.filename}: {(e.strerror or str(e)).lower()}", file=sys.stderr)
        return 1
    except Exception as e:  # never a traceback for the user; TCPC_DEBUG=1 shows it
        message = simulation_error(e)
        if message is not None:
            print(f"tcpc: error: {message}", file=sys.stderr)
            return 1
        if os.environ.get("TCPC_DEBUG"):
            raise
        print(f"tcpc: internal error: {type(e).__name__}: {e} (set TCPC_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
