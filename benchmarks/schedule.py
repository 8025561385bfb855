"""The schedule level against the chip's limit: issue #12's target table.

    python benchmarks/schedule.py                                  # every family, T = 1, 16, 64, 2048, 4096
    python benchmarks/schedule.py --families qwen3_moe --tokens 1 64   # a subset (real-dim prefill is slow)
    python benchmarks/schedule.py --out DIR                        # also write DIR/schedule.md
    python benchmarks/schedule.py --tokens 2048 4096 --blocks 16 64 256   # fixed B: the robustness sweep

Every family of benchmarks/run.py's model table (examples/*.moe at the real model's dims) is
compiled with the full pipeline (the schedule level included) and simulated cost-only with
balanced routing on the default machine. The block size is the compiler's choice by default
(`block=auto`, tcpc/autotune.py: the candidate of fewest simulated cycles, with balanced
routing), or run.py's rule with `--block rule` (`block_size`: the rows an expert receives under
balanced routing, a power of two, at most 64, within T).

The chip limit is computed here, not taken from the simulator's counters:

    limit = max(FLOPs / 256 TFLOPS, minimal HBM bytes / 1.5 TB/s)

the whole RNGD chip's bf16 peak and HBM bandwidth (docs/hardware.md#one-chip), with

- FLOPs from the graph-level IR: 2 M N K for every `tmath.matmul` (the router, shared
  experts), and 2 x (T x K routed pairs) x the weight's two dims for every
  `moe.grouped_matmul` (padding rows of a block are not work);
- minimal HBM bytes: every function argument once (tokens in, the router, shared experts),
  except the per-expert tensors (the weights, biases and scales the grouped matmuls read),
  of which only the experts the routing uses count, once each; plus the outputs, written once.

The limit prices every FLOP at the bf16 peak. An f32 x f32 matmul (DeepSeek-V3's router) has
no multiplier pair on the contraction engine: it runs on the vector engines' float fma, four
MACs per slice per cycle, or on the multipliers as nine bf16 products per MAC (bf16x9,
docs/hardware.md#the-contraction-mapping), and the experts wait for its result; so the table
also gives a bound that sees those routes (`Limit.route_seconds`): the f32 FLOPs on the faster
route (every slice's fma, or nine times the FLOPs at the bf16 peak), then the rest of the work,
of whose HBM bytes only the chip's SRAM can be brought in meanwhile. It is a lower bound for any
program that computes the router in f32, computed from the graph like the limit; "-" for layers
with no f32 matmul.

Columns: simulated cycles, the limit and their ratio, the f32-route bound and the ratio to it; the cycles each phase spends on the
critical path (they sum to the simulated time); the overlap of DMA and contraction (cycles in
which a DMA command and a contraction both run, as a share of the contraction cycles); MAC
utilization (the graph's FLOPs over the chip's bf16 peak for the simulated time); what bounds
the layer (the engine and the bound of the commands on the critical path that hold the most of
it, and their share); the experts' mapping (the experts-phase contraction with the most cycles
in the IR: its mapping onto Slice, Lane, Time and Packet in the book's notation, its MAC
utilization and bounding stage, target/contraction_mapping.py); B and the schedule level's loops
(`phase: trips x rows`, from the IR); peak SRAM; spills and streams (the compiler's placement
should need none). With `--blocks`, every row is run at each fixed B (`--set B`) instead of the
compiler's choice: the robustness of the schedule to a block size the user fixes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from xdsl.dialects import func, scf  # noqa: E402
from xdsl.dialects.builtin import Float32Type, IntegerAttr, ModuleOp, TensorType  # noqa: E402

import tcpc  # noqa: E402
from dialects.annotations import PHASES, phase_of  # noqa: E402
from dialects.moe import GroupedMatmulOp  # noqa: E402
from dialects.tensor_types import shape_of  # noqa: E402
from dialects.tmath import MatmulOp  # noqa: E402
from runtime_sim.perf.report import SimReport  # noqa: E402
from runtime_sim.perf.routing_scenarios import scenario_choices  # noqa: E402
from runtime_sim.semantics.numerics import stored_nbytes, tensor_dtype  # noqa: E402
from tcpc.schedule_summary import contraction_mappings  # noqa: E402
from target.contraction_mapping import PIECES  # noqa: E402
from target.machine import default_machine  # noqa: E402


if str(ROOT / "benchmarks") not in sys.path:  # run.py, the model table, next to this script
    sys.path.insert(0, str(ROOT / "benchmarks"))

import run as bench  # noqa: E402

TOKENS: tuple[int, ...] = (1, 16, 64, 2048, 4096)
CHIP_FLOPS_PER_SECOND = 256e12
"""RNGD's bf16 peak, the whole chip (2 clusters of 256 slices): docs/hardware.md#one-chip (SDK)."""
CHIP_HBM_BYTES_PER_SECOND = 1.5e12
"""RNGD's HBM3 bandwidth: docs/hardware.md#one-chip (SDK)."""
CONTRACTIONS = ("tcp.contract", "tcp.scaled_contract")


