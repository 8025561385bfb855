"""split-clusters' token tiles: schedule-tokens' loops spread over the chip's clusters.

The token loops of `schedule-tokens` (the router's ranking, softmax or sigmoid and weights)
run token tile i on cluster i mod N: each iteration runs N tiles, one per cluster, pinned; the
full tiles left over (fewer than N) follow the loop on clusters N - 1, N - 2, ..., and the
partial remainder tile stays on cluster 0. A loop that skips its empty tiles (a mesh
receiver's combine) runs contiguous runs of tiles instead, cluster c the c-th run
(`skips_empty_tiles`). Every cluster has its own vector engine (the chain
sits in each slice, and a tensor-unit command, contraction and vector chain, occupies one
cluster's slices: docs/hardware.md#pes-clusters-and-slices; the simulator's `tensor` engine has
a unit per cluster), so the tiles run side by side; the 8 DMA engines are the chip's, shared.
Off cluster 0 a tile's SRAM input slice is copied to its cluster (`tile.copy`; a DMA gather
reads its source where it lives instead, `cluster_copies.read_in_place`; a slice of an
argument's SRAM copy is loaded from HBM by rows, `hbm_copied`) and its results
are copied back before they are stored into the loop's SRAM buffers, which are cluster 0's
(the routing after the loop runs there). A loop that gathers from HBM (the combine) stays on
cluster 0: the clusters share the HBM its time goes to, and a second one would only add copies;
unless it skips its empty tiles (`worth_splitting`).
"""

from __future__ import annotations

from collections.abc import Callable

from xdsl.dialects import arith, scf
from xdsl.dialects.builtin import IndexType
from xdsl.ir import Block, BlockArgument, Operation, SSAValue

from dialects import tcp, tile
from dialects.annotations import PHASE_ATTR
from dialects.tensor_types import stored_bytes
from passes.schedule._cluster_copies import pin, reacher, read_in_place
from passes._loop_builder import constant_index, in_hbm, index_constant
from target.machine import Machine
from target.target_spec import machine_of


def token_loops(block: Block) -> list[scf.ForOp]:
    """The loops of `block` built by schedule-tokens: loops from 0 with constant bounds that
    load no expert weights."""
    return [op for op in block.ops if isinstance(op, scf.ForOp)
            and not any(isinstance(inner, tile.LoadExpertOp) for inner in op.body.walk())
            and constant_index(op.lb) == 0 and constant_index(op.ub) is not None and constant_index(op.step)]


def skips_empty_tiles(loop: scf.ForOp) -> bool:
    """Whether `loop`'s tiles run only when they hold pairs: its body's work in an `scf.if` on a
    `tile.guard` (schedule-tokens' `skip_by`: a mesh receiver's combine, whose received rows sit
    at the head of each sender's range)."""
    return any(isinstance(op, scf.IfOp) and isinstance(op.cond.owner, tile.GuardOp) for op in loop.body.block.ops)


def _bytes(value: SSAValue) -> int:
    """The bytes of a tensor value as stored (sub-byte elements packed)."""
    return stored_bytes(value.type)


def vector_bytes_per_copied_byte(machine: Machine) -> int:
    """A compile-time rule of thumb, not a cost: a token tile goes to another cluster only when
    its vector ops make at least this many bytes per byte copied between the clusters for it.
    A cluster's vector engine streams a flit per slice per cycle (4-way float stages: half
    that; docs/hardware.md#vector-engine), the chip's DMA engines their bytes per cycle each,
    and a DM -> DM copy reads and writes in turn (docs/hardware.md#moving-data): on RNGD a
    copied byte takes the time of about 4 to 8 vector bytes (32 B x 256 slices over 8 x 256 B
    / 2), before each copy's ~500-cycle start-up; the rule takes the 8. Llama-4-Scout's router
    at T = 4096 took 68,336 cycles on one cluster and 125,578 split with copies of its [T, D]
    scaled input."""
    vector = machine.flit_bytes * machine.slices
    copy = machine.dma_engines * machine.dma_bytes_per_cycle / 2
    return max(1, round(vector / copy))


