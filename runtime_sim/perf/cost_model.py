"""The cost model's plumbing: what a cost is, which engine runs an op, and the registry of
cost functions.

A cost function is registered per op name and sees the op, its runtime operand and result
values and the machine, so a cost may depend on data (a guarded contraction skips blocks, a
gather skips index -1 rows). The formulas themselves live next to their sources:
`tcp_cost.py` (contraction, DMA) and `vector_cost.py` (the vector-engine chain), which
`ve_cost.py` applies to every `ve` op.

Engines (docs/hardware.md#pes-clusters-and-slices): `tensor`, the chain Fetch -> Contraction ->
Vector -> ... -> Commit; all slices of the cluster run it in lockstep and a command occupies
the whole chain, so it is one unit per cluster (a command is pinned to its op's `tcpc.cluster`). `dma` has one unit per DMA engine; a command runs on one
engine (the book's worked figures, 628 cycles for 16 KB HBM -> HBM, are one command on one engine), or, when it moves more
than the machine's `dma.split_bytes`, is spread over several (`OpCost.parts`, see tcp_cost.py). `none` is for ops that do
no work (views, the splat constants the loader places, returns): zero cycles, no unit.

Graph-level ops (tmath, moe) have no cost function: the simulator costs lowered IR. An op
without one stops the simulation before it runs, with the names of every such op
(NotLoweredError), unless the caller asks for them to be reported as free.

What a cost function may read: the shapes and dtypes of every operand and result, and the
*values* only of the operands its op declares with `register_data_operands` (a gather's
indices, a contraction's guard). Cost-only mode (cost_only.py) relies on this: it computes
exactly those operands and hands every other value over as a shape-only placeholder.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from xdsl.dialects import func, scf
from xdsl.ir import Block, BlockArgument, Operation, SSAValue

from dialects import tile
from dialects.annotations import expert_indices, placed_in_hbm
from target.machine import Machine

TENSOR = "tensor"
DMA = "dma"
NONE = "none"
LINK = "link"
"""A chip's link to the other chips of a mesh (ccl collectives; runtime_sim/perf/ccl_cost.py):
not an engine of the single-chip machine, so only a mesh simulation schedules it."""


def engine_units(machine: Machine) -> dict[str, int | None]:
    """Engine -> how many commands it runs at once (None: unlimited, zero-cost ops)."""
    return {TENSOR: machine.clusters, DMA: machine.dma_engines, NONE: None}


@dataclass(frozen=True)
class OpCost:
    """What one execution of an op costs on the machine.

    `bytes_moved` is the payload the op reads and writes (its SRAM or DMA traffic);
    `hbm_bytes` the part that crosses the HBM interface, in whole requests; `bound` names
    the term of the formula that set `cycles` (compute, fetch, dma startup, hbm, ...).
    `result_bytes` (DMA commands) is the part of `bytes_moved` written into the result, the
    rest being read: a gather that reuses a repeated row writes it once.
    """

    engine: str
    cycles: int
    bytes_moved: int = 0
    hbm_bytes: int = 0
    flops: int = 0
    bound: str = ""
    result_bytes: int | None = None
    parts: int = 1
    """Units of its engine the command occupies: a large DMA command is spread over several
    DMA engines (tcp_cost.dma_parts), its parts running in parallel. For a DMA command,
    `cycles` is its time while no other command moves HBM data (the scheduler shares HBM
    between the commands in flight: tcp_cost.py)."""
    part_cycles: tuple[int, ...] = ()
    """A DMA command's parts' cycles, each on its own engine, spread over 1, 2, ..., `parts`
    engines, for the scheduler to spread it over fewer when not all are free; empty: not a DMA
    command."""
    part_hbm_bytes: tuple[int, ...] = ()
    """The HBM bytes of each of those parts (over 1, 2, ..., `parts` engines): what it asks of
    the HBM bandwidth the DMA engines share; empty: it moves none."""
    fp8_flops: int = 0
    """The part of `flops` done on fp8 operand pairs, whose peak is the fp8 rate."""


def flop_cycles(machine: Machine, flops: int, fp8_flops: int = 0) -> float:
    """The fewest cycles the tensor unit needs for `flops`, `fp8_flops` of them at the fp8 peak."""
    return (flops - fp8_flops) / machine.peak_flops_per_cycle + fp8_flops / (2 * machine.peak_fp8_macs_per_cycle)


CostFn = Callable[[Operation, tuple[Any, ...], tuple[Any, ...], Machine], OpCost]
"""fn(op, operand values, result values, machine) -> OpCost."""

_COSTS: dict[str, CostFn] = {}
_VIEWS: set[str] = set()
_UNBUFFERED: set[str] = set()
_FUSED: set[str] = set()
_DATA_OPERANDS: dict[str, Callable[[Operation], tuple[SSAValue, ...]]] = {}
_ORDER_OPERANDS: dict[str, Callable[[Operation], tuple[SSAValue, ...]]] = {}
_ALIASES: dict[str, int] = {}
_DISJOINT_STORES: set[str] = set()
_UNREAD: dict[str, Callable[[Operation, tuple[Any, ...]], tuple[int, ...]]] = {}
_FORWARDED: dict[str, Callable[[Operation, tuple[Any, ...]], int | None]] = {}
_COST_KEYS: dict[str, Callable[[Operation, tuple[Any, ...]], Hashable]] = {}


class NotLoweredError(Exception):
    """The IR holds ops the simulator cannot cost (graph-level ops): lower it first."""


class CostModelError(Exception):
    """A cost function returned a cost that breaks the machine's limits (a bug in it)."""


