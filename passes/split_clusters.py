"""`split-clusters{clusters=N}`: the expert loop and the token loops spread over the chip's clusters.

RNGD has two clusters of 256 slices; each runs its own tensor-unit commands in lockstep, and
the two run at once (docs/hardware.md#pes-clusters-and-slices). `schedule-experts` builds one
loop over the G blocks; this pass makes each iteration carry one copy of the block's work per
cluster, pinned to it (`tcpc.cluster`), and guarded so that exactly one copy runs:

- cluster c owns the experts e with e mod N == c (N a power of two). Before the loop, each
  cluster computes its own `expert_ids` with the other clusters' blocks set to -1 (a `ve.and`,
  a comparison and a select on G ids), from a DMA copy (`tile.copy`) when it is not the cluster
  the routing ran on. An expert's blocks are adjacent and all on one cluster, so its weights
  are still loaded once, by the cluster that contracts them;
- in cluster c's copy the block's id is its own masked id: its weight loads (`tile.load_expert`)
  and guarded contractions skip a block another cluster owns, as they skip unused blocks; its
  row loads and result stores (`tile.load`, `tile.store`) are guarded by whether c owns the
  block (an unused block, id -1, belongs to cluster N - 1, which computes and stores it as the
  loop did), so each block is stored exactly once and a skipped copy moves nothing;
- the values a copy reads from SRAM that another cluster produced are copied to it by DMA once,
  before the loop (constants are rebuilt, not copied); HBM values are read directly;
- the result buffers in HBM are shared, chained through both copies' guarded stores; every
  other loop-carried value (previous ids and weights for reuse, the double-buffering waits) is
  each cluster's own.

Vector ops of the copy that does not own a block still run on that cluster's (zero) tiles: the
chain has no guard of its own. That costs each cluster the other's vector time on the block
(a few percent of a block's contraction at real sizes), and is visible in the report.

The token loops of `schedule-tokens` (the router's ranking, softmax or sigmoid and weights)
run token tile i on cluster i mod N: each iteration runs N tiles, one per cluster, pinned; the
full tiles left over (fewer than N) follow the loop on clusters N - 1, N - 2, ..., and the
partial remainder tile stays on cluster 0. Every cluster has its own vector engine (the chain
sits in each slice, and a tensor-unit command, contraction and vector chain, occupies one
cluster's slices: docs/hardware.md#pes-clusters-and-slices; the simulator's `tensor` engine has
a unit per cluster), so the tiles run side by side; the 8 DMA engines are the chip's, shared.
Off cluster 0 a tile's SRAM input slice is copied to its cluster (`tile.copy`) and its results
are copied back before they are stored into the loop's SRAM buffers, which are cluster 0's
(the routing after the loop runs there). A loop that gathers from HBM (the combine) stays on
cluster 0: the clusters share the HBM its time goes to, and a second one would only add copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import arith, func, scf
from xdsl.dialects.builtin import IndexType, IntegerAttr, ModuleOp, TensorType
from xdsl.ir import Block, BlockArgument, OpResult, Operation, SSAValue
from xdsl.passes import ModulePass

from dialects import tcp, tile, ve
from dialects.annotations import PHASE_ATTR, place_on_cluster, placed_in_hbm
from dialects.tensor_types import stored_bits


def expert_loops(block: Block) -> list[scf.ForOp]:
    """The loops of `block` built by schedule-experts: those whose body loads expert weights."""
    return [op for op in block.ops if isinstance(op, scf.ForOp)
            and any(isinstance(inner, tile.LoadExpertOp) for inner in op.body.walk())]


def _in_hbm(value: SSAValue) -> bool:
    """Whether `value` lives in HBM: a function argument, an HBM buffer or a command placed in
    HBM, through views, stores into a buffer and the loops that carry one."""
    while True:
        owner = value.owner
        if isinstance(owner, tcp.ViewOp):
            value = owner.input
        elif isinstance(owner, tile.StoreOp):
            value = owner.dest
        elif isinstance(owner, scf.ForOp) and isinstance(value, OpResult):
            value = owner.iter_args[value.index]
        else:
            break
    if isinstance(value, BlockArgument) and isinstance(owner, Block):
        return isinstance(owner.parent_op(), func.FuncOp)
    if isinstance(owner, tile.BufferOp):
        return owner.space.data == "hbm"
    return isinstance(owner, Operation) and placed_in_hbm(owner)


def _is_stored(value: SSAValue) -> bool:
    """Whether `value` is a buffer a `tile.store` wrote, directly or as a branch's result."""
    owner = value.owner
    if isinstance(owner, tile.StoreOp):
        return True
    if isinstance(owner, scf.IfOp) and isinstance(value, OpResult):
        then_yield = owner.true_region.block.last_op
        return isinstance(then_yield, scf.YieldOp) and _is_stored(then_yield.operands[value.index])
    return False


