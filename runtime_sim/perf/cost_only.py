"""Cost-only simulation: cycles for real model sizes, without weights, inputs or values.

DeepSeek-V3's routed experts alone are 22 GB in bf16, more than a test machine holds, yet
every cost in the model depends on shapes alone except a few that depend on *routing*: which
rows a DMA gather moves or skips, which blocks a guarded contraction runs. Cost-only mode
computes exactly those values and nothing else.

How (three parts):

1. **The routing is pinned at the graph level.** The `pin-routing` pass (passes/lowering/pin_routing.py)
   replaces the expert indices that each `moe.scatter` consumes by a new function argument, a
   *routing argument* tagged `tcpc.routing_experts = E` (routing_scenarios.py). The lowering
   passes rewrite ops, not function signatures, so the argument survives to the fully lowered
   IR, where it feeds the routing's index generation (one-hot, histogram, cumsum on the vector
   engine) and from there the DMA indices and contraction guards. The hook names no lowered op,
   so it works at every level and for every future lowering; handwritten lowered IR declares
   its routing argument the same way. The graph's own router (matmul, softmax, top-k) still
   runs and is still costed: its cost depends on shapes only (the ve lowering is branchless).
   Its expert indices no longer decide the routing but still order it: pin-routing reads the
   argument through `tcp.order` after them, so what reads the routing waits for the router
   (on a mesh, a collective sending the ids too), and the routing stands in their buffer. That
   op hands the routing on as it is and never computes the indices.
2. **A scenario fills the routing arguments** (balanced, skewed, one-expert, or a file of
   [T, K] indices); every other argument is a *placeholder*: a zero-stride numpy array of the
   declared shape and dtype (no memory, contents meaningless).
3. **Values are lazy.** The interpreter runs every op symbolically: an op with a placeholder
   operand yields placeholders; an op whose operands are all real yields a *lazy* value, not
   computed yet. A cost function reads values only of the operands its op declares
   (`register_data_operands`: a gather's or scatter's indices, a contraction's guard); only
   those are computed, through the chain of lazy ops that produce them, which bottoms out in
   the routing arguments and static tables (iota, const): small, [T*K, E] at most. The top-k
   ranking ([T, E, E]) and every tensor of activations or weights are never materialised. A
   data operand that depends on a placeholder (routing that was not pinned, or indices given
   as a plain argument) stops the run with CostOnlyError naming the op and the inputs.

Outputs are never produced: `SimResult.outputs` is empty in cost-only mode, so no garbage can
be printed. Given the routing a full simulation computed, cost-only mode reports the same
cycles as that simulation (tests/test_cost_only.py checks this).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, TensorType
from xdsl.interpreter import Interpreter, InterpreterFunctions, impl, register_impls
from xdsl.ir import Attribute, Block, Dialect, Operation, SSAValue
from xdsl.traits import IsTerminator
from xdsl.utils.exceptions import InterpretationError

from dialects.annotations import expert_indices, routing_arguments
from dialects import tcp
from dialects.moe import MoE
from dialects.tcp import TCP
from dialects import tile
from dialects.tile import Tile
from dialects.tmath import TMath
from dialects.ve import VE
from dialects.tensor_types import shape_of
from runtime_sim.perf.cost_model import (LINK, TENSOR, UNTRACED, OpCost, data_operands, engine_units, forwarded_operand,
                                         is_fused, unread_operands)
from runtime_sim.perf.graph_work import GraphWork
from target.machine import Machine, default_machine
from runtime_sim.perf.memory_plan import DEFAULT_SRAM_POLICY, MemoryPlan, SramPolicy
from runtime_sim.perf.op_trace import LoopTemplate, Trace, TracedOp, TraceRecorder
from runtime_sim.perf.routing_scenarios import DEFAULT_SCENARIO, Routing, scenario_choices
from runtime_sim.perf.simulate import (
    SimResult,
    UncostedPolicy,
    checked_roofline,
    plan_and_schedule,
    simulate_trace,
    trace_recorder,
    trace_report,
)
from runtime_sim.perf.report import roofline
from runtime_sim.perf.scheduler import Schedule
from runtime_sim.perf.value_memo import VALUES
from runtime_sim.semantics.collector import without_gc_pauses
from runtime_sim.semantics.executor import function_named, make_interpreter
from runtime_sim.semantics.numerics import tensor_dtype
from runtime_sim.semantics.tile_semantics import guard_runs, sliced


class CostOnlyError(Exception):
    """A cost that depends on values cost-only mode does not have."""


class Placeholder(np.ndarray):
    """A shape-only value: the declared shape and dtype, zero strides (no memory), contents
    meaningless. `sources` names the function arguments it was computed from."""

    sources: frozenset[str] = frozenset()

    def __array_finalize__(self, obj: Any) -> None:
        self.sources = getattr(obj, "sources", frozenset())


class ShapeOnly:
    """A placeholder for a value that is not a tensor (a `!moe.route`)."""

    def __init__(self, t: Attribute, sources: frozenset[str] = frozenset()):
        self.type = t
        self.sources = sources
        self.nbytes = 0


PLACEHOLDERS_KEPT = 4096
"""How many placeholders `placeholder` remembers (the least recently used are forgotten)."""


@functools.lru_cache(maxsize=PLACEHOLDERS_KEPT)
def placeholder(t: Attribute, sources: frozenset[str] = frozenset()) -> Placeholder | ShapeOnly:
    """A value of type `t` computed from `sources`: one object for each (read-only, so shared
    by every op that makes one: an unrolled expert loop's ops make tens of thousands)."""
    if not isinstance(t, TensorType):
        return ShapeOnly(t, sources)
    value = np.broadcast_to(np.zeros((), tensor_dtype(t)), shape_of(t)).view(Placeholder)
    value.sources = sources
    return value


def is_placeholder(value: Any) -> bool:
    return isinstance(value, (Placeholder, ShapeOnly))


class _Thunk:
    """One op whose operands are all real, run only if one of its results is needed. Its
    values are let go once nothing can read them again (`release`): every op that reads a
    result has run and every thunk made of them has computed. Only results all of whose
    readers are symbolic ops of the op's own block (not in a loop body, not a loop, call or
    terminator, which would hand the value on) are let go, each such reader running once: the routing's [T K, E] tables (32 MB each at DeepSeek-V3's T = 4096)
    then live one or two at a time rather than all through the run."""

    __slots__ = ("semantics", "op", "inputs", "values", "readers", "consumers", "key")

    def __init__(self, semantics: Interpreter, op: Operation, inputs: tuple[Any, ...],
                 readers: frozenset[Operation] | None, key: int | None = None):
        self.semantics = semantics
        self.op = op
        self.inputs: tuple[Any, ...] | None = inputs
        self.key = key
        """What names its values in `VALUES` (value_memo.py); None: not kept."""
        self.values: tuple[Any, ...] | None = None
        self.readers: set[Operation] | None = None if readers is None else set(readers)
        """The ops that read a result and have not run yet; None: never let go."""
        self.consumers = 0
        """Thunks made of a result that have not computed yet."""
        for v in inputs:
            if isinstance(v, Lazy):
                v.thunk.consumers += 1

    def compute(self) -> None:
        assert self.inputs is not None
        args = tuple(v.get() if isinstance(v, Lazy) else v for v in self.inputs)
        with np.errstate(all="ignore"):
            # The registered semantics, on an interpreter without listeners (they saw the op already).
            self.values = tuple(self.semantics.run_op(self.op, args))
        self._let_inputs_go()

    def recall(self) -> bool:
        """Take the values from `VALUES` if a run computed them (computing nothing it reads)."""
        values = VALUES.get(self.key) if self.key is not None else None
        if values is None:
            return False
        self.values = values
        self._let_inputs_go()
        return True

    def _let_inputs_go(self) -> None:
        assert self.inputs is not None
        inputs, self.inputs = self.inputs, None
        for v in inputs:
            if isinstance(v, Lazy):
                v.thunk.consumers -= 1
                v.thunk.release()

    def read_by(self, op: Operation) -> None:
        """`op`, a reader of a result, has run."""
        if self.readers is not None:
            self.readers.discard(op)
            self.release()

    def release(self) -> None:
        """Let the values go if nothing can read them again (the class docstring)."""
        if self.values and self.readers is not None and not self.readers and not self.consumers:
            self.values = ()  # computed, and gone: a read fails loudly (Lazy.get)


def _readers_in_block(op: Operation) -> frozenset[Operation] | None:
    """The ops that read `op`'s results, when every one is a symbolic op of `op`'s block (which
    makes values of its own, never hands a read one on: a loop, a call, a terminator or a
    `tcp.order` would); else None."""
    block = op.parent_block()
    readers = frozenset(use.operation for r in op.results for use in r.uses)
    if block is None or any(o.parent_block() is not block or not _is_symbolic(o) or o.has_trait(IsTerminator)
                            or isinstance(o, tcp.OrderOp) for o in readers):
        return None
    return readers


class Lazy:
    """A result of a thunk; `force` computes it and everything it needs, once."""

    __slots__ = ("thunk", "index")

    def __init__(self, thunk: _Thunk, index: int):
        self.thunk = thunk
        self.index = index

    def get(self) -> Any:
        assert self.thunk.values, "a value computed and let go, or not computed"
        return self.thunk.values[self.index]

    def force(self) -> Any:
        stack = [self.thunk]
        while stack:  # iteratively, however long the chain of ops
            t = stack[-1]
            if t.values is not None or t.recall():
                stack.pop()
                continue
            assert t.inputs is not None
            pending = [v.thunk for v in t.inputs if isinstance(v, Lazy) and v.thunk.values is None]
            if pending:
                stack.extend(pending)
            else:
                t.compute()
                stack.pop()
        if self.thunk.key is not None:  # a value a cost or a branch reads: small, and all a later run needs
            VALUES.keep(self.thunk.key, self.thunk.values)  # type: ignore[arg-type]
        return self.get()


SYMBOLIC_DIALECTS: tuple[Dialect, ...] = (MoE, TMath, VE, TCP, Tile)
"""The dialects whose ops run symbolically. Control flow (func, and the loops of the schedule
level) runs for real: its operands are never tensors of data. A branch's condition (the
schedule level's `tile.guard` of a block's expert id) comes from the routing, like a
contraction's guard: `scf.if` forces it."""


_SYMBOLIC_NAMES = frozenset(d.name for d in SYMBOLIC_DIALECTS)


def _is_symbolic(op: Operation) -> bool:
    return op.dialect_name() in _SYMBOLIC_NAMES


_UNKNOWN: Any = object()
"""Not worked out yet, in a cache whose values may be None (looked up once: an op's hash is
a Python call)."""


class ShapeOnlyFunctions(InterpreterFunctions):
    """The symbolic implementation of every op of `SYMBOLIC_DIALECTS` (see the module
    docstring), registered over the real semantics with `override=True`; `semantics` is a
    plain interpreter of the same module whose public `run_op` computes a thunk."""

    def __init__(self, semantics: Interpreter, replay: LoopReplay | None = None, shared: SharedViews | None = None):
        self.semantics = semantics
        self.replay = replay
        shared = shared or SharedViews()
        self._shaped = shared.shaped
        """(op, sources) -> its placeholder results: the same every iteration of a loop."""
        self._readers = shared.readers
        self._op_keys = shared.op_keys

    @impl(scf.ForOp)
    def run_for(self, interpreter: Interpreter, op: scf.ForOp, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """xDSL's loop, or with `replay`, as few iterations as show the rest (LoopReplay)."""
        lb, ub, step, *carried = args
        if self.replay is not None:
            return self.replay.run(interpreter, op, range(lb, ub, step), tuple(carried))
        loop_args = tuple(carried)
        for i in range(lb, ub, step):
            loop_args = interpreter.run_ssacfg_region(op.body, (i, *loop_args), "for_loop")
        return loop_args

    @impl(scf.IfOp)
    def run_if(self, interpreter: Interpreter, op: scf.IfOp, args: tuple[Any, ...]) -> tuple[Any, ...]:
        (cond,) = args
        if is_placeholder(cond):
            raise CostOnlyError(f"the branch {_describe(op)} depends on input(s) {', '.join(sorted(cond.sources)) or '?'}; "
                                "cost-only mode has values only for routing arguments")
        taken = cond.force() if isinstance(cond, Lazy) else cond
        return interpreter.run_ssacfg_region(op.true_region if taken else op.false_region, ())

    @impl(tcp.OrderOp)
    def run_order(self, interpreter: Interpreter, op: tcp.OrderOp, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The pinned routing as it is: what it waits for (the router's indices, a placeholder) is
        only an order, never computed."""
        return (args[0],)

    def run_symbolic(self, interpreter: Interpreter, op: Operation, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        shapes = [p for p in inputs if isinstance(p, (Placeholder, ShapeOnly))]
        if shapes:
            sources = frozenset().union(*(p.sources for p in shapes))
            key = (op, sources)
            results = self._shaped.get(key)
            if results is None:
                results = self._shaped[key] = tuple(placeholder(r.type, sources) for r in op.results)
            return results
        readers = self._readers.get(op, _UNKNOWN)
        if readers is _UNKNOWN:
            readers = self._readers[op] = _readers_in_block(op)
        op_key = self._op_keys.get(op)
        if op_key is None:
            op_key = self._op_keys[op] = VALUES.op_key(op)
        thunk = _Thunk(self.semantics, op, inputs, readers, VALUES.key(op_key, inputs, Lazy))
        return tuple(Lazy(thunk, i) for i in range(len(op.results)))


@dataclass
class SharedViews:
    """What cost-only interpreters of one module can share (a mesh's chips run one SPMD
    program): each symbolic op's placeholder results for the sources of its operands, and what
    the listeners see of it (`ShapeOnlyListener`), and its readers. Each depends on the op alone,
    so a chip finds them made by another; a placeholder is read-only."""

    shaped: dict[tuple[Operation, frozenset[str]], tuple[Any, ...]] = field(default_factory=dict)
    views: dict[Operation, _SymbolicViews | None] = field(default_factory=dict)
    readers: dict[Operation, frozenset[Operation] | None] = field(default_factory=dict)
    """Each op's readers whose runs let its thunk's values go (`_readers_in_block`), worked out
    once: every run of the op makes a thunk."""
    op_keys: dict[Operation, int] = field(default_factory=dict)
    """Each op's part of its thunks' keys (`ValueMemo.op_key`)."""


def shape_only_functions(semantics: Interpreter, replay: LoopReplay | None = None,
                         shared: SharedViews | None = None) -> ShapeOnlyFunctions:
    """`ShapeOnlyFunctions` with `run_symbolic` registered for every op of the symbolic
    dialects: one implementation for all of them, so it is registered in a loop. An op with a
    region (`ve.chain`) is one symbolic op too: its body runs only inside a thunk, on the
    semantics, when a value of it is needed; its terminator (`ve.yield`) never runs here."""
    methods = {f"run_{op.name.replace('.', '_')}": impl(op)(ShapeOnlyFunctions.run_symbolic)
               for dialect in SYMBOLIC_DIALECTS for op in dialect.operations
               if not op.has_trait(IsTerminator) and op is not tcp.OrderOp}
    return register_impls(type("ShapeOnlyDialectFunctions", (ShapeOnlyFunctions,), methods))(semantics, replay, shared)


REPLAY_TRIES = 5
"""The most iterations a loop whose costs read no values runs before its recorded iterations
are copied, if they can be: three at least (the last is checked against the one before, and
the first may differ, as it starts from values made before the loop), one more for a loop that
passes buffers round (double buffering)."""


LOOP_PERIOD = 8
"""The longest run of iterations a loop whose costs read values may repeat as a whole (two F
tiles alternating, one expert's blocks in a row)."""


class AboveBar(BaseException):
    """A cost-only run stopped: a lower bound on its cycles passed the bar (`LowerBoundBar`). A
    BaseException, so that it unwinds the interpreter as it is: xDSL turns an Exception
    raised inside an op into a diagnostic that prints the whole module, at every op it
    unwinds through."""

    def __init__(self, cycles: float):
        super().__init__(cycles)
        self.cycles = cycles


def least_unit_cycles(cost: OpCost) -> int:
    """The fewest cycles of its engine's units a command keeps busy, however it is scheduled:
    each of its parts takes its own cycles at least on its own unit (a DMA command spread over
    k engines, k <= `parts`: k parts of `part_cycles[k - 1]`; the shared HBM bandwidth only
    lengthens a part; scheduler.py)."""
    if cost.part_cycles:
        return min(k * cycles for k, cycles in enumerate(cost.part_cycles, 1))
    return cost.parts * cost.cycles


class LowerBoundBar:
    """A lower bound on the cycles of a trace's commands, summed as they are recorded, against
    a bar: `check` raises AboveBar once it is above `above`. No schedule of the commands ends
    before the larger of their roofline (`layer_roofline` without the graph's work: every
    FLOP at the peak, every HBM byte at the bandwidth; `checked_roofline`) and the busiest
    unit's cycles: a tensor-unit command runs on its cluster's unit (`pinned_units`), so that
    unit's commands run one after another; the DMA engines (and any other engine of units)
    share their commands' `least_unit_cycles` at best evenly. A run's prefix bound by the
    tensor units (Qwen3-30B-A3B at T = 4096, B = 128: 1.81 M cycles of one cluster's commands
    against 1.19 M of roofline, 1.88 M simulated) thus stops early. The sums only grow, so a
    run stopped there takes more cycles than the bar.

    With `paths` (a mesh chip's bar, `mesh_simulate.MeshBar`), also the longest path through
    the commands: a command starts after the commands it reads (its `deps`; the memory plan
    only adds waits) and, on a unit that runs its commands in issue order (a tensor command's
    cluster unit, the link), after the one before it there, and takes at least
    `least_command_cycles` (a link command its `link_cycles`). A decode step's chunks and
    collectives wait on one another far beyond the weights' HBM time this bound is otherwise
    (Qwen3-30B-A3B ep=8 at 16 a chip: 8 chunks take 288 k cycles, 1 chunk 127 k, their
    roofline 101 k). Unlike the sums, the path depends on the commands' order, so a bound of a
    program before a pass that reorders them (autotune's `cost_only_bound`) takes none."""

    def __init__(self, machine: Machine, above: float, paths: bool = False):
        self.machine, self.above = machine, above
        self.flops = self.fp8_flops = self.hbm_bytes = 0
        self.units = {e: n for e, n in engine_units(machine).items() if n}
        self.busy = dict.fromkeys(self.units, 0)
        """Engine -> its commands' least_unit_cycles, summed."""
        self.pinned = [0] * self.units[TENSOR]
        """Per tensor unit, its one-unit commands' cycles."""
        self.paths = paths
        self.path = 0
        """The longest path's cycles so far (with `paths`)."""
        self._ends: list[int] = []
        """Per command, the earliest cycle it can end (with `paths`)."""
        self._unit_ends: dict[tuple[str, int], int] = {}
        """Per unit that runs its commands in issue order, its last command's earliest end."""
        self._seen = 0

    def link_cycles(self, traced: TracedOp) -> int:
        """The fewest cycles a link command takes: its recorded cost (a mesh chip's bar knows
        its traffic, which the cost leaves to the mesh's schedule)."""
        return least_command_cycles(traced.cost)

    def least(self, trace: Trace) -> float:
        """The bound, with the commands recorded since the last call added."""
        ops, pinned, busy = trace.ops, self.pinned, self.busy
        ends, unit_ends, paths = self._ends, self._unit_ends, self.paths
        for i in range(self._seen, len(ops)):
            t = ops[i]
            cost = t.cost
            self.flops += cost.flops
            self.fp8_flops += cost.fp8_flops
            self.hbm_bytes += cost.hbm_bytes
            engine = cost.engine
            if engine == TENSOR and cost.parts == 1:
                pinned[t.cluster % len(pinned)] += cost.cycles
            if engine in busy:
                busy[engine] += least_unit_cycles(cost)
            if paths:
                ready = max((ends[d] for d in t.deps), default=0)
                unit: tuple[str, int] | None = None
                if engine == LINK:
                    cycles, unit = self.link_cycles(t), (LINK, 0)
                else:
                    cycles = least_command_cycles(cost)
                    if engine == TENSOR and cost.parts == 1:
                        unit = (TENSOR, t.cluster % len(pinned))
                if unit is not None:
                    ready = max(ready, unit_ends.get(unit, 0))
                    unit_ends[unit] = ready + cycles
                ends.append(ready + cycles)
                if ready + cycles > self.path:
                    self.path = ready + cycles
        self._seen = len(ops)
        return max(roofline(self.machine, self.flops, self.hbm_bytes, self.fp8_flops).cycles, max(pinned),
                   *(busy[e] / n for e, n in self.units.items()), self.path)

    def check(self, trace: Trace) -> None:
        least = self.least(trace)
        if least > self.above:
            raise AboveBar(least)


def least_command_cycles(cost: OpCost) -> int:
    """The fewest cycles a command takes, however it is scheduled: a DMA command spread over
    k engines ends with its parts, each taking `part_cycles[k - 1]` at least (the shared HBM
    bandwidth only lengthens a part; scheduler.py)."""
    return min(cost.part_cycles) if cost.part_cycles else cost.cycles


def _index_arithmetic(op: Operation, constants: dict[SSAValue, int], offsets: dict[SSAValue, tuple[int, int]]) -> bool:
    """Whether `op` is a loop's index arithmetic: an integer constant (noted in `constants`) or a
    value of `offsets` plus one (noted there as (scale, constant) of the index)."""
    if isinstance(op, arith.ConstantOp) and isinstance(op.value, IntegerAttr):
        constants[op.result] = op.value.value.data
    elif isinstance(op, arith.AddiOp) and op.lhs in offsets and op.rhs in constants:
        scale, base = offsets[op.lhs]
        offsets[op.result] = (scale, base + constants[op.rhs])
    else:
        return False
    return True


class GuardProbe:
    """Whether an iteration of a `values` loop skips every block it guards, worked out without
    running it. Such a loop's body (an expert or combine loop over the worst case's blocks or
    tiles, of which a routing fills a few) is, at its top level, index arithmetic, slices of
    values made before the loop at the index, guards of those slices and branches on the
    guards whose second region only yields. An iteration whose guards are all false runs
    those ops and the yields alone, whatever its index; if the iteration before it did too and
    passed its arguments on unchanged, it runs exactly the same ops on the same arguments, so
    the interpreter need not run it (`LoopReplay._run_values` takes the one before's ops)."""

    def __init__(self, guards: list[tuple[tile.SliceOp, int, int]]):
        self.guards = guards
        """Each guard's slice, and its offset as (index, constant): the loop index times the
        first plus the second."""

    @staticmethod
    def of(loop: scf.ForOp) -> GuardProbe | None:
        """The probe of `loop`, or None when its body is not of that form."""
        body = loop.body.block
        index = body.args[0]
        constants: dict[SSAValue, int] = {}
        offsets: dict[SSAValue, tuple[int, int]] = {index: (1, 0)}
        slices: set[SSAValue] = set()
        guards: dict[SSAValue, tuple[tile.SliceOp, int, int]] = {}
        found: list[tuple[tile.SliceOp, int, int]] = []
        for op in body.ops:
            if _index_arithmetic(op, constants, offsets):
                pass
            elif isinstance(op, tile.SliceOp):
                if op.operands[1] not in offsets or op.operands[0].owner in body.ops:
                    return None
                slices.add(op.result)
            elif isinstance(op, tile.GuardOp):
                source = op.operands[0].owner
                if op.operands[0] not in slices or not isinstance(source, tile.SliceOp):
                    return None
                guards[op.result] = (source, *offsets[source.operands[1]])
            elif isinstance(op, scf.IfOp):
                second = list(op.false_region.blocks.first.ops) if op.false_region.blocks.first is not None else []
                if op.cond not in guards or [type(o) for o in second] != [scf.YieldOp]:
                    return None
                found.append(guards[op.cond])
            elif not isinstance(op, scf.YieldOp):
                return None
            if any(v in offsets for v in op.operands) and not isinstance(op, (arith.AddiOp, tile.SliceOp)):
                return None  # the index read otherwise than through a slice's offset
        return GuardProbe(found) if found else None

    def skips(self, interpreter: Interpreter, i: int) -> bool:
        """Whether iteration `i` skips every guarded block: each guard's slice at `i` has no
        entry >= 0 (tile.guard's semantics)."""
        for op, scale, base in self.guards:
            (source,) = interpreter.get_values((op.operands[0],))
            if isinstance(source, Lazy):
                source = source.force()
            if is_placeholder(source):
                return False
            if guard_runs(sliced(op, np.asarray(source), scale * i + base)):
                return False
        return True


@dataclass
class _Ran:
    """An iteration of a `values` loop as it ran, for later ones that read the same to take
    (`IterationProbe`): its ops, their signature, and per result it yielded, how an iteration
    that takes it makes that result (`IterationProbe.yields`)."""

    events: list[tuple[bool, Operation, tuple[Any, ...]]]
    signature: tuple[tuple[object, ...], ...]
    kinds: tuple[tuple[Any, ...], ...]
    yielded: tuple[Any, ...]
    carried: tuple[Any, ...]
    """The arguments it started from: kept, so that the placeholders its key names by id live on."""
    ops: int
    """The ops it ran, as listeners count them (`did_skip_ops`)."""


class IterationProbe:
    """What an iteration of a `values` loop reads, worked out without running it, so that an
    iteration reading what an earlier one of the loop's run read takes that one's ops and
    signature instead of being interpreted (`LoopReplay._run_values`). interleave-shared cuts
    the routed loop into pieces of a few iterations each, too few for a template to pay much,
    and the interpreter still runs every iteration a template copies.

    What recording an iteration reads of values is its branches' conditions and what its
    costed ops read of their data operands (TraceRecorder.signature); everything else it sees
    of the ops (their placeholders, by type) is the same every iteration. Where each condition
    is a guard, and each data operand is, of a slice at the index (scaled, plus a constant) of
    a value made before the loop, an iteration argument, or a value made before the loop, those
    reads are worked out from the index and the arguments alone (`key`, which takes the
    branches as the guards decide). Which values are placeholders, and which placeholders,
    follows from which arguments are which placeholders (a symbolic op of a placeholder makes
    one for the op and its operands' sources, `ShapeOnlyFunctions.run_symbolic`), which the key
    also names. So an iteration whose key is an earlier one's runs the same ops, records the
    same commands, and yields the same placeholders; its other results are the index, a slice at
    it, or an argument passed on, each made for it (`yields`), or it is not taken."""

    def __init__(self, loop: scf.ForOp, slices: dict[SSAValue, tuple[tile.SliceOp, int, int]],
                 offsets: dict[SSAValue, tuple[int, int]], inside: set[SSAValue]):
        self.loop = loop
        self.slices = slices
        """Each slice at the index of a value made before the loop: its op and its offset as (scale, constant)."""
        self.offsets = offsets
        """The index and the index arithmetic: each value as (scale, constant) of the index."""
        self.inside = inside
        """The values the body makes (its ops' results, its blocks' arguments)."""
        body = loop.body.block
        self.arguments = {a: n for n, a in enumerate(body.args[1:])}
        self.outside = tuple(dict.fromkeys(v for op in body.walk() for v in op.operands if v not in inside))
        """The values made before the loop that its ops read."""
        self.views: dict[Operation, _SymbolicViews] = {}
        """Each costed op's views (`symbolic_views`), shared by the probes of a run's loops (LoopReplay)."""
        self._outside: dict[SSAValue, Any] = {}
        self._steps: tuple[tuple[Any, ...], ...] | None = None
        self._reads: dict[tuple[Any, ...], tuple[object, ...]] = {}
        """(op, its data operands' bytes) -> what recording it reads (TraceRecorder.reads)."""

    @staticmethod
    def of(loop: scf.ForOp) -> IterationProbe | None:
        """The probe of `loop`, or None when a condition or a data operand is anything else (the class docstring)."""
        body = loop.body.block
        inside: set[SSAValue] = set(body.args)
        for op in body.walk():
            inside.update(op.results)
            for region in op.regions:
                for block in region.blocks:
                    inside.update(block.args)
        offsets: dict[SSAValue, tuple[int, int]] = {body.args[0]: (1, 0)}
        constants: dict[SSAValue, int] = {}
        slices: dict[SSAValue, tuple[tile.SliceOp, int, int]] = {}
        readable = set(body.args[1:])

        def known(v: SSAValue) -> bool:
            return v in slices or v in readable or v not in inside

        def scan(block: Block) -> bool:
            for op in block.ops:
                if _index_arithmetic(op, constants, offsets):
                    pass
                elif isinstance(op, tile.SliceOp) and op.operands[1] in offsets and op.operands[0] not in inside:
                    slices[op.result] = (op, *offsets[op.operands[1]])
                elif isinstance(op, scf.IfOp):
                    guard = op.cond.owner
                    if not isinstance(guard, tile.GuardOp) or not known(guard.operands[0]):
                        return False
                    if not all(scan(b) for region in op.regions for b in region.blocks):
                        return False
                elif op.regions and not is_fused(op):
                    return False
                if _is_symbolic(op) and not all(known(v) for v in data_operands(op)):
                    return False
            return True

        return IterationProbe(loop, slices, offsets, inside) if scan(body) else None

    def start(self, interpreter: Interpreter) -> None:
        """Read the values made before the loop that the key reads (once per run of the loop)."""
        self._outside = dict(zip(self.outside, interpreter.get_values(self.outside)))

    def _value(self, v: SSAValue, i: int, carried: tuple[Any, ...]) -> Any:
        """`v`'s value in iteration `i` from `carried` (a slice, an argument or a value made before the loop)."""
        if v in self.slices:
            op, scale, base = self.slices[v]
            source = self._value(op.operands[0], i, carried)
            return source if is_placeholder(source) else sliced(op, np.asarray(source), scale * i + base)
        value = carried[self.arguments[v]] if v in self.arguments else self._outside[v]
        return value.force() if isinstance(value, Lazy) else value

    def key(self, recorder: TraceRecorder, i: int, carried: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """What iteration `i` from `carried` reads (the class docstring): which arguments are
        which placeholders, and in the order they would run, each branch taken and each costed
        op's reads (TraceRecorder.reads); None when it cannot be worked out (a value it reads is
        a placeholder or out of range: the interpreter then says so)."""
        if self._steps is None:
            self._steps = self._plan(self.loop.body.block, recorder)
        parts: list[Any] = [id(v) if is_placeholder(v) else None for v in carried]
        try:
            if not self._walk(self._steps, recorder, i, carried, {}, parts):
                return None
        except InterpretationError:
            return None
        return tuple(parts)

    def _plan(self, block: Block, recorder: TraceRecorder) -> tuple[tuple[Any, ...], ...]:
        """What `key` works out of `block`'s ops, in order: each branch (the ids its guard reads, the
        steps of either region) and each op whose recording reads values (its data operands and views)."""
        steps: list[tuple[Any, ...]] = []
        for op in block.ops:
            if isinstance(op, scf.IfOp):
                steps.append((op.cond.owner.operands[0], *(  # type: ignore[union-attr]
                    self._plan(region.blocks.first, recorder) if region.blocks.first is not None else ()
                    for region in (op.true_region, op.false_region))))
            elif _is_symbolic(op) and recorder.reads_values(op):
                original = recorder.costed_as(op)  # a clone's views are its original's (cloned_loop_ops)
                views = self.views.get(original) or self.views.setdefault(original, symbolic_views(original))
                steps.append((op, views.data, tuple(op.operands[n] for n in views.data), views.operands, views.results))
        return tuple(steps)

    def _walk(self, steps: tuple[tuple[Any, ...], ...], recorder: TraceRecorder, i: int, carried: tuple[Any, ...],
              values: dict[SSAValue, tuple[Any, bytes] | None], parts: list[Any]) -> bool:
        for step in steps:
            if len(step) == 3:  # a branch
                ids = self._read(step[0], i, carried, values)
                if ids is None:
                    return False
                taken = guard_runs(ids[0])
                parts.append(taken)
                if not self._walk(step[1] if taken else step[2], recorder, i, carried, values, parts):
                    return False
                continue
            op, data, read, operands, results = step
            got = [self._read(v, i, carried, values) for v in read]
            if None in got:
                return False
            seen = (op, *(b for _, b in got))  # type: ignore[misc]
            reads = self._reads.get(seen)
            if reads is None:
                forced = list(operands)
                for n, (value, _) in zip(data, got):  # type: ignore[misc]
                    forced[n] = value
                reads = self._reads[seen] = recorder.reads(op, tuple(forced), results)
            parts.append(reads)
        return True

    def _read(self, v: SSAValue, i: int, carried: tuple[Any, ...],
              values: dict[SSAValue, tuple[Any, bytes] | None]) -> tuple[Any, bytes] | None:
        """`v`'s value in iteration `i` and its bytes, once per iteration; None for a placeholder."""
        if v not in values:
            value = self._value(v, i, carried)
            values[v] = None if is_placeholder(value) else (value, np.ascontiguousarray(value).tobytes())
        return values[v]

    def ran(self, events: list[tuple[bool, Operation, tuple[Any, ...]]], signature: tuple[tuple[object, ...], ...],
            carried: tuple[Any, ...], yielded: tuple[Any, ...]) -> _Ran | None:
        """The iteration that ran `events` from `carried` and yielded `yielded`, for later ones
        to take; None when what it yields cannot be made for another index (`yields`)."""
        ran = {op for will, op, _ in events if will}
        kinds: list[tuple[Any, ...]] = []
        terminator = self.loop.body.block.last_op
        assert terminator is not None
        for value, result in zip(terminator.operands, yielded):
            while isinstance(value.owner, scf.IfOp) and value in self.inside:
                taken = [b.last_op for region in value.owner.regions for b in region.blocks if b.last_op in ran]
                if len(taken) != 1:
                    return None
                value = taken[0].operands[value.index]  # type: ignore[union-attr]
            if value in self.offsets:
                kinds.append(("index", *self.offsets[value]))
            elif value in self.arguments:
                kinds.append(("carried", self.arguments[value]))
            elif value in self.slices and not is_placeholder(result):
                kinds.append(("slice", value))
            elif value not in self.inside or is_placeholder(result) or isinstance(value.owner, arith.ConstantOp):
                kinds.append(("same",))
            else:
                return None
        return _Ran(events, signature, tuple(kinds), yielded, carried, sum(will for will, _, _ in events))

    def yields(self, ran: _Ran, i: int, carried: tuple[Any, ...]) -> tuple[Any, ...]:
        """What iteration `i` from `carried`, whose key is `ran`'s, yields."""
        out: list[Any] = []
        for kind, value in zip(ran.kinds, ran.yielded):
            if kind[0] == "index":
                out.append(kind[1] * i + kind[2])
            elif kind[0] == "carried":
                out.append(carried[kind[1]])
            elif kind[0] == "slice":
                out.append(np.array(self._value(kind[1], i, carried)))
            else:
                out.append(value)
        return tuple(out)


ITERATIONS_KEPT = 64
"""The most iterations of a loop's run that later ones may take (`IterationProbe`)."""


class LoopReplay:
    """Cost-only runs of loops whose iterations record the same commands, moved on by one
    iteration (TraceRecorder.template says when an iteration is such a template).

    - A loop whose body's costs read no values: every iteration is the template's copy once
      its iteration arguments are (the first may not be). It runs until the recorder finds a
      template, up to REPLAY_TRIES iterations, and the recorder copies it for the iterations
      left; the interpreter skips them, as nothing it would compute there is read (no op of
      the body reads a value for its cost, and the loop yields the same placeholders each
      iteration). Listeners other than the recorder see no op of the copied iterations, so a
      run replays only when each of them takes a count instead (`did_skip_ops(count)`, as
      tcpc.progress.Progress does).
    - A loop whose costs read values (an expert loop: a block's expert ids, its guard): every
      iteration runs on the interpreter, which computes those values, but the recorder keeps
      its ops (TraceRecorder.defer) and, if what they read (their `signature`) is the
      template's, records the template's copy instead of working each command out. The
      template may be a run of up to LOOP_PERIOD iterations, copied as a whole when as many
      iterations read what its iterations read, in turn. An iteration that reads otherwise is
      recorded as it ran (with the run's iterations before it), and a later run may become the
      next template.
    """

    def __init__(self, recorder: TraceRecorder, listeners: Sequence[Interpreter.Listener] = (),
                 bar: LowerBoundBar | None = None):
        self.recorder = recorder
        self.listeners = tuple(listeners)
        self.bar = bar
        """Checked after every iteration: a run that cannot win a choice stops in its first loop past the bar."""
        self._kinds: dict[scf.ForOp, str] = {}
        self._probes: dict[scf.ForOp, GuardProbe | None] = {}
        self._readers: dict[scf.ForOp, IterationProbe | None] = {}
        self._views: dict[Operation, _SymbolicViews] = {}

    @staticmethod
    def allowed(listeners: Sequence[Interpreter.Listener]) -> bool:
        """Whether every listener can be told of ops run without it (`did_skip_ops`)."""
        return all(callable(getattr(listener, "did_skip_ops", None)) for listener in listeners)

    def kind(self, loop: scf.ForOp) -> str:
        """`static` when each op of `loop`'s body is costed alike every iteration (a symbolic
        op whose cost reads no value: no data operands, no operand it may skip or pass
        through; a fused chain; the loop's index arithmetic and yield); `values` when its
        costs may read values but an iteration is still worked out from its iteration
        arguments, values made before the loop and what its ops read (no routing recorded,
        no inner loop or call; branches allowed); else `none`."""
        known = self._kinds.get(loop)
        if known is None:
            ops = list(loop.body.block.ops)
            if all(_same_every_iteration(o) for o in ops):
                known = "static"
            elif all(_worked_out_per_iteration(o) for o in ops):
                known = "values"
            else:
                known = "none"
            self._kinds[loop] = known
        return known

    def run(self, interpreter: Interpreter, loop: scf.ForOp, iterations: range,
            loop_args: tuple[Any, ...]) -> tuple[Any, ...]:
        kind = self.kind(loop) if len(iterations) > 3 else "none"
        if kind == "values":
            return self._run_values(interpreter, loop, iterations, loop_args)
        recorder = self.recorder
        start = recorder.mark()
        marks, carried, yielded = [start], [recorder.carried(loop)], [loop_args]
        for n, i in enumerate(iterations):
            if kind == "static" and 3 <= n <= REPLAY_TRIES and _same_placeholders(yielded[-2], yielded[-1]):
                if recorder.repeat(loop, start, tuple(marks[-3:]), tuple(carried[-3:]), len(iterations) - n):
                    ops = (len(iterations) - n) * len(loop.body.block.ops)
                    for listener in self.listeners:
                        listener.did_skip_ops(ops)  # type: ignore[attr-defined]
                    if self.bar is not None:
                        self.bar.check(recorder.trace)
                    return loop_args
            loop_args = interpreter.run_ssacfg_region(loop.body, (i, *loop_args), "for_loop")
            if self.bar is not None:
                self.bar.check(recorder.trace)
            if kind == "static" and n < REPLAY_TRIES:
                marks.append(recorder.mark())
                carried.append(recorder.carried(loop))
                yielded.append(loop_args)
        return loop_args

    def _run_values(self, interpreter: Interpreter, loop: scf.ForOp, iterations: range,
                    loop_args: tuple[Any, ...]) -> tuple[Any, ...]:
        recorder = self.recorder
        start = recorder.mark()
        # Where each iteration recorded began, what it started from and read; the latest ones.
        marks, carried, signatures = [start], [recorder.carried(loop)], [()]
        template: LoopTemplate | None = None
        period = copies = 0
        pending: list[list[tuple[bool, Operation, tuple[Any, ...]]]] = []
        """The iterations since the last copy, whose signatures match the template's so far."""
        if loop not in self._probes:
            self._probes[loop] = GuardProbe.of(loop)
        probe = self._probes[loop]
        if loop not in self._readers:
            self._readers[loop] = IterationProbe.of(loop)
        reads = self._readers[loop]
        if reads is not None:
            reads.views = self._views
            reads.start(interpreter)
        taken: dict[tuple[Any, ...], _Ran] = {}
        """The iterations interpreted, by what they read (IterationProbe.key)."""
        skipped: tuple[list[tuple[bool, Operation, tuple[Any, ...]]], tuple[tuple[object, ...], ...]] | None = None
        """The ops and signature of the iteration before, when it skipped every block and passed its arguments on."""
        for i in iterations:
            skips = probe is not None and probe.skips(interpreter, i)
            if skips and skipped is not None:  # the same ops on the same arguments (GuardProbe)
                events, signature = skipped
                for listener in self.listeners:
                    listener.did_skip_ops(sum(will for will, _, _ in events))  # type: ignore[attr-defined]
            else:
                before = loop_args
                key = reads.key(recorder, i, before) if reads is not None else None
                earlier = taken.get(key) if key is not None else None
                if earlier is not None:  # it reads what `earlier` read (IterationProbe)
                    assert reads is not None
                    events, signature = earlier.events, earlier.signature
                    loop_args = reads.yields(earlier, i, before)
                    for listener in self.listeners:
                        listener.did_skip_ops(earlier.ops)  # type: ignore[attr-defined]
                else:
                    recorder.defer()
                    loop_args = interpreter.run_ssacfg_region(loop.body, (i, *loop_args), "for_loop")
                    events = recorder.deferred()
                    signature = recorder.signature(events)
                    if key is not None and reads is not None and len(taken) < ITERATIONS_KEPT:
                        ran = reads.ran(events, signature, before, loop_args)
                        if ran is not None:
                            taken[key] = ran
                passed_on = len(before) == len(loop_args) and all(a is b for a, b in zip(before, loop_args))
                skipped = (events, signature) if skips and passed_on else None
            if template is not None:
                if signature == template.signature[len(pending)]:
                    pending.append(events)
                    if len(pending) == period:
                        copies += 1
                        template.append(copies)
                        pending = []
                        if self.bar is not None:
                            self.bar.check(recorder.trace)
                    continue
                template.finish(copies)  # where the copies left the recorder, to record the rest from
                template, copies = None, 0
                marks, carried, signatures = [recorder.mark()], [recorder.carried(loop)], [()]
                for kept in pending:
                    self._record(loop, kept, recorder.signature(kept), marks, carried, signatures)
                pending = []
            self._record(loop, events, signature, marks, carried, signatures)
            if self.bar is not None:
                self.bar.check(recorder.trace)
            for p in range(1, LOOP_PERIOD + 1):  # the shortest run of iterations that repeats
                if len(marks) > 2 * p and signatures[-p:] == signatures[-2 * p:-p]:
                    template = recorder.template(loop, start, (marks[-2 * p - 1], marks[-p - 1], marks[-1]),
                                                 (carried[-2 * p - 1], carried[-p - 1], carried[-1]))
                    if template is not None:
                        template.signature = tuple(signatures[-p:])
                        period = p
                        break
        if template is not None:
            template.finish(copies)
            for kept in pending:  # a run cut short by the loop's end
                recorder.record(kept)
        return loop_args

    def _record(self, loop: scf.ForOp, events: list[tuple[bool, Operation, tuple[Any, ...]]],
                signature: tuple[tuple[object, ...], ...], marks: list[tuple[int, int]],
                carried: list[list[Any]], signatures: list[tuple[tuple[object, ...], ...]]) -> None:
        """Record one iteration's ops as they ran, and note where it ended and what it read
        (the latest 2 * LOOP_PERIOD + 1 such notes)."""
        self.recorder.record(events)
        marks.append(self.recorder.mark())
        carried.append(self.recorder.carried(loop))
        signatures.append(signature)
        if len(marks) > 2 * LOOP_PERIOD + 1:
            del marks[0], carried[0], signatures[0]


def _same_every_iteration(op: Operation) -> bool:
    if op.name in UNTRACED and not op.regions and not isinstance(op, func.CallOp):
        return True  # the index arithmetic and the yield
    if not _is_symbolic(op) or (op.regions and not is_fused(op)):
        return False
    return not data_operands(op) and unread_operands(op) is None and forwarded_operand(op) is None


def _worked_out_per_iteration(op: Operation) -> bool:
    if isinstance(op, scf.IfOp):
        return all(_worked_out_per_iteration(o) for region in op.regions for block in region.blocks for o in block.ops)
    if op.name in UNTRACED and not op.regions and not isinstance(op, func.CallOp):
        return True
    if not _is_symbolic(op) or (op.regions and not is_fused(op)):
        return False
    return expert_indices(op) is None


def _same_placeholders(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two iterations yielded the same placeholders (so every later one does too)."""
    return len(a) == len(b) and all(x is y and is_placeholder(x) for x, y in zip(a, b))


@dataclass(frozen=True)
class _SymbolicViews:
    """What the listeners see of one symbolic op, the same every time it runs: a placeholder
    for each operand (None where the cost reads the value) and for each result."""

    data: tuple[int, ...]
    operands: tuple[Any, ...]
    results: tuple[Any, ...]


def symbolic_views(op: Operation) -> _SymbolicViews:
    operands = list(op.operands)
    read = set(data_operands(op))
    data = tuple(i for i, v in enumerate(operands) if v in read)
    return _SymbolicViews(data, tuple(None if i in data else placeholder(v.type) for i, v in enumerate(operands)),
                          tuple(placeholder(r.type) for r in op.results))


class ShapeOnlyListener(Interpreter.Listener):
    """Shows the listeners, for each symbolic op, forced values of its data operands and
    placeholders for everything else, so a cost function can never read a value that was not
    computed; other ops (calls, returns, loops) they see as they are."""

    def __init__(self, listeners: Sequence[Interpreter.Listener], shared: SharedViews | None = None):
        self.listeners = tuple(listeners)
        self._views = (shared or SharedViews()).views
        self._reading: list[tuple[_Thunk, ...]] = []
        """Per op running (nested ops inside), the thunks whose results it reads (`_Thunk.read_by`)."""

    def _views_of(self, op: Operation) -> _SymbolicViews | None:
        views = self._views.get(op, _UNKNOWN)
        if views is not _UNKNOWN:
            return views  # type: ignore[return-value]
        views = symbolic_views(op) if _is_symbolic(op) else None
        self._views[op] = views
        return views

    def will_interpret_op(self, op: Operation, args: tuple[Any, ...]) -> None:
        self._reading.append(tuple(a.thunk for a in args if isinstance(a, Lazy)))
        views = self._views_of(op)
        if views is not None:
            args = _forced(op, views, args) if views.data else views.operands
        for listener in self.listeners:
            listener.will_interpret_op(op, args)

    def did_interpret_op(self, op: Operation, results: tuple[Any, ...]) -> None:
        views = self._views_of(op)
        if views is not None:
            results = views.results
        for listener in self.listeners:
            listener.did_interpret_op(op, results)
        for thunk in self._reading.pop():
            thunk.read_by(op)


def _forced(op: Operation, views: _SymbolicViews, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The op's operand views with its data operands' values computed."""
    forced = list(views.operands)
    for i in views.data:
        value = inputs[i]
        if is_placeholder(value):
            raise CostOnlyError(
                f"the cost of {_describe(op)} depends on the values of its operand {_name(op.operands[i])}, "
                f"which is computed from input(s) {', '.join(sorted(value.sources)) or '?'}; cost-only mode "
                "has values only for routing arguments (tcpc.routing_experts; the pin-routing pass makes "
                "one of each moe.scatter's expert indices)")
        forced[i] = value.force() if isinstance(value, Lazy) else value
    return tuple(forced)


def shape_only_interpreter(module: ModuleOp, listeners: Sequence[Interpreter.Listener] = (),
                           replay: LoopReplay | None = None, shared: SharedViews | None = None) -> Interpreter:
    """xDSL's interpreter with the symbolic dialects' ops run shape-only (public API only:
    the real semantics registered first, the symbolic ones over them with override=True);
    with `replay`, its loops as LoopReplay runs them."""
    interpreter = make_interpreter(module, [ShapeOnlyListener(listeners, shared)])
    interpreter.register_implementations(shape_only_functions(make_interpreter(module), replay, shared), override=True)
    return interpreter


def _name(value: Any) -> str:
    return f"%{value.name_hint}" if getattr(value, "name_hint", None) else "(unnamed)"


def _describe(op: Operation) -> str:
    names = [f"%{r.name_hint}" for r in op.results if r.name_hint]
    return f"{', '.join(names)} = {op.name}" if names else op.name


def routing_inputs(fn: func.FuncOp, routing: str | Path = DEFAULT_SCENARIO, seed: int = 0) -> dict[int, Routing]:
    """Argument index -> the scenario's [T, K] expert choices, for every routing argument."""
    values: dict[int, Routing] = {}
    for index, experts in routing_arguments(fn).items():
        t = fn.function_type.inputs.data[index]
        assert isinstance(t, TensorType)
        shape = shape_of(t)
        if len(shape) != 2:
            raise CostOnlyError(f"routing argument {index} is {t}, not [T, K]")
        values[index] = Routing(str(routing), experts, scenario_choices(routing, shape[0], shape[1], experts, seed))
    return values


def arg_names(fn: func.FuncOp) -> list[str]:
    return [f"%{a.name_hint}" if a.name_hint else f"%arg{i}" for i, a in enumerate(fn.body.blocks.first.args)]


def simulate_cost_only(module: ModuleOp, function: str, machine: Machine | None = None, *,
                       routing: str | Path = DEFAULT_SCENARIO, seed: int = 0,
                       sram_policy: SramPolicy = DEFAULT_SRAM_POLICY, uncosted: UncostedPolicy = "error",
                       listeners: Sequence[Interpreter.Listener] = (), work: GraphWork | None = None) -> SimResult:
    """Simulate `function` without values: routing arguments from the scenario `routing`
    (`seed` for `skewed`), every other argument a placeholder. The result has no outputs;
    `routing` maps each routing argument's name to the Routing used. `work` is the graph-level
    program's (graph_work.py), for the roofline's useful FLOPs."""
    machine = machine or default_machine()
    with without_gc_pauses():
        trace, routings = _record(module, function, machine, routing, seed, uncosted, listeners)
        report, sched = simulate_trace(trace, machine, sram_policy, work=work)
    return SimResult((), report, sched, cost_only=True, routing=routings, trace=trace)


@dataclass
class CostOnlyRun:
    """A cost-only run without its report (`cost_only_run`): its cycles, and its trace, memory
    plan and schedule if they were kept."""

    cycles: int
    trace: Trace | None = None
    plan: MemoryPlan | None = None
    schedule: Schedule | None = None
    routing: dict[str, Routing] = field(default_factory=dict)
    """Routing argument name -> the Routing used."""
    bound: bool = False
    """True when `cycles` is not simulated but a lower bound (`LowerBoundBar`), which was
    above the `bound_above` asked for (`cost_only_run`)."""
    spills: int = 0
    """Buffers the memory plan spilled or streamed through HBM (0 for a bound): a schedule
    whose buffers do not all fit SRAM."""

    def result(self, machine: Machine, sram_policy: SramPolicy = DEFAULT_SRAM_POLICY,
               work: GraphWork | None = None) -> SimResult:
        """What `simulate_cost_only` gives for the same run (simulated with `sram_policy`);
        `work` as there."""
        assert self.trace is not None and self.plan is not None and self.schedule is not None, "a run kept"
        with without_gc_pauses():  # a record per command, as simulate_cost_only's report
            report = trace_report(self.trace, machine, sram_policy, self.plan, self.schedule, work)
        return SimResult((), report, self.schedule, cost_only=True, routing=self.routing, trace=self.trace)


def cost_only_run(module: ModuleOp, function: str, machine: Machine | None = None, *,
                  routing: str | Path = DEFAULT_SCENARIO, seed: int = 0,
                  sram_policy: SramPolicy = DEFAULT_SRAM_POLICY, keep_below: float = 0,
                  bound_above: float = math.inf) -> CostOnlyRun:
    """The total cycles `simulate_cost_only` reports (and the same errors), without the
    report: what the cost model's choices compare (tcpc/autotune.py). The trace, plan and
    schedule are kept when the run takes fewer cycles than `keep_below` (a report can then be
    made of them: CostOnlyRun.result); else everything the run made is dropped before
    Python's cycle collector runs again, which would otherwise scan it all once.

    A choice needs no more of an alternative than that it takes more cycles than the best one
    so far, `bound_above`: once a lower bound on the cycles of the commands recorded so far
    (`LowerBoundBar`: their roofline, their busiest unit's cycles) is above it, checked after
    every loop iteration and at the end, the run stops (no more recording, no memory plan, no
    schedule), and its `cycles` are that bound, rounded up (`bound` set)."""
    machine = machine or default_machine()

    def run() -> CostOnlyRun:
        bar = LowerBoundBar(machine, bound_above) if bound_above < math.inf else None
        recorded = _record_below(module, function, machine, routing, seed, bar)
        if isinstance(recorded, int):
            return CostOnlyRun(recorded, bound=True)
        trace, routings = recorded
        plan, sched = plan_and_schedule(trace, machine, sram_policy)
        checked_roofline(machine, trace, None, sched.makespan)
        assert bar is None or sched.makespan >= bar.least(trace), "a schedule below the bar's lower bound"
        spills = len(plan.spills) + len(plan.streams)
        if sched.makespan < keep_below:
            return CostOnlyRun(sched.makespan, trace, plan, sched, routings, spills=spills)
        return CostOnlyRun(sched.makespan, spills=spills)

    with without_gc_pauses():
        return run()


def cost_only_bound(module: ModuleOp, function: str, machine: Machine, above: float, *,
                    routing: str | Path = DEFAULT_SCENARIO, seed: int = 0) -> int | None:
    """`cost_only_run`'s bound when it stops above `above` (recording only as far as that); None
    when the whole run's bound (`LowerBoundBar`) is not above it, having recorded it all and
    planned nothing. A program whose commands another one only reorders has their bound: the
    cost model bounds a candidate before the last pass that reorders them (tcpc/autotune.py)."""
    with without_gc_pauses():
        recorded = _record_below(module, function, machine, routing, seed, LowerBoundBar(machine, above))
        return recorded if isinstance(recorded, int) else None


def _record_below(module: ModuleOp, function: str, machine: Machine, routing: str | Path, seed: int,
                  bar: LowerBoundBar | None) -> tuple[Trace, dict[str, Routing]] | int:
    """`_record`'s trace and routing, or the bound, rounded up, at which the run passed `bar`."""
    try:
        trace, routings = _record(module, function, machine, routing, seed, "error", (), bar)
        if bar is not None:
            bar.check(trace)
    except AboveBar as stop:
        return math.ceil(stop.cycles)
    return trace, routings


def cost_only_cycles(module: ModuleOp, function: str, machine: Machine | None = None, *,
                     routing: str | Path = DEFAULT_SCENARIO, seed: int = 0,
                     sram_policy: SramPolicy = DEFAULT_SRAM_POLICY) -> int:
    """`cost_only_run`'s cycles, nothing kept."""
    return cost_only_run(module, function, machine, routing=routing, seed=seed, sram_policy=sram_policy).cycles


def _record(module: ModuleOp, function: str, machine: Machine, routing: str | Path, seed: int,
            uncosted: UncostedPolicy, listeners: Sequence[Interpreter.Listener],
            bar: LowerBoundBar | None = None) -> tuple[Trace, dict[str, Routing]]:
    """Run `function` shape-only with the routing scenario: its trace, and the routing used
    by each routing argument's name. `bar` stops it in a loop (LoopReplay)."""
    recorder = trace_recorder(module, function, machine, uncosted)
    entry = function_named(module, function)
    chosen = routing_inputs(entry, routing, seed)
    names = arg_names(entry)
    args = [chosen[i].choices if i in chosen else placeholder(t, frozenset([names[i]]))
            for i, t in enumerate(entry.function_type.inputs.data)]
    replay = LoopReplay(recorder, listeners, bar) if LoopReplay.allowed(listeners) else None
    shape_only_interpreter(module, [recorder, *listeners], replay).call_op(function, tuple(args))
    return recorder.trace, {names[i].lstrip("%"): c for i, c in chosen.items()}