def worth_splitting(loop: scf.ForOp, machine: Machine) -> bool:
    """Whether a tile of `loop` on another cluster saves more than it costs.

    No when the loop gathers rows from HBM (the combine): its time is the gather's HBM traffic,
    and the clusters share one HBM and its 8 DMA engines (docs/hardware.md#moving-data), so a
    second cluster adds only the copies between them (Qwen3-30B-A3B at T = 4096: combine
    93,679 -> 148,465 cycles when split). Unless it `skips_empty_tiles`: a mesh receiver's
    combine gathers only the tiles that hold pairs, half of whose rows are empty under balanced
    routing, so its vector work (every row's K slots) outlasts its gathers on one cluster
    (Qwen3-30B-A3B on 8 chips, a2a_sum, 8 chunks: 17 us of vector work against 15 of gathers
    between two chunks' expert loops, 1,742.5 -> 1,706.3 us split), when a tile's vector work
    (its bytes at a flit per slice per cycle) outlasts a DMA start-up per SRAM value it slices
    or stores, a rule of thumb for tiles too small to pay for their cluster's copies
    (DeepSeek-V3's toy dims on 8 chips, 2 chunks: 8-row tiles of 64 columns, 117,793 ->
    118,143 cycles split). No when what crosses the clusters for a tile (the SRAM
    tiles it slices, copied to it, and the tiles it stores into SRAM buffers, copied back)
    is more than a `vector_bytes_per_copied_byte`-th of what its vector-engine ops make
    (Llama-4's router, which scales each token's whole input row by its routing weight)."""
    body = loop.body.block
    made = crossing = copies = 0
    skips = skips_empty_tiles(loop)
    for op in body.walk():
        if isinstance(op, tcp.DmaGatherOp) and in_hbm(op.source) and not skips:
            return False
        if isinstance(op, tile.SliceOp) and not in_hbm(op.source):
            crossing, copies = crossing + _bytes(op.result), copies + 1
        elif isinstance(op, tile.StoreOp) and not _stores_to_hbm(op, loop):
            crossing, copies = crossing + _bytes(op.tile), copies + 1
        elif op.dialect_name() == "ve":
            made += sum(_bytes(r) for r in op.results)
    if skips and made / (machine.flit_bytes * machine.slices) < copies * machine.dma_startup_cycles:
        return False
    return made >= vector_bytes_per_copied_byte(machine) * crossing


def hbm_copied(value: SSAValue) -> SSAValue | None:
    """The HBM tensor `value` is a whole SRAM copy of (its `tcp.load`, load-arguments' copy of
    an argument), else None: a tile of it is also rows of that tensor, which another cluster
    loads from HBM, pipelined, rather than copying cluster 0's rows SRAM -> SRAM (reads and
    writes in turn: docs/hardware.md#moving-data). `worth_splitting` still counts such a tile as
    crossing (docs/passes.md, split-clusters: counted free, gpt-oss-120b fp8 at T = 4096 split
    its router and lost 5k cycles)."""
    owner = value.owner
    return owner.input if isinstance(owner, tcp.LoadOp) and in_hbm(owner.input) else None


def load_sliced_rows(copy: tcp.LoadOp) -> None:
    """Where every reader of `copy`, a whole SRAM copy of an HBM tensor, slices whole rows of it
    (a token loop's tiles), each tile loads its rows from HBM instead (`tile.load`) and the copy
    goes, as schedule-tokens' `loaded_whole` does for a copy only its loop reads: the first
    tile's work then waits for that tile's rows, not for all T."""
    slices = [use.operation for use in copy.result.uses]
    if not slices or not all(isinstance(op, tile.SliceOp) and op.offsets is None for op in slices):
        return
    for op in slices:
        assert isinstance(op, tile.SliceOp)
        load = tile.LoadOp(copy.input, op.offset, op.result.type)
        load.attributes.update(op.attributes)
        load.result.name_hint = op.result.name_hint
        block = op.parent_block()
        assert block is not None
        block.insert_op_before(load, op)
        op.result.replace_all_uses_with(load.result)
        op.detach()
        op.erase()
    copy.detach()
    copy.erase()


