"""Record what every executed op costs, as the interpreter runs it.

An xDSL interpreter listener sees each op's runtime operands and results; it costs the op on
the spot (the values are not kept) and records which earlier commands produced its operands
and which SRAM buffers it reads and creates. The trace is what the memory plan and the
scheduler work on, so anything that can produce one (the interpreter here; a cost-only mode
that makes up routing later) can be planned, scheduled and reported the same way.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from xdsl.dialects import func, scf
from xdsl.interpreter import Interpreter
from xdsl.ir import Operation, SSAValue
from xdsl.printer import Printer
from xdsl.traits import SymbolTable

from dialects import ve
from dialects.annotations import OTHER, cluster_of, expert_indices, on_own_dma, phase_of
from runtime_sim.perf.cost_model import (
    TENSOR,
    UNTRACED,
    CostFn,
    OpCost,
    aliased_operand,
    check_cost,
    cost_function,
    data_operands,
    forwarded_operand,
    in_hbm,
    is_fused,
    is_unbuffered,
    not_costed,
    order_operands,
    stores_disjointly,
    unread_operands,
)
from target.machine import Machine
from runtime_sim.semantics.numerics import stored_nbytes


# Not frozen: one is built per command of a run (hundreds of thousands at prefill), and a frozen
# dataclass takes about five times as long to build. Nothing modifies one once built.
@dataclass(slots=True)
class TracedOp:
    """One executed command. `deps` are indices of the commands whose results it reads;
    `reads`/`writes` are SRAM buffer ids (values in HBM have none; a view writes nothing);
    `phase` is the op's `tcpc.phase` (dialects/annotations.py), "other" without one."""

    index: int
    name: str
    label: str
    cost: OpCost
    deps: tuple[int, ...] = ()
    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    phase: str = OTHER
    op: Operation | None = field(default=None, compare=False, repr=False)
    """The IR op that ran (planned IR annotates it with its scheduled slot)."""
    cluster: int = 0
    """The cluster whose engines run it (`tcpc.cluster`; what a tensor-engine command is pinned to)."""
    own_dma: bool = False
    """Whether a DMA command runs on its cluster's own engines only (`tcpc.own_dma`)."""
    hbm_reads: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    """For a command of a computing engine (the contraction or vector engine, which read SRAM
    only): each operand it reads from HBM, as (its name, its bytes, the commands it waits for).
    The passes never leave one (load-arguments, the schedule level); hand-written IR or a
    partial pipeline may, and the memory plan then streams the operand in (memory_plan.py)."""


class RoutingChoices(NamedTuple):
    """The expert choices one routing of a run read (the op lower-routing marks
    `tcpc.expert_indices`, dialects/annotations.py): E and the [T, K] choices."""

    experts: int
    choices: np.ndarray


@dataclass
class Trace:
    ops: list[TracedOp] = field(default_factory=list)
    buffer_bytes: dict[int, int] = field(default_factory=dict)
    buffer_labels: dict[int, str] = field(default_factory=dict)
    outputs: set[int] = field(default_factory=set)
    """Buffers the function returns: live until the end."""
    routings: list[RoutingChoices] = field(default_factory=list)
    """Each routing's expert choices, in the order they ran: the routed pairs the report's
    roofline counts (graph_work.py)."""


class _Value(NamedTuple):
    producer: int | None
    buffer: int | None
    stores: tuple[int, ...] = ()
    """For the result of a chain of disjoint stores (`register_disjoint_store`): the chain's
    earlier stores, which a reader waits for besides `producer`."""
    base: int | None = None
    """For such a result: what made the buffer before the chain (what each store waits for)."""
    chained: bool = False
    """Whether this is the result of a chain of disjoint stores, or of an op that forwarded
    an operand (`forwarded`): a reader waits for `stores` too."""
    forwarded: bool = False
    """Whether this is an operand passed through by the op that made it (cost_model.
    register_forwarded_operand): `stores` are what made the operand."""

    def ready_after(self) -> tuple[int, ...]:
        """The commands a reader of this value waits for."""
        return self.stores + ((self.producer,) if self.producer is not None else ())


_ENTRY = _Value(None, None)
"""An entry argument: in HBM, ready at cycle 0."""

_DATA_KEY_BYTES = 4096
"""Data operands up to this size key the cost cache by their bytes (a guard, a block's expert
ids); larger ones (a gather's [T*K] indices, outside any loop) are costed every time."""


