"""Simulate an SPMD program (passes/mesh/shard_experts.py) on every chip of a mesh.

Every chip runs the function on its own interpreter and thread (ccl_semantics.run_mesh), with
the single-chip simulator's listener costing its ops (op_trace), so each chip gets its own
trace, memory plan and schedule on its own engines plus its link. Collectives couple the
chips: one starts on every chip of its group when the last of them reaches it and lasts as long
as the busiest link of the group (ccl_cost.py; a chip that skips an all-to-all, knowing it has
nothing to exchange, waits for nobody and nobody for it). The schedules are found collective by
collective: schedule every chip, align collective j's start on its group's latest, fix that
wait, and go on with j + 1 (a collective's start depends only on what comes before it, so each
step is final).

Cost-only mode works as on one chip (cost_only.py): routing arguments get a scenario's expert
choices for all T tokens of the mesh, split by chip as the tokens are; every other argument is
a placeholder; collectives whose operands have values (expert indices and counts) exchange them
at once, the others exchange nothing and yield placeholders.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr, TensorType
from xdsl.interpreter import Interpreter, impl, register_impls
from xdsl.ir import Operation, SSAValue

from dialects import ccl
from dialects.annotations import routing_arguments
from dialects.tensor_types import is_float_type, shape_of
from runtime_sim.perf.ccl_cost import Traffic, least_link_cycles, link_parts, received_bytes, traffic
from runtime_sim.perf.cost_model import LINK, engine_units
from runtime_sim.perf.cost_only import (AboveBar, LoopReplay, Lazy, LowerBoundBar, SharedViews, is_placeholder,
                                         placeholder, shape_only_interpreter)
from runtime_sim.perf.graph_work import GraphWork
from runtime_sim.perf.memory_plan import DEFAULT_SRAM_POLICY, SramPolicy, plan_memory
from target.mesh_machine import MeshMachine
from runtime_sim.perf.op_trace import Trace, TracedOp, TraceRecorder
from runtime_sim.perf.report import Choice, SimReport, TileLoop
from runtime_sim.perf.scheduler import Placer, Task
from runtime_sim.perf.tcp_cost import hbm_sharing
from runtime_sim.perf.routing_scenarios import DEFAULT_SCENARIO, Routing, RoutingError, scenario_choices
from runtime_sim.perf.simulate import own_dma_units, pinned_units, trace_recorder, trace_report
from runtime_sim.semantics.ccl_semantics import (CCLFunctions, ChipInterpreter, MeshExchange, collective_label,
                                                   plain_chip, run_mesh)
from runtime_sim.semantics.executor import function_named

_COLLECTIVE_NAMES = {c.name for c in ccl.COLLECTIVES}


class MeshError(Exception):
    """A mesh that does not fit the program or the mesh machine."""


class AboveBound(Exception):
    """A cost-only mesh run stopped (`simulate_mesh`'s `bound_above`): a chip's commands'
    lower bound (`LowerBoundBar`) passed the bound, so the mesh takes at least `cycles`, the
    bound's next whole cycle. Not the passing chip's own bound: which chip passes first, and
    how far the others got, depends on the threads' timing, and a rerun must list the same."""

    def __init__(self, cycles: int):
        super().__init__(cycles)
        self.cycles = cycles


class MeshBar:
    """Every chip's `LowerBoundBar` against one bound: the mesh takes at least the cycles of its
    slowest chip, which no schedule ends below its commands' bound (their roofline, their
    busiest unit's cycles, their longest path with each collective at least its own link
    time, `least_link_cycles`). The first chip past the bound stops the run; the others stop
    at their next check or collective."""

    def __init__(self, machine: MeshMachine, above: float, traffics: Sequence[TrafficRecorder]):
        self.bars = [_ChipBar(self, machine, above, t) for t in traffics]
        self.passed: float | None = None
        """The chip bound that passed the bound, once one has."""
        self.exchange: MeshExchange | None = None

    def stop(self, cycles: float) -> None:
        """Stop every chip: the ones waiting at a collective are released (ShapeOnlyCCLFunctions)."""
        self.passed = cycles
        if self.exchange is not None:
            self.exchange.abort()


class _ChipBar(LowerBoundBar):
    """One chip's bar in a `MeshBar`, its collectives timed by its `traffic` (in program
    order, as schedule_mesh pairs them with the trace's commands)."""

    def __init__(self, mesh: MeshBar, machine: MeshMachine, above: float, traffic: TrafficRecorder):
        super().__init__(machine.chip, above, paths=True)
        self.mesh, self.mesh_machine, self.traffic = mesh, machine, traffic
        self._collectives = 0

    def link_cycles(self, traced: TracedOp) -> int:
        if traced.name not in _COLLECTIVE_NAMES:
            return super().link_cycles(traced)
        t = self.traffic.traffic[self._collectives]
        self._collectives += 1
        return least_link_cycles(self.mesh_machine, t)

    def check(self, trace: Trace) -> None:
        if self.mesh.passed is not None:
            raise AboveBar(self.mesh.passed)
        try:
            super().check(trace)
        except AboveBar as stop:
            self.mesh.stop(stop.cycles)
            raise


def mesh_of(fn: func.FuncOp) -> ccl.Mesh:
    attr = fn.attributes.get(ccl.MESH_ATTR)
    if not isinstance(attr, StringAttr):
        raise MeshError(f"@{fn.sym_name.data} has no {ccl.MESH_ATTR} attribute: run shard-experts first")
    return ccl.Mesh.parse(attr.data)


class TrafficRecorder(Interpreter.Listener):
    """What one chip sends in each collective, in program order."""

    def __init__(self, mesh: ccl.Mesh, chip: int):
        self.mesh = mesh
        self.chip = chip
        self.traffic: list[Traffic] = []
        self.axes: list[str] = []

    def will_interpret_op(self, op: Operation, args: tuple[Any, ...]) -> None:
        if isinstance(op, ccl.COLLECTIVES):
            group = self.mesh.group(self.chip, op.axis_name)  # type: ignore[attr-defined]
            self.traffic.append(traffic(op, args, len(group), group.index(self.chip)))
            self.axes.append(op.axis_name)  # type: ignore[attr-defined]

    def did_skip_ops(self, count: int) -> None:
        """Ops a cost-only loop copied (cost_only.LoopReplay): never a collective."""


class ShapeOnlyCCLFunctions(CCLFunctions):
    """Cost-only mode's `ccl` ops on one chip: one with a placeholder operand yields
    placeholders; one with values computes them first and runs at once (a lazy collective would
    meet the other chips at a different point). Whether an operand has values can depend on the
    routing (a chip that receives no pair skips its expert loop, and its rows to send back are
    real zeros while another chip's are placeholders), so the chips of the mesh first agree at
    every collective: placeholders on every chip if any chip has one, else the exchange; every
    chip meets the others at every collective, as the program says."""

    bar: MeshBar | None = None
    """The run's bound (`simulate_mesh`'s `bound_above`): a collective that the bar broke off
    stops this chip as its bar would (AboveBar, which the interpreter does not wrap)."""

    def run_now(self, interpreter: Interpreter, op: Operation, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        try:
            return self._run_now(interpreter, op, inputs)
        except threading.BrokenBarrierError:
            if self.bar is not None and self.bar.passed is not None:
                raise AboveBar(self.bar.passed) from None
            raise

    def _run_now(self, interpreter: Interpreter, op: Operation, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        # Rows of floats that cross are never an index, count or guard a cost reads: exchanged
        # as placeholders, even where a chip holds real zeros (a loop whose tiles were all
        # skipped yields its zero-filled buffer: a2a's split pairs, 3.5 GB a chip for
        # DeepSeek-V3 on 8 chips at 4,096 tokens each).
        shapes_only = any(is_placeholder(v) for v in inputs) or all(_float_rows(r) for r in op.results)
        if isinstance(op, ccl.COLLECTIVES) and self.exchange is not None:
            shapes_only = any(self.exchange.collect(self.chip, shapes_only, f"{collective_label(op)} (placeholders?)"))
        if shapes_only:
            sources = frozenset().union(*(getattr(v, "sources", frozenset()) for v in inputs))
            return tuple(placeholder(r.type, sources) for r in op.results)
        values = tuple(v.force() if isinstance(v, Lazy) else v for v in inputs)
        return tuple(getattr(CCLFunctions, _method(op))(self, interpreter, op, values).values)


def _float_rows(value: SSAValue) -> bool:
    return isinstance(value.type, TensorType) and is_float_type(value.type.get_element_type())


def _method(op: Operation | type[Operation]) -> str:
    return f"run_{op.name.split('.')[1]}"


ShapeOnlyCCL = register_impls(type("ShapeOnlyCCL", (ShapeOnlyCCLFunctions,), {
    f"{_method(op)}_shape_only": impl(op)(ShapeOnlyCCLFunctions.run_now) for op in ccl.CCL.operations}))


_CCL_OPS = frozenset(op.name for op in ccl.CCL.operations)


class _ForcedValues(Interpreter.Listener):
    """Shows a chip's listeners the values of a ccl op's operands, computed (lazy ones) or
    placeholders; every other op as the shape-only interpreter shows it (forcing its lazy
    operands too would compute values no cost reads: the loops' buffers, a third of a chip's
    interpretation). One for all of a chip's listeners, on the path of every op: a
    TrafficRecorder, which reads only collectives, sees only ccl ops."""

    def __init__(self, listeners: Sequence[Interpreter.Listener]):
        self.listeners = tuple(listeners)
        self.every_op = tuple(x for x in self.listeners if not isinstance(x, TrafficRecorder))

    def will_interpret_op(self, op: Operation, args: tuple[Any, ...]) -> None:
        if op.name in _CCL_OPS:  # float rows: never read by a cost (ShapeOnlyCCLFunctions._run_now)
            args = tuple((placeholder(x.type) if _float_rows(x) else v.force()) if isinstance(v, Lazy) else v
                         for v, x in zip(args, op.operands))
            for listener in self.listeners:
                listener.will_interpret_op(op, args)
        else:
            for listener in self.every_op:
                listener.will_interpret_op(op, args)

    def did_interpret_op(self, op: Operation, results: tuple[Any, ...]) -> None:
        for listener in self.listeners if op.name in _CCL_OPS else self.every_op:
            listener.did_interpret_op(op, results)


def shape_only_chip(listeners: Callable[[int], Sequence[Interpreter.Listener]],
                    recorders: Sequence[TraceRecorder] = (), bar: MeshBar | None = None) -> ChipInterpreter:
    """Cost-only mode's interpreter of one chip (cost_only.shape_only_interpreter) with its ccl
    ops; with the chips' `recorders` (among each chip's listeners), its loops copy iterations
    where they can (cost_only.LoopReplay), checking the chip's `bar` after each. The chips
    share their ops' placeholders and views (cost_only.SharedViews)."""
    shared = SharedViews()

    def build(module: ModuleOp, exchange: MeshExchange, chip: int) -> Interpreter:
        chip_listeners = listeners(chip)
        replay = None
        if recorders:
            others = [x for x in chip_listeners if x is not recorders[chip]]
            chip_bar = bar.bars[chip] if bar is not None else None
            replay = LoopReplay(recorders[chip], others, chip_bar) if LoopReplay.allowed(others) else None
        interpreter = shape_only_interpreter(module, [_ForcedValues(chip_listeners)], replay, shared)
        functions = ShapeOnlyCCL(exchange, chip)
        functions.bar = bar
        if bar is not None:
            bar.exchange = exchange
        interpreter.register_implementations(functions, override=True)
        return interpreter

    return build


@dataclass(frozen=True)
class LinkRecord:
    """One chip's link in one collective."""

    chip: int
    collective: int
    op: str
    label: str
    sent_bytes: int
    received_bytes: int
    busy_cycles: int
    """The chip's own transfer time: the steps' latency and its bytes over the link."""
    latency_cycles: int
    """The steps' latency within `busy_cycles`."""
    wait_cycles: int
    """Cycles the chip waited for the last chip of its group to reach the collective."""
    start: int
    end: int
    key: int
    """The collective's command in the chip's report (its op record and trace event)."""
    skipped: bool = False
    """The chip had nothing to exchange and knew it (an all-to-all's `expects`, ccl_cost.py)."""

    @property
    def bound(self) -> str:
        """`latency` when the steps' latency is at least the transfer (a small collective, as a
        decode step's), else `bandwidth`; `skipped` when the chip skipped it."""
        if self.skipped:
            return "skipped"
        return "latency" if self.latency_cycles >= self.busy_cycles - self.latency_cycles else "bandwidth"

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "bound": self.bound}


@dataclass
class MeshReport:
    machine: MeshMachine
    mesh: ccl.Mesh
    chips: list[SimReport]
    links: list[LinkRecord]
    routing: dict[str, Routing] = field(default_factory=dict)
    choices: list[Choice] = field(default_factory=list)
    """The cost model's choices for the program every chip runs (the driver fills them)."""
    loops: list[TileLoop] = field(default_factory=list)
    """The schedule level's loops of that program, the same on every chip (the driver fills them)."""

    @property
    def total_cycles(self) -> int:
        return max(r.total_cycles for r in self.chips)

    @property
    def microseconds(self) -> float:
        return self.machine.chip.cycles_to_us(self.total_cycles)

    def link_busy(self, chip: int) -> int:
        return sum(r.busy_cycles for r in self.links if r.chip == chip)

    def link_bytes(self, chip: int) -> tuple[int, int]:
        mine = [r for r in self.links if r.chip == chip]
        return sum(r.sent_bytes for r in mine), sum(r.received_bytes for r in mine)

    def compute_busy(self, chip: int) -> int:
        """The chip's tensor-unit and DMA busy cycles (its own work, without the link)."""
        return sum(e.busy_cycles for e in self.chips[chip].engines if e.name in ("tensor", "dma"))

    def imbalance(self, values: Sequence[float]) -> float:
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean else 1.0

    @property
    def communication_cycles(self) -> int:
        """Cycles of the critical chip spent in collectives (waiting included)."""
        chip = max(range(len(self.chips)), key=lambda c: self.chips[c].total_cycles)
        return sum(r.end - r.start for r in self.links if r.chip == chip)

    def to_text(self) -> str:
        m = self.machine
        lines = [
            f"mesh {self.mesh} on {m.name}: {len(self.chips)} x {m.chip.name}, link {m.link_bytes_per_cycle:g} B/cycle "
            f"per direction, {m.link_latency_cycles:,} cycles per step",
            f"total {self.total_cycles:,} cycles = {self.microseconds:.3f} us (the slowest chip)",
            *(f"chose {c.describe()}" for c in self.choices),
            *(f"schedule (every chip): {t.describe()}" for t in self.loops),
            "",
            f"{'chip':>4} {'cycles':>12} {'tensor+dma busy':>16} {'link busy':>10} {'link wait':>10} "
            f"{'sent B':>12} {'received B':>12}",
        ]
        for c, r in enumerate(self.chips):
            sent, received = self.link_bytes(c)
            wait = sum(x.wait_cycles for x in self.links if x.chip == c)
            lines.append(f"{c:>4} {r.total_cycles:>12,} {self.compute_busy(c):>16,} {self.link_busy(c):>10,} "
                         f"{wait:>10,} {sent:>12,} {received:>12,}")
        busy = [self.compute_busy(c) for c in range(len(self.chips))]
        received = [self.link_bytes(c)[1] for c in range(len(self.chips))]
        lines += ["", f"load imbalance (max / mean): tensor+dma busy {self.imbalance(busy):.2f}, "
                      f"received bytes {self.imbalance(received):.2f}; hottest chip {max(range(len(busy)), key=busy.__getitem__)}",
                  "", f"{'#':>3} {'collective':<36} {'chip':>4} {'start':>10} {'end':>10} {'busy':>9} {'wait':>9} "
                      f"{'sent B':>11} {'received B':>11} bound"]
        for x in self.links:
            lines.append(f"{x.collective:>3} {x.label[:36]:<36} {x.chip:>4} {x.start:>10,} {x.end:>10,} "
                         f"{x.busy_cycles:>9,} {x.wait_cycles:>9,} {x.sent_bytes:>11,} {x.received_bytes:>11,} "
                         f"{x.bound}")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": str(self.mesh),
            "machine": self.machine.name,
            "machine_file": self.machine.path,
            "machine_assumptions": self.machine.assumptions(),
            "total_cycles": self.total_cycles,
            "microseconds": self.microseconds,
            "communication_cycles": self.communication_cycles,
            "choices": [c.to_json() for c in self.choices],
            "links": [x.to_json() for x in self.links],
            "chips": [r.to_json() for r in self.chips],
        }

    def chrome_trace(self) -> dict[str, Any]:
        """One process per chip, `chip c`: its engines' and its link's tracks, as on one chip
        (SimReport.trace_events), a collective's event with its link figures."""
        events: list[dict[str, Any]] = []
        for c, report in enumerate(self.chips):
            links = {x.key: {"busy_cycles": x.busy_cycles, "wait_cycles": x.wait_cycles, "sent_bytes": x.sent_bytes,
                             "received_bytes": x.received_bytes} for x in self.links if x.chip == c}
            events += report.trace_events(c + 1, f"chip {c}", links)
        return {"traceEvents": events, "displayTimeUnit": "ns",
                "otherData": {"total_cycles": self.total_cycles, "clock_hz": self.machine.chip.clock_hz}}


@dataclass
class MeshResult:
    outputs: list[tuple[Any, ...]]
    """Every chip's outputs (empty in cost-only mode)."""
    report: MeshReport


def mesh_routing(fn: func.FuncOp, mesh: ccl.Mesh, routing: str | Path, seed: int) -> dict[int, Routing]:
    """Argument index -> the scenario's expert choices for all T tokens of the mesh (`balanced`
    dealt over the ep chips as well as the experts)."""
    found: dict[int, Routing] = {}
    for index, experts in routing_arguments(fn).items():
        t = fn.function_type.inputs.data[index]
        assert isinstance(t, TensorType)
        tl, k = shape_of(t)
        try:
            choices = scenario_choices(routing, tl * mesh.token_shards, k, experts, seed, chips=mesh.expert_shards)
        except RoutingError as e:
            raise RoutingError(f"{e} (the mesh's T = {tl * mesh.token_shards} tokens in token order, split over "
                               f"its {mesh.token_shards} token shards as the tokens are: {tl} each)") from None
        found[index] = Routing(str(routing), experts, choices)
    return found


def pairs_received(routing: Routing, mesh: ccl.Mesh) -> list[int]:
    """The (token, expert) pairs of `routing` each chip of `mesh` receives: its dp group's
    tokens' pairs on its E/(ep * sp) experts (the tp chips of a group receive the same)."""
    t, _ = routing.choices.shape
    per_group = t // mesh.size("dp")
    owner = routing.choices // (routing.experts // mesh.expert_shards)
    counts = []
    for c in range(mesh.chips):
        coords = mesh.coordinates(c)
        group = owner[coords.get("dp", 0) * per_group:(coords.get("dp", 0) + 1) * per_group]
        counts.append(int((group == mesh.expert_shard(c)).sum()))
    return counts


def simulate_mesh(module: ModuleOp, function: str, machine: MeshMachine,
                  args: Sequence[Sequence[Any]] | None = None, *, cost_only: bool = False,
                  routing: str | Path = DEFAULT_SCENARIO, seed: int = 0,
                  sram_policy: SramPolicy = DEFAULT_SRAM_POLICY,
                  listeners: Sequence[Interpreter.Listener] = (), work: GraphWork | None = None,
                  bound_above: float = math.inf) -> MeshResult:
    """Run and simulate the SPMD `function` on every chip (chip c on `args[c]`), or cost it
    without values (`cost_only`, routing from the scenario); `listeners` see every chip's ops
    (from every chip's thread), as a progress line does. `work` is the sharded graph-level
    program's (graph_work.py): each chip's roofline counts its useful FLOPs.

    A choice needs no more of a cost-only candidate than that it takes more cycles than the
    best so far, `bound_above`: once a chip's commands' lower bound is above it (`MeshBar`, checked
    after every loop iteration and at the end), the run stops, neither planned nor scheduled,
    with AboveBound."""
    fn = function_named(module, function)
    mesh = mesh_of(fn)
    if machine.chips is not None and machine.chips != mesh.chips:
        raise MeshError(f"the mesh {mesh} has {mesh.chips} chips, the mesh machine {machine.name} "
                        f"has {machine.chips} (shape {' x '.join(map(str, machine.shape or ()))})")
    chip_machine = machine.chip
    first = trace_recorder(module, function, chip_machine, "error")
    recorders = [first, *(first.sibling() for _ in range(mesh.chips - 1))]
    traffics = [TrafficRecorder(mesh, c) for c in range(mesh.chips)]
    chosen: dict[int, Routing] = {}
    bar: MeshBar | None = None
    if cost_only:
        chosen = mesh_routing(fn, mesh, routing, seed)
        names = [a.name_hint or f"arg{i}" for i, a in enumerate(fn.body.blocks.first.args)]  # type: ignore[union-attr]
        per_chip = []
        for c in range(mesh.chips):
            row = []
            for i, t in enumerate(fn.function_type.inputs.data):
                if i in chosen:
                    tl, shard = shape_of(t)[0], mesh.token_shard(c)
                    row.append(chosen[i].choices[shard * tl:(shard + 1) * tl])
                else:
                    row.append(placeholder(t, frozenset([names[i]])))
            per_chip.append(row)
        bar = MeshBar(machine, bound_above, traffics) if bound_above < math.inf else None
        try:
            run_mesh(module, function, mesh, per_chip,
                     shape_only_chip(lambda c: (recorders[c], traffics[c], *listeners), recorders, bar))
            if bar is not None:
                for c, recorder in enumerate(recorders):
                    bar.bars[c].check(recorder.trace)
        except AboveBar:
            raise AboveBound(math.floor(bound_above) + 1) from None
        outputs: list[tuple[Any, ...]] = []
    else:
        if args is None or len(args) != mesh.chips:
            raise MeshError(f"the mesh {mesh} needs arguments for {mesh.chips} chips")
        outputs = run_mesh(module, function, mesh, args, plain_chip(lambda c: (recorders[c], traffics[c], *listeners)))
    report = schedule_mesh(machine, mesh, [r.trace for r in recorders], traffics, sram_policy, work)
    if bar is not None:
        assert all(r.total_cycles >= b.least(t.trace) for r, b, t in zip(report.chips, bar.bars, recorders)), \
            "a chip's schedule below its bar's lower bound"
    names = [a.name_hint or f"arg{i}" for i, a in enumerate(fn.body.blocks.first.args)]  # type: ignore[union-attr]
    report.routing = {names[i]: r for i, r in chosen.items()}
    return MeshResult(outputs, report)


def same_trace(a: Trace, b: Trace) -> bool:
    """Whether two chips' traces plan, schedule and report alike: the same commands of the same
    IR ops, buffers and outputs, and routings of the same per-expert loads (all the roofline
    reads of them, graph_work.routed_pairs), whatever their expert ids."""
    return (a.ops == b.ops and all(x.op is y.op for x, y in zip(a.ops, b.ops)) and a.buffer_bytes == b.buffer_bytes
            and a.buffer_labels == b.buffer_labels and a.outputs == b.outputs and _loads(a) == _loads(b))


def _loads(trace: Trace) -> list[tuple[int, int, tuple[int, ...]]]:
    """Each routing's experts, pairs and per-expert pair counts, largest first."""
    loads = []
    for r in trace.routings:
        choices = np.asarray(r.choices).reshape(-1)
        counts = np.bincount(choices[(choices >= 0) & (choices < r.experts)], minlength=r.experts)
        loads.append((r.experts, choices.size, tuple(sorted(counts.tolist(), reverse=True))))
    return loads


def trace_classes(traces: Sequence[Trace]) -> list[int]:
    """For each chip, the first chip whose trace is the same (`same_trace`)."""
    firsts: list[int] = []
    classes = []
    for c, trace in enumerate(traces):
        same = next((f for f in firsts if same_trace(traces[f], trace)), None)
        if same is None:
            firsts.append(c)
            same = c
        classes.append(same)
    return classes


def schedule_mesh(machine: MeshMachine, mesh: ccl.Mesh, traces: list[Trace], traffics: list[TrafficRecorder],
                  sram_policy: SramPolicy, work: GraphWork | None = None) -> MeshReport:
    """Every chip's report, with the collectives aligned across each group (module docstring)."""
    n = mesh.chips
    keys = [[o.index for o in t.ops if o.name in _COLLECTIVE_NAMES] for t in traces]
    count = len(keys[0])
    if any(len(k) != count or len(t.traffic) != count for k, t in zip(keys, traffics)):
        raise MeshError("the chips ran different numbers of collectives")
    busy = [[0] * count for _ in range(n)]
    latency = [[0] * count for _ in range(n)]
    duration = [[0] * count for _ in range(n)]
    groups: list[list[list[int]]] = []
    for j in range(count):
        axis = traffics[0].axes[j]
        seen: list[list[int]] = []
        for c in range(n):
            group = mesh.group(c, axis)
            if group not in seen:
                seen.append(group)
                flows = [traffics[g].traffic[j] for g in group]
                parts = [link_parts(machine, flows, i) for i in range(len(group))]
                own = [sum(p) for p in parts]
                taking = [o for o, f in zip(own, flows) if not f.skips]  # a chip that skips waits for nobody
                for i, g in enumerate(group):
                    busy[g][j], latency[g][j] = own[i], parts[i][0]
                    duration[g][j] = own[i] if flows[i].skips else max(taking)
        groups.append(seen)
    wait = [[0] * count for _ in range(n)]

    def timed(c: int) -> Trace:
        ops = list(traces[c].ops)
        for j, key in enumerate(keys[c]):
            ops[key] = dataclasses.replace(ops[key], cost=dataclasses.replace(ops[key].cost, cycles=wait[c][j] + duration[c][j]))
        return dataclasses.replace(traces[c], ops=ops)

    # The memory plan follows program order, not time (no decision of it reads a command's
    # cycles; a collective is a link command, whose cost the plan never changes): plan each
    # chip once, place its tasks with the collectives' cycles as they are fixed (below), and
    # report from the same plan and schedule (tests/test_mesh.py: the same reports as planning
    # and scheduling again).
    # Chips of one trace (`same_trace`) with the same collective cycles so far plan, schedule
    # and report alike: that is done once for them.
    units = {**engine_units(machine.chip), LINK: 1}
    first = trace_classes(traces)
    plans: list[Any] = [None] * n
    for c in range(n):
        same = next((p for p in range(c) if first[p] == first[c] and duration[p] == duration[c]), None)
        plans[c] = plans[same] if same is not None else plan_memory(timed(c), machine.chip, sram_policy)
    pinned = [pinned_units(traces[c]) if first[c] == c else None for c in range(n)]
    own_dma = [own_dma_units(traces[c], machine.chip) if first[c] == c else None for c in range(n)]
    sharing = hbm_sharing(machine.chip)

    def timed_task(c: int, t: Task) -> Task:
        """Chip c's task `t` with its collective's cycles as fixed so far."""
        i = index[c].get(t.key)
        return t if i is None else dataclasses.replace(t, cycles=wait[c][i] + duration[c][i])

    def timing(c: int, upto: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """What chip c's schedule before its collective `upto` reads: its trace's class and
        the earlier collectives' cycles."""
        return first[c], tuple(wait[c][:upto]), tuple(duration[c][:upto])

    # In issue order a command's slot depends only on the commands before it, so each chip's
    # schedule is placed once, up to its next collective at a time (`Placer`): the collective
    # starts when its inputs and the link are ready, its wait then follows from its group's,
    # and it is placed with that wait. Chips of one class with the same collective cycles so
    # far share a placer; a chip whose cycles part from its class's places its own from the start.
    index = [{key: i for i, key in enumerate(keys[c])} for c in range(n)]
    placers: dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[Placer, int]] = {}

    def placed_upto(c: int, upto: int) -> Placer:
        """A placer of chip c's tasks before its collective `upto` (all of them at `count`)."""
        tasks = plans[c].tasks
        end = len(tasks) if upto == count else positions(c)[upto]
        here = timing(c, upto)
        if here in placers:
            return placers[here][0]
        before = timing(c, upto - 1) if upto else None
        placer, done = placers.pop(before) if before in placers else (None, 0)  # type: ignore[arg-type]
        if placer is None:
            r = first[c]
            placer = Placer(units, pinned[r], own_dma[r], sharing)
        for t in tasks[done:end]:
            placer.place(timed_task(c, t))
        placers[here] = (placer, end)
        return placer

    found: dict[int, list[int]] = {}

    def positions(c: int) -> list[int]:
        """Where chip c's collectives sit among its plan's tasks."""
        tasks = plans[c].tasks
        if id(tasks) not in found:
            found[id(tasks)] = [i for i, t in enumerate(tasks) if t.key in index[c]]
        return found[id(tasks)]

    # When each chip's collective starts: a link command waits for its inputs and the link.
    starts = [[0] * count for _ in range(n)]
    for j in range(count):
        for c in range(n):
            placer = placed_upto(c, j)
            task = plans[c].tasks[positions(c)[j]]
            ready = max((placer.slots[d].end for d in (*task.deps, *task.after)), default=0)
            starts[c][j] = max(ready, placer.free[LINK][0])
        for group in groups[j]:
            taking = [c for c in group if not traffics[c].traffic[j].skips]
            sync = max((starts[c][j] for c in taking), default=0)
            for c in taking:
                wait[c][j] = sync - starts[c][j]
    made: dict[tuple[int, tuple[int, ...], tuple[int, ...]], SimReport] = {}
    reports = []
    for c in range(n):
        key = timing(c, count)
        if key in made:
            reports.append(copy.copy(made[key]))
            continue
        sched = placed_upto(c, count).finish()
        placers.pop(key)
        for j, k in enumerate(keys[c]):
            if sched.slots[k].start != starts[c][j]:  # the link commands' rule above is the scheduler's
                raise MeshError(f"chip {c}: collective {j} started at {sched.slots[k].start}, not {starts[c][j]}")
        plan = dataclasses.replace(plans[c], tasks=list(sched.tasks))
        made[key] = trace_report(timed(c), machine.chip, sram_policy, plan, sched, work)
        reports.append(made[key])
    links = []
    for c in range(n):
        for j, key in enumerate(keys[c]):
            record = reports[c].op(key)
            t = traffics[c].traffic[j]
            group = mesh.group(c, traffics[c].axes[j])
            flows = [traffics[g].traffic[j] for g in group]
            received = received_bytes(flows, t.me)
            links.append(LinkRecord(c, j, t.op, record.label, sum(t.sent), received, busy[c][j], latency[c][j],
                                    wait[c][j], record.start, record.end, key, t.skips))
    return MeshReport(machine, mesh, reports, links)