def _is_constant(value: SSAValue) -> bool:
    return isinstance(value.owner, (ve.ConstOp, arith.ConstantOp))


def _owned_ids(ids: SSAValue, cluster: int, clusters: int, before: list[Operation],
               with_blocks: bool) -> tuple[SSAValue, SSAValue | None]:
    """For `cluster`, computed on it from `ids` (the expert ids as it reads them): the ids with
    the blocks of experts another cluster owns set to -1, and, `with_blocks`, the blocks it owns
    (0, else -1; an unused block, id -1, belongs to the cluster -1 mod N names)."""
    t = ids.type
    mask = ve.ConstOp(clusters - 1, t)
    owner = ve.AndOp(ids, mask.result)
    this = ve.ConstOp(cluster, t)
    mine = ve.TagOp("eq", owner.result, this.result)
    none = ve.ConstOp(-1, t)
    owned = ve.SelectOp(mine.result, [1], ids, none.result)
    ops: list[Operation] = [mask, owner, this, mine, none, owned]
    owned.result.name_hint = f"expert_ids_cluster{cluster}"
    blocks = None
    if with_blocks:
        zero = ve.ConstOp(0, t)
        select = ve.SelectOp(mine.result, [1], zero.result, none.result)
        select.result.name_hint = f"blocks_cluster{cluster}"
        ops += [zero, select]
        blocks = select.result
    for op in ops:
        place_on_cluster(op, cluster)
    before.extend(ops)
    return owned.result, blocks


def _reacher(before: list[Operation]) -> Callable[[SSAValue, int], SSAValue]:
    """`reach(value, cluster)`: `value`, defined before a loop, as `cluster` reads it: itself
    on cluster 0, in HBM or a constant, else its DMA copy (`tile.copy`, appended to `before`
    once per cluster and value)."""
    copies: dict[tuple[int, SSAValue], SSAValue] = {}

    def reach(value: SSAValue, cluster: int) -> SSAValue:
        if cluster == 0 or _in_hbm(value) or _is_constant(value):
            return value
        if (cluster, value) not in copies:
            copy = tile.CopyOp(value)
            place_on_cluster(copy, cluster)
            before.append(copy)
            copies[(cluster, value)] = copy.result
        return copies[(cluster, value)]

    return reach


def _pin(op: Operation, cluster: int) -> None:
    for inner in op.walk():
        place_on_cluster(inner, cluster)


