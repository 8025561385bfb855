"""Record what every executed op costs, as the interpreter runs it.

An xDSL interpreter listener sees each op's runtime operands and results; it costs the op on
the spot (the values are not kept) and records which earlier commands produced its operands
and which SRAM buffers it reads and creates. The trace is what the memory plan and the
scheduler work on, so anything that can produce one (the interpreter here; a cost-only mode
that makes up routing later) can be planned, scheduled and reported the same way.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from xdsl.dialects import func, scf
from xdsl.interpreter import Interpreter
from xdsl.ir import Operation, Region, SSAValue
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
    cost_key,
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
    key: Callable[[Operation, tuple[Any, ...]], Hashable] | None
    """What its cost reads of its data operands' values (cost_model.register_cost_key)."""
    costed_as: Operation
    """The op whose costs it shares: itself, or the op it is a clone of (`cloned_loop_ops`)."""


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


def cloned_loop_ops(loop: scf.ForOp) -> dict[Operation, Operation]:
    """Each op of `loop`'s body -> its op in the loop before it, when that loop's results are
    `loop`'s iteration arguments and `loop`'s body is a clone of its body (interleave-shared's
    pieces of the routed loop): the same ops with the same properties, attributes, result
    types and value names (the objects themselves, as a clone shares them), reading the same
    values from outside the body. Such ops are costed alike: a cost reads its op's types and
    attributes and where its operands live, which a clone's find by the same chain of values
    (a piece's iteration arguments start from the piece before's results). Empty otherwise."""
    before = loop.iter_args[0].owner if loop.iter_args else None
    if not isinstance(before, scf.ForOp) or list(before.results) != list(loop.iter_args):
        return {}
    pairs: dict[Operation, Operation] = {}
    values: dict[SSAValue, SSAValue] = {}
    return pairs if _same_regions(loop.regions, before.regions, pairs, values) else {}


def _same_regions(regions: Sequence[Region], originals: Sequence[Region], pairs: dict[Operation, Operation],
                  values: dict[SSAValue, SSAValue]) -> bool:
    if len(regions) != len(originals):
        return False
    for region, original in zip(regions, originals):
        blocks, original_blocks = list(region.blocks), list(original.blocks)
        if len(blocks) != len(original_blocks):
            return False
        for block, original_block in zip(blocks, original_blocks):
            if len(block.args) != len(original_block.args):
                return False
            values.update(zip(block.args, original_block.args))
            ops, original_ops = list(block.ops), list(original_block.ops)
            if len(ops) != len(original_ops):
                return False
            for op, first in zip(ops, original_ops):
                if not _same_op(op, first, values) or not _same_regions(op.regions, first.regions, pairs, values):
                    return False
                pairs[op] = first
                values.update(zip(op.results, first.results))
    return True


def _same_op(op: Operation, first: Operation, values: dict[SSAValue, SSAValue]) -> bool:
    if (op.name != first.name or len(op.operands) != len(first.operands) or len(op.results) != len(first.results)
            or not _same_objects(op.properties, first.properties) or not _same_objects(op.attributes, first.attributes)):
        return False
    if any(values.get(v, v) is not w for v, w in zip(op.operands, first.operands)):
        return False
    return all(r.type is q.type and r.name_hint == q.name_hint for r, q in zip(op.results, first.results))