def _op_name(op: type[Operation] | str) -> str:
    return op if isinstance(op, str) else op.name


def register_cost(*ops: type[Operation] | str) -> Callable[[CostFn], CostFn]:
    """Decorator: `fn` costs every op named (by class or by name). Registering a name twice
    replaces the earlier function, so a refined model can override a rough one."""

    def decorate(fn: CostFn) -> CostFn:
        for op in ops:
            _COSTS[_op_name(op)] = fn
        return fn

    return decorate


def register_view(*ops: type[Operation] | str) -> None:
    """Ops whose result is operand 0's buffer seen with another shape: free, and the memory
    plan treats the result as the same buffer (no new SRAM)."""
    for op in ops:
        name = _op_name(op)
        _VIEWS.add(name)
        _ALIASES[name] = 0
        _COSTS[name] = free_cost


def register_alias(op: type[Operation] | str, operand: int) -> None:
    """`op`'s result is the buffer of its operand number `operand` (a tile written into a
    buffer in place, a slice of a tensor): the memory plan gives it no new space, and it lives
    where that operand lives. Its cost is registered separately."""
    _ALIASES[_op_name(op)] = operand


def register_unread_operands(op: type[Operation] | str,
                             operands: Callable[[Operation, tuple[Any, ...]], tuple[int, ...]]) -> None:
    """Declare that `op`, run on some operand values, does not touch some operands at all:
    `operands(op, values)` gives their indices, which the op then neither waits for nor keeps
    alive (a weight load that fetches a new expert does not read the previous expert's tile)."""
    _UNREAD[_op_name(op)] = operands


def register_forwarded_operand(op: type[Operation] | str,
                               operand: Callable[[Operation, tuple[Any, ...]], int | None]) -> None:
    """Declare that `op`, run on some operand values, passes one operand through unchanged as
    its result (a reused weight tile): `operand(op, values)` gives its index, or None when it
    does not. The op then neither waits for that operand nor reads it; its readers wait for
    what made it, and it stays in that operand's buffer."""
    _FORWARDED[_op_name(op)] = operand


def forwarded_operand(op: Operation) -> Callable[[Operation, tuple[Any, ...]], int | None] | None:
    return _FORWARDED.get(op.name)


def unread_operands(op: Operation) -> Callable[[Operation, tuple[Any, ...]], tuple[int, ...]] | None:
    return _UNREAD.get(op.name)


def register_disjoint_store(op: type[Operation] | str) -> None:
    """Declare that `op` (aliased to its destination, see `register_alias`) writes a part of
    the destination that no other op of the same chain of stores writes (a tile at its own
    offset): it need not wait for the chain's earlier stores, only for what made the buffer;
    a reader of the chain's result waits for every store of it."""
    _DISJOINT_STORES.add(_op_name(op))


def stores_disjointly(op: Operation) -> bool:
    return op.name in _DISJOINT_STORES


def register_order_operands(op: type[Operation] | str, operands: Callable[[Operation], tuple[SSAValue, ...]]) -> None:
    """Declare operands that only order `op` after their producers (double buffering's waits):
    the op reads no data from them, so they do not keep a buffer alive."""
    _ORDER_OPERANDS[_op_name(op)] = operands


def register_unbuffered(*ops: type[Operation] | str) -> None:
    """Ops that are free and whose result needs no buffer: a splat that rides in an operand's
    constant slot, or a static table of one line that consumers fetch with zero strides.
    The memory plan gives their results no SRAM."""
    for op in ops:
        name = _op_name(op)
        _UNBUFFERED.add(name)
        _COSTS[name] = free_cost


