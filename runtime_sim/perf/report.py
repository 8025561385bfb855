"""What a simulation reports: totals, the roofline, per-op, per-engine and per-phase records,
as text, as JSON for tools, and as a Chrome trace (one track per unit of every engine) that
Perfetto opens.

Cycles by phase (the `tcpc.phase` of each op, dialects/annotations.py; a spill, reload or stream
command counts in the phase of the command it serves) are given two ways:
- `busy_cycles`: the engine cycles of the phase's commands, every engine and unit summed (the
  tensor units and the eight DMA engines); the phases' busy cycles sum to the engines' busy
  cycles, which may exceed the total when engines overlap;
- `critical_cycles`: the cycles of the phase's commands on the critical path. The critical
  path runs back to back from cycle 0 to the end, so these sum exactly to the total cycles:
  the share of the simulated time each phase is responsible for.

Cycles, bytes and FLOPs by source line (`lines`) add up the same way, by the `.moe` line of
each command's op (its source locations, dialects/locations.py; a plan's command, the line of
the command it serves). An op made for several lines (a `ve.chain` of ops from two lines, a
value several lines read) shares its figures equally among them, the remainder going to the
first lines, so the lines too sum exactly to the totals; commands without a location are one
row of their own.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any

from dialects.annotations import PHASES
from runtime_sim.perf.cost_model import DMA, TENSOR, flop_cycles
from runtime_sim.perf.graph_work import Padding
from target.machine import Machine
from runtime_sim.perf.memory_plan import Spill, Stream


# Not frozen: one is built per command of a run (hundreds of thousands at prefill), and a frozen
# dataclass takes about five times as long to build. Nothing modifies one once built.
@dataclass(slots=True)
class OpRecord:
    key: int
    """Position in issue order among all commands (the plan's spill commands included)."""
    label: str
    name: str
    engine: str
    unit: int
    start: int
    end: int
    cycles: int
    bytes: int
    hbm_bytes: int
    flops: int
    bound: str
    phase: str = "other"
    """The op's `tcpc.phase`; a plan command's is the phase of the command it serves."""
    units: tuple[int, ...] = (0,)
    """Every unit of its engine the command occupies (`unit` is the first): a large DMA
    command runs its parts on several DMA engines at once."""
    part_starts: tuple[int, ...] = ()
    """For a command on several units, when its part on each of `units` started (each part
    starts when its unit frees; `start` is the last one's); empty for a command on one unit."""
    part_ends: tuple[int, ...] = ()
    """For a command on several units, when its part on each of `units` ended (the last at
    `end`: parts sharing HBM end apart); empty for a command on one unit (or each part took
    `cycles`)."""
    locations: tuple[str, ...] = ()
    """`file:line:col` of each source location of its op (dialects/locations.py), a plan
    command's those of the command it serves; empty without one."""
    created_by: tuple[str, ...] = ()
    """The passes that made its op, first to last (dialects.locations.created_by)."""
    deps: tuple[int, ...] = ()
    """Keys of the commands whose results it waits for."""

    @property
    def engine_cycles(self) -> int:
        """Engine cycles: each part's, on each unit it occupies."""
        if self.part_ends:
            return sum(self.part_ends) - sum(self.part_starts)
        return self.cycles * len(self.units)

    @property
    def engine_label(self) -> str:
        """`tensor`, `dma3`, or `dma0-7` / `dma0,2,5` for a command on several DMA engines."""
        if self.engine != "dma":
            return self.engine
        u = self.units
        if len(u) == 1:
            return f"dma{u[0]}"
        if list(u) == list(range(u[0], u[-1] + 1)):
            return f"dma{u[0]}-{u[-1]}"
        return "dma" + ",".join(map(str, u))


_OP_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(OpRecord))
_op_values = operator.attrgetter(*_OP_FIELDS)
"""An OpRecord's fields, in order: its JSON (fields of ints, strings and tuples of ints)."""


@dataclass(frozen=True)
class PhaseRecord:
    name: str
    busy_cycles: int
    """Engine cycles of the phase's commands, all engines and units summed."""
    critical_cycles: int
    """Cycles of the phase's commands on the critical path (the phases' sum is the total)."""
    commands: int
    """Commands that ran on an engine (zero-cost ops are not counted)."""


