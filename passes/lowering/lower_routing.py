"""`lower-routing`: the index generation of every `moe.scatter` becomes vector-engine (`ve`) ops.

`%xb, %route = moe.scatter %x, %expert_idx` becomes ve ops computing the routing plan
(docs/architecture.md#the-routing-plan-and-the-block-layout), bit for bit as
`runtime_sim.semantics.moe_semantics.route_plan` computes it, then
`%route = moe.route %scatter_idx, %expert_ids` and `%xb = moe.dispatch %x, %route`; the data
movement is left to the dispatch lowering. Pairs p = t*K + k run along a flattened axis of
P = T*K (the `[T, K]` indices are viewed as `[P]`, and `scatter_idx` viewed back: `tcp.view`,
no data moves); experts run along the other axis. The steps, named as in the book's MoE
chapter, section 3.3 (docs/hardware.md#the-moe-chapter-of-the-book):

1. `expert_mask [P, E]`: the one-hot of each pair's expert, a tag `eq` against an expert iota.
2. `counts [E]`: the histogram, a reduce-sum of the mask over pairs (of its chunk totals when
   the cumsum of step 5 runs in chunks, see below). With a capacity C,
   `kept_counts = min(counts, C)`.
3. `num_blocks [E] = ceil(kept_counts / B)`, by counting block starts (see below).
4. `global_offset [E]`: the first block of each expert, an exclusive cumsum of `num_blocks`
   (the inclusive cumsum minus `num_blocks`).
5. `token_rank [P]`: a cumsum of the mask over the pairs axis, gathered at the pair's expert;
   `local_offset = token_rank - 1` is the pair's position within its expert in token-major
   order.
6. `scatter_idx [T, K] = global_offset * B + local_offset` (global offset gathered at the
   pair's expert) for kept pairs, -1 for dropped ones. A pair is kept iff
   `local_offset < min(C, R * B)`: the capacity (R * B matters only for routings the reference
   rejects, see below).
7. `expert_ids [G]`: `grid[e, g] = e` where `num_blocks[e] - g > 0`, else -1; flattened
   expert-major and filter-compacted (keep `grid >= 0`) into G entries padded with -1.
   One token's (T = 1) are made right after step 3, before steps 4 to 6: the vector engine
   runs its ops in program order, and one token's weight loads wait for the ids alone
   (schedule-experts), not for the pairs' offsets (Qwen3-30B-A3B: the first load ~550 cycles
   sooner). With more tokens the loop starts from the dispatch, which needs scatter_idx: the
   ids come last, so as not to hold it back. Where an expert owns one block at most (R = 1:
   T, or the capacity, at most B), steps 3 and 7 read the counts directly: `num_blocks =
   min(counts, 1)` and the ids the experts with a positive count, compacted (no block grid).
   At T = 1 the graph's math that only the combine reads (the routing weights), written
   before the scatter, moves after it (`weights_behind`), so the ids come before it too.

Every cumsum is the branch-logger pattern of the book (section 4), nothing opaque: a static
`ve.position_tag` over the scanned axis (first 0, middle 1, last 2; an axis of one element gets
3, which the scan neither reads nor writes, so it passes through) and `ve.scan add` whose
register-file operand is read only for tags [1, 2] and written back only for tags [0, 1].

Chunked cumsum. A scan takes one step per element of its axis whatever the rows beside it,
so the cumsum of `[P, E]` over P takes P steps while only E lanes of the vector engine work
(Qwen3-30B-A3B at T = 4096: 32,768 steps for 128 lanes). From MIN_CHUNKED_PAIRS pairs it runs
in S chunks (`scan_chunks`: the divisor of P with the fewest scan steps): `[S, P/S, E]`
scanned along its middle axis (S * E rows of P/S steps), each chunk's total, an exclusive
cumsum of the totals over the S chunks, added back. The histogram of step 2 is then the sum
of the chunk totals (S steps instead of a reduction over P). The same i32 adds of the same
counts: the same values. At T = 4096 the routing of Qwen3-30B-A3B goes from 83k cycles to
about 20k.

Gathers. The vector engine has no gather; a per-pair value of the pair's expert is taken with
the one-hot tag: `select` it where the pair's tag is set, 0 elsewhere, and reduce-sum over E
(exactly one non-zero term per valid pair, so the i32 sum is exact). Branchless. With a
chunked cumsum the two gathers (the rank of step 5, the first block of step 6) are one
(`packing_shift`): the expert's first block shifted left by the bits of P is added to the
chunks' offsets ([S, E]) before they are added to each chunk's cumsum, so the one gathered i32
holds the rank in its low bits (`and`) and the first block above them (`shr_s`); the adds of
non-negative integers below 2^31 are exact, so the same values as two gathers. It applies when
(G << shift) + P < 2^31 (Qwen3-30B-A3B at T = 2048: shift 15, G = 255).

Pair groups. The chunked cumsum's [P, E] tensors (the one-hot, the i32 mask, each chunk's
cumsum: 9 bytes per element) take 36 MB for Qwen3-30B-A3B at T = 4096, more than a 32 MB
target's SRAM can hold beside the rest: the memory plan would spill and stream them. When they
exceed the routing's share of the target's SRAM (1 / ROUTING_SHARE; `pair_groups`), the chunks
run in groups of consecutive chunks, one group's [P / groups, E] tensors live at a time, in two
passes over the groups (`grouped_packed_ranks`). The first scans each group's chunks, gathers
each pair's rank within its chunk ([P / groups]) and carries the chunk totals' running sum
over the groups (the carry after the last group is the histogram). The second, once the
experts' first blocks are known, recomputes each group's one-hot (cheaper than keeping it),
gathers each pair's packed chunk offset and adds the rank: the gather of a sum is the sum of
the gathers (one non-zero term per pair), and i32 adds of the same non-negative counts below
2^31 are exact, so the same values as one group. The pairs' packed ranks are written group by
group into one [P] buffer (`tile.store`). A target whose SRAM holds the tensors (RNGD) keeps
one group: the same program as before. Groups need the packed gather: without it (a P and G
too large for one i32) the routing keeps one group, for the memory plan to spill.

Ceiling division. The Fxp ALU adds, shifts and multiplies but does not divide, so
`ceil(n / B)` is computed as the number of blocks that start before n:
`num_blocks[e] = #{g in [0, R) : kept_counts[e] > g * B}`, a tag against a block-range iota
times B and a reduce-sum. For integers n >= 0, `n > g*B` iff `g < ceil(n / B)`, so this is
`min(ceil(n / B), R)`: exact for any B (not only powers of two, where a shift would do) and
every count up to R * B. R = ceil(min(T, C) / B) is the most blocks one expert can own (an
expert holds at most T pairs, one per token, and keeps at most C), so every count of a valid
routing is exact; larger counts (only from repeated experts) saturate at R. R <= G: the routing
that sends every token to one expert needs R blocks for that expert alone, and G is the worst
case over all routings. The same `[E, R]` block range then
serves the expert-id expansion, so the division costs one tile of E*R elements that the
expansion needs anyway (a shift would save it only for power-of-two B). The range stops at R,
not G, because no expert owns more than R blocks: E*R elements instead of E*G (for
T = 4096, K = 8, E = 256, B = 64: 16 384 instead of 195 584).

Capacity order. As `route_plan`: an expert keeps its first C pairs in token-major order
(later tokens drop first; a token's choices in k order); kept counts are min(count, C); a
dropped pair's scatter_idx is -1.

Inputs the reference rejects. `route_plan` raises an execution error when a token picks an
expert twice or an index is outside [0, E); the lowered routing computes a plan anyway, never
faults, and never points outside the static buffers:
- an index outside [0, E) matches no expert: the pair is not counted, its rank is 0, and its
  scatter_idx is 0 * B + (0 - 1) = -1 (dropped: it contributes nothing);
- a repeated expert counts as two pairs of that expert, in token-major order, like pairs of
  different tokens; an expert can then hold more pairs than the R * B rows of its (at most R)
  blocks, so step 6 keeps a pair only if `local_offset < min(C, R * B)`. For valid routings
  `local_offset < T <= R * B`, so without a capacity this guard never drops a pair.
With both, every kept pair lies in a block of its own expert, and every block inside G:
each expert owns at most R blocks, and G = `max_blocks` is the maximum of
sum_e min(ceil(n_e / B), R) over *any* counts with sum_e n_e <= T*K (its argument never uses
that a token's experts are distinct), so the filter never cuts a block. Every scatter_idx is in
[-1, G * B) and every expert id in [-1, E): `moe.route` accepts the plan, and a DMA indexed by
it stays in bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, StringAttr, TensorType, i32
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from dialects import moe, tcp, tile, ve
from dialects.annotations import EXPERT_INDICES_ATTR, PHASE_ATTR, mark
from dialects.tensor_types import shape_of
from passes._loop_builder import index_constant
from passes.lowering._builder import LoweringBuilder
from runtime_sim.semantics.numerics import numpy_dtype
from target.chunked_scan import scan_chunks, scan_rows_of
from target.target_spec import machine_of

CUMSUM_TAGS = (0, 1, 2, 3)
"""Position tags of a cumsum: first, middle, last, single (an axis of one element)."""
CUMSUM_READ = (1, 2)
"""The register-file operand is read after the first element ..."""
CUMSUM_WRITE = (0, 1)
"""... and written back before the last, so each row restarts."""


class _RoutingBuilder(LoweringBuilder):
    """lower-topk's op collector, plus the cumsum, the one-hot gather and views."""

    def cumsum(self, x: SSAValue, axis: int, tags_name: str, name: str) -> SSAValue:
        """Inclusive cumsum along `axis`: the static branch log and a tag-guarded add."""
        position = self.emit(ve.PositionTagOp(shape_of(x.type), axis, CUMSUM_TAGS), tags_name)
        return self.emit(ve.ScanOp("add", x, position, axis, CUMSUM_READ, CUMSUM_WRITE), name)

    def gather(self, one_hot: SSAValue, x: SSAValue, name: str) -> SSAValue:
        """[P] = x[p, e] at the e where one_hot[p, e] is set (0 where none is): select and
        reduce over E."""
        return self.reduce(ve.ReduceSumOp, self.select(one_hot, x, 0), 1, name)

    def view(self, x: SSAValue, shape: list[int], name: str | None = None) -> SSAValue:
        return self.emit(tcp.ViewOp(x, shape), name)


