"""Expert groups, for `schedule-experts{order=tile}`: the expert loop over groups of consecutive
blocks, each weight tile loaded once per expert of a group and contracted with all of that
expert's rows in the group at once.

In block order (the pass's default) the loop runs one block at a time, and each block loads its
expert's weights, fetching streamed F tiles again for every block: with B = 16, Mixtral-8x7B's
experts (352 MB each, 64 blocks each at T = 4096) cross HBM 64 times. Its contractions are one
block's rows too, [B, D] x [D, F tile]: at B = 16 a slice's share of the stationary and the
streamed operand is too small to keep the multipliers busy (target/contraction_mapping.py:
Qwen3-30B-A3B's [16, 2048] x [2048, 512] runs at 25% of the MACs, bound by fetch).

A group is R consecutive blocks (`group=N`, else `group_blocks`: the most, a power of two, whose
rows and what the blocks' ops make of them fit a quarter of a cluster's SRAM). Before the loop,
vector ops on the expert ids find each group's distinct experts, its *slots* (`slot_tables`: at
most min(R, E), by comparing ids, so any layout of the ids works), and which chunks (blocks, or
128-row parts of blocks of a multiple of 128 rows) each slot computes: a chunk of another
expert, or one holding only padding rows, is guarded off. Made before the loop, they hold up no
weight load behind the previous group's work. The body:

- gathers the group's rows at once (`tile.gather %x[%block_tokens_tile]`, [R, B, D]);
- for each slot, in order, runs the F tiles as a block does: loads the tile of the slot's
  expert (`tile.load_expert` by the slot's id), contracts the group's rows with it
  (`tcp.contract "gbd,df->gbf"`: one weight for every chunk, so the mapping streams the
  group's rows past a stationary weight, or the weight past them; each chunk gets the bits
  of its own block's product, numerics.contract), runs the column work on the group's rows,
  and adds its share of the down-projection to the group's f32 sum (`acc`). The slots share
  that sum: a guarded-off chunk keeps it. A slot after the first is an `scf.if` on its id, so
  a group of fewer experts skips the rest;
- stores the group's rows in one command guarded chunk by chunk (`tile.store ... guard`, one
  id per chunk): split-clusters' copies write only the blocks of the experts they own, and no
  copy writes an unused block or a chunk of padding. With resident weight tiles (their loads
  issued up front) the next group issues it, after its weight loads: a group's results wait in
  SRAM for it (loop-carried with their chunks' ids and first block); a group that does not run
  stores them, and the last group stores its own, these last stores one command per block
  (`store_rows`: nothing overlaps them). DMA engines run their commands in program
  order, so a store issued at the end of its own group held an engine idle until the group's
  last contraction, and the next group's loads, issued after it, could not use that engine
  meanwhile (Qwen3-30B-A3B, T = 2048, B = 128, cost-only, balanced: 1,055,440 -> 1,039,088
  cycles; B = 256: 1,068,833 -> 1,041,060). Streamed tiles' loads wait for the contractions,
  and a loop of one group (decode's, or the blocks left over) has no next group: there the
  group stores its own rows at the end of its body (deferred, Mixtral-8x7B at T = 4096,
  B = 64, took 76,032 cycles more).

So a weight tile crosses HBM once per expert and group, and a contraction takes all the rows
an expert has in the group instead of a block's. More than one slot add into one accumulator:
it starts at -0.0, the additive identity (-0.0 + x is x for every x, where +0.0 + -0.0 is
+0.0), so each chunk's sum has the bits it has alone. With one slot (one block, or one expert)
the sum starts from the first tile's product as in block order.

The loop runs over the groups of R blocks; when R does not divide G the remaining blocks run in
a second loop of one group. The row gather of a group waits for the last contraction of the
group two before it (`GROUPS_AHEAD`: two groups' rows in SRAM). A streamed tile's loads wait for
the down-projection two tiles earlier, across the slots and groups (`TILES_IN_FLIGHT`); a
resident tile's (reused by the expert's next group) for the last contraction of the slot two
active slots before (`SLOTS_AHEAD`: two experts' weights in SRAM, as `choose_f_tile` sizes them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from xdsl.dialects import arith, scf
from xdsl.dialects.builtin import IndexType, TensorType, f32, i32
from xdsl.ir import Attribute, Block, Operation, SSAValue

from dialects import tcp, tile, ve
from dialects.annotations import PHASE_ATTR
from dialects.tensor_types import shape_of, stored_bytes
from passes._loop_builder import (ZERO_OPERAND_VE, clone_rows, in_hbm, index_constant, leading, reopen_otherwise,
                                  replace_by_loop, skip_unless, tile_type)
from passes.schedule._f_tiles import TILES_IN_FLIGHT, WEIGHT_SHARE, FRegion
from runtime_sim.semantics.numerics import GRID_M

GROUP_SPEC = "gbd,df->gbf"
"""A group's contraction: its chunks' rows [n, C, K] by one expert's weight [K, N]."""
GROUPS_AHEAD = 2
"""A group's rows are gathered once the group two before has contracted: two groups' rows in SRAM."""
SLOTS_AHEAD = 2
"""A resident weight tile's load waits for the slot two active slots before: two experts' weights."""
ROWS_SHARE = 4
"""A group's rows and the values it makes per row may take 1 / ROWS_SHARE of a cluster's SRAM
(the weights take 1 / WEIGHT_SHARE; the rest holds the other phases' tiles). Assumption: a
compiler's split, checked against the simulator's peak SRAM (docs/passes.md)."""
assert 1 / ROWS_SHARE + 1 / WEIGHT_SHARE < 1
SLOTS_UNROLLED = 4
"""A group of at most this many slots has them one after another in its body; more (decode's
groups: 8 to 128 slots, DeepSeek-V3 at T = 16 some 35,000 ops unrolled) run the slots after the
first as an `scf.for` over the slot number (`GroupLoop.slot_loop`). A prefill group is a few
blocks (2 to 4 slots) in a loop of hundreds of groups, whose iterations a cost-only run copies
only while the body holds no inner loop (runtime_sim/perf/cost_only.py, LoopReplay)."""


