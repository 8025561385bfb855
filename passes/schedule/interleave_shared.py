"""`interleave-shared`: a shared expert's contractions spread through the routed expert loop.

schedule-shared puts a shared expert's loop before the routing, where at prefill its
contractions held the tensor units for millions of cycles (DeepSeek-V3 at T = 4096: 1.49 M)
while HBM was mostly idle; the routed expert loop after it waits for its weights from HBM, its
tensor units idle a third of the time. Engines issue their commands in program order and never
back-fill a unit (runtime_sim/perf/scheduler.py), so the shared work fills that idle time only
where the program puts it. Last in the pipeline but interleave-chunks (after split-clusters, fuse-ve-chains and
map-contractions: its pieces copy a body already fused and mapped, rather than each piece being
fused and mapped again; the IR is the same), when `spreads` (prefill, and a routed loop that
waits for HBM), this pass:

- unrolls the shared loop (a copy of its body per iteration, its index a constant, its carried
  values threaded through) and cuts the straight-line ops after each run of contractions
  (split-clusters interleaved the clusters' copies: a run is one contraction on every
  cluster, or two where an F tile's down-projection meets the next tile's first contraction).
  Finer cuts spread the work more evenly than cuts after whole F tiles (DeepSeek-V3 at
  T = 4096: 18.80 M cycles against 19.00 M);
- splits the routed expert loop (its first loop, if schedule-experts made several) into as
  many pieces, loops over consecutive blocks chained through their carried values, and puts
  the cuts before the pieces in order. The pieces divide the first ceil(T K / B) blocks
  evenly, the blocks every routing fills (the worst case G's trailing blocks are mostly
  unused, and an unused block costs only its guard), the last piece running to G; with fewer
  such blocks than cuts, consecutive cuts share a piece;
- moves the readers of the shared result (its load into SRAM) after the last piece.

Block-scaled experts (`tcp.scaled_contract`, fp8 and MXFP4: DeepSeek-V3 fp8's routed and
shared experts) are spread alike: `spreads` judges the routed contraction at its format's
peak (the fp8 rate) and its stored bytes (scales included), and the shared expert's
quantization ops go with the contractions they feed (DeepSeek-V3 fp8 at T = 4096: 11.86 M
cycles -> 11.43 M).

Each op runs on the same values in the same order within its own loop, so the outputs keep
their bits. The shared weight tiles are in SRAM beside the routed loop's, so schedule-experts
chooses them for half a cluster's SRAM when the shared expert will be spread
(`schedule_experts.spread_through_routed`).

On a mesh chip at decode (one shared block, one routed loop) nothing spreads, but the shared
loop is placed (`_place_one_block`): unrolled, the gate and up projections of its F tiles after
the first on the other clusters, after the routing (split-clusters left it whole on the last
cluster, where its contractions outlasted the dispatch and held that cluster's first routed
blocks), when its block is bound by its contractions on one cluster; and its result's store
after the routed loop, not holding DMA engines while it waits. DeepSeek-V3 on 8 chips, 128
tokens each, a2a, B = 32 (tcpc run --cost-only, balanced): 2,158.6 -> 2,152.0 us. That adds
commands (a `tile.copy` of each moved tile's hidden rows, its rows of x loaded again), so it
is not what `interleaves` reports. On a chip that gathers its tokens over sp (seed 001's meshes)
and moves no tile, the loop from its first down projection's weights on goes after the combine's
reduce-scatter instead (`_defer_down_projections`): HBM streams them while the link returns the
experts' rows and reduce-scatters them (DeepSeek-V3 on ep=16,sp=8, 4 tokens a chip, a2a_sum:
241.7 -> 232.8 us), and its result stays in SRAM for the output's add (`_keep_result_in_sram`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import Block, Operation, SSAValue
from xdsl.passes import ModulePass

from dialects import ccl, tcp, tile, ve
from dialects.annotations import PHASE_ATTR, SHARED, cluster_of, expert_indices, phase_of, place_on_cluster
from dialects.tensor_types import shape_of
from passes._loop_builder import (clone_op, clone_region, constant_index, erase_unread, index_constant,
                                  move_readers_after, op_of_block, sink_to_first_reader)
from passes.schedule._cluster_copies import pin
from passes.schedule._f_tiles import CONTRACTIONS, ancestors
from passes.schedule.split_clusters import addressed, contraction_flops_per_weight_byte, expert_loops, own_dma_intensity
from target.machine import Machine
from target.target_spec import machine_of


def _erase_with_bounds(loop: scf.ForOp) -> None:
    """Erase `loop` (already detached), and its bounds' and step's constants if nothing else reads them."""
    bounds = dict.fromkeys((loop.lb, loop.ub, loop.step))
    loop.erase()
    for v in bounds:
        erase_unread(v)


def _trips(loop: scf.ForOp) -> list[int] | None:
    """The values a loop's index takes, when its bounds and step are constants."""
    lb, ub, step = (constant_index(v) for v in (loop.lb, loop.ub, loop.step))
    if lb is None or ub is None or not step:
        return None
    return list(range(lb, ub, step))