def split_loop(loop: scf.ForOp, clusters: int) -> scf.ForOp:
    """Rebuild `loop` with one guarded copy of its body per cluster (see the docstring)."""
    body = loop.body.block
    yielded = body.last_op
    assert isinstance(yielded, scf.YieldOp)
    loads = [op for op in body.walk() if isinstance(op, tile.LoadExpertOp)]
    ids_tile = loads[0].ids
    slice_op = ids_tile.owner
    if not isinstance(slice_op, tile.SliceOp) or slice_op.parent_block() is not body:
        raise ValueError("split-clusters: the expert loop's weight loads are not indexed by the block's expert id")
    expert_ids = slice_op.source
    index, *old_args = body.args
    # A carried value is a result buffer (shared by every cluster) when the body yields a store into it.
    shared = [i for i, v in enumerate(yielded.operands) if _is_stored(v)]
    private = [i for i in range(len(old_args)) if i not in shared]
    for i in private:
        if loop.results[i].uses:
            raise ValueError("split-clusters: a loop result other than a stored buffer is used after the loop")
    phase = loop.attributes.get(PHASE_ATTR)

    before: list[Operation] = []
    reach = _reacher(before)

    # Row loads and stores outside an scf.if need a guard of their own: whether c owns the block.
    guarded = any(isinstance(op, (tile.LoadOp, tile.StoreOp)) for op in body.ops)
    owned, block_guards = zip(*(_owned_ids(reach(expert_ids, c), c, clusters, before, guarded) for c in range(clusters)))
    inits = list(loop.iter_args)
    new_inits = [inits[i] for i in shared] + [inits[i] for _ in range(clusters) for i in private]
    new_body = Block(arg_types=[index.type, *(v.type for v in new_inits)])
    new_index, *new_args = new_body.args
    new_index.name_hint = index.name_hint
    shared_args = dict(zip(shared, new_args[:len(shared)]))
    chain: dict[int, SSAValue] = dict(shared_args)
    private_yields: list[SSAValue] = []
    defined_in_body = {r for op in body.walk() for r in op.results} | set(body.args)
    for region_op in body.walk():
        for region in region_op.regions:
            for blk in region.blocks:
                defined_in_body |= set(blk.args)

    for c in range(clusters):
        mapping: dict[SSAValue, SSAValue] = {index: new_index}
        mapping.update({old_args[i]: chain[i] for i in shared})
        cluster_args = new_args[len(shared) + c * len(private):len(shared) + (c + 1) * len(private)]
        mapping.update({old_args[i]: a for i, a in zip(private, cluster_args)})
        for a, old in zip(cluster_args, (old_args[i] for i in private)):
            a.name_hint = f"{old.name_hint}_c{c}" if old.name_hint else None
        block_guard: SSAValue | None = None
        if guarded:
            owns = tile.SliceOp(block_guards[c], new_index, ids_tile.type)
            owns.result.name_hint = "block_is_mine" if c == 0 else f"block_is_mine_c{c}"
            _pin(owns, c)
            if phase is not None:
                owns.attributes[PHASE_ATTR] = phase
            new_body.add_op(owns)
            block_guard = owns.result

        for op in body.ops:
            if op is yielded:
                break
            for operand in (o for inner in op.walk() for o in inner.operands):
                if operand not in defined_in_body and operand not in mapping:
                    mapping[operand] = reach(operand, c)
            if op is slice_op:
                new: Operation = tile.SliceOp(owned[c], mapping[index], ids_tile.type)
            elif isinstance(op, tile.LoadOp):
                new = tile.LoadOp(mapping[op.source], mapping[op.offset], op.result.type,
                                  [mapping[a] for a in op.after], guard=block_guard)
            elif isinstance(op, tile.StoreOp):
                new = tile.StoreOp(mapping[op.tile], mapping[op.dest], mapping[op.offset], guard=block_guard)
            else:
                new = op.clone(value_mapper=mapping)
            for key, attr in op.attributes.items():
                new.attributes.setdefault(key, attr)
            for old_r, new_r in zip(op.results, new.results):
                new_r.name_hint = old_r.name_hint
                mapping[old_r] = new_r
            _pin(new, c)
            new_body.add_op(new)
        for i in shared:
            chain[i] = mapping[yielded.operands[i]]
        private_yields += [mapping[yielded.operands[i]] for i in private]
    new_body.add_op(scf.YieldOp(*(chain[i] for i in shared), *private_yields))

    new_loop = scf.ForOp(loop.lb, loop.ub, loop.step, new_inits, new_body)
    new_loop.attributes.update(loop.attributes)
    for op in before:
        if phase is not None:
            op.attributes.setdefault(PHASE_ATTR, phase)
    parent = loop.parent_block()
    assert parent is not None
    parent.insert_ops_before([*before, new_loop], loop)
    for k, i in enumerate(shared):
        loop.results[i].replace_all_uses_with(new_loop.results[k])
    loop.detach()
    loop.erase()
    return new_loop


