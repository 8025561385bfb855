"""What each pass did: the watchers of a pipeline run behind `--print-ir-after-all`, `--dump-ir`,
`--time-passes`, `--pass-stats` and the IR section of `tcpc run --html` (docs/command-line.md).
Each is a callback on the one per-pass hook, `apply_pipeline`'s `after_each`
(tcpc.pipelines.PassStep), so they see the pipeline the user gets, after the driver resolved
every `auto` option, never its candidate compiles."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from xdsl.dialects.builtin import ModuleOp

from dialects import ccl

from tcpc.pipelines import COST_ONLY_PASSES, PassStep, apply_pipeline, make_context, parse_pipeline
from tcpc.program import function_in, print_ir

if TYPE_CHECKING:
    from target.machine import Machine


class IRPrinter:
    """`--print-ir-after-all`: the IR at every step, each under an MLIR-style comment line."""

    def __init__(self, generic: bool, locations: bool = False) -> None:
        self.generic = generic
        self.locations = locations
        self.chunks: list[str] = []

    def __call__(self, step: PassStep) -> None:
        after = "parsing" if step.pass_ is None else step.name
        self.chunks.append(f"// -----// IR after {after} //----- //\n{print_ir(step.module, self.generic, self.locations)}")


class IRDump:
    """`--dump-ir DIR`: the IR at every step in a file of its own, `00-input.mlir`, then
    `NN-<pass>.mlir`, printed as `--emit` prints it, so each file parses with `tcpc-opt`;
    `write` writes a file whole or not at all."""

    def __init__(self, directory: Path, generic: bool, write: Callable[[Path, str], None],
                 locations: bool = False) -> None:
        self.directory = directory
        self.generic = generic
        self.write = write
        self.locations = locations

    def __call__(self, step: PassStep) -> None:
        self.write(self.directory / f"{step.index:02d}-{step.name}.mlir",
                   print_ir(step.module, self.generic, self.locations))


@dataclass(frozen=True)
class IRStep:
    """One step of `IRHistory`: the IR after it as `--emit` prints it, or None when the pass
    left the IR as it was (`same_ir`: the previous step's text stands)."""

    index: int
    name: str
    text: str | None
    ops: str
    """Its op counts by dialect (`counted`), or, after a pass that changed the IR, those it
    changed (`delta`)."""

    @property
    def changed(self) -> bool:
        return self.text is not None


class IRHistory:
    """`tcpc run --html`: the IR at every step, and which passes changed it, as `--pass-stats`
    decides it (`same_ir`); an unchanged step keeps no copy of the text."""

    def __init__(self) -> None:
        self.steps: list[IRStep] = []
        self._previous: ModuleOp | None = None
        self._counts: Counter[str] = Counter()

    def __call__(self, step: PassStep) -> None:
        counts = ops_by_dialect(step.module)
        if self._previous is not None and same_ir(step.module, self._previous):
            self.steps.append(IRStep(step.index, step.name, None, ""))
            return
        ops = counted(counts) if step.pass_ is None else delta(self._counts, counts)
        self.steps.append(IRStep(step.index, step.name, print_ir(step.module), ops))
        self._previous, self._counts = step.module.clone(), counts


class PassTimer:
    """`--time-passes`: each pass's wall time, the verifier's after them, in the layout of MLIR's
    `--mlir-timing` report (list display, pipeline order)."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, float]] = []
        self.verifier = 0.0

    def __call__(self, step: PassStep) -> None:
        if step.pass_ is not None:
            self.passes.append((step.name, step.seconds))
            self.verifier += step.verify_seconds

    def report(self) -> str:
        rows = [*self.passes, ("verifier", self.verifier)]
        total = sum(seconds for _, seconds in rows)
        rule = "===" + "-" * 73 + "===\n"
        lines = [rule, "... Pass execution timing report ...".center(79).rstrip() + "\n", rule,
                 f"  Total Execution Time: {total:.4f} seconds\n\n", "  ----Wall Time----  ----Name----\n"]
        for name, seconds in [*rows, ("Total", total)]:
            share = 100 * seconds / total if total > 0 else 0.0
            lines.append(f"  {seconds:9.4f} ({share:5.1f}%)  {name}\n")
        return "".join(lines)


def same_ir(a: ModuleOp, b: ModuleOp) -> bool:
    """The same ops, operands, attributes, properties and types (SSA names aside): xDSL's
    structural equivalence, which leaves result types out, and the result types."""
    return a.is_structurally_equivalent(b) and all(x.result_types == y.result_types for x, y in zip(a.walk(), b.walk()))


def ops_by_dialect(module: ModuleOp) -> Counter[str]:
    """How many ops of each dialect the module holds (the module itself not counted)."""
    return Counter(op.name.split(".", 1)[0] for op in module.walk() if op is not module)


@dataclass
class StatsRow:
    """One step of `--pass-stats`: the op counts after it and, where the simulator could run the
    IR, its cycles (None: it could not, or the step changed nothing)."""

    index: int
    name: str
    changed: bool
    before: Counter[str]
    after: Counter[str]
    cycles: int | None = None


@dataclass
class PassStatistics:
    """`--pass-stats`: for every pass, whether it changed the IR (`same_ir`), the op counts by
    dialect before and after, and the cycles of `graph` after it, cost-only on `machine` for the
    routing scenario `routing`, wherever every op has a cost.

    Cost-only needs the routing pinned before any lowering (pin-routing, runtime_sim/perf/cost_only.py),
    which would change the IR the user gets; so a twin of the input is pinned, and each pass
    replayed on it, as `tcpc run --cost-only` compiles it: after the last pass the cycles are
    that run's."""

    graph: str
    machine: Machine
    routing: str = "balanced"
    seed: int = 0
    rows: list[StatsRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Why the simulator could not run a level whose ops all have a cost."""
    _previous: ModuleOp | None = field(default=None, repr=False)
    """A copy of the previous step's IR, which the pipeline's own is rewritten from in place."""
    _twin: ModuleOp | None = field(default=None, repr=False)

    def __call__(self, step: PassStep) -> None:
        counts = ops_by_dialect(step.module)
        if step.pass_ is None:
            self._twin = apply_pipeline(step.module, parse_pipeline(",".join(COST_ONLY_PASSES)))
            self.rows.append(StatsRow(0, step.name, True, Counter(), counts, self._cycles()))
        else:
            assert self._twin is not None and self._previous is not None, "step 0 comes first"
            step.pass_.apply(make_context(), self._twin)
            changed = not same_ir(step.module, self._previous)
            before = self.rows[-1].after
            self.rows.append(StatsRow(step.index, step.name, changed, before, counts,
                                      self._cycles() if changed else None))
        self._previous = step.module.clone()

    def _cycles(self) -> int | None:
        """The twin's cycles, or None when an op has no cost model (graph-level IR)."""
        from runtime_sim.perf.cost_only import CostOnlyError, simulate_cost_only
        from runtime_sim.perf.simulate import uncosted_ops

        assert self._twin is not None
        if uncosted_ops(self._twin.ops):
            return None
        if ccl.MESH_ATTR in function_in(self._twin, self.graph).attributes:
            self.note(f"@{self.graph} is sharded over a mesh: the cycles of a chip need every chip "
                      "(tcpc run --mesh SPEC --cost-only simulates them)")
            return None
        try:
            result = simulate_cost_only(self._twin, self.graph, self.machine, routing=self.routing, seed=self.seed)
        except CostOnlyError as e:
            self.note(f"no cycles: {e}")
            return None
        return result.report.total_cycles

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def report(self) -> str:
        """The table: one row per step, an unchanged pass in one line, then the output's counts."""
        last = self.rows[-1]
        final = next(r.cycles for r in reversed(self.rows) if r.changed)  # step 0 always is
        table: list[tuple[str, str, str, str, str]] = []
        previous: int | None = None
        for row in self.rows:
            if not row.changed:
                table.append((str(row.index), row.name, "unchanged", "", ""))
                continue
            change = ""
            if row.cycles is not None and previous is not None:
                change = f"{row.cycles - previous:+,}" if row.cycles != previous else "0"
            if row.cycles is not None:
                previous = row.cycles
            ops = counted(row.after) if row.index == 0 else delta(row.before, row.after)
            table.append((str(row.index), row.name, cycles_text(row.cycles), change, ops))
        table.append(("", "output", cycles_text(final), "", counted(last.after)))
        heads = ("#", "pass", "cycles", "change", "ops by dialect")
        widths = [max(len(r[i]) for r in [heads, *table]) for i in range(2)]
        widths += [max(len(r[i]) for r in [heads, *table] if r[2] != "unchanged") for i in (2, 3)]
        unknown = "-: the IR holds ops without a cost model" + (", or as noted below" if self.notes else "")
        lines = ["pass statistics: op counts by dialect before -> after each pass that changed the IR, and the cycles "
                 f"after it\n(@{self.graph}, cost-only on {self.machine.name} for {self.routing} routing; {unknown})\n"]
        for index, name, cycles, change, ops in [heads, *table]:
            if cycles == "unchanged":
                lines.append(f"  {index:>{widths[0]}}  {name:<{widths[1]}}  unchanged\n")
            else:
                lines.append(f"  {index:>{widths[0]}}  {name:<{widths[1]}}  {cycles:>{widths[2]}}  "
                             f"{change:>{widths[3]}}  {ops}".rstrip() + "\n")
        lines += [f"  note: {note}\n" for note in self.notes]
        return "".join(lines)


def cycles_text(cycles: int | None) -> str:
    return "-" if cycles is None else f"{cycles:,}"


def counted(counts: Counter[str]) -> str:
    """`func 2, moe 4, tmath 7`: every dialect, by name."""
    return ", ".join(f"{d} {n}" for d, n in sorted(counts.items()))


def delta(before: Counter[str], after: Counter[str]) -> str:
    """`moe 4 -> 0, ve 0 -> 37`: the dialects whose op count changed."""
    changed = [f"{d} {before[d]} -> {after[d]}" for d in sorted(set(before) | set(after)) if before[d] != after[d]]
    return ", ".join(changed) or "op counts unchanged"


@dataclass
class PassInstruments:
    """The watchers a command asked for, called in turn at every step of its pipeline."""

    printer: IRPrinter | None = None
    dump: IRDump | None = None
    timer: PassTimer | None = None
    stats: PassStatistics | None = None
    history: IRHistory | None = None

    def __call__(self, step: PassStep) -> None:
        for instrument in (self.printer, self.dump, self.timer, self.stats, self.history):
            if instrument is not None:
                instrument(step)

    def report(self) -> str:
        """What goes to stderr after the pipeline: the statistics, then the timing."""
        return "".join(part.report() for part in (self.stats, self.timer) if part is not None)