@dataclass(frozen=True)
class Limit:
    flops: int
    hbm_bytes: int
    f32_flops: int = 0
    """Of `flops`, those of f32 x f32 matmuls (DeepSeek-V3's router), which the contraction
    engine's multipliers do not take: `route_seconds`."""

    @property
    def seconds(self) -> float:
        return max(self.flops / CHIP_FLOPS_PER_SECOND, self.hbm_bytes / CHIP_HBM_BYTES_PER_SECOND)

    @property
    def route_seconds(self) -> float:
        """A lower bound that sees the f32 matmuls' routes (0 when there are none): they run on
        the vector engines' float fma (docs/hardware.md#the-contraction-mapping: `float_ways` MACs
        per slice per cycle, every slice of the chip) or as nine bf16 products per MAC at the
        peak (bf16x9), whichever is faster, and the layer's other work waits for their result
        (the router's logits decide the experts) except HBM traffic into the SRAM it can fill
        meanwhile: f32 time + max(other FLOPs at the peak, (bytes - SRAM) at the HBM rate), and
        never below `seconds`."""
        if not self.f32_flops:
            return 0.0
        m = default_machine()
        vector = min(self.f32_flops / 2 / (m.float_ways * m.slices * m.clusters * m.clock_hz),
                     PIECES * PIECES * self.f32_flops / CHIP_FLOPS_PER_SECOND)
        rest = max((self.flops - self.f32_flops) / CHIP_FLOPS_PER_SECOND,
                   max(0, self.hbm_bytes - m.sram_bytes) / CHIP_HBM_BYTES_PER_SECOND)
        return max(self.seconds, vector + rest)

    @property
    def bound(self) -> str:
        return "flops" if self.flops / CHIP_FLOPS_PER_SECOND >= self.hbm_bytes / CHIP_HBM_BYTES_PER_SECOND else "hbm"


def stored_bytes(t: TensorType) -> int:
    """Bytes of a tensor of type `t` at its stored width (f4e2m1: half a byte per value)."""
    return stored_nbytes(np.broadcast_to(np.zeros((), tensor_dtype(t)), shape_of(t)))


def chip_limit(graph: func.FuncOp, tokens: int, k: int, experts: int) -> Limit:
    """The layer's FLOPs and minimal HBM bytes from its graph-level IR (see the docstring);
    the experts used are those of the balanced routing scenario."""
    used = len(np.unique(scenario_choices("balanced", tokens, k, experts)))
    return work_limit(graph, tokens * k, used, experts)


