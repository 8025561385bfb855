"""The `tcpc` command: compile a .moe file and print its IR, or run it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from xdsl.utils.exceptions import InterpretationError, PassFailedException

from dialects.tmath import format_type
from tcpc.arrays import InputError, load_npz, save_outputs
from tcpc.diagnostics import CompileError
from tcpc.pipelines import LOWERED_PIPELINE, apply_pipeline, parse_pipeline
from tcpc.program import Program, compile_file, print_ir


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
    p.add_argument("file", help=".moe program")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override a dim")
    p.add_argument("-p", "--pipeline", default=None, help="passes to apply, e.g. 'lower-topk{strategy=rounds}'")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tcpc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile and print the IR")
    add_common(c)
    c.add_argument("--emit", choices=("graph", "lowered", "planned"), default=None,
                   help="which level to print (default: graph, or the IR after -p)")
    c.add_argument("--print-ir-after-all", action="store_true", help="print the IR after every pass")
    c.add_argument("--generic", action="store_true", help="print the generic op format")
    c.add_argument("-o", "--output", default=None, help="write the IR here instead of stdout")

    r = sub.add_parser("run", help="run a graph on inputs and print its outputs")
    add_common(r)
    r.add_argument("--graph", default=None, help="which graph to run (default: the first)")
    r.add_argument("--inputs", default=None, help=".npz with inputs by argument name")
    r.add_argument("--seed", type=int, default=0, help="seed for inputs not given (default 0)")
    r.add_argument("--out", default=None, help="write outputs to this .npz as out0, out1, ...")
    r.add_argument("--reference", action="store_true", help="run the graph-level IR")
    r.add_argument("--check", action="store_true", help="also run the reference and compare")
    return parser


def passes_for(args: argparse.Namespace, emit: str | None) -> str | None:
    if args.pipeline is not None:
        return args.pipeline
    if emit in ("lowered", "planned"):
        if not LOWERED_PIPELINE:
            raise UsageError(f"--emit {emit}: the lowering pipeline does not exist yet (try --emit graph or -p)")
        return ",".join(LOWERED_PIPELINE)
    return None


def cmd_compile(args: argparse.Namespace) -> int:
    program = compile_file(args.file, parse_set(args.set))
    spec = passes_for(args, args.emit)
    chunks: list[str] = []
    if spec is None:
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


def compare(outputs: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> list[str]:
    problems = []
    for i, (got, want) in enumerate(zip(outputs, reference)):
        g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
        if not np.array_equal(g, w, equal_nan=True):
            diff = np.nanmax(np.abs(g - w)) if g.size else 0.0
            problems.append(f"out{i} differs from the reference (max abs difference {diff:.4g})")
    return problems


def cmd_run(args: argparse.Namespace) -> int:
    program: Program = compile_file(args.file, parse_set(args.set))
    given = load_npz(args.inputs) if args.inputs else {}
    if not args.reference and args.pipeline is None and not LOWERED_PIPELINE:
        raise UsageError("running the lowered program needs the lowering passes, which do not exist yet; "
                         "use --reference (graph level) or -p PASSES")
    result = program.run(given, seed=args.seed, graph=args.graph,
                         reference=args.reference, pipeline=args.pipeline)
    fn = program.function(args.graph)
    level = "reference (graph-level IR)" if args.reference and args.pipeline is None else f"after {args.pipeline or 'the full pipeline'}"
    print(f"graph {fn.sym_name.data} from {args.file}, {level}, seed {args.seed}")
    for i, (value, t) in enumerate(zip(result.outputs, fn.function_type.outputs.data)):
        print("  " + describe(f"out{i} {format_type(t)}", value))
    if args.out:
        save_outputs(args.out, result.outputs)
        print(f"wrote {args.out}")
    if args.check:
        ref = program.run(given, seed=args.seed, graph=args.graph, reference=True)
        problems = compare(result.outputs, ref.outputs)
        for p in problems:
            print(f"check: {p}")
        if problems:
            return 1
        print("check: outputs equal the reference")
    return 0


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
    except (UsageError, InputError) as e:
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
        if os.environ.get("TCPC_DEBUG"):
            raise
        print(f"tcpc: internal error: {type(e).__name__}: {e} (set TCPC_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
