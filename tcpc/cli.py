"""The `tcpc` command: compile a .moe file and print its IR, or run it: simulated on the
machine model (the default), on the reference executor (`--reference`), or costed without
values (`--cost-only`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

import numpy as np
from xdsl.utils.exceptions import InterpretationError, PassFailedException

from dialects.ccl import MeshSpecError
from dialects.tensor_types import format_type
from target.contraction_mapping import MappingError
from target.machine import MachineError
from target.mesh_machine import load_mesh_machine
from runtime_sim.perf.op_trace import ir_forms
from runtime_sim.perf.report import REPORT_TABLES
from runtime_sim.perf.routing_scenarios import SCENARIOS, Routing, RoutingError
from runtime_sim.semantics.tolerance import ULPS, compare_outputs
from tcpc.arrays import InputError, load_npz, save_outputs
from tcpc.checkpoints import CONVERSIONS, CheckpointError
from tcpc.diagnostics import CompileError
from tcpc.host_memory import ResourceError
from tcpc.html_page import Page
from tcpc.html_page import render as render_page
from tcpc.mesh_run import (MAX_SIMULATED_CHIPS, MeshSimulation, MeshSpec, check_on_mesh, compile_for_mesh,
                           scattered_tokens, simulate_on_mesh)
from tcpc.pass_instruments import IRDump, IRHistory, IRPrinter, PassInstruments, PassStatistics, PassTimer
from tcpc.pipelines import PipelineError, apply_pipeline, parse_pipeline
from tcpc.program import Program, SimulationResult, as_machine, choice_routing, compile_file, print_ir
from tcpc.progress import Progress
from tcpc.routing_check import RoutingRangeCheck
from tcpc.streams import EXIT_BROKEN_PIPE, OutputError, cannot_write, checked_stdout, discard_stdout, remove_partial
from tcpc.sweep import MAX_POINTS, SweepError

if TYPE_CHECKING:
    from xdsl.dialects import func

    from runtime_sim.perf.mesh_simulate import MeshReport
    from runtime_sim.perf.report import BetterBlock, Choice, SimReport
    from target.machine import Machine


EXIT_OK = 0
EXIT_ERROR = 1
"""An error in what the command names: the program, an input, a file, the machine, the
pipeline, a size this computer cannot hold; also a failed --check."""
EXIT_USAGE = 2
"""The command line itself: an unknown or missing option, options that do not go together
(argparse's own status for the same kind of mistake)."""
EXIT_INTERNAL = 70
"""A bug in tcpc (sysexits' EX_SOFTWARE): `tcpc: internal error: ...`, TCPC_DEBUG=1 for the traceback."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT, what a shell reports for a process SIGINT ends). A reader of stdout that
went away ends it with EXIT_BROKEN_PIPE (tcpc/streams.py, shared with tcpc-opt)."""


class UsageError(Exception):
    """A command-line mistake that is not in the program text (exit status EXIT_USAGE)."""


class SetError(Exception):
    """A `--set` that is not NAME=INTEGER: a mistake in the program's dims, like a bad dim value."""


class FileError(Exception):
    """A file tcpc was asked to write that it cannot write; the message names the path."""


def parse_set(items: Sequence[str]) -> dict[str, int | str]:
    """`--set NAME=VALUE` items: an integer, or `auto` for a dim that is a scatter's block=."""
    dims: dict[str, int | str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise SetError(f"--set {item}: expected NAME=VALUE")
        if value.strip() == "auto":
            dims[name.strip()] = "auto"
            continue
        try:
            dims[name.strip()] = int(value)
        except ValueError:
            raise SetError(f"--set {item}: {value!r} is neither an integer nor auto") from None
    return dims


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help=".moe program (or .mlir IR)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a dim")
    p.add_argument("-p", "--pipeline", default=None, help="passes to apply, e.g. 'lower-topk{strategy=rounds}'")


def add_instrument_flags(p: argparse.ArgumentParser) -> None:
    """The flags that report on the pipeline pass by pass (tcpc/pass_instruments.py)."""
    p.add_argument("--dump-ir", default=None, metavar="DIR",
                   help="write the IR before the passes and after each one to DIR: 00-input.mlir, 01-lower-topk.mlir, ...")
    p.add_argument("--time-passes", action="store_true", help="print each pass's wall time (on stderr)")
    p.add_argument("--pass-stats", action="store_true",
                   help="print, for each pass, whether it changed the IR, its op counts by dialect before -> after and "
                        "the cycles after it, cost-only (on stderr)")


def make_parser() -> argparse.ArgumentParser:
    parser = TcpcArgumentParser(prog="tcpc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile and print the IR")
    add_common(c)
    c.add_argument("--emit", choices=("graph", "lowered", "scheduled", "planned"), default=None,
                   help="which level to print (default: graph, or the IR after -p): lowered is the "
                        "engine ops on whole tensors, scheduled adds the schedule level (loops, tiles, "
                        "buffers, DMA), planned is the scheduled IR with each op's simulated engine slot")
    c.add_argument("--seed", type=int, default=None, help="--emit planned: seed for the inputs (default 0)")
    c.add_argument("--machine", default=None,
                   help="the machine to compile for (TOML file or built-in name; default: RNGD): the module's "
                        "target, which every pass tiles for; --emit planned also simulates on it")
    c.add_argument("--cost-only", action="store_true",
                   help="--emit planned: plan without values (real model sizes); the routing comes from --routing")
    c.add_argument("--routing", default=None, metavar="SCENARIO",
                   help=f"--emit planned --cost-only: {', '.join(SCENARIOS)} (default balanced) or an .npz of [T, K] expert indices")
    c.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass")
    add_instrument_flags(c)
    c.add_argument("--generic", action="store_true", help="print the generic op format")
    c.add_argument("--debug-locations", action="store_true",
                   help="print each op's source location, loc(\"FILE\":LINE:COL), inside the passes that made it")
    c.add_argument("-o", "--output", default=None, help="write the IR here instead of stdout")
    c.add_argument("--mesh", default=None, metavar="SPEC",
                   help="shard over a mesh first: ep=8, dp=2,ep=4, ep=4,tp=2, optionally strategy=a2a|a2a_sum|allgather, "
                        "topk=rank|rounds|auto, tokens=global|per-chip (the program's T: the whole mesh's tokens, "
                        "the default, or each chip's)")

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
    r.add_argument("--report-ops", default="200", metavar="N",
                   help="ops listed in --report's table and at each end of its critical path (default 200; 0: the summary only; all: every op)")
    r.add_argument("--report-by", action="append", default=None, metavar="TABLES",
                   help=f"--report's tables, comma-separated or repeated: {', '.join(REPORT_TABLES)} (cycles by "
                        f"phase, by source line, every op and the critical path; default all three)")
    r.add_argument("--report-json", default=None, metavar="FILE", help="write the report as JSON")
    r.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace (open it in Perfetto)")
    r.add_argument("--html", default=None, metavar="FILE",
                   help="write the run as one self-contained page that opens offline: the source with each line's "
                        "cycles, the IR after each pass, the report's tables and a timeline")
    r.add_argument("--machine", default=None, metavar="FILE", help="machine file (TOML; default: RNGD)")
    r.add_argument("--sram-policy", choices=("spill", "error"), default="spill",  # memory_plan.SRAM_POLICIES
                   help="when SRAM is full: spill to HBM, and stream ops too large for SRAM through it (default), or stop with an error")
    r.add_argument("--cost-only", action="store_true",
                   help="cycles without inputs or values (real model sizes); the routing comes from --routing")
    r.add_argument("--mesh", default=None, metavar="SPEC",
                   help="shard over a mesh of chips and simulate every chip: ep=8, dp=2,ep=4, ep=4,tp=2, ep=4,sp=8 "
                        "(seed 001's 4 x 8 mesh: tokens all-gathered over sp before the all-to-all over ep, "
                        "reduce-scattered back), optionally "
                        "strategy=a2a|a2a_sum|allgather, topk=rank|rounds|auto, tokens=global|per-chip (the program's "
                        "T: the whole mesh's tokens, split over the dp*ep*sp chips, the default; or each chip's own "
                        "batch: --set T=1 --mesh ep=8,tokens=per-chip is one token per chip), chunks=N|auto (a2a, "
                        "a2a_sum: the chip's token loop in N software-pipelined chunks; auto: the count of fewest "
                        "simulated cycles), sp_sum=f32|bf16 (with sp: the columns' sums cross the reduce-scatter "
                        "in f32, or rounded to bf16 first as seed 001's do: half the bytes, a2a_sum's tolerance), "
                        "waves=N (a2a: the split pairs go back in N all-to-alls under the expert loop, each once the "
                        "blocks of its range of the receiver's experts are computed, and one after it)")
    r.add_argument("--max-chips", type=int, default=None, metavar="N",
                   help=f"--mesh: simulate meshes of up to N chips (default {MAX_SIMULATED_CHIPS}; every chip is "
                        "simulated, and the time grows faster than the chip count)")
    r.add_argument("--mesh-machine", default=None, metavar="FILE",
                   help="--mesh: mesh file (TOML: chip machine, mesh shape, links) or a built-in one by name "
                        "(rngd_pcie, the default: RNGD cards over PCIe; rngd_2x4)")
    r.add_argument("--routing", default=None, metavar="SCENARIO",
                   help=f"cost-only routing: {', '.join(SCENARIOS)} (default balanced) or an .npz of [T, K] expert indices")
    r.add_argument("--weights", default=None, metavar="PATH",
                   help="real weights: a .safetensors file, a directory of shards with model.safetensors.index.json, "
                        "or a snapshot directory with config.json (dims come from it)")
    r.add_argument("--layer", type=int, default=None, metavar="N", help="--weights: which layer's MoE block to read")
    r.add_argument("--family", default=None, metavar="FILE",
                   help="--weights: a checkpoint family tcpc has no table for, declared in TOML (tensor names, "
                        "layouts, config keys; see docs/checkpoints.md)")
    r.add_argument("--convert-weights", choices=CONVERSIONS, default=None,
                   help="--weights: convert a checkpoint's precision to the program's, which otherwise must match: "
                        "quantize (e.g. bf16 weights into an fp8 program) or dequantize (fp8 or MXFP4 weights into a "
                        "bf16 program)")
    add_instrument_flags(r)

    s = sub.add_parser("sweep", help="cost-only simulations over a grid of programs, dims, machines, routings "
                                     "and pass options, on Dask (results as Parquet and CSV)")
    s.add_argument("spec", help="sweep spec (TOML; see examples/sweeps/)")
    s.add_argument("-o", "--out", default=None, metavar="DIR",
                   help="results directory (default: the spec's `out`, else SPEC-NAME-sweep/ here)")
    s.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="an existing Dask scheduler, e.g. tcp://10.0.0.5:8786 (default: a LocalCluster)")
    s.add_argument("--workers", type=int, default=None, metavar="N",
                   help="LocalCluster worker processes (default: one per core)")
    s.add_argument("--max-points", type=int, default=MAX_POINTS, metavar="N",
                   help=f"refuse a spec of more than N points (default {MAX_POINTS:,})")
    s.add_argument("--plot", action="store_true",
                   help="also draw roofline.png and cycles_vs_PARAM.png for each swept parameter")
    return parser