def work_limit(graph: func.FuncOp, pairs: int, used: int, experts: int) -> Limit:
    """FLOPs and minimal HBM bytes of `graph` (graph-level IR, or one chip's SPMD program before
    lowering: its per-chip shapes) when `pairs` routed pairs go through its grouped matmuls and
    `used` of its `experts` experts receive one: every matmul's 2 M N K, 2 x pairs x the
    weight's two dims per grouped matmul; every argument once, of the per-expert ones (what
    the grouped matmuls read) only the used experts' share; the outputs written once."""
    args = list(graph.body.block.args)
    per_expert: set[int] = set()
    flops = f32_flops = 0
    for op in graph.walk():
        if isinstance(op, MatmulOp):
            out = shape_of(op.results[0].type)
            work = 2 * math.prod(out) * shape_of(op.operands[0].type)[-1]
            flops += work
            if all(isinstance(v.type, TensorType) and isinstance(v.type.get_element_type(), Float32Type)
                   for v in op.operands[:2]):
                f32_flops += work
        elif isinstance(op, GroupedMatmulOp):
            w = shape_of(op.operands[1].type)
            flops += 2 * pairs * w[-2] * w[-1]
            per_expert.update(args.index(v) for v in (op.weight, op.bias) if v in args)
    hbm = 0
    for i, arg in enumerate(args):
        t = arg.type
        if not isinstance(t, TensorType):
            continue
        size = stored_bytes(t)
        hbm += size * used // experts if i in per_expert else size
    hbm += sum(stored_bytes(t) for t in graph.function_type.outputs.data if isinstance(t, TensorType))
    return Limit(flops, hbm, f32_flops)


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_cycles(a: Iterable[tuple[int, int]], b: Iterable[tuple[int, int]]) -> int:
    """Cycles in which some interval of `a` and some interval of `b` both run."""
    ua, ub = _union(a), _union(b)
    i = j = total = 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0, hi - lo)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def loops_of(module: ModuleOp, function: str) -> str:
    """The schedule level's top-level loops of `function`: `phase: trips x rows` each; the
    consecutive pieces of one loop over blocks (interleave-shared's) as one, `in N pieces`."""
    fn = next(op for op in module.ops if isinstance(op, func.FuncOp) and op.sym_name.data == function)
    parts: list[str] = []
    last: tuple[int, str, int, int, int] | None = None  # the last block loop: its part, phase, end, blocks, pieces
    for op in fn.body.block.ops:
        if not isinstance(op, scf.ForOp):
            continue
        bounds = []
        for v in (op.lb, op.ub, op.step):
            value = getattr(v.owner, "value", None)
            bounds.append(value.value.data if isinstance(value, IntegerAttr) else None)
        lb, ub, step = bounds
        if None in bounds or not step:
            parts.append(f"{phase_of(op) or 'loop'}: ?")
            continue
        trips = -(-(ub - lb) // step)
        if any(inner.name == "tile.load_expert" for inner in op.body.walk()):  # a loop over blocks
            blocks, phase = ub - lb, phase_of(op) or "loop"  # a shared expert's loop steps over one block per cluster
            if last is not None and last[:3] == (len(parts) - 1, phase, lb):  # the loop's next piece
                blocks, count = last[3] + blocks, last[4] + 1
                parts[-1] = f"{phase}: {blocks} blocks in {count} pieces"
            else:
                count = 1
                parts.append(f"{phase}: {blocks} block{'s' if blocks != 1 else ''}")
            last = (len(parts) - 1, phase, ub, blocks, count)
            continue
        rows = step if step > 1 else None
        unit = f" x {rows} rows" if rows else (" block" if trips == 1 else " blocks")
        parts.append(f"{phase_of(op) or 'loop'}: {trips}{unit}")
    return "; ".join(parts) or "-"


@dataclass
class Row:
    title: str
    tokens: int
    block: int
    cycles: int
    microseconds: float
    limit: Limit
    critical: dict[str, int]
    overlap: int
    contraction_cycles: int
    loops: str
    bound: str
    mapping: str
    peak_sram_bytes: int
    spills: int
    streams: int
    seconds: float

    @property
    def limit_microseconds(self) -> float:
        return self.limit.seconds * 1e6

    @property
    def ratio(self) -> float:
        return self.microseconds / self.limit_microseconds if self.limit_microseconds else math.inf

    @property
    def utilization(self) -> float:
        """The graph's FLOPs over what the chip's bf16 peak does in the simulated time."""
        return self.limit.flops / (CHIP_FLOPS_PER_SECOND * self.microseconds * 1e-6) if self.microseconds else 0.0


def layer_bound(report: SimReport) -> str:
    """The engine and bound of the critical path's commands that hold the most of it, and their
    share: `tensor outer 71%`, `dma hbm 88%`."""
    held: dict[str, int] = {}
    for key in report.critical_path:
        o = report.op(key)
        what = f"{o.engine} {o.bound}"
        held[what] = held.get(what, 0) + report.critical_cycles.get(key, o.cycles)
    if not held or not report.total_cycles:
        return "-"
    top = max(held, key=lambda k: held[k])
    return f"{top} {100 * held[top] / report.total_cycles:.0f}%"


def experts_mapping(module: ModuleOp, function: str) -> str:
    """The experts-phase contraction with the most cycles in the IR (per command x commands):
    its mapping, MAC utilization and bounding stage."""
    records = [c for c in contraction_mappings(module, function) if c.phase == "experts"]
    if not records:
        return "-"
    top = max(records, key=lambda c: c.cycles * c.commands)
    return f"{top.mapping} ({top.utilization:.0%}, {top.bound})"


AUTO_BLOCK = 2**31 - 1
"""A block no T fits: the compiler then chooses it (block=auto)."""


def schedule_row(model, tokens: int, block: str | int = "auto") -> Row:  # type: ignore[no-untyped-def]
    """`model` at T = tokens: compiled with the full pipeline, simulated cost-only (balanced);
    `block` "auto" lets the compiler choose B, "rule" takes run.py's, a number fixes it."""
    dims = bench.dims_for(model, tokens)
    if block == "auto":
        dims = {**dims, "B": AUTO_BLOCK}
    elif isinstance(block, int):
        dims = {**dims, "B": block}
    start = time.perf_counter()
    program = tcpc.compile_file(model.path, dims=dims)
    if block == "auto":
        dims["B"] = int(program.choices[0].chosen) if program.choices else program.dims["B"]
    name = program.function().sym_name.data
    limit = chip_limit(program.function(), tokens, dims["K"], dims["E"])
    simulated = program.simulate(cost_only=True, routing="balanced")  # `tcpc run --cost-only`'s choices and run
    report: SimReport = simulated.report
    module = simulated.module
    assert module is not None
    seconds = time.perf_counter() - start
    dma = [(o.start, o.end) for o in report.ops if o.engine == "dma"]
    contracting = [(o.start, o.end) for o in report.ops if o.name in CONTRACTIONS]
    return Row(model.title, tokens, dims["B"], report.total_cycles, report.microseconds, limit,
               {p.name: p.critical_cycles for p in report.phases}, overlap_cycles(dma, contracting),
               sum(e - s for s, e in _union(contracting)), loops_of(module, name), layer_bound(report),
               experts_mapping(module, name), report.peak_sram_bytes,
               len(report.spills), len(report.streams), seconds)


def table(rows: Sequence[Row]) -> str:
    phases = [p for p in PHASES if any(p in r.critical for r in rows)]
    head = (["model", "T", "B", "simulated cycles", "limit µs", "simulated µs", "ratio", "f32-route bound µs",
             "ratio to it"]
            + [f"{p} cycles" for p in phases]
            + ["DMA ∥ contraction", "MAC util.", "bound", "experts' mapping", "loops", "peak SRAM MB", "spills",
               "streams", "run s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|"]
    for r in rows:
        share = f"{r.overlap:,} ({100 * r.overlap / r.contraction_cycles:.0f}%)" if r.contraction_cycles else "-"
        cells = [r.title, str(r.tokens), str(r.block), f"{r.cycles:,}", bench._num(r.limit_microseconds),
                 bench._num(r.microseconds), f"{r.ratio:.2f}"]
        route = r.limit.route_seconds * 1e6
        cells += [bench._num(route), f"{r.microseconds / route:.2f}"] if route else ["-", "-"]
        cells += [f"{r.critical.get(p, 0):,}" for p in phases]
        cells += [share, f"{r.utilization:.0%}", r.bound, r.mapping, r.loops, f"{r.peak_sram_bytes / 2**20:.1f}",
                  str(r.spills), str(r.streams), f"{r.seconds:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    names = [m.name for m in bench.MODELS]
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=names, default=names, metavar="NAME",
                        help=f"model families to run (default: all of {', '.join(names)})")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), metavar="T",
                        help=f"token counts (default: {' '.join(map(str, TOKENS))})")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to DIR/schedule.md")
    parser.add_argument("--block", choices=("auto", "rule"), default="auto",
                        help="the block size: the compiler's choice (default) or run.py's rule")
    parser.add_argument("--blocks", nargs="+", type=int, default=None, metavar="B",
                        help="run every row at each of these fixed block sizes instead (--set B)")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens: every T must be at least 1")
    if args.blocks is not None and any(b < 1 for b in args.blocks):
        parser.error("--blocks: every B must be at least 1")
    rows = []
    for model in (m for m in bench.MODELS if m.name in args.families):
        for t in args.tokens:
            for block in args.blocks or [args.block]:
                row = schedule_row(model, t, block)
                rows.append(row)
                print(f"  {model.title} T={t} B={row.block}: {row.cycles:,} cycles, {row.ratio:.2f}x the chip limit "
                      f"({row.seconds:.1f} s)", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/schedule.py " + " ".join(argv if argv is not None else sys.argv[1:])
        doc = (__doc__ or "").split("\n\n", 2)[2]
        (args.out / ("schedule.md" if args.blocks is None else "schedule_blocks.md")).write_text(
            f"# The schedule level against the chip limit\n\nGenerated by `{command.strip()}`. "
            + bench.machine_text(command.strip()) + "\n\n" + doc.strip() + "\n\n" + text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
