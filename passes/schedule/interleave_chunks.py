"""`interleave-chunks`: the work between a chunked mesh chip's expert loops spread into them.

shard-experts issues a chunked chip's stages software-pipelined (docs/mesh.md, Chunks): between
chunk i's expert loop and chunk i+1's stand chunk i+1's receive (its routing), chunk i's combine
and the start of its return, chunk i+2's dispatch and chunk i-1's home sum. Engines issue their
commands in program order and never back-fill a unit (runtime_sim/perf/scheduler.py), so the
next expert loop waited for all of them: the combine's gathers of the blocks' rows took every
DMA engine, the loop's first token gather and weight loads queued behind them, and the tensor
units, whose contractions are the chip's critical work at prefill, stood still meanwhile.

Last at the schedule level (after interleave-shared), on a chunked chip (`ccl.chunks`) whose
routed loops are whole and that gathers no tokens over sp (`ccl.gathers_over_sp`), this pass cuts each chunk's expert loop at block boundaries a quarter
and three quarters through the blocks a routing balanced over the chips fills (the chunk's
pairs over B, `_filled`; rounded to whole rounds of the clusters, which take blocks in turn),
with interleave-shared's `split`, and moves the ops between loops i and i+1:

- the next chunk's routing (the vector work of its receive, which loop i+1 reads and which reads
  nothing of loop i) after loop i's first quarter, behind chunk i-1's combine (for loop 0, when
  chunk 1's tokens may still be crossing the link, before its last quarter, and the DMA work
  below a round of the clusters' blocks after it); every other chunk's routing runs on the last
  cluster (`_on_last_cluster`), reading the received lists there, its results that cluster 0's
  compute reads copied back by DMA with the row marks: cluster 0 routed every chunk while the
  last cluster's tensor unit waited for its next block;
- the rest of that receive (its DMA row marks, and what reads them) and chunk i+2's dispatch
  before loop i's last quarter. A DMA command issued right behind the routing waited for it,
  and with it every DMA command issued after it (engines never back-fill): loop i's last
  quarter's first token gather waited for cluster 0 to end loop i's previous piece and route,
  a bubble on both tensor units at every cut (ep=8 below: 8-13 us a chunk);
- the rest (chunk i's combine and return, chunk i-1's home sum) after loop i+1's first
  quarter, under whose contractions the combine's gathers run;
- after the last loop, the collectives that read none of it (with tp, the all-gather over tp
  of chunk n-2's home sums), with what they read there, before its last quarter: the link runs
  its commands in issue order, and they queued behind chunk n-1's reduce-scatter and return
  (Qwen3-30B-A3B ep=2,tp=2, 16 tokens a chip, 8 chunks: 240.9 -> 239.6 us).

The first chunks' dispatches (those whose token rows the router loop's first trips make, as
few as hold chunk 0, at decode the first trip only) go after those trips, before the rest of the router's, so the link starts
sending once chunk 0's rows are made rather than after the router ends (ep=8 as below: 1,675.3
-> 1,664.7 us; ep=2, 2 chunks of 2,048 in trips of 1,024, after two of the four: 1,719.8 ->
1,708.3 us with schedule-tokens' `chunk_trips`). In cost-only runs those chunks' slices of
pin-routing's routing argument wait for those trips alone, as their slices of the router's own
indices do (a `tcp.order` after the first trips' indices): waiting for the whole router put
its last trips before the first dispatch (Qwen3-30B-A3B at 4,096 tokens a chip, B = 256, a2a:
ep=2 1,711.4 -> 1,694.9 us, ep=4 1,643.8 -> 1,618.9).

At decode the last chunk's loop ends the chip's weight stream: its last round of the clusters'
blocks (those a balanced routing fills) is a loop piece of its own whose weights one DMA engine
loads each (at most one `dma.split_bytes` piece) load in pieces (`_k_pieces.round_in_pieces`),
so the engines finish closer together (Qwen3-30B-A3B, 16 tokens a chip, ep=4, B = 4, 2 chunks:
223.4 -> 222.5 us; ep=8 117.5 -> 116.6; docs/passes.md).

The later chunks' dispatch plans (`ccl.a2a_plan`, `a2a_tokens`, `a2a_token_lists`: vector work
on the router's results alone) go before the first expert loop, where cluster 0 would otherwise
wait for the first chunk's tokens to cross the link; between the loops they held cluster 0
while cluster 1 waited for the next block. a2a's return plans (`ccl.a2a_returns`) stay where
shard-experts put them, on cluster 0: their cumsums chunked as lower-routing's, they take 0.6 us
a chunk there (Qwen3-30B-A3B ep=8), and run on the last cluster with copies of their tables back
to cluster 0 they cost ep=8 a2a 1,562.0 -> 1,592.4 us (those copies took DMA queues the next
blocks' token gathers waited behind).

Measured (Qwen3-30B-A3B on 8 chips, 4,096 tokens a chip, 8 chunks of 16 filled blocks, a2a_sum):
main's order 1,706.3 us; the receive and dispatch before the last quarter, the combine after
the next loop's first 1,675.3; the router first 1,664.7; the routing apart from its row marks
1,641.7; the plans first as well 1,611.4; every other routing on the last cluster 1,601.4; loop
0's DMA work a round later 1,591.7 (with schedule-tokens' router tiles of a chunk and home sums
in HBM, 1,578.4; a2a, with its return plans on the last cluster, 1,584.5). Cuts elsewhere paid
less (3 and 5 blocks 1,695.1; everything after loop i+1's first 4 blocks 1,698.9). Each op reads
the same values as before (from a DMA copy where another cluster made them), so the outputs keep
their bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, SSAValue
from xdsl.passes import ModulePass

from dialects import ccl, tcp, tile, ve
from dialects.annotations import CLUSTER_ATTR, cluster_of, phase_of, place_on_cluster
from dialects.tensor_types import shape_of
from passes._loop_builder import constant_index, op_of_block
from passes.schedule._cluster_copies import DMA_OPS
from passes.schedule._k_pieces import round_cuts, round_in_pieces
from passes.schedule.interleave_shared import block_rows, split
from passes.schedule.split_clusters import PREFILL_PAIRS_PER_EXPERT, expert_loops
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


def _between(first: Operation, last: Operation | None) -> list[Operation]:
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
    routing: list[list[Operation]] = []
    early: list[list[Operation]] = []
    late: list[list[Operation]] = []
    for loop, following in zip(loops, loops[1:]):
        among = _between(loop, following)
        after = _read_by({loop}, among)
        needed = _reads([following], among, block)
        dispatch = _reads([op for op in among if phase_of(op) == "dispatch"], among, block) - needed - after
        marks = {op for op in among if isinstance(op, (tcp.DmaScatterOp, tile.CopyOp))} & needed
        marks = (marks | _read_by(marks, among)) & needed
        routing.append([op for op in among if op in needed and op not in after and op not in marks])
        early.append([op for op in among if (op in marks or op in dispatch) and op not in after])
        late.append([op for op in among if op not in needed and op not in dispatch])
    early.append(_earlier_homes(block, loops[-1]))
    back: list[list[Operation]] = [[] for _ in routing]
    for j in range(1, len(routing), 2):  # every other chunk's: the clusters' tensor units share it
        routing[j], back[j], dropped = _on_last_cluster(routing[j], clusters)
        early[j] = [op for op in early[j] if op not in dropped]
        for op in dropped:
            op.detach()
            op.erase()
    round_later = cuts[1] + clusters * step
    for j, loop in enumerate(loops):
        first = (late[j - 1] if j else []) + (routing[j] if 0 < j < len(routing) else [])
        second = (back[j] if j < len(back) else []) + (early[j] if j < len(early) else [])
        places = [(cuts[0], first), (cuts[1], second)]
        if j == 0 and routing and round_later < lb + filled * step:  # a filled round after it
            places = [(cuts[1], routing[0]), (round_later, second)]
        elif j == 0 and routing:
            places = [(cuts[1], routing[0] + second)]
        at = {cut: moved for cut, moved in places if moved}
        if not at:
            continue
        pieces = split(loop, [lb, *at, ub])
        for moved, piece in zip(at.values(), pieces[1:]):
            for op in moved:
                if op.parent is not None:
                    op.detach()
            block.insert_ops_before(moved, piece)


_KEPT = (ve.ConstOp, arith.ConstantOp, tile.BufferOp)
"""Ops a cluster rebuilds or that hold no data: left where they are."""


def _on_last_cluster(routing: list[Operation], clusters: int
                     ) -> tuple[list[Operation], list[Operation], set[Operation]]:
    """`routing`'s unpinned ops on the last cluster, whose tensor unit waits at the chunks' cuts
    while cluster 0 routes: (those ops, in order; the DMA copies of their results that cluster 0's
    compute reads, with the ops of `routing` that read those copies, to issue later, once the
    routing is done, so that no DMA queue waits for it; the last cluster's copies of the
    routing's results, which it now reads where they are, to erase)."""
    last = clusters - 1
    if last == 0:
        return routing, [], set()
    moved = {op for op in routing if CLUSTER_ATTR not in op.attributes and not isinstance(op, _KEPT)}
    copies: dict[SSAValue, tile.CopyOp] = {}
    dropped: set[Operation] = set()
    for op in routing:
        if op not in moved:
            continue
        place_on_cluster(op, last)
        block = op.parent_block()
        assert block is not None
        for r in op.results:
            for use in list(r.uses):
                user = use.operation
                if block.find_ancestor_op_in_block(user) in moved or isinstance(user, DMA_OPS) and not isinstance(user, tile.CopyOp):
                    continue
                if isinstance(user, tile.CopyOp) and cluster_of(user) == last:
                    user.result.replace_all_uses_with(r)
                    dropped.add(user)
                    continue
                if cluster_of(user) == last:
                    continue
                if r not in copies:
                    copies[r] = tile.CopyOp(r)
                    copies[r].result.name_hint = f"{r.name_hint}_back" if r.name_hint else None
                    place_on_cluster(copies[r], 0)
                user.operands[use.index] = copies[r].result
    routing = [op for op in routing if op not in dropped]
    later = _read_by(set(copies.values()), routing)
    return ([op for op in routing if op not in later], [*copies.values(), *(op for op in routing if op in later)],
            dropped)


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


def _router_first(block: Block, prefill: bool) -> None:
    """The dispatches of the chunks whose rows the router loop's first trips make (as few as
    hold the first chunk; their slices of its results then read those trips'), with what they
    read, between those trips and the router's others: their all-to-alls start while the
    router computes the rest. Not prefill's (`prefill`), only after the first trip: the first
    loop streams weights whatever the tokens' time, and a router cut after more trips held the
    later chunks' plans back (DeepSeek-V3 ep=8 at 256 tokens a chip, 2 chunks, trips of 16
    rows: 117,239 -> 117,450 cycles after 8)."""
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
    ends = [(op, made[v], at + shape_of(op.result.type)[0]) for op in among if isinstance(op, tile.SliceOp)
            and (v := _stored_into(_ordered_after(op.source))) in made
            and (at := constant_index(op.offset)) is not None]
    if not ends:
        return
    cut = lb + -(-(min(end for _, _, end in ends) - lb) // step) * step  # the trips that hold the first chunk
    if cut >= ub or (cut > lb + step and not prefill):
        return
    slices = [(op, i) for op, i, end in ends if end <= cut]
    head, rest = split(router, [lb, cut, ub])
    orders: list[tuple[tcp.OrderOp, tile.SliceOp]] = []
    for op, i in slices:
        if isinstance(pinned := op.source.owner, tcp.OrderOp):  # the pinned routing waits for these trips alone
            order = tcp.OrderOp(pinned.input, head.results[i])
            order.attributes.update(pinned.attributes)
            order.result.name_hint = pinned.result.name_hint
            orders.append((order, op))
            op.operands[0] = order.result
        else:
            op.operands[0] = head.results[i]
    dones = {op for op in among if isinstance(op, ccl.AllToAllDoneOp)}
    late = _read_by({rest, *dones}, among) | dones
    moved = [op for op in among if op not in late]
    for op in moved:
        op.detach()
    block.insert_ops_before(moved, rest)
    for order, op in orders:
        block.insert_op_before(order, op)


def _ordered_after(value: SSAValue) -> SSAValue:
    """What `value` waits for where it is pin-routing's routing argument (`tcp.order`): the
    router's indices, whose trips make its rows; else `value`."""
    return value.owner.after if isinstance(value.owner, tcp.OrderOp) else value


def _stream_end_in_pieces(block: Block, clusters: int) -> None:
    """At decode, the last round of the clusters' blocks (a routing balanced over the chips fills,
    `_filled`) of the last chunk's loop, the end of the chip's weight stream, a loop piece of its
    own whose one-engine weight loads go in pieces (`_k_pieces.round_in_pieces`; docstring)."""
    loop = expert_loops(block)[-1]
    machine = machine_of(block.parent_op())
    lb, ub, step = (constant_index(v) for v in (loop.lb, loop.ub, loop.step))
    filled = _filled(block, loop)
    if lb is None or ub is None or not step or not filled or not round_cuts(loop.body.block, machine):
        return
    at = (filled - clusters) * step
    if lb < at < ub:
        loop = split(loop, [lb, at, ub])[-1]
    round_in_pieces(loop.body.block, machine)


_PLANS = (ccl.A2APlanOp, ccl.A2ATokensOp, ccl.A2ATokenListsOp)


def _plans_first(block: Block) -> None:
    """The later chunks' dispatch plans (vector work on the router's results alone) before the
    first expert loop, where cluster 0 waits for the first chunk's tokens to cross the link."""
    first = next(iter(expert_loops(block)), None)
    if first is None:
        return
    after = _between(first, None)
    moved: set[Operation] = set()
    for plan in (op for op in after if isinstance(op, _PLANS)):
        reads = _reads([plan], after, block)
        if all(isinstance(op, (*_PLANS, tile.SliceOp, arith.ConstantOp)) for op in reads):
            moved |= reads
    ops = [op for op in after if op in moved]
    for op in ops:
        op.detach()
    block.insert_ops_before(ops, first)


def _prefill(block: Block) -> bool:
    """Whether a chunk's experts receive prefill's pairs (split-clusters' PREFILL_PAIRS_PER_EXPERT
    each, under a routing balanced over the chips): their contractions then keep the tensor units
    busy, and `_router_first` cuts the router after the trips that make chunk 0 (at decode after
    the first)."""
    plan = next((op for op in block.ops if isinstance(op, ccl.A2APlanOp)), None)
    return plan is not None and math.prod(shape_of(plan.experts_idx.type)) * plan.chips.value.data \
        >= PREFILL_PAIRS_PER_EXPERT * plan.experts.value.data


@dataclass(frozen=True)
class InterleaveChunksPass(ModulePass):
    """The work between a chunked mesh chip's expert loops -> inside them, at a quarter and at
    three quarters of their filled blocks; the first chunks' dispatches -> after the router
    loop's first trips (the module docstring says what goes where)."""

    name = "interleave-chunks"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        clusters = machine_of(op).clusters
        for fn in op.ops:
            # Not over sp: shard-experts already orders such a chip's chunk stages for the all-gather and
            # reduce-scatter (`_sp_order`), and moving them into the loops undid it (DeepSeek-V3 D = 7168,
            # E = 32 on ep=4,sp=4, 2 chunks: 855,127 -> 940,719 cycles; tests/test_mesh_sp.py).
            if isinstance(fn, func.FuncOp) and fn.body.blocks and ccl.CHUNKS_ATTR in fn.attributes \
                    and not ccl.gathers_over_sp(fn.body.block):
                interleave(fn.body.block, clusters)
                _router_first(fn.body.block, _prefill(fn.body.block))
                _plans_first(fn.body.block)
                if not _prefill(fn.body.block):
                    _stream_end_in_pieces(fn.body.block, clusters)