@dataclass(frozen=True)
class _Statics:
    """What recording an op needs that is the same every time it runs: an op in a loop runs
    once per iteration with the same types, so this is worked out on its first run only."""

    name: str
    label: str
    phase: str
    cost_fn: CostFn
    data: tuple[int, ...]
    """Operands whose values the cost reads (cost_model.data_operands): they key the cost."""
    read: tuple[int, ...]
    """Operands whose buffers it reads (all but the order-only ones)."""
    in_hbm: tuple[int, ...]
    """Of those, the ones in HBM (cost_model.in_hbm)."""
    alias: int | None
    fresh: tuple[bool, ...]
    """Per result: whether it is a new SRAM buffer (not a view, not unbuffered, not in HBM)."""
    buffer_names: tuple[str | None, ...]
    """Per result: `%name`, or None for `op.name#index`."""
    disjoint: bool
    """Whether it stores into its aliased operand disjointly (cost_model.register_disjoint_store)."""
    cluster: int
    """The cluster whose engines run it (`tcpc.cluster`)."""
    own_dma: bool
    """Whether its DMA runs on its cluster's own engines (`tcpc.own_dma`)."""
    unread: Callable[[Operation, tuple[Any, ...]], tuple[int, ...]] | None
    """Operands it may skip, by its operands' values (cost_model.register_unread_operands)."""
    forward: Callable[[Operation, tuple[Any, ...]], int | None] | None
    """The operand it may pass through, by its operands' values (cost_model.register_forwarded_operand)."""
    experts: int | None
    """E when it reads a routing's expert choices (`tcpc.expert_indices`), which are recorded."""


def op_label(op: Operation) -> str:
    """`%y = ve.mul`; a chain names its members: `%h = ve.chain[3](sigmoid,mul,narrow)`."""
    name = op.name
    if isinstance(op, ve.ChainOp):
        members = op.members
        name = f"{op.name}[{len(members)}]({','.join(m.name.removeprefix('ve.') for m in members)})"
    names = [f"%{r.name_hint}" for r in op.results if r.name_hint]
    return f"{', '.join(names)} = {name}" if names else name


IR_FORM_CHARACTERS = 400
"""The longest IR form of an op that `ir_forms` gives (a chain prints its members too)."""


def ir_forms(trace: Trace) -> dict[int, dict[str, str]]:
    """Command index -> {"ir": its op as the IR prints it, on one line}: the values named as in
    the whole module's printout (`tcpc compile`'s), which is printed first to name them."""
    ops = list(dict.fromkeys(t.op for t in trace.ops if t.op is not None))
    if not ops:
        return {}
    printer = Printer(stream=io.StringIO())
    printer.print_op(ops[0].get_toplevel_object())  # type: ignore[arg-type]
    forms: dict[Operation, str] = {}
    for op in ops:
        printer.stream = io.StringIO()
        printer.print_op(op)
        text = " ".join(printer.stream.getvalue().split())
        forms[op] = text if len(text) <= IR_FORM_CHARACTERS else text[:IR_FORM_CHARACTERS - 3] + "..."
    return {t.index: {"ir": forms[t.op]} for t in trace.ops if t.op is not None}