def check_compile_flags(args: argparse.Namespace) -> None:
    """Options that only `--emit planned` reads, and `--emit` levels that `-p` contradicts."""
    if args.emit != "planned":
        for flag, value in (("--seed", args.seed), ("--cost-only", args.cost_only), ("--routing", args.routing)):
            if value not in (None, False):
                raise UsageError(f"{flag} applies to --emit planned (the plan depends on it); nothing else reads it")
    elif instrument_flags(args):
        raise UsageError(f"{instrument_flags(args)[0]} reports on the passes one by one; --emit planned prints "
                         "the planned IR once")
    if args.pipeline is None and args.mesh is None and args.emit in (None, "graph") and instrument_flags(args):
        raise UsageError(f"{instrument_flags(args)[0]} reports on the passes one by one; the graph-level IR goes "
                         "through none (add --emit lowered, --emit scheduled or -p PASSES)")
    if args.pipeline is not None and args.emit in ("graph", "lowered", "scheduled"):
        level = {"graph": "the IR before any pass", "lowered": "the IR after the lowering passes",
                 "scheduled": "the IR after the full pipeline"}[args.emit]
        raise UsageError(f"--emit {args.emit} prints {level}; -p gives other passes (drop one of them)")
    if args.routing is not None and not args.cost_only:
        raise UsageError("--routing sets the routing of a cost-only plan; add --cost-only")