@dataclass(frozen=True)
class LineRecord:
    """One source line's share of the run (the module docstring says how it is counted)."""

    file: str
    """The source file; "" for commands without a source location."""
    line: int
    """1-based; 0 for commands without a source location."""
    text: str | None
    """The line as written (None when the source is not known)."""
    commands: int
    """Commands with a share in the line (zero-cost ops are not counted)."""
    busy_cycles: int
    critical_cycles: int
    bytes: int
    hbm_bytes: int
    flops: int


REPORT_TABLES: tuple[str, ...] = ("phase", "line", "op")
"""The tables of `SimReport.to_text`, in the order it prints them: cycles by phase, by source
line, and every op with the critical path."""


@dataclass(frozen=True)
class EngineRecord:
    name: str
    units: int | None
    busy_cycles: int
    utilisation: float
    """Busy cycles / (total cycles x units)."""


@dataclass(frozen=True)
class Roofline:
    """The layer's lower bound: its FLOPs at the tensor unit's peak, its HBM bytes at HBM
    bandwidth; the simulated time can never be below the larger of the two.

    The FLOPs are the useful ones when the graph-level program is known (graph_work.py: its
    contractions on the routed pairs, not on the blocks' padding rows), else every FLOP the
    commands did (`padding` is None then). The HBM bytes are those the layer's own commands
    move (loads, gathers, scatters, stores), less the padding rows'; the memory plan's spills,
    reloads and streams are left out: they are the price of SRAM pressure, which the ratio of
    the simulated time to the roofline includes."""

    flops: int
    hbm_bytes: int
    flop_cycles: float
    byte_cycles: float
    padding: Padding | None = None
    """The contraction FLOPs and HBM bytes spent on padding rows, left out of the bound."""

    @property
    def cycles(self) -> float:
        return max(self.flop_cycles, self.byte_cycles)

    @property
    def bound(self) -> str:
        return "compute" if self.flop_cycles >= self.byte_cycles else "hbm bandwidth"


@dataclass(frozen=True)
class Choice:
    """A compile-time choice the driver made by the cost model (tcpc/autotune.py): a scatter's
    block size or lower-topk's strategy. Every alternative was compiled and simulated
    cost-only, or for those in `bounded` bounded below; `chosen` has the fewest cycles (ties:
    the first listed, the smaller block)."""

    what: str
    """`block` or `lower-topk strategy`."""
    where: str
    """`file:line:col` of the block= argument, or the pass in the pipeline."""
    reason: str
    """Why it was chosen rather than given: `block=auto`, a block that does not fit, `strategy=auto`."""
    chosen: int | str
    alternatives: tuple[tuple[int | str, int], ...]
    """(value, total cycles) of every alternative considered, in the order tried."""
    routing: str = "balanced"
    """The routing scenario the alternatives were simulated with."""
    on: str = ""
    """Where they were simulated when not on one chip: `the mesh ep=8 (a2a)`."""
    bounded: tuple[int | str, ...] = ()
    """The alternatives whose cycles are a lower bound, not simulated: their commands' roofline,
    which was above the fewest cycles simulated (they can neither win nor tie)."""

    def describe(self) -> str:
        tried = ", ".join(f"{v}: {'>= ' if v in self.bounded else ''}{c:,}" for v, c in self.alternatives)
        on = f" on {self.on}" if self.on else ""
        return (f"{self.what} {self.chosen} at {self.where} ({self.reason}); cycles by {self.what}{on} "
                f"({self.routing} routing): {tried}")

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "where": self.where, "reason": self.reason, "chosen": self.chosen,
                "routing": self.routing, **({"on": self.on} if self.on else {}),
                "alternatives": [{"value": v, "cycles": c, **({"lower_bound": True} if v in self.bounded else {})}
                                 for v, c in self.alternatives]}