def unroll(loop: scf.ForOp) -> tuple[list[Operation], list[SSAValue]]:
    """Replace `loop` by a copy of its body per iteration, in place; the copies' ops and what
    now stands for the loop's results that are read."""
    trips = _trips(loop)
    assert trips is not None
    body = loop.body.block
    yielded = body.last_op
    assert isinstance(yielded, scf.YieldOp)
    carried: list[SSAValue] = list(loop.iter_args)
    made: list[Operation] = []
    phase = loop.attributes.get(PHASE_ATTR)
    for i in trips:
        index = index_constant(i)
        if phase is not None:
            index.attributes[PHASE_ATTR] = phase
        made.append(index)
        mapping: dict[SSAValue, SSAValue] = {body.args[0]: index.result, **dict(zip(body.args[1:], carried))}
        for op in body.ops:
            if op is yielded:
                break
            made.append(clone_op(op, mapping))
        carried = [mapping.get(v, v) for v in yielded.operands]
    parent = loop.parent_block()
    assert parent is not None
    parent.insert_ops_before(made, loop)
    read = [new for old, new in zip(loop.results, carried) if old.uses]
    for old, new in zip(loop.results, carried):
        old.replace_all_uses_with(new)
    loop.detach()
    _erase_with_bounds(loop)
    return made, read


def chunks(ops: list[Operation]) -> list[list[Operation]]:
    """`ops` cut after each run of contractions (the split-clusters copies' commands are
    interleaved, so a run is one contraction on every cluster); what follows the last cut joins
    the last chunk."""
    cut: list[list[Operation]] = [[]]
    for i, op in enumerate(ops):
        cut[-1].append(op)
        if isinstance(op, CONTRACTIONS) and (i + 1 == len(ops) or not isinstance(ops[i + 1], CONTRACTIONS)):
            cut.append([])
    tail = cut.pop()
    if cut:
        cut[-1] += tail
        return cut
    return [tail]