def chunk_rows(rows: int) -> int:
    """The rows of a contraction chunk: a block, or 128-row parts of a block of a multiple of
    128 rows (the contraction grid's GRID_M: each part's product has the bits of the block's,
    and a part holding only padding rows is skipped)."""
    return GRID_M if rows > GRID_M and rows % GRID_M == 0 else rows


@dataclass
class GroupPlan:
    """What schedule-experts found for one plan: its block-parallel ops (in order), the results
    read after the loop, its F region and tiles, and the plan's sizes."""

    ops: list[Operation]
    escaping: list[SSAValue]
    region: FRegion
    tiles: list[tuple[int, int]]
    resident: bool
    expert_ids: SSAValue
    tokens: SSAValue
    """The dispatch's row -> token index [G, B] (-1 on padding rows)."""
    phase: Attribute
    experts: int
    rows: int
    """Rows of a block (B)."""
    gathers: list[tcp.DmaGatherOp] = field(default_factory=list)
    """The weight gathers by the plan's expert ids."""
    from_dispatch: bool = True
    """Whether a weight load also waits for `tokens` (the loop starts from the dispatch; not for
    one token's, schedule_experts.starts_from_dispatch)."""

    @property
    def blocks(self) -> int:
        return shape_of(self.expert_ids.type)[0]


def per_expert_values(plan_ops: list[Operation], gathers: list[tcp.DmaGatherOp]) -> set[SSAValue]:
    """The values that are one expert's (a weight gathered by the expert ids, a view of one):
    one row per slot of a group, not per block."""
    found = {g.result for g in gathers}
    for op in plan_ops:
        if op.operands and all(v in found for v in op.operands) and isinstance(op, (tcp.ViewOp, ve.ConversionOp)):
            found.update(op.results)
    return found


def groupable(plan_ops: list[Operation], region: FRegion | None, gathers: list[tcp.DmaGatherOp]) -> bool:
    """Whether the plan's blocks can run in groups: an F region of bf16/f32 contractions (not
    block-scaled: their scales are gathered per block) whose per-expert values only the
    contractions read (as weight or bias), every other op working on the blocks' rows."""
    if region is None or region.outside:
        return False
    if not isinstance(region.down, tcp.ContractOp) or not all(isinstance(u, tcp.ContractOp) for u in region.ups):
        return False
    experts = per_expert_values(plan_ops, gathers)
    for op in plan_ops:
        for use_op in (u.operation for r in op.results if r in experts for u in r.uses):
            if isinstance(use_op, tcp.ContractOp):
                if any(v in experts for v in (use_op.lhs, use_op.acc, use_op.guard) if v is not None):
                    return False
            elif not (set(use_op.results) <= experts):
                return False
    return True