class TraceRecorder(Interpreter.Listener):
    """Costs and records every op that `entry` executes (and the functions it calls)."""

    def __init__(self, machine: Machine, entry: func.FuncOp, strict: bool = True):
        self.machine = machine
        self.strict = strict
        self.trace = Trace()
        self._entry = entry
        self._values: dict[SSAValue, _Value] = {}
        self._static: dict[Operation, _Statics] = {}
        self._costs: dict[Any, OpCost] = {}
        self._loop_results: dict[Operation, list[_Value]] = {}
        """A loop's (or a branch's) results as its last yield gave them."""
        self._args: list[tuple[Any, ...]] = []
        self._returned: list[_Value] = []
        self._fused: Operation | None = None
        """The fused op running now (a `ve.chain`): the ops inside it are its cost, not traced."""

    def _value(self, v: SSAValue) -> _Value:
        return self._values.get(v, _ENTRY)

    def _statics(self, op: Operation) -> _Statics:
        statics = self._static.get(op)
        if statics is None:
            fn = cost_function(op) or (None if self.strict else not_costed)
            if fn is None:
                raise KeyError(f"{op.name} has no cost function")  # simulate() checks this first
            operands = list(op.operands)
            order_only = set(order_operands(op))
            alias = aliased_operand(op)
            statics = self._static[op] = _Statics(
                op.name, op_label(op), phase_of(op) or OTHER, fn,
                tuple(operands.index(v) for v in data_operands(op)),
                tuple(i for i, v in enumerate(operands) if v not in order_only),
                tuple(i for i, v in enumerate(operands) if v not in order_only and in_hbm(v)),
                alias,
                tuple(alias is None and not is_unbuffered(op) and not in_hbm(r) for r in op.results),
                tuple(f"%{r.name_hint}" if r.name_hint else None for r in op.results),
                alias is not None and stores_disjointly(op), cluster_of(op), on_own_dma(op), unread_operands(op),
                forwarded_operand(op), expert_indices(op))
        return statics

    def _cost(self, op: Operation, statics: _Statics, args: tuple[Any, ...], results: tuple[Any, ...]) -> OpCost:
        """The op's cost, computed once per op and values of its data operands: every other
        operand it may read for shape and dtype only (cost_model), which do not change."""
        key: Any = op
        if statics.data:
            values = [np.asarray(args[i]) for i in statics.data]
            if sum(v.nbytes for v in values) > _DATA_KEY_BYTES:
                key = None
            else:
                key = (op, *((v.dtype.str, v.shape, v.tobytes()) for v in values))
        cost = self._costs.get(key) if key is not None else None
        if cost is None:
            cost = statics.cost_fn(op, args, results, self.machine)
            check_cost(op, cost, self.machine)
            if key is not None:
                self._costs[key] = cost
        return cost

    def will_interpret_op(self, op: Operation, args: tuple[Any, ...]) -> None:
        if self._fused is not None:
            return
        if is_fused(op):
            self._fused = op
        self._args.append(args)
        if isinstance(op, func.CallOp):
            callee = SymbolTable.lookup_symbol(op, op.callee)
            if isinstance(callee, func.FuncOp) and callee.body.blocks.first is not None:
                for arg, operand in zip(callee.body.blocks.first.args, op.operands):
                    self._values[arg] = self._value(operand)
        elif isinstance(op, scf.ForOp):
            # Iteration arguments start as the initial values; a zero-trip loop returns them.
            initial = [self._value(v) for v in op.iter_args]
            for arg, value in zip(op.body.block.args[1:], initial):
                self._values[arg] = value
            self._loop_results[op] = initial
        elif isinstance(op, scf.YieldOp) and isinstance(loop := op.parent_op(), scf.ForOp):
            carried = [self._value(v) for v in op.operands]
            for arg, value in zip(loop.body.block.args[1:], carried):
                self._values[arg] = value
            self._loop_results[loop] = carried
        elif isinstance(op, scf.YieldOp) and isinstance(branch := op.parent_op(), scf.IfOp):
            self._loop_results[branch] = [self._value(v) for v in op.operands]
        elif isinstance(op, func.ReturnOp):
            self._returned = [self._value(v) for v in op.operands]
            if op.parent_op() is self._entry:
                self.trace.outputs.update(v.buffer for v in self._returned if v.buffer is not None)

    def did_interpret_op(self, op: Operation, results: tuple[Any, ...]) -> None:
        if self._fused is not None:
            if op is not self._fused:
                return
            self._fused = None
        args = self._args.pop()
        if op.name in UNTRACED:
            if isinstance(op, func.CallOp):
                for r, v in zip(op.results, self._returned):
                    self._values[r] = v
            elif isinstance(op, (scf.ForOp, scf.IfOp)):
                for r, v in zip(op.results, self._loop_results.pop(op, [])):
                    self._values[r] = v
            return
        statics = self._statics(op)
        cost = self._cost(op, statics, args, results)
        trace = self.trace
        if statics.experts is not None:
            trace.routings.append(RoutingChoices(statics.experts, np.array(args[0])))
        index = len(trace.ops)
        values = self._values
        operands = op.operands
        ins = [values.get(v, _ENTRY) for v in operands]
        alias = statics.alias
        disjoint = statics.disjoint
        unread = statics.unread(op, args) if statics.unread is not None else ()
        forward = statics.forward(op, args) if statics.forward is not None else None
        if forward is not None:
            unread = (*unread, forward)
        waits: set[int] = set()
        for i, v in enumerate(ins):
            if i in unread:
                continue
            if disjoint and i == alias:
                base = v.base if v.chained else v.producer
                if base is not None:
                    waits.add(base)
            elif v.chained:
                waits.update(v.ready_after())
            elif v.producer is not None:
                waits.add(v.producer)
        deps = tuple(sorted(waits))
        reads = tuple(sorted({b for i in statics.read if (b := ins[i].buffer) is not None and i not in unread}))
        writes: list[int] = []
        for r, value, fresh, name in zip(op.results, results, statics.fresh, statics.buffer_names):
            if forward is not None:
                passed = ins[forward]
                made = passed.stores if passed.forwarded else passed.ready_after()
                values[r] = _Value(index, passed.buffer, made, None, True, True)
                continue
            if statics.alias is not None:
                buffer = ins[statics.alias].buffer
            elif not fresh:
                buffer = None
            else:
                buffer = len(trace.buffer_bytes)
                trace.buffer_bytes[buffer] = stored_nbytes(value)
                trace.buffer_labels[buffer] = name or f"{statics.name}#{index}"
                writes.append(buffer)
            if disjoint:
                dest = ins[alias]  # type: ignore[index]
                values[r] = _Value(index, buffer, dest.ready_after() if dest.chained else (),
                                   dest.base if dest.chained else dest.producer, True)
            else:
                values[r] = _Value(index, buffer)
        hbm_reads = ()
        if statics.in_hbm and cost.engine == TENSOR:
            hbm_reads = tuple((f"%{v.name_hint}" if (v := operands[i]).name_hint else f"{statics.name} operand #{i}",
                               stored_nbytes(args[i]), ins[i].ready_after()) for i in statics.in_hbm if i not in unread)
        trace.ops.append(TracedOp(index, statics.name, statics.label, cost, deps, reads, tuple(writes),
                                  statics.phase, op, statics.cluster, statics.own_dma, hbm_reads))
