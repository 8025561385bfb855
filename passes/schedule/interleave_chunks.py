"""`interleave-chunks`: the work between a chunked mesh chip's expert loops spread into them.

shard-experts issues a chunked chip's stages software-pipelined (docs/mesh.md, Chunks): between
chunk i's expert loop and chunk i+1's stand chunk i+1's receive (its routing), chunk i's combine
and the start of its return, chunk i+2's dispatch and chunk i-1's home sum. Engines issue their
commands in program order and never back-fill a unit (runtime_sim/perf/scheduler.py), so the
next expert loop waited for all of them: the combine's gathers of the blocks' rows took every
DMA engine, the loop's first token gather and weight loads queued behind them, and the tensor
units, whose contractions are the chip's critical work at prefill, stood still meanwhile.

Last at the schedule level (after interleave-shared), on a chunked chip (`ccl.chunks`) whose
routed loops are whole and that gathers no tokens over sp (`_gathers_over_sp`), this pass cuts each chunk's expert loop at block boundaries a quarter
and three quarters through the blocks a routing balanced over the chips fills (the chunk's
pairs over B, `_filled`; rounded to whole rounds of the clusters, which take blocks in turn),
with interleave-shared's `split`, and moves the ops between loops i and i+1:

- those loop i+1 reads (its receive) and do not read loop i, and the next chunk's dispatch,
  before loop i's last quarter: its routing and its first token gather are done when loop i
  ends, and the dispatch's all-to-alls start a quarter loop earlier;
- the rest (chunk i's combine and return, chunk i-1's home sum) after loop i+1's first
  quarter, under whose contractions the combine's gathers run;
- after the last loop, the collectives that read none of it (with tp, the all-gather over tp
  of chunk n-2's home sums), with what they read there, before its last quarter: the link runs
  its commands in issue order, and they queued behind chunk n-1's reduce-scatter and return
  (Qwen3-30B-A3B ep=2,tp=2, 16 tokens a chip, 8 chunks: 240.9 -> 239.6 us).

The first chunks' dispatches (those whose token rows the router loop's first trip makes; in
cost-only runs the routing is an argument and only the weights come from the router) go after
that trip, before the rest of the router's, so the link starts sending a trip after the
router starts rather than after it ends (ep=8 as below: 1,675.3 -> 1,664.7 us).

Cuts elsewhere paid less (Qwen3-30B-A3B on 8 chips, 4,096 tokens a chip, 8 chunks of 16
filled blocks, a2a_sum: cut after 4 and before the last 4 blocks 1,675.3 us; 3 and 5 blocks
1,695.1; everything after loop i+1's first 4 blocks 1,698.9; main's order 1,706.3). Each op
reads the same values as before, so the outputs keep their bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func, scf
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, SSAValue
from xdsl.passes import ModulePass

from dialects import ccl, tile
from dialects.annotations import phase_of
from dialects.tensor_types import shape_of
from passes._loop_builder import constant_index, op_of_block
from passes.schedule.interleave_shared import block_rows, split
from passes.schedule.split_clusters import expert_loops
from target.target_spec import machine_of


def _reads(seeds: list[Operation], among: list[Operation], block: Block) -> set[Operation]:
    """The ops of `among` that `seeds` read (anywhere in them), directly or through each other,
    and the seeds of `among` themselves."""
    inside = set(among)
    found = {op for op in seeds if op in inside}
    pending = list(seeds)
    while pending:
        for nested in pending.pop().walk():
            for v in nested.operands:
                owner = op_of_block(v.owner, block) if isinstance(v.owner, Operation) else None
                if owner in inside and owner not in found:
                    found.add(owner)
                    pending.append(owner)
    return found


def _read_by(seeds: set[Operation], among: list[Operation]) -> set[Operation]:
    """The ops of `among` (in order, after `seeds`) that read the seeds' results, directly or
    through each other; not the seeds themselves."""
    found = set(seeds)
    for op in among:
        if any(isinstance(v.owner, Operation) and v.owner in found for nested in op.walk() for v in nested.operands):
            found.add(op)
    return found - seeds


def _between(first: Operation, last: Operation) -> list[Operation]:
    ops: list[Operation] = []
    op = first.next_op
    while op is not None and op is not last:
        ops.append(op)
        op = op.next_op
    return ops


def _filled(block: Block, loop: scf.ForOp) -> int:
    """The blocks of a chunk's expert loop that a routing balanced over the chips fills: the
    pairs the chip sends for its chunk (the first `ccl.a2a_plan`'s expert choices), which it
    then receives, over B; 0 without a plan."""
    plan = next((op for op in block.ops if isinstance(op, ccl.A2APlanOp)), None)
    return -(-math.prod(shape_of(plan.experts_idx.type)) // block_rows(loop)) if plan is not None else 0


def _chained(loops: list[scf.ForOp]) -> bool:
    """Whether a loop carries another's results: one chunk's loop in pieces (interleave-shared)."""
    made = {r for loop in loops for r in loop.results}
    return any(v in made for loop in loops for v in loop.iter_args)


def _gathers_over_sp(block: Block) -> bool:
    """Whether the chip gathers its tokens over sp (seed 001's meshes): shard-experts already
    orders such a chip's chunk stages for the all-gather and reduce-scatter (`_sp_order`), and
    moving them into the loops undid it (DeepSeek-V3 D = 7168, E = 32 on ep=4,sp=4, 2 chunks:
    855,127 -> 940,719 cycles; tests/test_mesh_sp.py)."""
    return any(isinstance(op, (ccl.AllGatherOp, ccl.ReduceScatterOp)) and op.axis_name == "sp" for op in block.ops)


def interleave(block: Block, clusters: int) -> None:
    """Spread the ops between `block`'s chunk expert loops into them (the module docstring)."""
    loops = [op for op in expert_loops(block) if phase_of(op) == "experts"]
    if len(loops) < 2 or _chained(loops):
        return
    lb, ub, step = (constant_index(v) for v in (loops[0].lb, loops[0].ub, loops[0].step))
    filled = _filled(block, loops[0])
    quarter = filled // 4 // clusters * clusters
    if lb is None or ub is None or not step or not quarter or lb + (filled - quarter) * step >= ub:
        return
    cuts = [lb + quarter * step, lb + (filled - quarter) * step]
    early: list[list[Operation]] = []
    late: list[list[Operation]] = []
    for loop, following in zip(loops, loops[1:]):
        among = _between(loop, following)
        after = _read_by({loop}, among)
        needed = _reads([following], among, block)
        dispatch = _reads([op for op in among if phase_of(op) == "dispatch"], among, block) - needed - after
        early.append([op for op in among if (op in needed or op in dispatch) and op not in after])
        late.append([op for op in among if op not in needed and op not in dispatch])
    early.append(_earlier_homes(block, loops[-1]))
    for j, loop in enumerate(loops):
        at = {cut: moved for cut, moved in zip(cuts, (late[j - 1] if j else [], early[j] if j < len(early) else []))
              if moved}
        if not at:
            continue
        pieces = split(loop, [lb, *at, ub])
        for moved, piece in zip(at.values(), pieces[1:]):
            for op in moved:
                op.detach()
            block.insert_ops_before(moved, piece)


def _earlier_homes(block: Block, last: scf.ForOp) -> list[Operation]:
    """The collectives after the last chunk's loop that read none of it (with tp, the
    all-gather of an earlier chunk's home sums' columns), with what they read there: the link
    runs its commands in issue order, so they go before the loop's last quarter rather than
    queue behind the last chunk's reduction and return. The home sums' other work stays."""
    assert last.parent_block() is block and block.last_op is not None
    among = _between(last, block.last_op)
    after = _read_by({last}, among)
    links = [op for op in among if isinstance(op, ccl.COLLECTIVES) and op not in after]
    moved = _reads(links, among, block)
    return [op for op in among if op in moved]


def _stored_into(value: SSAValue) -> SSAValue:
    """The buffer `value` is, through the `tile.store`s into it."""
    while isinstance(value.owner, tile.StoreOp):
        value = value.owner.dest
    return value


def _router_first(block: Block) -> None:
    """The dispatches of the chunks whose rows the router loop's first trip makes (their slices
    of its results then read that trip's), with what they read, between that trip and the
    router's other trips: their all-to-alls start while the router computes the rest."""
    loops = [op for op in block.ops if isinstance(op, scf.ForOp) and phase_of(op) == "router"]
    first = next(iter(expert_loops(block)), None)
    if len(loops) != 1 or first is None:
        return
    (router,) = loops
    lb, ub, step = (constant_index(v) for v in (router.lb, router.ub, router.step))
    if lb is None or ub is None or not step or ub - lb < 2 * step:
        return
    among = _between(router, first)
    made = {r: i for i, r in enumerate(router.results)}
    slices = [(op, made[v]) for op in among if isinstance(op, tile.SliceOp) and (v := _stored_into(op.source)) in made
              and (at := constant_index(op.offset)) is not None and at + shape_of(op.result.type)[0] <= lb + step]
    if not slices:
        return
    head, rest = split(router, [lb, lb + step, ub])
    for op, i in slices:
        op.operands[0] = head.results[i]
    dones = {op for op in among if isinstance(op, ccl.AllToAllDoneOp)}
    late = _read_by({rest, *dones}, among) | dones
    moved = [op for op in among if op not in late]
    for op in moved:
        op.detach()
    block.insert_ops_before(moved, rest)


@dataclass(frozen=True)
class InterleaveChunksPass(ModulePass):
    """The work between a chunked mesh chip's expert loops -> inside them, at a quarter and at
    three quarters of their filled blocks; the first chunks' dispatches -> after the router
    loop's first trip (the module docstring says what goes where)."""

    name = "interleave-chunks"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        clusters = machine_of(op).clusters
        for fn in op.ops:
            if isinstance(fn, func.FuncOp) and fn.body.blocks and ccl.CHUNKS_ATTR in fn.attributes \
                    and not _gathers_over_sp(fn.body.block):
                interleave(fn.body.block, clusters)
                _router_first(fn.body.block)