def _stores_to_hbm(store: tile.StoreOp, loop: scf.ForOp) -> bool:
    """Whether `store` writes a buffer in HBM (its destination a carried buffer of `loop`)."""
    dest = store.dest
    body = loop.body.block
    if isinstance(dest, BlockArgument) and dest.owner is body and dest.index > 0:
        return in_hbm(loop.iter_args[dest.index - 1])
    return in_hbm(dest)


def _tile_on_cluster(loop: scf.ForOp, offset: SSAValue, carried: list[SSAValue], cluster: int,
                     add: Callable[[Operation], None], reach: Callable[[SSAValue, int], SSAValue]) -> list[SSAValue]:
    """One tile of `loop`'s body, at row `offset`, on `cluster` (every op pinned to it), with
    the carried buffers `carried`; returns what it yields. Off cluster 0, an SRAM tile it
    slices is copied to it (`tile.copy`; rows of an argument's SRAM copy are loaded from HBM,
    `hbm_copied`) and a tile it stores into an SRAM buffer is copied back
    first: the buffers are cluster 0's, where the phases after the loop run. In a loop that
    `skips_empty_tiles` it slices a copy of the whole SRAM value instead, made once before the
    loop: a skipped tile then costs its guard alone, not two copies' start-ups ahead of it
    (Qwen3-30B-A3B on 2 chips, a2a_sum, 2 chunks: a receiver's 32 tiles of 128 rows, each
    holding pairs, 1,769.2 us with a copy of each tile's indices, 1,765.0 so; 1,764.8 on one
    cluster)."""
    whole = skips_empty_tiles(loop)
    body = loop.body.block
    yielded = body.last_op
    assert isinstance(yielded, scf.YieldOp)
    index, *args = body.args
    mapping: dict[SSAValue, SSAValue] = {index: offset, **dict(zip(args, carried))}
    defined = {r for op in body.walk() for r in op.results} | set(body.args)
    for nested in body.walk():
        for region in nested.regions:
            for blk in region.blocks:
                defined |= set(blk.args)

    def place(op: Operation, on: int, like: Operation) -> Operation:
        for key, attr in like.attributes.items():
            op.attributes.setdefault(key, attr)
        pin(op, on)
        add(op)
        return op

    for op in body.ops:
        if op is yielded:
            break
        if isinstance(op, tile.SliceOp) and op.source not in defined:
            source = reach(op.source, cluster) if whole else op.source
            hbm = hbm_copied(op.source) if cluster != 0 and not whole else None
            if hbm is not None:  # rows of an argument's SRAM copy: loaded from HBM, not copied across
                new: Operation = place(tile.LoadOp(hbm, mapping[op.offset], op.result.type), cluster, op)
            else:
                new = place(tile.SliceOp(source, mapping[op.offset], op.result.type), cluster, op)
            new.results[0].name_hint = op.result.name_hint
            if cluster != 0 and not in_hbm(op.source) and not whole and hbm is None:
                new = place(tile.CopyOp(new.results[0]), cluster, op)
                new.results[0].name_hint = op.result.name_hint
            mapping[op.result] = new.results[0]
            continue
        for inner in op.walk():
            for operand in inner.operands:
                if operand not in defined and operand not in mapping and not read_in_place(inner, operand):
                    mapping[operand] = reach(operand, cluster)
        if isinstance(op, tile.StoreOp) and cluster != 0 and not _stores_to_hbm(op, loop):
            back = place(tile.CopyOp(mapping[op.tile]), 0, op)
            guard = None if op.guard is None else mapping[op.guard]
            new = place(tile.StoreOp(back.results[0], mapping[op.dest], mapping[op.offset], guard), 0, op)
        else:
            new = place(op.clone(value_mapper=mapping), cluster, op)
        for old_r, new_r in zip(op.results, new.results):
            new_r.name_hint = old_r.name_hint
            mapping[old_r] = new_r
    return [mapping[v] for v in yielded.operands]


