"""Record what every executed op costs, as the interpreter runs it.

An xDSL interpreter listener sees each op's runtime operands and results; it costs the op on
the spot (the values are not kept) and records which earlier commands produced its operands
and which SRAM buffers it reads and creates. The trace is what the memory plan and the
scheduler work on, so anything that can produce one (the interpreter here; a cost-only mode
that makes up routing later) can be planned, scheduled and reported the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xdsl.dialects import func, scf
from xdsl.interpreter import Interpreter
from xdsl.ir import Operation, SSAValue
from xdsl.traits import SymbolTable

from dialects import ve
from dialects.annotations import OTHER, cluster_of, phase_of
from runtime_sim.perf.cost_model import (
    UNTRACED,
    OpCost,
    aliased_operand,
    check_cost,
    cost_function,
    in_hbm,
    is_fused,
    is_unbuffered,
    not_costed,
    order_operands,
    stores_disjointly,
)
from runtime_sim.perf.machine import Machine
from runtime_sim.semantics.numerics import stored_nbytes


@dataclass(frozen=True)
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
    cluster: int = 0
    """The cluster whose engines run it (`tcpc.cluster`; what a tensor-engine command is pinned to)."""
    """The IR op that ran (planned IR annotates it with its scheduled slot)."""


@dataclass
class Trace:
    ops: list[TracedOp] = field(default_factory=list)
    buffer_bytes: dict[int, int] = field(default_factory=dict)
    buffer_labels: dict[int, str] = field(default_factory=dict)
    outputs: set[int] = field(default_factory=set)
    """Buffers the function returns: live until the end."""


@dataclass(frozen=True)
class _Value:
    producer: int | None
    buffer: int | None
    stores: tuple[int, ...] = ()
    """For the result of a chain of disjoint stores (`register_disjoint_store`): the chain's
    earlier stores, which a reader waits for besides `producer`."""
    base: int | None = None
    """For such a result: what made the buffer before the chain (what each store waits for)."""
    chained: bool = False
    """Whether this is the result of a chain of disjoint stores."""

    def ready_after(self) -> tuple[int, ...]:
        """The commands a reader of this value waits for."""
        return self.stores + ((self.producer,) if self.producer is not None else ())


def op_label(op: Operation) -> str:
    """`%y = ve.mul`; a chain names its members: `%h = ve.chain[3](sigmoid,mul,narrow)`."""
    name = op.name
    if isinstance(op, ve.ChainOp):
        members = op.members
        name = f"{op.name}[{len(members)}]({','.join(m.name.removeprefix('ve.') for m in members)})"
    names = [f"%{r.name_hint}" for r in op.results if r.name_hint]
    return f"{', '.join(names)} = {name}" if names else name


class TraceRecorder(Interpreter.Listener):
    """Costs and records every op that `entry` executes (and the functions it calls)."""

    def __init__(self, machine: Machine, entry: func.FuncOp, strict: bool = True):
        self.machine = machine
        self.strict = strict
        self.trace = Trace()
        self._entry = entry
        self._values: dict[SSAValue, _Value] = {}
        self._loop_results: dict[scf.ForOp, list[_Value]] = {}
        self._args: list[tuple[Any, ...]] = []
        self._returned: list[_Value] = []
        self._fused: Operation | None = None
        """The fused op running now (a `ve.chain`): the ops inside it are its cost, not traced."""

    def _value(self, v: SSAValue) -> _Value:
        return self._values.get(v, _Value(None, None))  # entry arguments: in HBM, ready at 0

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
            elif isinstance(op, scf.ForOp):
                for r, v in zip(op.results, self._loop_results.pop(op)):
                    self._values[r] = v
            return
        fn = cost_function(op) or (None if self.strict else not_costed)
        if fn is None:
            raise KeyError(f"{op.name} has no cost function")  # simulate() checks this first
        cost = fn(op, args, results, self.machine)
        check_cost(op, cost, self.machine)
        index = len(self.trace.ops)
        ins = [self._value(v) for v in op.operands]
        order_only = set(order_operands(op))
        alias = aliased_operand(op)
        disjoint = alias is not None and stores_disjointly(op)
        waits: set[int] = set()
        for i, v in enumerate(ins):
            if disjoint and i == alias:
                base = v.base if v.chained else v.producer
                waits.update(() if base is None else (base,))
            else:
                waits.update(v.ready_after())
        deps = tuple(sorted(waits))
        reads = tuple(sorted({v.buffer for v, operand in zip(ins, op.operands)
                              if v.buffer is not None and operand not in order_only}))
        writes: list[int] = []
        for r, value in zip(op.results, results):
            if alias is not None:
                buffer = ins[alias].buffer
            elif is_unbuffered(op) or in_hbm(r):
                buffer = None
            else:
                buffer = len(self.trace.buffer_bytes)
                self.trace.buffer_bytes[buffer] = stored_nbytes(value)
                self.trace.buffer_labels[buffer] = f"%{r.name_hint}" if r.name_hint else f"{op.name}#{index}"
                writes.append(buffer)
            if disjoint:
                dest = ins[alias]  # type: ignore[index]
                self._values[r] = _Value(index, buffer, dest.ready_after() if dest.chained else (),
                                         dest.base if dest.chained else dest.producer, chained=True)
            else:
                self._values[r] = _Value(index, buffer)
        self.trace.ops.append(TracedOp(index, op.name, op_label(op), cost, deps, reads, tuple(writes),
                                       phase_of(op) or OTHER, op, cluster_of(op)))