def group_row_bytes(plan: GroupPlan, width: int) -> int:
    """SRAM a group takes per row of its blocks: the gathered rows (GROUPS_AHEAD groups'), each
    value the block's ops write to SRAM once (F-wide ones at the tile's `width`; constants,
    views and broadcasts take none) and the f32 sum's successor in the chain."""
    per_expert = per_expert_values(plan.ops, plan.gathers)
    total = 0
    for op in plan.ops:
        if isinstance(op, (*ZERO_OPERAND_VE, tcp.ViewOp, ve.BroadcastOp)):
            continue
        for r in op.results:
            if r in per_expert or leading(r) != plan.blocks:
                continue
            total += stored_bytes(plan.region.tile_type(r, width) if r in plan.region.axes else tile_type(r.type))
    successor = stored_bytes(tile_type(plan.region.down.result.type))
    rows = stored_bytes(tile_type(plan.region.ups[0].operands[0].type))
    return -(-(total + successor + (GROUPS_AHEAD - 1) * rows) // plan.rows)


def group_blocks(plan: GroupPlan, width: int, sram_bytes: int) -> int:
    """Blocks per group: the most, a power of two as blocks are, whose rows fit the rows'
    share of `sram_bytes` (at least 1, at most G)."""
    fit = sram_bytes // ROWS_SHARE // group_row_bytes(plan, width) // plan.rows
    return max(1, min(plan.blocks, 1 << max(0, fit.bit_length() - 1)))


def slot_tables(add: Callable[[Operation, str | None], SSAValue], ids: SSAValue, tokens: SSAValue,
                slots: int, parts: int, chunk: int) -> tuple[SSAValue, SSAValue, SSAValue]:
    """For every group: its distinct experts, in order of first appearance, -1 after them
    (`[groups, slots]`), for each of them the id of every chunk it computes, -1 elsewhere
    (`[groups, slots, chunks]`), and each chunk's id (`[groups, chunks]`): the chunk's block's
    expert, -1 when the chunk holds no routed row. From the groups' block ids (`ids`, [groups, R]) and row -> token
    index (`tokens`, [groups x R, B]), by vector ops on the ids once, before the loop, so that a
    group's weight loads wait for nothing the previous groups' commands hold up; any ids (not
    only the canonical layout's) give the right slots."""
    groups, group = shape_of(ids.type)
    cube = TensorType(i32, [groups, group, group])
    mine = add(ve.BroadcastOp(ids, 2, group), None)                       # [g, r, s]: ids[g, r]
    theirs = add(ve.BroadcastOp(ids, 1, group), None)                     # [g, r, s]: ids[g, s]
    same = add(ve.TagOp("eq", mine, theirs), None)
    where = add(ve.SelectOp(same, [1], add(ve.IotaOp(cube, 2), None), add(ve.ConstOp(group, cube), None)), None)
    first = add(ve.ReduceMinOp(where, 2), "first_of_expert")               # each block's expert's first block
    is_first = add(ve.TagOp("eq", first, add(ve.IotaOp(ids.type, 1), None)), None)  # type: ignore[arg-type]
    firsts = add(ve.SelectOp(is_first, [1], ids, add(ve.ConstOp(-1, ids.type), None)), None)  # type: ignore[arg-type]
    used = add(ve.TagOp("ge", firsts, add(ve.ConstOp(0, ids.type), None)), None)  # type: ignore[arg-type]
    slot_ids = add(ve.FilterOp(firsts, used, [1], 1, slots, -1), "slot_experts")
    chunks = group * parts
    if parts == 1:
        chunk_ids = ids
    else:  # a part holding only padding rows (every index -1) is skipped
        flat = TensorType(i32, [groups, chunks])
        top = add(ve.ReduceMaxOp(add(tcp.ViewOp(tokens, [groups, chunks, chunk]), None), 2), None)
        routed = add(ve.TagOp("ge", top, add(ve.ConstOp(0, flat), None)), None)
        repeated = add(tcp.ViewOp(add(ve.BroadcastOp(ids, 2, parts), None), [groups, chunks]), None)
        chunk_ids = add(ve.SelectOp(routed, [1], repeated, add(ve.ConstOp(-1, flat), None)), "chunk_experts")
    table = TensorType(i32, [groups, slots, chunks])
    by_slot = add(ve.BroadcastOp(slot_ids, 2, chunks), None)
    by_chunk = add(ve.BroadcastOp(chunk_ids, 1, slots), None)
    match = add(ve.TagOp("eq", by_slot, by_chunk), None)
    guards = add(ve.SelectOp(match, [1], by_chunk, add(ve.ConstOp(-1, table), None)), "slot_chunks")
    return slot_ids, guards, chunk_ids


def last_group_table(add: Callable[[Operation, str | None], SSAValue], chunk_ids: SSAValue) -> SSAValue:
    """For every group, the ids of its chunks if it is the loop's last group, else -1
    (`[groups, chunks]`, from `chunk_ids`): the last group stores its own results. The groups
    are numbered from the ids (an iota plus the ids and 0), so that split-clusters makes each
    cluster its own table from its own ids (`derived`) rather than reading one cluster's."""
    t = chunk_ids.type
    groups = shape_of(t)[0]
    zeros = add(ve.AndOp(chunk_ids, add(ve.ConstOp(0, t), None)), None)  # type: ignore[arg-type]
    number = add(ve.AddOp(add(ve.IotaOp(t, 0), None), zeros), None)  # type: ignore[arg-type]
    last = add(ve.TagOp("eq", number, add(ve.ConstOp(groups - 1, t), None)), None)  # type: ignore[arg-type]
    return add(ve.SelectOp(last, [1], chunk_ids, add(ve.ConstOp(-1, t), None)), "chunks_if_last")  # type: ignore[arg-type]


@dataclass
class _State:
    """What a group's slots pass on to each other and the loop to the next group: the f32 sum
    of the down-projection, what the next weight loads wait for (`waits`, oldest first: the
    last down-projections of streamed tiles, or the last contractions of the last active
    slots for resident ones), and each reused weight's last id and tile."""

    acc: SSAValue | None
    waits: list[SSAValue]
    reuse: dict[tuple[tcp.DmaGatherOp, tuple[int, int] | None], tuple[SSAValue, SSAValue]]

    def values(self) -> list[SSAValue]:
        assert self.acc is not None
        return [self.acc, *self.waits, *(v for pair in self.reuse.values() for v in pair)]

    def replaced(self, values: list[SSAValue]) -> _State:
        """The same state with `values` (in `values()` order) in place of its own."""
        it = iter(values)
        acc = next(it)
        waits = [next(it) for _ in self.waits]
        reuse = {k: (next(it), next(it)) for k in self.reuse}
        return _State(acc, waits, reuse)

    def take(self, values: list[SSAValue]) -> None:
        """Hold `values` (in `values()` order) from now on: a branch's or loop's results."""
        new = self.replaced(values)
        self.acc, self.waits, self.reuse = new.acc, new.waits, new.reuse

    def done(self, value: SSAValue) -> None:
        """`value` (a down-projection or a slot's last contraction) is the newest wait."""
        self.waits = [*self.waits[1:], value]


class GroupLoop:
    """The loop over groups of `group` blocks from block `first` to `last` (see the module
    docstring); `build` makes it and the ops it needs before it."""

    index: SSAValue
    """The first block of the iteration's group."""
    group_wait: SSAValue
    """What the group's row gather waits for: the last contraction GROUPS_AHEAD groups before."""

    def __init__(self, plan: GroupPlan, group: int, first: int, last: int):
        self.plan, self.group, self.first, self.last = plan, group, first, last
        self.chunk = chunk_rows(plan.rows)
        self.parts = plan.rows // self.chunk
        self.chunks = group * self.parts
        self.slots = min(group, plan.experts)
        self.dispatched = [plan.tokens] if plan.from_dispatch else []  # the loop starts from the dispatch
        self.per_expert = per_expert_values(plan.ops, plan.gathers)
        self.before: list[Operation] = []
        self.mapping: dict[SSAValue, SSAValue] = {}
        self.target: Block = Block()
        self.slot_rows: tuple[SSAValue, SSAValue, SSAValue, SSAValue] | None = None
        """With the slots in a loop: the slot tables with a row per (group, slot) (expert ids
        [groups x slots, 1], chunk ids [groups x slots, chunks]), the slots per group and 1."""

    # ---- building blocks -----------------------------------------------------------------

    def add(self, op: Operation, name: str | None = None) -> SSAValue:
        """Append `op` to the block being built (its phase the plan's); its first result."""
        assert op.results, "every op the loop builds has a result"
        op.attributes.setdefault(PHASE_ATTR, self.plan.phase)
        self.target.add_op(op)
        if name is not None:
            op.results[0].name_hint = name
        return op.results[0]

    def hoist(self, op: Operation) -> SSAValue:
        """A constant made once before the loop."""
        op.attributes[PHASE_ATTR] = self.plan.phase
        self.before.append(op)
        return op.results[0]

    def view(self, value: SSAValue, shape: list[int]) -> SSAValue:
        """`value` seen as `shape` (a free view; itself when it has that shape)."""
        if list(shape_of(value.type)) == shape:
            return value
        return self.add(tcp.ViewOp(value, shape))

    def tile_of(self, v: SSAValue) -> SSAValue:
        """The group's rows of a value made before the loop (a slice, or a load from HBM)."""
        if v in self.mapping:
            return self.mapping[v]
        if leading(v) != self.plan.blocks:
            return v
        name = f"{v.name_hint}_tile" if v.name_hint else None
        if in_hbm(v):
            self.mapping[v] = self.add(tile.LoadOp(v, self.index, tile_type(v.type, self.group), [self.group_wait]), name)
        else:
            self.mapping[v] = self.add(tile.SliceOp(v, self.index, tile_type(v.type, self.group)), name)
        return self.mapping[v]

    def rows_type(self, v: SSAValue, width: int) -> Attribute:
        """A region value's type for the group's rows and `width` columns of F."""
        t = self.plan.region.tile_type(v, width)
        return TensorType(t.get_element_type(), [self.group, *t.get_shape()[1:]])

    # ---- one slot's F tiles --------------------------------------------------------------

    def load(self, gather: tcp.DmaGatherOp, columns: tuple[int, int] | None, slot: SSAValue, wait: SSAValue,
             state: _State) -> SSAValue:
        """The load of `gather`'s weight (`columns` of F) for the slot's expert, reusing the last
        one loaded when it is carried (resident tiles, whole per-expert weights)."""
        key = (gather, columns)
        prev = state.reuse.get(key, (None, None))
        whole = columns is None or columns == (0, self.plan.region.f)
        window = None if whole else self.plan.region.window(gather.result, columns)
        new = tile.LoadExpertOp(gather.source, slot, prev[0], prev[1], [wait, *self.dispatched], window)
        new.attributes.update(gather.attributes)
        new.location = gather.location
        result = self.add(new, gather.result.name_hint)
        if key in state.reuse:
            state.reuse[key] = (slot, result)
        return result

    def contract(self, op: tcp.ContractOp, lhs: SSAValue, weight: SSAValue, bias: SSAValue | None,
                 guard: SSAValue, acc: SSAValue | None) -> SSAValue:
        """`op` for the group: its rows in chunks by the slot's weight, skipped chunks guarded
        off; the result in chunks (the caller views it as the group's rows where needed)."""
        k, n = shape_of(weight.type)[1:]
        rows = self.view(lhs, [self.chunks, self.chunk, k])
        result = TensorType(op.result.type.get_element_type(), [self.chunks, self.chunk, n])  # type: ignore[attr-defined]
        new = tcp.ContractOp(GROUP_SPEC, rows, self.view(weight, [k, n]), result, bias=bias, guard=guard, acc=acc)
        new.attributes.update(op.attributes)
        new.location = op.location
        return self.add(new, op.result.name_hint)

    def expert_value(self, v: SSAValue, slot: SSAValue, state: _State, local: dict[SSAValue, SSAValue]) -> SSAValue:
        """A per-expert value outside the F region (the down-projection's bias) for the slot."""
        if v in local:
            return local[v]
        owner = v.owner
        assert isinstance(owner, Operation)
        if isinstance(owner, tcp.DmaGatherOp):
            local[v] = self.load(owner, None, slot, self.weight_wait(state), state)
        else:
            new = clone_rows(owner, [self.expert_value(o, slot, state, local) for o in owner.operands], 1)
            self.add(new)
            local.update(zip(owner.results, new.results))
        return local[v]

    def weight_wait(self, state: _State) -> SSAValue:
        """What a weight load waits for: the last contraction SLOTS_AHEAD active slots before
        (resident), or the down-projection TILES_IN_FLIGHT tiles before (streamed)."""
        return state.waits[0]

    def slot_tiles(self, slot: SSAValue, guard: SSAValue, state: _State) -> None:
        """One slot's F tiles (as `schedule_plan.f_tiles` runs a block's), updating `state`:
        streamed tiles place the loads of tile t + 1 before the work of tile t."""
        region, plan = self.plan.region, self.plan
        streamed = not plan.resident
        loads: list[list[Operation]] = []
        work: list[list[Operation]] = []
        target = self.target
        for t, columns in enumerate(plan.tiles):
            width = columns[1] - columns[0]
            local: dict[SSAValue, SSAValue] = {}
            loads.append([])
            work.append([])
            wait = self.weight_wait(state)

            def operand(v: SSAValue, local: dict[SSAValue, SSAValue] = local) -> SSAValue:
                return local[v] if v in local else self.tile_of(v)

            def emit(op: Operation, into: list[Operation]) -> None:
                into.append(op)
                if not streamed:
                    target.add_op(op)

            def built(make: Callable[[], SSAValue], into: list[Operation]) -> SSAValue:
                """`make()` appends to a scratch block; its ops go to `into` (and the target when resident)."""
                scratch = Block()
                self.target = scratch
                value = make()
                self.target = target
                for op in list(scratch.ops):
                    op.detach()
                    emit(op, into)
                return value

            for op in region.tiled:
                if isinstance(op, tcp.DmaGatherOp):
                    local[op.result] = built(lambda op=op: self.load(op, columns, slot, wait, state), loads[t])
                elif op in region.ups:
                    assert isinstance(op, tcp.ContractOp)
                    bias = None if op.bias is None else operand(op.bias)
                    out = built(lambda op=op, bias=bias: self.view(
                        self.contract(op, operand(op.lhs), operand(op.rhs), bias, guard, None),
                        list(shape_of(self.rows_type(op.result, width)))), work[t])
                    local[op.result] = out
                else:
                    one = bool(op.operands) and all(o in self.per_expert for o in op.operands)
                    types = [region.tile_type(r, width) if one else self.rows_type(r, width) for r in op.results]
                    new = type(op).create(operands=[operand(v) for v in op.operands], result_types=types,
                                          properties=dict(op.properties), attributes=dict(op.attributes),
                                          location=op.location)
                    new.attributes.setdefault(PHASE_ATTR, plan.phase)
                    for old, r in zip(op.results, new.results):
                        r.name_hint = old.name_hint
                        local[old] = r
                    emit(new, work[t])
            for gather in region.down_loads:
                local[gather.result] = built(lambda g=gather: self.load(g, columns, slot, wait, state), loads[t])
            final = t == len(plan.tiles) - 1
            down = region.down
            assert isinstance(down, tcp.ContractOp)

            def down_tile(down: tcp.ContractOp = down, final: bool = final,
                          operand: Callable[[SSAValue], SSAValue] = operand) -> SSAValue:
                bias = None
                if final and down.bias is not None:
                    bias = self.expert_value(down.bias, slot, state, {})
                return self.contract(down, operand(down.lhs), operand(down.rhs), bias, guard, state.acc)

            state.acc = built(down_tile, work[t])
            if streamed:
                state.done(state.acc)
        if streamed:
            target.add_ops(loads[0])
            for t in range(len(plan.tiles)):
                target.add_ops(loads[t + 1] if t + 1 < len(plan.tiles) else [])
                target.add_ops(work[t])
        assert state.acc is not None
        if not streamed:
            state.done(state.acc)

    # ---- the loop ------------------------------------------------------------------------

    def build(self, buffers: list[SSAValue]) -> scf.ForOp:
        """The loop, storing into `buffers` (HBM, G blocks each); what it needs before it in
        `self.before`: its constants and the groups' slot tables."""
        plan, region = self.plan, self.plan.region
        groups = (self.last - self.first) // self.group
        c_zero, c_groups, c_one, c_first, c_rows = (index_constant(v) for v in (0, groups, 1, self.first, self.group))
        for c in (c_zero, c_groups, c_one, c_first, c_rows):
            self.hoist(c)
        sums = TensorType(f32, [self.chunks, self.chunk, shape_of(region.down.result.type)[-1]])
        nothing = self.hoist(ve.ConstOp(0.0, sums))
        nothing.name_hint = "nothing"
        start = None
        if self.slots > 1:  # the slots' shared sum starts at -0.0 (module docstring)
            start = self.hoist(ve.ConstOp(-0.0, sums))
            start.name_hint = "minus_zero"
        no_ids = self.hoist(ve.ConstOp(-1, TensorType(i32, [1])))
        reuse: dict[tuple[tcp.DmaGatherOp, tuple[int, int] | None], tuple[SSAValue, SSAValue]] = {}
        tiled = set(region.tiled) | set(region.down_loads)
        for g in plan.gathers:
            keys = [(g, c) for c in plan.tiles] if g in tiled else [(g, None)]
            if g in tiled and not plan.resident:
                continue
            for key in keys:
                window = None if key[1] is None else region.window(g.result, key[1])
                sizes = list(shape_of(g.result.type)[1:]) if window is None else window[1]
                empty = self.hoist(tile.BufferOp("sram", TensorType(g.result.type.get_element_type(), [1, *sizes])))  # type: ignore[attr-defined]
                reuse[key] = (no_ids, empty)

        # The groups' ids [groups, R] and, before the loop, their slot tables.
        self.target = Block()
        count = self.last - self.first
        ids_all, tokens_all = plan.expert_ids, plan.tokens
        if count != plan.blocks:
            ids_all = self.add(tile.SliceOp(plan.expert_ids, c_first, tile_type(plan.expert_ids.type, count)))
            tokens_all = self.add(tile.SliceOp(plan.tokens, c_first, tile_type(plan.tokens.type, count)))
        group_ids = self.view(ids_all, [groups, self.group])
        group_ids.name_hint = "experts_by_group"
        tables, chunk_ids = None, group_ids
        if self.group > 1 or self.parts > 1:
            *tables, chunk_ids = slot_tables(self.add, group_ids, tokens_all, self.slots, self.parts, self.chunk)
            if self.slots > SLOTS_UNROLLED:  # a row per slot, for the slot loop to slice by its number
                slot_ids, guards = tables
                c_slots = index_constant(self.slots)
                self.hoist(c_slots)
                by_row = self.view(slot_ids, [groups * self.slots, 1]), self.view(guards, [groups * self.slots, self.chunks])
                by_row[0].name_hint, by_row[1].name_hint = "slot_experts_by_row", "slot_chunks_by_row"
                self.slot_rows = (*by_row, c_slots.result, c_one.result)
        # Stores wait for the next group where its loads are issued up front, resident tiles'
        # (streamed tiles' loads wait for the contractions, and a loop of one group has no next).
        defer = groups > 1 and plan.resident
        last_ids = last_group_table(self.add, chunk_ids) if defer else None
        for op in list(self.target.ops):
            op.detach()
            self.hoist(op)

        # The previous group's results, the ids of their chunks and its first block: stored after
        # this group's weight loads (`deferred_stores`). Before the first group nothing is
        # pending: every chunk -1, the tiles an (unread) HBM buffer, which takes no SRAM.
        pending_init: list[SSAValue] = []
        if defer:
            no_results = [self.hoist(tile.BufferOp("hbm", tile_type(r.type, self.group))) for r in plan.escaping]
            for none, r in zip(no_results, plan.escaping):
                none.name_hint = f"{r.name_hint or 'out'}_none"
            no_chunks = self.hoist(ve.ConstOp(-1, TensorType(i32, [self.chunks])))
            no_chunks.name_hint = "no_chunks"
            pending_init = [*no_results, no_chunks, c_first.result]
        init = _State(nothing, [nothing] * (SLOTS_AHEAD if plan.resident else TILES_IN_FLIGHT), reuse)
        carried_init = [*buffers, *init.values()[1:], *([nothing] * GROUPS_AHEAD), *pending_init]
        body = Block(arg_types=[IndexType(), *(v.type for v in carried_init)])
        number, *args = body.args
        number.name_hint = "group"
        buffer_args = args[:len(buffers)]
        args, pending = args[:len(args) - len(pending_init)], args[len(args) - len(pending_init):]
        if defer:
            for p, r in zip(pending, plan.escaping):
                p.name_hint = f"{r.name_hint or 'out'}_pending"
            pending[-2].name_hint, pending[-1].name_hint = "pending_chunks", "pending_block"
        state = init.replaced([nothing, *args[len(buffers):len(args) - GROUPS_AHEAD]])
        state.acc = start
        what = "slot" if plan.resident else "f_tile"
        for i, w in enumerate(state.waits):
            w.name_hint = f"{what}_done_{len(state.waits) - i}_ago"
        group_waits = args[len(args) - GROUPS_AHEAD:]
        for i, w in enumerate(group_waits):
            w.name_hint = f"group_done_{i + 1}_ago"
        self.group_wait = group_waits[-1]
        self.target = body

        ids_row = self.add(tile.SliceOp(group_ids, number, tile_type(group_ids.type)))
        ids = self.view(ids_row, [self.group])
        ids.name_hint = "experts_of_group"
        runs = self.add(tile.GuardOp(ids), "group_runs")
        self.index = self.add(arith.AddiOp(self.add(arith.MuliOp(number, c_rows)), c_first), "block")

        # Ops of the region also read outside it are made whole as well, as in block order.
        deferred = (set(region.tiled) - set(region.shared)) | {region.down, *region.down_loads}
        made = {r for op in deferred for r in op.results}
        flushed = list(buffer_args)
        for op in plan.ops:
            if op in deferred:
                if op is region.down:
                    for inner in deferred:  # the group's rows the tiles read, before the slots' branches
                        for v in inner.operands:
                            if v not in made and v not in self.per_expert and v is not plan.expert_ids:
                                self.tile_of(v)
                    self.slots_of_group(number, ids, tables, state)
                    if defer:  # the previous group's store: after every slot's weight loads
                        flushed = self.deferred_stores(pending, buffer_args)
                    self.mapping[op.result] = self.view(state.acc, list(shape_of(tile_type(op.result.type, self.group))))
                continue
            if op.results and all(r in self.per_expert for r in op.results):
                continue  # made per slot, where a contraction reads it
            if isinstance(op, tcp.DmaGatherOp) and op.indices is plan.tokens:  # the dispatch: the group's rows
                rows = tile.GatherOp(op.source, self.tile_of(op.indices), [self.group_wait])
                rows.attributes.update(op.attributes)
                rows.location = op.location
                self.mapping[op.result] = self.add(rows, f"{op.result.name_hint}_tile" if op.result.name_hint else None)
                continue
            new = clone_rows(op, [self.tile_of(v) for v in op.operands], self.group)
            self.add(new)
            self.mapping.update(zip(op.results, new.results))

        # One command per result, its chunks guarded by their ids: split-clusters' copies write
        # only the blocks of the experts they own, and no copy writes an unused block or part.
        # Deferred, the next group stores it, and the last group its own, as no group follows.
        written: SSAValue | None = None
        if defer or self.chunks > 1:
            written = self.view(self.add(tile.SliceOp(chunk_ids, number, tile_type(chunk_ids.type))), [self.chunks])
            written.name_hint = "chunks_of_group"
        done = state.acc
        assert done is not None
        carried_out: list[SSAValue] = []
        if defer:
            assert last_ids is not None and written is not None
            last_chunks = self.view(self.add(tile.SliceOp(last_ids, number, tile_type(last_ids.type))), [self.chunks])
            last_chunks.name_hint = "chunks_if_last"
            is_last = self.add(tile.GuardOp(last_chunks), "group_is_last")
            outer, then = self.target, Block()
            self.target = then
            then.add_op(scf.YieldOp(*self.stores(flushed, written, by_block=True)))
            self.target = outer
            last_store = scf.IfOp(is_last, [v.type for v in flushed], [then], [Block([scf.YieldOp(*flushed)])])
            self.add(last_store)
            stored = list(last_store.results)
            carried_out = [*(self.mapping[r] for r in plan.escaping), written, self.index]
        else:
            stored = self.stores(buffer_args, written)
        body.add_op(scf.YieldOp(*stored, *state.values()[1:], done, *group_waits[:-1], *carried_out))
        branch = skip_unless(body, runs)
        branch.attributes[PHASE_ATTR] = plan.phase
        if defer:  # a group that does not run stores the previous one's results; nothing is pending
            otherwise, carried = reopen_otherwise(branch)
            self.target = otherwise
            flushed = self.deferred_stores(pending, buffer_args, by_block=True)
            carried[:len(flushed)] = flushed
            carried[-2] = pending_init[-2]
            otherwise.add_op(scf.YieldOp(*carried))
            self.target = body
        loop = scf.ForOp(c_zero, c_groups, c_one, carried_init, body)
        loop.attributes[PHASE_ATTR] = plan.phase
        return loop

    def stores(self, buffers: list[SSAValue], written: SSAValue | None, by_block: bool = False) -> list[SSAValue]:
        """Store the group's results into `buffers`, chunk by chunk as `written` says; the
        buffers after the stores (`by_block`: `store_rows`)."""
        return [self.store_rows(self.mapping[r], buf, self.index, written, f"{r.name_hint}_stored" if r.name_hint else None,
                                by_block)
                for r, buf in zip(self.plan.escaping, buffers)]

    def deferred_stores(self, pending: list[SSAValue], buffers: list[SSAValue], by_block: bool = False) -> list[SSAValue]:
        """Store the previous group's results (`pending`: its tiles, the ids of their chunks, -1
        where nothing is to be written, and its first block) into `buffers`; the buffers after
        the stores. Issued after this group's weight loads: stored in its own group, a store
        waited for the group's last contraction at the head of a DMA engine's queue, and the
        next group's loads, issued after it, could not use that engine meanwhile."""
        *tiles, chunks, block = pending
        return [self.store_rows(t, buf, block, chunks, f"{r.name_hint or 'out'}_flushed", by_block)
                for t, buf, r in zip(tiles, buffers, self.plan.escaping)]

    def store_rows(self, rows: SSAValue, buffer: SSAValue, block: SSAValue, chunks: SSAValue | None,
                   name: str | None, by_block: bool) -> SSAValue:
        """One store of a group's `rows` at `block`, its chunks guarded by `chunks`; `by_block`,
        one per block (the last stores of the loop, which nothing overlaps: the combine waits
        for them, and a command of 1 MB or less runs on one engine, machines/rngd.toml's
        split_bytes, so a group's store of several blocks took one engine's time where its
        blocks' stores run on as many engines at once). The buffer after the stores."""
        if not by_block or self.group == 1 or chunks is None:
            return self.add(tile.StoreOp(rows, buffer, block, guard=chunks), name)
        for r in range(self.group):
            at = index_constant(r)
            self.add(at)
            one = self.add(tile.SliceOp(rows, at.result, tile_type(rows.type, 1)))
            guard = self.add(tile.SliceOp(chunks, self.add(index_constant(r * self.parts)), tile_type(chunks.type, self.parts)))
            buffer = self.add(tile.StoreOp(one, buffer, self.add(arith.AddiOp(block, at.result)), guard=guard), name)
        return buffer

    def slots_of_group(self, number: SSAValue, ids: SSAValue, tables: list[SSAValue] | None, state: _State) -> None:
        """Every slot's tiles; slots after the first in an `scf.if` on the slot's expert, in a
        loop over them when there are more than SLOTS_UNROLLED (`slot_loop`)."""
        for k in range(self.slots if self.slot_rows is None else 1):
            if tables is None:  # one block of one chunk: its id is the slot's and the chunk's
                slot, guard = ids, ids
            else:
                slot_ids, guards = tables
                row = self.add(tile.SliceOp(slot_ids, number, TensorType(i32, [1, 1]), [k]))
                slot = self.view(row, [1])
                slot.name_hint = "slot_expert"
                chunks = self.add(tile.SliceOp(guards, number, TensorType(i32, [1, 1, self.chunks]), [k, 0]))
                guard = self.view(chunks, [self.chunks])
                guard.name_hint = "chunks_of_slot"
            if k == 0:  # a group that runs has a first expert
                self.slot_tiles(slot, guard, state)
            else:
                self.guarded_slot(slot, guard, state)
        if self.slot_rows is not None:
            self.slot_loop(number, state)

    def guarded_slot(self, slot: SSAValue, guard: SSAValue, state: _State) -> None:
        """A later slot's tiles in an `scf.if` on its expert id (-1: the slot is unused, and
        `state` passes through); `state` becomes the branch's results."""
        runs = self.add(tile.GuardOp(slot), "slot_runs")
        before = state.values()
        outer, then = self.target, Block()
        self.target = then
        inner = state.replaced(list(before))
        self.slot_tiles(slot, guard, inner)
        then.add_op(scf.YieldOp(*inner.values()))
        self.target = outer
        branch = scf.IfOp(runs, [v.type for v in before], [then], [Block([scf.YieldOp(*before)])])
        self.add(branch)
        state.take(list(branch.results))

    def slot_loop(self, number: SSAValue, state: _State) -> None:
        """The slots after the first as `scf.for %slot = 1 to slots`, `state` carried: one body
        that slices its slot's expert id and chunk ids at row group x slots + slot of the flat
        tables (`slot_rows`) and runs the slot's tiles in an `scf.if` on the id, as each
        unrolled slot did. Index arithmetic and views are free, so the commands, their order
        and their operands are the unrolled slots'."""
        assert self.slot_rows is not None
        slot_ids, guards, c_slots, c_one = self.slot_rows
        before = state.values()
        body = Block(arg_types=[IndexType(), *(v.type for v in before)])
        slot_number, *args = body.args
        slot_number.name_hint = "slot"
        outer = self.target
        self.target = body
        row = self.add(arith.AddiOp(self.add(arith.MuliOp(number, c_slots)), slot_number), "slot_row")
        slot = self.view(self.add(tile.SliceOp(slot_ids, row, TensorType(i32, [1, 1]))), [1])
        slot.name_hint = "slot_expert"
        guard = self.view(self.add(tile.SliceOp(guards, row, TensorType(i32, [1, self.chunks]))), [self.chunks])
        guard.name_hint = "chunks_of_slot"
        inner = state.replaced(list(args))
        self.guarded_slot(slot, guard, inner)
        body.add_op(scf.YieldOp(*inner.values()))
        self.target = outer
        loop = scf.ForOp(c_one, c_slots, c_one, before, body)
        self.add(loop)
        state.take(list(loop.results))


def build_group_loops(block: Block, plan: GroupPlan, group: int) -> list[scf.ForOp]:
    """Replace the plan's ops in `block` by the loop over its groups of `group` blocks (and one
    more for the blocks left over); their HBM result buffers are what the ops' readers read."""
    blocks = plan.blocks
    full = blocks - blocks % group
    buffers = [tile.BufferOp("hbm", r.type) for r in plan.escaping]
    for b, r in zip(buffers, plan.escaping):
        b.result.name_hint = f"{r.name_hint or 'out'}_buffer"
        b.attributes[PHASE_ATTR] = plan.phase
    new_ops: list[Operation] = [*buffers]
    loops: list[scf.ForOp] = []
    current = [b.result for b in buffers]
    for first, last, size in ((0, full, group), (full, blocks, blocks - full)):
        if last <= first:
            continue
        builder = GroupLoop(plan, size, first, last)
        loop = builder.build(current)
        new_ops += [*builder.before, loop]
        loops.append(loop)
        current = list(loop.results[:len(buffers)])
    replace_by_loop(block, plan.ops, plan.escaping, current, new_ops)
    return loops