def split_token_loop(loop: scf.ForOp, clusters: int) -> scf.ForOp | None:
    """Rebuild a token-tile loop so that tile i runs on cluster i mod N: each iteration runs N
    tiles, one per cluster; the tiles left over (fewer than N) follow the loop, on clusters
    N - 1, N - 2, ... (cluster 0 runs schedule-tokens' partial remainder tile after them).
    A loop that `skips_empty_tiles` runs tile r + c R on cluster c instead (R the rounds):
    a receiver's pairs sit at the head of each sender's rows, so the tiles that hold them
    are every (rows a sender / rows a tile)-th, all on cluster 0 when taken in turn, and
    contiguous runs give each cluster its share of the senders.
    None (the loop left as it is, on cluster 0) when splitting it would not pay
    (`_worth_splitting`)."""
    if not worth_splitting(loop, machine_of(loop)):
        return None
    rows, main = constant_index(loop.step), constant_index(loop.ub)
    assert rows and main is not None
    tiles = main // rows
    rounds, leftover = divmod(tiles, clusters)
    run = rounds if skips_empty_tiles(loop) else 1  # cluster c's first tile
    marker = {k: v for k, v in loop.attributes.items() if k == PHASE_ATTR}
    before: list[Operation] = []
    reach = reacher(before)
    new_body = Block(arg_types=[IndexType(), *(v.type for v in loop.iter_args)])
    row, *carried = new_body.args
    row.name_hint = loop.body.block.args[0].name_hint
    for c in range(clusters):
        if c == 0:
            offset: SSAValue = row
        else:
            shift = index_constant(c * run * rows)
            step_to = arith.AddiOp(row, shift.result)
            step_to.result.name_hint = f"{row.name_hint or 'row'}_c{c}"
            for op in (shift, step_to):
                op.attributes.update(marker)
                pin(op, c)
                new_body.add_op(op)
            offset = step_to.result
        carried = _tile_on_cluster(loop, offset, carried, c, new_body.add_op, reach)
    new_body.add_op(scf.YieldOp(*carried))
    step = rows * (1 if run > 1 else clusters)
    bounds = [index_constant(0), index_constant(rounds * step), index_constant(step)]
    new_loop = scf.ForOp(*(b.result for b in bounds), loop.iter_args, new_body)
    new_loop.attributes.update(loop.attributes)
    after: list[Operation] = []
    results: list[SSAValue] = list(new_loop.results)
    for k in range(leftover):
        start = index_constant((rounds * clusters + k) * rows)
        after.append(start)
        results = _tile_on_cluster(loop, start.result, results, clusters - 1 - k, after.append, reach)
    for op in [*bounds, *before, *after]:
        op.attributes.update({k: v for k, v in marker.items() if k not in op.attributes})
    parent = loop.parent_block()
    assert parent is not None
    parent.insert_ops_before([*(bounds if rounds else []), *before, *([new_loop] if rounds else []), *after], loop)
    if not rounds:  # fewer tiles than clusters: no loop, the leftovers start from the buffers
        for arg, init in zip(new_loop.results, loop.iter_args):
            arg.replace_all_uses_with(init)
    for old, new in zip(loop.results, results):
        new.name_hint = old.name_hint
        old.replace_all_uses_with(new)
    old_bounds = [v.owner for v in (loop.lb, loop.ub, loop.step)]
    loop.detach()
    loop.erase()
    for bound in dict.fromkeys(old_bounds):
        if isinstance(bound, Operation) and not any(r.uses for r in bound.results):
            bound.detach()
            bound.erase()
    if not rounds:
        new_loop.erase()
        for bound in bounds:
            bound.erase()
    return new_loop if rounds else None