def instrument_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that watch the pipeline pass by pass."""
    given = {"--print-ir-after-all": getattr(args, "print_ir_after_all", False), "--dump-ir": args.dump_ir is not None,
             "--time-passes": args.time_passes, "--pass-stats": args.pass_stats}
    return [flag for flag, on in given.items() if on]


def dump_directory(path: str) -> Path:
    """--dump-ir's directory, made (with its parents) if missing; checked before any work."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise FileError(f"--dump-ir {path}: is a file; name a directory")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FileError(f"--dump-ir {path}: cannot create the directory: {(e.strerror or str(e)).lower()}") from None
    if not os.access(target, os.W_OK | os.X_OK):
        raise FileError(f"--dump-ir {path}: permission denied")
    return target


def instruments(args: argparse.Namespace, dump: Path | None, graph: str, machine: Machine,
                routing: str = "balanced", seed: int = 0) -> PassInstruments:
    """The watchers of the pipeline that --print-ir-after-all, --dump-ir, --time-passes and
    --pass-stats ask for (cost-only cycles of `graph` for the routing scenario `routing`)."""
    def write(path: Path, text: str) -> None:
        write_file(path, lambda f: f.write(text.encode()))

    generic = getattr(args, "generic", False)  # compile's flags, like --print-ir-after-all
    locations = getattr(args, "debug_locations", False)
    return PassInstruments(
        printer=IRPrinter(generic, locations) if getattr(args, "print_ir_after_all", False) else None,
        dump=IRDump(dump, generic, write, locations) if dump is not None else None,
        timer=PassTimer() if args.time_passes else None,
        stats=PassStatistics(graph, machine, routing, seed) if args.pass_stats else None,
        history=IRHistory() if getattr(args, "html", None) else None)  # run's --html


def cmd_compile(args: argparse.Namespace) -> int:
    check_compile_flags(args)
    out = writable(args.output, "-o", [args.file]) if args.output else None
    dump = dump_directory(args.dump_ir) if args.dump_ir is not None else None
    machine = as_machine(args.machine)
    routing = args.routing or "balanced"
    spec = args.pipeline
    if args.mesh is not None:
        if args.emit == "planned" or args.pipeline is not None:
            raise UsageError("--mesh prints the sharded graph, or with --emit lowered or scheduled a chip's program at "
                             "that level; not with -p or --emit planned")
        mesh = MeshSpec.parse(args.mesh)
        spec = mesh.pipeline(lowered=args.emit in ("lowered", "scheduled"), scheduled=args.emit == "scheduled")
        # as `tcpc run --mesh` compiles it: block=auto chosen on the default mesh's links, --machine's chips
        program = compile_for_mesh(args.file, parse_set(args.set), mesh,
                                   machine=dataclasses.replace(load_mesh_machine(), chip=machine))
    else:
        program = compile_file(args.file, parse_set(args.set), machine=machine, routing=routing, seed=args.seed or 0)
    chunks: list[str] = []
    if args.emit == "planned":
        seed = args.seed or 0
        planned = program.planned(seed=seed, machine=machine, pipeline=args.pipeline,
                                  cost_only=args.cost_only, routing=routing)
        # the plan's own choices (Program.passes keeps them): the first graph's, for its routing
        _, choices = program.passes(args.pipeline, graph=program.graph_names[0], machine=machine,
                                    routing=choice_routing(args.cost_only, routing), seed=seed)
        given = f"the IR after {args.pipeline}" if args.pipeline is not None else "the full pipeline"
        values = (f"without values, for the {args.routing or 'balanced'} routing (cost-only)" if args.cost_only
                  else f"for the inputs drawn from seed {seed}")
        chunks += [f"// chose {c.describe()}\n" for c in choices]
        chunks.append(f"// planned: {given}, each op with the slot the simulator scheduled it in\n"
                      f"// (tcpc.plan), {values}\n")
        chunks.append(print_ir(planned, args.generic, args.debug_locations))
    elif spec is None and args.emit in (None, "graph"):
        chunks += [f"// chose {c.describe()}\n" for c in program.choices]
        chunks.append(print_ir(program.module, args.generic, args.debug_locations))
    else:  # as `tcpc run` resolves every auto: on --machine (default RNGD), for balanced routing
        passes, choices = program.passes(spec, level=args.emit or "scheduled", machine=machine, routing=routing)
        chunks += [f"// chose {c.describe()}\n" for c in choices]
        watch = instruments(args, dump, program.graph_names[0], machine)
        lowered = apply_pipeline(program.module, passes, watch, machine=machine)
        chunks += watch.printer.chunks if watch.printer is not None else [print_ir(lowered, args.generic, args.debug_locations)]
        sys.stderr.write(watch.report())
    text = "".join(chunks)
    if out is not None:
        write_file(out, lambda f: f.write(text.encode()))
    else:
        sys.stdout.write(text)
    return EXIT_OK


