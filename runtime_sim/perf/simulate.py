"""The cycle-approximate simulator: run lowered IR, cost every op, plan memory, schedule.

`simulate` runs a function with the same interpreter and numpy semantics as every other
level (so outputs are the real outputs), costs each op as it runs (op_trace), places buffers
and handles SRAM overflow (memory_plan), overlaps the engines (scheduler) and returns the
outputs with a report (report). `simulate_trace` does the last three for a trace from
elsewhere; cost_only.py's `simulate_cost_only` records one without values.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import DictionaryAttr, IntegerAttr, ModuleOp, StringAttr
from xdsl.interpreter import Interpreter
from xdsl.ir import Operation
from xdsl.traits import SymbolTable

from dialects.locations import created_by, op_places
from runtime_sim.perf import cost_model
from runtime_sim.perf.cost_model import DMA, TENSOR, CostModelError, engine_units, require_lowered
from runtime_sim.perf.costs import register_cost_models
from runtime_sim.perf.graph_work import GraphWork, useful_work
from target.machine import Machine, default_machine
from runtime_sim.perf.memory_plan import DEFAULT_SRAM_POLICY, MemoryPlan, SramPolicy, plan_memory, scheduled_peak
from runtime_sim.perf.op_trace import Trace, TraceRecorder
from runtime_sim.perf.report import EngineRecord, OpRecord, Roofline, SimReport, roofline
from runtime_sim.perf.scheduler import Schedule, schedule
from runtime_sim.perf.tcp_cost import hbm_sharing
from runtime_sim.semantics.collector import without_gc_pauses
from runtime_sim.semantics.executor import function_named, run_function

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["annotate_plan", "plan_and_schedule", "simulate", "simulate_trace", "trace_report", "uncosted_ops"]

UncostedPolicy = Literal["error", "free"]


@dataclass
class SimResult:
    outputs: tuple[Any, ...]
    report: SimReport
    schedule: Schedule
    cost_only: bool = False
    """True for a cost-only run (cost_only.py): no values were computed and `outputs` is empty."""
    routing: dict[str, Any] = field(default_factory=dict)
    """Routing argument name -> the routing_scenarios.Routing a cost-only run used."""
    trace: Trace | None = None
    """The executed commands, each with the IR op that ran."""

    @property
    def graph(self) -> nx.DiGraph:
        """The scheduled dependency graph: node attributes label, engine, cycles, unit, start,
        end; edge attribute kind (data, memory, engine). Built when first asked for."""
        return self.schedule.graph


def reachable_functions(module: ModuleOp, entry: func.FuncOp) -> list[func.FuncOp]:
    """`entry` and every function it calls, directly or not."""
    seen: dict[str, func.FuncOp] = {entry.sym_name.data: entry}
    todo = [entry]
    while todo:
        for op in todo.pop().walk():
            if isinstance(op, func.CallOp):
                callee = SymbolTable.lookup_symbol(module, op.callee)
                if isinstance(callee, func.FuncOp) and callee.sym_name.data not in seen:
                    seen[callee.sym_name.data] = callee
                    todo.append(callee)
    return list(seen.values())


def uncosted_ops(ops: Iterable[Operation]) -> Counter[str]:
    """Names (with counts) of the ops under `ops` that no registered cost model covers."""
    register_cost_models()
    return cost_model.uncosted_ops(ops)


def trace_recorder(module: ModuleOp, function: str, machine: Machine,
                   uncosted: UncostedPolicy) -> TraceRecorder:
    """The listener that costs `function` as it runs, after checking (`uncosted="error"`) that
    every op it can reach has a cost."""
    register_cost_models()
    entry = function_named(module, function)
    if uncosted == "error":
        require_lowered(reachable_functions(module, entry))
    elif uncosted != "free":
        raise ValueError(f"uncosted must be 'error' or 'free', got {uncosted!r}")
    return TraceRecorder(machine, entry, strict=uncosted == "error")


def simulate(module: ModuleOp, function: str, args: Sequence[np.ndarray], machine: Machine | None = None,
             *, sram_policy: SramPolicy = DEFAULT_SRAM_POLICY, uncosted: UncostedPolicy = "error",
             listeners: Sequence[Interpreter.Listener] = (), work: GraphWork | None = None) -> SimResult:
    """Run `function` on `args` and simulate it on `machine` (default RNGD).

    `uncosted="error"` (default) refuses IR with ops that have no cost model (graph-level ops)
    before running, naming them all (NotLoweredError); `"free"` runs it anyway and reports
    those ops as zero-cost, "not costed: lower it first". `sram_policy` is `spill` (default)
    or `error`; see memory_plan. `listeners` see every op as it runs (progress displays).
    `work` is the graph-level program's (graph_work.py), for the roofline's useful FLOPs.
    """
    machine = machine or default_machine()
    recorder = trace_recorder(module, function, machine, uncosted)
    with without_gc_pauses():
        outputs = run_function(module, function, args, listeners=[recorder, *listeners])
        report, sched = simulate_trace(recorder.trace, machine, sram_policy, work=work)
    return SimResult(outputs, report, sched, trace=recorder.trace)


def pinned_units(trace: Trace) -> dict[int, int]:
    """Each tensor-unit command's unit: its op's cluster (`tcpc.cluster`)."""
    return {t.index: t.cluster for t in trace.ops if t.cost.engine == TENSOR}


def own_dma_units(trace: Trace, machine: Machine) -> dict[int, tuple[int, ...]]:
    """The DMA engines each command marked `tcpc.own_dma` may take: its cluster's own, the
    engines u with u * clusters // engines == its cluster (the book: the eight engines sit one
    per pair of DMNs, eight DMNs per cluster, so four per cluster on RNGD)."""
    groups: dict[int, tuple[int, ...]] = {}
    n, clusters = machine.dma_engines, machine.clusters
    for t in trace.ops:
        if t.own_dma and t.cost.engine == DMA and n >= clusters > 1:
            groups[t.index] = tuple(u for u in range(n) if u * clusters // n == t.cluster % clusters)
    return groups


def simulate_trace(trace: Trace, machine: Machine, sram_policy: SramPolicy = DEFAULT_SRAM_POLICY,
                   extra_units: Mapping[str, int] | None = None,
                   plan: MemoryPlan | None = None, work: GraphWork | None = None) -> tuple[SimReport, Schedule]:
    """Plan, schedule and report a recorded trace; `extra_units` adds engines the machine does
    not have (a mesh chip's link); `plan`, the trace's memory plan if the caller has it (the
    mesh's, made once per chip: its tasks must carry the trace's cycles); `work`, the
    graph-level program's (the roofline then counts useful FLOPs, see `layer_roofline`).
    Returns the report and the schedule (its `graph` is the dependency graph)."""
    plan, sched = plan_and_schedule(trace, machine, sram_policy, extra_units, plan)
    return trace_report(trace, machine, sram_policy, plan, sched, work), sched


def trace_report(trace: Trace, machine: Machine, sram_policy: SramPolicy, plan: MemoryPlan, sched: Schedule,
                 work: GraphWork | None = None) -> SimReport:
    """The report of a trace planned and scheduled (`plan_and_schedule`), as `simulate_trace`
    gives it."""
    units = sched.units
    records: list[OpRecord] = []
    sources: dict[Operation | None, tuple[tuple[str, ...], tuple[str, ...]]] = {None: ((), ())}
    for task in plan.tasks:
        if task.key in plan.extra:
            extra = plan.extra[task.key]
            name, cost, phase = extra.name, extra.cost, extra.phase
            op = trace.ops[extra.serves].op
        else:
            traced = trace.ops[task.key]
            name, cost, phase, op = traced.name, plan.cost(trace, task.key), traced.phase, traced.op
        if op not in sources:  # once per op: a loop's ops run many times
            sources[op] = (op_places(op), created_by(op))  # type: ignore[arg-type]
        places, made_by = sources[op]
        slot = sched.slots[task.key]
        bound = "hbm" if slot.shared else cost.bound  # the commands in flight left it too little HBM
        records.append(OpRecord(task.key, task.label, name, cost.engine, slot.unit, slot.start, slot.end,
                                slot.end - slot.start, cost.bytes_moved, cost.hbm_bytes, cost.flops, bound, phase, slot.units,
                                slot.part_starts, slot.part_ends, places, made_by, task.deps))
    engines = [EngineRecord(e, n, sched.busy.get(e, 0), sched.utilisation(e)) for e, n in units.items()]
    bound = checked_roofline(machine, trace, work, sched.makespan)
    peak, cluster_peaks = scheduled_peak(plan, sched.slots, machine.clusters)
    return SimReport(machine, sched.makespan, bound, records, engines, sched.critical_path,
                     peak, plan.sram_capacity, sram_policy, plan.spills, plan.streams,
                     critical_cycles=sched.critical_cycles, cluster_peak_sram_bytes=cluster_peaks)



def plan_and_schedule(trace: Trace, machine: Machine, sram_policy: SramPolicy = DEFAULT_SRAM_POLICY,
                      extra_units: Mapping[str, int] | None = None,
                      plan: MemoryPlan | None = None) -> tuple[MemoryPlan, Schedule]:
    """The memory plan (`plan` if given) and the schedule of a recorded trace, as
    `simulate_trace` makes them, without the report: the total cycles are the schedule's
    makespan. `extra_units` adds engines the machine does not have."""
    plan = plan or plan_memory(trace, machine, sram_policy)
    units = {**engine_units(machine), **(extra_units or {})}
    sched = schedule(plan.tasks, units, pinned_units(trace), own_dma_units(trace, machine), hbm_sharing(machine))
    return plan, sched


def checked_roofline(machine: Machine, trace: Trace, work: GraphWork | None, cycles: int) -> Roofline:
    """The layer's roofline (`layer_roofline`), which `cycles` simulated must not be below."""
    bound = layer_roofline(machine, trace, work)
    if cycles < bound.cycles:  # check_cost makes this impossible; never report it
        raise CostModelError(f"simulated {cycles} cycles is below the roofline {bound.cycles:.1f}")
    return bound


def layer_roofline(machine: Machine, trace: Trace, work: GraphWork | None) -> Roofline:
    """The layer's roofline. Its HBM traffic is its commands' as traced, without the plan's
    spills, reloads and streams (the cost of SRAM pressure, which the ratio to the roofline
    then shows). With the graph's `work`, the FLOPs are the useful ones and the padding rows'
    FLOPs and bytes are left out and reported (graph_work.py); without, every FLOP the
    commands did."""
    hbm_bytes = sum(t.cost.hbm_bytes for t in trace.ops)
    if work is None:
        return roofline(machine, sum(t.cost.flops for t in trace.ops), hbm_bytes, sum(t.cost.fp8_flops for t in trace.ops))
    useful = useful_work(work, trace.ops, trace.routings)
    return roofline(machine, useful.flops, hbm_bytes - useful.padding.hbm_bytes, useful.fp8_flops, useful.padding)


PLAN_ATTR = "tcpc.plan"


def annotate_plan(result: SimResult) -> None:
    """Write each executed op's scheduled slot into the IR it ran from, as the discardable
    attribute `tcpc.plan = {engine = "dma", unit = 2, start = 0, end = 628, bound = "dma"}`
    (the planned IR of `tcpc compile --emit planned`). Commands the memory plan added (spills,
    reloads, streams) have no op of their own; an op the plan streamed says so in `bound`."""
    assert result.trace is not None, "simulate and simulate_cost_only keep the trace"
    for record in result.report.ops:
        if record.key >= len(result.trace.ops) or (op := result.trace.ops[record.key].op) is None:
            continue
        plan = {
            "engine": StringAttr(record.engine),
            "unit": IntegerAttr(record.unit, 64),
            "start": IntegerAttr(record.start, 64),
            "end": IntegerAttr(record.end, 64),
            "bound": StringAttr(record.bound),
        }
        if len(record.units) > 1:  # spread over several DMA engines: how many (from `unit` on)
            plan["units"] = IntegerAttr(len(record.units), 64)
        op.attributes[PLAN_ATTR] = DictionaryAttr(plan)