def register_fused(*ops: type[Operation] | str) -> None:
    """Ops costed as ONE command together with everything in their regions (a `ve.chain`):
    the simulator costs the op and records nothing for the ops it runs inside."""
    for op in ops:
        _FUSED.add(_op_name(op))


def is_fused(op: Operation) -> bool:
    return op.name in _FUSED


def register_data_operands(op: type[Operation] | str, operands: Callable[[Operation], tuple[SSAValue, ...]]) -> None:
    """Declare the operands whose runtime *values* `op`'s cost function reads (all others it
    may read only for shape and dtype)."""
    _DATA_OPERANDS[_op_name(op)] = operands


def register_cost_key(op: type[Operation] | str, key: Callable[[Operation, tuple[Any, ...]], Hashable]) -> None:
    """Declare what of its data operands' values (in `data_operands` order) `op`'s cost reads,
    when that is less than the values: key(op, values) equal for two runs of the op means
    equal costs. A loop's guarded command is then costed once per kind of block (run or
    skipped) rather than once per expert id (op_trace.py's cost cache)."""
    _COST_KEYS[_op_name(op)] = key


def cost_key(op: Operation) -> Callable[[Operation, tuple[Any, ...]], Hashable] | None:
    return _COST_KEYS.get(op.name)


def guard_signs(op: Operation, values: tuple[Any, ...]) -> Hashable:
    """A cost key (`register_cost_key`) for a command whose cost reads of its guards only
    which entries are negative (the blocks it skips)."""
    signs = [np.asarray(v) >= 0 for v in values]
    return tuple((s.shape, s.tobytes()) for s in signs)


def order_operands(op: Operation) -> tuple[SSAValue, ...]:
    fn = _ORDER_OPERANDS.get(op.name)
    return fn(op) if fn is not None else ()


def aliased_operand(op: Operation) -> int | None:
    """The operand whose buffer `op`'s result is (views, in-place stores), or None."""
    return _ALIASES.get(op.name)


def data_operands(op: Operation) -> tuple[SSAValue, ...]:
    """The operands whose values `op`'s cost depends on (empty for most ops), and a routing's
    expert choices where lower-routing marks them (`tcpc.expert_indices`): the trace records
    them, the routed pairs the roofline counts (graph_work.py)."""
    fn = _DATA_OPERANDS.get(op.name)
    operands = fn(op) if fn is not None else ()
    if expert_indices(op) is not None:
        operands = (*operands, op.operands[0])
    return operands


_T = TypeVar("_T")


def per_op(fn: Callable[[Operation, Machine], _T]) -> Callable[[Operation, Machine], _T]:
    """`fn(op, machine)` worked out once per op and machine (and again if the op changed: its
    operand and result types, properties or attributes), for the part of a cost that reads no
    values: a cost function that reads values runs again for each value its op meets (a
    guarded contraction in a loop, for each block's guard), and this part need not."""
    known: weakref.WeakKeyDictionary[Operation, tuple[tuple[object, ...], _T]] = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def once(op: Operation, machine: Machine) -> _T:
        key = (machine, tuple(op.properties.items()), tuple(op.attributes.items()),
               tuple(v.type for v in op.operands), tuple(r.type for r in op.results))
        kept = known.get(op)
        if kept is not None and kept[0] == key:
            return kept[1]
        value = fn(op, machine)
        known[op] = (key, value)
        return value

    return once