def filled_blocks(block: Block, blocks: int, rows: int) -> int:
    """The blocks every routing fills, ceil(T K / B) (at most G): the pairs are the expert
    choices lower-routing marks (`tcpc.expert_indices`); G when there are none."""
    for op in block.walk():
        if expert_indices(op) is not None:
            return min(blocks, -(-math.prod(shape_of(op.operands[0].type)) // rows))
    return blocks


def split(loop: scf.ForOp, bounds: list[int]) -> list[scf.ForOp]:
    """`loop` as consecutive loops over [bounds[i], bounds[i + 1]), chained through their
    carried values, in place."""
    step = loop.step
    parent = loop.parent_block()
    assert parent is not None
    carried: list[SSAValue] = list(loop.iter_args)
    pieces: list[scf.ForOp] = []
    constants = [index_constant(b) for b in bounds]
    for op in constants:
        op.attributes.update({k: v for k, v in loop.attributes.items() if k == PHASE_ATTR})
    parent.insert_op_before(constants[0], loop)
    for lb, ub in zip(constants, constants[1:]):
        piece = scf.ForOp(lb, ub, step, carried, clone_region(loop.body))
        piece.attributes.update(loop.attributes)
        parent.insert_ops_before([ub, piece], loop)
        for old, new in zip(loop.results, piece.results):
            new.name_hint = old.name_hint
        carried = list(piece.results)
        pieces.append(piece)
    for old, new in zip(loop.results, carried):
        old.replace_all_uses_with(new)
    loop.detach()
    _erase_with_bounds(loop)
    return pieces


def block_rows(loop: scf.ForOp) -> int:
    """B: the rows of a block, the row index [G, B] the routed loop's row gathers read."""
    for op in loop.body.walk():
        if isinstance(op, tile.GatherOp):
            return shape_of(addressed(op.indices).type)[-1]
    return 1


def spreads(shared_blocks: int, routed: tcp.ContractOp | tcp.ScaledContractOp, machine: Machine) -> bool:
    """Whether a shared expert of `shared_blocks` row blocks is spread through the routed loop
    whose block contraction is `routed`: at prefill (two blocks or more; at decode the shared
    expert is its weight loads, which already share HBM with the router's), when `routed` does
    fewer FLOPs per stored weight byte than the chip's peak at its format's rate over its HBM
    bandwidth, so the routed loop waits for its weights and leaves the tensor units idle
    (DeepSeek-V3 and Llama-4-Scout at B = 128: 128 FLOPs a byte against RNGD's 175 in bf16;
    DeepSeek-V3 fp8 at B = 128: 256 against 350 at the fp8 rate; not Llama-4-Scout at T = 4096,
    B = 256, whose routed loop is bound by its contractions, which the shared work would only
    lengthen)."""
    peak = machine.chip_peak_fp8_flops_per_cycle if isinstance(routed, tcp.ScaledContractOp) else machine.chip_peak_flops_per_cycle
    return shared_blocks >= 2 and contraction_flops_per_weight_byte(routed) < peak / machine.hbm_bytes_per_cycle


def _first_contraction(loop: scf.ForOp) -> tcp.ContractOp | tcp.ScaledContractOp | None:
    """The first contraction of `loop`'s body (bf16/f32 or block-scaled): its block contraction."""
    return next((op for op in loop.body.walk() if isinstance(op, CONTRACTIONS)), None)


def _spread(block: Block, machine: Machine) -> tuple[scf.ForOp, scf.ForOp, list[int]] | None:
    """`block`'s shared loop, its routed loop and the routed loop's trips, when the one
    `spreads` through the other (the module docstring); else None."""
    shared = [op for op in block.ops if isinstance(op, scf.ForOp) and op.attributes.get(PHASE_ATTR) == StringAttr(SHARED)]
    routed = [op for op in expert_loops(block) if phase_of(op) == "experts"]
    if len(shared) != 1 or not routed:
        return None
    (loop,) = shared
    trips, routed_trips, contraction = _trips(loop), _trips(routed[0]), _first_contraction(routed[0])
    if not trips or routed_trips is None or len(routed_trips) < 2 or contraction is None:
        return None
    lb, ub = constant_index(loop.lb), constant_index(loop.ub)
    assert lb is not None and ub is not None
    if not spreads(ub - lb, contraction, machine):
        return None
    return loop, routed[0], routed_trips


def interleaves(module: ModuleOp) -> bool:
    """Whether the pass would spread a function's shared loop through its routed loop (it may
    also place a mesh chip's one-block shared loop, `_place_one_block`). The commands are the
    same either way, only their order changes, so a lower bound on the commands' cycles (a
    roofline, a unit's busy cycles) is the same before the pass as after it; the cost model
    bounds a candidate before interleaving it (tcpc/autotune.py)."""
    machine = machine_of(module)
    return any(_spread(fn.body.block, machine) is not None
               for fn in module.ops if isinstance(fn, func.FuncOp) and fn.body.blocks)


def _defer_shared_result(block: Block) -> None:
    """On a mesh chip, the load of the shared loop's result into SRAM (and its views) just
    before the first op that reads it, not right after the loop: schedule-shared puts the
    loop under the dispatch's all-to-all, and the load there held the [T, D] rows in SRAM
    through the whole routed part (DeepSeek-V3 at 4,096 tokens a chip: 58.7 MB, which the
    receiver's routing then spilled, with the next chunk's lists the link was still reading:
    16,894.5 -> 16,709.1 us on 8 chips, a2a_sum, B = 512, 2 chunks)."""
    if ccl.first_all_to_all_done(block) is None:
        return
    shared = [op for op in block.ops if isinstance(op, scf.ForOp) and op.attributes.get(PHASE_ATTR) == StringAttr(SHARED)]
    if len(shared) != 1:
        return
    values: set[SSAValue] = set(shared[0].results)
    chain: list[Operation] = []
    op = shared[0].next_op
    while op is not None:
        if any(v in values for nested in op.walk() for v in nested.operands):  # a loop reads inside its body too
            if not isinstance(op, (tcp.LoadOp, tcp.ViewOp)):
                break  # the first reader
            chain.append(op)
            values.update(op.results)
        op = op.next_op
    if chain:
        sink_to_first_reader(block, chain)


def _one_block_shared(block: Block) -> tuple[scf.ForOp, scf.ForOp] | None:
    """On a mesh chip, `block`'s shared loop when it runs one block (decode) of more than one
    token and its results are read only after the routed expert loop, with that routed loop;
    else None (one token a chip: 563.7 -> 564.3 us for DeepSeek-V3 on 8 chips)."""
    if ccl.first_all_to_all_done(block) is None:
        return None
    shared = [op for op in block.ops if isinstance(op, scf.ForOp) and phase_of(op) == SHARED]
    routed = [op for op in expert_loops(block) if phase_of(op) == "experts"]
    if len(shared) != 1 or len(routed) != 1 or len(_trips(shared[0]) or ()) != 1:
        return None
    if any(isinstance(op, tile.StoreOp) and shape_of(op.operands[0].type)[-2] == 1 for op in shared[0].body.walk()):
        return None  # one token: its store, after the routed loop, would start on the combine's path
    ordered = list(block.ops)
    at = ordered.index(routed[0])
    readers = [op_of_block(use.operation, block) for r in shared[0].results for use in r.uses]
    if ordered.index(shared[0]) > at or any(op is None or ordered.index(op) <= at for op in readers):
        return None
    return shared[0], routed[0]


def _reloadable(op: Operation) -> bool:
    """An op another cluster makes again rather than copying its result: a row load from HBM,
    an address computation on a constant."""
    return isinstance(op, tile.LoadOp) or (isinstance(op, tile.SliceOp)
                                           and isinstance(op.operands[0].owner, ve.ConstOp))


def _hidden_projections(ops: list[Operation], machine: Machine
                        ) -> list[tuple[tcp.ContractOp | tcp.ScaledContractOp, int, set[Operation]]]:
    """The F tiles of an unrolled one-block shared loop (`ops`, on one cluster) whose gate and up
    projections go to another cluster: (the tile's down projection, that cluster, the ops that
    make its hidden rows and nothing else). Tile j goes to cluster home - j mod `clusters`; its
    down projection stays home, the tiles' partial sums accumulating there in F order. None
    when the block does fewer FLOPs per weight byte than `own_dma_intensity` (its contractions
    on one cluster then take less time than its weights take to load: DeepSeek-V3 at 16 tokens
    a chip), or a moved op would read a value of the home cluster other than HBM rows or
    constants."""
    within = set(ops)
    downs = [op for op in ops if isinstance(op, CONTRACTIONS)
             and any(isinstance(o, CONTRACTIONS) for o in ancestors(op.operands[0], within))]
    clusters = machine.clusters
    if len(downs) < 2 or clusters < 2 or contraction_flops_per_weight_byte(downs[0]) < own_dma_intensity(machine):
        return []
    home = cluster_of(downs[0])
    made = [ancestors(d.operands[0], within) for d in downs]
    moves = []
    for j, down in enumerate(downs):
        cluster = (home - j) % clusters
        if cluster == home:
            continue
        own = made[j].difference(*(m for i, m in enumerate(made) if i != j), (down,))
        read = {v.owner for op in own for nested in op.walk() for v in nested.operands}
        if any(isinstance(o, Operation) and o in within and o not in own and not isinstance(o, arith.ConstantOp)
               and not _reloadable(o) for o in read):
            return []
        moves.append((down, cluster, own))
    return moves


def _share_clusters(block: Block, ops: list[Operation], routed: scf.ForOp, machine: Machine) -> bool:
    """The gate and up projections of a one-block shared loop's later F tiles on the other
    clusters (`_hidden_projections`), issued after the routing, just before the routed loop.
    split-clusters runs a shared loop of fewer blocks than clusters whole on the last cluster,
    beside the router on cluster 0; at decode its six contractions there (DeepSeek-V3 at 128
    tokens a chip: 87 us) ran past the tokens' arrival and held that cluster's first routed
    blocks, whose weight loads then held the DMA engines. Each moved tile loads the rows of x
    it reads again, on its cluster, and its hidden rows are copied home (`tile.copy`, 256 KB)
    for its down projection; its cluster runs them once the routing is done, while the link
    moves the tokens. Each contraction reads the same values, so the bits are the same."""
    moves = _hidden_projections(ops, machine)
    if not moves:
        return False
    within = set(ops)
    issued: list[Operation] = []
    for down, cluster, own in moves:
        again: dict[SSAValue, SSAValue] = {}
        for op in (o for o in ops if o in own):
            for nested in op.walk():
                for i, v in enumerate(nested.operands):
                    source = v.owner
                    if isinstance(source, Operation) and source in within and source not in own and _reloadable(source):
                        if v not in again:
                            made = source.clone()
                            pin(made, cluster)
                            block.insert_op_before(made, op)
                            again[v] = made.results[0]
                        nested.operands[i] = again[v]
            pin(op, cluster)
            if not isinstance(op, (tile.LoadExpertOp, arith.ConstantOp)):
                issued.append(op)
        copy = tile.CopyOp(down.operands[0])
        copy.attributes[PHASE_ATTR] = StringAttr(SHARED)
        place_on_cluster(copy, cluster_of(down))
        block.insert_op_before(copy, down)
        down.operands[0] = copy.result
        issued.append(copy)
    ordered = list(block.ops)
    tail = [op for op in ordered[min(ordered.index(op) for op in issued):]
            if op in issued or (op in within and not isinstance(op, (tile.LoadExpertOp, arith.ConstantOp)))]
    for op in tail:
        op.detach()
    block.insert_ops_before(tail, routed)
    return True


def _defer_down_projections(block: Block, ops: list[Operation]) -> None:
    """On a chip that gathers its tokens over sp, an unrolled one-block shared loop (`ops`) from
    its first down projection's weights on, with its result's store, issued just before the first
    op that reads that result: after the combine's return and reduce-scatter, whose link steps HBM
    otherwise idled through (DeepSeek-V3 on ep=16,sp=8, 4 tokens a chip: 45 us). HBM then loads the
    first F tile's gate and up weights while the tokens and their lists cross, the routed weights once the
    routing is done, and the rest of the shared weights while the link returns the experts' rows;
    the combine's DMA commands, issued first, do not queue behind them (ep=16,sp=8, 4 tokens a chip,
    a2a_sum: 241.7 -> 232.8 us, tcpc run --cost-only, balanced)."""
    within = set(ops)
    down = next((op for op in ops if isinstance(op, CONTRACTIONS)
                 and any(isinstance(o, CONTRACTIONS) for o in ancestors(op.operands[0], within))), None)
    if down is None:
        return
    weights = ancestors(down.operands[1], within)
    first = next(i for i, op in enumerate(ops) if isinstance(op, tile.LoadExpertOp) and op in weights)
    sink_to_first_reader(block, ops[first:])


def _keep_result_in_sram(ops: list[Operation]) -> None:
    """An unrolled one-block shared loop's result (`ops`) stays in SRAM where its store fills the
    whole HBM buffer and the only reader loads it all back: the load's readers take the stored tile,
    and the store and the load go. On a chip that gathers its tokens over sp they are the last
    commands before the output's add, after the last down projection (DeepSeek-V3 on
    ep=16,sp=8, 4 tokens a chip: 1.5 us of DMA start-ups)."""
    for store in [op for op in ops if isinstance(op, tile.StoreOp)]:
        buffer, (use, *others) = store.dest.owner, list(store.result.uses) or [None]
        load = None if use is None else use.operation
        if (others or not isinstance(load, tcp.LoadOp) or not isinstance(buffer, tile.BufferOp)
                or store.guard is not None or store.tile.type != store.dest.type):
            continue
        load.result.replace_all_uses_with(store.tile)
        offset = store.offset
        for op in (load, store):
            op.detach()
            op.erase()
        if not buffer.result.uses:
            buffer.detach()
            buffer.erase()
        erase_unread(offset)


def _place_one_block(block: Block, machine: Machine) -> None:
    """On a mesh chip with one routed expert loop, a one-block shared loop (decode) unrolled, its
    later F tiles' gate and up projections on the other clusters (`_share_clusters`) and its
    result's store issued after the routed loop, which the store's readers follow (the
    combine adds the rows): DMA engines run their commands in issue order, and the store,
    waiting for the shared expert's last contraction, held two of them until then while the
    routed weights streamed on the others."""
    found = _one_block_shared(block)
    if found is None:
        return
    shared, routed = found
    last = routed
    ops, _ = unroll(shared)
    moved = _share_clusters(block, ops, routed, machine)
    if ccl.gathers_over_sp(block) and not moved:
        _defer_down_projections(block, ops)
        _keep_result_in_sram(ops)
        return
    for store in [op for op in ops if isinstance(op, tile.StoreOp)]:
        store.detach()
        block.insert_op_after(store, last)
        last = store


def interleave(block: Block, machine: Machine) -> None:
    """Spread `block`'s shared loop through its routed loop, when it `spreads` (the module
    docstring); else, on a mesh chip, defer the load of its result (`_defer_shared_result`) and
    its one block's work (`_place_one_block`)."""
    spread = _spread(block, machine)
    if spread is None:
        _defer_shared_result(block)
        _place_one_block(block, machine)
        return
    loop, routed, routed_trips = spread
    ops, results = unroll(loop)
    cuts = chunks(ops)
    step = constant_index(routed.step)
    assert step is not None
    first, end = routed_trips[0], routed_trips[-1] + step
    filled = filled_blocks(block, end - first, block_rows(routed))
    n = max(1, min(len(cuts), filled // step))
    bounds = [first + filled * i // n // step * step for i in range(n)] + [end]
    before: list[list[Operation]] = [[] for _ in range(n)]
    for i, cut in enumerate(cuts):
        before[i * n // len(cuts)] += cut
    pieces = split(routed, bounds)
    for cut, piece in zip(before, pieces):
        for op in cut:
            op.detach()
        block.insert_ops_before(cut, piece)
    move_readers_after(block, pieces[-1], results, set())


@dataclass(frozen=True)
class InterleaveSharedPass(ModulePass):
    """A shared expert's loop -> its contractions between pieces of the routed expert loop
    (the module docstring says how)."""

    name = "interleave-shared"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        machine = machine_of(op)
        for fn in op.ops:
            if isinstance(fn, func.FuncOp) and fn.body.blocks:
                interleave(fn.body.block, machine)