def _same_objects(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


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
        self._clones: dict[Operation, Operation] = {}
        """Op of a loop's body -> the op of the loop before it that it is a clone of (`cloned_loop_ops`)."""
        self._loops_seen: set[Operation] = set()
        self._loop_results: dict[Operation, list[_Value]] = {}
        """A loop's (or a branch's) results as its last yield gave them."""
        self._args: list[tuple[Any, ...]] = []
        self._returned: list[_Value] = []
        self._fused: Operation | None = None
        """The fused op running now (a `ve.chain`): the ops inside it are its cost, not traced."""
        self._deferred: list[tuple[bool, Operation, tuple[Any, ...]]] | None = None
        """The ops seen since `defer`, not recorded yet."""

    def sibling(self) -> TraceRecorder:
        """A recorder for another chip running the same program (a mesh's SPMD function): its
        own trace, this one's op statics and cost cache, since an op's cost is a function of
        the op and its data operands' values (`_cost`), whichever chip runs it."""
        other = TraceRecorder(self.machine, self._entry, self.strict)
        other._static, other._costs, other._clones = self._static, self._costs, self._clones
        return other

    def _value(self, v: SSAValue) -> _Value:
        return self._values.get(v, _ENTRY)

    def _statics(self, op: Operation) -> _Statics:
        statics = self._static.get(op)
        if statics is None and (original := self._clones.get(op)) is not None:
            statics = self._static[op] = self._statics(original)
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
                forwarded_operand(op), expert_indices(op), cost_key(op), op)
        return statics

    def _cost(self, op: Operation, statics: _Statics, args: tuple[Any, ...], results: tuple[Any, ...]) -> OpCost:
        """The op's cost, computed once per op and values of its data operands (or what of them
        it reads, its `key`: a guarded command in an expert loop once per kind of block, not
        once per expert id): every other operand it may read for shape and dtype only
        (cost_model), which do not change."""
        key: Any = statics.costed_as
        if statics.key is not None:
            key = (key, statics.key(op, tuple(args[i] for i in statics.data)))
        elif statics.data:
            values = [np.asarray(args[i]) for i in statics.data]
            if sum(v.nbytes for v in values) > _DATA_KEY_BYTES:
                key = None
            else:
                key = (key, *((v.dtype.str, v.shape, v.tobytes()) for v in values))
        cost = self._costs.get(key) if key is not None else None
        if cost is None:
            cost = statics.cost_fn(op, args, results, self.machine)
            check_cost(op, cost, self.machine)
            if key is not None:
                self._costs[key] = cost
        return cost

    def will_interpret_op(self, op: Operation, args: tuple[Any, ...]) -> None:
        if self._deferred is not None:
            self._deferred.append((True, op, args))
            return
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
            if op not in self._loops_seen:
                self._loops_seen.add(op)
                self._clones.update(cloned_loop_ops(op))
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
        if self._deferred is not None:
            self._deferred.append((False, op, results))
            return
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

    def defer(self) -> None:
        """Keep the ops seen from now on for `deferred` instead of recording them."""
        self._deferred = []

    def deferred(self) -> list[tuple[bool, Operation, tuple[Any, ...]]]:
        """The ops seen since `defer`, as (will run, op, its operands or results), and record
        again from now on (`record` records the ones kept, if they are to be)."""
        events, self._deferred = self._deferred, None
        assert events is not None
        return events

    def record(self, events: list[tuple[bool, Operation, tuple[Any, ...]]]) -> None:
        """Record ops kept by `defer`, as if they had just run."""
        for will, op, values in events:
            (self.will_interpret_op if will else self.did_interpret_op)(op, values)

    def signature(self, events: list[tuple[bool, Operation, tuple[Any, ...]]]) -> tuple[tuple[object, ...], ...]:
        """What recording these ops reads besides the values made before them: the ops in
        order (a branch shows in the ops it ran), and for each op whose cost reads values its
        cost and the operands it skips or passes through (`_statics`)."""
        out: list[tuple[object, ...]] = []
        args: list[tuple[Any, ...]] = []
        fused: Operation | None = None
        for will, op, values in events:
            if fused is not None and op is not fused:
                continue
            if will:
                fused = op if is_fused(op) else None
                args.append(values)
                continue
            fused = None
            operands = args.pop()
            out.append((op,) if op.name in UNTRACED else self.reads(op, operands, values))
        return tuple(out)

    def costed_as(self, op: Operation) -> Operation:
        """The op whose costs `op` shares: itself, or the op it is a clone of (`cloned_loop_ops`)."""
        return self._statics(op).costed_as

    def reads_values(self, op: Operation) -> bool:
        """Whether recording `op` reads values of its operands (its cost, or what it skips or passes through)."""
        statics = self._statics(op)
        return bool(statics.data or statics.unread or statics.forward)

    def reads(self, op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...]) -> tuple[object, ...]:
        """What recording `op` on `operands` reads of their values, its part of a `signature`: its cost and
        the operands it skips or passes through, or nothing."""
        if not self.reads_values(op):
            return (op,)
        statics = self._statics(op)
        return (op, self._cost(op, statics, operands, results),
                statics.unread(op, operands) if statics.unread is not None else (),
                statics.forward(op, operands) if statics.forward is not None else None)

    def template(self, loop: scf.ForOp, start: tuple[int, int], marks: tuple[tuple[int, int], ...],
                 carried: tuple[list[_Value], ...]) -> LoopTemplate | None:
        """`loop`'s last iteration as a template for the ones after it, if it is one. `marks`
        are where the last two iterations began and where the last one ended, `carried` the
        iteration arguments each of those three points started from; `start` marks where the
        loop began. An "iteration" here may be a run of several (a loop whose iterations
        alternate, as two F tiles do): the template is then that run, copied as a whole.

        The recorder works an iteration out from its iteration arguments, values made before
        the loop and what its ops read of their values (`signature`). So when the last
        iteration's arguments are the previous one's moved on by one iteration (every command
        and buffer made in the loop one iteration later, everything made before it the same),
        an iteration after it whose ops read what the last one's read records the last one
        moved on, and leaves its arguments moved on again: by induction, as long as the
        signatures agree. One part of an argument may grow instead: the stores of a chain of
        disjoint stores into one buffer (a tile written at a new offset each iteration) add one
        iteration's stores each time; only a reader of the whole chain reads them, and it
        would wait for more commands each iteration, so the last iteration must also be the
        previous one moved on. An argument passed on unchanged (every block the guard skips
        yields it again) stays unchanged: no command reads it, or the last iteration would
        not be the previous one moved on. None when any of this fails."""
        (first, first_buffer), (a, a_buffers), (b, b_buffers), (c, c_buffers) = start, *marks
        step, buffer_step = c - b, c_buffers - b_buffers
        if b - a != step or b_buffers - a_buffers != buffer_step:
            return None
        template = LoopTemplate(self, loop, first, first_buffer, b, c, b_buffers, c_buffers, carried[2])

        def growth(v: _Value, w: _Value) -> tuple[int, ...] | None:
            """What `w` (an iteration later) adds to `v`'s stores, if `w` is `v` moved on."""
            if w.stores == template.later(v.stores, 1):
                return ()
            if w.stores[:len(v.stores)] != v.stores:
                return None
            return w.stores[len(v.stores):]

        previous, before, after = carried
        if not len(previous) == len(before) == len(after):
            return None
        for u, v, w in zip(previous, before, after):
            if u == v == w:  # passed on unchanged (a block the guard skips): it stays
                template.grown.append(None)
                continue
            added, earlier = growth(v, w), growth(u, v)
            if (added is None or earlier is None or template.moved(v, 1, w.stores) != w
                    or (added != () and added != template.later(earlier, 1))):
                return None
            template.grown.append(added)
        ops = self.trace.ops
        if ops[a:b] and [template.copy(t, 1) for t in ops[a:b]] != ops[b:c]:
            return None
        return template

    def repeat(self, loop: scf.ForOp, start: tuple[int, int], marks: tuple[tuple[int, int], ...],
               carried: tuple[list[_Value], ...], times: int) -> bool:
        """Record `times` more iterations of `loop` as copies of its last one, if that is what
        they record: its ops read no values (cost_only.LoopReplay checks), so each iteration's
        signature is the last one's, and the last one is a `template`. False, recording
        nothing, when it is not."""
        template = self.template(loop, start, marks, carried)
        if template is None:
            return False
        for n in range(1, times + 1):
            template.append(n)
        template.finish(times)
        return True