def writable(path: str, flag: str, inputs: Sequence[str | None]) -> Path:
    """`path` if tcpc may write it: not a directory, not one of the files it reads, in a
    directory that exists. Checked before any work, so a long run never ends in a bad path."""
    target = Path(path)
    if target.is_dir():
        raise FileError(f"{flag} {path}: is a directory; name a file")
    for given in inputs:
        if given and Path(given).exists() and target.exists() and target.resolve() == Path(given).resolve():
            raise FileError(f"{flag} {path}: is an input of this command; writing it would overwrite it")
    if not target.parent.is_dir():
        raise FileError(f"{flag} {path}: no such file or directory ({target.parent} does not exist)")
    if target.exists() and not os.access(target, os.W_OK) or not target.exists() and not os.access(target.parent, os.W_OK):
        raise FileError(f"{flag} {path}: permission denied")
    return target


def write_file(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write a file whole or not at all: on an error (a full disk) the partial file is removed
    and the error names the path."""
    try:
        with open(path, "wb") as f:
            write(f)
    except OSError as e:
        remove_partial(path)
        raise FileError(cannot_write(str(path), e)) from None


def describe(name: str, value: np.ndarray) -> str:
    """Shape, dtype, the first values; for floats the mean and largest magnitude of the finite
    values, and how many overflowed to +-inf or are NaN, in words."""
    v = value.astype(np.float64) if value.dtype.kind in "fV" or value.dtype.name == "bfloat16" else value
    head = np.array2string(np.asarray(v).reshape(-1)[:6], precision=4, separator=", ")
    stats = ""
    if value.size and v.dtype.kind == "f":
        finite = v[np.isfinite(v)]
        if finite.size:
            stats = f"  mean {finite.mean():.4g}  abs max {np.abs(finite).max():.4g}"
        nan, pos, neg = int(np.isnan(v).sum()), int(np.isposinf(v).sum()), int(np.isneginf(v).sum())
        if nan or pos or neg:
            counts = [f"{n} {what}" for n, what in ((nan, "NaN"), (pos, "+inf"), (neg, "-inf")) if n]
            whole = "all" if finite.size == 0 else f"{value.size - finite.size} of {value.size}"
            stats += f"  not finite: {whole} ({', '.join(counts)})"
    return f"{name}: {list(value.shape)} {value.dtype.name}  first {head}{stats}"


SIMULATION_FLAGS = ("report", "report_json", "trace", "html", "machine", "cost_only", "routing")


def report_by(args: argparse.Namespace) -> tuple[str, ...]:
    """--report-by: the tables --report prints (REPORT_TABLES, in that order)."""
    if args.report_by is None:
        return REPORT_TABLES
    if not args.report:
        raise UsageError("--report-by chooses --report's tables; add --report")
    if args.mesh is not None:
        raise UsageError("--report-by chooses the tables of a chip's report; a --mesh report has its own")
    asked = [t.strip() for given in args.report_by for t in given.split(",")]
    for t in asked:
        if t not in REPORT_TABLES:
            raise UsageError(f"--report-by {t or repr(t)}: expected {', '.join(REPORT_TABLES[:-1])} or "
                             f"{REPORT_TABLES[-1]} (comma-separated or repeated)")
    return tuple(t for t in REPORT_TABLES if t in asked)


def check_flags(args: argparse.Namespace) -> None:
    def given(flag: str) -> bool:
        value = getattr(args, flag)
        return value not in (None, False)

    def name(flag: str) -> str:
        return "--" + flag.replace("_", "-")

    if args.reference and args.check and args.pipeline is None:
        raise UsageError("--check compares a run with the reference, and --reference runs only the reference: "
                         "nothing to compare (drop --reference to check the simulation, or add -p PASSES to "
                         "check the IR after those passes)")
    if args.reference:
        for flag in SIMULATION_FLAGS:
            if given(flag):
                raise UsageError(f"{name(flag)} needs a simulation; --reference runs the IR without one")
        if args.sram_policy != "spill":
            raise UsageError("--sram-policy needs a simulation; --reference runs the IR without one")
        if args.pipeline is None and instrument_flags(args):
            raise UsageError(f"{instrument_flags(args)[0]} reports on the passes one by one; --reference runs the "
                             "graph-level IR, which goes through none (add -p PASSES)")
    if (args.weights is None) != (args.layer is None):
        raise UsageError("--weights and --layer go together: --weights PATH --layer N")
    for flag in ("family", "convert_weights"):
        if given(flag) and args.weights is None:
            raise UsageError(f"{name(flag)} applies to --weights PATH --layer N")
    if args.cost_only:
        for flag in ("inputs", "out", "check", "weights"):
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
                           given: dict[str, np.ndarray], routing_check: RoutingRangeCheck,
                           watch: PassInstruments) -> SimulationResult:
    machine = as_machine(args.machine)
    progress = Progress()
    listeners = [progress] if args.cost_only else [progress, routing_check]
    try:
        return program.simulate(given, seed=args.seed, graph=fn_name, pipeline=args.pipeline, machine=machine,
                                sram_policy=args.sram_policy, cost_only=args.cost_only,
                                routing=args.routing or "balanced", listeners=listeners, after_each=watch)
    finally:
        progress.close()


def partly_lowered(program: Program, args: argparse.Namespace) -> str:
    """Why the IR after `-p` cannot be simulated (the ops left without a cost), or "" when it
    can, or when the user asked for something only a simulation gives."""
    wants_cycles = args.report or args.report_json or args.trace or args.html or args.cost_only
    if args.pipeline is None or wants_cycles:
        return ""
    from runtime_sim.perf.simulate import uncosted_ops  # the simulator registers every cost model

    left = uncosted_ops(program.lower(args.pipeline).ops)
    return f"{', '.join(sorted(left))} have no cost; the full pipeline lowers them" if left else ""


def write_json(path: Path, data: object) -> None:
    text = json.dumps(data, indent=1) + "\n"
    write_file(path, lambda f: f.write(text.encode()))


def output_paths(args: argparse.Namespace) -> dict[str, Path]:
    """The files `tcpc run` will write, checked before the run; two flags naming one file
    would leave only the last."""
    reads = [args.file, args.inputs, args.machine, args.routing]
    paths: dict[str, Path] = {}
    for flag in ("out", "report_json", "trace", "html"):
        value = getattr(args, flag)
        if value:
            name = "--" + flag.replace("_", "-")
            path = writable(value, name, reads)
            for other, seen in paths.items():
                if seen.resolve() == path.resolve():
                    raise UsageError(f"{other} and {name} both name {value}")
            paths[name] = path
    return paths


def compile_with_weights(args: argparse.Namespace, given: dict[str, np.ndarray], choose_for: dict[str, Any]) -> Program:
    """The program with a checkpoint's dims, its layer's weights added to `given`; `choose_for`
    is what block=auto is chosen for (compile_file's machine, routing, seed)."""
    from tcpc import checkpoints
    from tcpc.family_file import load_family

    families = (load_family(args.family), *checkpoints.FAMILIES) if args.family else checkpoints.FAMILIES
    checkpoint = checkpoints.open_checkpoint(args.weights)
    layer = checkpoints.compile_with_weights(args.file, checkpoint, args.layer, parse_set(args.set), args.graph,
                                             convert=args.convert_weights, families=families, **choose_for)
    both = sorted(set(given) & set(layer.weights))
    if both:
        raise UsageError(f"argument '{both[0]}' is given by both --inputs and --weights")
    given.update(layer.weights)
    print(layer.describe(checkpoint, args.layer))
    return layer.program


def cmd_run(args: argparse.Namespace) -> int:
    check_flags(args)
    max_ops = report_ops(args.report_ops)  # checked before a long simulation
    tables = report_by(args)
    if args.mesh is not None:
        return cmd_run_mesh(args)
    for flag, value in (("--mesh-machine", args.mesh_machine), ("--max-chips", args.max_chips)):
        if value is not None:
            raise UsageError(f"{flag} applies to a --mesh run; add --mesh")
    if Path(args.file).suffix == ".mlir" and args.set:
        raise UsageError("--set applies to .moe programs, not to .mlir IR")
    paths = output_paths(args)
    if args.check and args.pipeline and "pin-routing" in (p.name for p in parse_pipeline(args.pipeline)):
        raise UsageError("--check compares with the reference, whose routing comes from the router; after "
                         "pin-routing the routing argument takes the balanced scenario instead, so they differ")
    dump = dump_directory(args.dump_ir) if args.dump_ir is not None else None
    given = load_npz(args.inputs) if args.inputs else {}
    # block=auto is chosen for the run's machine and, cost-only, its routing scenario
    choose_for = {"machine": as_machine(args.machine), "routing": args.routing or "balanced", "seed": args.seed}
    program = (compile_with_weights(args, given, choose_for) if args.weights
               else compile_file(args.file, parse_set(args.set), **choose_for))
    fn = program.function(args.graph)
    name = fn.sym_name.data
    # The IR after a partial pipeline may still hold graph-level ops, which have no cost: it
    # runs on the interpreter then (translation validation), saying why there are no cycles.
    why = "" if args.reference else partly_lowered(program, args)
    not_simulated = f"not simulated: {why}" if why else ""
    routing_check = RoutingRangeCheck()
    watch = instruments(args, dump, name, as_machine(args.machine), args.routing or "balanced", args.seed)
    if args.reference or not_simulated:  # the interpreter: the graph-level IR, or the IR after -p
        result = program.run(given, seed=args.seed, graph=name, reference=True, pipeline=args.pipeline,
                             listeners=[routing_check], after_each=watch)
        sys.stderr.write(watch.report())  # before the run's lines, as compile's come before the IR
        if args.pipeline is not None:
            level = f"after {args.pipeline}, {not_simulated or 'not simulated'}"
        else:
            level = "the IR as given, not simulated" if program.is_ir else "reference (graph-level IR)"
        print(f"graph {name} from {args.file}, {level}, seed {args.seed}")
        # the choices `program.run` lowered with (Program.passes keeps them)
        for choice in program.choices if args.pipeline is None else program.passes(args.pipeline)[1]:
            print(f"  chose {choice.describe()}")
        outputs, report = result.outputs, None
    else:
        sim = simulate_with_progress(program, name, args, given, routing_check, watch)
        sys.stderr.write(watch.report())
        report = sim.report
        if args.report or args.report_json or args.html:  # a block search per fixed block: only for a report
            report.better_blocks = program.better_blocks(graph=name, **choose_for)
        level = f"after {sim.pipeline}" if sim.pipeline else "as given"
        if sim.cost_only:
            title = f"graph {name} from {args.file}, {level}, cost-only on {report.machine.name} (no values computed)"
            print(title)
            print_choices(report, args.report)
            for arg, routing in sim.routing.items():
                print(f"  routing %{arg}: {routing.describe()}")
            if not sim.routing:
                print("  no routing arguments: no cost depends on routing")
            for i, t in enumerate(fn.function_type.outputs.data):
                print(f"  out{i} {format_type(t)}: not computed (cost-only)")
        else:
            title = f"graph {name} from {args.file}, {level}, simulated on {report.machine.name}, seed {args.seed}"
            print(title)
            print_choices(report, args.report)
        outputs = sim.outputs
    for i, (value, t) in enumerate(zip(outputs, fn.function_type.outputs.data)):
        print("  " + describe(f"out{i} {format_type(t)}", value))
    for found in routing_check.found:
        sys.stdout.flush()
        print(f"tcpc: warning: {found.describe()}", file=sys.stderr)
    if report is not None:
        if args.report:
            print()
            sys.stdout.write(report.to_text(max_ops=max_ops, tables=tables))
        print(cycle_summary(report))
        if args.report_json:
            write_json(paths["--report-json"], report.to_json())
            print(f"wrote {args.report_json}")
        trace = report.chrome_trace(None if sim.trace is None else ir_forms(sim.trace)) if args.trace or args.html else {}
        if args.trace:
            write_json(paths["--trace"], trace)
            print(f"wrote {args.trace}")
        if args.html:
            assert watch.history is not None, "instruments() watches the pipeline for --html"
            routing_text = {arg: r.describe() for arg, r in sim.routing.items()}
            facts = [*run_facts(report.machine.name, cycle_summary(report), report.choices, report.better_blocks or (),
                                routing_text), *output_facts(fn, outputs, sim.cost_only)]
            page = Page(title, facts, report, "", watch.history.steps, sim.pipeline,
                        report.to_text(max_ops=max_ops, tables=[t for t in tables if t != "line"]), trace,
                        {1: report.critical_path})
            write_page(paths["--html"], args.html, page)
    if args.out:
        write_file(paths["--out"], lambda f: save_outputs(f, outputs))
        print(f"wrote {args.out}")
    if args.check:
        ref = program.run(given, seed=args.seed, graph=name, reference=True)
        ran = "the simulated outputs" if report is not None else f"the outputs of the IR after {args.pipeline}"
        print(f"check: {ran} against the reference ({'the IR as given' if program.is_ir else 'the graph-level IR'})")
        results = compare_outputs(outputs, ref.outputs)
        for c in results:
            print(f"check: {c.message}")
        if not all(c.ok for c in results):
            return EXIT_ERROR
        print("check: outputs agree with the reference" if any(not c.identical for c in results)
              else "check: outputs equal the reference")
    return EXIT_OK


def run_facts(machine: str, cycles: str, choices: Sequence[Choice], better_blocks: Sequence[BetterBlock],
              routing: Mapping[str, str]) -> list[tuple[str, str]]:
    """The head of `--html`'s page: the machine, the cycle line, the cost model's choices and
    the routing, in the words the run prints them."""
    return [("machine", machine), ("cycles", cycles.removeprefix("cycles: ")),
            *(("chose", c.describe()) for c in choices), *(("better block", b.describe()) for b in better_blocks),
            *((f"routing %{arg}", text) for arg, text in routing.items())]


def output_facts(fn: func.FuncOp, outputs: Sequence[np.ndarray], cost_only: bool) -> list[tuple[str, str]]:
    """Each output as the run prints it (`describe`), or that cost-only computes none."""
    types = fn.function_type.outputs.data
    if cost_only:
        return [(f"out{i}", f"{format_type(t)}: not computed (cost-only)") for i, t in enumerate(types)]
    return [(f"out{i}", describe(format_type(t), value)) for i, (value, t) in enumerate(zip(outputs, types))]


def write_page(path: Path, given: str, page: Page) -> None:
    """--html: the page, written whole or not at all."""
    text = render_page(page)
    write_file(path, lambda f: f.write(text.encode()))
    print(f"wrote {given}")


def report_ops(value: str) -> int | None:
    """--report-ops: a count (0: the summary only, without the op table and the critical
    path), or `all` (None)."""
    if value == "all":
        return None
    if not value.isdigit():
        raise UsageError(f"--report-ops {value}: expected a count (0 for the summary only) or all")
    return int(value)


def print_choices(report: SimReport, in_report: bool) -> None:
    """The cost model's choices, and the fixed blocks it beats (--report-json), under the run's
    header, unless --report prints them (its text carries them, so a saved report says what was
    chosen)."""
    if not in_report:
        for choice in report.choices:
            print(f"  chose {choice.describe()}")
        for better in report.better_blocks or ():
            print(f"  better block: {better.describe()}")


def cmd_sweep(args: argparse.Namespace) -> int:
    """Check the flags, the whole spec and the results directory, say how many points, and only
    then start the cluster. A sweep whose every point failed is an error (status 1)."""
    from tcpc.sweep import RESULTS_CSV, check_out, load_spec, plot, run_sweep

    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers {args.workers}: a LocalCluster needs at least 1 worker process")
    if args.workers is not None and args.scheduler:
        raise UsageError("--workers sizes the LocalCluster; it does not apply with --scheduler")
    if args.max_points < 1:
        raise UsageError(f"--max-points {args.max_points}: expected a positive integer")
    spec = load_spec(args.spec, max_points=args.max_points)
    if args.out:
        out, named = Path(args.out), f"-o {args.out}"
    elif spec.out:
        out, named = spec.out, f"{args.spec}: out {spec.out}"
    else:
        out = Path(f"{Path(args.spec).stem}-sweep")
        named = f"{out} (the default results directory; -o names another)"
    check_out(out, named)
    where = f"the Dask scheduler at {args.scheduler}" if args.scheduler else "a LocalCluster"
    about = f" ({spec.description})" if spec.description else ""
    print(f"sweep {args.spec}{about}: {len(spec.points):,} point(s) on {where}", flush=True)
    outcome = run_sweep(spec, out, scheduler=args.scheduler, workers=args.workers)
    print(f"  ran {outcome.ran}, skipped {outcome.skipped} already done, {len(outcome.failed)} failed")
    if outcome.ran:
        print(f"  {outcome.points_per_second:.2f} points per second ({outcome.ran} in {outcome.seconds:.1f} s)")
    for row in outcome.failed[:10]:
        print(f"  failed {row['key']}: {row['error']}")
    if len(outcome.failed) > 10:
        print(f"  ... {len(outcome.failed) - 10} more failures in the results' error column")
    print(f"wrote {out / 'results.parquet'} and {out / 'results.csv'} ({len(outcome.rows)} rows)")
    if not outcome.succeeded:
        raise SweepError(f"{args.spec}: every point failed ({len(spec.points):,} of {len(spec.points):,}); "
                         f"the errors are above and in {out / RESULTS_CSV}")
    if args.plot:
        for path in plot(outcome.rows, out):
            print(f"wrote {path}")
    return EXIT_OK


def cmd_run_mesh(args: argparse.Namespace) -> int:
    """`tcpc run --mesh`: every chip simulated, the outputs put back together and checked."""
    why = {"reference": "a mesh run simulates every chip; --check compares with the reference",
           "pipeline": "the mesh runs shard-experts and then the full pipeline",
           "machine": "the mesh file names the chip machine: --mesh-machine",
           **dict.fromkeys(("dump_ir", "time_passes", "pass_stats"),
                           "tcpc compile --mesh SPEC --emit scheduled reports on a chip's passes")}
    for flag, reason in why.items():
        if getattr(args, flag) not in (None, False):
            raise UsageError(f"--{flag.replace('_', '-')} does not apply to --mesh ({reason})")
    spec = MeshSpec.parse(args.mesh)
    check_chips(spec, args)
    paths = output_paths(args)
    routing = args.routing or "balanced"
    given = load_npz(args.inputs) if args.inputs else {}
    # block=auto is chosen on the mesh, for a cost-only run's routing (balanced with values)
    program = compile_for_mesh(args.file, parse_set(args.set), spec, graph=args.graph, machine=args.mesh_machine,
                               routing=choice_routing(args.cost_only, routing), seed=args.seed)
    fn = program.function(args.graph)
    name = fn.sym_name.data
    progress = Progress(runs=spec.mesh.chips * spec.simulations(args.cost_only))
    try:
        sim = simulate_on_mesh(program, spec, given, seed=args.seed, graph=name, machine=args.mesh_machine,
                               sram_policy=args.sram_policy, cost_only=args.cost_only, routing=routing,
                               listeners=[progress])
    finally:
        progress.close()
    report = sim.report
    tokens = scattered_tokens(fn)
    per_chip = f", T = {tokens:,} tokens ({tokens // spec.mesh.token_shards:,} per chip)" if tokens else ""
    how = (f"{spec.mesh} ({spec.strategy}), {len(report.chips)} chips of {report.machine.chip.name} on "
           f"{report.machine.name}{per_chip}")
    routing_text = {arg: f"{used.describe()}; {received_by_chip(used, spec)}" for arg, used in sim.routing.items()}
    if sim.cost_only:
        title = f"graph {name} from {args.file}, sharded over {how}, cost-only (no values computed)"
        print(title)
        for arg, text in routing_text.items():
            print(f"  routing %{arg}: {text}")
    else:
        title = f"graph {name} from {args.file}, sharded over {how}, seed {args.seed}"
        print(title)
    if not args.report:  # --report's text carries them
        for choice in report.choices:
            print(f"  chose {choice.describe()}")
    for i, (value, t) in enumerate(zip(sim.outputs, fn.function_type.outputs.data)):
        print("  " + describe(f"out{i} {format_type(t)}", value))
    if args.report:
        print()
        sys.stdout.write(report.to_text())
    print(mesh_cycles(report))
    if args.report_json:
        write_json(paths["--report-json"], report.to_json())
        print(f"wrote {args.report_json}")
    if args.trace:
        write_json(paths["--trace"], report.chrome_trace())
        print(f"wrote {args.trace}")
    if args.html:
        machine = f"{report.machine.name}: {len(report.chips)} x {report.machine.chip.name}"
        facts = [*run_facts(machine, mesh_cycles(report), report.choices, (), routing_text),
                 *output_facts(fn, sim.outputs, sim.cost_only)]
        write_page(paths["--html"], args.html, mesh_page(program, sim, title, facts))
    if args.out:
        write_file(paths["--out"], lambda f: save_outputs(f, sim.outputs))
        print(f"wrote {args.out}")
    if args.check:
        results = check_on_mesh(program, spec, sim, seed=args.seed, graph=name)
        for c in results:
            print(f"check: {c.message}")
        if not all(c.ok for c in results):
            return 1
        print("check: outputs agree with the reference" if any(not c.identical for c in results)
              else "check: outputs equal the reference")
    return 0


def mesh_cycles(report: MeshReport) -> str:
    """One line: the slowest chip's cycles and time, and its share in collectives."""
    if not report.total_cycles:
        return "cycles: 0"
    comm = report.communication_cycles
    return (f"cycles: {report.total_cycles:,} = {report.microseconds:,.3f} us on the slowest of {len(report.chips)} "
            f"chips; {comm:,} in collectives ({comm / report.total_cycles:.0%})")


def mesh_page(program: Program, sim: MeshSimulation, title: str, facts: list[tuple[str, str]]) -> Page:
    """--html of a mesh run: its source figures are the slowest chip's, whose critical path is
    the mesh's total (every chip runs the one program); its IR, a chip's passes, compiled once
    more with the pipeline the run simulated (simulate_on_mesh takes no per-pass hook: with
    topk=auto it compiles the program once per strategy)."""
    report = sim.report
    history = IRHistory()
    program.lower(sim.pipeline, machine=report.machine.chip, after_each=history)
    slowest = max(range(len(report.chips)), key=lambda c: report.chips[c].total_cycles)
    chip = report.chips[slowest]
    chip.sources = program.source_lines(chip)
    note = (f"The figures are chip {slowest}'s, the slowest of the {len(report.chips)}: its critical path is the "
            "mesh's total cycles.")
    return Page(title, facts, chip, note, history.steps, sim.pipeline, report.to_text(), report.chrome_trace(),
                {c + 1: r.critical_path for c, r in enumerate(report.chips)})


def received_by_chip(routing: Routing, spec: MeshSpec) -> str:
    """How evenly a cost-only routing loads the chips: the pairs each one receives."""
    from runtime_sim.perf.mesh_simulate import pairs_received

    counts = pairs_received(routing, spec.mesh)
    if len(set(counts)) == 1:
        return f"{counts[0]:,} pairs to each chip"
    return f"pairs by chip: {', '.join(f'{c:,}' for c in counts)}"


def check_chips(spec: MeshSpec, args: argparse.Namespace) -> None:
    """A mesh of more chips than --max-chips is refused before any work: it would run for a
    long time without a word (mesh_run.MAX_SIMULATED_CHIPS)."""
    limit = MAX_SIMULATED_CHIPS if args.max_chips is None else args.max_chips
    if limit < 1:
        raise UsageError(f"--max-chips {limit}: expected a positive number of chips")
    chips = spec.mesh.chips
    if chips > limit:
        allowed = f"the {limit:,} tcpc simulates by default" if args.max_chips is None else f"--max-chips {limit:,}"
        raise ResourceError(f"--mesh {args.mesh}: {chips:,} chips, more than {allowed} (every chip is simulated, and "
                            f"the time grows faster than the chip count); --max-chips {chips} lifts the limit")


def simulation_error(e: Exception, command: str) -> str | None:
    """The message of a simulator error that is the user's to fix, or None. (Imported here,
    not at the top: the simulator's modules are slow to import and `tcpc compile` needs none.)"""
    from runtime_sim.perf.cost_model import NotLoweredError
    from runtime_sim.perf.cost_only import CostOnlyError
    from runtime_sim.perf.memory_plan import SramOverflowError
    from runtime_sim.perf.mesh_simulate import MeshError

    if isinstance(e, NotLoweredError):
        hint = "--reference runs it without simulating" if command == "run" else "--emit planned needs every op lowered"
        return f"{e} ({hint})"
    if isinstance(e, (CostOnlyError, SramOverflowError, MeshError)):
        return str(e)
    return None


class TcpcArgumentParser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line after the usage, and EXIT_USAGE."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"tcpc: error: {message}\n")


def run_command(args: argparse.Namespace) -> int:
    """Run the command, turning every error the user can fix into one line on stderr and its
    exit status (the table in docs/command-line.md#exit-statuses-and-errors)."""
    try:
        code = {"compile": cmd_compile, "run": cmd_run, "sweep": cmd_sweep}[args.command](args)
        sys.stdout.flush()  # a failing stdout shows here, after the command's last line
        return code
    except OutputError as e:
        print(f"tcpc: error: {e}", file=sys.stderr)
        discard_stdout()
    except CompileError as e:
        source = ""
        try:
            source = Path(args.file).read_text(encoding="utf-8-sig", errors="replace")  # as compile_file reads it
        except OSError:
            pass
        print(e.render(args.file, source), file=sys.stderr)
    except UsageError as e:
        print(f"tcpc: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except InputError as e:
        # An array's error names the --inputs file (--weights arrays were checked by the same
        # rules when read, so a given array that fails here came from the file).
        where = f"{args.inputs}: " if e.argument is not None and getattr(args, "inputs", None) else ""
        print(f"tcpc: error: {where}{e}", file=sys.stderr)
    except (SetError, FileError, MachineError, MappingError, RoutingError, PipelineError, ResourceError,
            CheckpointError, SweepError, MeshSpecError) as e:
        print(f"tcpc: error: {e}", file=sys.stderr)
    except InterpretationError as e:
        print(f"tcpc: error while running: {e}", file=sys.stderr)
    except PassFailedException as e:  # a pass that cannot run on this IR, e.g. out of order
        print(f"tcpc: error: {e}", file=sys.stderr)
    except MemoryError:
        print("tcpc: error: out of memory (--cost-only computes the cycles without values)", file=sys.stderr)
    except (BrokenPipeError, KeyboardInterrupt):
        raise
    except OSError as e:  # the .moe file, an input that is not readable
        where = f"{e.filename}: " if e.filename is not None else ""
        print(f"tcpc: error: {where}{(e.strerror or str(e)).lower()}", file=sys.stderr)
    except Exception as e:  # never a traceback for the user; TCPC_DEBUG=1 shows it
        message = simulation_error(e, args.command)
        if message is None:
            if os.environ.get("TCPC_DEBUG"):
                raise
            print(f"tcpc: internal error: {type(e).__name__}: {e} (set TCPC_DEBUG=1 for the traceback)", file=sys.stderr)
            return EXIT_INTERNAL
        print(f"tcpc: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """`tcpc`: exit statuses are EXIT_* above. numpy's floating-point warnings are never printed
    raw: the outputs say which values are not finite (`describe`)."""
    try:
        args = make_parser().parse_args(argv)
        with warnings.catch_warnings(), checked_stdout():
            warnings.simplefilter("ignore", RuntimeWarning)
            return run_command(args)
    except KeyboardInterrupt:
        print("tcpc: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader is gone: end quietly
        discard_stdout()
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