def free_cost(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    return OpCost(NONE, 0, bound="free")


def not_costed(op: Operation, operands: tuple[Any, ...], results: tuple[Any, ...], machine: Machine) -> OpCost:
    return OpCost(NONE, 0, bound="not costed: lower it first")


def cost_function(op: Operation) -> CostFn | None:
    return _COSTS.get(op.name)


def is_view(op: Operation) -> bool:
    return op.name in _VIEWS


def is_unbuffered(op: Operation) -> bool:
    return op.name in _UNBUFFERED


def costed_op_names() -> set[str]:
    """Names of every op with a registered cost function."""
    return set(_COSTS)


def register_builtin_costs() -> None:
    """Control flow does no work; the splat constants of tmath are data the loader places in
    memory; a reshape is a view."""
    register_cost(func.ReturnOp, func.CallOp, "tmath.constant")(free_cost)
    register_view("tmath.reshape")
    # A static loop is the sequencer's: its index arithmetic and its yield do no engine work
    # (an assumption: the book gives no per-iteration cost of a static loop). A branch costs
    # its condition (`tile.guard`, costed on its own) and nothing more.
    register_cost(*LOOP_OPS)(free_cost)

LOOP_OPS: tuple[str, ...] = ("scf.for", "scf.if", "scf.yield", "arith.constant", "arith.addi", "arith.muli")
"""The control ops of the schedule level's static loops and of its guarded block bodies."""

UNTRACED = {func.ReturnOp.name, func.CallOp.name, *LOOP_OPS}
"""Ops that only pass values along: the simulator follows them but lists no row for them."""


def uncosted_ops(ops: Iterable[Operation]) -> Counter[str]:
    """Names (with counts) of the ops under `ops` that have no cost function."""
    missing: Counter[str] = Counter()
    for top in ops:
        for op in top.walk():
            if isinstance(op, func.FuncOp):
                continue
            if op.name not in _COSTS:
                missing[op.name] += 1
    return missing


def require_lowered(ops: Iterable[Operation]) -> None:
    missing = uncosted_ops(ops)
    if missing:
        names = ", ".join(f"{name} (x{n})" if n > 1 else name for name, n in sorted(missing.items()))
        raise NotLoweredError(f"cannot simulate ops that have no cost model; lower them first: {names}")


def in_hbm(value: SSAValue) -> bool:
    """Where the memory plan keeps a value: function arguments (the layer's inputs and
    weights), stored values and what the compiler placed in HBM (`tcpc.space = "hbm"`, an HBM
    `tile.buffer`) are in HBM; views and in-place stores are where their buffer is; a loop's
    iteration argument is where its initial value is; everything else an op produces is in
    SRAM."""
    while True:
        if isinstance(value, BlockArgument):
            block: Block = value.block
            parent = block.parent_op()
            if isinstance(parent, scf.ForOp) and value.index > 0:
                value = parent.iter_args[value.index - 1]
                continue
            return isinstance(parent, func.FuncOp)
        owner = value.owner
        if not isinstance(owner, Operation):
            return False
        alias = aliased_operand(owner)
        if alias is not None:
            value = owner.operands[alias]
            continue
        if isinstance(owner, scf.ForOp):
            value = owner.iter_args[owner.results.index(value)]
            continue
        if isinstance(owner, scf.IfOp):  # where the taken branch's value is: the then branch's
            value = owner.true_region.block.last_op.operands[owner.results.index(value)]  # type: ignore[union-attr]
            continue
        if isinstance(owner, tile.BufferOp):
            return owner.space.data == "hbm"
        return owner.name == "tcp.store" or placed_in_hbm(owner)


def check_cost(op: Operation, cost: OpCost, machine: Machine) -> None:
    """Every cost must respect the peaks the roofline uses, so that the simulated time can
    never fall below the roofline: FLOPs only on the tensor unit (one command at a time) and
    no faster than its peak; HBM bytes only on DMA engines, no faster than HBM bandwidth even
    alone (the scheduler keeps the commands in flight together within it)."""
    units = {**engine_units(machine), LINK: 1}
    if cost.engine not in units:
        raise CostModelError(f"{op.name}: unknown engine '{cost.engine}' (engines: {', '.join(units)})")
    limit = units[cost.engine]
    if cost.parts < 1 or (cost.parts > 1 and (limit is None or cost.parts > limit)):
        raise CostModelError(f"{op.name}: {cost.parts} parts on '{cost.engine}', which has {limit} units")
    if cost.cycles < 0 or cost.flops < 0 or cost.hbm_bytes < 0 or cost.bytes_moved < 0:
        raise CostModelError(f"{op.name}: negative cost {cost}")
    if cost.flops and (cost.engine != TENSOR or flop_cycles(machine, cost.flops, cost.fp8_flops) > cost.cycles):
        raise CostModelError(f"{op.name}: {cost.flops} FLOPs in {cost.cycles} cycles on '{cost.engine}' exceeds the tensor unit's peak")
    for name, by_parts in (("part cycles", cost.part_cycles), ("part HBM bytes", cost.part_hbm_bytes)):
        if by_parts and (cost.engine != DMA or len(by_parts) != cost.parts):
            raise CostModelError(f"{op.name}: {name} {by_parts} are not a DMA command's on 1 to {cost.parts} engines")
    if cost.hbm_bytes and (cost.engine != DMA or cost.hbm_bytes > cost.cycles * machine.hbm_bytes_per_cycle):
        raise CostModelError(f"{op.name}: {cost.hbm_bytes} HBM bytes in {cost.cycles} cycles on '{cost.engine}' "
                             f"exceeds HBM bandwidth")