def _moving(t: TracedOp, first: int, first_buffer: int) -> tuple[tuple[int, ...], ...] | None:
    """`t`'s commands waited for and buffers read, each as what stays (those made before the
    loop, `first` and `first_buffer`) and what moves on with the iterations: its sorted deps and
    reads have the ones that stay first. None for a command that `LoopTemplate.copy` moves
    otherwise (operands streamed from HBM, which no pass leaves)."""
    if t.hbm_reads:
        return None
    deps = sum(1 for i in t.deps if i < first)
    reads = sum(1 for r in t.reads if r < first_buffer)
    if any(i < first for i in t.deps[deps:]) or any(r < first_buffer for r in t.reads[reads:]):
        return None
    return t.deps[:deps], t.deps[deps:], t.reads[:reads], t.reads[reads:]


class LoopTemplate:
    """An iteration of a loop that the iterations after it copy, moved on by one iteration each
    (TraceRecorder.template says when): what the copies need of it."""

    def __init__(self, recorder: TraceRecorder, loop: scf.ForOp, first: int, first_buffer: int, begin: int, end: int,
                 begin_buffers: int, end_buffers: int, after: list[_Value]):
        self.recorder, self.loop = recorder, loop
        self.first, self.first_buffer = first, first_buffer
        """The first command and buffer the loop made: only those move on."""
        self.step, self.buffer_step = end - begin, end_buffers - begin_buffers
        self.iteration = recorder.trace.ops[begin:end]
        self.buffers = range(begin_buffers, end_buffers)
        self.after = after
        """The iteration arguments it left."""
        self.grown: list[tuple[int, ...] | None] = []
        """Per argument, what one iteration adds to its stores (empty: they move on instead;
        None: the argument is passed on unchanged)."""
        labels = recorder.trace.buffer_labels
        # A buffer without a value name is labelled by the command that made it (`_statics`).
        self.unnamed = {buffer: t for t in self.iteration for buffer in t.writes
                        if labels[buffer] == f"{t.name}#{t.index}"}
        self.signature: tuple[tuple[object, ...], ...] | None = None
        """What its ops read of values (TraceRecorder.signature), when a copy must match it."""
        self.moving = [_moving(t, first, first_buffer) for t in self.iteration]
        """Per command, what `append` moves on (`_moving`)."""

    def later(self, indices: tuple[int, ...], n: int) -> tuple[int, ...]:
        first, by = self.first, n * self.step
        return tuple(i + by if i >= first else i for i in indices)

    def moved(self, v: _Value, n: int, stores: tuple[int, ...]) -> _Value:
        """`v` as `n` iterations later, with `stores`."""
        first, by, by_buffers = self.first, n * self.step, n * self.buffer_step
        return _Value(v.producer + by if v.producer is not None and v.producer >= first else v.producer,
                      v.buffer + by_buffers if v.buffer is not None and v.buffer >= self.first_buffer else v.buffer,
                      stores, v.base + by if v.base is not None and v.base >= first else v.base, v.chained, v.forwarded)

    def copy(self, t: TracedOp, n: int) -> TracedOp:
        """Command `t` as `n` iterations later. (Lists made into tuples, not generators: a
        replayed loop copies hundreds of thousands of commands, a third faster so.)"""
        first, by = self.first, n * self.step
        first_buffer, by_buffers = self.first_buffer, n * self.buffer_step
        return TracedOp(t.index + by, t.name, t.label, t.cost, tuple([i + by if i >= first else i for i in t.deps]),
                        tuple([r + by_buffers if r >= first_buffer else r for r in t.reads]),
                        tuple([w + by_buffers for w in t.writes]), t.phase, t.op, t.cluster, t.own_dma,
                        tuple([(name, nbytes, self.later(ready, n)) for name, nbytes, ready in t.hbm_reads])
                        if t.hbm_reads else ())

    def append(self, n: int) -> None:
        """Record the iteration `n` after the template, a copy of it (`copy`, from each command's
        split into what stays and what moves on: a replayed loop copies hundreds of thousands)."""
        trace = self.recorder.trace
        by, by_buffers = n * self.step, n * self.buffer_step
        ops = trace.ops
        for t, split in zip(self.iteration, self.moving):
            if split is None:
                ops.append(self.copy(t, n))
                continue
            deps, moved, reads, moved_reads = split
            ops.append(TracedOp(t.index + by, t.name, t.label, t.cost,
                                deps + tuple([i + by for i in moved]) if moved else deps,
                                reads + tuple([r + by_buffers for r in moved_reads]) if moved_reads else reads,
                                tuple([w + by_buffers for w in t.writes]) if t.writes else (),
                                t.phase, t.op, t.cluster, t.own_dma))
        labels, sizes = trace.buffer_labels, trace.buffer_bytes
        for buffer in self.buffers:
            maker = self.unnamed.get(buffer)
            sizes[buffer + by_buffers] = sizes[buffer]
            labels[buffer + by_buffers] = labels[buffer] if maker is None else f"{maker.name}#{maker.index + by}"

    def finish(self, times: int) -> None:
        """Leave the recorder where `times` copies leave it: the loop's iteration arguments."""
        last = [w if added is None else
                self.moved(w, times, w.stores + tuple(i for n in range(1, times + 1) for i in self.later(added, n))
                           if added else self.later(w.stores, times))
                for w, added in zip(self.after, self.grown)]
        for arg, value in zip(self.loop.body.block.args[1:], last):
            self.recorder._values[arg] = value
        self.recorder._loop_results[self.loop] = last