def blocks_per_expert_bound(route: moe.RouteType) -> int:
    """R: the most blocks one expert can own, ceil(min(T, C) / B), never more than G."""
    t, b, g = route.tokens.data, route.block.data, route.blocks.data
    c = route.capacity_limit
    most = t if c is None else min(t, c)
    return max(1, min(g, -(-most // b)))


def pair_limit(route: moe.RouteType) -> int:
    """A pair is kept iff its local offset is below this: the capacity C, and never more than
    the R * B rows one expert can own (every valid pair fits those, so without a capacity the
    limit only drops pairs of routings the reference rejects)."""
    rows = blocks_per_expert_bound(route) * route.block.data
    c = route.capacity_limit
    return rows if c is None else min(c, rows)


def chunked_cumsum(b: _RoutingBuilder, mask: SSAValue, chunks: int) -> tuple[SSAValue, SSAValue, SSAValue]:
    """The cumsum of `mask` [P, E] over P in `chunks` = S chunks, before its last add: each
    chunk's own cumsum ([S, P / S, E]), the exclusive cumsum of the chunks' totals ([S, E]: what
    `add_chunk_offsets` adds back to every row of the chunk), and the column totals (the counts).
    A chunk's total is the last row of its inclusive cumsum, addressed in place (`tile.slice`
    of row P / S - 1 in every chunk, read with a stride), not a reduction of the mask over the
    chunk (Qwen3-30B-A3B at T = 2048: 2,193 cycles). i32 adds of the same terms (a cumsum of
    counts never wraps: P < 2^31), so the same values as one scan."""
    p, e = shape_of(mask.type)
    length = p // chunks
    chunked = b.view(mask, [chunks, length, e], "chunked_mask")
    chunk_cumsum = b.cumsum(chunked, 1, "chunk_position", "chunk_cumsum")
    first_chunk = b.emit(index_constant(0))
    last_rows = b.emit(tile.SliceOp(chunk_cumsum, first_chunk, TensorType(i32, [chunks, 1, e]), [length - 1, 0]),
                       "chunk_last_rows")
    chunk_totals = b.view(last_rows, [chunks, e], "chunk_totals")
    totals_cumsum = b.cumsum(chunk_totals, 0, "chunk_index", "totals_cumsum")
    chunk_offset = b.binary(ve.SubOp, totals_cumsum, chunk_totals, "chunk_offset")
    counts = b.reduce(ve.ReduceSumOp, chunk_totals, 0, "counts")
    return chunk_cumsum, chunk_offset, counts


def add_chunk_offsets(b: _RoutingBuilder, chunk_cumsum: SSAValue, chunk_offset: SSAValue, name: str) -> SSAValue:
    """[P, E]: each chunk's cumsum plus its offset, broadcast over the chunk's rows. (The add
    cannot join the one-hot gather's chain that reads it: the gather's select runs at the Logic
    stage, before the Fxp adder.)"""
    chunks, length, e = shape_of(chunk_cumsum.type)
    offset_tile = b.broadcast(chunk_offset, 1, length, "chunk_offset_tile")
    return b.view(b.binary(ve.AddOp, chunk_cumsum, offset_tile, "chunked_cumsum"), [chunks * length, e], name)


def packing_shift(pairs: int, blocks: int) -> int | None:
    """Bits of the low field when a pair's rank and its expert's first block share one i32
    (`(global_offset << shift) + mask_cumsum`, one one-hot gather for both): `shift` holds any
    cumsum (at most P), and the block offset (at most G) fits above it; None when it does not."""
    shift = pairs.bit_length()
    return shift if (blocks << shift) + pairs < 2**31 else None


ROUTING_SHARE = 2
"""The chunked cumsum's [P, E] tensors may take 1 / ROUTING_SHARE of the target's SRAM before
they run in pair groups (RNGD: 128 MB, which Qwen3-30B-A3B's 36 MB at T = 4096 and 72 MB at
T = 8192 fit; a 32 MB target: 16 MB, so 4 groups of 4 of its 16 chunks, 9 MB each, beside the
rest). A quarter grouped RNGD's T = 8192 for nothing (2 groups, 12,868 cycles slower, no spill
either way) and a 32 MB target's T = 4096 into 8 groups (9,928 cycles slower than 4). A
compiler choice, not a machine number; `lower-routing{routing_bytes=...}` overrides it."""


def group_bytes(pairs: int, experts: int) -> int:
    """SRAM bytes one group's [pairs, E] tensors take at once, as the simulator stores them: the
    one-hot tag, the i32 mask and its chunks' i32 cumsum (the scan reads the mask while it
    writes the cumsum)."""
    per_element = sum(numpy_dtype(t).itemsize for t in (ve.TAG, i32, i32))
    return pairs * experts * per_element


def pair_groups(pairs: int, experts: int, chunks: int, budget: int) -> int:
    """How many groups of consecutive chunks the chunked cumsum runs in: the fewest (a divisor
    of `chunks`) whose tensors fit `budget` bytes, or one group per chunk if none does."""
    return next((g for g in range(1, chunks + 1) if chunks % g == 0 and group_bytes(pairs // g, experts) <= budget),
                chunks)


def one_hot_of(b: _RoutingBuilder, pair_expert: SSAValue, experts: int, name: str) -> SSAValue:
    """[P, E]: the tag `eq` of each pair's expert against an expert iota."""
    (p,) = shape_of(pair_expert.type)
    chosen = b.broadcast(pair_expert, 1, experts, "chosen_expert")
    return b.tag("eq", chosen, b.iota([p, experts], 1, "expert_index"), name)


def grouped_packed_ranks(b: _RoutingBuilder, pair_expert: SSAValue, experts: int, chunks: int, groups: int,
                         shift: int, route_type: moe.RouteType) -> tuple[SSAValue, SSAValue, SSAValue | None]:
    """The chunked cumsum and its packed gather (`shift` from `packing_shift`) in `groups`
    groups of chunks (module docstring, "Pair groups"): the pairs' packed ranks [P] (what the
    one-group gather `pair_packed` holds), the experts' block counts and the block range
    (`block_counts`)."""
    (p,) = shape_of(pair_expert.type)
    pairs, group_chunks = p // groups, chunks // groups
    length = p // chunks

    def group_experts(g: int) -> SSAValue:
        offset = b.emit(index_constant(g * pairs))
        return b.emit(tile.SliceOp(pair_expert, offset, TensorType(i32, [pairs])), "group_expert")

    ranks, offsets, carry = [], [], None
    for g in range(groups):
        one_hot = one_hot_of(b, group_experts(g), experts, "group_one_hot")
        mask = b.select(one_hot, 1, 0, "group_mask")
        chunk_cumsum, chunk_offset, group_total = chunked_cumsum(b, mask, group_chunks)
        ranks.append(b.gather(one_hot, b.view(chunk_cumsum, [pairs, experts]), "chunk_rank"))
        if carry is not None:
            chunk_offset = b.binary(ve.AddOp, chunk_offset, b.broadcast(carry, 0, group_chunks, "carry_tile"),
                                    "carried_offset")
            group_total = b.binary(ve.AddOp, carry, group_total, "carried_counts")
        offsets.append(chunk_offset)
        carry = group_total
    assert carry is not None
    capacity = route_type.capacity_limit
    counts = carry if capacity is None else b.binary(ve.MinOp, carry, capacity, "kept_counts")
    num_blocks, global_offset, block_range, _ = block_counts(b, counts, route_type)
    expert_base = b.broadcast(b.binary(ve.ShlOp, global_offset, shift, "expert_base"), 0, group_chunks,
                              "expert_base_tile")
    packed = b.emit(tile.BufferOp("sram", TensorType(i32, [p])), "pair_packed_buffer")
    for g, (rank, chunk_offset) in enumerate(zip(ranks, offsets)):
        one_hot = one_hot_of(b, group_experts(g), experts, "group_one_hot")
        offset_tile = b.broadcast(b.binary(ve.AddOp, chunk_offset, expert_base, "packed_offset"), 1, length,
                                  "chunk_offset_tile")
        pair_offset = b.gather(one_hot, b.view(offset_tile, [pairs, experts]), "pair_chunk_offset")
        row = b.emit(index_constant(g * pairs))
        packed = b.emit(tile.StoreOp(b.binary(ve.AddOp, rank, pair_offset, "group_packed"), packed, row),
                        "pair_packed")
    return packed, num_blocks, block_range


def block_counts(b: _RoutingBuilder, counts: SSAValue, route_type: moe.RouteType,
                 ids_first: bool = False) -> tuple[SSAValue, SSAValue, SSAValue | None, SSAValue | None]:
    """Steps 3 and 4: each expert's blocks, ceil(counts / B) counted as block starts g * B below
    the count, g in [0, R), its first block, the exclusive cumsum over experts, and the block
    range [E, R] (the expert-id expansion of step 7 reuses it); with `ids_first`, the expert ids
    too (`expert_ids_of`, made between the two steps), else None."""
    (e,) = shape_of(counts.type)
    r = blocks_per_expert_bound(route_type)
    if r == 1:  # at most one block an expert: ceil(counts / B) is whether it has a pair
        expert_ids = expert_ids_of(b, counts, None, route_type.blocks.data) if ids_first else None
        num_blocks = b.binary(ve.MinOp, counts, 1, "num_blocks")
        block_range = None
    else:
        block_range = b.iota([e, r], 1, "block_range")
        block_start = b.binary(ve.MulOp, block_range, route_type.block.data, "block_start")
        opens = b.tag("gt", b.broadcast(counts, 1, r, "counts_tile"), block_start, "opens_block")
        num_blocks = b.reduce(ve.ReduceSumOp, b.select(opens, 1, 0, "opened"), 1, "num_blocks")
        expert_ids = expert_ids_of(b, num_blocks, block_range, route_type.blocks.data) if ids_first else None
    blocks_cumsum = b.cumsum(num_blocks, 0, "expert_position", "blocks_cumsum")
    return num_blocks, b.binary(ve.SubOp, blocks_cumsum, num_blocks, "global_offset"), block_range, expert_ids


def expert_ids_of(b: _RoutingBuilder, num_blocks: SSAValue, block_range: SSAValue | None, blocks: int) -> SSAValue:
    """Step 7, the expert-id expansion: grid[e, g] = e where num_blocks[e] - g > 0, else -1,
    over the block range [E, R], compacted to [G]. Without a block range (one block at most an
    expert, R = 1) the experts whose `num_blocks` (or counts) are positive, compacted: two ops,
    not five, on the path to one token's first weight load."""
    if block_range is None:
        (e,) = shape_of(num_blocks.type)
        has_block = b.tag("gt", num_blocks, 0, "has_block")
        return b.emit(ve.FilterOp(b.iota([e], 0, "block_expert"), has_block, [1], 0, blocks, pad=-1), "expert_ids")
    e, r = shape_of(block_range.type)
    diff = b.binary(ve.SubOp, b.broadcast(num_blocks, 1, r, "num_blocks_tile"), block_range, "diff")
    has_block = b.tag("gt", diff, 0, "has_block")
    grid = b.select(has_block, b.iota([e, r], 0, "block_expert"), -1, "grid")
    flat_grid = b.view(grid, [e * r], "flat_grid")
    is_expert = b.tag("ge", flat_grid, 0, "is_expert")
    return b.emit(ve.FilterOp(flat_grid, is_expert, [1], 0, blocks, pad=-1), "expert_ids")


def lower_routing(op: moe.ScatterOp, scan_rows: int,
                  routing_bytes: int | None = None) -> tuple[list[Operation], SSAValue, SSAValue]:
    """The ops that replace `op`, its blocked tokens and its routing plan; `scan_rows` as
    `scan_chunks` takes it, `routing_bytes` the SRAM the chunked cumsum's tensors may take
    before they run in pair groups (None: no limit)."""
    route_type = op.route.type
    assert isinstance(route_type, moe.RouteType)
    t, k, e = route_type.tokens.data, route_type.k.data, route_type.experts.data
    block, blocks, capacity = route_type.block.data, route_type.blocks.data, route_type.capacity_limit
    p = t * k
    b = _RoutingBuilder()

    # 1. One-hot of each pair's expert: [P, E].
    pair_expert = b.view(op.expert_idx, [p], "pair_expert")
    pair_expert.owner.attributes[EXPERT_INDICES_ATTR] = IntegerAttr(e, 64)  # out-of-range choices are counted here
    chunks = scan_chunks(p, e, scan_rows)
    shift = packing_shift(p, blocks) if chunks > 1 else None
    groups = 1
    if shift is not None and routing_bytes is not None:
        groups = pair_groups(p, e, chunks, routing_bytes)
    if shift is not None and groups > 1:
        expert_ids: SSAValue | None = None
        pair_packed, num_blocks, block_range = grouped_packed_ranks(b, pair_expert, e, chunks, groups, shift,
                                                                    route_type)
        token_rank = b.binary(ve.AndOp, pair_packed, (1 << shift) - 1, "token_rank")
        local_offset = b.binary(ve.SubOp, token_rank, 1, "local_offset")
        pair_offset = b.binary(ve.ShrSOp, pair_packed, shift, "pair_global_offset")
    else:
        one_hot = one_hot_of(b, pair_expert, e, "one_hot")
        expert_mask = b.select(one_hot, 1, 0, "expert_mask")

        # 2. Histogram, and the capacity; the cumsum of step 5 with it, when chunked.
        if chunks > 1:
            chunk_cumsum, chunk_offset, counts = chunked_cumsum(b, expert_mask, chunks)
        else:
            counts = b.reduce(ve.ReduceSumOp, expert_mask, 0, "counts")
        if capacity is not None:
            counts = b.binary(ve.MinOp, counts, capacity, "kept_counts")

        # 3. num_blocks = ceil(counts / B); 4. global offsets: exclusive cumsum over experts.
        num_blocks, global_offset, block_range, expert_ids = block_counts(b, counts, route_type, ids_first=t == 1)

        # 5. Local offsets: cumsum over pairs, gathered at the pair's expert; 6. the expert's
        # first block gathered too. Chunked, both ride one gather (`packing_shift`): the
        # expert's offset, shifted above the cumsum's bits, joins the chunks' offsets ([S, E])
        # before they are added.
        if shift is not None:
            expert_base = b.broadcast(b.binary(ve.ShlOp, global_offset, shift, "expert_base"), 0, chunks,
                                      "expert_base_tile")
            packed = add_chunk_offsets(b, chunk_cumsum, b.binary(ve.AddOp, chunk_offset, expert_base, "packed_offset"),
                                       "packed_cumsum")
            pair_packed = b.gather(one_hot, packed, "pair_packed")
            token_rank = b.binary(ve.AndOp, pair_packed, (1 << shift) - 1, "token_rank")
            local_offset = b.binary(ve.SubOp, token_rank, 1, "local_offset")
            pair_offset = b.binary(ve.ShrSOp, pair_packed, shift, "pair_global_offset")
        else:
            if chunks > 1:
                mask_cumsum = add_chunk_offsets(b, chunk_cumsum, chunk_offset, "mask_cumsum")
            else:
                mask_cumsum = b.cumsum(expert_mask, 0, "pair_position", "mask_cumsum")
            token_rank = b.gather(one_hot, mask_cumsum, "token_rank")
            local_offset = b.binary(ve.SubOp, token_rank, 1, "local_offset")
            pair_offset = b.gather(one_hot, b.broadcast(global_offset, 0, p, "offset_tile"), "pair_global_offset")

    # 6. Address synthesis and capacity drops.
    first_row = b.binary(ve.MulOp, pair_offset, block, "pair_first_row")
    row = b.binary(ve.AddOp, first_row, local_offset, "pair_row")
    kept = b.tag("lt", local_offset, pair_limit(route_type), "kept")
    scatter_idx = b.view(b.select(kept, row, -1, "pair_scatter_idx"), [t, k], "scatter_idx")

    # 7. Expert-id expansion (one token's is made with the block counts, module docstring).
    if expert_ids is None:
        expert_ids = expert_ids_of(b, num_blocks, block_range, blocks)

    route = b.emit(moe.RouteOp(scatter_idx, expert_ids, route_type))
    blocked = b.emit(moe.DispatchOp(op.input, route))
    return b.ops, blocked, route


def weights_behind(scatter: moe.ScatterOp) -> None:
    """Move the graph's math that only the combine reads (the routing weights: the top-k
    values' softmax or renormalisation), when it comes before `scatter`, to just after it: the
    vector engine runs its commands in program order, and one token's first weight loads wait
    for the expert ids the routing makes (module docstring, step 7), not for the weights
    (Qwen3-30B-A3B T = 1: 97 cycles). Only the graph's math moves (`tmath`), never the top-k's
    lowered ops: their values and indices share ops, and with the routing pinned (pin-routing)
    the indices only order the routing (`tcp.order`), so moving those could move other ops in
    cost-only runs than in real ones; math that feeds the top-k never moves."""
    block = scatter.parent_block()
    assert block is not None
    ahead = list(block.ops)[:block.get_operation_index(scatter)]
    behind: set[Operation] = set()
    for op in reversed(ahead):
        users = [u.operation for r in op.results for u in r.uses]
        if op.dialect_name() == "tmath" and users and all(u in behind or isinstance(u, moe.CombineOp) for u in users):
            behind.add(op)
    moved = [op for op in ahead if op in behind]
    for op in moved:
        op.detach()
    block.insert_ops_after(moved, scatter)


@dataclass
class LowerRoutingPattern(RewritePattern):
    scan_rows: int
    routing_bytes: int

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: moe.ScatterOp, rewriter: PatternRewriter) -> None:
        ops, blocked, route = lower_routing(op, self.scan_rows, self.routing_bytes)
        mark(ops, "routing")
        for o in ops:  # the chunk totals' and pair groups' addressing and buffer
            if o.name in ("tile.slice", "arith.constant", "tile.buffer", "tile.store"):
                o.attributes[PHASE_ATTR] = StringAttr("routing")
        blocked.name_hint, route.name_hint = op.blocked.name_hint, op.route.name_hint
        rewriter.replace(op, ops, [blocked, route])


@dataclass(frozen=True)
class LowerRoutingPass(ModulePass):
    """moe.scatter -> ve ops computing scatter_idx [T, K] and expert_ids [G], then moe.route
    and moe.dispatch."""

    name = "lower-routing"

    scan_rows: int = 0
    """The rows the vector engine scans in one round, which the cumsum's chunks are chosen for
    (0, the default: the target's, `scan_rows_of`)."""

    routing_bytes: int = 0
    """The SRAM the chunked cumsum's [P, E] tensors may take before they run in pair groups (0,
    the default: the target's SRAM / ROUTING_SHARE)."""

    def __post_init__(self) -> None:
        if self.scan_rows < 0:
            raise ValueError(f"lower-routing: scan_rows must be positive (or 0: the target's), got {self.scan_rows}")
        if self.routing_bytes < 0:
            raise ValueError(f"lower-routing: routing_bytes must be positive (or 0: the target's), "
                             f"got {self.routing_bytes}")

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        machine = machine_of(op)
        for scatter in [o for o in op.walk() if isinstance(o, moe.ScatterOp)]:
            if scatter.route.type.tokens.data == 1:
                weights_behind(scatter)
        rows = self.scan_rows or scan_rows_of(machine)
        budget = self.routing_bytes or machine.sram_bytes // ROUTING_SHARE
        PatternRewriteWalker(
            GreedyRewritePatternApplier([LowerRoutingPattern(rows, budget)]), apply_recursively=False
        ).rewrite_module(op)