def token_loops(block: Block) -> list[scf.ForOp]:
    """The loops of `block` built by schedule-tokens: the other loops from 0 with constant
    bounds (no expert weights loaded in them)."""
    experts = set(expert_loops(block))
    return [op for op in block.ops if isinstance(op, scf.ForOp) and op not in experts
            and _constant_index(op.lb) == 0 and _constant_index(op.ub) is not None and _constant_index(op.step)]


def _constant_index(value: SSAValue) -> int | None:
    owner = value.owner
    if isinstance(owner, arith.ConstantOp) and isinstance(owner.value, IntegerAttr):
        return owner.value.value.data
    return None


def _index(value: int) -> arith.ConstantOp:
    return arith.ConstantOp.from_int_and_width(value, IndexType())


def _bytes(value: SSAValue) -> int:
    t = value.type
    if not isinstance(t, TensorType):
        return 0
    return -(-math.prod(t.get_shape()) * stored_bits(t.get_element_type()) // 8)


VECTOR_BYTES_PER_COPIED_BYTE = 8
"""A compile-time rule of thumb, not a cost (the pass sees no machine): a token tile goes to
another cluster only when its vector ops make at least this many bytes per byte copied between
the clusters for it. A cluster's vector engine streams a 32-byte flit per slice per cycle over
256 slices (4-way float stages: half that; docs/hardware.md#vector-engine), the chip's 8 DMA
engines 256 B per cycle each, and a DM -> DM copy reads and writes in turn
(docs/hardware.md#moving-data): a copied byte takes the time of about 4 to 8 vector bytes,
before each copy's ~500-cycle start-up. Llama-4-Scout's router at T = 4096 took 68,336 cycles
on one cluster and 125,578 split with copies of its [T, D] scaled input."""


def _worth_splitting(loop: scf.ForOp) -> bool:
    """Whether a tile of `loop` on another cluster saves more than it costs.

    No when the loop gathers rows from HBM (the combine): its time is the gather's HBM traffic,
    and the clusters share one HBM and its 8 DMA engines (docs/hardware.md#moving-data), so a
    second cluster adds only the copies between them (Qwen3-30B-A3B at T = 4096: combine
    93,679 -> 148,465 cycles when split). No when what crosses the clusters for a tile (the SRAM
    tiles it slices, copied to it, and the tiles it stores into SRAM buffers, copied back)
    is more than a `VECTOR_BYTES_PER_COPIED_BYTE`-th of what its vector-engine ops make
    (Llama-4's router, which scales each token's whole input row by its routing weight)."""
    body = loop.body.block
    made = crossing = 0
    for op in body.walk():
        if isinstance(op, tcp.DmaGatherOp) and _in_hbm(op.source):
            return False
        if isinstance(op, tile.SliceOp):
            crossing += 0 if _in_hbm(op.source) else _bytes(op.result)
        elif isinstance(op, tile.StoreOp):
            crossing += 0 if _stores_to_hbm(op, loop) else _bytes(op.tile)
        elif op.dialect_name() == "ve":
            made += sum(_bytes(r) for r in op.results)
    return made >= VECTOR_BYTES_PER_COPIED_BYTE * crossing


def _stores_to_hbm(store: tile.StoreOp, loop: scf.ForOp) -> bool:
    """Whether `store` writes a buffer in HBM (its destination a carried buffer of `loop`)."""
    dest = store.dest
    body = loop.body.block
    if isinstance(dest, BlockArgument) and dest.owner is body and dest.index > 0:
        return _in_hbm(loop.iter_args[dest.index - 1])
    return _in_hbm(dest)


def _tile_on_cluster(loop: scf.ForOp, offset: SSAValue, carried: list[SSAValue], cluster: int,
                     add: Callable[[Operation], None], reach: Callable[[SSAValue, int], SSAValue]) -> list[SSAValue]:
    """One tile of `loop`'s body, at row `offset`, on `cluster` (every op pinned to it), with
    the carried buffers `carried`; returns what it yields. Off cluster 0, an SRAM tile it
    slices is copied to it (`tile.copy`) and a tile it stores into an SRAM buffer is copied back
    first: the buffers are cluster 0's, where the phases after the loop run."""
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
        _pin(op, on)
        add(op)
        return op

    for op in body.ops:
        if op is yielded:
            break
        if isinstance(op, tile.SliceOp) and op.source not in defined:
            new: Operation = place(tile.SliceOp(op.source, mapping[op.offset], op.result.type), cluster, op)
            new.results[0].name_hint = op.result.name_hint
            if cluster != 0 and not _in_hbm(op.source):
                new = place(tile.CopyOp(new.results[0]), cluster, op)
                new.results[0].name_hint = op.result.name_hint
            mapping[op.result] = new.results[0]
            continue
        for operand in (o for inner in op.walk() for o in inner.operands):
            if operand not in defined and operand not in mapping:
                mapping[operand] = reach(operand, cluster)
        if isinstance(op, tile.StoreOp) and cluster != 0 and not _stores_to_hbm(op, loop):
            back = place(tile.CopyOp(mapping[op.tile]), 0, op)
            new = place(tile.StoreOp(back.results[0], mapping[op.dest], mapping[op.offset]), 0, op)
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
    None (the loop left as it is, on cluster 0) when splitting it would not pay
    (`_worth_splitting`)."""
    if not _worth_splitting(loop):
        return None
    rows, main = _constant_index(loop.step), _constant_index(loop.ub)
    assert rows and main is not None
    tiles = main // rows
    rounds, leftover = divmod(tiles, clusters)
    marker = {k: v for k, v in loop.attributes.items() if k == PHASE_ATTR}
    before: list[Operation] = []
    reach = _reacher(before)
    body_ops: list[Operation] = []
    new_body = Block(arg_types=[IndexType(), *(v.type for v in loop.iter_args)])
    row, *carried = new_body.args
    row.name_hint = loop.body.block.args[0].name_hint
    for c in range(clusters):
        if c == 0:
            offset: SSAValue = row
        else:
            shift = _index(c * rows)
            step_to = arith.AddiOp(row, shift.result)
            step_to.result.name_hint = f"{row.name_hint or 'row'}_c{c}"
            for op in (shift, step_to):
                op.attributes.update(marker)
                _pin(op, c)
                new_body.add_op(op)
            offset = step_to.result
        carried = _tile_on_cluster(loop, offset, carried, c, new_body.add_op, reach)
    new_body.add_op(scf.YieldOp(*carried))
    bounds = [_index(0), _index(rounds * clusters * rows), _index(clusters * rows)]
    new_loop = scf.ForOp(*(b.result for b in bounds), loop.iter_args, new_body)
    new_loop.attributes.update(loop.attributes)
    after: list[Operation] = []
    results: list[SSAValue] = list(new_loop.results)
    for k in range(leftover):
        start = _index((rounds * clusters + k) * rows)
        after.append(start)
        results = _tile_on_cluster(loop, start.result, results, clusters - 1 - k, after.append, reach)
    for op in [*bounds, *before, *after]:
        op.attributes.update({k: v for k, v in marker.items() if k not in op.attributes})
    parent = loop.parent_block()
    assert parent is not None
    parent.insert_ops_before([*bounds, *before, *([new_loop] if rounds else []), *after], loop)
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
    return new_loop if rounds else None


@dataclass(frozen=True)
class SplitClustersPass(ModulePass):
    name = "split-clusters"

    clusters: int = 2
    """Clusters of the target chip (RNGD: 2); 1 leaves the loops as they are."""

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.clusters < 1 or self.clusters & (self.clusters - 1):
            raise ValueError(f"split-clusters: clusters={self.clusters} is not a power of two")
        if self.clusters == 1:
            return
        for fn in op.ops:
            if isinstance(fn, func.FuncOp) and fn.body.blocks:
                tokens = token_loops(fn.body.block)
                for loop in expert_loops(fn.body.block):
                    split_loop(loop, self.clusters)
                for loop in tokens:
                    split_token_loop(loop, self.clusters)
