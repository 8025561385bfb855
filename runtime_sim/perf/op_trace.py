"""Record what every executed op costs, as the interpreter runs it.

An xDSL interpreter listener sees each op's runtime operands and results; it costs the op on
the spot (the values are not kept) and records which earlier commands produced its operands
and which SRAM buffers it reads and creates. The trace is what the memory plan and the
scheduler work on, so anything that can produce one (the interpreter here; a cost-only mode
that makes up routing later) can be planned, scheduled and reported the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from xdsl.dialects import func, scf
from xdsl.interpreter import Interpreter
from xdsl.ir import Operation, SSAValue
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

    # --- loop iterations recorded as copies -------------------------------------------------

    def mark(self) -> tuple[int, int]:
        """Where the trace is: the commands and the buffers recorded so far."""
        return len(self.trace.ops), len(self.trace.buffer_bytes)

    def carried(self, loop: scf.ForOp) -> list[_Value]:
        """What `loop`'s next iteration starts from: its iteration arguments as followed here."""
        return list(self._loop_results.get(loop, ()))

    def repeat(self, loop: scf.ForOp, start: tuple[int, int], marks: tuple[tuple[int, int], ...],
               carried: tuple[list[_Value], ...], times: int) -> bool:
        """Record `times` more iterations of `loop` as copies of its last one, if that is what
        they would record. `marks` are where the last two iterations began and where the last
        one ended, `carried` the iteration arguments each of those three points started from;
        `start` marks where the loop began.

        The recorder works an iteration out from its iteration arguments and from values made
        before the loop alone (its ops read no values: cost_only.LoopReplay). So when the last
        iteration's arguments are the previous one's moved on by one iteration (every command
        and buffer made in the loop one iteration later, everything made before it the same),
        it records the previous iteration moved on, and so does every later one, by
        induction. One part of an argument may grow instead: the stores of a chain of disjoint
        stores into one buffer (a tile written at a new offset each iteration) add one
        iteration's stores each time; they are read only by a reader of the whole chain, which
        would wait for more commands each iteration, so the last iteration must also be the
        previous one moved on. Returns False, recording nothing, when any of this fails."""
        (first, first_buffer), (a, a_buffers), (b, b_buffers), (c, c_buffers) = start, *marks
        step, buffer_step = c - b, c_buffers - b_buffers
        if b - a != step or b_buffers - a_buffers != buffer_step:
            return False

        def moved(v: _Value, n: int, stores: tuple[int, ...]) -> _Value:
            by, by_buffers = n * step, n * buffer_step
            return _Value(v.producer + by if v.producer is not None and v.producer >= first else v.producer,
                          v.buffer + by_buffers if v.buffer is not None and v.buffer >= first_buffer else v.buffer,
                          stores, v.base + by if v.base is not None and v.base >= first else v.base, v.chained,
                          v.forwarded)

        def later(indices: tuple[int, ...], n: int) -> tuple[int, ...]:
            return tuple(i + n * step if i >= first else i for i in indices)

        def growth(v: _Value, w: _Value) -> tuple[int, ...] | None:
            """What `w` (an iteration later) adds to `v`'s stores, if `w` is `v` moved on."""
            if w.stores == later(v.stores, 1):
                return ()
            if w.stores[:len(v.stores)] != v.stores:
                return None
            return w.stores[len(v.stores):]

        previous, before, after = carried
        if not len(previous) == len(before) == len(after):
            return False
        grown: list[tuple[int, ...]] = []
        for u, v, w in zip(previous, before, after):
            added, earlier = growth(v, w), growth(u, v)
            if (added is None or earlier is None or moved(v, 1, w.stores) != w
                    or (added != () and added != later(earlier, 1))):
                return False
            grown.append(added)
        trace = self.trace
        ops, labels, sizes = trace.ops, trace.buffer_labels, trace.buffer_bytes
        iteration = ops[b:c]

        def copy(t: TracedOp, n: int) -> TracedOp:
            by, by_buffers = n * step, n * buffer_step
            return TracedOp(t.index + by, t.name, t.label, t.cost, later(t.deps, n),
                            tuple(r + by_buffers if r >= first_buffer else r for r in t.reads),
                            tuple(w + by_buffers for w in t.writes), t.phase, t.op, t.cluster, t.own_dma,
                            tuple((name, nbytes, later(ready, n)) for name, nbytes, ready in t.hbm_reads))

        if ops[a:b] and [copy(t, 1) for t in ops[a:b]] != iteration:
            return False
        # A buffer without a value name is labelled by the command that made it (`_statics`).
        unnamed = {buffer: t for t in iteration for buffer in t.writes if labels[buffer] == f"{t.name}#{t.index}"}
        for n in range(1, times + 1):
            ops.extend(copy(t, n) for t in iteration)
            by, by_buffers = n * step, n * buffer_step
            for buffer in range(b_buffers, c_buffers):
                maker = unnamed.get(buffer)
                sizes[buffer + by_buffers] = sizes[buffer]
                labels[buffer + by_buffers] = labels[buffer] if maker is None else f"{maker.name}#{maker.index + by}"
        last = [moved(w, times, w.stores + tuple(i for n in range(1, times + 1) for i in later(added, n))
                      if added else later(w.stores, times))
                for w, added in zip(after, grown)]
        for arg, value in zip(loop.body.block.args[1:], last):
            self._values[arg] = value
        self._loop_results[loop] = last
        return True