@dataclass(frozen=True)
class BetterBlock:
    """A scatter whose block the program (or --set) fixes, and the block the compiler would
    choose in its place (the same search as block=auto, tcpc/autotune.py) when that one is
    more than autotune.BETTER_BLOCK_RATIO times faster: a small-T block kept at prefill."""

    where: str
    """`file:line:col` of the block= argument."""
    given: int
    given_cycles: int
    better: int
    better_cycles: int
    routing: str
    """The routing scenario both were simulated with (cost-only)."""
    dim: str | None = None
    """The dim block= names, which `--set` changes; None for a block written as a number."""

    def describe(self) -> str:
        change = (f"--set {self.dim}={self.better} or --set {self.dim}=auto" if self.dim
                  else f"block={self.better} or block=auto")
        return (f"block {self.given} at {self.where} takes {self.given_cycles:,} cycles, "
                f"{self.given_cycles / self.better_cycles:.2f}x the {self.better_cycles:,} of block {self.better}, "
                f"the compiler's choice (cost-only, {self.routing} routing): {change}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TileLoop:
    """One static loop of the schedule level in the simulated IR, and the tiles it moves:
    the sizes the compiler chose (token tile rows, the block, weight tiles)."""

    phase: str
    variable: str
    """The loop's induction variable (`row`, `block`)."""
    iterations: int
    step: int
    tiles: tuple[str, ...]
    """The distinct types of the tiles it slices and loads each iteration (`8x128xbf16`)."""
    pieces: int = 1
    """The consecutive loops it was split into (interleave-shared's pieces of the routed loop)."""

    def describe(self) -> str:
        pieces = f" in {self.pieces} pieces" if self.pieces > 1 else ""
        return (f"{self.phase} loop %{self.variable}: {self.iterations:,} x step {self.step}{pieces}; "
                f"tiles {', '.join(self.tiles) or 'none'}")


@dataclass(frozen=True)
class ContractionRecord:
    """One distinct contraction command of the simulated IR and how the contraction engine runs
    it: its mapping in the book's notation, the cycles of its passes (without configuration,
    guards and the tree's fill), the MAC utilization, the stage that bounds it, and the best
    mapping with another stationary operand or slice split (the runner-up)."""

    phase: str
    contraction: str
    """`gbd,gdf->gbf bf16[1, 256, 4096] x bf16[1, 4096, 1792]`."""
    commands: int
    """How many ops of the IR have this contraction and mapping (a loop body's op counts once)."""
    mapping: str
    cycles: int
    utilization: float
    bound: str
    runner_up: str
    runner_up_cycles: int

    def describe(self) -> str:
        runner = f"; runner-up {self.runner_up_cycles:,} cycles: {self.runner_up}" if self.runner_up else ""
        return (f"{self.phase} {self.contraction} (x{self.commands}): {self.cycles:,} cycles, {self.utilization:.1%} "
                f"of the MACs, bound by {self.bound}; {self.mapping}{runner}")


def roofline(machine: Machine, flops: int, hbm_bytes: int, fp8_flops: int = 0,
             padding: Padding | None = None) -> Roofline:
    """The whole chip's bound: every cluster's contraction peak, `fp8_flops` of the `flops` at the
    fp8 peak (twice bf16's on RNGD), and HBM bandwidth."""
    return Roofline(flops, hbm_bytes, flop_cycles(machine, flops, fp8_flops) / machine.clusters,
                    hbm_bytes / machine.hbm_bytes_per_cycle, padding)


@dataclass
class SimReport:
    machine: Machine
    total_cycles: int
    roofline: Roofline
    ops: list[OpRecord]
    engines: list[EngineRecord]
    critical_path: list[int]
    """Keys of the commands on the critical path, first to last."""
    peak_sram_bytes: int
    sram_capacity: int
    sram_policy: str
    spills: list[Spill] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    """Buffers that commands too large for SRAM streamed through HBM, and values in HBM a
    computing engine read (streamed in before it; memory_plan)."""
    choices: list[Choice] = field(default_factory=list)
    """What the driver chose by the cost model for this run (block=auto, strategy=auto)."""
    better_blocks: list[BetterBlock] | None = None
    """Fixed blocks the compiler's choice beats by far; None when not looked for (the driver
    looks only for a printed or written report: it costs a block search)."""
    loops: list[TileLoop] = field(default_factory=list)
    """The schedule level's loops and their tile sizes (the driver fills it from the IR)."""
    contractions: list[ContractionRecord] = field(default_factory=list)
    """The IR's distinct contraction commands and their mappings (the driver fills it)."""
    critical_cycles: dict[int, int] = field(default_factory=dict)
    """Key -> the cycles the command spends on the critical path (scheduler.Schedule's; a
    command on several DMA engines is on it from its part's start, not its slot's)."""
    cluster_peak_sram_bytes: list[int] = field(default_factory=list)
    """Cluster -> the most bytes its SRAM held at once (each at most `machine.cluster_sram_bytes`:
    a buffer lives in the SRAM of one cluster, whose engines read it)."""
    sources: dict[str, list[str]] = field(default_factory=dict)
    """Source file -> its lines, for the text of `lines` (the driver fills it)."""

    @property
    def clock_hz(self) -> float:
        return self.machine.clock_hz

    @property
    def microseconds(self) -> float:
        return self.machine.cycles_to_us(self.total_cycles)

    def op(self, key: int) -> OpRecord:
        """The record of command `key` (a dict lookup: reports of long programs walk the
        critical path by key)."""
        return self._records_by_key[key]

    @cached_property
    def _records_by_key(self) -> dict[int, OpRecord]:
        return {o.key: o for o in self.ops}

    @property
    def phases(self) -> list[PhaseRecord]:
        """Cycles by phase, in the order of dialects.annotations.PHASES (then any other phase names,
        sorted); phases without a costed command are left out."""
        busy: dict[str, int] = {}
        crit: dict[str, int] = {}
        count: dict[str, int] = {}
        for o, on_path in self._costed():
            busy[o.phase] = busy.get(o.phase, 0) + o.engine_cycles
            crit[o.phase] = crit.get(o.phase, 0) + on_path
            count[o.phase] = count.get(o.phase, 0) + 1
        names = [p for p in PHASES if p in busy] + sorted(set(busy) - set(PHASES))
        return [PhaseRecord(p, busy[p], crit[p], count[p]) for p in names]

    def _costed(self) -> Iterator[tuple[OpRecord, int]]:
        """Every command that ran on an engine (not a zero-cost op), with its cycles on the
        critical path (0 off it)."""
        critical = set(self.critical_path)
        for o in self.ops:
            if not (o.cycles == 0 and o.engine == "none"):
                yield o, self.critical_cycles.get(o.key, o.cycles) if o.key in critical else 0

    @property
    def lines(self) -> list[LineRecord]:
        """Cycles, bytes and FLOPs by source line (the module docstring), in file and line
        order, commands without a location last; lines without a costed command are left out."""
        totals: dict[tuple[str, int], list[int]] = {}
        places: dict[tuple[str, ...], list[tuple[str, int]]] = {}
        for o, on_path in self._costed():
            where = places.get(o.locations)
            if where is None:
                where = places[o.locations] = list(dict.fromkeys(file_line(p) for p in o.locations)) or [("", 0)]
            figures = (o.engine_cycles, on_path, o.bytes, o.hbm_bytes, o.flops)
            shares = [_shares(f, len(where)) for f in figures]
            for i, place in enumerate(where):
                row = totals.setdefault(place, [0] * 6)
                row[0] += 1
                for j, share in enumerate(shares):
                    row[j + 1] += share[i]
        order = sorted(totals, key=lambda p: (p == ("", 0), p))
        return [LineRecord(f, n, self._line_text(f, n), *totals[(f, n)]) for f, n in order]

    def _line_text(self, file: str, line: int) -> str | None:
        lines = self.sources.get(file)
        return lines[line - 1].rstrip() if lines is not None and 1 <= line <= len(lines) else None

    def _lines_text(self) -> list[str]:
        """The by-line table: each file's lines from the first to the last with a cost, as an
        annotated listing (a line without cost shows its text alone)."""
        records = self.lines
        if all(r.line == 0 for r in records):
            return ["", "cycles by source line: no op has a source location (IR without loc(...))"]
        out: list[str] = []
        for file in dict.fromkeys(r.file for r in records):
            mine = {r.line: r for r in records if r.file == file}
            out += ["", f"{'line':>5} {'commands':>8} {'busy':>12} {'critical path':>14} {'share':>7} "
                        f"{'bytes':>12} {'FLOPs':>14}  {file or '(no source location)'}"]
            numbers = range(min(mine), max(mine) + 1) if file in self.sources else sorted(mine)
            for n in numbers:
                text = self._line_text(file, n) or ""
                r = mine.get(n)
                if r is None:
                    out.append(f"{n:>5} {'':>8} {'':>12} {'':>14} {'':>7} {'':>12} {'':>14}  {text}".rstrip())
                    continue
                share = r.critical_cycles / self.total_cycles if self.total_cycles else 0.0
                shown = f"{n:>5}" if n else f"{'-':>5}"
                out.append(f"{shown} {r.commands:>8,} {r.busy_cycles:>12,} {r.critical_cycles:>14,} {share:>7.1%} "
                           f"{r.bytes:>12,} {r.flops:>14,}  {text}".rstrip())
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; field names are the contract with tools reading --report-json."""
        r = self.roofline
        return {
            "machine": self.machine.name,
            "machine_file": self.machine.path,
            "machine_assumptions": self.machine.assumptions(),
            "clock_hz": self.clock_hz,
            "total_cycles": self.total_cycles,
            "microseconds": self.microseconds,
            "roofline_cycles": r.cycles,
            "roofline": {"flops": r.flops, "hbm_bytes": r.hbm_bytes, "flop_cycles": r.flop_cycles,
                         "byte_cycles": r.byte_cycles, "bound": r.bound,
                         "padding": None if r.padding is None else {
                             "flops": r.padding.flops, "hbm_bytes": r.padding.hbm_bytes,
                             "contraction_flops": r.padding.contraction_flops, "share": r.padding.share}},
            "peak_sram_bytes": self.peak_sram_bytes,
            "cluster_peak_sram_bytes": self.cluster_peak_sram_bytes,
            "sram_capacity_bytes": self.sram_capacity,
            "sram_policy": self.sram_policy,
            "spills": [asdict(s) for s in self.spills],
            "streams": [asdict(s) for s in self.streams],
            "choices": [c.to_json() for c in self.choices],
            **({} if self.better_blocks is None else {"better_blocks": [b.to_json() for b in self.better_blocks]}),
            "loops": [asdict(t) for t in self.loops],
            "contractions": [asdict(c) for c in self.contractions],
            "critical_path": self.critical_path,
            "engines": [asdict(e) for e in self.engines],
            "phases": [asdict(p) for p in self.phases],
            "lines": [asdict(line) for line in self.lines],
            "ops": [dict(zip(_OP_FIELDS, _op_values(o))) for o in self.ops],  # asdict's, without its deep copy
        }

    def _cluster_peaks(self) -> str:
        """`, by cluster 96.0 MB, 64.0 MB of 128 MB each` on a chip of several clusters."""
        if len(self.cluster_peak_sram_bytes) < 2:
            return ""
        peaks = ", ".join(_size(p) for p in self.cluster_peak_sram_bytes)
        return f", by cluster {peaks} of {_size(self.machine.cluster_sram_bytes)} each"

    def to_text(self, max_ops: int | None = None, tables: Collection[str] = REPORT_TABLES) -> str:
        """The report as text: the summary, then the `tables` of REPORT_TABLES asked for;
        `max_ops` bounds the op table (the first ones) and the critical path (its first and last
        ones), None for all, 0 for neither (a count of the ops instead)."""
        m, r = self.machine, self.roofline
        lines = [
            f"machine {m.name}: {m.clock_hz / 1e9:g} GHz, {m.clusters} x {m.slices} slices, SRAM {_size(self.sram_capacity)}",
            f"total {self.total_cycles:,} cycles = {self.microseconds:.3f} us",
            f"roofline {r.cycles:,.0f} cycles ({r.bound}: {r.flops:,} {'FLOPs' if r.padding is None else 'useful FLOPs'} "
            f"/ {m.chip_peak_flops_per_cycle:,} per cycle, {r.hbm_bytes:,} HBM bytes / {m.hbm_bytes_per_cycle:,.0f} per cycle)",
            _padding_line(r.padding),
            f"peak SRAM {_size(self.peak_sram_bytes)} of {_size(self.sram_capacity)}{self._cluster_peaks()} "
            f"(policy {self.sram_policy}; {len(self.spills)} spill(s), {len(self.streams)} stream(s))",
        ]
        lines += [f"  spilled {s.buffer} ({s.bytes:,} B) to make room for {s.evicted_at}" for s in self.spills]
        how = {"out": "out to HBM by", "in": "in from HBM by", "fused": "by its DMA command into its readers' tiles:",
               "read": "in from HBM for", "cluster": "from another cluster's SRAM for",
               "store": "into another cluster's SRAM by"}
        why = {"read": "which reads SRAM only (a value in HBM)", "cluster": "which reads its own cluster's SRAM only",
               "store": "whose engine writes its own cluster's SRAM only"}
        lines += [f"  streamed {s.buffer} ({s.bytes:,} B) {how[s.direction]} {s.op}, {why.get(s.direction, 'too large for SRAM')}"
                  for s in self.streams]
        lines += [f"chose {c.describe()}" for c in self.choices]
        lines += [f"better block: {b.describe()}" for b in self.better_blocks or ()]
        lines += [f"schedule: {t.describe()}" for t in self.loops]
        lines += [f"contraction: {c.describe()}" for c in self.contractions]
        lines += [
            "",
            f"{'engine':<8} {'units':>5} {'busy':>12} {'util':>7}",
        ]
        for e in self.engines:
            if e.units is None:  # zero-cost ops: nothing to show
                continue
            units = "-" if e.units is None else str(e.units)
            lines.append(f"{e.name:<8} {units:>5} {e.busy_cycles:>12,} {e.utilisation:>6.1%}")
        if "phase" in tables:
            lines += ["", f"{'phase':<9} {'commands':>8} {'busy':>12} {'critical path':>14} {'share':>7}"]
            for p in self.phases:
                share = p.critical_cycles / self.total_cycles if self.total_cycles else 0.0
                lines.append(f"{p.name:<9} {p.commands:>8,} {p.busy_cycles:>12,} {p.critical_cycles:>14,} {share:>6.1%}")
        if "line" in tables:
            lines += self._lines_text()
        if "op" not in tables:
            return "\n".join(lines) + "\n"
        if max_ops == 0:
            lines += ["", f"{len(self.ops):,} ops, {len(self.critical_path):,} on the critical path "
                          "(listed by --report-ops N or all, and in --report-json)"]
            return "\n".join(lines) + "\n"
        lines += ["", f"{'#':>4} {'op':<36} {'engine':<7} {'start':>10} {'end':>10} {'cycles':>9} "
                      f"{'bytes':>11} {'FLOPs':>13}  {'phase':<8}  bound"]
        critical = set(self.critical_path)
        shown = self.ops if max_ops is None else self.ops[:max_ops]
        for o in shown:
            engine = o.engine_label
            mark = "*" if o.key in critical else " "
            lines.append(f"{o.key:>4}{mark}{_cut(o.label, 36):<36} {engine:<7} {o.start:>10,} {o.end:>10,} "
                         f"{o.cycles:>9,} {o.bytes:>11,} {o.flops:>13,}  {o.phase:<8}  {o.bound}")
        if len(shown) < len(self.ops):
            lines.append(f"     ... {len(self.ops) - len(shown):,} more (every op: --report-ops all, or --report-json)")
        path = [f"#{k}" for k in self.critical_path]
        if max_ops is not None and len(path) > 2 * max_ops:  # a loop's path runs through every trip
            path = [*path[:max_ops], f"... {len(path) - 2 * max_ops:,} more ...", *path[-max_ops:]]
        lines += ["", f"critical path (*, {len(self.critical_path):,} ops): " + " -> ".join(path)]
        return "\n".join(lines) + "\n"

    def chrome_trace(self, extra_args: Mapping[int, Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """Chrome trace JSON (Perfetto opens it): this run as one process, `trace_events`."""
        return {"traceEvents": self.trace_events(1, f"tcpc on {self.machine.name}", extra_args), "displayTimeUnit": "ns",
                "otherData": {"total_cycles": self.total_cycles, "clock_hz": self.clock_hz}}

    def trace_events(self, pid: int, process: str,
                     extra_args: Mapping[int, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The run's trace events as process `pid` named `process`: a named track (thread) per
        unit of every engine that has units, in the engines' order (`track_name`), and a complete
        event per command and unit it occupies, at the time its part ran there; zero-cost ops
        run on no engine and are left out. A command's arguments say where it came from: its
        op's source location (`location`, `file:line:col`), the line as written (`source`) and
        the passes that made the op (`created_by`, first to last). `extra_args` adds to the
        arguments of the command of a key (the op's IR, `ir`; a mesh chip's link figures).
        A flow (an arrow) runs from each DMA command to each tensor-unit command (a contraction,
        a vector-engine op) that waits for its result (`flow_events`)."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": process}},
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}},
        ]
        tids: dict[tuple[str, int], int] = {}
        for e in self.engines:
            for unit in range(e.units or 0):
                tid = tids[(e.name, unit)] = len(tids) + 1
                events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                               "args": {"name": track_name(e.name, unit, e.units or 0)}})
                events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                               "args": {"sort_index": tid}})
        extra_args = extra_args or {}
        spans: dict[int, tuple[int, float]] = {}
        """Key -> (track, ts) of the command's first part: where a flow starts or ends."""
        for o in self.ops:
            origin = self._origin(o)
            starts = o.part_starts or (o.start,) * len(o.units)
            ends = o.part_ends or tuple(s + o.cycles for s in starts)
            # A command on several units shows on each, with its part's share of the bytes and
            # FLOPs (parts move equal shares): summed over a trace's slices they are the report's.
            moved = zip(*(_shares(f, len(o.units)) for f in (o.bytes, o.hbm_bytes, o.flops)))
            for i, (unit, start, end, (nbytes, hbm, flops)) in enumerate(zip(o.units, starts, ends, moved)):
                tid = tids.get((o.engine, unit))
                if tid is None:  # zero-cost ops run on no engine
                    continue
                name = o.label if len(o.units) == 1 else f"{o.label} ({i + 1}/{len(o.units)})"
                ts, dur = self._trace_span(start, end - start)
                spans.setdefault(o.key, (tid, ts))
                events.append({
                    "ph": "X", "pid": pid, "tid": tid, "name": name, "cat": o.engine, "ts": ts, "dur": dur,
                    "args": {"key": o.key, "cycles": o.cycles, "start_cycle": start, "bytes": nbytes,
                             "hbm_bytes": hbm, "flops": flops, "bound": o.bound, "phase": o.phase,
                             "units": len(o.units), **origin, **extra_args.get(o.key, {})},
                })
        return events + self.flow_events(pid, spans)

    def _origin(self, o: OpRecord) -> dict[str, str]:
        """A trace event's arguments that say where its command came from (`trace_events`)."""
        if not o.locations:
            return {}
        texts = [t.strip() for t in dict.fromkeys(self._line_text(*file_line(p)) for p in o.locations) if t]
        return {"location": ", ".join(o.locations), **({"source": " | ".join(texts)} if texts else {}),
                "created_by": ", ".join(o.created_by)}

    def flow_events(self, pid: int, spans: Mapping[int, tuple[int, float]]) -> list[dict[str, Any]]:
        """Chrome flow events, a start (`s`) on each DMA command's slice and a finish (`f`,
        bound to the enclosing slice) on each tensor-unit command's that waits for it; `spans`
        gives each command's track and start."""
        events: list[dict[str, Any]] = []
        for o in self.ops:
            if o.engine != TENSOR or o.key not in spans:
                continue
            for dep in o.deps:
                if dep not in spans or self.op(dep).engine != DMA:
                    continue
                flow = (pid << 32) + len(events) // 2 + 1  # unique across a mesh's chips
                (source_tid, source_ts), (tid, ts) = spans[dep], spans[o.key]
                events.append({"ph": "s", "pid": pid, "tid": source_tid, "ts": source_ts, "id": flow,
                               "name": "waits for", "cat": "dma"})
                events.append({"ph": "f", "bp": "e", "pid": pid, "tid": tid, "ts": ts, "id": flow,
                               "name": "waits for", "cat": "dma"})
        return events

    def _trace_span(self, start: int, cycles: int) -> tuple[float, float]:
        """(ts, dur) in microseconds, the Chrome format's unit, each a whole number of
        nanoseconds: Perfetto rounds both to the nanosecond, and a slice that then overlapped
        the next one on its track (end rounded up, next start down) would be dropped."""
        begin, end = (round(self.machine.cycles_to_us(c) * 1000) for c in (start, start + cycles))
        return begin / 1000, (end - begin) / 1000


def track_name(engine: str, unit: int, units: int) -> str:
    """A trace track's name: `tensor unit 1` (cluster 1's), `dma 3`; an engine of one unit
    other than the tensor unit (a mesh chip's link) is its name alone."""
    if engine == TENSOR:
        return f"tensor unit {unit}"
    return engine if units == 1 else f"{engine} {unit}"


def file_line(place: str) -> tuple[str, int]:
    """`file:line:col` -> (file, line)."""
    file, line, _ = place.rsplit(":", 2)
    return file, int(line)


def _shares(total: int, parts: int) -> list[int]:
    """`total` in `parts` whole shares as equal as can be, the larger first; they sum to it."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def _padding_line(padding: Padding | None) -> str:
    if padding is None:
        return "padding: not known (no graph-level program: the roofline counts every FLOP the commands did)"
    return (f"padding: {padding.flops:,} FLOPs ({padding.share:.1%} of the contraction work), "
            f"{padding.hbm_bytes:,} HBM bytes; not in the roofline")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"
